"""Stress w4a16_rwg's KP form (two MMA warpgroups on alternate K steps, NOTES_w4a16.md section 31): many
launches per layer / M / format, synchronised every --sync launches, each output checked against the R = 1
form of the same kernel (relative error) and against the first KP output (bit-identical). --graph N: the
launches go through a CUDA graph of N back-to-back calls (as bench_w4a16.py times them), replayed --reps // N
times. Prints the first CUDA error or mismatch and exits 1.

    python benchmarks/probe_rwg_kp.py [--reps 400] [--sync 50] [--graph 0] [--shapes 3584x18944,7168x5120]
        [--ms 17,32,64] [--formats nvfp4,mxfp4] [--config '{"R": 1, "KP": 2, "XREL": 1, "NSX": 4}']
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from qerl.formats import quantize_weight  # noqa: E402
from qerl.kernels import prepare  # noqa: E402
from qerl.kernels import w4a16_triton as W  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--sync", type=int, default=50)
    ap.add_argument("--graph", type=int, default=0)
    ap.add_argument("--shapes", default="3584x18944,7168x5120,2048x11008")
    ap.add_argument("--ms", default="17,32,64")
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    ap.add_argument("--config", default='{"R": 1, "KP": 2, "XREL": 1, "NSX": 4}')
    a = ap.parse_args()
    conf = dict(json.loads(a.config), PATH="rwg")
    t0 = time.time()
    for fmt in a.formats.split(","):
        for shape in a.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            st = prepare(fmt, quantize_weight(w, fmt))
            for m in (int(v) for v in a.ms.split(",")):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ref = W.forward(x, st, config={"PATH": "rwg", "R": 1}).float()
                first = W.forward(x, st, config=conf)
                err = ((first.float() - ref).norm() / ref.norm()).item()
                bad, rep = 0, 0
                try:
                    if a.graph:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            ys = [W.forward(x, st, config=conf) for _ in range(a.graph)]
                        for rep in range(max(1, a.reps // a.graph)):
                            graph.replay()
                            torch.cuda.synchronize()
                            bad += sum(int(not torch.equal(y, first)) for y in ys)
                    else:
                        for rep in range(a.reps):
                            y = W.forward(x, st, config=conf)
                            if (rep + 1) % a.sync == 0:
                                torch.cuda.synchronize()
                                bad += int(not torch.equal(y, first))
                        torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (a CUDA error: report where and stop)
                    print(f"FAIL {fmt} {n}x{k} M={m} after <= {rep + 1} launches: {type(e).__name__}: {e}", flush=True)
                    return 1
                print(f"{fmt} {n}x{k} M={m}: {a.reps} launches ok, rel err vs R = 1 {err:.2e}, "
                      f"non-identical checks {bad}  [{time.time() - t0:.0f}s]", flush=True)
                if err > 1e-2 or bad:
                    return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
