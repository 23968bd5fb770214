"""Where a decode step of the rollout engine spends its time (CUDA GPU).

    python benchmarks/profile_rollout.py --model qwen2.5-7b --formats bf16 nvfp4 --batches 1 8 [--lora 16] \
        [--keys 1280] --out prof.json

For each format and batch: the engine's CUDA-graph step time at --keys keys of KV cache (the
graph of that key bucket, median of 64 replays, taken from a generate long enough to reach it;
1280 is the mean length of an issue-9 rollout, 256-token prompts and 2048 new tokens), then
torch.profiler over 16 eager steps: the GPU time of every kernel, grouped by kind (4-bit / cuBLAS
GEMMs, attention, the decode_ops kernels, sampling, ...). Without PDL (--no-pdl) and LoRA, the sum
of kernel times against the graph's step time is what the step loses between kernels; with PDL a
kernel's time includes its wait for the one before it, and LoRA's kernels run beside the base
products on a side stream, so the sum then exceeds the step. Random-initialised weights (honest
for speed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_rollout, also when loaded as a module

from bench_rollout import build  # noqa: E402

from qerl.rl.rollout import RolloutSettings  # noqa: E402
from qerl.rollout.engine import RolloutEngine  # noqa: E402

KINDS = [  # (kind, regex on the kernel name), first match wins
    ("attention", r"attn_partial|attn_combine|fmha|sdpa|flash|attention"),
    ("4-bit GEMM", r"w4a16|gluon_gemv|_gemv_kernel|wgmma|wsmma|_rwg|nf4_dequant|nf4_fused|w4_to_bf16"),
    ("cuBLAS GEMM", r"nvjet|gemm|splitK|cutlass|xmma"),
    ("norm/rope/silu", r"add_rms_norm|rope_cache|silu_mul"),
    ("LoRA", r"lora_shrink|lora_expand"),
    ("sampling", r"sample_partial|sample_finish|softmax|scan|searchsorted|argmax|reduce|isin|gather|where|exp|log"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.I):
            return kind
    return "other"


def rewind(engine: RolloutEngine, rows: int, keys: int = 512) -> None:
    """Put the decode state back at slot keys - 212 of 256-token prompts (timed replays advance it;
    the `keys`-key graph and step read `keys` cache slots whatever the slot, so only its bound matters)."""
    engine._slot.fill_(keys - 212)
    engine._step.fill_(keys - 212 - 256)
    engine._pos[:rows].fill_(keys - 212)


def add_generations_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--generations", type=int, default=1,
                    help="samples per prompt (GRPO's 8: batch / 8 prompts whose samples share their prompt's slots)")


def random_prompts(rows: int, generations: int) -> list:
    """rows / generations random 256-token prompts (each sampled `generations` times: `rows` rows);
    SystemExit where rows is not a multiple of generations."""
    if rows % generations:
        raise SystemExit(f"batch {rows}: not a multiple of --generations {generations}")
    return [torch.randint(0, 150000, (256,)).tolist() for _ in range(rows // generations)]


def graph_step_ms(engine: RolloutEngine, prompts: list, settings: RolloutSettings, replays: int = 64,
                  keys: int = 512):
    """(graph, ms): capture the decode graphs (two generates: a warm-up step, then the capture) and
    time `replays` replays of the `keys`-key graph (a multiple of 256; the generates must reach
    it), rewound into its bucket; the median, CUDA events."""
    rows = len(prompts) * settings.num_generations
    gen = torch.Generator(device="cuda").manual_seed(0)
    engine.generate(prompts, settings, gen)
    engine.generate(prompts, settings, gen)
    graph = engine._graphs[(rows, keys, (float(settings.temperature), int(settings.top_k), float(settings.top_p)))][0]
    rewind(engine, rows, keys)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return graph, statistics.median(times)


def profile_prefill(a) -> None:
    """Host (CPU self time by op) and GPU (kernel time) of a prefill: generate 2 tokens, after a
    warm-up. A prefill slower than its kernels is bound by the host."""
    import time

    from torch.profiler import ProfilerActivity, profile

    settings = RolloutSettings(max_new_tokens=2, temperature=1.0, stop_ids=[10**9], pad_id=0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv), "rows": []}
    for fmt in a.formats:
        model = build(a.model, fmt)
        engine = RolloutEngine(model, max_batch=max(a.batches), max_len=768)
        for b in a.batches:
            prompts = [torch.randint(0, 150000, (256,)).tolist() for _ in range(b)]
            gen = torch.Generator(device="cuda").manual_seed(0)
            with torch.inference_mode():
                for _ in range(2):
                    engine.generate(prompts, settings, gen)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.generate(prompts, settings, gen)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    engine.generate(prompts, settings, gen)
                    torch.cuda.synchronize()
            cpu: dict = defaultdict(float)
            gpu: dict = defaultdict(float)
            kernels: dict = defaultdict(float)
            for ev in prof.key_averages():
                if ev.self_cpu_time_total > 0:
                    cpu[ev.key[:80]] += ev.self_cpu_time_total / 1e3
                if ev.self_device_time_total > 0:
                    gpu[kind_of(ev.key)] += ev.self_device_time_total / 1e3
                    kernels[ev.key[:80]] += ev.self_device_time_total / 1e3
            row = {"model": a.model, "format": fmt, "batch": b, "wall_ms": round(wall * 1e3, 2),
                   "prefill_ms": round(engine.stats["prefill_s"] * 1e3, 2), "gpu_kernel_ms": round(sum(gpu.values()), 2),
                   "gpu_by_kind_ms": {k: round(v, 2) for k, v in sorted(gpu.items(), key=lambda kv: -kv[1])},
                   "gpu_top_ms": [(k, round(v, 2)) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:20]],
                   "cpu_self_top_ms": [(k, round(v, 2)) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])[:15]]}
            result["rows"].append(row)
            print(json.dumps(row, indent=1), flush=True)
        del model, engine
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--lora", type=int, default=0)
    ap.add_argument("--keys", type=int, default=512,
                    help="keys of KV cache the timed and profiled steps attend over (a multiple of 256, >= 512)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-pdl", dest="pdl", action="store_false", help="as bench_rollout.py --no-pdl")
    add_generations_arg(ap)
    ap.add_argument("--prefill", action="store_true",
                    help="profile the prefill instead (host and GPU time of one generate of 2 tokens)")
    a = ap.parse_args()
    if a.prefill:
        return profile_prefill(a)
    from qerl.kernels import decode_ops

    decode_ops.PDL = decode_ops.PDL and a.pdl
    if a.keys < 512 or a.keys % 256:
        ap.error(f"--keys {a.keys}: a multiple of 256, at least 512")
    # long enough that the generate's slots reach the --keys bucket from 256-token prompts
    settings = RolloutSettings(max_new_tokens=max(512, a.keys - 240), temperature=1.0, stop_ids=[10**9], pad_id=0,
                               num_generations=a.generations)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv), "rows": []}
    for fmt in a.formats:
        model = build(a.model, fmt)
        if a.lora:
            from qerl.nn.lora import LoraSettings, apply_lora

            model = apply_lora(model, LoraSettings(r=a.lora, lora_alpha=a.lora)).eval()
        engine = RolloutEngine(model, max_batch=max(a.batches), max_len=a.keys + 256)
        for b in a.batches:
            prompts = random_prompts(b, a.generations)
            with torch.inference_mode():
                _, step_ms = graph_step_ms(engine, prompts, settings, keys=a.keys)
                from torch.profiler import ProfilerActivity, profile

                rewind(engine, b, a.keys)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(16):
                        engine._decode_step(b, a.keys, (1.0, 0, 1.0))
                    torch.cuda.synchronize()
            per_kind: dict[str, float] = defaultdict(float)
            per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
            for ev in prof.events():
                if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
                    per_kind[kind_of(ev.name)] += ev.device_time_total / 16
                    per_kernel[ev.name][0] += ev.device_time_total / 16
                    per_kernel[ev.name][1] += 1 / 16
            kernel_ms = sum(per_kind.values()) / 1e3
            top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:12]
            row = {"model": a.model, "format": fmt, "batch": b, "generations": a.generations, "lora_rank": a.lora,
                   "graph_step_ms": round(step_ms, 4),
                   "kernel_ms_per_step": round(kernel_ms, 4), "launches_per_step": round(sum(v[1] for v in per_kernel.values())),
                   "per_kind_us": {k: round(v, 1) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
                   "top_kernels_us": [(n[:90], round(v[0], 1), round(v[1], 1)) for n, v in top]}
            result["rows"].append(row)
            print(json.dumps(row, indent=1), flush=True)
        del model, engine
        torch.cuda.empty_cache()
    print("\n| format | batch | LoRA | graph step ms | kernels ms | launches | " + " | ".join(k for k, _ in KINDS) + " | other |")
    for r in result["rows"]:
        kinds = [f"{r['per_kind_us'].get(k, 0):.0f}" for k, _ in KINDS] + [f"{r['per_kind_us'].get('other', 0):.0f}"]
        print(f"| {r['format']} | {r['batch']} | {r['lora_rank']} | {r['graph_step_ms']:.3f} | {r['kernel_ms_per_step']:.3f} | {r['launches_per_step']} | " + " | ".join(kinds) + " |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
