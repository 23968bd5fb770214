"""The training path's fused RMSNorm and SiLU-gated product on the GPU (Triton), at Qwen2.5 sizes,
against Hugging Face's modules on fresh random inputs: forward equal to the module's own bf16
output (both round to nearest at the same points), gradients within bf16 level of a float64
reference; and a LoRA policy's log-probs and adapter gradients with the fused ops against the
modules' own code. Skipped without a CUDA GPU (CPU side: tests/test_fused_train.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _close_fraction(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(fraction of elements equal, largest distance relative to |b| in bf16 epsilons)."""
    a, b = a.detach().float(), b.detach().float()
    ulp = torch.finfo(torch.bfloat16).eps * b.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return float((a == b).float().mean()), float(((a - b).abs() / ulp).max())


@pytest.mark.parametrize("n", [896, 3584, 5120, 8192])
@pytest.mark.parametrize("train_weight", [False, True])
def test_rms_norm_matches_the_module(n, train_weight):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from qerl.nn.fused_train import rms_norm

    torch.manual_seed(n + train_weight)
    m = 1000 + int(torch.randint(0, 97, ()))
    big = torch.randn(m, n + 64, device="cuda").mul_(3).bfloat16()
    x = big[:, :n].requires_grad_(True)  # rows with a stride past their length
    norm = Qwen2RMSNorm(n, eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, device="cuda"))
    norm.weight.requires_grad_(train_weight)
    y_ref, y = norm(x), rms_norm(x, norm.weight, 1e-6)
    equal, far = _close_fraction(y, y_ref)
    # the same roundings; the rare element whose normalised value sits on a rounding boundary
    # (rsqrt's last float32 bit) lands one bf16 step away before the weight, so up to 2 after it
    # (measured: 1 in 10^5 elements, 1.04 epsilons)
    assert equal >= 0.999 and far <= 2.0, (equal, far)
    dy = torch.randn_like(y)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(train_weight)
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * dy.double()).sum().backward()
    grads = torch.autograd.grad(y, [x, norm.weight] if train_weight else [x], dy)
    assert torch.isfinite(grads[0]).all()
    assert (grads[0].double() - x64.grad).norm() / x64.grad.norm() <= 1e-2
    if train_weight:
        assert (grads[1].double() - w64.grad).norm() / w64.grad.norm() <= 1e-2


@pytest.mark.parametrize("n", [4864, 13824, 18944])
def test_silu_mul_matches_the_module(n):
    from qerl.nn.fused_train import silu_mul

    torch.manual_seed(n)
    m = 700 + int(torch.randint(0, 97, ()))
    g = (torch.randn(m, n, device="cuda") * 3).bfloat16().requires_grad_(True)
    u = torch.randn(m, n, device="cuda").bfloat16().requires_grad_(True)
    o_ref, o = torch.nn.functional.silu(g) * u, silu_mul(g, u)
    equal, far = _close_fraction(o, o_ref)
    assert equal >= 0.999 and far <= 1.0, (equal, far)
    dy = torch.randn_like(o)
    g64, u64 = g.detach().double().requires_grad_(True), u.detach().double().requires_grad_(True)
    ((torch.nn.functional.silu(g64) * u64) * dy.double()).sum().backward()
    dg, du = torch.autograd.grad(o, (g, u), dy)
    assert (dg.double() - g64.grad).norm() / g64.grad.norm() <= 1e-2
    assert (du.double() - u64.grad).norm() / u64.grad.norm() <= 1e-2


@pytest.mark.parametrize("n", [512, 5120, 13824])
@pytest.mark.parametrize("r", [16, 32, 64])
def test_lora_expand_add_matches_the_reference(n, r):
    """c + s * h @ B^T (one Triton pass over c) against float64, and its gradients; B is the fp32
    master that autocast would cast to bf16."""
    from qerl.nn.fused_train import lora_expand_add

    torch.manual_seed(n + r)
    m = 2000 + int(torch.randint(0, 97, ()))
    c = torch.randn(m, n, device="cuda").bfloat16().requires_grad_(True)
    h = torch.randn(m, r, device="cuda").bfloat16().requires_grad_(True)
    w = (0.05 * torch.randn(n, r, device="cuda")).requires_grad_(True)
    y = lora_expand_add(c, h, w, 2.0)
    wb = w.detach().bfloat16().double()
    ref = c.detach().double() + 2.0 * h.detach().double() @ wb.t()
    assert (y.double() - ref).norm() / ref.norm() <= 4e-3
    dy = torch.randn_like(y)
    dc, dh, dw = torch.autograd.grad(y, (c, h, w), dy)
    assert torch.equal(dc, dy) and dw.dtype == torch.float32
    ddh, ddw = 2.0 * dy.double() @ wb, 2.0 * dy.double().t() @ h.detach().double()
    assert (dh.double() - ddh).norm() / ddh.norm() <= 1e-2
    assert (dw.double() - ddw).norm() / ddw.norm() <= 1e-2


@pytest.mark.parametrize("vocab", [151936, 152064, 49152])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_match_log_softmax(vocab, temperature):
    """The training log-probs' one-pass log-softmax + gather against torch's float32 log_softmax
    of the same bf16 logits, and its gradient (rounded once to bf16)."""
    from qerl.nn.fused_train import token_logprobs

    torch.manual_seed(vocab)
    m = 1000 + int(torch.randint(0, 97, ()))
    x = (4 * torch.randn(m, vocab, device="cuda")).bfloat16().requires_grad_(True)
    t = torch.randint(0, vocab, (m,), device="cuda")
    lp = token_logprobs(x, t, temperature)
    xr = x.detach().float().requires_grad_(True)
    ref = torch.log_softmax(xr / temperature, -1).gather(-1, t[:, None]).squeeze(-1)
    assert lp.dtype == torch.float32 and (lp - ref).abs().max() <= 2e-4
    g = torch.randn(m, device="cuda")
    ref.backward(g)
    dx, = torch.autograd.grad(lp, x, g)
    assert dx.dtype == torch.bfloat16
    assert (dx.float() - xr.grad).norm() / xr.grad.norm() <= 1e-2


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(40, 8, 128), (28, 4, 128), (9, 3, 64)])
def test_rope_matches_apply_rotary_pos_emb(heads, kv_heads, head_dim):
    """RoPE on HF's [B, H, T, D] views of q / k: bf16 bit for bit as apply_rotary_pos_emb (the same
    three roundings, to nearest), the output in the input's strides, the gradients at bf16 level."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2RotaryEmbedding, apply_rotary_pos_emb

    from qerl.nn.fused_train import _Rope

    torch.manual_seed(heads)
    b, t = 3, 600 + int(torch.randint(0, 97, ()))
    rot = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=heads * head_dim, num_attention_heads=heads,
                                           num_key_value_heads=kv_heads, rope_theta=1e6)).cuda()
    pos = torch.arange(t, device="cuda")[None].expand(b, t) + torch.tensor([[0], [17], [301]], device="cuda")
    cos, sin = rot(torch.randn(b, t, head_dim, device="cuda").bfloat16(), pos)
    q = torch.randn(b, t, heads, head_dim, device="cuda").bfloat16().transpose(1, 2).requires_grad_(True)
    k = torch.randn(b, t, kv_heads, head_dim, device="cuda").bfloat16().transpose(1, 2).requires_grad_(True)
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    qf, kf = _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)
    for got, want in ((qf, qr), (kf, kr)):
        bad = got != want
        assert not bad.any(), (f"{int(bad.sum())} of {want.numel()} differ, max "
                               f"{float((got.float() - want.float()).abs().max())}, first at {bad.nonzero()[0].tolist()}")
    assert qf.stride() == q.stride() and kf.stride() == k.stride(), (qf.stride(), q.stride(), kf.stride(), k.stride())
    gq, gk = torch.randn_like(qr), torch.randn_like(kr)
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    a, c = apply_rotary_pos_emb(q64, k64, cos.double(), sin.double())
    ((a * gq.double()).sum() + (c * gk.double()).sum()).backward()
    dq, dk = torch.autograd.grad((qf, kf), (q, k), (gq, gk))
    assert (dq.double() - q64.grad).norm() / q64.grad.norm() <= 1e-2
    assert (dk.double() - k64.grad).norm() / k64.grad.norm() <= 1e-2


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_policy_logprobs_and_lora_grads_with_fused_ops(fmt, qwen3b_policy):
    """A Qwen2-shaped policy in bf16 / nvfp4 with LoRA, bf16 autocast and gradient checkpointing,
    as the trainer prepares it: the fused ops' log-probs and adapter gradients (RoPE included)
    against the same policy running the modules' own code and PEFT's LoRA expression."""
    from qerl.nn import fused_train
    from qerl.rl.rollout import RolloutBatch, policy_logprobs

    policy, _ = qwen3b_policy(fmt, layers=2, rank=16, alpha=32)  # Qwen2.5-3B's layer shapes, two layers
    assert sum(getattr(type(m), "_qerl_fused", False) for m in policy.modules()) > 0
    torch.manual_seed(3)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    batch = RolloutBatch.random(4, 64, 96, 150000, seed=5, logprob=0.0)
    policy.train()

    rope_default = fused_train.ENABLED_ROPE

    def run(enabled: bool):
        fused_train.ENABLED_NORM = fused_train.ENABLED_MLP = fused_train.ENABLED_LORA = enabled
        fused_train.ENABLED_LOGP = fused_train.ENABLED_ROPE = fused_train.ENABLED_LORA_ADD = enabled
        try:
            policy.zero_grad(set_to_none=True)
            # the backward inside the patch too, as the trainer's optimise runs it: checkpointing
            # recomputes each layer there and must meet the forward's RoPE
            with torch.autocast("cuda", dtype=torch.bfloat16), fused_train.rope_patched():
                lp = policy_logprobs(policy, batch, None, 1.0, False, 64)
                lp.float().mean().backward()
            grads = {n: p.grad.float().clone() for n, p in policy.named_parameters() if p.grad is not None}
            return lp.detach().float(), grads
        finally:
            fused_train.ENABLED_NORM = fused_train.ENABLED_MLP = fused_train.ENABLED_LORA = True
            fused_train.ENABLED_LOGP = fused_train.ENABLED_LORA_ADD = True
            fused_train.ENABLED_ROPE = rope_default

    (lp1, g1), (lp0, g0) = run(True), run(False)
    assert torch.isfinite(lp1).all()
    assert (lp1 - lp0).abs().max() <= 0.05
    assert g1.keys() == g0.keys() and len(g1) > 0
    num = sum(float((g1[k] - g0[k]).norm() ** 2) for k in g0) ** 0.5
    den = sum(float(g0[k].norm() ** 2) for k in g0) ** 0.5
    assert num / den <= 3e-2, num / den
