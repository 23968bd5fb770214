"""The checkpoint plan of a GRPO step (GRPOSettings.checkpoint_layers, qerl/rl/memory_plan.py), on CPU
with tiny models: the probe of what a decoder layer keeps for its backward, the arithmetic that turns
free memory into layers run without checkpointing, training with some layers uncheckpointed (the same
gradients as with every layer checkpointed), and the fall-back to every layer after an out-of-memory
error. Whether the probe's bytes match a GPU's allocator is tests/test_memory_plan_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

GB = 10**9


def _policy(tiny_model, layers=2, checkpointing=True):
    """The tiny Llama (cut or grown to `layers`) as the trainer prepares it: LoRA r4 (B drawn, so the
    adapters matter; the same draw every call), float32, in train mode; with its GRPOSettings."""
    from qerl.nn.lora import LoraSettings
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import prepare_policy

    model = copy.deepcopy(tiny_model)
    if layers != len(model.model.layers):
        from transformers import LlamaForCausalLM

        cfg = copy.deepcopy(model.config)
        cfg.num_hidden_layers = layers
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg).float()
    for p in model.parameters():
        p.requires_grad_(False)
    settings = GRPOSettings(gradient_checkpointing=checkpointing, per_device_train_batch_size=2, num_generations=2,
                            bf16_autocast=False)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        policy = prepare_policy(model, settings, LoraSettings(r=4, lora_alpha=8))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    policy.train()
    return policy, settings


def _adapter_grads(policy, settings, aqn=None, noise_in_training=False, plan=None):
    """(loss, {name: gradient}) of one optimise_planned call on two random rows of a 6-token prompt
    + 5 tokens, at learning rate 0 (so repeated calls see the same weights); the gradients as the
    optimiser met them."""
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings
    from qerl.rl.rollout import RolloutBatch
    from qerl.rl.trainer import make_optimizer, optimise_planned

    batch = RolloutBatch.random(2, 6, 5, policy.config.vocab_size, seed=1, logprob=0.0)
    parts = [(batch, torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 1.0]))]
    settings = settings.model_copy(update={"learning_rate": 0.0})
    aqn = aqn or AdaptiveQuantNoise(policy, AQNSettings(enabled=False), total_steps=1)
    optimizer, scheduler = make_optimizer(policy, settings)
    captured = {}
    optimizer.register_step_pre_hook(lambda opt, *_: captured.update(
        {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    stats = optimise_planned(policy, parts, settings, optimizer, scheduler, aqn, noise_in_training, False, 1, None,
                             None, plan)
    return stats["loss"], captured


def test_probe_counts_one_layers_saved_activations_per_token(tiny_model):
    from qerl.rl.memory_plan import decoder_layers, layer_bytes_per_token

    policy, _ = _policy(tiny_model)
    layers = decoder_layers(policy)
    assert len(layers) == 2 and all(layer.gradient_checkpointing for layer in layers)
    per_token = layer_bytes_per_token(policy)
    cfg = policy.config
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * (h := cfg.hidden_size) // cfg.num_attention_heads
    # a Llama layer in float32 keeps at least its norms' inputs and outputs, q / k / v, the attention
    # output, gate / up / their product, and at most a few times that
    low = 4 * (4 * h + 2 * kv + 3 * i)
    assert low <= per_token <= 4 * low, (per_token, low)
    # linear in the tokens: another pair of lengths gives the same slope
    assert layer_bytes_per_token(policy, tokens=(32, 64)) == pytest.approx(per_token, rel=0.02)
    # per layer: a deeper model of the same width keeps the same bytes per layer
    deeper, _ = _policy(tiny_model, layers=4)
    assert layer_bytes_per_token(deeper) == pytest.approx(per_token, rel=0.02)
    # the probe leaves the layers as it found them: checkpointed, no hooks
    assert all(layer.gradient_checkpointing for layer in layers)
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in layers)


class _Memory:
    def __init__(self, total):
        self.total = total


def test_plan_turns_the_memory_left_into_uncheckpointed_layers(tiny_model):
    from types import SimpleNamespace

    from qerl.rl.memory_plan import PROBE_CREDIT, CheckpointPlan

    policy, _ = _policy(tiny_model, layers=4)
    probes = []

    def probe():
        probes.append(1)
        return 1000.0  # bytes per token and layer

    rollout = SimpleNamespace(projected=60 * GB)
    plan = CheckpointPlan("auto", torch.device("cpu"), memory=_Memory(100 * GB))
    # 90 GB usable - 60 projected = 30 GB; a layer over 8 rows x 1.5 M tokens keeps 12 GB: 2 layers
    plan.after_training(policy, rollout, rows=8, max_len=1_500_000, probe=probe)
    assert plan.free_layers == 2
    plan.apply(policy)
    assert [layer.gradient_checkpointing for layer in policy.base_model.model.model.layers] == [True, True, False, False]
    assert plan.applied == 2 and plan.applied_bytes(rows=8, trained_len=1_000_000) == int(PROBE_CREDIT * 2 * 1000 * 8 * 1_000_000)
    # capped at the model's layers; the probe ran once
    plan.after_training(policy, SimpleNamespace(projected=1 * GB), rows=1, max_len=10, probe=probe)
    assert plan.free_layers == 4 and len(probes) == 1
    # no room: none
    plan.after_training(policy, SimpleNamespace(projected=95 * GB), rows=1, max_len=10, probe=probe)
    assert plan.free_layers == 0
    # "all", no GPU (no allocator), no projection yet: every layer checkpointed
    for p in (CheckpointPlan("all", torch.device("cpu"), memory=_Memory(100 * GB)), CheckpointPlan("auto", torch.device("cpu"))):
        p.after_training(policy, rollout, rows=8, max_len=10, probe=probe)
        assert p.free_layers == 0
    plan.after_training(policy, SimpleNamespace(projected=None), rows=8, max_len=10, probe=probe)
    assert plan.free_layers == 0
    # after an out-of-memory error with free layers: every layer checkpointed from then on
    plan.after_training(policy, rollout, rows=8, max_len=1_500_000, probe=probe)
    plan.apply(policy)
    assert plan.recompute_all_after_oom(policy)
    assert all(layer.gradient_checkpointing for layer in policy.base_model.model.model.layers)
    assert not plan.recompute_all_after_oom(policy)  # nothing left to give back
    plan.after_training(policy, SimpleNamespace(projected=1 * GB), rows=1, max_len=10, probe=probe)
    assert plan.free_layers == 0
    with pytest.raises(ValueError, match="checkpoint_layers"):
        CheckpointPlan("some", torch.device("cpu"))


def test_rollout_plan_projects_the_next_peak_without_the_planned_layers():
    from qerl.rl.memory_plan import RolloutMemoryPlan

    from tests.test_step_memory import _Allocator

    model = torch.nn.Linear(2, 2)
    # step 1 frees (30 -> 20 GB reserved: 10 held), training peaks at 60 of which 12 were free layers':
    # without them 48, so keeping fits (48 + 10 <= 90); next peak 48 + 10 = 58 at the same length,
    # 20 + 28 * 1.5 + 10 = 72 at a 1.5x longer limit
    alloc = _Allocator(100 * GB, script=[30 * GB, 20 * GB, 30 * GB, 20 * GB], peaks=[60 * GB, 60 * GB])
    plan = RolloutMemoryPlan("auto", torch.device("cpu"), memory=alloc)
    plan.after_rollout(model)
    plan.after_training(trained_len=1000, max_len=1000, unplanned=12 * GB)
    assert plan.keeping and plan.projected == 58 * GB
    plan2 = RolloutMemoryPlan(True, torch.device("cpu"), memory=alloc)
    plan2.after_rollout(model)
    plan2.after_training(trained_len=1000, max_len=1500, unplanned=12 * GB)
    assert not plan2.keeping and plan2.projected == 20 * GB + 28 * GB * 1.5


def test_training_with_uncheckpointed_layers_gives_the_same_gradients(tiny_model):
    """optimise on one micro-batch with every layer checkpointed and with one layer not: the same
    loss and adapter gradients (the recomputation gives what the forward kept)."""
    from qerl.rl.memory_plan import CheckpointPlan

    policy, settings = _policy(tiny_model)
    grads = []
    for free in (0, 1):
        plan = CheckpointPlan("auto", torch.device("cpu"))
        plan.free_layers = free
        loss, captured = _adapter_grads(policy, settings, plan=plan)
        assert plan.applied == free
        assert [layer.gradient_checkpointing for layer in policy.base_model.model.model.layers] == [True, not free]
        grads.append((loss, captured))
    (l0, g0), (l1, g1) = grads
    assert len(g0) > 0 and g0.keys() == g1.keys()
    assert l0 == pytest.approx(l1, rel=1e-6, abs=1e-7)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7)


def _train_planned(tiny_model, tiny_tokenizer, tmp_path, monkeypatch, steps=2):
    """`steps` GRPO steps with gradient checkpointing and checkpoint_layers "auto", the plans over a
    scripted 100 GB allocator (GB; tests.test_step_memory._Allocator): step 1 frees 5 GB of rollout
    memory and peaks at 6, so step 2 keeps it and has room to run both layers uncheckpointed."""
    from qerl.rl import trainer as trainer_mod
    from qerl.rl.arith import make_problems
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.memory_plan import CheckpointPlan, RolloutMemoryPlan

    from tests.test_step_memory import _Allocator

    alloc = _Allocator(100 * GB, script=[10 * GB, 5 * GB] + [10 * GB] * 12, peaks=[6 * GB] * 6)
    monkeypatch.setattr(trainer_mod, "RolloutMemoryPlan", lambda setting, device: RolloutMemoryPlan(setting, device, memory=alloc))
    monkeypatch.setattr(trainer_mod, "CheckpointPlan",
                        lambda setting, device: CheckpointPlan(setting, device, memory=_Memory(100 * GB)))

    def reward(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    settings = GRPOSettings(max_steps=steps, num_generations=2, per_device_train_batch_size=2,
                            gradient_accumulation_steps=2, max_completion_length=5, learning_rate=1e-3, save_steps=1,
                            logprob_chunk_tokens=3, gradient_checkpointing=True, checkpoint_layers="auto")
    logged = []
    result = trainer_mod.train(copy.deepcopy(tiny_model), tiny_tokenizer, settings, None, make_problems(4, seed=0),
                               [reward], tmp_path, log_fn=lambda s, m: logged.append(m))
    return result, logged


def test_trainer_runs_the_planned_layers_uncheckpointed(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    result, logged = _train_planned(tiny_model, tiny_tokenizer, tmp_path, monkeypatch)
    assert [m["uncheckpointed_layers"] for m in logged] == [0.0, 2.0]
    assert [m["rollout_memory_released"] for m in logged] == [1.0, 0.0]
    assert all(m["loss"] == m["loss"] for m in logged)  # finite, not NaN


def test_an_oom_with_uncheckpointed_layers_checkpoints_them_again_and_retrains(tiny_model, tiny_tokenizer, tmp_path,
                                                                             monkeypatch):
    from tests.test_step_memory import _flaky_optimise

    calls = _flaky_optimise(monkeypatch, fail_at={2})
    with pytest.warns(RuntimeWarning, match="step 2: training ran out of memory with decoder layers kept from "
                                            "checkpointing.*trains again"):
        result, logged = _train_planned(tiny_model, tiny_tokenizer, tmp_path, monkeypatch)
    assert len(calls) == 3  # step 1 once, step 2 twice
    # step 2 trained again with every layer checkpointed; the rollout memory stayed kept
    assert [m["uncheckpointed_layers"] for m in logged] == [0.0, 0.0]
    assert [m["rollout_memory_released"] for m in logged] == [1.0, 0.0]
    layers = result.model.base_model.model.model.layers
    assert all(layer.gradient_checkpointing for layer in layers)


class _FailOnceInBackward(torch.autograd.Function):
    """Identity whose first backward raises out-of-memory, as an allocation inside a node's backward
    does on a GPU; `raised` (a list) records it."""

    @staticmethod
    def forward(ctx, t, raised):
        ctx.raised = raised
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.raised:
            ctx.raised.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        return grad, None


def test_the_retry_after_an_oom_in_the_backward_starts_with_the_first_attempts_activations_freed(tiny_model):
    """optimise_planned's fall-back after an out-of-memory error raised in the backward of the last layer's
    MLP (run uncheckpointed), while the first layer (checkpointed) still waits for its gradient: the retry
    starts with none of the first attempt's activations alive (here the first layer's output, which the
    second layer saved; a GPU retry that still held them would run out again), runs every layer
    checkpointed and trains to the gradients of a run that never failed."""
    import weakref

    from qerl.rl.memory_plan import CheckpointPlan

    policy, settings = _policy(tiny_model)
    layers = policy.base_model.model.model.layers
    reference = _adapter_grads(policy, settings)
    first_outputs, alive_at_retry, raised = [], [], []

    def fail_inside(module, args, output):
        return _FailOnceInBackward.apply(output, raised) if torch.is_grad_enabled() else output

    def keep_ref(module, args, output):
        if torch.is_grad_enabled() and not raised:
            first_outputs.append(weakref.ref(output[0] if isinstance(output, tuple) else output))

    def check_at_retry(module, args):
        if raised and torch.is_grad_enabled() and not alive_at_retry:
            alive_at_retry.append(any(r() is not None for r in first_outputs))

    hooks = [layers[-1].mlp.register_forward_hook(fail_inside), layers[0].register_forward_hook(keep_ref),
             layers[0].register_forward_pre_hook(check_at_retry)]
    plan = CheckpointPlan("auto", torch.device("cpu"))
    plan.free_layers = 1
    try:
        with pytest.warns(RuntimeWarning, match="ran out of memory with decoder layers kept from checkpointing"):
            loss, grads = _adapter_grads(policy, settings, plan=plan)
    finally:
        for h in hooks:
            h.remove()
    assert raised and first_outputs and alive_at_retry == [False]
    assert all(layer.gradient_checkpointing for layer in layers)
    assert loss == pytest.approx(reference[0], rel=1e-6, abs=1e-7)
    assert grads.keys() == reference[1].keys()
    for k in reference[1]:
        torch.testing.assert_close(grads[k], reference[1][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("place", ["rollout", "both"])
def test_checkpointing_gives_the_gradients_of_no_checkpointing_under_aqn(tiny_model, place):
    """With AQN noise in training (place "both") the checkpointed layers' recomputation in the
    backward must run under the same noisy norms as the forward: the adapter gradients equal those of
    a run without checkpointing (a large sigma makes a miss obvious: 9% off before the fix)."""
    from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings

    grads = []
    for checkpointing in (False, True):
        policy, settings = _policy(tiny_model, checkpointing=checkpointing)
        aqn = AdaptiveQuantNoise(policy, AQNSettings(enabled=True, place=place, sigma_start=0.05, sigma_end=0.05),
                                 total_steps=10)
        assert aqn.resample(5) == 0.05
        grads.append(_adapter_grads(policy, settings, aqn, place == "both")[1])
    g0, g1 = grads
    assert len(g0) > 0 and g0.keys() == g1.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-7)


def test_a_device_memory_cap_is_what_the_plans_size_against():
    """GRPOSettings.device_memory_gib: the plans read the allocator's per-process fraction as the card's size
    (allowed_bytes); off a CUDA device, or without a value, nothing is capped; a cap must be positive. That the
    allocator then refuses more is tests/test_memory_plan_gpu.py."""
    from pydantic import ValidationError

    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.memory_plan import allowed_bytes, cap_device_memory, fits_with_rollout_memory

    h200 = 150_754_820_096  # an H200's total_memory
    assert allowed_bytes(h200, None) == allowed_bytes(h200, 1.0) == h200
    capped = allowed_bytes(h200, 79 * 2**30 / h200)
    assert abs(capped - 79 * 2**30) <= 1 and allowed_bytes(h200, 1.7) == h200
    # a step that fits the whole H200 with its KV cache held no longer fits the capped one
    base, peak, held = 40 * 2**30, 66 * 2**30, 6 * 2**30
    assert fits_with_rollout_memory(base, peak, held, h200) and not fits_with_rollout_memory(base, peak, held, capped)
    assert cap_device_memory("cpu", 79) is None and cap_device_memory("cpu", None) is None
    assert GRPOSettings(device_memory_gib=79).device_memory_gib == 79.0 and GRPOSettings().device_memory_gib is None
    for bad in (0, -1):
        with pytest.raises(ValidationError):
            GRPOSettings(device_memory_gib=bad)
