"""Run one decode-size fused product a few times, for Nsight Compute to read its counters.

    ncu --clock-control none --kernel-name regex:w4a16 --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats python benchmarks/profile_decode.py --fmt nvfp4 --n 37888 --k 3584 --m 1

Answers whether the decode path is limited by DRAM bandwidth or by issued instructions.
"""

from __future__ import annotations

import argparse
import json

import torch

from qerl.formats import quantize_weight
from qerl.kernels import linear, prepare


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--n", type=int, default=37888)
    ap.add_argument("--k", type=int, default=3584)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--path", default=None, help="force a forward path (gemv, fused, ws) instead of the dispatch")
    ap.add_argument("--config", default=None,
                    help='JSON config for w4a16_triton.forward (e.g. \'{"PATH": "wgmma", "BM": 128}\'), with or instead of --path')
    a = ap.parse_args()
    w = (torch.randn(a.n, a.k, device="cuda") * 0.02).to(torch.bfloat16)
    state = prepare(a.fmt, quantize_weight(w, a.fmt))
    x = torch.randn(a.m, a.k, device="cuda", dtype=torch.bfloat16)
    from qerl.kernels import w4a16_triton as W

    config = json.loads(a.config) if a.config else None
    if a.path is not None:
        config = {**(config or {}), "PATH": a.path}
    for _ in range(a.reps):
        y = linear(x, state, a.fmt) if config is None else W.forward(x, state, config=config)
    torch.cuda.synchronize()
    print("ok", tuple(y.shape))


if __name__ == "__main__":
    main()
