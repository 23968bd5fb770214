"""benchmarks/plot_results.py: the numbers it plots come from the evidence files' own fields, and it
writes one figure per issue (matplotlib Agg, no display)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def plots():
    spec = importlib.util.spec_from_file_location("plot_results", os.path.join(ROOT, "benchmarks", "plot_results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _w4a16_rows():
    rows = []
    for fmt, scale in (("bf16", 1.0), ("nvfp4", 2.0), ("mxfp4", 1.5)):
        for i, n in enumerate((1024, 2048, 4096)):
            for m in (1, 64):
                rows.append({"model": "x", "layer": str(n), "n": n, "k": 1024, "m": m, "format": fmt, "op": "forward",
                             "us": 1.0, "bf16_us": 1.0, "speedup": scale * (i + 1) / m ** 0.5, "gbps": 1.0})
        rows.append({"model": "x", "layer": "b", "n": 1024, "k": 1024, "m": 4096, "format": fmt, "op": "backward",
                     "us": 1.0, "bf16_us": 1.0, "speedup": 0.9 * scale, "gbps": 1.0})
    return rows


def test_medians_ratios_and_newest_pairs(plots):
    med = plots.w4a16_medians(_w4a16_rows())
    assert set(med) == {("nvfp4", "forward"), ("mxfp4", "forward"), ("nvfp4", "backward"), ("mxfp4", "backward")}
    assert med["nvfp4", "forward"] == {1: 4.0, 64: pytest.approx(0.5)}  # median of 2, 4, 6 (and of those / 8)
    assert med["mxfp4", "backward"] == {4096: pytest.approx(1.35)}
    fused = [dict(r, format="nf4-fused") for r in _w4a16_rows() if r["format"] == "nvfp4"]
    assert ("nf4-fused", "forward") not in plots.w4a16_medians(fused)  # issue 4's figure: the three formats only
    assert plots.w4a16_medians(fused, plots.NF4_FORMATS)["nf4-fused", "forward"] == {1: 4.0, 64: pytest.approx(0.5)}

    rollout = [{"model": "qwen2.5-7b", "format": "nvfp4", "batch": 8, "lora_rank": 0, "tokens_per_s": 300.0,
                "bf16_tokens_per_s": 150.0},
               {"model": "qwen2.5-7b", "format": "nvfp4", "batch": 8, "lora_rank": 32, "tokens_per_s": 250.0,
                "bf16_tokens_per_s": 150.0},
               {"model": "qwen2.5-7b", "format": "mxfp4", "batch": 1, "lora_rank": 0, "tokens_per_s": 90.0,
                "bf16_tokens_per_s": None},
               {"model": "qwen2.5-7b", "format": "bf16", "batch": 8, "lora_rank": 0, "tokens_per_s": 150.0,
                "bf16_tokens_per_s": 150.0}]
    assert plots.rollout_ratios(rollout) == {("qwen2.5-7b", 8, "nvfp4"): 2.0}
    rollout[1]["lora0_tokens_per_s"] = 300.0
    assert plots.lora_ratios(rollout) == {("qwen2.5-7b", 8, "r32"): pytest.approx(250 / 300)}

    grpo = [{"model": "m", "format": "nvfp4", "batch": 2, "speedup": 1.3, "date": "2026-11-25 08:30 UTC"},
            {"model": "m", "format": "nvfp4", "batch": 2, "speedup": 1.6, "date": "2026-11-27 10:00 UTC"},
            {"model": "m", "format": "nvfp4", "batch": 2, "speedup": None, "date": "2026-11-28 10:00 UTC"},
            {"model": "m", "format": "nf4", "batch": 2, "speedup": 0.7, "date": "2026-11-26 10:00 UTC"}]
    assert plots.grpo_speedups(grpo) == {("m", 2, "nvfp4"): 1.6, ("m", 2, "nf4"): 0.7}
    assert plots.short_gpu("NVIDIA H100 80GB HBM3") == "H100" and plots.short_gpu("NVIDIA H200") == "H200"
    assert sorted(["qwen2.5-32b", "qwen2.5-7b", "other"], key=plots._size) == ["qwen2.5-7b", "qwen2.5-32b", "other"]
    probe = [{"model": "qwen2.5-7b", "rows": 32, "keys": 1280, "cand": "old", "of_copy": 0.46},
             {"model": "qwen2.5-7b", "rows": 32, "keys": 1280, "cand": "new", "of_copy": 0.57},
             {"model": "qwen2.5-7b", "rows": 8, "keys": 512, "cand": "old", "of_copy": None}]
    assert plots.attention_fractions(probe) == {("qwen2.5-7b", 32, 1280): {"old": 0.46, "new": 0.57}}
    # the ceiling: each layer's fastest streaming launch (not its first), bf16 at the same M, shapes in both files only
    stream = [{"n": 2048, "k": 1024, "cfg": "a", "us4": 0.5}, {"n": 2048, "k": 1024, "cfg": "b", "us4": 0.25},
              {"n": 2048, "k": 1024, "m": 1, "cfg": "bf16", "bf16_us": 1.0},
              {"n": 2048, "k": 1024, "m": 64, "cfg": "bf16", "bf16_us": 9.0},
              {"n": 8192, "k": 1024, "cfg": "a", "us4": 1.0}, {"n": 8192, "k": 1024, "m": 1, "cfg": "bf16", "bf16_us": 4.0}]
    assert plots.ceiling_pairs(_w4a16_rows(), stream) == [(2048, 1024, 4.0, 4.0)]


def test_writes_the_six_figures_and_refuses_bad_input(plots, tmp_path):
    def write(name, gpu, rows):
        path = tmp_path / name
        path.write_text(json.dumps({"gpu": gpu, "command": "c", "date": "d", "rows": rows}))
        return str(path)

    w4a16 = [write("w_h100.json", "NVIDIA H100 80GB HBM3", _w4a16_rows()),
             write("w_h200.json", "NVIDIA H200", _w4a16_rows())]
    rollout = write("r.json", "NVIDIA H200", [{"model": "qwen2.5-7b", "format": f, "batch": 8, "lora_rank": 0,
                                                "tokens_per_s": t, "bf16_tokens_per_s": 100.0}
                                               for f, t in (("nvfp4", 200.0), ("mxfp4", 190.0), ("nf4", 50.0))]
                    + [{"model": "qwen2.5-7b", "format": "nvfp4", "batch": 8, "lora_rank": 16, "tokens_per_s": 180.0,
                        "bf16_tokens_per_s": 100.0, "lora0_tokens_per_s": 200.0}])
    grpo = write("g.json", "NVIDIA H200", [{"model": "qwen2.5-7b", "format": "nvfp4", "batch": 2, "speedup": 1.4,
                                             "date": "d", "device_memory_gib": 79.0}])
    attention = write("a.json", "NVIDIA H200", [{"model": "qwen2.5-7b", "rows": 32, "keys": k, "cand": c,
                                                  "of_copy": f} for k in (1280, 2048)
                                                 for c, f in (("old", 0.5), ("new", 0.8))])
    nf4_rows = _w4a16_rows() + [dict(r, format=f, speedup=r["speedup"] / d) for r in _w4a16_rows()
                                if r["format"] == "nvfp4" for f, d in (("nf4", 4.0), ("nf4-fused", 2.5))]
    nf4 = write("n.json", "NVIDIA H200", nf4_rows)
    stream = write("s.json", "NVIDIA H100 80GB HBM3", [{"n": n, "k": 1024, "cfg": c, "us4": u, "us16": 1.0, "bf16_us": 1.0}
                                                       for n in (1024, 2048) for c, u in (("a", 0.5), ("b", 0.25))]
                   + [{"n": n, "k": 1024, "m": 1, "cfg": "bf16", "bf16_us": 1.0} for n in (1024, 2048)])
    out = tmp_path / "plots"
    written = plots.main(["--w4a16", *w4a16, "--rollout", rollout, "--grpo", grpo, "--attention", attention,
                          "--nf4", nf4, "--ceiling", w4a16[0], stream, "--out", str(out)])
    assert sorted(os.path.basename(p) for p in written) == ["attention_bandwidth.png", "grpo_step.png",
                                                                "lora_cost.png", "nf4_kernels.png",
                                                                "rollout_ratio.png", "w4a16_ceiling.png",
                                                                "w4a16_speedup.png"]
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit, match="no such evidence file: .*missing.json"):
        plots.main(["--w4a16", str(tmp_path / "missing.json"), "--out", str(out)])
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a benchmark file"):
        plots.main(["--rollout", str(tmp_path / "list.json"), "--out", str(out)])
    empty = write("e.json", "NVIDIA H200", [{"model": "m", "format": "nvfp4", "batch": 2, "speedup": None}])
    with pytest.raises(SystemExit, match="no rows to plot for grpo_step.png"):
        plots.main(["--w4a16", *w4a16, "--rollout", rollout, "--grpo", empty, "--attention", attention,
                    "--nf4", nf4, "--out", str(out)])
    with pytest.raises(SystemExit, match="no rows to plot for nf4_kernels.png"):
        plots.main(["--w4a16", *w4a16, "--rollout", rollout, "--grpo", grpo, "--attention", attention,
                    "--nf4", empty, "--out", str(out)])
