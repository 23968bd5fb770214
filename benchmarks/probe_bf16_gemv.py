"""The one-row bf16 decode GEMV (qerl/kernels/bf16_gemv.py) against cuBLAS (torch.matmul) on the
GPU, bench_w4a16's method (weight copies rotated past L2, CUDA-graph replays of back-to-back
calls, median): per shape, cuBLAS, the kernel launched plainly, and the kernel chained with PDL
(each call's weight load overlaps the previous call's tail, as inside the decode step), and
whether bf16_gemv.usable routes the shape to the kernel. Each shape is first checked against an
fp32 reference.

    python benchmarks/probe_bf16_gemv.py [--shapes 4608x3584,3584x3584,37888x3584,3584x18944] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w4a16 import activations, copies, time_per_call, weight_bytes, write_probe  # noqa: E402


def main(argv=None) -> int:
    from qerl.kernels import bf16_gemv

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4608x3584,3584x3584,37888x3584,3584x18944,152064x3584,7168x5120,27648x5120,5120x13824,152064x5120")
    ap.add_argument("--tiles", default="8x1024,16x512,8x512,4x2048,4x512", help="(rows per program)x(K per step) candidates")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(n * 31 + k)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        ws = [w] + [w.clone() for _ in range(copies(weight_bytes("bf16", n, k)) - 1)]
        m = 1  # the kernel takes one row
        xs = activations(m, k, len(ws))
        ref = (xs[0].float() @ w.float().T)
        got = bf16_gemv.linear(xs[0], w, pdl=False).float()
        err = ((got - ref).norm() / ref.norm()).item()
        calls = max(len(ws), len(xs), 3)
        cublas = time_per_call(lambda i: torch.matmul(xs[i % len(xs)], ws[i % len(ws)].T), calls)
        plain = time_per_call(lambda i: bf16_gemv.linear(xs[i % len(xs)], ws[i % len(ws)], pdl=False), calls)
        pdl = time_per_call(lambda i: bf16_gemv.linear(xs[i % len(xs)], ws[i % len(ws)], pdl=True), calls)
        tiles = {}
        for spec in filter(None, a.tiles.split(",")):
            t = tuple(int(v) for v in spec.split("x"))
            tiles[spec] = round(time_per_call(lambda i, t=t: bf16_gemv.linear(xs[i % len(xs)], ws[i % len(ws)], pdl=True,
                                                                             tile=t), calls), 2)
        row = {"n": n, "k": k, "m": m, "routed": bf16_gemv.usable(xs[0], w), "rel_err": err, "cublas_us": round(cublas, 2), "kernel_us": round(plain, 2),
               "kernel_pdl_us": round(pdl, 2), "x_cublas": round(cublas / plain, 3),
               "x_cublas_pdl": round(cublas / pdl, 3), "kernel_pdl_gbps": round(2 * n * k / pdl / 1e3, 1),
               "tiles_pdl_us": tiles}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ws, w
        torch.cuda.empty_cache()
    write_probe(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
