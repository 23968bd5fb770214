"""Fused training ops on a GPU: RMSNorm, SiLU-gated MLP, the LoRA update, the token log-probs, RoPE.

Why: the training phase of a GRPO step runs Hugging Face's decoder layers eagerly. Their RMSNorm
is seven float32 elementwise kernels forward (and more backward), their MLP a SiLU and a product
over [tokens x intermediate]; with LoRA's scale-and-add and the float32 log-softmax they were ~40%
of the phase's GPU time at 14B (benchmarks/bench_train_phase.py, NOTES_grpo.md section 18). One
Triton kernel per op forward and one backward (`qerl.kernels.train_triton`) read and write each
tensor once.

    fuse_training_ops(model)     # in place; returns the number of modules switched
    lora_expand_add(c, h, B, s)  # c + s * h @ B^T (qerl.nn.lora.add_lora calls it under autocast)
    token_logprobs(logits, t, T) # log softmax(logits / T)[t] (qerl.rl.rollout's training log-probs)

Each supported module's class is swapped for a subclass whose forward takes the fused path on a
CUDA tensor and otherwise calls the original forward, so CPU runs, state dicts, PEFT wrappers and
isinstance checks are unchanged. Supported: the Qwen2 / Llama / Mistral / Qwen3 RMSNorm (weight *
bf16(normalised x)) and MLP (down(silu(gate(x)) * up(x)), hidden_act "silu", no tensor-parallel
split). Outputs round where the modules' own ops round; gradients are computed in float32 and
rounded once. GRPOSettings.fused_training_ops: false turns all of it off for a run (`switched`);
the ENABLED_* switches turn one off (ablations).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

ENABLED_NORM = True
ENABLED_MLP = True
# the LoRA update inside the expand product (qerl.nn.lora.add_lora: torch.addmm, or on a GPU under
# autocast and with ENABLED_LORA the one Triton pass of lora_expand_add); off: PEFT's expression
ENABLED_LORA_ADD = True
ENABLED_LORA = True  # the LoRA update's expand + add in one Triton pass (qerl.nn.lora.add_lora)
ENABLED_LOGP = True  # the training log-probs' log-softmax + gather in one pass (qerl.rl.rollout)
# RoPE on q and k in one pass each (rope_patched), bf16 bit for bit as Hugging Face's: timed in session
# 34 (training phase x1.067 bf16 / x1.058 nvfp4 at 14B, 6 layers; NOTES_grpo.md section 19), so on;
# QERL_FUSED_ROPE=0 turns it off
ENABLED_ROPE = os.environ.get("QERL_FUSED_ROPE", "1") == "1"

_SWITCHES = ("ENABLED_NORM", "ENABLED_MLP", "ENABLED_LORA_ADD", "ENABLED_LORA", "ENABLED_LOGP", "ENABLED_ROPE")


@contextlib.contextmanager
def switched(on: bool):
    """With on False every fused op is off inside the block (restored after); with on True the
    switches stay as they are."""
    g = globals()
    saved = {k: g[k] for k in _SWITCHES}
    try:
        if not on:
            g.update({k: False for k in _SWITCHES})
        yield
    finally:
        g.update(saved)


_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3RMSNorm")
_MLPS = ("Qwen2MLP", "LlamaMLP", "MistralMLP", "Qwen3MLP")
_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


def _kernels():
    from qerl.kernels import train_triton

    return train_triton


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        x2 = _rows(x)
        y, r = _kernels().rms_norm_fwd(x2, w, torch.promote_types(w.dtype, x.dtype), eps)
        ctx.save_for_backward(x2, w, r)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w, r = ctx.saved_tensors
        dy2 = _rows(dy)
        dx = _kernels().rms_norm_bwd(dy2, x2, w, r).view(ctx.shape)
        dw = None
        if ctx.needs_input_grad[1]:  # trained norms only: d(w * xhat) / dw = xhat, summed over rows
            xhat = (x2.float() * r[:, None]).to(x2.dtype)
            dw = (dy2.float() * xhat.float()).sum(0).to(w.dtype)
        return dx, dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        g2, u2 = _rows(g), _rows(u)
        ctx.save_for_backward(g2, u2)
        ctx.shape = g.shape
        return _kernels().silu_mul_fwd(g2, u2).view(g.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2 = ctx.saved_tensors
        dg, du = _kernels().silu_mul_bwd(_rows(dy), g2, u2)
        return dg.view(ctx.shape), du.view(ctx.shape)


class _LoraExpandAdd(torch.autograd.Function):
    """y = c + scale * h @ B^T in one pass over c (Triton), B cast to h's dtype as autocast would;
    the backward: dc = dy, dh = scale * dy @ B, dB = scale * dy^T @ h (cuBLAS)."""

    @staticmethod
    def forward(ctx, c, h, weight, scale):
        c2, h2 = _rows(c), _rows(h)
        b = weight.to(h.dtype)
        ctx.save_for_backward(h2, b)
        ctx.scale, ctx.shape, ctx.wdtype = scale, c.shape, weight.dtype
        return _kernels().lora_expand_add(c2, h2, b, scale).view(c.shape)

    @staticmethod
    def backward(ctx, dy):
        h2, b = ctx.saved_tensors
        dy2 = _rows(dy).to(h2.dtype)
        dh = (dy2 @ b).mul_(ctx.scale).view(*ctx.shape[:-1], h2.shape[-1]) if ctx.needs_input_grad[1] else None
        dw = (dy2.t() @ h2).mul_(ctx.scale).to(ctx.wdtype) if ctx.needs_input_grad[2] else None
        return dy, dh, dw, None


def lora_expand_add(c: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor | None:
    """c + scale * h @ weight^T fused on CUDA (c and h bf16 / fp16 alike), else None (the caller's
    own path)."""
    if not (ENABLED_LORA and c.is_cuda and c.dtype in (torch.bfloat16, torch.float16) and h.dtype == c.dtype
            and h.shape[-1] <= 256):
        return None
    return _LoraExpandAdd.apply(c, h, weight, float(scale))


class _TokenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, inv_t):
        x2 = _rows(logits)
        t = tokens.reshape(-1).contiguous()
        lp, lse = _kernels().token_logprob_fwd(x2, t, inv_t)
        ctx.save_for_backward(x2, t, lse)
        ctx.inv_t, ctx.shape = inv_t, logits.shape
        return lp.view(tokens.shape)

    @staticmethod
    def backward(ctx, g):
        x2, t, lse = ctx.saved_tensors
        dx = _kernels().token_logprob_bwd(x2, t, lse, g.reshape(-1).float().contiguous(), ctx.inv_t)
        return dx.view(ctx.shape), None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor | None:
    """log softmax(logits / temperature)[tokens] as float32 [*tokens.shape], the logits read once
    (bf16 / fp16 / fp32 on CUDA; autograd for the logits); None where it does not apply."""
    if not (ENABLED_LOGP and logits.is_cuda and logits.dtype in _FLOAT and logits.shape[:-1] == tokens.shape):
        return None
    return _TokenLogprob.apply(logits, tokens, 1.0 / float(temperature))


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _kernels().rope(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _kernels().rope(dy if dy.stride(-1) == 1 else dy.contiguous(), cos, sin, backward=True), None, None


def _rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dim() == 4 and cos.dim() == 3 and x.dtype in _FLOAT and cos.dtype == x.dtype == sin.dtype):
        return False
    b, _, t, d = x.shape
    pow2 = d >= 2 and d & (d - 1) == 0
    return (pow2 and x.stride(-1) == 1 and cos.shape[1:] == (t, d) and cos.shape[0] in (1, b)
            and sin.shape == cos.shape and sin.stride() == cos.stride() and cos.stride(-1) == 1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated as Hugging Face's apply_rotary_pos_emb (unsqueeze_dim 1) rounds them, one Triton
    pass each forward and backward; None where it does not apply."""
    if not (ENABLED_ROPE and _rope_supported(q, cos, sin) and _rope_supported(k, cos, sin)):
        return None
    cos, sin = cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1)
    return _Rope.apply(q, cos, sin), _Rope.apply(k, cos, sin)


_ROPE_MODULES = ("transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama")


@contextlib.contextmanager
def rope_patched():
    """While inside (and ENABLED_ROPE is on at entry), the Qwen2 / Llama attention's
    apply_rotary_pos_emb takes apply_rope where it applies (CUDA tensors) and the original otherwise;
    the originals are put back on exit. The trainer's training phase runs inside it (the attention looks the function up in its
    module at each call, so this is the one place to reach it without copying the attention)."""
    import importlib

    saved = []
    if not ENABLED_ROPE:  # off: nothing is patched
        yield
        return
    try:
        for name in _ROPE_MODULES:
            mod = importlib.import_module(name)
            orig = getattr(mod, "apply_rotary_pos_emb", None)
            if orig is None or getattr(orig, "_qerl_fused", False):
                continue

            def fused(q, k, cos, sin, unsqueeze_dim=1, _orig=orig):
                out = apply_rope(q, k, cos, sin) if unsqueeze_dim == 1 else None
                return out if out is not None else _orig(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

            fused._qerl_fused = True
            saved.append((mod, orig))
            mod.apply_rotary_pos_emb = fused
        yield
    finally:
        for mod, orig in saved:
            mod.apply_rotary_pos_emb = orig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), fused on CUDA (autograd for x and weight)."""
    return _RMSNorm.apply(x, weight, float(eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with silu rounded to gate's dtype first (as `act_fn(gate) * up`), fused on CUDA."""
    return _SiluMul.apply(gate, up)


def _cuda_float(*ts: torch.Tensor) -> bool:
    return all(t.is_cuda and t.dtype in _FLOAT for t in ts)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if ENABLED_NORM and _cuda_float(hidden_states, self.weight) and self.weight.shape[-1] == hidden_states.shape[-1]:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return super(type(self), self).forward(hidden_states)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if ENABLED_MLP and x.is_cuda:
        g, u = self.gate_proj(x), self.up_proj(x)
        if g.dtype == u.dtype and g.shape == u.shape and _cuda_float(g, u):
            return self.down_proj(silu_mul(g, u))
        return self.down_proj(self.act_fn(g) * u)
    return super(type(self), self).forward(x)


_SUBCLASSES: dict[type, type] = {}


def _fused_class(cls: type, forward) -> type:
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "_qerl_fused": True,
                                                       "__module__": cls.__module__})
    return _SUBCLASSES[cls]


def _mlp_supported(mod: nn.Module) -> bool:
    cfg = getattr(mod, "config", None)
    act = getattr(cfg, "hidden_act", None)
    tp = getattr(cfg, "pretraining_tp", 1) or 1
    return act == "silu" and tp == 1 and all(hasattr(mod, n) for n in ("gate_proj", "up_proj", "down_proj"))


def fuse_training_ops(model: nn.Module) -> int:
    """Swap the supported RMSNorm and MLP modules of `model` to their fused forms (in place)."""
    n = 0
    for mod in model.modules():
        cls = type(mod)
        if getattr(cls, "_qerl_fused", False):
            continue
        if cls.__name__ in _NORMS and hasattr(mod, "variance_epsilon") and isinstance(getattr(mod, "weight", None), torch.Tensor):
            mod.__class__ = _fused_class(cls, _norm_forward)
            n += 1
        elif cls.__name__ in _MLPS and _mlp_supported(mod):
            mod.__class__ = _fused_class(cls, _mlp_forward)
            n += 1
    return n
