"""Same-process A/B of rollout-engine variants on one model, and a kernel timeline of a graph replay.

    python benchmarks/ablate_rollout.py --model qwen2.5-14b --format nvfp4 --batch 8 --lora 64 \
        --variants base lora serial only:qkv+o only:gate_up+down base@nowsmma lora@nowsmma \
        --timeline base lora --out ablate.json

One engine, built once; for each variant the CUDA graphs are captured afresh and the graph step
is timed (median of 64 replays at the 257..512-key bucket, as profile_rollout.py; --keys N: the
(N - 255)..N bucket). Variants:
  base            LoRA off (the adapters disabled: the no-LoRA step, NORM_FOLD and GLU included)
  lora            LoRA on every group, on the side stream (the engine's default)
  serial          LoRA on every group, on the main stream after the base product
  ldrop           timing bound, not a rollout: every group's real LoRA kernels run on the side stream, but
                  their delta is dropped and nothing waits for it (one join at the end of the step),
                  so the groups keep the no-LoRA step's NORM_FOLD / GLU launches; under the LoRA
                  groups' GEMV plan (engine.lora_gemv_per_sm). What a fold that added the delta for free
                  inside those launches could reach (NOTES_rollout.md section 49)
  only:K1+K2      LoRA only for those group kinds (qkv, o, gate_up, down), side stream
  late:K1+K2      no LoRA; the CUDA-core GEMV's late PDL trigger only for those kinds
  ...@FLAG[@FLAG]  with switches (see _switches): nowsmma (no Gluon tensor-core GEMVs), nopdl,
                  late / early (the 4-bit kernels trigger their dependents after the main loop /
                  at their start), pf0..pf3 (GEMV
                  weight prefetch depth before the PDL wait), gsm3 (Gluon GEMV at 3 programs per SM), s8 / s16 / s32 / s64 / s128 / s256
                  (LoRA shrink slices), gemv0 (every M = 1 layer on the Gluon GEMV), in the decode chain:
                  tok0 (every M = 2..8 layer on the Gluon GEMV, the default), tokall (those with
                  K >= 4096), tokold (N >= 16384 and K >= 4096, the rule before session 12),
                  wg9 / wg9all / wg9two (9..16-token layers on the wgmma GEMM where _small_m_wgmma
                  picks it / on every layer at one / two programs per SM, not the fused Triton kernel;
                  the Gluon GEMV at 9..16 tokens and its flags tok8 / m16all / m16n5k come with
                  benchmarks/patches/gluon_gemv_16_tokens_narrow.patch, NOTES_rollout.md sections 16-17),
                  wsmma20m (in the decode chain, M = 1 layers from 20M weights on the Gluon GEMV, the rule before
                  session 45),
                  wsmx (mxfp4 on the Gluon GEMV by the nvfp4 rules, w4a16_triton.WSMMA_FORMATS; the default
                  since session 44), nowsmx (mxfp4 off it, the route before),
                  gluon44 (the Gluon GEMV's thresholds before session 45: M = 1 from 60M weights, 20M in the
                  decode chain; 2..8 tokens standalone only on N >= 16384 and K >= 4096),
                  wsplit (rwg's wide forms split K in two where that fills the last wave better,
                  w4a16_triton.RWG_WAVE_SPLIT = 0.1; lost 3.9% at 7B batch 32 on the H200, off),
                  r9:KIND+KIND (rwg from 9 tokens only for those kinds' products),
                  norwg (no w4a16_rwg: 17..128 tokens back on the fused / wgmma kernels), rwg9 (rwg from
                  9 tokens; on the H200 +8.5% on the 14B 16-row base step, -1% on the GRPO batch-2 rollouts,
                  whose LoRA side stream it starves: NOTES_rollout.md section 41),
                  norwgw (no 128-token rwg tiles: 65..128 tokens on the wgmma GEMM), norwg2
                  (no two-per-SM rwg form), noxrel (that form without XREL), norwg3 / rwg3all
                  (17..32 tokens at three rwg programs per SM, w4a16_triton.RWG_THREE_PER_SM: nowhere /
                  on every layer, not only the wide ones), rwg3b32 (rwg3all, and 33..64 tokens as
                  two 32-token tiles at three per SM), rwg2n (the narrow layers' 17..64-token launches,
                  KP / R by fill by default, at the two-per-SM form instead), nodec (every nvfp4 rwg launch
                  without its decode, rwg's DIAG: timing only, wrong tokens), frag (every nvfp4 rwg launch on
                  fragment-ordered words, rwg's FRAG: a second copy of each layer's words), kp / nokp / kpall (rwg's KP form, two MMA warpgroups
                  on alternate K steps of one tile, w4a16_triton.RWG_KP_FORM; on by default: where
                  _rwg_kp_wins / nowhere / on every layer whose 64-row tiles fit one wave), three4k / kp5k / r2w48
                  (fragment-ordered layers: the three-per-SM form only where K <= 4096, else two per SM; KP where
                  its model is within 5% of R = 2's; R = 2 on the wide layers at 33..48 tokens:
                  w4a16_triton.FRAG_THREE_MAX_K / FRAG_KP_MARGIN_PCT / FRAG_R2_WIDE_MAX_M; on by default,
                  no3k / nokp5k / nor2w turn them off), three64 (wide layers with K <= 2048 whose 64-row tiles fit
                  one wave at three per SM, at 49..64 tokens: three per SM at BM 64, w4a16_triton.FRAG_THREE64_MAX_K;
                  on by default since session 80, no3x64 turns it off), xrows (the step's
                  GEMM inputs in whole 64-row buffers and rwg reading a last token tile's rows from them instead
                  of a zero-filled box: decode_ops.ROW_TILE = 64, w4a16_rwg.XROWS = 1; on by default, noxrows
                  turns it off), pwa / pwag / pwar (per-warp
                  stage release, qerl/kernels/ptx_pwa.py, forced on: Gluon GEMV at every M and rwg / GEMV
                  only / rwg only), nopwa (off in both; the default: GEMV at M = 2..8 and rwg),
                  earlyv (attention loads V with K),
                  kvpre / nokvpre / kvrule (attention reads its first K / V block before the PDL wait:
                  always / never / by decode_ops.attention_prefetch), attold (the attention before session 26:
                  no short-bucket rule, decode_ops.ATTN_SHORT_KEYS = 0, and no prefetch),
                  ap128 / ap192 / ap248 / ap528 / ap1056 (attention programs to aim for; default 264), aw8 (8 warps per attention program),
                  ast1 / ast2 / ast3 / ast4 (the attention's key loop pipelined that deep; default 2),
                  anr0 / anr96 / anr128 (the attention's register cap on its launches of over 3 x SMs programs in
                  64-key blocks: none / 96 / 128, the default; decode_ops.ATTN_MAXNREG),
                  oldslot (the step's new key / value selected into its loaded block, not taken as the first key:
                  decode_ops.ATTN_SLOT_FIRST off, the form before session 47), amb0 / amb2 / amb8 (key blocks per
                  attention program at most: off / 2 / 8, not ATTN_MAX_BLOCKS), ab16 / ab32 (attention key block),
                  br16 / br32 (LoRA shrink rows per program), lw8 (8 warps per shrink program),
                  sprold (the LoRA shrink's K split as before session 36: MAX_SPLITS at every row count,
                  lora_ops.SPLIT_PARTIAL_ROWS unbounded), sp1024 (session 36's split: SPLIT_PARTIAL_ROWS
                  1024, i.e. 32 slices at 17-32 rows, 16 at 33-64),
                  g:K1+K2:pPsS[wW][kK][x][q][t][z|y] (the Gluon GEMV for those group kinds, or "all",
                  planned for P programs per SM with an S-stage ring, W consumer warps, K slices per
                  row block forced, x loaded a step ahead, stream-K, split tail forced, x beside the
                  weight stages (XS) on / off, e.g. g:qkv+o:p2s6, g:down:p4s3x, g:gate_up:p4s3q,
                  g:down:p4s3y; the late-trigger flags of NOTES_rollout.md section 23 (g:...l, nlate /
                  slate / nslate) lost and are in 570eaa6's tree only),
                  cl / nocl (the Gluon GEMV's split fixup through a cluster's shared memory wherever the
                  clusters fit / never; default: in PDL chains on layers of short per-program loops,
                  w4a16_gluon.CLUSTER_FIXUP, qerl/kernels/ptx_cluster.py), cl:K1+K2 (forced for those group
                  kinds only, e.g. base@nocl@cl:o to time one kind's clusters at batch 8),
                  xpf / noxpf (Gluon GEMV loads x a step ahead or not), noxpf8 (not by rule at M = 2..8),
                  xs / xsall / noxs (its producer copies x beside each weight stage: at M = 2..8 / at every M /
                  never), sk / nosk (its stream-K
                  schedule forced on every launch / off; default: in PDL chains where a split tail
                  would apply), notail (no split tail; default: where w4a16_gluon.tail_plan finds
                  one beyond the resident programs), nosbits (its scales by the float conversion, not
                  the integer one), sks1 / 2 / 4 / 8 / 16 / 32 (stream-K planned for that many slots fewer,
                  w4a16_gluon.SK_SPARE, on top of SK_SPARE_GLU for GLU launches), noglu (the gate/up
                  product and the silu kernel as two launches, not engine.GLU's one), norope / nocomb
                  (RoPE / the split combine in launches of their own, not inside the attention kernel), comb (the combine inside), oldepi (its epilogues
                  without the shared-memory sum), lsm0 / lsm1 / lsm2 (a LoRA group's Gluon GEMV planned
                  as without LoRA / for 1 / 2 programs per SM, not engine.lora_gemv_per_sm's),
                  lsmk:KIND+KIND=N (N programs per SM for those LoRA groups only,
                  engine.LORA_GEMV_PER_SM_KIND), lxs0 (a LoRA
                  group's Gluon GEMV without XS, engine.LORA_GEMV_XS), lora1k
                  (LoRA's shrink and expand as one launch, lora_ops.FUSED), nohoist (Gluon GEMV's
                  alpha / bias and the norm weight loaded after the PDL wait, not before),
                  gr56 / gr48p4 / gr48 / gr40 (Gluon GEMV capped at 56 / 48 / 48 / 40 registers,
                  planned for 4 / 4 / 5 / 6 programs per SM: 8 warps x 32 x regs registers each),
                  nobf16gemv (one-row bf16 products, the lm_head's included, through cuBLAS, not
                  qerl.kernels.bf16_gemv),
                  lnull / lshrink / lexpand (with lora: the side stream keeps its fork and join but
                  runs one empty kernel / the shrink alone / the expand alone, delta zero: timing only;
                  the device-side join these were measured against, flags dj / djqkv / djearly, is
                  benchmarks/patches/lora_device_join_qkv.patch, NOTES_rollout.md sections 16, 23 and 24),
                  noaddmm (a prefill's LoRA delta written and then added, not added in place by the
                  expand GEMM, lora_ops.ADD_IN_PLACE), lb64 / lb128 / lb256 (decode key buckets of that
                  many slots, engine.LENGTH_BUCKET; with --generate, as they change which buckets run),
                  nostepfuse (the step's embedding, cos / sin gathers and advance as their own launches,
                  not engine.STEP_FUSE's), noshare (each sample reads its own copy of the prompt's K / V,
                  not engine.SHARE_PROMPT_KEYS's first-sample copy; matters with --generations > 1),
                  noprerope / nogqa (the prefill's RoPE as torch ops / K and V
                  repeated per query head, not engine.PREFILL_ROPE / PREFILL_GQA; with --generate),
                  nonorm (timing only: every decode norm but the first skipped, no residual add: what
                  folding the norms into the GEMVs could give at most), fold / nofold (engine.NORM_FOLD
                  on / off: the norms between 4-bit GEMVs split over their epilogues),
                  hold:N:US[:MIB] (timing only: a stream of its own, forked at each decode step's start, keeps
                  N SMs for US microseconds with one 216 KiB shared-memory program each, so no 4-bit GEMV
                  program shares them, first reading MIB MiB from DRAM between them (the row records how
                  long: hold_read_*); joined at the step's end), sms:M (the kernels plan their grids for M SMs,
                  w4a16_triton._num_sms): what a kernel that kept N SMs through the step would cost the rest;
                  lres / lres4 / lres16 / lres32 (with lora: the captured decode step's LoRA by one resident
                  kernel of engine.LORA_RESIDENT_PROGRAMS (32) / 4 / 16 / 32 programs, engine.LORA_RESIDENT,
                  qerl/kernels/lora_resident.py;
                  where engine._resident_ok refuses, the side stream as before), lres:P:BK:BN:S:W[:p][:n][:sNS][:c][:x][:f][:e][:r][:wNS]
                  (the same with P programs, BK / BN shrink / expand tiles, S pipelining stages, W warps; p: each
                  program prefetches its adapter bytes of a group into L2 before it waits for the input;
                  n: timing only, the waits and counts without the loads, math and stores; sNS: each failed
                  poll of the kernel naps NS ns first, lora_resident.SLEEP; timing only: c, the deltas'
                  consumers poll once and never wait, engine.LORA_RESIDENT_WAIT off; x, as c and no resident
                  kernel at all, engine.LORA_RESIDENT_KERNEL off; f: the LoRA groups keep NORM_FOLD and GLU,
                  the fused GEMVs waiting for the delta in their epilogues, engine.LORA_RESIDENT_FUSED; wNS:
                  those epilogues' waits nap NS ns between polls, w4a16_gluon.SYNC_NAP)
`--generate N` times N whole generate calls per variant instead (256-token prompts, 512 new tokens:
the tok/s bench_rollout reports, prefill and every key bucket included) and prints their medians.
`--rounds N` times the variant list N times over (A B C A B C ...) and summarises each variant by
its median: the GPU drifts by up to ~6% over a call (the first and last "base" of one list
differed that much), so single back-to-back timings of two variants mislead.
`--stamp V` runs variant V once more with per-program clocks in the Gluon GEMV and the fused
Triton kernel and prints, per kernel and layer shape (medians over the layers), when its programs
got past the PDL wait and how long the main loop, the epilogue and the kernel's tail took
(stamp_summary).
`--timeline V` profiles one graph replay of variant V and reports the kernels' summed durations
and what each kernel adds to the critical path (its end minus the latest end before it, grouped
by kernel; with PDL durations include the wait for the predecessor): summed over the replay's
streams in the printout, per stream and per launch in the JSON, then the layer's period and the intervals
between its Gluon GEMVs' ends (layer_intervals). `--intervals FILE...` prints those from result files
already written, without a GPU. Random-initialised weights.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_rollout import build, gpu_state  # noqa: E402
from profile_rollout import add_generations_arg, graph_step_ms, random_prompts, rewind  # noqa: E402

from qerl.rl.rollout import RolloutSettings  # noqa: E402
from qerl.rollout import engine as engine_mod  # noqa: E402
from qerl.rollout.engine import LORA_GROUP_KINDS as KINDS, RolloutEngine  # noqa: E402


def _rwg_three_everywhere(default, form: dict, up_to: int = 32):
    """_rwg_config with every rwg launch of up to `up_to` tokens at `form` (w4a16_triton.RWG_THREE_PER_SM),
    R = 1 (wide or not); 33..64 tokens (up_to 64) as two 32-token tiles, each weight tile decoded twice."""
    def config(n, k, m, slots, fmt="nvfp4"):
        if m > up_to:
            return default(n, k, m, slots, fmt)
        return {"R": 1, **form, **({"BM": 32} if m > 32 else {})}
    return config


def _rwg_two_narrow(default, forms: dict):
    """_rwg_config with the narrow layers (64-row tiles that fit one program per SM: the KP / R-by-fill forms) at
    17..64 tokens on rwg's two-programs-per-SM form (w4a16_triton.RWG_TWO_PER_SM, R = 1), the wide ones as before."""
    def config(n, k, m, slots, fmt="nvfp4"):
        if m > 64 or -(-n // 64) > slots:
            return default(n, k, m, slots, fmt)
        return {"R": 1, **forms[32 if m <= 32 else 64]}
    return config


def _rwg_nvfp4_key(default, key):
    """_rwg_config with rwg's path key `key` = 1 on every nvfp4 rwg launch (17..128 tokens), the rule's tiles kept:
    DIAG (nodec: no decode, timing only, the engine's tokens are then meaningless: what a free decode would give the
    step) or FRAG (frag: fragment-ordered words; each layer builds its second copy on first use)."""
    def config(n, k, m, slots, fmt="nvfp4"):
        cfg = default(n, k, m, slots, fmt)
        return {**cfg, key: 1} if fmt == "nvfp4" else cfg
    return config


def _switches() -> dict:
    """flag -> [(module, attribute, value)] set while a variant runs."""
    from qerl.kernels import (bf16_gemv, decode_ops, lora_ops, w4a16_gemv, w4a16_gluon, w4a16_rwg, w4a16_triton,
                              w4a16_wgmma)
    three = dict(w4a16_triton.RWG_THREE_PER_SM)
    table = {
        "lsm0": [(engine_mod, "LORA_GEMV_PER_SM", 0)],
        "sk": [(w4a16_gluon, "STREAMK", True)],
        "nosk": [(w4a16_gluon, "STREAMK", False)],
        "notail": [(w4a16_gluon, "TAIL_SPLIT", False)],
        **{f"sks{n}": [(w4a16_gluon, "SK_SPARE", n)] for n in (1, 2, 4, 8, 16, 32)},
        "nosbits": [(w4a16_gluon, "SCALE_BITS", False), (w4a16_wgmma, "SCALE_BITS", False)],
        "lsm2": [(engine_mod, "LORA_GEMV_PER_SM", 2)],
        "lsm1": [(engine_mod, "LORA_GEMV_PER_SM", 1)],
        "lxs0": [(engine_mod, "LORA_GEMV_XS", False)],
        "lora1k": [(lora_ops, "FUSED", True)],
        "noaddmm": [(lora_ops, "ADD_IN_PLACE", False)],
        **{f"lb{n}": [(engine_mod, "LENGTH_BUCKET", n)] for n in (64, 128, 256)},
        "nowsmma": [(w4a16_triton, "WSMMA_MIN_NK", 0), (w4a16_triton, "WSMMA_MIN_NK_PDL", 0),
                    (w4a16_triton, "WSMMA_TOKENS_MIN_N", 0), (w4a16_triton, "WSMMA_TOKENS_MIN_N_PDL", 0)],
        "nopdl": [(decode_ops, "PDL", False)],
        "late": [(w4a16_triton, "PDL_LATE", True), (w4a16_gemv, "PDL_LATE", True)],
        "early": [(w4a16_triton, "PDL_LATE", False), (w4a16_gemv, "PDL_LATE", False)],
        "gsm3": [(w4a16_gluon, "DEFAULT", {**w4a16_gluon.DEFAULT, "PER_SM": 3})],
        "gemv0": [(w4a16_triton, "GEMV_MAX_NK", 0), (w4a16_triton, "WSMMA_MIN_NK", 1),
                  (w4a16_triton, "WSMMA_MIN_NK_PDL", 1)],
        "tokall": [(w4a16_triton, "WSMMA_TOKENS_MIN_N_PDL", 1), (w4a16_triton, "WSMMA_TOKENS_MIN_K_PDL", 4096)],
        "tok0": [(w4a16_triton, "WSMMA_TOKENS_MIN_N_PDL", 1), (w4a16_triton, "WSMMA_TOKENS_MIN_K_PDL", 0)],
        "wsmx": [(w4a16_triton, "WSMMA_FORMATS", ("nvfp4", "mxfp4"))],
        "nowsmx": [(w4a16_triton, "WSMMA_FORMATS", ("nvfp4",))],
        "tokold": [(w4a16_triton, "WSMMA_TOKENS_MIN_N_PDL", 16384), (w4a16_triton, "WSMMA_TOKENS_MIN_K_PDL", 4096)],
        "norwg": [(w4a16_triton, "RWG_MIN_M", 0)],
        "wsplit": [(w4a16_triton, "RWG_WAVE_SPLIT", 0.1)],
        "rwg9": [(w4a16_triton, "RWG_MIN_M", 9)],
        "norwgw": [(w4a16_triton, "RWG_WIDE_MAX_M", 0)],
        "pwa": [(w4a16_gluon, "PER_WARP_ARRIVE", True), (w4a16_rwg, "PER_WARP_ARRIVE", True)],
        "pwag": [(w4a16_gluon, "PER_WARP_ARRIVE", True)],
        "pwar": [(w4a16_rwg, "PER_WARP_ARRIVE", True)],
        "nopwa": [(w4a16_gluon, "PER_WARP_ARRIVE", False), (w4a16_rwg, "PER_WARP_ARRIVE", False)],
        "norwg2": [(w4a16_triton, "RWG_TWO_PER_SM", {})],
        "noxrel": [(w4a16_triton, "RWG_TWO_PER_SM",
                    {b: {**c, "XREL": 0} for b, c in w4a16_triton.RWG_TWO_PER_SM.items()})],
        "norwg3": [(w4a16_triton, "RWG_THREE_PER_SM", {})],
        "three4k": [(w4a16_triton, "FRAG_THREE_MAX_K", 4096)],
        "kp5k": [(w4a16_triton, "FRAG_KP_MARGIN_PCT", 5)],
        "r2w48": [(w4a16_triton, "FRAG_R2_WIDE_MAX_M", 48)],
        "xrows": [(decode_ops, "ROW_TILE", 64), (w4a16_rwg, "XROWS", 1)],
        "no3k": [(w4a16_triton, "FRAG_THREE_MAX_K", 0)],
        "nokp5k": [(w4a16_triton, "FRAG_KP_MARGIN_PCT", 0)],
        "nor2w": [(w4a16_triton, "FRAG_R2_WIDE_MAX_M", 0)],
        "three64": [(w4a16_triton, "FRAG_THREE64_MAX_K", 2048)],
        "no3x64": [(w4a16_triton, "FRAG_THREE64_MAX_K", 0)],
        "noxrows": [(decode_ops, "ROW_TILE", 0), (w4a16_rwg, "XROWS", 0)],
        "kp": [(w4a16_triton, "RWG_KP", dict(w4a16_triton.RWG_KP_FORM))],
        "nokp": [(w4a16_triton, "RWG_KP", {})],
        "kpall": [(w4a16_triton, "RWG_KP", dict(w4a16_triton.RWG_KP_FORM)),
                  (w4a16_triton, "_rwg_kp_wins", lambda n, k, slots, r: True)],
        "rwg3all": [(w4a16_triton, "_rwg_config", _rwg_three_everywhere(w4a16_triton._rwg_config, three))],
        "rwg3b32": [(w4a16_triton, "_rwg_config", _rwg_three_everywhere(w4a16_triton._rwg_config, three, 64))],
        "nodec": [(w4a16_triton, "_rwg_config", _rwg_nvfp4_key(w4a16_triton._rwg_config, "DIAG"))],
        "frag": [(w4a16_triton, "_rwg_config", _rwg_nvfp4_key(w4a16_triton._rwg_config, "FRAG"))],
        "rwg2n": [(w4a16_triton, "_rwg_config", _rwg_two_narrow(w4a16_triton._rwg_config,
                                                                 {m: dict(f) for m, f in w4a16_triton.RWG_TWO_PER_SM.items()}))],
        "wg9": [(w4a16_triton, "WGMMA_SMALL_M", 9)],
        "wg9all": [(w4a16_triton, "WGMMA_SMALL_M", 9), (w4a16_triton, "_small_m_wgmma", lambda n, k, m: {})],
        "wg9two": [(w4a16_triton, "WGMMA_SMALL_M", 9),
                   (w4a16_triton, "_small_m_wgmma", lambda n, k, m: dict(w4a16_triton.WGMMA_TWO_PER_SM))],
        "lw8": [(lora_ops, "SHRINK_WARPS", 8)],
        "wsmma20m": [(w4a16_triton, "WSMMA_MIN_NK_PDL", 20_000_000)],
        "gluon44": [(w4a16_triton, "WSMMA_MIN_NK", 60_000_000), (w4a16_triton, "WSMMA_MIN_NK_PDL", 20_000_000),
                    (w4a16_triton, "WSMMA_TOKENS_MIN_N", 16384), (w4a16_triton, "WSMMA_TOKENS_MIN_K", 4096)],
        "earlyv": [(decode_ops, "ATTN_EARLY_V", True)],
        "xpf": [(w4a16_gluon, "DEFAULT", {**w4a16_gluon.DEFAULT, "XPF": True})],
        "noxpf": [(w4a16_gluon, "DEFAULT", {**w4a16_gluon.DEFAULT, "XPF": False})],
        "noxpf8": [(w4a16_gluon, "XPF_TOKENS_MIN_K", 0)],
        "cl": [(w4a16_gluon, "CLUSTER_FIXUP", True)],
        "nocl": [(w4a16_gluon, "CLUSTER_FIXUP", False)],
        "xs": [(w4a16_gluon, "X_SMEM", None)],
        "xsall": [(w4a16_gluon, "X_SMEM", True)],
        "noxs": [(w4a16_gluon, "X_SMEM", False)],
        "oldepi": [(w4a16_gluon, "EPI_SMEM", False)],
        "nohoist": [(w4a16_gluon, "HOIST_CONSTS", False), (decode_ops, "NORM_W_EARLY", False)],
        "kvpre": [(decode_ops, "ATTN_PREFETCH", True)],
        "kvrule": [(decode_ops, "ATTN_PREFETCH", None)],
        "attold": [(decode_ops, "ATTN_SHORT_KEYS", 0), (decode_ops, "ATTN_PREFETCH", False)],
        "nokvpre": [(decode_ops, "ATTN_PREFETCH", False)],
        "norope": [(decode_ops, "ATTN_ROPE", False)],
        "nocomb": [(decode_ops, "ATTN_COMBINE", False)],
        "comb": [(decode_ops, "ATTN_COMBINE", True)],
        **{f"ap{n}": [(decode_ops, "ATTN_PROGRAMS", n)] for n in (128, 192, 248, 528, 1056)},
        "amb0": [(decode_ops, "ATTN_MAX_BLOCKS", 0)],
        "amb2": [(decode_ops, "ATTN_MAX_BLOCKS", 2)],
        "amb8": [(decode_ops, "ATTN_MAX_BLOCKS", 8)],
        "aw8": [(decode_ops, "ATTN_WARPS", 8)],
        "oldslot": [(decode_ops, "ATTN_SLOT_FIRST", False)],
    }
    for n in (1, 2, 3, 4):
        table[f"ast{n}"] = [(decode_ops, "ATTN_STAGES", n)]
    for n in (0, 96, 128):
        table[f"anr{n}"] = [(decode_ops, "ATTN_MAXNREG", n or None)]
    for name, regs, per_sm in (("gr56", 56, 4), ("gr48p4", 48, 4), ("gr48", 48, 5), ("gr40", 40, 6)):
        table[name] = [
            (w4a16_gluon, "DEFAULT", {**w4a16_gluon.DEFAULT, "maxnreg": regs, "PER_SM": per_sm})]
    table["nobf16gemv"] = [(bf16_gemv, "ENABLED", False)]
    table["noglu"] = [(engine_mod, "GLU", False)]
    table["nostepfuse"] = [(engine_mod, "STEP_FUSE", False)]
    table["noshare"] = [(engine_mod, "SHARE_PROMPT_KEYS", False)]
    table["nonorm"] = [(engine_mod._Norm, "__call__", _skip_norm)]
    table["fold"] = [(engine_mod, "NORM_FOLD", True)]
    table["nofold"] = [(engine_mod, "NORM_FOLD", False)]
    table["noprerope"] = [(engine_mod, "PREFILL_ROPE", False)]
    table["lres"] = [(engine_mod, "LORA_RESIDENT", True)]
    for n in (4, 16, 32):
        table[f"lres{n}"] = [(engine_mod, "LORA_RESIDENT", True), (engine_mod, "LORA_RESIDENT_PROGRAMS", n)]
    table["nogqa"] = [(engine_mod, "PREFILL_GQA", False)]
    from qerl.rollout import fuse
    for part in ("null", "shrink", "expand"):
        table[f"l{part}"] = [(fuse.LinearGroup, "lora", _lora_part(part))]
    for n in (16, 32, 64):
        table[f"ab{n}"] = [(decode_ops, "ATTN_BLOCK", n), (decode_ops, "ATTN_BLOCK_SMALL", n)]
        table[f"br{n}"] = [(lora_ops, "SHRINK_BR", n)]
    for d in (0, 1, 2, 3):
        table[f"pf{d}"] = [(w4a16_gemv, "PF_DEPTH", d)]
    for n in (8, 16, 32, 64, 128, 256):
        table[f"s{n}"] = [(lora_ops, "MAX_SPLITS", n)]
    table["sprold"] = [(lora_ops, "SPLIT_PARTIAL_ROWS", 1 << 30)]
    table["sp1024"] = [(lora_ops, "SPLIT_PARTIAL_ROWS", 1024)]
    return table


def _skip_norm(self, delta, h, extra=None, signal=None):
    """Timing only (flag `nonorm`): no residual add and no RMSNorm launch; the next product reads
    the unnormalised input. What the norm launches cost the step at most (the first norm, which
    reads the embedding, stays)."""
    out = h if delta is None else delta
    return out, out


@functools.lru_cache(maxsize=None)
def _noop_kernel():
    import triton

    @triton.jit
    def _noop(p):
        pass

    return _noop


def _lora_part(part: str):
    """A stand-in for LinearGroup.lora that keeps the side stream's fork and join but runs only part
    of the LoRA work there ("null": one empty kernel; "shrink": the shrink alone; "expand": the
    expand alone, from a zeroed h) and hands back a zeroed delta, so the rollout is the base one:
    what the fork / join structure costs on its own, and each kernel's share (timing only)."""
    from qerl.kernels import lora_ops
    from qerl.rollout import fuse

    zeroed: set = set()
    real = fuse.LinearGroup.lora  # the prefill (no workspace) keeps the real delta

    def zeros(t: torch.Tensor) -> torch.Tensor:  # zero-filled once, in the eager warm-up before capture
        if t.data_ptr() not in zeroed:
            t.zero_()
            zeroed.add(t.data_ptr())
        return t

    def lora(self, x, workspace=None):
        if workspace is None:
            return real(self, x)
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if part == "null":
            _noop_kernel()[(1,)](workspace[3])
        elif part == "shrink":
            lora_ops.lora_shrink_triton(x2, self._a, workspace)
        else:
            lora_ops.lora_expand_triton(zeros(workspace[1])[:m], self._b, self.bounds, self.rank, m, workspace)
            return workspace[3][:m]
        return zeros(workspace[3])[:m]

    return lora


@contextlib.contextmanager
def _decode_step_wrapped(engine: RolloutEngine, wrap):
    """engine._decode_logits replaced by wrap(the current one) inside; afterwards whatever was there before
    (the class method, or an outer variant's wrapper) is back."""
    real = engine._decode_logits
    own = "_decode_logits" in vars(engine)
    engine._decode_logits = wrap(real)
    try:
        yield
    finally:
        if own:
            engine._decode_logits = real
        else:
            del engine._decode_logits


HOLD_WORDS = 432 * 128  # int32 words of shared memory per hold program: 216 KiB of the H100 / H200's 227
HOLD_BLOCK = 128 * 16  # int32 words one hold program loads per unrolled read: 16 per thread (two 16-byte loads)
HOLD_UNROLL = 8  # reads in flight per program: 64 KiB
HELD: dict = {}  # the active hold's buffers (hold:N:US[:MIB]), for main() to read its stream times


@functools.lru_cache(maxsize=None)
def _hold_kernel():
    """A Gluon kernel whose every program takes HOLD_WORDS of shared memory, so that at most one fits an SM
    and the 4-bit GEMVs' programs (whose stages need more than the SM has left) cannot share it. With STREAM
    each program first reads its `words` int32 words of `src` from DRAM (HOLD_UNROLL reads of HOLD_BLOCK words
    in flight) and stores how many nanoseconds that took in out[2 * program + 1] (their sum in out[2 * program]); then it spins on
    %globaltimer until `ns` nanoseconds from its start. Timing only (flag hold:N:US[:MIB])."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from qerl.kernels.w4a16_gluon import _sreg

    @gluon.jit
    def _hold(out_ptr, src_ptr, ns, words, ROWS: gl.constexpr, STREAM: gl.constexpr, BLOCK: gl.constexpr,
              UNROLL: gl.constexpr):
        line: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        wide: gl.constexpr = gl.BlockedLayout([BLOCK // 128], [32], [4], [0])
        buf = gl.allocate_shared_memory(gl.int32, [ROWS, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in range(ROWS):
            buf.index(i).store(gl.full([128], 1, gl.int32, line))
        p = gl.program_id(0)
        t0 = _sreg("globaltimer")
        if STREAM:
            acc = gl.zeros([BLOCK], gl.int32, wide)
            offs = gl.arange(0, BLOCK, layout=wide)
            base = src_ptr + p.to(gl.int64) * words
            for i in range(0, words, BLOCK * UNROLL):
                for u in gl.static_range(UNROLL):
                    acc += gl.load(base + i + u * BLOCK + offs)
            gl.store(out_ptr + 2 * p + 1, (_sreg("globaltimer") - t0).to(gl.int32))
            gl.store(out_ptr + 2 * p, gl.sum(acc, axis=0))  # so the loads stay
        t = t0
        while t - t0 < ns:
            t = _sreg("globaltimer")
        total = gl.sum(buf.index(ROWS - 1).load(line), axis=0)  # read back, so the allocation stays
        gl.atomic_add(out_ptr + 2 * p, total)

    return _hold


def _hold_flags(flags: list, name: str) -> tuple:
    """Take the flags hold:N:US[:MIB] (N hold programs for US microseconds from each decode step's start,
    first reading MIB MiB between them) and sms:M (the kernels plan their grids for M SMs,
    w4a16_triton._num_sms) out of `flags`: (N, US, MIB, M), 0 for those not given."""
    held = us = mib = sms = 0
    for f in [f for f in flags if f.startswith(("hold:", "sms:"))]:
        flags.remove(f)
        m = re.fullmatch(r"hold:(\d+):(\d+)(?::(\d+))?|sms:(\d+)", f)
        if m is None or (m[1] is not None and not (int(m[1]) and int(m[2]))) or (m[4] is not None and not int(m[4])):
            raise SystemExit(f"bad flag {f!r} in {name!r}: hold:N:US[:MIB] (N programs, US microseconds, both > 0; "
                             "MIB MiB read between them first) or sms:M (M > 0)")
        if m[1] is not None:
            held, us, mib = int(m[1]), int(m[2]), int(m[3] or 0)
        else:
            sms = int(m[4])
    return held, us, mib, sms


@contextlib.contextmanager
def _held_sms(engine: RolloutEngine, programs: int, us: int, mib: int = 0):
    """Flag hold:N:US[:MIB]: each decode step forks a stream of its own at its start, which runs N programs of
    _hold_kernel (one per SM, by their shared memory) for US microseconds, the first part of it reading MIB MiB
    from DRAM; the main stream joins it at the step's end. With US below the step's time the join waits for
    nothing, so the step's time is that of the rollout's kernels on the SMs left (with sms:M, planned for
    them), beside a reader of that many bytes. What an adapter kernel that kept N SMs for the whole step would
    cost the base kernels, and what bandwidth it would get (NOTES_rollout.md section 50). Timing only; nothing
    is held without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    chunk = HOLD_BLOCK * HOLD_UNROLL
    words = -(-(mib << 18) // (programs * chunk)) * chunk  # per program, whole unrolled reads
    stream = torch.cuda.Stream(engine.device)
    out = torch.zeros(2 * programs, dtype=torch.int32, device=engine.device)
    src = torch.randint(-8, 8, (max(words, 1) * programs,), dtype=torch.int32, device=engine.device)

    def holding(real):
        def decode_logits(rows, keys):
            main = torch.cuda.current_stream(engine.device)
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                _hold_kernel()[(programs,)](out, src, us * 1000, words, HOLD_WORDS // 128, bool(mib), HOLD_BLOCK,
                                            HOLD_UNROLL, num_warps=4)
            logits = real(rows, keys)
            main.wait_stream(stream)
            return logits
        return decode_logits

    HELD.update(out=out, bytes=4 * words * programs if mib else 0)
    try:
        with _decode_step_wrapped(engine, holding):
            yield
    finally:
        HELD.clear()


def held_read() -> dict:
    """The active hold's last read (hold:N:US:MIB): per program nanoseconds, as bytes and GB/s; {} without one."""
    if not HELD.get("bytes"):
        return {}
    ns = HELD["out"].view(-1, 2)[:, 1].tolist()
    us = statistics.median(ns) / 1e3
    return {"hold_read_mib": round(HELD["bytes"] / 2**20, 1), "hold_read_us_median": round(us, 1),
            "hold_read_us_max": round(max(ns) / 1e3, 1), "hold_read_gbps": round(HELD["bytes"] / (max(ns) or 1), 1)}


@contextlib.contextmanager
def _dropped_lora(engine: RolloutEngine):
    """The `ldrop` variant: LinearGroup.has_lora reads False (so NORM_FOLD, GLU and the plain product take every
    group, as in the no-LoRA step), while each decode-step product of a group with adapters first forks that
    group's real shrink and expand onto the engine's side stream, into a workspace of its own, under the LoRA
    groups' GEMV plan. Nothing reads their delta; the main stream joins the side stream once, at the end of
    the step. Timing only: the decode steps' products lack the delta (the prefill keeps it). Off the GPU (no
    side stream) only has_lora moves."""
    from qerl.rollout import fuse

    cls = fuse.LinearGroup
    products = ("base_forward", "res_forward", "scale_forward", "glu_forward")
    saved = {name: cls.__dict__[name] for name in ("has_lora", *products)}
    has_lora = saved["has_lora"].fget  # the group's own answer, before the variant hides it
    state = {"decoding": False, "forked": False, "pending": None}

    def forking(fn):
        def product(self, x, *args, **kwargs):
            side = engine._side
            if not (state["decoding"] and side is not None and has_lora(self)):
                return fn(self, x, *args, **kwargs)
            if state["pending"] is not self:  # not forked already by a GLU launch that did not apply
                main = torch.cuda.current_stream(engine.device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    self.lora(x, engine._lora_workspace(self, f"ldrop{id(self)}"))
                state["forked"] = True
            with engine._lora_gemv_plan():
                out = fn(self, x, *args, **kwargs)
            state["pending"] = self if out is None else None  # glu_forward: the plain product follows
            return out
        return product

    def joining(real_logits):
        def decode_logits(rows, keys):
            state["decoding"], state["forked"], state["pending"] = True, False, None
            try:
                logits = real_logits(rows, keys)
            finally:
                state["decoding"] = False
            if state["forked"]:
                torch.cuda.current_stream(engine.device).wait_stream(engine._side)
            return logits
        return decode_logits

    cls.has_lora = property(lambda self: False)
    for name in products:
        setattr(cls, name, forking(saved[name]))
    try:
        with _decode_step_wrapped(engine, joining):
            yield
    finally:
        for name, value in saved.items():
            setattr(cls, name, value)


def _lres_flags(flags: list, name: str) -> list:
    """Take the flag lres:P:BK:BN:S:W[:p][:n][:sNS][:c][:x][:f][:e][:r][:wNS] out of `flags` (the resident LoRA kernel on, with
    P programs, BK / BN tiles, S pipelining stages, W warps, NS ns naps between polls, consumers that do not wait,
    no kernel, the fusions kept, their GEMVs expanding the deltas, the GEMVs planned around the kernel's programs,
    naps in the fused epilogues' waits:
    qerl/kernels/lora_resident.py): its switches,
    [] without it."""
    from qerl.kernels import lora_resident, w4a16_gluon

    out = []
    for f in [f for f in flags if f.startswith("lres:")]:
        flags.remove(f)
        m = re.fullmatch(r"lres:(\d+):(\d+):(\d+):(\d+):(\d+)(:p)?(:n)?(?::s(\d+))?(:c)?(:x)?(:f)?(:e)?(:r)?(?::w(\d+))?", f)
        pow2 = m is not None and all(int(v) and not int(v) & (int(v) - 1) for v in m.groups()[1:3] + m.groups()[4:5])
        if not pow2 or not (16 <= int(m[2]) and 16 <= int(m[3]) and int(m[1]) and int(m[4])):
            raise SystemExit(f"bad flag {f!r} in {name!r}: lres:P:BK:BN:S:W[:p][:n][:sNS][:c][:x][:f][:e][:r][:wNS] (P programs, BK "
                             "and BN powers of two >= 16, S stages >= 1, W warps a power of two, p: prefetch into L2, "
                             "n: waits only, sNS: NS ns naps between polls, c: consumers never wait, x: no kernel, "
                             "f: NORM_FOLD and GLU kept, e: (with f) their GEMVs expand the deltas, r: the GEMVs plan "
                             "around the kernel's programs, wNS: NS ns naps in their waits)")
        out = [(engine_mod, "LORA_RESIDENT", True), (engine_mod, "LORA_RESIDENT_PROGRAMS", int(m[1])),
               (lora_resident, "BK", int(m[2])), (lora_resident, "BN", int(m[3])), (lora_resident, "STAGES", int(m[4])),
               (lora_resident, "WARPS", int(m[5])), (lora_resident, "PREFETCH", m[6] is not None),
               (lora_resident, "WORK", m[7] is None), (lora_resident, "SLEEP", int(m[8] or 0)),
               (engine_mod, "LORA_RESIDENT_WAIT", m[9] is None and m[10] is None),
               (engine_mod, "LORA_RESIDENT_KERNEL", m[10] is None), (engine_mod, "LORA_RESIDENT_FUSED", m[11] is not None),
               (engine_mod, "LORA_RESIDENT_EXPAND", m[12] is not None),
               (engine_mod, "LORA_RESIDENT_RESERVE", m[13] is not None), (w4a16_gluon, "SYNC_NAP", int(m[14] or 0))]
        if m[12] and not m[11]:
            raise SystemExit(f"bad flag {f!r} in {name!r}: e (the GEMVs expand) needs f (the fused chain)")
    return out


@contextlib.contextmanager
def variant_of(engine: RolloutEngine, name: str):
    """Set the engine and kernel switches for variant `name`; restore them afterwards."""
    base, _, flags = name.partition("@")
    flags = list(filter(None, flags.split("@")))
    table = _switches()
    gluon_cfg = {}  # group kind -> the Gluon GEMV config while that kind's linear runs
    per_sm_kind = {}  # lsmk:KIND+KIND=N: engine.LORA_GEMV_PER_SM_KIND for those LoRA groups
    for f in [f for f in flags if f.startswith("lsmk:")]:
        flags.remove(f)
        kinds_, _, n = f[5:].partition("=")
        try:  # the engine's own parser of QERL_LORA_GEMV_PER_SM_KIND checks kinds and count
            per_sm_kind.update(engine_mod._kind_values(",".join(f"{kind}={n}" for kind in kinds_.split("+"))))
        except ValueError:
            raise SystemExit(f"bad flag {f!r} in {name!r}: lsmk:KIND+KIND=N, KIND in {', '.join(KINDS)}") from None
    rwg9_kinds = ()  # r9:KIND+KIND: rwg from 9 rows (w4a16_triton.RWG_MIN_M = 9) only for those kinds' products
    for f in [f for f in flags if f.startswith("r9:")]:
        flags.remove(f)
        rwg9_kinds = tuple(f[3:].split("+"))
        if set(rwg9_kinds) - set(KINDS):
            raise SystemExit(f"bad flag {f!r} in {name!r}: r9:KIND+KIND, KIND in {', '.join(KINDS)}")
    held, held_us, held_mib, sms = _hold_flags(flags, name)
    resident = _lres_flags(flags, name)
    for f in [f for f in flags if f.startswith("g:")]:
        flags.remove(f)
        kinds_, _, spec = f[2:].partition(":")
        m = re.fullmatch(r"p(\d+)s(\d+)(?:w(\d+))?(?:k(\d+))?(x?)(q?)(t?)([zy]?)", spec)
        targets = KINDS if kinds_ == "all" else tuple(kinds_.split("+"))
        if m is None or set(targets) - set(KINDS):
            raise SystemExit(f"bad Gluon flag {f!r} in {name!r}: g:KIND+KIND:pPsS[wW][kK][x][q][t][z|y], KIND in {', '.join(KINDS)} or all")
        for kind in targets:
            gluon_cfg[kind] = {"PER_SM": int(m[1]), "NUM_STAGES": int(m[2]), "num_warps": int(m[3] or 4),
                               **({"S": int(m[4])} if m[4] else {}), **({"XPF": True} if m[5] else {}),
                               **({"STREAMK": True} if m[6] else {}), **({"TAIL_SPLIT": True} if m[7] else {}),
                               **({"XS": m[8] == "z"} if m[8] else {})}
    for f in [f for f in flags if f.startswith("cl:")]:  # cl:KIND+KIND: the cluster fixup forced for those kinds
        flags.remove(f)
        targets = tuple(f[3:].split("+"))
        if set(targets) - set(KINDS):
            raise SystemExit(f"bad flag {f!r} in {name!r}: cl:KIND+KIND, KIND in {', '.join(KINDS)}")
        for kind in targets:
            gluon_cfg[kind] = {**gluon_cfg.get(kind, {}), "CLUSTER": True}
    unknown = set(flags) - set(table)
    if unknown:
        raise SystemExit(f"unknown variant flag(s) {sorted(unknown)} in {name!r}; valid: {', '.join(table)}")
    late_kinds = None
    if base.startswith("late:"):  # late:K1+K2 = base, the CUDA-core GEMV's late PDL trigger only for those kinds
        late_kinds = tuple(base[5:].split("+"))
        base = "base"
    if base == "base":
        kinds: tuple = ()
    elif base in ("lora", "serial"):
        kinds = KINDS
    elif base == "ldrop":
        kinds = ()
    elif base.startswith("only:"):
        kinds = tuple(base[5:].split("+"))
        if set(kinds) - set(KINDS):
            raise SystemExit(f"unknown group kind in {name!r}; valid: {', '.join(KINDS)}")
    else:
        raise SystemExit(f"unknown variant {name!r}")
    switches = [sw for f in flags for sw in table[f]] + resident
    if per_sm_kind:
        switches.append((engine_mod, "LORA_GEMV_PER_SM_KIND", per_sm_kind))
    from qerl.kernels import w4a16_gemv, w4a16_gluon, w4a16_triton

    if sms:
        switches.append((w4a16_triton, "_num_sms", lambda device_index: sms))
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in switches]
    saved_side = engine._side
    original = engine._linear

    def linear(group, x, kind, scale=None, source=None):
        before, gluon_before, rwg_before = w4a16_gemv.PDL_LATE, w4a16_gluon.DEFAULT, w4a16_triton.RWG_MIN_M
        if kind in rwg9_kinds:
            w4a16_triton.RWG_MIN_M = 9
        if late_kinds is not None:
            w4a16_gemv.PDL_LATE = kind in late_kinds
        if kind in gluon_cfg:
            w4a16_gluon.DEFAULT = {**gluon_before, **gluon_cfg[kind]}
        try:
            if scale is not None:  # NORM_FOLD's consumer (a LoRA group only under the resident kernel)
                return original(group, x, kind, scale, source)
            return original(group, x, kind, source=source) if kind in kinds else (group.base_forward(x), None)
        finally:
            w4a16_gemv.PDL_LATE, w4a16_gluon.DEFAULT, w4a16_triton.RWG_MIN_M = before, gluon_before, rwg_before

    def reset():
        engine._graphs.clear()
        engine._pool = None  # a pool whose graphs are all gone cannot be captured into again
        engine._lora_buffers.clear()  # sized by lora_ops.MAX_SPLITS

    engine._linear = linear
    if base == "serial":
        engine._side = None
    dropped = _dropped_lora(engine) if base == "ldrop" else contextlib.nullcontext()
    hold = _held_sms(engine, held, held_us, held_mib) if held else contextlib.nullcontext()
    # `base` on a model with adapters: the adapters off (PEFT's disable_adapter), so that NORM_FOLD and GLU,
    # which skip a group with LoRA, take every group as in the no-LoRA step (with them merely unused,
    # `base` ran ~3% slower than that step at 7B batch 8: NOTES_rollout.md section 26)
    model = getattr(engine, "model", None)
    adapters_off = model.disable_adapter() if base == "base" and hasattr(model, "disable_adapter") else (
        contextlib.nullcontext())
    for mod, attr, value in switches:
        setattr(mod, attr, value)
    reset()
    try:
        with adapters_off, dropped, hold:
            yield
    finally:
        reset()
        for mod, attr, value in saved:
            setattr(mod, attr, value)
        engine._side = saved_side
        del engine._linear  # back to the class method


def timeline(graph, rows: int, engine: RolloutEngine, keys: int = 512) -> dict:
    """One profiled replay: per-stream kernel sums and what each kernel adds to the critical path."""
    from torch.profiler import ProfilerActivity, profile

    events = []
    for _ in range(2):  # the first window warms CUPTI up; keep the second
        rewind(engine, rows, keys)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        os.unlink(path)
        events = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not events:
        return {"error": "no kernel events in the trace (graph kernels not reported by this CUPTI)"}

    def stream(e):
        return e.get("args", {}).get("stream", e.get("tid"))

    by_stream: dict = defaultdict(list)
    for e in events:
        by_stream[stream(e)].append(e)
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    t0 = min(e["ts"] for e in events)
    out = {"span_us": round(max(e["ts"] + e["dur"] for e in events) - t0, 1), "streams": {},
           "kernels": [[e["name"][:48], "main" if stream(e) == main else "side",
                        round(e["ts"] - t0, 1), round(e["dur"], 1)] for e in sorted(events, key=lambda e: e["ts"])]}
    for s, evs in by_stream.items():
        evs.sort(key=lambda e: e["ts"])
        sums: dict = defaultdict(lambda: [0, 0.0])
        for e in evs:
            sums[e["name"][:60]][0] += 1
            sums[e["name"][:60]][1] += e["dur"]
        entry = {"kernels": len(evs), "busy_us": round(sum(e["dur"] for e in evs), 1),
                 "by_kernel_us": {k: [v[0], round(v[1], 1)] for k, v in sorted(sums.items(), key=lambda kv: -kv[1][1])}}
        if s == main:
            # what each kernel adds to the critical path: its end minus the latest end before it
            # (with PDL a kernel starts early and waits, so its duration overstates its cost)
            adds: dict = defaultdict(lambda: [0, 0.0])
            mine = {id(e) for e in evs}
            latest = t0
            for e in sorted(events, key=lambda e: e["ts"] + e["dur"]):
                end = e["ts"] + e["dur"]
                key = e["name"][:60] if id(e) in mine else "side: " + e["name"][:54]
                adds[key][0] += 1
                adds[key][1] += max(0.0, end - latest)
                latest = max(latest, end)
            entry["adds_us"] = {k: [v[0], round(v[1], 1)] for k, v in sorted(adds.items(), key=lambda kv: -kv[1][1])}
        out["streams"]["main" if s == main else f"side{s}"] = entry
    return out


def stamp_summary(graph, sm_mhz: float) -> dict:
    """Replay `graph` once with the 4-bit kernels' per-program clocks on (w4a16_triton.STAMP, set
    before the graph was captured: the Gluon GEMV and the fused Triton kernel) and summarise each
    kernel and layer shape over the layers: when the programs started and got past the PDL wait,
    how long the main loop and the epilogue (split fixup, stores) took, when the Gluon producer had
    issued its last copy, and how long the kernel ran on after the last program got past its wait.
    us; globaltimer for cross-SM times, clock64 at `sm_mhz` within a program."""
    import numpy as np

    from qerl.kernels import w4a16_triton

    st = w4a16_triton.STAMP
    st["buf"].fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    arr = st["buf"].cpu().numpy()
    per_shape: dict = defaultdict(list)
    cyc = 1.0 / sm_mhz  # us per clock
    for off, grid, n, k, S, m, kernel in st["calls"]:
        a = arr[off:off + grid * 8].reshape(grid, 8).astype(np.float64)
        if (a[:, 0] < 0).any():
            continue  # not a launch of this graph
        g0 = a[:, 5].min()
        wait_g = (a[:, 5] - g0) / 1e3 + (a[:, 1] - a[:, 0]) * cyc  # us from the first program's start
        end_g = (a[:, 6] - g0) / 1e3
        start_g = (a[:, 5] - g0) / 1e3
        producer = (a[:, 7] - a[:, 1]) * cyc if kernel == "gluon" else np.zeros(1)  # (-1 elsewhere)
        per_shape[f"{kernel} {n}x{k} M{m} S{S} grid{grid}"].append({
            "start_last": start_g.max(), "wait_first": wait_g.min(), "wait_median": float(np.median(wait_g)),
            "wait_last": wait_g.max(), "end": end_g.max(),
            "after_last_wait": end_g.max() - wait_g.max(), "after_first_wait": end_g.max() - wait_g.min(),
            "loop_median": float(np.median((a[:, 2] - a[:, 1]) * cyc)), "loop_max": ((a[:, 2] - a[:, 1]) * cyc).max(),
            "epilogue_median": float(np.median((a[:, 3] - a[:, 2]) * cyc)),
            "epilogue_max": ((a[:, 3] - a[:, 2]) * cyc).max(),
            "producer_done_vs_wait_median": float(np.median(producer)), "producer_done_vs_wait_max": producer.max(),
            "programs_per_sm_max": int(np.bincount(a[:, 4].astype(np.int64)).max()),
            "sms": int(len(np.unique(a[:, 4]))),
        })
    out = {}
    for shape, rows in per_shape.items():
        out[shape] = {"layers": len(rows), **{key: round(float(np.median([r[key] for r in rows])), 2) for key in rows[0]}}
    return out


def resident_stamp_summary(engine: RolloutEngine, graph) -> dict | None:
    """After stamp_summary's replay of `graph` with lora_resident.STAMP on at its capture: per group kind, the
    median over the layers (us) of how long the resident kernel waited for the group's input after the
    previous group's delta was out (wait), summed its K slices (shrink), met at the grid-wide count (meet),
    wrote the delta (expand), input to delta (in_to_out), and against the group's own Gluon GEMV (the
    k-th stamped Gluon launch of the replay is group k): the GEMV's span (gemv), when the delta was out
    after the GEMV's first program started (out_after_gemv_start) and how long the GEMV ran on after it
    (gemv_end_after_out: near 0 where the GEMV's epilogue waited for the delta). None: no resident kernel."""
    import numpy as np

    from qerl.kernels import lora_resident, w4a16_triton
    from qerl.rollout import engine as engine_mod

    res = next((v[-1] for v in engine._graphs.values() if isinstance(v, tuple) and v and v[0] is graph
                and isinstance(v[-1], engine_mod._Resident)), None)
    if res is None or res.stamps is None:
        return None
    times = lora_resident.stamp_times(res.stamps, res.groups, res.programs)
    st = w4a16_triton.STAMP
    arr = st["buf"].cpu().numpy() if st else None
    spans = []  # (first start, last end) of each Gluon launch this replay ran, in launch order
    for off, grid, _n, _k, _s, _m, kernel in (st["calls"] if st else []):
        a = arr[off:off + grid * 8].reshape(grid, 8)
        if kernel == "gluon" and not (a[:, 0] < 0).any():
            spans.append((int(a[:, 5].min()), int(a[:, 6].max())))
    paired = len(spans) == len(times)
    per_kind: dict = defaultdict(list)
    for g, t in enumerate(times):
        row = {"shrink": t["sums"] - t["in_first"], "meet": t["met"] - t["sums"], "expand": t["out"] - t["met"],
               "in_to_out": t["out"] - t["in_first"]}
        if g:
            row["wait"] = t["in_first"] - times[g - 1]["out"]
        if paired:
            start, end = spans[g]
            row.update(gemv=end - start, out_after_gemv_start=t["out"] - start, gemv_end_after_out=end - t["out"])
        per_kind[engine_mod.LORA_GROUP_KINDS[g % len(engine_mod.LORA_GROUP_KINDS)]].append(row)
    out = {"programs": res.programs, "paired_with_gemvs": paired,
           "step_us": round((times[-1]["out"] - times[0]["in_first"]) / 1e3, 1)}
    for kind, rows in per_kind.items():
        keys = sorted({k for r in rows for k in r})
        out[kind] = {k: round(float(np.median([r[k] for r in rows if k in r])) / 1e3, 2) for k in keys}
    return out


def time_variant(engine: RolloutEngine, prompts: list, settings, with_timeline: bool, keys: int = 512) -> dict:
    """Capture the step graphs afresh (two generates) and time 64 replays of the `keys`-key graph."""
    rows = len(prompts) * settings.num_generations
    graph, ms = graph_step_ms(engine, prompts, settings, keys=keys)
    row = {"step_ms": round(ms, 4), "tokens_per_s": round(rows * 1e3 / ms, 1), "gpu_state": gpu_state()}
    if with_timeline:
        try:
            row["timeline"] = timeline(graph, rows, engine, keys)
        except Exception as exc:  # the timings above stand without it
            row["timeline"] = {"error": f"{type(exc).__name__}: {exc}"}
    return row


def time_generate(engine: RolloutEngine, prompts: list, settings, calls: int) -> dict:
    """Whole generate calls, as bench_rollout times them (prefill, every key bucket, the host's
    checks): one call to compile and capture, then `calls` timed; the median call's tok/s."""
    import time

    def one():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = engine.generate(prompts, settings, torch.Generator(device="cuda").manual_seed(3))
        torch.cuda.synchronize()
        return time.perf_counter() - t0, dict(engine.stats), int(batch.completion_mask.sum())

    one()
    runs = sorted((one() for _ in range(calls)), key=lambda r: r[0])
    sec, stats, tokens = runs[len(runs) // 2]
    return {"step_ms": round(stats["decode_s"] * 1e3 / max(1, stats["steps"] - 1), 4),
            "tokens_per_s": round(tokens / sec, 1), "call_s": round(sec, 4), "all_call_s": [round(r[0], 4) for r in runs],
            "prefill_ms": round(stats["prefill_s"] * 1e3, 2), "decode_s": round(stats["decode_s"], 4),
            "graphs": stats["graphs"], "gpu_state": gpu_state()}


def save(result: dict, out: str | None) -> None:
    """Write what was measured so far (after every row: a call cut short keeps it)."""
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def summarise(result: dict, rounds: int, out: str | None) -> None:
    """Medians per (batch, variant) over the rounds into result["medians"]; the table (with
    --generate: the calls' tok/s, x base from them, and the prefill)."""
    medians, clocks, tps, prefill = {}, {}, {}, {}
    for r in result["rows"]:
        key = (r["batch"], r["variant"])
        medians.setdefault(key, []).append(r["step_ms"])
        clocks.setdefault(key, []).append(r["gpu_state"].get("sm_mhz"))
        tps.setdefault(key, []).append(r["tokens_per_s"])
        if "prefill_ms" in r:
            prefill.setdefault(key, []).append(r["prefill_ms"])
    result["medians"] = [{"batch": b, "variant": v, "step_ms": statistics.median(ms), "all_ms": ms,
                          "tokens_per_s": statistics.median(tps[(b, v)]), "sm_mhz": clocks[(b, v)],
                          **({"prefill_ms": statistics.median(prefill[(b, v)])} if (b, v) in prefill else {})}
                         for (b, v), ms in medians.items()]
    save(result, out)
    whole = bool(prefill)
    print(f"\n{result['model']} {result['format']} LoRA r{result['lora_rank']}, {rounds} round(s): medians"
          + (" of whole generate calls (step ms: decode per step)" if whole else ""))
    print("| batch | variant | step ms | tok/s | x base | all ms | SM MHz after each |" + (" prefill ms |" if whole else ""))
    for m in result["medians"]:
        key = (m["batch"], "base")
        if whole:
            rel = f"{m['tokens_per_s'] / statistics.median(tps[key]):.3f}" if key in tps else "-"
            rate = m["tokens_per_s"]
        else:
            rel = f"{statistics.median(medians[key]) / m['step_ms']:.3f}" if key in medians else "-"
            rate = m["batch"] * 1e3 / m["step_ms"]
        print(f"| {m['batch']} | {m['variant']} | {m['step_ms']:.3f} | {rate:.1f} | {rel} | "
              f"{' '.join(f'{x:.3f}' for x in m['all_ms'])} | {' '.join(str(c) for c in m['sm_mhz'])} |"
              + (f" {m['prefill_ms']:.1f} |" if whole else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--batch", nargs="+", type=int, default=[8])
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank of the adapters (0: variant base only)")
    ap.add_argument("--variants", nargs="+", default=["base", "lora"])
    ap.add_argument("--timeline", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=1, help="time the variant list this many times over (medians)")
    ap.add_argument("--stamp", nargs="*", default=[],
                    help="variants to run once more with the 4-bit kernels' per-program clocks (stamp_summary) and, where the "
                         "variant runs it, the resident LoRA kernel's per group (resident_stamp_summary)")
    ap.add_argument("--keys", type=int, default=512,
                    help="the key bucket of the timed step graph (a multiple of 256; 512: slots 257..512)")
    ap.add_argument("--generate", type=int, default=0,
                    help="time N whole generate calls per variant (256-token prompts, 512 new tokens: bench_rollout's "
                         "tok/s, prefill and both key buckets) instead of one bucket's graph step; step_ms is then "
                         "the decode time per step")
    add_generations_arg(ap)
    ap.add_argument("--out", default=None)
    ap.add_argument("--intervals", nargs="+", metavar="FILE",
                    help="no GPU: print the layer intervals of the timelines in these result files and exit")
    a = ap.parse_args()
    if a.intervals:
        return print_intervals(a.intervals)
    if a.keys % 256 or a.keys < 512:
        raise SystemExit(f"--keys must be a multiple of 256 from 512, got {a.keys}")
    model = build(a.model, a.format)
    if a.lora:
        from qerl.nn.lora import LoraSettings, apply_lora

        model = apply_lora(model, LoraSettings(r=a.lora, lora_alpha=a.lora)).eval()
    # 256-token prompts: 512 new tokens reach the 768-key bucket, keys - 192 the `keys` one
    engine = RolloutEngine(model, max_batch=max(a.batch), max_len=max(768, a.keys + 64))
    settings = RolloutSettings(max_new_tokens=512 if a.keys == 512 else a.keys - 192, temperature=1.0,
                               stop_ids=[10**9], pad_id=0, num_generations=a.generations)
    from qerl.env import switches_prefix
    from qerl.kernels import layout

    # the command with this process's QERL_* switches (e.g. QERL_W4A16_ORDER, the layers' word order) reproduces it
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": switches_prefix() + " ".join(sys.argv),
              "word_order": layout.default_order(a.format, torch.device("cuda"), 256),  # a K % 256 == 0 layer's
              "model": a.model, "format": a.format, "lora_rank": a.lora, "keys": a.keys, "generations": a.generations,
              "rows": []}
    for batch in a.batch:
        prompts = random_prompts(batch, a.generations)
        for rnd, name in ((r, n) for r in range(a.rounds) for n in a.variants):
            with variant_of(engine, name), torch.inference_mode():
                timed = (time_generate(engine, prompts, settings, a.generate) if a.generate else
                         time_variant(engine, prompts, settings, rnd == 0 and name in a.timeline, a.keys))
                row = {"batch": batch, "variant": name, "round": rnd, **timed, **held_read()}
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "timeline"}), flush=True)  # with gpu_state
            save(result, a.out)
        for name in a.stamp:
            from qerl.kernels import lora_resident, w4a16_triton

            w4a16_triton.STAMP = {"buf": torch.empty(32 << 20, dtype=torch.int64, device="cuda"), "used": 0, "calls": []}
            lora_resident.STAMP = True  # (the resident kernel's clocks, where the variant runs it)
            try:
                with variant_of(engine, name), torch.inference_mode():
                    graph, ms = graph_step_ms(engine, prompts, settings, keys=a.keys)
                    state = gpu_state()
                    row = {"batch": batch, "variant": name, "stamped": True, "step_ms": round(ms, 4), "gpu_state": state,
                           "stamps": stamp_summary(graph, float(state.get("sm_mhz") or 1980))}
                    resident = resident_stamp_summary(engine, graph)
                    if resident is not None:
                        row["resident_stamps"] = resident
            finally:
                w4a16_triton.STAMP = None
                lora_resident.STAMP = False
            result.setdefault("stamp_rows", []).append(row)
            print(f"stamps, batch {batch}, {name} (step {ms:.3f} ms with stamps):")
            for shape, v in row["stamps"].items():
                print(f"  {shape}: {json.dumps(v)}")
            if "resident_stamps" in row:
                print(f"  resident LoRA kernel, per group kind (us, medians over the layers): {json.dumps(row['resident_stamps'])}")
            save(result, a.out)
    for r in result["rows"]:
        if "timeline" in r and "streams" in r["timeline"]:
            print("\n".join(timeline_lines(r["timeline"], f"timeline, batch {r['batch']}, {r['variant']}")))
    summarise(result, a.rounds, a.out)  # last, so a log's tail holds the table


def layer_intervals(kernels: list) -> dict:
    """The layer's step between the ends of consecutive Gluon GEMVs in a timeline's kernel list ([name,
    stream, start, dur] rows, as `timeline` keeps them), medians over the layers, us. Each interval is named by
    the GEMVs it runs between ("o->gate_up": from o's end to gate/up's end: the norm and gate/up's own run).
    Where a LoRA shrink / expand runs beside each GEMV, also its end minus that GEMV's end per group kind
    (> 0: the LoRA kernel ends later, so the consumer waits for it). {} when the Gluon GEMVs do not come four
    per layer (a bf16 step runs cuBLAS). The groups launch in KINDS order (engine.LORA_GROUP_KINDS)."""

    def ends(name):
        return [start + dur for k, _, start, dur in kernels if k.startswith(name)]

    gemv = ends("_gluon_gemv_kernel")
    n = len(KINDS)
    if len(gemv) < 2 * n or len(gemv) % n:
        return {}
    out = {"layers": len(gemv) // n,
           "layer_us": round(statistics.median(gemv[i + n] - gemv[i] for i in range(len(gemv) - n)), 1),
           "intervals_us": {}}
    for i, kind in enumerate(KINDS):
        nxt = KINDS[(i + 1) % n]
        gaps = [gemv[j + 1] - gemv[j] for j in range(i, len(gemv) - 1, n)]
        out["intervals_us"][f"{kind}->{nxt}"] = round(statistics.median(gaps), 1)
    for part in ("shrink", "expand"):
        lora = ends(f"lora_{part}_kernel")
        if len(lora) == len(gemv):
            out[f"{part}_end_after_gemv_us"] = {
                kind: round(statistics.median(lora[j] - gemv[j] for j in range(i, len(gemv), n)), 1)
                for i, kind in enumerate(KINDS)}
    return out


def interval_lines(tl: dict) -> list[str]:
    """`layer_intervals` of one timeline as two or three lines (none when it finds no layers)."""
    iv = layer_intervals(tl.get("kernels", []))
    if not iv:
        return []
    lines = [f"    layer {iv['layer_us']} us over {iv['layers']} layers; between GEMV ends: "
             + ", ".join(f"{k} {v}" for k, v in iv["intervals_us"].items())]
    for part in ("shrink", "expand"):
        if f"{part}_end_after_gemv_us" in iv:
            lines.append(f"    LoRA {part} ends after its GEMV by: "
                         + ", ".join(f"{k} {v}" for k, v in iv[f"{part}_end_after_gemv_us"].items()))
    return lines


def print_intervals(paths: list[str]) -> None:
    """`--intervals FILE...`: the timelines' layer intervals of result files written before (no GPU)."""
    for path in paths:
        try:
            with open(path) as f:
                rows = json.load(f)["rows"]
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"--intervals: cannot read the rows of {path}: {exc}") from None
        timelines = [r for r in rows if "kernels" in r.get("timeline", {})]
        if not timelines:
            print(f"{path}: no timelines")
        for r in timelines:
            print(f"{path}: batch {r['batch']}, {r['variant']}, span {r['timeline']['span_us']} us")
            print("\n".join(interval_lines(r["timeline"]) or ["    no four Gluon GEMVs per layer"]))


def timeline_lines(tl: dict, title: str, top: int = 8) -> list[str]:
    """A few lines per timeline: its span, busy time per kernel summed over every stream, and what each kernel
    adds to the critical path. A replayed graph runs its branches on streams of its own (one per LoRA fork),
    so the streams are summed here, not listed; the JSON keeps them."""
    busy: dict = defaultdict(lambda: [0, 0.0])
    adds: dict = defaultdict(lambda: [0, 0.0])
    for e in tl["streams"].values():
        for name, (n, us) in e["by_kernel_us"].items():
            busy[name][0] += n
            busy[name][1] += us
        for name, (n, us) in e.get("adds_us", {}).items():
            key = name.removeprefix("side: ")
            adds[key][0] += n
            adds[key][1] += us

    def fmt(d: dict) -> str:
        rows = sorted(d.items(), key=lambda kv: -kv[1][1])[:top]
        return ", ".join(f"{name[:32]} {n}x {us:.0f}" for name, (n, us) in rows)

    kernels = sum(e["kernels"] for e in tl["streams"].values())
    return [f"  {title}: span {tl['span_us']} us, {kernels} kernels on {len(tl['streams'])} streams",
            f"    busy us: {fmt(busy)}", f"    critical-path adds us: {fmt(adds)}", *interval_lines(tl)]


if __name__ == "__main__":
    main()
