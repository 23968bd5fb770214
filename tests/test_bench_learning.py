"""benchmarks/bench_learning.py (GPU learning runs of the embedded recipe) and the demo's device
flags: variant and seed parsing, statistics, combining sweeps, and one real CPU sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_learning as bl  # noqa: E402


def test_parse_variant():
    assert bl.parse_variant("nvfp4+aqn@autocast") == {
        "variant": "nvfp4+aqn@autocast", "format": "nvfp4", "aqn": True, "bf16_autocast": True}
    assert bl.parse_variant(" bf16 ")["bf16_autocast"] is False
    for bad in ("fp8", "nvfp4+noise", "nvfp4@fp16", "", "+aqn"):
        with pytest.raises(ValueError):
            bl.parse_variant(bad)


def test_parse_seeds():
    assert bl.parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "1,1", "a,b", ","):
        with pytest.raises(ValueError):
            bl.parse_seeds(bad)


def _row(variant, seed, after, status="ok"):
    v = bl.parse_variant(variant)
    if status != "ok":
        return {**v, "seed": seed, "status": status}
    return {**v, "seed": seed, "status": "ok", "heldout_before": 0.25, "heldout_after": after,
            "reward_first_fifth": 0.1, "reward_last_fifth": after, "entropy_last_fifth": 0.5,
            "train_s_per_step": 1.0, "rewards": [0.1, after], "entropies": [1.0, 0.5]}


def test_variant_stats_mean_std_and_failures():
    rows = [_row("nvfp4", 0, 0.5), _row("nvfp4", 1, 0.7), _row("nvfp4", 2, 0.0, status="failed")]
    (st,) = bl.variant_stats(rows, [bl.parse_variant("nvfp4")])
    assert st["runs"] == 2 and st["failed"] == 1
    assert st["heldout_after"] == pytest.approx(0.6)
    assert st["heldout_after_std"] == pytest.approx(0.1414213, rel=1e-5)  # sample std


def _sweep(path, rows, device="GPU X", date="d1", command="c1"):
    res = {"device": device, "torch": "t", "triton": None, "steps": 2, "date": date, "command": command, "rows": rows}
    path.write_text(json.dumps(res))
    return str(path)


def test_combine_keeps_the_later_measurement_and_refuses_other_devices(tmp_path):
    a = _sweep(tmp_path / "a.json", [_row("nvfp4", 0, 0.5), _row("bf16", 0, 0.9)])
    b = _sweep(tmp_path / "b.json", [_row("nvfp4", 0, 0.8), _row("nvfp4", 1, 0.6)], date="d2", command="c2")
    res = bl.combine([a, b])
    assert [(r["variant"], r["seed"]) for r in res["rows"]] == [("nvfp4", 0), ("nvfp4", 1), ("bf16", 0)]
    assert res["rows"][0]["heldout_after"] == 0.8 and res["rows"][0]["command"] == "c2"
    assert res["rows"][2]["command"] == "c1"
    assert res["variants"][0]["heldout_after"] == pytest.approx(0.7)
    c = _sweep(tmp_path / "c.json", [_row("nvfp4", 3, 0.5)], device="other")
    with pytest.raises(ValueError, match="device"):
        bl.combine([a, c])


def test_report_writes_table_and_plot(tmp_path):
    a = _sweep(tmp_path / "gpu.json", [_row("nvfp4", 0, 0.5), _row("nvfp4", 1, 0.7)])
    res = bl.combine([a])
    Path(a).write_text(json.dumps(res))
    pytest.importorskip("matplotlib")
    bl.report([a], str(tmp_path / "rep"))
    md = (tmp_path / "rep" / "learning.md").read_text()
    assert "| nvfp4 | 2 | 25.0 +- 0.0 | 60.0 +- 14.1 |" in md
    assert (tmp_path / "rep" / "gpu_curves.png").stat().st_size > 1000


def test_demo_device_flag():
    from qerl.rl.demo import resolve_device

    assert resolve_device("cpu") == "cpu"
    import torch

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "cuda:x", "cudax", "cuda:"):
        with pytest.raises(SystemExit, match="expected cpu, cuda"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            resolve_device("cuda")


def test_bad_variant_exits_in_one_line():
    p = subprocess.run([sys.executable, "benchmarks/bench_learning.py", "--variants", "fp8"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["bench_learning: variant 'fp8': unknown format 'fp8' (one of bf16, nf4, mxfp4, nvfp4)"]


@pytest.mark.slow
def test_cpu_sweep_end_to_end(tmp_path):
    """Two real 1-step demo runs of the embedded model in parallel processes: the JSON has a row
    per run with the demo's numbers and the autocast setting each ran with; a second call runs
    nothing again."""
    out = tmp_path / "cpu.json"
    cmd = [sys.executable, "benchmarks/bench_learning.py", "--variants", "nvfp4,nvfp4@autocast", "--seeds", "0",
           "--steps", "1", "--num-eval", "2", "--device", "cpu", "--jobs", "2", "--threads", "1",
           "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [(r["variant"], r["status"], r["steps"]) for r in res["rows"]] == [("nvfp4", "ok", 1), ("nvfp4@autocast", "ok", 1)]
    sums = [json.loads(f.read_text()) for f in sorted((tmp_path / "runs").glob("*/seed0/nvfp4/summary.json"))]
    assert sorted(s["bf16_autocast"] for s in sums) == [False, True]
    assert all(0.0 <= r["heldout_after"] <= 1.0 and len(r["rewards"]) == 1 for r in res["rows"])
    p2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p2.returncode == 0 and "done in" not in p2.stdout


def test_paired_tables_for_autocast_and_aqn():
    """Each option is paired with the same variant without it, on common seeds only."""
    rows = [_row("nvfp4", 0, 0.5), _row("nvfp4", 1, 0.7), _row("nvfp4@autocast", 0, 0.6), _row("nvfp4@autocast", 1, 0.6),
            _row("nvfp4+aqn", 0, 0.8), _row("nvfp4+aqn@autocast", 0, 0.9), _row("nvfp4+aqn@autocast", 5, 0.1)]
    res = {"rows": rows}
    assert bl._without("nvfp4+aqn@autocast", "aqn") == "nvfp4@autocast"
    assert bl._without("nvfp4+aqn@autocast", "autocast") == "nvfp4+aqn"
    assert bl._without("bf16", "aqn") is None
    ac = bl.paired(res, "autocast")
    assert "| nvfp4@autocast | 2 | +0.0 +- 10.0 |" in "\n".join(ac)  # +10 and -10 points
    assert "| nvfp4+aqn@autocast | 1 | +10.0 +- nan |" in "\n".join(ac)
    aq = "\n".join(bl.paired(res, "aqn"))
    assert "| nvfp4+aqn | 1 | +30.0 +- nan |" in aq and "| nvfp4+aqn@autocast | 1 | +30.0 +- nan |" in aq
    assert "| all | 2 | +30.0 +- 0.0 |" in aq
    assert bl.paired({"rows": rows[:2]}, "aqn") == []
