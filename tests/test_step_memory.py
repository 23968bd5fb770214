"""The memory plan of a GRPO step (issue 9), on CPU with tiny models:

- chunked log-probs (`qerl.rl.rollout.chunked_logprobs` / `policy_logprobs`): the same values,
  entropies and gradients as the whole [tokens x vocab] logits at once, while the lm_head never
  sees more than one chunk of positions, in the forward or the backward pass;
- the rollout engine's KV cache and graphs are freed between rollout and training
  (`release_memory`) and re-made by the next rollout, which samples exactly as before;
- the trainer logs the time of each phase (rollout, log-probs, backward, optimizer) and frees the
  rollout memory after the rollout phase when `release_rollout_memory` is on;
- benchmarks/bench_grpo_step.py runs end to end on a tiny model and writes the issue's fields.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from qerl.rl.rollout import RolloutSettings, chunked_logprobs, policy_logprobs

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _lora(tiny_model):
    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.quantize import quantize_

    model = copy.deepcopy(tiny_model)
    quantize_(model, "nvfp4", progress=False)
    model = apply_lora(model, LoraSettings(r=4, lora_alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_whole_logits(chunk, temperature):
    torch.manual_seed(chunk)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 11))
    lp, ent = chunked_logprobs(head, hidden, tokens, temperature, chunk)
    logits = head(hidden).float() / temperature
    want = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    p = torch.softmax(logits, -1)
    want_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent.detach(), rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    weights = torch.randn(3, 11)
    g_h, g_w = torch.autograd.grad((lp * weights).sum(), (hidden, head.weight))
    r_h, r_w = torch.autograd.grad((want * weights).sum(), (hidden, head.weight))
    torch.testing.assert_close(g_h, r_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(g_w, r_w, rtol=1e-4, atol=1e-6)


def test_policy_logprobs_chunks_never_build_whole_logits(tiny_model, tiny_tokenizer):
    from qerl.eval.generate import stop_token_ids
    from qerl.rl.rollout import sample_rollouts

    model = _lora(tiny_model)
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("one two three", "four five")]
    rs = RolloutSettings(num_generations=2, max_new_tokens=9, temperature=1.0, stop_ids=stop_token_ids(tiny_tokenizer),
                         pad_id=151643)
    batch = sample_rollouts(model, prompts, rs, torch.Generator().manual_seed(0))
    mask = batch.completion_mask.float()
    seen = []
    head = model.get_base_model().lm_head
    hook = head.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[:-1].numel()))
    results = {}
    try:
        for share in (True, False):
            for chunk in (0, 5):
                model.zero_grad()
                seen.clear()
                lp, ent = policy_logprobs(model, batch, share_prompt=share, chunk_tokens=chunk, return_entropy=True)
                (lp * mask).sum().backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
                results[share, chunk] = (lp.detach(), ent, grads)
                if chunk:  # the forward and the backward's recomputation: at most one chunk per call
                    assert max(seen) <= chunk and len(seen) > 2, seen
                else:
                    assert max(seen) >= batch.completion_ids.numel() - batch.num_rows
    finally:
        hook.remove()
    m = batch.completion_mask.bool()
    ref_lp, ref_ent, ref_g = results[False, 0]
    for (lp, ent, g) in results.values():
        torch.testing.assert_close(lp[m], ref_lp[m], rtol=0, atol=2e-5)
        torch.testing.assert_close(ent[m], ref_ent[m], rtol=0, atol=2e-5)
        torch.testing.assert_close(g, ref_g, rtol=1e-3, atol=1e-5)  # float32 order of sums, as test_grpo
    # the entropies are those of the sampling distribution the rollout recorded
    torch.testing.assert_close(ref_ent[m], batch.entropies[m], rtol=0, atol=1e-4)
    torch.testing.assert_close(ref_lp[m], batch.logprobs[m], rtol=0, atol=2e-5)


def test_engine_releases_and_remakes_its_cache(tiny_model, tiny_tokenizer):
    from qerl.rollout.engine import RolloutEngine, release_rollout_memory

    model = copy.deepcopy(tiny_model)
    prompts = [tiny_tokenizer("a b c d", add_special_tokens=False)["input_ids"]]
    rs = RolloutSettings(num_generations=3, max_new_tokens=6, temperature=1.0, stop_ids=[10**9], pad_id=0)
    engine = RolloutEngine(model, max_batch=3, max_len=32)
    first = engine.generate(prompts, rs, torch.Generator().manual_seed(3))
    cfg = model.config
    want = 2 * cfg.num_hidden_layers * 3 * cfg.num_key_value_heads * 32 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert engine.cache_bytes == want
    assert engine.release_memory() == want and engine.cache_bytes == 0 and not engine._graphs
    again = engine.generate(prompts, rs, torch.Generator().manual_seed(3))
    assert engine.cache_bytes == want
    assert torch.equal(first.completion_ids, again.completion_ids)
    torch.testing.assert_close(first.logprobs, again.logprobs, rtol=0, atol=0)
    model.__dict__["_qerl_rollout_engine"] = engine
    assert release_rollout_memory(model) == want and release_rollout_memory(model) == 0
    bare = copy.deepcopy(tiny_model)
    bare.__dict__.pop("_qerl_rollout_engine", None)  # an earlier test may have run the shared fixture's engine
    assert release_rollout_memory(bare) == 0  # no engine: nothing to free


def _train_steps(tiny_model, tiny_tokenizer, tmp_path, release, steps=1):
    """`steps` GRPO steps of the tiny model on arithmetic problems; (TrainResult, logged metrics)."""
    from qerl.rl.arith import make_problems
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import train

    def reward(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    settings = GRPOSettings(max_steps=steps, num_generations=2, per_device_train_batch_size=2,
                            gradient_accumulation_steps=2, max_completion_length=5, learning_rate=1e-3, save_steps=1,
                            logprob_chunk_tokens=3, release_rollout_memory=release)
    logged = []
    result = train(copy.deepcopy(tiny_model), tiny_tokenizer, settings, None, make_problems(4, seed=0), [reward],
                   tmp_path, log_fn=lambda s, m: logged.append(m))
    return result, logged


@pytest.mark.parametrize("release", [True, False, "auto"])
def test_trainer_times_phases_and_frees_rollout_memory(tiny_model, tiny_tokenizer, tmp_path, release):
    result, logged = _train_steps(tiny_model, tiny_tokenizer, tmp_path, release)
    m = logged[0]
    phases = [m[k] for k in ("rollout_s", "logprob_s", "backward_s", "optimizer_s")]
    assert all(p > 0 for p in phases), phases
    assert sum(phases) <= m["step_time_s"]
    engine = result.model.__dict__["_qerl_rollout_engine"]
    # off a GPU "auto" frees as True does: there are no graph captures to save by keeping the cache
    assert (engine.cache_bytes == 0) == (release is not False)
    assert m["rollout_memory_released"] == float(release is not False)


class _Allocator:
    """A scripted caching allocator for RolloutMemoryPlan: reserved() answers from `script` in
    turn, peak() gives `peaks` in turn; counts empty_cache() calls."""

    def __init__(self, total, script, peaks):
        self.total, self.script, self.peaks, self.emptied = total, list(script), list(peaks), 0

    def reserved(self):
        return self.script.pop(0)

    def peak(self):
        return self.peaks.pop(0)

    def empty_cache(self):
        self.emptied += 1


def test_rollout_memory_plan_keeps_once_a_measured_step_fits_and_frees_again_when_not():
    from qerl.rl.memory_plan import RolloutMemoryPlan, fits_with_rollout_memory

    GB = 10**9
    # 100 GB card, 10% headroom -> 90 GB usable
    assert fits_with_rollout_memory(20 * GB, 60 * GB, 10 * GB, 100 * GB)  # 60 + 10 <= 90
    assert not fits_with_rollout_memory(20 * GB, 60 * GB, 31 * GB, 100 * GB)  # 91 > 90
    assert not fits_with_rollout_memory(20 * GB, 60 * GB, 10 * GB, 100 * GB, length_ratio=2.0)  # 20 + 80 + 10
    assert fits_with_rollout_memory(20 * GB, 60 * GB, 10 * GB, 100 * GB, length_ratio=0.5)  # never shrinks below measured

    model = torch.nn.Linear(2, 2)  # no engine: release_rollout_memory frees nothing, the allocator script decides
    # step 1 frees (30 -> 20 GB reserved, so 10 GB held), training peaks at 60: keep next time
    # step 2 keeps (30 GB reserved at its start), training peaks at 85 at a 1.1x longer limit: 30 + 55 * 1.1 > 90
    # step 3 frees again
    alloc = _Allocator(100 * GB, script=[30 * GB, 20 * GB, 30 * GB, 30 * GB, 32 * GB, 21 * GB], peaks=[60 * GB, 85 * GB, 50 * GB])
    plan = RolloutMemoryPlan("auto", torch.device("cpu"), memory=alloc)
    assert not plan.keeping
    plan.after_rollout(model)
    assert plan.released
    plan.after_training(trained_len=1000, max_len=1000)
    assert plan.keeping and alloc.emptied == 1
    plan.after_rollout(model)
    assert not plan.released
    plan.after_training(trained_len=1000, max_len=1100)
    assert not plan.keeping and alloc.emptied == 1  # a keeping step leaves the cache as it is
    plan.after_rollout(model)
    assert plan.released
    plan.after_training(trained_len=1000, max_len=1000)
    assert plan.keeping and alloc.emptied == 2


@pytest.mark.parametrize("setting", [True, False])
def test_rollout_memory_plan_fixed_settings_never_change(setting):
    from qerl.rl.memory_plan import RolloutMemoryPlan

    GB = 10**9
    alloc = _Allocator(100 * GB, script=[1 * GB] * 8, peaks=[99 * GB, 1 * GB])
    plan = RolloutMemoryPlan(setting, torch.device("cpu"), memory=alloc)
    for _ in range(2):
        plan.after_rollout(torch.nn.Linear(2, 2))
        assert plan.released is setting and plan.keeping is (not setting)
        plan.after_training(1, 1)
    with pytest.raises(ValueError, match="release_rollout_memory"):
        RolloutMemoryPlan("sometimes", torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["on", "off"])
def test_bench_grpo_step_runs_on_a_tiny_model(tmp_path, checkpointing):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_grpo_step.py"), "--device", "cpu",
           "--models", "tiny-llama", "--formats", "bf16", "nvfp4", "--batches", "1", "--generations", "2",
           "--prompt-len", "8", "--completion", "6", "--rank", "4", "--micro-batch", "1", "--chunk-tokens", "4",
           "--steps", "2", "--out-dir", str(tmp_path), "--gradient-checkpointing", checkpointing]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = json.loads((tmp_path / "memory.json").read_text())
    steps = json.loads((tmp_path / "grpo_step.json").read_text())
    assert {"gpu", "torch", "date", "command", "rows"} <= set(memory)
    assert [(r["format"], r["status"]) for r in memory["rows"]] == [("bf16", "ok"), ("nvfp4", "ok")]
    for r in memory["rows"]:
        assert set(r) >= {"model", "format", "gpu", "generations", "completion_len", "lora_rank", "status", "peak_gib",
                          "rollout_s", "logprob_s", "backward_s", "optimizer_s", "step_s"}
        assert r["generations"] == 2 and r["completion_len"] == 6 and r["lora_rank"] == 4
        assert r["rollout_tokens"] == 2 * 6  # every row generates exactly --completion tokens
        # the phases lie within the step; each of the five values is rounded to 1 ms (a tiny model's phases
        # take a few ms, so their rounded sum may pass the rounded step by up to 2.5 ms)
        assert 0 < r["rollout_s"] + r["logprob_s"] + r["backward_s"] + r["optimizer_s"] <= r["step_s"] + 0.0025 + 1e-9
        assert r["aqn"] == (r["format"] == "nvfp4") and "warmup_step_s" in r
        # without checkpointing the training forwards share each group's prompt, as train() does
        assert (r["gradient_checkpointing"], r["share_prompt"]) == ((True, False) if checkpointing == "on" else (False, True))
        # "auto", the default: a CPU plans no free layer, every layer checkpointed (when checkpointing is on)
        assert (r["checkpoint_layers"], r["uncheckpointed_layers"]) == ("auto", 0)
        # the pauses counted over the reported step: no CUDA allocator on a CPU, whole collections counted
        assert r["alloc_retries"] == 0 and isinstance(r["full_gc_collections"], int) and r["full_gc_collections"] >= 0
    rows = {r["format"]: r for r in steps["rows"]}
    assert set(rows["nvfp4"]) >= {"model", "format", "batch", "step_s", "bf16_step_s", "speedup"}
    assert rows["nvfp4"]["bf16_step_s"] == rows["bf16"]["step_s"]
    assert rows["nvfp4"]["speedup"] == pytest.approx(rows["bf16"]["step_s"] / rows["nvfp4"]["step_s"], rel=1e-2)
    assert "| tiny-llama | nvfp4 | 1 | 1 | 1 | ok |" in proc.stdout  # one weight copy: the kernel layout's
    assert [r["weight_copies"] for r in memory["rows"]] == [1, 1]
    from qerl.kernels.layout import order_setting

    assert [r["w4a16_order"] for r in memory["rows"]] == [None, order_setting()]  # "auto" unless the env names one
    assert all(r["command"].startswith("python benchmarks/bench_grpo_step.py") for r in memory["rows"])


def test_bench_counts_the_full_collections_between_two_reads():
    import gc
    import torch

    mem = _bench_module()._Memory(torch.device("cpu"))
    before = mem.stalls()
    gc.collect()
    gc.collect()
    after = mem.stalls()
    assert after[0] == before[0] == 0
    assert after[1] - before[1] == 2


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_grpo_step", os.path.join(ROOT, "benchmarks", "bench_grpo_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_pairs_baselines_and_combines_calls(tmp_path):
    bench = _bench_module()

    def row(fmt, step_s, micro=8, steps=2, batch=2, model="m"):
        return {"model": model, "format": fmt, "batch": batch, "micro_batch": micro, "steps": steps, "status": "ok",
                "step_s": step_s, "generations": 8, "completion_len": 2048, "peak_gib": 1.0,
                **{k: step_s / 4 for k in ("rollout_s", "logprob_s", "backward_s", "optimizer_s")}}

    rows = [row("bf16", 20.0), row("nvfp4", 16.0), row("nvfp4", 10.0, micro=2), row("bf16", 30.0, steps=1),
            row("nvfp4", 12.0, steps=1, micro=4), dict(row("nf4", 0.0), status="oom")]
    got = {(r["format"], r["micro_batch"]): r for r in bench.step_rows(rows)}
    assert got["nvfp4", 8]["speedup"] == 1.25 and got["nvfp4", 8]["bf16_step_s"] == 20.0
    assert got["nvfp4", 2]["speedup"] is None  # no bf16 row at that micro-batch
    assert got["nvfp4", 4]["speedup"] is None  # a warm-up step is not compared with a steady one
    assert ("nf4", 8) not in got  # out-of-memory rows have no step time
    # rows from before --rollout-memory count as freed each step: an auto row pairs only with an auto baseline
    auto = [dict(row("nvfp4", 12.5), rollout_memory="auto"), dict(row("bf16", 18.75), rollout_memory="auto")]
    paired = {(r["format"], r["rollout_memory"]): r for r in bench.step_rows(rows + auto) if r["micro_batch"] == 8}
    assert paired["nvfp4", "auto"]["speedup"] == 1.5 and paired["nvfp4", "release"]["speedup"] == 1.25
    # rows from before --gradient-checkpointing had it on: a row without it pairs only with its like
    off = [dict(row("nvfp4", 8.0), gradient_checkpointing=False)]
    got = {(r["format"], r["gradient_checkpointing"]): r for r in bench.step_rows(rows + off) if r["micro_batch"] == 8}
    assert got["nvfp4", False]["speedup"] is None and got["nvfp4", True]["speedup"] == 1.25
    got = bench.step_rows(rows + off + [dict(row("bf16", 12.0), gradient_checkpointing=False)])
    assert [r["speedup"] for r in got if not r["gradient_checkpointing"] and r["format"] == "nvfp4"] == [1.5]
    # a row run under a device-memory cap pairs only with a bf16 row under the same cap
    capped = [dict(row("nvfp4", 10.0), device_memory_gib=79.0)]
    got = bench.step_rows(rows + capped + [dict(row("bf16", 25.0), device_memory_gib=79.0)])
    assert [r["speedup"] for r in got if r.get("device_memory_gib") and r["format"] == "nvfp4"] == [2.5]
    assert [r["speedup"] for r in bench.step_rows(rows + capped) if r.get("device_memory_gib")] == [None]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"gpu": "g", "command": "first", "date": "d1", "rows": [row("bf16", 20.0), row("nvfp4", 16.0)]}))
    b.write_text(json.dumps({"gpu": "g", "command": "second", "date": "d2", "rows": [row("nvfp4", 15.0)]}))
    out = bench.combine([str(a), str(b)], str(tmp_path / "out"))
    assert [(r["format"], r["step_s"], r["command"]) for r in out["rows"]] == [("bf16", 20.0, "first"), ("nvfp4", 15.0, "second")]
    steps = json.loads((tmp_path / "out" / "grpo_step.json").read_text())
    assert steps["command"] == ["first", "second"] and steps["rows"][1]["speedup"] == round(20.0 / 15.0, 3)
    # a later call's bf16 row replaces the earlier one, but the earlier call's nvfp4 row keeps its own
    # call's bf16 step as its baseline (the ratio of one process), and says when that baseline ran
    g = tmp_path / "g.json"
    g.write_text(json.dumps({"gpu": "g", "command": "bf16 again", "date": "d7", "rows": [row("bf16", 30.0), row("nf4", 60.0)]}))
    out = bench.combine([str(a), str(g)], str(tmp_path / "later_bf16"))
    steps = {r["format"]: r for r in json.loads((tmp_path / "later_bf16" / "grpo_step.json").read_text())["rows"]}
    assert steps["nvfp4"]["bf16_step_s"] == 20.0 and steps["nvfp4"]["speedup"] == 1.25 and steps["nvfp4"]["bf16_date"] == "d1"
    assert steps["nf4"]["speedup"] == 0.5 and steps["bf16"]["step_s"] == 30.0
    # ... and again when the combined file is combined once more (the pairing travels in the rows)
    again = bench.combine([str(tmp_path / "later_bf16" / "memory.json")], str(tmp_path / "later_again"))
    assert [r["speedup"] for r in bench.step_rows(again["rows"]) if r["format"] == "nvfp4"] == [1.25]
    # rows from before the single-copy change (no field: two copies of the 4-bit weights) are kept
    # beside a single-copy row of the same configuration, not replaced by it
    c = tmp_path / "c.json"
    c.write_text(json.dumps({"gpu": "g", "command": "third", "date": "d3", "rows": [dict(row("nvfp4", 14.0), weight_copies=1)]}))
    out = bench.combine([str(a), str(b), str(c)], str(tmp_path / "out"))
    assert [(r["format"], r["step_s"], bench._row_copies(r)) for r in out["rows"]] == [
        ("bf16", 20.0, 1), ("nvfp4", 15.0, 2), ("nvfp4", 14.0, 1)]
    # a combined file combines again: its rows keep their calls' commands, the list stays flat
    d = tmp_path / "d.json"
    d.write_text(json.dumps({"gpu": "g", "command": "fourth", "date": "d4", "rows": [dict(row("bf16", 9.0), batch=4)]}))
    again = bench.combine([str(tmp_path / "out" / "memory.json"), str(d)], str(tmp_path / "again"))
    assert [(r["batch"], r["format"], r["command"]) for r in again["rows"]] == [
        (2, "bf16", "first"), (2, "nvfp4", "second"), (2, "nvfp4", "third"), (4, "bf16", "fourth")]
    assert json.loads((tmp_path / "again" / "grpo_step.json").read_text())["command"] == ["first", "second", "third", "fourth"]
    # nf4 with the labelled fused decode (the field, or before it the QERL_NF4_FUSED_MAX_M prefix of the command)
    # is kept beside the QLoRA baseline's row, not in its place, and grpo_step.json says which is which
    e, f = tmp_path / "e.json", tmp_path / "f.json"
    e.write_text(json.dumps({"gpu": "g", "command": "python bench_grpo_step.py", "date": "d5",
                             "rows": [row("bf16", 20.0), row("nf4", 40.0)]}))
    f.write_text(json.dumps({"gpu": "g", "command": "QERL_NF4_FUSED_MAX_M=16 python bench_grpo_step.py", "date": "d6",
                             "rows": [row("nf4", 25.0)]}))
    out = bench.combine([str(e), str(f)], str(tmp_path / "nf4"))
    assert [(r["format"], r["step_s"]) for r in out["rows"]] == [("bf16", 20.0), ("nf4", 40.0), ("nf4", 25.0)]
    steps = json.loads((tmp_path / "nf4" / "grpo_step.json").read_text())["rows"]
    assert [(r["format"], r["nf4_decode"], r["speedup"]) for r in steps] == [
        ("bf16", None, 1.0), ("nf4", "baseline", 0.5), ("nf4", "fused<=16", 0.8)]


def test_demo_without_held_out_problems_reports_nan():
    import math

    from qerl.rl.demo import held_out_accuracy

    assert math.isnan(held_out_accuracy(None, None, [], 8))  # `--num-eval 0` crashed in the tokenizer before


@pytest.mark.parametrize("gc", [False, True])
def test_bf16_autocast_runs_the_lora_path_in_bf16_over_fp32_masters(tiny_model, gc):
    """GRPOSettings.bf16_autocast: the training forwards (and the checkpointed recomputations)
    run the LoRA matmuls in bf16; the adapters stay fp32, get fp32 gradients, and one update lands
    close to the fp32 path's update (not bit-equal: it is a different rounding)."""
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings
    from qerl.rl.grpo import GRPOSettings, group_advantages
    from qerl.rl.rollout import sample_rollouts
    from qerl.rl.trainer import make_optimizer, optimise, prepare_policy, run_rollout

    results = {}
    for on in (False, True):
        settings = GRPOSettings(max_steps=1, num_generations=2, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, max_completion_length=6, learning_rate=1e-2,
                                gradient_checkpointing=gc, logprob_chunk_tokens=4, bf16_autocast=on)
        torch.manual_seed(0)  # the same adapters in both runs
        policy = prepare_policy(_lora(tiny_model), settings)
        optimizer, scheduler = make_optimizer(policy, settings)
        aqn = AdaptiveQuantNoise(policy, AQNSettings(enabled=False), total_steps=1)
        seen, casts = set(), set()
        hooks = [m.register_forward_hook(lambda mod, inp, out: seen.add(out.dtype))
                 for n, m in policy.named_modules() if n.endswith("lora_A.default")]
        hooks += [m.register_forward_pre_hook(lambda mod, inp: casts.add(mod.cast_input_dtype_enabled))
                  for m in policy.modules() if hasattr(m, "lora_A") and hasattr(m, "cast_input_dtype_enabled")]
        rs = RolloutSettings(num_generations=2, max_new_tokens=6, temperature=1.0, stop_ids=[10**9], pad_id=0)
        rollout = run_rollout(policy, sample_rollouts, [[5, 6, 7], [8, 9]], rs, torch.Generator().manual_seed(0), aqn, False)
        seen.clear()  # the rollout is not part of the training forward
        casts.clear()
        rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
        adv = group_advantages(rewards, 2, settings.reward_scaling)
        before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
        optimise(policy, [(rollout, rewards, adv)], settings, optimizer, scheduler, aqn, False, False, 1)
        for h in hooks:
            h.remove()
        assert seen == ({torch.bfloat16} if on else {torch.float32}), seen
        # under autocast the adapters take their input as it comes, in the forwards and in the
        # checkpointed recomputations (no fp32 copy of bf16 activations for autocast to copy back);
        # PEFT's casting is back on after the update
        assert casts == ({False} if on else {True}), casts
        assert all(m.cast_input_dtype_enabled for m in policy.modules() if hasattr(m, "cast_input_dtype_enabled"))
        params = {n: p.detach() for n, p in policy.named_parameters() if p.requires_grad}
        assert all(p.dtype == torch.float32 for p in params.values())
        results[on] = {n: params[n] - before[n] for n in params}
    moved = [n for n, d in results[False].items() if d.abs().max() > 0]
    assert moved
    for n in moved:  # AdamW's first update is ~lr * sign(grad): the same direction in both precisions
        agree = (torch.sign(results[True][n]) == torch.sign(results[False][n])).float().mean()
        assert agree > 0.9, (n, float(agree))


def _flaky_optimise(monkeypatch, fail_at, after_update=False):
    """qerl.rl.trainer.optimise raising torch.OutOfMemoryError on its calls numbered in `fail_at`
    (from 1), before any update, or after one optimiser + scheduler step with `after_update`:
    the out-of-memory error a GPU would give, injected (a CPU has no such limit)."""
    from qerl.rl import trainer as trainer_mod

    real, calls = trainer_mod.optimise, []

    def flaky(model, parts, settings, optimizer, scheduler, *rest):
        calls.append(1)
        if len(calls) in fail_at:
            if after_update:
                optimizer.step()
                scheduler.step()
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(model, parts, settings, optimizer, scheduler, *rest)

    monkeypatch.setattr(trainer_mod, "optimise", flaky)
    return calls


def _plan_that_keeps_from_step_2(monkeypatch):
    """The trainer's RolloutMemoryPlan over a scripted allocator (GB): step 1 frees (10 -> 5 reserved)
    and its training peaks at 6, which fits a 100 GB card, so step 2 keeps."""
    from qerl.rl import trainer as trainer_mod
    from qerl.rl.memory_plan import RolloutMemoryPlan

    GB = 10**9
    alloc = _Allocator(100 * GB, script=[10 * GB, 5 * GB] + [10 * GB] * 6, peaks=[6 * GB] * 4)
    monkeypatch.setattr(trainer_mod, "RolloutMemoryPlan", lambda setting, device: RolloutMemoryPlan(setting, device, memory=alloc))


def test_kept_rollout_memory_is_freed_and_the_step_retrained_after_an_oom(tiny_model, tiny_tokenizer, tmp_path,
                                                                          monkeypatch):
    _plan_that_keeps_from_step_2(monkeypatch)
    calls = _flaky_optimise(monkeypatch, fail_at={2})
    with pytest.warns(RuntimeWarning, match="step 2: training ran out of memory.*trains again"):
        result, logged = _train_steps(tiny_model, tiny_tokenizer, tmp_path, "auto", steps=2)
    assert len(calls) == 3  # step 1 once, step 2 twice
    # step 1 freed (auto's first step), step 2 kept until its training ran out of memory, then freed
    assert [m["rollout_memory_released"] for m in logged] == [1.0, 1.0]
    assert result.model.__dict__["_qerl_rollout_engine"].cache_bytes == 0
    assert all(math.isfinite(m["loss"]) for m in logged)


@pytest.mark.parametrize("release,after_update", [(True, False), ("auto", True)])
def test_an_oom_with_nothing_to_free_or_after_an_update_stops_the_run(tiny_model, tiny_tokenizer, tmp_path, monkeypatch,
                                                                      release, after_update):
    from qerl.rl.trainer import TrainingOOM

    _plan_that_keeps_from_step_2(monkeypatch)
    fail = 2 if release == "auto" else 1  # auto keeps only from step 2
    calls = _flaky_optimise(monkeypatch, fail_at={fail}, after_update=after_update)
    with pytest.raises(TrainingOOM, match="release_rollout_memory"):
        _train_steps(tiny_model, tiny_tokenizer, tmp_path, release, steps=2)
    assert len(calls) == fail


def test_bench_notes_each_oom_retry_of_the_training_phase():
    """bench_grpo_step's rows say when a step's training ran out of memory and trained again after a plan
    gave memory back (the trainer's RuntimeWarning), and which plan; kept when the retry then fails too;
    other warnings pass through."""
    import warnings

    bench = _bench_module()
    row = {}
    with bench._retries_noted(row, 2):
        warnings.warn("step 2: training ran out of memory with decoder layers kept from checkpointing "
                      "(checkpoint_layers: auto); every layer is checkpointed from now on, and this step trains again",
                      RuntimeWarning)
    with pytest.raises(torch.OutOfMemoryError), bench._retries_noted(row, 3):
        warnings.warn("step 3: training ran out of memory with the rollout engine's KV cache and CUDA graphs kept "
                      "(release_rollout_memory: auto); they are freed after every rollout from now on, and this step "
                      "trains again", RuntimeWarning)
        raise torch.OutOfMemoryError("the retry ran out too")
    assert row["oom_retries"] == [{"step": 2, "gave_way": "checkpoint_layers"}, {"step": 3, "gave_way": "rollout_memory"}]
    with pytest.warns(UserWarning, match="something else"), bench._retries_noted(row, 4):
        warnings.warn("something else", UserWarning)
    assert len(row["oom_retries"]) == 2
