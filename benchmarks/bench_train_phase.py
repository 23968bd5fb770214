"""The GRPO training phase alone (log-probs with autograd, backward), on a Qwen2.5-shaped model cut
to a few decoder layers, with switches for the training path's fused ops; optional profile.

Why: in a GRPO step the training phase takes the same seconds in every format (NOTES_grpo.md
sections 9-10), so it dilutes the 4-bit rollout's gain; at 7B batch 2 about 40% of its GPU time
was elementwise kernels (grpo_parts/profiles27). This times that phase per decoder layer without
a rollout: the trainer's own `optimise` on a random RolloutBatch, micro-batches of --micro-batch
rows of --prompt-len + --completion tokens, LoRA on all seven linears, gradient checkpointing and
bf16 autocast as the trainer's defaults on a GPU.

    python benchmarks/bench_train_phase.py --model qwen2.5-14b --layers 4 --formats bf16 nvfp4 \\
        --variants stock fused --out $OUT/train_phase.json [--profile $OUT/profiles]
    # tiny and slow on a CPU, to try the code path:
    python benchmarks/bench_train_phase.py --device cpu --model tiny-llama --layers 2 --prompt-len 8 \\
        --completion 8 --micro-batch 2 --rows 2 --rank 4 --reps 1

Variants (comma-joined switches on top of the defaults): `stock` = every fused op off,
`fused` = every fused op (LoRA update, RMSNorm, MLP, token log-probs, RoPE), `default` = the switches as
the product sets them, `compile` = torch.compile on each decoder layer (run it last: a reference
for what fusing everything could give, not a product path), `nolora` / `noloratriton` / `nonorm` / `nomlp` / `nologp` / `norope` = without the fused LoRA update
(`qerl.nn.fused_train.ENABLED_LORA_ADD`), its Triton form (torch.addmm instead), the fused RMSNorm, MLP, token
log-probs or RoPE (`qerl.nn.fused_train`); `free<N>` = the last N decoder layers without gradient checkpointing
(what GRPOSettings.checkpoint_layers auto plans), `free` = every layer (e.g. `default,free`: what the
recomputation costs per layer).
Rows: {"model", "layers", "format", "variant", "rows", "tokens", "uncheckpointed_layers", "train_s" (median
over --reps of log-probs + backward + optimizer), "logprob_s", "backward_s", "ms_per_layer", "x_stock"}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from qerl.env import switches_prefix  # noqa: E402

SWITCHES = {"lora": ("qerl.nn.fused_train", "ENABLED_LORA_ADD"), "loratriton": ("qerl.nn.fused_train", "ENABLED_LORA"),
            "norm": ("qerl.nn.fused_train", "ENABLED_NORM"), "mlp": ("qerl.nn.fused_train", "ENABLED_MLP"),
            "logp": ("qerl.nn.fused_train", "ENABLED_LOGP"), "rope": ("qerl.nn.fused_train", "ENABLED_ROPE")}


def log(*a):
    print(*a, flush=True, file=sys.stderr)


@contextlib.contextmanager
def variant(name: str):
    """Set the fused-op switches for `name`; restore them afterwards."""
    import importlib

    saved = {}
    want = {k: True for k in SWITCHES}
    for part in name.split(","):
        if part == "stock":
            want = {k: False for k in SWITCHES}
        elif part == "default":  # the switches as the product sets them
            want = {k: getattr(importlib.import_module(mod), attr) for k, (mod, attr) in SWITCHES.items()}
        elif part in ("fused", "compile") or _free_layers(part) is not None:
            pass
        elif part.startswith("no") and part[2:] in SWITCHES:
            want[part[2:]] = False
        else:
            raise SystemExit(f"unknown variant part {part!r}; use stock, default, fused, no<{'|'.join(SWITCHES)}> "
                             "or free<N> / free")
    try:
        for k, (mod, attr) in SWITCHES.items():
            m = importlib.import_module(mod)
            saved[k] = getattr(m, attr)
            setattr(m, attr, want[k])
        yield
    finally:
        for k, (mod, attr) in SWITCHES.items():
            setattr(importlib.import_module(mod), attr, saved[k])


def _free_layers(part: str) -> int | None:
    """free<N>: the last N decoder layers run without checkpointing (as GRPOSettings.checkpoint_layers
    auto would plan them); free: every layer; None for other parts."""
    if part == "free":
        return 10**9
    return int(part[4:]) if part.startswith("free") and part[4:].isdigit() else None


def run_format(args, fmt: str) -> list[dict]:
    from qerl import model as qmodel
    from qerl.build import build_model
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings
    from qerl.nn.lora import LoraSettings
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.rollout import RolloutBatch
    from qerl.rl.trainer import make_optimizer, prepare_policy

    device = torch.device(args.device)
    preset = f"{args.model}-l{args.layers}"
    if args.model in qmodel.QWEN_PRESETS:
        qmodel.QWEN_PRESETS[preset] = {**qmodel.QWEN_PRESETS[args.model], "num_hidden_layers": args.layers}
    else:
        preset = args.model
    model = build_model(f"random:{preset}", fmt, device, seed=0, progress=False)
    for p in model.parameters():
        p.requires_grad_(False)
    settings = GRPOSettings(
        num_generations=args.rows, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=max(1, args.rows // args.micro_batch), max_completion_length=args.completion,
        max_steps=1000, learning_rate=1e-6, loss_type="dapo", epsilon_high=0.28, gradient_checkpointing=True,
    )
    policy = prepare_policy(model, settings, LoraSettings(r=args.rank, lora_alpha=args.rank))
    optimizer, scheduler = make_optimizer(policy, settings)
    aqn = AdaptiveQuantNoise(policy, AQNSettings(enabled=False), total_steps=1000)
    vocab = min(int(model.config.vocab_size), 150000)
    batch = RolloutBatch.random(args.rows, args.prompt_len, args.completion, vocab, seed=1)
    adv = torch.linspace(-1.0, 1.0, args.rows)
    rows = []
    for name in args.variants:
        if "compile" in name.split(","):  # a reference for what fusion could give, not a product path
            for mod in policy.modules():
                if type(mod).__name__.endswith("DecoderLayer"):
                    mod.compile()
        try:
            rows.append(_time_variant(args, fmt, name, policy, settings, optimizer, scheduler, aqn, batch, adv, device))
        except Exception as e:  # noqa: BLE001
            if "compile" not in name.split(","):
                raise
            log(f"  {fmt} {name}: failed: {type(e).__name__}: {str(e)[:400]}")
    base = {r["format"]: r["train_s"] for r in rows if r["variant"] == "stock"}
    for r in rows:
        if r["format"] in base:
            r["x_stock"] = round(base[r["format"]] / r["train_s"], 3)
    del policy, model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _time_variant(args, fmt, name, policy, settings, optimizer, scheduler, aqn, batch, adv, device) -> dict:
    from qerl.rl.memory_plan import CheckpointPlan
    from qerl.rl.trainer import PhaseTimer, optimise

    plan = CheckpointPlan("auto", device)
    with variant(name), _layers_free(plan, policy, max([_free_layers(p) or 0 for p in name.split(",")])):
        times = []
        for rep in range(args.warmup + args.reps):
            timer = PhaseTimer(device)
            t0 = time.perf_counter()
            prof = _profiler(args, fmt, name) if rep == args.warmup + args.reps - 1 else contextlib.nullcontext()
            with prof:
                optimise(policy, [(batch, adv, adv)], settings, optimizer, scheduler, aqn, False, False, rep + 1,
                         timer)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= args.warmup and not (args.profile and rep == args.warmup + args.reps - 1 and args.reps > 1):
                times.append((time.perf_counter() - t0, timer.seconds))
        med = statistics.median(t for t, _ in times)
        pick = min(times, key=lambda ts: abs(ts[0] - med))[1]
        tokens = args.rows * (args.prompt_len + args.completion)
        row = {"model": args.model, "layers": args.layers, "format": fmt, "variant": name, "rows": args.rows,
               "uncheckpointed_layers": plan.applied,
               "tokens": tokens, "train_s": round(med, 4), "logprob_s": round(pick.get("logprob_s", 0.0), 4),
               "backward_s": round(pick.get("backward_s", 0.0), 4),
               "ms_per_layer": round(1000 * med / args.layers, 2), "reps_s": [round(t, 4) for t, _ in times]}
        log(f"  {fmt} {name}: {med:.3f} s ({row['ms_per_layer']} ms per layer) reps {row['reps_s']}")
        return row


@contextlib.contextmanager
def _layers_free(plan, policy, n: int):
    """The last n decoder layers without checkpointing inside; every layer checkpointed again after."""
    plan.free_layers = n
    plan.apply(policy)
    try:
        yield
    finally:
        plan.free_layers = 0
        plan.apply(policy)


def _profiler(args, fmt: str, name: str):
    if not args.profile:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def prof():
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts, record_shapes=True) as p:
            yield
        os.makedirs(args.profile, exist_ok=True)
        stem = os.path.join(args.profile, f"{args.model}_l{args.layers}_{fmt}_{name.replace(',', '+')}")
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        with open(stem + "_kernels.txt", "w") as f:
            f.write(p.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=120))
        with open(stem + "_ops_shapes.txt", "w") as f:
            f.write(p.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=80,
                                                                     max_name_column_width=60, max_shapes_column_width=90))
    return prof()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--variants", nargs="+", default=["stock", "fused"])
    ap.add_argument("--rows", type=int, default=8, help="completions trained")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default=None, help="folder: profile the last rep of each variant (kernel and op tables)")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args(argv)
    for v in args.variants:
        with variant(v):
            pass
    rows = []
    for fmt in args.formats:
        rows += run_format(args, fmt)
    result = {
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": switches_prefix() + "python " + " ".join([os.path.relpath(__file__, os.getcwd())] + (argv or sys.argv[1:])),
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r['format']:6s} {r['variant']:20s} {r['train_s']:8.3f} s  {r['ms_per_layer']:8.2f} ms/layer  "
              f"x{r.get('x_stock', float('nan')):.3f}")


if __name__ == "__main__":
    main()
