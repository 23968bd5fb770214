"""qerl.efficiency: benchmark result files as MLflow runs (a real SQLite store) and the efficiency tables rebuilt from
those runs, checked against the committed evidence files they came from."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from qerl.efficiency import (
    FUSED_NF4,
    PAPER_STEP_SPEEDUP,
    BenchmarkError,
    build_tables,
    detect_kind,
    kernel_medians,
    load_result,
    log_results,
    result_metrics,
    write_report,
)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
B8 = RESULTS / "h200" / "grpo_step_cap79_b8.json"
FUSED = RESULTS / "h200" / "grpo_step_cap79_b2_7b_nf4_fused.json"
W4A16 = RESULTS / "w4a16.json"


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'bench.db'}"


def _step_file(path: Path, date: str, speedup: float, fmt: str = "nvfp4", **extra) -> Path:
    row = {"model": "qwen2.5-7b", "format": fmt, "batch": 4, "micro_batch": 8, "step_s": 10.0 / speedup,
           "bf16_step_s": 10.0, "speedup": speedup, "gpu": "NVIDIA H100 80GB HBM3", "date": date, **extra}
    path.write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "date": date,
                                "command": "python benchmarks/bench_grpo_step.py", "rows": [row]}))
    return path


def test_the_kind_of_every_committed_result_file_is_recognised():
    assert load_result(B8)[0] == "grpo_step"
    assert load_result(RESULTS / "memory.json")[0] == "memory"
    assert load_result(RESULTS / "rollout.json")[0] == "rollout"
    assert load_result(W4A16)[0] == "w4a16"


@pytest.mark.parametrize("data, why", [({"rows": []}, "no rows"), ({"x": 1}, "no rows"),
                                        ({"rows": [{"model": "a", "us": 1}]}, "not one of")])
def test_a_file_that_is_not_a_benchmark_result_is_refused(data, why):
    with pytest.raises(BenchmarkError, match=why):
        detect_kind(data)


def test_bad_files_fail_in_one_line_naming_the_file(tmp_path):
    with pytest.raises(BenchmarkError, match="no such benchmark file"):
        load_result(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BenchmarkError, match=r"bad\.json: not JSON"):
        load_result(bad)


def test_kernel_medians_are_medians_over_the_cells_of_each_bucket():
    rows = [{"format": "nvfp4", "op": "forward", "m": m, "speedup": s}
            for m, s in [(1, 3.0), (2, 1.0), (16, 2.0), (32, 9.0), (64, 1.5), (256, 0.9), (1024, 0.8), (4096, 0.9)]]
    rows += [{"format": "nvfp4", "op": "backward", "m": 4096, "speedup": 0.7},
             {"format": "bf16", "op": "forward", "m": 1, "speedup": 1.0}]
    med = kernel_medians(rows)
    assert med["nvfp4", "M<=16"] == 2.0  # M = 32 belongs to no bucket
    assert med["nvfp4", "M=64"] == 1.5 and med["nvfp4", "M=256"] == 0.9
    assert med["nvfp4", "M>=1024"] == pytest.approx(0.85) and med["nvfp4", "backward M=4096"] == 0.7
    assert not any(f == "bf16" for f, _ in med)


def test_the_h100_sweep_gives_the_medians_results_md_states():
    data = json.loads(W4A16.read_text())
    med = kernel_medians(data["rows"])
    fwd = [r["speedup"] for r in data["rows"] if r["format"] == "nvfp4" and r["op"] == "forward" and r["m"] <= 16]
    assert med["nvfp4", "M<=16"] == statistics.median(fwd)
    assert round(med["nvfp4", "M<=16"], 2) == 2.13 and round(med["mxfp4", "M=64"], 2) == 1.64  # RESULTS.md, issue 4


def test_metrics_carry_each_rows_numbers_under_legal_mlflow_names():
    data = json.loads(B8.read_text())
    m = result_metrics("grpo_step", data)
    row = next(r for r in data["rows"] if r["model"] == "qwen2.5-14b" and r["format"] == "nvfp4")
    assert m["qwen2.5-14b/nvfp4/b8/mb8/speedup"] == row["speedup"]
    k = result_metrics("w4a16", json.loads(W4A16.read_text()))
    assert "nvfp4/M_le_16/median_speedup" in k and "nvfp4/M_ge_1024/median_speedup" in k


def test_files_become_runs_once_and_the_tables_come_back_from_the_store(tmp_path):
    uri = _uri(tmp_path)
    first = log_results([B8, FUSED], uri)
    assert [d["logged"] for d in first] == [True, True]
    again = log_results([B8], uri)
    assert again[0] == {**first[0], "logged": False}  # same bytes: the same run, nothing new

    from mlflow import MlflowClient

    run = MlflowClient(uri).get_run(first[0]["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["step"] == "benchmark"
    assert run.data.params["gpu"] == "NVIDIA H200" and "bench_grpo_step.py" in run.data.params["command"]

    tables = build_tables(uri)
    assert tables["runs"] == 2
    cells = {(r["gpu"], r["model"], r["format"], r["batch"]): r for r in tables["step"]}
    data = json.loads(B8.read_text())
    for src in data["rows"]:
        if src["format"] == "bf16":
            continue
        cell = cells["H200 (79 GiB cap)", src["model"], src["format"], src["batch"]]
        assert cell["speedup"] == src["speedup"] and cell["bf16_step_s"] == src["bf16_step_s"]
        assert cell["paper"] == PAPER_STEP_SPEEDUP[src["model"]][src["format"]][8]
    # a file made with QERL_NF4_FUSED_MAX_M=16 (before rows named their nf4 decode) is the labelled column
    fused = cells["H200 (79 GiB cap)", "qwen2.5-7b", FUSED_NF4, 2]
    assert fused["paper"] is None and fused["speedup"] == json.loads(FUSED.read_text())["rows"][-1]["speedup"]
    assert ("H200 (79 GiB cap)", "qwen2.5-7b", "nf4", 2) not in cells


def test_the_newest_measurement_of_a_cell_wins_whatever_the_logging_order(tmp_path):
    uri = _uri(tmp_path)
    new = _step_file(tmp_path / "new.json", "2026-11-28 10:00 UTC", 1.40)
    old = _step_file(tmp_path / "old.json", "2026-11-20 10:00 UTC", 1.10)
    log_results([new, old], uri)
    (cell,) = build_tables(uri)["step"]
    assert cell["speedup"] == 1.40 and cell["paper"] == 1.4 and cell["gpu"] == "H100"


def test_a_warm_up_measurement_never_replaces_a_steady_one(tmp_path):
    """A step from a --steps 2 call (its last step re-captured the graphs, x0.99 where the steady step was x1.52 on
    the H200 3B pair) is newer but does not replace the steady cell; alone in its cell it is shown, marked."""
    from qerl.efficiency import render_markdown

    uri = _uri(tmp_path)
    steady = _step_file(tmp_path / "steady.json", "2026-11-20 10:00 UTC", 1.40, steps=3)
    unknown = _step_file(tmp_path / "unknown.json", "2026-11-20 10:00 UTC", 0.7, fmt="nf4")  # no steps recorded
    warm = _step_file(tmp_path / "warm.json", "2026-11-28 10:00 UTC", 0.99, steps=2)
    alone = _step_file(tmp_path / "alone.json", "2026-11-28 10:00 UTC", 0.98, fmt="mxfp4")
    data = json.loads(alone.read_text())
    data["command"] = "python benchmarks/bench_grpo_step.py --steps 1 --device cuda"  # a file from before rows had steps
    alone.write_text(json.dumps(data))
    log_results([warm, steady, alone, unknown], uri)
    tables = build_tables(uri)
    got = {r["format"]: (r["speedup"], r["steps"], r["steady"]) for r in tables["step"]}
    assert got == {"nvfp4": (1.40, 3, True), "mxfp4": (0.98, 1, False), "nf4": (0.7, None, True)}
    text = render_markdown(tables)
    assert "| 1 (warm-up) |" in text and "| 3 |" in text


def test_a_row_naming_its_fused_nf4_decode_is_kept_apart_from_the_baseline(tmp_path):
    uri = _uri(tmp_path)
    log_results([_step_file(tmp_path / "a.json", "2026-11-28", 0.6, fmt="nf4", nf4_decode="baseline"),
                 _step_file(tmp_path / "b.json", "2026-11-29", 0.8, fmt="nf4", nf4_decode="fused<=16")], uri)
    got = {r["format"]: r["speedup"] for r in build_tables(uri)["step"]}
    assert got == {"nf4": 0.6, FUSED_NF4: 0.8}


def test_a_ratio_that_misses_its_goal_never_prints_as_the_goal():
    from qerl.efficiency import _near_goal

    assert _near_goal(0.848, 0.85) == "0.848"  # 2 decimals would print the goal itself
    assert _near_goal(0.853, 0.85) == "0.85" and _near_goal(0.8449, 0.85) == "0.84"
    assert _near_goal(2.114, 3.0) == "2.11" and _near_goal(None, 1.0) == "" and _near_goal(0.849, None) == "0.85"


def test_the_report_files_are_written(tmp_path):
    uri = _uri(tmp_path)
    log_results([B8, W4A16, RESULTS / "h200" / "rollout_32b.json"], uri)
    paths = write_report(build_tables(uri), tmp_path / "out")
    md = Path(paths["table_md"]).read_text()
    assert "| H200 (79 GiB cap) | qwen2.5-14b | nvfp4 | 8 | 8 | 3 | 46.57 | 55.58 | **1.19** | 1.2 |" in md
    assert "| H100 | nvfp4 | M<=16 | 2.13 | 3.00 | no |" in md
    assert "| H100 | nvfp4 | M=64 | 2.03 | 2.00 | yes |" in md  # session 81's second sweep, three64 on
    assert "| H100 | nvfp4 | M>=1024 | 0.84 | 0.85 | no |" in md  # 0.844 there (0.853 in session 80's)
    assert "58.0 (LoRA r16, probably batch 1)" in md  # the paper's 32B QeRL rollout beside ours at batch 1
    assert Path(paths["plot_png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(Path(paths["json"]).read_text())["runs"] == 3


def test_cli_logs_builds_and_fails_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from qerl.cli import app

    uri = _uri(tmp_path)
    runner = CliRunner()
    empty = runner.invoke(app, ["bench", "table", "--uri", uri, "--out", str(tmp_path / "out")])
    assert empty.exit_code == 2 and "no benchmark runs" in empty.output
    bad = runner.invoke(app, ["bench", "log", "--uri", uri, str(tmp_path / "nope.json")])
    assert bad.exit_code == 2 and bad.output.strip().splitlines()[-1].startswith("error: ")
    ok = runner.invoke(app, ["bench", "log", "--uri", uri, str(B8)])
    assert ok.exit_code == 0 and ok.output.startswith("logged  grpo_step")
    table = runner.invoke(app, ["bench", "table", "--uri", uri, "--out", str(tmp_path / "out")])
    assert table.exit_code == 0 and "3 GRPO step cells" in table.output  # 7B nvfp4, 14B nvfp4, 7B nf4
    assert (tmp_path / "out" / "table.md").is_file()
    # the report is also an MLflow run, beside the benchmark runs, that the tables never read back
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("qerl-benchmarks")
    (report,) = client.search_runs([exp.experiment_id], filter_string="tags.step = 'report'")
    assert report.info.run_name == "efficiency/report" and report.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(report.info.run_id, "report")} == {
        "report/table.md", "report/efficiency.json", "report/step_speedup.png"}
    assert build_tables(uri)["runs"] == 1


def test_import_stays_light():
    code = ("import sys, qerl.efficiency; bad = [m for m in ('mlflow', 'matplotlib', 'prefect', 'triton') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_memory_cells_carry_the_weights_in_the_papers_units(tmp_path):
    uri = _uri(tmp_path)
    mem = RESULTS / "h200" / "memory_cap79_b8.json"
    log_results([mem], uri)
    cells = {(r["model"], r["format"]): r for r in build_tables(uri)["memory"]}
    src = next(r for r in json.loads(mem.read_text())["rows"] if r["model"] == "qwen2.5-7b" and r["format"] == "nvfp4")
    cell = cells["qwen2.5-7b", "nvfp4"]
    assert cell["peak_gib"] == src["peak_gib"] and cell["status"] == "ok"
    assert cell["weights_gb"] == pytest.approx(src["weights_gib"] * 2**30 / 1e9)
    assert cell["paper_weights_gb"] == 5.9 and round(cell["weights_gb"], 1) == 5.9  # the paper's 7B NVFP4 figure


# ----------------------------------------------------------------------------- the Prefect flow (real local engine)

TINY_GRPO = ["--device", "cpu", "--models", "tiny-llama", "--formats", "bf16", "nvfp4", "--batches", "1",
             "--generations", "2", "--prompt-len", "8", "--completion", "8", "--rank", "4", "--steps", "1"]


@pytest.fixture(scope="module")
def harness():
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
def test_flow_runs_a_benchmark_logs_every_file_and_rebuilds_the_tables(harness, tmp_path):
    from flows.efficiency import efficiency

    uri = _uri(tmp_path)
    res = efficiency(benchmarks=[{"kind": "grpo_step", "args": TINY_GRPO},
                                 {"kind": "grpo_step", "args": ["--device", "cpu", "--models", "no-such-model"]}],
                     files=[str(B8)], tracking_uri=uri, out_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"),
                     return_state=True)
    assert res.is_failed()  # the second benchmark failed: the flow says so, after logging what was measured
    (folder,) = (tmp_path / "work").iterdir()
    written = json.loads((folder / "0" / "grpo_step.json").read_text())
    tables = build_tables(uri)
    assert tables["runs"] == 3  # the committed file, and the tiny benchmark's grpo_step.json and memory.json
    tiny = {r["format"]: r for r in tables["step"] if r["model"] == "tiny-llama"}
    src = next(r for r in written["rows"] if r["format"] == "nvfp4")
    assert tiny["nvfp4"]["speedup"] == src["speedup"] and tiny["nvfp4"]["paper"] is None
    assert any(r["model"] == "tiny-llama" and r["status"] == "ok" for r in tables["memory"])
    assert "tiny-llama" in (tmp_path / "out" / "table.md").read_text()
    assert build_tables(uri)["runs"] == 3  # the report run the flow logged is not a benchmark run


def test_flow_refuses_bad_input_before_running_anything(harness, tmp_path):
    from flows.efficiency import efficiency

    uri = _uri(tmp_path)
    for params in ({"benchmarks": [{"kind": "bench_nothing", "args": []}]},
                   {"benchmarks": [{"kind": "rollout", "args": ["--out", "x.json"]}]},
                   {"files": [str(tmp_path / "missing*.json")]}):
        with pytest.raises(BenchmarkError):
            efficiency(**params, tracking_uri=uri, out_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"))
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_a_cuda_benchmark_on_a_machine_without_one_fails_in_one_line(tmp_path):
    import torch

    from qerl.efficiency import run_benchmark

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BenchmarkError, match="no CUDA GPU .*--device cpu"):
        run_benchmark("grpo_step", ["--models", "qwen2.5-7b"], tmp_path)


def test_make_efficiency_runs_the_evidence_deployment_of_prefect_yaml():
    from flows.efficiency import deployment_parameters
    from qerl.efficiency import expand_files

    params = deployment_parameters("evidence")
    import os

    cwd = os.getcwd()
    os.chdir(RESULTS.parents[1])
    try:
        files = expand_files(params["files"])
    finally:
        os.chdir(cwd)
    names = {str(f) for f in files}
    assert {"benchmarks/results/grpo_step.json", "benchmarks/results/h200/grpo_step_cap79_b8.json",
            "benchmarks/results/w4a16.json"} <= names
    assert "--deployment evidence" in (RESULTS.parents[1] / "Makefile").read_text()
