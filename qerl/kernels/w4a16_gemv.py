"""CUDA-core GEMV for M = 1 decode: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (nvfp4, mxfp4).

Default for M = 1 on layers with N*K <= 40M (w4a16_triton.GEMV_MAX_NK), where it beats the fused
tensor-core kernel by 10-25% on the H100; any M runs (PATH="gemv"), but M > 1 is slow.

No tensor cores: each program decodes a [BN, 256] block of the tiled weight layout
(`qerl.kernels.layout`, one contiguous 64 x 256 tile per row block and step), multiplies it by
the activations broadcast along N and reduces along K with `tl.sum` (fp32 FMA), so there is no
MMA operand to assemble (the register moves that cost the tensor-core path ~1.1 instructions per
weight, benchmarks/NOTES_w4a16.md section 7) and the register footprint stays small (many
programs resident, many 16-byte loads in flight). The cost grows by one FMA per weight per extra
row of x, which is why it only serves the smallest M.

Schedule: split-K as the fused kernel's SPLIT schedule: program p owns row block p // S and the
reduction steps [j*KI//S, (j+1)*KI//S), j = p % S. A block covered by one program is stored
directly; otherwise each program writes its fp32 partial to its own workspace slot, bumps the
block's counter, and the last arrival sums the partials in program order (deterministic),
writes bf16 and resets the counter: one launch, no host sync, CUDA-graph capturable.

Decode (exact, as the fused kernel): PACKED (GPU default) = the packed bf16x2 decode with the
scale multiply in inline PTX (q * s * 2^-J exact in bf16), widened to fp32; otherwise (the
interpreter, or DECODE_F32) the fp32 decode. The accumulator is multiplied by alpha once at the
end. BN divides 64, so every load stays inside the zero-padded tiles (no load masks).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qerl.kernels import w4a16_triton as W


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_cm, KB, exp_bias, S,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, PACKED: tl.constexpr,
    ACC2D: tl.constexpr = False, CH: tl.constexpr = 32, PDL: tl.constexpr = False, PF: tl.constexpr = 0,
    LATE: tl.constexpr = False,
):
    if PDL and not LATE:  # (w4a16_triton.PDL_LATE)
        W.gdc_launch_dependents()
    p = tl.program_id(0)
    blk = p // S
    j = p - blk * S
    KI = tl.cdiv(K, BK)
    k0 = (j * KI) // S
    k1 = ((j + 1) * KI) // S
    offs_n = blk * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < M
    offs_k = k0 * BK + tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # ACC2D (M = 1 only): accumulate [BN, BK / CH] partial sums (each a run of CH consecutive K,
    # summed inside a thread), one cross-thread reduction at the end; otherwise a full tl.sum over
    # K every step (slow: ~2x at M = 1, far worse at M > 1; kept for M > 1 correctness only).
    acc2 = tl.zeros([BN, BK // CH], dtype=tl.float32)
    # PF = D > 0: the weight of step kk + D is loaded while step kk is decoded (D raw tiles in
    # registers per program: more bytes in flight per SM, which is what bounds a GEMV's
    # bandwidth; benchmarks/NOTES_w4a16.md section 10), the first D before the PDL wait: weights
    # never depend on the previous kernel. PF = 0: Triton's own scheduling of the loop.
    if PF >= 1:
        r0w, r0s = W._w_raw_at(w_ptr, s_ptr, offs_n, k0 * (BK // 8), KB, k0 < k1, FMT, BK, F32, PACKED)
    if PF >= 2:
        r1w, r1s = W._w_raw_at(w_ptr, s_ptr, offs_n, (k0 + 1) * (BK // 8), KB, k0 + 1 < k1, FMT, BK, F32, PACKED)
    if PF >= 3:
        r2w, r2s = W._w_raw_at(w_ptr, s_ptr, offs_n, (k0 + 2) * (BK // 8), KB, k0 + 2 < k1, FMT, BK, F32, PACKED)
    alpha = tl.load(alpha_ptr)  # the layer's constants before the wait: no dependent load in the epilogue
    bias = W._bias(bias_ptr, offs_n, N, HAS_BIAS)
    if PDL:
        W.gdc_wait()
    for kk in range(k0, k1):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if PF >= 1:
            nw, ns = W._w_raw_at(w_ptr, s_ptr, offs_n, (kk + PF) * (BK // 8), KB, kk + PF < k1, FMT, BK, F32, PACKED)
            w = W._decode_raw(r0w, r0s, exp_bias, FMT, BN, BK, F32, PACKED)
            if PF == 1:
                r0w, r0s = nw, ns
            elif PF == 2:
                r0w, r0s, r1w, r1s = r1w, r1s, nw, ns
            else:
                r0w, r0s, r1w, r1s, r2w, r2s = r1w, r1s, r2w, r2s, nw, ns
        else:
            w = W._w_tile_at(w_ptr, s_ptr, offs_n, offs_n < N, kk * (BK // 8), KB, exp_bias, FMT, BN, BK,
                             False, F32, PACKED)
        if ACC2D:  # BM == 1
            prod = w.to(tl.float32) * tl.sum(x.to(tl.float32), axis=0)[None, :]
            acc2 += tl.sum(prod.reshape(BN, BK // CH, CH), axis=2)
        else:  # rows past N exist (zero padding of the 64-row tiles): no load mask needed
            w = w.to(tl.float32)
            acc += tl.sum(w[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        x_ptrs += BK
        offs_k += BK
    if PDL and LATE:
        W.gdc_launch_dependents()
    if ACC2D:
        acc = tl.sum(acc2, axis=1)[None, :]
    mask = m_mask[:, None] & (offs_n < N)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    done = k1 > k0
    if S > 1:
        ws_tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(ws_ptr + p * (BM * BN) + ws_tile, acc)
        tl.debug_barrier()  # all threads' partials are written before the counter moves
        count = tl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
        done = count == S - 1
        if done:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for q in range(blk * S, blk * S + S):
                acc += tl.load(ws_ptr + q * (BM * BN) + ws_tile, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + blk, 0)  # ready for the next launch
    if done:
        W._store_out(acc, alpha, bias, c_ptrs, mask, HAS_BIAS)


# Default for M = 1 on layers with N*K <= w4a16_triton.GEMV_MAX_NK (benchmarks/NOTES_w4a16.md
# section 9): 32 rows x 256 K per step, 4 warps, in-thread sums of 32 K, ~7 programs per SM.
# M > 1 runs the per-step tl.sum path (correct, but 3-20x slower than the fused kernel).
DEFAULT = dict(BN=32, num_warps=4, PER_SM=7, ACC2D=True, CH=32)
PF_DEPTH = 1  # weight prefetch depth (steps) used with PDL unless the config names PF
# With PDL, let the next kernel launch after the main loop rather than at the start: in the
# rollout engine's chain an early trigger cascades through the small kernels after a q/k/v or o
# GEMV (RoPE, attention, combine, the next GEMV), whose programs then sit resident in their PDL
# wait and take slots from this one. Measured (H100, step time, batch 1): 32B +1.8..2.8%, 14B +2.5%.
# (The same for the tensor-core kernel at batch 8 cost 2.5%: w4a16_triton.PDL_LATE stays off.)
PDL_LATE = os.environ.get("QERL_W4A16_GEMV_PDL_LATE", "1") == "1"
_RESIDENT: dict = {}


def _resident(kernel) -> int | None:
    return W._resident_per_sm(kernel)


def forward(x: torch.Tensor, state: dict, bias=None, config: dict | None = None, out=None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias), x [M, K] bf16 with M <= 16 (contiguous rows)."""
    n, k = state["n"], state["k"]
    m = x.shape[0]
    cfg = dict(DEFAULT)
    cfg.update({key: v for key, v in (config or {}).items() if key in W._GEMV_KEYS})
    bn, per_sm = cfg.pop("BN"), cfg.pop("PER_SM")
    if 64 % bn:
        raise ValueError(f"BN must divide 64, got {bn}")
    s_forced, waves = cfg.pop("S", None), int(cfg.pop("WAVES", 1))
    port = W.portable(x.device)  # (w4a16_triton.PORTABLE)
    decode_f32 = bool(cfg.pop("DECODE_F32", W.DECODE_F32 or port))
    packed = bool(cfg.pop("PACKED", W.PACKED_DECODE)) and not W.INTERPRETED and not decode_f32 and not port
    acc2d = bool(cfg.pop("ACC2D", False)) and m == 1
    pdl = bool(cfg.pop("PDL", W.PDL)) and not W.INTERPRETED and not port
    cfg["LATE"] = bool(cfg.pop("PDL_LATE", PDL_LATE)) and pdl
    cfg["PF"] = min(3, int(cfg.get("PF", PF_DEPTH if pdl else 0)))
    cfg["CH"] = int(cfg.get("CH", 32))
    bk = 256
    bm = max(1, triton.next_power_of_2(m))
    blocks = triton.cdiv(n, bn)
    ki = triton.cdiv(k, bk)
    W.rows_order(state, "CUDA-core GEMV")
    flags = dict(FMT=W.fmt_id(state), HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BM=bm, BN=bn, BK=bk,
                 F32=W.INTERPRETED or decode_f32, PACKED=packed, ACC2D=acc2d, PDL=pdl, **cfg)
    key = tuple(sorted(flags.items()))
    if s_forced is not None:
        s = max(1, min(int(s_forced), ki))
    else:
        slots = _RESIDENT.get(key, per_sm) * W._num_sms(x.device.index if x.device.index is not None else 0) * waves
        s_max = max(1, min(ki, slots // blocks))
        steps = -(-ki // s_max)
        s = -(-ki // steps)  # fewest slices with the same longest slice
    locks = state["locks"]
    if blocks > locks.numel():
        locks = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    c = torch.empty(m, n, device=x.device, dtype=torch.bfloat16) if out is None else out
    grid = blocks * s
    ws = torch.empty(grid * bm * bn if s > 1 else 1, device=x.device, dtype=torch.float32)
    kernel = _gemv_kernel[(grid,)](
        x, state["words"], state["scale"], state["alpha"], bias if bias is not None else c, c, ws, locks,
        m, n, k, x.stride(0), c.stride(0), state["kb"], state["exp_bias"], s, launch_pdl=pdl, **flags,
    )
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident(kernel) or per_sm
    return c
