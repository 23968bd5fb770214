"""Plain-torch references for the kernel ops, on any device (the CPU path and the test oracle).

    dequant(fmt, tensors, dtype)      checkpoint tensors -> dense [N, K]
    matmul_ref(x, tensors, fmt)       x @ W^T with W dequantised in fp32 and an fp32 matmul
    matmul_grad_ref(dy, tensors, fmt) dy @ W, same precision (the input-gradient reference)
    nf4_dequant_matmul(x, tensors)    the QLoRA baseline: NF4 -> bf16 weight in memory, then a
                                      bf16 matmul (cuBLAS on GPU). Deliberately unfused: this is
                                      what makes QLoRA slow, and the benchmarks compare against it.
"""

from __future__ import annotations

import torch

from qerl.formats import dequantize_weight


def dequant(fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense [N, K] weight in `dtype` (dequantised in fp32, then cast)."""
    return dequantize_weight(tensors, fmt, dtype)


def matmul_ref(x: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """x [..., K] @ dequant(W)^T in fp32; returns fp32 [..., N]."""
    w = dequant(fmt, tensors, torch.float32)
    return x.to(torch.float32) @ w.T


def matmul_grad_ref(dy: torch.Tensor, tensors: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """dy [..., N] @ dequant(W) in fp32; returns fp32 [..., K]."""
    w = dequant(fmt, tensors, torch.float32)
    return dy.to(torch.float32) @ w


def nf4_dequant_matmul(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """QLoRA baseline: materialise the bf16 weight, then x @ W^T in x's dtype (bf16)."""
    w = dequantize_weight(tensors, "nf4", x.dtype)
    return x @ w.T


__all__ = ["dequant", "matmul_grad_ref", "matmul_ref", "nf4_dequant_matmul"]
