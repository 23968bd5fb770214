"""Cross-check qerl's GSM8K evaluator against lm-eval (through the `qerl` lm-eval model).

    python -m qerl.eval.crosscheck --n 200 --out reports/embedded/eval_crosscheck.json

The embedded model's bf16 checkpoint (made by the pipeline's quantize step if missing), the
first N GSM8K test problems, qerl's prompt on both sides (lm-eval task `gsm8k_qerl` with
--apply_chat_template renders the same string as qerl.eval.generate.build_prompt: checked per
problem), greedy decoding, max_new_tokens 256 (the embedded recipe's). qerl grades with its own
extraction (number after "####", else in \\boxed{}, else the last number; compared as
numbers); lm-eval with its gsm8k filters and exact_match (flexible-extract: last number;
strict-match: number after "####"). The two accuracies must agree within 1 point.

Writes {"n", "qerl_accuracy", "lm_eval_accuracy", "lm_eval_version", "task", ...} plus
per-problem agreement counts and every disagreement. Exit code 0: agree within --tolerance;
1: they do not; 2: bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _checkpoint(checkpoint: str | None) -> str:
    if checkpoint:
        return checkpoint
    from qerl.checkpoint import is_complete
    from qerl.pipeline import checkpoint_dir, quantize_step
    from qerl.recipe import load_recipe

    recipe = load_recipe("embedded")
    path = checkpoint_dir(recipe, "bf16")
    if not is_complete(path):
        quantize_step(recipe, "bf16", progress=False)
    return str(path)


def _data_dir(data_dir: str | None) -> str:
    if data_dir:
        return data_dir
    from qerl.data import resolve_data_dir

    env = resolve_data_dir(None)
    if env is not None:
        return str(env)
    from qerl.recipe import load_recipe

    return str(load_recipe("embedded").data_dir)


def run_crosscheck(
    n: int = 200,
    *,
    checkpoint: str | None = None,
    adapter: str | None = None,
    data_dir: str | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    device: str = "cpu",
    progress: bool = False,
) -> dict:
    """Run both evaluators on the same problems; -> the report dict (see module docstring)."""
    import qerl
    from qerl.data import load_benchmark
    from qerl.eval.generate import GenerationSettings, build_prompt
    from qerl.eval.harness import HarnessError, evaluate_with_harness, load_for_eval
    from qerl.eval.lm_eval_model import GSM8K_QERL_TASK, run_lm_eval

    if n < 1:
        raise HarnessError(f"--n must be >= 1, got {n}")
    data_dir = _data_dir(data_dir)
    problems = load_benchmark("gsm8k", data_dir=data_dir, limit=n)  # data first: fails in a second
    checkpoint = _checkpoint(checkpoint)
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0, batch_size=batch_size)
    t0 = time.perf_counter()
    model, tokenizer = load_for_eval(checkpoint, adapter, device)
    qres, qmeta = evaluate_with_harness(
        "qerl", checkpoint, adapter, "gsm8k", data_dir=data_dir, limit=n, generation=settings,
        device=device, model=model, tokenizer=tokenizer, progress=progress,
    )
    t1 = time.perf_counter()
    lres, lmeta = run_lm_eval(
        checkpoint, adapter, GSM8K_QERL_TASK, data_dir=data_dir, limit=n, generation=settings, device=device,
        model=model, tokenizer=tokenizer, apply_chat_template=True, progress=progress,
    )
    t2 = time.perf_counter()

    qrec = {r["id"]: r for r in qres.records}
    lrec = {r["id"]: r for r in lres.records}
    if sorted(qrec) != sorted(lrec):
        raise RuntimeError(f"the two evaluators saw different problems: {sorted(set(qrec) ^ set(lrec))[:5]}")
    same_prompt = same_question = same_completion = same_correct = 0
    disagreements = []
    for p in problems:
        q, l = qrec[p.id], lrec[p.id]
        same_question += q["question"] == l["question"]
        same_prompt += build_prompt(tokenizer, p.question, "gsm8k") == l["prompt"]
        same_completion += q["completion"] == l["completion"]
        same_correct += q["correct"] == l["correct"]
        if q["correct"] != l["correct"] or q["completion"] != l["completion"]:
            disagreements.append(
                {
                    "id": p.id,
                    "gold": p.answer,
                    "qerl_extracted": q["extracted"],
                    "qerl_correct": q["correct"],
                    "lm_eval_extracted": l["extracted"],
                    "lm_eval_correct": l["correct"],
                    "lm_eval_strict_correct": l["strict_correct"],
                    "same_completion": q["completion"] == l["completion"],
                    "completion_tail": q["completion"][-160:],
                }
            )
    report = {
        "n": len(problems),
        "qerl_accuracy": qres.accuracy,
        "lm_eval_accuracy": lres.accuracy,
        "lm_eval_version": lmeta["harness_version"],
        "task": lmeta["task"],
        "task_version": lmeta["task_version"],
        "task_config": "lm-eval gsm8k.yaml 3.0 (filters, exact_match) with qerl's 0-shot prompt, chat template on, local test.jsonl",
        "lm_eval_metric": lmeta["metric"],
        "lm_eval_metrics": lmeta["metrics"],
        "qerl_metric": "pass@1, qerl.eval.grading.grade_gsm8k",
        "difference_points": round(100 * abs(qres.accuracy - lres.accuracy), 4),
        "agree_within_1_point": abs(qres.accuracy - lres.accuracy) <= 0.01 + 1e-12,
        "same_question": same_question,
        "same_prompt": same_prompt,
        "same_completion": same_completion,
        "same_correct": same_correct,
        "disagreements": disagreements,
        "model": "embedded (SmolLM2-135M-Instruct), bf16 checkpoint, float32 compute on CPU" if device == "cpu" else f"embedded, {device}",
        "checkpoint": checkpoint,
        "adapter": adapter,
        "decoding": {"greedy": True, "max_new_tokens": max_new_tokens, "batch_size": batch_size},
        "data": f"{data_dir}/gsm8k/test.jsonl, first {len(problems)} rows",
        "qerl_version": qerl.__version__,
        "seconds": {"qerl": round(t1 - t0, 1), "lm_eval": round(t2 - t1, 1)},
        "command": f"python -m qerl.eval.crosscheck --n {n}",
    }
    return report


def main(argv: list[str] | None = None) -> int:
    from qerl.data import DataError
    from qerl.eval.harness import HarnessError, one_line

    ap = argparse.ArgumentParser(prog="python -m qerl.eval.crosscheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="first N GSM8K test problems (default 200)")
    ap.add_argument("--out", default=None, help="write the JSON report here (default: stdout only)")
    ap.add_argument("--checkpoint", default=None, help="qerl checkpoint dir (default: the embedded bf16 one)")
    ap.add_argument("--adapter", default=None, help="PEFT LoRA adapter dir applied on both sides")
    ap.add_argument("--data_dir", default=None, help="data directory (default: $QERL_DATA_DIR, else the embedded recipe's)")
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tolerance", type=float, default=1.0, help="allowed difference in points (default 1)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars on stderr")
    args = ap.parse_args(argv)
    try:
        report = run_crosscheck(
            args.n, checkpoint=args.checkpoint, adapter=args.adapter, data_dir=args.data_dir,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device=args.device,
            progress=args.progress,
        )
    except (HarnessError, DataError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(json.dumps({k: report[k] for k in ("n", "qerl_accuracy", "lm_eval_accuracy", "difference_points",
                                              "same_prompt", "same_completion", "same_correct", "lm_eval_version", "task")}))
    return 0 if report["difference_points"] <= args.tolerance + 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
