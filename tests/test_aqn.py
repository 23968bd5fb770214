"""AQN: the sigma schedule, the noise really reaching the logits (by the expected amount), exact restore."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from qerl.model import build_random
from qerl.nn.aqn import (
    AdaptiveQuantNoise,
    AQNSettings,
    aqn_sigmas,
    find_norm_targets,
    sigma_at_step,
    stage_at_step,
)
from qerl.nn.lora import LoraSettings, apply_lora
from qerl.quantize import quantize_


def _tiny(fmt: str = "nvfp4", seed: int = 0):
    model = build_random("tiny-llama", torch.float32, seed=seed)
    if fmt != "bf16":
        quantize_(model, fmt, progress=False)
    # Random init leaves every norm weight at 1.0; make them uneven so w and z are told apart.
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.rand(p.shape, generator=g))
    return model.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 5000, (2, 11), generator=torch.Generator().manual_seed(0))


def test_sigma_table():
    sig = aqn_sigmas(1e-2, 1e-4, 10)
    print("\nAQN sigma per stage (sigma_start 1e-2, sigma_end 1e-4, K=10):")
    for i, s in enumerate(sig):
        print(f"  stage {i}: {s:.6e}")
    assert len(sig) == 10 and sig[0] == 0.0
    assert sig[1] == pytest.approx(1e-2, rel=1e-12) and sig[9] == pytest.approx(1e-4, rel=1e-12)
    for i in range(1, 10):  # exactly DESIGN.md section 3
        assert sig[i] == pytest.approx(1e-2 * (1e-4 / 1e-2) ** ((i - 1) / 8), rel=1e-12)
    ratios = [sig[i + 1] / sig[i] for i in range(1, 9)]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-9)  # geometric
    assert sig[5] == pytest.approx(1e-3, rel=1e-12)  # halfway in log space
    assert aqn_sigmas(1e-2, 1e-4, 2) == [0.0, 1e-2]
    with pytest.raises(ValueError):
        aqn_sigmas(1e-2, 1e-4, 1)


def test_sigma_at_step_uses_equal_stages():
    assert [stage_at_step(s, 100, 10) for s in (0, 9, 10, 19, 55, 99)] == [0, 0, 1, 1, 5, 9]
    assert sigma_at_step(5, 100) == 0.0
    assert sigma_at_step(10, 100) == pytest.approx(1e-2)
    assert sigma_at_step(99, 100) == pytest.approx(1e-4)
    # fewer steps than stages: every step is its own stage, the schedule still ends at sigma_end
    assert [stage_at_step(s, 5, 10) for s in range(5)] == [0, 2, 4, 6, 8]
    assert stage_at_step(250, 100, 10) == 9  # clamped


def test_targets_are_every_decoder_norm():
    model = _tiny()
    targets = find_norm_targets(model)
    names = [t.name for t in targets]
    assert names == [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    assert all(t.hidden_size == 64 and len(t.modules) == 1 for t in targets)


def _capture_inputs(model, module_names):
    store = {}
    hooks = []
    for name in module_names:
        mod = model.get_submodule(name)
        hooks.append(mod.register_forward_pre_hook(lambda m, args, name=name: store.__setitem__(name, args[0].detach().clone())))
    return store, hooks


@pytest.mark.parametrize("fmt", ["bf16", "nf4", "mxfp4", "nvfp4"])
def test_noise_reaches_the_quantised_linears_exactly(fmt):
    """q/k/v and gate/up see x_hat * (w + z): the change of their input is x_hat * z, in every weight format
    (the recipe's AQN variants put it on bf16, nf4 and mxfp4 as well as nvfp4)."""
    model = _tiny(fmt)
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True, num_stages=2, sigma_start=1e-2, sigma_end=1e-2), 2)
    assert aqn.resample(1) == pytest.approx(1e-2)
    sites = {
        "model.layers.0.self_attn.q_proj": ("model.layers.0.input_layernorm", 0),
        "model.layers.1.mlp.gate_proj": ("model.layers.1.post_attention_layernorm", 3),
    }
    x = _ids()
    store, hooks = _capture_inputs(model, list(sites))
    with torch.no_grad():
        # the input of each site's norm, captured in the clean pass, is replayed for the noisy one
        norm_in, norm_hooks = _capture_inputs(model, [v[0] for v in sites.values()])
        model(x)
        clean = dict(store)
        for h in norm_hooks:
            h.remove()
        for lin, (norm_name, k) in sites.items():
            norm = model.get_submodule(norm_name)
            z = aqn.noise_vectors()[k]
            with aqn.applied():
                noisy_out = norm(norm_in[norm_name])
            clean_out = norm(norm_in[norm_name])
            torch.testing.assert_close(clean_out, clean[lin], rtol=0, atol=0)
            x_hat = clean_out / norm.weight  # the normalised input (w > 0 here)
            # float32: (w + z) * x_hat - w * x_hat differs from z * x_hat by rounding only (~1e-7 of O(1) values)
            torch.testing.assert_close(noisy_out - clean_out, x_hat * z, rtol=1e-3, atol=1e-6)
            assert float(z.std()) == pytest.approx(1e-2, rel=0.35)
    for h in hooks:
        h.remove()


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits.double()


def test_logits_change_by_the_expected_amount():
    """Noisy logits = clean + J z to first order (J from autograd): the change has the size that the
    noise predicts, scales linearly with sigma, and is exactly zero at stage 0."""
    model = _tiny()
    model.set_attn_implementation("eager")  # forward-mode AD (jvp) has no CPU flash-attention rule
    x = _ids()
    clean = _logits(model, x)
    targets = find_norm_targets(model)

    # stage 0: nothing happens, bit for bit
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True), total_steps=100)
    assert aqn.resample(3) == 0.0
    with aqn.applied() as s:
        assert s == 0.0
        assert torch.equal(_logits(model, x), clean)

    rel = {}
    for sigma in (1e-2, 1e-3):
        aqn = AdaptiveQuantNoise(
            model, AQNSettings(enabled=True, num_stages=2, sigma_start=sigma, sigma_end=sigma, seed=5), total_steps=2
        )
        aqn.resample(1)
        zs = aqn.noise_vectors()
        with aqn.applied():
            noisy = _logits(model, x)
        delta = noisy - clean
        # first-order prediction: directional derivative of the logits along z (torch.func.jvp)
        from torch.func import functional_call, jvp

        names = [f"{t.name}.weight" for t in targets]
        params = dict(model.named_parameters())
        primals = tuple(params[n].detach() for n in names)

        def f(*ws):
            return functional_call(model, {n: w for n, w in zip(names, ws)}, (x,)).logits.double()

        with torch.no_grad():
            _, predicted = jvp(f, primals, tuple(z for z in zs))
        err = float((delta - predicted).norm() / predicted.norm())
        assert err < 5 * sigma + 1e-3, (sigma, err)  # agreement up to second-order terms
        rel[sigma] = float(delta.norm() / clean.norm())
        print(f"\nsigma {sigma:.0e}: relative logit change {rel[sigma]:.3e}, first-order mismatch {err:.2e}")
        assert 0.05 * sigma < rel[sigma] < 20 * sigma  # sigma-order relative change
    assert rel[1e-2] / rel[1e-3] == pytest.approx(10.0, rel=0.25)  # linear in sigma (same seed, z scales)


def test_clean_weights_bit_identical_after_1000_steps():
    model = apply_lora(_tiny(), LoraSettings(r=4, train_norms=True))
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True), total_steps=1000)
    leaves = [m for t in aqn.targets for m in t.modules]
    assert len(leaves) == 8  # 2 layers x 2 norms x (original + trainable copy)
    objects = [m._parameters["weight"] for m in leaves]
    copies = [w.detach().clone() for w in objects]
    x = _ids()
    clean = _logits(model, x)
    applied = 0
    for step in range(1000):
        if aqn.resample(step) > 0:
            with aqn.applied():
                applied += 1
                assert all(m._parameters["weight"] is not w for m, w in zip(leaves, objects))
                if step % 200 == 0:
                    assert not torch.equal(_logits(model, x), clean)
    assert applied == 900  # every step but stage 0
    for m, w, c in zip(leaves, objects, copies):
        assert m._parameters["weight"] is w
        assert torch.equal(w, c)
    assert torch.equal(_logits(model, x), clean)


def test_restores_after_an_exception():
    model = _tiny()
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True, num_stages=2), total_steps=2)
    aqn.resample(1)
    w = model.model.layers[0].input_layernorm.weight
    with pytest.raises(RuntimeError, match="boom"):
        with aqn.applied():
            raise RuntimeError("boom")
    assert model.model.layers[0].input_layernorm.weight is w


class _MyNorm(nn.Module):
    """Not Hugging Face's RMSNorm class: the weight is a buffer, the math the same."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def test_fires_for_any_rmsnorm_like_module():
    model = _tiny()
    for layer in model.model.layers:
        layer.input_layernorm = _MyNorm(layer.input_layernorm.weight)
        layer.post_attention_layernorm = _MyNorm(layer.post_attention_layernorm.weight)
    x = _ids()
    clean = _logits(model, x)
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True, num_stages=2), total_steps=2)
    assert len(aqn.targets) == 4
    aqn.resample(1)
    with aqn.applied():
        rel = float((_logits(model, x) - clean).norm() / clean.norm())
    assert 1e-4 < rel < 0.5
    assert torch.equal(_logits(model, x), clean)


def test_place_both_keeps_gradient_to_trainable_norms():
    model = apply_lora(_tiny(), LoraSettings(r=4, train_norms=True))
    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True, num_stages=2, place="both"), total_steps=2)
    aqn.resample(1)
    model.train()
    with aqn.applied():
        loss = model(_ids()).logits.pow(2).mean()
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "input_layernorm" in n and p.requires_grad]
    assert grads and all(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_same_noise_for_same_step_and_seed():
    model = _tiny()
    a = AdaptiveQuantNoise(model, AQNSettings(enabled=True, seed=3), total_steps=100)
    b = AdaptiveQuantNoise(model, AQNSettings(enabled=True, seed=3), total_steps=100)
    a.resample(42)
    b.resample(42)
    assert all(torch.equal(x, y) for x, y in zip(a.noise_vectors(), b.noise_vectors()))
    b.resample(43)
    assert not torch.equal(a.noise_vectors()[0], b.noise_vectors()[0])


def test_disabled_or_missing_norms():
    model = _tiny()
    off = AdaptiveQuantNoise(model, AQNSettings(enabled=False), total_steps=10)
    assert off.resample(9) == 0.0
    with pytest.raises(ValueError, match="no norm modules"):
        AdaptiveQuantNoise(model, AQNSettings(enabled=True, norm_names=["ln_1"]), total_steps=10)
    assert math.isclose(AdaptiveQuantNoise(model, AQNSettings(enabled=True), 10).sigma_at(9), 1e-4)
