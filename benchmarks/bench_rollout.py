"""Rollout throughput of the engine (qerl/rollout/engine.py) per weight format, against Hugging Face.

Run on a CUDA GPU:

    python benchmarks/bench_rollout.py --out benchmarks/results/rollout.json \
        [--models qwen2.5-7b qwen2.5-14b] [--batches 1 8 64] [--completion 512] [--check]
    python benchmarks/bench_rollout.py --combine part1.json part2.json --out rollout.json

For each random-initialised Qwen2.5-*-shaped model (random weights are honest for speed, not for
quality: with near-uniform logits no row stops early, so every row generates exactly
--completion tokens) and each format, in one process: the model is built in bf16 on the GPU
(seeded, the same weights for every format), quantised in place (nf4, mxfp4, nvfp4), and the
engine generates batch x --completion tokens from batch random prompts of --prompt tokens
(temperature 1, no top-k / top-p). One warm-up call per shape first (it captures the CUDA
graphs), then the median of --repeats timed calls; tokens/s = generated tokens / wall time of
the whole call (prefill included). LoRA rows: nvfp4 at batch 8 with PEFT adapters of rank 16 /
32 / 64 on all seven linears. Baseline a user has today: Hugging Face `generate` with the bf16
model (sampling, dynamic cache), timed over --hf-tokens new tokens.

Output: a markdown table at the end and JSON rows {"model", "format", "batch", "prompt_len",
"completion_len", "lora_rank", "tokens_per_s", "bf16_tokens_per_s", "hf_generate_tokens_per_s",
...}; rows are written after every measurement, so a call cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qerl.model import build_random  # noqa: E402
from qerl.env import switches_prefix  # noqa: E402
from qerl.nn.quant_linear import nf4_decode, nf4_decode_of  # noqa: E402
from qerl.kernels.layout import order_setting  # noqa: E402
from qerl.quantize import quantize_  # noqa: E402
from qerl.rl.rollout import RolloutSettings  # noqa: E402
from qerl.rollout.engine import RolloutEngine  # noqa: E402

FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4")
LORA_RANKS = (16, 32, 64)


def log(*a):
    print(*a, flush=True)


def gpu_state() -> dict:
    """The GPU's clocks, temperature, power and active throttle reasons right now (NVML through
    nvidia-ml-py, where installed; {} otherwise): the speed of one variant drifts by up to ~6% within
    a call, and these say whether the clocks moved with it."""
    try:
        import pynvml as nv

        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        names = [n[len("nvmlClocksEventReason"):] for n in dir(nv)
                 if n.startswith("nvmlClocksEventReason") and n not in ("nvmlClocksEventReasonNone", "nvmlClocksEventReasonAll")
                 and isinstance(getattr(nv, n), int) and reasons & getattr(nv, n)]
        return {"sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "mem_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                "power_w": round(nv.nvmlDeviceGetPowerUsage(h) / 1000, 1), "throttle": sorted(set(names))}
    except Exception:  # no NVML, an old driver or library: the timings stand without it
        return {}


def build(preset: str, fmt: str, seed: int = 0):
    model = build_random(preset, torch.bfloat16, "cuda", seed=seed).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if fmt != "bf16":
        quantize_(model, fmt, progress=False)
    torch.cuda.empty_cache()
    return model


def timed_generate(engine: RolloutEngine, prompts, settings, repeats: int) -> tuple[float, dict]:
    """(tokens / s, engine stats + "capture_loads": the Triton / Gluon kernels first loaded inside one of the
    warm-up's graph captures, which should be none: qerl.kernels.capture_check)."""
    from qerl.kernels.capture_check import loads_during_capture

    gen = torch.Generator(device="cuda").manual_seed(0)
    with loads_during_capture() as loads:
        engine.generate(prompts, settings, gen)  # warm-up: kernels compiled, graphs captured
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = engine.generate(prompts, settings, gen)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = int(batch.completion_mask.sum())
    return tokens / statistics.median(times), dict(engine.stats, capture_loads=sorted(set(loads)))


def hf_generate_tps(model, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    return ids.shape[0] * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def check(args) -> dict:
    """GPU correctness on a small random Qwen2 model (bf16): the CUDA-graph decode (and, on a second
    call, the CUDA-graph prefill) gives the very tokens of the eager engine; greedy tokens vs Hugging Face generate (leading agreement, bf16
    kernels differ); sampled logprobs vs a fresh forward."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from qerl.rl.rollout import policy_logprobs

    from qerl.kernels import decode_ops as ops

    out = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    h, d = (torch.randn(8, 3584, device="cuda", generator=g).bfloat16() for _ in range(2))
    w = (torch.rand(3584, device="cuda", generator=g) + 0.5).bfloat16()
    qkv = torch.randn(8, 36 * 128, device="cuda", generator=g).bfloat16()
    ang = torch.rand(8, 64, device="cuda", generator=g) * 100
    cos, sin = (torch.cat([f(ang), f(ang)], -1).bfloat16() for f in (torch.cos, torch.sin))
    caches = [torch.randn(8, 4, 300, 128, device="cuda", generator=g).bfloat16() for _ in range(2)]
    caches += [c.clone() for c in caches]
    slot = torch.tensor([123], device="cuda")
    gu = torch.randn(8, 2 * 18944, device="cuda", generator=g).bfloat16() * 3
    pairs = {
        "add_rms_norm": (ops.add_rms_norm_triton(d, h, w, 1e-6), ops.add_rms_norm_reference(d, h, w, 1e-6)),
        "rope_to_cache": ((ops.rope_to_cache_triton(qkv, cos, sin, caches[0], caches[1], slot, 28, 4), caches[0], caches[1]),
                          (ops.rope_to_cache_reference(qkv, cos, sin, caches[2], caches[3], slot, 28, 4), caches[2], caches[3])),
        "silu_mul": ((ops.silu_mul_triton(gu),), (ops.silu_mul_reference(gu),)),
        "rotary_rows": ((ops.rotary_rows_triton(qkv.view(8, 36, 128)[:, :32], cos, sin),),
                        (ops.rotary(qkv.view(8, 36, 128)[:, :32], cos[:, None], sin[:, None]),)),
    }
    for name, (got, ref) in pairs.items():
        diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]
        unequal = sum(int((a != b).sum()) for a, b in zip(got, ref))
        out[f"decode_ops_{name}"] = {"max_abs_diff": max(diffs), "elements_differing": unequal}
        log(f"check {name}: triton vs torch (bf16) max |diff| {max(diffs):.3g}, {unequal} elements differ")
    # A random model whose greedy tokens have clear margins (initializer_range 0.3) is chaotic:
    # a 1-ulp bf16 difference anywhere grows into different tokens within a few steps. Each
    # check runs twice, with the decode_ops kernels and with their torch references (the
    # latter computes op for op what Hugging Face computes), so the kernels' share is visible.
    for init, fmt in ((0.3, "bf16"), (0.3, "nvfp4"), (0.02, "bf16"), (0.02, "nvfp4")):
        cfg = Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, initializer_range=init, rope_theta=1e6)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        if fmt != "bf16":
            quantize_(model, fmt, progress=False)
        prompts = [torch.randint(0, 4096, (n,)).tolist() for n in (37, 64, 50)]
        greedy = RolloutSettings(max_new_tokens=64, temperature=0.0, stop_ids=[10**9], pad_id=0)
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
        att = (torch.arange(width, device="cuda")[None] >= torch.tensor([width - len(p) for p in prompts], device="cuda")[:, None]).long()
        with torch.inference_mode():
            hf = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                pad_token_id=0, eos_token_id=None)[:, width:].cpu()
        for mode in ("kernels", "torch-ops"):
            ops.TORCH_ONLY.clear()
            if mode == "torch-ops":
                ops.TORCH_ONLY.update({"norm", "rope", "silu"})
            with torch.inference_mode():
                eager = RolloutEngine(model, max_batch=8, max_len=256, cuda_graphs=False).generate(prompts, greedy)
                engine = RolloutEngine(model, max_batch=8, max_len=256)
                graphed = engine.generate(prompts, greedy)
                replayed = engine.generate(prompts, greedy)  # the prefill as a CUDA graph this time
                sample = RolloutSettings(num_generations=2, max_new_tokens=48, temperature=1.0, stop_ids=[10**9], pad_id=0)
                sampled = engine.generate(prompts, sample, torch.Generator(device="cuda").manual_seed(1))
            fresh = policy_logprobs(model, sampled, temperature=1.0).detach().float().cpu()
            same = graphed.completion_ids == hf
            m = sampled.completion_mask.bool()
            err = (sampled.logprobs[m] - fresh[m]).abs()
            first = (sampled.logprobs[:, 0] - fresh[:, 0]).abs()
            key = f"init{init}/{fmt}/{mode}"
            out[key] = {
                "graph_equals_eager": bool(torch.equal(graphed.completion_ids, eager.completion_ids)),
                "prefill_graph_equals_eager": bool(torch.equal(replayed.completion_ids, eager.completion_ids)),
                "hf_leading_equal_tokens": [int(r.cumprod(0).sum()) for r in same],
                "logprob_max_abs_err": float(err.max()), "logprob_mean_abs_err": float(err.mean()),
                "first_token_logprob_max_abs_err": float(first.max()),
            }
            log(f"check {key}: {out[key]}")
            if not (out[key]["graph_equals_eager"] and out[key]["prefill_graph_equals_eager"]):
                raise SystemExit(f"check failed: CUDA-graph decode or prefill differs from eager ({key})")
            del engine
        ops.TORCH_ONLY.clear()
        if init == 0.02:
            # rows that stop at different steps: compaction in the graphed engine (graphs at the
            # shrinking row counts) vs the same compaction eager, which must agree token for token,
            # and vs no compaction, which agrees only as far as the kernels' results do not
            # depend on the number of rows (the 4-bit kernels change path with M)
            stop = RolloutSettings(num_generations=4, max_new_tokens=96, temperature=1.0, stop_ids=list(range(100, 300)),
                                   pad_id=0)
            with torch.inference_mode():
                ref = RolloutEngine(model, max_batch=16, max_len=256, cuda_graphs=False, compact_below=0.5,
                                    check_every=8).generate(prompts, stop, torch.Generator(device="cuda").manual_seed(2))
                whole = RolloutEngine(model, max_batch=16, max_len=256, cuda_graphs=False, compact_below=0.0).generate(
                    prompts, stop, torch.Generator(device="cuda").manual_seed(2))
                eng = RolloutEngine(model, max_batch=16, max_len=256, compact_below=0.5, check_every=8)
                got = eng.generate(prompts, stop, torch.Generator(device="cuda").manual_seed(2))
                nucleus = RolloutSettings(num_generations=2, max_new_tokens=48, temperature=0.6, top_p=0.95, top_k=50,
                                          stop_ids=[10**9], pad_id=0)
                t_eager = RolloutEngine(model, max_batch=16, max_len=256, cuda_graphs=False).generate(
                    prompts, nucleus, torch.Generator(device="cuda").manual_seed(3))
                t_graph = RolloutEngine(model, max_batch=16, max_len=256).generate(
                    prompts, nucleus, torch.Generator(device="cuda").manual_seed(3))
            out[f"init{init}/{fmt}/top_p_graph_equals_eager"] = bool(torch.equal(t_graph.completion_ids, t_eager.completion_ids))
            log(f"check init{init}/{fmt}/top_p_graph_equals_eager: {out[f'init{init}/{fmt}/top_p_graph_equals_eager']}")
            key = f"init{init}/{fmt}/compaction"
            out[key] = {"equal_tokens": bool(torch.equal(got.completion_ids, ref.completion_ids)),
                        "equal_masks": bool(torch.equal(got.completion_mask, ref.completion_mask)),
                        "tokens_differing_from_uncompacted": int((got.completion_ids != whole.completion_ids).sum()),
                        "compactions": eng.stats["compactions"], "final_rows": eng.stats["final_rows"],
                        "lengths": got.completion_mask.sum(1).tolist()}
            log(f"check {key}: {out[key]}")
            if not (out[key]["equal_tokens"] and out[key]["equal_masks"]):
                raise SystemExit(f"check failed: compaction in CUDA graphs differs from the same compaction eager ({key})")
            del eng
        if init == 0.02:
            # programmatic dependent launch changes when kernels start, never what they compute:
            # the same sampled rollout with and without it, token for token
            # (both runs route layers as the PDL chain does: w4a16_triton picks some kernels by
            # PDL, and this compares the launch attribute, not two kernel choices)
            from qerl.kernels import w4a16_triton as W4

            runs, before, routing = [], ops.PDL, W4.CHAIN_ROUTING
            W4.CHAIN_ROUTING = True
            for pdl in (False, True):
                ops.PDL = pdl  # the engine launches the 4-bit kernels with PDL when this is on
                with torch.inference_mode():
                    runs.append(RolloutEngine(model, max_batch=8, max_len=256).generate(
                        prompts, sample, torch.Generator(device="cuda").manual_seed(4)))
            ops.PDL, W4.CHAIN_ROUTING = before, routing
            key = f"init{init}/{fmt}/pdl_equals_no_pdl"
            out[key] = bool(torch.equal(runs[0].completion_ids, runs[1].completion_ids)
                            and torch.equal(runs[0].logprobs, runs[1].logprobs))
            log(f"check {key}: {out[key]}")
            if not out[key]:
                raise SystemExit(f"check failed: the rollout with PDL differs from the one without ({key})")
        if init == 0.02 and fmt == "nvfp4":
            # LoRA on the GPU path: the adapters' two kernels run on the side stream inside the graph
            from qerl.nn.lora import LoraSettings, apply_lora

            model = apply_lora(model, LoraSettings(r=16, lora_alpha=32)).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.02)
            with torch.inference_mode():
                engine = RolloutEngine(model, max_batch=8, max_len=256)
                sampled = engine.generate(prompts, sample, torch.Generator(device="cuda").manual_seed(1))
            fresh = policy_logprobs(model, sampled, temperature=1.0).detach().float().cpu()
            m = sampled.completion_mask.bool()
            with torch.no_grad(), model.disable_adapter():
                no_lora = policy_logprobs(model, sampled, temperature=1.0).detach().float().cpu()
            key = f"init{init}/{fmt}+lora16/kernels"
            out[key] = {"logprob_max_abs_err": float((sampled.logprobs[m] - fresh[m]).abs().max()),
                        "logprob_mean_abs_err": float((sampled.logprobs[m] - fresh[m]).abs().mean()),
                        "lora_effect_mean_abs": float((fresh[m] - no_lora[m]).abs().mean())}
            log(f"check {key}: {out[key]}")
            del engine
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return out


def run(args) -> None:
    started = time.time()
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": switches_prefix() + "python benchmarks/bench_rollout.py " + " ".join(sys.argv[1:]),
        "pdl": bool(args.pdl),
        "note": "random-initialised weights (honest for speed, not quality); every row generates exactly completion_len tokens",
    }
    rows: list[dict] = []
    result = dict(meta, rows=rows)

    def save():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    if args.check:
        result["check"] = check(args)
        save()
    settings = RolloutSettings(max_new_tokens=args.completion, temperature=1.0, stop_ids=[10**9], pad_id=0)
    for preset in args.models:
        bf16_tps: dict[int, float] = {}
        hf_tps: dict[int, float] = {}
        batches = [b for b in args.batches if not (preset == "qwen2.5-32b" and b > args.max_batch_32b)]
        g = torch.Generator().manual_seed(1)
        prompts = {b: [torch.randint(0, 150000, (args.prompt,), generator=g).tolist() for _ in range(b)] for b in batches}
        for fmt in args.formats:
            if time.time() - started > args.time_budget_s:
                log(f"time budget reached before {preset} {fmt}")
                break
            t0 = time.time()
            try:
                model = build(preset, fmt)
                log(f"{preset} {fmt}: built in {time.time() - t0:.0f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
                if fmt == "bf16" and args.hf_tokens:
                    with torch.inference_mode():
                        for b in [b for b in batches if b <= args.hf_max_batch]:
                            hf_tps[b] = hf_generate_tps(model, prompts[b], args.hf_tokens)
                            log(f"  HF generate bf16 batch {b}: {hf_tps[b]:.1f} tok/s ({args.hf_tokens} new tokens)")
                variants = [(b, 0) for b in batches]
                if fmt == "nvfp4" and args.lora and 8 in batches:
                    variants += [(8, r) for r in LORA_RANKS]
                engine = None
                for b, rank in variants:
                    if rank:
                        from qerl.nn.lora import LoraSettings, apply_lora

                        if hasattr(model, "unload"):
                            model = model.unload()
                        model = apply_lora(model, LoraSettings(r=rank, lora_alpha=rank)).eval()
                        engine = None
                    if engine is None:
                        engine = RolloutEngine(model, max_batch=max(b for b, _ in variants), max_len=args.prompt + args.completion)
                    with torch.inference_mode():
                        tps, stats = timed_generate(engine, prompts[b], settings, args.repeats)
                    if fmt == "bf16" and rank == 0:
                        bf16_tps[b] = tps
                    row = {
                        "model": preset, "format": fmt, "batch": b, "prompt_len": args.prompt,
                        "completion_len": args.completion, "lora_rank": rank, "tokens_per_s": round(tps, 1),
                        "bf16_tokens_per_s": round(bf16_tps[b], 1) if b in bf16_tps else None,
                        "hf_generate_tokens_per_s": round(hf_tps[b], 1) if b in hf_tps else None,
                        "lora0_tokens_per_s": next((x["tokens_per_s"] for x in rows if x.get("model") == preset and x.get("format") == fmt
                                                    and x.get("batch") == b and x.get("lora_rank") == 0), None) if rank else None,
                        "prefill_s": round(stats["prefill_s"], 4), "decode_s": round(stats["decode_s"], 4),
                        "capture_loads": stats["capture_loads"],
                        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                        "gpu_state": gpu_state(),
                        # nf4 only: "baseline" or "fused<=N" (QERL_NF4_FUSED_MAX_M, the labelled fused NF4 decode)
                        "nf4_decode": nf4_decode(fmt),
                        # nvfp4 only: the word-order setting (QERL_W4A16_ORDER, unset: layout.DEFAULT_ORDER)
                        "w4a16_order": order_setting(fmt),
                    }
                    rows.append(row)
                    save()
                    ratio = f" x{tps / bf16_tps[b]:.2f} of bf16" if b in bf16_tps and fmt != "bf16" else ""
                    log(f"  {fmt} batch {b} lora {rank}: {tps:.1f} tok/s{ratio} (prefill {stats['prefill_s']*1e3:.0f} ms, decode {stats['decode_s']:.2f} s)"
                        + (f"; kernels loaded inside a capture: {stats['capture_loads']}" if stats["capture_loads"] else ""))
                    if rank:
                        engine.release_graphs()
            except torch.cuda.OutOfMemoryError:
                log(f"{preset} {fmt}: out of memory")
                rows.append({"model": preset, "format": fmt, "status": "oom"})
                save()
            except Exception:
                traceback.print_exc()
                rows.append({"model": preset, "format": fmt, "status": "error"})
                save()
            finally:
                model = engine = None
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    summary(result)


def summary(result: dict) -> None:
    log("\n| model | format | batch | LoRA r | tok/s | x bf16 engine | x HF generate | x no-LoRA (same run) |")
    log("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "tokens_per_s" not in r:
            log(f"| {r['model']} | {r['format']} | | | {r.get('status')} | | | |")
            continue
        xb = f"{r['tokens_per_s'] / r['bf16_tokens_per_s']:.2f}" if r.get("bf16_tokens_per_s") else ""
        xh = f"{r['tokens_per_s'] / r['hf_generate_tokens_per_s']:.1f}" if r.get("hf_generate_tokens_per_s") else ""
        xl = f"{r['tokens_per_s'] / r['lora0_tokens_per_s']:.3f}" if r.get("lora0_tokens_per_s") else ""
        log(f"| {r['model']} | {r['format']} | {r['batch']} | {r['lora_rank']} | {r['tokens_per_s']:.1f} | {xb} | {xh} | {xl} |")


def combine(paths: list[str], out: str) -> None:
    parts = [json.load(open(p)) for p in paths]
    result = {k: v for k, v in parts[0].items() if k != "rows"}
    # A combined file can be combined again: its commands and dates are spliced in, and its rows'
    # `run` indices shifted to match, so `run` always indexes the flat command list.
    listed = lambda v: v if isinstance(v, list) else [v]  # noqa: E731
    result["command"] = [c for p in parts for c in listed(p["command"])]
    result["date"] = [d for p in parts for d in listed(p["date"])]
    # A later file's measurement of a configuration replaces an earlier one, except that a plain
    # (no-LoRA) row without an in-process bf16 baseline never replaces one with it. LoRA rows
    # carry the throughput without LoRA from their own run (same process).
    rows: dict[tuple, dict] = {}
    offset = 0
    for p in parts:
        nested = isinstance(p["command"], list)
        plain = {(r["model"], r["format"], r.get("batch"), r.get("run", 0) if nested else 0): r["tokens_per_s"]
                 for r in p["rows"] if r.get("lora_rank") == 0 and "tokens_per_s" in r}
        for r in p["rows"]:
            run_in_part = r.get("run", 0) if nested else 0
            # a fused-decode nf4 row never replaces a baseline one (rows before the field: read from their command)
            decode = nf4_decode_of(r, listed(p["command"])[run_in_part])
            r = dict(r, run=offset + run_in_part)
            if decode is not None:
                r["nf4_decode"] = decode
            key = (r["model"], r["format"], r.get("batch"), r.get("lora_rank"), decode)
            if r.get("lora_rank"):
                r["lora0_tokens_per_s"] = plain.get(key[:3] + (run_in_part,))
            old = rows.get(key)
            if old is not None and not r.get("lora_rank") and old.get("bf16_tokens_per_s") and not r.get("bf16_tokens_per_s"):
                continue
            rows[key] = r
        offset += len(listed(p["command"]))
    result["rows"] = list(rows.values())
    for p in parts:
        if "check" in p:
            result["check"] = p["check"]
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    summary(result)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--hf-tokens", type=int, default=64, help="new tokens for the HF generate baseline (0 = skip)")
    ap.add_argument("--hf-max-batch", type=int, default=8)
    ap.add_argument("--max-batch-32b", type=int, default=8, help="32B bf16 leaves no room for a batch-64 KV cache on 80 GB")
    ap.add_argument("--no-lora", dest="lora", action="store_false")
    ap.add_argument("--check", action="store_true", help="GPU correctness checks first")
    ap.add_argument("--no-pdl", dest="pdl", action="store_false",
                    help="no programmatic dependent launch in the decode step (the engine's default is on; QERL_ROLLOUT_PDL=0)")
    ap.add_argument("--time-budget-s", type=float, default=520)
    ap.add_argument("--combine", nargs="+", default=None,
                    help="merge the JSON files of several calls into --out (later files replace the same model/format/batch/rank)")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out)
    if not torch.cuda.is_available():
        raise SystemExit("bench_rollout.py needs a CUDA GPU")
    from qerl.kernels import decode_ops

    decode_ops.PDL = decode_ops.PDL and args.pdl
    run(args)


if __name__ == "__main__":
    main()
