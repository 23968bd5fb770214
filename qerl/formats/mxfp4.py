"""MXFP4 weight-only format (OCP Microscaling v1.0, compressed-tensors `mxfp4-pack-quantized`).

Groups of 32 elements along K share one power-of-two scale stored as a biased E8M0 exponent
(uint8, bias 127). Elements are E2M1 with saturation. No global scale.

Scale choice. The OCP spec's reference picks `2^(floor(log2(amax)) - 2)`, which maps groups
whose amax mantissa is in [1.5, 2) onto values above 6 that saturate. compressed-tensors (and
vLLM's MXFP4 reference) first round amax up to the next power of two when its mantissa is
>= 1.75, which bounds that saturation error at a quarter of the top step. We default to the
compressed-tensors rule (`scale_rule="ct"`) so our checkpoints are byte-identical to theirs, and
keep the plain OCP rule as `scale_rule="floor"`; benchmarks/results/formats.json reports both
errors.

    e = clamp(127 + floor(log2(round_pow2(amax_group))) - 2, 0, 255)   weight_scale uint8 [N, K/32]
    q = e2m1(W / 2^(e - 127))                                           weight_packed uint8 [N, K/2]
"""

from __future__ import annotations

import torch

from qerl.formats.fp4 import E2M1_MAX, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

GROUP_SIZE = 32
E8M0_BIAS = 127
# floor(log2(6)): puts the group max into E2M1's top binade.
ELEMENT_EXP_OFFSET = 2
SCALE_RULES = ("ct", "floor")


def _floor_log2(a: torch.Tensor, round_up_at_175: bool) -> torch.Tensor:
    """floor(log2(a)) for a > 0 (float32 result); with round_up_at_175, one more when the
    mantissa (in 1.m form) is >= 1.75. a == 0 gives -inf."""
    mant, exp = torch.frexp(a.to(torch.float32))  # a = mant * 2^exp, mant in [0.5, 1)
    e = (exp - 1).to(torch.float32)
    if round_up_at_175:
        e = e + (mant >= 0.875).to(torch.float32)
    return torch.where(a == 0, torch.full_like(e, float("-inf")), e)


def scale_exponents(w: torch.Tensor, scale_rule: str = "ct") -> torch.Tensor:
    """Biased E8M0 exponents [N, K/32] (uint8)."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown mxfp4 scale_rule {scale_rule!r}; valid: {', '.join(SCALE_RULES)}")
    n, k = w.shape
    amax_g = w.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    e = _floor_log2(amax_g, round_up_at_175=scale_rule == "ct") + (E8M0_BIAS - ELEMENT_EXP_OFFSET)
    return e.clamp(0, 255).to(torch.uint8)


def exponent_to_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(weight_scale.to(torch.float32) - E8M0_BIAS)


def quantize(w: torch.Tensor, scale_rule: str = "ct") -> dict[str, torch.Tensor]:
    """W [N, K] (K % 32 == 0) -> {weight_packed, weight_scale}."""
    if w.ndim != 2 or w.shape[1] % GROUP_SIZE:
        raise ValueError(f"mxfp4 needs a 2-D weight with K divisible by {GROUP_SIZE}, got {tuple(w.shape)}")
    e = scale_exponents(w, scale_rule)
    scale = exponent_to_scale(e).repeat_interleave(GROUP_SIZE, dim=1)
    scaled = (w.detach().to(torch.float32) / scale).clamp(-E2M1_MAX, E2M1_MAX)
    return {"weight_packed": pack_nibbles(e2m1_encode(scaled)), "weight_scale": e}


def dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = e2m1_decode(unpack_nibbles(weight_packed))
    return (values * exponent_to_scale(weight_scale).repeat_interleave(GROUP_SIZE, dim=1)).to(dtype)
