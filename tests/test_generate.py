"""Generation (greedy / sampled, batched, stop tokens, entropy) and benchmark evaluation.

Fast tests use the tiny random Llama from conftest.py; the `slow` test runs the embedded
SmolLM2-135M-Instruct GGUF on 4 GSM8K problems end to end.
"""

from __future__ import annotations

import json
import math

import pydantic
import pytest
import torch

from qerl.data import Problem
from qerl.eval.evaluate import EvalResult, evaluate_benchmark, to_jsonl
from qerl.eval.generate import (
    Generation,
    GenerationSettings,
    _sample,
    build_prompt,
    generate,
    stop_token_ids,
)

IM_END, ENDOFTEXT = 151645, 151643
QUESTIONS = [
    "What is 2+2?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Hi",
]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [build_prompt(tiny_tokenizer, q, "gsm8k") for q in QUESTIONS]


class _StopAt:
    """Forward hook: on the `call`-th forward pass, make <|im_end|> the argmax of `rows`."""

    def __init__(self, call: int, rows=None):
        self.call, self.rows, self.n = call, rows, 0

    def __call__(self, module, args, output):
        self.n += 1
        if self.n == self.call:
            rows = slice(None) if self.rows is None else self.rows
            output.logits[rows, -1, IM_END] = 1e4
        return output


# ----------------------------------------------------------------------------- settings, prompts


def test_settings_validation():
    s = GenerationSettings()
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.num_samples, s.batch_size, s.seed) == (
        256, 0.0, 1.0, 0, 1, 8, 0
    )
    assert not s.do_sample and GenerationSettings(temperature=0.6).do_sample
    for bad in (
        {"max_new_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"batch_size": 0},
        {"num_samples": 0},
        {"num_samples": 4},  # greedy: 4 identical samples
        {"max_tokens": 5},  # unknown key
    ):
        with pytest.raises(pydantic.ValidationError):
            GenerationSettings(**bad)
    GenerationSettings(num_samples=4, temperature=0.6, top_p=0.95)


def test_build_prompt(tiny_tokenizer):
    p = build_prompt(tiny_tokenizer, "How many eggs?", "gsm8k")
    assert p.startswith("<|im_start|>user\nHow many eggs?") and '"####"' in p
    assert p.endswith("<|im_end|>\n<|im_start|>assistant\n")
    m = build_prompt(tiny_tokenizer, "Solve x.", "math500")
    assert "\\boxed{}" in m and "####" not in m


def test_stop_token_ids(tiny_tokenizer):
    assert stop_token_ids(tiny_tokenizer) == [ENDOFTEXT, IM_END]  # eos first, then <|im_end|>


# ----------------------------------------------------------------------------- greedy decoding


def test_greedy_deterministic_and_matches_hf(tiny_model, tiny_tokenizer, prompts):
    s = GenerationSettings(max_new_tokens=8)
    a = generate(tiny_model, tiny_tokenizer, prompts[:1], s, progress=False)
    b = generate(tiny_model, tiny_tokenizer, prompts[:1], s, progress=False)
    assert isinstance(a[0], Generation)
    assert a[0].token_ids == b[0].token_ids and a[0].num_tokens == 8 and not a[0].finished

    enc = tiny_tokenizer(prompts[0], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        hf = tiny_model.generate(
            **enc, max_new_tokens=8, do_sample=False, eos_token_id=[ENDOFTEXT, IM_END], pad_token_id=ENDOFTEXT
        )
    assert a[0].token_ids == hf[0, enc.input_ids.shape[1] :].tolist()
    assert a[0].text == tiny_tokenizer.decode(a[0].token_ids, skip_special_tokens=True)


def test_entropy_finite_positive_and_exact(tiny_model, tiny_tokenizer, prompts):
    g = generate(tiny_model, tiny_tokenizer, prompts[:1], GenerationSettings(max_new_tokens=3), progress=False)[0]
    assert math.isfinite(g.mean_entropy) and 0.0 < g.mean_entropy <= math.log(len(tiny_tokenizer)) + 1e-4
    assert len(g.token_entropies) == g.num_tokens == 3
    # first generated token: entropy of softmax(logits) of the prompt's last position
    enc = tiny_tokenizer(prompts[0], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        logits = tiny_model(**enc).logits[0, -1].float()
    logp = torch.log_softmax(logits, -1)
    assert g.token_entropies[0] == pytest.approx(float(-(logp.exp() * logp).sum()), abs=1e-4)
    assert g.mean_entropy == pytest.approx(sum(g.token_entropies) / 3, rel=1e-6)


def test_batched_equals_one_at_a_time(tiny_model, tiny_tokenizer, prompts):
    lengths = {len(tiny_tokenizer(p, add_special_tokens=False).input_ids) for p in prompts}
    assert len(lengths) == len(prompts)  # really different lengths, so left padding is exercised
    batched = generate(tiny_model, tiny_tokenizer, prompts, GenerationSettings(max_new_tokens=6, batch_size=3), progress=False)
    single = [
        generate(tiny_model, tiny_tokenizer, [p], GenerationSettings(max_new_tokens=6), progress=False)[0] for p in prompts
    ]
    for b, s in zip(batched, single):
        assert b.token_ids == s.token_ids
        assert b.text == s.text
        assert b.mean_entropy == pytest.approx(s.mean_entropy, abs=1e-4)


def test_stops_at_im_end(tiny_model, tiny_tokenizer, prompts):
    # forward hooks force the stop token: they see the Hugging Face loop's forward calls, so this
    # tests that loop (the engine's stops: tests/test_rollout_engine.py)
    s = GenerationSettings(max_new_tokens=7, engine="hf")
    handle = tiny_model.register_forward_hook(_StopAt(call=4))  # prefill = call 1 -> 4th token
    try:
        g = generate(tiny_model, tiny_tokenizer, prompts[:2], GenerationSettings(max_new_tokens=7, batch_size=2, engine="hf"), progress=False)
    finally:
        handle.remove()
    for x in g:
        assert x.finished and x.num_tokens == 4 and x.token_ids[-1] == IM_END
        assert x.text == tiny_tokenizer.decode(x.token_ids[:3], skip_special_tokens=True)
        assert "<|im_end|>" not in x.text

    # only one row of the batch stops; the other goes on exactly as it would alone
    free = [generate(tiny_model, tiny_tokenizer, [p], s, progress=False)[0] for p in prompts[:2]]
    handle = tiny_model.register_forward_hook(_StopAt(call=3, rows=[0]))
    try:
        g = generate(tiny_model, tiny_tokenizer, prompts[:2], GenerationSettings(max_new_tokens=7, batch_size=2, engine="hf"), progress=False)
    finally:
        handle.remove()
    stopped = [x for x in g if x.finished]
    running = [(x, f) for x, f in zip(g, free) if not x.finished]
    assert len(stopped) == 1 and len(running) == 1
    assert stopped[0].num_tokens == 3 and stopped[0].token_ids[-1] == IM_END
    x, f = running[0]
    assert x.num_tokens == 7 and x.token_ids == f.token_ids


def test_restores_training_mode(tiny_model, tiny_tokenizer, prompts):
    tiny_model.train()
    try:
        generate(tiny_model, tiny_tokenizer, prompts[:1], GenerationSettings(max_new_tokens=1), progress=False)
        assert tiny_model.training
    finally:
        tiny_model.eval()


# ----------------------------------------------------------------------------- sampling


def test_sampling_seeded(tiny_model, tiny_tokenizer, prompts):
    s = GenerationSettings(max_new_tokens=6, temperature=1.0, top_k=50, top_p=0.95, seed=1)
    a = generate(tiny_model, tiny_tokenizer, prompts, s, progress=False)
    b = generate(tiny_model, tiny_tokenizer, prompts, s, progress=False)
    c = generate(tiny_model, tiny_tokenizer, prompts, s.model_copy(update={"seed": 2}), progress=False)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    greedy = generate(tiny_model, tiny_tokenizer, prompts, GenerationSettings(max_new_tokens=6), progress=False)
    assert [g.token_ids for g in a] != [g.token_ids for g in greedy]


def test_sample_top_k_top_p():
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    draws = _sample(logits, GenerationSettings(temperature=1.0, top_k=2), gen)
    assert set(draws.tolist()) == {0, 1}
    draws = _sample(logits, GenerationSettings(temperature=1.0, top_p=0.8), gen)  # 0.5 + 0.3 >= 0.8
    assert set(draws.tolist()) == {0, 1}
    draws = _sample(logits, GenerationSettings(temperature=1.0, top_p=0.81), gen)
    assert set(draws.tolist()) == {0, 1, 2}
    draws = _sample(logits, GenerationSettings(temperature=1.0, top_p=0.01), gen)
    assert set(draws.tolist()) == {0}
    freq = (_sample(logits, GenerationSettings(temperature=1.0), gen) == 0).float().mean()
    assert abs(float(freq) - 0.5) < 0.05


# ----------------------------------------------------------------------------- evaluation


def _problems(n):
    return [Problem(id=str(i), question=f"What is {i} + {i}?", answer=str(2 * i), benchmark="gsm8k") for i in range(n)]


def test_evaluate_benchmark_tiny(tiny_model, tiny_tokenizer, tmp_path):
    res = evaluate_benchmark(
        tiny_model, tiny_tokenizer, "gsm8k", _problems(3), GenerationSettings(max_new_tokens=3), progress=False
    )
    assert isinstance(res, EvalResult) and res.n == 3 and len(res.records) == 3
    assert 0.0 <= res.accuracy <= 1.0 and res.ci_low <= res.accuracy <= res.ci_high
    assert res.mean_completion_tokens == 3 and math.isfinite(res.mean_entropy) and res.mean_entropy > 0
    r = res.records[0]
    assert set(r) >= {"id", "question", "gold", "completion", "extracted", "correct", "num_tokens", "entropy"}
    path = to_jsonl(res.records, tmp_path / "out" / "gsm8k.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == res.records


def test_evaluate_benchmark_samples(tiny_model, tiny_tokenizer):
    s = GenerationSettings(max_new_tokens=2, temperature=1.0, num_samples=3, batch_size=4)
    res = evaluate_benchmark(tiny_model, tiny_tokenizer, "gsm8k", _problems(2), s, progress=False)
    assert res.n == 2 and res.num_samples == 3 and len(res.records) == 6
    assert [r["id"] for r in res.records] == ["0", "0", "0", "1", "1", "1"]
    assert [r["sample"] for r in res.records] == [0, 1, 2, 0, 1, 2]
    assert res.correct == pytest.approx(sum(r["correct"] for r in res.records) / 3)


def test_evaluate_grades_with_the_benchmark_rule(tiny_tokenizer, monkeypatch):
    """Graded correct when the completion says the gold answer (generation stubbed out)."""
    import qerl.eval.evaluate as ev

    def fake_generate(model, tokenizer, prompts, settings, progress=True):
        texts = ["so #### 0", "#### 3", r"\boxed{4}"]
        return [Generation(text=t, token_ids=[1, 2], num_tokens=2, mean_entropy=1.0, finished=True) for t in texts]

    monkeypatch.setattr(ev, "generate", fake_generate)
    res = ev.evaluate_benchmark(None, tiny_tokenizer, "gsm8k", _problems(3), GenerationSettings(), progress=False)
    assert [r["correct"] for r in res.records] == [True, False, True]
    assert res.correct == 2 and res.accuracy == pytest.approx(2 / 3)
    assert [r["extracted"] for r in res.records] == ["0", "3", "4"]


# ----------------------------------------------------------------------------- real model (slow)


@pytest.mark.slow
def test_smollm2_gsm8k_end_to_end(data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.data import load_benchmark
    from qerl.model import embedded_dir

    model_dir = str(embedded_dir())
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf, dtype=torch.bfloat16)
    assert tokenizer.eos_token == "<|im_start|>"  # the GGUF quirk stop_token_ids works around
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tokenizer)

    problems = load_benchmark("gsm8k", data_dir, limit=4)
    res = evaluate_benchmark(
        model, tokenizer, "gsm8k", problems, GenerationSettings(max_new_tokens=128, batch_size=4), progress=False
    )
    assert res.n == 4 and len(res.records) == 4
    assert 0.0 <= res.accuracy <= 1.0
    assert all(r["completion"].strip() for r in res.records)
    assert all(1 <= r["num_tokens"] <= 128 for r in res.records)
    assert math.isfinite(res.mean_entropy) and res.mean_entropy > 0
    print(res.summary())


def test_engine_and_hf_loop_agree(tiny_model, tiny_tokenizer, prompts):
    """engine: qerl (the default) and engine: hf give the same greedy tokens, texts and entropies."""
    s = GenerationSettings(max_new_tokens=8, batch_size=3)
    a = generate(tiny_model, tiny_tokenizer, prompts, s, progress=False)
    b = generate(tiny_model, tiny_tokenizer, prompts, s.model_copy(update={"engine": "hf"}), progress=False)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finished == y.finished
        assert x.token_entropies == pytest.approx(y.token_entropies, abs=1e-4)
