"""Does a 4-bit GEMV run faster when part of its weights was prefetched into L2 by an earlier,
latency-bound kernel? Standalone on the GPU, bench_w4a16's method (weight copies rotated past L2,
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
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w4a16 import Layer, activations, time_per_call  # noqa: E402
from probe_gemv_schedule import _mode  # noqa: E402


def main(argv=None) -> int:
    from qerl.kernels import decode_ops
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
        decode_ops.l2_prefetch_wait([], sms, wait_ns, like)

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
                        decode_ops.l2_prefetch_wait(spans, sms, wait_ns, like)
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
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "wait_kernel_us": base_wait,
                       "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
