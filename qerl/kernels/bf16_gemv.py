"""bf16 x bf16 GEMV for the decode chain, one row: y[N] = W[N, K] @ x[K] (+ bias), fp32 accumulate,
bf16 out; a Triton kernel that takes part in programmatic dependent launch (PDL).

Why: in the rollout engine's bf16 decode step every linear was a cuBLAS call. cuBLAS streams a
large weight near the copy bandwidth, but it takes no part in PDL, so each product starts only
after the kernel before it has drained, and the kernel after it waits the same way. This kernel
loads its first weight tile before `griddepcontrol.wait` (weights never depend on the previous
kernel) and lets the next kernel launch early, as the 4-bit GEMVs of issue 4 do in the same chain.

Schedule: one program per ROWS = 8 output rows over the whole K (no split, so no workspace and one
fixed summation order: deterministic); 8 KB weight tiles [8, 512], the next tile's load issued
before the current tile's products (two in flight per program); fp32 products summed per row on
the CUDA cores.

Measured against cuBLAS (H100, benchmarks/probe_bf16_gemv.py, chained with PDL,
benchmarks/results/bf16_gemv.json; NOTES_rollout.md section 15): 7B q/k/v x1.13, o x1.12, gate/up
x1.13, down x1.08, lm_head x1.085; 14B q/k/v x1.03, gate/up x1.07, down x1.08, lm_head x1.08. A tensor-core variant for 2..8 rows lost to cuBLAS on every 7B shape, so the engine
(qerl.rollout.fuse.LinearGroup, decode) routes one-row bf16 products here and everything else to
cuBLAS. ENABLED = False (or QERL_BF16_GEMV=0): cuBLAS always.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("QERL_BF16_GEMV", "1") == "1"


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    import triton.language.extra.cuda  # noqa: F401  (gdc_* for PDL)

    @triton.jit
    def _tile(ptr, mask_r, ks, k0, K, EVEN_K: tl.constexpr):
        if EVEN_K:
            return tl.load(ptr + k0, mask=mask_r[:, None], other=0.0)
        return tl.load(ptr + k0, mask=mask_r[:, None] & ((k0 + ks)[None, :] < K), other=0.0)

    @triton.jit
    def bf16_gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr,
                         HAS_BIAS: tl.constexpr, PDL: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        rmask = rows < N
        ks = tl.arange(0, BK)
        wp = w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
        # the first weight tile and the bias before the wait: no kernel of the step writes them
        w = _tile(wp, rmask, ks, 0, K, EVEN_K)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        one = tl.full([1], 1, tl.int1)
        xp = x_ptr + tl.zeros([1], tl.int32)[:, None] + ks[None, :]
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(BK, K, BK):  # the next tile's load issued before this tile's products (two in flight)
            w_next = _tile(wp, rmask, ks, k0, K, EVEN_K)
            acc += w.to(tl.float32) * _tile(xp, one, ks, k0 - BK, K, EVEN_K).to(tl.float32)
            w = w_next
        acc += w.to(tl.float32) * _tile(xp, one, ks, (K - 1) // BK * BK, K, EVEN_K).to(tl.float32)
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += bias
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    return bf16_gemv_kernel


ROWS = 8  # rows per program: 8 KB weight tiles [8, 512], two in flight per program
BK = 512


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where the engine routes x @ weight^T here: one bf16 row, a contiguous bf16 weight, an sm_90+
    GPU."""
    from qerl.kernels.decode_ops import _sm90  # cached per device: this runs for every decode product

    if not ENABLED or x.device.type != "cuda" or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    return (x.numel() == x.shape[-1] and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] == x.shape[-1]
            and _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def dense(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for the decode step: a plain bf16 nn.Linear on one row through this kernel (PDL as
    the chain has it), anything else through the module itself."""
    from qerl.kernels.decode_ops import pdl_on

    if type(module) is torch.nn.Linear and usable(x, module.weight):
        return linear(x, module.weight, module.bias, pdl=pdl_on(x))
    return module(x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pdl: bool = True,
           tile: tuple[int, int] | None = None) -> torch.Tensor:
    """One row x [.., K] @ weight [N, K]^T (+ bias) -> [.., N] (contiguous bf16 weight); `tile`
    (rows per program, K per step) overrides (ROWS, BK)."""
    k = x.shape[-1]
    n = weight.shape[0]
    if x.numel() != k:
        raise ValueError(f"bf16_gemv takes one row, got x of shape {tuple(x.shape)}")
    x2 = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    bn, bk = tile or (ROWS, BK)
    _kernel()[(-(-n // bn),)](x2, weight.contiguous(), bias if bias is not None else weight, y, n, k, BN=bn, BK=bk,
                              HAS_BIAS=bias is not None, PDL=pdl, EVEN_K=k % bk == 0, num_warps=4, launch_pdl=pdl)
    return y.view(*x.shape[:-1], n)
