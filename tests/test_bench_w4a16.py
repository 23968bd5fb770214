"""benchmarks/bench_w4a16.py's summary on the CPU (the timings themselves need a GPU): with the fused NF4
kernel's rows (`nf4-fused`) present, the table gets its column and nvfp4 / mxfp4 against it beside the
dequantise-then-cuBLAS baseline's, and the goal line names both; without them, neither appears."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_w4a16", os.path.join(ROOT, "benchmarks", "bench_w4a16.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(with_fused: bool) -> list[dict]:
    us = {"nvfp4": 10.0, "mxfp4": 12.5, "nf4": 40.0, "nf4-fused": 20.0}
    rows = []
    for m in (1, 16):
        for f, t in us.items():
            if f == "nf4-fused" and not with_fused:
                continue
            rows.append({"model": "7B", "layer": "o", "n": 3584, "k": 3584, "m": m, "format": f, "op": "forward",
                         "us": t, "bf16_us": 30.0, "speedup": 30.0 / t, "gbps": 1000.0})
    return rows


def test_summary_compares_nvfp4_with_both_nf4_kernels():
    bench = _bench()
    text = bench.summarize(_rows(True), copy_gbps=3000.0)
    header = next(line for line in text.splitlines() if line.startswith("| M |"))
    assert header == ("| M | nvfp4 | mxfp4 | nf4 | nf4-fused | nvfp4 vs nf4 | mxfp4 vs nf4 | nvfp4 vs nf4-fused | "
                      "mxfp4 vs nf4-fused | nvfp4 GB/s (med) | shapes |")
    row1 = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert row1 == "| 1 | 3.00 | 2.40 | 0.75 | 1.50 | 4.00 | 3.20 | 2.00 | 1.60 | 1000 | 1 |"
    assert "nvfp4: M<=16 3.00" in text and "vs nf4 M<=16 4.00 | vs nf4-fused M<=16 2.00" in text
    plain = bench.summarize(_rows(False), copy_gbps=3000.0)
    assert "nf4-fused" not in plain and "| 1 | 3.00 | 2.40 | 0.75 | 4.00 | 3.20 | 1000 | 1 |" in plain


def test_candidate_configs_of_the_fused_nf4_kernel_get_their_own_columns():
    """--nf4-fused-cands rows ("nf4-fused:<name>") are summarised as columns after the fixed formats, and their
    weight bytes are nf4's (the GB/s column)."""
    bench = _bench()
    rows = _rows(True)
    for m in (1, 16):
        rows.append({"model": "7B", "layer": "o", "n": 3584, "k": 3584, "m": m, "format": "nf4-fused:split4",
                     "op": "forward", "us": 15.0, "bf16_us": 30.0, "speedup": 2.0, "gbps": 1.0})
    text = bench.summarize(rows, copy_gbps=3000.0)
    header = next(line for line in text.splitlines() if line.startswith("| M |"))
    assert header.startswith("| M | nvfp4 | mxfp4 | nf4 | nf4-fused | nf4-fused:split4 | nvfp4 vs nf4 |")
    assert next(line for line in text.splitlines() if line.startswith("| 16 |")).startswith("| 16 | 3.00 | 2.40 | 0.75 | 1.50 | 2.00 |")
    assert bench.weight_bytes("nf4-fused:split4", 64, 128) == bench.weight_bytes("nf4", 64, 128) == 64 * 128 // 2 + 64 * 128 // 64 * 4


def test_candidate_medians_count_shared_shapes_as_the_sweep_does():
    """`--cands`'s closing summary: a shape that is several model layers (14B / 32B q/k/v: 7168 x 5120) counts
    once per layer in the median, as the sweep's 16 cells do; candidates are kept apart per M and format, and
    one whose output missed the reference is marked."""
    bench = _bench()

    def row(n, k, cfg, us, err=1e-3):
        return {"n": n, "k": k, "m": 256, "fmt": "nvfp4", "cfg": cfg, "us": us, "bf16_us": 10.0, "err": err}

    rows = [row(7168, 5120, "sk", 5.0), row(3584, 3584, "sk", 20.0), row(2048, 2048, "sk", 20.0),
            row(7168, 5120, "default", 10.0, err=0.5)]
    lines = bench.candidate_medians(rows)
    # [2, 2, 0.5, 0.5] with 7168x5120 counted twice (once per model): 1.25; once, [2, 0.5, 0.5] would give 0.5
    assert "M=256 nvfp4 sk: median x1.250 over 4 cells" in lines
    assert "M=256 nvfp4 default: median x1.000 over 2 cells (1 BAD)" in lines


def test_chain_clock_probe_reads_its_modes_and_refuses_bad_ones():
    """benchmarks/probe_chain_clocks.py: "rule" is the routing with no config, NAME:{json} a Gluon config; a bare
    name other than rule, or a config that is not a JSON object, stops with a one-line error before any GPU work."""
    import json

    import pytest

    spec = importlib.util.spec_from_file_location("probe_chain_clocks",
                                                  os.path.join(ROOT, "benchmarks", "probe_chain_clocks.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.parse_modes('rule; g2:{"PATH": "wsmma", "PER_SM": 2};') == [
        ("rule", None), ("g2", {"PATH": "wsmma", "PER_SM": 2})]
    with pytest.raises(ValueError, match="'rule' or NAME"):
        probe.parse_modes("rule;split")
    with pytest.raises(ValueError, match="JSON object"):
        probe.parse_modes("g:[1, 2]")
    with pytest.raises(json.JSONDecodeError):
        probe.parse_modes("g:{PER_SM: 2}")


def test_stream_ceiling_takes_each_layers_fastest_launch_and_counts_shapes_as_the_sweep():
    """`--stream --stream-ms`: per cell, bf16 us over the fastest streaming config of that layer (not the first
    or the mean); a shape the sweep holds twice (5120 x 5120: 14B o and 32B o) counts twice."""
    bench = _bench()
    shapes = bench.stream_shapes("all")
    assert len(shapes) == 14 and shapes[0] == (2048, 2048) and shapes[-1] == (55296, 5120)
    assert bench.stream_shapes("3584x3584,7168x5120") == [(3584, 3584), (7168, 5120)]
    assert bench.stream_shapes(None) == list(bench.STREAM_SHAPES)
    rows = []
    for (n, k), fast in (((5120, 5120), 5.0), ((3584, 3584), 4.0)):
        rows += [dict(n=n, k=k, cfg="a", us4=fast * 2, us16=1.0, bf16_us=20.0),
                 dict(n=n, k=k, cfg="b", us4=fast, us16=1.0, bf16_us=20.0)]
        rows += [dict(n=n, k=k, m=m, cfg="bf16", bf16_us=20.0 + m) for m in (1, 16)]
    out = bench.stream_ceiling(rows, (1, 16))
    # M = 1: 5120^2 21 / 5 = 4.2 twice, 3584^2 21 / 4 = 5.25 once -> median 4.2 over 3 cells
    assert out[1] == (4.2, 3)
    assert out[16] == (36 / 5, 3)
    assert out["all"][1] == 6
    try:
        bench.stream_shapes("3584by3584")
    except SystemExit as e:
        assert "--stream-shapes" in str(e)
    else:
        raise AssertionError("a bad --stream-shapes value must stop the run")


def test_pdl_medians_count_shapes_as_the_sweep_and_pool_the_ms():
    """`--pdl`'s summary: per format, M and candidate the median of bf16 us / us with 5120 x 5120 counted twice
    (14B o and 32B o), and an "all" entry pooling the M values given (the goal's M <= 16 median)."""
    bench = _bench()
    rows = []
    for (n, k), us in (((5120, 5120), 5.0), ((3584, 3584), 4.0)):
        for m in (1, 16):
            rows.append(dict(n=n, k=k, m=m, fmt="nvfp4", cfg="stream4-pdl-best", us=us, bf16_us=20.0 + m))
            rows.append(dict(n=n, k=k, m=m, fmt="mxfp4", cfg="default", us=2 * us, bf16_us=20.0 + m))
    out = bench.pdl_medians(rows, (1, 16))
    assert out[("nvfp4", 1, "stream4-pdl-best")] == (21 / 5, 3)
    assert out[("nvfp4", 16, "stream4-pdl-best")] == (36 / 5, 3)
    assert out[("nvfp4", "all", "stream4-pdl-best")][1] == 6
    assert out[("mxfp4", 1, "default")] == (21 / 10, 3)
    assert ("nvfp4", 1, "default") not in out and ("mxfp4", 1, "stream4-pdl-best") not in out
    assert ("nvfp4", "all", "default") not in out
    assert all(m != "all" for (_, m, _) in bench.pdl_medians(rows, (1,)))


def test_distinct_copies_clones_up_to_n_and_keeps_what_is_there():
    """`--pdl`'s streaming floors rotate over at least three distinct weight copies (two let chained calls one and
    three share L2)."""
    import torch

    bench = _bench()
    a, b = torch.arange(4), torch.arange(2)
    out = bench.distinct_copies([(a, b)], 3)
    assert len(out) == 3 and out[0][0] is a
    assert all(torch.equal(o[0], a) and torch.equal(o[1], b) for o in out)
    assert len({o[0].data_ptr() for o in out}) == 3
    four = [(a, None)] * 4
    assert bench.distinct_copies(four, 3) == four


def test_the_first_stream_config_is_stream_us_default_shape():
    """`--pdl` reads `stream4` / `stream4-pdl` (the default launch shape, as sessions 6-70 timed it) out of the
    STREAM_CFGS sweep, so its first entry must stay stream_us's own default."""
    import inspect

    bench = _bench()
    defaults = {p.name: p.default for p in inspect.signature(bench.stream_us).parameters.values()
                if p.default is not inspect.Parameter.empty}
    assert bench.STREAM_CFGS[0] == defaults
    assert bench.stream_cfg_name(bench.STREAM_CFGS[0]) == "per_sm4/block2048/unroll1/num_warps4/num_stages3"


def test_candidates_timed_in_rotated_rounds(monkeypatch):
    """--cand-rounds: every round times the whole candidate list, each round starting one candidate later (no
    candidate always first after bf16); a row keeps the median and the rounds' samples; the reference check runs
    once per candidate; one round is the old single pass."""
    import types

    import torch

    from qerl.formats import quantize_weight
    from qerl.kernels import prepare

    bench = _bench()
    assert bench.round_orders(3, 1) == [[0, 1, 2]]
    assert bench.round_orders(3, 4) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    st = prepare("nvfp4", quantize_weight(torch.randn(64, 256) * 0.05, "nvfp4"))
    layer = types.SimpleNamespace(n=64, k=256)
    x = torch.randn(4, 256).to(torch.bfloat16)
    cands = [("a", {"PATH": "fused"}), ("b", {"PATH": "fused"}), ("c", {"PATH": "fused"})]
    calls = []
    slow_first = iter([9.0, 1.0, 2.0, 9.0, 3.0, 4.0, 9.0, 5.0, 6.0])  # the first of each round is slow

    def fake_measure(layer, m, fmt, op, config=None):
        calls.append(next(i for i, (_, c) in enumerate(cands) if c is config))
        return next(slow_first)

    from qerl.kernels import reference, state_tensors
    from qerl.kernels import w4a16_triton as W

    w = reference.dequant("nvfp4", state_tensors(st), torch.float32)
    checked = []
    monkeypatch.setattr(W, "forward", lambda x, st, config=None: checked.append(config) or (x.float() @ w.T))
    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(bench, "CAND_ROUNDS", 3)
    rows = []
    parts = bench.time_candidates(layer, x, st, "nvfp4", cands, 10.0, rows)
    assert calls == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    by = {r["cfg"]: r for r in rows}
    assert by["a"]["us_rounds"] == [9.0, 4.0, 5.0] and by["a"]["us"] == 5.0
    assert by["b"]["us_rounds"] == [1.0, 9.0, 6.0] and by["c"]["us_rounds"] == [2.0, 3.0, 9.0]
    assert all(r["err"] < 1e-2 for r in rows) and len(parts) == 3 and len(checked) == 3
    monkeypatch.setattr(bench, "CAND_ROUNDS", 1)
    calls.clear()
    slow_first = iter([1.0, 2.0, 3.0])
    rows = []
    bench.time_candidates(layer, x, st, "nvfp4", cands, 10.0, rows)
    assert calls == [0, 1, 2] and [r["us"] for r in rows] == [1.0, 2.0, 3.0] and "us_rounds" not in rows[0]
