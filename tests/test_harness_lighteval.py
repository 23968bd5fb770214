"""lighteval model + local tasks (qerl.eval.lighteval_model, qerl.eval.lighteval_tasks).

Real lighteval 0.13 (LightevalTask, Pipeline, PassAtK, details/metrics loggers) over a tiny
NVFP4 checkpoint with a perturbed LoRA adapter, and once over the embedded model (slow). The
tasks read the local data directory; grading is math-verify through qerl.eval.grading.
Run:  pytest tests/test_harness_lighteval.py -q
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lighteval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from test_harness_lm_eval import make_adapter, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("le_ckpt") / "nvfp4")


@pytest.fixture(scope="module")
def adapter(ckpt, tmp_path_factory):
    return make_adapter(ckpt, tmp_path_factory.mktemp("le_adapter") / "adapter")


def _sampling(max_new_tokens=6):
    from qerl.eval.generate import GenerationSettings

    return GenerationSettings(temperature=0.6, top_p=0.95, max_new_tokens=max_new_tokens, batch_size=8, seed=3)


# ----------------------------------------------------------------------------- metric


def test_pass_at_1_over_k_samples_is_lightevals_estimator_with_math_verify():
    from lighteval.models.model_output import ModelResponse
    from lighteval.tasks.requests import Doc

    from qerl.eval.lighteval_tasks import pass_at_1_metric

    m = pass_at_1_metric("aime24", 4)
    assert m.metric_name == "pass@k:k=1&n=4"
    doc = Doc(query="q", choices=["025"], gold_index=0)
    resp = ModelResponse(text=["so \\boxed{25}", "\\boxed{7}", "\\boxed{025}", "no answer"])
    assert m.compute_sample(doc=doc, model_response=resp)[m.metric_name] == pytest.approx(0.5)
    m500 = pass_at_1_metric("math500", 2)
    doc = Doc(query="q", choices=["\\frac{1}{2}"], gold_index=0)
    resp = ModelResponse(text=["the answer is \\boxed{0.5}", "\\boxed{\\dfrac12}"])
    assert m500.compute_sample(doc=doc, model_response=resp)[m500.metric_name] == pytest.approx(1.0)


def test_metric_grades_correctly_off_the_main_thread():
    """The Prefect evaluate task runs in a worker thread; math_verify must still grade there."""
    from concurrent.futures import ThreadPoolExecutor

    from lighteval.models.model_output import ModelResponse
    from lighteval.tasks.requests import Doc

    from qerl.eval.lighteval_tasks import pass_at_1_metric

    m = pass_at_1_metric("math500", 1)
    doc = Doc(query="q", choices=["\\frac{\\sqrt{3}}{2}"], gold_index=0)
    resp = ModelResponse(text=["\\boxed{\\frac{\\sqrt3}{2}}"])
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(lambda: m.compute_sample(doc=doc, model_response=resp)).result()
    assert got[m.metric_name] == 1.0


# ----------------------------------------------------------------------------- tasks and pipeline


def test_all_four_tasks_read_the_local_files(data_dir):
    from qerl.data import load_benchmark
    from qerl.eval.lighteval_tasks import TASKS, make_task_configs
    from lighteval.tasks.lighteval_task import LightevalTask

    for cfg in make_task_configs(data_dir, limit=3):
        task = LightevalTask(cfg)
        docs = task.eval_docs()
        want = load_benchmark(TASKS[cfg.name], data_dir=data_dir, limit=3)
        assert [d.specific["id"] for d in docs] == [p.id for p in want]  # the first rows, in order
        assert [d.get_golds()[0] for d in docs] == [p.answer for p in want]
        assert "\\boxed{}" in docs[0].query


def test_pipeline_runs_k_samples_with_the_adapter_applied(ckpt, adapter, data_dir):
    from qerl.eval.harness import evaluate_with_harness

    res_b, meta_b = evaluate_with_harness("lighteval", str(ckpt), None, "aime24", data_dir=data_dir, limit=2,
                                          generation=_sampling(), num_samples=3)
    res_a, meta_a = evaluate_with_harness("lighteval", str(ckpt), str(adapter), "aime24", data_dir=data_dir, limit=2,
                                          generation=_sampling(), num_samples=3)
    assert meta_a["harness"] == "lighteval" and meta_a["harness_version"].startswith("0.13")
    assert meta_a["task"] == "aime24" and meta_a["task_version"] == 1
    assert meta_a["metric"].startswith("pass@k:k=1&n=3")
    assert meta_a["temperature"] == 0.6 and meta_a["top_p"] == 0.95
    assert res_a.n == 2 and res_a.num_samples == 3 and len(res_a.records) == 6
    assert {r["sample"] for r in res_a.records} == {0, 1, 2}
    assert all(r["num_tokens"] and r["entropy"] is not None for r in res_a.records)
    assert [r["completion"] for r in res_a.records] != [r["completion"] for r in res_b.records]
    # lighteval switches autograd off process-wide when its pipeline is imported; we restore it
    import torch

    assert torch.is_grad_enabled()


def test_lighteval_model_loglikelihood_depends_on_the_adapter(ckpt, adapter):
    from lighteval.tasks.requests import Doc

    from qerl.eval.lighteval_model import QerlLightevalModel, QerlLightevalModelConfig

    doc = Doc(query="What is 2 + 3?", choices=[" 5", " 7"], gold_index=0)
    base = QerlLightevalModel(QerlLightevalModelConfig(checkpoint=str(ckpt)))
    tuned = QerlLightevalModel(QerlLightevalModelConfig(checkpoint=str(ckpt), adapter=str(adapter)))
    lb, lt = base.loglikelihood([doc])[0].logprobs, tuned.loglikelihood([doc])[0].logprobs
    assert len(lb) == 2 and all(x < 0 for x in lb)
    assert max(abs(a - b) for a, b in zip(lb, lt)) > 1e-2
    roll = base.loglikelihood_rolling([doc])[0].logprobs[0]
    assert roll < 0


def test_bad_input(ckpt, data_dir, tmp_path):
    from qerl.data import DataError
    from qerl.eval.generate import GenerationSettings
    from qerl.eval.harness import HarnessError, evaluate_with_harness

    with pytest.raises(HarnessError, match="unknown task 'gsm8k' for lighteval"):
        evaluate_with_harness("lighteval", str(ckpt), None, "gsm8k", data_dir=data_dir, limit=1, generation=_sampling())
    (tmp_path / "aime24").mkdir()
    with pytest.raises(DataError, match="aime24/test.jsonl"):
        evaluate_with_harness("lighteval", str(ckpt), None, "aime24", data_dir=tmp_path, limit=1, generation=_sampling())
    with pytest.raises(HarnessError, match="temperature"):
        evaluate_with_harness("lighteval", str(ckpt), None, "aime24", data_dir=data_dir, limit=1,
                              generation=GenerationSettings(max_new_tokens=4), num_samples=2)


@pytest.mark.slow
def test_embedded_model_on_each_math_task(data_dir, tmp_path):
    """The embedded SmolLM2-135M through lighteval on 2 problems of each task, 2 samples, 8 tokens."""
    from qerl.checkpoint import save_quantized
    from qerl.eval.harness import evaluate_with_harness, load_for_eval
    from qerl.model import ModelSpec, load_model

    model, tok = load_model(ModelSpec(name="embedded"))
    ckpt = save_quantized(model, tok, tmp_path / "bf16", "bf16")
    del model
    m, t = load_for_eval(ckpt)
    for bench in ("math500", "aime24", "aime25", "amc23"):
        res, meta = evaluate_with_harness("lighteval", str(ckpt), None, bench, data_dir=data_dir, limit=2,
                                          generation=_sampling(8), num_samples=2, model=m, tokenizer=t)
        assert res.n == 2 and len(res.records) == 4, bench
        assert meta["metric"].startswith("pass@k:k=1&n=2")
        assert all(r["completion"].strip() for r in res.records)  # the model answered something

