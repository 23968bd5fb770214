"""RL on the embedded model (SmolLM2-135M-Instruct) with the generated arithmetic task, on a CPU or a GPU.

The smallest real run of the whole method: the embedded model, optionally quantised to a
4-bit format (frozen), LoRA adapters trained by GRPO/DAPO on `qerl.rl.arith` problems, optional
AQN, and a greedy evaluation on held-out problems before and after. Prints one line per step
and a summary (reward over the first vs the last fifth of the steps, held-out accuracy, time).

    python -m qerl.rl.demo --format nvfp4 --aqn --out runs/demo-nvfp4-aqn
    python -m qerl.rl.demo --format bf16,nvfp4 --steps 20          # several variants in a row

`--device` picks where (default auto: a GPU when there is one). On a CPU the model runs in float32
(bf16 matmuls are ~50x slower there), on a GPU in bf16 with the 4-bit kernels and the rollout
engine; "bf16" names the unquantised baseline, as everywhere in qerl. `run_variant` is the
function behind it; `benchmarks/bench_learning.py` runs it as variants x seeds side by side.
On a busy machine pass `--threads 1` (OpenMP threads spin when the cores are shared).

The recipe (DEMO_SETTINGS) and why, from the runs in qerl/rl/DESIGN_NOTES.md: DAPO loss with
clip-higher, 4 prompts x 4 samples per step (fewer prompts made the per-step reward swing with
problem difficulty), 24-token completions with truncated ones masked (DAPO overlong filtering;
without it the policy drifted to long, truncated answers), correctness as the only reward (a
format reward was learned first and pulled accuracy down), lr 2e-4 with LoRA r16 / alpha 32
(5e-4 and 1e-3 collapsed the policy into gibberish within 20 steps), T = 1.0.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qerl.nn.aqn import AQNSettings
from qerl.nn.lora import LoraSettings
from qerl.rl.grpo import GRPOSettings, autocast_enabled

# The embedded recipe: tuned so the reward clearly rises within ~20 steps on 2 CPU cores.
DEMO_SETTINGS = dict(
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    num_generations=4,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,  # 4 prompts x 4 samples per step
    mask_truncated_completions=True,  # DAPO overlong filtering
    max_completion_length=24,
    temperature=1.0,
    loss_type="dapo",
    epsilon=0.2,
    epsilon_high=0.28,
    beta=0.0,
    reward_weights=[1.0, 0.0],  # gsm8k_accuracy, format_reward (logged, not rewarded)
    max_grad_norm=1.0,
    max_steps=20,
    save_steps=10,
    log_completions=True,
)
DEMO_LORA = dict(r=16, lora_alpha=32.0)


def _load(fmt: str, device: str):
    from qerl.model import ModelSpec, load_model
    from qerl.quantize import quantize_

    dtype = "float32" if device == "cpu" else "bfloat16"
    model, tok = load_model(ModelSpec(name="embedded", dtype=dtype), device=device)
    if fmt != "bf16":
        quantize_(model, fmt, progress=False)
    return model, tok


def held_out_accuracy(model, tokenizer, problems, max_new_tokens: int) -> float:
    """Greedy accuracy on `problems` (gsm8k grading), with the training prompt format; NaN for
    no problems (`--num-eval 0` skips the held-out evaluation)."""
    if not problems:
        return float("nan")
    from qerl.eval.generate import stop_token_ids
    from qerl.rl.rewards import gsm8k_accuracy
    from qerl.rl.rollout import RolloutSettings, sample_rollouts
    from qerl.rl.trainer import _decode, _prompt_text

    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    ids = tokenizer([_prompt_text(tokenizer, p) for p in problems], add_special_tokens=False)["input_ids"]
    rs = RolloutSettings(num_generations=1, max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=stops, pad_id=pad)
    correct = 0.0
    for s in range(0, len(ids), 32):
        batch = sample_rollouts(model, ids[s : s + 32], rs)
        texts = _decode(tokenizer, batch, set(stops))
        correct += sum(gsm8k_accuracy(texts, answer=[p.answer for p in problems[s : s + 32]]))
    return correct / max(1, len(problems))


def run_variant(
    fmt: str,
    aqn: bool,
    out_dir: str | Path,
    settings: GRPOSettings | None = None,
    lora: LoraSettings | None = None,
    aqn_settings: AQNSettings | None = None,
    num_train: int = 2000,
    num_eval: int = 64,
    device: str = "cpu",
    log=print,
    resume: bool = False,
) -> dict:
    """Train one variant on the arithmetic task and return its summary dict."""
    from qerl.memory import device_name
    from qerl.rl.arith import make_problems
    from qerl.rl.rewards import format_reward, gsm8k_accuracy
    from qerl.rl.trainer import train

    t0 = time.perf_counter()
    settings = settings or GRPOSettings(**DEMO_SETTINGS)
    lora = lora or LoraSettings(**DEMO_LORA)
    aqn_settings = aqn_settings or AQNSettings(enabled=aqn)
    model, tok = _load(fmt, device)
    train_set = make_problems(num_train, seed=settings.seed)
    eval_set = make_problems(num_eval, seed=10_000 + settings.seed)
    acc_before = held_out_accuracy(model, tok, eval_set, settings.max_completion_length)

    def log_step(step, m):
        log(
            f"[{fmt}{'+aqn' if aqn else ''}] step {step:3d} reward {m['reward_mean']:.3f} acc {m['accuracy']:.3f} "
            f"fmt {m.get('reward/format_reward', float('nan')):.2f} len {m['completion_length']:.1f} "
            f"H {m['entropy']:.2f} sigma {m['aqn_sigma']:.1e} zero-var {m['zero_variance_groups_frac']:.2f} "
            f"{m['step_time_s']:.1f}s"
        )

    result = train(
        model, tok, settings, aqn_settings, train_set, [gsm8k_accuracy, format_reward], out_dir,
        log_fn=log_step, resume=resume, lora_settings=lora,
    )
    acc_after = held_out_accuracy(result.model, tok, eval_set, settings.max_completion_length)
    first, last = result.reward_fifths("reward_mean")
    afirst, alast = result.reward_fifths("accuracy")
    summary = {
        "format": fmt,
        "aqn": aqn,
        "steps": result.steps,
        "reward_first_fifth": first,
        "reward_last_fifth": last,
        "accuracy_first_fifth": afirst,
        "accuracy_last_fifth": alast,
        "heldout_accuracy_before": acc_before,
        "heldout_accuracy_after": acc_after,
        "train_time_s": sum(h["step_time_s"] for h in result.history),
        "wall_time_s": time.perf_counter() - t0,
        "device": device,
        "device_name": device_name(device),
        "seed": settings.seed,
        "bf16_autocast": autocast_enabled(settings.bf16_autocast, device),
        "rewards": [round(h["reward_mean"], 4) for h in result.history],
        "accuracies": [round(h["accuracy"], 4) for h in result.history],
        "entropies": [round(h["entropy"], 4) for h in result.history],
        "step_times_s": [round(h["step_time_s"], 3) for h in result.history],
        "settings": settings.model_dump(),
        "lora": lora.model_dump(),
    }
    Path(out_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def variant_dir(out: str | Path, fmt: str, aqn: bool) -> Path:
    """Where main() puts a variant's run (checkpoints, metrics, summary.json) under --out."""
    return Path(out) / f"{fmt}{'-aqn' if aqn else ''}"


def resolve_device(name: str) -> str:
    """The demo's --device: "auto" is cuda when a GPU is present, else cpu; anything but cpu, cuda,
    cuda:N or auto, or a CUDA device that is not there, is refused in one line (SystemExit) before
    any model is loaded."""
    import re

    from qerl.recipe import _DEVICE_RE, resolve_device as resolve_auto

    name = name.strip().lower()
    if not re.fullmatch(_DEVICE_RE, name):
        raise SystemExit(f"--device {name}: expected cpu, cuda, cuda:N or auto")
    name = resolve_auto(name)
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {name}: no CUDA device here (use --device cpu)")
        if ":" in name and int(name.split(":", 1)[1]) >= torch.cuda.device_count():
            raise SystemExit(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
    return name


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="nvfp4", help="comma list of bf16,nf4,mxfp4,nvfp4 (default nvfp4)")
    ap.add_argument("--aqn", action="store_true", help="Adaptive Quantization Noise on")
    ap.add_argument("--steps", type=int, default=DEMO_SETTINGS["max_steps"])
    ap.add_argument("--lr", type=float, default=DEMO_SETTINGS["learning_rate"])
    ap.add_argument("--num-generations", type=int, default=DEMO_SETTINGS["num_generations"])
    ap.add_argument("--prompts-per-step", type=int, default=DEMO_SETTINGS["gradient_accumulation_steps"])
    ap.add_argument("--max-completion-length", type=int, default=DEMO_SETTINGS["max_completion_length"])
    ap.add_argument("--loss-type", default=DEMO_SETTINGS["loss_type"], choices=["grpo", "dapo", "dr_grpo"])
    ap.add_argument("--temperature", type=float, default=DEMO_SETTINGS["temperature"])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--format-weight", type=float, default=DEMO_SETTINGS["reward_weights"][1],
                    help="weight of the format reward (0: logged only)")
    ap.add_argument("--lora-alpha", type=float, default=DEMO_LORA["lora_alpha"])
    ap.add_argument("--dynamic-sampling", action="store_true")
    ap.add_argument("--no-mask-truncated", action="store_true", help="keep truncated completions in the loss")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-eval", type=int, default=64, help="held-out problems (0: no held-out evaluation)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="auto",
                    help="auto (default: cuda when present, else cpu), cpu, cuda or cuda:N; on a GPU the model is bf16")
    ap.add_argument("--bf16-autocast", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                    help="training forwards under bf16 autocast (GRPOSettings.bf16_autocast); auto (default): "
                         "on a GPU only; the bare flag means on")
    ap.add_argument("--out", default="runs/rl-demo")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for fmt in [f.strip() for f in args.format.split(",") if f.strip()]:
        st = dict(DEMO_SETTINGS)
        st.update(
            max_steps=args.steps, learning_rate=args.lr, num_generations=args.num_generations,
            per_device_train_batch_size=args.num_generations, gradient_accumulation_steps=args.prompts_per_step,
            max_completion_length=args.max_completion_length, loss_type=args.loss_type, seed=args.seed,
            dynamic_sampling=args.dynamic_sampling, temperature=args.temperature, top_p=args.top_p,
            reward_weights=[1.0, args.format_weight], mask_truncated_completions=not args.no_mask_truncated,
            bf16_autocast={"auto": "auto", "on": True, "off": False}[args.bf16_autocast],
        )
        out = variant_dir(args.out, fmt, args.aqn)
        lora = LoraSettings(**{**DEMO_LORA, "lora_alpha": args.lora_alpha})
        s = run_variant(fmt, args.aqn, out, GRPOSettings(**st), lora=lora, num_eval=args.num_eval, resume=args.resume,
                        device=device)
        rows.append(s)
        print(json.dumps({k: v for k, v in s.items() if k not in ("settings", "lora")}))
    print("\n| variant | steps | reward first 1/5 | reward last 1/5 | held-out acc before -> after | train s | wall s |")
    print("|---|---|---|---|---|---|---|")
    for s in rows:
        print(
            f"| {s['format']}{' + AQN' if s['aqn'] else ''} | {s['steps']} | {s['reward_first_fifth']:.3f} | "
            f"{s['reward_last_fifth']:.3f} | {s['heldout_accuracy_before']:.3f} -> {s['heldout_accuracy_after']:.3f} | "
            f"{s['train_time_s']:.0f} | {s['wall_time_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
