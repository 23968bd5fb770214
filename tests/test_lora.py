"""LoRA over QuantLinear through PEFT: wrapping, frozen 4-bit base, save/load, zero-init identity."""

from __future__ import annotations

import copy

import pytest
import torch

from qerl.model import build_random
from qerl.nn.lora import (
    DEFAULT_TARGET_MODULES,
    LoraSettings,
    QuantLoraLinear,
    apply_lora,
    load_lora,
    trainable_parameters,
)
from qerl.nn.quant_linear import QuantLinear
from qerl.quantize import quantize_


def _tiny(fmt: str = "nvfp4"):
    model = build_random("tiny-llama", torch.float32, seed=0)
    if fmt != "bf16":
        quantize_(model, fmt, progress=False)
    return model.eval()


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5000, (2, 9), generator=g)


def _randomise_lora(model, seed: int = 1, norms: bool = False) -> None:
    """Non-zero lora_B (a fresh adapter is the identity); with norms, also move the trainable norm weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        if norms:
            for name, p in trainable_parameters(model).items():
                if "norm" in name:
                    p.add_(0.01 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_peft_wraps_every_target_module(fmt):
    model = apply_lora(_tiny(fmt))
    layers = model.get_base_model().config.num_hidden_layers
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, QuantLoraLinear)}
    assert wrapped == set(DEFAULT_TARGET_MODULES)
    count = sum(isinstance(m, QuantLoraLinear) for m in model.modules())
    assert count == len(DEFAULT_TARGET_MODULES) * layers
    for m in model.modules():
        if isinstance(m, QuantLoraLinear):
            assert isinstance(m.get_base_layer(), QuantLinear)
            assert m.get_base_layer().fmt == fmt
            assert "qweight" not in m.get_base_layer().__dict__  # injection helper cleaned up


def test_only_lora_params_train():
    model = apply_lora(_tiny(), LoraSettings(r=4))
    names = list(trainable_parameters(model))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * len(DEFAULT_TARGET_MODULES) * model.get_base_model().config.num_hidden_layers
    for m in model.modules():
        if isinstance(m, QuantLinear):
            assert not any(p.requires_grad for p in m.parameters())


def test_trainable_norms_option():
    model = apply_lora(_tiny(), LoraSettings(r=4, train_norms=True))
    names = list(trainable_parameters(model))
    norms = [n for n in names if "lora_" not in n]
    assert norms and all("norm" in n and "modules_to_save" in n for n in norms)
    # input_layernorm + post_attention_layernorm per layer, plus the final norm
    assert len(norms) == 2 * model.get_base_model().config.num_hidden_layers + 1


def test_zero_init_B_equals_quantlinear_output():
    base = _tiny()
    x = _ids()
    with torch.no_grad():
        ref = base(x).logits
    q = base.model.layers[0].self_attn.q_proj
    h = torch.randn(3, q.in_features)
    with torch.no_grad():
        q_ref = q(h)
    model = apply_lora(base)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    assert isinstance(layer, QuantLoraLinear)
    assert all(float(layer.lora_B[a].weight.detach().abs().max()) == 0.0 for a in layer.lora_B)
    with torch.no_grad():
        assert torch.equal(layer(h), q_ref)
        assert torch.equal(model(x).logits, ref)


def test_lora_path_is_unmerged_low_rank_product():
    model = apply_lora(_tiny(), LoraSettings(r=4, lora_alpha=8))
    _randomise_lora(model)
    layer = model.get_base_model().model.layers[1].mlp.down_proj
    h = torch.randn(5, layer.in_features)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        expected = layer.get_base_layer()(h) + (h @ a.T @ b.T) * (8 / 4)
        torch.testing.assert_close(layer(h), expected, rtol=1e-5, atol=1e-6)
        with model.disable_adapter():
            assert torch.equal(layer(h), layer.get_base_layer()(h))
    with pytest.raises(NotImplementedError, match="unmerged"):
        layer.merge()


def test_packed_buffers_never_change_after_optimiser_step():
    model = apply_lora(_tiny(), LoraSettings(r=4, train_norms=True))
    _randomise_lora(model)
    before = {n: b.clone() for n, b in model.named_buffers() if "weight_" in n}
    assert before, "no packed buffers found"
    lora_before = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    opt = torch.optim.AdamW(trainable_parameters(model).values(), lr=1e-2)
    model.train()
    for _ in range(2):
        loss = model(_ids()).logits.float().pow(2).mean()
        loss.backward()
        for m in model.modules():
            if isinstance(m, QuantLinear):
                assert all(t.grad is None for t in m.buffers())
        opt.step()
        opt.zero_grad()
    for n, b in model.named_buffers():
        if n in before:
            assert torch.equal(b, before[n]), n
    changed = [n for n, p in trainable_parameters(model).items() if not torch.equal(p, lora_before[n])]
    assert len(changed) == len(lora_before)


@pytest.mark.parametrize("train_norms", [False, True])
def test_adapter_save_load_round_trip(tmp_path, train_norms):
    base = _tiny()
    fresh = copy.deepcopy(base)
    model = apply_lora(base, LoraSettings(r=4, train_norms=train_norms))
    _randomise_lora(model, norms=train_norms)
    x = _ids(3)
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "adapter_config.json").exists()
    loaded = load_lora(fresh, tmp_path)
    with torch.no_grad():
        got = loaded(x).logits
    assert torch.equal(got, expected)
    trainable = load_lora(copy.deepcopy(_tiny()), tmp_path, is_trainable=True)
    assert trainable_parameters(trainable)


def test_bf16_linears_use_peft_default_layer():
    model = apply_lora(_tiny("bf16"), LoraSettings(r=4))
    assert not any(isinstance(m, QuantLoraLinear) for m in model.modules())
    assert len(trainable_parameters(model)) == 2 * len(DEFAULT_TARGET_MODULES) * 2


def test_unknown_target_module_is_a_clear_error():
    with pytest.raises(ValueError, match="not linear layers"):
        apply_lora(_tiny(), LoraSettings(target_modules=["q_proj", "nonexistent"]))


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_first_forward_in_inference_mode_then_training_backward(fmt):
    # A rollout (torch.inference_mode) runs before the first training forward: the dequantised
    # weight cached by that first call must still serve a backward pass (LoRA's grad_x).
    model = apply_lora(_tiny(fmt), LoraSettings(r=4))
    _randomise_lora(model)
    with torch.inference_mode():
        ref = model(_ids()).logits
    model.train()
    loss = model(_ids()).logits.float().pow(2).mean()
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert torch.allclose(model(_ids()).logits.detach(), ref)


def test_adapters_built_while_another_thread_loads_a_checkpoint_are_initialised():
    """transformers' no_init_weights patches torch.nn.init in every thread while a checkpoint
    skeleton is built; LoRA injected in another thread at that moment kept torch.empty garbage
    (NaN rollouts in the flow). Both now hold qerl.threads.INIT_LOCK: a loader thread builds
    skeletons in a loop while this thread wraps fresh models, and every lora_A is initialised
    (kaiming uniform: nonzero, finite, within 1/sqrt(fan_in))."""
    import threading

    from qerl.checkpoint import _empty_model
    from qerl.model import random_config
    from qerl.threads import INIT_LOCK

    cfg = random_config("tiny-llama")
    stop = threading.Event()

    def loader():
        while not stop.is_set():
            _empty_model(cfg)

    t = threading.Thread(target=loader, daemon=True)
    t.start()
    try:
        for _ in range(12):
            peft_model = apply_lora(build_random("tiny-llama", torch.float32))
            for name, p in peft_model.named_parameters():
                if "lora_A" in name:
                    bound = 1.0 / p.shape[1] ** 0.5
                    assert torch.isfinite(p).all() and p.abs().max() > 0 and p.abs().max() <= bound + 1e-6, name
    finally:
        stop.set()
        t.join()

    # and a holder of the lock really holds off an adapter build in another thread
    done = threading.Event()
    with INIT_LOCK:
        w = threading.Thread(target=lambda: (apply_lora(build_random("tiny-llama", torch.float32)), done.set()))
        w.start()
        assert not done.wait(0.5)
    w.join(60)
    assert done.is_set()


def test_seeded_adapters_do_not_depend_on_the_process_wide_rng():
    """apply_lora(seed=s): the same A matrices whatever the global RNG's state (other threads of the flow reseed it
    and draw from it while a trainer builds its adapters), PEFT's distribution U(+-1/sqrt(in_features)), B zero;
    another seed gives other A matrices. The trainer builds its adapters this way from GRPO's seed."""
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import prepare_policy

    def lora(model, key):
        return {n: p.detach().clone() for n, p in model.named_parameters() if key in n}

    torch.manual_seed(1)
    a = apply_lora(_tiny("nvfp4"), seed=7)
    torch.manual_seed(2)
    torch.rand(1000)
    b = apply_lora(_tiny("nvfp4"), seed=7)
    la, lb = lora(a, "lora_A"), lora(b, "lora_A")
    assert la and la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)
    for n, p in la.items():
        bound = 1.0 / p.shape[1] ** 0.5
        assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound and abs(float(p.mean())) < 0.2 * bound, n
    assert all(not p.any() for p in lora(a, "lora_B").values())
    other = lora(apply_lora(_tiny("nvfp4"), seed=8), "lora_A")
    assert not any(torch.equal(other[k], la[k]) for k in la)
    torch.manual_seed(3)
    policy = lora(prepare_policy(_tiny("nvfp4"), GRPOSettings(seed=7, gradient_checkpointing=False)), "lora_A")
    assert all(torch.equal(policy[k], la[k]) for k in la)


def test_an_optimizer_state_saved_in_one_group_resumes_in_the_decay_groups():
    """Checkpoints from before session 53 saved AdamW with one parameter group; with trainable norms the optimizer
    now keeps them in an undecayed group. Each parameter's moments follow it to its new place."""
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import make_optimizer, regrouped_optimizer_state

    model = apply_lora(_tiny(), LoraSettings(r=4, train_norms=True), seed=1)
    params = [p for p in model.parameters() if p.requires_grad]
    old = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # the old layout: everything in one group
    for p in params:
        p.grad = torch.randn_like(p)
    old.step()
    optimizer, _ = make_optimizer(model, GRPOSettings(weight_decay=0.1, learning_rate=1e-3))
    assert len(optimizer.param_groups) == 2
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] != [id(p) for p in params]  # reordered
    optimizer.load_state_dict(regrouped_optimizer_state(old.state_dict(), optimizer, model))
    for p in params:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], old.state[p][key]), key
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    # a state saved in today's layout loads as it is
    assert regrouped_optimizer_state(optimizer.state_dict(), optimizer, model)["param_groups"] == \
        optimizer.state_dict()["param_groups"]


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
@pytest.mark.parametrize("train_norms", [False, True])
def test_a_saved_adapter_loads_with_plain_peft_on_the_dequantised_model(tmp_path, fmt, train_norms):
    """The adapter a run logs (PEFT format) is usable without qerl: `peft.PeftModel.from_pretrained` on a plain
    Hugging Face model holding the dequantised weights gives the logits of the 4-bit model with the adapter."""
    from peft import PeftModel

    from qerl.quantize import dequantize_

    quantized = _tiny(fmt)
    plain = copy.deepcopy(quantized)
    assert dequantize_(plain, torch.float32) == 7 * plain.config.num_hidden_layers
    model = apply_lora(quantized, LoraSettings(r=4, train_norms=train_norms), seed=0)
    with pytest.raises(ValueError, match="without its LoRA adapters"):
        dequantize_(copy.deepcopy(model))
    _randomise_lora(model, norms=train_norms)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(plain, tmp_path).eval()
    assert not any(isinstance(m, QuantLinear) for m in loaded.modules())
    x = _ids(5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-4, atol=1e-5)
