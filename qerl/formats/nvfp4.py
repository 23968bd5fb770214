"""NVFP4 weight-only format ("NVFP4A16", compressed-tensors format `nvfp4-pack-quantized`).

Groups of 16 consecutive elements along the input dimension K share one FP8-E4M3 scale; one
float32 global scale per tensor (or per fused group of tensors) stretches the group scales over
the FP8 range:

    g = 448 * 6 / amax(|W|)                       weight_global_scale  float32 [1]
    s = fp8_e4m3(amax_group / 6 * g)  (0 -> 1/8)  weight_scale         float8_e4m3fn [N, K/16]
    q = e2m1(W / (s / g))                         weight_packed        uint8 [N, K/2]
    W ~= q * (s / g)

The order of operations and the dtypes follow compressed-tensors exactly (amax/6 is taken in
the weight's own dtype, then multiplied by g in float32), so our bytes equal theirs; the tests
check that bit for bit.
"""

from __future__ import annotations

import torch

from qerl.formats.fp4 import E2M1_MAX, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

GROUP_SIZE = 16
FP8_E4M3_MAX = 448.0
# compressed-tensors replaces a zero group scale by the FP8 epsilon it uses (1/8).
ZERO_SCALE_REPLACEMENT = 0.125


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """0-d tensor of `value` with like's dtype and device (a divisor CUDA divides by exactly)."""
    return torch.full((), value, dtype=like.dtype, device=like.device)


def tensor_amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| in w's dtype, as a 0-d tensor (the statistic the global scale is built from)."""
    return w.detach().abs().amax()


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """g = 448 * 6 / amax, computed in amax's dtype, returned as float32 [1].

    A zero tensor (amax 0) or a non-finite statistic gives g = 1, as compressed-tensors does.
    """
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    g = (FP8_E4M3_MAX * E2M1_MAX) / amax
    g = torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
    return g.to(torch.float32).reshape(1)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    return global_scale_from_amax(tensor_amax(w))


def shared_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One g for tensors that a serving engine fuses (q/k/v, gate/up): the smallest g,
    i.e. the one built from the largest amax of the group."""
    amax = torch.stack([tensor_amax(w).to(weights[0].dtype) for w in weights]).amax()
    return global_scale_from_amax(amax)


def group_scales(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """FP8 group scales [N, K/16] as float32 values (exactly representable in FP8)."""
    n, k = w.shape
    amax_g = w.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    # amax/6 in w.dtype, then float32 multiply. The divisor is a tensor on w's device, not a
    # Python number: CUDA turns `tensor / python_scalar` into a multiply by the rounded
    # reciprocal (one ulp off for ~1/3 of fp32 inputs, enough to flip ~1 FP8 scale per
    # 1M groups), while the CPU divides exactly; a same-device divisor is a true division on both.
    s = g * (amax_g / _scalar(E2M1_MAX, amax_g))
    s = s.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(s == 0, torch.full_like(s, ZERO_SCALE_REPLACEMENT), s)


def quantize(w: torch.Tensor, weight_global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """W [N, K] (K % 16 == 0) -> {weight_packed, weight_scale, weight_global_scale}."""
    if w.ndim != 2 or w.shape[1] % GROUP_SIZE:
        raise ValueError(f"nvfp4 needs a 2-D weight with K divisible by {GROUP_SIZE}, got {tuple(w.shape)}")
    g = global_scale(w) if weight_global_scale is None else weight_global_scale.to(torch.float32).reshape(1)
    s = group_scales(w, g)
    n, k = w.shape
    eff = (s / g).repeat_interleave(GROUP_SIZE, dim=1)
    scaled = (w.detach() / eff).clamp(-E2M1_MAX, E2M1_MAX)
    return {
        "weight_packed": pack_nibbles(e2m1_encode(scaled)),
        "weight_scale": s.to(torch.float8_e4m3fn),
        "weight_global_scale": g,
    }


def dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Back to a dense [N, K] tensor: q * (s / g) in float32, then cast."""
    values = e2m1_decode(unpack_nibbles(weight_packed))
    eff = weight_scale.to(torch.float32) / weight_global_scale.to(torch.float32)
    return (values * eff.repeat_interleave(GROUP_SIZE, dim=1)).to(dtype)
