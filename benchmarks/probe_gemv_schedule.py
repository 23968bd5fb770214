"""Split schedule vs split tail vs stream-K in the Gluon GEMV (w4a16_gluon), standalone on the GPU: per-call time
(bench_w4a16's method: weight copies rotated past L2, CUDA-graph replays, median) and one stamped
launch per case with per-program clocks (w4a16_triton.STAMP), summarised as: programs, SMs used,
most programs resident on one SM at once, when the last program started, median / max main-loop
and epilogue time, and the spread of program end times.

    python benchmarks/probe_gemv_schedule.py [--shapes 55296x5120,37888x3584] [--ms 1,8]
            [--modes 'split;sk;sk3:{"STREAMK": true, "PER_SM": 3}'] [--sm-mhz 1980] [--out probe.json]

Modes (separated by ";"): "split" (plain split schedule), "tail" (split tail forced), "sk" (stream-K) or "NAME:{json config}" for any other
Gluon config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w4a16 import Layer, probe_rows, write_probe  # noqa: E402


def _mode(spec: str) -> tuple[str, dict]:
    if spec == "split":
        return spec, {"PATH": "wsmma", "STREAMK": False, "TAIL_SPLIT": False}
    if spec == "sk":
        return spec, {"PATH": "wsmma", "STREAMK": True}
    if spec == "tail":
        return spec, {"PATH": "wsmma", "TAIL_SPLIT": True}
    name, _, cfg = spec.partition(":")
    return name, {"PATH": "wsmma", **json.loads(cfg)}


def stamped(layer: Layer, m: int, config: dict, sm_mhz: float) -> dict:
    """One launch with per-program clocks -> the schedule's summary (us)."""
    import numpy as np

    from qerl.kernels import w4a16_triton as W

    st = layer.states["nvfp4"][0]
    x = torch.randn(m, layer.k, device="cuda").to(torch.bfloat16)
    W.forward(x, st, config=config)
    W.STAMP = {"buf": torch.full((1 << 20,), -1, dtype=torch.int64, device="cuda"), "used": 0, "calls": []}
    try:
        W.forward(x, st, config=config)
        torch.cuda.synchronize()
        off, grid, *_ = W.STAMP["calls"][-1]
        a = W.STAMP["buf"][off:off + grid * 8].view(grid, 8).cpu().numpy().astype(np.float64)
    finally:
        W.STAMP = None
    cyc = 1.0 / sm_mhz
    start = (a[:, 5] - a[:, 5].min()) / 1e3
    end = (a[:, 6] - a[:, 5].min()) / 1e3
    sm = a[:, 4].astype(np.int64)
    most = 0
    for s in np.unique(sm):  # most programs of one SM alive at the same time
        ev = sorted([(t, 1) for t in start[sm == s]] + [(t, -1) for t in end[sm == s]], key=lambda e: (e[0], e[1]))
        live = 0
        for _t, d in ev:
            live += d
            most = max(most, live)
    loop = (a[:, 2] - a[:, 1]) * cyc
    epi = (a[:, 3] - a[:, 2]) * cyc
    return {"programs": int(grid), "sms": int(len(np.unique(sm))), "resident_per_sm_max": int(most),
            "start_last_us": round(float(start.max()), 2), "end_first_us": round(float(end.min()), 2),
            "end_last_us": round(float(end.max()), 2), "loop_median_us": round(float(np.median(loop)), 2),
            "loop_max_us": round(float(loop.max()), 2), "epilogue_median_us": round(float(np.median(epi)), 2),
            "epilogue_max_us": round(float(epi.max()), 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="55296x5120,37888x3584,7168x5120")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--modes", default="split;sk", help='split, sk, or NAME:{"KEY": value}, separated by ";"')
    ap.add_argument("--sm-mhz", type=float, default=1980.0, help="SM clock for the clock64 stamps")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sm_mhz = a.sm_mhz
    modes = [_mode(s) for s in a.modes.split(";")]
    rows = probe_rows(a.shapes, a.ms, modes, lambda layer, m, cfg: stamped(layer, m, cfg, sm_mhz))
    write_probe(a.out, rows, sm_mhz=sm_mhz)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
