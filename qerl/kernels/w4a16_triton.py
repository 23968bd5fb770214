"""Fused 4-bit weight x bf16 activation GEMMs in Triton: nvfp4 and mxfp4, forward and input-grad.

    y[M, N]  = x[M, K]  @ dequant(W)[N, K]^T      (forward, `forward`)
    dx[M, K] = dy[M, N] @ dequant(W)[N, K]        (input gradient, `backward`; no weight grad)

bf16 activations in, fp32 accumulation on the tensor cores, bf16 out. The weight is read in
the tiled kernel layout of `qerl.kernels.layout` (one int32 word = 8 codes, 64 x 256 tiles)
and decoded in registers each reduction step. This module imports triton at import time: only
`qerl.kernels` imports it, and only when the triton backend is used.

One persistent kernel (`_w4a16_kernel`) for both directions; tile shape by M bucket
(`_fwd_config` / `_bwd_config`):
- decode (M <= 64): 16/32/64-row tiles, the weight streamed once with 16-byte loads; small
  layers split each tile's reduction over several programs, large ones use stream-K (equal
  work per SM). Shared tiles are finished through an fp32 workspace and a per-tile counter:
  the last program sums the partials in a fixed order and writes bf16 - one launch,
  deterministic, no host sync, CUDA-graph capturable.
- 64 < M < DEQUANT_MIN_M: 128 x 128 wgmma tiles, same schedule.
- M >= DEQUANT_MIN_M (512) (on Hopper up to WGMMA_MAX_M only where the wgmma GEMM's tiles do not
  fill the SMs, _large_m_wgmma): `dequant_bf16` writes the layer's bf16 weight once (transient) and
  cuBLAS multiplies; faster than the fused kernel there (benchmarks/NOTES_w4a16.md, section 3).
  Opt-in PATH="overlap": the same in weight slices, decoded on a side stream while cuBLAS runs
  the previous slice; measured slower on the H100, not the default (NOTES_w4a16.md, section 8).

Run the interpreter checks on CPU with tests/test_kernels.py; GPU numbers with
benchmarks/bench_w4a16.py.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qerl.env import env_int
from qerl.kernels import layout


def _patch_interpreter() -> None:
    """TRITON_INTERPRET=1 with numpy >= 2.4: triton 3.6's interpreter turns loop bounds into
    int() of a 1-element array, which numpy now refuses; index the element instead."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_qerl_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._qerl_patched = True


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Fallback decode: build the tile in fp32 (FMUL) instead of packed bf16 (HMUL2), then cast.
# Slower; only for a GPU whose bf16 multiply would flush the subnormal patterns of codes 0/0.5
# (tests/test_kernels_gpu.py::test_decode_is_exact_per_element checks both paths).
DECODE_F32 = os.environ.get("QERL_W4A16_DECODE_F32") == "1"
# Large M (compute bound): the fused kernel overlaps its in-loop decode with the tensor cores
# poorly in Triton (~350 TFLOP/s on H100, 0.45x of cuBLAS, benchmarks/NOTES_w4a16.md), while
# decoding the weight once to a transient bf16 buffer (one memory-bound pass, ~0.1 ms for 7B
# gate/up) and running cuBLAS reaches 0.76x at M=1024 and 0.93x at M=4096. So for
# M >= DEQUANT_MIN_M both directions take that path unless QERL_W4A16_PREFILL=fused (or a
# config with PATH="fused"); the transient buffer is one layer's bf16 weight.
PREFILL = os.environ.get("QERL_W4A16_PREFILL", "auto")
# GPU decode: multiply the packed bf16x2 registers by the group scale with inline PTX before
# splitting them (fewer register permutes; benchmarks/NOTES_w4a16.md section 7). The interpreter
# cannot run inline PTX and always takes the plain path.
PACKED_DECODE = os.environ.get("QERL_W4A16_PACKED", "1") == "1"
DEQUANT_MIN_M = env_int("QERL_W4A16_DEQUANT_MIN_M", 512)
# Slices of the overlapped dequant + cuBLAS path (PATH "overlap"); 0 or 1 = one whole buffer.
OVERLAP_CHUNKS = env_int("QERL_W4A16_CHUNKS", 0)
# Forward with M <= GEMV_MAX_M (1) on layers with N*K <= GEMV_MAX_NK: the CUDA-core GEMV of
# w4a16_gemv.py (no tensor cores), 10-25% faster than the fused kernel there on the H100 and
# slower on the largest layers (benchmarks/NOTES_w4a16.md section 9). PATH="gemv" forces it,
# PATH="fused" or a tile config (BO key) the tensor-core kernel.
GEMV_MAX_M = env_int("QERL_W4A16_GEMV_MAX_M", 1)
GEMV_MAX_NK = env_int("QERL_W4A16_GEMV_MAX_NK", 40000000)
# Forward with M = 1, nvfp4 / mxfp4 (WSMMA_FORMATS), on Hopper (sm_90) layers with N*K >= WSMMA_MIN_NK: the
# warp-specialised Gluon GEMV with the reduction on the tensor cores (w4a16_gluon.py). Fitted on the H100 before
# its later epilogues at 60M (5-14% faster than the CUDA-core GEMV / fused kernel from 67M, slower below ~40M,
# NOTES_w4a16.md section 12); retaken on the H200 in session 45 with today's kernel (section 35): faster than
# the old route on every layer from 13M weights (3584x3584 8.2 -> 7.8 us, 7168x5120 14.6 -> 13.1, 22016x2048
# 16.2 -> 12.4), 4-6% slower on the two under 6M (2048x2048, 2560x2048); hence 8M. 0 disables it.
WSMMA_MIN_NK = env_int("QERL_W4A16_WSMMA_MIN_NK", 8000000)
# The same threshold with PDL on (the rollout engine's decode step, a PDL chain), where the Gluon GEMV's loader
# warps stream weights while the previous kernels finish. It was 20M, below the standalone 60M (H100: 32B / 14B
# batch-1 step +2.9% / +2.7%; moving 7B's 4608x3584 / 3584x3584 too lost 1.6% then, NOTES_rollout.md sections 7
# and 9). On the H200 moving those two gains 1.3% on the 7B batch-1 step and moving 3B's 4-5M layers loses 1.7%
# (NOTES_rollout.md section 40), so it now equals WSMMA_MIN_NK. QERL_W4A16_WSMMA_MIN_NK=0 turns both off.
WSMMA_MIN_NK_PDL = env_int("QERL_W4A16_WSMMA_MIN_NK_PDL", WSMMA_MIN_NK)
# Forward with WGMMA_MIN_M <= M < DEQUANT_MIN_M, nvfp4 / mxfp4, on Hopper with K % 256 == 0: the
# warp-specialised Gluon GEMM (w4a16_wgmma.py: TMA loaders, decoder warps, async wgmma), which
# overlaps decoding with the tensor cores; on the H100 1.6-2x faster than the fused Triton kernel
# at M = 128 / 256 and even with it at M = 64 (NOTES_w4a16.md section 13). 0 disables it.
WGMMA_MIN_M = env_int("QERL_W4A16_WGMMA_MIN_M", 65)
# Forward with 2 <= M <= 8, nvfp4 / mxfp4, on Hopper layers with N >= WSMMA_TOKENS_MIN_N and K >=
# WSMMA_TOKENS_MIN_K: the same Gluon GEMV with one token per column of its MMA (w4a16_gluon MT = 8) in place of
# the fused Triton kernel. Fitted on the H100 before the MT = 8 shared-memory epilogue (w4a16_gluon.EPI_SMEM) as
# N >= 16384 and K >= 4096: it won only on 27648x5120 and 55296x5120 then and lost 4-66% on the other 12
# (NOTES_w4a16.md sections 15 and 17). Retaken on the H200 in session 45: at M = 2..8, both formats, it beats the
# old route on all 12 layers that rule kept off it, by 5-38% (37888x3584 M = 2 39.4 -> 30.9 us, 5120x27648 40.9 ->
# 30.1, 2048x2048 6.6 -> 6.2; the same kernel timed twice reads ~2% apart; section 35), so every layer now.
# 0 disables it.
WSMMA_TOKENS_MIN_N = env_int("QERL_W4A16_WSMMA_TOKENS_MIN_N", 1)
WSMMA_TOKENS_MIN_K = 0
# The same with PDL on (the rollout engine's decode chain): every 2..8-token layer (NOTES_w4a16.md section 17).
# There its producer warp copies the weights before the wait (the fused kernel loads only after it), and with
# the shared-memory epilogue the 7B batch-8 step went 3.232 -> 2.941 ms on the H100 (+9.9%; NOTES_rollout.md
# section 11). 0 disables it.
WSMMA_TOKENS_MIN_N_PDL = env_int("QERL_W4A16_WSMMA_TOKENS_MIN_N_PDL", 1 if WSMMA_TOKENS_MIN_N else 0)
WSMMA_TOKENS_MIN_K_PDL = 0
# The formats the four rules above send to the Gluon GEMV: nvfp4, and mxfp4 since session 44 (its E8M0 scales in
# [32, 16] TMA boxes, w4a16_gluon._decode_mx). Timed on the H200 against the route mxfp4 had before (the fused Triton
# kernel / CUDA-core GEMV): 55296x5120 M = 1 75.9 -> 47.5 us, 37888x3584 38.8 -> 27.1, 7168x5120 15.1 -> 12.8; the
# 32B mxfp4 decode step 9.69 -> 6.56 ms at batch 1, 10.43 -> 6.98 ms at batch 8 (NOTES_w4a16.md section 34).
# QERL_W4A16_WSMMA_FORMATS=nvfp4 takes mxfp4 back off it.
_WSMMA_FORMATS_ENV = os.environ.get("QERL_W4A16_WSMMA_FORMATS", "").strip()
WSMMA_FORMATS: tuple = tuple(f.strip() for f in _WSMMA_FORMATS_ENV.split(",") if f.strip()) or ("nvfp4", "mxfp4")
if not set(WSMMA_FORMATS) <= {"nvfp4", "mxfp4"}:
    raise ValueError(f"QERL_W4A16_WSMMA_FORMATS={_WSMMA_FORMATS_ENV!r}: expected a comma list of nvfp4, mxfp4 "
                     "(unset it for the default, nvfp4,mxfp4)")
# Forward with WGMMA_SMALL_M <= M < WGMMA_MIN_M on Hopper: the wgmma GEMM where it beat the fused
# Triton kernel on the H100 (_small_m_wgmma; NOTES_w4a16.md section 15). 0 disables it.
WGMMA_SMALL_M = env_int("QERL_W4A16_WGMMA_SMALL_M", 17)
# Forward with RWG_MIN_M <= M <= RWG_MAX_M, nvfp4 / mxfp4, on Hopper with K % 256 == 0: the GEMM with the decoded
# weights as wgmma's register operand (w4a16_rwg.py), checked before the rule above. On the H100, of the
# kernels then in use at M = 32 / 64 it was the fastest on 13 / 12 of the 14 layer shapes (5120x27648 M = 64
# 72.9 -> 56.0 us, nvfp4; the sweep's mxfp4 medians at M = 32 / 64 went 1.42 / 1.27 -> 1.57 / 1.51;
# NOTES_w4a16.md section 20); at M = 16 the fused kernel stays faster on the wide layers.
# RWG_MIN_M = 0 disables it.
RWG_MIN_M = env_int("QERL_W4A16_RWG_MIN_M", 17)
RWG_MAX_M = 64
# w4a16_rwg with R = 1 at two programs per SM (104 registers, shallower rings), by tokens per tile (BM), for
# layers whose 64-row tiles overrun one program per SM: on the H100 37888x3584 at M = 64 65.9 -> 57.7 us,
# 55296x5120 at M = 32 105.8 -> 84.5, and the 7B decode step at batch 32 / 64 +7.4% / +7.8% (applied to
# every R = 1 layer there); XREL (the activation stage released with the next weight stage, one CTA
# barrier less per step) then 57.3 -> 53.2 and 107.5 -> 99.0 us at M = 64 (NOTES_w4a16.md section 20).
# {} turns it off.
RWG_TWO_PER_SM = {32: {"NSW": 4, "NSX": 3, "maxnreg": 104, "XREL": 1},
                  64: {"NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1}}
# Its three-programs-per-SM form for RWG_THREE_MIN_M..32 tokens on the same wide layers (80 registers, rings of
# 2 weight / 2 activation stages, 59.5 KB: 12 MMA warps per SM instead of 8). On the H100, nvfp4 at M = 32
# (NOTES_w4a16.md section 30): 22016x2048 19.8 -> 18.0 us, 37888x3584 47.2 -> 44.4, 27648x5120 50.4 -> 49.4,
# 55296x5120 85.6 -> 80.2; at 17 / 20 tokens 27648x5120 lost 10-15%, hence the M floor. The 32-row decode
# step: 7B 4.612 -> 4.581 ms, 14B 9.553 -> 9.433. Narrower layers lost 3-13% standalone, except 3584x18944
# (30.2 -> 27.0 us), which lost in the 7B chain (4.620 -> 4.773 ms with it). mxfp4 (session 41, 24..32 tokens):
# 22016x2048 20.0 -> 17.8 us, 37888x3584 48.3 -> 44.4, 27648x5120 52.2 -> 50.8, 55296x5120 89.0 -> 82.2 at 32,
# and 27648x5120 lost at 17 / 20 there too (52.8 -> 54.6). {} turns it off; RWG_THREE_FORMATS names who takes it.
RWG_THREE_PER_SM = {"NSW": 2, "NSX": 2, "maxnreg": 80, "XREL": 1}
RWG_THREE_MIN_M = 24
RWG_THREE_FORMATS = ("nvfp4", "mxfp4")
# A K split in two for those wide forms where it fills the last wave better: S = 2 when the programs' share of the
# slots of their last wave (tiles x S / (waves x slots), slots = programs per SM x SMs) grows by >= RWG_WAVE_SPLIT
# and each half still runs >= RWG_WAVE_SPLIT_MIN_STEPS 256-K steps. Why: Nsight on the H200 (NOTES_w4a16.md
# section 34) found rwg at 32 tokens latency-bound (DRAM 39%, L2 46% of peak on 37888x3584) with its 592 tiles on
# 396 slots, 1.49 waves; S = 2 makes that 2.99, at 2 x M x N x 4 bytes of fp32 partials. Timed in session 45
# (section 35): slower than the unsplit form on 37888x3584 (M = 32 43.4 -> 48.3 us), 55296x5120 and 22016x2048,
# 1-3% faster only on 27648x5120 at 17..32 tokens; the 7B batch-32 step lost 3.9%. So 0 (off) stays the default;
# ablate_rollout.py's flag `wsplit` sets 0.1.
RWG_WAVE_SPLIT = 0.0
RWG_WAVE_SPLIT_MIN_STEPS = 4
# Its KP form (R = 1 with two MMA warpgroups on alternate 256-K steps of one tile, one program per SM, the split
# summed in shared memory) for 17..64 tokens on the layers whose 64-row tiles fit one wave, where its slices run
# >= RWG_KP_MIN_STEPS steps and, against R = 2, a time model fitted on the H100 at M = 32 (us: KP 3.4 + 0.57 per
# step of its slice, R = 2 6.8 + 1.12 per step of its slice) says it is faster. nvfp4 at M = 32 (NOTES_w4a16.md
# section 31): 7168x5120 16.9 -> 15.6 us, 4608x3584 12.4 -> 11.4, 3584x18944 29.4 -> 27.3, 2048x11008 13.7 -> 13.0;
# 2048x2048 / 2560x2048 (2-3 step slices) lost 3-5%, 5120x13824 (R = 2: 27 us) 34.3. Timed first with 3 activation
# stages, it raced (two processes on the H100 died of "unspecified launch failure", one hung, one output in 2000
# differed): an odd ring lets a warpgroup wait on a stage two phases ahead, so the form needs even rings (NSX 4).
# On since session 42: the NSX 4 form gave identical outputs in 3000 graph-replayed launches on each of 18 cases
# (benchmarks/probe_rwg_kp.py, H200) and the nvfp4 LoRA r32 32-row decode step went 4.316 -> 4.221 ms at 7B and
# 8.803 -> 8.792 at 14B (ablate a127, H200; routing every fitting layer to it, kpall, lost at 14B: 9.132).
# RWG_KP = {} turns it off (ablate_rollout.py flag nokp).
RWG_KP_FORM = {"KP": 2, "XREL": 1, "NSX": 4}
RWG_KP: dict = dict(RWG_KP_FORM)
RWG_KP_MIN_STEPS = 6
# The same GEMM at RWG_MAX_M < M <= RWG_WIDE_MAX_M in 128-token tiles (one program per SM, two activation stages of
# 64 KB): R = 2 where its slices run >= RWG_WIDE_R2_STEPS 256-K steps (the activation traffic, 64 KB per step, is
# shared by twice the weight rows), else R = 1 with XREL. On the H100 at M = 128, nvfp4, against the wgmma GEMM it
# replaces: 5120x27648 127.3 -> 74.6 us, 5120x13824 65.2 -> 43.7, 27648x5120 103.1 -> 78.5, 55296x5120 175.8 ->
# 154.3, 3584^2 15.3 -> 14.5; one loss, 7168x5120 26.4 -> 27.2 (R = 2 by the rule, R = 1 26.8); the M = 128
# median of the sweep went 0.98 -> 1.18. At M = 256 it lost on every layer (the wgmma GEMM's 256-token tiles
# read each weight once; NOTES_w4a16.md section 21). RWG_WIDE_MAX_M = 0 turns it off.
RWG_WIDE_MAX_M = env_int("QERL_W4A16_RWG_WIDE_MAX_M", 128)
RWG_WIDE_R2_STEPS = 10
# its two-programs-per-SM form (80 registers per thread, shallower rings: 93 KB of shared memory)
WGMMA_TWO_PER_SM = {"maxnreg": 80, "DEC_REGS": 96, "NSW": 3, "NSD": 2, "NSX": 3, "BM": 64}
# Forward with DEQUANT_MIN_M <= M < WGMMA_MAX_M on the same layers: the same GEMM instead of
# dequant + cuBLAS where its tiles fill the SMs' waves (_large_m_wgmma): 128 weight rows per
# program (two MMA warpgroups, half the activation traffic per weight) where those tiles fill
# >= 84% of their last wave, else 64 rows where >= 80%, else dequant + cuBLAS. On the H100, of
# bf16: M = 512 0.58-0.61 -> 0.83-0.91x on the large layers; M = 1024 0.68-0.77 -> 0.84-0.93x on
# six layers, 5120^2 0.77 -> 0.73x (NOTES_w4a16.md section 14); at M = 4096 dequant + cuBLAS stays
# faster. 0 disables it.
WGMMA_MAX_M = env_int("QERL_W4A16_WGMMA_MAX_M", 2048)
# the 128-row configuration: TMA issued by the MMA warps (12 warps in all), one chunk per decoded stage
WGMMA_BN128 = {"BN": 128, "LOADS": 1, "CPS": 1, "NSD": 4, "NSX": 3}
# Programmatic dependent launch (sm_90+): each kernel lets the next one in the stream launch as
# soon as all its programs are running (griddepcontrol.launch_dependents) and waits for the
# previous kernel (griddepcontrol.wait) only before it touches activations, outputs or the
# workspace, so launch latency and - in the GEMV - the first weight loads overlap the previous
# kernel's tail. Config key PDL overrides. Never under the interpreter.
PDL = os.environ.get("QERL_W4A16_PDL", "0") == "1"
# Where a PDL kernel lets its dependent launch: "early" = at its start (the dependent's programs
# become resident at once and prefetch what does not depend on us), "late" = after its main loop
# (the dependent overlaps only our fixup and epilogue, and cannot take SM slots, or bandwidth,
# from our main loop). Config key PDL_LATE overrides. This kernel's default; the CUDA-core GEMV has
# its own (w4a16_gemv.PDL_LATE).
PDL_LATE = os.environ.get("QERL_W4A16_PDL_LATE", "0") == "1"
# Which thresholds pick the kernels: the decode chain's (*_PDL) or the standalone ones. None: the
# chain's exactly when PDL is on. True routes as the chain does without PDL (bench_rollout's
# PDL-on / PDL-off check compares the launch attribute on the same kernels).
CHAIN_ROUTING: bool | None = None
if INTERPRETED:
    _patch_interpreter()

# Instrumentation (benchmarks/ablate_rollout.py --stamp): while set to {"buf": int64 CUDA tensor,
# "used": 0, "calls": []}, every launch of the fused kernel and of the Gluon GEMV writes 8 int64 per
# program into buf[used:] (clock64 at start / past the PDL wait / main loop done / end, smid,
# globaltimer at start / end, and for the Gluon GEMV clock64 when its producer issued the last
# weight copy, else -1) and appends (offset, grid, n, k, S, M, kernel) to calls.
STAMP: dict | None = None


def stamp_slice(grid: int, n: int, k: int, s: int, m: int, kernel: str):
    """The stamp buffer from this launch's offset (None when STAMP is off); records the call."""
    if STAMP is None:
        return None
    used = STAMP["used"]
    if used + grid * 8 > STAMP["buf"].numel():
        raise RuntimeError("w4a16_triton.STAMP buffer full")
    STAMP["calls"].append((used, grid, n, k, s, m, kernel))
    STAMP["used"] = used + grid * 8
    return STAMP["buf"][used:]


FMT_ID = {"nvfp4": 0, "mxfp4": 1}
FRAG_FMT = 2  # the Triton kernels' FMT for nvfp4 words in the fragment order (layout.py, state["order"])


def rows_order(state: dict, kernel: str) -> None:
    """One-line error where a kernel that reads only today's ("rows") word order gets a "frag" state."""
    if layout.is_frag(state):
        raise ValueError(f"the {kernel} reads rows-ordered words; this layer was prepared with order='frag' (rwg, "
                         "the Gluon GEMV, the wgmma GEMM and the Triton kernels read it)")


SOFT_E4M3_FMT = 3  # nvfp4 rows-ordered words whose FP8-E4M3 scales are decoded with integer operations (_scales)
# Pre-Hopper GPUs (compute capability 8.x: A100, A10, L4, L40S, RTX 30xx / 40xx): the Triton kernels (fused,
# dequantise, CUDA-core GEMV; not the sm_90 Gluon ones) build there in a portable form: the fp32 decode instead of
# the packed bf16x2 multiply (sm_90), and below 8.9 the E4M3 scales decoded without the hardware conversion
# (SOFT_E4M3_FMT). Built offline for sm_80 / 86 / 89 (tests/test_kernels.py) and checked for numerics on Hopper,
# where QERL_W4A16_PORTABLE=1 forces the sm_80 form; not timed on such a GPU. kernels.resolve_backend gives it to
# backend="triton" only ("auto" stays torch there).
PORTABLE = os.environ.get("QERL_W4A16_PORTABLE") == "1"


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))


def _portable_below(device: torch.device, cap: tuple[int, int]) -> bool:
    """QERL_W4A16_PORTABLE, or a CUDA `device` of compute capability below `cap`."""
    return PORTABLE or (device.type == "cuda" and _capability(device.index or 0) < cap)


def portable(device: torch.device) -> bool:
    """True where the Triton kernels take their portable form: a CUDA GPU below sm_90, or QERL_W4A16_PORTABLE."""
    return _portable_below(device, (9, 0))


def fmt_id(state: dict) -> int:
    """The Triton kernels' FMT constexpr of a prepared state: its format, nvfp4's word order, and for nvfp4 on a
    GPU without the E4M3 conversion (below sm_89, or QERL_W4A16_PORTABLE) the integer scale decode."""
    if layout.is_frag(state):
        return FRAG_FMT
    if state["fmt"] == "nvfp4" and _portable_below(state["words"].device, (8, 9)):
        return SOFT_E4M3_FMT
    return FMT_ID[state["fmt"]]
GROUP = {"nvfp4": 16, "mxfp4": 32}

# Bit layout (see layout.py); constexpr globals so the jit functions can read them.
_R1 = tl.constexpr(layout.ROT_MAG[1])
_R2 = tl.constexpr(layout.ROT_MAG[2])
_R3 = tl.constexpr(layout.ROT_MAG[3])
_S0 = tl.constexpr(layout.ROT_SIGN[0])
_S3 = tl.constexpr(layout.ROT_SIGN[3])
_KM = tl.constexpr(layout.MAG_MASK)
_KS = tl.constexpr(layout.SIGN_MASK)
_KA = tl.constexpr(layout.MAG_MASK | layout.SIGN_MASK)
assert layout.ROT_MAG[0] == 0 and layout.ROT_MAG[1] == layout.ROT_SIGN[1] and layout.ROT_MAG[2] == layout.ROT_SIGN[2]


# --------------------------------------------------------------------------- decode helpers


@triton.jit
def _rotr(w, r: tl.constexpr):
    return (w >> r) | (w << (32 - r))


@triton.jit
def _hi(p, F32: tl.constexpr):
    """High 16 bits of p as a bf16; with F32, widened to the same value in fp32 by shifting the
    bits (the interpreter's bf16 -> fp32 conversion flushes subnormals; see DECODE_F32)."""
    if F32:
        return (p & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        return (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _lo(p, F32: tl.constexpr):
    if F32:
        return (p << 16).to(tl.float32, bitcast=True)
    else:
        return p.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _decode_tile(words, sc, G: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """words uint32 [R, BK/8] + bf16 group scales [R, BK/G] (pre-multiplied by 2^(126-J))
    -> tile [R, BK] = q * s * 2^-J, exact: bf16 (one packed bf16x2 multiply per pair), or fp32
    with F32 (the interpreter, whose bf16 arithmetic works on raw uint16 bits, or DECODE_F32)."""
    p0 = (words & _KM) | (_rotr(words, _S0) & _KS)
    p1 = _rotr(words, _R1) & _KA
    p2 = _rotr(words, _R2) & _KA
    p3 = (_rotr(words, _R3) & _KM) | (_rotr(words, _S3) & _KS)
    # Flat order inside a word: t = 4*(j%2) + 2*(j//2) + (0 for the low half, 1 for the high):
    # K offsets (t, t+1) are the (low, high) halves of one P_j, the MMA's bf16x2 register order.
    v = tl.join(
        tl.join(tl.join(_lo(p0, F32), _lo(p1, F32)), tl.join(_lo(p2, F32), _lo(p3, F32))),
        tl.join(tl.join(_hi(p0, F32), _hi(p1, F32)), tl.join(_hi(p2, F32), _hi(p3, F32))),
    )
    if F32:
        sc = sc.to(tl.float32)
    v = v.reshape(R, BK // G, G) * sc[:, :, None]
    return v.reshape(R, BK)


@triton.jit
def _bf16x2_mul(p, s2):
    """Packed bf16x2 product of two int32 registers (one `mul.rn.bf16x2`; exact here: 2 x 4
    significant bits, and bf16 multiplies keep subnormal inputs on sm_90)."""
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, s2], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@triton.jit
def _decode_tile_packed(words, sc, G: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """As _decode_tile (bf16), but the scale multiply runs on the packed P_j registers before
    they are split into halves (inline PTX, GPU only): the halves then go to the MMA operand
    registers unchanged, without the half-swapping PRMTs that a multiply on the split tile costs.
    `sc`: bf16 multipliers [R, BK/G], one per G weights (= per G/8 words)."""
    s16 = sc.to(tl.uint16, bitcast=True).to(tl.uint32)
    s2 = s16 | (s16 << 16)  # the scale in both halves
    s2 = tl.broadcast_to(s2[:, :, None], (R, BK // G, G // 8)).reshape(R, BK // 8)
    p0 = _bf16x2_mul((words & _KM) | (_rotr(words, _S0) & _KS), s2)
    p1 = _bf16x2_mul(_rotr(words, _R1) & _KA, s2)
    p2 = _bf16x2_mul(_rotr(words, _R2) & _KA, s2)
    p3 = _bf16x2_mul((_rotr(words, _R3) & _KM) | (_rotr(words, _S3) & _KS), s2)
    v = tl.join(
        tl.join(tl.join(_lo(p0, False), _lo(p1, False)), tl.join(_lo(p2, False), _lo(p3, False))),
        tl.join(tl.join(_hi(p0, False), _hi(p1, False)), tl.join(_hi(p2, False), _hi(p3, False))),
    )
    return v.reshape(R, BK)


@triton.jit
def _scales(sraw, exp_bias, FMT: tl.constexpr):
    """Raw group scales (uint8) -> bf16 multipliers s * 2^(126-J).

    nvfp4: FP8-E4M3 bits, J = 8 (s * 2^118 stays inside bf16 for every E4M3 value).
    mxfp4: E8M0 biased exponent e, scale 2^(e-127); exp_bias = 126 - J chosen per tensor.
    2^(e + exp_bias - 127) is computed as exp2 of an exact integer-valued float and rounded to
    bf16, which makes it exact even if exp2 were off by ulps. (Building the bits with integer
    shifts is exact too, but then Triton stages the decoded tile through shared memory.)"""
    if FMT == 0:
        return (sraw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 3.3230699894622897e35).to(tl.bfloat16)
    elif FMT == 3:  # the same value from the E4M3 bits (sign, 4 exponent bits, bias 7, 3 mantissa bits)
        b = sraw.to(tl.int32)
        e = (b >> 3) & 15
        normal = (((b & 128) << 24) | ((e + 120) << 23) | ((b & 7) << 20)).to(tl.float32, bitcast=True)
        sub = (b & 7).to(tl.float32) * 0.001953125  # e = 0: (bits & 7) * 2^-9, the sign applied below
        sub = tl.where((b & 128) != 0, -sub, sub)
        return (tl.where(e == 0, sub, normal) * 3.3230699894622897e35).to(tl.bfloat16)
    else:
        return tl.exp2(sraw.to(tl.float32) + (exp_bias - 127)).to(tl.bfloat16)


@triton.jit
def _load_w_tile(w_ptrs, s_ptrs, row_mask, exp_bias, FMT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
                 MASKED: tl.constexpr, F32: tl.constexpr, PACKED: tl.constexpr = False):
    """Weight tile [R, BK] from `words` [R, BK/8] and one scale per 16 weights [R, BK/16] (for
    mxfp4 the pointers read each E8M0 byte twice: both formats then share the same tile shapes,
    and Triton keeps the mxfp4 tile in registers too instead of a shared-memory round trip)."""
    if MASKED:
        words = tl.load(w_ptrs, mask=row_mask[:, None], other=0)
        sraw = tl.load(s_ptrs, mask=row_mask[:, None], other=0)
    else:
        words = tl.load(w_ptrs)
        sraw = tl.load(s_ptrs)
    return _decode_raw(words, sraw, exp_bias, FMT, R, BK, F32, PACKED)


@triton.jit
def _decode_raw(words, sraw, exp_bias, FMT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                PACKED: tl.constexpr = False):
    """Loaded words [R, BK/8] and raw scales -> the decoded tile [R, BK] (see _load_w_tile)."""
    sc = _scales(sraw, exp_bias, FMT)
    if PACKED and not F32:
        w = _decode_tile_packed(words.to(tl.uint32, bitcast=True), sc, 32 if FMT == 1 else 16, R, BK)
    else:
        w = _decode_tile(words.to(tl.uint32, bitcast=True), sc, 16, R, BK, F32)
    return w


@triton.jit
def _tile_ids(tile, M, NOUT, BM: tl.constexpr, BO: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order of output tiles: GROUP_M row-tiles share each column sweep."""
    tiles_m = tl.cdiv(M, BM)
    tiles_o = tl.cdiv(NOUT, BO)
    per_group = GROUP_M * tiles_o
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_o = (tile % per_group) // size_m
    return pid_m, pid_o


@triton.jit
def _start(p, P, T):
    """First flat iteration of program p: p*T//P (in int64: p*T can pass 2^31)."""
    return (tl.cast(p, tl.int64) * T // P).to(tl.int32)


@triton.jit
def _owner(i, P, T):
    """The program whose iteration range [_start(p), _start(p+1)) holds flat iteration i."""
    return (((tl.cast(i, tl.int64) + 1) * P - 1) // T).to(tl.int32)


@triton.jit
def _row_base(n, KB, PER_ROW: tl.constexpr):
    """Offset (in units) of row n, K block 0, in the tiled layout (layout.py): PER_ROW units
    per row of a 64 x 256 tile (32 words, or 256/G scales)."""
    return (n // 64) * (KB * 64 * PER_ROW) + (n % 64) * PER_ROW


@triton.jit
def _k_off(j, PER_ROW: tl.constexpr):
    """Offset of unit j along K (word j = K // 8, or scale j) from its row's K block 0."""
    return (j // PER_ROW) * (64 * PER_ROW) + (j % PER_ROW)


@triton.jit
def _w_ptrs(w_ptr, s_ptr, rows, kw0, KB, FMT: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
            PACKED: tl.constexpr = False):
    """Pointers to the words [R, BK/8] and scales of the weight tile of `rows` (1-D, length R)
    and K = 8*kw0 .. 8*kw0 + BK."""
    SPT: tl.constexpr = 8 if FMT == 1 else 16
    kw = kw0 + tl.arange(0, BK // 8)
    g16 = kw0 // 2 + tl.arange(0, BK // 16)  # one scale per 16 weights (mxfp4: each read twice)
    if FMT != 1:  # nvfp4 (FMT 0, SOFT_E4M3_FMT)
        g = g16
    elif PACKED and not F32:
        g = kw0 // 4 + tl.arange(0, BK // 32)  # packed decode broadcasts each E8M0 scale itself
    else:
        g = g16 // 2
    w_ptrs = w_ptr + _row_base(rows, KB, 32)[:, None] + _k_off(kw, 32)[None, :]
    s_ptrs = s_ptr + _row_base(rows, KB, SPT)[:, None] + _k_off(g, SPT)[None, :]
    return w_ptrs, s_ptrs


@triton.jit
def _w_tile_at(w_ptr, s_ptr, rows, row_mask, kw0, KB, exp_bias, FMT: tl.constexpr, R: tl.constexpr,
               BK: tl.constexpr, MASKED: tl.constexpr, F32: tl.constexpr, PACKED: tl.constexpr = False):
    """Decoded weight tile [R, BK] for `rows` (1-D, length R) and K = 8*kw0 .. 8*kw0 + BK."""
    if FMT == 2:
        return _frag_tile_at(w_ptr, s_ptr, rows, row_mask, kw0, KB, R, BK, F32)
    w_ptrs, s_ptrs = _w_ptrs(w_ptr, s_ptr, rows, kw0, KB, FMT, BK, F32, PACKED)
    return _load_w_tile(w_ptrs, s_ptrs, row_mask, exp_bias, FMT, R, BK, MASKED, F32, PACKED)


_FT = tl.constexpr(layout.FRAG_TARGET)
_FR1 = tl.constexpr(layout.FRAG_ROT[1])
_FR2 = tl.constexpr(layout.FRAG_ROT[2])


@triton.jit
def _frag_tile_at(w_ptr, s_ptr, rows, row_mask, kw0, KB, R: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """_w_tile_at for fragment-ordered nvfp4 words (FMT 2; layout.py): the decoded tile [R, BK] of `rows`
    (1-D, R consecutive rows from a multiple of 16) and K = 8*kw0 .. 8*kw0 + BK (8*kw0 a multiple of 16).

    Word (r, c) of an [R, BK/8] index space is the fragment word of lane (g, t) = (r % 8, 2 h' + c % 2),
    h' = (r // 8) % 2, of 16-row group r // 16 and 16-K slice s = kw // 2: its pairs (h, kh) are rows
    16 (r // 16) + 8 h + g at K 16 s + 8 kh + 2 t (+1). They are decoded as rwg does (9 integer ops, the
    scale of their row), then moved to their rows and columns (a register permutation; this path serves
    the backward, dequant and tests, not the decode-time hot loop, which is rwg's)."""
    kw = kw0 + tl.arange(0, BK // 8)
    rb = rows // 16
    g = rows % 8
    hp = (rows // 8) % 2
    sl = kw // 2
    w_row = (rb // 4) * (KB * 2048) + (rb % 4) * 512 + g * 16 + hp * 8
    w_col = (sl // 16) * 2048 + ((sl % 16) // 4) * 128 + (kw % 2) * 4 + sl % 4
    # a word holds two rows of its 16-row group: read every word of a group with a valid row (the zero-padded
    # 64-row tiles hold whole groups)
    gm = tl.max(row_mask.to(tl.int32).reshape(R // 16, 16), 1)
    gm = tl.broadcast_to(gm[:, None], (R // 16, 16)).reshape(R) != 0
    words = tl.load(w_ptr + w_row[:, None] + w_col[None, :], mask=gm[:, None], other=0)
    r0 = rows - hp * 8  # row g of the pair's 16-row group (h = 0), and g + 8 (h = 1)
    s_col = _k_off(sl, 16)[None, :]
    s0 = _scales(tl.load(s_ptr + _row_base(r0, KB, 16)[:, None] + s_col, mask=gm[:, None], other=0), 0, 0)
    s1 = _scales(tl.load(s_ptr + _row_base(r0 + 8, KB, 16)[:, None] + s_col, mask=gm[:, None], other=0), 0, 0)
    if F32:
        s0 = s0.to(tl.float32)
        s1 = s1.to(tl.float32)
    u = words.to(tl.uint32, bitcast=True)
    p00 = u & _FT  # pair pi = h + 2 kh
    p10 = _rotr(u, _FR1) & _FT
    p01 = _rotr(u, _FR2) & _FT
    p11 = (_rotr(u, 6) & 0x81808180) | (_rotr(u, 30) & 0x00400040)
    q0 = tl.join(tl.join(_lo(p00, F32), _hi(p00, F32)), tl.join(_lo(p01, F32), _hi(p01, F32))) * s0[:, :, None, None]
    q1 = tl.join(tl.join(_lo(p10, F32), _hi(p10, F32)), tl.join(_lo(p11, F32), _hi(p11, F32))) * s1[:, :, None, None]
    v = tl.join(q0, q1)  # [R, BK/8, e, kh, h] (join adds the last dimension)
    v = v.reshape(R // 16, 2, 8, BK // 16, 2, 2, 2, 2)  # [group, h', g, s, i, e, kh, h]
    v = tl.permute(v, (0, 7, 2, 3, 6, 1, 4, 5))  # [group, h, g, s, kh, h', i, e]: row 8 h + g, K 8 kh + 4 h' + 2 i + e
    return v.reshape(R, BK)


@triton.jit
def _w_raw_at(w_ptr, s_ptr, rows, kw0, KB, valid, FMT: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
              PACKED: tl.constexpr = False):
    """The undecoded words and raw scales of _w_tile_at's tile (rows inside the zero-padded
    tiles), so a step can be loaded ahead of its decode (_decode_raw); `valid` (a scalar)
    false: nothing is read (zeros)."""
    w_ptrs, s_ptrs = _w_ptrs(w_ptr, s_ptr, rows, kw0, KB, FMT, BK, F32, PACKED)
    return tl.load(w_ptrs, mask=valid, other=0), tl.load(s_ptrs, mask=valid, other=0)


@triton.jit
def _mainloop(a_ptr, w_ptr, s_ptr, pid_m, pid_o, k0, k1, M, NOUT, RED, stride_am, KB, exp_bias,
              BWD: tl.constexpr, FMT: tl.constexpr, EVEN_O: tl.constexpr, EVEN_R: tl.constexpr,
              BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, INTERPRETED: tl.constexpr,
              DECODE_F32: tl.constexpr, SWAP: tl.constexpr, PACKED: tl.constexpr):
    """acc[BM, BO] = sum over reduction steps k0 .. k1-1 of (A tile) @ (weight tile, decoded here).

    forward:  A = x  [M, K]; weight tile = BO rows of W (outputs) x BR of K  -> dot(A, W^T)
    backward: A = dy [M, N]; weight tile = BR rows of W (reduction) x BO of K -> dot(A, W)
    SWAP (forward only): acc^T[BO, BM] = dot(W, A^T): the decoded weight is the left operand,
    kept in registers (mma / wgmma A from registers), the activations the right one."""
    F32: tl.constexpr = DECODE_F32 or INTERPRETED
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    offs_r = k0 * BR + tl.arange(0, BR)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_r[None, :]
    offs_o = pid_o * BO + tl.arange(0, BO)
    o_mask = offs_o < NOUT
    if SWAP:
        acc = tl.zeros([BO, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BO], dtype=tl.float32)
    for kk in range(k0, k1):
        if BWD:
            r_mask = offs_r < RED
            w = _w_tile_at(w_ptr, s_ptr, offs_r, r_mask, pid_o * (BO // 8), KB, exp_bias, FMT, BR, BO,
                           not EVEN_R, F32, PACKED)
            if EVEN_R:
                a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        else:
            w = _w_tile_at(w_ptr, s_ptr, offs_o, o_mask, kk * (BR // 8), KB, exp_bias, FMT, BO, BR,
                           not EVEN_O, F32, PACKED)
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        if DECODE_F32 and not INTERPRETED:
            w = w.to(tl.bfloat16)
        if INTERPRETED:
            a = a.to(tl.float32)
        if BWD:
            acc = tl.dot(a, w, acc)
        elif SWAP:
            acc = tl.dot(w, a.T, acc)
        else:
            acc = tl.dot(a, w.T, acc)
        offs_r += BR
        a_ptrs += BR
    return acc


@triton.jit
def _stamp(stamp_ptr, p, slot: tl.constexpr, name: tl.constexpr):
    """Per-program instrumentation (STAMP): %clock64, %globaltimer or %smid into stamp_ptr[p, slot]."""
    if name == "smid":
        v = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(stamp_ptr + p * 8 + slot, v.to(tl.int64))
    else:
        v = tl.inline_asm_elementwise("mov.u64 $0, %" + name + ";", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(stamp_ptr + p * 8 + slot, v)


@triton.jit
def _bias(bias_ptr, offs_o, NOUT, HAS_BIAS: tl.constexpr):
    """The bias of outputs offs_o in fp32 (0 without one): loaded ahead of the epilogue that adds it."""
    if HAS_BIAS:
        return tl.load(bias_ptr + offs_o, mask=offs_o < NOUT, other=0.0).to(tl.float32)
    return tl.zeros(offs_o.shape, tl.float32)


@triton.jit
def _store_out(acc, alpha, bias, c_ptrs, mask, HAS_BIAS: tl.constexpr):
    """Finished fp32 tile [rows, outputs] -> acc * alpha (+ bias over the outputs, from _bias),
    stored in the output's dtype under `mask` (the fused kernel and the GEMV)."""
    out = acc * alpha
    if HAS_BIAS:
        out += bias[None, :]
    tl.store(c_ptrs, out.to(c_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compile for every M in a bucket (M=1 included)
def _w4a16_kernel(
    a_ptr, w_ptr, s_ptr, alpha_ptr, bias_ptr, c_ptr, ws_ptr, lock_ptr, stamp_ptr,
    M, NOUT, RED, stride_am, stride_cm, KB, exp_bias, S,
    BWD: tl.constexpr, FMT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_O: tl.constexpr, EVEN_R: tl.constexpr,
    BM: tl.constexpr, BO: tl.constexpr, BR: tl.constexpr, GROUP_M: tl.constexpr, INTERPRETED: tl.constexpr,
    DECODE_F32: tl.constexpr, SWAP: tl.constexpr, SPLIT: tl.constexpr, PACKED: tl.constexpr,
    PDL: tl.constexpr = False, LATE: tl.constexpr = False, STAMP: tl.constexpr = False,
):
    """C[M, NOUT] = A[M, RED] @ (weight as [RED, NOUT]) * alpha (+ bias), bf16 out.

    Two schedules, both one launch with no host sync (CUDA-graph capturable):
    - SPLIT (decode, fewer output tiles than resident slots): program p owns output tile p // S
      and the reduction steps [j*KI//S, (j+1)*KI//S) of it, j = p % S (slices differ by at most
      one step; S need not divide KI). One pipeline fill per program, at most one fixup.
    - stream-K (otherwise): the flat iteration space (output tile, reduction step) is cut into
      P equal contiguous ranges, one per program, so every SM gets the same work whatever the
      tile count (no wave-quantisation tail).
    A tile covered by one program is stored directly. A tile shared by several programs: each
    writes its fp32 partial to its own workspace slot, bumps the tile's counter, and the last
    one sums all partials in program order (deterministic), writes bf16 and resets the counter
    for the next launch."""
    if STAMP:
        _stamp(stamp_ptr, tl.program_id(0), 0, "clock64")
        _stamp(stamp_ptr, tl.program_id(0), 4, "smid")
        _stamp(stamp_ptr, tl.program_id(0), 5, "globaltimer")
    alpha = tl.load(alpha_ptr)  # a constant of the layer: before the wait, off the critical path
    if PDL:  # the next kernel may launch now (or late); ours waits for the previous one (see PDL)
        if not LATE:
            gdc_launch_dependents()
        gdc_wait()
    P = tl.num_programs(0)
    p = tl.program_id(0)
    if STAMP:
        _stamp(stamp_ptr, p, 1, "clock64")
    KI = tl.cdiv(RED, BR)  # reduction steps per tile
    T = tl.cdiv(M, BM) * tl.cdiv(NOUT, BO) * KI
    if SPLIT:
        first_tile = p // S
        j = p - first_tile * S
        start = first_tile * KI + (j * KI) // S
        end = first_tile * KI + ((j + 1) * KI) // S
    else:
        start = _start(p, P, T)
        end = _start(p + 1, P, T)
    it = start
    while it < end:
        tile = it // KI
        k0 = it - tile * KI
        k1 = tl.minimum(KI, k0 + (end - it))
        pid_m, pid_o = _tile_ids(tile, M, NOUT, BM, BO, GROUP_M)
        offs_o = pid_o * BO + tl.arange(0, BO)
        acc = _mainloop(a_ptr, w_ptr, s_ptr, pid_m, pid_o, k0, k1, M, NOUT, RED, stride_am, KB,
                        exp_bias, BWD, FMT, EVEN_O, EVEN_R, BM, BO, BR, INTERPRETED, DECODE_F32, SWAP, PACKED)
        if STAMP:  # (the last tile's, for a program that walks several)
            _stamp(stamp_ptr, p, 2, "clock64")
        # the bias before the split fixup, in flight while the partial is published (held through
        # the main loop it added 16 bytes of spills at the M <= 16 tiles' 96-register cap)
        bias = _bias(bias_ptr, offs_o, NOUT, HAS_BIAS)
        if SWAP:
            acc = tl.trans(acc)
        offs_m = pid_m * BM + tl.arange(0, BM)
        mask = (offs_m < M)[:, None] & (offs_o < NOUT)[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_o[None, :]
        ws_tile = tl.arange(0, BM)[:, None] * BO + tl.arange(0, BO)[None, :]
        done = k1 > k0  # always true: the tile is written unless another program will finish it
        if (k0 != 0) | (k1 != KI):  # shared tile: publish the partial, the last arrival reduces
            slot = tl.where(it == start, 0, 1)  # a program shares at most its first and last tile
            tl.store(ws_ptr + (p * 2 + slot) * (BM * BO) + ws_tile, acc)
            tl.debug_barrier()  # all threads' partials are written before the counter moves
            if SPLIT:
                p_lo = tile * S
                p_hi = p_lo + S - 1
            else:
                p_lo = _owner(tile * KI, P, T)
                p_hi = _owner(tile * KI + KI - 1, P, T)
            count = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            done = count == p_hi - p_lo
            if done:
                acc = tl.zeros([BM, BO], dtype=tl.float32)
                for q in range(p_lo, p_hi + 1):
                    if SPLIT:
                        q_slot = 0
                    else:
                        q_slot = tl.where(_start(q, P, T) // KI == tile, 0, 1)
                    acc += tl.load(ws_ptr + (q * 2 + q_slot) * (BM * BO) + ws_tile, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
        if done:
            _store_out(acc, alpha, bias, c_ptrs, mask, HAS_BIAS)
        it += k1 - k0
    if PDL and LATE:
        gdc_launch_dependents()
    if STAMP:
        _stamp(stamp_ptr, p, 3, "clock64")
        _stamp(stamp_ptr, p, 6, "globaltimer")
        tl.store(stamp_ptr + p * 8 + 7, -1)


@triton.jit
def _w4_to_bf16_kernel(w_ptr, s_ptr, alpha_ptr, o_ptr, N, K, KB, exp_bias, ROW0, ROW1, COL0, LDO,
                       FMT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """Dense bf16 W[ROW0:ROW1, COL0:COL0 + grid1*BK] = q * s / g (one rounding) from the kernel
    layout, written to o[r - ROW0, c - COL0] (row stride LDO): the weight operand of the cuBLAS
    path for large M (the whole layer; one chunk of rows / columns for PATH="overlap").
    Reads 4.5 (4.25) bits and writes 16 per weight."""
    rows = ROW0 + tl.program_id(0) * BR + tl.arange(0, BR)
    mask = rows < ROW1
    w = _w_tile_at(w_ptr, s_ptr, rows, mask, COL0 // 8 + tl.program_id(1) * (BK // 8), KB, exp_bias, FMT, BR, BK,
                   True, F32)
    w = w.to(tl.float32) * tl.load(alpha_ptr)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    tl.store(o_ptr + (rows - ROW0)[:, None] * LDO + cols[None, :], w.to(tl.bfloat16), mask=mask[:, None])


# --------------------------------------------------------------------------- configuration


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    return 3  # interpreter: a small persistent grid, so tiles get shared and the fixup runs


def _largest_divisor(k: int, candidates) -> int:
    for c in candidates:
        if k % c == 0:
            return c
    raise ValueError(f"K={k} must be a multiple of 32 for the fused kernels")


# PER_SM: programs per SM each config keeps resident (registers, shared memory), from an
# offline sm_90a compile (benchmarks/NOTES_w4a16.md); after the first launch the value measured
# from the compiled kernel replaces it. The persistent grid is PER_SM x SM count.
def _fwd_config(m: int, n: int, k: int, fmt: str = "nvfp4") -> dict:
    """Tile shape by M bucket (benchmarks/NOTES_w4a16.md: SASS counts and the H100 sweeps).

    M <= 16: 16-row mma.sync tiles, 64 weight rows x 256 K per step, 3 stages and a 96-register
    cap (maxnreg), so 5 programs share an SM (v3 explore: 39 us vs 47 us on 7B gate/up at 4
    stages / 125 registers, equal elsewhere). M <= 32: 32-row tiles. M <= 64: wgmma 64 x 128 x 64
    tiles on wide layers (N >= 16384: 69 vs 76 us on 7B/14B gate/up), 64 x 64 x 128 on the others
    (fewer, longer tiles were slower there). 64 < M < DEQUANT_MIN_M (the fused path): wgmma
    128 x 128 x 64, or 64 x 128 x 64 on small layers (N*K <= 17M: 35 vs 41 us on 3584^2)."""
    if m <= 16:
        cfg = dict(BM=16, BO=64, BR=256, num_warps=4, num_stages=3, maxnreg=96, PER_SM=5)
    elif m <= 32:
        cfg = dict(BM=32, BO=128, BR=128, num_warps=4, num_stages=3, PER_SM=2)
    elif m <= 64:
        if n >= 16384:
            cfg = dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)
        else:
            cfg = dict(BM=64, BO=64, BR=128, num_warps=4, num_stages=4, PER_SM=2)
    elif n * k <= 17_000_000:
        cfg = dict(BM=64, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)
    else:
        cfg = dict(BM=128, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)
    cfg["BR"] = _largest_divisor(k, [c for c in (256, 128, 64, 32) if c <= cfg["BR"]])
    return cfg


def _bwd_config(m: int, n: int, k: int, fmt: str = "nvfp4") -> dict:
    """dx tiles: BM rows x BO input features, reducing over BR weight rows per step."""
    if m <= 64:
        cfg = dict(BM=max(16, triton.next_power_of_2(m)), BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)
    else:
        cfg = dict(BM=128, BO=128, BR=64, num_warps=4, num_stages=4, PER_SM=2)
    cfg["BO"] = _largest_divisor(k, [c for c in (256, 128, 64, 32) if c <= cfg["BO"]])
    return cfg


_RESIDENT: dict = {}  # launch key -> programs per SM measured from the compiled kernel


def _resident_per_sm(kernel) -> int | None:
    """Programs of `kernel` one SM can hold (registers, shared memory, threads); None if unknown."""
    try:
        regs, smem, warps = kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps
    except AttributeError:
        return None
    warp_regs = -(-max(regs, 1) // 8) * 8 * 32
    by_regs = 65536 // (warp_regs * warps)
    by_smem = 233472 // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // (32 * warps), 32))


def _grid(m: int, tiles: int, steps_per_tile: int, per_sm: int, device, programs: int | None,
          schedule: str = "auto", waves: int = 1) -> tuple[int, int]:
    """(persistent grid size, S): S > 0 selects the split schedule with S slices per tile,
    S = 0 stream-K.

    Decode (m <= 64) with fewer output tiles than resident slots (per_sm x SMs): split, every
    program one slice of one tile (one pipeline fill, at most one fixup; a program spanning two
    tiles pays the memory latency twice, which dominated small layers). S is the smallest slice
    count giving the same longest slice as slots // tiles (fewer partials to sum). Otherwise
    one program per slot (stream-K: equal work per SM, no wave tail). PROGRAMS forces
    stream-K with that many programs."""
    total = tiles * steps_per_tile
    if programs is not None:
        return max(1, min(programs, total)), 0
    slots = per_sm * _num_sms(device.index if device.index is not None else 0)
    if schedule == "split" or (schedule == "auto" and m <= 64 and tiles < slots):
        slots *= waves  # WAVES > 1: more, shorter slices than fit at once (more parallel work for small layers)
    if schedule == "split" or (schedule == "auto" and m <= 64 and tiles < slots):
        s_max = max(1, min(steps_per_tile, slots // tiles))
        steps = -(-steps_per_tile // s_max)
        s = -(-steps_per_tile // steps)
        return tiles * s, s
    return max(1, min(slots, total)), 0


# Workspace counters per layer and direction; one per output tile (2048 x 128x128 tiles =
# M 16384 x N 16384; larger problems fall back to a bigger counter array allocated on the fly).
LOCKS = 2048


# --------------------------------------------------------------------------- host side


def _check(x: torch.Tensor, state: dict, dim: int, name: str):
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"{name} must be [M, {dim}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be bfloat16, got {x.dtype}")
    if x.device != state["words"].device:
        raise ValueError(f"{name} on {x.device} but the weight is on {state['words'].device}")


def _launch(a: torch.Tensor, state: dict, bwd: bool, bias, cfg: dict, out):
    n, k = state["n"], state["k"]
    m = a.shape[0]
    n_out, red = (k, n) if bwd else (n, k)
    cfg = dict(cfg)
    bm, bo, br, per_sm = cfg.pop("BM"), cfg.pop("BO"), cfg.pop("BR"), cfg.pop("PER_SM")
    programs = cfg.pop("PROGRAMS", None)
    schedule = cfg.pop("SCHEDULE", "auto")
    waves = int(cfg.pop("WAVES", 1))
    swap = bool(cfg.pop("SWAP", False)) and not bwd
    port = portable(a.device)  # the packed decode is sm_90 PTX: the fp32 decode instead
    packed = bool(cfg.pop("PACKED", PACKED_DECODE)) and not INTERPRETED and not port
    decode_f32 = bool(cfg.pop("DECODE_F32", DECODE_F32 or port))
    pdl = bool(cfg.pop("PDL", PDL)) and not INTERPRETED and not port  # (griddepcontrol: sm_90)
    late = bool(cfg.pop("PDL_LATE", PDL_LATE)) and pdl
    if cfg.get("maxnreg") is None or INTERPRETED:
        cfg.pop("maxnreg", None)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n_out, bo)
    locks = state["locks_bwd" if bwd else "locks"]
    if tiles > locks.numel():  # huge problem: counters for every tile (allocation, no sync)
        locks = torch.zeros(tiles, dtype=torch.int32, device=a.device)
    c = torch.empty(m, n_out, device=a.device, dtype=torch.bfloat16) if out is None else out
    flags = dict(BWD=bwd, FMT=fmt_id(state), HAS_BIAS=bias is not None, EVEN_O=n_out % bo == 0,
                 EVEN_R=red % br == 0, BM=bm, BO=bo, BR=br, GROUP_M=8, INTERPRETED=INTERPRETED,
                 DECODE_F32=decode_f32, SWAP=swap, PACKED=packed, PDL=pdl, LATE=late, **cfg)
    key = tuple(sorted(flags.items()))
    grid, split = _grid(m, tiles, triton.cdiv(red, br), _RESIDENT.get(key, per_sm), a.device, programs, schedule, waves)
    ws = torch.empty(grid * 2 * bm * bo, device=a.device, dtype=torch.float32)
    stamps = None if INTERPRETED else stamp_slice(grid, n, k, max(split, 1), m, "fused")
    kernel = _w4a16_kernel[(grid,)](
        a, state["words"], state["scale"], state["alpha"], bias if bias is not None else c, c, ws, locks,
        stamps if stamps is not None else ws,
        m, n_out, red, a.stride(0), c.stride(0), state["kb"], state["exp_bias"], max(split, 1),
        SPLIT=split > 0, STAMP=stamps is not None, launch_pdl=pdl, **flags,
    )
    if key not in _RESIDENT:
        _RESIDENT[key] = _resident_per_sm(kernel) or per_sm
    return c


def _dequant_bk(k: int) -> int:
    return _largest_divisor(k, (256, 128, 64, 32))


def dequant_bf16(state: dict, out: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
                 cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Dense bf16 weight from a prepared nvfp4/mxfp4 state (one kernel pass): [N, K], or the
    block W[r0:r1, c0:c1] for rows=(r0, r1) / cols=(c0, c1) (c0, c1 multiples of
    `_dequant_bk(K)`), written contiguously (or into `out`, any [r1-r0, c1-c0] view whose rows
    are contiguous)."""
    n, k = state["n"], state["k"]
    r0, r1 = rows if rows is not None else (0, n)
    c0, c1 = cols if cols is not None else (0, k)
    words = state["words"]
    bk = _dequant_bk(k)
    if c0 % bk or (c1 % bk and c1 != k) or not (0 <= c0 < c1 <= k) or not (0 <= r0 < r1 <= n):
        raise ValueError(f"bad dequant block rows {r0}:{r1} cols {c0}:{c1} for [{n}, {k}] (column step {bk})")
    if r0 % 16 and layout.is_frag(state):
        raise ValueError(f"fragment-ordered words dequantise from a row that is a multiple of 16, got {r0}")
    o = torch.empty(r1 - r0, c1 - c0, device=words.device, dtype=torch.bfloat16) if out is None else out
    if o.shape != (r1 - r0, c1 - c0) or o.stride(1) != 1:
        raise ValueError(f"out must be a row-contiguous [{r1 - r0}, {c1 - c0}] bf16 view, got {tuple(o.shape)}")
    br = 32
    _w4_to_bf16_kernel[(triton.cdiv(r1 - r0, br), (c1 - c0) // bk)](
        words, state["scale"], state["alpha"], o, n, k, state["kb"], state["exp_bias"], r0, r1, c0, o.stride(0),
        FMT=fmt_id(state), BR=br, BK=bk, F32=INTERPRETED or DECODE_F32 or portable(words.device), num_warps=4,
    )
    return o


# Overlapped dequant + cuBLAS (large M), opt-in only (PATH="overlap", CHUNKS): measured SLOWER
# than one whole-layer dequant + one cuBLAS call on the H100 at every M and not the default
# (benchmarks/NOTES_w4a16.md section 8: cuBLAS's GEMM holds every SM's register file, so the
# side-stream dequant cannot run beside it, and each extra chunk adds ~3-8 us of GEMM tail and
# stream hand-off). Kept for re-measuring on other GPUs / cuBLAS versions. The weight is split
# into CHUNKS slices (forward: rows of W = output columns of y; backward: columns of W = output
# columns of dx), each dequantised into one of two reused transient buffers on a side stream
# while cuBLAS multiplies the previous slice on the caller's stream into its column slice of the
# output (exact: every output element is one cuBLAS dot product over the full reduction). Events
# order the streams (no host sync; capturable in a CUDA graph).
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(idx)
    if s is None:  # high priority: its blocks go first when the GEMM's CTAs retire
        s = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=-1)
    return s


def _chunk_bounds(extent: int, chunks: int, align: int) -> list[tuple[int, int]]:
    units = -(-extent // align)
    chunks = max(1, min(chunks, units))
    cuts = [min(extent, (i * units // chunks) * align) for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _overlapped(a: torch.Tensor, state: dict, bwd: bool, bias, out, chunks: int, side: bool = True) -> torch.Tensor:
    """y = a @ W^T (+ bias) (forward) or dx = a @ W (backward) through chunked dequant + cuBLAS."""
    n, k = state["n"], state["k"]
    m = a.shape[0]
    n_out = k if bwd else n
    c = torch.empty(m, n_out, device=a.device, dtype=torch.bfloat16) if out is None else out
    if bwd:
        bounds = _chunk_bounds(k, chunks, _dequant_bk(k) * max(1, 256 // _dequant_bk(k)))
    else:
        bounds = _chunk_bounds(n, chunks, 256)
    width = max(b - a_ for a_, b in bounds)
    other = n if bwd else k
    bufs = [torch.empty(width * other, device=a.device, dtype=torch.bfloat16) for _ in range(min(2, len(bounds)))]
    use_side = side and a.is_cuda and len(bounds) > 1
    main = torch.cuda.current_stream(a.device) if use_side else None
    stream = _side_stream(a.device) if use_side else None
    if use_side:
        stream.wait_stream(main)  # the inputs (and buffers' previous users) come first
    freed = [None, None]
    for i, (lo, hi) in enumerate(bounds):
        buf = bufs[i % 2][: (hi - lo) * other]
        wv = buf.view(n, hi - lo) if bwd else buf.view(hi - lo, k)
        if use_side:
            with torch.cuda.stream(stream):
                if freed[i % 2] is not None:
                    stream.wait_event(freed[i % 2])  # GEMM i-2 has finished reading this buffer
                dequant_bf16(state, out=wv, cols=(lo, hi)) if bwd else dequant_bf16(state, out=wv, rows=(lo, hi))
                ready = torch.cuda.Event()
                ready.record(stream)
            main.wait_event(ready)
        else:
            dequant_bf16(state, out=wv, cols=(lo, hi)) if bwd else dequant_bf16(state, out=wv, rows=(lo, hi))
        dst = c[:, lo:hi]
        if bwd:
            torch.mm(a, wv, out=dst)
        elif bias is None:
            torch.mm(a, wv.T, out=dst)
        else:
            torch.addmm(bias[lo:hi].to(torch.bfloat16), a, wv.T, out=dst)
        if use_side:
            ev = torch.cuda.Event()
            ev.record(main)
            freed[i % 2] = ev
    # Every side-stream write to the buffers precedes an event the caller's stream waited on,
    # so freeing them in the caller's stream order is safe (no record_stream needed).
    return c


def _overlap_chunks(m: int, n: int, k: int, bwd: bool) -> int:
    """Slices for the overlapped path (0: plain dequant + one cuBLAS call)."""
    return OVERLAP_CHUNKS


def _path(m: int, config: dict | None) -> str:
    """'fused' (the kernel above), 'dequant' (bf16 weight buffer + cuBLAS) or 'overlap'
    (chunked dequant on a side stream + cuBLAS per chunk) for this call."""
    if config is not None and "PATH" in config:
        return config["PATH"]
    if PREFILL in ("fused", "dequant", "overlap"):
        return PREFILL
    return "dequant" if m >= DEQUANT_MIN_M else "fused"


def _hopper(device_index: int) -> bool:
    return _capability(device_index)[0] == 9


def _wave_fill(programs: int, slots: int) -> float:
    """The share of the program slots of the waves that `programs` take which they fill (1.0: whole waves)."""
    return programs / (-(-programs // slots) * slots)


def _large_m_wgmma(n: int, m: int, slots: int) -> dict | None:
    """The wgmma GEMM's config for a large-M forward (DEQUANT_MIN_M <= M < WGMMA_MAX_M), or None
    for dequant + cuBLAS: the wave fill of a layer's tiles decides (a tile is BN weight rows x 256
    tokens, one program per SM; `slots` = SMs)."""
    mt = -(-m // 256)

    def fill(bn: int) -> float:
        return _wave_fill(-(-n // bn) * mt, slots)

    if fill(128) >= 0.84:
        return dict(WGMMA_BN128)
    if fill(64) >= 0.8:
        return {}
    return None


def _small_m_wgmma(n: int, k: int, m: int) -> dict | None:
    """The wgmma GEMM's config for WGMMA_SMALL_M <= M < WGMMA_MIN_M, or None for the fused Triton
    kernel. Measured on the H100 at M = 16 / 32 / 64, all 16 layers (results/wgmma_two_per_sm.json):
    one program per SM wins at M = 17..64 on the small layers (N <= 3584 and N*K <= 23M: 2048^2
    at M = 32 8.4 vs 12.7 us); two per SM at M = 33..64 on the other layers with N <= 8192
    (7168x5120 24.3 vs 26.4 us); the fused kernel everywhere at M <= 16 and on N > 8192."""
    if n <= 3584 and n * k <= 23_000_000:
        return {}
    if m > 32 and n <= 8192:
        return dict(WGMMA_TWO_PER_SM)
    return None


@functools.lru_cache(maxsize=None)
def _rwg_rows(n: int, k: int, slots: int) -> int:
    """w4a16_rwg's row tiles per program (R = 1 or 2 of 64 rows) for an N x K layer on `slots` SMs: the
    R whose programs (tiles x K slices, w4a16_wgmma.split) fill their last wave better; on a tie R = 2
    where its tiles alone fill the SMs, else R = 1. Measured on the H100 at M = 64 it picked the faster
    R on 12 of the 14 layer shapes (the other two within 4%; NOTES_w4a16.md section 20)."""
    from qerl.kernels.w4a16_wgmma import split

    kb = -(-k // 256)

    def fill(r: int) -> float:
        tiles = -(-n // (64 * r))
        return _wave_fill(tiles * split(tiles, kb, slots), slots)

    f1, f2 = fill(1), fill(2)
    if abs(f1 - f2) > 0.01:
        return 1 if f1 > f2 else 2
    return 2 if -(-n // 128) >= slots else 1


def _rwg_config(n: int, k: int, m: int, slots: int, fmt: str = "nvfp4") -> dict:
    """w4a16_rwg's config for M = RWG_MIN_M..RWG_WIDE_MAX_M tokens. Up to RWG_MAX_M, where the 64-row tiles
    overrun one program per SM: R = 1 at three programs per SM for RWG_THREE_MIN_M..32 tokens
    (RWG_THREE_PER_SM, RWG_THREE_FORMATS), else at two (RWG_TWO_PER_SM), either with K split in two where
    RWG_WAVE_SPLIT says; elsewhere the KP form where
    _rwg_kp_wins, else R by _rwg_rows. Above:
    128-token tiles, R = 2 where its K slices are long (RWG_WIDE_R2_STEPS), else R = 1."""
    if m > RWG_MAX_M:
        from qerl.kernels.w4a16_wgmma import split

        kb, tiles = -(-k // 256), -(-n // 128)
        long_slices = kb // split(tiles, kb, slots) >= RWG_WIDE_R2_STEPS
        return {"BM": 128, "NSX": 2, **({"R": 2} if long_slices else {"R": 1, "XREL": 1})}
    wide = -(-n // 64) > slots  # the 64-row tiles overrun one program per SM
    if wide and RWG_THREE_PER_SM and RWG_THREE_MIN_M <= m <= 32 and fmt in RWG_THREE_FORMATS:
        return {"R": 1, **RWG_THREE_PER_SM, **_rwg_wave_split(n, k, 3 * slots)}
    two = _rwg_two_per_sm(n, k, m, slots) if wide else None
    if two:
        return two
    r = _rwg_rows(n, k, slots)
    return {"R": 1, **RWG_KP} if not wide and RWG_KP and _rwg_kp_wins(n, k, slots, r) else {"R": r}


def _rwg_two_per_sm(n: int, k: int, m: int, slots: int) -> dict | None:
    """rwg's two-programs-per-SM config (RWG_TWO_PER_SM's 32- or 64-token form, R = 1, K split by RWG_WAVE_SPLIT) for
    an m-token launch of a wide layer, or None where that form is off."""
    two = RWG_TWO_PER_SM.get(32 if m <= 32 else 64)
    return {"R": 1, **two, **_rwg_wave_split(n, k, 2 * slots)} if two else None


def _rwg_wave_split(n: int, k: int, slots: int) -> dict:
    """{"S": 2} where RWG_WAVE_SPLIT's rule splits K for this wide layer on `slots` program slots, else {}."""
    if RWG_WAVE_SPLIT <= 0:
        return {}
    kb, tiles = -(-k // 256), -(-n // 64)
    if kb // 2 >= RWG_WAVE_SPLIT_MIN_STEPS and _wave_fill(2 * tiles, slots) >= _wave_fill(tiles, slots) + RWG_WAVE_SPLIT:
        return {"S": 2}
    return {}


def _rwg_kp_model(n: int, k: int, slots: int) -> tuple[int, float, float]:
    """(the KP form's steps per slice, its modelled us, R = 2's modelled us) for an N x K layer on `slots` SMs: the
    time model fitted on the H100 at M = 32 on rows-ordered words (RWG_KP's comment)."""
    from qerl.kernels.w4a16_wgmma import split

    kb, tiles = -(-k // 256), -(-n // 64)
    steps = -(-kb // max(1, min(split(tiles, kb, slots), kb // 2)))
    tiles2 = -(-n // 128)
    return steps, 3.4 + 0.57 * steps, 6.8 + 1.12 * -(-kb // split(tiles2, kb, slots))


def _rwg_kp_wins(n: int, k: int, slots: int, r: int) -> bool:
    """RWG_KP's rule for a layer whose 64-row tiles fit one wave and the R the fill rule picked: its
    slices (one program per SM, >= 2 steps each) run >= RWG_KP_MIN_STEPS steps, and against R = 2 the
    fitted time model says it is faster."""
    steps, kp_us, r2_us = _rwg_kp_model(n, k, slots)
    if steps < RWG_KP_MIN_STEPS:
        return False
    return r == 1 or kp_us < r2_us


def _wsmma_ok(device: torch.device, state: dict) -> bool:
    """The Gluon kernels run on sm_90 only (TMA, warp specialisation) and need K % 256 == 0 (one tile's K;
    layout.default_order's "auto" rule follows this one)."""
    return (not INTERPRETED and device.type == "cuda" and state["k"] % layout.TILE_K == 0
            and _hopper(device.index if device.index is not None else 0))


def _kernel_config(config: dict | None, default: dict) -> dict:
    """The tile config: `config` if it names tile keys, else the heuristic's default; modifier
    keys (PDL) apply on top of either."""
    cfg = dict(default if config is None or set(config) <= _PATH_KEYS | _MOD_KEYS else config)
    cfg.update({key: v for key, v in (config or {}).items() if key in _MOD_KEYS})
    for key in _PATH_KEYS | {"PF"}:
        cfg.pop(key, None)
    return cfg


# PWA (per-warp stage release, qerl/kernels/ptx_pwa.py) belongs to the Gluon GEMV and rwg, XS (x beside
# the weight stages) to the Gluon GEMV, DIAG (timing only: no decode, wrong outputs), FRAG (fragment-ordered
# words, a second copy) and XROWS (the last token tile's rows past M read from x's storage) to rwg; the other
# kernels ignore them, so a config of path keys and these keeps every kernel's own tiles
_PATH_KEYS = {"PATH", "CHUNKS", "SIDE", "PWA", "XS", "DIAG", "FRAG", "XROWS"}
_MOD_KEYS = {"PDL", "PDL_LATE", "PF"}  # launch modifiers: never replace the tile heuristic
_GEMV_KEYS = {"BN", "num_warps", "PER_SM", "S", "WAVES", "PACKED", "DECODE_F32", "num_stages", "ACC2D", "CH", "PDL",
              "PDL_LATE", "PF"}


def _dense(a: torch.Tensor, state: dict, bwd: bool, bias, config: dict | None, out):
    """The two cuBLAS paths: overlapped chunks when CHUNKS > 1, else one whole-layer buffer."""
    m = a.shape[0]
    chunks = (config or {}).get("CHUNKS", _overlap_chunks(m, state["n"], state["k"], bwd))
    if _path(m, config) == "overlap" and chunks <= 1 and "CHUNKS" not in (config or {}):
        chunks = 4
    if chunks > 1:
        return _overlapped(a, state, bwd, bias, out, chunks, side=bool((config or {}).get("SIDE", True)))
    w = dequant_bf16(state)
    if bwd:
        return torch.mm(a, w, out=out)
    if bias is None:
        return torch.mm(a, w.T, out=out)
    return torch.addmm(bias.to(torch.bfloat16), a, w.T, out=out)


def _names_kernel(config: dict | None) -> bool:
    """True where `config` picks the kernel itself (a PATH or a Triton tile config), so no route replaces it."""
    return bool(config) and ("PATH" in config or "BO" in config)


def _fused_route(m: int, state: dict, device: torch.device, config: dict | None) -> tuple[str, dict | None]:
    """The kernel `forward` runs an M-row launch of the fused path on (no tile config) -> (path,
    config): routed as a PDL chain where CHAIN_ROUTING / PDL say so."""
    path = "fused"
    if layout.is_frag(state):
        return _frag_route(m, state, device, config)
    nk = state["n"] * state["k"]
    chain = PDL if CHAIN_ROUTING is None else CHAIN_ROUTING
    min_nk, tok_min_n, tok_min_k = ((WSMMA_MIN_NK_PDL, WSMMA_TOKENS_MIN_N_PDL, WSMMA_TOKENS_MIN_K_PDL) if chain
                                    else (WSMMA_MIN_NK, WSMMA_TOKENS_MIN_N, WSMMA_TOKENS_MIN_K))
    gluon_fmt = state["fmt"] in WSMMA_FORMATS
    if m == 1 and gluon_fmt and 0 < min_nk <= nk and _wsmma_ok(device, state):
        path = "wsmma"  # (checked first: with PDL its threshold may be below GEMV_MAX_NK)
    elif m <= GEMV_MAX_M and nk <= GEMV_MAX_NK:
        path = "gemv"
    elif (2 <= m <= 8 and gluon_fmt and 0 < tok_min_n <= state["n"]
          and state["k"] >= tok_min_k and _wsmma_ok(device, state)):
        path = "wsmma"
    elif 0 < RWG_MIN_M <= m <= max(RWG_MAX_M, RWG_WIDE_MAX_M) and _wsmma_ok(device, state):
        path = "rwg"
        slots = _num_sms(device.index if device.index is not None else 0)
        config = {**_rwg_config(state["n"], state["k"], m, slots, state["fmt"]), **(config or {})}
    elif 0 < WGMMA_MIN_M <= m and _wsmma_ok(device, state):
        path = "wgmma"
    elif 0 < WGMMA_SMALL_M <= m and WGMMA_MIN_M > 0 and _wsmma_ok(device, state):
        small = _small_m_wgmma(state["n"], state["k"], m)
        if small is not None:
            path, config = "wgmma", {**small, **(config or {})}
    return path, config


# Fragment-ordered layers at 1..FRAG_GEMV_MAX_M tokens on the Gluon GEMV (w4a16_gluon WF 2) instead of rwg (0: off).
# Its GPU test passed in session 74 (H100); 16 layers at 1 / 8 tokens: median 2.06 / 2.12x bf16 on rows layers,
# 2.08 / 2.18x on frag layers with it (rwg there: 1.52 / 1.51x on the H200, NOTES_w4a16.md section 49).
FRAG_GEMV_MAX_M = env_int("QERL_W4A16_FRAG_GEMV_MAX_M", 8)
# Fragment-ordered layers above rwg's range on the wgmma GEMM (w4a16_wgmma FMT 4 / 5, by the rows layers' rules)
# instead of dequantise + cuBLAS: on since session 77. Its GPU tests passed for all four configs (sessions 74-75) and
# from 1 to 700 tokens beside FRAG_BWD_DEQUANT (session 77); H100, whole sweep on frag layers, median x bf16 without
# -> with it: M = 256 0.50 -> 0.95, M >= 1024 0.80 -> 0.85 (rows layers 0.93 / 0.85; NOTES_w4a16.md section 52).
FRAG_WGMMA = env_int("QERL_W4A16_FRAG_WGMMA", 1)


# Fragment-ordered layers at 9 .. RWG_MIN_M - 1 tokens (BM 16 tiles) on rwg with its 17..32-token
# config rule instead of its R = 2 defaults: the wide layers' two / three programs per SM (three where K <=
# FRAG_SMALL_THREE_MAX_K), the narrow ones' KP / R rule. H100, 10 / 16 tokens, x bf16 (defaults -> rule):
# 22016x2048 1.91 / 1.88 -> 2.44 / 2.64, 37888x3584 2.45 / 2.28 -> 2.87 / 2.71, 55296x5120 2.38 / 2.34 -> 2.93 / 2.92,
# 27648x5120 2.35 / 2.34 -> 2.63 / 2.65, 7168x5120 2.00 / 2.01 -> 2.43 / 2.46, 3584x18944 2.38 / 2.37 -> 2.48 / 2.47
# (NOTES_w4a16.md section 50). 0: off.
FRAG_SMALL_RULE = env_int("QERL_W4A16_FRAG_SMALL_RULE", 1)
FRAG_SMALL_THREE_MAX_K = 4096


def _frag_rule_tokens(m: int, k: int) -> int | None:
    """The token count whose rwg config rule an m-token launch on a frag layer of K `k` takes (None: rwg's
    defaults): m itself from RWG_MIN_M, and with FRAG_SMALL_RULE at 9 .. RWG_MIN_M - 1 the 24- or 17-token rule."""
    if m >= RWG_MIN_M > 0:
        return m
    if FRAG_SMALL_RULE and 9 <= m < RWG_MIN_M:
        return RWG_THREE_MIN_M if k <= FRAG_SMALL_THREE_MAX_K else RWG_MIN_M
    return None


# Three refinements of rwg's 17..64-token rule for fragment-ordered layers, on since session 79 (0 turns each off;
# ablate_rollout.py flags `three4k` / `kp5k` / `r2w48` force them, `no3k` / `nokp5k` / `nor2w` turn them off). In
# the decode chain (14B nvfp4, LoRA r32, H100, NOTES_w4a16.md section 54): 32 rows 8.322 ms -> 8.037 with the first,
# 8.265 with the second, 7.976 with all three and xrows; 40 rows 11.013 -> 10.708 with the third (9.764 with xrows).
# Single launches on frag words (H100, section 53):
# - FRAG_THREE_MAX_K: the three-programs-per-SM form at RWG_THREE_MIN_M..32 tokens only where K <= this, the wider-K
#   wide layers on the two-per-SM form instead (as FRAG_SMALL_RULE already does at 9..16 tokens): 27648x5120 at 24 /
#   32 tokens 45.5 / 46.0 -> 41.2 / 41.2 us, 55296x5120 2.46-2.67x -> 2.70 / 2.73x bf16. Default 4096.
# - FRAG_KP_MARGIN_PCT: the KP form where its modelled time is within this many percent of R = 2's (the model was
#   fitted on rows words): 5120x5120 (model 14.80 against 14.64 us) measured 13.9 -> 12.4 us at 24 and 32 tokens
#   and 8-12% faster at 48 / 56 / 64. Default 5: that layer alone among the Qwen2.5 3B-32B shapes.
# - FRAG_R2_WIDE_MAX_M: R = 2 (one program per SM, two 64-row tiles sharing each activation chunk) on the wide layers
#   at 33..this many tokens, where the two-per-SM form's 64-token tiles run with 16-31 rows out of bounds: at 40 / 48
#   tokens 27648x5120 67.5 / 58.3 -> 51.4 / 46.8 us, 55296x5120 126.2 / 110.2 -> 94.8 / 90.6, 37888x3584 63.7 / 57.0
#   -> 52.9 / 52.1, 22016x2048 even; at 56 R = 2 no longer wins. Default 48.
FRAG_THREE_MAX_K = env_int("QERL_W4A16_FRAG_THREE_MAX_K", 4096)
FRAG_KP_MARGIN_PCT = env_int("QERL_W4A16_FRAG_KP_MARGIN_PCT", 5)
FRAG_R2_WIDE_MAX_M = env_int("QERL_W4A16_FRAG_R2_WIDE_MAX_M", 48)
# A fourth, on since session 80 (0 turns it off; ablation flags `three64` / `no3x64`): at 49..64 tokens, the wide
# layers with K <= this whose 64-row tiles fit one wave at three programs per SM (two per SM run them in 1.3 waves) take
# FRAG_THREE64, three per SM at BM 64 with one activation stage. 22016x2048 (344 tiles on 396 slots), H100, NOTES_w4a16.md
# sections 54-55: 20.1 -> 18.8 us at 64 tokens (session 79, 3 rounds); 23.3 / 21.9 / 20.1 -> 20.7 / 19.1 / 19.1 us at
# 49 / 56 / 64 (session 80, 5 rounds). The wider layers (432-864 tiles) lose 7-40% on it (both sessions). 2048 applies it to
# 22016x2048 alone among the Qwen2.5 3B-32B shapes.
FRAG_THREE64_MAX_K = env_int("QERL_W4A16_FRAG_THREE64_MAX_K", 2048)
FRAG_THREE64 = {"R": 1, "BM": 64, "NSW": 2, "NSX": 1, "maxnreg": 80, "XREL": 1}


def _frag_rwg_config(n: int, k: int, m: int, slots: int, fmt: str = "nvfp4") -> dict:
    """rwg's config rule (_rwg_config) for a fragment-ordered layer, with FRAG_THREE_MAX_K, FRAG_KP_MARGIN_PCT,
    FRAG_R2_WIDE_MAX_M and FRAG_THREE64_MAX_K."""
    tiles = -(-n // 64)
    wide = tiles > slots
    if wide and 32 < m <= min(FRAG_R2_WIDE_MAX_M, RWG_MAX_M):
        return {"R": 2}
    if (wide and FRAG_THREE64_MAX_K and k <= FRAG_THREE64_MAX_K and 48 < m <= RWG_MAX_M and tiles <= 3 * slots
            and fmt in RWG_THREE_FORMATS):
        return dict(FRAG_THREE64)
    if (wide and FRAG_THREE_MAX_K and k > FRAG_THREE_MAX_K and RWG_THREE_PER_SM and RWG_THREE_MIN_M <= m <= 32
            and fmt in RWG_THREE_FORMATS):
        two = _rwg_two_per_sm(n, k, m, slots)
        if two:
            return two
    config = _rwg_config(n, k, m, slots, fmt)
    if not wide and FRAG_KP_MARGIN_PCT > 0 and RWG_KP and m <= RWG_MAX_M and config == {"R": 2}:
        steps, kp_us, r2_us = _rwg_kp_model(n, k, slots)
        if steps >= RWG_KP_MIN_STEPS and kp_us <= r2_us * (1 + FRAG_KP_MARGIN_PCT / 100):
            return {"R": 1, **RWG_KP}
    return config


def _frag_route(m: int, state: dict, device: torch.device, config: dict | None) -> tuple[str, dict | None]:
    """_fused_route for fragment-ordered words (state["order"] "frag"; rwg, the Triton kernels and the Gluon GEMV
    read them, the wgmma GEMM too, partly GPU-tested). On sm_90: the Gluon GEMV up to FRAG_GEMV_MAX_M tokens, rwg
    up to RWG_WIDE_MAX_M (its config rule from RWG_MIN_M tokens, its defaults below: R = 2, BM 16, measured 1.93x
    bf16 at 9..16 tokens on the H100, NOTES_w4a16.md section 47), then the bf16 buffer + cuBLAS, or with FRAG_WGMMA
    the wgmma GEMM (and from DEQUANT_MIN_M by its large-M rule in `forward`, as rows layers). The fused Triton
    kernel where no Gluon kernel runs (not sm_90, K % 256)."""
    if FRAG_GEMV_MAX_M and m <= FRAG_GEMV_MAX_M and _wsmma_ok(device, state):
        return "wsmma", config
    if m <= max(RWG_MAX_M, RWG_WIDE_MAX_M) and _wsmma_ok(device, state):
        rule_m = _frag_rule_tokens(m, state["k"])
        if rule_m:
            slots = _num_sms(device.index if device.index is not None else 0)
            config = {**_frag_rwg_config(state["n"], state["k"], rule_m, slots, state["fmt"]), **(config or {})}
        return "rwg", config
    if m > max(RWG_MAX_M, RWG_WIDE_MAX_M) and _wsmma_ok(device, state):
        return ("wgmma" if FRAG_WGMMA and 0 < WGMMA_MIN_M <= m else "dequant"), config
    return "fused", config


def routes_to_gluon_tokens(x: torch.Tensor, state: dict) -> bool:
    """True where `forward` (no config) runs this 2..8-token launch on the Gluon GEMV with one token
    per MMA column (path "wsmma"), as it routes a PDL chain (CHAIN_ROUTING / PDL)."""
    m = x.shape[0]
    return 2 <= m <= 8 and _path(m, None) == "fused" and _fused_route(m, state, x.device, None)[0] == "wsmma"


def forward(x: torch.Tensor, state: dict, bias: torch.Tensor | None = None, config: dict | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [M, K] bf16; `state` from qerl.kernels.prepare.
    `config` overrides the heuristics: tile keys of _fwd_config, PROGRAMS (grid size), PATH,
    CHUNKS / SIDE (overlapped path)."""
    _check(x, state, state["k"], "x")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    path = _path(m, config)
    if path == "fused" and not _names_kernel(config):  # (modifier keys such as PDL keep the dispatch)
        path, config = _fused_route(m, state, x.device, config)
    if (path == "dequant" and PREFILL not in ("fused", "dequant", "overlap") and not (config and "PATH" in config)
            and (FRAG_WGMMA or not layout.is_frag(state)) and m < WGMMA_MAX_M and WGMMA_MIN_M > 0
            and _wsmma_ok(x.device, state)):
        large = _large_m_wgmma(state["n"], m, _num_sms(x.device.index if x.device.index is not None else 0))
        if large is not None:
            path, config = "wgmma", {**large, **(config or {})}
    if path in ("dequant", "overlap"):
        return _dense(x, state, False, bias, config, out)
    if path == "gemv":
        from qerl.kernels import w4a16_gemv

        return w4a16_gemv.forward(x, state, bias, {k_: v for k_, v in (config or {}).items() if k_ in _GEMV_KEYS}, out)
    if path == "ws":  # experimental warp-specialised Gluon GEMV (nvfp4, M = 1), opt-in only
        from qerl.kernels import w4a16_ws

        return w4a16_ws.forward(x, state, bias, config, out)
    if path == "wsmma":  # the same with the reduction on the tensor cores (mma.sync), opt-in only
        from qerl.kernels import w4a16_gluon

        return w4a16_gluon.forward(x, state, bias, out=out, config=config)
    if path == "rwg":  # 4-bit GEMM with the decoded weights as wgmma's register operand (M <= 128), sm_90
        from qerl.kernels import w4a16_rwg

        return w4a16_rwg.forward(x, state, bias, out=out, config=config)
    if path == "wgmma":  # warp-specialised Gluon GEMM (TMA, decoder warps, async wgmma), sm_90
        from qerl.kernels import w4a16_wgmma

        return w4a16_wgmma.forward(x, state, bias, out=out, config=config)
    cfg = _kernel_config(config, _fwd_config(m, state["n"], state["k"], state["fmt"]))
    return _launch(x, state, False, bias, cfg, out)


# Fragment-ordered layers' input gradient below DEQUANT_MIN_M rows through the bf16 buffer + cuBLAS instead of the
# fused Triton kernel, whose fragment-word tile gather (FMT 2) is slow: H100, 256 rows, median of 16 layers x bf16,
# rows layers (fused) 0.56, frag layers (fused) 0.31, frag layers' forward through the buffer 0.50 (NOTES_w4a16.md
# section 51). On since session 77: 256 rows 0.31 -> 0.50 (rows layers 0.58 in the same sweep; section 52).
# 0: the fused kernel.
FRAG_BWD_DEQUANT = env_int("QERL_W4A16_FRAG_BWD_DEQUANT", 1)


def _bwd_path(m: int, state: dict, config: dict | None) -> str:
    """_path for the input gradient: as the forward's, except FRAG_BWD_DEQUANT's fragment-ordered layers (no config
    PATH / tile keys) take the bf16 buffer + cuBLAS at every M."""
    path = _path(m, config)
    if path == "fused" and FRAG_BWD_DEQUANT and layout.is_frag(state) and not _names_kernel(config):
        return "dequant"
    return path


def backward(dy: torch.Tensor, state: dict, config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """dx = dy @ dequant(W) for dy [M, N] bf16 (the input gradient of forward)."""
    _check(dy, state, state["n"], "grad_output")
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    m = dy.shape[0]
    if _bwd_path(m, state, config) in ("dequant", "overlap"):
        return _dense(dy, state, True, None, config, out)
    cfg = _kernel_config(config, _bwd_config(m, state["n"], state["k"], state["fmt"]))
    return _launch(dy, state, True, None, cfg, out)
