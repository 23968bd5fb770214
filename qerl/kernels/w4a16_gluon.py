"""Warp-specialised GEMV for nvfp4 (and mxfp4) on Hopper (Gluon), tensor-core reduction, M = 1..8:
y[M, N] = x[M, K] @ dequant(W)[N, K]^T, bf16 in / out, fp32 accumulate.

mxfp4 (MX, since session 43; routed by w4a16_triton.WSMMA_FORMATS, by default since session 44): the
same ring and MMAs; a tile's 64 x 8 E8M0 bytes travel as one [32, 16] TMA box (TMA wants >= 16-byte rows),
read in `_layouts_mx` so that the lanes sharing a 32-weight group read the same byte, and `_decode_mx`
multiplies the words viewed [4, 2, 8, 8, 4] (four word columns per scale) by 2^(e + exp_bias - 127).

Sibling of `w4a16_ws.py` (same ring, same schedule and fixup); `benchmarks/compile_gluon.py`
compiles it offline. The default for M = 1 nvfp4 / mxfp4 on Hopper layers with N*K >= WSMMA_MIN_NK
(w4a16_triton; 8M since it beat the other kernels there on the H200, NOTES_w4a16.md section 35) and for
M = 2..8 on every layer (section 35; WSMMA_TOKENS_MIN_N); PATH="wsmma" forces it.
M = 1 puts x in all 8 columns of the MMA's B (MT = 1); M = 2..8 puts token g in column g (MT = 8,
rows of x past M read as zeros), which costs the same MMAs and 4 more instructions per step.

Pipeline (per program = one 64-row block x one K slice):
- producer partition (1 warp): TMA copies of whole 64 x 256 weight tiles (8 KB of words, 1 KB of
  FP8 scales, `layout.py`'s tiled order viewed as 2-D [N/64*KB*64, 32] / [.., 16]) into a ring of
  NUM_STAGES shared-memory stages; `ready[s]` (count 1, expect-tx 9216 bytes) / `empty[s]`.
- XS (`X_SMEM`, `xs_auto`): the producer also copies the step's x (MT tokens x 256 K, 4 KB at MT = 8)
  into the stage on the same barrier, after the PDL wait (`_xs_producer`), instead of every
  consumer thread loading x from global memory.
- consumer partition (default, 4 warps): wait `ready`, read the stage into registers, release it
  (`empty`), decode with the exact packed bf16x2 decode of `w4a16_triton._decode_tile_packed`
  (P0..P3 = q * s * 2^-J, bf16x2), and reduce with `mma.sync.m16n8k16` (inline PTX): the decoded
  registers are used as the A fragment as they are, x as the B fragment (all 8 columns of B equal
  x, so every column of C holds the same row sums). This replaces the 8 widen + 8 FFMA per word
  of the CUDA-core reduction (`w4a16_ws.py`, NOTES_w4a16.md section 11: issue bound at ~4
  instructions per weight) by 2 MMAs per thread-word.

Why this is exact to reorder: a thread of an m16n8k16 MMA holds, for its lane (g = lane // 4,
t = lane % 4), A rows g and g + 8 at K slots (2t, 2t+1) and (2t+8, 2t+9), and B at the same K
slots. Which true K index a slot stands for is free as long as A and B agree and it does not
depend on g. Thread (g, t) of warp w takes word column c = 8w + 2t + i (i = 0, 1) of rows
16m + g and 16m + 8 + g (m = 0..3): one word holds K = 8c .. 8c+7 as P0 = (0, 1), P1 = (4, 5),
P2 = (2, 3), P3 = (6, 7) (layout._slot), so
    MMA 1: a = (P0[g], P0[g+8], P1[g], P1[g+8]), b = (x pair (8c, 8c+1), x pair (8c+4, 8c+5))
    MMA 2: a = (P2[g], P2[g+8], P3[g], P3[g+8]), b = (x pair (8c+2, 8c+3), x pair (8c+6, 8c+7))
and x is read as int32 pairs (x.view(int32)). The two word columns of a thread share one scale
(16 weights per FP8 scale). Products of two bf16 are exact in fp32; the tensor core adds them
in fp32 (as the fused tensor-core kernel does).

Register tensors are 5-D [m 4, h 2, g 8, sc 16, i 2] (row = 16m + 8h + g, word column
c = 2 sc + i, sc = 4w + t) in the blocked layout L5; the h = 0 / 1 halves (A rows g, g+8) are
split off last, so each MMA is one element of a [4, 8, 16, 2] tensor: 8 elements (m, i) per
thread, 16 MMAs per thread per 64 x 256 step (a warp: 64 rows x 8 word columns = 4096 weights).
Offline sm_90a build (benchmarks/compile_gluon.py, N=7168, K=5120, 6 stages, maxnreg 64): no
spills, 55.9 KB shared, consumer loop 345 SASS instructions per step = 21.6 per word (11 decode
LOP3/SHF + 4 HMUL2 + 1 HMMA per word; ~32 in w4a16_ws).

Schedule and fixup as `w4a16_gemv.py`: program p owns row block p // S and reduction steps
[j*KB//S, (j+1)*KB//S), j = p % S; a block covered by several programs goes through the fp32
workspace [grid, 64] and the block's counter; the last arrival sums the partials in program
order (deterministic; all S loads issued at once), writes bf16 and resets the counter. One launch,
no host sync. Layers with more row blocks than program slots and a nearly empty last wave (7B
gate/up) run a split tail (the last wave's blocks in K slices; TAIL) or, in PDL chains, stream-K
(one program per slot, equal runs of the flat (block, step) order, a segment and an epilogue per
block it touches; SK); see TAIL_SPLIT / STREAMK below. With PDL, everything that does not depend
on the previous kernel happens before the wait: the producer's weight copies and the consumer's alpha / bias rows (`_tile_consts`), so the
last-arriving program's epilogue waits on no load (NOTES_w4a16.md section 16).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from qerl.kernels import layout, ptx_cluster
from qerl.kernels.w4a16_frag import FRAG_SCALE_PAIRS  # the fragment words' scale pairs, as rwg's
from qerl.kernels import w4a16_triton as W
from qerl.kernels.w4a16_triton import _KA, _KM, _KS, _R1, _R2, _R3, _S0, _S3  # the bit layout (layout.py)
from qerl.kernels.w4a16_ws import (_copy_tile, _gdc, _mul2, _nv_scale2, _plan, _producer, _resident,  # shared
                                   _rotr, _scale_pairs, _setup)

ptx_cluster.install()  # the cluster fixup's entry code (CLUSTER; only kernels that emit its mark)


@functools.lru_cache(maxsize=None)
def _layouts(num_warps: int, fmt: str = "nvfp4", frag: bool = False):
    """(L5, L2W, L2S): the consumer's 5-D register layout of a tile and the 2-D layouts of the
    shared-memory reads that reshape into it without data movement (checked at compile time with
    convert_layout(assert_trivial=True)). WM = num_warps // 4 warps split the four 16-row MMA
    tiles; the other factor 4 of the warps splits the word columns. L2S for `fmt` (mxfp4: `_layouts_mx`);
    frag: the stage reads of fragment-ordered words (_FRAG_W2, _FRAG_S2; 4 warps)."""
    wm = num_warps // 4
    l5 = gl.BlockedLayout([1, 1, 1, 1, 2], [1, 1, 8, 4, 1], [wm, 1, 1, 4, 1], [4, 3, 2, 1, 0])
    if frag:
        return l5, _FRAG_W2.value, _FRAG_S2.value
    # 2-D [64 rows, 32 words]: row = 16m + 8h + g (bits: g 0-2, h 3, m 4-5), col = 8w + 2t + i
    lanes_w = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    warps_w = [[0, 8], [0, 16]] + ([[16, 0]] if wm == 2 else [])
    regs_w = [[0, 1], [8, 0]] + ([[32, 0]] if wm == 2 else [[16, 0], [32, 0]])
    l2w = gl.DistributedLinearLayout(regs_w, lanes_w, warps_w, [], [64, 32])
    # 2-D [64 rows, 16 scales]: scale column sc = 4w + t (both words of a thread share it)
    lanes_s = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warps_s = [[0, 4], [0, 8]] + ([[16, 0]] if wm == 2 else [])
    regs_s = [[8, 0]] + ([[32, 0]] if wm == 2 else [[16, 0], [32, 0]])
    l2s = gl.DistributedLinearLayout(regs_s, lanes_s, warps_s, [], [64, 16])
    return l5, l2w, (_layouts_mx(num_warps) if fmt == "mxfp4" else l2s)


@functools.lru_cache(maxsize=None)
def _layouts_mx(num_warps: int):
    """mxfp4's L2S: the 2-D [32, 16] layout of a tile's E8M0 scales (64 rows x 8 bytes, read as 16-byte rows
    because TMA's inner box must be >= 16 bytes: byte 8r + j at [r // 2, 8 (r % 2) + j]) such that thread
    (g, t) of warp w holds the scale j = 2w + t // 2 of rows 16m + 8h + g: the SliceLayout(4, .) of the
    words viewed [4, 2, 8, 8 j, 4] (`_decode_mx`), lanes t and t ^ 1 reading the same byte."""
    wm = num_warps // 4
    lanes = [[0, 0], [0, 1], [0, 8], [1, 0], [2, 0]]  # t0 (none), t1 (j + 1), g (r + 1, 2, 4)
    warps = [[0, 2], [0, 4]] + ([[8, 0]] if wm == 2 else [])  # w (j + 2, 4), WM = 2: m bit 0 (r + 16)
    regs = [[4, 0]] + ([[16, 0]] if wm == 2 else [[8, 0], [16, 0]])  # h (r + 8), m (r + 16, 32)
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [32, 16])


@functools.lru_cache(maxsize=None)
def _x_layout_frag(mt: int):
    """XS on fragment-ordered words (WF 2, 4 warps): the stage's x [4 chunk, MT token, 32 pair] such that thread
    (g, t) of warp w holds chunk w (slices 4 w .. 4 w + 3), token g (MT = 8; MT = 1: the one token), pairs
    16 u + 8 i + 4 b + t (registers b, i, u): the B pairs of its elements' two MMAs (`_x_unpack_frag`)."""
    g = [[0, 1, 0], [0, 2, 0], [0, 4, 0]] if mt > 1 else [[0, 0, 0]] * 3
    return gl.DistributedLinearLayout([[0, 0, 4], [0, 0, 8], [0, 0, 16]], [[0, 0, 1], [0, 0, 2]] + g,
                                      [[1, 0, 0], [2, 0, 0]], [], [4, mt, 32])


@functools.lru_cache(maxsize=None)
def _x_layout(num_warps: int, mt: int, frag: bool = False):
    """XS: the register layout of one stage of x in shared memory, int32 [4 (64-K chunk), MT (token),
    32 (K pairs of the chunk)], that unpacks (`_x_unpack`) into the four [1, 1, 8, 16, 2] x tensors
    of the consumer's L5 without data movement. Thread (g = lane // 4, t = lane % 4) of warp w reads
    word columns c = 8w + 2t + i (chunk w, K pairs 4(2t + i) .. + 3 of it: 16 bytes each) of token
    g (MT = 8) or of the one token (MT = 1: the lanes of a column read the same address). frag: on
    fragment-ordered words, `_x_layout_frag`."""
    if frag:
        return _x_layout_frag(mt)
    g = [[0, 1, 0], [0, 2, 0], [0, 4, 0]] if mt > 1 else [[0, 0, 0]] * 3
    warps = [[1, 0, 0], [2, 0, 0]] + ([[0, 0, 0]] if num_warps == 8 else [])
    return gl.DistributedLinearLayout([[0, 0, 1], [0, 0, 2], [0, 0, 4]], [[0, 0, 8], [0, 0, 16]] + g, warps, [],
                                      [4, mt, 32])


def x_descriptor(x: torch.Tensor, mt: int):
    """XS: TMA descriptor of x [M, K] bf16 as int32 K pairs viewed 3-D [K / 64, M, 32] (64-K chunk,
    token, pair): one box is a step's 4 chunks x MT tokens, 128-byte swizzled (token g's 16-byte
    groups XOR g, so the 8 tokens a warp reads hit 8 different bank groups); tokens >= M are filled
    with zeros by the copy, which is the mask of the register path."""
    m, k = x.shape
    xw = x.view(torch.int32)
    # MT = 1: no swizzle (a 128-byte swizzle spans 8 rows; the lanes of a column read one address anyway)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128 if mt > 1 else 0, element_bitwidth=32, rank=3)
    return TensorDescriptor(xw, [k // 64, m, 32], [32, k // 2, 1], [4, mt, 32], layout)


@gluon.jit
def _mma(c0, c1, c2, c3, a0, a1, a2, a3, b0, b1):
    """One warp-wide mma.sync m16n8k16 (bf16 x bf16 -> fp32) per element: every thread of the
    warp holds the same number of elements in the same order, so the warp executes them together."""
    return gl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(gl.float32, gl.float32, gl.float32, gl.float32), is_pure=True, pack=1)


@gluon.jit
def _sreg(name: gl.constexpr):
    """A 64-bit special register (%clock64, %globaltimer) or %smid, read once per thread."""
    if name == "smid":
        return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False,
                                         pack=1).to(gl.int64)
    return gl.inline_asm_elementwise("mov.u64 $0, %" + name + ";", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _stamp(stamp_ptr, p, slot: gl.constexpr, name: gl.constexpr):
    gl.store(stamp_ptr + p * 8 + slot, _sreg(name))


@gluon.jit
def _gluon_producer(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, trow0, k0, k1, KB, stamp_ptr, p,
                    NUM_STAGES: gl.constexpr, STAMP: gl.constexpr, XS: gl.constexpr, PDL: gl.constexpr,
                    GLU: gl.constexpr):
    if GLU:
        _glu_producer(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, trow0, k0, k1, KB, NUM_STAGES, XS,
                      PDL)
    elif XS:
        _xs_producer(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, trow0, k0, k1, KB, NUM_STAGES, PDL)
    else:
        _producer(w_desc, s_desc, w_bufs, s_bufs, ready, empty, trow0, k0, k1, NUM_STAGES)
    if STAMP:  # the clock when the last weight copy was issued
        _stamp(stamp_ptr, p, 7, "clock64")


@gluon.jit
def _xs_producer(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, trow0, k0, k1, KB, NS: gl.constexpr,
                 PDL: gl.constexpr):
    """XS: the producer copies each step's x (MT tokens x 256 K, `x_descriptor`) into the stage
    beside its weight tile, on the same `ready` barrier, so x arrives with the weights instead of
    behind them: a consumer's own x load waits in the SM's queue behind the ring's weight copies
    (20-25% of the M = 8 GEMV's warp samples stalled on it, NOTES_w4a16.md section 23). x is the
    previous kernel's output: the ring's first pass copies its weights, waits for that kernel
    (PDL), then copies those stages' x; their `ready` expects all bytes from the start. Steps are
    flat in stream-K, so the step's K block is kk % KB."""
    nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
    k2 = gl.minimum(k1, k0 + NS)
    for kk in range(k0, k2):  # the first pass: every stage is free
        idx = kk - k0
        mbarrier.expect(ready.index(idx), nbytes)
        _copy_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, trow0 + kk * 64)
    if PDL:
        _gdc("wait")
    for kk in range(k0, k2):
        idx = kk - k0
        tma.async_copy_global_to_shared(x_desc, [(kk % KB) * 4, 0, 0], ready.index(idx), x_bufs.index(idx))
    for kk in range(k2, k1):
        i = kk - k0
        idx = i % NS
        mbarrier.wait(empty.index(idx), ((i // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(idx), nbytes)
        _copy_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, trow0 + kk * 64)
        tma.async_copy_global_to_shared(x_desc, [(kk % KB) * 4, 0, 0], ready.index(idx), x_bufs.index(idx))


@gluon.jit
def _glu_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, f, KB):
    """GLU: the stage of flat step f (pair block f // KB, K step f % KB) = the 32 gate rows and the 32
    up rows of that pair, one 3-D box each for words and scales (`glu_descriptors`: [2 (gate, up),
    rows, .], the up rows a fixed row distance behind the gate rows): rows 0..31 / 32..63 of the
    stage, the byte order of a 64-row box (mxfp4's scale boxes [2, 16, 16]: half the rows, `glu_descriptors`)."""
    j = f // KB
    row = ((j // 2) * KB + (f - j * KB)) * 64 + (j % 2) * 32
    tma.async_copy_global_to_shared(w_desc, [0, row, 0], ready.index(idx), w_bufs.index(idx))
    SROWS: gl.constexpr = s_desc.block_type.shape[1]
    if SROWS == 32:
        tma.async_copy_global_to_shared(s_desc, [0, row, 0], ready.index(idx), s_bufs.index(idx))
    else:
        tma.async_copy_global_to_shared(s_desc, [0, row // 2, 0], ready.index(idx), s_bufs.index(idx))


@gluon.jit
def _glu_producer(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, trow0, k0, k1, KB, NS: gl.constexpr,
                  XS: gl.constexpr, PDL: gl.constexpr):
    """GLU: `_producer` / `_xs_producer` with `_glu_tile` stages (flat step trow0 / 64 + kk)."""
    f0 = trow0 // 64
    if XS:
        nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes + x_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = w_desc.block_type.nbytes + s_desc.block_type.nbytes
    k2 = gl.minimum(k1, k0 + NS)
    if XS:  # the first pass: weights before the PDL wait, x after it (as _xs_producer)
        for kk in range(k0, k2):
            idx = kk - k0
            mbarrier.expect(ready.index(idx), nbytes)
            _glu_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, f0 + kk, KB)
        if PDL:
            _gdc("wait")
        for kk in range(k0, k2):
            idx = kk - k0
            tma.async_copy_global_to_shared(x_desc, [(kk % KB) * 4, 0, 0], ready.index(idx), x_bufs.index(idx))
        kfirst = k2
    else:
        kfirst = k0
    for kk in range(kfirst, k1):
        i = kk - k0
        idx = i % NS
        mbarrier.wait(empty.index(idx), ((i // NS) & 1) ^ 1)
        mbarrier.expect(ready.index(idx), nbytes)
        _glu_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, f0 + kk, KB)
        if XS:
            tma.async_copy_global_to_shared(x_desc, [(kk % KB) * 4, 0, 0], ready.index(idx), x_bufs.index(idx))


@gluon.jit
def _lr_rows(LR: gl.constexpr):
    """MT = 1 epilogue: rows g + 16m of a 64-row block's half in its [8 (g), 4 (m)] layout LR."""
    g1 = gl.arange(0, 8, layout=gl.SliceLayout(1, LR))
    m1 = gl.arange(0, 4, layout=gl.SliceLayout(0, LR))
    return gl.expand_dims(g1, 1) + gl.expand_dims(m1, 0) * 16


@gluon.jit
def _lr3_rows(LR3: gl.constexpr):
    """MT = 8 epilogue: in its [4 (m), 8 (g), 4 (t)] layout LR3, rows 16m + g ([4, 8, 1]) and first
    tokens 2t ([1, 1, 4])."""
    m1 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LR3)))
    g1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LR3)))
    t1 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LR3)))
    row = gl.expand_dims(gl.expand_dims(m1 * 16, 1) + gl.expand_dims(g1, 0), 2)
    tok = gl.expand_dims(gl.expand_dims(t1 * 2, 0), 1)
    return row, tok


@gluon.jit
def _red_idx(LO: gl.constexpr, NM: gl.constexpr = 4, base=0):
    """MT = 8 shared-memory epilogue: in its [NM (m), 8 (g), 4 (t), 2 (b), 2 (h)] layout LO, rows
    base + 16m + 8h + g ([NM, 8, 1, 1, 2]) and tokens 2t + b ([1, 1, 4, 2, 1]); NM = 2 and base = the
    pair block's first column for `_glu_store`."""
    m = gl.arange(0, NM, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LO)))))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LO)))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, gl.SliceLayout(4, LO)))))
    b = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(4, LO)))))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, LO)))))
    m5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(m, 1), 2), 3), 4)
    g5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(g, 0), 2), 3), 4)
    t5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 0), 3), 4)
    b5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(b, 0), 0), 0), 4)
    h5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(h, 0), 0), 0), 0)
    return base + m5 * 16 + h5 * 8 + g5, t5 * 2 + b5


@gluon.jit
def _red_idx1(LO: gl.constexpr):
    """MT = 1 shared-memory epilogue: rows 16m + 8h + g in its [4 (m), 8 (g), 2 (h)] layout LO."""
    m = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LO)))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LO)))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, LO)))
    return gl.expand_dims(gl.expand_dims(m * 16, 1) + gl.expand_dims(g, 0), 2) + gl.expand_dims(
        gl.expand_dims(h * 8, 0), 0)


@gluon.jit
def _tile_consts(alpha_ptr, bias_ptr, blk, N, rows, HAS_BIAS: gl.constexpr, HI: gl.constexpr):
    """(alpha, bias of `rows`, bias of rows + 8 if HI) in the epilogue's layout: the layer's
    constants, loaded before the PDL wait so the epilogue of the last program has no dependent load."""
    alpha = gl.load(alpha_ptr)
    if HAS_BIAS:
        n = blk * 64 + rows
        b_lo = gl.load(bias_ptr + n, mask=n < N, other=0.0).to(gl.float32)
        if HI:
            b_hi = gl.load(bias_ptr + n + 8, mask=n + 8 < N, other=0.0).to(gl.float32)
        else:
            b_hi = b_lo
    else:
        b_lo = rows.to(gl.float32) * 0.0  # unused without a bias
        b_hi = b_lo
    return alpha, b_lo, b_hi


@gluon.jit
def _x_step(xw_ptr, kk, xoff, xmask, MT: gl.constexpr, FRAG: gl.constexpr = False):
    """x of reduction step kk as four int32-pair tensors [1, 1, 8, 16, 2] (K pairs (8c, 8c+1),
    (8c+2, 8c+3), (8c+4, 8c+5), (8c+6, 8c+7)); MT = 8: rows past M read as zeros. FRAG (fragment-ordered
    words, the consumer's xoff): the B registers (b0, b1) of the element's two MMAs, pairs +0, +4 and +16, +20."""
    xb = xw_ptr + kk * 128 + xoff
    D1: gl.constexpr = 4 if FRAG else 1
    D2: gl.constexpr = 16 if FRAG else 2
    if MT > 1:
        return (gl.load(xb + 0, mask=xmask, other=0), gl.load(xb + D1, mask=xmask, other=0),
                gl.load(xb + D2, mask=xmask, other=0), gl.load(xb + D2 + D1, mask=xmask, other=0))
    return gl.load(xb + 0), gl.load(xb + D1), gl.load(xb + D2), gl.load(xb + D2 + D1)


@gluon.jit
def _x_unpack(xv, L5: gl.constexpr):
    """XS: one stage of x read from shared memory ([4 chunk, MT token, 32 pair] in `_x_layout`) ->
    the four int32-pair tensors [1, 1, MT, 16, 2] of `_x_step` (pairs (8c, 8c+1), (8c+2, 8c+3),
    (8c+4, 8c+5), (8c+6, 8c+7), c = 2 sc + i, sc = 4 chunk + t), all in L5 (register renames only)."""
    MT: gl.constexpr = xv.shape[1]
    a, b = gl.split(gl.reshape(xv, [4, MT, 4, 2, 2, 2]))  # pair j = 2 jh + jl: jl split first
    x01, x45 = gl.split(a)
    x23, x67 = gl.split(b)
    return _x_cols(x01, L5), _x_cols(x23, L5), _x_cols(x45, L5), _x_cols(x67, L5)


@gluon.jit
def _x_unpack_frag(xv, L5: gl.constexpr):
    """XS on fragment words: a stage of x in `_x_layout_frag` -> the B registers (b0, b1) of each element's MMA
    u = 0 and u = 1 (pairs 8 (4 w + i) + t, + 4 and + 16, + 20 of `_x_step` FRAG), [1, 1, MT, 16, 2] in L5."""
    MT: gl.constexpr = xv.shape[1]
    v = gl.permute(gl.reshape(xv, [4, MT, 2, 2, 2, 4]), (0, 1, 5, 3, 2, 4))  # [w, MT, t, i, u, b]
    u0, u1 = gl.split(gl.permute(v, (0, 1, 2, 3, 5, 4)))  # [w, MT, t, i, b]
    b00, b01 = gl.split(u0)
    b10, b11 = gl.split(u1)
    return _x_cols(b00, L5), _x_cols(b01, L5), _x_cols(b10, L5), _x_cols(b11, L5)  # chunk = warp w


@gluon.jit
def _x_cols(v, L5: gl.constexpr):
    """[4 chunk, MT token, 4 t, 2 i] -> [1, 1, MT, 16 (sc = 4 chunk + t), 2 i] in L5."""
    MT: gl.constexpr = v.shape[1]
    return gl.convert_layout(gl.reshape(gl.permute(v, (1, 0, 2, 3)), [1, 1, MT, 16, 2]), L5, assert_trivial=True)


@gluon.jit
def _halves(v):
    """[4, 2, 8, 16, 2] (m, h, g, sc, i) -> the h = 0 and h = 1 halves, each [4, 8, 16, 2]."""
    return gl.split(gl.permute(v, (0, 2, 3, 4, 1)))


@gluon.jit
def _consumer(xw_ptr, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, stamp_ptr, w_bufs, s_bufs, x_bufs, ready, empty,
              p, blk, M, N, KB, k0, k1, S, NW, SP: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
              PDL: gl.constexpr, MT: gl.constexpr, XPF: gl.constexpr, STAMP: gl.constexpr, HOIST: gl.constexpr,
              EPI: gl.constexpr, SK: gl.constexpr, red, L5: gl.constexpr, L2W: gl.constexpr, L2S: gl.constexpr,
              SBITS: gl.constexpr, XS: gl.constexpr, LX: gl.constexpr, GLU: gl.constexpr, glu_buf,
              h_ptr, hout_ptr, nw_ptr, ss_ptr, NSS, eps, KN, FOLD: gl.constexpr, SSP: gl.constexpr,
              EB, WF: gl.constexpr, dl_ptr, dflag_ptr, sig_ptr, DT, SYNC: gl.constexpr, lx, LEXP: gl.constexpr,
              CL: gl.constexpr, num_warps: gl.constexpr):
    # activations: x as int32 pairs, element (sc, i) of the 5-D tile needs word column c = 2 sc + i
    LSC: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(4, L5))))
    LI: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L5))))
    LG: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L5))))
    sc1 = gl.arange(0, 16, layout=LSC)
    i1 = gl.arange(0, 2, layout=LI)
    sc5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(sc1, 0), 0), 0), 4)
    i5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i1, 0), 0), 0), 0)
    if WF == 2:  # fragment-ordered words: element (sc = 4 w + t, i)'s MMAs cover 16-K slices 4 w + i and + 2
        xoff = (sc5 // 4) * 32 + (sc5 % 4) + i5 * 8  # its first b0: pair 8 (4 w + i) + t
    else:
        xoff = sc5 * 8 + i5 * 4  # [1, 1, 1, 16, 2]: int32 pair index of K = 8c
    zero5 = gl.zeros([4, 2, 8, 16, 2], gl.int32, L5)
    # the epilogue's layouts: MT = 1 [8 (g), 4 (m)] per 32-row half, MT = 8 [4 (m), 8 (g), 4 (t)]
    LR: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, num_warps], [0, 1])
    LR3: gl.constexpr = gl.BlockedLayout([4, 1, 1], [1, 8, 4], [1, 1, num_warps], [2, 1, 0])
    # MT = 8 with EPI: the per-warp partials [m, w, g, t, b, h] read back with the 4 warps' copies in one thread
    WM: gl.constexpr = num_warps // 4
    LRED: gl.constexpr = gl.BlockedLayout([1, 4, 1, 1, 2, 2 // WM], [1, 1, 8, 4, 1, 1], [4, 1, 1, 1, 1, WM],
                                          [5, 4, 3, 2, 1, 0])
    # MT = 1 with EPI: the t = 0 copy [1, m, w, g, h], the 4 warps' values of a row in one thread (warps replicate)
    LRED1: gl.constexpr = gl.BlockedLayout([1, 1, 4, 1, 2], [1, 4, 1, 8, 1], [1, 1, 1, 1, num_warps], [4, 3, 2, 1, 0])
    if MT == 1 and EPI:
        rows = _red_idx1(gl.SliceLayout(0, gl.SliceLayout(2, LRED1)))
    elif MT == 1:
        rows = _lr_rows(LR)
    elif EPI:
        rows, _tok = _red_idx(gl.SliceLayout(1, LRED))
    else:
        rows, _tok = _lr3_rows(LR3)
    # MT = 8: B column g (lane // 4) is token g, so x row g (rows >= M read as 0); MT = 1: x in every column
    g5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=LG), 0), 1), 3), 4)
    if MT > 1:
        xoff = xoff + g5 * (KB * 128)
    xmask = (g5 < M) & (xoff >= 0)  # [1, 1, 8, 16, 2]

    cz, _unused = _halves(gl.zeros([4, 2, 8, 16, 2], gl.float32, L5))
    if STAMP:  # per-program clocks (w4a16_triton.STAMP): start, PDL wait done, main loop done, end, ...
        _stamp(stamp_ptr, p, 0, "clock64")
        _stamp(stamp_ptr, p, 4, "smid")
        _stamp(stamp_ptr, p, 5, "globaltimer")
    if HOIST:
        alpha, b_lo, b_hi = _tile_consts(alpha_ptr, bias_ptr, blk, N, rows, HAS_BIAS, not EPI)
    if PDL:  # x, the output and the workspace only after the previous kernel (the producer needs no wait)
        _gdc("wait")
    if STAMP:
        _stamp(stamp_ptr, p, 1, "clock64")
    if FOLD == 2:  # SCALE (NORM_FOLD): alpha times each token's RMS scale, from the producer's partial sums
        inv = _fold_scale(ss_ptr, NSS, eps, KN, LRED, SSP)
        alpha = alpha * inv
    if SK:  # stream-K: the flat steps [k0, k1) of the (row block, K step) order, one segment per row block
        f = k0
        while f < k1:
            sblk = f // KB
            s0 = f - sblk * KB
            s1 = gl.minimum(k1, sblk * KB + KB) - sblk * KB
            if HAS_BIAS:  # a later segment's rows (the first segment's were loaded before the wait)
                if f != k0:
                    alpha, b_lo, b_hi = _tile_consts(alpha_ptr, bias_ptr, sblk, N, rows, HAS_BIAS, not EPI)
                    if FOLD == 2:
                        alpha = alpha * inv
            acc0, acc1, acc2, acc3 = _mainloop(xw_ptr, w_bufs, s_bufs, x_bufs, ready, empty, s0, s1, f - k0, xoff,
                                               xmask, zero5, cz, NUM_STAGES, MT, XPF, L5, L2W, L2S, SBITS, XS, LX, GLU,
                                               EB, WF)
            if STAMP:
                _stamp(stamp_ptr, p, 2, "clock64")
            if MT == 1:
                _epilogue_smem1(alpha, b_lo, red, c_ptr, ws_ptr, lock_ptr, acc0, acc2, p, sblk, N, s0, s1, S, SP,
                                HAS_BIAS, LRED1, SK, k0, KB, 0)
            else:
                _epilogue_smem(alpha, b_lo, red, c_ptr, ws_ptr, lock_ptr, acc0, acc1, acc2, acc3,
                               p, sblk, M, N, s0, s1, S, SP, HAS_BIAS, LRED, SK, k0, KB, 0, GLU, glu_buf,
                               FOLD, h_ptr, hout_ptr, nw_ptr, ss_ptr, dl_ptr, dflag_ptr, sig_ptr, DT, SYNC, lx, LEXP)
            gl.thread_barrier()  # every warp has read `red` before a later segment's epilogue rewrites it
            f = sblk * KB + s1
    else:
        acc0, acc1, acc2, acc3 = _mainloop(xw_ptr, w_bufs, s_bufs, x_bufs, ready, empty, k0, k1, 0, xoff, xmask, zero5,
                                           cz, NUM_STAGES, MT, XPF, L5, L2W, L2S, SBITS, XS, LX, GLU, EB, WF)
        _block_epilogue(alpha_ptr, bias_ptr, alpha, b_lo, b_hi, red, c_ptr, ws_ptr, lock_ptr, stamp_ptr, acc0, acc1,
                        acc2, acc3, p, blk, M, N, k0, k1, S, NW, SP, HAS_BIAS, MT, STAMP, HOIST, EPI, rows, sc5, zero5,
                        LR, LR3, LRED, LRED1, GLU, glu_buf, FOLD, h_ptr, hout_ptr, nw_ptr, ss_ptr, dl_ptr, dflag_ptr,
                        sig_ptr, DT, SYNC, lx, LEXP, CL)
    if STAMP:
        _stamp(stamp_ptr, p, 3, "clock64")
        _stamp(stamp_ptr, p, 6, "globaltimer")


@gluon.jit
def _mainloop(xw_ptr, w_bufs, s_bufs, x_bufs, ready, empty, k0, k1, i0, xoff, xmask, zero5, cz,
              NUM_STAGES: gl.constexpr, MT: gl.constexpr, XPF: gl.constexpr, L5: gl.constexpr, L2W: gl.constexpr,
              L2S: gl.constexpr, SBITS: gl.constexpr, XS: gl.constexpr, LX: gl.constexpr, GLU: gl.constexpr = False,
              EB=0, WF: gl.constexpr = 0):
    """Reduction steps [k0, k1) of one row block, the ring's stage counter starting at i0 ->
    the four [4, 8, 16, 2] MMA accumulators (rows g / g + 8 x B columns 2t / 2t + 1). XS: x comes
    with the stage (`_xs_producer`), else from global memory (XPF: one step ahead). WF: the weights' format code,
    0 nvfp4, 1 mxfp4 (`_decode_mx`; EB = the tensor's exp_bias), 2 nvfp4 on fragment-ordered words
    (`_frag_operands`: one word is one MMA's A fragment)."""
    acc0 = cz
    acc1 = cz
    acc2 = cz
    acc3 = cz
    FRAG: gl.constexpr = WF == 2
    if XPF and not XS:  # x of the first step now, each later step's x one step ahead (its L2 latency behind a decode)
        n01, n23, n45, n67 = _x_step(xw_ptr, k0, xoff, xmask, MT, FRAG)
    for kk in range(k0, k1):
        i = i0 + kk - k0
        idx = i % NUM_STAGES
        if XPF and not XS:
            x01, x23, x45, x67 = n01 + zero5, n23 + zero5, n45 + zero5, n67 + zero5
            n01, n23, n45, n67 = _x_step(xw_ptr, gl.minimum(kk + 1, k1 - 1), xoff, xmask, MT, FRAG)
        elif not XS:
            x01, x23, x45, x67 = _x_step(xw_ptr, kk, xoff, xmask, MT, FRAG)  # pairs (8c, 8c+1), (8c+2, 8c+3), ...
            x01, x23, x45, x67 = x01 + zero5, x23 + zero5, x45 + zero5, x67 + zero5
        mbarrier.wait(ready.index(idx), (i // NUM_STAGES) & 1)
        if GLU:  # [2 (gate, up), 32, .] stages: the byte order of a 64-row one
            w2 = w_bufs.index(idx).reshape([64, 32]).load(L2W)
            s2d = s_bufs.index(idx).reshape([32 if WF == 1 else 64, 16]).load(L2S)
        else:
            w2 = w_bufs.index(idx).load(L2W)
            s2d = s_bufs.index(idx).load(L2S)
        if XS:
            xv = x_bufs.index(idx).load(LX)
        # order these generic-proxy reads before the producer's TMA (async proxy) refills the stage:
        # without the fence the refill overtook in-flight reads on the H100 (rows of 7168x5120 at
        # M = 2..3 wrong by ~2% in 2 of 3 launches, NOTES_w4a16.md section 15)
        fence_async_shared()
        mbarrier.arrive(empty.index(idx))
        if XS:
            if FRAG:
                x01, x23, x45, x67 = _x_unpack_frag(xv, L5)
            else:
                x01, x23, x45, x67 = _x_unpack(xv, L5)
            x01, x23, x45, x67 = x01 + zero5, x23 + zero5, x45 + zero5, x67 + zero5
        if FRAG:  # each word one MMA's A fragment: element (m, i) takes slices 4 w + i (u = 0) and 4 w + i + 2
            # (u = 1), in the XS order of the MMAs below: (p0g, p0h, p2g, p2h) x (b01, b23), then (p1g, p1h, p3g,
            # p3h) x (b45, b67)
            CZ: gl.constexpr = cz.type.layout
            p0g, p0h, p2g, p2h, p1g, p1h, p3g, p3h = _frag_operands(w2, s2d, SBITS, CZ)
        else:
            words = gl.convert_layout(gl.reshape(w2, [4, 2, 8, 16, 2]), L5, assert_trivial=True).to(gl.uint32,
                                                                                                       bitcast=True)
            if WF == 1:
                p0, p1, p2, p3 = _decode_mx(words, s2d, EB, L5, SBITS)
            else:
                p0, p1, p2, p3 = _decode_nv(words, s2d, L5, SBITS)
            p0g, p0h = _halves(p0.to(gl.int32, bitcast=True))
            p1g, p1h = _halves(p1.to(gl.int32, bitcast=True))
            p2g, p2h = _halves(p2.to(gl.int32, bitcast=True))
            p3g, p3h = _halves(p3.to(gl.int32, bitcast=True))
        b01, _u0 = _halves(x01)
        b23, _u1 = _halves(x23)
        b45, _u2 = _halves(x45)
        b67, _u3 = _halves(x67)
        if XS or FRAG:  # B = (pairs 01, 23) / (45, 67): adjacent registers of one 16-byte shared load, no moves
            acc0, acc1, acc2, acc3 = _mma(acc0, acc1, acc2, acc3, p0g, p0h, p2g, p2h, b01, b23)
            acc0, acc1, acc2, acc3 = _mma(acc0, acc1, acc2, acc3, p1g, p1h, p3g, p3h, b45, b67)
        else:
            acc0, acc1, acc2, acc3 = _mma(acc0, acc1, acc2, acc3, p0g, p0h, p1g, p1h, b01, b45)
            acc0, acc1, acc2, acc3 = _mma(acc0, acc1, acc2, acc3, p2g, p2h, p3g, p3h, b23, b67)

    return acc0, acc1, acc2, acc3


# FRAG (WF 2): fragment-ordered nvfp4 words (layout.py), 4 consumer warps. Thread (g, t) of warp w takes, for each
# 16-row group m and u, i in 0..1, the word of lane (g, t) and 16-K slice 4 w + 2 u + i: rows 16 m + g, + 8 at
# K 2t (+1), 2t + 8 (+1) of the slice, i.e. one mma.sync A fragment (a0..a3 = pairs h + 2 kh) as it is. The word
# sits at m * 512 + w * 128 + (4 g + t) * 4 + 2 u + i of the tile (4 x 16 bytes per thread per step), its two scales
# (rows 16 m + g and + 8, slice 4 w + 2 u + i) at byte (16 m + 8 h + g) * 16 + 4 w + 2 u + i of the stage's scales.
# Element (m, i) of the accumulators then runs two MMAs (u = 0, 1) over slices 4 w + i, + 2 with the same rows and
# lanes as the rows order's, so the epilogues are shared. Register bases below: i, u, (h,) m; lanes t, g; warps w.
_FRAG_W2 = gl.constexpr(gl.DistributedLinearLayout(  # the stage's words [64, 32], flat = the tile's word order
    [[0, 1], [0, 2], [16, 0], [32, 0]], [[0, 4], [0, 8], [0, 16], [1, 0], [2, 0]], [[4, 0], [8, 0]], [], [64, 32]))
_FRAG_S2 = gl.constexpr(gl.DistributedLinearLayout(  # the stage's FP8 scales [64, 16]: lanes t read the same bytes
    [[0, 1], [0, 2], [8, 0], [16, 0], [32, 0]], [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]], [[0, 4], [0, 8]], [],
    [64, 16]))
_FRAG_P6 = gl.constexpr(gl.DistributedLinearLayout(  # the words as [m 4, g 8, w 4, t 4, u 2, i 2]
    [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]],
    [[0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 0, 0], [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 4, 0, 0, 0, 0]],
    [[0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0]], [], [4, 8, 4, 4, 2, 2]))
_FT = gl.constexpr(layout.FRAG_TARGET)
_FR1 = gl.constexpr(layout.FRAG_ROT[1])
_FR2 = gl.constexpr(layout.FRAG_ROT[2])


@gluon.jit
def _mul2_half(p, s2, half: gl.constexpr):
    """bf16x2 p times the low (half "l") or high ("h") bf16 of s2 in both halves."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; .reg .b32 s; mov.b32 {l, h}, $2; mov.b32 s, {" + half + ", " + half + "}; "
        "mul.rn.bf16x2 $0, $1, s; }", "=r,r,r", [p, s2], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _frag_split(p, CZ: gl.constexpr):
    """[m, g, w, t, u, i] -> its u = 0 / 1 halves [m, g, 16 (sc = 4 w + t), i] in the accumulators' layout CZ."""
    q = gl.reshape(gl.permute(p.to(gl.int32, bitcast=True), (0, 1, 2, 3, 5, 4)), [4, 8, 16, 2, 2])
    a, b = gl.split(q)
    return gl.convert_layout(a, CZ, assert_trivial=True), gl.convert_layout(b, CZ, assert_trivial=True)


@gluon.jit
def _frag_operands(w2, s2d, SBITS: gl.constexpr, CZ: gl.constexpr):
    """FRAG: a stage's words [64, 32] (_FRAG_W2) and scales [64, 16] (_FRAG_S2) -> the A registers of the two
    MMAs of every element: (a0, a1, a2, a3) for u = 0, then for u = 1, each [4, 8, 16, 2] in CZ. Decode: rwg's
    (layout.frag_decode_reference), 9 integer ops and 4 bf16x2 multiplies per word; 2 ops per scale, two scales
    per word (rows g and g + 8)."""
    u = gl.convert_layout(gl.permute(gl.reshape(w2, [4, 4, 8, 4, 2, 2]), (0, 2, 1, 3, 4, 5)), _FRAG_P6,
                          assert_trivial=True).to(gl.uint32, bitcast=True)
    sv = gl.permute(gl.reshape(s2d, [4, 2, 8, 4, 2, 2]), (0, 2, 3, 4, 5, 1))  # [m, g, w, u, i, h]
    s_lo, s_hi = gl.split(sv)
    SL: gl.constexpr = gl.SliceLayout(3, _FRAG_P6)
    s_lo = gl.convert_layout(s_lo, SL, assert_trivial=True)
    s_hi = gl.convert_layout(s_hi, SL, assert_trivial=True)
    if SBITS and FRAG_SCALE_PAIRS:
        s01 = gl.expand_dims(_scale_pairs(s_lo.to(gl.uint8, bitcast=True), s_hi.to(gl.uint8, bitcast=True)), 3)
        a0 = _mul2_half(u & _FT, s01, "l")  # pair h + 2 kh = 0: row g, K 2t
        a1 = _mul2_half(_rotr(u, _FR1) & _FT, s01, "h")  # 1: row g + 8, K 2t
        a2 = _mul2_half(_rotr(u, _FR2) & _FT, s01, "l")  # 2: row g, K 2t + 8
        a3 = _mul2_half((_rotr(u, 6) & 0x81808180) | (_rotr(u, 30) & 0x00400040), s01, "h")  # 3: row g + 8, K 2t + 8
    else:
        s0 = gl.expand_dims(_nv_scale2(s_lo, SBITS), 3)  # rows g
        s1 = gl.expand_dims(_nv_scale2(s_hi, SBITS), 3)  # rows g + 8
        a0 = _mul2(u & _FT, s0)
        a1 = _mul2(_rotr(u, _FR1) & _FT, s1)
        a2 = _mul2(_rotr(u, _FR2) & _FT, s0)
        a3 = _mul2((_rotr(u, 6) & 0x81808180) | (_rotr(u, 30) & 0x00400040), s1)
    a0u0, a0u1 = _frag_split(a0, CZ)
    a1u0, a1u1 = _frag_split(a1, CZ)
    a2u0, a2u1 = _frag_split(a2, CZ)
    a3u0, a3u1 = _frag_split(a3, CZ)
    return a0u0, a1u0, a2u0, a3u0, a0u1, a1u1, a2u1, a3u1


@gluon.jit
def _decode_nv(words, s2d, L5: gl.constexpr, SBITS: gl.constexpr):
    """nvfp4: a stage's words [4, 2, 8, 16, 2] (in L5) and FP8 scales [64, 16] (L2S) -> P0..P3 = q * s * 2^-J
    as bf16x2 (one FP8 scale per two words of a thread)."""
    sraw = gl.convert_layout(gl.reshape(s2d, [4, 2, 8, 16]), gl.SliceLayout(4, L5), assert_trivial=True)
    s2 = gl.expand_dims(_nv_scale2(sraw, SBITS), 4)  # [4, 2, 8, 16, 1]: the scale in both halves
    p0 = _mul2((words & _KM) | (_rotr(words, _S0) & _KS), s2)
    p1 = _mul2(_rotr(words, _R1) & _KA, s2)
    p2 = _mul2(_rotr(words, _R2) & _KA, s2)
    p3 = _mul2((_rotr(words, _R3) & _KM) | (_rotr(words, _S3) & _KS), s2)
    return p0, p1, p2, p3


@gluon.jit
def _mx_mul(q, s2, L5: gl.constexpr):
    """mxfp4: q [4, 2, 8, 16 sc, 2 i] times its E8M0 multiplier s2 [4, 2, 8, 8, 1], which word column
    c = 2 sc + i shares with the three others of its 32 weights (scale j = c // 4 = sc // 2): q viewed as
    [4, 2, 8, 8 j, 4 (sc % 2, i)] (a register rename), multiplied, viewed back in L5."""
    p = _mul2(gl.reshape(q, [4, 2, 8, 8, 4]), s2)
    return gl.convert_layout(gl.reshape(p, [4, 2, 8, 16, 2]), L5, assert_trivial=True)


@gluon.jit
def _decode_mx(words, s2d, EB, L5: gl.constexpr, SBITS: gl.constexpr):
    """mxfp4: a stage's words [4, 2, 8, 16, 2] (in L5) and E8M0 scales (the tile's 64 x 8 bytes as the [32, 16]
    TMA box, read in `_layouts_mx`'s layout: lanes t and t ^ 1 read the same byte) -> P0..P3 = q * s * 2^-J as
    bf16x2, s * 2^(126 - J) = 2^(e + EB - 127) as w4a16_triton._scales computes it (exp2 of an exact integer), or
    with SBITS (prepare's mxfp4 `scale_bits`: every e + EB in 1..254) as the bf16 bits (e + EB) << 7."""
    q0 = (words & _KM) | (_rotr(words, _S0) & _KS)
    q8 = gl.reshape(q0, [4, 2, 8, 8, 4])
    e = gl.convert_layout(gl.reshape(s2d, [4, 2, 8, 8]), gl.SliceLayout(4, q8.type.layout), assert_trivial=True)
    if SBITS:
        s2 = gl.expand_dims((((e.to(gl.uint8, bitcast=True).to(gl.int32) + EB) << 7) * 0x10001).to(gl.uint32,
                                                                                                      bitcast=True), 4)
    else:
        s = gl.exp2(e.to(gl.uint8, bitcast=True).to(gl.float32) + (EB - 127)).to(gl.bfloat16)
        s16 = s.to(gl.uint16, bitcast=True).to(gl.uint32)
        s2 = gl.expand_dims(s16 | (s16 << 16), 4)  # [4, 2, 8, 8, 1]: the scale in both halves
    p0 = _mx_mul(q0, s2, L5)
    p1 = _mx_mul(_rotr(words, _R1) & _KA, s2, L5)
    p2 = _mx_mul(_rotr(words, _R2) & _KA, s2, L5)
    p3 = _mx_mul((_rotr(words, _R3) & _KM) | (_rotr(words, _S3) & _KS), s2, L5)
    return p0, p1, p2, p3


@gluon.jit
def _block_epilogue(alpha_ptr, bias_ptr, alpha, b_lo, b_hi, red, c_ptr, ws_ptr, lock_ptr, stamp_ptr, acc0, acc1, acc2,
                    acc3, p, blk, M, N, k0, k1, S, NW, SP: gl.constexpr, HAS_BIAS: gl.constexpr, MT: gl.constexpr,
                    STAMP: gl.constexpr, HOIST: gl.constexpr, EPI: gl.constexpr, rows, sc5, zero5, LR: gl.constexpr,
                    LR3: gl.constexpr, LRED: gl.constexpr, LRED1: gl.constexpr, GLU: gl.constexpr = False,
                    glu_buf=None, FOLD: gl.constexpr = 0, h_ptr=None, hout_ptr=None, nw_ptr=None, ss_ptr=None,
                    dl_ptr=None, dflag_ptr=None, sig_ptr=None, DT=0, SYNC: gl.constexpr = False, lx=None,
                    LEXP: gl.constexpr = 0, CL: gl.constexpr = 0):
    """The split schedule's epilogue: one row block, K slice [k0, k1) of S (CL > 0: the block's S = CL
    programs are one cluster, fixed up through the leader's shared memory; EPI only)."""
    if STAMP:
        _stamp(stamp_ptr, p, 2, "clock64")
    if not HOIST:  # (A/B switch) the constants loaded after the main loop, as before HOIST
        alpha, b_lo, b_hi = _tile_consts(alpha_ptr, bias_ptr, blk, N, rows, HAS_BIAS, not EPI)
    if MT == 1 and EPI:
        _epilogue_smem1(alpha, b_lo, red, c_ptr, ws_ptr, lock_ptr, acc0, acc2, p, blk, N, k0, k1, S, SP, HAS_BIAS,
                        LRED1, False, 0, 0, NW, CL)
    elif MT == 1:
        # acc0 (= acc1): row 16m + g, acc2 (= acc3): row 16m + 8 + g, for every lane t of the quad
        # (all B columns equal x): keep lane t = 0 (sc % 4 == 0), sum the word columns and the warps.
        sc4, _u4 = _halves(sc5 + zero5)
        keep = (sc4 % 4) == 0
        lo = gl.sum(gl.sum(gl.where(keep, acc0, 0.0), axis=3), axis=2)  # [m, g]
        hi = gl.sum(gl.sum(gl.where(keep, acc2, 0.0), axis=3), axis=2)
        lo = gl.convert_layout(gl.permute(lo, (1, 0)), LR)  # [g, m]
        hi = gl.convert_layout(gl.permute(hi, (1, 0)), LR)
        rows_lo = rows  # [8, 4]: g + 16m
        rows_hi = rows_lo + 8
        done = k1 > k0
        if S > 1:
            gl.store(ws_ptr + p * 64 + rows_lo, lo)
            gl.store(ws_ptr + p * 64 + rows_hi, hi)
            gl.thread_barrier()  # all threads' partials are written before the counter moves
            count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
            done = count == S - 1
            if done:
                lo = gl.zeros([8, 4], gl.float32, LR)
                hi = gl.zeros([8, 4], gl.float32, LR)
                for j in gl.static_range(SP):  # unrolled: all S loads in flight at once, summed in order
                    ok = (rows_lo >= 0) & (j < S)
                    lo += gl.load(ws_ptr + (blk * S + j) * 64 + rows_lo, mask=ok, other=0.0, cache_modifier=".cg")
                    hi += gl.load(ws_ptr + (blk * S + j) * 64 + rows_hi, mask=ok, other=0.0, cache_modifier=".cg")
                gl.atomic_xchg(lock_ptr + blk, 0)  # ready for the next launch
        if done:
            n_lo = blk * 64 + rows_lo
            n_hi = blk * 64 + rows_hi
            out_lo = lo * alpha
            out_hi = hi * alpha
            if HAS_BIAS:
                out_lo += b_lo
                out_hi += b_hi
            gl.store(c_ptr + n_lo, out_lo.to(gl.bfloat16), mask=n_lo < N)
            gl.store(c_ptr + n_hi, out_hi.to(gl.bfloat16), mask=n_hi < N)
    elif EPI:
        _epilogue_smem(alpha, b_lo, red, c_ptr, ws_ptr, lock_ptr, acc0, acc1, acc2, acc3,
                       p, blk, M, N, k0, k1, S, SP, HAS_BIAS, LRED, False, 0, 0, NW, GLU, glu_buf,
                       FOLD, h_ptr, hout_ptr, nw_ptr, ss_ptr, dl_ptr, dflag_ptr, sig_ptr, DT, SYNC, lx, LEXP, CL)
    else:
        _epilogue_tokens(alpha, b_lo, b_hi, c_ptr, ws_ptr, lock_ptr, acc0, acc1, acc2, acc3,
                         p, blk, M, N, k0, k1, S, SP, HAS_BIAS, LR3)


@gluon.jit
def _per_token(acc):
    """[4 m, 8 g, 16 sc, 2 i] accumulators (sc = 4w + t) -> [4 m, 8 g, 4 t]: summed over the warps'
    word columns w and the two words i of a thread (the K slots those MMAs covered)."""
    return gl.sum(gl.sum(gl.reshape(acc, [4, 8, 4, 4, 2]), axis=4), axis=2)


@gluon.jit
def _epilogue_tokens(alpha, b_lo, b_hi, c_ptr, ws_ptr, lock_ptr, acc0, acc1, acc2, acc3,
                     p, blk, M, N, k0, k1, S, SP: gl.constexpr, HAS_BIAS: gl.constexpr, LR3: gl.constexpr):
    """MT = 8: C of an m16n8k16 MMA holds rows g / g + 8 (acc0, acc1 / acc2, acc3) and tokens 2t,
    2t + 1 (acc0, acc2 / acc1, acc3) of thread (g, t). Reduce each to [m, g, t], then the same
    deterministic split fixup as M = 1 over a [8 tokens, 64 rows] fp32 workspace per program, and
    y[token, row] for token < M."""
    v00 = gl.convert_layout(_per_token(acc0), LR3)
    v01 = gl.convert_layout(_per_token(acc1), LR3)
    v10 = gl.convert_layout(_per_token(acc2), LR3)
    v11 = gl.convert_layout(_per_token(acc3), LR3)
    row, tok = _lr3_rows(LR3)  # [4, 8, 1]: 16m + g; [1, 1, 4]: 2t
    o00 = tok * 64 + row  # workspace offsets [token, row] of the four
    o01 = o00 + 64
    o10 = o00 + 8
    o11 = o00 + 72
    done = k1 > k0
    if S > 1:
        base = ws_ptr + p * 512
        gl.store(base + o00, v00)
        gl.store(base + o01, v01)
        gl.store(base + o10, v10)
        gl.store(base + o11, v11)
        gl.thread_barrier()  # all threads' partials are written before the counter moves
        count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
        done = count == S - 1
        if done:
            v00 = gl.zeros([4, 8, 4], gl.float32, LR3)
            v01 = v00
            v10 = v00
            v11 = v00
            for j in gl.static_range(SP):  # unrolled: all S loads in flight at once, summed in order
                ok = (o00 >= 0) & (j < S)
                base = ws_ptr + (blk * S + j) * 512
                v00 += gl.load(base + o00, mask=ok, other=0.0, cache_modifier=".cg")
                v01 += gl.load(base + o01, mask=ok, other=0.0, cache_modifier=".cg")
                v10 += gl.load(base + o10, mask=ok, other=0.0, cache_modifier=".cg")
                v11 += gl.load(base + o11, mask=ok, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(lock_ptr + blk, 0)  # ready for the next launch
    if done:
        _store_tokens(c_ptr, b_lo, v00 * alpha, tok, blk * 64 + row, M, N, HAS_BIAS)
        _store_tokens(c_ptr, b_lo, v01 * alpha, tok + 1, blk * 64 + row, M, N, HAS_BIAS)
        _store_tokens(c_ptr, b_hi, v10 * alpha, tok, blk * 64 + 8 + row, M, N, HAS_BIAS)
        _store_tokens(c_ptr, b_hi, v11 * alpha, tok + 1, blk * 64 + 8 + row, M, N, HAS_BIAS)


@gluon.jit
def _epilogue_smem(alpha, bias, red, c_ptr, ws_ptr, lock_ptr, acc0, acc1, acc2, acc3,
                   p, blk, M, N, k0, k1, S, SP: gl.constexpr, HAS_BIAS: gl.constexpr, LRED: gl.constexpr,
                   SK: gl.constexpr, f0, KB, NW, GLU: gl.constexpr = False, glu_buf=None, FOLD: gl.constexpr = 0,
                   h_ptr=None, hout_ptr=None, nw_ptr=None, ss_ptr=None, dl_ptr=None, dflag_ptr=None, sig_ptr=None,
                   DT=0, SYNC: gl.constexpr = False, lx=None, LEXP: gl.constexpr = 0, CL: gl.constexpr = 0):
    """MT = 8 through shared memory (EPI): each thread sums its two words i, writes its 16 partials
    [m, b, h] of warp w to `red` [4 m, 4 w, 8 g, 4 t, 2 b, 2 h] (16-byte rows, no bank conflict), one
    barrier, and reads back the four warps' values of its own (m, g, t) to sum them in registers:
    one shared-memory round trip instead of a cross-warp reduction and a layout change per
    accumulator. Then the split fixup and y[token, row] as `_epilogue_tokens`, with row 16m + 8h + g
    and token 2t + b (acc0 / acc1: b = 0 / 1, h = 0; acc2 / acc3: h = 1)."""
    v = gl.join(gl.join(gl.sum(acc0, axis=3), gl.sum(acc1, axis=3)),
                gl.join(gl.sum(acc2, axis=3), gl.sum(acc3, axis=3)))  # [4 m, 8 g, 16 sc, 2 b, 2 h]
    red.store(gl.permute(gl.reshape(v, [4, 8, 4, 4, 2, 2]), (0, 2, 1, 3, 4, 5)))  # sc = 4w + t
    gl.thread_barrier()
    part = gl.sum(red.load(LRED), axis=1)  # [4 m, 8 g, 4 t, 2 b, 2 h]
    row, tok = _red_idx(gl.SliceLayout(1, LRED))
    n = blk * 64 + row
    _fixup_store(part, tok * 64 + row, 512, c_ptr, tok * N + n, (n < N) & (tok < M), alpha, bias, ws_ptr, lock_ptr,
                 p, blk, N, k0, k1, S, SP, HAS_BIAS, SK, f0, KB, NW, GLU, glu_buf, M, FOLD, h_ptr, hout_ptr, nw_ptr,
                 ss_ptr, tok, n, dl_ptr, dflag_ptr, sig_ptr, DT, SYNC, lx, LEXP, CL)


@gluon.jit
def _epilogue_smem1(alpha, bias, red, c_ptr, ws_ptr, lock_ptr, acc0, acc2, p, blk, N, k0, k1, S,
                    SP: gl.constexpr, HAS_BIAS: gl.constexpr, LRED1: gl.constexpr, SK: gl.constexpr, f0, KB,
                    NW, CL: gl.constexpr = 0):
    """MT = 1 through shared memory (EPI): every B column holds x, so every lane t of a quad has the
    same sums. Each thread sums its two words i and writes its [m, h] partials to `red`
    [4 t, 4 m, 4 w, 8 g, 2 h]; one barrier; the t = 0 slice is read back with the four warps' values
    of a row in one thread and summed there (row 16m + 8h + g; acc0: h = 0, acc2: h = 1)."""
    v = gl.join(gl.sum(acc0, axis=3), gl.sum(acc2, axis=3))  # [4 m, 8 g, 16 sc, 2 h]
    red.store(gl.permute(gl.reshape(v, [4, 8, 4, 4, 2]), (3, 0, 2, 1, 4)))  # sc = 4w + t
    gl.thread_barrier()
    part = gl.sum(gl.sum(red.slice(0, 1).load(LRED1), axis=2), axis=0)  # t = 0: [4 m, 8 g, 2 h]
    row = _red_idx1(gl.SliceLayout(0, gl.SliceLayout(2, LRED1)))
    n = blk * 64 + row
    _fixup_store(part, row, 64, c_ptr, n, n < N, alpha, bias, ws_ptr, lock_ptr, p, blk, N, k0, k1, S, SP, HAS_BIAS,
                 SK, f0, KB, NW, CL=CL)


@gluon.jit
def _sk_start(q, T):
    """Stream-K: the first flat step of program q of P (= the grid): q * T // P (int32: the host
    keeps T * P below 2^31)."""
    return q * T // gl.num_programs(0)


@gluon.jit
def _sk_owner(f, T):
    """Stream-K: the program whose flat steps [q T / P, (q + 1) T / P) hold flat step f."""
    return ((f + 1) * gl.num_programs(0) - 1) // T


@gluon.jit
def _split_sum(part, off, WS: gl.constexpr, ws_ptr, lock_ptr, slot, blk, q0, nq, SP: gl.constexpr, SK: gl.constexpr, T,
               KB, CL: gl.constexpr = 0):
    """Write this program's partial to workspace slot `slot`, count the arrival on the block's
    counter; the last of the block's nq programs (q0 ..) sums all partials in program order
    (all loads in flight at once) and resets the counter -> (sum or own partial, last?).
    CL > 0: the block's nq = CL programs are one cluster and the fixup goes through the leader's
    shared memory instead (qerl/kernels/ptx_cluster.py; the leader, slot q0, sums in the same order)."""
    if CL > 0:
        return ptx_cluster.split_sum(part, off, slot - q0, CL, WS)
    gl.store(ws_ptr + slot * WS + off, part)
    gl.thread_barrier()  # all threads' partials are written before the counter moves
    count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
    done = count == nq - 1
    if done:
        part = gl.zeros_like(part)
        for j in gl.static_range(SP):  # unrolled: all loads in flight at once, summed in program order
            q = q0 + j
            if SK:  # slot 2q + 1 unless this block is where q's range starts
                sq = 2 * q + (_sk_start(q, T) // KB != blk).to(gl.int32)
            else:
                sq = q
            part += gl.load(ws_ptr + sq * WS + off, mask=(off >= 0) & (j < nq), other=0.0, cache_modifier=".cg")
        gl.atomic_xchg(lock_ptr + blk, 0)  # ready for the next launch
    return part, done


@gluon.jit
def _fixup_store(part, off, WS: gl.constexpr, c_ptr, c_off, c_mask, alpha, bias, ws_ptr, lock_ptr, p, blk, N, k0, k1,
                 S, SP: gl.constexpr, HAS_BIAS: gl.constexpr, SK: gl.constexpr, f0, KB, NW, GLU: gl.constexpr = False,
                 glu_buf=None, M=0, FOLD: gl.constexpr = 0, h_ptr=None, hout_ptr=None, nw_ptr=None, ss_ptr=None,
                 tok=None, ncol=None, dl_ptr=None, dflag_ptr=None, sig_ptr=None, DT=0, SYNC: gl.constexpr = False,
                 lx=None, LEXP: gl.constexpr = 0, CL: gl.constexpr = 0):
    """Split fixup and output of the shared-memory epilogues. A row block covered by several
    programs: each writes its partial to its WS-float workspace slot at `off`, and the last
    arrival sums all partials in program order (deterministic; all loads in flight at once) and
    resets the counter; then y = part * alpha (+ bias) in bf16 at c_off where c_mask.
    Split schedule: the block's programs are blk * S .. blk * S + S - 1, slot = program; with a
    split tail (TAIL) blocks below NW have one program each and block blk >= NW has programs
    NW + (blk - NW) S .. + S - 1.
    Stream-K (SK): this segment covers steps [k0, k1) of block blk (a program's first segment
    starts at its flat step f0); the block's programs are owner(blk KB) .. owner(blk KB + KB - 1)
    and program q keeps the partial of its first segment in slot 2q, of its last in slot 2q + 1.
    SYNC (GLU or FOLD == 1; the rollout engine's resident LoRA kernel, qerl/kernels/lora_resident.py):
    the block's writer waits until the int32 at dflag_ptr reaches DT (the LoRA delta [M, N] at dl_ptr,
    row stride N, is written), adds the delta to the product before the GLU / residual, and after
    its stores adds one at sig_ptr (the block is out: the kernel reading this output waits for N / 64).
    LEXP > 0 (the rank; SYNC with an `Expand`): the writer computes the delta itself instead of reading
    it, `_lora_expand` (dl_ptr: the fp32 shrink sums h; lx: B, the segment bounds, h's row stride,
    alpha), and adds it to the fp32 sum before alpha, so it takes the GLU, the residual add or a plain
    store alike."""
    done = k1 > k0
    if SK:
        T = gl.cdiv(N, 64) * KB
        q0 = _sk_owner(blk * KB, T)
        if (k0 > 0) | (k1 < KB):  # a segment of the block
            part, done = _split_sum(part, off, WS, ws_ptr, lock_ptr, 2 * p + (blk * KB + k0 != f0).to(gl.int32), blk,
                                    q0, _sk_owner(blk * KB + KB - 1, T) - q0 + 1, SP, SK, T, KB)
    elif S > 1:
        if blk >= NW:
            part, done = _split_sum(part, off, WS, ws_ptr, lock_ptr, p, blk, NW + (blk - NW) * S, S, SP, SK, 0, 0, CL)
    if done:
        if LEXP > 0:  # (SYNC) the LoRA delta of this block, computed here once the shrink's sums are in
            part = _lora_expand(part, ncol - blk * 64, tok, blk, M, N, dl_ptr, lx, dflag_ptr, DT, SYNC - 1, LEXP, GLU)
        out = part * alpha
        if HAS_BIAS:
            out += bias
        if SYNC and LEXP == 0:  # (SYNC - 1: ns naps between the wait's polls, SYNC_NAP)
            _wait_flag(dflag_ptr, DT, SYNC - 1)
        if GLU:
            _glu_store(out.to(gl.bfloat16).to(gl.float32), glu_buf, c_ptr, blk, M, N // 2, dl_ptr, SYNC and LEXP == 0)
        elif FOLD == 1:
            y = out.to(gl.bfloat16)
            if SYNC and LEXP == 0:  # as add_rms_norm's extra: the delta added to the product in bf16 before the residual
                y = (y.to(gl.float32) + gl.load(dl_ptr + c_off, mask=c_mask, other=0.0, cache_modifier=".cg")
                     .to(gl.float32)).to(gl.bfloat16)
            _fold_residual(y, c_ptr, c_off, c_mask, h_ptr, hout_ptr, nw_ptr, ss_ptr, blk, M, N, tok, ncol)
        else:
            gl.store(c_ptr + c_off, out.to(gl.bfloat16), mask=c_mask)
        if SYNC:
            gl.thread_barrier()  # every thread's stores before the count
            gl.atomic_add(sig_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _lora_ids(row, tok):
    """From the MT = 8 epilogue's rows 16m + 8h + g and tokens 2t + b (`_red_idx`): (m, g, t) as [4, 8, 4]
    tensors, one element per thread, in the layout of the (h, b) = (0, 0) part of its [4 m, 8 g, 4 t, 2 b,
    2 h] tiles (two gl.split): the C fragment of warp m's m16n8k16 MMA, thread (g, t) holding rows g and
    g + 8 and columns 2t and 2t + 1."""
    r0, _r1 = gl.split(row + tok * 0)
    r00, _r01 = gl.split(r0)
    q0, _q1 = gl.split(tok + row * 0)
    q00, _q01 = gl.split(q0)
    return r00 // 16, r00 % 8, q00 // 2


@gluon.jit
def _bf16x2(lo, hi):
    """Two fp32 tensors -> int32 holding (bf16(lo), bf16(hi)): one 32-bit MMA operand register."""
    lb = lo.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
    hb = hi.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
    return (lb | (hb << 16)).to(gl.int32, bitcast=True)


@gluon.jit
def _lora_afrag(lb_ptr, n0, g, t, KSI: gl.constexpr, LRANK: gl.constexpr):
    """The m16n8k16 A fragment of K step KSI of the expand: thread (g, t) holds B rows n0 + g / n0 + g + 8
    at rank pairs 8 KSI + t / + 4 (B [N, LRANK] bf16 read as int32 pairs); zeros past the rank."""
    z = g * 0
    if KSI < LRANK // 16:
        RW: gl.constexpr = LRANK // 2
        bl = lb_ptr + (n0 + g) * RW + t + KSI * 8
        return gl.load(bl), gl.load(bl + 8 * RW), gl.load(bl + 4), gl.load(bl + 8 * RW + 4)
    return z, z, z, z


@gluon.jit
def _lora_kstep(c0, c1, c2, c3, hk, hm, a0, a1, a2, a3, KSI: gl.constexpr, LRANK: gl.constexpr):
    """One K step of the expand: h[token g, 16 KSI + 2t ..] (fp32, rounded to bf16) as the MMA's B."""
    if KSI < LRANK // 16:
        h0 = gl.load(hk + KSI * 16, mask=hm, other=0.0, cache_modifier=".cg")
        h1 = gl.load(hk + KSI * 16 + 1, mask=hm, other=0.0, cache_modifier=".cg")
        h8 = gl.load(hk + KSI * 16 + 8, mask=hm, other=0.0, cache_modifier=".cg")
        h9 = gl.load(hk + KSI * 16 + 9, mask=hm, other=0.0, cache_modifier=".cg")
        c0, c1, c2, c3 = _mma(c0, c1, c2, c3, a0, a1, a2, a3, _bf16x2(h0, h1), _bf16x2(h8, h9))
    return c0, c1, c2, c3


@gluon.jit
def _lora_expand(part, row, tok, blk, M, N, h_ptr, lx, flag_ptr, target, NAP: gl.constexpr, LRANK: gl.constexpr,
                 GLU: gl.constexpr):
    """SYNC with LEXP = LRANK (the rollout engine's resident LoRA kernel sums the shrink, this GEMV expands):
    part [4 m, 8 g, 4 t, 2 b, 2 h] (rows 16m + 8h + g of block blk, tokens 2t + b, before alpha) plus the
    block's delta over alpha, sum_j bf16(h[tok, seg LRANK + j]) B[n, j] / alpha, as warp m's m16n8k16 MMAs
    (rank / 16 K steps): A = 16 rows of B, B = h^T. B's fragments are loaded before the wait for the
    shrink's sums (int32 at flag_ptr reaching target), h after it. lx = (B as int32 pairs, n1, n2: the
    segment bounds, h's row stride, alpha's pointer). Over alpha because the caller multiplies by alpha,
    and with SCALE by the token's RMS scale, which h, made from the unscaled x, needs too. GLU: warps 0-1
    hold gate rows 32 blk + .., warps 2-3 up rows N / 2 + 32 blk + .. (`glu_descriptors`)."""
    m, g, t = _lora_ids(row, tok)
    if GLU:
        n0 = gl.where(m < 2, blk * 32 + 16 * m, N // 2 + blk * 32 + 16 * (m - 2))
    else:
        n0 = blk * 64 + 16 * m
    lb_ptr = lx[0]
    a00, a01, a02, a03 = _lora_afrag(lb_ptr, n0, g, t, 0, LRANK)
    a10, a11, a12, a13 = _lora_afrag(lb_ptr, n0, g, t, 1, LRANK)
    a20, a21, a22, a23 = _lora_afrag(lb_ptr, n0, g, t, 2, LRANK)
    a30, a31, a32, a33 = _lora_afrag(lb_ptr, n0, g, t, 3, LRANK)
    r = 1.0 / gl.load(lx[4])
    _wait_flag(flag_ptr, target, NAP)
    seg = (n0 >= lx[1]).to(gl.int32) + (n0 >= lx[2]).to(gl.int32)
    hk = h_ptr + g * lx[3] + seg * LRANK + 2 * t
    hm = g < M
    c0 = (g * 0).to(gl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    c0, c1, c2, c3 = _lora_kstep(c0, c1, c2, c3, hk, hm, a00, a01, a02, a03, 0, LRANK)
    c0, c1, c2, c3 = _lora_kstep(c0, c1, c2, c3, hk, hm, a10, a11, a12, a13, 1, LRANK)
    c0, c1, c2, c3 = _lora_kstep(c0, c1, c2, c3, hk, hm, a20, a21, a22, a23, 2, LRANK)
    c0, c1, c2, c3 = _lora_kstep(c0, c1, c2, c3, hk, hm, a30, a31, a32, a33, 3, LRANK)
    p0, p1 = gl.split(part)  # h = 0 / 1
    p00, p01 = gl.split(p0)  # b = 0 / 1
    p10, p11 = gl.split(p1)
    return gl.join(gl.join(p00 + c0 * r, p01 + c1 * r), gl.join(p10 + c2 * r, p11 + c3 * r))


@gluon.jit
def _wait_flag(ptr, target, NAP: gl.constexpr):
    # SYNC: until the int32 at ptr reaches target: volatile polls, then an acquire whose value is used
    # (qerl/kernels/device_wait.py's wait_count, in Gluon). NAP > 0: each failed poll first naps about
    # NAP ns (PTX nanosleep), so the waiting warps leave the SM's issue slots to the kernels beside them
    # (the resident LoRA kernel computing this very delta among them)
    done = gl.load(ptr, volatile=True)
    while done < target:
        if NAP > 0:
            gl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, 0;", "=r,r", [done * 0 + NAP], dtype=gl.int32,
                                      is_pure=False, pack=1)
        done = gl.load(ptr, volatile=True)
    done = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while done < target:
        done = gl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@gluon.jit
def _fold_residual(y, c_ptr, c_off, c_mask, h_ptr, hout_ptr, nw_ptr, ss_ptr, blk, M, N, tok, ncol):
    """RES (NORM_FOLD, MT = 8): the block's bf16 outputs y [4 m, 8 g, 4 t, 2 b, 2 h] (token tok, column
    ncol) as decode_ops.add_rms_norm's residual add would take them: r = bf16(h + y) to hout, bf16(r
    w) to the output (w: the next RMSNorm's weight), and per token the block's fp32 sum of r^2 (its 64
    columns) to ss[blk, token], which the GEMV reading bf16(r w) turns into the norm's scale (SCALE)."""
    r = (gl.load(h_ptr + c_off, mask=c_mask, other=0.0).to(gl.float32) + y.to(gl.float32)).to(gl.bfloat16)
    gl.store(hout_ptr + c_off, r, mask=c_mask)
    rf = r.to(gl.float32)
    w = gl.load(nw_ptr + ncol, mask=ncol < N, other=0.0).to(gl.float32)
    gl.store(c_ptr + c_off, (rf * w).to(gl.bfloat16), mask=c_mask)
    sq = gl.where(c_mask, rf * rf, 0.0)
    part = gl.sum(gl.sum(gl.sum(sq, axis=4, keep_dims=True), axis=1, keep_dims=True), axis=0, keep_dims=True)
    gl.store(ss_ptr + blk * 8 + tok, part, mask=tok < M)


@gluon.jit
def _fold_scale(ss_ptr, NSS, eps, KN, LRED: gl.constexpr, SSP: gl.constexpr):
    """SCALE (NORM_FOLD, MT = 8): each token's RMSNorm scale 1 / sqrt(sum of the NSS partial sums
    ss[j, token] / KN + eps), as [1, 1, 4, 2, 1] (token 2t + b) in the epilogue's layout: one [SSP, 8]
    load (all in flight at once), summed over the blocks, then the 8 values moved into that layout."""
    LS: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [gl.num_warps(), 1], [1, 0])
    j = gl.arange(0, SSP, layout=gl.SliceLayout(1, LS))
    t = gl.arange(0, 8, layout=gl.SliceLayout(0, LS))
    v = gl.load(ss_ptr + gl.expand_dims(j, 1) * 8 + gl.expand_dims(t, 0),
                mask=gl.expand_dims(j < NSS, 1) & gl.expand_dims(t >= 0, 0), other=0.0)
    inv = 1.0 / gl.sqrt(gl.sum(v, axis=0) / KN + eps)  # [8]: token
    return gl.convert_layout(gl.reshape(inv, [1, 1, 4, 2, 1]), gl.SliceLayout(1, LRED))


@gluon.jit
def _glu_store(out, glu_buf, c_ptr, blk, M, NI, dl_ptr=None, SYNC: gl.constexpr = False):
    """GLU (MT = 8): `out` [4 m, 8 g, 4 t, 2 b, 2 h] holds pair block blk's gate rows (m = 0, 1: row
    16m + 8h + g) and up rows (m = 2, 3), as bf16 values, one warp per m. Through shared memory,
    each thread takes matching gate / up values and writes silu(gate) * up to y[token 2t + b,
    column 32 blk + 16m + 8h + g] of the [M, NI] output, rounded as decode_ops.silu_mul rounds (the
    silu in fp32 to bf16, the product to bf16). SYNC: the LoRA delta [M, 2 NI] at dl_ptr added to
    gate and up first, in bf16, as silu_mul's extra."""
    glu_buf.store(out)
    gl.thread_barrier()
    NWC: gl.constexpr = gl.num_warps()
    LG: gl.constexpr = gl.BlockedLayout([1, 1, 1, 1, 8 // NWC], [1, 8, 4, 1, 1], [2, 1, 1, 2, NWC // 4],
                                        [4, 3, 2, 1, 0])
    g = glu_buf.slice(0, 2).load(LG)
    u = glu_buf.slice(2, 2).load(LG)
    col, tok = _red_idx(LG, 2, blk * 32)
    ok = (tok < M) & (col < NI)
    if SYNC:
        d = dl_ptr + tok * (2 * NI) + col
        g = (g + gl.load(d, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)).to(gl.bfloat16).to(gl.float32)
        u = (u + gl.load(d + NI, mask=ok, other=0.0, cache_modifier=".cg").to(gl.float32)).to(gl.bfloat16).to(gl.float32)
    sg = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
    y = (sg * u).to(gl.bfloat16)
    gl.store(c_ptr + tok * NI + col, y, mask=ok)


@gluon.jit
def _store_tokens(c_ptr, b, v, tok, n, M, N, HAS_BIAS: gl.constexpr):
    ok = (n < N) & (tok < M)
    if HAS_BIAS:
        v += b
    gl.store(c_ptr + tok * N + n, v.to(gl.bfloat16), mask=ok)


@gluon.jit
def _gluon_gemv_kernel(xw_ptr, w_desc, s_desc, x_desc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, stamp_ptr,
                       h_ptr, hout_ptr, nw_ptr, ss_ptr, M, N, KB, S, NW, CS, NSS, eps, KN, EB, dl_ptr, dflag_ptr,
                       sig_ptr, DT, lb_ptr, LN1, LN2, LHS, SP: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, PDL: gl.constexpr,
                       MT: gl.constexpr, XPF: gl.constexpr, STAMP: gl.constexpr, HOIST: gl.constexpr,
                       EPI: gl.constexpr, PRODUCER_REGS: gl.constexpr, L5: gl.constexpr, L2W: gl.constexpr,
                       L2S: gl.constexpr, SK: gl.constexpr, TAIL: gl.constexpr, SBITS: gl.constexpr,
                       PWA: gl.constexpr, XS: gl.constexpr, LX: gl.constexpr, GLU: gl.constexpr,
                       FOLD: gl.constexpr, SSP: gl.constexpr, WF: gl.constexpr, SYNC: gl.constexpr,
                       LEXP: gl.constexpr, CL: gl.constexpr, num_warps: gl.constexpr):
    # PWA: each consumer warp frees a stage itself (empty barriers of num_warps arrivals, qerl/kernels/ptx_pwa.py)
    p, blk, k0, k1, trow0, w_bufs, s_bufs, ready, empty = _setup(w_desc, s_desc, KB, S, NUM_STAGES, PDL,
                                                                 num_warps if PWA else 1)
    if SK:  # stream-K: flat steps [k0, k1) of the (row block, K step) order; tile f sits at row f * 64
        T = gl.cdiv(N, 64) * KB
        k0 = _sk_start(p, T)
        k1 = _sk_start(p + 1, T)
        blk = k0 // KB
        trow0 = k0 * 0
    if TAIL:  # split tail: blocks below NW whole (one program each), block NW + i in S slices of CS steps
        if p >= NW:
            q = p - NW
            blk = NW + q // S
            k0 = (q - (q // S) * S) * CS
            k1 = gl.minimum(k0 + CS, KB)
        else:
            blk = p
            k0 = p * 0
            k1 = k0 + KB
        trow0 = blk * (KB * 64)
    if XS:  # x beside each weight stage (4 KB at MT = 8)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape, x_desc.layout)
    else:
        x_bufs = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if MT > 1 and EPI:  # the per-warp partials of the shared-memory epilogues (8 KB / 4 KB)
        red = gl.allocate_shared_memory(gl.float32, [4, 4, 8, 4, 2, 2],
                                        gl.SwizzledSharedLayout(1, 1, 1, [5, 4, 3, 2, 1, 0]))
    elif EPI:
        red = gl.allocate_shared_memory(gl.float32, [4, 4, 4, 8, 2], gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0]))
    else:
        red = gl.allocate_shared_memory(gl.float32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if GLU:  # a pair block's gate / up outputs [4 m, 8 g, 4 t, 2 b, 2 h] for `_glu_store` (2 KB)
        glu_buf = gl.allocate_shared_memory(gl.float32, [4, 8, 4, 2, 2],
                                            gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0]))
    else:
        glu_buf = red
    lx = (lb_ptr, LN1, LN2, LHS, alpha_ptr)  # LEXP: what the epilogue's expand reads besides h (`_lora_expand`)
    if CL > 0:  # the split fixup through the cluster's shared memory: ptx_cluster's entry code goes in
        ptx_cluster.mark()
    gl.warp_specialize([
        (_consumer, (xw_ptr, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, stamp_ptr, w_bufs, s_bufs, x_bufs, ready,
                     empty, p, blk, M, N, KB, k0, k1, S, NW, SP, NUM_STAGES, HAS_BIAS, PDL, MT, XPF, STAMP, HOIST, EPI,
                     SK, red, L5, L2W, L2S, SBITS, XS, LX, GLU, glu_buf, h_ptr, hout_ptr, nw_ptr, ss_ptr, NSS, eps,
                     KN, FOLD, SSP, EB, WF, dl_ptr, dflag_ptr, sig_ptr, DT, SYNC, lx, LEXP, CL, num_warps)),
        (_gluon_producer, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, trow0, k0, k1, KB, stamp_ptr,
                           p, NUM_STAGES, STAMP, XS, PDL, GLU)),
    ], [1], [PRODUCER_REGS])


# 6 stages x 9 KB and 64 registers: 4 programs (16 consumer warps) per SM by both limits (offline build)
# NUM_STAGES 3: best of 3 / 6 on the H100 (results/gemv_warp_specialised_mma.json)
# XPF: load each step's x one step ahead (section 16 of NOTES_w4a16.md); None = auto (xpf_auto)
# XS: x copied by the producer beside each weight stage (None = X_SMEM)
DEFAULT = dict(NUM_STAGES=3, num_warps=4, PER_SM=4, maxnreg=64, PRODUCER_REGS=24, PDL=None, XPF=None, PWA=None,
               XS=None, CLUSTER=None)
_RESIDENT: dict = {}
CLUSTERS: dict = {}  # compiled kernel's hash -> (cluster size, MT, the device's most co-resident clusters of it)
# alpha and the bias rows loaded before the PDL wait (the epilogue of the last-arriving program
# then waits on no load); False: after the main loop (the A/B switch of NOTES_rollout.md section 10)
HOIST_CONSTS = True
# the epilogue's cross-warp sum through one shared-memory round trip (`_epilogue_smem`, MT = 8;
# `_epilogue_smem1`, MT = 1); False: per-accumulator reductions and layout changes (the A/B switch)
EPI_SMEM = True
MAX_M = 8  # tokens per launch: the 8 columns of an m16n8k16 MMA
FORMATS = ("nvfp4", "mxfp4")  # what the kernel decodes (w4a16_triton.WSMMA_FORMATS: what the routing sends it)
# Schedules for layers with more 64-row blocks than program slots and a partial last wave (where
# `tail_plan` finds a split tail; e.g. the 7B gate/up GEMV on an H100), instead of the plain split:
# - split tail: the blocks of the last wave are cut into K slices, so they spread over all slots as
#   the first wave's programs finish (the hardware's block scheduler balances them); the default
#   for launches without PDL (standalone 7B gate/up 43.2 -> 34.7 us at M = 1, 43.6 -> 39.5 at M = 8).
# - stream-K: one program per slot, each an equal run of the flat (row block, K step) order; the
#   default inside PDL chains, where all its programs are resident from the start and copy their
#   first tiles before the wait (7B decode step +1.0% at b1, +1.5% at b8 over the split tail).
# TAIL_SPLIT / STREAMK: None = that rule (PDL read as w4a16_triton.CHAIN_ROUTING says, so a run
# without PDL can route as the chain does), True / False = forced / never (config keys override per
# call). Both need HOIST_CONSTS and EPI_SMEM. NOTES_w4a16.md section 18 has the measurements.
TAIL_SPLIT = None
STREAMK = None
# Stream-K plans this many program slots fewer than the planned slots (timing switch: a slot taken by
# another kernel's resident program delays one stream-K program by a whole program's run)
SK_SPARE = 0
# Program slots the launch plans around (split slices, split tail, stream-K programs): another kernel's
# programs resident beside it take them (the rollout engine's resident LoRA kernel: engine.LORA_RESIDENT_RESERVE
# sets this while it records a step with one). With 4 programs per SM filling the register file, each
# resident program costs one slot, so a launch planned for all of them runs its last programs as a second wave.
RESERVE = 0
# forward(sync=): each failed poll of the epilogue's wait for the delta first naps about this many ns
# (0: polls back to back); passed to the kernel as SYNC = 1 + SYNC_NAP (0: no sync). Ablation flag
# lres...:wNS; 200 / 1000 ns changed nothing (a177, NOTES_rollout.md section 53)
SYNC_NAP = 0
# ... and this many more for GLU launches (forward(glu=True)). The 7B gate/up GLU GEMV at M = 8 (592
# blocks, the only stream-K layer of the three models' decode steps) again had one program start
# ~20 us late (a90 clocks, `start_last` 29.7 us against 9.1 without GLU); 4 spare slots remove it
# (a91, same process: step 2.618 -> 2.586 ms; SK_SPARE = 8 on the two-launch form costs 1.2%).
SK_SPARE_GLU = 4
# Scales converted to the bf16 multiplier by integer arithmetic on layers whose scales are all
# normal (prepare's `scale_bits`; bit-identical there): 351 -> 320 SASS per main-loop step at M = 8
# offline (NOTES_w4a16.md section 18). False: the float conversion everywhere (the A/B switch).
SCALE_BITS = True
# XPF by rule at M = 2..8 (xpf_auto): x one step ahead where K >= this (0: never at M = 2..8)
XPF_TOKENS_MIN_K = 4096
# The split fixup through distributed shared memory (qerl/kernels/ptx_cluster.py): the S <= 8 programs of a
# row block launched as one cluster, the partials added in the leader's shared memory instead of through a
# global workspace and counter. Split schedule only (not the split tail or stream-K), where the clusters fit
# at once (`cluster_fits`). None = M = 1 launches in PDL chains (chain routing) on layers whose programs
# run at most CLUSTER_MAX_STEPS K steps each (the fixup's ~0.5 us only shows beside a short loop); True /
# False = wherever the clusters fit / never. Config key CLUSTER overrides per call. Measured (H100,
# NOTES_w4a16.md section 44): chained, 3584^2 M = 1 7.1 -> 6.4 us, 5120^2 10.6 -> 9.9, 1024 x 2048 4.1 -> 3.7,
# but 5120 x 13824 (9 steps) 19.5 -> 23.6; every single launch without PDL slower (M = 1 median over 11
# layers x1.76 -> x1.71); decode steps by this rule at batch 1 7B / 14B / 32B +0.8 / +1.6 / +0.9%, while
# the 2..8-token form (8 KB more shared memory a program) took 14B batch 8 1.7% slower.
CLUSTER_FIXUP = None
CLUSTER_MAX_STEPS = 4
# Per-warp release of the ring's stages (qerl/kernels/ptx_pwa.py): no CTA barrier in the main loop.
# None = on for M = 2..8 launches (MT = 8), off at M = 1; True / False = everywhere / never. Config key
# PWA overrides per call. Decode steps (a64, H100, same process): 7B b8 +0.6%, 14B b8 +1.3%; b1 within
# +-0.4%; standalone M = 1 mixed (55296x5120 +16%, 5120x27648 -9%). NOTES_w4a16.md section 22.
PER_WARP_ARRIVE = None
# x copied by the producer's TMA beside each weight tile (`_xs_producer`; XPF is then moot). None =
# `xs_auto`; True / False = everywhere / never. Config key XS overrides per call. Decode steps (a70-a76,
# H100, same process, XS on every layer vs none): batch 8 7B +0.1..0.6%, 14B +1.3..1.9%, 32B +3.4..3.5%;
# batch 1 7B +0.9%, 14B -1.0%, 32B +0.8%. NOTES_w4a16.md section 23.
X_SMEM = None


@contextlib.contextmanager
def defaults(**overrides):
    """DEFAULT with `overrides` for the launches made inside the block (host side; in a captured
    graph that is at capture). The rollout engine plans the GEMVs of LoRA groups with PER_SM=3."""
    global DEFAULT
    saved = DEFAULT
    DEFAULT = {**saved, **overrides}
    try:
        yield
    finally:
        DEFAULT = saved


def xpf_auto(mt: int, s: int, grid: int, slots: int, k: int = 0) -> bool:
    """XPF = None: x one step ahead for M = 1 launches of one K slice per row block that need
    more than one wave of programs (grid > per-SM programs x SMs), and for M = 2..8 launches with
    K >= XPF_TOKENS_MIN_K. M = 1 fit on the gate/up GEMVs of three models at batch 1
    (NOTES_rollout.md section 11, same-process A/B): 7B 37888x3584 (592 programs for 528 slots)
    +1.0%, 32B 55296x5120 (864) +1.3%, but 14B 27648x5120 (432, one wave) -0.7%; 32B down / q/k/v /
    o (S > 1) +-0. M = 2..8 (with per-warp stage release, NOTES_rollout.md section 21): every layer
    at batch 8 14B +1.9%, 32B +3.7%, 7B -0.5%."""
    if mt == 1:
        return s == 1 and grid > slots
    return 0 < XPF_TOKENS_MIN_K <= k


def xs_auto(mt: int, blocks: int, slots: int) -> bool:
    """XS = None: x beside the weight stages for M = 2..8 launches unless the layer is one wave of
    whole 64-row blocks (slots / 2 < blocks <= slots: one K slice per block, every program in step
    over K from the start), and for M = 1 launches of layers with more blocks than planned program
    slots (the launches where XPF's rule loads x ahead). Decode steps at batch 8 (a76, same process):
    XS off on the gate/up GEMV alone 7B -1.5% (592 blocks on 528 slots), 32B -1.4% (864), 14B +0.7%
    (432: one wave); XS off everywhere 7B -0.1%, 14B -1.3%, 32B -3.4%. Standalone at M = 1
    (xs_cands.json) XS took 55296x5120 72.1 -> 62.6 us and 37888x3584 33.7 -> 33.1, but 27648x5120
    34.2 -> 36.7 and the small layers 2-4% slower; batch 1 with the rule (a73): 7B +0.4%, 32B +0.5%."""
    if mt > 1:
        return not slots < 2 * blocks <= 2 * slots
    return blocks > slots


@functools.lru_cache(maxsize=1024)
def streamk_plan(blocks: int, kb: int, slots: int) -> tuple[int, int]:
    """Stream-K over `blocks` 64-row blocks of `kb` steps on `slots` program slots -> (programs P,
    the most programs any block is split over). Program q takes flat steps [q T / P, (q + 1) T / P),
    T = blocks x kb (flat step f = block f // kb, K step f % kb), as the kernel's _sk_start / _sk_owner."""
    t = blocks * kb
    p = max(1, min(slots, t))
    if t * (p + 1) >= 2**31:
        raise ValueError(f"stream-K: {blocks} x {kb} steps on {p} programs overflows the kernel's int32 schedule")
    most = 1
    for b in range(blocks):
        first = ((b * kb + 1) * p - 1) // t
        last = ((b * kb + kb) * p - 1) // t
        most = max(most, last - first + 1)
    return p, most


def tail_plan(blocks: int, kb: int, slots: int) -> tuple[int, int, int] | None:
    """Split tail for `blocks` 64-row blocks of `kb` K steps on `slots` program slots -> (NW whole
    blocks, S slices per tail block, CS steps per slice), or None. Only when the blocks overrun one
    wave with a partial last wave of r = blocks % slots blocks: those r blocks get S = min(kb,
    slots // r, 16) slices (their r * S programs fit the slots freed by the first wave), e.g. the 7B
    gate/up GEMV on an H100, 592 blocks x 14 steps on 528 slots: 528 whole blocks and 64 blocks in
    7 slices of 2 steps. The 32B gate/up GEMV (864 blocks: r = 336, slots // r = 1) stays whole."""
    if blocks <= slots or blocks % slots == 0:
        return None
    r = blocks % slots
    nc = min(kb, slots // r, 16)  # at most 16 slices: the fixup unrolls its partial loads
    if nc < 2:
        return None
    cs = -(-kb // nc)
    return blocks - r, -(-kb // cs), cs


def schedule(blocks: int, kb: int, s: int, grid: int, slots: int, resident: int, chain: bool, free: bool,
             tail_on: bool | None, sk_on: bool | None, spare: int = 0) -> tuple[str, int, int, int, int, int]:
    """The launch's schedule from the split plan (`s` slices per block, `grid` programs for `slots`
    planned slots; `resident`: the programs that really fit at once; `chain`: routed as a PDL chain;
    `free`: no forced S and the kernel's other schedules available; TAIL_SPLIT / STREAMK as
    `tail_on` / `sk_on`; stream-K plans for `spare` + SK_SPARE slots fewer) -> (kind "split" |
    "tail" | "sk", grid, S, NW, CS, SP = the fixup's unrolled partial count). The split tail where
    the blocks overrun the resident programs (or forced), stream-K instead of it in PDL chains (or
    forced), else the split plan unchanged."""
    tail = tail_plan(blocks, kb, slots) if free and s == 1 and (
        tail_on or (tail_on is None and blocks > resident)) else None
    if free and (bool(sk_on) if sk_on is not None else (tail is not None and chain and not tail_on)):
        programs, most = streamk_plan(blocks, kb, max(1, slots - SK_SPARE - spare))
        return "sk", programs, 1, 0, 0, triton.next_power_of_2(most)
    if tail is not None:
        nw, slices, cs = tail
        return "tail", nw + (blocks - nw) * slices, slices, nw, cs, triton.next_power_of_2(slices)
    if tail_on and free:
        raise ValueError(f"TAIL_SPLIT forced, but {blocks} blocks x {kb} steps on {slots} slots have no split tail")
    return "split", grid, s, 0, 0, triton.next_power_of_2(s)


def cluster_size(kind: str, s: int, kb: int, mt: int, chain: bool, want: bool | None) -> int:
    """The launch's cluster size for the split fixup through shared memory (0: the global workspace): S for a
    plain split of 2..8 slices with EPI_SMEM, if `want` (None: CLUSTER_FIXUP's rule, M = 1 in a PDL chain
    with at most CLUSTER_MAX_STEPS K steps a program); the clusters must still fit (`cluster_fits`)."""
    if want is None:
        want = chain and mt == 1 and -(-kb // max(s, 1)) <= CLUSTER_MAX_STEPS
    return s if want and kind == "split" and 2 <= s <= ptx_cluster.MAX_CLUSTER and EPI_SMEM else 0


def cluster_fits(grid: int, cl: int, most: int | None, slots: int, gpcs: int = 8) -> bool:
    """CLUSTER: the launch's grid / cl clusters all co-resident, else it keeps the global fixup (a second wave of
    clusters costs far more than the fixup saves: the 4608 x 3584 layer at M = 1, 72 clusters of 7, 9.3 -> 12.0
    us alone). `most` is the driver's count of co-resident clusters, which on the H100 overstates what fits
    beside 4 register-bound programs per SM (it gave 101 clusters of 7 where 72 did not fit), so the grid must
    also fit the planned program `slots` less cl - 1 idle slots in each of the `gpcs` GPCs (a cluster never
    spans two; the H100's runs placed clusters on 124 of its 132 SMs). most None: the slot test alone (before
    the cluster variant is compiled, so a layer that cannot fit never builds one)."""
    return (most is None or grid // cl <= most) and grid <= slots - gpcs * (cl - 1)


def glu_descriptors(state: dict):
    """GLU: TMA descriptors of a fused [gate; up] layer's tiled words / scales as 3-D [2 (gate, up),
    D, 32] / [2, D, 16] (D = the gate half's tiled rows: the up rows sit D rows behind the gate
    rows), boxes [2, 32, .]: one copy brings a pair block's 32 gate rows and 32 up rows of a K step
    (`_glu_tile`), in the byte order (and 128-byte swizzle) of a 64-row box. mxfp4's scales (8 bytes a
    row) as [2, D / 2, 16] with boxes [2, 16, 16]: the same 32 + 32 rows, as `descriptors` views them."""
    d = (state["n"] // 2 // 64) * state["kb"] * 64
    words, scale = state["words"].view(-1, 32), state["scale"].view(-1, 16)
    ds, srows = (d // 2, 16) if state.get("fmt") == "mxfp4" else (d, 32)
    wl = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    return (TensorDescriptor(words, [2, d, 32], [d * 32, 32, 1], [2, 32, 32], wl),
            TensorDescriptor(scale, [2, ds, 16], [ds * 16, 16, 1], [2, srows, 16], sl))


def sync_count(state: dict) -> int:
    """How many counts a `forward(..., sync=...)` launch adds to its signal: one per 64-row block."""
    return state["n"] // 64


def glu_usable(x: torch.Tensor, state: dict, bias=None) -> bool:
    """`forward(..., glu=True)` takes this launch: nvfp4 or mxfp4 [gate; up] with each half whole 64-row
    blocks, 2..8 tokens, no bias."""
    return (state.get("fmt") in FORMATS and bias is None and x.dim() == 2 and 2 <= x.shape[0] <= MAX_M
            and state["n"] % 128 == 0 and state["k"] == state["kb"] * 256)


def forward(x: torch.Tensor, state: dict, bias=None, out=None, config: dict | None = None,
            glu: bool = False, fold: tuple | None = None, sync: tuple | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [M, K] bf16 (contiguous, M <= 8) and an nvfp4 or mxfp4 `state`
    (qerl.kernels.prepare). M = 1 puts x in every column of the MMA's B; M = 2..8 puts token g in
    column g (MT = 8), at the same MMA count per weight.

    config: NUM_STAGES (ring depth), PER_SM (programs per SM the grid is planned for, at most what
    the first launch measures fits), S (forced K slices per row block), num_warps (consumer warps: 4 or 8),
    maxnreg (register cap per thread), PRODUCER_REGS, PDL, XPF (x loaded one step ahead; None:
    `xpf_auto`), TAIL_SPLIT / STREAMK (None: the module's TAIL_SPLIT / STREAMK; a forced S turns
    both off), PWA (per-warp stage release, qerl/kernels/ptx_pwa.py; None: PER_WARP_ARRIVE), XS (x
    copied beside each weight stage by the producer; None: X_SMEM; off for an x TMA cannot read).

    glu: the layer is a fused [gate; up] pair (N = 2 I) and the launch returns silu(gate) * up [M, I]
    as decode_ops.silu_mul would from the [M, N] product (same bf16 roundings): each program's
    64-row block holds 32 gate rows and the 32 up rows of the same outputs (`glu_descriptors`), and
    the epilogue combines them (`_glu_store`). Needs `glu_usable`.

    fold (NORM_FOLD, 2..8 tokens): the residual add + RMSNorm between two GEMVs, split over their
    epilogues. ("res", h, w, h_out, ss): this GEMV's output y goes on as the next norm's input:
    h_out = bf16(h + y) (h, h_out [M, N] bf16), the return value is bf16(h_out * w) (w [N] bf16: the
    norm's weight), and ss[blk, token] (fp32 [N / 64, 8]) gets each 64-column block's sum of h_out^2.
    ("scale", ss, blocks, eps, k): x is such a bf16(h_out * w), and each token's products are scaled by
    1 / sqrt(sum of its `blocks` partial sums / k + eps) before alpha and bias (and GLU). With one
    rounding fewer than bf16(w * bf16(h_out * scale)) in the norm kernel, so not bit-equal to it.

    sync (with glu or fold "res", 2..8 tokens): (delta, flag, target, signal) for the rollout engine's
    resident LoRA kernel (qerl/kernels/lora_resident.py): each row block's writer waits on the device
    until the int32 flag reaches target, adds delta ([>= M, N] bf16, contiguous: the LoRA delta of the
    whole [M, N] product) before the GLU or the residual add, and after its stores adds one to the
    int32 signal, N / 64 counts in all (`sync_count`). With a lora_resident.Expand in place of the
    delta (any product: plain, fold "res" or "scale", glu; 4 warps): the flag counts the resident
    kernel's shrink sums in, and each writer computes its block's delta from them and B itself
    (`_lora_expand`), added to the fp32 product before alpha (one bf16 rounding fewer than the delta
    form's)."""
    if state["fmt"] not in FORMATS:
        raise ValueError(f"the Gluon GEMV takes nvfp4 or mxfp4 weights, got {state['fmt']}")
    mx = state["fmt"] == "mxfp4"
    frag = layout.is_frag(state)
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"the Gluon GEMV takes 1 <= M <= {MAX_M}, got x of shape {tuple(x.shape)}")
    n, k, kb = state["n"], state["k"], state["kb"]
    if k != kb * 256:
        raise ValueError("the Gluon GEMV needs K a multiple of 256")
    m = x.shape[0]
    if x.shape[1] != k or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 [{m}, {k}]")
    if glu and not glu_usable(x, state, bias):
        raise ValueError("glu needs nvfp4 [gate; up] halves of whole 64-row blocks, 2..8 tokens and no bias")
    if glu and out is None:
        out = torch.empty(m, n // 2, device=x.device, dtype=torch.bfloat16)
    kind_fold = fold[0] if fold is not None else None
    if kind_fold not in (None, "res", "scale") or (fold is not None and (m < 2 or not (HOIST_CONSTS and EPI_SMEM))):
        raise ValueError("fold: ('res', ...) or ('scale', ...) at 2..8 tokens with HOIST_CONSTS and EPI_SMEM")
    if kind_fold == "res" and (glu or n % 64):
        raise ValueError("fold 'res' needs a plain product of whole 64-row blocks")
    cfg = dict(DEFAULT)
    cfg.update({key: v for key, v in (config or {}).items() if key in DEFAULT or key in ("S", "STREAMK", "TAIL_SPLIT")})
    nw = int(cfg["num_warps"])
    if nw not in (4, 8):
        raise ValueError(f"num_warps must be 4 or 8, got {nw}")
    if frag and nw != 4:
        raise ValueError("the Gluon GEMV reads fragment-ordered words with 4 consumer warps")
    sync_mode = 0 if sync is None else 1 + int(SYNC_NAP)  # the kernel's SYNC
    lexp, lx = 0, None  # the kernel's LEXP and its (B, n1, n2, h's row stride) with an Expand
    if sync is not None:
        from qerl.kernels.lora_resident import Expand

        dl, dflag, dtarget, sig = sync
        if m < 2 or not (HOIST_CONSTS and EPI_SMEM):
            raise ValueError("sync needs 2..8 tokens with HOIST_CONSTS and EPI_SMEM")
        if isinstance(dl, Expand):
            segs = 1 + int(dl.bounds[0] < n) + int(dl.bounds[1] < n)
            if (nw != 4 or dl.rank not in (16, 32, 64) or dl.h.dtype != torch.float32 or dl.h.stride(1) != 1
                    or dl.h.shape[0] < m or dl.h.shape[1] < segs * dl.rank or dl.b.dtype != torch.bfloat16
                    or not dl.b.is_contiguous() or tuple(dl.b.shape) != (n, dl.rank) or dl.bounds[0] % 16
                    or dl.bounds[1] % 16 or (glu and dl.bounds[0] != n // 2)):
                raise ValueError("sync: an Expand needs 4 warps, rank 16 / 32 / 64, fp32 h [>= M, segments x rank] "
                                 "with unit column stride, contiguous bf16 b [N, rank], bounds multiples of 16 "
                                 "(GLU: the [gate; up] halves)")
            lexp, lx = dl.rank, (dl.b.view(torch.int32), int(dl.bounds[0]), int(dl.bounds[1]), dl.h.stride(0))
            dl = dl.h
        elif not (glu or kind_fold == "res"):
            raise ValueError("sync with a delta needs glu or fold 'res'")
        elif dl.dtype != torch.bfloat16 or not dl.is_contiguous() or dl.shape[-1] != n or dl.shape[0] < m:
            raise ValueError(f"sync: the delta must be contiguous bf16 [>= {m}, {n}], got {tuple(dl.shape)}")
    ns, per_sm = int(cfg["NUM_STAGES"]), int(cfg["PER_SM"])
    pdl = bool(W.PDL if cfg["PDL"] is None else cfg["PDL"])
    preg = int(cfg["PRODUCER_REGS"])
    mt = 1 if m == 1 else MAX_M
    pwa = bool(cfg["PWA"] if cfg["PWA"] is not None else mt > 1 if PER_WARP_ARRIVE is None else PER_WARP_ARRIVE)
    xs = cfg["XS"] if cfg["XS"] is not None else X_SMEM
    if xs is None:
        xs = xs_auto(mt, triton.cdiv(n, 64), per_sm * W._num_sms(x.device.index or 0))
    x = x.contiguous()
    xs = bool(xs) and x.data_ptr() % 16 == 0  # TMA: a 16-byte aligned base
    key = (ns, nw, cfg["maxnreg"], preg, pdl, mt, cfg["XPF"], EPI_SMEM, pwa, xs, glu, kind_fold, mx + 2 * frag,
           sync_mode, lexp)  # (occupancy; SBITS keeps it)
    fits = min(_RESIDENT.get(key, per_sm), per_sm)
    s, grid, w_desc, s_desc, c, locks, ws = _plan(x, state, out, cfg.get("S"), fits, mt,
                                                  glu_descriptors(state) if glu else None, RESERVE)
    slots = max(1, fits * W._num_sms(x.device.index or 0) - RESERVE)
    xpf = not xs and (bool(cfg["XPF"]) if cfg["XPF"] is not None else xpf_auto(mt, s, grid, slots, k))
    free = cfg.get("S") is None and HOIST_CONSTS and EPI_SMEM  # the other schedules need both
    resident = max(_RESIDENT.get(key, max(per_sm, 4)), fits) * W._num_sms(x.device.index or 0) - RESERVE  # 4: before measured
    chain = pdl if W.CHAIN_ROUTING is None else W.CHAIN_ROUTING  # as w4a16_triton routes a PDL chain
    kind, grid, s, nw_whole, cs, sp = schedule(triton.cdiv(n, 64), kb, s, grid, slots, resident, chain, free,
                                               cfg.get("TAIL_SPLIT", TAIL_SPLIT), cfg.get("STREAMK", STREAMK),
                                               SK_SPARE_GLU if glu else 0)
    cl = cluster_size(kind, s, kb, mt, chain, CLUSTER_FIXUP if cfg.get("CLUSTER") is None else bool(cfg["CLUSTER"]))
    if cl and not cluster_fits(grid, cl, None, slots + RESERVE):  # decided without compiling the cluster variant
        cl = 0
    if kind == "sk":  # workspace: two partial slots (first and last segment) per program
        ws = torch.empty(2 * grid * 64 * mt, device=x.device, dtype=torch.float32)
    elif kind == "tail":  # workspace slot = program (the whole blocks' slots go unused)
        ws = torch.empty(grid * 64 * mt, device=x.device, dtype=torch.float32)
    l5, l2w, l2s = _layouts(nw, state["fmt"], frag)
    extra = {} if cfg["maxnreg"] is None else {"maxnreg": int(cfg["maxnreg"])}
    stamps = W.stamp_slice(grid, n, k, s, m, "gluon")  # instrumentation, None when off (w4a16_triton.STAMP)
    h_in = h_out = w_norm = ss = c
    nss, eps, kn, ssp = 0, 0.0, 1, 1
    if kind_fold == "res":
        _, h_in, w_norm, h_out, ss = fold
    elif kind_fold == "scale":
        _, ss, nss, eps, kn = fold
        ssp = triton.next_power_of_2(int(nss))
    args = (
        x.view(torch.int32), w_desc, s_desc, x_descriptor(x, mt) if xs else w_desc, state["alpha"], bias if bias is not None else c, c, ws,
        locks, stamps if stamps is not None else ws, h_in, h_out, w_norm, ss, m, n, kb, s, nw_whole, cs, int(nss),
        float(eps), int(kn), int(state.get("exp_bias", 0)),
        *((dl, dflag, sig, int(dtarget)) if sync is not None else (c, locks, locks, 0)),
        *(lx if lx is not None else (locks, 0, 0, 0)))
    kw = dict(
        FOLD={"res": 1, "scale": 2}.get(kind_fold, 0), SSP=ssp,
        SP=sp, NUM_STAGES=ns, WF=2 if frag else int(mx),
        HAS_BIAS=bias is not None, PDL=pdl, MT=mt, XPF=xpf,
        STAMP=stamps is not None, HOIST=HOIST_CONSTS, EPI=EPI_SMEM, PRODUCER_REGS=preg, SK=kind == "sk", TAIL=kind == "tail",
        SBITS=SCALE_BITS and bool(state.get("scale_bits", False)), PWA=pwa, XS=xs, LX=_x_layout(nw, mt, frag),
        GLU=bool(glu), SYNC=sync_mode, LEXP=lexp, CL=cl,
        L5=l5, L2W=l2w, L2S=l2s, num_warps=nw, launch_pdl=pdl, **extra,
    )
    if cl:  # compiled first, then launched as clusters of cl programs (the launcher multiplies the grid by cl)
        compiled = _gluon_gemv_kernel.warmup(*args, grid=(grid,), **kw)
        if compiled.hash not in CLUSTERS:
            CLUSTERS[compiled.hash] = (cl, mt, ptx_cluster.prepare(compiled, cl, ptx_cluster.extra_bytes(cl, 64 * mt)))
        if not cluster_fits(grid, cl, CLUSTERS[compiled.hash][2], slots + RESERVE):
            cl = kw["CL"] = 0
    kernel = _gluon_gemv_kernel[(grid // max(cl, 1),)](*args, **kw)
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident(kernel, nw, cfg["maxnreg"]) or per_sm
    return c
