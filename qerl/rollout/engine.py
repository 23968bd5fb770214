"""The rollout engine: batched prefill + decode over a Llama / Qwen2-family model's own modules.

    engine = RolloutEngine(model, max_batch=64, max_len=2304)
    batch = engine.generate(prompt_ids, RolloutSettings(...), generator)   # -> qerl.rl.rollout.RolloutBatch
    # or, as the trainer's rollout_fn:  engine_rollouts(model, prompt_ids, settings, generator)

What it runs. The decoder is re-expressed here (embedding, RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP, lm_head) but every weight is the model's own: the linears are called as
modules (QuantLinear's fused 4-bit kernels for nvfp4 / mxfp4, the NF4 dequantise-then-matmul
path for nf4, cuBLAS for bf16), LoRA adapters stay unmerged (PEFT's parameters, read on every
call, so an optimiser step is seen with no copy), and q/k/v and gate/up run as one product each
(`fuse.LinearGroup`, which makes the modules' weights views of the fused ones: the trainer and
the engine share one copy). Supported: model_type llama, qwen2, qwen3, mistral (no sliding
window), i.e. Hugging Face's `model.model.layers[i].self_attn / mlp / *_layernorm` layout.

How a call runs.
- Prefill: each distinct prompt once (left padded, causal + padding mask), its K/V written to
  the preallocated cache rows of its `num_generations` samples (the decode attention then reads
  a prompt's slots from its first sample's row for all of them: SHARE_PROMPT_KEYS). On a GPU the
  prompt width is padded to a multiple of PROMPT_BUCKET and a small prefill (<=
  PREFILL_GRAPH_TOKENS tokens) is captured in a CUDA graph per (prompts, width, rows) after its
  first, eager run, and replayed.
- Decode: one token per row per step, the whole step on the device: forward, sampling
  (qerl.rollout.sampling, from uniforms drawn for the whole rollout up front), the writes of the
  token / logprob / entropy, the finished flags and the advance of position and cache slot. On a
  GPU the step is captured in a CUDA graph once per (rows, key-length bucket, sampling settings)
  and replayed; attention reads only the first `bucket` cache slots (LENGTH_BUCKET, 128). The host
  only replays, and checks the finished flags once every `check_every` steps, not per token:
  when all rows are done it stops, and when at most half of them are still going, those rows
  move to the front (cache and state, `compact_below`) and decoding goes on with fewer rows.
- Besides its four linear products a layer is at most 5 kernels (qerl.kernels.decode_ops): residual
  add + RMSNorm twice (split over the GEMVs' epilogues where NORM_FOLD applies), the split-K decode
  attention with RoPE and the KV-cache write inside, its combine, and the SiLU gate (in the gate/up
  GEMV's epilogue where GLU applies). The step's embedding lookup and its advance ride in the first
  norm and one small kernel (STEP_FUSE). LoRA is two small kernels per linear group
  (qerl.kernels.lora_ops) on a side stream, added by the next kernel; the group's Gluon GEMV is then
  planned to leave each SM room for them (`lora_gemv_per_sm`).
- A row finishes at a stop token (kept) or at max_new_tokens.
- AQN: the norm weights are read into the engine's buffers at the start of every call, so noise
  swapped in by `AdaptiveQuantNoise.applied()` (or trained norms) is what the rollout samples
  with, and the graphs stay valid.
- Returns token ids, per-token logprobs of softmax(logits / T) and its entropies (RolloutBatch).

On a CPU it runs the same code eagerly (no graphs): slow but exact, which is what the tests use.
Greedy output equals Hugging Face `generate` token for token; logprobs equal a fresh forward
(`qerl.rl.rollout.policy_logprobs`). Try it:  pytest tests/test_rollout_engine.py -q
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qerl.env import env_int
from qerl.nn.quant_linear import _outside_inference_mode
from qerl.kernels import bf16_gemv
from qerl.kernels.lora_ops import shrink_splits
from qerl.kernels.decode_ops import (Ready, Signal, add_rms_norm, advance, advance_reference, decode_attention_rope,
                                    embed_rms_norm, pdl_on, rotary, rotary_rows, silu_mul)
from qerl.rl.rollout import RolloutBatch, RolloutSettings, pad_prompts
from qerl.rollout.fuse import LinearGroup
from qerl.kernels.sample_ops import SampleState, sample_step
from qerl.rollout.sampling import draw_uniform

__all__ = ["EngineError", "RolloutEngine", "engine_rollouts", "release_rollout_memory", "supports"]

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# Decode steps attend the first `bucket` cache slots, the slot count rounded up to a multiple of
# LENGTH_BUCKET (one CUDA graph per rows x bucket): finer buckets read fewer masked keys but
# capture more graphs (each first met with one eager step, then a capture). Whole 7B generate
# calls, 256-token prompts + 512 new tokens, same process (H100, NOTES_rollout.md section 25):
# 128 against 256 gave batch 1 / 8 / 64 x1.001 / x1.008 / x1.014, 64 gave x1.001 / x1.009 / x1.018
# with twice 128's graphs. QERL_ROLLOUT_LENGTH_BUCKET (a multiple of 64) overrides it.
LENGTH_BUCKET = env_int("QERL_ROLLOUT_LENGTH_BUCKET", 128)
if LENGTH_BUCKET < 64 or LENGTH_BUCKET % 64:
    raise ValueError(f"QERL_ROLLOUT_LENGTH_BUCKET must be a positive multiple of 64, got {LENGTH_BUCKET}")
# On a GPU, prompt widths are left-padded to a multiple of PROMPT_BUCKET, and a prefill of at most
# PREFILL_GRAPH_TOKENS prompt tokens (distinct prompts x width) runs as a CUDA graph from its
# second use on: such a prefill is host-bound (32B at batch 1: ~100-175 ms of launches for
# ~35 ms of GPU work), a larger one is not and would hold more graph memory.
PROMPT_BUCKET = 64
PREFILL_GRAPH_TOKENS = 2048
# SiLU MLPs whose gate/up group has no LoRA delta and runs on the Gluon GEMV (nvfp4 or routed mxfp4, 2..8 rows):
# one launch gives silu(gate) * up (w4a16_gluon GLU: the epilogue pairs each gate row with its up
# row), instead of the gate/up product and the silu_mul kernel after it. False: the two launches.
GLU = os.environ.get("QERL_ROLLOUT_GLU", "1") == "1"
# The Gluon GEMV of a linear group with LoRA is planned for this many programs per SM (its K split
# fills that many x SMs slots) instead of 4: four of its programs (8 warps x 64 registers each)
# fill an SM's register file, so the side stream's LoRA programs could only start as the GEMV's
# drained. 0: plan as without LoRA. Same-process A/B at batch 8 (NOTES_rollout.md section 12):
# 7B r16 0.910 -> 0.927 of the no-LoRA step, r64 0.841 -> 0.886 (and 0.838 -> 0.886 in a second
# call), 14B r32 0.912 -> 0.928. Retuned on the session-28 tree (NORM_FOLD and GLU, which LoRA groups
# skip), same process, 2 rounds (NOTES_rollout.md section 26, a106-a109): 7B batch 8, 2 against 3,
# r16 / r32 / r64 x1.023 / x1.025 / x1.041 per step (1: x0.964 at r32); 14B r32 x0.996. On the H200
# (sessions 56-57, a152-a159, 2 against 3): 14B r16 / r32 / r64 x1.013 / x1.022-1.025 / x1.027 per
# step (tok/s of whole generate calls at r32 x1.012), 32B r32 x0.95; 7B keeps 2 (3: x0.97). So the line runs
# between 14B and 32B, not 7B and 14B: 14B at 2 is within noise on the H100 and ahead on the H200.
# None (the default) = `lora_gemv_per_sm`: 2 for models whose hidden x intermediate size is below
# 96M (7B 68M, 14B 71M), else 3 (32B 142M, 72B 242M); 0: plan as without LoRA.
# QERL_LORA_GEMV_PER_SM sets one value for every model.
LORA_GEMV_PER_SM = env_int("QERL_LORA_GEMV_PER_SM", None)
# ... and per group kind, over both (QERL_LORA_GEMV_PER_SM_KIND="qkv=2,o=2"; ablation flag `lsmk:KIND+KIND=N`).
# Measured at batch 8, r32, same process (NOTES_rollout.md section 27, a110-a112): the 7B gain is gate/up's
# and down's (3 there again: x0.970; on q/k/v and o: x0.993); 14B gate/up and down at 2 x1.005; 32B x0.965
# (2 everywhere x0.958). Within the spread of a rule, so no per-kind default.
LORA_GROUP_KINDS = ("qkv", "o", "gate_up", "down")


def _kind_values(text: str) -> dict[str, int]:
    """"qkv=2,o=2" -> {"qkv": 2, "o": 2}; ValueError (one line) on an unknown kind or a bad count."""
    out = {}
    for item in filter(str.strip, text.split(",")):
        kind, eq, n = (part.strip() for part in item.partition("="))
        if kind not in LORA_GROUP_KINDS or not eq or not n.isdigit():
            raise ValueError(f"QERL_LORA_GEMV_PER_SM_KIND: bad item {item.strip()!r}; expected KIND=N, KIND in "
                             f"{', '.join(LORA_GROUP_KINDS)}, N >= 0 programs per SM (0: plan as without LoRA)")
        out[kind] = int(n)
    return out


LORA_GEMV_PER_SM_KIND: dict[str, int] = _kind_values(os.environ.get("QERL_LORA_GEMV_PER_SM_KIND", ""))


LORA_GEMV_WIDE_MLP = 96_000_000  # hidden x intermediate size from which the rule above plans 3


def lora_gemv_per_sm(hidden: int, intermediate: int, kind: str | None = None) -> int:
    """Programs per SM for a LoRA group's Gluon GEMV: LORA_GEMV_PER_SM_KIND[kind], else
    LORA_GEMV_PER_SM, else 2 for a model whose hidden x intermediate size is below
    LORA_GEMV_WIDE_MLP and 3 from it."""
    if kind in LORA_GEMV_PER_SM_KIND:
        return LORA_GEMV_PER_SM_KIND[kind]
    if LORA_GEMV_PER_SM is not None:
        return LORA_GEMV_PER_SM
    return 2 if hidden * intermediate < LORA_GEMV_WIDE_MLP else 3
# XS (x copied beside the weight stages, w4a16_gluon.X_SMEM) for a LoRA group's Gluon GEMV: None =
# the kernel's rule, False / True = off / on there.
LORA_GEMV_XS = None
# The decode step's own small launches folded into others (same bits): the token embedding read by
# the first norm (decode_ops.embed_rms_norm), each row's cos / sin read by the attention at the
# row's position (no gathers), and slot / step / key-mask advance in one launch
# (decode_ops.advance); the same values. 7B batch 8, same process: decode step 2.611 -> 2.599 ms
# (NOTES_rollout.md section 25). False: as before (ablation flag `nostepfuse`).
STEP_FUSE = os.environ.get("QERL_ROLLOUT_STEP_FUSE", "1") == "1"
# The prefill's RoPE on q and k as one launch each (decode_ops.rotary_rows, the same roundings as
# the five elementwise torch ops and the cat it replaces), and its attention with GQA inside SDPA
# (enable_gqa, the same values) instead of K / V repeated per query head. 7B prefill,
# same process (NOTES_rollout.md section 25): 2048 tokens 50.0 -> 47.4 ms, 16384 tokens 364 -> 339
# ms. False: the torch ops (flags `noprerope`, `nogqa`).
PREFILL_ROPE = os.environ.get("QERL_ROLLOUT_PREFILL_ROPE", "1") == "1"
PREFILL_GQA = os.environ.get("QERL_ROLLOUT_PREFILL_GQA", "1") == "1"
# The decode step's residual add + RMSNorm between two 4-bit GEMVs split over their epilogues
# (w4a16_gluon.forward fold): the o / down GEMV adds the residual and writes bf16(r * weight) and
# per-block sums of r^2, the q/k/v or gate/up GEMV after it scales each token by the norm's
# 1 / rms. No norm launch; one rounding fewer than the norm kernel (not bit-equal). Where every
# product involved is nvfp4 (or routed mxfp4) without LoRA on the Gluon GEMV (2..8 rows); the first and final norms
# stay kernels. Same process, batch 8 (NOTES_rollout.md section 25): 7B step 2.564 -> 2.529 ms,
# whole generate calls 2960.9 -> 3010.1 tok/s; 14B step 4.740 -> 4.651 ms. QERL_ROLLOUT_NORM_FOLD=0
# (ablation flag `nofold`): the norm kernels.
NORM_FOLD = os.environ.get("QERL_ROLLOUT_NORM_FOLD", "1") == "1"
# The samples of one prompt hold the same K / V in its slots (one prefill, copied to each row):
# the decode attention reads a prompt key block from the group's first row for all of them
# (decode_ops attn_partial LEAD), so L2 serves the other rows' reads of it and DRAM carries each
# prompt's keys once per step instead of once per sample. Same values, bit for bit. Same process
# (H100, nvfp4 LoRA r32, 256-token prompts x 8 samples, 1280 keys; NOTES_rollout.md section 33):
# 14B step at 32 / 64 rows 9.77 -> 9.54 / 13.62 -> 13.19 ms, 7B at 32 rows 4.712 -> 4.630 ms.
# False: each row reads its own copy (ablation flag `noshare`).
SHARE_PROMPT_KEYS = os.environ.get("QERL_ROLLOUT_SHARE_PROMPT_KEYS", "1") == "1"
# LoRA in captured decode steps by one resident kernel instead of the side stream's two kernels,
# fork and join per linear group (qerl.kernels.lora_resident): launched once per step on the side
# stream, LORA_RESIDENT_PROGRAMS programs wait on the device for each group's input (the norm,
# attention-combine and silu kernels count their programs out: decode_ops.Signal) and the kernel
# that adds the delta waits for it (decode_ops.Ready). The side stream's edges cost the 7B / 14B
# step 10-12% with empty kernels (NOTES_rollout.md sections 27, 50). Experimental, off
# (QERL_LORA_RESIDENT=1, ablation flag `lres`); where it does not apply (`_resident_ok`) the side stream runs.
LORA_RESIDENT = os.environ.get("QERL_LORA_RESIDENT", "0") == "1"
LORA_RESIDENT_PROGRAMS = env_int("QERL_LORA_RESIDENT_PROGRAMS", 32)  # 8 / 16 / 64 lose (NOTES_rollout.md section 51)
# Timing only (ablation flags lres:...:c / :x): the consumers of the deltas poll once and never wait (they may
# add a stale delta), and with LORA_RESIDENT_KERNEL off no resident kernel runs at all (the producers
# still signal, the consumers still poll): what the synchronisation costs the chain apart from its stalls
LORA_RESIDENT_WAIT = True
LORA_RESIDENT_KERNEL = True
# True: with LORA_RESIDENT the LoRA groups keep the fusions of the no-LoRA step: NORM_FOLD (the o / down
# GEMVs add their delta in the residual epilogue, the resident kernel scales its shrink by the folded
# norm's 1 / rms) and GLU (the gate / up GEMV adds its delta before the silu); those launches wait for
# the delta on the device and count their row blocks out for the next group (w4a16_gluon.forward sync).
# Unfused, the resident kernel's synchronisation alone left a 7B b8 step at 0.879 of the no-LoRA step
# (a172: the norm and silu launches, ~11 us a layer); fused and planned as without LoRA (lsm0) 0.913,
# 14B 0.941 (a174, a176). But the kernel does not deliver the deltas by the fused GEMVs' epilogues:
# 0.751-0.775 against 0.849 unfused (a173, a175; NOTES_rollout.md section 52), so off (ablation flag
# `lres...:f` turns it on).
LORA_RESIDENT_FUSED = False
# True (with LORA_RESIDENT_FUSED, ranks 16-64): the fused o, gate/up and down GEMVs expand their LoRA delta
# themselves from the resident kernel's shrink sums (w4a16_gluon.forward with a lora_resident.Expand), so
# the kernel only sums and arrives for those groups: no meet of its programs, no B reads, no delta buffer.
# Session 61 (a177-a178) timed the kernel's expand of the 7B gate/up delta at 10-15 us of a ~25 us GEMV; with
# the GEMVs expanding, the sums are out 8.7 us after the input (a179), but the step stays at 0.775 of the
# no-LoRA step, and the expand in the epilogues alone (no kernel) costs 0.914 -> 0.844 (a179 / a180;
# NOTES_rollout.md section 53). Off (ablation flag `lres...:f:e`).
LORA_RESIDENT_EXPAND = False
# True: while a step with the resident kernel is recorded, the Gluon GEMVs plan for the program slots its
# programs leave (w4a16_gluon.RESERVE = LORA_RESIDENT_PROGRAMS): with the no-LoRA plan of 4 programs per SM
# the 7B gate/up stream-K launch otherwise runs 28 of its 524 programs as a second wave. a180: 0.774 -> 0.788 of
# the no-LoRA step (7B b8 r32, 32 programs, fused), still far under the side stream's 0.868. Off (flag `:r`).
LORA_RESIDENT_RESERVE = False


class EngineError(ValueError):
    """The model or the request does not fit the engine."""


def lead_rows(prompt: torch.Tensor) -> torch.Tensor:
    """For rows that sample prompts `prompt` (long [R], prompt index per row): the first row of
    each row's prompt (int32 [R]), the copy SHARE_PROMPT_KEYS reads."""
    rows = torch.arange(prompt.shape[0], device=prompt.device)
    first = torch.full((int(prompt.max()) + 1 if prompt.numel() else 0,), prompt.shape[0], dtype=torch.long,
                       device=prompt.device).scatter_reduce(0, prompt, rows, "amin")
    return first[prompt].to(torch.int32)


def supports(model: nn.Module) -> bool:
    """True when the engine can run `model` (a supported model_type, no sliding window)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    return (getattr(cfg, "model_type", None) in SUPPORTED and hasattr(base, "model") and hasattr(base.model, "layers")
            and not (getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None)))


def prompt_width(plen: int, steps: int, max_len: int) -> int:
    """The width a GPU prefill pads `plen` prompt tokens to: the next multiple of PROMPT_BUCKET, at
    most max_len - steps (so the rollout still fits the cache), never less than plen."""
    return max(plen, min(-(-plen // PROMPT_BUCKET) * PROMPT_BUCKET, max_len - steps))


def _active_norm(mod: nn.Module) -> nn.Module:
    """The norm a PEFT `modules_to_save` wrapper would run (the trained copy when active)."""
    if hasattr(mod, "modules_to_save") and hasattr(mod, "original_module"):
        if not getattr(mod, "disable_adapters", False):
            for name in getattr(mod, "active_adapters", [getattr(mod, "active_adapter", None)]):
                if name in mod.modules_to_save:
                    return mod.modules_to_save[name]
        return mod.original_module
    return mod


class _Norm:
    """An RMSNorm's epsilon and the engine's copy of its weight (re-read per call: AQN noise and
    trained norms), applied together with the residual add by decode_ops.add_rms_norm."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        norm = _active_norm(mod)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise EngineError(f"{type(norm).__name__} has no epsilon; not an RMSNorm the engine knows")
        self.eps = float(eps)
        with torch.no_grad():
            self.weight = norm.weight.detach().clone()

    def refresh(self) -> None:
        with torch.no_grad():
            self.weight.copy_(_active_norm(self.mod).weight)

    def __call__(self, delta: torch.Tensor | None, h: torch.Tensor, extra: torch.Tensor | None = None,
                 signal: Signal | None = None):
        """(h + delta (+ extra), norm of that); `signal`: decode_ops'."""
        return add_rms_norm(delta, h, self.weight, self.eps, extra, signal)

    def embed(self, ids: torch.Tensor, table: torch.Tensor, signal: Signal | None = None, gate=None):
        """(table[ids], norm of that): the embedding lookup inside the norm's launch."""
        return embed_rms_norm(ids, table, self.weight, self.eps, signal, gate)


class _Layer:
    def __init__(self, layer: nn.Module, fuse: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn_norm = _Norm(layer.input_layernorm)
        self.mlp_norm = _Norm(layer.post_attention_layernorm)
        self.qkv = LinearGroup([attn.q_proj, attn.k_proj, attn.v_proj], fuse=fuse)
        self.o = LinearGroup([attn.o_proj])
        self.gate_up = LinearGroup([mlp.gate_proj, mlp.up_proj], fuse=fuse)
        self.down = LinearGroup([mlp.down_proj])
        self.act = mlp.act_fn
        self.silu = isinstance(self.act, nn.SiLU) or type(self.act).__name__ == "SiLUActivation"
        self.q_norm = _Norm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = _Norm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None

    def norms(self) -> list[_Norm]:
        return [n for n in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm) if n is not None]

    def groups(self) -> list[LinearGroup]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def gate(self, gu: torch.Tensor, extra: torch.Tensor | None = None, signal: Signal | None = None) -> torch.Tensor:
        """act(gate) * up from the fused gate/up output (+ its LoRA delta)."""
        if self.silu:
            return silu_mul(gu, extra, signal)
        gate, up = (gu if extra is None else gu + extra).chunk(2, dim=-1)
        return self.act(gate) * up

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate(self.gate_up(x)))


def _resident_join() -> None:
    raise EngineError("a resident LoRA delta reached a path that cannot wait for it on the device")


class _Resident:
    """One decode step's state for the resident LoRA kernel (LORA_RESIDENT): its flags, shrink
    accumulators and table of groups (qerl.kernels.lora_resident), filled while the step's forward
    is recorded. `dry`: an eager warm-up of the same launches (each consumer's wait is passed in
    advance and the kernel runs after the forward), so nothing compiles inside a graph capture."""

    KINDS = {kind: i for i, kind in enumerate(LORA_GROUP_KINDS)}  # _Layer.groups()' order

    def __init__(self, engine: "RolloutEngine", rows: int, dry: bool = False):
        from qerl.kernels import lora_resident

        self.engine, self.rows, self.dry = engine, rows, dry
        self.programs = LORA_RESIDENT_PROGRAMS
        groups = engine._groups()
        dev = engine.device
        self.groups = len(groups)
        self.rank = groups[0].rank
        rp = 1 << max(0, (max(g._a.shape[0] for g in groups) - 1).bit_length())
        self.flags = torch.zeros(3 * self.groups + 2, dtype=torch.int32, device=dev)  # lora_resident's layout
        self.xa = torch.zeros(self.groups, lora_resident.MP, rp, dtype=torch.float32, device=dev)
        self.table = torch.zeros(self.groups, lora_resident.FIELDS, dtype=torch.int64, device=dev)
        self.entries: list[list[int]] = []
        self.signals: list[Signal] = []
        self.keep: list[torch.Tensor] = []  # the groups' inputs stay allocated while the kernel may read them
        self.scales: list[tuple | None] = []  # per group: the folded norm's scale its input carries (or None)
        self.synced = 0  # groups whose delta a Gluon GEMV's epilogue waits for and adds (LORA_RESIDENT_FUSED)
        self.start = torch.cuda.Event()
        # lora_resident.STAMP (timing only): the kernel's clocks per group and program
        self.stamps = (torch.zeros(self.groups * self.programs * 8, dtype=torch.int64, device=dev)
                       if lora_resident.STAMP else None)

    def begin(self, main) -> None:
        """At the step's start, on the main stream: flags and accumulators zeroed (dry: every consumer's
        wait already met), and the event the kernel's launch waits on."""
        self.flags.zero_()
        self.xa.zero_()
        if self.dry or not LORA_RESIDENT_KERNEL:  # (fill_: no host-to-device copy, which a capture refuses)
            self.flags[2:3 * self.groups:3].fill_(self.programs)
            self.flags[1:3 * self.groups:3].fill_(self.programs)  # (the sums an expanding GEMV waits for)
            self.flags[-1:].fill_(self.programs)
        self.start.record(main)
        if not self.dry and LORA_RESIDENT_KERNEL:  # first in the graph (section 51 of NOTES_rollout.md: recorded last, it started 47 us late)
            side = self.engine._side
            side.wait_event(self.start)
            self._kernel(side)

    def gate(self) -> Ready:
        """For the step's first kernel: wait until every program of the kernel has started."""
        return Ready(self.flags[-1:], self.flags[-1:], self.programs, _resident_join)

    def signal(self) -> Signal:
        sig = Signal(self.flags[3 * len(self.signals):3 * len(self.signals) + 1])
        self.signals.append(sig)
        return sig

    def group(self, group: LinearGroup, x: torch.Tensor, source: tuple, kind: str, scale: tuple | None = None,
              in_gemv: bool = False) -> Ready:
        """Record group `kind` of layer source[0] into the kernel's table -> its delta as a Ready for the
        consumer; in_gemv (LORA_RESIDENT_EXPAND): the consumer, a Gluon GEMV, expands it itself, the Ready
        holding a lora_resident.Expand of the shrink sums, ready when every program has arrived."""
        from qerl.kernels import lora_resident

        layer, sig = source
        g = 4 * layer + self.KINDS[kind]
        if len(self.entries) != g or self.signals[g] is not sig or not sig.programs:
            raise EngineError(f"resident LoRA: group {kind} of layer {layer} out of order or its input did not signal")
        out = self.engine._resident_delta(layer, kind, group)
        x2 = x.reshape(-1, group.in_features)
        self.entries.append(lora_resident.table_row(self.engine._res_base, x2, group._a, group._b, out, group.bounds,
                                                    sig.programs, scale, expand=not in_gemv))
        self.keep.append(x2)
        self.scales.append(scale)
        target = self.programs if LORA_RESIDENT_WAIT else 0
        if in_gemv:
            expand = lora_resident.Expand(self.xa[g], group._b, group.bounds, self.rank)
            return Ready(expand, self.flags[3 * g + 1:3 * g + 2], target, _resident_join)
        return Ready(out[:self.rows], self.flags[3 * g + 2:3 * g + 3], target, _resident_join)

    def finish(self) -> None:
        """The table into device memory (after a capture: the graph's kernel reads it at each replay)."""
        if len(self.entries) != self.groups:
            raise EngineError(f"resident LoRA: {len(self.entries)} of {self.groups} groups recorded")
        self.table.copy_(torch.tensor(self.entries, dtype=torch.int64))

    def launch(self, main, side) -> None:
        """The kernel on the side stream, after the step's start (dry: after the whole forward, whose
        table it needs now), joined back into the main stream (the step's one fork and one join). A
        captured step records it first (begin), so the graph launches it before the chain; its table is
        read at replay, written by finish() after the capture."""
        if self.dry:
            self.finish()
            side.wait_stream(main)
            if LORA_RESIDENT_KERNEL:
                self._kernel(side)
        if self.dry or LORA_RESIDENT_KERNEL:  # (no kernel: the captured side stream holds nothing to join)
            main.wait_stream(side)

    def _kernel(self, side) -> None:
        from qerl.kernels import lora_resident

        with torch.cuda.stream(side):
            lora_resident.resident_lora(self.engine._res_base, self.table, self.flags, self.xa, self.groups, self.rows,
                                        self.rank, self.programs, stamps=self.stamps)

    def timeouts(self) -> int:
        """Waits that gave up (lora_resident.SPIN_CAP) since the last begin(): 0 unless a producer never came."""
        return int(self.flags[-2])


class RolloutEngine:
    """Static-cache generation over one model; see the module docstring."""

    def __init__(self, model: nn.Module, max_batch: int = 64, max_len: int = 2048, cuda_graphs: bool | None = None,
                 fuse: bool = True, check_every: int = 32, compact_below: float = 0.5):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = base.config
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            raise EngineError(f"the rollout engine supports model types {', '.join(SUPPORTED)}, not {getattr(cfg, 'model_type', None)!r}")
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise EngineError("sliding-window attention is not supported by the rollout engine")
        inner = base.model
        self.model = model
        self.config = cfg
        self.embed = inner.embed_tokens
        self.lm_head = base.lm_head
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.scaling = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs and self.device.type == "cuda")
        self.check_every = int(check_every) if self.device.type == "cuda" else 1
        # at a check, when at most this fraction of the decoding rows is still unfinished, the
        # unfinished rows (their KV cache and state) move to the front and decoding continues
        # with fewer rows (0 = never)
        self.compact_below = float(compact_below)
        dev, mb, ml = self.device, self.max_batch, self.max_len
        with _outside_inference_mode():
            self.layers = [_Layer(layer, fuse) for layer in inner.layers]
            self.final_norm = _Norm(inner.norm)
            probe = torch.zeros(1, dtype=self.dtype, device=dev)
            cos, sin = inner.rotary_emb(probe, torch.arange(ml, device=dev)[None])
            self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, head_dim]
            self._k: list[torch.Tensor] = []
            self._v: list[torch.Tensor] = []
            self._allocate_cache()
            # the decode state the CUDA graphs read and advance (all on the device)
            self._tok = torch.zeros(mb, dtype=torch.long, device=dev)  # last sampled token
            self._pos = torch.zeros(mb, dtype=torch.long, device=dev)  # its RoPE position
            self._slot = torch.zeros(1, dtype=torch.long, device=dev)  # its cache slot
            self._step = torch.zeros(1, dtype=torch.long, device=dev)  # index of the token to sample
            self._valid = torch.zeros(mb, ml, dtype=torch.bool, device=dev)  # keys a row may attend
            self._attn_counters = torch.zeros(mb * self.n_kv, dtype=torch.int32, device=dev)  # decode_attention_rope
            # SHARE_PROMPT_KEYS: the row whose cache the attention reads for slots below _shared[0]
            self._lead = torch.arange(mb, dtype=torch.int32, device=dev)
            self._shared = torch.zeros(1, dtype=torch.long, device=dev)
            self._group = 1  # samples per prompt in the current call's rows (1: nothing shared)
            self._finished = torch.zeros(mb, dtype=torch.bool, device=dev)
            self._row_map = torch.zeros(mb, dtype=torch.long, device=dev)  # decoding row -> output row
            self._uniform = torch.zeros(ml, mb, dtype=torch.float32, device=dev)
            self._out_tok = torch.zeros(mb, ml, dtype=torch.long, device=dev)
            self._out_lp = torch.zeros(mb, ml, dtype=torch.float32, device=dev)
            self._out_ent = torch.zeros(mb, ml, dtype=torch.float32, device=dev)
            self._out_alive = torch.zeros(mb, ml, dtype=torch.bool, device=dev)
            # stop tokens as a mask over the vocabulary, filled in place per call (the graphs read
            # it): one gather per step, capturable whatever the number of stop ids (torch.isin's
            # sort path for many ids is not)
            self.vocab = int(getattr(self.lm_head, "out_features", None) or self.embed.num_embeddings)
            self._is_stop = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            self._pad = torch.zeros(1, dtype=torch.long, device=dev)
            self._sample_state = SampleState(
                uniform=self._uniform, step=self._step, row_map=self._row_map, finished=self._finished,
                is_stop=self._is_stop, pad=self._pad, out_tok=self._out_tok, out_lp=self._out_lp, out_ent=self._out_ent,
                out_alive=self._out_alive, tok=self._tok, pos=self._pos)
        self._graphs: dict[tuple, object] = {}
        self._pool = None
        self._lora_ptrs: tuple = ()
        # LoRA products run on a side stream beside the base 4-bit product (captured as a parallel
        # branch of the graph), into buffers kept per group kind so the side stream allocates nothing
        # (high priority, which applies to eager steps only: a captured graph runs every node at its launch
        # stream's priority, and restoring the per-node priorities there changed nothing, NOTES_rollout.md section 48)
        self._side = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self._lora_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> LinearGroup.lora_workspace
        self._res: _Resident | None = None  # LORA_RESIDENT: the state of the step being recorded
        self._res_deltas: dict[tuple, torch.Tensor] = {}  # (layer, kind) -> [MP, N] delta buffer
        self._res_base = torch.zeros(8, dtype=self.dtype, device=self.device)  # the offsets' origin
        self.stats: dict = {}

    # ------------------------------------------------------------------ forward pieces

    def _logits(self, delta: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(delta, h)[1])

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Run the prompts [P, Lp] (left padded); cache row r gets the K/V of prompt source[r].
        Returns the last position's logits [P, V]."""
        p, length = ids.shape
        rows = torch.arange(source.shape[0], device=ids.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._cos[positions], self._sin[positions]  # [P, Lp, D]
        keys = mask.bool()[:, None, None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(length, dtype=torch.bool, device=ids.device)
        attn_mask = (causal & keys) | eye  # a pad query sees itself: no all-masked row, no NaN
        h, delta = self.embed(ids), None
        d, nq, nk = self.head_dim, self.n_heads, self.n_kv
        for i, layer in enumerate(self.layers):
            h, x = layer.attn_norm(delta, h)
            q, k, v = layer.qkv(x).split([nq * d, nk * d, nk * d], dim=-1)
            q, k, v = (t.view(p, length, -1, d) for t in (q, k, v))
            if layer.q_norm is not None:
                q, k = layer.q_norm(None, q)[1], layer.k_norm(None, k)[1]
            if PREFILL_ROPE:
                q, k = (rotary_rows(t.reshape(p * length, -1, d), cos.view(p * length, d), sin.view(p * length, d))
                        .view(p, length, -1, d) for t in (q, k))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if not PREFILL_ROPE:
                q, k = rotary(q, cos[:, None], sin[:, None]), rotary(k, cos[:, None], sin[:, None])
            self._k[i][rows, :, :length] = k[source]
            self._v[i][rows, :, :length] = v[source]
            gqa = self.group > 1 and PREFILL_GQA
            if self.group > 1 and not gqa:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling,
                                                  **({"enable_gqa": True} if gqa else {}))
            h, x = layer.mlp_norm(layer.o(attn.transpose(1, 2).reshape(p, length, -1)), h)
            delta = layer.mlp(x)
        return self._logits(delta[:, -1], h[:, -1])

    def _graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _run_prefill(self, ids: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """`_prefill`, as a CUDA graph where that pays: the first prefill of a shape runs eagerly
        (it compiles the kernels and is this call's result) and is then captured (capture runs
        nothing); later ones copy their inputs into the graph's and replay it. The graph writes
        the same cache rows and shares the decode graphs' memory pool (they never run at once)."""
        p, length = ids.shape
        if not self.cuda_graphs or p * length > PREFILL_GRAPH_TOKENS:
            return self._prefill(ids, mask, source)
        key = ("prefill", p, length, source.shape[0])
        entry = self._graphs.get(key)
        if isinstance(entry, tuple):
            graph, inputs, captured = entry
            for dst, src in zip(inputs, (ids, mask, source)):
                dst.copy_(src)
            graph.replay()
            return captured
        out = self._prefill(ids, mask, source)
        if entry is None:  # first of this shape: capture it for the next calls ("eager": it failed once)
            self._graphs[key] = self._capture_prefill(ids, mask, source)
        return out

    def _capture_prefill(self, ids: torch.Tensor, mask: torch.Tensor, source: torch.Tensor):
        """(graph, its input buffers, its output), or "eager" where capture failed (out of memory,
        say: that shape then stays eager, with a warning)."""
        inputs = (ids.clone(), mask.clone(), source.clone())
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool()):
                captured = self._prefill(*inputs)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            warnings.warn(f"rollout engine: the prefill of {ids.shape[0]} x {ids.shape[1]} tokens was not captured in a "
                          f"CUDA graph and runs eagerly ({type(exc).__name__}: {first})")
            # a capture CUDA invalidated leaves its pool marked as recording (torch's capture_end raises before it
            # ends the pool's allocation): later captures take a fresh pool, or each would fail with "already
            # recording to mempool_id"
            self._pool = None
            return "eager"
        return graph, inputs, captured

    def _decode_logits(self, rows: int, keys: int) -> torch.Tensor:
        """Logits [rows, V] for the tokens in self._tok at self._pos / self._slot; attends cache
        slots [0, keys)."""
        tok, pos = self._tok[:rows], self._pos[:rows]
        fused = STEP_FUSE and type(self.embed) is nn.Embedding and self.embed.max_norm is None
        if fused:  # the embedding read by the first norm, cos / sin rows by the attention (STEP_FUSE)
            cos, sin, at = self._cos, self._sin, pos
        else:
            cos, sin, at = self._cos[pos], self._sin[pos], None
        valid = self._valid[:rows]
        h, delta, lo_down = (None if fused else self.embed(tok)), None, None
        res = self._res  # LORA_RESIDENT: this step's resident-kernel state (None: the side stream)
        fused = res is not None and LORA_RESIDENT_FUSED
        plan = self._fold_plan(rows, fused) if NORM_FOLD else None
        shared = (self._lead[:rows], self._shared) if SHARE_PROMPT_KEYS else ()
        scale = None  # NORM_FOLD: x is bf16(r * weight) and the next product applies this scale
        if res is not None:
            res.begin(torch.cuda.current_stream(self.device))
        # LORA_RESIDENT: one Signal per linear group's input, in the step's order (sig); s_in is the
        # Signal of the next product's input, which its producer counts out
        sig = res.signal if res is not None else (lambda: None)
        s_in = None
        for i, layer in enumerate(self.layers):
            if h is None:
                s_in = sig()
                h, x = layer.attn_norm.embed(tok, self.embed.weight, s_in, res.gate() if res is not None else None)
            elif scale is None:
                s_in = sig()
                h, x = layer.attn_norm(delta, h, lo_down, s_in)
            kc, vc = self._k[i][:rows], self._v[i][:rows]
            qkv, lo = self._linear(layer.qkv, x, "qkv", scale, (i, s_in))
            if layer.q_norm is not None:  # Qwen3: per-head norms on q and k before RoPE
                d = self.head_dim
                qkv = qkv if lo is None else qkv + lo
                q, k, v = qkv.view(rows, -1, d).split([self.n_heads, self.n_kv, self.n_kv], dim=1)
                q, k = layer.q_norm(None, q)[1], layer.k_norm(None, k)[1]
                qkv, lo = torch.cat([q, k, v], 1).reshape(rows, -1), None
            s_in = sig()
            attn = decode_attention_rope(qkv, cos, sin, kc, vc, self._slot, valid, keys, self.scaling, self.n_heads,
                                         self.n_kv, lo, self._attn_counters, at, *shared, signal=s_in)
            fold_o, fold_down = plan[i] if plan else (False, False)
            if fold_o:
                h, x, scale, s_in = self._res_forward(layer.o, "o", attn, h, layer.mlp_norm, (i, s_in))
            else:
                o, lo = self._linear(layer.o, attn, "o", source=(i, s_in))
                s_in = sig()
                h, x = layer.mlp_norm(o, h, lo, s_in)
                scale = None
            act = None
            if GLU and layer.silu and fused and layer.gate_up.glu_usable(x, True):
                act, s_in = self._synced(layer.gate_up, "gate_up", x, (i, s_in), scale,
                                         lambda sync: layer.gate_up.glu_forward(x, scale, sync=sync))
            elif GLU and layer.silu:
                act = layer.gate_up.glu_forward(x, scale)
            if act is None:
                gu, lo = self._linear(layer.gate_up, x, "gate_up", scale, (i, s_in))
                s_in = sig()
                act = layer.gate(gu, lo, s_in)
            if fold_down:
                h, x, scale, s_in = self._res_forward(layer.down, "down", act, h, self.layers[i + 1].attn_norm,
                                                      (i, s_in))
                delta = lo_down = None
            else:
                delta, lo_down = self._linear(layer.down, act, "down", source=(i, s_in))
                scale = None
        logits = bf16_gemv.dense(self.lm_head, self.final_norm(delta, h, lo_down)[1])  # batch 1: the PDL GEMV
        if res is not None:
            res.launch(torch.cuda.current_stream(self.device), self._side)
        return logits

    def _res_forward(self, group: LinearGroup, kind: str, x: torch.Tensor, h: torch.Tensor, norm, source: tuple):
        """NORM_FOLD producer: group.res_forward into `norm`'s input; with the resident LoRA kernel
        (`_synced`) -> (h, x, scale, the Signal of the next group's input or None)."""
        if self._res is None or not group.has_lora:
            return (*group.res_forward(x, h, norm.weight, norm.eps), None)
        out, s_next = self._synced(group, kind, x, source, None,
                                   lambda sync: group.res_forward(x, h, norm.weight, norm.eps, sync=sync))
        return (*out, s_next)

    def _synced(self, group: LinearGroup, kind: str, x: torch.Tensor, source: tuple, scale: tuple | None, launch):
        """LORA_RESIDENT_FUSED: launch(sync) runs a Gluon GEMV of this LoRA group that waits for the resident
        kernel's delta in its epilogue and counts the next group's input out (fuse.LinearGroup's `sync`)
        -> (its result, the Signal of the next group's input)."""
        s_next = self._res.signal()
        ready = self._res.group(group, x, source, kind, scale, LORA_RESIDENT_EXPAND and group.rank <= 64)
        with self._lora_gemv_plan(kind):
            out = launch((ready, s_next))
        self._res.synced += 1
        return out, s_next

    def _fold_plan(self, rows: int, synced: bool = False) -> list[tuple[bool, bool]]:
        """NORM_FOLD per layer: (fold the mlp norm into o -> gate/up, fold the next layer's input
        norm into down -> next q/k/v); only where producer and consumer both take it (synced: LoRA
        groups too, whose deltas the resident kernel computes, LORA_RESIDENT_FUSED)."""
        ok = [(layer.qkv.fold_usable(rows, synced), layer.o.fold_usable(rows, synced),
               layer.gate_up.fold_usable(rows, synced), layer.down.fold_usable(rows, synced)) for layer in self.layers]
        return [(o and gu, d and i + 1 < len(ok) and ok[i + 1][0]) for i, (_q, o, gu, d) in enumerate(ok)]

    def _linear(self, group: LinearGroup, x: torch.Tensor, kind: str, scale: tuple | None = None,
                source: tuple | None = None):
        """(base product, LoRA delta or None): on a GPU the delta's two kernels run on the side
        stream while the base product runs; the caller's kernel adds the delta (`extra`). `scale`
        (NORM_FOLD): x is bf16(r * weight) and the product applies the norm's scale. `source`
        (layer index, the Signal of x's kernel): with LORA_RESIDENT the delta is the resident
        kernel's, a decode_ops.Ready.
        (Running the shrink first on the main stream, so the base product cannot starve it, was
        slower: 0.72-0.79 of the no-LoRA step at 14B r64 against 0.89; NOTES_rollout.md section 7.)"""
        if self._res is not None and group.has_lora:  # (with a scale: LORA_RESIDENT_FUSED, a folded norm's input)
            with self._lora_gemv_plan(kind):
                y = group.base_forward(x) if scale is None else group.scale_forward(x, scale)
            return y, self._res.group(group, x, source, kind, scale)
        if scale is not None:
            return group.scale_forward(x, scale), None
        if not group.has_lora:
            return group.base_forward(x), None
        workspace = self._lora_workspace(group, kind)
        if self._side is None:
            return group.base_forward(x), group.lora(x, workspace)
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            lo = group.lora(x, workspace)
        with self._lora_gemv_plan(kind):
            y = group.base_forward(x)
        main.wait_stream(self._side)
        return y, (lo if lo.dtype == y.dtype else lo.to(y.dtype))

    def _resident_ok(self, rows: int) -> bool:
        """LORA_RESIDENT applies to a captured step of `rows` rows: a GPU with Triton, every linear
        group with its LoRA in one rank of 16..128 (bf16 / fp16 as the model), output blocks the kernel
        takes, SiLU MLPs, no q / k norms, the attention's combine as its own kernel."""
        from qerl.kernels import decode_ops, lora_resident

        if not (LORA_RESIDENT and self._side is not None and rows <= lora_resident.MP) or decode_ops.ATTN_COMBINE:
            return False
        from qerl import kernels

        if not kernels.available():
            return False
        groups = self._groups()
        rank = groups[0].rank
        return (all(layer.silu and layer.q_norm is None for layer in self.layers) and rank in (16, 32, 64, 128)
                and all(g.has_lora and g.rank == rank and g._a.dtype == self.dtype
                        and lora_resident.fits(g.in_features, g._b.shape[0], g.bounds) for g in groups))

    def _groups(self) -> list[LinearGroup]:
        """Every linear group of the decoder, in the order a step runs them."""
        return [g for layer in self.layers for g in layer.groups()]

    def _resident_delta(self, layer: int, kind: str, group: LinearGroup) -> torch.Tensor:
        """The resident kernel's delta buffer of one group (zeros at first: a dry step reads it unwritten)."""
        from qerl.kernels.lora_resident import MP

        key = (layer, kind)
        buf = self._res_deltas.get(key)
        if buf is None or buf.shape[1] != group._b.shape[0] or buf.dtype != self.dtype:
            with _outside_inference_mode():
                buf = self._res_deltas[key] = torch.zeros(MP, group._b.shape[0], dtype=self.dtype, device=self.device)
        return buf

    def _lora_workspace(self, group: LinearGroup, kind: str) -> tuple[torch.Tensor, ...]:
        """The preallocated LoRA buffers of this group kind and shape (made on first use)."""
        # the shrink's K slices size its partials: a changed lora_ops.MAX_SPLITS needs new buffers
        key = (kind, tuple(group._a.shape), tuple(group._b.shape), group._a.dtype, shrink_splits(group._a.shape[1]))
        if key not in self._lora_buffers:
            self._lora_buffers[key] = group.lora_workspace(self.max_batch)
        return self._lora_buffers[key]

    def _lora_gemv_plan(self, kind: str | None = None):
        """The planning of a LoRA group's Gluon GEMV (`lora_gemv_per_sm` programs per SM, and no
        stream-K: beside the side stream's LoRA kernels its persistent programs cost more than the
        split tail gains, 7B b8 r32 0.863 vs 0.882 of the no-LoRA step, NOTES_w4a16.md section 18);
        a no-op when that is 0."""
        per_sm = lora_gemv_per_sm(self.config.hidden_size, self.config.intermediate_size, kind)
        if per_sm <= 0:
            return contextlib.nullcontext()
        try:
            from qerl.kernels import w4a16_gluon
        except ImportError:  # a Triton without Gluon: no Gluon GEMV to plan
            return contextlib.nullcontext()
        xs = {} if LORA_GEMV_XS is None else {"XS": LORA_GEMV_XS}
        return w4a16_gluon.defaults(PER_SM=per_sm, STREAMK=False, **xs)

    def _resident_step(self, res: _Resident | None, fn):
        """fn() with `res` as the state the forward records into (LORA_RESIDENT; None: the side stream)."""
        self._res = res
        reserve = res is not None and LORA_RESIDENT_RESERVE and LORA_RESIDENT_KERNEL
        if reserve:
            from qerl.kernels import w4a16_gluon

            w4a16_gluon.RESERVE = res.programs
        try:
            return fn()
        finally:
            self._res = None
            if reserve:
                w4a16_gluon.RESERVE = 0

    def _sample_and_advance(self, logits: torch.Tensor, rows: int, sampling: tuple) -> None:
        """Sample token self._step for every row, record it, and move the state one token on.
        Device work only (no host sync): part of the captured step. The per-row part is one
        kernel on a GPU (qerl.kernels.sample_ops); the shared counters advance here."""
        temperature, top_k, top_p = sampling
        sample_step(logits, temperature, self._sample_state, top_k, top_p)
        (advance if STEP_FUSE else advance_reference)(self._slot, self._step, self._valid[:rows])

    def _decode_step(self, rows: int, keys: int, sampling: tuple) -> None:
        self._sample_and_advance(self._decode_logits(rows, keys), rows, sampling)

    def _run_step(self, rows: int, keys: int, sampling: tuple) -> None:
        """One decode step: eager on a CPU; on a GPU the first step of a key runs eagerly (it is
        also the warm-up), the second is captured and every later one replays the graph.

        With top-k / top-p truncation (a sort over the vocabulary) the graph holds the forward
        only and the sampling runs eagerly after it: that sort has not been checked under graph
        capture on our GPUs, and the plain-temperature sampling RL uses by default has no sort."""
        if not self.cuda_graphs:
            return self._decode_step(rows, keys, sampling)
        _, top_k, top_p = sampling
        whole = not (top_k or top_p < 1.0)
        key = (rows, keys, sampling if whole else None)
        graph = self._graphs.get(key)
        if graph is None:
            if self._resident_ok(rows):  # its launches once, eagerly, before the step (which rewrites the same slot)
                self._resident_step(_Resident(self, rows, dry=True), lambda: self._decode_logits(rows, keys))
            logits = self._decode_logits(rows, keys)
            self._graphs[key] = "warm"
        else:
            if graph == "warm":
                graph = torch.cuda.CUDAGraph()
                res = _Resident(self, rows) if self._resident_ok(rows) else None

                def record():
                    with torch.cuda.graph(graph, pool=self._graph_pool()):
                        return self._decode_step(rows, keys, sampling) if whole else self._decode_logits(rows, keys)

                out = self._resident_step(res, record)
                if res is not None:
                    res.finish()
                self._graphs[key] = graph = (graph, out, res)
            graph[0].replay()
            logits = graph[1]
            if whole:
                return
        self._sample_and_advance(logits, rows, sampling)

    def _compact(self, rows: int) -> None:
        """Move the unfinished rows among the first `rows` to the front (KV cache, mask, token,
        position, output row), in their order; eager, between graph replays."""
        keep = (~self._finished[:rows]).nonzero().squeeze(1)
        k = keep.shape[0]
        for buf in (*self._k, *self._v, self._tok, self._pos, self._valid, self._finished, self._row_map):
            buf[:k] = buf.index_select(0, keep)
        self._lead[:k] = lead_rows(self._row_map[:k] // self._group)

    @contextlib.contextmanager
    def _four_bit_pdl(self):
        """While decoding, issue 4's 4-bit kernels launch with programmatic dependent launch as
        the decode_ops kernels do (decode_ops.PDL: the whole step's chain overlaps launch and
        prologue with the previous kernel's tail; with PDL the Gluon GEMV at M = 1 takes its own
        threshold, w4a16_triton.WSMMA_MIN_NK_PDL); their global default stays as it was."""
        if not (self.device.type == "cuda" and pdl_on(self._tok)):
            yield
            return
        from qerl import kernels

        if not kernels.available():
            yield
            return
        from qerl.kernels import w4a16_triton

        before = w4a16_triton.PDL
        w4a16_triton.PDL = True
        try:
            yield
        finally:
            w4a16_triton.PDL = before

    def _bucket(self, slot: int) -> int:
        return min(self.max_len, -(-(slot + 1) // LENGTH_BUCKET) * LENGTH_BUCKET)

    # ------------------------------------------------------------------ public

    def refresh(self) -> None:
        """Re-read the norm weights (AQN noise, trained norms) and the LoRA adapters; generate()
        calls this first."""
        for layer in self.layers:
            for norm in layer.norms():
                norm.refresh()
            for group in layer.groups():
                group.refresh(self.dtype)
        self.final_norm.refresh()
        # the graphs hold the adapters' buffer addresses: a group that re-allocated them (new rank,
        # adapters added or removed) invalidates every captured graph
        buffers = tuple((g._per_module, g._a.data_ptr() if g._a is not None else 0, g._b.data_ptr() if g._b is not None else 0)
                        for g in self._groups())
        if buffers != self._lora_ptrs:
            self.release_graphs()
            self._lora_ptrs = buffers

    def release_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    def _allocate_cache(self) -> None:
        if self._k:
            return
        shape = (self.max_batch, self.n_kv, self.max_len, self.head_dim)
        with _outside_inference_mode():
            # zeros, not empty: a masked key still multiplies its value by 0, and 0 * NaN = NaN
            self._k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            self._v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    @property
    def cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 after release_memory())."""
        return sum(t.numel() * t.element_size() for t in (*self._k, *self._v))

    def release_memory(self) -> int:
        """Free the KV cache and the CUDA graphs (and their memory pool) until the next generate(),
        which allocates and captures them again: the training phase of an RL step gets that memory
        (the cache of 8 x 2304 tokens of a 32B model is 4.8 GB). Returns the cache bytes freed."""
        freed = self.cache_bytes
        self.release_graphs()
        self._k, self._v = [], []
        return freed

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], settings: RolloutSettings,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        t0 = time.perf_counter()
        g = settings.num_generations
        if not list(settings.stop_ids):
            raise ValueError("rollouts need at least one stop token id")
        p_ids, p_mask = pad_prompts(prompt_ids, settings.pad_id)
        n_prompts, plen = p_ids.shape
        n = n_prompts * g
        steps = int(settings.max_new_tokens)
        if n > self.max_batch:
            raise EngineError(f"{n_prompts} prompts x {g} generations = {n} rows > the engine's max_batch {self.max_batch}")
        if plen + steps > self.max_len:
            raise EngineError(f"prompt {plen} + {steps} new tokens > the engine's max_len {self.max_len}")
        ids, mask = p_ids, p_mask
        width = prompt_width(plen, steps, self.max_len) if self.device.type == "cuda" else plen
        if width > plen:  # wider left padding (masked keys) so that prefill graphs and key buckets repeat
            ids, mask = F.pad(p_ids, (width - plen, 0), value=settings.pad_id), F.pad(p_mask, (width - plen, 0), value=0)
            plen = width
        sampling = (float(settings.temperature), int(settings.top_k), float(settings.top_p))
        self._allocate_cache()
        self.refresh()
        stops = tuple(int(s) for s in settings.stop_ids)
        self._is_stop.zero_()
        inside = [s for s in stops if 0 <= s < self.vocab]  # an id outside the vocabulary is never sampled
        if inside:
            self._is_stop[torch.tensor(inside, dtype=torch.long, device=self.device)] = True
        self._pad.fill_(settings.pad_id)
        if settings.temperature:
            self._uniform[:steps, :n] = draw_uniform((steps, n), generator, self.device)
        index = torch.arange(n_prompts).repeat_interleave(g)
        dev_index = index.to(self.device)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if settings.share_prompt:
            source = dev_index
        else:
            ids, mask = ids[dev_index], mask[dev_index]
            source = torch.arange(n, device=self.device)
        self._valid[:n].zero_()
        self._valid[:n, :plen] = mask[source].bool()
        # rows of one prompt hold one prefill's K / V in slots [0, plen) (share_prompt): the decode
        # attention may read them from the group's first row (SHARE_PROMPT_KEYS)
        self._group = g if settings.share_prompt else 1
        self._lead[:n] = lead_rows(torch.arange(n, device=self.device) // self._group)
        self._shared.fill_(plen if self._group > 1 else 0)
        t_prefill = time.perf_counter()
        logits = self._run_prefill(ids, mask, source)[source if settings.share_prompt else slice(None)]
        # state for the first token: it is sampled from the prefill logits, then goes in slot plen
        self._pos[:n] = self._valid[:n, :plen].sum(-1) - 1
        self._slot.fill_(plen - 1)
        self._step.zero_()
        self._finished[:n] = False
        self._row_map[:n] = torch.arange(n, device=self.device)
        self._out_tok[:n, :steps] = settings.pad_id  # rows compacted away are not written again
        self._out_lp[:n, :steps] = 0.0
        self._out_ent[:n, :steps] = 0.0
        self._out_alive[:n, :steps] = False
        self._sample_and_advance(logits, n, sampling)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_decode = time.perf_counter()
        done, rows, compactions = 1, n, 0
        with self._four_bit_pdl():
            while done < steps:
                if done % self.check_every == 0:
                    unfinished = int((~self._finished[:rows]).sum())
                    if unfinished == 0:
                        break
                    if unfinished < rows and unfinished <= self.compact_below * rows:
                        self._compact(rows)
                        rows, compactions = unfinished, compactions + 1
                self._run_step(rows, self._bucket(plen + done - 1), sampling)
                done += 1
        alive = self._out_alive[:n, :done].cpu()
        comp = self._out_tok[:n, :done].cpu()
        logprobs = self._out_lp[:n, :done].cpu()
        entropies = self._out_ent[:n, :done].cpu()
        t_end = time.perf_counter()
        # trim the steps after every row finished (up to check_every - 1 of them)
        last = int(alive.any(0).nonzero().max()) + 1 if alive.any() else 1
        alive, comp, logprobs, entropies = alive[:, :last], comp[:, :last], logprobs[:, :last], entropies[:, :last]
        lengths = alive.sum(-1)
        has = lengths > 0
        final = comp[torch.arange(n), (lengths - 1).clamp(min=0)]
        fin = torch.zeros(n, dtype=torch.bool)
        fin[has] = torch.isin(final[has], torch.tensor(stops))
        self.stats = {"prefill_s": t_decode - t_prefill, "decode_s": t_end - t_decode, "steps": done,
                      "rows": n, "tokens": int(lengths.sum()), "graphs": len(self._graphs),
                      "compactions": compactions, "final_rows": rows}
        return RolloutBatch(
            prompt_ids=p_ids, prompt_mask=p_mask, prompt_index=index, completion_ids=comp,
            completion_mask=alive.long(), logprobs=logprobs * alive, entropies=entropies * alive,
            finished=fin, elapsed_s=time.perf_counter() - t0, extra={"engine": dict(self.stats)},
        )


def engine_rollouts(model, prompt_ids: Sequence[Sequence[int]], settings: RolloutSettings,
                    generator: torch.Generator | None = None) -> RolloutBatch:
    """`rollout_fn` for the trainer: the model's engine (built on first use, rebuilt when the
    request outgrows it or the model's layers were replaced) generates the batch."""
    rows = len(prompt_ids) * settings.num_generations
    length = max(len(p) for p in prompt_ids) + settings.max_new_tokens
    engine = model.__dict__.get("_qerl_rollout_engine")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    first_q = base.model.layers[0].self_attn.q_proj
    if engine is None or engine.max_batch < rows or engine.max_len < length or engine.layers[0].qkv.modules[0] is not first_q:
        model.__dict__.pop("_qerl_rollout_engine", None)
        engine = RolloutEngine(model, max_batch=rows, max_len=-(-length // LENGTH_BUCKET) * LENGTH_BUCKET)
        model.__dict__["_qerl_rollout_engine"] = engine
    return engine.generate(prompt_ids, settings, generator)


def release_rollout_memory(model) -> int:
    """Free the KV cache and CUDA graphs of `model`'s rollout engine, if it has one (the engine
    stays, and re-allocates them at its next rollout). Returns the bytes of KV cache freed."""
    engine = model.__dict__.get("_qerl_rollout_engine")
    freed = engine.release_memory() if engine is not None else 0
    if freed and engine.device.type == "cuda":
        torch.cuda.empty_cache()
    return freed
