"""The rollout engine (qerl/rollout/engine.py) against Hugging Face on CPU.

- greedy: token for token equal to `model.generate` for 64 new tokens, on the embedded
  SmolLM2-135M-Instruct (real weights: clear logit margins) in float32, on left-padded prompts of
  different lengths, for the bf16 weights and for the nvfp4-quantised model (the same QuantLinear
  modules in both);
- sampled: the recorded logprobs equal a fresh forward over prompt + completion
  (`policy_logprobs`), with LoRA adapters and AQN noise applied;
- AQN: noisy norms change the rollout logits, clean norms give back the clean rollout;
- fusion: q/k/v and gate/up become one product over one copy of the weights.

GPU runs (CUDA graphs, bf16) are covered by benchmarks/bench_rollout.py --check.
"""

from __future__ import annotations

import copy

import pytest
import torch

from qerl.rl.rollout import RolloutSettings, policy_logprobs
from qerl.rollout.engine import EngineError, RolloutEngine, engine_rollouts

PROMPTS = [
    "<|im_start|>user\nWhat is 17 + 25? Answer with a number.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def embedded():
    from qerl.model import ModelSpec, load_model, to_inference

    model, tok = load_model(ModelSpec(name="embedded"))
    return to_inference(model), tok


def _hf_greedy(model, tok, prompts, new_tokens):
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    att = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    out = model.generate(input_ids=inp, attention_mask=att, max_new_tokens=new_tokens, do_sample=False,
                         min_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=None)
    return ids, out[:, width:]


def _greedy_settings(n, pad):
    # a stop id that is never produced: all 64 tokens are compared
    return RolloutSettings(num_generations=1, max_new_tokens=n, temperature=0.0, stop_ids=[10**9], pad_id=pad)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_greedy_equals_hf_generate(embedded, fmt):
    model, tok = embedded
    model = copy.deepcopy(model)
    if fmt != "bf16":
        from qerl.quantize import quantize_

        quantize_(model, fmt, progress=False)
    ids, ref = _hf_greedy(model, tok, PROMPTS, 64)
    engine = RolloutEngine(model, max_batch=4, max_len=256)
    batch = engine.generate(ids, _greedy_settings(64, tok.eos_token_id))
    assert batch.completion_ids.shape == (2, 64)
    assert torch.equal(batch.completion_ids, ref), (batch.completion_ids, ref)
    assert batch.completion_mask.all()
    assert not batch.finished.any()


def test_fusion_shares_one_copy(tiny_model):
    from qerl.quantize import quantize_

    for fmt in ("bf16", "nvfp4", "mxfp4"):
        model = copy.deepcopy(tiny_model)
        if fmt != "bf16":
            quantize_(model, fmt, progress=False)
        attn = model.model.layers[0].self_attn
        before = attn.k_proj(torch.randn(3, 64)) if fmt == "bf16" else None
        engine = RolloutEngine(model, max_batch=2, max_len=64)
        group = engine.layers[0].qkv
        assert group.fused is not None, fmt
        name = "weight" if fmt == "bf16" else "weight_packed"
        fused = getattr(group.fused, name)
        for mod in (attn.q_proj, attn.k_proj, attn.v_proj):
            t = getattr(mod, name)
            assert t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), (fmt, mod)
        x = torch.randn(5, 64)
        q, k, v = group(x).split(group.sizes, -1)
        torch.testing.assert_close(k, attn.k_proj(x), rtol=0, atol=0)
        torch.testing.assert_close(q, attn.q_proj(x), rtol=0, atol=0)
        if before is not None:
            assert before.shape == (3, attn.k_proj.out_features)


def _lora_model(tiny_model, fmt="nvfp4"):
    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.quantize import quantize_

    model = copy.deepcopy(tiny_model)
    quantize_(model, fmt, progress=False)
    model = apply_lora(model, LoraSettings(r=8, lora_alpha=16, train_norms=True))
    with torch.no_grad():  # non-zero B, so the adapters change the policy
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def test_lora_groups_equal_peft_forward(tiny_model):
    """Two GEMMs per group (stacked A, block-diagonal scaled B) = PEFT's per-module LoRA forward,
    and an optimiser-style in-place update of the adapters is seen after refresh()."""
    model = _lora_model(tiny_model)
    engine = RolloutEngine(model, max_batch=2, max_len=64)
    layer = engine.layers[1]
    x = torch.randn(7, 64)
    for group in (layer.qkv, layer.gate_up):
        got = group(x).split(group.sizes, -1)
        for out, mod in zip(got, group.modules):
            torch.testing.assert_close(out, mod(x), rtol=1e-5, atol=1e-5)
    h = torch.randn(7, layer.o.in_features)
    torch.testing.assert_close(layer.o(h), layer.o.modules[0](h), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.qkv.modules[1].lora_B["default"].weight.add_(0.5)
    stale = layer.qkv(x).split(layer.qkv.sizes, -1)[1]
    engine.refresh()
    fresh = layer.qkv(x).split(layer.qkv.sizes, -1)[1]
    want = layer.qkv.modules[1](x)
    torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-5)
    assert (stale - want).abs().max() > 1e-2


def test_sampled_logprobs_match_a_fresh_forward_with_lora_and_aqn(tiny_model, tiny_tokenizer):
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings

    model = _lora_model(tiny_model)
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True, sigma_start=0.05, sigma_end=0.01), total_steps=10)
    aqn.resample(5)
    prompts = [tiny_tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    settings = RolloutSettings(num_generations=3, max_new_tokens=12, temperature=1.0, top_p=1.0,
                               stop_ids=[151645], pad_id=151643)
    gen = torch.Generator().manual_seed(0)
    with aqn.applied():
        batch = engine_rollouts(model, prompts, settings, gen)
        fresh = policy_logprobs(model, batch, temperature=1.0)
    assert batch.num_rows == 6
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.logprobs[m], fresh.detach()[m], rtol=1e-4, atol=1e-4)
    # the same engine is reused, and without noise the recorded logprobs are those of the clean policy
    engine = model.__dict__["_qerl_rollout_engine"]
    clean = engine_rollouts(model, prompts, settings, torch.Generator().manual_seed(0))
    assert model.__dict__["_qerl_rollout_engine"] is engine
    fresh_clean = policy_logprobs(model, clean, temperature=1.0).detach()
    mc = clean.completion_mask.bool()
    torch.testing.assert_close(clean.logprobs[mc], fresh_clean[mc], rtol=1e-4, atol=1e-4)


def test_aqn_noise_reaches_the_engine_logits(tiny_model, tiny_tokenizer):
    """The noise must change what the engine samples from by the expected amount: the same
    logits as Hugging Face's forward with the noisy norms, and different from the clean ones."""
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings

    model = _lora_model(tiny_model)
    engine = RolloutEngine(model, max_batch=2, max_len=64)
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True, sigma_start=0.1, sigma_end=0.05), total_steps=10)
    aqn.resample(5)
    ids = torch.tensor([tiny_tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]])
    mask = torch.ones_like(ids)
    source = torch.zeros(1, dtype=torch.long)
    with torch.no_grad():
        engine.refresh()
        clean = engine._prefill(ids, mask, source)
        with aqn.applied():
            engine.refresh()
            noisy = engine._prefill(ids, mask, source)
            hf_noisy = model(input_ids=ids).logits[:, -1]
        engine.refresh()
        clean_again = engine._prefill(ids, mask, source)
    torch.testing.assert_close(noisy, hf_noisy, rtol=1e-4, atol=1e-4)
    assert torch.equal(clean, clean_again)
    assert (noisy - clean).abs().max() > 1e-3


def test_stop_tokens_and_bad_requests(tiny_model):
    model = copy.deepcopy(tiny_model)
    engine = RolloutEngine(model, max_batch=4, max_len=64)
    prompt = [[5, 6, 7, 8]]
    # make the stop token the greedy choice from the first step: one token, finished
    first = engine._prefill(torch.tensor(prompt), torch.ones(1, 4, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    stop = int(first.argmax(-1))
    batch = engine.generate(prompt, RolloutSettings(max_new_tokens=10, temperature=0.0, stop_ids=[stop], pad_id=0))
    assert batch.completion_ids.shape == (1, 1) and batch.finished.tolist() == [True]
    with pytest.raises(EngineError, match="max_batch"):
        engine.generate(prompt * 5, RolloutSettings(max_new_tokens=4, stop_ids=[1]))
    with pytest.raises(EngineError, match="max_len"):
        engine.generate(prompt, RolloutSettings(max_new_tokens=100, stop_ids=[1]))
    with pytest.raises(EngineError, match="model types"):
        from transformers import GPT2Config, GPT2LMHeadModel

        RolloutEngine(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))


def test_finished_rows_are_compacted_without_changing_the_rollout():
    """Rows that stop early leave the decoding batch (their cache and state move out of the way);
    the uniforms belong to output rows, so the tokens, logprobs and masks are those of a run that
    never compacts, and they still equal a fresh forward."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        prompts = [torch.randint(0, 64, (n,)).tolist() for n in (5, 9, 7, 3)]
    settings = RolloutSettings(num_generations=3, max_new_tokens=40, temperature=1.0, stop_ids=[3, 7], pad_id=0)
    runs = {}
    for below in (0.0, 0.5, 1.0):
        engine = RolloutEngine(model, max_batch=16, max_len=64, compact_below=below)
        runs[below] = (engine.generate(prompts, settings, torch.Generator().manual_seed(0)), dict(engine.stats))
        # after the compactions every row's lead (whose prompt slots the GPU attention reads) is a row
        # of the same prompt, at or before it
        rows = engine.stats["final_rows"]
        prompt, lead = engine._row_map[:rows] // 3, engine._lead[:rows].long()
        assert torch.equal(prompt[lead], prompt) and bool((lead <= torch.arange(rows)).all())
    base, stats0 = runs[0.0]
    lengths = base.completion_mask.sum(1)
    assert stats0["compactions"] == 0 and lengths.min() < lengths.max() == 40  # rows stop at different steps
    for below in (0.5, 1.0):
        batch, stats = runs[below]
        assert stats["compactions"] >= 1 and stats["final_rows"] < 12
        assert torch.equal(batch.completion_ids, base.completion_ids)
        assert torch.equal(batch.completion_mask, base.completion_mask)
        assert torch.equal(batch.finished, base.finished)
        torch.testing.assert_close(batch.logprobs, base.logprobs, rtol=1e-5, atol=1e-5)
    m = base.completion_mask.bool()
    fresh = policy_logprobs(model, runs[1.0][0], temperature=1.0).detach()
    torch.testing.assert_close(runs[1.0][0].logprobs[m], fresh[m], rtol=1e-4, atol=1e-4)


def test_lead_rows_is_the_first_row_of_each_prompt():
    """engine.lead_rows: per row, the first row sampling the same prompt (SHARE_PROMPT_KEYS reads
    the prompt's slots there), for grouped rows, rows left after a compaction, and any order."""
    from qerl.rollout.engine import lead_rows

    assert lead_rows(torch.arange(8) // 4).tolist() == [0, 0, 0, 0, 4, 4, 4, 4]
    assert lead_rows(torch.tensor([0, 2, 2, 5])).tolist() == [0, 1, 1, 3]
    assert lead_rows(torch.tensor([3, 1, 3, 1, 0])).tolist() == [0, 1, 0, 1, 4]
    assert lead_rows(torch.arange(5)).tolist() == list(range(5))
    assert lead_rows(torch.arange(5)).dtype == torch.int32


def test_gpu_prompt_width_buckets_within_the_cache():
    """Prompt widths on a GPU: up to the next multiple of PROMPT_BUCKET (so prefill graphs repeat),
    never past max_len - new tokens, never below the prompt."""
    from qerl.rollout.engine import PROMPT_BUCKET, prompt_width

    assert prompt_width(70, 100, 1024) == 2 * PROMPT_BUCKET
    assert prompt_width(PROMPT_BUCKET, 100, 1024) == PROMPT_BUCKET
    assert prompt_width(70, 940, 1024) == 84  # the cache's end, not the bucket
    assert prompt_width(70, 954, 1024) == 70
    assert prompt_width(1, 1, 2) == 1



def test_bench_rollout_combines_a_combined_file_again(tmp_path):
    """bench_rollout.py --combine on a file that is itself combined: the command and date lists come out flat,
    every row's `run` indexes that flat list, a later run replaces the same configuration, and a LoRA row's
    no-LoRA throughput comes from its own run."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_rollout.py")
    spec = importlib.util.spec_from_file_location("bench_rollout_for_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(model, fmt, tps, rank=0, batch=8):
        return {"model": model, "format": fmt, "batch": batch, "lora_rank": rank, "prompt_len": 256,
                "completion_len": 512, "tokens_per_s": tps, "bf16_tokens_per_s": 100.0}

    parts = [{"gpu": "g", "command": "c1", "date": "d1", "rows": [row("7b", "nvfp4", 200.0), row("7b", "bf16", 100.0)]},
             {"gpu": "g", "command": "c2", "date": "d2", "rows": [row("14b", "nvfp4", 150.0), row("14b", "nvfp4", 120.0, 32)]},
             {"gpu": "g", "command": "c3", "date": "d3", "rows": [row("7b", "nvfp4", 210.0), row("7b", "nvfp4", 180.0, 16)]}]
    files = []
    for i, p in enumerate(parts):
        files.append(str(tmp_path / f"p{i}.json"))
        with open(files[-1], "w") as f:
            json.dump(p, f)
    bench.combine(files[:2], str(tmp_path / "ab.json"))
    bench.combine([str(tmp_path / "ab.json"), files[2]], str(tmp_path / "abc.json"))
    out = json.load(open(tmp_path / "abc.json"))
    assert out["command"] == ["c1", "c2", "c3"] and out["date"] == ["d1", "d2", "d3"]
    got = {(r["model"], r["format"], r["lora_rank"]): r for r in out["rows"]}
    assert len(out["rows"]) == 5
    assert got["7b", "nvfp4", 0]["tokens_per_s"] == 210.0 and got["7b", "nvfp4", 0]["run"] == 2
    assert got["7b", "bf16", 0]["run"] == 0
    assert got["14b", "nvfp4", 32]["run"] == 1 and got["14b", "nvfp4", 32]["lora0_tokens_per_s"] == 150.0
    assert got["7b", "nvfp4", 16]["lora0_tokens_per_s"] == 210.0


def test_bench_rollout_keeps_fused_nf4_rows_apart_from_the_baseline(tmp_path):
    """nf4 rows measured with the labelled fused NF4 decode (QERL_NF4_FUSED_MAX_M > 0) never replace the QLoRA
    baseline's rows of the same configuration when files are combined: rows from before the `nf4_decode` field
    are read from their call's command, and the combined rows carry the label."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_rollout.py")
    spec = importlib.util.spec_from_file_location("bench_rollout_for_nf4_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(fmt, tps):
        return {"model": "7b", "format": fmt, "batch": 8, "lora_rank": 0, "tokens_per_s": tps, "bf16_tokens_per_s": 100.0}

    parts = [{"gpu": "g", "command": "python bench_rollout.py", "date": "d1", "rows": [row("nf4", 50.0), row("nvfp4", 200.0)]},
             {"gpu": "g", "command": "QERL_NF4_FUSED_MAX_M=16 python bench_rollout.py", "date": "d2", "rows": [row("nf4", 80.0)]},
             {"gpu": "g", "command": "python bench_rollout.py", "date": "d3",
              "rows": [dict(row("nf4", 52.0), nf4_decode="baseline")]}]
    files = []
    for i, p in enumerate(parts):
        files.append(str(tmp_path / f"p{i}.json"))
        with open(files[-1], "w") as f:
            json.dump(p, f)
    bench.combine(files, str(tmp_path / "all.json"))
    rows = json.load(open(tmp_path / "all.json"))["rows"]
    got = {(r["format"], r.get("nf4_decode")): r["tokens_per_s"] for r in rows}
    assert got == {("nf4", "baseline"): 52.0, ("nvfp4", None): 200.0, ("nf4", "fused<=16"): 80.0}
