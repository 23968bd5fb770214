"""4-bit weight formats: exact reference quantise / dequantise / pack, in plain torch.

One entry point per direction, by format name:

    tensors = quantize_weight(w, "nvfp4")          # dict of named tensors, checkpoint names
    w_hat = dequantize_weight(tensors, "nvfp4")    # dense [N, K]

`bf16` is the identity format (the tensors dict is {"weight": w.to(bfloat16)}).
"""

from __future__ import annotations

import torch

from qerl import FORMATS
from qerl.formats import mxfp4, nf4, nvfp4

QUANTIZED_FORMATS = ("nf4", "mxfp4", "nvfp4")
GROUP_SIZE = {"nvfp4": nvfp4.GROUP_SIZE, "mxfp4": mxfp4.GROUP_SIZE, "nf4": nf4.GROUP_SIZE}
# compressed-tensors format names for the formats it defines.
COMPRESSED_TENSORS_FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
# Nominal storage cost per weight, scales included (per-tensor float32 scales excluded).
NOMINAL_BITS = {"bf16": 16.0, "nvfp4": 4.5, "mxfp4": 4.25, "nf4": 4.5}


class FormatError(ValueError):
    """An unknown format name, or a weight that a format cannot hold."""


def check_format(name: str) -> str:
    if name not in FORMATS:
        raise FormatError(f"unknown format {name!r}; valid formats: {', '.join(FORMATS)}")
    return name


def quantize_weight(w: torch.Tensor, fmt: str, **options) -> dict[str, torch.Tensor]:
    """Quantise a 2-D weight [out, in]. Options: nvfp4 `weight_global_scale`,
    mxfp4 `scale_rule`, nf4 `double_quant`."""
    check_format(fmt)
    if not torch.isfinite(w).all():
        raise FormatError(f"weight of shape {tuple(w.shape)} has NaN or Inf values; refusing to quantise it")
    if fmt == "bf16":
        return {"weight": w.detach().to(torch.bfloat16)}
    if w.ndim != 2 or w.shape[1] % GROUP_SIZE[fmt]:
        raise FormatError(
            f"{fmt} needs the input dimension divisible by {GROUP_SIZE[fmt]}, got weight shape {tuple(w.shape)}"
        )
    module = {"nvfp4": nvfp4, "mxfp4": mxfp4, "nf4": nf4}[fmt]
    return module.quantize(w, **options)


def dequantize_weight(tensors: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    check_format(fmt)
    if fmt == "bf16":
        return tensors["weight"].to(dtype)
    if fmt == "nvfp4":
        return nvfp4.dequantize(tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"], dtype)
    if fmt == "mxfp4":
        return mxfp4.dequantize(tensors["weight_packed"], tensors["weight_scale"], dtype)
    return nf4.dequantize(tensors, dtype)


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = [
    "COMPRESSED_TENSORS_FORMAT",
    "FormatError",
    "GROUP_SIZE",
    "NOMINAL_BITS",
    "QUANTIZED_FORMATS",
    "check_format",
    "dequantize_weight",
    "quantize_weight",
    "tensor_bytes",
]
