"""Unmerged LoRA for a group of linears that share an input, at decode sizes: two Triton kernels.

    delta = lora_delta(x, a, b, bounds, rank)     # [M, N]: segment i of the output gets
                                                  # (x @ a[i*rank:(i+1)*rank]^T) @ b[rows of i]^T

Layout (built by qerl.rollout.fuse.LinearGroup from PEFT's parameters): `a` [nseg * rank, K] the
segments' A matrices stacked (each padded to the group's largest rank with zero rows), `b` [N,
rank] their B matrices stacked along the output rows, each already multiplied by its LoRA
scaling. `bounds` = (n1, n2): output rows [0, n1) are segment 0, [n1, n2) segment 1, [n2, N)
segment 2 (q / k / v; gate / up uses two, a single linear one).

Why two kernels: the shrink x @ A^T is M x K x R with R = 16..192 and K up to 18944: one program
per K-slice (S slices) writes an fp32 partial [S, M, R], so the reads of A (the large part) spread
over ~20-30 SMs; the expand (one program per 64 output rows) sums the S partials, rounds them to
the activation dtype (as PEFT's lora_A output is) and multiplies by its block of B, only by the
segment its rows belong to. Against two cuBLAS GEMMs this halves the launches (cuBLAS's split-K
shrink is itself two kernels), reads B at its own size rather than a block-diagonal one padded
with zeros, and needs no bf16 round trip of the partial sums. The rollout engine runs both on a
side stream beside the 4-bit product and the next kernel adds the delta.

The torch reference (CPU, and any dtype or layout the kernels do not take) computes the same
two products with torch.mm. tests/test_lora_ops.py runs the kernels under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["lora_delta", "lora_delta_reference", "lora_delta_triton", "lora_expand_triton", "lora_shrink_triton",
           "shrink_splits"]


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    n = b.shape[0]
    ha = torch.mm(x, a.t())
    edges = [0, *bounds, n]
    segs = [(i, edges[i], edges[i + 1]) for i in range(3) if edges[i + 1] > edges[i]]
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for i, n0, n1 in segs:
        torch.mm(ha[:, i * rank:(i + 1) * rank], b[n0:n1].t(), out=out[:, n0:n1])
    return out


MAX_SPLITS = int(os.environ.get("QERL_LORA_MAX_SPLITS", "64"))


def shrink_splits(k: int) -> tuple[int, int]:
    """(BK, S): the K-slice per shrink program (a power of two >= 128) and the number of slices
    (<= MAX_SPLITS)."""
    bk = 128
    while -(-k // bk) > MAX_SPLITS:
        bk *= 2
    return bk, -(-k // bk)


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


# LoRA rows per shrink program. The last program of each row block to arrive reduces S x M x
# SHRINK_BR fp32 partials alone, so small blocks shorten that serial tail: 16 against 64 took the
# cost of r64 LoRA at 14B batch 8 from 11.2% to 8.3% of the step (benchmarks/NOTES_rollout.md
# section 7).
SHRINK_BR = 16
SHRINK_WARPS = 4


def _shrink_blocks(r: int) -> tuple[int, int]:
    br = min(SHRINK_BR, _pow2_at_least(r))
    return br, -(-r // br)


def workspace(x_rows: int, k: int, r: int, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """Buffers for lora_delta_triton at up to `x_rows` rows: the shrink's fp32 partials [S, rows,
    R], its reduced product [rows, R], one arrival counter per R block (zeros; the last arrival
    resets it) and the output [rows, N]."""
    s = shrink_splits(k)[1]
    return (torch.empty(s, x_rows, r, dtype=torch.float32, device=device),
            torch.empty(x_rows, r, dtype=torch.float32, device=device),
            torch.zeros(_shrink_blocks(r)[1], dtype=torch.int32, device=device),
            torch.empty(x_rows, n, dtype=dtype, device=device))


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl
    import triton.language.extra.cuda  # noqa: F401  (gdc_* for PDL)

    if os.environ.get("TRITON_INTERPRET") == "1":
        from qerl.kernels.w4a16_triton import _patch_interpreter

        _patch_interpreter()  # numpy >= 2.4 and the interpreter's handling of scalar bounds

    @triton.jit
    def lora_shrink_kernel(x_ptr, a_ptr, p_ptr, h_ptr, lock_ptr, M, K, R, stride_xm, stride_ps, stride_pm, stride_hm,
                           S: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, MP: tl.constexpr, BR: tl.constexpr,
                           MR: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr = False):
        # program (s, rb): x[:, slice s] @ A[block rb, slice s]^T -> partial s; the last program of
        # block rb to arrive sums the S partials in order (deterministic) into h
        if PDL:  # decode_ops.PDL; A's first chunk is read before the wait (it never depends on it)
            tl.extra.cuda.gdc_launch_dependents()
        s = tl.program_id(0)
        rb = tl.program_id(1)
        r = rb * BR + tl.arange(0, BR)
        m = tl.arange(0, MP)
        acc = tl.zeros([MP, BR], tl.float32)
        k = s * BK + tl.arange(0, KC)
        a0 = tl.load(a_ptr + r[None, :] * K + k[:, None], mask=(r < R)[None, :] & (k < K)[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        for k0 in tl.static_range(0, BK, KC):
            k = s * BK + k0 + tl.arange(0, KC)
            xk = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
            if k0 == 0:
                ak = a0
            else:
                ak = tl.load(a_ptr + r[None, :] * K + k[:, None], mask=(r < R)[None, :] & (k < K)[:, None], other=0.0)
            acc += tl.dot(xk, ak)
        tl.store(p_ptr + s * stride_ps + m[:, None] * stride_pm + r[None, :], acc, mask=(m < M)[:, None] & (r < R)[None, :])
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        count = tl.atomic_add(lock_ptr + rb, 1, sem="acq_rel", scope="gpu")
        if count == S - 1:
            sb = tl.arange(0, SB)
            mr = tl.arange(0, MR)
            total = tl.zeros([MR, BR], tl.float32)
            for s0 in tl.static_range(0, S, SB):
                ss = s0 + sb
                ptrs = p_ptr + ss[:, None, None] * stride_ps + mr[None, :, None] * stride_pm + r[None, None, :]
                ok = (ss < S)[:, None, None] & (mr < M)[None, :, None] & (r < R)[None, None, :]
                total += tl.sum(tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            tl.store(h_ptr + mr[:, None] * stride_hm + r[None, :], total, mask=(mr < M)[:, None] & (r < R)[None, :])
            tl.atomic_xchg(lock_ptr + rb, 0)  # ready for the next launch

    @triton.jit
    def lora_expand_kernel(h_ptr, b_ptr, out_ptr, M, N, rank, n1, n2, stride_hm, stride_om,
                           NSEG: tl.constexpr, MP: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr,
                           PDL: tl.constexpr = False):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.arange(0, MP)
        j = tl.arange(0, RP)
        nm = n < N
        mm = m < M
        jm = j < rank
        b = tl.load(b_ptr + n[:, None] * rank + j[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
        if PDL:  # B was read before the wait; h is the previous kernel's
            tl.extra.cuda.gdc_wait()
        seg_of_n = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)
        out = tl.zeros([MP, BN], tl.float32)
        for seg in tl.static_range(NSEG):
            h = tl.load(h_ptr + m[:, None] * stride_hm + seg * rank + j[None, :], mask=mm[:, None] & jm[None, :], other=0.0)
            o = tl.dot(h.to(b.dtype), tl.trans(b))
            out = tl.where((seg_of_n == seg)[None, :], o, out)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])

    return lora_shrink_kernel, lora_expand_kernel


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """h [M, R] fp32 = x @ a^T into buffers[1] (the first of lora_delta_triton's two kernels)."""
    from qerl.kernels.decode_ops import pdl_on

    shrink, _ = _kernels()
    m, k = x.shape
    r = a.shape[0]
    bk, s = shrink_splits(k)
    partials, h, locks, _ = buffers
    br, rb = _shrink_blocks(r)
    mr = _pow2_at_least(m, 1)
    sb = max(1, min(_pow2_at_least(s, 1), 8192 // (mr * br)))
    pdl = pdl_on(x)
    shrink[(s, rb)](x, a, partials, h, locks, m, k, r, x.stride(0), partials.stride(0), partials.stride(1), h.stride(0),
                    S=s, BK=bk, KC=128, MP=_pow2_at_least(m), BR=br, MR=mr, SB=sb, PDL=pdl, num_warps=SHRINK_WARPS,
                    launch_pdl=pdl)
    return h


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int, m: int,
                       buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """delta [M, N] = per-segment h @ b^T into buffers[3] (the second kernel)."""
    from qerl.kernels.decode_ops import pdl_on

    _, expand = _kernels()
    n = b.shape[0]
    out = buffers[3]
    nseg = 1 + int(bounds[0] < n) + int(bounds[1] < n)
    bn = 128 if n >= 16384 else 64
    pdl = pdl_on(h)
    expand[(-(-n // bn),)](h, b, out, m, n, rank, bounds[0], bounds[1], h.stride(0), out.stride(0),
                           NSEG=nseg, MP=_pow2_at_least(m), RP=_pow2_at_least(rank), BN=bn, PDL=pdl, num_warps=4,
                           launch_pdl=pdl)
    return out[:m]


def lora_delta_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
                      buffers: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x [M, K] (row stride free, unit column stride), a [R, K], b [N, rank] contiguous; `buffers`
    from `workspace` (preallocated: the engine's, so a side stream allocates nothing)."""
    m, k = x.shape
    if buffers is None:
        buffers = workspace(m, k, a.shape[0], b.shape[0], x.dtype, x.device)
    h = lora_shrink_triton(x, a, buffers)
    return lora_expand_triton(h, b, bounds, rank, m, buffers)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
               buffers: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """The group's LoRA delta [M, N] (module docstring): the two Triton kernels on CUDA for bf16 /
    fp16 with M <= 64; torch otherwise (or with `lora` in QERL_DECODE_OPS_TORCH)."""
    from qerl.kernels.decode_ops import _on_gpu

    if (x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= 64 and x.stride(-1) == 1
            and a.is_contiguous() and b.is_contiguous() and _on_gpu(x, "lora")):
        return lora_delta_triton(x, a, b, bounds, rank, buffers)
    return lora_delta_reference(x, a, b, bounds, rank, None if buffers is None else buffers[-1][:x.shape[0]])
