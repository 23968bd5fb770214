"""Benchmark the fused 4-bit x bf16 GEMMs against torch bf16 matmul and the NF4 baseline.

Run on a CUDA GPU (one call, about 4-5 minutes on an H100; stops itself at --time-budget-s):

    python benchmarks/bench_w4a16.py --out benchmarks/results/w4a16.json [--quick] [--variants] [--explore] [--overlap]

For every linear layer of Qwen2.5-3B/7B/14B/32B-Instruct (q/k/v fused, o, gate/up fused,
down) and M in 1..4096, in one process: bf16 `x @ W^T` (cuBLAS), nvfp4 and mxfp4 through the
fused kernels, and the QLoRA baseline nf4 = one-pass NF4 -> bf16 dequantisation kernel (as
bitsandbytes does) + cuBLAS; forward, plus backward (grad_x = grad_y @ W) at M in 256/1024/4096.
`--formats ...,nf4-fused` adds the fused NF4 kernel (nf4_triton.fused_matmul in its FUSED_CONFIG: what
"a fused NF4 kernel, if cheap" costs), forward only, labelled apart from the baseline; the summary
then also gives nvfp4 / mxfp4 against it. `--nf4-fused-cands` adds named configs of it as
`nf4-fused:<name>` columns.

Timing (benchmarks/NOTES_w4a16.md has the details): fresh random data (never zeros); each
format gets enough copies of its weight (and of x) that one sweep over them moves >= 192 MB,
about 4x the 50 MB L2, and calls cycle through the copies, so no call finds its weight in L2
(rotation, not a flush: a flush kernel leaves 50 MB of dirty lines for the timed kernel to
write back). The calls are captured in a CUDA graph (no launch gaps from Python) and each
graph replay is timed with CUDA events; the reported time per call is the median over replays
after a warm-up. A device-to-device copy of 1 GiB measures the copy bandwidth first.

Output: one line per (shape, M) as it goes, an optional variant sweep, then a markdown summary
(median speedup per M per format) at the very end; the full rows go to --out as JSON:
{"gpu", "torch", "triton", "date", "command", "copy_gbps", "rows": [{"model", "layer", "n", "k",
"m", "format", "op", "us", "bf16_us", "speedup", "gbps"}]}.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qerl.formats import nf4, quantize_weight  # noqa: E402
from qerl.env import switches_prefix  # noqa: E402
from qerl.kernels import prepare  # noqa: E402
from qerl.kernels.shapes import M_SWEEP, QWEN25, linear_shapes  # noqa: E402

try:  # the threshold where the default dispatch switches to bf16 weight + cuBLAS
    from qerl.kernels.w4a16_triton import DEQUANT_MIN_M, WGMMA_MAX_M  # noqa: E402
except Exception:  # no triton
    DEQUANT_MIN_M, WGMMA_MAX_M = 512, 2048

ROTATE_BYTES = 192 << 20
ORDER = None  # --order: nvfp4's word order in every prepared layer (None: layout.default_order())
NF4_FUSED_CANDS: dict[str, dict] = {}  # --nf4-fused-cands: name -> nf4_triton.fused_matmul config
MAX_COPIES = 96
BWD_MS = (256, 1024, 4096)
KEY_MS = (1, 16, 64, 256, 1024, 4096)
# (N, K, M) for --variants: 7B gate/up and o
VARIANT_CASES = [(37888, 3584, m) for m in (1, 16, 64, 1024, 4096)] + [(3584, 3584, m) for m in (1, 16)]


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- timing


_GRAPH_WARNED: list = []


def time_per_call(fn, n_calls: int, target_ms: float = 25.0) -> float:
    """Median microseconds per call of fn(i), i = 0..n_calls-1, replayed from a CUDA graph."""
    fn(0)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n_calls):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end), 1e-3)
    reps = int(min(30, max(5, target_ms / est_ms)))
    graph = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n_calls):
                fn(i)
        run = graph.replay
        run()
    except Exception as e:  # fall back to eager launches
        if not _GRAPH_WARNED:
            log(f"    (graph capture failed: {type(e).__name__}: {str(e)[:160]}; timing eager launches from here on)")
            _GRAPH_WARNED.append(True)
        graph = None
        torch.cuda.synchronize()

        def run():
            for i in range(n_calls):
                fn(i)

    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / n_calls)
    del graph
    return statistics.median(times)


def copy_bandwidth_gbps() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1000.0)
    del src, dst
    return 2 * n / statistics.median(ts) / 1e9


META: dict = {}  # gpu, torch, triton, date, command, copy_gbps of this run (set by main)


def dump_rows(out_path: str | None, rows: list, **extra) -> None:
    """Write an explore mode's rows with the run's metadata (as they come: a cut-short run keeps them)."""
    if out_path:
        with open(out_path, "w") as f:
            json.dump({**META, **extra, "rows": rows}, f, indent=1)


def probe_rows(shapes: str, ms: str, modes: list, clocks) -> list[dict]:
    """The probes' loop: per "NxK" of `shapes` and M of `ms` (comma lists), bf16 and each (name, config) of `modes`
    timed as the sweep times them, plus clocks(layer, m, config) -> dict of per-program clocks; each row printed
    as JSON when measured."""
    rows = []
    for shape in shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        layer = Layer(n, k, ("nvfp4",), seed=1)
        for m in (int(v) for v in ms.split(",")):
            bf = measure(layer, m, "bf16", "forward")
            for name, cfg in modes:
                us = measure(layer, m, "nvfp4", "forward", cfg)
                row = {"n": n, "k": k, "m": m, "mode": name, "config": cfg, "us": round(us, 2),
                       "bf16_us": round(bf, 2), "speedup": round(bf / us, 3), **clocks(layer, m, cfg)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del layer
        torch.cuda.empty_cache()
    return rows


def write_probe(path: str | None, rows: list, **extra) -> None:
    """A probe script's JSON (gpu, torch, `extra`, its command line, rows); nothing when path is None."""
    if path:
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, **extra,
                       "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


# --------------------------------------------------------------------------- weights


def _kernel(fmt: str) -> str:
    """A format column without its --nf4-fused-cands config name ("nf4-fused:split4" -> "nf4-fused")."""
    return fmt.partition(":")[0]


def weight_bytes(fmt: str, n: int, k: int) -> int:
    fmt = _kernel(fmt).replace("-fused", "")
    return {"bf16": 2 * n * k, "nvfp4": n * k // 2 + n * k // 16 + 4, "mxfp4": n * k // 2 + n * k // 32,
            "nf4": n * k // 2 + n * k // 64 * 4}[fmt]


def copies(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def clone_state(st: dict) -> dict:
    out = {}
    for key, v in st.items():
        if key in ("locks", "locks_bwd"):
            out[key] = torch.zeros_like(v)
        elif isinstance(v, torch.Tensor) and key in ("words", "scale"):
            out[key] = v.clone()
        else:
            out[key] = v
    return out


class Layer:
    """All formats of one random weight [N, K], each replicated for L2 rotation."""

    def __init__(self, n: int, k: int, formats, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        self.n, self.k = n, k
        self.bf16 = [w] + [w.clone() for _ in range(copies(weight_bytes("bf16", n, k)) - 1)]
        self.states, self.nf4 = {}, []
        for fmt in formats:
            if fmt in ("nvfp4", "mxfp4"):
                st = prepare(fmt, quantize_weight(w, fmt), order=ORDER if fmt == "nvfp4" else None)
                self.states[fmt] = [st] + [clone_state(st) for _ in range(copies(weight_bytes(fmt, n, k)) - 1)]
            elif _kernel(fmt) in ("nf4", "nf4-fused") and not self.nf4:
                t = quantize_weight(w, "nf4")
                self.nf4 = [t] + [{a: b.clone() for a, b in t.items()} for _ in range(copies(weight_bytes("nf4", n, k)) - 1)]
        del w


# --x-spare-tile T: every activation x [M, K] is the first M rows of a buffer of M rounded up to T rows (its spare
# rows NaN), as the rollout engine would hold it to let rwg's XROWS read a whole last token tile; 0: plain x.
X_SPARE_TILE = 0


def activation(m: int, dim: int) -> torch.Tensor:
    """A fresh random bf16 x [m, dim] (with X_SPARE_TILE: a view of a longer buffer, spare rows NaN)."""
    rows = -(-m // X_SPARE_TILE) * X_SPARE_TILE if X_SPARE_TILE else m
    x = torch.randn(rows, dim, device="cuda").to(torch.bfloat16)
    if rows > m:
        x[m:] = float("nan")
    return x[:m]


def activations(m: int, dim: int, n_copies: int) -> list[torch.Tensor]:
    nbytes = m * dim * 2
    count = max(1, min(n_copies, math.ceil((64 << 20) / nbytes)))
    return [activation(m, dim) for _ in range(count)]


# --------------------------------------------------------------------------- one measurement


def measure(layer: Layer, m: int, fmt: str, op: str, config: dict | None = None) -> float:
    from qerl.kernels import nf4_triton
    from qerl.kernels import w4a16_triton as W

    n, k = layer.n, layer.k
    if _kernel(fmt) == "nf4-fused":  # "nf4-fused" (FUSED_CONFIG) or "nf4-fused:<name>" (--nf4-fused-cands)
        if op != "forward":
            raise ValueError("nf4-fused is timed forward only")
        cfg = NF4_FUSED_CANDS.get(fmt.partition(":")[2], {})
        xs = activations(m, k, len(layer.nf4))
        absmax = [nf4.absmax_from(t).float().contiguous() for t in layer.nf4]
        return time_per_call(lambda i: nf4_triton.fused_matmul(xs[i % len(xs)], layer.nf4[i % len(layer.nf4)],
                                                               absmax[i % len(layer.nf4)], cfg),
                             max(len(layer.nf4), len(xs), 3))
    if fmt.endswith("-fused"):  # the fused kernel where the default dispatch takes the bf16 path
        fmt = fmt[: -len("-fused")]
        config = dict(config or {}, PATH="fused")
    if fmt == "bf16":
        ws = layer.bf16
    elif fmt == "nf4":
        ws = layer.nf4
    else:
        ws = layer.states[fmt]
    xs = activations(m, k if op == "forward" else n, len(ws))
    calls = max(len(ws), len(xs), 3)
    if op == "forward":
        if fmt == "bf16":
            fn = lambda i: torch.matmul(xs[i % len(xs)], ws[i % len(ws)].T)  # noqa: E731
        elif fmt == "nf4":
            fn = lambda i: nf4_triton.dequant_matmul(xs[i % len(xs)], ws[i % len(ws)])  # noqa: E731
        else:
            fn = lambda i: W.forward(xs[i % len(xs)], ws[i % len(ws)], config=config)  # noqa: E731
    else:
        if fmt == "bf16":
            fn = lambda i: torch.matmul(xs[i % len(xs)], ws[i % len(ws)])  # noqa: E731
        else:
            fn = lambda i: W.backward(xs[i % len(xs)], ws[i % len(ws)], config=config)  # noqa: E731
    return time_per_call(fn, calls)


def moved_bytes(fmt: str, n: int, k: int, m: int) -> int:
    return weight_bytes(fmt, n, k) + 2 * m * k + 2 * m * n


# --------------------------------------------------------------------------- main


def summarize(rows: list[dict], copy_gbps: float) -> str:
    fwd = [r for r in rows if r["op"] == "forward" and r["format"] != "bf16" and r["us"] > 0]
    fmts = [f for f in ("nvfp4", "mxfp4", "nf4", "nf4-fused", "nvfp4-fused", "mxfp4-fused") if any(r["format"] == f for r in fwd)]
    fmts += sorted({r["format"] for r in fwd if r["format"].startswith("nf4-fused:")})
    fused_nf4 = "nf4-fused" in fmts
    ms = sorted({r["m"] for r in fwd})
    if not fwd:
        return "\n## w4a16 summary: no forward rows were measured"
    out = ["", "## w4a16 summary: median over shapes of speedup = bf16_us / us (forward)", ""]
    versus = [("nvfp4", "nf4"), ("mxfp4", "nf4")] + ([("nvfp4", "nf4-fused"), ("mxfp4", "nf4-fused")] if fused_nf4 else [])
    out.append("| M | " + " | ".join(fmts) + "".join(f" | {a} vs {b}" for a, b in versus) + " | nvfp4 GB/s (med) | shapes |")
    out.append("|---|" + "---|" * (len(fmts) + len(versus) + 2))
    by = {(r["model"], r["layer"], r["m"], r["format"]): r for r in fwd}

    def vs(f, base, pred):
        """Median over shapes of base us / f us, at the M values `pred` accepts (nan without a pair)."""
        v = [by[(a, b, mm, base)]["us"] / r["us"] for (a, b, mm, ff), r in by.items()
             if ff == f and pred(mm) and (a, b, mm, base) in by]
        return statistics.median(v) if v else float("nan")

    for m in ms:
        cells, n_shapes = [], 0
        for f in fmts:
            v = [r["speedup"] for r in fwd if r["m"] == m and r["format"] == f]
            n_shapes = max(n_shapes, len(v))
            cells.append(f"{statistics.median(v):.2f}" if v else "-")
        for f, base in versus:
            v = vs(f, base, lambda mm, m=m: mm == m)
            cells.append("-" if math.isnan(v) else f"{v:.2f}")
        g = [r["gbps"] for r in fwd if r["m"] == m and r["format"] == "nvfp4"]
        cells.append(f"{statistics.median(g):.0f}" if g else "-")
        out.append(f"| {m} | " + " | ".join(cells) + f" | {n_shapes} |")
    bwd = [r for r in rows if r["op"] == "backward" and r["format"] != "bf16" and r["us"] > 0]
    if bwd:
        bf = [f for f in ("nvfp4", "mxfp4", "nvfp4-fused", "mxfp4-fused") if any(r["format"] == f for r in bwd)]
        out += ["", "| backward M | " + " | ".join(bf) + " |", "|---|" + "---|" * len(bf)]
        for m in sorted({r["m"] for r in bwd}):
            cells = []
            for f in bf:
                v = [r["speedup"] for r in bwd if r["m"] == m and r["format"] == f]
                cells.append(f"{statistics.median(v):.2f}" if v else "-")
            out.append(f"| {m} | " + " | ".join(cells) + " |")

    def med(fmt, pred, key="speedup", src=fwd):
        v = [r[key] for r in src if r["format"] == fmt and pred(r["m"])]
        return statistics.median(v) if v else float("nan")

    big = [r for r in fwd if r["n"] * r["k"] >= 50_000_000 and r["m"] == 1]
    out += ["", "(nvfp4/mxfp4 = default dispatch: GEMVs at M = 1, the fused Triton kernel up to M = 64 (on Hopper"
            " from M = 17 the register-operand wgmma GEMM, w4a16_rwg), on Hopper"
            f" the warp-specialised Gluon GEMM (w4a16_wgmma) from M = 65 (from M={DEQUANT_MIN_M} to"
            f" {WGMMA_MAX_M - 1} only on layers whose tiles fill the SMs), else bf16 weight + cuBLAS from M={DEQUANT_MIN_M};"
            " the -fused columns time the fused Triton kernel at those M.)",
            f"copy bandwidth {copy_gbps:.0f} GB/s (read+write, 1 GiB D2D)."]
    for f in ("nvfp4", "mxfp4"):
        v = [r["gbps"] for r in big if r["format"] == f]
        if v:
            out.append(f"{f} M=1 on N*K >= 50M: median {statistics.median(v):.0f} GB/s = {statistics.median(v) / copy_gbps:.0%} of copy bandwidth")
    out += ["", "goals (H100): M<=16 nvfp4 >= 3.0, mxfp4 >= 3.1; M=64 >= 2.0; M=256 >= 1.0; M>=1024 >= 0.85; bwd M=4096 >= 0.85; vs nf4 at M<=16 >= 3"]
    for f in ("nvfp4", "mxfp4"):
        out.append(
            f"{f}: M<=16 {med(f, lambda m: m <= 16):.2f} | M=64 {med(f, lambda m: m == 64):.2f} | M=256 {med(f, lambda m: m == 256):.2f}"
            f" | M>=1024 {med(f, lambda m: m >= 1024):.2f} | bwd M=4096 {med(f, lambda m: m == 4096, src=bwd):.2f}"
            f" | vs nf4 M<=16 {vs(f, 'nf4', lambda mm: mm <= 16):.2f}"
            + (f" | vs nf4-fused M<=16 {vs(f, 'nf4-fused', lambda mm: mm <= 16):.2f}" if fused_nf4 else ""))
    return "\n".join(out)


def variant_sweep(deadline: float):
    """Alternative tile configs on a few representative shapes, for the next tuning round."""
    log("\n## variant sweep (us per call; default = the heuristic)")
    cases = VARIANT_CASES
    decode = [dict(BM=16, BO=64, BR=256, num_warps=4, num_stages=4, PER_SM=4),
              dict(BM=16, BO=128, BR=128, num_warps=4, num_stages=4, PER_SM=3),
              dict(BM=16, BO=64, BR=128, num_warps=4, num_stages=6, PER_SM=4),
              dict(BM=16, BO=32, BR=256, num_warps=4, num_stages=4, PER_SM=6),
              dict(BM=16, BO=64, BR=256, num_warps=4, num_stages=4, PER_SM=4, PROGRAMS=132 * 8)]
    mid = [dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2),
           dict(BM=64, BO=64, BR=128, num_warps=4, num_stages=4, PER_SM=3),
           dict(BM=64, BO=64, BR=64, num_warps=4, num_stages=4, PER_SM=3)]
    big = [dict(BM=128, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2, PATH="fused"),
           dict(BM=256, BO=128, BR=64, num_warps=8, num_stages=3, PER_SM=1, PATH="fused"),
           dict(BM=256, BO=128, BR=64, num_warps=8, num_stages=4, PER_SM=1, PATH="fused"),
           dict(BM=128, BO=256, BR=64, num_warps=8, num_stages=3, PER_SM=1, PATH="fused"),
           {"PATH": "dequant"}]
    layers = {}
    for n, k, m in cases:
        if time.time() > deadline:
            log("  (time budget reached)")
            return
        if (n, k) not in layers:
            layers.clear()
            torch.cuda.empty_cache()
            layers[(n, k)] = Layer(n, k, ("nvfp4",), seed=1)
        layer = layers[(n, k)]
        cands = decode if m <= 16 else (mid if m <= 64 else big)
        parts = [f"N={n} K={k} M={m}: default {measure(layer, m, 'nvfp4', 'forward'):.1f}"]
        for cfg in cands:
            if time.time() > deadline:
                break
            if "BM" not in cfg:
                name = cfg["PATH"]
            else:
                name = "x".join(str(cfg[a]) for a in ("BM", "BO", "BR")) + f"/w{cfg['num_warps']}s{cfg['num_stages']}" + (
                    f"/P{cfg['PROGRAMS']}" if "PROGRAMS" in cfg else "")
            try:
                parts.append(f"{name} {measure(layer, m, 'nvfp4', 'forward', config=cfg):.1f}")
            except Exception as e:
                parts.append(f"{name} ERR {type(e).__name__}")
        log("  " + " | ".join(parts))
    layers.clear()


EXPLORE_SHAPES = [(7168, 5120), (3584, 3584), (4608, 3584), (5120, 13824), (2560, 2048), (37888, 3584), (27648, 5120)]


def explore(deadline: float, out_path: str | None):
    """Candidate configs (tile, stages, register cap, packed decode, schedule) on a few shapes,
    each checked against the fp32 reference once, then timed like the sweep (`--explore`)."""
    d16 = dict(BM=16, BO=64, BR=256, num_warps=4, num_stages=4, PER_SM=4)
    cands = {
        1: [("p16x64x256s4", dict(d16)),
            ("p16x64x256w8s4", dict(d16, num_warps=8, PER_SM=2)),
            ("p16x64x128w8s4", dict(d16, BR=128, num_warps=8, PER_SM=3)),
            ("p16x64x256s3r96", dict(d16, num_stages=3, maxnreg=96, PER_SM=5)),
            ("p16x32x256s4", dict(d16, BO=32, PER_SM=5)),
            ("p16x64x256s4W2", dict(d16, WAVES=2)),
            ("p16x64x256s3r96W2", dict(d16, num_stages=3, maxnreg=96, PER_SM=5, WAVES=2)),
            ("p16x128x128s4", dict(d16, BO=128, BR=128, PER_SM=3))],
        64: [("p64x64x128s4", dict(BM=64, BO=64, BR=128, num_warps=4, num_stages=4, PER_SM=2)),
             ("p64x128x64s4", dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)),
             ("p64x128x64s5", dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=5, PER_SM=2)),
             ("p64x256x64w8s3", dict(BM=64, BO=256, BR=64, num_warps=8, num_stages=3, PER_SM=1)),
             ("p64x128x64s4W2", dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2, WAVES=2))],
        256: [("p128x128x64s4", dict(BM=128, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)),
              ("p128x128x64s5", dict(BM=128, BO=128, BR=64, num_warps=4, num_stages=5, PER_SM=1)),
              ("p128x64x128s4", dict(BM=128, BO=64, BR=128, num_warps=4, num_stages=4, PER_SM=2)),
              ("p64x128x64s4", dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2))],
    }
    cands[16] = cands[1]

    def pick(n, k, m, fmt):
        if fmt == "mxfp4" and (m in (16, 64, 256) or (n, k) != (7168, 5120)):
            return []
        return cands[m]

    log("\n## explore (us per call, x = speedup vs bf16 in this process)")
    return candidate_sweep(deadline, out_path, EXPLORE_SHAPES, (1, 16, 64, 256), pick)


def candidate_sweep(deadline: float, out_path: str | None, shapes, ms, pick, formats=("nvfp4", "mxfp4")) -> list[dict]:
    """For each shape and M: bf16 once, then the candidates pick(n, k, m, fmt) returns for each
    of `formats` (nvfp4, mxfp4; time_candidates); rows written as they come."""
    rows = []
    for n, k in shapes:
        layer = Layer(n, k, ("nvfp4", "mxfp4"), seed=3)
        for m in ms:
            if time.time() > deadline:
                log("  (time budget reached)")
                break
            bf = measure(layer, m, "bf16", "forward")
            x = activation(m, k)
            for fmt in formats:
                chosen = pick(n, k, m, fmt)
                if not chosen:
                    continue
                parts = time_candidates(layer, x, layer.states[fmt][0], fmt, chosen, bf, rows, deadline)
                log(f"  N={n} K={k} M={m} {fmt} bf16 {bf:.1f}: " + " | ".join(parts))
                dump_rows(out_path, rows)
        del layer
        torch.cuda.empty_cache()
    return rows


GEMV_SHAPES = [(n, k) for n, k in dict.fromkeys((n, k) for _, _, n, k in linear_shapes())]
# (n, k) -> how many of the sweep's 16 layers have that shape (14B and 32B share q/k/v and o): the weight of a
# shape in every median "over the 16 shapes"
SHAPE_CELLS = collections.Counter((n, k) for _, _, n, k in linear_shapes())


def candidate_medians(rows: list[dict]) -> list[str]:
    """Per (M, format, candidate): the median speedup over bf16 with each shape counted once per model layer it
    is (14B and 32B share q/k/v and o), as the sweep's medians are, and over how many of the 16 cells; a
    candidate whose output missed the fp32 reference (err >= 1e-2) is marked BAD."""
    cells = SHAPE_CELLS
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["m"], r["fmt"], r["cfg"]), []).append(r)
    lines = []
    for (m, fmt, cfg), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        weighted = [r["bf16_us"] / r["us"] for r in rs for _ in range(cells.get((r["n"], r["k"]), 1))]
        bad = sum(r["err"] >= 1e-2 for r in rs)
        lines.append(f"M={m} {fmt} {cfg}: median x{statistics.median(weighted):.3f} over {len(weighted)} cells"
                     + (f" ({bad} BAD)" if bad else ""))
    return lines


# --cand-rounds R: each shape's candidate list is timed R times, the list rotated by one each round (so no candidate
# always runs first after bf16), and each candidate's row keeps the median and the R samples.
CAND_ROUNDS = 1


def round_orders(count: int, rounds: int) -> list[list[int]]:
    """The candidate indices in each round's order: round r starts at candidate r % count."""
    return [[(r + i) % count for i in range(count)] for r in range(max(1, rounds))] if count else []


def time_candidates(layer: Layer, x: torch.Tensor, st: dict, fmt: str, cands, bf: float, rows: list,
                    deadline: float | None = None) -> list[str]:
    """Check each (name, config) of the forward against the fp32 reference on x, then time it
    like the sweep (CAND_ROUNDS rounds in rotated order: the median); append one row per candidate,
    return the log pieces."""
    from qerl.kernels import reference, state_tensors
    from qerl.kernels import w4a16_triton as W

    n, k, m = layer.n, layer.k, x.shape[0]
    ref = x.float() @ reference.dequant(fmt, state_tensors(st), torch.float32).T
    cands = list(cands)
    errs, samples, failed = {}, {i: [] for i in range(len(cands))}, {}
    for order in round_orders(len(cands), CAND_ROUNDS):
        for i in order:
            name, cfg = cands[i]
            if i in failed or (deadline is not None and time.time() > deadline):
                continue
            try:
                if i not in errs:
                    y = W.forward(x, st, config=cfg)
                    errs[i] = ((y.float() - ref).norm() / ref.norm()).item()
                samples[i].append(measure(layer, m, fmt, "forward", config=cfg))
            except Exception as e:
                failed[i] = f"{name} ERR {type(e).__name__}: {str(e)[:200]}"
    parts = []
    for i, (name, _cfg) in enumerate(cands):
        if i in failed:
            parts.append(failed[i])
            continue
        if not samples[i]:
            continue
        us, err = statistics.median(samples[i]), errs[i]
        gb = moved_bytes(fmt, n, k, m) / us / 1e3
        parts.append(f"{name} {us:.1f} x{bf / us:.2f} {gb:.0f}GB/s" + ("" if err < 1e-2 else f" BAD{err:.2g}"))
        row = dict(n=n, k=k, m=m, fmt=fmt, cfg=name, us=us, bf16_us=bf, err=err, gbps=gb)
        if CAND_ROUNDS > 1:
            row["us_rounds"] = [round(v, 3) for v in samples[i]]
        rows.append(row)
    return parts


GEMV_CANDS = [("v3", None),
              ("g32w4C32", dict(PATH="gemv", BN=32, num_warps=4, ACC2D=True, CH=32)),
              ("g64w8C32", dict(PATH="gemv", BN=64, num_warps=8, ACC2D=True, CH=32)),
              ("g16w2C32", dict(PATH="gemv", BN=16, num_warps=2, ACC2D=True, CH=32))]


NVFP4_ONLY_PATHS = ("ws",)  # the CUDA-core Gluon GEMV reads FP8 scale rows of 16 bytes (wsmma takes mxfp4 too)


def gemv_explore(deadline: float, out_path: str | None, ms=(1,), cands=None, shapes=None, all_formats=("v3", "g32w4C32"),
                 formats=("nvfp4", "mxfp4")):
    """Candidate configs against bf16 (`--gemv`: the CUDA-core GEMV against the v3 tensor-core
    kernel; `--cands`: any list of (name, config), mxfp4 too unless the config's PATH is an
    nvfp4-only kernel); each checked against the fp32 reference."""
    from qerl.kernels import w4a16_gemv as G

    explicit = cands is not None

    def runs(name, cfg, fmt):
        if fmt == "nvfp4" or name in all_formats:
            return True
        return explicit and (cfg or {}).get("PATH") not in NVFP4_ONLY_PATHS

    cands = cands or GEMV_CANDS
    log("\n## candidate explore (us per call, x = speedup vs bf16 in this process)")
    rows = candidate_sweep(deadline, out_path, shapes or GEMV_SHAPES, ms,
                           lambda n, k, m, fmt: [(a, c) for a, c in cands if runs(a, c, fmt)], formats)
    medians = candidate_medians(rows)
    for line in medians:
        log("  " + line)
    dump_rows(out_path, rows, candidate_medians=medians)  # the closing summary in the JSON too
    ws_mod = sys.modules.get("qerl.kernels.w4a16_ws")
    if ws_mod is not None:
        log(f"  resident programs per SM (ws: NS, warps, maxnreg, CPT): {ws_mod._RESIDENT}")
    wg_mod = sys.modules.get("qerl.kernels.w4a16_wgmma")
    if wg_mod is not None:
        log(f"  resident programs per SM (wgmma: BN, BM, NSW, NSD, NSX, warps, DEC_REGS, maxnreg, PDL): {wg_mod._RESIDENT}")
    log("  resident programs per SM (gemv): " + "; ".join(f"{dict(k_).get('BN')}/{dict(k_).get('num_warps')}/"
                                                         f"{'f32' if dict(k_).get('F32') else 'pk'}/BM{dict(k_).get('BM')}: {v}"
                                                         for k_, v in G._RESIDENT.items()))
    return rows


OVERLAP_SHAPES = [(37888, 3584), (3584, 18944), (4608, 3584), (3584, 3584), (27648, 5120), (5120, 13824),
                  (2560, 2048), (55296, 5120)]
OVERLAP_MS = (256, 1024, 4096)


def overlap_explore(deadline: float, out_path: str | None, ms=OVERLAP_MS):
    """The large-M cuBLAS paths (`--overlap`): whole-layer dequant + one cuBLAS call against the
    overlapped chunked path (CHUNKS slices, side stream on/off), bf16 in the same process;
    each candidate checked against the fp32 reference first."""
    from qerl.kernels import reference, state_tensors
    from qerl.kernels import w4a16_triton as W

    cands = [("dequant", {"PATH": "dequant", "CHUNKS": 0})]
    cands += [(f"ov{c}", {"PATH": "overlap", "CHUNKS": c}) for c in (2, 3, 4, 6, 8)]
    cands += [("ser4", {"PATH": "overlap", "CHUNKS": 4, "SIDE": False})]
    rows = []
    log("\n## overlap explore (us per call, x = speedup vs bf16 in this process)")
    for n, k in OVERLAP_SHAPES:
        if time.time() > deadline:
            break
        layer = Layer(n, k, ("nvfp4",), seed=5)
        st = layer.states["nvfp4"][0]
        w32 = reference.dequant("nvfp4", state_tensors(st), torch.float32)
        torch.cuda.synchronize()
        copies_ = layer.states["nvfp4"]
        t_dq = time_per_call(lambda i: W.dequant_bf16(copies_[i % len(copies_)]), len(copies_))
        log(f"  N={n} K={k}: dequant_bf16 alone {t_dq:.1f} us ({(n * k * 2.5625) / t_dq / 1e3:.0f} GB/s)")
        for m in ms:
            for op in ("forward", "backward"):
                if time.time() > deadline:
                    break
                bf = measure(layer, m, "bf16", op)
                a = torch.randn(m, k if op == "forward" else n, device="cuda").to(torch.bfloat16)
                ref = a.float() @ (w32.T if op == "forward" else w32)
                parts = []
                todo = list(cands) + ([("fused", {"PATH": "fused"})] if m <= 256 else [])
                for name, cfg in todo:
                    if time.time() > deadline:
                        break
                    try:
                        fn = W.forward if op == "forward" else W.backward
                        err = ((fn(a, st, config=cfg).float() - ref).norm() / ref.norm()).item()
                        us = measure(layer, m, "nvfp4", op, config=cfg)
                        parts.append(f"{name} {us:.1f} x{bf / us:.2f}" + ("" if err < 1e-2 else f" BAD{err:.2g}"))
                        rows.append(dict(n=n, k=k, m=m, op=op, fmt="nvfp4", cfg=name, us=us, bf16_us=bf, err=err))
                    except Exception as e:
                        parts.append(f"{name} ERR {type(e).__name__}: {str(e)[:160]}")
                log(f"  {op[:3]} N={n} K={k} M={m} bf16 {bf:.1f}: " + " | ".join(parts))
                dump_rows(out_path, rows)
        del layer, w32
        torch.cuda.empty_cache()
    # median speedup per (M, op, candidate) over the shapes measured
    log("\n| M | op | " + " | ".join(c for c, _ in cands) + " |")
    for m in ms:
        for op in ("forward", "backward"):
            cells = []
            for c, _ in cands:
                v = [r["bf16_us"] / r["us"] for r in rows if r["m"] == m and r["op"] == op and r["cfg"] == c]
                cells.append(f"{statistics.median(v):.3f}" if v else "-")
            log(f"| {m} | {op} | " + " | ".join(cells) + " |")
    return rows


PDL_MS = (1, 4, 16, 64)


def stream_shapes(spec: str | None) -> list[tuple[int, int]]:
    """--stream-shapes: None -> STREAM_SHAPES; "all" -> the sweep's unique shapes (smallest first); else NxK,..."""
    if not spec:
        return list(STREAM_SHAPES)
    if spec == "all":
        return sorted(SHAPE_CELLS, key=lambda s: s[0] * s[1])
    try:
        return [tuple(int(v) for v in sh.split("x")) for sh in spec.split(",") if sh]
    except ValueError:
        raise SystemExit(f"--stream-shapes {spec!r}: expected all or NxK,NxK,...") from None


def _stream_kernel():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def stream(a_ptr, na, b_ptr, nb, out_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr, UNROLL: tl.constexpr):
        """Read a[:na] and b[:nb] (int32) once, XOR-reduce, one int per program: the time a
        single kernel needs to stream those bytes (a floor for a GEMV that reads them). UNROLL
        blocks are loaded per iteration before any is used (more loads in flight)."""
        if PDL:
            gdc_launch_dependents()
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK * UNROLL
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(pid * BLOCK * UNROLL, na, step):
            offs = i + tl.arange(0, UNROLL * BLOCK)
            v = tl.load(a_ptr + offs, mask=offs < na, other=0)
            acc ^= tl.xor_sum(v.reshape(UNROLL, BLOCK), 0)
        for i in range(pid * BLOCK * UNROLL, nb, step):
            offs = i + tl.arange(0, UNROLL * BLOCK)
            v = tl.load(b_ptr + offs, mask=offs < nb, other=0)
            acc ^= tl.xor_sum(v.reshape(UNROLL, BLOCK), 0)
        if PDL:
            gdc_wait()
        tl.store(out_ptr + pid, tl.xor_sum(acc, 0))

    return stream


_STREAM = []


def stream_us(tensors: list[tuple[torch.Tensor, torch.Tensor | None]], pdl: bool, per_sm: int = 4,
              block: int = 2048, unroll: int = 1, num_warps: int = 4, num_stages: int = 3) -> float:
    """Median us per call of the streaming kernel over rotating (a, b) weight copies."""
    if not _STREAM:
        _STREAM.append(_stream_kernel())
    kern = _STREAM[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * per_sm, dtype=torch.int32, device="cuda")
    views = [(a.view(torch.int32).reshape(-1), (b if b is not None else a[:0]).view(torch.int32).reshape(-1))
             for a, b in tensors]

    def fn(i):
        a, b = views[i % len(views)]
        kern[(sms * per_sm,)](a, a.numel(), b, b.numel(), out, BLOCK=block, PDL=pdl, UNROLL=unroll,
                              num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)

    return time_per_call(fn, max(len(views), 3))


STREAM_SHAPES = [(37888, 3584), (7168, 5120), (3584, 3584)]
STREAM_CFGS = [dict(per_sm=4, block=2048, unroll=1, num_warps=4, num_stages=3),
               dict(per_sm=4, block=2048, unroll=1, num_warps=4, num_stages=1),
               dict(per_sm=4, block=2048, unroll=4, num_warps=4, num_stages=1),
               dict(per_sm=8, block=2048, unroll=2, num_warps=4, num_stages=1),
               dict(per_sm=8, block=1024, unroll=4, num_warps=4, num_stages=1),
               dict(per_sm=2, block=4096, unroll=4, num_warps=8, num_stages=1),
               dict(per_sm=16, block=1024, unroll=2, num_warps=2, num_stages=1),
               dict(per_sm=4, block=2048, unroll=2, num_warps=4, num_stages=3),
               dict(per_sm=1, block=4096, unroll=4, num_warps=16, num_stages=1),
               dict(per_sm=8, block=2048, unroll=4, num_warps=8, num_stages=1),
               dict(per_sm=4, block=1024, unroll=8, num_warps=4, num_stages=1)]


def stream_explore(deadline: float, out_path: str | None, shapes=STREAM_SHAPES, floor_ms=(), fmt: str = "nvfp4"):
    """`--stream`: how fast can one kernel read a layer's bytes (4-bit words + scales, and the
    bf16 weight), by launch shape and loads in flight, against bf16 cuBLAS at M = 1.

    floor_ms (`--stream-ms`): also bf16 cuBLAS at those M, and the summary of the single-launch ceiling the
    issue's sweep can reach: per (layer, M) cell, bf16 time / the fastest streaming launch of the layer's
    4-bit bytes; medians over the sweep's 16 shapes (duplicates counted as in the sweep). `fmt`
    (`--stream-format`): whose packed bytes are streamed (nvfp4: 4.5 bits a weight, mxfp4: 4.25)."""
    rows = []
    log("\n## streaming floor explore (us per call; GB/s of bytes read)")
    for n, k in shapes:
        if time.time() > deadline:
            log("  (time budget reached)")
            break
        layer = Layer(n, k, (fmt,), seed=5)
        bf = measure(layer, 1, "bf16", "forward")
        for m in floor_ms:
            rows.append(dict(n=n, k=k, m=m, cfg="bf16", bf16_us=bf if m == 1 else measure(layer, m, "bf16", "forward")))
        b4, b16 = weight_bytes(fmt, n, k), weight_bytes("bf16", n, k)
        log(f"  N={n} K={k}: bf16 cuBLAS M=1 {bf:.1f} us ({b16 / bf / 1e3:.0f} GB/s)")
        for cfg in STREAM_CFGS:
            if time.time() > deadline:
                break
            name = stream_cfg_name(cfg)
            try:
                u4 = stream_us([(st["words"], st["scale"]) for st in layer.states[fmt]], False, **cfg)
                u16 = stream_us([(w, None) for w in layer.bf16], False, **cfg)
                log(f"    {name}: 4-bit {u4:.1f} us {b4 / u4 / 1e3:.0f} GB/s (x{bf / u4:.2f} of bf16) | bf16 bytes {u16:.1f} us {b16 / u16 / 1e3:.0f} GB/s")
                rows.append(dict(n=n, k=k, fmt=fmt, cfg=name, us4=u4, us16=u16, bf16_us=bf))
            except Exception as e:
                log(f"    {name}: ERR {type(e).__name__}: {str(e)[:200]}")
        dump_rows(out_path, rows)
        del layer
        torch.cuda.empty_cache()
    if floor_ms:
        summary = stream_ceiling(rows, floor_ms)
        for m, (med, cells) in summary.items():
            log(f"  single-launch ceiling, M = {m}: median x{med:.2f} of bf16 over {cells} cells")
        dump_rows(out_path, rows, ceiling={str(m): v[0] for m, v in summary.items()})
    return rows


def stream_ceiling(rows: list[dict], ms) -> dict:
    """{M: (median over the sweep's cells of bf16 us / the layer's fastest 4-bit streaming launch, cells)}, and
    one entry "all" over every M given: what a kernel that only reads the 4-bit bytes would score in the sweep."""
    fastest = {}
    for r in rows:
        if "us4" in r:
            key = (r["n"], r["k"])
            fastest[key] = min(fastest.get(key, float("inf")), r["us4"])
    out, every = {}, []
    for m in ms:
        v = [r["bf16_us"] / fastest[(r["n"], r["k"])] for r in rows
             if r.get("cfg") == "bf16" and r.get("m") == m and (r["n"], r["k"]) in fastest
             for _ in range(SHAPE_CELLS[(r["n"], r["k"])])]
        every += v
        if v:
            out[m] = (statistics.median(v), len(v))
    if every and len(ms) > 1:
        out["all"] = (statistics.median(every), len(every))
    return out


def stream_cfg_name(cfg: dict) -> str:
    """A STREAM_CFGS launch shape as one token, e.g. per_sm4/block2048/unroll1/num_warps4/num_stages3."""
    return "/".join(f"{a}{v}" for a, v in cfg.items())


def stream_times(tensors, pdl: bool) -> dict[str, float]:
    """{config name: us} of every STREAM_CFGS launch streaming `tensors` (see stream_us); configs that fail to
    build or launch are left out. The first config is stream_us's default shape."""
    times = {}
    for cfg in STREAM_CFGS:
        try:
            times[stream_cfg_name(cfg)] = stream_us(tensors, pdl, **cfg)
        except Exception as e:  # a launch shape this GPU cannot run: the others still count
            log(f"    stream {cfg}: ERR {type(e).__name__}: {str(e)[:160]}")
    return times


def distinct_copies(tensors: list[tuple], n: int) -> list[tuple]:
    """`tensors` with clones appended until there are n distinct copies. A chained streaming kernel holds so little
    of an SM that three calls run at once; with two copies (the 159 MB layer: ROTATE_BYTES / its bytes) calls one
    and three read the same bytes together and the second reader hits L2: session 71 timed 55296x5120 at 4.4 TB/s
    chained, over the HBM's peak."""
    out = list(tensors)
    while len(out) < n:
        out.append(tuple(t.clone() if t is not None else None for t in tensors[len(out) % len(tensors)]))
    return out


PDL_SUMMARY = ("default", "pdl", "gemv-pdl", "stream4", "stream4-pdl", "stream4-best", "stream4-pdl-best")


def pdl_medians(rows: list[dict], ms, names=PDL_SUMMARY) -> dict:
    """{(fmt, M or "all", name): (median of bf16 us / us over the sweep's cells, cells)} for `--pdl`'s rows;
    "all" pools every M given (the goal's M <= 16 median when ms = 1, 2, 4, 8, 16)."""
    out = {}
    for fmt in ("nvfp4", "mxfp4"):
        for name in names:
            pooled = []
            for m in ms:
                v = [r["bf16_us"] / r["us"] for r in rows if r["fmt"] == fmt and r["m"] == m and r["cfg"] == name
                     for _ in range(SHAPE_CELLS[(r["n"], r["k"])])]
                pooled += v
                if v:
                    out[(fmt, m, name)] = (statistics.median(v), len(v))
            if pooled and len(ms) > 1:
                out[(fmt, "all", name)] = (statistics.median(pooled), len(pooled))
    return out


def pdl_explore(deadline: float, out_path: str | None, ms=PDL_MS, shapes_spec: str | None = None):
    """`--pdl`: programmatic dependent launch against plain launches, plus the streaming floor.

    Per shape: bf16 cuBLAS; the default dispatch; the same with PDL=True; at M = 1 also the GEMV
    with its weights loaded a step ahead (PF) and with PDL on every shape (the 40M threshold with
    PDL), and the fused kernel with PDL; and the time one streaming kernel needs to read the
    layer's packed bytes (words + scales, per format) without / with PDL: `stream4` / `stream4-pdl` at the
    kernel's default launch shape (as sessions 6-70 timed it), `stream4-best` / `stream4-pdl-best` the fastest
    of STREAM_CFGS (the layer's ceiling, single and chained), and its bf16 bytes (`stream16`): the speedup a
    perfect kernel could reach is bf16 cuBLAS time / 4-bit streaming time. The streaming rows are
    entered at every M (the bytes do not depend on M; bf16 does). Every candidate is checked against the
    fp32 reference first. `shapes_spec` (`--stream-shapes`): NxK,... (default: the sweep's 14 shapes)."""
    shapes = stream_shapes(shapes_spec or "all")
    rows = []
    log("\n## PDL explore (us per call; x = bf16 cuBLAS time / this)")
    for n, k in shapes:
        if time.time() > deadline:
            log("  (time budget reached)")
            break
        layer = Layer(n, k, ("nvfp4", "mxfp4"), seed=5)
        floor = {}
        for fmt in ("nvfp4", "mxfp4"):
            packed = distinct_copies([(st["words"], st["scale"]) for st in layer.states[fmt]], 3)
            f = floor[fmt] = {}
            try:
                default = stream_cfg_name(STREAM_CFGS[0])
                for suffix, pdl in (("", False), ("-pdl", True)):
                    times = stream_times(packed, pdl)
                    f["stream4" + suffix] = times[default]
                    fastest = min(times, key=times.get)
                    f["stream4" + suffix + "-best"] = times[fastest]
                    log(f"  N={n} K={k} {fmt} fastest streaming launch{' chained' if pdl else ''}: {fastest}")
                if fmt == "nvfp4":
                    f["stream16"] = stream_us([(w, None) for w in layer.bf16], False)
            except Exception as e:
                log(f"  stream ERR {type(e).__name__}: {str(e)[:200]}")
        for m in ms:
            if time.time() > deadline:
                break
            bf = measure(layer, m, "bf16", "forward")
            cands = [("default", None), ("pdl", {"PDL": True})]
            if m == 1:
                cands += [("gemv-pf", {"PATH": "gemv", "PF": True}), ("gemv-pdl", {"PATH": "gemv", "PDL": True}),
                          ("fused-pdl", {"PATH": "fused", "PDL": True})]
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for fmt in ("nvfp4", "mxfp4"):
                st = layer.states[fmt][0]
                chosen = [(a, c) for a, c in cands if fmt == "nvfp4" or a in ("default", "pdl")]
                parts = time_candidates(layer, x, st, fmt, chosen, bf, rows)
                for name, us in floor[fmt].items():
                    if m == 1:
                        parts.append(f"{name} {us:.1f} x{bf / us:.2f}")
                    rows.append(dict(n=n, k=k, m=m, fmt=fmt, cfg=name, us=us, bf16_us=bf, err=0.0,
                                     gbps=(weight_bytes("bf16" if name == "stream16" else fmt, n, k)) / us / 1e3))
                log(f"  N={n} K={k} M={m} {fmt} bf16 {bf:.1f}: " + " | ".join(parts))
                dump_rows(out_path, rows)
        del layer
        torch.cuda.empty_cache()
    # medians over the 16 shapes (duplicates counted as in the sweep)
    log("\n  median speedup over the 16 shapes (all: every M above pooled):")
    summary = pdl_medians(rows, ms)
    for (fmt, m, name), (med, cells) in summary.items():
        log(f"    {fmt} M={m} {name}: {med:.2f} ({cells} cells)")
    dump_rows(out_path, rows, medians={f"{fmt}/{m}/{name}": med for (fmt, m, name), (med, _) in summary.items()})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(QWEN25), help="comma list of " + ",".join(QWEN25))
    ap.add_argument("--ms", default=",".join(map(str, M_SWEEP)))
    ap.add_argument("--formats", default="nvfp4,mxfp4,nf4", help="the sweep's formats; --cands times its nvfp4 / mxfp4")
    ap.add_argument("--bwd-ms", default=",".join(map(str, BWD_MS)))
    ap.add_argument("--quick", action="store_true", help="7B only, M in 1,16,64,256,4096")
    ap.add_argument("--variants", action="store_true", help="also time alternative tile configs (if time is left)")
    ap.add_argument("--explore", action="store_true", help="only time candidate configs on a few shapes (tuning)")
    ap.add_argument("--gemv", action="store_true", help="only time the CUDA-core GEMV against v3 and bf16 at M=1, 8")
    ap.add_argument("--overlap", action="store_true", help="only time the large-M cuBLAS paths (dequant vs overlapped chunks)")
    ap.add_argument("--pdl", action="store_true", help="only time programmatic dependent launch and the streaming floor")
    ap.add_argument("--stream", action="store_true", help="only time the streaming floor by launch shape")
    ap.add_argument("--stream-shapes", default=None,
                    help="NxK,... or all (the sweep's unique shapes) for --stream (default: three shapes) and "
                         "--pdl (default: all)")
    ap.add_argument("--stream-format", default="nvfp4", choices=("nvfp4", "mxfp4"),
                    help="with --stream: whose packed bytes to stream")
    ap.add_argument("--pdl-ms", default=",".join(map(str, PDL_MS)), help="M values for --pdl")
    ap.add_argument("--stream-ms", default="",
                    help="with --stream: also time bf16 at these M and report the single-launch ceiling per M")
    ap.add_argument("--cands", default=None, help='only time these configs: JSON [["name", {config} or null], ...]')
    ap.add_argument("--cand-shapes", default="37888x3584,7168x5120,3584x3584", help="NxK,... for --cands")
    ap.add_argument("--cand-ms", default="1,16", help="M values for --cands")
    ap.add_argument("--cand-rounds", type=int, default=1,
                    help="time each shape's candidate list this many times, rotated by one each round (the median)")
    ap.add_argument("--x-spare-tile", type=int, default=0,
                    help="each activation x [M, K] is a view of a buffer of M rounded up to this many rows (the "
                         "spare rows NaN), for rwg's XROWS; 0: plain tensors")
    ap.add_argument("--nf4-fused-cands", default=None,
                    help='with nf4-fused in --formats, also time these configs of the fused NF4 kernel as formats '
                         '"nf4-fused:<name>": JSON [["name", {config}], ...] (keys of nf4_triton.FUSED_CONFIG)')
    ap.add_argument("--order", default=None, choices=("rows", "frag"),
                    help="nvfp4's word order in the prepared layers (qerl.kernels.prepare; default QERL_W4A16_ORDER or rows)")
    ap.add_argument("--time-budget-s", type=float, default=330.0, help="stop starting new work after this")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "w4a16.json"))
    args = ap.parse_args(argv)
    global ORDER, X_SPARE_TILE, CAND_ROUNDS
    ORDER, X_SPARE_TILE, CAND_ROUNDS = args.order, max(0, args.x_spare_tile), max(1, args.cand_rounds)
    t0 = time.time()
    deadline = t0 + args.time_budget_s
    models = [m for m in args.models.split(",") if m]
    ms = [int(v) for v in args.ms.split(",") if v]
    bwd_ms = [int(v) for v in args.bwd_ms.split(",") if v]
    formats = [f for f in args.formats.split(",") if f]
    if args.nf4_fused_cands:
        if "nf4-fused" not in formats:
            raise SystemExit("--nf4-fused-cands needs nf4-fused in --formats")
        NF4_FUSED_CANDS.update({name: dict(cfg) for name, cfg in json.loads(args.nf4_fused_cands)})
        formats += [f"nf4-fused:{name}" for name in NF4_FUSED_CANDS]
    if args.quick:
        models, ms, bwd_ms = ["7B"], [1, 16, 64, 256, 4096], [4096]

    import triton

    result = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
              "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": switches_prefix() + " ".join([os.path.basename(sys.executable)] + sys.argv),
              "copy_gbps": None, "rows": []}
    rows = result["rows"]

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if not torch.cuda.is_available():
        log("no CUDA GPU: nothing to benchmark")
        write()
        return 0
    torch.cuda.set_device(0)
    log(f"{result['gpu']} torch {result['torch']} triton {result['triton']}  SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    result["copy_gbps"] = copy_gbps = copy_bandwidth_gbps()
    log(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    META.update({k: v for k, v in result.items() if k != "rows"})

    modes = {"overlap": lambda: overlap_explore(deadline, args.out),
             "cands": lambda: gemv_explore(
                 deadline, args.out, ms=[int(v) for v in args.cand_ms.split(",") if v],
                 cands=[(name, cfg) for name, cfg in json.loads(args.cands)],
                 shapes=[tuple(int(v) for v in sh.split("x")) for sh in args.cand_shapes.split(",") if sh],
                 all_formats=("default",),
                 formats=tuple(f for f in args.formats.split(",") if f in ("nvfp4", "mxfp4")) or ("nvfp4", "mxfp4")),
             "stream": lambda: stream_explore(deadline, args.out, stream_shapes(args.stream_shapes),
                                              [int(v) for v in args.stream_ms.split(",") if v], args.stream_format),
             "pdl": lambda: pdl_explore(deadline, args.out, [int(v) for v in args.pdl_ms.split(",") if v],
                                        args.stream_shapes),
             "gemv": lambda: gemv_explore(deadline, args.out),
             "explore": lambda: explore(deadline, args.out)}
    for mode, run_mode in modes.items():  # the explore modes: one study each, then stop
        if getattr(args, mode):
            run_mode()
            log(f"{mode} explore done in {time.time() - t0:.0f} s")
            return 0

    shapes = [s for s in linear_shapes(models)]
    unique = {}
    for model, layer, n, k in shapes:
        unique.setdefault((n, k), []).append((model, layer))
    # Key M values first over all shapes, then the rest, so a cut-short run still covers the goals.
    passes = [[m for m in ms if m in KEY_MS], [m for m in ms if m not in KEY_MS]]
    stopped = False
    for pass_ms in passes:
        for (n, k), names in unique.items():
            if stopped or not pass_ms:
                break
            todo = [m for m in pass_ms] + [("bwd", m) for m in bwd_ms if pass_ms is passes[0]]
            try:
                layer = Layer(n, k, formats, seed=n + 7 * k)
            except Exception as e:
                log(f"N={n} K={k}: weight setup failed: {type(e).__name__}: {str(e)[:200]}")
                torch.cuda.empty_cache()
                continue
            for item in todo:
                if time.time() > deadline:
                    log(f"time budget of {args.time_budget_s:.0f} s reached; stopping")
                    stopped = True
                    break
                op, m = ("backward", item[1]) if isinstance(item, tuple) else ("forward", item)
                fmts = ["bf16"] + [f for f in formats if op == "forward" or not f.startswith("nf4")]
                if m >= DEQUANT_MIN_M:  # default dispatch = bf16 weight + cuBLAS; also time the fused kernel
                    fmts += [f + "-fused" for f in formats if f in ("nvfp4", "mxfp4")]
                res = {}
                for f in fmts:
                    try:
                        res[f] = measure(layer, m, f, op)
                    except Exception as e:
                        res[f] = -1.0
                        log(f"  ERROR {f} {op} N={n} K={k} M={m}: {type(e).__name__}: {str(e)[:300]}")
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                        torch.cuda.synchronize()
                bf = res["bf16"]
                flops = 2.0 * m * n * k
                line = [f"{'fwd' if op == 'forward' else 'bwd'} N={n:5d} K={k:5d} M={m:4d} bf16 {bf:8.1f}us {flops / bf / 1e6 if bf > 0 else 0:6.0f}TF/s"]
                for f in fmts:
                    us = res[f]
                    gbps = moved_bytes(f, n, k, m) / (us * 1e-6) / 1e9 if us > 0 else 0.0
                    sp = bf / us if us > 0 and bf > 0 else 0.0
                    if f != "bf16":
                        line.append(f"{f} {us:8.1f}us x{sp:4.2f} {gbps:5.0f}GB/s")
                    for model, lname in names:
                        rows.append({"model": model, "layer": lname, "n": n, "k": k, "m": m, "format": f, "op": op,
                                     "us": round(us, 3), "bf16_us": round(bf, 3), "speedup": round(sp, 4), "gbps": round(gbps, 1)})
                log(" | ".join(line) + f"  [{time.time() - t0:.0f}s]")
                write()
            del layer
            torch.cuda.empty_cache()

    if args.variants:
        try:
            variant_sweep(deadline + 45)
        except Exception as e:
            log(f"variant sweep failed: {type(e).__name__}: {str(e)[:300]}")
    write()
    log(summarize(rows, copy_gbps))
    log(f"\nwrote {len(rows)} rows to {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
