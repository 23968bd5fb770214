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


def codes_to_words(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes (0..15) -> [N, K/8] int32 kernel words (32 cheap passes, no big temporaries)."""
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"K must be a multiple of 8 for the kernel layout, got {k}")
    c = codes.reshape(n, k // 8, 8)
    words = torch.zeros(n, k // 8, dtype=torch.int64, device=codes.device)
    for t in range(8):
        ct = c[:, :, t].to(torch.int64)
        for b in range(4):
            words |= ((ct >> b) & 1) << int(_POS[t, b])
    return (words - ((words >> 31) << 32)).to(torch.int32)  # wrap to signed 32-bit


def words_to_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of codes_to_words: [N, K/8] int32 -> [N, K] uint8 codes."""
    n, w = words.shape
    u = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.zeros(n, w, 8, dtype=torch.uint8, device=words.device)
    for t in range(8):
        acc = torch.zeros(n, w, dtype=torch.int64, device=words.device)
        for b in range(4):
            acc |= ((u >> int(_POS[t, b])) & 1) << b
        codes[:, :, t] = acc.to(torch.uint8)
    return codes.reshape(n, w * 8)


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

