"""nvfp4 / mxfp4 GEMM with the decoded weights as wgmma's register operand, for Hopper (Gluon), M <= 128:
y[M, N] = x[M, K] @ dequant(W)[N, K]^T, bf16 in / out, fp32 accumulate.

Why another kernel. `w4a16_wgmma.py` decodes in separate warps into shared memory, fences the
stores for the async proxy and hands each stage over through an mbarrier; on the H100 its
decoder warps stalled on those fences and barriers about half of the time and the kernel was
latency bound (NOTES_w4a16.md section 13), no faster than the Triton kernel at M = 64. Here the
warps that issue the wgmma decode the weights themselves, straight into the registers of the
wgmma's A operand: no shared-memory round trip for the decoded weights, no proxy fence, no
hand-off. The tensor cores work on chunk c while the same warps decode chunk c + 1 (one wgmma
group in flight).

The register operand fixes which K each thread must hold: in a warp's 16 rows, thread (g, t)
(lane = 4g + t) holds rows g and g + 8 at K = 2t, 2t + 1 and 2t + 8, 2t + 9 of every 16-K slice.
A layout word holds K = 8c .. 8c + 7 of one row as four bf16 pairs P_j (layout.py), and the pair
at K offsets (2t, 2t + 1) is P_j(t) with j(t) = (0, 2, 1, 3)[t]. So the four threads of a quad
read the same words (one broadcast shared-memory read) and each decodes only its own pair:
P = (rotr(w, R_t) & MAG) | (rotr(w, S_t) & SIGN), times the group scale, with per-lane rotation
amounts. That is the whole decode (2 funnel shifts, 2 logic ops, 1 bf16x2 multiply per two
weights) and the result is the A fragment as it is.

Program = R row tiles of 64 (one warpgroup each, R = 1 or 2) x BM tokens (the wgmma N: 16, 32,
64 or 128) x a K slice. Partitions:
- default (4 R warps): per 256-K step, wait for the raw weight stage, read it into registers,
  release it; then per 64-K chunk decode, issue the async wgmma acc[64 R, BM] += A[64 R, 64] @
  x_chunk[BM, 64]^T, and retire the previous chunk; the activation stage is released once the
  step's last wgmma retired (XREL = 1: the next step drains that wgmma after its loads and releases
  the activation stage beside its weight stage, one CTA barrier less per step). Epilogue:
  w4a16_wgmma's (split fixup, bias, alpha).
- weight loader (1 warp): TMA copies of the R tiles of a step (words 8 KB + scales 1 KB nvfp4 /
  512 B mxfp4 each) into a ring of NSW stages.
- activation loader (1 warp): TMA copies of the step's four x chunks [BM, 64] (128-byte swizzle)
  into a ring of NSX stages; with PDL only this warp waits for the previous kernel, so weights
  stream before it ends.
KP = 2 (`_rwg_kp_kernel`, R = 1): a second 4-warp MMA partition takes the odd steps of the same tile and
hands its accumulator to the first through shared memory; the rings need an even number of stages, so that
each stage belongs to one MMA warpgroup (with an odd ring a warpgroup can reach a stage two phases ahead of
its last wait there, where the parity wait passes at once).
Schedule: as w4a16_wgmma (tile p // S, K slice p % S, deterministic fixup). Scales: one per two
words (nvfp4, FP8-E4M3 per 16 K) or per four (mxfp4, E8M0 per 32 K), broadcast onto the words in
registers before the decode. One launch, no host sync, capturable.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from qerl.env import env_int
from qerl.kernels import layout
from qerl.kernels import w4a16_triton as W
from qerl.kernels import w4a16_wgmma as WG
from qerl.kernels.w4a16_frag import FRAG_SCALE_PAIRS, FRAG_SMEM, frag_decode, frag_layouts, frag_prep, frag_stage
from qerl.kernels.w4a16_ws import _gdc, _mul2, _ring_barriers

_MAG = gl.constexpr(layout.MAG_MASK)
_SIGN = gl.constexpr(layout.SIGN_MASK)
_SCALE_MUL = gl.constexpr(3.3230699894622897e35)  # 2^118: FP8-E4M3 scale times 2^(126 - J), J = 8


def lane_rotations() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(R_t, S_t) for t = 0..3: the rotations that put the pair at K offsets (2t, 2t + 1) of a
    word into one bf16x2 register (low half = the lower K), from layout.py's bit layout."""
    rot_mag, rot_sign = [], []
    for t in range(4):
        j, half = layout._slot(2 * t)
        assert half == 0 and layout._slot(2 * t + 1) == (j, 1)
        rot_mag.append(layout.ROT_MAG[j])
        rot_sign.append(layout.ROT_SIGN[j])
    return tuple(rot_mag), tuple(rot_sign)


def layouts(r: int, bm: int, fmt: str = "nvfp4"):
    """(LW2, LS3, LW3, ACC, AOP) for R row tiles: the [64R, 32] word tile as each thread reads it
    (rows g and g + 8 of its warp's 16, all 32 words; the four lanes t of a quad read the same),
    the scale tile with its words as the last dimension ([64R, 16, 2] nvfp4: a scale per two words;
    [64R, 8, 4] mxfp4: a scale per four), the [64R, 32, 4] words with the quad's lane t as the last
    dimension, the accumulator and the wgmma's register A operand."""
    warps = [[16, 0], [32, 0]] + [[64 << i, 0] for i in range(r.bit_length() - 1)]
    lanes = [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
    lw2 = gl.DistributedLinearLayout([[8, 0], [0, 1], [0, 2], [0, 4], [0, 8], [0, 16]], lanes, warps, [], [64 * r, 32])
    if fmt == "nvfp4":
        ls3 = gl.DistributedLinearLayout([[8, 0, 0], [0, 0, 1], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]],
                                         [w + [0] for w in lanes], [w + [0] for w in warps], [], [64 * r, 16, 2])
    else:
        ls3 = gl.DistributedLinearLayout([[8, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                         [w + [0] for w in lanes], [w + [0] for w in warps], [], [64 * r, 8, 4])
    lw3 = gl.DistributedLinearLayout([[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
                                     [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                     [w + [0] for w in warps], [], [64 * r, 32, 4])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * r, 1], instr_shape=[16, bm, 16])
    aop = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    return lw2, ls3, lw3, acc, aop


@gluon.jit
def _rotr_v(w, r):
    """Rotate right by a per-element amount (one funnel shift)."""
    return gl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $1, $2;", "=r,r,r", [w, r], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def _chunks(v, ROWS: gl.constexpr):
    """[ROWS, 32, 4] (word column c, lane t) -> its four 64-K chunks [ROWS, 8, 4] (words 8i .. 8i + 7):
    the chunk index is word bits 3-4, which sit in registers."""
    t = gl.reshape(gl.permute(gl.reshape(v, [ROWS, 4, 8, 4]), (0, 2, 3, 1)), [ROWS, 8, 4, 2, 2])
    a, b = gl.split(t)  # chunk 2i + 0 / 2i + 1
    c0, c2 = gl.split(a)
    c1, c3 = gl.split(b)
    return c0, c1, c2, c3


@gluon.jit
def _a_operand(wc, sc, rt, st, ROWS: gl.constexpr, AOP: gl.constexpr, RAW: gl.constexpr = False,
               FRAG: gl.constexpr = 0):
    """One chunk's words [ROWS, 8, 4] and scale pairs (same shape) -> the wgmma A operand
    [ROWS, 64] bf16: lane t's pair of every word, q * s * 2^-J (exact). RAW (the DIAG config, timing only):
    the words themselves as the pairs, no decode and no scale (wrong values, the same data flow), ANDed with
    0x3F3F3F3F so every value is finite (an engine run on them samples from finite logits)."""
    if FRAG:  # wc: [ROWS, 32] bytes of fragment words, sc: their pairs' scales (FRAG 2: scale pairs)
        p = frag_decode(wc, sc, FRAG == 2)
    elif RAW:
        p = gl.reshape(wc & 0x3F3F3F3F, [ROWS, 32])
    else:
        p = gl.reshape(_mul2((_rotr_v(wc, rt) & _MAG) | (_rotr_v(wc, st) & _SIGN), sc), [ROWS, 32])
    return _pairs_to_aop(p, ROWS, AOP)  # pair 4c + t = K (8c + 2t, 8c + 2t + 1)


@gluon.jit
def _pairs_to_aop(p, ROWS: gl.constexpr, AOP: gl.constexpr):
    """A chunk's pairs [ROWS, 32] (bf16x2 bits, pair P = K 2P, 2P + 1) -> the wgmma A operand [ROWS, 64]."""
    q = p.to(gl.int32, bitcast=True)
    lo = (q & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (q >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [ROWS, 64]), AOP, assert_trivial=True)


@gluon.jit
def _step(acc, kk, k0, w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, zw, r0, r1, r2, r3, s0_, s1_, s2_,
          s3_, exp_bias, NSW: gl.constexpr, NSX: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr,
          ROWS: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr, LW3: gl.constexpr, AOP: gl.constexpr,
          KP: gl.constexpr = 1):
    """One 256-K step: read and release the weight stage, then per 64-K chunk decode into the A
    operand, issue the async wgmma and retire the previous chunk's; the previous step's activation
    stage is released once its last wgmma retired (after this step's first wait). With KP MMA
    warpgroups on alternate steps, this warpgroup's previous step is i - KP. FMT 4 / 5 (FRAG): the stage
    holds fragment-ordered words (layout.py) and LW2 / LS3 / LW3 are frag_layouts' LB2 / L3S / LP."""
    FRAG: gl.constexpr = FMT >= 4
    i = kk - k0
    iw = i % NSW
    mbarrier.wait(w_ready.index(iw), (i // NSW) & 1)
    if FRAG:
        w2, s2d = frag_stage(w_bufs, s_bufs, iw, ROWS, LW2, LS3)
    elif FMT == 1:  # mxfp4: the stage's [32 R, 16] scale rows are the [64 R, 8] E8M0 bytes
        w2 = w_bufs.index(iw).load(LW2)
        s2d = s_bufs.index(iw)._reinterpret(gl.uint8, [ROWS, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(
            gl.SliceLayout(2, LS3))
    else:
        w2 = w_bufs.index(iw).load(LW2)
        s2d = s_bufs.index(iw).load(gl.SliceLayout(2, LS3))
    fence_async_shared()  # the generic reads are done before TMA (async proxy) refills the stage
    if XREL:  # drain the previous step's last wgmma here (behind this step's wait and loads) and release
        # its activation stage beside this weight stage: three CTA barriers per step instead of four
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(w_empty.index(iw), count=1)
        mbarrier.arrive(x_empty.index((i + NSX - KP) % NSX), count=1, pred=i >= KP)
    else:
        mbarrier.arrive(w_empty.index(iw), count=1)
    RAW: gl.constexpr = FMT == 3  # DIAG: no decode (timing only)
    if FRAG:  # the four chunks' words and multipliers (w4a16_frag)
        w0, w1, w2c, w3c, c0, c1, c2, c3 = frag_prep(w2, s2d, ROWS, FMT, LS3, LW3)
    else:
        w3 = gl.expand_dims(gl.convert_layout(w2, gl.SliceLayout(2, LW3), assert_trivial=True), 2).to(
            gl.uint32, bitcast=True) + zw
        if FMT == 2 or FMT == 3:  # all scales normal (prepare: scale_bits): bf16 bits (b << 4) + 0x7700
            s16 = (s2d.to(gl.uint8, bitcast=True).to(gl.uint32) << 4) + 0x7700
        elif FMT == 1:  # mxfp4: 2^(e - 127 + J), J the layer's exponent offset (w4a16_wgmma's conversion)
            s16 = gl.exp2(s2d.to(gl.float32) + (exp_bias - 127).to(gl.float32)).to(gl.bfloat16).to(
                gl.uint16, bitcast=True).to(gl.uint32)
        else:
            s16 = (s2d.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _SCALE_MUL).to(gl.bfloat16).to(
                gl.uint16, bitcast=True).to(gl.uint32)
        WPS: gl.constexpr = 4 if FMT == 1 else 2  # words per scale
        sp = gl.reshape(gl.expand_dims(s16 * 0x10001, 2) + gl.zeros([ROWS, 32 // WPS, WPS], gl.uint32, LS3),
                        [ROWS, 32])
        s3 = gl.expand_dims(gl.convert_layout(sp, gl.SliceLayout(2, LW3), assert_trivial=True), 2) + zw
        w0, w1, w2c, w3c = _chunks(w3, ROWS)
        c0, c1, c2, c3 = _chunks(s3, ROWS)
    ix = i % NSX
    mbarrier.wait(x_ready.index(ix), (i // NSX) & 1)
    FRAG2: gl.constexpr = 2 if FMT == 5 and FRAG_SCALE_PAIRS else FRAG  # _a_operand's decode
    a = _a_operand(w0, c0, r0, s0_, ROWS, AOP, RAW, FRAG2)
    acc = warpgroup_mma(a, x_bufs.index(4 * ix + 0).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    if not XREL:  # the previous step's last wgmma has retired: its activation stage is free
        mbarrier.arrive(x_empty.index((i + NSX - KP) % NSX), count=1, pred=i >= KP)
    a = _a_operand(w1, c1, r1, s1_, ROWS, AOP, RAW, FRAG2)
    acc = warpgroup_mma(a, x_bufs.index(4 * ix + 1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    a = _a_operand(w2c, c2, r2, s2_, ROWS, AOP, RAW, FRAG2)
    acc = warpgroup_mma(a, x_bufs.index(4 * ix + 2).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    a = _a_operand(w3c, c3, r3, s3_, ROWS, AOP, RAW, FRAG2)
    acc = warpgroup_mma(a, x_bufs.index(4 * ix + 3).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    return acc


@gluon.jit
def _mma_steps(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, k0, k1, exp_bias, NSW: gl.constexpr,
               NSX: gl.constexpr, BM: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr, RT: gl.constexpr,
               ST: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr, LW3: gl.constexpr, ACC: gl.constexpr,
               AOP: gl.constexpr, KP: gl.constexpr, PART: gl.constexpr, num_warps: gl.constexpr):
    """The MMA warpgroups' main loop: steps k0 + PART, k0 + PART + KP, ... < k1 (KP MMA warpgroups
    on alternate steps of one tile, this one number PART), every wgmma retired -> the accumulator."""
    ROWS: gl.constexpr = 16 * num_warps
    if FMT >= 4:  # FRAG: the same shifts for every lane (immediates in the decode)
        zw = 0
        r0, r1, r2, r3, s0_, s1_, s2_, s3_ = 0, 0, 0, 0, 0, 0, 0, 0
    else:
        t1 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, LW3)))
        t3 = gl.expand_dims(gl.expand_dims(t1, 0), 0)  # [1, 1, 4]: the quad lane t
        rt = gl.where(t3 == 0, RT[0], gl.where(t3 == 1, RT[1], gl.where(t3 == 2, RT[2], RT[3]))).to(gl.uint32)
        st = gl.where(t3 == 0, ST[0], gl.where(t3 == 1, ST[1], gl.where(t3 == 2, ST[2], ST[3]))).to(gl.uint32)
        zw = gl.zeros([ROWS, 32, 4], gl.uint32, LW3)
        rt = rt + zw
        st = st + zw
        r0, r1, r2, r3 = _chunks(rt, ROWS)
        s0_, s1_, s2_, s3_ = _chunks(st, ROWS)
    acc = gl.zeros([ROWS, BM], gl.float32, ACC)
    # the first step outside the loop: with a loop that may run zero times, the path that skips it
    # reached the final wait with zeroed accumulator registers and ptxas serialised every wgmma
    # (C7515); the split never makes an empty slice (nor, with KP = 2, one of a single step)
    acc = _step(acc, k0 + PART, k0, w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, zw, r0, r1, r2, r3,
                s0_, s1_, s2_, s3_, exp_bias, NSW, NSX, FMT, XREL, ROWS, LW2, LS3, LW3, AOP, KP)
    for kk in range(k0 + PART + KP, k1, KP):
        acc = _step(acc, kk, k0, w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, zw, r0, r1, r2, r3, s0_,
                    s1_, s2_, s3_, exp_bias, NSW, NSX, FMT, XREL, ROWS, LW2, LS3, LW3, AOP, KP)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _consumer(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, alpha_ptr, bias_ptr, c_ptr, ws_ptr,
              lock_ptr, p, tile, n0, m0, M, N, k0, k1, S, exp_bias, NSW: gl.constexpr, NSX: gl.constexpr,
              BM: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr,
              RT: gl.constexpr, ST: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr, LW3: gl.constexpr,
              ACC: gl.constexpr, AOP: gl.constexpr, num_warps: gl.constexpr):
    acc = _mma_steps(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, k0, k1, exp_bias, NSW, NSX, BM, FMT,
                     XREL, RT, ST, LW2, LS3, LW3, ACC, AOP, 1, 0, num_warps)
    WG._tile_epilogue(acc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, p, tile, n0, m0, M, N, k0, k1, S,
                      16 * num_warps, BM, HAS_BIAS, PDL, num_warps)


@gluon.jit
def _kp_lead(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, red, red_bar, alpha_ptr, bias_ptr, c_ptr,
             ws_ptr, lock_ptr, p, tile, n0, m0, M, N, k0, k1, S, exp_bias, NSW: gl.constexpr, NSX: gl.constexpr,
             BM: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr,
             RT: gl.constexpr, ST: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr, LW3: gl.constexpr,
             ACC: gl.constexpr, AOP: gl.constexpr, num_warps: gl.constexpr):
    """KP = 2, the even steps (default partition): adds the odd steps' accumulator from shared memory
    once it is there, then the epilogue."""
    acc = _mma_steps(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, k0, k1, exp_bias, NSW, NSX, BM, FMT,
                     XREL, RT, ST, LW2, LS3, LW3, ACC, AOP, 2, 0, num_warps)
    mbarrier.wait(red_bar, 0)
    acc = acc + red.load(ACC)
    WG._tile_epilogue(acc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, p, tile, n0, m0, M, N, k0, k1, S,
                      16 * num_warps, BM, HAS_BIAS, PDL, num_warps)


@gluon.jit
def _kp_odd(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, red, red_bar, k0, k1, exp_bias,
            NSW: gl.constexpr, NSX: gl.constexpr, BM: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr,
            RT: gl.constexpr, ST: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr, LW3: gl.constexpr,
            ACC: gl.constexpr, AOP: gl.constexpr):
    """KP = 2, the odd steps (a 4-warp worker partition): its accumulator into shared memory for the
    lead warpgroup (the arrive follows a barrier of this partition's warps, so every store is in)."""
    acc = _mma_steps(w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, k0, k1, exp_bias, NSW, NSX, BM, FMT,
                     XREL, RT, ST, LW2, LS3, LW3, ACC, AOP, 2, 1, 4)
    red.store(acc)
    mbarrier.arrive(red_bar, count=1)


@gluon.jit
def _w_loader(w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, k1, KB, R: gl.constexpr,
              NSW: gl.constexpr):
    """The R row tiles of each step (tile r of the program at TMA row trow0 + (r KB + step) 64)
    into rows [64 r, 64 r + 64) of a weight stage, its scales into SROWS rows of 16 bytes (64 nvfp4,
    32 mxfp4); a tile past the last row block reads as zeros."""
    SROWS: gl.constexpr = s_desc.block_type.shape[0]
    for kk in range(k0, k1):
        i = kk - k0
        iw = i % NSW
        mbarrier.wait(w_empty.index(iw), ((i // NSW) & 1) ^ 1)  # stages start free
        mbarrier.expect(w_ready.index(iw), R * (w_desc.block_type.nbytes + s_desc.block_type.nbytes))
        for r in gl.static_range(R):
            row = trow0 + (r * KB + kk) * 64
            tma.async_copy_global_to_shared(w_desc, [row, 0], w_ready.index(iw), w_bufs.index(iw).slice(64 * r, 64))
            tma.async_copy_global_to_shared(s_desc, [(row // 64) * SROWS, 0], w_ready.index(iw),
                                            s_bufs.index(iw).slice(SROWS * r, SROWS))


@gluon.jit
def _x_loader(x_desc, x_bufs, x_ready, x_empty, m0, k0, k1, NSX: gl.constexpr, PDL: gl.constexpr):
    """The four x chunks [BM, 64] of each step into one activation stage."""
    if PDL:  # x is the previous kernel's output (the weights need no wait)
        _gdc("wait")
    for kk in range(k0, k1):
        i = kk - k0
        ix = i % NSX
        mbarrier.wait(x_empty.index(ix), ((i // NSX) & 1) ^ 1)
        mbarrier.expect(x_ready.index(ix), 4 * x_desc.block_type.nbytes)
        for c in gl.static_range(4):
            tma.async_copy_global_to_shared(x_desc, [m0, kk * 256 + c * 64], x_ready.index(ix),
                                            x_bufs.index(4 * ix + c))


@gluon.jit
def _rwg_kernel(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, M, N, KB, S, MT, exp_bias,
                BM: gl.constexpr, NSW: gl.constexpr, NSX: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr,
                HAS_BIAS: gl.constexpr, PWA: gl.constexpr,
                PDL: gl.constexpr, LOAD_REGS: gl.constexpr, RT: gl.constexpr, ST: gl.constexpr, LW2: gl.constexpr,
                LS3: gl.constexpr, LW3: gl.constexpr, ACC: gl.constexpr, AOP: gl.constexpr, num_warps: gl.constexpr):
    R: gl.constexpr = num_warps // 4
    if PDL:
        _gdc("launch_dependents")
    p, tile, nt, mt, k0, k1 = WG._tile_slice(KB, S, MT)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NSW, 64 * R, 32], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NSW, s_desc.block_type.shape[0] * R, 16], s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [4 * NSX] + x_desc.block_type.shape, x_desc.layout)
    # PWA: each MMA warp frees the stages itself (empty barriers of num_warps arrivals, qerl/kernels/ptx_pwa.py)
    w_ready, w_empty = _ring_barriers(NSW, num_warps if PWA else 1)
    x_ready, x_empty = _ring_barriers(NSX, num_warps if PWA else 1)
    trow0 = nt * R * KB * 64
    gl.warp_specialize([
        (_consumer, (w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, alpha_ptr, bias_ptr, c_ptr, ws_ptr,
                     lock_ptr, p, tile, nt * 64 * R, mt * BM, M, N, k0, k1, S, exp_bias, NSW, NSX, BM, FMT, XREL,
                     HAS_BIAS, PDL, RT, ST, LW2, LS3, LW3, ACC, AOP, num_warps)),
        (_w_loader, (w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, k1, KB, R, NSW)),
        (_x_loader, (x_desc, x_bufs, x_ready, x_empty, mt * BM, k0, k1, NSX, PDL)),
    ], [1, 1], [LOAD_REGS, LOAD_REGS])


@gluon.jit
def _rwg_kp_kernel(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, M, N, KB, S, MT, exp_bias,
                   BM: gl.constexpr, NSW: gl.constexpr, NSX: gl.constexpr, FMT: gl.constexpr, XREL: gl.constexpr,
                   HAS_BIAS: gl.constexpr, PDL: gl.constexpr, LOAD_REGS: gl.constexpr,
                   MMA_REGS: gl.constexpr, RT: gl.constexpr, ST: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr,
                   LW3: gl.constexpr, ACC: gl.constexpr, AOP: gl.constexpr, num_warps: gl.constexpr):
    """_rwg_kernel's R = 1 tile with two MMA warpgroups on alternate 256-K steps (KP = 2): twice the
    warps decoding one tile, one weight ring, and the K split summed in shared memory instead of
    through the workspace (slices of >= 2 steps, forward() sees to it). The even steps' warpgroup
    (default partition) ends with the tile's epilogue."""
    if PDL:
        _gdc("launch_dependents")
    p, tile, nt, mt, k0, k1 = WG._tile_slice(KB, S, MT)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NSW, 64, 32], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NSW, s_desc.block_type.shape[0], 16], s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [4 * NSX] + x_desc.block_type.shape, x_desc.layout)
    red = gl.allocate_shared_memory(gl.float32, [64, BM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    w_ready, w_empty = _ring_barriers(NSW)
    x_ready, x_empty = _ring_barriers(NSX)
    red_bar, _unused = _ring_barriers(1)
    gl.warp_specialize([
        (_kp_lead, (w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, red, red_bar.index(0), alpha_ptr,
                    bias_ptr, c_ptr, ws_ptr, lock_ptr, p, tile, nt * 64, mt * BM, M, N, k0, k1, S, exp_bias, NSW, NSX,
                    BM, FMT, XREL, HAS_BIAS, PDL, RT, ST, LW2, LS3, LW3, ACC, AOP, num_warps)),
        (_kp_odd, (w_bufs, s_bufs, x_bufs, w_ready, w_empty, x_ready, x_empty, red, red_bar.index(0), k0, k1, exp_bias,
                   NSW, NSX, BM, FMT, XREL, RT, ST, LW2, LS3, LW3, ACC, AOP)),
        (_w_loader, (w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, nt * KB * 64, k0, k1, KB, 1, NSW)),
        (_x_loader, (x_desc, x_bufs, x_ready, x_empty, mt * BM, k0, k1, NSX, PDL)),
    ], [4, 1, 1], [MMA_REGS, LOAD_REGS, LOAD_REGS])


def kernel_for(kp) -> object:
    """The rwg kernel a config's KP selects: _rwg_kp_kernel for 2, else _rwg_kernel."""
    return _rwg_kp_kernel if int(kp) == 2 else _rwg_kernel


DEFAULT = dict(BM=None, R=2, NSW=4, NSX=3, XREL=0, LOAD_REGS=24, PER_SM=None, maxnreg=None, PDL=None, S=None, PWA=None,
               KP=1, MMA_REGS=160, DIAG=0, FRAG=0, XROWS=None)
# XROWS for launches whose config leaves it unset (None): 1 reads a last token tile's rows past M from x's storage
# where it holds them (decode_ops.ROW_TILE makes the decode step's GEMM inputs so; the default since session 79);
# 0 zero-fills them. Where x's storage ends at row M (w4a16_wgmma.rows_in_storage) the box is zero-filled either way.
XROWS = env_int("QERL_W4A16_RWG_XROWS", 1)
# Per-warp release of the weight and activation stages (qerl/kernels/ptx_pwa.py): no CTA barrier in
# the MMA loop. Config key PWA overrides per call (None: this switch). Decode steps (a64, H100, same
# process): 7B at 32 / 64 rows +1.1% / +0.5%. NOTES_w4a16.md section 22.
PER_WARP_ARRIVE = True
_RESIDENT: dict = {}


def smem_bytes(bm: int, r: int, nsw: int, nsx: int, kp: int = 1) -> int:
    """Shared memory of the rings (nvfp4's, the larger scale tile): R raw weight tiles per stage, four
    x chunks per stage (+ barriers); with KP = 2 also the odd steps' fp32 accumulator."""
    return nsw * r * (8192 + 1024) + nsx * 4 * bm * 128 + 1024 + (64 * bm * 4 if kp > 1 else 0)


@functools.lru_cache(maxsize=256)
def _kernel_args(fmt: str, m: int, items: tuple, pdl_default: bool, pwa_default: bool) -> tuple[dict, dict]:
    cfg = dict(DEFAULT)
    # path keys and the other kernels' launch modifiers are ignored
    unknown = {key for key, _ in items} - set(DEFAULT) - W._PATH_KEYS - W._MOD_KEYS
    if unknown:
        raise ValueError(f"unknown rwg config keys {sorted(unknown)}; known: {sorted(DEFAULT)}")
    cfg.update({key: v for key, v in items if key in DEFAULT})
    bm = int(cfg["BM"] or (16 if m <= 16 else 32 if m <= 32 else 64))
    r, nsw, nsx, kp = int(cfg["R"]), int(cfg["NSW"]), int(cfg["NSX"]), int(cfg["KP"])
    if bm not in (16, 32, 64, 128) or r not in (1, 2) or nsw < 1 or nsx < 1:
        # (R = 4 compiles but spills at the 16-warp register cap and overruns shared memory)
        raise ValueError(f"rwg needs BM in (16, 32, 64, 128), R in (1, 2), NSW, NSX >= 1; got {bm}, {r}, {nsw}, "
                         f"{nsx}")
    if kp not in (1, 2) or (kp == 2 and (r != 1 or nsw % 2 or nsx % 2)):
        # each ring stage must belong to one MMA warpgroup: with an odd ring a warpgroup can reach a stage two
        # phases ahead of its last wait there, and mbarrier.try_wait.parity passes at once on such a phase
        raise ValueError(f"rwg needs KP in (1, 2), and with KP = 2 R = 1 and even NSW, NSX; got KP {kp}, R {r}, "
                         f"NSW {nsw}, NSX {nsx}")
    if kp == 2 and min(nsw, nsx) < 4:
        # untested below 4 stages, and NSW = NSX = 2 (two programs per SM on FRAG words) gave NaN outputs in 3 of 48
        # cells on the H100 (session 72, NOTES_w4a16.md section 47): refused until understood
        raise ValueError(f"rwg KP = 2 needs NSW, NSX >= 4 (rings of 2 gave NaN outputs); got NSW {nsw}, NSX {nsx}")
    if smem_bytes(bm, r, nsw, nsx, kp) > 232448:
        raise ValueError(f"rwg rings need {smem_bytes(bm, r, nsw, nsx, kp)} B of shared memory (H100: 232448)")
    cfg["PDL"] = bool(pdl_default if cfg["PDL"] is None else cfg["PDL"])
    lw2, ls3, lw3, acc, aop = layouts(r, bm, fmt)
    rot_mag, rot_sign = lane_rotations()
    pwa = int(bool(pwa_default if cfg["PWA"] is None else cfg["PWA"]))
    consts = dict(BM=bm, NSW=nsw, NSX=nsx, FMT=0 if fmt == "nvfp4" else 1, XREL=int(bool(cfg["XREL"])), PDL=cfg["PDL"],
                  PWA=pwa,
                  LOAD_REGS=int(cfg["LOAD_REGS"]), RT=rot_mag, ST=rot_sign, LW2=lw2, LS3=ls3, LW3=lw3, ACC=acc,
                  AOP=aop, num_warps=4 * r)
    if cfg["DIAG"]:  # timing only: the MMA warps skip the decode (FMT 3, nvfp4's stage layout): wrong outputs
        if fmt != "nvfp4":
            raise ValueError("rwg DIAG (no decode) is built on nvfp4's stages only")
        consts["FMT"] = 3
    if cfg["FRAG"]:  # fragment-ordered words (layout.py; a second copy of the weights, benchmark only so far)
        if fmt != "nvfp4" or cfg["DIAG"]:
            raise ValueError("rwg FRAG (fragment-ordered words) is built for nvfp4 only, and not with DIAG")
        lb2, l3s, lp, acc, aop = frag_layouts(r, bm)
        consts.update(FMT=4, LW2=lb2, LS3=l3s, LW3=lp, ACC=acc, AOP=aop)
    if kp == 2:  # _rwg_kp_kernel: the odd steps' partition gets MMA_REGS; no per-warp release (ptx_pwa's
        # rewrite knows one MMA partition per kernel)
        consts["MMA_REGS"] = int(cfg["MMA_REGS"])
        del consts["PWA"]
    return consts, cfg


def kernel_args(m: int, config: dict | None = None, fmt: str = "nvfp4") -> tuple[dict, dict]:
    """(constexpr arguments of _rwg_kernel, the resolved config); memoised, shared read-only."""
    return _kernel_args(fmt, m, tuple(sorted((config or {}).items())), W.PDL, PER_WARP_ARRIVE)


def forward(x: torch.Tensor, state: dict, bias=None, out=None, config: dict | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [M, K] bf16 (M <= BM tokens per tile; larger M runs
    several token tiles) and an nvfp4 / mxfp4 `state` (qerl.kernels.prepare).

    config: BM (tokens per tile: 16, 32, 64, 128; default the smallest of 16 / 32 / 64 that holds M,
    else 64; 128 only when asked), R (64-row tiles per program: 1 or 2, one MMA warpgroup each), NSW
    (weight stages), NSX (activation stages), XREL (0 / 1: where the activation stage is released, see
    the module doc), LOAD_REGS (setmaxnreg of the loader warps), S (forced K slices), PER_SM, maxnreg,
    PDL, PWA (per-warp stage release, qerl/kernels/ptx_pwa.py; None: PER_WARP_ARRIVE), KP (1, or 2 with R = 1:
    two MMA warpgroups on alternate 256-K steps of one tile, _rwg_kp_kernel; slices of >= 2 steps), MMA_REGS
    (KP = 2: setmaxnreg of the odd steps' warpgroup), DIAG (1: no decode, timing only, wrong outputs: what the
    decode's instructions cost a step; nvfp4), XROWS (1: where M is not a multiple of BM and x's storage holds
    the last tile's rows past M, e.g. x = buf[:M] of a longer buffer, the activation box reads them instead of
    zero-filling; a test of what out-of-bounds rows cost, NOTES_w4a16.md section 53)."""
    x = WG.checked_input(x, state, "rwg")
    fmt, n, kb, m = state["fmt"], state["n"], state["kb"], x.shape[0]
    if layout.is_frag(state):  # the layer's words are fragment-ordered: FRAG reads them as they are
        if config is not None and "FRAG" in config and not config["FRAG"]:
            raise ValueError("rwg FRAG=0 reads rows-ordered words; this layer was prepared with order='frag'")
        config = dict(config or {}, FRAG=1)
    consts, cfg = kernel_args(m, config, fmt)
    kp = int(cfg["KP"])
    if kp == 2 and kb < 2:  # two warpgroups on alternate steps need two steps per slice
        consts, cfg, kp = *kernel_args(m, dict(config or {}, KP=1), fmt), 1
    if consts["FMT"] in WG.SCALE_BITS_FMT and WG.SCALE_BITS and state.get("scale_bits", False):
        consts = dict(consts, FMT=WG.SCALE_BITS_FMT[consts["FMT"]])
    bm, rows = consts["BM"], consts["num_warps"] * 16
    nt, mt = triton.cdiv(n, rows), triton.cdiv(m, bm)
    tiles = nt * mt
    key = (bm, rows, consts["NSW"], consts["NSX"], consts["XREL"], consts["PDL"], cfg["maxnreg"], consts.get("PWA"), kp)
    # (the KP = 2 kernel's 12 warps at ~168 registers fit one program per SM)
    per_sm = cfg["PER_SM"] or _RESIDENT.get(key) or max(1, min(2 if kp == 1 else 1, 232448 // smem_bytes(
        bm, rows // 64, consts["NSW"], consts["NSX"], kp)))
    if cfg.get("S") is not None:
        s = max(1, min(int(cfg["S"]), kb))
    else:
        s = WG.split(tiles, kb, int(per_sm) * W._num_sms(x.device.index or 0))
    if kp == 2:
        s = min(s, kb // 2)
    x_tma = x
    # XROWS: the last token tile's rows past M from x's storage, where it has them
    if (XROWS if cfg["XROWS"] is None else cfg["XROWS"]) and m % bm:
        x_tma = WG.rows_in_storage(x, mt * bm)
        x_tma = x if x_tma is None else x_tma
    x_desc, w_desc, s_desc = WG.descriptors(x_tma, state, bm)
    if consts["FMT"] >= 4:
        w_desc = frag_descriptor(state)
    c, locks, ws = WG.launch_buffers(x, state, out, tiles, s, rows * bm)
    extra = {} if cfg["maxnreg"] is None else {"maxnreg": int(cfg["maxnreg"])}
    kernel = kernel_for(kp)[(tiles * s,)](
        x_desc, w_desc, s_desc, state["alpha"], bias if bias is not None else c, c, ws, locks, m, n, kb, s, mt,
        int(state.get("exp_bias", 0)), HAS_BIAS=bias is not None, launch_pdl=consts["PDL"], **consts, **extra,
    )
    if key not in _RESIDENT:
        _RESIDENT[key] = WG._resident(kernel, consts["num_warps"]) or per_sm
        if (_RESIDENT[key] != per_sm and cfg["PER_SM"] is None and cfg.get("S") is None and kp == 1
                and WG.split(tiles, kb, int(_RESIDENT[key]) * W._num_sms(x.device.index or 0)) != s
                and not torch.cuda.is_current_stream_capturing()):
            # this key's first launch split K by a guessed occupancy; once more with the measured one, so the
            # first launch sums K in the same slices as every later launch (bit-identical outputs)
            return forward(x, state, bias=bias, out=out, config=config)
    return c if out is None or c is out else out.copy_(c)


def frag_descriptor(state: dict):
    """The TMA descriptor of the layer's fragment-ordered words (no swizzle: the kernel reads them as
    16-byte rows): a "frag" state's own words, or for a "rows" state a fragment-ordered copy built with
    the words on first use and kept in the state (memory: a second copy; benchmark only)."""
    found = state.get("_frag")
    words = state["words"]
    key = (words.data_ptr(), words.numel())  # (a sub-state slicing a fused layer's rows has its own)
    if found is not None and found[0] == key:
        return found[2]
    if layout.is_frag(state):
        frag = words
    else:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("rwg FRAG: the layer's fragment-ordered copy is built on its first eager call, not "
                               "inside a CUDA graph capture; run the shape once eagerly first")
        frag = layout.tiles_to_frag_tiles(words)
    desc = TensorDescriptor.from_tensor(frag.view(-1, 32), [64, 32], FRAG_SMEM)
    state["_frag"] = (key, frag, desc)
    return desc


def compile_offline(m: int = 64, n: int = 7168, k: int = 5120, config: dict | None = None, bias: bool = False,
                    sbits: bool = False, fmt: str = "nvfp4"):
    """Compile for sm_90a without a GPU (ptxas included) -> triton CompiledKernel."""
    consts, cfg = kernel_args(m, config, fmt)
    return WG.compile_gemm_offline(kernel_for(cfg["KP"]), fmt, m, n, k, consts, cfg, bias, sbits,
                                   FRAG_SMEM if consts["FMT"] >= 4 else None)
