"""Single-pass NF4 -> bf16 dequantisation in Triton: the fast half of the QLoRA baseline.

QLoRA (bitsandbytes) runs a 4-bit matmul in training as "dequantise the whole weight to bf16
in one kernel, then cuBLAS". `dequant_bf16` is that first kernel (reads 4.5 bits per weight,
writes 16); the benchmark times it + torch.matmul as the `nf4` baseline, which is a fairer
opponent than the multi-pass torch dequantisation in `reference.nf4_dequant_matmul` (the CPU
reference). Not a fused GEMM. Imported only when triton is used.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from qerl.formats import nf4

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _nf4_dequant_kernel(p_ptr, a_ptr, cb_ptr, o_ptr, n_bytes, BLOCK: tl.constexpr):
    """Each program: BLOCK packed bytes -> 2*BLOCK bf16 (low nibble first); absmax per 32 bytes."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(a_ptr + offs // 32, mask=mask, other=0.0)
    lo = tl.load(cb_ptr + (b & 0xF)) * absmax
    hi = tl.load(cb_ptr + (b >> 4)) * absmax
    out = tl.join(lo, hi).reshape(2 * BLOCK)
    offs2 = tl.program_id(0) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(o_ptr + offs2, out.to(o_ptr.dtype.element_ty), mask=offs2 < 2 * n_bytes)


@functools.lru_cache(maxsize=None)
def _codebook(device: torch.device) -> torch.Tensor:
    """The 16 NF4 values on `device`, built once (no host->device copy inside a CUDA graph)."""
    return nf4.codebook(device)


def dequant_bf16(tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """NF4 checkpoint tensors (absmax or double-quant) -> dense bf16 [N, K], one kernel pass."""
    packed = tensors["weight_packed"].contiguous()
    n, k2 = packed.shape
    absmax = nf4.absmax_from(tensors).to(torch.float32).contiguous()
    cb = _codebook(packed.device)
    o = torch.empty(n, 2 * k2, dtype=torch.bfloat16, device=packed.device) if out is None else out
    block = 1024
    _nf4_dequant_kernel[(triton.cdiv(packed.numel(), block),)](packed, absmax, cb, o, packed.numel(), BLOCK=block)
    return o


def dequant_matmul(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The QLoRA baseline: y = x @ dequant_bf16(W)^T (cuBLAS), weight materialised in memory."""
    return x @ dequant_bf16(tensors).T
