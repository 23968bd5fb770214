"""Triton kernels of qerl.kernels.lora_ops (imported on first use, so `import qerl.kernels.lora_ops`
stays free of Triton): the shrink, the expand, and both in one launch with ticketed roles. The
helpers are module-level @triton.jit functions so both the compiler and the interpreter find them."""

from __future__ import annotations

import os

import triton
import triton.language as tl
import triton.language.extra.cuda  # noqa: F401  (gdc_* for PDL)

from qerl.kernels.device_wait import wait_count

if os.environ.get("TRITON_INTERPRET") == "1":
    from qerl.kernels.w4a16_triton import _patch_interpreter

    _patch_interpreter()  # numpy >= 2.4 and the interpreter's handling of scalar bounds


@triton.jit
def _shrink(x_ptr, a_ptr, p_ptr, h_ptr, lock_ptr, s, rb, M, K, R, stride_xm, stride_ps, stride_pm, stride_hm,
            S: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, MP: tl.constexpr, BR: tl.constexpr,
            MR: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr):
    # x[:, slice s] @ A[block rb, slice s]^T -> partial s; the last program of block rb to
    # arrive sums the S partials in order (deterministic) into h and returns True
    r = rb * BR + tl.arange(0, BR)
    m = tl.arange(0, MP)
    acc = tl.zeros([MP, BR], tl.float32)
    k = s * BK + tl.arange(0, KC)
    # A's first chunk is read before the PDL wait (it never depends on the previous kernel)
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
    last = count == S - 1
    if last:
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
    return last

@triton.jit
def _expand(h_ptr, b_ptr, out_ptr, blk, M, N, rank, n1, n2, stride_hm, stride_om, done_ptr, DONE,
            NSEG: tl.constexpr, MP: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr,
            SPIN: tl.constexpr):
    # out rows block blk = per-segment h @ B[block]^T; B is read before any wait; SPIN: h is
    # ready once the counter at done_ptr reaches DONE (the fused kernel's shrink programs)
    n = blk * BN + tl.arange(0, BN)
    m = tl.arange(0, MP)
    j = tl.arange(0, RP)
    nm = n < N
    mm = m < M
    jm = j < rank
    b = tl.load(b_ptr + n[:, None] * rank + j[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if SPIN:  # until every shrink program has counted (device_wait: polls, then an acquire that orders the h loads)
        wait_count(done_ptr, DONE, done_ptr, 0)
    seg_of_n = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)
    out = tl.zeros([MP, BN], tl.float32)
    for seg in tl.static_range(NSEG):
        # .cg: in the fused kernel h was written by other programs of this launch (L1 is not coherent)
        h = tl.load(h_ptr + m[:, None] * stride_hm + seg * rank + j[None, :], mask=mm[:, None] & jm[None, :],
                    other=0.0, cache_modifier=".cg")
        o = tl.dot(h.to(b.dtype), tl.trans(b))
        out = tl.where((seg_of_n == seg)[None, :], o, out)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], out.to(out_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])

@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, p_ptr, h_ptr, lock_ptr, M, K, R, stride_xm, stride_ps, stride_pm, stride_hm,
                       S: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, MP: tl.constexpr, BR: tl.constexpr,
                       MR: tl.constexpr, SB: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # decode_ops.PDL
        tl.extra.cuda.gdc_launch_dependents()
    _shrink(x_ptr, a_ptr, p_ptr, h_ptr, lock_ptr, tl.program_id(0), tl.program_id(1), M, K, R, stride_xm, stride_ps,
            stride_pm, stride_hm, S, BK, KC, MP, BR, MR, SB, PDL)

@triton.jit
def lora_expand_kernel(h_ptr, b_ptr, out_ptr, M, N, rank, n1, n2, stride_hm, stride_om,
                       NSEG: tl.constexpr, MP: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _expand(h_ptr, b_ptr, out_ptr, tl.program_id(0), M, N, rank, n1, n2, stride_hm, stride_om, h_ptr, 0,
            NSEG, MP, RP, BN, PDL, False)

@triton.jit
def lora_fused_kernel(x_ptr, a_ptr, b_ptr, p_ptr, h_ptr, out_ptr, lock_ptr, M, K, R, N, rank, n1, n2,
                      stride_xm, stride_ps, stride_pm, stride_hm, stride_om, GRID,
                      S: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, MP: tl.constexpr, BR: tl.constexpr,
                      MR: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr, NSEG: tl.constexpr,
                      RP: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = False):
    # lock_ptr: RB arrival counters, then ticket, reduced blocks, finished programs.
    # With PDL the wait comes first: a launch queued behind this one on the same workspace must
    # not take a ticket before this launch's last program has reset the counters (so nothing is
    # read before the wait here; in the engine the kernel follows a stream join, not a PDL edge)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.atomic_add(lock_ptr + RB, 1, sem="relaxed", scope="gpu")
    if t < S * RB:
        last = _shrink(x_ptr, a_ptr, p_ptr, h_ptr, lock_ptr, t % S, t // S, M, K, R, stride_xm, stride_ps,
                       stride_pm, stride_hm, S, BK, KC, MP, BR, MR, SB, False)
        if last:
            tl.debug_barrier()  # h is written before the block counts as reduced
            tl.atomic_add(lock_ptr + RB + 1, 1, sem="release", scope="gpu")
    else:
        _expand(h_ptr, b_ptr, out_ptr, t - S * RB, M, N, rank, n1, n2, stride_hm, stride_om, lock_ptr + RB + 1, RB,
                NSEG, MP, RP, BN, False, True)
    tl.debug_barrier()
    finished = tl.atomic_add(lock_ptr + RB + 2, 1, sem="acq_rel", scope="gpu")
    if finished == GRID - 1:  # every program has taken its ticket: reset for the next launch
        tl.atomic_xchg(lock_ptr + RB, 0)
        tl.atomic_xchg(lock_ptr + RB + 1, 0)
        tl.atomic_xchg(lock_ptr + RB + 2, 0)

