"""The kernel weight layout: E2M1 codes re-packed so the Triton kernels decode them cheaply.

Plain torch (no Triton), so `prepare()` runs anywhere and the tests can check the layout on CPU.

Checkpoints store two E2M1 codes per byte (`weight_packed` uint8 [N, K/2], even index in the
low nibble). The fused kernels instead load one 32-bit word per 8 consecutive K elements
(int32 [N, K/8], 16-byte vector loads = 32 weights per thread per load) and turn every word
into four packed bf16 pairs with 11 integer instructions (5 funnel shifts, 6 and/or):

    P_j = (rotr(w, R_j) & 0x01C001C0) | (rotr(w, S_j) & 0x80008000),  j = 0..3

Each 16-bit half of P_j is then a bf16 bit pattern: the code's sign in bit 15 and its three
magnitude bits (e1 e0 m) in bits 8..6, i.e. exponent field e and top mantissa bit m. That
pattern is the E2M1 value times 2^-126 exactly (codes with e = 0 are bf16 subnormals), and the
kernel multiplies it by the group scale pre-multiplied by 2^(126 - J) (one packed bf16x2
multiply per two weights; bf16 multiplies keep subnormal inputs, so 0 and 0.5 decode exactly).
The result, q * s * 2^-J, is exact in bf16; the fp32 accumulator is multiplied by
`alpha` = 2^J / g once at the end.

`R`, `S` below were found by exhaustive search so that the 8 elements' 32 bits tile the word
with the fewest shifts. Which half of which P_j holds which K index follows from how the kernel
joins the halves back into a [rows, K] tile; `_T_TO_SLOT` records it and the tests check a
round trip plus the kernel's decode in the interpreter.

Tiles. Words and scales are then stored tile-major: blocks of TILE_N = 64 rows x TILE_K = 256
K (8 KB of words, 1 KB / 512 B of scales), each block contiguous, blocks ordered (row block,
K block). A decode step of the kernel reads exactly one such block: one 8 KB contiguous
stream instead of 64 rows x 128 B scattered 1-14 KB apart (on the H100 the row-major layout
reached only half the copy bandwidth). N and K are padded up to whole tiles with zero words /
zero scales (which decode to 0; the kernels never read past N, K anyway).

    word (n, j)  [j = k // 8]   at ((n // 64 * KB + j // 32) * 64 + n % 64) * 32 + j % 32
    scale (n, g) [g = k // G]   at ((n // 64 * KB + g // SPT) * 64 + n % 64) * SPT + g % SPT
    KB = ceil(K / 256), SPT = 256 / G scales per tile row (16 nvfp4, 8 mxfp4)
"""

from __future__ import annotations

import torch

# rotr amounts per output pair j: magnitude bits, sign bits.
ROT_MAG = (0, 3, 6, 9)
ROT_SIGN = (4, 3, 6, 5)
MAG_MASK = 0x01C001C0
SIGN_MASK = 0x80008000
# The kernel's final exponent offset J for nvfp4 (mxfp4 picks J per tensor, see prepare).
NVFP4_EXP_OFFSET = 8


def _slot(t: int) -> tuple[int, int]:
    """K offset t (0..7) inside a word -> (pair j, half) with half 1 = bits 16..31.

    The kernel builds the tile as join(join(join(l0, l1), join(l2, l3)),
    join(join(h0, h1), join(h2, h3))), giving flat index t = 4*(j % 2) + 2*(j // 2) + (half == hi):
    K offsets t, t+1 sit in the low and high half of the same register P_j, which is exactly
    the packed bf16x2 operand register of the tensor-core MMA (no half-swapping PRMT).
    """
    a, b, c = t // 4, (t // 2) % 2, t % 2
    return a + 2 * b, c


_T_TO_SLOT = tuple(_slot(t) for t in range(8))


def _bit_positions() -> torch.Tensor:
    """[8, 4] stored bit position of (element t, code bit b) inside the 32-bit word."""
    pos = torch.empty(8, 4, dtype=torch.int64)
    for t, (j, half) in enumerate(_T_TO_SLOT):
        base = 16 * half
        for b in range(3):  # magnitude bits land on output bits 6..8 (+16)
            pos[t, b] = (base + 6 + b + ROT_MAG[j]) % 32
        pos[t, 3] = (base + 15 + ROT_SIGN[j]) % 32  # sign lands on bit 15 (+16)
    if sorted(pos.flatten().tolist()) != list(range(32)):
        raise AssertionError("kernel bit layout does not tile a 32-bit word")
    return pos


_POS = _bit_positions()


def _pack_bits(c: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[..., 8] uint8 codes -> [...] int32 words, code t's bit b at bit pos[t, b] (32 cheap passes, no big
    temporaries)."""
    words = torch.zeros(c.shape[:-1], dtype=torch.int64, device=c.device)
    for t in range(8):
        ct = c[..., t].to(torch.int64)
        for b in range(4):
            words |= ((ct >> b) & 1) << int(pos[t, b])
    return (words - ((words >> 31) << 32)).to(torch.int32)  # wrap to signed 32-bit


def _unpack_bits(words: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Inverse of _pack_bits: [...] int32 words -> [..., 8] uint8 codes."""
    u = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.zeros(*u.shape, 8, dtype=torch.uint8, device=words.device)
    for t in range(8):
        acc = torch.zeros_like(u)
        for b in range(4):
            acc |= ((u >> int(pos[t, b])) & 1) << b
        codes[..., t] = acc.to(torch.uint8)
    return codes


def codes_to_words(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes (0..15) -> [N, K/8] int32 kernel words."""
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"K must be a multiple of 8 for the kernel layout, got {k}")
    return _pack_bits(codes.reshape(n, k // 8, 8), _POS)


def words_to_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of codes_to_words: [N, K/8] int32 -> [N, K] uint8 codes."""
    n, w = words.shape
    return _unpack_bits(words, _POS).reshape(n, w * 8)


def packed_to_words(weight_packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint bytes [N, K/2] (two codes per byte, even index low) -> kernel words [N, K/8]."""
    from qerl.formats.fp4 import unpack_nibbles

    return codes_to_words(unpack_nibbles(weight_packed))


def words_to_packed(words: torch.Tensor) -> torch.Tensor:
    from qerl.formats.fp4 import pack_nibbles

    return pack_nibbles(words_to_codes(words))


TILE_N = 64
TILE_K = 256


def tile_shape(n: int, k: int) -> tuple[int, int]:
    """(row blocks, K blocks) of the tiled layout."""
    return -(-n // TILE_N), -(-k // TILE_K)


def to_tiles(rows: torch.Tensor, per_row: int) -> torch.Tensor:
    """Row-major [N, K/U] (U = K per unit: 8 for words, G for scales) -> tiled [NB, KB, 64, per_row]
    where per_row = TILE_K / U units; zero padding up to whole tiles."""
    n, units = rows.shape
    nb, kb = -(-n // TILE_N), -(-units // per_row)
    padded = torch.zeros(nb * TILE_N, kb * per_row, dtype=rows.dtype, device=rows.device)
    padded[:n, :units] = rows
    return padded.reshape(nb, TILE_N, kb, per_row).permute(0, 2, 1, 3).contiguous()


def from_tiles(tiles: torch.Tensor, n: int, units: int) -> torch.Tensor:
    """Inverse of to_tiles: tiled [NB, KB, 64, per_row] -> row-major [n, units]."""
    nb, kb, tn, per_row = tiles.shape
    return tiles.permute(0, 2, 1, 3).reshape(nb * tn, kb * per_row)[:n, :units].contiguous()



# ---------------------------------------------------------------------------------------------
# Fragment-ordered words (word order "frag"; nvfp4). prepare(order="frag") stores the layer's only copy in
# this order (rwg reads it directly; the Triton kernels decode it too, see w4a16_triton._frag_tile_at);
# on a "rows" state rwg's FRAG config reads a second copy built on first use (benchmark only).
#
# wgmma's register A operand gives thread (g, t) of a warp (lane 4 g + t) four bf16 pairs of every
# 16-K slice s: rows g and g + 8 of the warp's 16, at K = 16 s + 2 t (+1) and 16 s + 2 t + 8 (+1),
# in the register order pair pi = h + 2 kh (h: row g + 8, kh: K + 8). A fragment word holds exactly
# those four pairs, so each thread reads only its own 16 words per 256-K step (4 x 16 bytes, no
# quad broadcast) and every pair sits at the same bit position for every lane (immediate shifts):
#   pair 0 on the bf16x2 target bits {6, 7, 8, 15, 22, 23, 24, 31} themselves (one AND),
#   pairs 1, 2 rotated by 4 and 10 (a funnel shift and an AND each),
#   pair 3 on the 8 bits left, two rotations: (rotr(w, 6) & {7, 8, 15, 23, 24, 31}) | (rotr(w, 30) & {6, 22}).
# (Four translates of the target bits cannot tile a word; this is 9 integer ops + 4 bf16x2 multiplies
# per word, against 8 funnel shifts and ~9 logic ops for today's words' four pairs.)
# Inside a 64 x 256 tile (2048 words) the word of (warp w, lane L, slice s = 4 j + q) sits at
# w * 512 + j * 128 + L * 4 + q: per j, a warp's 32 lanes read 512 contiguous bytes (one LDS.128 each,
# no bank conflict). Tiles are ordered as the layout above (row block, K block); scales are unchanged.
FRAG_TARGET = 0x81C081C0  # a bf16x2 register's code bits: (m, e0, e1) at 6..8, the sign at 15 (+16)
FRAG_ROT = (0, 4, 10)  # pairs 0..2: stored bit = target bit + rotation (mod 32)


def _frag_bit_positions() -> torch.Tensor:
    """[4 pairs, 2 halves, 4 code bits] -> stored bit position inside a fragment word."""
    pos = torch.empty(4, 2, 4, dtype=torch.int64)
    for pi in range(4):
        for e in range(2):
            for b in range(4):
                target = 16 * e + (6 + b if b < 3 else 15)
                if pi < 3:
                    pos[pi, e, b] = (target + FRAG_ROT[pi]) % 32
                else:  # pair 3's two rotations, undone
                    pos[pi, e, b] = (target + (6 if b else 30)) % 32
    if sorted(pos.flatten().tolist()) != list(range(32)):
        raise AssertionError("fragment bit layout does not tile a 32-bit word")
    return pos


_FRAG_POS = _frag_bit_positions()
# the same positions per code in (h, kh, e) order, e the K parity inside a pair: _pack_bits's t = 4 h + 2 kh + e
_FRAG_POS8 = torch.stack([_FRAG_POS[h + 2 * kh, e] for h in range(2) for kh in range(2) for e in range(2)])


def codes_to_frag_tiles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes (0..15) -> fragment-ordered words, tiled int32 [NB, KB, 64, 32] (zero padded)."""
    n, k = codes.shape
    nb, kb = tile_shape(n, k)
    padded = torch.zeros(nb * TILE_N, kb * TILE_K, dtype=torch.uint8, device=codes.device)
    padded[:n, :k] = codes
    # row = 64 nb' + 16 w + 8 h + g; K = 256 kb' + 16 (4 j + q) + 8 kh + 2 t + e
    c = padded.reshape(nb, 4, 2, 8, kb, 4, 4, 2, 4, 2)
    # -> [nb, kb, w, j, g, t, q | h, kh, e]
    c = c.permute(0, 4, 1, 5, 3, 8, 6, 2, 7, 9).reshape(nb, kb, 4, 4, 8, 4, 4, 8)
    return _pack_bits(c, _FRAG_POS8).reshape(nb, kb, TILE_N, 32)


def frag_tiles_to_codes(tiles: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of codes_to_frag_tiles: [NB, KB, 64, 32] int32 -> [n, k] uint8 codes."""
    nb, kb = tiles.shape[:2]
    words = tiles.reshape(nb, kb, 4, 4, 8, 4, 4)  # nb, kb, w, j, g, t, q
    out = _unpack_bits(words, _FRAG_POS8).reshape(*words.shape, 2, 2, 2)
    # [nb, kb, w, j, g, t, q, h, kh, e] -> [nb, w, h, g, kb, j, q, kh, t, e]
    codes = out.permute(0, 2, 7, 4, 1, 3, 6, 8, 5, 9).reshape(nb * TILE_N, kb * TILE_K)
    return codes[:n, :k].contiguous()


def frag_decode_reference(words: torch.Tensor) -> torch.Tensor:
    """The kernel's integer decode of fragment words (any shape, int32) -> [..., 4] int64 bf16x2 bit
    patterns before the scale (pair pi = h + 2 kh), as the inline assembly computes them."""
    w = words.to(torch.int64) & 0xFFFFFFFF

    def rotr(v, r):
        return ((v >> r) | (v << (32 - r))) & 0xFFFFFFFF if r else v

    p3 = (rotr(w, 6) & 0x81808180) | (rotr(w, 30) & 0x00400040)
    return torch.stack([rotr(w, FRAG_ROT[pi]) & FRAG_TARGET for pi in range(3)] + [p3], -1)


def tiles_to_frag_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Today's tiled words [NB, KB, 64, 32] -> the fragment-ordered copy of the same codes."""
    nb, kb = tiles.shape[:2]
    codes = words_to_codes(from_tiles(tiles, nb * TILE_N, kb * 32))
    return codes_to_frag_tiles(codes)


# The two word orders of a prepared state (state["order"]): "rows" (codes_to_words, tiled) and "frag"
# (codes_to_frag_tiles; nvfp4 only). QERL_W4A16_ORDER picks one, or "auto": frag where the sm_90 kernels that
# read it fastest run (an sm_90 GPU and K % TILE_K == 0), rows elsewhere. Unset: DEFAULT_ORDER, "auto" since
# session 77. Whole sweep on one H100, rows -> auto (with w4a16_triton.FRAG_WGMMA and FRAG_BWD_DEQUANT on), median
# x bf16 of nvfp4: M <= 16 2.04 -> 2.09, M = 64 1.66 -> 1.96, M = 256 0.93 -> 0.95, M >= 1024 0.85 -> 0.85, input
# gradient at 4096 rows 0.86 -> 0.87 (only the 256-row input gradient loses: 0.58 -> 0.50); GRPO steps x bf16
# 7B batch 2 / 4 / 8 1.53 / 1.41 / 1.26 -> 1.71 / 1.47 / 1.26 (NOTES_w4a16.md section 52, NOTES_grpo.md 45).
ORDERS = ("rows", "frag")
DEFAULT_ORDER = "auto"


def order_setting(fmt: str = "nvfp4") -> str | None:
    """The word-order setting nvfp4 layers are prepared under (QERL_W4A16_ORDER, unset: DEFAULT_ORDER), for a
    benchmark row to record; None for formats that have only the rows order."""
    import os

    if fmt != "nvfp4":
        return None
    return os.environ.get("QERL_W4A16_ORDER", DEFAULT_ORDER).strip() or DEFAULT_ORDER


def default_order(fmt: str = "nvfp4", device: torch.device | None = None, k: int | None = None) -> str:
    """The word order `prepare` gives a `fmt` layer of K `k` on `device` by default: QERL_W4A16_ORDER for nvfp4
    (unset: DEFAULT_ORDER; "auto": frag on an sm_90 GPU with K % 256 == 0, else rows); other formats have only
    the rows order."""
    order = order_setting(fmt)
    if order is None:
        return "rows"
    if order == "auto":  # where w4a16_triton._wsmma_ok runs the sm_90 kernels
        device = torch.device(device) if device is not None else None
        hopper = device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        return "frag" if hopper and k is not None and k % TILE_K == 0 else "rows"
    if order not in ORDERS:
        raise ValueError(f"QERL_W4A16_ORDER={order!r}: valid word orders are {', '.join(ORDERS)}, auto")
    return order


def is_frag(state: dict) -> bool:
    """True for a prepared state whose words are in the fragment order (state["order"]; states built without the
    key, by older code or by hand for a shape check, are rows-ordered)."""
    return state.get("order", "rows") == "frag"


def tiles_to_codes(tiles: torch.Tensor, n: int, k: int, order: str = "rows") -> torch.Tensor:
    """A state's tiled words [NB, KB, 64, 32] in either order -> [n, k] uint8 codes."""
    if order == "frag":
        return frag_tiles_to_codes(tiles, n, k)
    return words_to_codes(from_tiles(tiles, n, k // 8))
