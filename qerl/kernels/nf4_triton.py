"""Single-pass NF4 -> bf16 dequantisation in Triton: the fast half of the QLoRA baseline.

QLoRA (bitsandbytes) runs a 4-bit matmul in training as "dequantise the whole weight to bf16
in one kernel, then cuBLAS". `dequant_bf16` is that first kernel (reads 4.5 bits per weight,
writes 16); the benchmark times it + torch.matmul as the `nf4` baseline, which is a fairer
opponent than the multi-pass torch dequantisation in `reference.nf4_dequant_matmul` (the CPU
reference). Not a fused GEMM. Imported only when triton is used.

`fused_matmul` is the other NF4 column of issue 4's report, labelled as such (`nf4-fused` in
benchmarks/bench_w4a16.py): a plain fused Triton GEMM (by default 16 to 64 rows of x by 32 rows of W per program, up to 4
slices of K summed in fp32) that decodes NF4 tiles in registers and reduces them with tensor-core dots, so the
bf16 weight never reaches memory. Its default decode (DECODE "prmt") looks the codes up with byte permutes in
inline PTX (PRMT_ASM) and rounds as bitsandbytes' fused 4-bit GEMV does, bf16(code) * bf16(absmax), which
differs from dequant_bf16 in the last bit of some weights; DECODE "table" is the first version (code book loads,
rounded as dequant_bf16 rounds), about 10x slower. On an H200 (NOTES_w4a16.md section 38) it runs at ~0.77x of
bf16 for M <= 16, against the baseline's 0.47x; from M = 64 the baseline is as fast or faster. QuantLinear's nf4
stays the dequantise-then-cuBLAS baseline that QLoRA trains with; QERL_NF4_FUSED_MAX_M (default 0) sends small
inference calls here, for benchmarks that time a fused NF4 rollout.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from qerl.formats import nf4
from qerl.kernels.train_triton import _to_bf16_rne
from qerl.kernels.w4a16_triton import _hi, _lo

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # w4a16_triton patches the interpreter on import


@triton.jit
def _nf4_dequant_kernel(p_ptr, a_ptr, cb_ptr, o_ptr, n_bytes, BLOCK: tl.constexpr):
    """Each program: BLOCK packed bytes -> 2*BLOCK bf16 (low nibble first); absmax per 32 bytes."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    b = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(a_ptr + offs // 32, mask=mask, other=0.0)
    lo = tl.load(cb_ptr + (b & 0xF)) * absmax
    hi = tl.load(cb_ptr + (b >> 4)) * absmax
    out = tl.join(lo, hi).reshape(2 * BLOCK)
    offs2 = tl.program_id(0) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(o_ptr + offs2, out.to(o_ptr.dtype.element_ty), mask=offs2 < 2 * n_bytes)


def _prmt_tables() -> list[int]:
    """The 16 code book values' bf16 bytes as 8 words: high bytes of entries 0-3, 4-7, 8-11, 12-15, then the low
    bytes likewise (entry 4i + b in byte b)."""
    bits = [int(v) & 0xFFFF for v in nf4.codebook(torch.device("cpu")).to(torch.bfloat16).view(torch.int16).tolist()]

    def word(vals):
        return sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals))

    return [word([b >> 8 for b in bits[4 * i: 4 * i + 4]]) for i in range(4)] + \
        [word([b & 0xFF for b in bits[4 * i: 4 * i + 4]]) for i in range(4)]


def _prmt_asm() -> str:
    """Inline PTX for DECODE = "prmt": one packed word (8 NF4 codes, weight 2j in the low nibble of byte j) and
    the block's absmax as bf16x2 -> four bf16x2 words, weights (0, 1), (2, 3), (4, 5), (6, 7). The 16 code book
    values' bf16 bytes sit in 8 registers (high bytes HT0..HT3, low bytes LT0..LT3, four entries each); for four
    codes at once, two byte permutes (PRMT) pick each byte from entries 0-7 and from entries 8-15 (3-bit
    selectors: the code & 7), a third keeps the half named by the code's bit 3, two more interleave low and high
    bytes into bf16 pairs, and one bf16x2 multiply applies the absmax: ~3.5 instructions a weight (the table moves
    aside), no memory."""
    tables = _prmt_tables()
    lines = [".reg .b32 ht<4>, lt<4>, o<4>, sc, s7, q, a, b, h, l;"]
    lines += [f"mov.b32 {'ht' if i < 4 else 'lt'}{i % 4}, {v:#010x};" for i, v in enumerate(tables)]
    lines += ["mov.b32 sc, $5;",
              "and.b32 s7, $4, 0x77777777;",  # 3-bit selectors (prmt reads the low 16 bits: four codes)
              "shr.u32 q, $4, 1;",
              "lop3.b32 q, q, 0x44444444, 0x32103210, 0xEA;"]  # (q & 0x4..) | 0x3210..: byte i from a or b by bit 3
    for half in (0, 1):
        o0, o1 = 2 * half, 2 * half + 1
        if half:
            lines += ["shr.u32 s7, s7, 16;", "shr.u32 q, q, 16;"]
        lines += ["prmt.b32 a, ht0, ht1, s7;", "prmt.b32 b, ht2, ht3, s7;", "prmt.b32 h, a, b, q;",
                  "prmt.b32 a, lt0, lt1, s7;", "prmt.b32 b, lt2, lt3, s7;", "prmt.b32 l, a, b, q;",
                  f"prmt.b32 o{o0}, l, h, 0x5140;", f"prmt.b32 o{o1}, l, h, 0x7362;",
                  f"mul.rn.bf16x2 o{o0}, o{o0}, sc;", f"mul.rn.bf16x2 o{o1}, o{o1}, sc;"]
    # the outputs only after the last read of an input: an output may share an input's register
    lines += [f"mov.b32 ${i}, o{i};" for i in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


PRMT_ASM = _prmt_asm()


@triton.jit
def _pairs_emulated(w, s2, cbb_ptr, j: tl.constexpr):
    """The interpreter's stand-in for PRMT_ASM's output word j: weights 2j and 2j + 1 as bf16x2 bits, each
    bf16(code) * bf16(absmax) rounded to bf16 (the fp32 product of two bf16 values is exact). Like the PTX's
    mul.bf16x2, the low weight takes s2's low half and the high weight its high half, so a wrong half shows here."""
    a_lo = (s2 << 16).to(tl.float32, bitcast=True)
    a_hi = (s2 & 0xFFFF0000).to(tl.float32, bitcast=True)
    lo = _to_bf16_rne(tl.load(cbb_ptr + ((w >> (8 * j)) & 0xF)) * a_lo).to(tl.uint32, bitcast=True)
    hi = _to_bf16_rne(tl.load(cbb_ptr + ((w >> (8 * j + 4)) & 0xF)) * a_hi).to(tl.uint32, bitcast=True)
    return (lo >> 16) | hi


@triton.jit
def _nf4_fused_kernel(x_ptr, p_ptr, pw_ptr, a_ptr, cb_ptr, cbb_ptr, y_ptr, M, N, K, STEPS, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, DECODE: tl.constexpr,
                      PRMT: tl.constexpr, INTERPRETED: tl.constexpr):
    """y[BM rows, BN cols] of x [M, K] @ dequant(W)^T: per BK step, the packed weights [BN, BK/2 bytes] decode to
    bf16 [BN, BK] (low nibble = even k; absmax per 64 weights of a row) and meet x's [BM, BK] in a dot.
    SPLIT > 1: program axis 2 takes its share of the STEPS = K / BK steps and writes fp32 partials to
    y_ptr [SPLIT, M, N]. DECODE "table": bytes p_ptr, two code book loads (cb_ptr, fp32) per byte, times the fp32
    absmax, rounded to bf16 (= dequant_bf16's weight). DECODE "prmt": words pw_ptr [N, K/8], decoded in registers by
    PRMT (the inline PTX) as bf16(code) * bf16(absmax) (bitsandbytes' 4-bit GEMV rounding); the interpreter runs
    the same words through _pairs_emulated (cbb_ptr: the code book rounded to bf16, as fp32). The interpreter's dot
    of bf16 operands is wrong, so there both stay float32 (as in w4a16_triton)."""
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rn < N
    s = tl.program_id(2)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(s * STEPS // SPLIT, (s + 1) * STEPS // SPLIT):
        k0 = step * BK
        kg = k0 // 64 + tl.arange(0, BK // 64)
        amax = tl.load(a_ptr + rn[:, None] * (K // 64) + kg[None, :], mask=row_ok[:, None], other=0.0)
        if DECODE == "prmt":
            kw = k0 // 8 + tl.arange(0, BK // 8)
            w = tl.load(pw_ptr + rn[:, None] * (K // 8) + kw[None, :], mask=row_ok[:, None], other=0)
            w = w.to(tl.uint32, bitcast=True)
            ab = _to_bf16_rne(amax).to(tl.uint32, bitcast=True)  # the absmax's bf16 in the high half
            s2 = tl.broadcast_to((ab | (ab >> 16))[:, :, None], (BN, BK // 64, 8)).reshape(BN, BK // 8)
            if INTERPRETED:
                p0 = _pairs_emulated(w, s2, cbb_ptr, 0)
                p1 = _pairs_emulated(w, s2, cbb_ptr, 1)
                p2 = _pairs_emulated(w, s2, cbb_ptr, 2)
                p3 = _pairs_emulated(w, s2, cbb_ptr, 3)
            else:
                p0, p1, p2, p3 = tl.inline_asm_elementwise(PRMT, "=r,=r,=r,=r,r,r", [w, s2],
                                                           dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                           is_pure=True, pack=1)
            # flat order inside a word: t = 2j + half = 4 * (j // 2) + 2 * (j % 2) + half
            wt = tl.join(tl.join(tl.join(_lo(p0, INTERPRETED), _lo(p2, INTERPRETED)),
                                 tl.join(_lo(p1, INTERPRETED), _lo(p3, INTERPRETED))),
                         tl.join(tl.join(_hi(p0, INTERPRETED), _hi(p2, INTERPRETED)),
                                 tl.join(_hi(p1, INTERPRETED), _hi(p3, INTERPRETED)))).reshape(BN, BK)
        else:
            kb = k0 // 2 + tl.arange(0, BK // 2)
            b = tl.load(p_ptr + rn[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None], other=0).to(tl.int32)
            lo = tl.load(cb_ptr + (b & 0xF))
            hi = tl.load(cb_ptr + (b >> 4))
            wt = (tl.join(lo, hi).reshape(BN, BK // 64, 64) * amax[:, :, None]).reshape(BN, BK)
            if not INTERPRETED:
                wt = wt.to(tl.bfloat16)
        kx = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + rm[:, None] * K + kx[None, :], mask=(rm < M)[:, None], other=0.0)
        if INTERPRETED:
            xk = xk.to(tl.float32)
        acc += tl.dot(xk, tl.trans(wt))
    out = y_ptr + s * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & row_ok[None, :])


@functools.lru_cache(maxsize=None)
def _codebook(device: torch.device) -> torch.Tensor:
    """The 16 NF4 values on `device`, built once (no host->device copy inside a CUDA graph)."""
    return nf4.codebook(device)


@functools.lru_cache(maxsize=None)
def _codebook_bf16(device: torch.device) -> torch.Tensor:
    """The code book rounded to bf16, held as fp32 (the interpreter's DECODE = "prmt" stand-in reads it)."""
    with torch.inference_mode(False):
        return nf4.codebook(device).to(torch.bfloat16).float()


def dequant_bf16(tensors: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """NF4 checkpoint tensors (absmax or double-quant) -> dense bf16 [N, K], one kernel pass."""
    packed = tensors["weight_packed"].contiguous()
    n, k2 = packed.shape
    absmax = nf4.absmax_from(tensors).to(torch.float32).contiguous()
    cb = _codebook(packed.device)
    o = torch.empty(n, 2 * k2, dtype=torch.bfloat16, device=packed.device) if out is None else out
    block = 1024
    _nf4_dequant_kernel[(triton.cdiv(packed.numel(), block),)](packed, absmax, cb, o, packed.numel(), BLOCK=block)
    return o


# the default config (H100 / H200 are the targets; K of every Qwen2.5 layer is a multiple of 256); `config`
# overrides any of these (benchmarks/bench_w4a16.py --nf4-fused-cands times them)
FUSED_CONFIG = {"BM": 0, "BN": 32, "BK": 256, "SPLIT": 4, "DECODE": "prmt", "num_warps": 4, "num_stages": 3}
DECODES = ("prmt", "table")


def fused_bm(m: int) -> int:
    """Rows of x per program for BM = 0 (auto): 16 (the smallest MMA tile) up to M = 16, else 32 or 64, so each
    weight tile is decoded once for every 64 rows of x rather than every 16."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def fused_matmul(x: torch.Tensor, tensors: dict[str, torch.Tensor], absmax: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for bf16 x [M, K] (any M) and NF4 checkpoint tensors of W [N, K], with K a multiple
    of the config's BK, in one fused kernel (module docstring; with SPLIT > 1, up to SPLIT slices of K, a torch
    sum of the fp32 partials follows); `absmax` may hand in nf4.absmax_from(tensors) made once (double
    quantisation otherwise costs a few torch kernels per call); `config` overrides FUSED_CONFIG's keys."""
    cfg = dict(FUSED_CONFIG, **(config or {}))
    unknown = set(cfg) - set(FUSED_CONFIG)
    if unknown:
        raise ValueError(f"fused_matmul config keys are {', '.join(FUSED_CONFIG)}; got {', '.join(sorted(unknown))}")
    packed = tensors["weight_packed"]
    n, k = packed.shape[0], 2 * packed.shape[1]
    bk, split = int(cfg["BK"]), int(cfg["SPLIT"])
    if x.ndim != 2 or x.shape[1] != k or k % bk or bk % 64:
        raise ValueError(f"fused_matmul takes x [M, {k}] with K a multiple of BK = {bk} (itself of 64), got {tuple(x.shape)}")
    steps = k // bk
    if cfg["DECODE"] not in DECODES:
        raise ValueError(f"fused_matmul's DECODE is one of {', '.join(DECODES)}, got {cfg['DECODE']!r}")
    if split < 1:
        raise ValueError(f"fused_matmul's SPLIT must be at least 1, got {split}")
    split = min(split, steps)  # SPLIT is the most K slices; a short K takes fewer
    absmax = (nf4.absmax_from(tensors) if absmax is None else absmax).to(torch.float32).contiguous()
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    bm = int(cfg["BM"]) or fused_bm(m)
    grid = (triton.cdiv(n, int(cfg["BN"])), triton.cdiv(m, bm), split)
    packed = packed.contiguous()
    _nf4_fused_kernel[grid](x, packed, packed.view(torch.int32), absmax, _codebook(x.device), _codebook_bf16(x.device),
                            y, m, n, k, steps, BM=bm, BN=int(cfg["BN"]), BK=bk, SPLIT=split,
                            DECODE=cfg["DECODE"], PRMT=PRMT_ASM, INTERPRETED=INTERPRETED,
                            num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]))
    return y if split == 1 else y.sum(0).to(x.dtype)


def dequant_matmul(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The QLoRA baseline: y = x @ dequant_bf16(W)^T (cuBLAS), weight materialised in memory."""
    return x @ dequant_bf16(tensors).T
