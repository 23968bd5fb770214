"""Integration: the real `reproduce-table` Prefect flow (under prefect_test_harness) with a real
MLflow SQLite store in a temp dir, on the smoke recipe (tiny random Llama, 4 GSM8K problems).

Checks the parent and nested runs, their params/tags/metrics/artifacts, the report files, that
summary.json merges by variant, and that a failing task leaves a FAILED run with its error.
The slow test runs the embedded SmolLM2 on 2 problems.

    python -m pytest tests/test_flow.py -q            (about a minute; -m "not slow" skips the embedded one)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qerl.recipe import TABLE1_VARIANTS, VARIANTS

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "recipes" / "smoke.yaml")
EMBEDDED = str(ROOT / "recipes" / "embedded.yaml")

# The first four problems of the GSM8K test set (openai/grade-school-math, MIT license),
# so the test needs no data directory; the gold answer follows "####" as in the original.
GSM8K_ROWS = [
    {"question": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?", "answer": "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18 every day at the farmer\u2019s market.\n#### 18"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?", "answer": "It takes 2/2=1 bolt of white fiber\nSo the total amount of fabric is 2+1=3 bolts of fabric\n#### 3"},
    {"question": "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in repairs.  This increased the value of the house by 150%.  How much profit did he make?", "answer": "The cost of the house and repairs came out to 80,000+50,000=$130,000\nHe increased the value of the house by 80,000*1.5=120,000\nSo the new value of the house is 120,000+80,000=$200,000\nSo he made a profit of 200,000-130,000=$70,000\n#### 70000"},
    {"question": "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters does he run a week?", "answer": "He sprints 3*3=9 times\nSo he runs 9*60=540 meters\n#### 540"},
]


@pytest.fixture(scope="session")
def prefect_harness():
    """A throwaway Prefect API + database for the whole session (no server needed)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def gsm8k_dir(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    (d / "gsm8k").mkdir(parents=True)
    with open(d / "gsm8k" / "test.jsonl", "w", encoding="utf-8") as f:
        for row in GSM8K_ROWS:
            f.write(json.dumps(row) + "\n")
    return d


def overrides_for(tmp_path: Path, data_dir: Path, **extra) -> dict:
    return {
        "data_dir": str(data_dir),
        "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "mlflow.experiment": "test-flow",
        "output_dir": str(tmp_path / "out"),
        "report_dir": str(tmp_path / "reports"),
        **extra,
    }


def client_for(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def children(client, parent_id: str) -> list:
    """The parent's child runs, oldest first (MLflow's search returns newest first)."""
    exp = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    return sorted(runs, key=lambda r: (r.info.start_time, r.info.end_time or 0))


def artifact_paths(client, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for f in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def test_flow_on_smoke_recipe(prefect_harness, tmp_path, gsm8k_dir):
    from flows.reproduce_table import reproduce_table

    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    # a row of a later issue's variant: the report must keep it (merge by variant)
    (report_dir / "summary.json").write_text(json.dumps({"rows": [{"variant": "grpo-nvfp4", "format": "nvfp4", "gsm8k_accuracy": 0.5, "n": 4, "entropy": 0.1}]}))

    result = reproduce_table(SMOKE, overrides_for(tmp_path, gsm8k_dir))

    client = client_for(tmp_path)
    parent = client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["step"] == "flow" and parent.data.tags["recipe"] == "smoke"
    assert parent.data.tags["prefect.flow_run_id"]
    assert parent.data.params["model.name"] == "random:tiny-llama"
    assert parent.data.params["formats"] == "bf16,nf4,mxfp4,nvfp4"
    assert parent.data.params["benchmarks.0.limit"] == "4"
    for pkg in ("torch", "transformers", "qerl", "prefect", "mlflow"):
        assert parent.data.tags[f"version.{pkg}"]
    from qerl.kernels.layout import order_setting

    assert parent.data.tags["w4a16_order"] == order_setting()  # what the kernels ran under, beside the versions
    parent_files = artifact_paths(client, parent.info.run_id)
    assert {"recipe.yaml", "report/table.md", "report/table.html", "report/summary.json"} <= parent_files

    runs = children(client, parent.info.run_id)  # oldest first
    by_step: dict[str, dict[str, object]] = {}
    for r in runs:
        key = r.data.tags.get("format", "-") if r.data.tags["step"] == "quantize" else r.data.tags.get("variant", "-")
        by_step.setdefault(r.data.tags["step"], {})[key] = r  # the latest attempt
    for step, latest in by_step.items():
        for key, r in latest.items():
            # a task may fail once and be retried by Prefect (tasks retry once); its last attempt must finish
            assert r.info.status == "FINISHED", (r.info.run_name, r.data.tags.get("error"))
    retried = [r for r in runs if r.info.status != "FINISHED"]
    assert len(retried) <= 1, [(r.info.run_name, r.data.tags.get("error")) for r in retried]
    assert set(by_step) == {"quantize", "train", "evaluate", "report"}
    assert set(by_step["quantize"]) == {"bf16", "nf4", "mxfp4", "nvfp4"}  # once per format, shared
    assert len([r for r in runs if r.data.tags["step"] == "quantize" and r.info.status == "FINISHED"]) == 4
    assert set(by_step["train"]) == set(TABLE1_VARIANTS)  # the smoke recipe trains the paper's five columns
    assert set(by_step["evaluate"]) == {f"base-{f}" for f in ("bf16", "nf4", "mxfp4", "nvfp4")} | set(TABLE1_VARIANTS)
    for variant, run in by_step["evaluate"].items():
        fmt = variant[len("base-"):] if variant.startswith("base-") else VARIANTS[variant][0]
        assert run.data.tags["format"] == fmt
        assert run.data.tags["aqn"] == ("true" if variant == "qerl-nvfp4-aqn" else "false")
        assert run.data.tags["model"] == "random:tiny-llama" and run.data.tags["seed"] == "0"
        assert run.data.tags["device"] == run.data.tags["device_name"] == "cpu"  # on a GPU: its name
        assert run.data.params["format"] == fmt and run.data.params["generation.max_new_tokens"] == "16"
        assert ("adapter" in run.data.params) == (not variant.startswith("base-"))
        m = run.data.metrics
        assert m["gsm8k_n"] == 4 and 0.0 <= m["gsm8k_accuracy"] <= 1.0
        assert m["gsm8k_ci_low"] <= m["gsm8k_accuracy"] <= m["gsm8k_ci_high"]
        assert m["gsm8k_entropy"] > 0
        assert "results/gsm8k.jsonl" in artifact_paths(client, run.info.run_id)
        local = client.download_artifacts(run.info.run_id, "results/gsm8k.jsonl", str(tmp_path / f"dl-{variant}"))
        records = [json.loads(line) for line in Path(local).read_text().splitlines()]
        assert len(records) == 4 and {"id", "completion", "correct", "entropy"} <= set(records[0])
    for variant, run in by_step["train"].items():
        # per-step metrics with step numbers, the summary, the adapter as artifacts
        for key in ("reward_mean", "reward_std", "accuracy", "entropy", "clip_ratio_high", "completion_length",
                    "zero_variance_groups_frac", "aqn_sigma", "rollout_tokens_per_s", "step_time_s", "peak_memory_bytes"):
            hist = client.get_metric_history(run.info.run_id, key)
            assert sorted(m.step for m in hist) == [1, 2], (variant, key)
        sigmas = [m.value for m in client.get_metric_history(run.info.run_id, "aqn_sigma")]
        assert (max(sigmas) > 0) == (variant == "qerl-nvfp4-aqn")
        m = run.data.metrics
        assert m["steps"] == 2 and "reward_first_fifth" in m and "reward_last_fifth" in m
        assert run.data.params["grpo.max_steps"] == "2" and run.data.params["lora.r"] == "4"
        assert run.data.tags["device_name"] == "cpu"
        assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "train_history.json"} <= artifact_paths(client, run.info.run_id)
    bits = {f: r.data.metrics["bits_per_weight"] for f, r in by_step["quantize"].items()}
    assert bits["bf16"] == 16 and bits["mxfp4"] < bits["nf4"] < bits["bf16"]

    table = Path(result["table_md"]).read_text()
    for fmt in ("bf16", "nf4", "mxfp4", "nvfp4"):
        assert f"| base-{fmt} | {fmt} |" in table
    for variant, (fmt, _) in ((v, VARIANTS[v]) for v in TABLE1_VARIANTS):
        assert f"| {variant} | {fmt} |" in table
    assert "61.2" in table and "76.3" in table  # the paper's base bf16 column (3B, 7B)
    assert "83.7" in table  # the paper's QeRL + AQN 3B cell
    assert Path(result["curves_png"]).stat().st_size > 10_000 and Path(result["plot_png"]).is_file()
    assert Path(result["table_html"]).read_text().startswith("<!doctype html>")
    summary = json.loads(Path(result["summary_json"]).read_text())
    rows = {r["variant"]: r for r in summary["rows"]}
    assert set(rows) == {"base-bf16", "base-nf4", "base-mxfp4", "base-nvfp4", "grpo-nvfp4"} | set(TABLE1_VARIANTS)
    for variant, (fmt, aqn) in ((v, VARIANTS[v]) for v in TABLE1_VARIANTS):
        row = rows[variant]
        assert row["format"] == fmt and row["aqn"] == aqn and row["steps"] == 2 and row["n"] == 4
        assert 0 <= row["reward_first_fifth"] <= 1 and 0 <= row["reward_last_fifth"] <= 1
        assert 0 <= row["gsm8k_accuracy"] <= 1 and row["entropy"] > 0
    for fmt in ("bf16", "nf4", "mxfp4", "nvfp4"):
        row = rows[f"base-{fmt}"]
        assert row["format"] == fmt and row["n"] == 4
        assert 0 <= row["gsm8k_accuracy"] <= 1 and row["entropy"] > 0
    assert rows["grpo-nvfp4"]["gsm8k_accuracy"] == 0.5
    assert len(result["rows"]) == 4 + len(TABLE1_VARIANTS)

    # `qerl report` rebuilds the same table from the MLflow runs alone
    from typer.testing import CliRunner

    from qerl.cli import app

    ov = overrides_for(tmp_path, gsm8k_dir, report_dir=str(tmp_path / "again"))
    sets = [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]
    out = CliRunner().invoke(app, ["report", SMOKE, *sets])
    assert out.exit_code == 0, out.output
    assert "| base-nvfp4 | nvfp4 |" in (tmp_path / "again" / "table.md").read_text()


def test_failed_task_leaves_failed_run_and_flow_raises(prefect_harness, tmp_path):
    from flows.reproduce_table import reproduce_table
    from qerl.data import DataError

    missing = tmp_path / "no-such-data"
    with pytest.raises(DataError, match="does not exist"):
        reproduce_table(SMOKE, overrides_for(tmp_path, missing, formats=["bf16"], train=None))

    client = client_for(tmp_path)
    exp = client.get_experiment_by_name("test-flow")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.step = 'flow'")
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FAILED" and "does not exist" in parent.data.tags["error"]
    runs = children(client, parent.info.run_id)
    evals = [r for r in runs if r.data.tags["step"] == "evaluate"]
    assert len(evals) == 1  # bad input (a DataError) is not retried
    ev = evals[0]
    assert ev.info.status == "FAILED"
    assert ev.data.tags["error_type"] == "DataError" and str(missing) in ev.data.tags["error"]
    assert "error.txt" in artifact_paths(client, ev.info.run_id)
    # the quantize step worked; the report still ran and says what failed
    assert [r.info.status for r in runs if r.data.tags["step"] == "quantize"] == ["FINISHED"]
    table = (tmp_path / "reports" / "table.md").read_text()
    assert "| base-bf16 | bf16 | FAILED |" in table and "DataError" in table


def test_failed_quantize_shows_its_own_error(prefect_harness, tmp_path, gsm8k_dir):
    from flows.reproduce_table import reproduce_table
    from qerl.model import ModelError

    with pytest.raises(ModelError, match="no-such-preset"):
        reproduce_table(SMOKE, overrides_for(tmp_path, gsm8k_dir, formats=["nvfp4"], train=None, **{"model.name": "random:no-such-preset"}))
    client = client_for(tmp_path)
    exp = client.get_experiment_by_name("test-flow")
    (parent,) = client.search_runs([exp.experiment_id], filter_string="tags.step = 'flow'")
    runs = {r.data.tags["step"]: r for r in children(client, parent.info.run_id)}
    assert set(runs) == {"quantize", "report"}  # evaluate never started: no run, no silent gap in the report
    assert runs["quantize"].info.status == "FAILED" and runs["quantize"].data.tags["error_type"] == "ModelError"
    assert "| base-nvfp4 | nvfp4 | FAILED |" in (tmp_path / "reports" / "table.md").read_text()


def test_bad_recipe_fails_before_any_mlflow_run(prefect_harness, tmp_path, gsm8k_dir):
    from flows.reproduce_table import reproduce_table
    from qerl.recipe import RecipeError

    with pytest.raises(RecipeError, match="unknown format 'fp6'"):
        reproduce_table(SMOKE, overrides_for(tmp_path, gsm8k_dir, formats=["bf16", "fp6"]))
    assert not (tmp_path / "mlflow.db").exists()


def _fail_with_oom(monkeypatch, module, name: str, held: list, fail_if=lambda *a, **k: True):
    """Replace module.name with a function that raises torch's out-of-memory error (as a GPU that runs out does)
    while holding its model argument, which `held` gets a weak reference to; where fail_if says no, the real one
    runs."""
    import weakref

    import torch

    real = getattr(module, name)

    def failing(*args, **kwargs):
        if not fail_if(*args, **kwargs):
            return real(*args, **kwargs)
        model = kwargs.get("model", args[0] if args else None)
        held.append(weakref.ref(model))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(module, name, failing)


def test_a_step_out_of_memory_fails_in_one_line_and_frees_its_model(prefect_harness, tmp_path, gsm8k_dir, monkeypatch):
    """nvfp4's evaluation runs out of memory: its run is FAILED with a line naming the recipe keys, bf16's column
    still finishes, the flow raises that error, and the failed step's model is freed though the error is held (a
    Prefect flow keeps a failed task's error while the other columns run)."""
    import gc

    import torch

    import qerl.eval.harness
    from flows.reproduce_table import reproduce_table
    from qerl.eval.evaluate import EvaluationOOM

    held: list = []
    _fail_with_oom(monkeypatch, qerl.eval.harness, "evaluate_with_harness", held,
                   fail_if=lambda harness, checkpoint, *a, **k: "nvfp4" in str(checkpoint))
    with pytest.raises(EvaluationOOM) as info:
        reproduce_table(SMOKE, overrides_for(tmp_path, gsm8k_dir, formats=["bf16", "nvfp4"], train=None))
    assert "evaluating base-nvfp4 on cpu: lower generation.batch_size (now 4)" in str(info.value)
    assert isinstance(info.value, torch.OutOfMemoryError) and "Tried to allocate" in str(info.value.__cause__)
    gc.collect()
    assert len(held) == 2 and all(ref() is None for ref in held)  # tried twice (a retry); freed while `info` holds the error
    client = client_for(tmp_path)
    exp = client.get_experiment_by_name("test-flow")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.step = 'evaluate'")
    status = {r.data.tags["format"]: (r.info.status, r.data.tags.get("error_type")) for r in runs}
    assert status["bf16"] == ("FINISHED", None) and status["nvfp4"][1] == "EvaluationOOM"
    assert {r.info.status for r in runs if r.data.tags["format"] == "nvfp4"} == {"FAILED"}  # retried once, both FAILED


def test_quantize_out_of_memory_says_to_quantize_on_the_cpu(tmp_path, gsm8k_dir, monkeypatch):
    """The quantize step runs out of memory: QuantizeOOM in one line with the command that quantizes on the CPU, the
    run FAILED, the model freed, no complete checkpoint left behind."""
    import gc

    import qerl.quantize
    from qerl import pipeline
    from qerl.checkpoint import is_complete
    from qerl.quantize import QuantizeOOM
    from qerl.recipe import load_recipe

    held: list = []
    _fail_with_oom(monkeypatch, qerl.quantize, "quantize_", held)
    recipe = load_recipe(SMOKE, overrides_for(tmp_path, gsm8k_dir, train=None))
    with pytest.raises(QuantizeOOM) as info:
        pipeline.quantize_step(recipe, "nvfp4", progress=False)
    assert str(info.value).startswith("out of GPU memory quantizing random:tiny-llama to nvfp4 on cpu: quantize on the CPU")
    assert "qerl quantize RECIPE --format nvfp4 --set device=cpu" in str(info.value)
    gc.collect()
    assert len(held) == 1 and held[0]() is None
    assert not is_complete(pipeline.checkpoint_dir(recipe, "nvfp4"))
    (run,) = client_for(tmp_path).search_runs([client_for(tmp_path).get_experiment_by_name("test-flow").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error_type"] == "QuantizeOOM"


def test_cli_says_a_training_oom_in_one_line_and_frees_the_model(prefect_harness, tmp_path, gsm8k_dir, monkeypatch):
    """Training runs out of memory in its update: `qerl reproduce` ends with the trainer's hint in one line and where
    the traceback is, exit code 1 (not bad input: 2), and the trainer's model is freed."""
    import gc

    from typer.testing import CliRunner

    import qerl.rl.trainer
    from qerl.cli import app

    held: list = []
    _fail_with_oom(monkeypatch, qerl.rl.trainer, "optimise", held)
    ov = overrides_for(tmp_path, gsm8k_dir, formats="[nvfp4]", **{"train.variants": "[qerl-nvfp4]"})
    sets = [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]
    out = CliRunner().invoke(app, ["reproduce", SMOKE, *sets])
    assert out.exit_code == 1, out.output
    # Prefect's log above has the traceback; the command's last words are the line and where the traceback is
    last = out.output.strip().splitlines()[-2:]
    assert last[0] == f"error: {qerl.rl.trainer.OOM_HINT}" and "error.txt" in last[1]
    gc.collect()
    assert held and all(ref() is None for ref in held)
    client = client_for(tmp_path)
    exp = client.get_experiment_by_name("test-flow")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.step = 'train'")
    assert runs and {(r.info.status, r.data.tags["error_type"]) for r in runs} == {("FAILED", "TrainingOOM")}


@pytest.mark.slow
def test_flow_on_embedded_model(prefect_harness, tmp_path, gsm8k_dir):
    """SmolLM2-135M (embedded GGUF), 2 GSM8K + 4 arith problems, 32 new tokens, bf16 and nvfp4,
    and 2 RL steps of QeRL nvfp4 + AQN."""
    from qerl.model import embedded_dir

    embedded_dir()  # the embedded model must be installed (make setup does it): fail, never skip
    from flows.reproduce_table import reproduce_table

    ov = overrides_for(
        tmp_path, gsm8k_dir, formats=["bf16", "nvfp4"],
        **{"benchmarks.0.limit": 2, "benchmarks.1.limit": 4, "generation.max_new_tokens": 32,
           "generation.batch_size": 2, "device": "cpu", "train.variants": ["qerl-nvfp4-aqn"],
           "train.grpo.max_steps": 2, "train.grpo.save_steps": 1},
    )
    result = reproduce_table(EMBEDDED, ov)
    client = client_for(tmp_path)
    assert client.get_run(result["parent_run_id"]).info.status == "FINISHED"
    rows = {r["variant"]: r for r in json.loads(Path(result["summary_json"]).read_text())["rows"]}
    assert set(rows) == {"base-bf16", "base-nvfp4", "qerl-nvfp4-aqn"}
    assert rows["qerl-nvfp4-aqn"]["steps"] == 2 and rows["qerl-nvfp4-aqn"]["arith_n"] == 4
    for row in rows.values():
        assert row["n"] == 2 and 0 <= row["gsm8k_accuracy"] <= 1 and 0 <= row["arith_accuracy"] <= 1
        # a trained model is far from uniform over its 49k-token vocabulary (ln 49152 = 10.8)
        assert 0 < row["entropy"] < 5
    assert "| base-nvfp4 | nvfp4 |" in Path(result["table_md"]).read_text()


@pytest.mark.slow
def test_cli_ablation_runs_each_seed_with_the_overrides(prefect_harness, tmp_path, gsm8k_dir):
    """`qerl ablation RECIPE --seeds --set ...`: the ablation flow in this process, every --set reaching
    every seed's runs, mean +- std per variant in <report_dir>/ablation/ablation.json."""
    from typer.testing import CliRunner

    from qerl.cli import app

    ov = overrides_for(tmp_path, gsm8k_dir, formats="[nvfp4]", **{"train.variants": "[qerl-nvfp4,qerl-nvfp4-aqn]",
                                                                  "train.grpo.max_steps": 1})
    sets = [a for k, v in ov.items() for a in ("--set", f"{k}={v}")]
    out = CliRunner().invoke(app, ["ablation", SMOKE, "--seeds", "0,1", *sets])
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "reports" / "ablation" / "ablation.json").read_text())
    assert doc["completed_seeds"] == [0, 1] and not doc["failed_seeds"]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"base-nvfp4", "qerl-nvfp4", "qerl-nvfp4-aqn"} and all(r["n_seeds"] == 2 for r in rows.values())
    # AQN on - off, paired by seed, from the same runs the per-variant rows come from
    (effect,) = doc["aqn_effects"]
    assert (effect["format"], effect["aqn_off"], effect["aqn_on"]) == ("nvfp4", "qerl-nvfp4", "qerl-nvfp4-aqn")
    assert effect["gsm8k_accuracy_seeds"] == [0, 1]
    assert effect["gsm8k_accuracy_diff_mean"] == pytest.approx(
        rows["qerl-nvfp4-aqn"]["gsm8k_accuracy_mean"] - rows["qerl-nvfp4"]["gsm8k_accuracy_mean"], abs=1e-12)
    assert "## AQN on - off, per format, paired by seed" in (tmp_path / "reports" / "ablation" / "ablation.md").read_text()
    client = client_for(tmp_path)
    exp = client.get_experiment_by_name("test-flow")
    train = client.search_runs([exp.experiment_id], filter_string="tags.step = 'train'")
    assert len(train) == 4 and {r.data.params["grpo.max_steps"] for r in train} == {"1"}
    assert sorted(r.data.tags["seed"] for r in train) == ["0", "0", "1", "1"]
    (abl,) = client.search_runs([exp.experiment_id], filter_string="tags.step = 'ablation'")
    assert abl.data.metrics["aqn_effect.nvfp4.gsm8k_accuracy_diff_mean"] == pytest.approx(effect["gsm8k_accuracy_diff_mean"])


@pytest.mark.parametrize("seeds", ["", "0,0", "a,1"])
def test_cli_ablation_refuses_bad_seeds_in_one_line(tmp_path, seeds):
    from typer.testing import CliRunner

    from qerl.cli import app

    out = CliRunner().invoke(app, ["ablation", SMOKE, "--seeds", seeds, "--set", f"output_dir={tmp_path / 'out'}"])
    assert out.exit_code == 2 and out.output.strip().startswith("error: --seeds") and len(out.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_report_names_the_accelerator_its_runs_used():
    """The report's compute line names each device with the accelerator its runs recorded (the device_name
    tag: an H100's and an H200's speeds differ); runs from before the tag show the bare device."""
    from qerl.memory import device_name
    from qerl.report import _compute

    assert device_name("cpu") == "cpu"
    rows = [{"status": "ok", "device": "cuda", "device_name": "NVIDIA H200, 140 GiB", "compute_dtype": "bfloat16"},
            {"status": "ok", "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3, 80 GiB", "compute_dtype": "bfloat16"},
            {"status": "ok", "device": "cpu", "device_name": "cpu", "compute_dtype": "float32"},
            {"status": "ok", "device": "cuda", "compute_dtype": "bfloat16"},
            {"status": "failed", "device": "cuda", "device_name": "other"}]
    assert _compute(rows).split(" (weights")[0].split("; ") == [
        "float32 activations on cpu", "bfloat16 activations on cuda",
        "bfloat16 activations on cuda (NVIDIA H100 80GB HBM3, 80 GiB)", "bfloat16 activations on cuda (NVIDIA H200, 140 GiB)"]


def test_report_puts_the_papers_numbers_only_under_the_benchmarks_they_are_for():
    """GSM8K recipes get Table 1's GSM8K cells (3B and 7B, base and trained); the Table 2 setting (MATH500, AIME,
    AMC) gets the 7B MATH500 cells of the trained variants and no GSM8K number; a recipe with neither gets none."""
    from qerl.recipe import load_recipe
    from qerl.report import _cells, _columns, _notes, _title

    def rows(variants):
        return [{"variant": v, "format": v.split("-")[1] if "-" in v else v, "status": "ok",
                 "trained": not v.startswith("base-")} for v in variants]

    smoke = load_recipe(SMOKE, {})
    assert _columns(smoke)[-2:] == ["paper Qwen2.5-3B GSM8K %", "paper Qwen2.5-7B GSM8K %"]
    base, aqn = rows(["base-bf16", "qerl-nvfp4-aqn"])
    assert _cells(smoke, {**base, "gsm8k": {}})[-2:] == ["61.2", "76.3"]
    assert _cells(smoke, {**aqn, "gsm8k": {}})[-2:] == ["83.7", "90.8"]
    assert _title(smoke).startswith("Table 1,") and "GSM8K" in _notes(smoke)[-1]

    dapo = load_recipe("qwen2.5-7b-dapo", {"formats": ["bf16", "nf4", "nvfp4"]})
    cols = _columns(dapo)
    assert cols[-1] == "paper Qwen2.5-7B MATH500 %" and not any("GSM8K" in c for c in cols)
    evals = {b: {} for b in dapo.benchmark_names()}
    got = {r["variant"]: _cells(dapo, {**r, **evals})[-1] for r in rows(["base-nvfp4", "lora-bf16", "qlora-nf4", "lora-mxfp4",
                                                           "qerl-nvfp4", "qerl-nvfp4-aqn"])}
    assert got == {"base-nvfp4": "-", "lora-bf16": "77.0", "qlora-nf4": "76.4", "lora-mxfp4": "-",
                   "qerl-nvfp4": "77.4", "qerl-nvfp4-aqn": "77.4"}
    assert _title(dapo).startswith("Table 2 setting,") and "MATH500" in _notes(dapo)[-1]

    arith = load_recipe(SMOKE, {"benchmarks": [{"name": "arith"}]})
    assert not any(c.startswith("paper ") for c in _columns(arith)) and "none" in _notes(arith)[-1]
    assert _title(arith) == "Base and RL-trained: accuracy by weight format (recipe `smoke`)"  # neither paper table
    assert _title(load_recipe(SMOKE, {"benchmarks": [{"name": "aime24"}], "train": None})).startswith(
        "Table 2 setting, base models:")


def test_training_curves_pair_each_formats_variants_by_colour():
    """One colour per weight format, AQN dashed: qerl-nvfp4 and qerl-nvfp4-aqn read as a pair; formats differ."""
    from qerl.recipe import VARIANTS
    from qerl.report import _curve_style

    styles = {v: _curve_style(v, i) for i, v in enumerate(VARIANTS)}
    assert styles["qerl-nvfp4"][0] == styles["qerl-nvfp4-aqn"][0] and (styles["qerl-nvfp4"][1], styles["qerl-nvfp4-aqn"][1]) == ("-", "--")
    assert len({styles[v][0] for v in ("lora-bf16", "qlora-nf4", "lora-mxfp4", "qerl-nvfp4")}) == 4
    assert all(s[1] == ("--" if VARIANTS[v][1] else "-") for v, s in styles.items())
    assert _curve_style("grpo-nvfp4", 0)[0] not in {s[0] for s in styles.values()}
