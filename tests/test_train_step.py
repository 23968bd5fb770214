"""The pipeline's train step on the smoke recipe (tiny random Llama, generated arith problems),
with a real MLflow SQLite store: per-step metrics, a NaN that stops the run (FAILED, last good
checkpoint kept), and a real training process killed with SIGKILL that a rerun resumes with the
same step count and no lost metrics (the killed run is marked KILLED).

    python -m pytest tests/test_train_step.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "recipes" / "smoke.yaml")


def _recipe(tmp_path: Path, **extra):
    from qerl.recipe import load_recipe

    ov = {
        "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "mlflow.experiment": "test-train",
        "output_dir": str(tmp_path / "out"),
        "report_dir": str(tmp_path / "reports"),
        "formats": ["nvfp4"],
        "train.variants": ["qerl-nvfp4-aqn"],
        **extra,
    }
    return load_recipe(SMOKE, ov), ov


def _client(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def _train_runs(client) -> list:
    exp = client.get_experiment_by_name("test-train")
    return client.search_runs([exp.experiment_id], filter_string="tags.step = 'train'", order_by=["attributes.start_time ASC"])


def test_nan_reward_fails_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    from qerl import pipeline
    from qerl.rl import rewards
    from qerl.rl.trainer import TrainingError

    recipe, _ = _recipe(tmp_path, **{"train.grpo.max_steps": 4, "train.grpo.save_steps": 1})
    ckpt = pipeline.quantize_step(recipe, "nvfp4", progress=False)
    real = rewards.accuracy

    def accuracy_then_nan(completions, **kw):  # our own reward function, broken on purpose at step 3
        out = real(completions, **kw)
        return [float("nan")] * len(out) if kw["step"] >= 3 else out

    accuracy_then_nan.is_accuracy = True

    monkeypatch.setattr(rewards, "accuracy", accuracy_then_nan)
    with pytest.raises(TrainingError, match="step 3"):
        pipeline.train_step(recipe, "qerl-nvfp4-aqn", ckpt, progress=False)
    (run,) = _train_runs(_client(tmp_path))
    assert run.info.status == "FAILED"
    assert run.data.tags["error_type"] == "TrainingError" and "reward" in run.data.tags["error"]
    out = pipeline.train_dir(recipe, "qerl-nvfp4-aqn")
    assert (out / "checkpoint-2" / "COMPLETE").is_file() and not (out / "checkpoint-3").exists()
    hist = _client(tmp_path).get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in hist) == [1, 2]  # the good steps were logged


def test_killed_training_resumes_with_same_steps_and_no_lost_metrics(tmp_path):
    from qerl import pipeline

    steps = 10
    recipe, ov = _recipe(tmp_path, **{"train.grpo.max_steps": steps, "train.grpo.save_steps": 1})
    ckpt = pipeline.quantize_step(recipe, "nvfp4", progress=False)
    out = pipeline.train_dir(recipe, "qerl-nvfp4-aqn")
    code = (
        "import json, sys\n"
        "from qerl import pipeline\nfrom qerl.recipe import load_recipe\n"
        f"r = load_recipe({SMOKE!r}, json.loads(sys.argv[1]))\n"
        f"pipeline.train_step(r, 'qerl-nvfp4-aqn', {ckpt!r}, progress=False)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(ov)], cwd=str(ROOT), env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not (out / "checkpoint-3" / "COMPLETE").is_file():
            if proc.poll() is not None:
                pytest.fail(f"training exited before it could be killed:\n{proc.stdout.read().decode()[-3000:]}")
            assert time.time() < deadline, "no checkpoint-3 within 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    done_before = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "COMPLETE").is_file())
    assert 3 <= done_before < steps

    result = pipeline.train_step(recipe, "qerl-nvfp4-aqn", ckpt, progress=False)
    assert result["steps"] == steps
    client = _client(tmp_path)
    killed, resumed = _train_runs(client)
    assert killed.info.status == "KILLED" and killed.data.tags["resumed_by"] == resumed.info.run_id
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags["resumed_from"] == str(done_before)
    for key in ("reward_mean", "entropy", "aqn_sigma", "step_time_s"):
        hist = client.get_metric_history(resumed.info.run_id, key)
        assert sorted(m.step for m in hist) == list(range(1, steps + 1)), key  # whole curve in one run
    history = json.loads((out / "metrics.json").read_text())
    assert [h["step"] for h in history] == list(range(1, steps + 1))
    assert Path(result["adapter"], "adapter_model.safetensors").is_file()


def test_evaluate_step_through_lm_eval_logs_the_harness(tmp_path, data_dir):
    """The recipe picks the harness: lm-eval's gsm8k task on the local data, with an adapter."""
    from mlflow import MlflowClient

    from qerl import pipeline

    recipe, _ = _recipe(
        tmp_path, harness="lm-eval", data_dir=str(data_dir),
        **{"benchmarks.0.limit": 2, "generation.max_new_tokens": 8, "train.grpo.max_steps": 1},
    )
    ckpt = pipeline.quantize_step(recipe, "nvfp4", progress=False)
    trained = pipeline.train_step(recipe, "qerl-nvfp4-aqn", ckpt, progress=False)
    row = pipeline.evaluate_step(recipe, "nvfp4", ckpt, trained=trained, progress=False)
    assert row["variant"] == "qerl-nvfp4-aqn" and row["gsm8k_n"] == 2
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(row["mlflow_run_id"])
    tags = run.data.tags
    assert tags["gsm8k_harness"] == "lm-eval" and tags["gsm8k_harness_version"].startswith("0.4")
    assert tags["gsm8k_task"] and tags["gsm8k_metric"]
    assert run.data.params["adapter"] == trained["adapter"]


def test_evaluate_step_rejects_a_missing_adapter_before_loading(tmp_path):
    from qerl import pipeline
    from qerl.eval.harness import HarnessError

    recipe, _ = _recipe(tmp_path)
    ckpt = pipeline.quantize_step(recipe, "nvfp4", progress=False)
    with pytest.raises(HarnessError, match="adapter"):
        pipeline.evaluate_step(recipe, "nvfp4", ckpt, trained={"variant": "qerl-nvfp4", "adapter": str(tmp_path / "nope")}, progress=False)
