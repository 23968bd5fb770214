"""A resident LoRA kernel for a decode step: one launch computes every linear group's delta.

The side stream of the rollout engine forks and joins once per linear group (112 times in a 7B
step), and those edges cost the step 10-12% even with empty kernels (benchmarks/NOTES_rollout.md
sections 27 and 48-50). Here one kernel, launched on the side stream at the start of the step,
stays resident on a few SMs for the whole step and synchronises with the main chain on the device:

    for each group g, in the order of the step:
        wait until flags[3g] reaches in_target      (each program of the kernel that writes g's
                                                     input adds one after its stores: `signal`)
        xa[g] += x[:, my K slices] @ A^T            (fp32 atomics; A is [rt, K], rt = segments x rank)
        arrive at flags[3g + 1]; wait for all programs
        delta[:, my column blocks] = bf16(xa[g][:, segment]) @ B[block]^T
        add one to flags[3g + 2]                    (the consumer waits for `programs`, decode_ops.Ready)

A group whose table row says `expand` = 0 stops after its arrival at flags[3g + 1]: its consumer, a Gluon
GEMV (w4a16_gluon.forward with an `Expand` sync), waits there for all `programs` arrivals and computes
bf16(xa[g]) @ B^T for its own output rows in its epilogue, so the kernel neither waits for the other
programs nor reads B (engine.LORA_RESIDENT_EXPAND).

Table of groups: int64 [G, FIELDS], offsets in elements from `base` (a bf16 tensor), so the kernel
casts no integer to a pointer (the interpreter cannot) and one table serves any buffers:
x, a, b, out (element offsets), k, n, n1, n2 (segment bounds, as fuse.LinearGroup), rt, sx (x's row
stride), in_target, then for an input that is a folded norm's bf16(r * weight) (engine NORM_FOLD: the
norm's scale is applied by the products, w4a16_gluon fold "scale"): ss (offset of its fp32 [nss, 8]
per-block sums of r^2), nss (0: a plain input), eps (float32 bits); the shrink's sums of each row are
then scaled by 1 / sqrt(sum of ss[:, row] / k + eps) before the expand, as the GEMV scales its products;
expand (1: this kernel expands the group, 0: its GEMV does, the scale then applied there).
flags: int32 [3 G + 2] zeros at the step's start; [3 G] counts waits that gave up
(SPIN_CAP polls: a producer that never came; the delta is then garbage, never a hang), [3 G + 1] the
programs that have started: the step's first kernel waits until all have (decode_ops.embed_rms_norm's
gate), since they wait on each other and on the main chain, whose kernels could otherwise fill the SMs
first and keep the rest from ever being placed (seen: 64 programs stalled a 7B step at batch 8).
xa: fp32 [G, MP, RP] zeros at the step's start.

The math equals qerl.kernels.lora_ops (shrink in fp32, rounded to the activation dtype, expand
with fp32 accumulation); `resident_reference` is the torch form. The fp32 atomics make the low bits
of xa vary between runs. Needs every output segment boundary and N to be multiples of BN, K of BK,
and 16-byte aligned operands (table_row checks; the kernel's loads are vectorised on that promise).
"""

from __future__ import annotations

import functools
import os
import struct
from typing import NamedTuple

import torch

__all__ = ["BK", "BN", "Expand", "FIELDS", "MP", "fits", "PREFETCH", "SLEEP", "STAGES", "STAMP", "WARPS", "WORK", "resident_lora",
           "resident_reference", "stamp_times", "table_row"]

FIELDS = 16  # table row width (15 used)
MP = 16  # rows per step the kernel takes (the tl.dot minimum; decode steps of 1..16 rows)
# The kernel's tiles and pipelining, read at each launch (the ablation flag lres:P:BK:BN:S:W sets them):
# BK columns of x / A per shrink step, BN output columns per expand step, STAGES software-pipelining
# depth of both loops (1: every step waits out its loads' latency), WARPS per program.
# Defaults: the best of session 59's H100 ablations at 7B batch 8 r32 (with 32 programs, engine.LORA_RESIDENT_PROGRAMS:
# 0.853 of the no-LoRA step; 8 programs at BN 64, one stage: 0.414; NOTES_rollout.md section 51). BN 128 fits every
# Qwen2.5 shape (3B-32B); a group that does not fit leaves the step to the side stream (engine._resident_ok).
BK = 64
BN = 128
STAGES = 2
WARPS = 4
# Each program prefetches its A slices and B blocks of a group into L2 before it waits for the group's
# input (prefetch.global.L2), so its loads after the wait find them there instead of in DRAM.
PREFETCH = True
# False (timing only): every wait and count as usual, but no adapter loads, math or delta stores: what the
# kernel's waits and polls alone cost the step (the delta buffers keep whatever they held).
WORK = True
# > 0: each of the kernel's failed polls first naps about SLEEP ns (PTX nanosleep), so its waiting warps
# leave their issue slots to the GEMV programs sharing their SMs (0: polls back to back)
SLEEP = 0
SPIN_CAP = 1 << 20
# Timing only: the kernel writes %globaltimer per group and program (`stamps`, int64 [G, P, 8]): [0] the
# group's input seen, [1] its partial sums added, [2] every program arrived, [3] its delta out, [4] the SM
# (the engine allocates the buffer when this is on at capture; `stamp_times` reads it; ablation --stamp)
STAMP = False


class Expand(NamedTuple):
    """A group's LoRA delta as its Gluon GEMV computes it in the epilogue (table_row expand=False): h, the
    group's fp32 shrink sums [MP, >= segments x rank] (this kernel's xa[g]), and b [N, rank] bf16, split
    into segments at bounds (as fuse.LinearGroup); the delta is bf16(h[:, seg]) @ b[rows of seg]^T."""
    h: torch.Tensor
    b: torch.Tensor
    bounds: tuple[int, int]
    rank: int


def fits(k: int, n: int, bounds: tuple[int, int]) -> bool:
    """The kernel takes a group of input width k and n outputs split at `bounds`: K a multiple of BK,
    N and the segment bounds multiples of BN."""
    return not (k % BK or n % BN or bounds[0] % BN or bounds[1] % BN)


def table_row(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
              bounds: tuple[int, int], in_target: int, scale: tuple | None = None, expand: bool = True) -> list[int]:
    """One group's table row: x [M, K] (unit column stride), a [rt, K], b [N, rank], out [>= M, N]
    contiguous, all of base's dtype; in_target: how many producer programs signal; scale: the
    NORM_FOLD consumer's ("scale", ss, blocks, eps, k) when x is bf16(r * weight) (M <= 8); expand:
    False when the group's GEMV expands (`Expand`; then out is not written)."""
    size = base.element_size()

    def off(t: torch.Tensor) -> int:
        if t.dtype != base.dtype:
            raise ValueError(f"resident LoRA: {t.dtype} operand, the table's base is {base.dtype}")
        return (t.data_ptr() - base.data_ptr()) // size

    k, n = x.shape[1], b.shape[0]
    if x.stride(1) != 1 or not (a.is_contiguous() and b.is_contiguous() and out.is_contiguous()):
        raise ValueError("resident LoRA: x needs unit column stride, a / b / out contiguous")
    if not fits(k, n, bounds) or out.shape[1] != n or a.shape[1] != k:
        raise ValueError(f"resident LoRA: N {n} and bounds {bounds} must be multiples of {BN}, K {k} of {BK}, "
                         f"out [.., {n}]")
    row = [off(x), off(a), off(b), off(out), k, n, bounds[0], bounds[1], a.shape[0], x.stride(0), int(in_target)]
    if any(v % 8 for v in row[:4] + row[9:10]):
        raise ValueError("resident LoRA: operands and x's rows must start 16-byte aligned (offsets multiples of 8)")
    if scale is not None:
        _, ss, blocks, eps, kn = scale
        gap = ss.data_ptr() - base.data_ptr()
        if (ss.dtype != torch.float32 or not ss.is_contiguous() or ss.shape[-1] != 8 or int(kn) != k
                or gap % size or x.shape[0] > 8 or not 0 < int(blocks) <= ss.shape[0]):
            raise ValueError("resident LoRA: a scale needs fp32 [>= blocks, 8] sums, K as the group's, at most 8 rows")
        row += [gap // size, int(blocks), struct.unpack("<i", struct.pack("<f", float(eps)))[0]]
    else:
        row += [0, 0, 0]
    row.append(int(bool(expand)))
    return row + [0] * (FIELDS - len(row))


def resident_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: tuple[int, int],
                       rank: int, scale: tuple | None = None) -> torch.Tensor:
    """What the kernel writes for one group: per segment bf16(x @ A_seg^T in fp32) @ B_seg^T (with
    `scale`, as table_row's: the fp32 sums times each row's 1 / sqrt(sum of its ss / k + eps) first)."""
    n = b.shape[0]
    h = x.float() @ a.float().t()
    if scale is not None:
        _, ss, blocks, eps, kn = scale
        h = h / torch.sqrt(ss[:blocks, :x.shape[0]].float().sum(0) / kn + eps)[:, None]
    h = h.to(x.dtype)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    edges = [0, bounds[0], bounds[1], n]
    for s in range(3):
        if edges[s + 1] > edges[s]:
            out[:, edges[s]:edges[s + 1]] = (h[:, s * rank:(s + 1) * rank].float()
                                             @ b[edges[s]:edges[s + 1]].float().t()).to(x.dtype)
    return out


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    from qerl.kernels.device_wait import wait_count
    from qerl.kernels.w4a16_triton import _stamp

    @triton.jit
    def _spin(ptr, target, err_ptr, CAP: tl.constexpr, SLEEP: tl.constexpr):
        wait_count(ptr, target, err_ptr, CAP, SLEEP)  # gives up after CAP polls and counts that at err_ptr
        tl.debug_barrier()

    @triton.jit
    def _prefetch_l2(ptrs):
        # fire-and-forget: each pointer's 128-byte line into L2 (PREFETCH); nothing waits on it
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _expand(base, t, flags_ptr, xa, stamp_ptr, g, sp, err, b_ptr, o_ptr, N, n1, n2, nss, K, pid, nprog, rows, rm,
                rk, cn, RANK: tl.constexpr, RP: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, CAP: tl.constexpr,
                STAGES: tl.constexpr, WORK: tl.constexpr, SLEEP: tl.constexpr, STAMP: tl.constexpr):
        # a group this kernel expands: once every program's sums are in, this program's column blocks of the
        # delta (rows scaled by a folded norm's 1 / rms first), then its count for the consumer
        _spin(flags_ptr + 3 * g + 1, nprog, err, CAP, SLEEP)
        if STAMP:
            _stamp(stamp_ptr, sp, 2, "globaltimer")
        if WORK:
            inv = tl.full([MP], 1.0, tl.float32)
            if nss > 0:  # a folded norm's input: its rows' 1 / rms from the producer's per-block sums
                ss_ptr = (base + tl.load(t + 11)).to(tl.pointer_type(tl.float32), bitcast=True)
                eps = tl.load(t + 13).to(tl.int32).to(tl.float32, bitcast=True)
                sq = tl.zeros([MP], tl.float32)
                jj = tl.arange(0, 64)
                for j0 in range(0, nss, 64):
                    j = j0 + jj
                    v = tl.load(ss_ptr + j[:, None] * 8 + rows[None, :], mask=(j < nss)[:, None] & (rows < 8)[None, :],
                                other=0.0, cache_modifier=".cg")
                    sq += tl.sum(v, axis=0)
                inv = 1.0 / tl.sqrt(sq / K.to(tl.float32) + eps)
            for c0 in tl.range(pid * BN, N, nprog * BN, num_stages=STAGES):
                seg = (c0 >= n1).to(tl.int32) + (c0 >= n2).to(tl.int32)
                h = tl.load(xa + rows[:, None] * RP + seg * RANK + rk[None, :], cache_modifier=".cg")
                h = h * inv[:, None]
                bt = tl.load(b_ptr + (c0 + cn)[None, :] * RANK + rk[:, None])
                y = tl.dot(h.to(bt.dtype), bt)
                tl.store(o_ptr + rows[:, None] * N + (c0 + cn)[None, :], y.to(bt.dtype), mask=rm[:, None])
        tl.debug_barrier()  # every thread's delta before the count
        tl.atomic_add(flags_ptr + 3 * g + 2, 1, sem="release", scope="gpu")

    globals()["wait_count"] = wait_count
    globals()["_prefetch_l2"] = _prefetch_l2
    globals()["_spin"] = _spin  # the kernel calls it by name: Triton (and its interpreter) look it up in the module
    globals()["_stamp"] = _stamp
    globals()["_expand"] = _expand

    @triton.jit(do_not_specialize=["groups", "M"])
    def resident_kernel(base, tab_ptr, flags_ptr, xa_ptr, stamp_ptr, groups, M, RANK: tl.constexpr, RP: tl.constexpr,
                        MP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, FIELDS: tl.constexpr,
                        CAP: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr = False,
                        WORK: tl.constexpr = True, SLEEP: tl.constexpr = 0, STAMP: tl.constexpr = False):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        rows = tl.arange(0, MP)
        rm = rows < M
        rr = tl.arange(0, RP)
        kk = tl.arange(0, BK)
        cn = tl.arange(0, BN)
        rk = tl.arange(0, RANK)
        err = flags_ptr + 3 * groups
        tl.atomic_add(err + 1, 1, sem="release", scope="gpu")  # resident: the step's first kernel waits for all
        for g in range(groups):
            t = tab_ptr + g * FIELDS
            # the hints table_row guarantees (16-byte aligned operands and rows, K a multiple of BK, N of
            # BN): without them no load is vectorised, and a tile's per-element pointers take every register
            x_ptr = base + tl.multiple_of(tl.load(t), 8)
            a_ptr = base + tl.multiple_of(tl.load(t + 1), 8)
            b_ptr = base + tl.multiple_of(tl.load(t + 2), 8)
            o_ptr = base + tl.multiple_of(tl.load(t + 3), 8)
            K = tl.multiple_of(tl.load(t + 4), BK)
            N = tl.multiple_of(tl.load(t + 5), BN)
            n1 = tl.load(t + 6)
            n2 = tl.load(t + 7)
            rt = tl.load(t + 8)
            sx = tl.multiple_of(tl.load(t + 9), 8)
            target = tl.load(t + 10).to(tl.int32)
            nss = tl.load(t + 12).to(tl.int32)
            rexp = tl.load(t + 14)  # 0: the group's GEMV expands (Expand), this kernel only sums and arrives
            xa = xa_ptr + g * MP * RP
            if PREFETCH and WORK:  # this program's A slices and B blocks into L2 while its input is still to come
                for k0 in tl.range(pid * BK, K, nprog * BK):
                    for kp in tl.static_range(0, BK, 64):  # a line is 64 bf16
                        _prefetch_l2(tl.where(rr < rt, a_ptr + rr * K + k0 + kp, a_ptr))
                if rexp != 0:
                    for c0 in tl.range(pid * BN, N, nprog * BN):
                        for kp in tl.static_range(0, RANK, 64):
                            _prefetch_l2(b_ptr + (c0 + cn) * RANK + kp)
            _spin(flags_ptr + 3 * g, target, err, CAP, SLEEP)
            sp = g * nprog + pid  # this group's and program's stamp row
            if STAMP:
                _stamp(stamp_ptr, sp, 0, "globaltimer")
            acc = tl.zeros([MP, RP], tl.float32)
            if WORK:
                for k0 in tl.range(pid * BK, K, nprog * BK, num_stages=STAGES):
                    k = k0 + kk
                    # .cg: the producer wrote x just now, and an earlier group's x may have had this address (L1 is
                    # not coherent)
                    xk = tl.load(x_ptr + rows[:, None] * sx + k[None, :], mask=rm[:, None], other=0.0, cache_modifier=".cg")
                    ak = tl.load(a_ptr + rr[None, :] * K + k[:, None], mask=(rr < rt)[None, :], other=0.0)
                    acc = tl.dot(xk, ak, acc)
            tl.atomic_add(xa + rows[:, None] * RP + rr[None, :], acc, mask=rm[:, None] & (rr < rt)[None, :],
                          sem="relaxed", scope="gpu")
            tl.debug_barrier()  # every thread's partial before the arrival
            if STAMP:
                _stamp(stamp_ptr, sp, 1, "globaltimer")
            tl.atomic_add(flags_ptr + 3 * g + 1, 1, sem="release", scope="gpu")
            if rexp == 0:  # the GEMV waits for every arrival and expands (Expand)
                if STAMP:
                    _stamp(stamp_ptr, sp, 2, "globaltimer")
            else:
                _expand(base, t, flags_ptr, xa, stamp_ptr, g, sp, err, b_ptr, o_ptr, N, n1, n2, nss, K, pid, nprog,
                        rows, rm, rk, cn, RANK, RP, MP, BN, CAP, STAGES, WORK, SLEEP, STAMP)
            if STAMP:
                _stamp(stamp_ptr, sp, 3, "globaltimer")
                _stamp(stamp_ptr, sp, 4, "smid")

    return resident_kernel


def resident_lora(base: torch.Tensor, table: torch.Tensor, flags: torch.Tensor, xa: torch.Tensor, groups: int,
                  rows: int, rank: int, programs: int, cap: int = SPIN_CAP, stamps: torch.Tensor | None = None) -> None:
    """Launch the resident kernel over `groups` rows of `table` (see the module docstring) on the
    current stream; `programs` of them, which must all be resident at once (they wait on each other).
    xa: fp32 [>= groups, MP, RP], RP a power of two >= every group's rt; `cap`: polls before a wait gives up;
    stamps: int64 [>= groups * programs * 8] for the STAMP clocks (None: none; not in the interpreter)."""
    if stamps is not None and (stamps.dtype != torch.int64 or stamps.numel() < groups * programs * 8):
        raise ValueError(f"resident LoRA: stamps must be int64 with at least {groups * programs * 8} elements")
    if rows > MP or xa.shape[-2] != MP or xa.shape[-1] & (xa.shape[-1] - 1):
        raise ValueError(f"resident LoRA takes at most {MP} rows (got {rows}) and xa [G, {MP}, power of two]")
    if rank & (rank - 1) or not 16 <= rank <= 128:
        raise ValueError(f"resident LoRA takes ranks 16, 32, 64 or 128, got {rank}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret:
        from qerl.kernels.w4a16_triton import _patch_interpreter

        _patch_interpreter()
    # (inline PTX: not in the interpreter)
    prefetch, sleep, stamp = (False, 0, False) if interpret else (PREFETCH, SLEEP, stamps is not None)
    _kernel()[(programs,)](base, table, flags, xa, stamps if stamp else flags, groups, rows, RANK=rank, RP=xa.shape[-1],
                           MP=MP, BK=BK, BN=BN, FIELDS=FIELDS, CAP=cap, STAGES=STAGES, PREFETCH=prefetch, WORK=WORK,
                           SLEEP=sleep, STAMP=stamp, num_warps=WARPS)


def stamp_times(stamps: torch.Tensor, groups: int, programs: int) -> list[dict]:
    """Per group, from a launch's STAMP clocks (ns, %globaltimer): when its first / last program saw the
    input (in_first / in_last), the last one had added its partial sums (sums), every program had
    arrived as the last one saw (met), the last program's delta was out (out), and how many SMs ran it."""
    a = stamps[:groups * programs * 8].view(groups, programs, 8).cpu()
    return [{"in_first": int(g[:, 0].min()), "in_last": int(g[:, 0].max()), "sums": int(g[:, 1].max()),
             "met": int(g[:, 2].max()), "out": int(g[:, 3].max()), "sms": len(set(g[:, 4].tolist()))} for g in a]
