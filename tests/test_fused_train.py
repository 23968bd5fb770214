"""The training path's fused ops (qerl.nn.fused_train, qerl.nn.lora.add_lora) on a CPU: the Triton
kernels under the interpreter against Hugging Face's modules and a float64 reference, the module
swap (CPU output unchanged), and the fused LoRA update against PEFT's expression. The same kernels
on the GPU at Qwen2.5 sizes: tests/test_fused_train_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

from interpreted import run_interpreted

KERNEL_SCRIPT = r"""
import json, os, torch
torch.manual_seed(int(os.environ["SEED"]))
from qerl.nn.fused_train import rms_norm, silu_mul
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

res = {}
for name, dt, bits in (("bf16", torch.bfloat16, 8), ("fp32", torch.float32, 24)):
    M, N = 7, 40 + 3 * int(os.environ["SEED"])
    x = (torch.randn(M, N) * 3).to(dt).requires_grad_(True)
    norm = Qwen2RMSNorm(N, eps=1e-6).to(dt)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(N).to(dt))
    y_ref, y = norm(x), rms_norm(x, norm.weight, 1e-6)
    res[f"norm_fwd_{name}"] = float(((y.double() - y_ref.double()).abs() / y_ref.double().abs().clamp(min=1e-30)).max()) * 2 ** bits
    dy = torch.randn(M, N).to(dt)
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double()
    (w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * dy.double()).sum().backward()
    dx, = torch.autograd.grad(y, x, dy)
    res[f"norm_bwd_{name}"] = float((dx.double() - x64.grad).norm() / x64.grad.norm())
    g = (torch.randn(M, 2 * N + 5) * 3).to(dt).requires_grad_(True)
    u = torch.randn(M, 2 * N + 5).to(dt).requires_grad_(True)
    o_ref, o = torch.nn.functional.silu(g) * u, silu_mul(g, u)
    res[f"silu_fwd_{name}"] = float(((o.double() - o_ref.double()).abs() / o_ref.double().abs().clamp(min=1e-30)).max()) * 2 ** bits
    dy = torch.randn(M, 2 * N + 5).to(dt)
    g64, u64 = g.detach().double().requires_grad_(True), u.detach().double().requires_grad_(True)
    ((torch.nn.functional.silu(g64) * u64) * dy.double()).sum().backward()
    dg, du = torch.autograd.grad(o, (g, u), dy)
    res[f"silu_bwd_{name}"] = max(float((dg.double() - g64.grad).norm() / g64.grad.norm()),
                                  float((du.double() - u64.grad).norm() / u64.grad.norm()))
from qerl.nn.fused_train import _LoraExpandAdd
for r in (4, 16, 40):
    M, N = 37, 150
    c = torch.randn(M, N).bfloat16().requires_grad_(True)
    h = torch.randn(M, r).bfloat16().requires_grad_(True)
    w = (0.3 * torch.randn(N, r)).requires_grad_(True)  # the fp32 master, as under autocast
    y = _LoraExpandAdd.apply(c, h, w, 0.5)
    ref = c.double() + 0.5 * h.double() @ w.to(torch.bfloat16).double().t()
    res[f"lora_fwd_r{r}"] = float((y.double() - ref).norm() / ref.norm())
    dy = torch.randn(M, N).bfloat16()
    dc, dh, dw = torch.autograd.grad(y, (c, h, w), dy)
    ddh = 0.5 * dy.double() @ w.to(torch.bfloat16).double()
    ddw = 0.5 * dy.double().t() @ h.double()
    res[f"lora_bwd_r{r}"] = max(float((dh.double() - ddh).norm() / ddh.norm()), float((dw.double() - ddw).norm() / ddw.norm()))
    res[f"lora_dc_r{r}"] = bool(torch.equal(dc, dy)) and dw.dtype == torch.float32
from qerl.nn.fused_train import _TokenLogprob
for V, temp in ((50, 1.0), (5000, 0.7)):  # one block short of BV, and several blocks with a tail
    x = (3 * torch.randn(6, V)).bfloat16().requires_grad_(True)
    t = torch.randint(0, V, (6,))
    lp = _TokenLogprob.apply(x, t, 1.0 / temp)
    x64 = x.detach().double().requires_grad_(True)
    ref = torch.log_softmax(x64 / temp, -1).gather(-1, t[:, None]).squeeze(-1)
    g = torch.randn(6)
    ref.backward(g.double())
    dx, = torch.autograd.grad(lp, x, g)
    res[f"logp_fwd_V{V}"] = float((lp.double() - ref.detach()).abs().max())
    res[f"logp_bwd_V{V}"] = float((dx.double() - x64.grad).norm() / x64.grad.norm())
print("RESULTS" + json.dumps(res))
"""


ROPE_SCRIPT = r"""
import json, os, torch
torch.manual_seed(int(os.environ["SEED"]))
from qerl.nn.fused_train import _Rope
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, Qwen2RotaryEmbedding, Qwen2Config
res = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    B, T, H, HK, D = 2, 5, 6, 2, 16
    rot = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HK))
    pos = torch.arange(T)[None].expand(B, T) + torch.tensor([[0], [3]])
    cos, sin = rot(torch.randn(B, T, D).to(dt), pos)
    q = torch.randn(B, T, H, D).to(dt).transpose(1, 2).requires_grad_(True)  # [B, H, T, D] views, as HF makes them
    k = torch.randn(B, T, HK, D).to(dt).transpose(1, 2).requires_grad_(True)
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    qf, kf = _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)
    res[f"equal_{name}"] = float(torch.cat([(qf == qr).flatten(), (kf == kr).flatten()]).float().mean())
    rel = lambda a, b: float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())
    res[f"rel_{name}"] = max(rel(qf, qr), rel(kf, kr))
    res[f"strides_{name}"] = qf.stride() == q.stride() and kf.stride() == k.stride()
    gq, gk = torch.randn_like(qr), torch.randn_like(kr)
    q64, k64 = q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)
    a, b = apply_rotary_pos_emb(q64, k64, cos.double(), sin.double())
    ((a * gq.double()).sum() + (b * gk.double()).sum()).backward()
    dq, dk = torch.autograd.grad((qf, kf), (q, k), (gq, gk))
    res[f"bwd_{name}"] = max(float((dq.double() - q64.grad).norm() / q64.grad.norm()),
                             float((dk.double() - k64.grad).norm() / k64.grad.norm()))
print("RESULTS" + json.dumps(res))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_rope_matches_apply_rotary_pos_emb_under_the_interpreter(seed):
    """The RoPE kernel on HF-shaped [B, H, T, D] views: bit for bit as apply_rotary_pos_emb in float32
    and bf16 (the same three roundings; bf16's are made with integer operations, so the interpreter's
    truncating casts do not enter); the output keeps the input's strides; the backward at bf16 level."""
    r = run_interpreted(ROPE_SCRIPT, seed)
    assert r["equal_fp32"] == 1.0 and r["equal_bf16"] == 1.0, r
    assert r["strides_fp32"] and r["strides_bf16"], r
    assert r["bwd_fp32"] <= 1e-6 and r["bwd_bf16"] <= 1e-2, r


def test_rope_patched_swaps_and_restores_and_a_cpu_keeps_the_original():
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    from qerl.nn import fused_train

    orig = qwen2.apply_rotary_pos_emb, llama.apply_rotary_pos_emb
    model = _tiny_qwen2()
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    saved = fused_train.ENABLED_ROPE
    fused_train.ENABLED_ROPE = True
    try:
        with fused_train.rope_patched():
            assert qwen2.apply_rotary_pos_emb is not orig[0] and llama.apply_rotary_pos_emb is not orig[1]
            with fused_train.rope_patched():  # nested: nothing patched twice
                pass
            assert getattr(qwen2.apply_rotary_pos_emb, "_qerl_fused", False)
            with torch.no_grad():
                assert torch.equal(model(ids).logits, ref)  # CPU tensors take the original
    finally:
        fused_train.ENABLED_ROPE = saved
    assert (qwen2.apply_rotary_pos_emb, llama.apply_rotary_pos_emb) == orig


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_kernels_match_the_modules_under_the_interpreter(seed):
    """Forward within a few units in the last place of Hugging Face's own output (the interpreter
    rounds to bf16 by truncation, the GPU to nearest: tests/test_fused_train_gpu.py asks for equality
    there); backward within bf16 level of a float64 reference (fp32: 1e-6)."""
    r = run_interpreted(KERNEL_SCRIPT, seed)
    assert r["norm_fwd_bf16"] <= 6 and r["silu_fwd_bf16"] <= 6, r
    assert r["norm_fwd_fp32"] <= 8 and r["silu_fwd_fp32"] <= 8, r
    assert r["norm_bwd_bf16"] <= 1e-2 and r["silu_bwd_bf16"] <= 1e-2, r
    assert r["norm_bwd_fp32"] <= 1e-6 and r["silu_bwd_fp32"] <= 1e-6, r
    for rank in (4, 16, 40):  # the LoRA expand + add: one bf16 rounding of an fp32 sum
        assert r[f"lora_fwd_r{rank}"] <= 8e-3 and r[f"lora_bwd_r{rank}"] <= 1e-2 and r[f"lora_dc_r{rank}"], r
    for v in (50, 5000):  # token log-probs: float32 math on the bf16 logits; gradient rounded to bf16 once
        assert r[f"logp_fwd_V{v}"] <= 1e-4 and r[f"logp_bwd_V{v}"] <= 1e-2, r


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def test_fuse_training_ops_swaps_norms_and_mlps_and_leaves_cpu_output_unchanged():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

    from qerl.nn.fused_train import fuse_training_ops

    model = _tiny_qwen2()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9))
    keys = list(model.state_dict())
    # 2 layers x (2 norms + 1 MLP) + the final norm
    assert fuse_training_ops(model) == 7
    assert fuse_training_ops(model) == 0  # idempotent
    norms = [m for m in model.modules() if isinstance(m, Qwen2RMSNorm)]
    assert len(norms) == 5 and all(getattr(type(m), "_qerl_fused", False) for m in norms)
    mlps = [m for m in model.modules() if isinstance(m, Qwen2MLP)]
    assert len(mlps) == 2 and all(getattr(type(m), "_qerl_fused", False) for m in mlps)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)  # a CPU runs the modules' own code
    copy.deepcopy(model)  # the swapped classes survive a copy


def test_prepare_policy_fuses_only_when_asked():
    from qerl.nn.lora import LoraSettings
    from qerl.rl.grpo import GRPOSettings
    from qerl.rl.trainer import prepare_policy

    def fused(model):
        return sum(getattr(type(m), "_qerl_fused", False) for m in model.modules())

    on = prepare_policy(_tiny_qwen2(), GRPOSettings(num_generations=2, per_device_train_batch_size=2),
                        LoraSettings(r=4, lora_alpha=4))
    off = prepare_policy(_tiny_qwen2(), GRPOSettings(num_generations=2, per_device_train_batch_size=2,
                                                     fused_training_ops=False), LoraSettings(r=4, lora_alpha=4))
    assert fused(on) == 7 and fused(off) == 0


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_lora_update_matches_pefts_expression(fmt, autocast):
    """add_lora (result + scaling * h @ B^T inside one addmm) against PEFT's `result + B(A(x)) *
    scaling`, outputs and adapter gradients, on an fp32 model and under CPU bf16 autocast."""
    from qerl.nn import fused_train
    from qerl.nn.lora import FusedLoraLinear, LoraSettings, QuantLoraLinear, apply_lora
    from qerl.quantize import quantize_

    base = _tiny_qwen2()
    if fmt != "bf16":
        quantize_(base, fmt)
    model = apply_lora(base, LoraSettings(r=8, lora_alpha=16))
    cls = QuantLoraLinear if fmt != "bf16" else FusedLoraLinear
    layers = [m for m in model.modules() if isinstance(m, cls)]
    assert len(layers) == 14
    torch.manual_seed(1)
    for m in layers:  # B starts at zero: give it values so the update matters
        torch.nn.init.normal_(m.lora_B["default"].weight, std=0.05)
    ids = torch.randint(0, 128, (2, 11))

    def run(fused: bool):
        saved = fused_train.ENABLED_LORA_ADD
        fused_train.ENABLED_LORA_ADD = fused
        try:
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(input_ids=ids).logits.float()
            out.square().mean().backward()
            grads = [m.lora_A["default"].weight.grad.clone() for m in layers]
            grads += [m.lora_B["default"].weight.grad.clone() for m in layers]
            return out.detach(), grads
        finally:
            fused_train.ENABLED_LORA_ADD = saved

    (o1, g1), (o0, g0) = run(True), run(False)
    tol = 2e-2 if autocast else 1e-5
    assert (o1 - o0).norm() / o0.norm() <= tol
    for a, b in zip(g1, g0):
        assert (a - b).norm() / b.norm().clamp(min=1e-12) <= 5 * tol


def test_switched_off_turns_every_fused_op_off_and_restores():
    from qerl.nn import fused_train

    names = ("ENABLED_NORM", "ENABLED_MLP", "ENABLED_LORA", "ENABLED_LOGP")
    fused_train.ENABLED_MLP = False  # an ablation's own switch survives both ways
    rope = fused_train.ENABLED_ROPE
    try:
        with fused_train.switched(True):
            assert [getattr(fused_train, n) for n in names] == [True, False, True, True]
            assert fused_train.ENABLED_ROPE == rope
        with fused_train.switched(False):
            assert not any(getattr(fused_train, n) for n in names) and not fused_train.ENABLED_ROPE
        assert [getattr(fused_train, n) for n in names] == [True, False, True, True]
    finally:
        fused_train.ENABLED_MLP = True


def test_bench_train_phase_runs_on_a_cpu_and_refuses_unknown_switches(tmp_path):
    """benchmarks/bench_train_phase.py end to end on a tiny model (the trainer's own optimise), its
    variants restoring the switches, and a one-line refusal of an unknown variant."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "t.json"
    cmd = [sys.executable, "benchmarks/bench_train_phase.py", "--device", "cpu", "--model", "tiny-llama", "--layers", "2",
           "--prompt-len", "6", "--completion", "6", "--micro-batch", "2", "--rows", "2", "--rank", "4", "--reps", "1",
           "--formats", "nvfp4", "--variants", "stock", "fused", "nonorm,nologp", "default,free1", "free", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["stock", "fused", "nonorm,nologp", "default,free1", "free"]
    assert all(r["train_s"] > 0 and r["tokens"] == 24 and "x_stock" in r for r in rows)
    assert [r["uncheckpointed_layers"] for r in rows] == [0, 0, 0, 1, 2]  # free<N>: the last N of the 2 layers
    bad = subprocess.run(cmd[:-8] + ["--variants", "nofoo"], cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "unknown variant part 'nofoo'" in bad.stderr
