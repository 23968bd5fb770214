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

One launch instead of two (`FUSED`, opt-in: slower in the engine, see FUSED): the same two phases
in one grid whose programs take their role from a ticket (an atomic counter) rather than from
their program id: the first S x RB tickets run the shrink, the rest the expand, which read their
block of B, then wait until the shrink's row blocks are all reduced. A program only waits on
programs that took earlier tickets, so they are already running: no launch order or residency is
assumed (the forward-progress argument of decoupled look-back scans). It removes a kernel boundary
from the side stream's chain per linear group. The waiting programs poll with volatile loads and
then take an acquire load whose value is used: without it (volatile polling alone) the expand read
stale h on the H100.

The torch reference (CPU, and any dtype or layout the kernels do not take) computes the same
two products with torch.mm. tests/test_lora_ops.py runs the kernels under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

from qerl.env import env_int

__all__ = ["lora_add_", "lora_delta", "lora_delta_reference", "lora_delta_triton", "lora_expand_triton", "lora_fused_triton",
           "lora_shrink_triton", "segment_bounds", "shrink_splits"]


def segment_bounds(sizes) -> tuple[int, int]:
    """`bounds` of a group whose N outputs stack segments of these sizes: rows [0, n1), [n1, n2), [n2, N)
    (one segment: (N, N); two: (s0, N))."""
    edges = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    n = edges[-1]
    return (edges[0] if len(edges) > 1 else n, edges[1] if len(edges) > 2 else n)


def lora_delta_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    n = b.shape[0]
    ha = torch.mm(x, a.t())
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for i, n0, n1 in _segments(bounds, n):
        torch.mm(ha[:, i * rank:(i + 1) * rank], b[n0:n1].t(), out=out[:, n0:n1])
    return out


def _segments(bounds: tuple[int, int], n: int) -> list[tuple[int, int, int]]:
    """(segment, first output row, end) of the non-empty segments of an N-row group."""
    edges = [0, *bounds, n]
    return [(i, edges[i], edges[i + 1]) for i in range(3) if edges[i + 1] > edges[i]]


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (int(n) - 1).bit_length())


# The shrink splits K into at most MAX_SPLITS slices. Above 16 rows it takes at most
# max(8, SPLIT_PARTIAL_ROWS // MP) of them (MP: the rows padded to a power of two). The last program of
# each row block sums the S x MP x BR fp32 partials alone, so that serial tail grows with the rows.
# 64 slices suit the 8- and 16-row decode steps. Measured on the H100 (NOTES_rollout.md sections 31-32),
# LoRA r32 as a fraction of the no-LoRA 14B step at 1280 keys:
#   64 rows: 0.811 with 64 slices, 0.970 / 0.969 with at most 16 / 8;
#   32 rows: 0.841 with 64 slices, 0.924 with at most 32, 0.954 / 0.959 with at most 16 / 8 (a118).
# 512 gives 16 at 17-32 rows and 8 from 33 rows on (K = 5120 at 64 rows: 5 slices of 1024).
MAX_SPLITS = env_int("QERL_LORA_MAX_SPLITS", 64)
SPLIT_PARTIAL_ROWS = 512


def shrink_splits(k: int, m: int = 1) -> tuple[int, int]:
    """(BK, S): the K-slice per shrink program (a power of two >= 128) and the number of slices for
    `m` rows (the bounds above; m = 1 gives the most, so a workspace sized by it serves any rows)."""
    mp = _pow2_at_least(m)
    most = MAX_SPLITS if mp <= 16 else min(MAX_SPLITS, max(8, SPLIT_PARTIAL_ROWS // mp))
    bk = 128
    while -(-k // bk) > most:
        bk *= 2
    return bk, -(-k // bk)


# LoRA rows per shrink program. The last program of each row block to arrive reduces S x M x
# SHRINK_BR fp32 partials alone, so small blocks shorten that serial tail: 16 against 64 took the
# cost of r64 LoRA at 14B batch 8 from 11.2% to 8.3% of the step (benchmarks/NOTES_rollout.md
# section 7).
SHRINK_BR = 16
SHRINK_WARPS = 4


def _shrink_blocks(r: int) -> tuple[int, int]:
    br = min(SHRINK_BR, _pow2_at_least(r))
    return br, -(-r // br)


# One launch for the shrink and the expand (module docstring); off by default: measured slower in
# the engine (same-process A/B at batch 8 with the LoRA GEMV plan: 7B r64 3.684 vs 3.341 ms per
# step, 14B r32 5.794 vs 5.535; its expand programs hold SM slots while they wait for the shrink,
# NOTES_rollout.md section 12)
FUSED = os.environ.get("QERL_LORA_FUSED", "0") == "1"


def workspace(x_rows: int, k: int, r: int, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """Buffers for lora_delta_triton at up to `x_rows` rows: the shrink's fp32 partials [S, rows,
    R], its reduced product [rows, R], one arrival counter per R block and three for the fused
    kernel (ticket, reduced blocks, finished programs; zeros, reset by the last program) and the
    output [rows, N]."""
    s = shrink_splits(k)[1]
    return (torch.empty(s, x_rows, r, dtype=torch.float32, device=device),
            torch.empty(x_rows, r, dtype=torch.float32, device=device),
            torch.zeros(_shrink_blocks(r)[1] + 3, dtype=torch.int32, device=device),
            torch.empty(x_rows, n, dtype=dtype, device=device))


@functools.lru_cache(maxsize=None)
def _kernels():
    from qerl.kernels import lora_triton as K

    return K.lora_shrink_kernel, K.lora_expand_kernel, K.lora_fused_kernel


def _shrink_meta(m: int, k: int, r: int) -> dict:
    """The shrink's launch constants (grid (S, RB) with S = K slices and RB = row blocks of A)."""
    bk, s = shrink_splits(k, m)
    br, rb = _shrink_blocks(r)
    mr = _pow2_at_least(m, 1)
    return dict(S=s, BK=bk, KC=128, MP=_pow2_at_least(m), BR=br, MR=mr,
                SB=max(1, min(_pow2_at_least(s, 1), 8192 // (mr * br))), RB=rb)


def _expand_meta(n: int, bounds: tuple[int, int], rank: int, m: int) -> dict:
    """The expand's launch constants (one program per BN output rows)."""
    return dict(NSEG=1 + int(bounds[0] < n) + int(bounds[1] < n), MP=_pow2_at_least(m), RP=_pow2_at_least(rank),
                BN=128 if n >= 16384 else 64)


def _check_partials(partials: torch.Tensor, s: int, m: int, r: int) -> None:
    """The kernels write S x M x R fp32 partials: refuse a workspace made for fewer (another MAX_SPLITS)."""
    if partials.shape[0] < s or partials.shape[1] < m or partials.shape[2] < r:
        raise ValueError(f"LoRA workspace partials {tuple(partials.shape)} too small for {s} K slices x {m} rows x "
                         f"rank {r} (made under another MAX_SPLITS?)")


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """h [M, R] fp32 = x @ a^T into buffers[1] (the first of lora_delta_triton's two kernels)."""
    from qerl.kernels.decode_ops import pdl_on

    shrink = _kernels()[0]
    m, k = x.shape
    r = a.shape[0]
    partials, h, locks, _ = buffers
    meta = _shrink_meta(m, k, r)
    rb = meta.pop("RB")
    _check_partials(partials, meta["S"], m, r)
    pdl = pdl_on(x)
    shrink[(meta["S"], rb)](x, a, partials, h, locks, m, k, r, x.stride(0), partials.stride(0), partials.stride(1),
                            h.stride(0), **meta, PDL=pdl, num_warps=SHRINK_WARPS, launch_pdl=pdl)
    return h


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int, m: int,
                       buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """delta [M, N] = per-segment h @ b^T into buffers[3] (the second kernel)."""
    from qerl.kernels.decode_ops import pdl_on

    expand = _kernels()[1]
    n = b.shape[0]
    out = buffers[3]
    meta = _expand_meta(n, bounds, rank, m)
    pdl = pdl_on(h)
    expand[(-(-n // meta["BN"]),)](h, b, out, m, n, rank, bounds[0], bounds[1], h.stride(0), out.stride(0), **meta,
                                   PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out[:m]


def lora_fused_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
                      buffers: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The shrink and the expand in one launch (module docstring); same results as the two
    kernels, bit for bit (the same products and the same order of sums)."""
    from qerl.kernels.decode_ops import pdl_on

    fused = _kernels()[2]
    m, k = x.shape
    r, n = a.shape[0], b.shape[0]
    partials, h, locks, out = buffers
    shrink = _shrink_meta(m, k, r)
    _check_partials(partials, shrink["S"], m, r)
    expand = _expand_meta(n, bounds, rank, m)
    grid = shrink["S"] * shrink["RB"] + -(-n // expand["BN"])
    pdl = pdl_on(x)
    fused[(grid,)](x, a, b, partials, h, out, locks, m, k, r, n, rank, bounds[0], bounds[1], x.stride(0),
                   partials.stride(0), partials.stride(1), h.stride(0), out.stride(0), grid,
                   **shrink, NSEG=expand["NSEG"], RP=expand["RP"], BN=expand["BN"], PDL=pdl, num_warps=SHRINK_WARPS,
                   launch_pdl=pdl)
    return out[:m]


def lora_delta_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
                      buffers: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x [M, K] (row stride free, unit column stride), a [R, K], b [N, rank] contiguous; `buffers`
    from `workspace` (preallocated: the engine's, so a side stream allocates nothing)."""
    m, k = x.shape
    if buffers is None:
        buffers = workspace(m, k, a.shape[0], b.shape[0], x.dtype, x.device)
    if FUSED:
        return lora_fused_triton(x, a, b, bounds, rank, buffers)
    h = lora_shrink_triton(x, a, buffers)
    return lora_expand_triton(h, b, bounds, rank, m, buffers)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
               buffers: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """The group's LoRA delta [M, N] (module docstring): the two Triton kernels on CUDA for bf16 /
    fp16 with M <= 64; torch otherwise (or with `lora` in QERL_DECODE_OPS_TORCH)."""
    if _kernel_path(x, a, b):
        return lora_delta_triton(x, a, b, bounds, rank, buffers)
    return lora_delta_reference(x, a, b, bounds, rank, None if buffers is None else buffers[-1][:x.shape[0]])


# Where the delta takes the torch path (a prefill: more than 64 rows), add it to the base product
# in place, one cuBLAS GEMM per segment with beta = 1 (y[:, segment] += h_seg @ B_seg^T), instead of
# writing the [M, N] delta and adding it after: at a 7B prefill of 2048 tokens that round trip is
# ~4 x M x N x 2 bytes per group, ~26 GB and ~9 ms of the ~10 ms LoRA added (NOTES_rollout.md
# section 24). The delta is then rounded once, with the sum, rather than on its own first.
# False: the old order (ablation flag `noaddmm`).
ADD_IN_PLACE = True


def _kernel_path(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    from qerl.kernels.decode_ops import _on_gpu

    return (x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= 64 and x.stride(-1) == 1
            and a.is_contiguous() and b.is_contiguous() and _on_gpu(x, "lora"))


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int], rank: int,
              buffers: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """y [M, N] += the group's LoRA delta (lora_delta's), in place; returns y."""
    if not ADD_IN_PLACE or y.dtype != a.dtype or _kernel_path(x, a, b):
        return y.add_(lora_delta(x, a, b, bounds, rank, buffers).to(y.dtype))
    ha = torch.mm(x, a.t())
    for i, n0, n1 in _segments(bounds, b.shape[0]):
        y[:, n0:n1].addmm_(ha[:, i * rank:(i + 1) * rank], b[n0:n1].t())
    return y
