"""Fragment-ordered nvfp4 words (layout.py's "frag" order) in the Gluon GEMMs: the layouts, the decode and the
stage preparation that rwg (`w4a16_rwg`, decoding straight into wgmma's register operand) and the wgmma GEMM's
decoder warps (`w4a16_wgmma`, decoding into shared memory) share. A word holds one thread's four wgmma A-fragment
pairs of a 16-K slice (rows g, g + 8 at K 2t, 2t + 8); 64 rows of a stage are one warpgroup's 4 warps x 16 rows.
FMT 4: FP8 scales converted in floating point; 5: every scale normal (prepare's scale_bits), integer bits."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from qerl.kernels.w4a16_ws import _nv_scale2, _scale_pairs

FRAG_SMEM = gl.NVMMASharedLayout(0, 32)  # the fragment words' stage: no swizzle (read as 16-byte rows)
# FMT 5: the two rows' multipliers of a word built together in one register (PRMT + LEA per two scales instead of
# two ops per scale), the multiplies selecting their half
FRAG_SCALE_PAIRS = gl.constexpr(True)


def frag_layouts(r: int, bm: int):
    """(LB2, L3S, LP, ACC, AOP) for the fragment-ordered words (FRAG, layout.py): the stage's bytes as
    [512 R, 16] uint8 (rows (warp, j, g, t), columns (q, kh, h): thread (g, t) reads its 16 words as four
    16-byte rows), the scale parent [64 R, 16 (slice s), 8 (kh, t)] whose slice along dim 2 is the [64 R, 16]
    scale tile with every lane t and both K halves sharing a scale, and the pair tensor [64 R, 128] (row, pair
    P = 8 s + 4 kh + t) in which one word's four pairs are four consecutive registers (h, kh)."""
    w = [[128, 0], [256, 0]] + ([[512, 0]] if r == 2 else [])
    lb2 = gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8], [32, 0], [64, 0]],
                                     [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]], w, [], [512 * r, 16])
    rows = [[16, 0], [32, 0]] + ([[64, 0]] if r == 2 else [])
    l3s = gl.DistributedLinearLayout([[8, 0, 0], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]],
                                     [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                     [b + [0] for b in rows], [], [64 * r, 16, 8])
    lp = gl.DistributedLinearLayout([[8, 0], [0, 4], [0, 8], [0, 16], [0, 32], [0, 64]],
                                    [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], rows, [], [64 * r, 128])
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * r, 1], instr_shape=[16, bm, 16])
    aop = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    return lb2, l3s, lp, acc, aop


# layout.py's FRAG decode of word $4 into p0, p1, p2 and a (pair 3), before the scales: 9 integer ops
_FRAG_INT = """
        and.b32 p0, $4, 0x81C081C0;
        shf.r.wrap.b32 a, $4, $4, 4;
        and.b32 p1, a, 0x81C081C0;
        shf.r.wrap.b32 a, $4, $4, 10;
        and.b32 p2, a, 0x81C081C0;
        shf.r.wrap.b32 a, $4, $4, 6;
        and.b32 a, a, 0x81808180;
        shf.r.wrap.b32 b, $4, $4, 30;
        and.b32 b, b, 0x00400040;
        or.b32 a, a, b;"""
# each pair times its own scale register ($5..$8)
_FRAG_DECODE = gl.constexpr("{ .reg .b32 p0, p1, p2, a, b;" + _FRAG_INT + """
        mul.rn.bf16x2 $0, p0, $5;
        mul.rn.bf16x2 $1, p1, $6;
        mul.rn.bf16x2 $2, p2, $7;
        mul.rn.bf16x2 $3, a, $8; }""")
# FRAG_SCALE_PAIRS: $5 holds rows g (low half) and g + 8 (high half); each multiply takes its row's half
_FRAG_DECODE_PAIRS = gl.constexpr("{ .reg .b32 p0, p1, p2, a, b, s0, s1; .reg .b16 l, h;" + """
        mov.b32 {l, h}, $5;
        mov.b32 s0, {l, l};
        mov.b32 s1, {h, h};""" + _FRAG_INT + """
        mul.rn.bf16x2 $0, p0, s0;
        mul.rn.bf16x2 $1, p1, s1;
        mul.rn.bf16x2 $2, p2, s0;
        mul.rn.bf16x2 $3, a, s1; }""")


@gluon.jit
def frag_decode(wb, sc, PAIRS: gl.constexpr = False):
    """Fragment words (uint8, four consecutive registers = one word) and their scales (bf16x2, one per
    pair; PAIRS: both rows' multipliers in each, `_scale_pairs`) -> the four scaled pairs (h + 2 kh), layout.py's
    FRAG decode: 9 integer ops + 4 bf16x2 multiplies per word (with PAIRS ptxas folds the half broadcasts into
    HMUL2's operand select)."""
    if PAIRS:
        return gl.inline_asm_elementwise(_FRAG_DECODE_PAIRS, "=r,=r,=r,=r,r,r,r,r,r", [wb, sc], dtype=gl.uint32,
                                         is_pure=True, pack=4)
    return gl.inline_asm_elementwise(_FRAG_DECODE, "=r,=r,=r,=r,r,r,r,r,r", [wb, sc], dtype=gl.uint32,
                                     is_pure=True, pack=4)


@gluon.jit
def _frag_chunks(v, ROWS: gl.constexpr):
    """[ROWS, 128] pairs (P = 32 j + ...) -> the four 64-K chunks [ROWS, 32] (j in registers)."""
    t = gl.reshape(gl.permute(gl.reshape(v, [ROWS, 4, 32]), (0, 2, 1)), [ROWS, 32, 2, 2])
    a, b = gl.split(t)
    c0, c2 = gl.split(a)
    c1, c3 = gl.split(b)
    return c0, c1, c2, c3


@gluon.jit
def frag_stage(w_bufs, s_bufs, iw, ROWS: gl.constexpr, LW2: gl.constexpr, LS3: gl.constexpr):
    """Ring stage iw of fragment words (FRAG_SMEM, read as [8 ROWS, 16] bytes) and its FP8 scales -> (words, scales)
    in frag_layouts' LB2 and the slice of L3S."""
    w2 = w_bufs.index(iw)._reinterpret(gl.uint8, [8 * ROWS, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])).load(LW2)
    return w2, s_bufs.index(iw).load(gl.SliceLayout(2, LS3))


@gluon.jit
def frag_prep(w2, s2d, ROWS: gl.constexpr, FMT: gl.constexpr, LS3: gl.constexpr, LW3: gl.constexpr):
    """A stage's fragment words and scales (`frag_stage`) -> the four 64-K chunks of words [ROWS, 32] (uint8, four
    consecutive registers = one word) and of their pairs' multipliers (FMT 5 with FRAG_SCALE_PAIRS: both rows' in
    each), the inputs of `frag_decode`."""
    b7 = gl.reshape(w2, [ROWS // 16, 4, 8, 4, 4, 2, 2])  # bytes (warp, j, g, t | q, kh, h) -> pairs [ROWS, 128]
    wp = gl.convert_layout(gl.reshape(gl.permute(b7, (0, 6, 2, 1, 4, 5, 3)), [ROWS, 128]), LW3, assert_trivial=True)
    if FMT == 5 and FRAG_SCALE_PAIRS:  # rows g, g + 8 of a slice in one register, the same for both rows
        sv = gl.permute(gl.reshape(s2d.to(gl.uint8, bitcast=True), [ROWS // 16, 2, 8, 16]), (0, 2, 3, 1))
        s_lo, s_hi = gl.split(sv)
        s01 = _scale_pairs(s_lo, s_hi)
        s2x = gl.reshape(gl.permute(gl.join(s01, s01), (0, 3, 1, 2)), [ROWS, 16])
        s2x = gl.convert_layout(s2x, gl.SliceLayout(2, LS3), assert_trivial=True)
    else:
        s2x = _nv_scale2(s2d, FMT == 5)  # in both halves
    sp = gl.reshape(gl.expand_dims(s2x, 2) + gl.zeros([ROWS, 16, 8], gl.uint32, LS3), [ROWS, 128])
    sp = gl.convert_layout(sp, LW3, assert_trivial=True)
    w0, w1, w2c, w3c = _frag_chunks(wp, ROWS)
    c0, c1, c2, c3 = _frag_chunks(sp, ROWS)
    return w0, w1, w2c, w3c, c0, c1, c2, c3
