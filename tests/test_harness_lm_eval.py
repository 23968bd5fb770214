"""lm-eval model `qerl` (qerl.eval.lm_eval_model) and the harness entry point (qerl.eval.harness).

Real lm-eval 0.4.13 (registry, TaskManager, simple_evaluate, gsm8k filters / exact_match) over a
tiny random Llama quantised to NVFP4 (a real qerl checkpoint) with a real PEFT LoRA adapter whose
lora_B is perturbed, so every result must change when the adapter is applied. Offline: the GSM8K
task reads the local data directory. Run:  pytest tests/test_harness_lm_eval.py -q
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- fixtures


def make_tiny_checkpoint(out: Path, fmt: str = "nvfp4") -> Path:
    import torch

    from qerl.checkpoint import save_quantized
    from qerl.model import build_random, embedded_tokenizer
    from qerl.quantize import quantize_

    model = build_random("tiny-llama", dtype=torch.bfloat16, seed=0)
    if fmt != "bf16":
        quantize_(model, fmt, progress=False)
    return save_quantized(model, embedded_tokenizer(), out, fmt)


def make_adapter(checkpoint: Path, out: Path, scale: float = 0.5, hidden: int | None = None) -> Path:
    """A saved PEFT adapter with a non-zero lora_B (PEFT initialises B to 0: no effect)."""
    import torch

    from qerl.checkpoint import load_quantized
    from qerl.nn.lora import LoraSettings, apply_lora

    if hidden is None:
        model, _ = load_quantized(checkpoint)
    else:  # another base: same layer names, other widths
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
    peft_model = apply_lora(model, LoraSettings(r=8, lora_alpha=16))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "nvfp4")


@pytest.fixture(scope="module")
def adapter(ckpt, tmp_path_factory) -> Path:
    return make_adapter(ckpt, tmp_path_factory.mktemp("adapter") / "adapter")


@pytest.fixture(scope="module")
def lms(ckpt, adapter):
    from qerl.eval.lm_eval_model import QerlLM

    return QerlLM(checkpoint=str(ckpt), batch_size=4), QerlLM(checkpoint=str(ckpt), adapter=str(adapter), batch_size=4)


def _inst(kind: str, args, idx: int = 0):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


# ----------------------------------------------------------------------------- registry


def test_qerl_is_registered_next_to_lm_evals_own_models():
    from lm_eval.api.registry import get_model

    from qerl.eval.lm_eval_model import QerlLM

    assert get_model("qerl") is QerlLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models are still there


# ----------------------------------------------------------------------------- scoring


def test_loglikelihood_is_the_forward_pass_logprob_and_depends_on_the_adapter(lms):
    import torch

    base, tuned = lms
    ctx, cont = "Question: 2 + 3 =", " 5 apples"
    reqs = [_inst("loglikelihood", (ctx, cont)), _inst("loglikelihood", ("The sky is", " blue"), 1)]
    got_base = base.loglikelihood(reqs)
    got_tuned = tuned.loglikelihood(reqs)

    # the same number by hand: one forward pass over context + continuation
    c_ids, k_ids = base._encode_pair(ctx, cont)
    ids = torch.tensor([c_ids + k_ids])
    with torch.no_grad():
        logp = torch.log_softmax(base.model(input_ids=ids).logits.float(), -1)[0]
    want = sum(float(logp[len(c_ids) - 1 + i, t]) for i, t in enumerate(k_ids))
    assert got_base[0][0] == pytest.approx(want, abs=1e-4)
    assert all(math.isfinite(lp) and lp < 0 for lp, _ in got_base + got_tuned)
    assert abs(got_base[0][0] - got_tuned[0][0]) > 1e-2, "the adapter must change the log-probabilities"


def test_loglikelihood_rolling_sums_every_token_once(lms):
    import torch

    base, _ = lms
    text = "One two three four five six seven eight nine ten."
    full = base.loglikelihood_rolling([_inst("loglikelihood_rolling", (text,))])[0]
    toks = base.tok_encode(text)
    ids = torch.tensor([[base.prefix_token_id] + toks[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(base.model(input_ids=ids).logits.float(), -1)[0]
    want = sum(float(logp[i, t]) for i, t in enumerate(toks))
    assert full == pytest.approx(want, abs=1e-3)
    base._max_length = 4  # windows of 4 tokens: every token still predicted once, with less context
    try:
        windowed = base.loglikelihood_rolling([_inst("loglikelihood_rolling", (text,))])[0]
    finally:
        base._max_length = 8192
    assert math.isfinite(windowed) and windowed != pytest.approx(full, abs=1e-3)


def test_scores_equal_lm_evals_own_hf_model_on_the_dequantised_weights(lms, ckpt):
    """lm-eval's own `HFLM` over a plain Hugging Face model holding the checkpoint's dequantised weights scores
    what `qerl` scores: loglikelihood (context / continuation split, greedy flag) and loglikelihood_rolling."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from qerl.checkpoint import load_quantized
    from qerl.quantize import dequantize_

    base, _ = lms
    model, tok = load_quantized(ckpt)
    plain = copy.deepcopy(model)  # by default the new layers take the model's own dtype
    assert dequantize_(plain) > 0 and len({p.dtype for p in plain.parameters()}) == 1
    # in float32 the dequantised weights are exact: what qerl's CPU evaluation computes with
    assert dequantize_(model, torch.float32) > 0
    theirs = HFLM(pretrained=model.float().eval(), tokenizer=tok, batch_size=4, device="cpu", max_length=base.max_length)
    pairs = [("Question: 2 + 3 =", " 5 apples"), ("The sky is", " blue"), ("a", "bc d"), ("x y z", " ")]
    reqs = [_inst("loglikelihood", pair, i) for i, pair in enumerate(pairs)]
    for (ours, greedy), (want, want_greedy) in zip(base.loglikelihood(reqs), theirs.loglikelihood(reqs)):
        assert ours == pytest.approx(want, abs=1e-4) and greedy == want_greedy
    text = "One two three four five six seven eight nine ten."
    rolling = [_inst("loglikelihood_rolling", (text,))]
    assert base.loglikelihood_rolling(rolling)[0] == pytest.approx(theirs.loglikelihood_rolling(rolling)[0], abs=1e-3)


# ----------------------------------------------------------------------------- generation


def test_generate_until_is_qerls_greedy_decoding_cut_at_until(lms):
    from qerl.eval.generate import GenerationSettings, generate

    base, tuned = lms
    prompts = ["Hello there", "Count: 1, 2, 3,"]
    kwargs = {"until": ["</s>"], "max_gen_toks": 12, "do_sample": False, "temperature": 0.0}
    out = base.generate_until([_inst("generate_until", (p, kwargs), i) for i, p in enumerate(prompts)])
    ref = generate(base.model, base.tokenizer, prompts, GenerationSettings(max_new_tokens=12, batch_size=4), progress=False)
    assert out == [g.text for g in ref]
    # a stop string from the text itself cuts it there
    stop = ref[0].text[3:6]
    assert stop and base.generate_until([_inst("generate_until", (prompts[0], {**kwargs, "until": [stop]}))])[0] == ref[0].text[: ref[0].text.find(stop)]
    tuned_out = tuned.generate_until([_inst("generate_until", (p, kwargs), i) for i, p in enumerate(prompts)])
    assert tuned_out != out, "the adapter must change the generations"


# ----------------------------------------------------------------------------- lm-eval tasks on local data


def test_simple_evaluate_runs_lm_evals_gsm8k_on_local_files(lms, data_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from qerl.eval.lm_eval_model import lm_eval_task_dir

    base, _ = lms
    tm = TaskManager(include_path=str(lm_eval_task_dir(data_dir)))
    out = lm_eval.simple_evaluate(
        model=base, tasks=["gsm8k"], task_manager=tm, limit=2, gen_kwargs={"max_gen_toks": 4},
        bootstrap_iters=0, log_samples=True,
    )
    assert out["versions"]["gsm8k"] == 3.0  # lm-eval's own gsm8k config
    assert out["n-shot"]["gsm8k"] == 5
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(out["results"]["gsm8k"])
    first = json.loads((Path(data_dir) / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    docs = sorted(out["samples"]["gsm8k"], key=lambda s: s["doc_id"])
    assert docs[0]["doc"]["question"] == first["question"]  # the local file, first rows
    assert docs[0]["arguments"][0][0].count("Question:") == 6  # 5 shots from train.jsonl + the problem


def test_harness_lm_eval_applies_the_adapter_and_reports_meta(ckpt, adapter, data_dir):
    from qerl.eval.generate import GenerationSettings
    from qerl.eval.harness import evaluate_with_harness

    gen = GenerationSettings(max_new_tokens=8, batch_size=4)
    res_b, meta_b = evaluate_with_harness("lm-eval", str(ckpt), None, "gsm8k", data_dir=data_dir, limit=3, generation=gen)
    res_a, meta_a = evaluate_with_harness("lm-eval", str(ckpt), str(adapter), "gsm8k", data_dir=data_dir, limit=3, generation=gen)
    for meta in (meta_b, meta_a):
        assert meta["harness"] == "lm-eval" and meta["harness_version"] == lm_eval_version()
        assert meta["task"] == "gsm8k" and meta["task_version"] == 3.0
        assert meta["metric"] == "exact_match,flexible-extract"
    assert meta_a["adapter"] == str(adapter)
    assert res_a.n == 3 and len(res_a.records) == 3
    rec = res_a.records[0]
    assert {"id", "question", "gold", "completion", "extracted", "correct", "num_tokens", "entropy"} <= set(rec)
    assert rec["num_tokens"] and rec["entropy"] is not None
    assert [r["completion"] for r in res_a.records] != [r["completion"] for r in res_b.records]


def lm_eval_version() -> str:
    import lm_eval

    return lm_eval.__version__


# ----------------------------------------------------------------------------- bad input


def test_bad_input_is_a_value_error_with_one_line(ckpt, adapter, data_dir, tmp_path):
    from qerl.data import DataError
    from qerl.eval.generate import GenerationSettings
    from qerl.eval.harness import HarnessError, check_adapter, evaluate_with_harness

    gen = GenerationSettings(max_new_tokens=4)
    run = lambda **kw: evaluate_with_harness(  # noqa: E731
        kw.pop("harness", "lm-eval"), str(ckpt), kw.pop("adapter", None), kw.pop("bench", "gsm8k"),
        data_dir=kw.pop("data", data_dir), limit=1, generation=gen,
    )
    cases = [
        (dict(adapter=str(tmp_path / "missing")), HarnessError, "does not exist"),
        (dict(bench="math500"), HarnessError, "unknown task"),
        (dict(harness="helm"), HarnessError, "unknown harness"),
        (dict(data=tmp_path), DataError, "gsm8k/test.jsonl"),
    ]
    empty = tmp_path / "empty_adapter"
    empty.mkdir()
    cases.append((dict(adapter=str(empty)), HarnessError, "adapter_config.json"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    cases.append((dict(adapter=str(no_weights)), HarnessError, "adapter_model.safetensors"))
    foreign = make_adapter(ckpt, tmp_path / "foreign", hidden=32)
    cases.append((dict(adapter=str(foreign)), HarnessError, "another base"))
    for kwargs, exc, words in cases:
        with pytest.raises(exc) as info:
            run(**kwargs)
        assert isinstance(info.value, ValueError)
        msg = str(info.value)
        assert "\n" not in msg and words in msg, msg
    check_adapter(adapter, ckpt)  # the right adapter passes


def _cli(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)


@pytest.mark.slow
def test_lm_eval_cli_front_end_runs_and_rejects_bad_input(ckpt, adapter, data_dir, tmp_path):
    base = ["-m", "qerl.eval.lm_eval_model", "--model", "qerl", "--device", "cpu", "--limit", "1", "--data_dir", str(data_dir)]
    ok = _cli(*base, "--model_args", f"checkpoint={ckpt},adapter={adapter},max_new_tokens=4", "--tasks", "gsm8k_qerl",
              "--apply_chat_template")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "gsm8k_qerl" in ok.stdout and "exact_match" in ok.stdout
    bad = [
        (["--model_args", f"checkpoint={ckpt},adapter={tmp_path / 'nope'}", "--tasks", "gsm8k"], "does not exist"),
        (["--model_args", f"checkpoint={ckpt}", "--tasks", "no_such_task_xyz"], "no_such_task_xyz"),
    ]
    for extra, words in bad:
        r = _cli(*base, *extra)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith("error: ") and words in last, (r.returncode, r.stderr[-1500:])
    empty = tmp_path / "data"
    empty.mkdir()
    r = _cli("-m", "qerl.eval.lm_eval_model", "--model", "qerl", "--model_args", f"checkpoint={ckpt}", "--tasks", "gsm8k",
             "--data_dir", str(empty))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("error: ") and "gsm8k" in last, r.stderr[-1500:]
