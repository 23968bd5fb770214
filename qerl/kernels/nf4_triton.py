"""Single-pass NF4 -> bf16 dequantisation in Triton: the fast half of the QLoRA baseline.

QLoRA (bitsandbytes) runs a 4-bit matmul in training as "dequantise the whole weight to bf16
in one kernel, then cuBLAS". `dequant_bf16` is that first kernel (reads 4.5 bits per weight,
writes 16); the benchmark times it + torch.matmul as the `nf4` baseline, which is a fairer
opponent than the multi-pass torch dequantisation in `reference.nf4_dequant_matmul` (the CPU
reference). Not a fused GEMM. Imported only when triton is used.

`fused_matmul` is the other NF4 column of issue 4's report, labelled as such (`nf4-fused` in
benchmarks/bench_w4a16.py): a plain fused Triton GEMM that decodes NF4 tiles in registers (code
book lookup, times the block's absmax, rounded to bf16 exactly as `dequant_bf16` rounds) and
reduces them with tensor-core dots, so the bf16 weight never reaches memory. It is what "a fused
NF4 kernel, if cheap" costs: no GEMV path, and its default config (FUSED_CONFIG: 64 weight rows,
no split-K) ran at 0.07-0.08x of bf16 on an H200, against the baseline's 0.47x (NOTES_w4a16.md
section 37); `config` selects the alternatives listed there. Nothing routes to it; QuantLinear's
nf4 stays the dequantise-then-cuBLAS baseline that QLoRA runs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from qerl.formats import nf4

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    from qerl.kernels.w4a16_triton import _patch_interpreter

    _patch_interpreter()  # numpy >= 2.4 and the interpreter's handling of scalar loop bounds


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


@triton.jit
def _nf4_fused_kernel(x_ptr, p_ptr, a_ptr, cb_ptr, pair_ptr, y_ptr, M, N, K, STEPS, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, PAIR: tl.constexpr,
                      AMAX2D: tl.constexpr, INTERPRETED: tl.constexpr):
    """y[BM rows, BN cols] of x [M, K] @ dequant(W)^T: per BK step, the packed bytes [BN, BK/2] decode to
    bf16 [BN, BK] (low nibble = even k; absmax per 64 weights of a row) and meet x's [BM, BK] in a dot.
    SPLIT > 1: program axis 2 takes its share of the STEPS = K / BK steps and writes fp32 partials to
    y_ptr [SPLIT, M, N]. PAIR: one 8-byte load per packed byte from a 256-entry table of both nibbles'
    fp32 code book values (pair_ptr) instead of two 4-byte loads. AMAX2D: the absmax gathered as
    [BN, BK] by k // 64 instead of [BN, BK/64] and a 3-D reshape. The interpreter's dot of bf16
    operands is wrong, so there both stay float32 (as in w4a16_triton)."""
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = rn < N
    s = tl.program_id(2)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(s * STEPS // SPLIT, (s + 1) * STEPS // SPLIT):
        k0 = step * BK
        kb = k0 // 2 + tl.arange(0, BK // 2)
        b = tl.load(p_ptr + rn[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None], other=0).to(tl.int32)
        if PAIR:
            v = tl.load(pair_ptr + b)
            lo = (v & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            hi = ((v >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            lo = tl.load(cb_ptr + (b & 0xF))
            hi = tl.load(cb_ptr + (b >> 4))
        if AMAX2D:
            kw = k0 + tl.arange(0, BK)
            amax = tl.load(a_ptr + rn[:, None] * (K // 64) + kw[None, :] // 64, mask=row_ok[:, None], other=0.0)
            w = tl.join(lo, hi).reshape(BN, BK) * amax
        else:
            kg = k0 // 64 + tl.arange(0, BK // 64)
            amax = tl.load(a_ptr + rn[:, None] * (K // 64) + kg[None, :], mask=row_ok[:, None], other=0.0)
            w = (tl.join(lo, hi).reshape(BN, BK // 64, 64) * amax[:, :, None]).reshape(BN, BK)
        kx = k0 + tl.arange(0, BK)
        xk = tl.load(x_ptr + rm[:, None] * K + kx[None, :], mask=(rm < M)[:, None], other=0.0)
        if INTERPRETED:
            xk = xk.to(tl.float32)
        else:
            w = w.to(tl.bfloat16)
        acc += tl.dot(xk, tl.trans(w))
    out = y_ptr + s * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & row_ok[None, :])


@functools.lru_cache(maxsize=None)
def _pair_table(device: torch.device) -> torch.Tensor:
    """[256] int64: byte b -> fp32 bits of code book[b & 15] (low word) and of code book[b >> 4] (high word)."""
    bits = nf4.codebook(torch.device("cpu")).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = torch.arange(256)
    with torch.inference_mode(False):
        return (bits[b & 15] | (bits[b >> 4] << 32)).to(device)


@functools.lru_cache(maxsize=None)
def _codebook(device: torch.device) -> torch.Tensor:
    """The 16 NF4 values on `device`, built once (no host->device copy inside a CUDA graph)."""
    return nf4.codebook(device)


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
FUSED_CONFIG = {"BN": 64, "BK": 256, "SPLIT": 1, "PAIR": False, "AMAX2D": False, "num_warps": 4, "num_stages": 3}
FUSED_BM = 16


def fused_matmul(x: torch.Tensor, tensors: dict[str, torch.Tensor], absmax: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T for bf16 x [M, K] (any M) and NF4 checkpoint tensors of W [N, K], with K a multiple
    of the config's BK, in one fused kernel (module docstring; with SPLIT > 1 a torch sum of the fp32 partials
    follows); `absmax` may hand in nf4.absmax_from(tensors) made once (double quantisation otherwise costs a few
    torch kernels per call); `config` overrides FUSED_CONFIG's keys."""
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
    if not 1 <= split <= steps:
        raise ValueError(f"fused_matmul's SPLIT must be 1..{steps} (K / BK) here, got {split}")
    absmax = (nf4.absmax_from(tensors) if absmax is None else absmax).to(torch.float32).contiguous()
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, int(cfg["BN"])), triton.cdiv(m, FUSED_BM), split)
    _nf4_fused_kernel[grid](x, packed.contiguous(), absmax, _codebook(x.device), _pair_table(x.device), y, m, n, k,
                            steps, BM=FUSED_BM, BN=int(cfg["BN"]), BK=bk, SPLIT=split, PAIR=bool(cfg["PAIR"]),
                            AMAX2D=bool(cfg["AMAX2D"]), INTERPRETED=INTERPRETED, num_warps=int(cfg["num_warps"]),
                            num_stages=int(cfg["num_stages"]))
    return y if split == 1 else y.sum(0).to(x.dtype)


def dequant_matmul(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The QLoRA baseline: y = x @ dequant_bf16(W)^T (cuBLAS), weight materialised in memory."""
    return x @ dequant_bf16(tensors).T
