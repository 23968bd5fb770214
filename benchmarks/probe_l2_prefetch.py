"""Does a 4-bit GEMV run faster when part of its weights was prefetched into L2 by an earlier,
latency-bound kernel? (Measured in session 18, NOTES_rollout.md section 15: no - at most 3% on an
H200, where the GEMV streams at 2.7 of 4.8 TB/s; the engine-side version, commit 15a2433, cost
26-38% of the decode step and was taken out.) Standalone on the GPU, bench_w4a16's method (weight copies rotated past L2,
CUDA-graph replays, median).

Each iteration of the captured chain is [wait kernel, T us, one program per SM] then [GEMV on weight
copy i]. With a prefetch fraction f > 0 the wait kernel first issues `cp.async.bulk.prefetch.L2` for
the first f of copy i's packed words and scales (the tiles the first programs of the GEMV read), so
the prefetch runs on otherwise idle DRAM while the wait kernel waits, as it would during a decode
step's attention and small kernels. Reported: time per iteration minus the wait kernel alone
(gemv_us), against f = 0 in the same process.

    python benchmarks/probe_l2_prefetch.py [--shapes 37888x3584,3584x18944] [--ms 1,8]
        [--fracs 0,0.25,0.5,0.75,1] [--wait-us 20] [--modes 'sk;tail'] [--out probe.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w4a16 import Layer, activations, time_per_call, write_probe  # noqa: E402
from probe_gemv_schedule import _mode  # noqa: E402


CHUNK = 32768  # bytes per cp.async.bulk.prefetch.L2 instruction


@functools.lru_cache(maxsize=None)
def _kernel():
    """A kernel of one-warp programs that issue L2 prefetches (sm_90's cp.async.bulk.prefetch.L2,
    fire and forget) of up to two spans, chunk c by program c // 32 % programs, one chunk per
    lane, and then wait until wait_ns have passed since they started (a stand-in for a
    latency-bound kernel of the decode step)."""
    import triton
    import triton.language as tl

    @triton.jit
    def globaltimer(dep):
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def prefetch_span(base_ptr, nbytes, pid, nprog, CHUNK: tl.constexpr, LANES: tl.constexpr):
        chunks = (nbytes + CHUNK - 1) // CHUNK
        lane = tl.arange(0, LANES)
        for c0 in range(pid * LANES, chunks, nprog * LANES):
            c = c0 + lane
            off = c.to(tl.int64) * CHUNK
            size = tl.where(c < chunks, tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [base_ptr + off, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_wait_kernel(p0, n0, p1, n1, wait_ns, CHUNK: tl.constexpr, LANES: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        t0 = globaltimer(pid)
        if n0 > 0:
            prefetch_span(p0, n0, pid, nprog, CHUNK, LANES)
        if n1 > 0:
            prefetch_span(p1, n1, pid, nprog, CHUNK, LANES)
        while globaltimer(pid) - t0 < wait_ns:
            pass

    return prefetch_wait_kernel


def prefetch_wait(spans, programs: int, wait_ns: int, like: torch.Tensor) -> None:
    """Launch the kernel above for up to two (tensor, nbytes) spans from each tensor's start
    (nbytes rounded down to 16, the instruction's unit)."""
    args = []
    for t, nbytes in list(spans)[:2] + [(None, 0)] * (2 - len(list(spans)[:2])):
        if t is None:
            args += [like, 0]
        else:
            args += [t.reshape(-1).view(torch.uint8), min(int(nbytes), t.numel() * t.element_size()) // 16 * 16]
    _kernel()[(programs,)](*args, int(wait_ns), CHUNK=CHUNK, LANES=32, num_warps=1)


def main(argv=None) -> int:
    from qerl.kernels import w4a16_triton as W

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="37888x3584,3584x18944")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--fracs", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--wait-us", type=float, default=20.0)
    ap.add_argument("--modes", default="sk;tail", help='split, sk, tail or NAME:{"KEY": value}, separated by ";"')
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wait_ns = int(a.wait_us * 1000)
    rows = []

    like = torch.zeros(16, dtype=torch.uint8, device="cuda")

    def wait_only(i):
        prefetch_wait([], sms, wait_ns, like)

    base_wait = time_per_call(wait_only, 8)
    print(json.dumps({"wait_kernel_us": round(base_wait, 2)}), flush=True)
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        layer = Layer(n, k, ("nvfp4",), seed=1)
        sts = layer.states["nvfp4"]
        for m in (int(v) for v in a.ms.split(",")):
            xs = activations(m, k, len(sts))
            for name, cfg in (_mode(s) for s in a.modes.split(";")):
                ref = None
                for frac in (float(v) for v in a.fracs.split(",")):
                    def fn(i, frac=frac, cfg=cfg):
                        st = sts[i % len(sts)]
                        spans = [] if frac <= 0 else [(t, int(t.numel() * t.element_size() * frac) // 16 * 16)
                                                      for t in (st["words"], st["scale"])]
                        prefetch_wait(spans, sms, wait_ns, like)
                        return W.forward(xs[i % len(xs)], st, config=cfg)

                    try:
                        us = time_per_call(fn, max(len(sts), 3)) - base_wait
                    except ValueError as exc:  # e.g. a forced split tail where the shape has none
                        print(json.dumps({"n": n, "k": k, "m": m, "mode": name, "skipped": str(exc)}), flush=True)
                        break
                    ref = us if ref is None else ref
                    nbytes = sum(t.numel() * t.element_size() for t in (sts[0]["words"], sts[0]["scale"]))
                    row = {"n": n, "k": k, "m": m, "mode": name, "config": cfg, "prefetch_frac": frac,
                           "prefetch_mb": round(nbytes * frac / 1e6, 1), "wait_us": a.wait_us,
                           "gemv_us": round(us, 2), "vs_no_prefetch": round(ref / us, 3),
                           "gbps": round(nbytes / us / 1e3, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        del layer, sts
        torch.cuda.empty_cache()
    write_probe(a.out, rows, wait_kernel_us=base_wait)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
