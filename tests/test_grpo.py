"""GRPO / DAPO: loss pieces against hand-computed values, rollouts, the training loop, resume, failures."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from qerl.rl.grpo import (
    GRPOSettings,
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    importance_weights,
    k3_kl,
    loss_mask,
    overlong_penalty,
    zero_variance_groups,
)

# ----------------------------------------------------------------------------- loss pieces


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    a = group_advantages(r, 4, "group")
    expect = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0]
    torch.testing.assert_close(a, torch.tensor(expect), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(group_advantages(r, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    bstd = float(r.std())
    torch.testing.assert_close(
        group_advantages(r, 4, "batch"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (bstd + 1e-4)
    )
    with pytest.raises(ValueError):
        group_advantages(torch.ones(6), 4)


def test_dr_grpo_defaults_to_unscaled_advantages():
    assert GRPOSettings(loss_type="dr_grpo").reward_scaling == "none"
    assert GRPOSettings(loss_type="grpo").reward_scaling == "group"
    assert GRPOSettings(loss_type="dapo").reward_scaling == "group"
    assert GRPOSettings(loss_type="dr_grpo", scale_rewards="group").reward_scaling == "group"


def test_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0])
    assert zero_variance_groups(r, 3).tolist() == [True, False, True, True]


def test_clipping_at_eps_low_and_eps_high():
    logp_old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 0.9]])
    logp = ratio.log()
    # positive advantage: clipped above at 1 + eps_high; negative: clipped below at 1 - eps_low
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, r = clipped_surrogate(logp, logp_old, adv, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(r, ratio)
    # -min(r A, clip(r) A): 1.5 -> 1.28 ; 0.5*-1 vs 0.8*-1 -> min is -0.8 ; inside the range: -r A
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -1.1, 0.9]]))
    # the other side never clips: positive A with small ratio, negative A with big ratio
    loss2, _ = clipped_surrogate(torch.tensor([[0.5, 1.5]]).log(), torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), 0.2, 0.28)
    torch.testing.assert_close(loss2, torch.tensor([[-0.5, 1.5]]))
    # gradient is zero where clipped, -A/... elsewhere
    lp = logp.clone().requires_grad_(True)
    l, _ = clipped_surrogate(lp, logp_old, adv, 0.2, 0.28)
    l.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -1.1, 0.9]]))


def test_clip_statistics():
    logp = torch.tensor([[1.5, 0.5, 1.1, 0.7]]).log()
    adv = torch.tensor([1.0])
    _, st = grpo_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    assert st["clip_high_tokens"] == 1.0 and st["clip_low_tokens"] == 0.0  # 0.5/0.7 with A > 0 are not clipped
    _, st = grpo_loss(logp, torch.zeros(1, 4), -adv, torch.ones(1, 4), loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    assert st["clip_low_tokens"] == 2.0 and st["clip_high_tokens"] == 0.0


def test_three_loss_normalisations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(per_token, mask, "grpo")) == pytest.approx((1.5 + 4.0) / 2)
    assert float(aggregate_loss(per_token, mask, "dapo")) == pytest.approx((1 + 2 + 4) / 3)
    assert float(aggregate_loss(per_token, mask, "dr_grpo", max_completion_length=4)) == pytest.approx(7 / (2 * 4))
    with pytest.raises(ValueError):
        aggregate_loss(per_token, mask, "ppo")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_with_global_normalisers_equal_the_full_batch(loss_type):
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    full = aggregate_loss(per_token, mask, loss_type, 5)
    parts = sum(
        aggregate_loss(per_token[s : s + 2], mask[s : s + 2], loss_type, 5, num_sequences=6, num_tokens=float(mask.sum()))
        for s in range(0, 6, 2)
    )
    torch.testing.assert_close(parts, full)


def test_truncated_completion_masking():
    cmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    finished = torch.tensor([False, True, True])
    assert loss_mask(cmask, finished, False).tolist() == cmask.float().tolist()
    assert loss_mask(cmask, finished, True).tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1]]
    # a masked completion contributes nothing to the loss or its gradient
    logp = torch.zeros(3, 3, requires_grad=True)
    loss, _ = grpo_loss(logp, torch.zeros(3, 3), torch.tensor([1.0, -1.0, 0.5]), loss_mask(cmask, finished, True))
    loss.backward()
    assert float(logp.grad[0].abs().sum()) == 0.0 and float(logp.grad[1].abs().sum()) > 0


def test_k3_kl_and_importance_weights_by_hand():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    assert float(k3_kl(logp, ref)) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert float(k3_kl(logp, logp)) == 0.0
    train = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.2)]])
    roll = torch.tensor([[math.log(0.2), math.log(0.3), math.log(0.4)]])
    m = torch.ones(1, 3)
    torch.testing.assert_close(importance_weights(train, roll, m, "token_truncate", 2.0), torch.tensor([[2.0, 1.0, 0.5]]))
    torch.testing.assert_close(importance_weights(train, roll, m, "token_mask", 2.0), torch.tensor([[0.0, 1.0, 0.5]]))
    seq = importance_weights(train, roll, m, "sequence_truncate", 2.0)
    assert seq.shape == (1, 1) and float(seq) == pytest.approx(min(2.0, 3 * 1 * 0.5))
    # beta term and IS weight enter the per-token loss
    adv = torch.tensor([0.0])
    loss, st = grpo_loss(logp, logp, adv, torch.ones(1, 1), beta=0.1, ref_logp=ref)
    assert float(loss) == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1))
    assert st["kl_sum"] == pytest.approx(0.5 - math.log(0.5) - 1)
    lw, _ = grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([2.0]), torch.ones(1, 1), is_weights=torch.tensor([[0.5]]))
    assert float(lw) == pytest.approx(-1.0)


def test_overlong_penalty():
    pen = overlong_penalty(torch.tensor([10, 12, 14, 16]), 16, 4, 1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    assert overlong_penalty(torch.tensor([16]), 16, 0).tolist() == [0.0]


def test_settings_validate():
    s = GRPOSettings(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=3)
    assert s.prompts_per_step == 3 and s.eps_high == s.epsilon == 0.2
    assert GRPOSettings(epsilon_high=0.28).eps_high == 0.28
    with pytest.raises(ValueError, match="multiple of num_generations"):
        GRPOSettings(num_generations=4, per_device_train_batch_size=6)
    with pytest.raises(ValueError):
        GRPOSettings(loss_type="ppo")
    with pytest.raises(ValueError):
        GRPOSettings(unknown_key=1)


# ----------------------------------------------------------------------------- rollouts


@pytest.fixture()
def model(tiny_model):
    return copy.deepcopy(tiny_model)


def _prompts(tok, n=3):
    from qerl.eval.generate import build_prompt
    from qerl.rl.arith import make_problems

    probs = make_problems(n, seed=1)
    ids = tok([build_prompt(tok, p.question, "gsm8k") for p in probs], add_special_tokens=False)["input_ids"]
    ids[1] = ids[1][3:]  # uneven lengths: left padding is exercised
    return probs, ids


def test_rollout_logprobs_match_training_forward(model, tiny_tokenizer):
    from qerl.eval.generate import stop_token_ids
    from qerl.rl.rollout import RolloutSettings, policy_logprobs, sample_rollouts

    _, ids = _prompts(tiny_tokenizer)
    # a large stop set so that some rows finish early
    stops = stop_token_ids(tiny_tokenizer) + list(range(0, 151000, 40))
    rs = RolloutSettings(num_generations=3, max_new_tokens=10, temperature=1.0, stop_ids=stops, pad_id=151643)
    batch = sample_rollouts(model, ids, rs, torch.Generator().manual_seed(0))
    assert batch.num_rows == 9 and batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    lengths = batch.lengths
    assert bool(batch.finished.any()) and not bool(batch.finished.all())
    for row in range(9):
        n = int(lengths[row])
        assert bool(batch.finished[row]) == (int(batch.completion_ids[row, n - 1]) in stops)
        assert bool((batch.completion_mask[row, n:] == 0).all())
    m = batch.completion_mask.bool()
    with torch.no_grad():
        shared = policy_logprobs(model, batch, share_prompt=True)
        full = policy_logprobs(model, batch, share_prompt=False)
    torch.testing.assert_close(shared[m], full[m], rtol=0, atol=2e-5)
    torch.testing.assert_close(batch.logprobs[m], full[m], rtol=0, atol=2e-5)
    # same seed, same samples, with or without the shared prompt prefix
    rs.share_prompt = False
    again = sample_rollouts(model, ids, rs, torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, batch.completion_ids)


def test_shared_prefix_gradient_equals_full_forward(model, tiny_tokenizer):
    from qerl.eval.generate import stop_token_ids
    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.rl.rollout import RolloutSettings, policy_logprobs, sample_rollouts

    peft_model = apply_lora(model, LoraSettings(r=2))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    _, ids = _prompts(tiny_tokenizer, 2)
    rs = RolloutSettings(num_generations=2, max_new_tokens=6, stop_ids=stop_token_ids(tiny_tokenizer), pad_id=151643)
    batch = sample_rollouts(peft_model, ids, rs, torch.Generator().manual_seed(1))
    grads = []
    for share in (True, False):
        peft_model.zero_grad()
        lp = policy_logprobs(peft_model, batch, share_prompt=share)
        (lp * batch.completion_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in peft_model.parameters() if p.requires_grad]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- training loop


def _small_settings(**kw) -> GRPOSettings:
    base = dict(
        max_steps=3, num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_completion_length=6, learning_rate=1e-3, save_steps=1, save_total_limit=None,
    )
    base.update(kw)
    return GRPOSettings(**base)


def _problems(n=16):
    from qerl.rl.arith import make_problems

    return make_problems(n, seed=0)


def _alternating_reward(completions, problem_id=None, **kwargs):
    """Variance inside every group (0/1 alternating), so every step has a gradient."""
    return [float(i % 2) for i in range(len(completions))]


_alternating_reward.is_accuracy = True


def test_three_step_run_logs_every_metric_and_checkpoints(model, tiny_model, tiny_tokenizer, tmp_path):
    from qerl.nn.aqn import AQNSettings
    from qerl.rl.rewards import format_reward
    from qerl.rl.trainer import COMPLETE, METRIC_KEYS, train

    logged = []
    settings = _small_settings(beta=0.05, loss_type="grpo", num_iterations=2, mask_truncated_completions=False)
    result = train(
        model, tiny_tokenizer, settings, AQNSettings(enabled=True, num_stages=3), _problems(),
        [_alternating_reward, format_reward], tmp_path, log_fn=lambda s, m: logged.append((s, m)),
    )
    assert [s for s, _ in logged] == [1, 2, 3] and result.steps == 3
    for _, m in logged:
        missing = [k for k in (*METRIC_KEYS, "kl") if k not in m]
        assert not missing, missing
        assert all(math.isfinite(float(v)) for v in m.values())
    assert [m["aqn_sigma"] for _, m in logged] == pytest.approx([0.0, 1e-2, 1e-4])
    assert logged[0][1]["accuracy"] == 0.5 and logged[0][1]["grad_norm"] > 0
    for step in (1, 2, 3):
        ck = tmp_path / f"checkpoint-{step}"
        assert (ck / COMPLETE).exists() and (ck / "adapter_model.safetensors").exists()
        assert (ck / "adapter_config.json").exists()
        state = torch.load(ck / "trainer_state.pt", weights_only=True)
        assert {"optimizer", "scheduler", "rng"} <= set(state)
        meta = json.loads((ck / "trainer_state.json").read_text())
        assert meta["step"] == step and len(meta["history"]) == step
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    # the trained adapter loads back as a standard PEFT adapter
    from qerl.nn.lora import load_lora

    loaded = load_lora(copy.deepcopy(tiny_model), tmp_path / "adapter")
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, result.model(x).logits)


def test_dynamic_sampling_drops_zero_variance_groups_and_refills(model, tiny_tokenizer, tmp_path):
    from qerl.rl.trainer import train

    problems = _problems(16)
    constant = {p.id for i, p in enumerate(problems) if i % 4}  # 3/4 of the prompts always get reward 1

    def reward(completions, problem_id=None, **kw):
        return [1.0 if pid in constant else float(i % 2) for i, pid in enumerate(problem_id)]

    logged = []
    settings = _small_settings(max_steps=2, dynamic_sampling=True, max_dynamic_sampling_rounds=6, save_steps=10)
    train(model, tiny_tokenizer, settings, None, problems, [reward], tmp_path, log_fn=lambda s, m: logged.append(m))
    for m in logged:
        assert m["groups_trained"] == settings.prompts_per_step  # refilled to a full batch of useful groups
        assert m["zero_variance_groups_frac"] < 1
    assert any(m["zero_variance_groups_frac"] > 0 for m in logged)
    assert any(m["sampling_rounds"] > 1 for m in logged)


def test_nan_reward_stops_with_training_error_and_keeps_last_checkpoint(model, tiny_tokenizer, tmp_path):
    from qerl.rl.trainer import TrainingError, latest_checkpoint, train

    def reward(completions, step=None, **kw):
        return [float("nan") if step == 3 else float(i % 2) for i in range(len(completions))]

    with pytest.raises(TrainingError, match="non-finite reward"):
        train(model, tiny_tokenizer, _small_settings(max_steps=4), None, _problems(), [reward], tmp_path)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert not (tmp_path / "checkpoint-3").exists()


def test_oom_is_reraised_with_a_hint(model, tiny_tokenizer, tmp_path):
    from qerl.rl.trainer import TrainingOOM, train

    def oom_rollout(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="num_generations.*max_completion_length") as info:
        train(model, tiny_tokenizer, _small_settings(), None, _problems(), [_alternating_reward], tmp_path, rollout_fn=oom_rollout)
    assert isinstance(info.value, TrainingOOM)


_RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, json, time, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import train
    from qerl.rl.arith import make_problems
    src, out, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(src + "/model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src + "/tok")
    def reward(completions, **kw):
        return [float(i % 2) for i in range(len(completions))]
    def log(step, m):
        print("STEP", step, flush=True)
        time.sleep(pause)
    settings = GRPOSettings(max_steps=5, num_generations=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=1, max_completion_length=4, learning_rate=1e-3, save_steps=1,
        save_total_limit=None, seed=3)
    r = train(model, tok, settings, None, make_problems(8), [reward], out, log_fn=log, resume=True)
    print("RESULT", json.dumps({"resumed_from": r.resumed_from, "steps": [h["step"] for h in r.history]}))
    """
)


@pytest.mark.slow
def test_resume_after_sigkill(model, tiny_tokenizer, tmp_path):
    src = tmp_path / "src"
    model.save_pretrained(src / "model")
    tiny_tokenizer.save_pretrained(src / "tok")
    out = tmp_path / "run"
    script = tmp_path / "run_train.py"
    script.write_text(_RESUME_SCRIPT)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(src), str(out), "2.0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        while not (out / "checkpoint-2" / "COMPLETE").exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.time() < deadline, "no second checkpoint in time"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "checkpoint-5").exists()
    done = subprocess.run(
        [sys.executable, str(script), str(src), str(out), "0"], capture_output=True, text=True, env=env, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")][-1]
    res = json.loads(line.split(" ", 1)[1])
    assert res["resumed_from"] >= 2
    assert res["steps"] == [1, 2, 3, 4, 5]  # no gap, no duplicate, the same step count
    first_run_steps = [int(x.split()[1]) for x in done.stdout.splitlines() if x.startswith("STEP")]
    assert first_run_steps[0] == res["resumed_from"] + 1
    meta = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert [h["step"] for h in meta["history"]] == [1, 2, 3, 4, 5]


def test_update_raises_the_logprob_of_the_rewarded_sample(model, tiny_tokenizer):
    """The sign of the whole chain: one rewarded sample in a group gains probability, the others lose."""
    from qerl.eval.generate import stop_token_ids
    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.rl.rollout import RolloutSettings, policy_logprobs, sample_rollouts

    peft_model = apply_lora(model, LoraSettings(r=4))
    ids = [tiny_tokenizer("hello there, how are you", add_special_tokens=False)["input_ids"]]
    rs = RolloutSettings(num_generations=4, max_new_tokens=6, stop_ids=stop_token_ids(tiny_tokenizer), pad_id=151643)
    batch = sample_rollouts(peft_model, ids, rs, torch.Generator().manual_seed(0))
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    mask = batch.completion_mask.float()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    with torch.no_grad():
        before = (policy_logprobs(peft_model, batch) * mask).sum(-1)
    for _ in range(3):
        lp = policy_logprobs(peft_model, batch)
        loss, _ = grpo_loss(lp, lp.detach(), adv, mask, loss_type="dapo")
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        delta = (policy_logprobs(peft_model, batch) * mask).sum(-1) - before
    assert delta[0] > 0 and bool((delta[1:] < 0).all()), delta


def test_reward_fifths():
    from qerl.rl.trainer import TrainResult

    hist = [{"reward_mean": float(i)} for i in range(10)]
    r = TrainResult(steps=10, history=hist, out_dir=Path("."), adapter_dir=None, last_checkpoint=None, wall_time_s=0.0)
    assert r.reward_fifths() == (0.5, 8.5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_zero_advantage_rows_can_be_skipped_exactly(loss_type):
    """With beta = 0 the trainer leaves rows with A = 0 out of the forward; the normalisers still
    count them, so the gradient is unchanged."""
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(6, 4, generator=g).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(6, 4, generator=g)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0]), 3)  # group 2: zero variance
    mask = torch.ones(6, 4)
    full, _ = grpo_loss(logp, old, adv, mask, loss_type=loss_type, max_completion_length=4)
    (g_full,) = torch.autograd.grad(full, logp)
    live = adv != 0
    part, _ = grpo_loss(logp[live], old[live], adv[live], mask[live], loss_type=loss_type, max_completion_length=4,
                        num_sequences=6, num_tokens=float(mask.sum()))
    (g_part,) = torch.autograd.grad(part, logp)
    torch.testing.assert_close(g_part, g_full)
    torch.testing.assert_close(part, full)


def test_a_step_that_trains_nothing_advances_the_schedule_without_torchs_warning():
    """A first step with nothing to train (every advantage 0) still steps the learning-rate schedule;
    torch's "lr_scheduler.step() before optimizer.step()" warning is intended there and not shown,
    while other warnings pass through."""
    from qerl.rl.trainer import advance_schedule

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        advance_schedule(sched)
        warnings.warn("another warning", UserWarning)
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert [str(w.message) for w in seen] == ["another warning"]
    with warnings.catch_warnings(record=True) as bare:  # the same call straight to torch does warn
        warnings.simplefilter("always")
        fresh = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([p], lr=1e-3), lambda s: 1.0)
        fresh.step()
    assert any("lr_scheduler.step()" in str(w.message) for w in bare)


def test_reward_functions():
    from qerl.rl.rewards import accuracy, format_reward, get_reward_functions, gsm8k_accuracy, math_accuracy

    comps = ["3 + 4 = 7\n#### 7", "#### 8", "the answer is 7", [{"role": "assistant", "content": "#### 7"}]]
    assert gsm8k_accuracy(comps, answer=["7", "7", "7", "7"]) == [1.0, 0.0, 1.0, 1.0]
    assert format_reward(comps) == [1.0, 1.0, 0.0, 1.0]
    assert format_reward(["\\boxed{2}", "2"], benchmark=["math500", "math500"]) == [1.0, 0.0]
    assert math_accuracy(["so \\boxed{\\frac{1}{2}}", "\\boxed{3}"], answer=["\\frac12", "4"]) == [1.0, 0.0]
    assert accuracy(["#### 5", "\\boxed{5}"], answer=["5", "5"], benchmark=["arith", "math500"]) == [1.0, 1.0]
    assert get_reward_functions(["gsm8k_accuracy", "format"]) == [gsm8k_accuracy, format_reward]
    with pytest.raises(ValueError):
        get_reward_functions(["nope"])
    with pytest.raises(ValueError):
        gsm8k_accuracy(["1"], answer=["1", "2"])


def test_arith_problems_are_deterministic_and_gradable():
    from qerl.rl.arith import make_problems
    from qerl.rl.rewards import gsm8k_accuracy

    a, b = make_problems(50, seed=3), make_problems(50, seed=3)
    assert a == b and make_problems(50, seed=4) != a
    assert len({p.id for p in a}) == 50 and all(p.benchmark == "arith" for p in a)
    assert all(int(p.answer) >= 0 for p in a)
    assert gsm8k_accuracy([f"#### {p.answer}" for p in a], answer=[p.answer for p in a]) == [1.0] * 50


def test_bf16_autocast_auto_is_on_for_cuda_only():
    """GRPOSettings.bf16_autocast: "auto" (the default) resolves by the model's device; explicit
    booleans win; anything else is refused by the settings."""
    from pydantic import ValidationError

    from qerl.rl.grpo import GRPOSettings, autocast_enabled

    assert GRPOSettings().bf16_autocast == "auto"
    assert autocast_enabled("auto", "cuda") and autocast_enabled("auto", torch.device("cuda", 1))
    assert not autocast_enabled("auto", "cpu")
    assert autocast_enabled(True, "cpu") and not autocast_enabled(False, "cuda")
    assert GRPOSettings(bf16_autocast=True).bf16_autocast is True
    with pytest.raises(ValidationError):
        GRPOSettings(bf16_autocast="sometimes")


def test_warmup_steps_reads_as_transformers_does():
    """warmup_steps: whole steps, or a fraction of the updates below 1 (transformers 5 / TRL 1.16); warmup_ratio,
    the older name of the fraction, gives the same; both at once, or a fractional count of steps, is refused."""
    assert GRPOSettings(warmup_steps=3).warmup_updates(20) == 3
    assert GRPOSettings(warmup_steps=0.1).warmup_updates(25) == 3  # ceil(2.5)
    assert GRPOSettings(warmup_ratio=0.1).warmup_updates(25) == 3
    assert GRPOSettings().warmup_updates(25) == 0
    with pytest.raises(ValueError, match="not both"):
        GRPOSettings(warmup_steps=0.1, warmup_ratio=0.1)
    with pytest.raises(ValueError, match="whole number"):
        GRPOSettings(warmup_steps=2.5)
