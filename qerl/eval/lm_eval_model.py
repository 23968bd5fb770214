"""lm-evaluation-harness model `qerl`: a quantised qerl checkpoint (+ LoRA adapter) in lm-eval.

From Python (importing this module registers the name `qerl` in lm-eval's model registry):

    import lm_eval
    from qerl.eval.lm_eval_model import QerlLM, lm_eval_task_dir
    lm = QerlLM(checkpoint=".qerl/checkpoints/<model>/nvfp4", adapter="path/to/adapter")
    tm = lm_eval.tasks.TaskManager(include_path=str(lm_eval_task_dir("../shared/data")))
    out = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k"], task_manager=tm, limit=40)

From the shell. lm-eval 0.4.13 has no plugin entry points for models (its registry only knows
the classes imported into the process), so `lm_eval` itself cannot see `qerl`. This module is
a drop-in front end to the same CLI: it registers the class, adds the local task configs
(`--data_dir`, default $QERL_DATA_DIR) as an --include_path, and runs lm-eval's own CLI:

    python -m qerl.eval.lm_eval_model --model qerl \
        --model_args checkpoint=.qerl/checkpoints/<model>/nvfp4,adapter=<dir> \
        --tasks gsm8k --data_dir ../shared/data --device cpu --batch_size 16 --limit 40

Bad input (missing/foreign adapter, unknown task, data dir without the task's file) prints one
line `error: ...` and exits with code 2.

Model (QerlLM): generate_until runs qerl's own decoding loop (qerl.eval.generate.generate:
KV cache, left padding, greedy unless the task asks for sampling) and cuts each completion at
the task's `until` strings; loglikelihood / loglikelihood_rolling are real log-probabilities
from a forward pass over the checkpoint (+ adapter). model_args: checkpoint, adapter, device,
batch_size (use the CLI's --batch_size), max_new_tokens (default when a task gives no
max_gen_toks; 256), max_length (context for loglikelihood; default the model's
max_position_embeddings), compute_dtype (float32 on CPU, bfloat16 on GPU by default), seed.

Tasks (lm_eval_task_dir writes them, yaml, next to the qerl cache):
- `gsm8k`: lm-eval's own gsm8k.yaml (included, so prompt, 5-shot, filters, metric and version
  are lm-eval's), with only the dataset swapped for the local json files (train + test; the
  same rows as openai/gsm8k "main"). It overrides lm-eval's hub-bound `gsm8k` of the same name.
- `gsm8k_qerl`: the same config but qerl's prompt (question + "Let's think step by step and
  output the final answer after \"####\"."; run with --apply_chat_template), 0-shot, stop
  strings without "Question:". Used by the cross-check (qerl.eval.crosscheck).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: get_model() only imports them into an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from qerl.eval.harness import HarnessError, load_for_eval, one_line, records_summary, score_continuations, truncate_at

log = logging.getLogger(__name__)

GSM8K_QERL_TASK = "gsm8k_qerl"
TASK_DIR_VERSION = 1  # bump when the generated yaml changes


# ----------------------------------------------------------------------------- tasks


def qerl_gsm8k_prompt(doc: dict) -> str:
    """qerl's GSM8K user message (the text qerl.eval.generate.build_prompt puts in the chat template)."""
    from qerl.eval.generate import instruction_for

    return f"{str(doc['question']).strip()}\n{instruction_for('gsm8k')}"


def _lm_eval_gsm8k_yaml() -> Path:
    return Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"


def lm_eval_task_dir(data_dir: str | os.PathLike | None = None, out_dir: str | os.PathLike | None = None) -> Path:
    """Write the local-data GSM8K task configs for lm-eval's --include_path; -> the folder.

    Raises DataError when the data directory or its gsm8k files are missing.
    """
    from qerl.data import DataError, resolve_data_dir
    from qerl.model import cache_dir

    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError("no data directory for lm-eval's gsm8k (no data_dir given, QERL_DATA_DIR unset)")
    root = root.resolve()
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; it must hold gsm8k/test.jsonl and gsm8k/train.jsonl")
    test, train = root / "gsm8k" / "test.jsonl", root / "gsm8k" / "train.jsonl"
    for f in (test, train):
        if not f.is_file():
            raise DataError(f"missing file {f}: data directory {root} has no {f.relative_to(root)} (needed by lm-eval's gsm8k)")
    include = _lm_eval_gsm8k_yaml()
    if not include.is_file():
        raise HarnessError(f"lm-eval {lm_eval.__version__} has no tasks/gsm8k/gsm8k.yaml to build the local task on")
    key = hashlib.sha256(f"{root}|{include}|{TASK_DIR_VERSION}".encode()).hexdigest()[:12]
    out = Path(out_dir) if out_dir else cache_dir() / "lm_eval_tasks" / key
    out.mkdir(parents=True, exist_ok=True)
    q = json.dumps  # JSON strings are valid YAML scalars
    gsm8k = "\n".join(
        [
            "# Generated by qerl.eval.lm_eval_model.lm_eval_task_dir: lm-eval's gsm8k with local data files.",
            f"include: {q(str(include))}",
            "task: gsm8k",
            "dataset_path: json",
            "dataset_name: null",
            "dataset_kwargs:",
            "  data_files:",
            f"    train: {q(str(train))}",
            f"    test: {q(str(test))}",
            "",
        ]
    )
    qerl_task = "\n".join(
        [
            "# Generated by qerl.eval.lm_eval_model.lm_eval_task_dir: lm-eval's gsm8k (filters, metric)",
            "# with qerl's 0-shot prompt; run with --apply_chat_template for qerl's exact prompt.",
            f"include: {q(str(include))}",
            f"task: {GSM8K_QERL_TASK}",
            "tag: []",
            "dataset_path: json",
            "dataset_name: null",
            "dataset_kwargs:",
            "  data_files:",
            f"    test: {q(str(test))}",
            "training_split: null",
            "fewshot_split: null",
            "num_fewshot: 0",
            "doc_to_text: !function qerl.eval.lm_eval_model.qerl_gsm8k_prompt",
            "generation_kwargs:",
            "  until:",
            '    - "</s>"',
            '    - "<|im_end|>"',
            "  do_sample: false",
            "  temperature: 0.0",
            "metadata:",
            "  version: 1.0",
            "  derived_from: gsm8k 3.0 (lm-eval)",
            "",
        ]
    )
    for name, text in (("gsm8k_local.yaml", gsm8k), ("gsm8k_qerl.yaml", qerl_task)):
        path = out / name
        if not path.exists() or path.read_text() != text:
            tmp = path.with_name(f".{name}.{os.getpid()}")
            tmp.write_text(text)
            tmp.replace(path)
    return out


LOCAL_TASKS = ("gsm8k", GSM8K_QERL_TASK)


# ----------------------------------------------------------------------------- the model


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


class QerlLM(TemplateLM):
    """lm-eval LM over a qerl checkpoint (+ PEFT LoRA adapter), see the module docstring."""

    def __init__(
        self,
        checkpoint: str | None = None,
        adapter: str | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = 8,
        max_new_tokens: int = 256,
        max_length: int | None = None,
        compute_dtype: str | None = None,
        seed: int = 0,
        model=None,
        tokenizer=None,
        max_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        import torch

        if kwargs:
            raise HarnessError(
                f"unknown model_args for qerl: {', '.join(sorted(kwargs))}; valid: checkpoint, adapter, device, "
                "max_new_tokens, max_length, compute_dtype, seed (batch size: --batch_size)"
            )
        adapter = None if adapter in (None, "", "none", "None") else str(adapter)
        device = str(device or "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("device %s requested but CUDA is not available: running on cpu", device)
            device = "cpu"
        if model is None:
            if not checkpoint:
                raise HarnessError("model_args needs checkpoint=<qerl checkpoint dir> (e.g. .qerl/checkpoints/<model>/nvfp4)")
            model, tokenizer = load_for_eval(checkpoint, adapter, device, compute_dtype)
        elif tokenizer is None:
            raise HarnessError("QerlLM(model=...) needs the tokenizer too")
        self.model = model
        self.tokenizer = tokenizer
        self.checkpoint = str(checkpoint) if checkpoint else None
        self.adapter = adapter
        self._device = torch.device(device)
        try:
            self.batch_size = max(1, int(batch_size)) if batch_size not in (None, "auto") else 8
        except (TypeError, ValueError):
            raise HarnessError(f"batch_size must be an integer or 'auto', got {batch_size!r}") from None
        self.max_new_tokens = int(max_new_tokens)
        cfg_len = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self._max_length = int(max_length) if max_length else int(cfg_len or 2048)
        self.seed = int(seed)
        # context -> the qerl Generation objects produced for it (entropy, token counts, finished)
        self.generations: dict[str, list] = {}

    # -- TemplateLM plumbing
    @property
    def eot_token_id(self) -> int:
        from qerl.eval.generate import stop_token_ids

        eos = self.tokenizer.eos_token_id
        return int(eos) if eos is not None else stop_token_ids(self.tokenizer)[0]

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "qerl")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # qerl's generation tokenizes without extra special tokens (chat templates carry their own)
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def get_model_info(self) -> dict:
        import qerl

        return {"checkpoint": self.checkpoint, "adapter": self.adapter, "qerl_version": qerl.__version__}

    # -- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        res = score_continuations(self.model, pairs, self.batch_size, self.max_length)
        for (key, _, _), r in zip(requests, res):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (string,) = req.args
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            total = float(sum(s for s, _ in scores))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # -- generation
    def _settings(self, gen_kwargs: dict):
        from qerl.eval.generate import GenerationSettings

        kw = dict(gen_kwargs)
        kw.pop("until", None)
        max_new = int(kw.pop("max_gen_toks", kw.pop("max_new_tokens", self.max_new_tokens)))
        do_sample = kw.pop("do_sample", None)
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        top_p = float(kw.pop("top_p", 1.0) or 1.0)
        top_k = int(kw.pop("top_k", 0) or 0)
        seed = int(kw.pop("seed", self.seed))
        if kw:
            log.warning("qerl model ignores generation kwargs %s", sorted(kw))
        sample = _as_bool(do_sample) if do_sample is not None else temperature > 0
        if sample and temperature == 0.0:
            temperature = 1.0  # do_sample without a temperature: Hugging Face's default
        if not sample:
            temperature, top_p, top_k = 0.0, 1.0, 0
        return GenerationSettings(
            max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
            batch_size=self.batch_size, seed=seed,
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from qerl.eval.generate import generate

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for key, idx in groups.items():
            gen_kwargs = requests[idx[0]].args[1]
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            settings = self._settings(gen_kwargs)
            contexts = [requests[i].args[0] for i in idx]
            gens = generate(self.model, self.tokenizer, contexts, settings, progress=not disable_tqdm)
            for i, ctx, g in zip(idx, contexts, gens):
                text = truncate_at(g.text, until)
                results[i] = text
                self.generations.setdefault(ctx, []).append(g)
                self.cache_hook.add_partial("generate_until", (ctx, gen_kwargs), text)
        return results  # type: ignore[return-value]


# ----------------------------------------------------------------------------- harness run


def run_lm_eval(
    checkpoint,
    adapter,
    task: str,
    *,
    data_dir,
    limit,
    generation,
    device: str = "cpu",
    compute_dtype: str | None = None,
    model=None,
    tokenizer=None,
    base_meta: dict | None = None,
    apply_chat_template: bool | None = None,
    progress: bool = True,
    metric_filter: str = "flexible-extract",
):
    """Run one local GSM8K task through lm-eval's simple_evaluate -> (EvalResult, meta).

    The accuracy is lm-eval's exact_match under `metric_filter` (flexible-extract: the last
    number; strict-match: the number after "####"); both are in meta["metrics"]. Chat template:
    on for gsm8k_qerl (qerl's prompt), lm-eval's default (off) for gsm8k unless given.
    """
    import lm_eval as _lm_eval
    from lm_eval.tasks import TaskManager

    from qerl.data import gsm8k_gold

    if task not in LOCAL_TASKS:
        raise HarnessError(f"unknown lm-eval task {task!r}; valid: {', '.join(LOCAL_TASKS)}")
    if generation.num_samples > 1:
        raise HarnessError("lm-eval's gsm8k scores one completion per problem: use num_samples=1 (or the lighteval/qerl harness)")
    task_dir = lm_eval_task_dir(data_dir)  # data first
    if model is None:
        model, tokenizer = load_for_eval(checkpoint, adapter, device, compute_dtype)
    lm = QerlLM(
        checkpoint=checkpoint, adapter=adapter, device=device, batch_size=generation.batch_size,
        max_new_tokens=generation.max_new_tokens, seed=generation.seed, model=model, tokenizer=tokenizer,
    )
    gen_kwargs = {"max_gen_toks": generation.max_new_tokens}
    if generation.do_sample:
        gen_kwargs.update(do_sample=True, temperature=generation.temperature, top_p=generation.top_p)
        if generation.top_k:
            gen_kwargs["top_k"] = generation.top_k
    else:
        gen_kwargs.update(do_sample=False, temperature=0.0)
    chat = (task == GSM8K_QERL_TASK) if apply_chat_template is None else apply_chat_template
    tm = TaskManager(include_path=str(task_dir), metadata={})
    out = _lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=tm, limit=limit, gen_kwargs=gen_kwargs,
        apply_chat_template=chat, fewshot_as_multiturn=chat, log_samples=True, bootstrap_iters=0,
        random_seed=generation.seed, numpy_random_seed=generation.seed, torch_random_seed=generation.seed,
        fewshot_random_seed=generation.seed,
    )
    res = out["results"][task]
    samples = out["samples"][task]
    by_doc: dict[int, dict] = {}
    for s in samples:
        d = by_doc.setdefault(int(s["doc_id"]), {"doc": s["doc"], "arguments": s["arguments"], "resps": s["resps"]})
        d[s.get("filter", "none")] = s
    records = []
    for doc_id in sorted(by_doc):
        d = by_doc[doc_id]
        context = d["arguments"][0][0] if isinstance(d["arguments"][0], (list, tuple)) else d["arguments"]["gen_args_0"]["arg_0"]
        completion = d["resps"][0][0]
        main = d.get(metric_filter) or next(v for k, v in d.items() if isinstance(v, dict) and "exact_match" in v)
        strict = d.get("strict-match")
        gens = lm.generations.get(context) or []
        g = gens[0] if gens else None
        records.append(
            {
                "id": str(doc_id),
                "sample": 0,
                "question": d["doc"]["question"],
                "gold": gsm8k_gold(d["doc"]["answer"]),
                "prompt": context,
                "completion": completion,
                "extracted": main["filtered_resps"][0] if main.get("filtered_resps") else None,
                "correct": bool(main["exact_match"]),
                "strict_correct": bool(strict["exact_match"]) if strict else None,
                "num_tokens": g.num_tokens if g else None,
                "entropy": g.mean_entropy if g else None,
                "finished": g.finished if g else None,
            }
        )
    result = records_summary("gsm8k", records, 1, len(records))
    metric_key = f"exact_match,{metric_filter}"
    if metric_key in res and abs(res[metric_key] - result.accuracy) > 1e-9:
        raise RuntimeError(f"lm-eval reports {metric_key}={res[metric_key]} but its samples give {result.accuracy}")
    cfg = out.get("configs", {}).get(task, {})
    meta = {
        **(base_meta or {}),
        "harness": "lm-eval",
        "harness_version": _lm_eval.__version__,
        "task": task,
        "task_version": out.get("versions", {}).get(task, (cfg.get("metadata") or {}).get("version")),
        "task_config": f"{_lm_eval_gsm8k_yaml()} with dataset_path=json, data_files from {task_dir}",
        "num_fewshot": out.get("n-shot", {}).get(task, cfg.get("num_fewshot")),
        "apply_chat_template": bool(chat),
        "metric": metric_key,
        "metrics": {k: v for k, v in res.items() if isinstance(v, (int, float)) and not k.endswith("_stderr") and "," in k},
    }
    return result, meta


# ----------------------------------------------------------------------------- CLI front end


def main(argv: list[str] | None = None) -> int:
    """`python -m qerl.eval.lm_eval_model [lm_eval args] [--data_dir DIR]` (see module docstring)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from qerl.data import DataError, resolve_data_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    data_dir = None
    if "--data_dir" in argv:
        i = argv.index("--data_dir")
        if i + 1 >= len(argv):
            print("error: --data_dir needs a directory", file=sys.stderr)
            return 2
        data_dir = argv[i + 1]
        del argv[i : i + 2]
    try:
        if resolve_data_dir(data_dir) is not None:
            argv += ["--include_path", str(lm_eval_task_dir(data_dir))]
        setup_logging()
        old = sys.argv
        sys.argv = ["lm_eval", *argv]
        try:
            parser = HarnessCLI()
            args = parser.parse_args()
            parser.execute(args)
        finally:
            sys.argv = old
    except (HarnessError, DataError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as e:  # lm-eval's own bad-input errors (unknown task, bad args)
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ != "__main__":  # run as a script, main() imports the real module, which registers
    register_model("qerl")(QerlLM)

__all__ = ["GSM8K_QERL_TASK", "QerlLM", "lm_eval_task_dir", "main", "qerl_gsm8k_prompt", "run_lm_eval"]

if __name__ == "__main__":
    from qerl.eval import lm_eval_model as _module  # the importable module registers `qerl` once

    sys.exit(_module.main())
