"""Warp-specialised fused 4-bit GEMM for Hopper (Gluon): y[M, N] = x[M, K] @ dequant(W)[N, K]^T.

nvfp4 and mxfp4 weights in the tiled kernel layout (layout.py), bf16 activations, fp32
accumulation on the tensor cores (async wgmma), bf16 out. The default on Hopper for
65 <= M < 512 (w4a16_triton.WGMMA_MIN_M), where the Triton kernel makes decoding and the tensor
cores take turns inside each program (M = 256 at 0.59x of bf16 there, 0.93x here; NOTES_w4a16.md
section 13), and for 512 <= M < 2048 on layers whose tiles fill the SMs
(w4a16_triton._large_m_wgmma; there with BN = 128, section 14). Here the three jobs run in
separate warps of one program (64 weight rows x BM tokens) and overlap:

- loaders (two 1-warp partitions): TMA copies of the packed weight tiles (64 rows x 256 K: 8 KB
  of words + 1 KB / 512 B of scales) into a ring of NSW stages, and of the activation chunks
  x[m0 : m0 + BM, 64-wide K chunk] (bf16, 128-byte swizzle) into a ring of NSX stages. Separate
  warps, so the weight stream runs ahead of the activations.
- decoder (one partition of DW = 4 or 8 warps): waits for a weight stage, reads it into
  registers (ldmatrix), frees it, decodes each 64-K chunk with the exact packed bf16x2 decode of
  w4a16_triton (P0..P3 = q * s * 2^-J) and stores the bf16 chunk [64, 64] into a ring of NSD
  decoded stages of CPS chunks each, in the wgmma operand layout (NVMMA 128-byte swizzle), one
  16-byte store per word: a word holds K = 8c .. 8c+7 as the pairs P0 = (0, 1), P2 = (2, 3),
  P1 = (4, 5), P3 = (6, 7), so the four registers joined in that order are the word's 8 weights
  in natural K order. One proxy fence and one mbarrier arrive per decoded stage.
- default partition (one warpgroup): per chunk, waits for its decoded stage and an activation
  stage and issues `acc[64, BM] += W_chunk[64, 64] @ x_chunk[BM, 64]^T` as an async wgmma (A =
  the decoded weights, B = the activations, K-major), keeps LAG in flight, and frees the stages
  of the chunk that retired. Then the epilogue.

BN = 128 (the large-M form): two MMA warpgroups and two 64-row weight tiles per program, decoded
into the two row halves of each decoded stage, so each activation chunk read from L2 feeds twice
the weight rows. At BM = 256 it needs LOADS = 1: the MMA warps issue the TMA copies themselves
(x chunk r + NSX once chunk r retired, the raw tiles NSW ahead once a step retired) and the loader
warps go, because 8 MMA + 4 decoder + loader warps make 16 warps, where ptxas caps every thread at
128 registers and the [128, 256] accumulator needs more. The 16-warp form (BM <= 128, loader
warps) gave wrong results until the decoder fenced its raw-ring releases (NOTES_w4a16.md
sections 14-15); it is correct now, and slower than BM = 256 with LOADS at M = 256 / 1024.

Decoder register layouts (4 warps, a [64 rows, 32 words] tile): lane (row bits 1-2, word bits
0-2), warp (row bits 0 and 3), registers (row bits 4-5 and word bits 3-4 = the chunk). Every
thread thus holds one word of each 64-K chunk for 4 rows, so a chunk is split off in registers;
rows 2 apart share a warp instruction, which keeps the 4-byte reads of the swizzled tile free of
bank conflicts. The scale of a word is loaded into the lanes of its words (zero lane bases in
the layout) so the multiply broadcasts without data movement (checked at compile time with
convert_layout(assert_trivial=True)).

Schedule: program p owns output tile p // S (64 weight rows x BM tokens; tokens vary fastest so
programs on the same weight rows run together) and reduction steps [j*KB//S, (j+1)*KB//S),
j = p % S. A tile split over several programs goes through an fp32 workspace and a per-tile
counter; the last arrival sums the partials in program order (deterministic) and writes bf16.
One launch, no host sync, CUDA-graph capturable. `benchmarks/compile_gluon.py --kernel wgmma`
compiles it offline for sm_90a.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from qerl.kernels import layout
from qerl.kernels import w4a16_triton as W
from qerl.kernels.w4a16_triton import _KA, _KM, _KS, _R1, _R2, _R3, _S0, _S3  # the bit layout (layout.py)
from qerl.kernels.w4a16_frag import FRAG_SCALE_PAIRS, FRAG_SMEM, frag_decode, frag_layouts, frag_prep, frag_stage
from qerl.kernels.w4a16_ws import _gdc, _mul2, _ring_barriers, _rotr

_NVFP4_SCALE_MUL = gl.constexpr(3.3230699894622897e35)  # 2^118: FP8-E4M3 scale times 2^(126 - J), J = 8
# nvfp4 layers whose scales are all normal (prepare's `scale_bits`) convert them to the bf16
# multiplier by integer arithmetic (FMT = 2, bit-identical there); False: the float conversion (A/B)
SCALE_BITS = True


def decoder_layouts(fmt: str, dw: int = 4):
    """(L2W, L2S, L3) of the decoder's dw warps (4 or 8): the [64, 32] word tile, the [64, SPT]
    scale tile (SPT = 16 nvfp4, 8 mxfp4) and one chunk's words as [64, SPC, WPS] (SPC scales per
    64-K chunk, WPS words per scale), word t = WPS * u + e of the chunk. 8 warps take row bit 4
    from the registers (two rows per thread instead of four)."""
    rows_r = [[16, 0], [32, 0]] if dw == 4 else [[32, 0]]
    warps = [[1, 0], [8, 0]] + ([] if dw == 4 else [[16, 0]])
    l2w = gl.DistributedLinearLayout([[0, 8], [0, 16]] + rows_r, [[0, 1], [0, 2], [0, 4], [2, 0], [4, 0]], warps, [],
                                     [64, 32])
    if fmt == "nvfp4":  # scale g = 4c + t // 2
        l2s = gl.DistributedLinearLayout([[0, 4], [0, 8]] + rows_r,
                                         [[0, 0], [0, 1], [0, 2], [2, 0], [4, 0]], warps, [], [64, 16])
        lanes3 = [[0, 0, 1], [0, 1, 0], [0, 2, 0], [2, 0, 0], [4, 0, 0]]
        shape3 = [64, 4, 2]
    else:  # mxfp4: scale g = 2c + t // 4
        l2s = gl.DistributedLinearLayout([[0, 2], [0, 4]] + rows_r,
                                         [[0, 0], [0, 0], [0, 1], [2, 0], [4, 0]], warps, [], [64, 8])
        lanes3 = [[0, 0, 1], [0, 0, 2], [0, 1, 0], [2, 0, 0], [4, 0, 0]]
        shape3 = [64, 2, 4]
    l3 = gl.DistributedLinearLayout([r + [0] for r in rows_r], lanes3, [w + [0] for w in warps], [], shape3)
    return l2w, l2s, l3


@gluon.jit
def _quarters(v, X: gl.constexpr):
    """[64, 4 * X] with the chunk c = column // X held in registers -> the four chunks [64, X]."""
    t = gl.reshape(gl.permute(gl.reshape(v, [64, 4, X]), (0, 2, 1)), [64, X, 2, 2])
    a, b = gl.split(t)  # c = 2 i + 0 / 2 i + 1
    c0, c2 = gl.split(a)
    c1, c3 = gl.split(b)
    return c0, c1, c2, c3


@gluon.jit
def _decode_chunk(wc, sc, exp_bias, FMT: gl.constexpr, L3: gl.constexpr):
    """One row tile's chunk: words [64, 8] + raw scales [64, SPC] -> [64, 32] int32, the 64 bf16
    weights of each row in natural K order (two per int32). FMT 4 / 5: fragment-ordered words and their pairs'
    multipliers from w4a16_frag.frag_prep (already converted), decoded by w4a16_frag.frag_decode."""
    if FMT >= 4:
        v = frag_decode(wc, sc, FMT == 5 and FRAG_SCALE_PAIRS).to(gl.int32, bitcast=True)
    else:
        SPC: gl.constexpr = L3.shape[1]
        WPS: gl.constexpr = L3.shape[2]
        words = gl.convert_layout(gl.reshape(wc, [64, SPC, WPS]), L3, assert_trivial=True).to(gl.uint32, bitcast=True)
        sraw = gl.convert_layout(sc, gl.SliceLayout(2, L3), assert_trivial=True)
        if FMT == 2:  # nvfp4 whose scales are all normal (prepare: scale_bits): bf16 bits (b << 4) + 0x7700
            s16 = (sraw.to(gl.uint8, bitcast=True).to(gl.uint32) << 4) + 0x7700
        else:
            if FMT == 0:
                s = (sraw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _NVFP4_SCALE_MUL).to(gl.bfloat16)
            else:
                s = gl.exp2(sraw.to(gl.float32) + (exp_bias - 127).to(gl.float32)).to(gl.bfloat16)
            s16 = s.to(gl.uint16, bitcast=True).to(gl.uint32)
        s2 = gl.expand_dims(s16 | (s16 << 16), 2)  # the scale in both halves, broadcast over its words
        p0 = _mul2((words & _KM) | (_rotr(words, _S0) & _KS), s2)
        p1 = _mul2(_rotr(words, _R1) & _KA, s2)
        p2 = _mul2(_rotr(words, _R2) & _KA, s2)
        p3 = _mul2((_rotr(words, _R3) & _KM) | (_rotr(words, _S3) & _KS), s2)
        v = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [64, SPC, WPS, 2, 2]: flat order P0, P2, P1, P3
        v = gl.reshape(v, [64, 32]).to(gl.int32, bitcast=True)
    return v


@gluon.jit
def _load_tile(w_bufs, s_bufs, idx, L2W: gl.constexpr, L2S: gl.constexpr, FMT: gl.constexpr, L3: gl.constexpr):
    """A stage's row tile -> its four chunks of words [64, 8] and raw scales [64, SPC]. FMT 4 / 5 (fragment-ordered
    words; L2W, L2S, L3 = frag_layouts' LB2, L3S, LP): the four chunks' words and multipliers of frag_prep."""
    if FMT >= 4:
        fw, fs = frag_stage(w_bufs, s_bufs, idx, 64, L2W, L2S)
        w0, w1, w2, w3, s0, s1, s2, s3 = frag_prep(fw, fs, 64, FMT, L2S, L3)
    else:
        words = w_bufs.index(idx).load(L2W)
        if FMT != 1:  # nvfp4
            sraw = s_bufs.index(idx).load(L2S)
        else:  # mxfp4: the 512-byte scale tile was copied as [32, 16] (TMA needs 16-byte rows)
            sraw = s_bufs.index(idx)._reinterpret(gl.uint8, [64, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(
                L2S)
        w0, w1, w2, w3 = _quarters(words, 8)
        s0, s1, s2, s3 = _quarters(sraw, L2S.shape[1] // 4)
    return w0, w1, w2, w3, s0, s1, s2, s3


@gluon.jit
def _put(d32, slot, v):
    d32.index(slot).store(v)


@gluon.jit
def _publish(d_ready, stage):
    fence_async_shared()  # generic-proxy stores -> visible to the wgmma (async proxy)
    mbarrier.arrive(d_ready.index(stage), count=1)


@gluon.jit
def _decoder(w_bufs, s_bufs, d_bufs, w_ready, w_empty, d_ready, d_empty, exp_bias, k0, k1,
             NSW: gl.constexpr, NSD: gl.constexpr, CPS: gl.constexpr, FMT: gl.constexpr, R: gl.constexpr,
             L2W: gl.constexpr, L2S: gl.constexpr, L3: gl.constexpr):
    """Per weight step: read the raw stage, free it, decode its four 64-K chunks and publish them
    in decoded stages of CPS chunks (one fence and one mbarrier arrive per decoded stage).
    R = 2 (128 weight rows per program): a step is two raw stages, one per 64-row tile, decoded
    into the two row halves of the same decoded stages."""
    d32 = d_bufs._reinterpret(gl.int32, [NSD * CPS, 64 * R, 32], gl.NVMMASharedLayout(128, 32))
    G: gl.constexpr = 4 // CPS  # decoded stages per weight step
    if R > 1:
        _decoder_rows(d32, w_bufs, s_bufs, w_ready, w_empty, d_ready, d_empty, exp_bias, k0, k1, NSW, NSD, CPS,
                      FMT, R, L2W, L2S, L3)
    else:
        for kk in range(k0, k1):
            i = kk - k0
            iw = i % NSW
            mbarrier.wait(w_ready.index(iw), (i // NSW) & 1)
            w0, w1, w2, w3, s0, s1, s2, s3 = _load_tile(w_bufs, s_bufs, iw, L2W, L2S, FMT, L3)
            fence_async_shared()  # the generic reads of the stage are done before TMA (async proxy) refills it
            mbarrier.arrive(w_empty.index(iw), count=1)  # the raw stage is in registers now
            v0 = _decode_chunk(w0, s0, exp_bias, FMT, L3)
            v1 = _decode_chunk(w1, s1, exp_bias, FMT, L3)
            q = i * G
            st = q % NSD
            mbarrier.wait(d_empty.index(st), ((q // NSD) & 1) ^ 1)  # stages start free
            _put(d32, st * CPS, v0)
            if CPS == 1:
                _publish(d_ready, st)
                st = (q + 1) % NSD
                mbarrier.wait(d_empty.index(st), (((q + 1) // NSD) & 1) ^ 1)
                _put(d32, st, v1)
                _publish(d_ready, st)
            else:
                _put(d32, st * CPS + 1, v1)
            v2 = _decode_chunk(w2, s2, exp_bias, FMT, L3)
            v3 = _decode_chunk(w3, s3, exp_bias, FMT, L3)
            if CPS == 4:
                _put(d32, st * 4 + 2, v2)
                _put(d32, st * 4 + 3, v3)
                _publish(d_ready, st)
            else:
                if CPS == 2:
                    _publish(d_ready, st)
                q2 = q + 2 // CPS  # the stage of chunk 2 (and 3 when CPS == 2)
                st = q2 % NSD
                mbarrier.wait(d_empty.index(st), ((q2 // NSD) & 1) ^ 1)
                _put(d32, st * CPS, v2)
                if CPS == 2:
                    _put(d32, st * 2 + 1, v3)
                    _publish(d_ready, st)
                else:
                    _publish(d_ready, st)
                    st = (q2 + 1) % NSD
                    mbarrier.wait(d_empty.index(st), (((q2 + 1) // NSD) & 1) ^ 1)
                    _put(d32, st, v3)
                    _publish(d_ready, st)


@gluon.jit
def _decoder_rows(d32, w_bufs, s_bufs, w_ready, w_empty, d_ready, d_empty, exp_bias, k0, k1,
                  NSW: gl.constexpr, NSD: gl.constexpr, CPS: gl.constexpr, FMT: gl.constexpr, R: gl.constexpr,
                  L2W: gl.constexpr, L2S: gl.constexpr, L3: gl.constexpr):
    """The decoder for two row tiles per program (R = 2): per weight step, read both raw stages
    into registers and free them, then chunk by chunk decode the two row tiles into rows [0, 64)
    and [64, 128) of the chunk's decoded slot, waiting for a stage just before its first chunk
    and publishing it after its last (as the one-tile decoder does)."""
    gl.static_assert(R == 2, "two row tiles per program")
    for kk in range(k0, k1):
        i = kk - k0
        ia = (2 * i) % NSW
        ib = (2 * i + 1) % NSW
        mbarrier.wait(w_ready.index(ia), ((2 * i) // NSW) & 1)
        a0, a1, a2, a3, sa0, sa1, sa2, sa3 = _load_tile(w_bufs, s_bufs, ia, L2W, L2S, FMT, L3)
        fence_async_shared()  # generic reads before the async-proxy refill (see _decoder)
        mbarrier.arrive(w_empty.index(ia), count=1)
        mbarrier.wait(w_ready.index(ib), ((2 * i + 1) // NSW) & 1)
        b0, b1, b2, b3, sb0, sb1, sb2, sb3 = _load_tile(w_bufs, s_bufs, ib, L2W, L2S, FMT, L3)
        fence_async_shared()
        mbarrier.arrive(w_empty.index(ib), count=1)
        _chunk_rows(d32, d_ready, d_empty, 4 * i + 0, a0, sa0, b0, sb0, exp_bias, NSD, CPS, FMT, L3)
        _chunk_rows(d32, d_ready, d_empty, 4 * i + 1, a1, sa1, b1, sb1, exp_bias, NSD, CPS, FMT, L3)
        _chunk_rows(d32, d_ready, d_empty, 4 * i + 2, a2, sa2, b2, sb2, exp_bias, NSD, CPS, FMT, L3)
        _chunk_rows(d32, d_ready, d_empty, 4 * i + 3, a3, sa3, b3, sb3, exp_bias, NSD, CPS, FMT, L3)


@gluon.jit
def _chunk_rows(d32, d_ready, d_empty, c, wa, sa, wb, sb, exp_bias, NSD: gl.constexpr, CPS: gl.constexpr,
                FMT: gl.constexpr, L3: gl.constexpr):
    """Decoded chunk c (counted from the program's first) of both row tiles into its slot."""
    g = c // CPS
    st = g % NSD
    if c % CPS == 0:
        mbarrier.wait(d_empty.index(st), ((g // NSD) & 1) ^ 1)  # stages start free
    slot = d32.index(st * CPS + c % CPS)
    slot.slice(0, 64).store(_decode_chunk(wa, sa, exp_bias, FMT, L3))
    slot.slice(64, 64).store(_decode_chunk(wb, sb, exp_bias, FMT, L3))
    if c % CPS == CPS - 1:
        _publish(d_ready, st)


@gluon.jit
def _w_issue(w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, KB, i, SROWS: gl.constexpr,
             NSW: gl.constexpr, R: gl.constexpr):
    """Raw tile i of this program (step k0 + i // R, row tile i % R; a row tile past the last one
    reads as zeros: TMA fills out-of-bounds boxes) into ring stage i % NSW, once it is free."""
    iw = i % NSW
    mbarrier.wait(w_empty.index(iw), ((i // NSW) & 1) ^ 1)  # stages start free
    mbarrier.expect(w_ready.index(iw), w_desc.block_type.nbytes + s_desc.block_type.nbytes)
    row = trow0 + ((i % R) * KB + k0 + i // R) * 64
    tma.async_copy_global_to_shared(w_desc, [row, 0], w_ready.index(iw), w_bufs.index(iw))
    tma.async_copy_global_to_shared(s_desc, [(row // 64) * SROWS, 0], w_ready.index(iw), s_bufs.index(iw))


@gluon.jit
def _x_issue(x_desc, x_bufs, x_ready, m0, k0, i, NSX: gl.constexpr):
    """Activation chunk i of this program (K = 64 (4 k0 + i) ...) into ring stage i % NSX."""
    ix = i % NSX
    mbarrier.expect(x_ready.index(ix), x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [m0, (k0 * 4 + i) * 64], x_ready.index(ix), x_bufs.index(ix))


@gluon.jit
def _w_loader(w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, k1, KB, SROWS: gl.constexpr,
              NSW: gl.constexpr, R: gl.constexpr):
    """Raw tiles in the decoder's order: step by step, and within a step the R row tiles."""
    for i in range((k1 - k0) * R):
        _w_issue(w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, KB, i, SROWS, NSW, R)


@gluon.jit
def _x_loader(x_desc, x_bufs, x_ready, x_empty, m0, k0, k1, NSX: gl.constexpr, PDL: gl.constexpr):
    if PDL:  # x is the previous kernel's output (the weights need no wait)
        _gdc("wait")
    for i in range((k1 - k0) * 4):
        mbarrier.wait(x_empty.index(i % NSX), ((i // NSX) & 1) ^ 1)
        _x_issue(x_desc, x_bufs, x_ready, m0, k0, i, NSX)


@gluon.jit
def _mma(d_bufs, x_bufs, d_ready, d_empty, x_ready, x_empty, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr,
         p, tile, n0, m0, M, N, k0, k1, S, x_desc, w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, KB,
         NSD: gl.constexpr, CPS: gl.constexpr, NSX: gl.constexpr, NSW: gl.constexpr, SROWS: gl.constexpr,
         R: gl.constexpr, BM: gl.constexpr, LAG: gl.constexpr, LOADS: gl.constexpr, HAS_BIAS: gl.constexpr,
         PDL: gl.constexpr, num_warps: gl.constexpr):
    """LOADS: this partition also issues the TMA copies (no loader warps): x chunk r + NSX once
    chunk r's wgmma retired, the raw tiles of step s + NSW / R once step s's did (the decoder
    read those stages before it decoded step s, so the empty waits never block)."""
    BN: gl.constexpr = 16 * num_warps  # weight rows: 64 per warpgroup
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    acc = gl.zeros([BN, BM], gl.float32, ACC)
    nq = (k1 - k0) * 4
    if LOADS:
        for t in range(min(NSW, (k1 - k0) * R)):
            _w_issue(w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, KB, t, SROWS, NSW, R)
        if PDL:  # x is the previous kernel's output (the weights need no wait)
            _gdc("wait")
        for t in range(min(NSX, nq)):
            _x_issue(x_desc, x_bufs, x_ready, m0, k0, t, NSX)
    for i in range(nq):
        g = i // CPS
        st = g % NSD
        ix = i % NSX
        if i % CPS == 0:
            mbarrier.wait(d_ready.index(st), (g // NSD) & 1)
        mbarrier.wait(x_ready.index(ix), (i // NSX) & 1)
        acc = warpgroup_mma(d_bufs.index(st * CPS + i % CPS), x_bufs.index(ix).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=LAG, deps=(acc,))
        # the wgmma of chunk i - LAG has retired: its activation stage is free, and its decoded
        # stage too if it was that stage's last chunk
        r = i - LAG
        mbarrier.arrive(d_empty.index(((r + CPS * NSD) // CPS) % NSD), count=1, pred=(r >= 0) & (r % CPS == CPS - 1))
        if LOADS:
            if (r >= 0) & (r + NSX < nq):
                _x_issue(x_desc, x_bufs, x_ready, m0, k0, r + NSX, NSX)
            if (r >= 0) & (r % 4 == 3):
                for j in gl.static_range(R):
                    t = (r // 4) * R + NSW + j
                    if t < (k1 - k0) * R:
                        _w_issue(w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, KB, t, SROWS, NSW, R)
        else:
            mbarrier.arrive(x_empty.index((r + NSX) % NSX), count=1, pred=r >= 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _tile_epilogue(acc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, p, tile, n0, m0, M, N, k0, k1, S, BN, BM,
                   HAS_BIAS, PDL, num_warps)


@gluon.jit
def _tile_epilogue(acc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, p, tile, n0, m0, M, N, k0, k1, S,
                   BN: gl.constexpr, BM: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr,
                   num_warps: gl.constexpr):
    """acc [BN weight rows, BM tokens] of output tile `tile` -> y[m0 + token, n0 + row] (bf16, times
    alpha, plus bias), through the split fixup when S > 1: the partial goes to workspace slot p,
    the last of the tile's S programs sums them in program order (deterministic) and resets the
    tile's counter."""
    # lanes along the weight rows (n), which are contiguous in the output y[M, N]
    LO: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
    part = gl.convert_layout(acc, LO)
    rows = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, LO)), 1)  # [BN, 1]
    cols = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, LO)), 0)  # [1, BM]
    tile_off = cols * BN + rows
    if PDL:  # the output and the workspace only after the previous kernel
        _gdc("wait")
    done = k1 > k0
    if S > 1:
        gl.store(ws_ptr + p * (BN * BM) + tile_off, part)
        gl.thread_barrier()  # every warp's partial is written before the counter moves
        count = gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        done = count == S - 1
        if done:
            part = gl.zeros([BN, BM], gl.float32, LO)
            for r in range(tile * S, tile * S + S):
                part += gl.load(ws_ptr + r * (BN * BM) + tile_off, cache_modifier=".cg")
            gl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
    if done:
        n = n0 + rows
        m = m0 + cols
        out = part * gl.load(alpha_ptr)
        if HAS_BIAS:
            out += gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
        gl.store(c_ptr + m * N + n, out.to(gl.bfloat16), mask=(n < N) & (m < M))


@gluon.jit
def _tile_slice(KB, S, MT):
    """This program's (p, output tile, its weight-row tile nt and token tile mt, K steps [k0, k1)):
    tile p // S (tokens vary fastest), K slice p % S of S."""
    p = gl.program_id(0)
    tile = p // S
    j = p - tile * S
    nt = tile // MT
    mt = tile - nt * MT
    return p, tile, nt, mt, (j * KB) // S, ((j + 1) * KB) // S


@gluon.jit
def _wgmma_kernel(x_desc, w_desc, s_desc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, M, N, KB, S, MT,
                  exp_bias, BM: gl.constexpr, NSW: gl.constexpr, NSD: gl.constexpr, CPS: gl.constexpr,
                  NSX: gl.constexpr, LAG: gl.constexpr, DW: gl.constexpr, FMT: gl.constexpr, LOADS: gl.constexpr,
                  HAS_BIAS: gl.constexpr, PDL: gl.constexpr, DEC_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
                  L2W: gl.constexpr, L2S: gl.constexpr, L3: gl.constexpr, num_warps: gl.constexpr):
    SROWS: gl.constexpr = s_desc.block_type.shape[0]  # 64 (nvfp4) or 32 (mxfp4) rows of 16 bytes per tile
    R: gl.constexpr = num_warps // 4  # 64-row weight tiles per program: one per MMA warpgroup
    if PDL:
        _gdc("launch_dependents")
    p, tile, nt, mt, k0, k1 = _tile_slice(KB, S, MT)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NSW] + w_desc.block_type.shape, w_desc.layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NSW] + s_desc.block_type.shape, s_desc.layout)
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NSX] + x_desc.block_type.shape, x_desc.layout)
    d_bufs = gl.allocate_shared_memory(gl.bfloat16, [NSD * CPS, 64 * R, 64], gl.NVMMASharedLayout(128, 16))
    w_ready, w_empty = _ring_barriers(NSW)
    x_ready, x_empty = _ring_barriers(NSX)
    d_ready, d_empty = _ring_barriers(NSD)
    trow0 = nt * R * KB * 64
    # (the argument tuples are spelled out twice: layouts and constexprs do not survive a tuple variable)
    if LOADS:  # the MMA partition issues the copies: MMA + decoder warps only (12 warps: 168 registers)
        gl.warp_specialize([
            (_mma, (d_bufs, x_bufs, d_ready, d_empty, x_ready, x_empty, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr,
                    p, tile, nt * 64 * R, mt * BM, M, N, k0, k1, S, x_desc, w_desc, s_desc, w_bufs, s_bufs, w_ready,
                    w_empty, trow0, KB, NSD, CPS, NSX, NSW, SROWS, R, BM, LAG, LOADS, HAS_BIAS, PDL, num_warps)),
            (_decoder, (w_bufs, s_bufs, d_bufs, w_ready, w_empty, d_ready, d_empty, exp_bias, k0, k1, NSW, NSD,
                        CPS, FMT, R, L2W, L2S, L3)),
        ], [DW], [DEC_REGS])
    else:
        gl.warp_specialize([
            (_mma, (d_bufs, x_bufs, d_ready, d_empty, x_ready, x_empty, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr,
                    p, tile, nt * 64 * R, mt * BM, M, N, k0, k1, S, x_desc, w_desc, s_desc, w_bufs, s_bufs, w_ready,
                    w_empty, trow0, KB, NSD, CPS, NSX, NSW, SROWS, R, BM, LAG, LOADS, HAS_BIAS, PDL, num_warps)),
            (_decoder, (w_bufs, s_bufs, d_bufs, w_ready, w_empty, d_ready, d_empty, exp_bias, k0, k1, NSW, NSD,
                        CPS, FMT, R, L2W, L2S, L3)),
            (_w_loader, (w_desc, s_desc, w_bufs, s_bufs, w_ready, w_empty, trow0, k0, k1, KB, SROWS, NSW, R)),
            (_x_loader, (x_desc, x_bufs, x_ready, x_empty, mt * BM, k0, k1, NSX, PDL)),
        ], [DW, 1, 1], [DEC_REGS, LOAD_REGS, LOAD_REGS])


# CPS 2 x NSD 3: best or even of the ring shapes timed on the H100 (NOTES_w4a16.md section 13)
DEFAULT = dict(BM=None, BN=64, LOADS=0, C0=None, NSW=4, NSD=3, CPS=2, NSX=4, LAG=1, DW=4, DEC_REGS=96, LOAD_REGS=24,
               PER_SM=None, maxnreg=None, PDL=None)
_RESIDENT: dict = {}
_KEYS = set(DEFAULT) | {"S"}


def block_m(m: int) -> int:
    """Tokens per tile: the wgmma N extent (16 .. 256)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128 if m <= 128 else 256


def split(tiles: int, kb: int, slots: int, c0: float | None = None) -> int:
    """K slices per output tile. c0 None (the default): the most slices that still fit one wave.
    Else the count minimising waves x (steps per slice + c0), c0 = a program's fixed cost in
    weight steps: 80 tiles of 20 steps on 132 slots would take 1 x 22 as one slice each but
    2 x (7 + 2) = 18 as three. Measured at M = 256 (NOTES_w4a16.md section 14), that model is
    wrong in the median: the fp32 partials (S x M x N x 4 bytes) cost more than the idle SMs
    (5120^2: 30.7 us with one slice, 45.9 with three; only 5120x27648 gained, 146.9 -> 129.6)."""
    if c0 is None:
        s_max = max(1, min(kb, slots // tiles))
        steps = -(-kb // s_max)
        return -(-kb // steps)  # fewest slices with the same longest slice
    best, best_cost = 1, None
    for s in range(1, min(kb, 32) + 1):
        steps = -(-kb // s)
        if s > 1 and -(-kb // (s - 1)) == steps:
            continue  # same longest slice as s - 1: more programs for nothing
        cost = -(-tiles * s // slots) * (steps + float(c0))
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


@functools.lru_cache(maxsize=None)
def _x_layout(bm: int):
    return gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16)


def _weight_descriptors(state: dict):
    """The weight and scale descriptors of a layer, built once and kept in its state dict (so they
    live and die with the layer: a module-level cache would keep freed weights alive). A prefill
    calls every layer once per forward, and building them took ~40 us of host time per call (the
    prefill at M = 256 was bound by the host: 56 ms of it in the 4-bit linears at 7B batch 1 for
    24 ms of GPU work; benchmarks/NOTES_rollout.md section 7). The key re-checks what they encode."""
    words, scale = state["words"], state["scale"]
    frag = layout.is_frag(state)
    key = (state["fmt"], frag, words.data_ptr(), tuple(words.shape), words.stride(), scale.data_ptr(),
           tuple(scale.shape), scale.stride())
    found = state.get("_tma_descriptors")
    if found is None or found[0] != key:
        # fragment-ordered words: the unswizzled stage w4a16_frag reads as 16-byte rows
        wl = FRAG_SMEM if frag else gl.NVMMASharedLayout.get_default_for([64, 32], gl.int32)
        srows = 64 if state["fmt"] == "nvfp4" else 32
        sl = gl.NVMMASharedLayout(0, 8)  # 16-byte rows: no swizzle
        found = state["_tma_descriptors"] = (key, TensorDescriptor.from_tensor(words.view(-1, 32), [64, 32], wl),
                                             TensorDescriptor.from_tensor(scale.view(-1, 16), [srows, 16], sl))
    return found[1:]


def descriptors(x: torch.Tensor, state: dict, bm: int):
    """TMA descriptors: x [M, K] in [BM, 64] boxes; words [NB*KB*64, 32] in [64, 32]; scales in
    one box per 64 x 256 tile ([64, 16] nvfp4; mxfp4's 512-byte tile as [32, 16])."""
    return (TensorDescriptor.from_tensor(x, [bm, 64], _x_layout(bm)), *_weight_descriptors(state))


def rows_in_storage(x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """x [M, K] seen as its first `rows` rows (M <= rows) where its storage already holds them, i.e. x = buf[:M] of
    a row-major buffer with at least `rows` rows from x's first: a TMA box of `rows` tokens then reads those rows
    instead of zero-filling past M. None where the storage ends sooner or x is not row-major. The rows past M are
    whatever the buffer holds; a GEMM row depends on its own x row only, and the epilogues mask the store by M."""
    m, k = x.shape
    if rows <= m:
        return x
    if x.stride() != (k, 1) or (x.storage_offset() + rows * k) * x.element_size() > x.untyped_storage().nbytes():
        return None
    return x.as_strided((rows, k), (k, 1))


def smem_bytes(bm: int, nsw: int, nsd: int, cps: int, nsx: int, bn: int = 64) -> int:
    """Shared memory of the rings: raw weight tiles, decoded stages, activation chunks (+ barriers)."""
    return nsw * (8192 + 1024) + nsd * cps * bn * 128 + nsx * bm * 128 + 1024


def kernel_args(fmt: str, m: int, config: dict | None = None, frag: bool = False) -> tuple[dict, dict]:
    """(constexpr arguments of _wgmma_kernel, the resolved config) for M tokens of a `fmt` layer (frag: nvfp4 in
    the fragment word order, FMT 4). Memoised (host time: ~75 us per call, mostly the decoder layouts); the dicts
    are shared, read-only."""
    items = tuple(sorted((config or {}).items()))
    try:
        hash(items)
    except TypeError:  # an unhashable config value: not memoised
        return _kernel_args.__wrapped__(fmt, m, items, W.PDL, frag)
    return _kernel_args(fmt, m, items, W.PDL, frag)


@functools.lru_cache(maxsize=1024)
def _kernel_args(fmt: str, m: int, items: tuple, pdl_default: bool, frag: bool = False) -> tuple[dict, dict]:
    config = dict(items)
    cfg = dict(DEFAULT)
    cfg.update({key: v for key, v in (config or {}).items() if key in _KEYS})
    nsw, nsd, cps, nsx, lag, dw, bn = (int(cfg[key]) for key in ("NSW", "NSD", "CPS", "NSX", "LAG", "DW", "BN"))
    bm = int(cfg["BM"] or block_m(m))
    loads = int(cfg["LOADS"])
    if bn not in (64, 128):
        raise ValueError(f"BN must be 64 or 128, got {bn}")
    if loads and nsw < 2 * (bn // 64):
        # the MMA warps refill the raw ring after a step retired, and the last chunk of step s
        # retires only once step s + 1 is decoded: the ring must hold two steps (NSW=2 at BN=128 hung)
        raise ValueError(f"LOADS=1 needs NSW >= 2 steps of raw tiles ({2 * (bn // 64)}), got NSW={nsw}")
    if bm not in (16, 32, 64, 128, 256):
        raise ValueError(f"BM must be 16, 32, 64, 128 or 256, got {bm}")
    if not 1 <= lag < min(nsd, nsx) or dw not in (4, 8) or cps not in (1, 2, 4):
        raise ValueError(f"need 1 <= LAG < NSD, NSX, DW in (4, 8), CPS in (1, 2, 4); got LAG={lag} DW={dw} CPS={cps}")
    if (dw // 4 + bn // 64 + (1 - loads)) > 3 and bm > 128:
        # 16 warps: ptxas caps the kernel at 128 registers, a [64, 256] accumulator needs 128
        raise ValueError("BM=256 fits 12 warps only: DW=8 or BN=128 need LOADS=1 (no loader warps)")
    if bm == 256 and cfg["maxnreg"] is not None and int(cfg["maxnreg"]) < 128:
        # the MMA warps' [64, 256] fp32 accumulator alone is 128 registers per thread; below that
        # triton 3.6's compiler crashed (maxnreg 80, section 15 of NOTES_w4a16.md)
        raise ValueError(f"BM=256 needs maxnreg >= 128, got {cfg['maxnreg']}; use BM <= 128 with it")
    if smem_bytes(bm, nsw, nsd, cps, nsx, bn) > 232448:
        raise ValueError(f"rings need {smem_bytes(bm, nsw, nsd, cps, nsx, bn)} B of shared memory (H100: 232448); "
                         "lower NSW / NSD / NSX")
    cfg["PDL"] = bool(pdl_default if cfg["PDL"] is None else cfg["PDL"])
    if frag and (fmt != "nvfp4" or dw != 4):
        raise ValueError(f"the wgmma kernel decodes fragment-ordered words (nvfp4) with 4 decoder warps; got {fmt}, "
                         f"DW={dw}")
    l2w, l2s, l3 = frag_layouts(1, bm)[:3] if frag else decoder_layouts(fmt, dw)
    consts = dict(BM=bm, LOADS=loads, NSW=nsw, NSD=nsd, CPS=cps, NSX=nsx, LAG=lag, DW=dw,
                  FMT=4 if frag else 0 if fmt == "nvfp4" else 1,
                  PDL=cfg["PDL"], DEC_REGS=int(cfg["DEC_REGS"]), LOAD_REGS=int(cfg["LOAD_REGS"]),
                  L2W=l2w, L2S=l2s, L3=l3, num_warps=bn // 16)
    return consts, cfg


def forward(x: torch.Tensor, state: dict, bias=None, out=None, config: dict | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [M, K] bf16 and an nvfp4 / mxfp4 `state`
    (qerl.kernels.prepare); BN weight rows per program.

    config: BM (tokens per program, default block_m(M)), BN (weight rows per program: 64, or 128
    with two MMA warpgroups, which halves the activation traffic per weight row), NSW (raw weight steps in flight), NSD x
    CPS (decoded stages of CPS 64-K chunks each: one fence + mbarrier hand-off per stage), NSX
    (activation chunks), LAG (wgmma groups in flight), DW (decoder warps: 4 or 8), DEC_REGS /
    LOAD_REGS (setmaxnreg of the decoder and loader warps), S (forced K slices per tile), C0 (the
    split rule's fixed cost per program, split(); None = the one-wave rule), LOADS (1: the MMA
    warps issue the TMA copies, no loader warps), PER_SM,
    maxnreg, PDL."""
    x = checked_input(x, state, "wgmma")
    fmt, n, kb, m = state["fmt"], state["n"], state["kb"], x.shape[0]
    consts, cfg = kernel_args(fmt, m, config, layout.is_frag(state))
    if consts["FMT"] in SCALE_BITS_FMT and SCALE_BITS and state.get("scale_bits", False):
        consts = dict(consts, FMT=SCALE_BITS_FMT[consts["FMT"]])  # the integer scale conversion
    bm, bn = consts["BM"], consts["num_warps"] * 16
    nt, mt = triton.cdiv(n, bn), triton.cdiv(m, bm)
    tiles = nt * mt
    key = tuple(consts[name] for name in ("BM", "LOADS", "NSW", "NSD", "CPS", "NSX", "LAG", "DW", "DEC_REGS", "PDL",
                                          "num_warps")) + (cfg["maxnreg"],)
    smem = smem_bytes(bm, consts["NSW"], consts["NSD"], consts["CPS"], consts["NSX"], bn)
    per_sm = cfg["PER_SM"] or _RESIDENT.get(key) or max(1, min(2, 232448 // smem))
    if cfg.get("S") is not None:
        s = max(1, min(int(cfg["S"]), kb))
    else:
        s = split(tiles, kb, int(per_sm) * W._num_sms(x.device.index or 0), cfg["C0"])
    x_desc, w_desc, s_desc = descriptors(x, state, bm)
    c, locks, ws = launch_buffers(x, state, out, tiles, s, bn * bm)
    extra = {} if cfg["maxnreg"] is None else {"maxnreg": int(cfg["maxnreg"])}
    kernel = _wgmma_kernel[(tiles * s,)](
        x_desc, w_desc, s_desc, state["alpha"], bias if bias is not None else c, c, ws, locks, m, n, kb, s, mt,
        int(state.get("exp_bias", 0)), HAS_BIAS=bias is not None, launch_pdl=consts["PDL"], **consts, **extra,
    )
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident(kernel, consts["num_warps"]) or per_sm
    return c if out is None or c is out else out.copy_(c)  # the kernel writes a dense [M, N]


def checked_input(x: torch.Tensor, state: dict, kernel: str) -> torch.Tensor:
    """The Gluon GEMMs' input checks (an nvfp4 / mxfp4 layer with K a multiple of 256, x bf16 [M, K]);
    x made TMA-ready (unit inner stride, 16-byte aligned)."""
    fmt, k = state["fmt"], state["k"]
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"the {kernel} kernel takes nvfp4 / mxfp4 weights, got {fmt}")
    if k != state["kb"] * 256:
        raise ValueError(f"the {kernel} kernel needs K a multiple of 256")
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [M, {k}]")
    if x.stride(1) != 1 or x.stride(0) != k or x.data_ptr() % 16:
        x = x.contiguous().clone() if x.data_ptr() % 16 else x.contiguous()
    return x


def launch_buffers(x: torch.Tensor, state: dict, out, tiles: int, s: int, tile_elems: int):
    """(c, locks, ws) of a Gluon GEMM launch: the bf16 output [M, N] (`out` itself when it is one), the
    layer's tile counters (a fresh zeroed set if it has fewer than `tiles`) and the fp32 split
    workspace (tile_elems per program when S > 1)."""
    m, n = x.shape[0], state["n"]
    direct = out is not None and out.is_contiguous() and tuple(out.shape) == (m, n) and out.dtype == torch.bfloat16
    c = out if direct else torch.empty(m, n, device=x.device, dtype=torch.bfloat16)
    locks = state["locks"]
    if tiles > locks.numel():
        locks = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    ws = torch.empty(tiles * s * tile_elems if s > 1 else 1, device=x.device, dtype=torch.float32)
    return c, locks, ws


def compile_offline(fmt: str = "nvfp4", m: int = 64, n: int = 7168, k: int = 5120, config: dict | None = None,
                    bias: bool = False, sbits: bool = False, frag: bool = False):
    """Compile the kernel for sm_90a without a GPU (ptxas included) -> triton CompiledKernel (frag: on
    fragment-ordered words). benchmarks/compile_gluon.py --kernel wgmma prints its resources; tests/test_kernels.py
    checks it."""
    consts, cfg = kernel_args(fmt, m, config, frag)
    return compile_gemm_offline(_wgmma_kernel, fmt, m, n, k, consts, cfg, bias, sbits, FRAG_SMEM if frag else None)


# FMT of a launch whose nvfp4 scales are all normal (prepare: scale_bits): the integer scale conversion; 0 -> 2 for
# today's words, 4 -> 5 for rwg's fragment-ordered ones (FRAG); other FMTs have no such form
SCALE_BITS_FMT = {0: 2, 4: 5}


def compile_gemm_offline(fn, fmt: str, m: int, n: int, k: int, consts: dict, cfg: dict, bias: bool, sbits: bool,
                         weight_smem=None):
    """sm_90a build of a Gluon GEMM with this module's argument list (x / weight / scale descriptors,
    alpha, bias, output, workspace, counters, M, N, KB, S, MT, exp_bias) for zero CPU tensors of the
    layer's shape; `consts` its constexpr arguments; weight_smem: another shared layout for the words' stage."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    state = {"fmt": fmt, "words": torch.zeros(triton.cdiv(n, 64), k // 256, 64, 32, dtype=torch.int32),
             "scale": torch.zeros(triton.cdiv(n, 64), k // 256, 64, 16 if fmt == "nvfp4" else 8, dtype=torch.uint8)}
    x_desc, w_desc, s_desc = descriptors(torch.zeros(m, k, dtype=torch.bfloat16), state, consts["BM"])
    if weight_smem is not None:
        w_desc = TensorDescriptor.from_tensor(state["words"].view(-1, 32), [64, 32], weight_smem)
    sig = {"x_desc": mangle_type(x_desc), "w_desc": mangle_type(w_desc), "s_desc": mangle_type(s_desc),
           "alpha_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "KB": "i32", "S": "i32", "MT": "i32", "exp_bias": "i32"}
    fmt_code = SCALE_BITS_FMT.get(consts["FMT"], consts["FMT"]) if sbits else consts["FMT"]
    consts = dict(consts, HAS_BIAS=bias, FMT=fmt_code)
    sig.update({name: "constexpr" for name in consts})
    # pointers 16-byte aligned, as the JIT specialises them on a GPU
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in ("alpha_ptr", "bias_ptr", "c_ptr", "ws_ptr", "lock_ptr")}
    opts = {"num_warps": consts["num_warps"]} | ({} if cfg["maxnreg"] is None else {"maxnreg": int(cfg["maxnreg"])})
    return triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def _resident(kernel, num_warps: int) -> int | None:
    """Programs per SM: registers (every warp at the kernel's count: setmaxnreg only moves
    registers between the partitions) and shared memory of the compiled kernel."""
    try:
        smem = kernel.metadata.shared
        regs = kernel.n_regs
        warps = kernel.metadata.num_warps
    except AttributeError:
        return None
    by_regs = 65536 // (max(int(regs), 24) * max(int(warps), num_warps) * 32)
    return max(1, min(by_regs, 233472 // (smem + 1024)))
