"""Warp-specialised M = 1 GEMV for nvfp4 on Hopper (Gluon): y[1, N] = x[1, K] @ dequant(W)[N, K]^T.

Experimental, opt-in (`config={"PATH": "ws"}`), never the default dispatch until it wins on the
H100 (benchmarks/NOTES_w4a16.md section 11).

Why: the Triton GEMV (w4a16_gemv.py) keeps only ~4.5 KB of weight loads in flight per program,
because every byte in flight is a register; a kernel that only streams the same bytes needs
~128 KB in flight per SM to reach 2.7 TB/s (section 10). Here one producer warp per program copies
whole 64-row x 256-K weight tiles (8 KB of words + 1 KB of scales) from global to shared memory
with TMA into a ring of NS stages (mbarriers "ready" / "empty"), so the bytes in flight cost
shared memory, not registers; four consumer warps wait for a stage, read it into registers,
decode (the exact packed bf16x2 decode of w4a16_triton), multiply by x in fp32 and free the
stage.

Decode without reshapes: word c of a row holds the 8 codes of K = 8c .. 8c+7 in the layout's
order; the four packed registers P0..P3 carry the K pairs (0, 1), (4, 5), (2, 3), (6, 7) in their
(low, high) bf16 halves, so each half is widened to fp32 by a shift or a mask and multiplied by
x at its K offset: the [64, 32]-word tile never becomes a [64, 256] tensor.

Schedule and fixup as the GEMV: program p owns row tile p // S (64 rows) and the reduction steps
[j*KB//S, (j+1)*KB//S), j = p % S; a tile shared by several programs goes through the fp32
workspace and a per-tile counter, the last arrival sums the partials in program order
(deterministic) and writes bf16. One launch, no host sync.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from qerl.kernels import ptx_pwa
from qerl.kernels import w4a16_triton as W
from qerl.kernels.w4a16_triton import _KA, _KM, _KS, _R1, _R2, _R3, _S0, _S3  # the bit layout's constexprs

ptx_pwa.install()  # every Gluon kernel module imports this one (_ring_barriers may mark a kernel)


@gluon.jit
def _rotr(w, r: gl.constexpr):
    return (w >> r) | (w << (32 - r))


_NV_SCALE_MUL = gl.constexpr(3.3230699894622897e35)  # 2^118: FP8-E4M3 scale times 2^(126 - J), J = 8


@gluon.jit
def _nv_scale2(sraw, SBITS: gl.constexpr):
    """FP8-E4M3 scale bytes -> the bf16x2 multiplier s * 2^118 in both halves: with SBITS (prepare's scale_bits:
    every scale normal) the bits (b << 4) + 0x7700 by integer arithmetic, else a float conversion."""
    if SBITS:
        s2 = ((sraw.to(gl.uint8, bitcast=True).to(gl.uint32) << 4) + 0x7700) * 0x10001
    else:
        s16 = (sraw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * _NV_SCALE_MUL).to(gl.bfloat16).to(
            gl.uint16, bitcast=True).to(gl.uint32)
        s2 = s16 | (s16 << 16)
    return s2


@gluon.jit
def _scale_pairs(s_lo, s_hi):
    """FP8 scale bytes (uint8, all normal: positive) of rows g and g + 8 -> one register of both bf16 multipliers
    (b << 4) + 0x7700, row g in the low half, for a fragment word's two rows (layout.py): a PRMT (byte k of each,
    zero-extended by sign replication) and a LEA per two scales, four bytes per input register (pack 4)."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $4, $5, 0xC480; mad.lo.u32 $0, $0, 16, 0x77007700; "
        "prmt.b32 $1, $4, $5, 0xD591; mad.lo.u32 $1, $1, 16, 0x77007700; "
        "prmt.b32 $2, $4, $5, 0xE6A2; mad.lo.u32 $2, $2, 16, 0x77007700; "
        "prmt.b32 $3, $4, $5, 0xF7B3; mad.lo.u32 $3, $3, 16, 0x77007700;",
        "=r,=r,=r,=r,r,r", [s_lo, s_hi], dtype=gl.uint32, is_pure=True, pack=4)


@gluon.jit
def _mul2(p, s2):
    return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, s2], dtype=gl.uint32,
                                     is_pure=True, pack=1)


@gluon.jit
def _lo(p):
    return (p << 16).to(gl.float32, bitcast=True)


@gluon.jit
def _hi(p):
    return (p & 0xFFFF0000).to(gl.float32, bitcast=True)


@gluon.jit
def _gdc(op: gl.constexpr):
    """griddepcontrol.wait / .launch_dependents (programmatic dependent launch, w4a16_triton.PDL)."""
    gl.inline_asm_elementwise("griddepcontrol." + op + "; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _copy_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, row):
    """TMA copies of one 64-row weight tile (words and scales at tiled row `row`) into stage idx,
    completing on ready[idx]. mxfp4's scale boxes are [32, 16] (a tile's 64 x 8 bytes, `descriptors`): their
    row is half the words' row."""
    tma.async_copy_global_to_shared(w_desc, [row, 0], ready.index(idx), w_bufs.index(idx))
    SROWS: gl.constexpr = s_desc.block_type.shape[0]
    if SROWS == 64:
        tma.async_copy_global_to_shared(s_desc, [row, 0], ready.index(idx), s_bufs.index(idx))
    else:
        tma.async_copy_global_to_shared(s_desc, [row // (64 // SROWS), 0], ready.index(idx), s_bufs.index(idx))


@gluon.jit
def _producer(w_desc, s_desc, w_bufs, s_bufs, ready, empty, trow0, k0, k1, NS: gl.constexpr):
    for kk in range(k0, k1):
        i = kk - k0
        idx = i % NS
        phase = (i // NS) & 1
        mbarrier.wait(empty.index(idx), phase ^ 1)  # barriers start with phase 1 complete
        mbarrier.expect(ready.index(idx), w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        _copy_tile(w_desc, s_desc, w_bufs, s_bufs, ready, idx, trow0 + kk * 64)


@gluon.jit
def _consumer(x_ptr, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, w_bufs, s_bufs, ready, empty,
              p, blk, N, k0, k1, S, NS: gl.constexpr, HAS_BIAS: gl.constexpr, LW: gl.constexpr,
              LS: gl.constexpr, PDL: gl.constexpr):
    LX: gl.constexpr = gl.SliceLayout(0, LW)
    LR: gl.constexpr = gl.SliceLayout(1, LW)
    cols8 = gl.arange(0, 32, layout=LX) * 8
    acc = gl.zeros([64, 32], gl.float32, LW)
    if PDL:  # x, the output and the workspace only after the previous kernel (the producer needs no wait)
        _gdc("wait")
    for kk in range(k0, k1):
        i = kk - k0
        idx = i % NS
        phase = (i // NS) & 1
        xb = x_ptr + kk * 256 + cols8
        x0 = gl.load(xb + 0).to(gl.float32)[None, :]
        x1 = gl.load(xb + 1).to(gl.float32)[None, :]
        x2 = gl.load(xb + 2).to(gl.float32)[None, :]
        x3 = gl.load(xb + 3).to(gl.float32)[None, :]
        x4 = gl.load(xb + 4).to(gl.float32)[None, :]
        x5 = gl.load(xb + 5).to(gl.float32)[None, :]
        x6 = gl.load(xb + 6).to(gl.float32)[None, :]
        x7 = gl.load(xb + 7).to(gl.float32)[None, :]
        mbarrier.wait(ready.index(idx), phase)
        words = w_bufs.index(idx).load(LW).to(gl.uint32, bitcast=True)
        sraw = s_bufs.index(idx).load(LS)
        fence_async_shared()
        mbarrier.arrive(empty.index(idx), count=1)
        # nvfp4 group scale (FP8-E4M3) as the bf16 multiplier s * 2^118, in both halves of a word
        s = (sraw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 3.3230699894622897e35).to(gl.bfloat16)
        s16 = s.to(gl.uint16, bitcast=True).to(gl.uint32)
        s2 = s16 | (s16 << 16)
        s2 = gl.convert_layout(gl.reshape(gl.join(s2, s2), [64, 32]), LW)  # one scale per 2 words
        p0 = _mul2((words & _KM) | (_rotr(words, _S0) & _KS), s2)
        p1 = _mul2(_rotr(words, _R1) & _KA, s2)
        p2 = _mul2(_rotr(words, _R2) & _KA, s2)
        p3 = _mul2((_rotr(words, _R3) & _KM) | (_rotr(words, _S3) & _KS), s2)
        acc += _lo(p0) * x0 + _hi(p0) * x1 + _lo(p2) * x2 + _hi(p2) * x3
        acc += _lo(p1) * x4 + _hi(p1) * x5 + _lo(p3) * x6 + _hi(p3) * x7
    part = gl.sum(acc, axis=1)  # [64] in LR
    rows = gl.arange(0, 64, layout=LR)
    offs_n = blk * 64 + rows
    done = k1 > k0
    if S > 1:
        gl.store(ws_ptr + p * 64 + rows, part)
        gl.thread_barrier()
        count = gl.atomic_add(lock_ptr + blk, 1, sem="acq_rel", scope="gpu")
        done = count == S - 1
        if done:
            part = gl.zeros([64], gl.float32, LR)
            for q in range(blk * S, blk * S + S):
                part += gl.load(ws_ptr + q * 64 + rows, cache_modifier=".cg")
            gl.atomic_xchg(lock_ptr + blk, 0)
    if done:
        out = part * gl.load(alpha_ptr)
        if HAS_BIAS:
            out += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)
        gl.store(c_ptr + offs_n, out.to(gl.bfloat16), mask=offs_n < N)


@gluon.jit
def _ring_barriers(NS: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr = 1):
    """(ready, empty): NS mbarriers each for a ring of NS shared-memory stages; ready completes on
    one arrival (the copy's), empty on EMPTY_ARRIVALS. EMPTY_ARRIVALS > 1 (one per consumer warp)
    also emits ptx_pwa's mark, so the consumers' arrives are rewritten to one per warp: the count
    and the rewrite go together or the ring would wait for arrivals that never come."""
    if EMPTY_ARRIVALS > 1:
        ptx_pwa.mark()
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=EMPTY_ARRIVALS)
    return ready, empty


@gluon.jit
def _setup(w_desc, s_desc, KB, S, NS: gl.constexpr, PDL: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr = 1):
    """Common start of the warp-specialised GEMVs: PDL trigger, this program's row block and K
    slice (split schedule), and the NS-stage ring with its ready / empty mbarriers (_ring_barriers)."""
    if PDL:
        _gdc("launch_dependents")
    p = gl.program_id(0)
    blk = p // S
    j = p - blk * S
    k0 = (j * KB) // S
    k1 = ((j + 1) * KB) // S
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NS] + w_desc.block_type.shape, w_desc.layout)
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [NS] + s_desc.block_type.shape, s_desc.layout)
    ready, empty = _ring_barriers(NS, EMPTY_ARRIVALS)
    return p, blk, k0, k1, blk * (KB * 64), w_bufs, s_bufs, ready, empty


@gluon.jit
def _ws_gemv_kernel(x_ptr, w_desc, s_desc, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, N, KB, S,
                    NS: gl.constexpr, HAS_BIAS: gl.constexpr, CPT: gl.constexpr, WREGS: gl.constexpr,
                    PDL: gl.constexpr, num_warps: gl.constexpr):
    # consumer layout of the [64 rows, 32 words] tile: CPT words per thread along K (each needs
    # 8 activations in registers), the rest of the 64 rows over the lanes and warps
    TPC: gl.constexpr = 32 // CPT
    TPR: gl.constexpr = 32 // TPC
    RPT: gl.constexpr = 64 // (TPR * num_warps)
    LW: gl.constexpr = gl.BlockedLayout([RPT, CPT], [TPR, TPC], [num_warps, 1], [1, 0])
    LS: gl.constexpr = gl.BlockedLayout([RPT, CPT // 2], [TPR, TPC], [num_warps, 1], [1, 0])
    p, blk, k0, k1, trow0, w_bufs, s_bufs, ready, empty = _setup(w_desc, s_desc, KB, S, NS, PDL)
    gl.warp_specialize([
        (_consumer, (x_ptr, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, w_bufs, s_bufs, ready, empty,
                     p, blk, N, k0, k1, S, NS, HAS_BIAS, LW, LS, PDL)),
        (_producer, (w_desc, s_desc, w_bufs, s_bufs, ready, empty, trow0, k0, k1, NS)),
    ], [1], [WREGS])  # the producer keeps WREGS registers and hands the rest to the consumers (setmaxnreg)


DEFAULT = dict(NS=3, num_warps=4, PER_SM=3, maxnreg=72, CPT=2)  # best of 20 configs on the H100 (section 11)
_RESIDENT: dict = {}


def forward(x: torch.Tensor, state: dict, bias=None, config: dict | None = None, out=None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [1, K] bf16 and an nvfp4 `state` (qerl.kernels.prepare)."""
    if state["fmt"] != "nvfp4" or x.shape[0] != 1:
        raise ValueError("the warp-specialised GEMV takes nvfp4 weights and M = 1")
    W.rows_order(state, "warp-specialised GEMV")
    cfg = dict(DEFAULT)
    cfg.update({k: v for k, v in (config or {}).items() if k in ("NS", "num_warps", "PER_SM", "S", "maxnreg", "CPT", "WREGS", "PDL")})
    cfg["WREGS"] = int(cfg.get("WREGS", 24))
    cfg["PDL"] = bool(cfg.get("PDL", W.PDL))
    n, kb = state["n"], state["kb"]
    if state["k"] != kb * 256:
        raise ValueError("the warp-specialised GEMV needs K a multiple of 256")
    ns, per_sm = int(cfg.pop("NS")), int(cfg.pop("PER_SM"))
    key = (ns, cfg["num_warps"], cfg.get("maxnreg"), cfg["CPT"], cfg["WREGS"], cfg["PDL"])
    s, grid, w_desc, s_desc, c, locks, ws = _plan(x, state, out, cfg.pop("S", None), _RESIDENT.get(key, per_sm))
    kernel = _ws_gemv_kernel[(grid,)](
        x, w_desc, s_desc, state["alpha"], bias if bias is not None else c, c, ws, locks, n, kb, s,
        NS=ns, HAS_BIAS=bias is not None, launch_pdl=cfg["PDL"], **cfg,
    )
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident(kernel, cfg["num_warps"], cfg.get("maxnreg")) or per_sm
    return c


def descriptors(state: dict):
    """TMA descriptors of the tiled words / scales viewed as 2-D [N/64*KB*64, 32] / [.., 16]: boxes of one
    64 x 256 tile; an mxfp4 tile's 64 x 8 scale bytes (under TMA's 16-byte minimum row) as one [32, 16] box."""
    srows = 32 if state.get("fmt") == "mxfp4" else 64
    wl = gl.NVMMASharedLayout.get_default_for([64, 32], gl.int32)
    sl = gl.NVMMASharedLayout.get_default_for([srows, 16], gl.uint8)
    return (TensorDescriptor.from_tensor(state["words"].view(-1, 32), [64, 32], wl),
            TensorDescriptor.from_tensor(state["scale"].view(-1, 16), [srows, 16], sl))


def _plan(x: torch.Tensor, state: dict, out, s_forced, per_sm: int, tokens: int = 1, descs=None, reserve: int = 0):
    """Host side of a warp-specialised GEMV launch: K slices per 64-row block (the fewest with
    the longest slice that fills per_sm programs on every SM less `reserve` slots, or s_forced), TMA
    descriptors (`descriptors`, or `descs` where the caller has its own), output [M, N], counters and
    workspace (tokens x 64 fp32 per program) -> (S, grid, w_desc, s_desc, c, locks, ws)."""
    n, kb = state["n"], state["kb"]
    blocks = triton.cdiv(n, 64)
    if s_forced is not None:
        s = max(1, min(int(s_forced), kb))
    else:
        slots = max(1, per_sm * W._num_sms(x.device.index or 0) - reserve)
        s_max = max(1, min(kb, slots // blocks))
        steps = -(-kb // s_max)
        s = -(-kb // steps)  # fewest slices with the same longest slice
    w_desc, s_desc = descriptors(state) if descs is None else descs
    c = torch.empty(x.shape[0], n, device=x.device, dtype=torch.bfloat16) if out is None else out
    locks = state["locks"]
    if blocks > locks.numel():
        locks = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    grid = blocks * s
    ws = torch.empty(grid * 64 * tokens if s > 1 else 1, device=x.device, dtype=torch.float32)
    return s, grid, w_desc, s_desc, c, locks, ws


def _resident(kernel, num_warps: int, maxnreg) -> int | None:
    """Programs per SM of a warp-specialised kernel: registers are given per warpgroup (the
    consumer warps at maxnreg, or the kernel's register count without a cap, plus one worker
    warpgroup), shared memory from the compiled kernel."""
    try:
        smem = kernel.metadata.shared
        regs = maxnreg or kernel.n_regs
    except AttributeError:
        return None
    warps = -(-num_warps // 4) * 4 + 4
    by_regs = 65536 // (max(int(regs), 24) * warps * 32)
    return max(1, min(by_regs, 233472 // (smem + 1024)))
