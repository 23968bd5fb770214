"""Where a chained 4-bit GEMV's time goes: per-program clocks of back-to-back calls of one layer launched with
PDL, as the decode step launches them (NOTES_w4a16.md section 43 left this open: with its whole weight slice in
shared memory before the PDL wait a small layer's launch still took 10 us, so the chain's cost is after the wait).

For each shape and M: bench_w4a16's time per call (CUDA-graph replays over rotating weight copies, chain routing
and PDL on), then one replay of a graph of --calls such calls with w4a16_triton.STAMP on, summarised over the
calls by ablate_rollout.stamp_summary (when the programs started and got past the PDL wait, measured from each
call's first program start; main loop and epilogue medians; how long the call ran on after its last program got
past the wait; when the Gluon producer had issued its last weight copy). Run on a Hopper GPU:

    python benchmarks/probe_chain_clocks.py [--shapes 3584x3584,7168x5120] [--ms 1,4] [--calls 24]
            [--modes 'rule;g2:{"PATH": "wsmma", "PER_SM": 2}'] [--sm-mhz 1980] [--no-pdl] [--out probe.json]

--no-pdl: single launches routed as the standalone sweep routes them (the same clocks without the chain).

Modes (";"-separated): "rule" (the chain's routing, no config) or NAME:{json config}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w4a16 import Layer, activations, probe_rows, write_probe  # noqa: E402

STAMP_WORDS = 8  # int64 words a stamped program writes (w4a16_triton.STAMP)
MAX_GRID = 4096  # programs per call the stamp buffer is sized for (the layers here launch <= 528)


def parse_modes(text: str) -> list[tuple[str, dict | None]]:
    """'rule;g2:{"PER_SM": 2}' -> [("rule", None), ("g2", {"PER_SM": 2})]; ValueError on a bad item."""
    out = []
    for item in filter(str.strip, text.split(";")):
        name, colon, cfg = item.strip().partition(":")
        if not colon:
            if name != "rule":
                raise ValueError(f"mode {item.strip()!r}: 'rule' or NAME:{{json config}}")
            out.append((name, None))
            continue
        config = json.loads(cfg)
        if not isinstance(config, dict):
            raise ValueError(f"mode {name!r}: the config must be a JSON object")
        out.append((name, config))
    return out


def chain_clocks(layer: Layer, m: int, config: dict | None, calls: int, sm_mhz: float) -> dict:
    """One replay of `calls` chained calls with per-program clocks -> stamp_summary's medians over the calls."""
    from ablate_rollout import stamp_summary

    from qerl.kernels import w4a16_triton as W

    states = layer.states["nvfp4"]
    xs = activations(m, layer.k, len(states))

    def call(i):
        W.forward(xs[i % len(xs)], states[i % len(states)], config=config)

    for i in range(len(states)):  # compile and measure residency outside the capture
        call(i)
    torch.cuda.synchronize()
    W.STAMP = {"buf": torch.full((calls * STAMP_WORDS * MAX_GRID,), -1, dtype=torch.int64, device="cuda"), "used": 0, "calls": []}
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                call(i)
        summary = stamp_summary(graph, sm_mhz)
    finally:
        W.STAMP = None
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="3584x3584,4608x3584,7168x5120")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--modes", default="rule")
    ap.add_argument("--sm-mhz", type=float, default=1980.0, help="SM clock for the clock64 stamps")
    ap.add_argument("--no-pdl", dest="pdl", action="store_false", help="single launches, the standalone routing")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    modes = parse_modes(a.modes)
    from qerl.kernels import w4a16_triton

    w4a16_triton.PDL = a.pdl  # routing and launches of the decode chain (QERL_W4A16_PDL=1), or single launches
    rows = probe_rows(a.shapes, a.ms, modes,
                      lambda layer, m, cfg: {"clocks": chain_clocks(layer, m, cfg, a.calls, a.sm_mhz)})
    write_probe(a.out, rows, sm_mhz=a.sm_mhz, pdl=a.pdl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
