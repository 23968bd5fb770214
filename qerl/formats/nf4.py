"""NF4 (QLoRA NormalFloat 4-bit) weight format, the QLoRA baseline.

Blocks of 64 consecutive elements along K are scaled by their absmax into [-1, 1] and each
element takes the nearest of the 16 NormalFloat values published with QLoRA (Dettmers et al.,
2023, appendix; the same table bitsandbytes ships). Codes are packed two per byte like the FP4
formats (even index in the low nibble; bitsandbytes itself puts the first element in the high
nibble, which matters only for byte-level interchange with it).

Optional double quantisation of the float32 absmax values (QLoRA's "DQ"): subtract their mean,
then store them as int8 with one float32 scale per block of 256 absmax values
(4 + 8/64 + 32/(64*256) = 4.127 bits per weight). QLoRA uses an 8-bit dynamic float code for
this second level; a linear int8 code is simpler and its error is far below the NF4 step.

The QLoRA baseline dequantises to bf16 in memory and then multiplies: `dequantize` is that
path, kept honest (no fusion) so speed comparisons against it are fair.
"""

from __future__ import annotations

import functools

import torch

from qerl.formats.fp4 import pack_nibbles, unpack_nibbles

GROUP_SIZE = 64
DQ_BLOCK = 256

# QLoRA / bitsandbytes NormalFloat4 code book, code index 0..15.
NF4_CODEBOOK = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


def codebook(device=None) -> torch.Tensor:
    """The code book on `device`, made once per device: a fresh host-to-device copy on every
    dequantisation could not be captured in a CUDA graph (the rollout engine's decode step)."""
    return _codebook(torch.device(device) if device is not None else torch.device("cpu"))


@functools.lru_cache(maxsize=None)
def _codebook(device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def encode(normalised: torch.Tensor) -> torch.Tensor:
    """Values in [-1, 1] -> nearest code index (uint8). Uses the midpoints between sorted
    code values, so it is exact nearest-value rounding without a [.., 16] distance tensor."""
    cb = codebook(normalised.device)
    midpoints = (cb[1:] + cb[:-1]) / 2
    return torch.bucketize(normalised.contiguous(), midpoints).to(torch.uint8)


def _double_quantize(absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    flat = absmax.reshape(-1)
    offset = flat.mean().reshape(1)
    centred = flat - offset
    pad = (-flat.numel()) % DQ_BLOCK
    blocks = torch.nn.functional.pad(centred, (0, pad)).reshape(-1, DQ_BLOCK)
    # Divisor as a same-device tensor: CUDA would multiply by a rounded 1/127 for a Python
    # number (qerl/formats/nvfp4.py, group_scales), the CPU divides exactly.
    amax = blocks.abs().amax(dim=1)
    bscale = amax / torch.full((), 127.0, dtype=amax.dtype, device=amax.device)
    bscale = torch.where(bscale == 0, torch.ones_like(bscale), bscale)
    q = torch.round(blocks / bscale[:, None]).clamp(-127, 127).to(torch.int8)
    return {
        "weight_absmax_q": q.reshape(-1)[: flat.numel()].reshape(absmax.shape),
        "weight_absmax_scale": bscale,
        "weight_absmax_offset": offset,
    }


def absmax_from(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 per-block absmax, undoing double quantisation when present."""
    if "weight_absmax" in tensors:
        return tensors["weight_absmax"].to(torch.float32)
    q = tensors["weight_absmax_q"]
    flat = q.reshape(-1).to(torch.float32)
    bscale = tensors["weight_absmax_scale"].repeat_interleave(DQ_BLOCK)[: flat.numel()]
    return (flat * bscale + tensors["weight_absmax_offset"]).reshape(q.shape)


def quantize(w: torch.Tensor, double_quant: bool = False) -> dict[str, torch.Tensor]:
    """W [N, K] (K % 64 == 0) -> {weight_packed, weight_absmax} (or the double-quant triple)."""
    if w.ndim != 2 or w.shape[1] % GROUP_SIZE:
        raise ValueError(f"nf4 needs a 2-D weight with K divisible by {GROUP_SIZE}, got {tuple(w.shape)}")
    n, k = w.shape
    blocks = w.detach().to(torch.float32).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    absmax = blocks.abs().amax(dim=-1)
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    out: dict[str, torch.Tensor]
    if double_quant:
        out = _double_quantize(absmax)
        # Encode against the absmax the decoder will actually see.
        safe = absmax_from(out)
        safe = torch.where(safe == 0, torch.ones_like(safe), safe)
    else:
        out = {"weight_absmax": absmax}
    codes = encode((blocks / safe[..., None]).clamp(-1, 1)).reshape(n, k)
    out["weight_packed"] = pack_nibbles(codes)
    return out


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = unpack_nibbles(tensors["weight_packed"])
    n, k = codes.shape
    values = codebook(codes.device)[codes.long()].reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    return (values * absmax_from(tensors)[..., None]).reshape(n, k).to(dtype)


def dequantize_bf16_products(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bf16 weight as bitsandbytes' fused 4-bit GEMV forms it: bf16(code) * bf16(absmax), rounded to bf16
    (`dequantize(..., torch.bfloat16)` instead rounds the fp32 product once, as its dequantise kernel does; the
    two differ in the last bit of some weights). nf4_triton.fused_matmul's register decode rounds this way."""
    codes = unpack_nibbles(tensors["weight_packed"])
    n, k = codes.shape
    values = codebook(codes.device).to(torch.bfloat16)[codes.long()].reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    return (values * absmax_from(tensors).to(torch.bfloat16)[..., None]).reshape(n, k)
