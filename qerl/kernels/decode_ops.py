"""The small per-token operations of a decoder layer, one kernel each (Triton on CUDA, torch elsewhere).

    h, x = add_rms_norm(delta, h, weight, eps)        # h = h + delta; x = RMSNorm(h) * weight
    q = rope_to_cache(qkv, cos, sin, k_cache, v_cache, slot, heads, kv_heads)
    a = silu_mul(gate_up)                             # silu(gate) * up, gate_up = [.., 2I]

Why: at decode a layer's 4-bit GEMMs take a few microseconds each, and so does every tiny
element-wise kernel around them. Written as torch ops, RMSNorm is ~7 kernels, RoPE on q and k
plus the two cache writes ~12, the SwiGLU gate 2, the residual adds 2: ~30 launches per layer,
~2.5 ms per token on a 28-layer model in a CUDA graph, about as long as reading all of a 7B
model's nvfp4 weights. Here they are 3 kernels (the residual add rides in the norm).

Numerics follow Hugging Face's Llama / Qwen2 modules rounding for rounding, so a bf16 rollout
matches `model.generate` as closely as kernels allow:
- add_rms_norm: h = bf16(delta + h); x = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))), statistics in
  fp32 (the fp32 sum's order differs from torch's, the only source of difference);
- rope: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1];
- silu_mul: bf16(bf16(silu(g)) * u).
Each `*_reference` function is the plain-torch definition (CPU, tests). The Triton versions run
when the tensors are on a CUDA device and triton imports (qerl.kernels.available()).

Try it:  pytest tests/test_decode_ops.py -q
"""

from __future__ import annotations

import functools
import os
from typing import Callable, NamedTuple

import torch

from qerl.env import env_int

__all__ = ["Ready", "Signal", "add_rms_norm", "add_rms_norm_reference", "advance", "advance_reference", "decode_attention", "decode_attention_reference",
           "decode_attention_rope", "embed_rms_norm", "joined", "rope_to_cache", "rope_to_cache_reference", "rotary", "rotary_rows",
           "silu_mul", "silu_mul_reference"]



class Ready(NamedTuple):
    """An `extra` (a LoRA delta) that another stream may still be computing. The kernel that adds
    it waits on the device: its programs poll the int32 counter `flag` until it reaches `target`
    (each program of the producer adds one after its stores, lora_ops' `signal`), and only then let
    their own dependents launch. A path that cannot wait on the device (torch, a kernel without the
    poll) calls `join()` first, which makes the current stream wait for the producing one. The
    rollout engine hands these out for the resident LoRA kernel's deltas (engine.LORA_RESIDENT,
    qerl.kernels.lora_resident), so the step has one fork and one join instead of one per linear."""
    delta: torch.Tensor
    flag: torch.Tensor
    target: int
    join: Callable[[], None]


def joined(extra):
    """`extra` as a tensor the current stream may read: a Ready is joined first."""
    if isinstance(extra, Ready):
        extra.join()
        return extra.delta
    return extra


def _delta(extra):
    """The tensor of an `extra` (for dtype and shape checks; not safe to read)."""
    return extra.delta if isinstance(extra, Ready) else extra


def _ready_args(extra, ref: torch.Tensor):
    """(extra tensor, flag, target, has_ready) for a kernel launch; a delta that would need a copy
    first (not contiguous) is joined, since the copy would read it on this stream."""
    if isinstance(extra, Ready):
        if extra.delta.is_contiguous():
            return extra.delta, extra.flag, int(extra.target), True
        extra = joined(extra)
    return extra, ref, 0, False


class Signal:
    """Where a kernel counts its programs done, for a reader on another stream: each program adds
    one to the int32 element `flag` after its stores (release); the launch sets `programs` to how
    many will. The rollout engine's resident LoRA kernel (qerl.kernels.lora_resident) waits on these
    for each linear group's input. Only the Triton kernels signal: a path without one raises."""

    __slots__ = ("flag", "programs")

    def __init__(self, flag: torch.Tensor):
        self.flag = flag
        self.programs = 0


def _no_signal(signal, op: str) -> None:
    if signal is not None:
        raise ValueError(f"decode_ops.{op}: a device Signal needs its Triton kernel, which this call does not take")


def _signal_args(signal, ref: torch.Tensor, programs: int):
    """(flag, SIGNAL) for a launch of `programs` programs; records them on the Signal."""
    if signal is None:
        return ref, False
    signal.programs = programs
    return signal.flag, True


# --------------------------------------------------------------------------- references


def add_rms_norm_reference(delta, h, weight, eps, extra=None):
    if delta is not None:
        h = h + (delta if extra is None else delta + extra)
    f = h.float()
    normed = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return h, weight * normed


def advance_reference(slot, step, valid):
    """slot += 1, step += 1, then valid[:, slot] = True (the decode state one token on)."""
    slot.add_(1)
    step.add_(1)
    valid.index_fill_(1, slot, True)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x, cos, sin):
    """x * cos + rotate_half(x) * sin (Hugging Face apply_rotary_pos_emb), cos / sin broadcastable to x."""
    return x * cos + _rotate_half(x) * sin


def rope_reference(x, cos, sin):
    """x [B, heads, D], cos / sin [B, D] -> x rotated."""
    return rotary(x, cos[:, None], sin[:, None])


def rope_to_cache_reference(qkv, cos, sin, k_cache, v_cache, slot, heads, kv_heads, extra=None):
    """qkv [B, (heads + 2 kv_heads) * D] (one token per row; `extra`, same shape, is added first);
    writes rotated k and v into k_cache / v_cache [B, kv_heads, L, D] at position `slot` (long
    [1]); returns rotated q [B, heads, D]."""
    if extra is not None:
        qkv = qkv + extra
    b = qkv.shape[0]
    d = cos.shape[-1]
    x = qkv.view(b, heads + 2 * kv_heads, d)
    q = rope_reference(x[:, :heads], cos, sin)
    k = rope_reference(x[:, heads:heads + kv_heads], cos, sin)
    k_cache.index_copy_(2, slot, k[:, :, None])
    v_cache.index_copy_(2, slot, x[:, heads + kv_heads:, None])
    return q


def decode_attention_reference(q, k_cache, v_cache, valid, keys: int, scale: float):
    """One query token per row. q [B, H, D]; k_cache / v_cache [B, KV, L, D]; valid [B, L] bool (the
    keys a row may attend); attends cache slots [0, keys). Returns [B, H * D]. Grouped-query
    attention without repeating K/V: the H / KV query heads that share a KV head (heads
    h = kv * group + g, as in Hugging Face) take the place of query positions."""
    b, heads, d = q.shape
    kv = k_cache.shape[1]
    qg = q.reshape(b, kv, heads // kv, d)
    mask = valid[:, None, None, :keys]
    out = torch.nn.functional.scaled_dot_product_attention(
        qg, k_cache[:, :, :keys], v_cache[:, :, :keys], attn_mask=mask, scale=scale)
    return out.reshape(b, heads * d)


def silu_mul_reference(gate_up, extra=None):
    if extra is not None:
        gate_up = gate_up + extra
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# --------------------------------------------------------------------------- triton


# Ops named here (comma-separated in QERL_DECODE_OPS_TORCH: norm, rope, silu, attention, advance) take the torch path
# on the GPU too: for bisecting a numerical difference, and for timing what the kernels save.
TORCH_ONLY = {x.strip() for x in os.environ.get("QERL_DECODE_OPS_TORCH", "").split(",") if x.strip()}


def _on_gpu(t: torch.Tensor, op: str) -> bool:
    if t.device.type != "cuda" or op in TORCH_ONLY:
        return False
    from qerl import kernels

    return kernels.available()


# Programmatic dependent launch (Hopper and later): every kernel here (and the sampling kernels)
# lets the next kernel in the stream launch as soon as all its programs run, and waits for the
# previous kernel to finish (griddepcontrol.wait) before it reads the previous kernels' outputs or
# writes anything; so launch latency and the next kernel's prologue hide behind this one's tail.
# The rollout engine turns it on for issue 4's 4-bit kernels too during decode.
# What a kernel may read before its wait: the wait only orders it after the kernel just before it,
# and every kernel of a chain triggers its successor at its start, so before the wait any earlier
# kernel of the chain may still be running. Reads before the wait are therefore limited to data no
# kernel of the current decode step writes: weights, scales, norm weights (AQN rewrites them between
# rollouts), LoRA A; and the decode state the previous step left: slot and positions (attention,
# POS / ROPE), the K / V of earlier slots (ATTN_PREFETCH). That holds because each decode step's
# first kernel (embed_rms_norm, or a torch op) is launched without PDL, so it starts only once
# everything before it finished; a graphed step starts after the previous replay anyway. Session
# 35 found the eager engine (no graphs) reading a stale slot when the step's first kernel was a PDL
# launch: two identical eager runs differed in 31 of 64 repetitions beside 7 other processes on
# the GPU (0 of 8 alone; benchmarks/NOTES_rollout.md section 30).
# bench_rollout.py --check compares rollouts with and without PDL token for token.
# Measured (H100, 7B / 14B nvfp4 batch 1): +6% / +7% tokens/s. QERL_ROLLOUT_PDL=0 turns it off.
PDL = os.environ.get("QERL_ROLLOUT_PDL", "1") == "1" and os.environ.get("TRITON_INTERPRET") != "1"


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_on(t: torch.Tensor) -> bool:
    """PDL for a launch on t's device: on, and the GPU has griddepcontrol (sm_90+)."""
    return PDL and t.device.type == "cuda" and _sm90(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    import triton
    import triton.language as tl

    import triton.language.extra.cuda  # noqa: F401  (gdc_* for PDL)
    from triton.language.extra.cuda import libdevice

    globals()["libdevice"] = libdevice
    globals()["_ROUND_EACH"] = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")

    from qerl.kernels.device_wait import wait_count

    @triton.jit
    def _pdl_enter(r_ptr, target, PDL: tl.constexpr, HAS_READY: tl.constexpr):
        # the PDL trigger and wait (see decode_ops.PDL), then a Ready's device wait; with a Ready the
        # dependents launch only after it, so none of their programs holds an SM slot while this
        # kernel waits on another stream (triggering first lost: djearly, NOTES_rollout.md section 49)
        if PDL:
            if not HAS_READY:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        if HAS_READY:
            wait_count(r_ptr, target, r_ptr, 0)  # until the producer's programs have all counted
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _signal(s_ptr, SIGNAL: tl.constexpr):
        # (Signal) count this program's stores as done, for a reader on another stream (lora_resident)
        if SIGNAL:
            tl.debug_barrier()  # every thread's stores before the release
            tl.atomic_add(s_ptr, 1, sem="release", scope="gpu")

    # the kernels below call them by name: Triton (and its interpreter) look names up in the module
    globals()["wait_count"] = wait_count
    globals()["_pdl_enter"] = _pdl_enter
    globals()["_signal"] = _signal

    @triton.jit
    def add_rms_norm_kernel(d_ptr, e_ptr, h_ptr, w_ptr, h_out, x_out, n, eps, ids_ptr, r_ptr, r_target, s_ptr,
                            HAS_DELTA: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False, W_EARLY: tl.constexpr = True, HAS_IDS: tl.constexpr = False,
                            HAS_READY: tl.constexpr = False, SIGNAL: tl.constexpr = False):
        # HAS_IDS (embed_rms_norm): h is row ids[row] of the table at h_ptr, written to h_out
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        # the norm weight is no kernel's output within a step (AQN rewrites it between steps):
        # read before the wait, so the multiply after the reduction waits on no load
        if W_EARLY:
            w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        _pdl_enter(r_ptr, r_target, PDL, HAS_READY)
        if HAS_IDS:
            h = tl.load(h_ptr + tl.load(ids_ptr + row).to(tl.int64) * n + cols, mask=m, other=0.0)
            tl.store(h_out + row * n + cols, h, mask=m)
        else:
            h = tl.load(h_ptr + row * n + cols, mask=m, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * n + cols, mask=m, other=0.0)
            if HAS_EXTRA:  # .cg: another stream may have written it just now (L1 is not coherent)
                e = tl.load(e_ptr + row * n + cols, mask=m, other=0.0, cache_modifier=".cg")
                d = (d.to(tl.float32) + e.to(tl.float32)).to(h_out.dtype.element_ty)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(h_out.dtype.element_ty)
            tl.store(h_out + row * n + cols, h, mask=m)
        f = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(f * f, axis=0) / n + eps)
        normed = (f * r).to(x_out.dtype.element_ty).to(tl.float32)
        if not W_EARLY:
            w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(x_out + row * n + cols, (w * normed).to(x_out.dtype.element_ty), mask=m)
        _signal(s_ptr, SIGNAL)

    @triton.jit
    def rope_cache_kernel(qkv_ptr, e_ptr, cos_ptr, sin_ptr, q_out, k_ptr, v_ptr, slot_ptr,
                          kc_b, kc_h, kc_l, vc_b, vc_h, vc_l,
                          HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HAS_EXTRA: tl.constexpr,
                          PDL: tl.constexpr = False):
        if PDL:  # see decode_ops.PDL
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        head = tl.program_id(1)  # 0..HEADS-1 q, then KV k heads, then KV v heads
        half = tl.arange(0, D // 2)
        offset = (row * (HEADS + 2 * KV) + head) * D
        x1 = tl.load(qkv_ptr + offset + half)
        x2 = tl.load(qkv_ptr + offset + D // 2 + half)
        slot = tl.load(slot_ptr)
        dt = q_out.dtype.element_ty
        if HAS_EXTRA:
            x1 = (x1.to(tl.float32) + tl.load(e_ptr + offset + half).to(tl.float32)).to(dt)
            x2 = (x2.to(tl.float32) + tl.load(e_ptr + offset + D // 2 + half).to(tl.float32)).to(dt)
        if head < HEADS + KV:
            c1 = tl.load(cos_ptr + row * D + half).to(tl.float32)
            c2 = tl.load(cos_ptr + row * D + D // 2 + half).to(tl.float32)
            s1 = tl.load(sin_ptr + row * D + half).to(tl.float32)
            s2 = tl.load(sin_ptr + row * D + D // 2 + half).to(tl.float32)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            o1 = (_mul_round(f1, c1, dt) + _mul_round(-f2, s1, dt)).to(dt)
            o2 = (_mul_round(f2, c2, dt) + _mul_round(f1, s2, dt)).to(dt)
            if head < HEADS:
                dst = q_out + (row * HEADS + head) * D
            else:
                dst = k_ptr + row * kc_b + (head - HEADS) * kc_h + slot * kc_l
            tl.store(dst + half, o1)
            tl.store(dst + D // 2 + half, o2)
        else:
            dst = v_ptr + row * vc_b + (head - HEADS - KV) * vc_h + slot * vc_l
            tl.store(dst + half, x1)
            tl.store(dst + D // 2 + half, x2)

    @triton.jit
    def silu_mul_kernel(gu_ptr, e_ptr, out_ptr, inter, r_ptr, r_target, s_ptr, HAS_EXTRA: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False, HAS_READY: tl.constexpr = False,
                        SIGNAL: tl.constexpr = False):
        _pdl_enter(r_ptr, r_target, PDL, HAS_READY)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(gu_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        if HAS_EXTRA:
            eg = tl.load(e_ptr + row * 2 * inter + cols, mask=m, other=0.0, cache_modifier=".cg")
            eu = tl.load(e_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0, cache_modifier=".cg")
            g = (g + eg.to(tl.float32)).to(dt).to(tl.float32)
            u = (u + eu.to(tl.float32)).to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, (s * u).to(dt), mask=m)
        _signal(s_ptr, SIGNAL)

    @triton.jit
    def _rope_rows(src_ptr, e_ptr, cos_ptr, sin_ptr, rows, d, D: tl.constexpr, HAS_EXTRA: tl.constexpr, dt):
        # rope_cache_kernel's arithmetic for rows of D at src + rows * D: bf16(bf16(x cos) + bf16(rot(x) sin)),
        # rot(x)[d] = -x[d + D/2] (d < D/2) or x[d - D/2]; `extra` added first and rounded once
        dp = (d + D // 2) % D
        x = tl.load(src_ptr + rows[:, None] * D + d[None, :])
        xp = tl.load(src_ptr + rows[:, None] * D + dp[None, :])
        if HAS_EXTRA:
            # .cg: another stream may have written `extra` just now (a Ready; L1 is not coherent)
            ex = tl.load(e_ptr + rows[:, None] * D + d[None, :], cache_modifier=".cg")
            exp_ = tl.load(e_ptr + rows[:, None] * D + dp[None, :], cache_modifier=".cg")
            x = (x.to(tl.float32) + ex.to(tl.float32)).to(dt)
            xp = (xp.to(tl.float32) + exp_.to(tl.float32)).to(dt)
        c = tl.load(cos_ptr + d).to(tl.float32)
        sn = tl.load(sin_ptr + d).to(tl.float32) * tl.where(d < D // 2, -1.0, 1.0)
        return (_mul_round(x.to(tl.float32), c[None, :], dt) + _mul_round(xp.to(tl.float32), sn[None, :], dt)).to(dt)

    @triton.jit
    def _mul_round(a, b, dt):
        # bf16(a * b) back in fp32, as torch's bf16 multiply rounds it. With the plain product the
        # compiler contracted bf16(bf16(x c) + y) into one fma.rn.bf16, skipping the product's own
        # rounding (1 ulp off torch's rotary on ~20% of elements); mul.rn is never contracted
        # (the interpreter, exact anyway, has no libdevice)
        if _ROUND_EACH:
            p = libdevice.mul_rn(a, b)
        else:
            p = a * b
        return p.to(dt).to(tl.float32)

    # the kernels below call these by name: Triton (and its interpreter) look names up in the module
    globals()["_rope_rows"] = _rope_rows
    globals()["_mul_round"] = _mul_round

    @triton.jit
    def attn_partial_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, slot_ptr, po_ptr, pm_ptr, pl_ptr,
                            kc_b, kc_h, kc_l, vc_b, vc_h, vc_l, valid_b, keys, splits, scale,
                            e_ptr, cos_ptr, sin_ptr, cnt_ptr, out_ptr, pos_ptr, lead_ptr, shared_ptr, r_ptr, r_target,
                            CHUNK: tl.constexpr,
                            KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False, EARLY_V: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                            ROPE: tl.constexpr = False, HAS_EXTRA: tl.constexpr = False, COMBINE: tl.constexpr = False,
                            POS: tl.constexpr = False, LEAD: tl.constexpr = False, SLOT_FIRST: tl.constexpr = False,
                            HAS_READY: tl.constexpr = False):
        # one (row, KV head, key chunk): the G query heads of that KV head against CHUNK keys,
        # online softmax; partial output, max and sum per query head to po / pm / pl.
        # ROPE (decode_attention_rope): q_ptr is the qkv projection [B, (KV G + 2 KV) D]; the
        # program rotates its q heads itself, and the program whose chunk holds `slot` rotates the
        # new key, writes key and value to the cache and uses them for that slot (rope_to_cache's
        # work, without its launch). COMBINE: the last of a (row, KV head)'s programs to finish
        # (counter cnt_ptr, reset by it) does attn_combine_kernel's sum for the G heads. POS: cos /
        # sin are the whole tables and row b's are at its position pos[b] (final before the step).
        # LEAD (the engine's SHARE_PROMPT_KEYS): key blocks wholly below shared[0] are read from
        # row lead[b]'s cache, not b's: rows that sample the same prompt hold the same K / V there,
        # and reading one copy lets L2 serve the group's other programs (launched next to it: b
        # varies fastest). SLOT_FIRST (ATTN_SLOT_FIRST, `slot` given): the step's new key is the online
        # softmax's first key (its score and value start m, l and acc before the block loop, which masks
        # its slot), so with ROPE the loaded K / V blocks go to the dots as loaded: selecting the new key
        # into them cost a shared-memory round trip per block, more shared memory and more registers.
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        start = s * CHUNK
        stop = tl.minimum(start + CHUNK, keys)
        if PDL and not HAS_READY:  # see decode_ops.PDL (with a Ready: after its wait, as _pdl_enter)
            tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH or ROPE or SLOT_FIRST:
            slot = tl.load(slot_ptr)
        if POS:
            crow = tl.load(pos_ptr + b).to(tl.int64)
        else:
            crow = b
        if LEAD:  # final before this step (set between generate calls and compactions)
            lead = tl.load(lead_ptr + b)
            shared = tl.load(shared_ptr).to(tl.int32)
        if PREFETCH:  # (ATTN_PREFETCH) the chunk's first K / V block read before the wait: every
            # slot but `slot` (written in this step: by the RoPE kernel, or with ROPE below) was
            # final before this step began (its first kernel starts the PDL chain: decode_ops.PDL),
            # as are slot and pos above
            n = start + tl.arange(0, BLOCK)
            old = (n < stop) & (n != slot)
            if LEAD:
                rk = tl.where(start + BLOCK <= shared, lead, b)
            else:
                rk = b
            k_pre = tl.load(k_ptr + rk * kc_b + h * kc_h + n[:, None] * kc_l + d[None, :], mask=old[:, None], other=0.0)
            v_pre = tl.load(v_ptr + rk * vc_b + h * vc_h + n[:, None] * vc_l + d[None, :], mask=old[:, None], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if HAS_READY:
            wait_count(r_ptr, r_target, r_ptr, 0)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
        if ROPE:
            dt = k_ptr.dtype.element_ty
            width = (KV * G + 2 * KV) * D
            q = _rope_rows(q_ptr + b * width, e_ptr + b * width, cos_ptr + crow * D, sin_ptr + crow * D,
                           h * G + tl.minimum(g, G - 1), d, D, HAS_EXTRA, dt)
            new = (slot >= start) & ((slot < stop) | ((s == splits - 1) & (slot >= keys)))
            if new:  # this program's chunk holds this step's slot: the new key and value, to the cache
                one = tl.zeros([1], tl.int32)
                k_new = tl.reshape(_rope_rows(q_ptr + b * width + (KV * G + h) * D, e_ptr + b * width + (KV * G + h) * D,
                                              cos_ptr + crow * D, sin_ptr + crow * D, one, d, D, HAS_EXTRA, dt), [D])
                vrow = q_ptr + b * width + (KV * G + KV + h) * D + d
                v_new = tl.load(vrow)
                if HAS_EXTRA:
                    ev = tl.load(e_ptr + b * width + (KV * G + KV + h) * D + d, cache_modifier=".cg")
                    v_new = (v_new.to(tl.float32) + ev.to(tl.float32)).to(dt)
                tl.store(k_ptr + b * kc_b + h * kc_h + slot * kc_l + d, k_new)
                tl.store(v_ptr + b * vc_b + h * vc_h + slot * vc_l + d, v_new)
            else:
                k_new = tl.zeros([D], dt)
                v_new = tl.zeros([D], dt)
        else:
            q = tl.load(q_ptr + ((b * KV + h) * G + g[:, None]) * D + d[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        if SLOT_FIRST:  # the slot as the first key, where it lies in this chunk and is valid
            if (slot >= start) & (slot < stop):
                if tl.load(valid_ptr + b * valid_b + slot) != 0:
                    if ROPE:  # the program's own new key and value
                        k_first, v_first = k_new, v_new
                    else:  # the cache's (rope_to_cache wrote them: the same bits)
                        k_first = tl.load(k_ptr + b * kc_b + h * kc_h + slot * kc_l + d)
                        v_first = tl.load(v_ptr + b * vc_b + h * vc_h + slot * vc_l + d)
                    m_i = tl.sum(q.to(tl.float32) * k_first.to(tl.float32)[None, :], axis=1) * scale
                    l_i = tl.full([GP], 1.0, tl.float32)
                    acc = tl.zeros([GP, D], tl.float32) + v_first.to(tl.float32)[None, :]
        for n0 in range(0, CHUNK, BLOCK):
            n = start + n0 + tl.arange(0, BLOCK)
            nm = n < stop
            ok = tl.load(valid_ptr + b * valid_b + n, mask=nm, other=0) != 0
            # K, and V too where it is loaded with K (ATTN_EARLY_V: not after the block's softmax;
            # PREFETCH: the first block's rows but `slot` come from the prefetch; ROPE: the slot's
            # row is the program's own k_new / v_new, never read back)
            if PREFETCH:
                fresh = nm & ((n0 > 0) | (n == slot))
            else:
                fresh = nm
            if ROPE:
                mine = n == slot
                fresh = fresh & (n != slot)
            if LEAD:  # the whole block below `shared`: the group's first row's copy
                rk = tl.where(start + n0 + BLOCK <= shared, lead, b)
            else:
                rk = b
            k = tl.load(k_ptr + rk * kc_b + h * kc_h + n[:, None] * kc_l + d[None, :], mask=fresh[:, None], other=0.0)
            if EARLY_V or PREFETCH:
                v = tl.load(v_ptr + rk * vc_b + h * vc_h + n[:, None] * vc_l + d[None, :], mask=fresh[:, None], other=0.0)
            if PREFETCH:
                k = tl.where(fresh[:, None], k, k_pre)
                v = tl.where(fresh[:, None], v, v_pre)
            if ROPE and not SLOT_FIRST:
                k = tl.where(mine[:, None], k_new[None, :], k)
            if SLOT_FIRST:  # taken before the loop
                ok = ok & (n != slot)
            sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(ok[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(sc - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if not (EARLY_V or PREFETCH):
                v = tl.load(v_ptr + rk * vc_b + h * vc_h + n[:, None] * vc_l + d[None, :], mask=fresh[:, None], other=0.0)
            if ROPE and not SLOT_FIRST:
                v = tl.where(mine[:, None], v_new[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        base = ((b * KV + h) * splits + s) * G + g
        tl.store(po_ptr + base[:, None] * D + d[None, :], acc, mask=gm[:, None])
        tl.store(pm_ptr + base, m_i, mask=gm)
        tl.store(pl_ptr + base, l_i, mask=gm)
        if COMBINE:
            tl.debug_barrier()  # every thread's partial stored before the counter's release
            done = tl.atomic_add(cnt_ptr + b * KV + h, 1, sem="acq_rel")
            if done == splits - 1:  # the last program of (b, h): the others' partials are visible
                tl.store(cnt_ptr + b * KV + h, 0)  # for the next launch (graph replays)
                # the splits' partials one at a time (a [splits, G, D] tile would spill): the
                # largest max first, then the weighted sums
                row0 = (b * KV + h) * splits * G
                big = tl.full([GP], float("-inf"), tl.float32)
                for j in range(0, splits):
                    big = tl.maximum(big, tl.load(pm_ptr + row0 + j * G + g, mask=gm, other=float("-inf"), volatile=True))
                big = tl.where(big == float("-inf"), 0.0, big)
                num = tl.zeros([GP, D], tl.float32)
                den = tl.zeros([GP], tl.float32)
                for j in range(0, splits):
                    w = tl.exp(tl.load(pm_ptr + row0 + j * G + g, mask=gm, other=float("-inf"), volatile=True) - big)
                    den += tl.load(pl_ptr + row0 + j * G + g, mask=gm, other=0.0, volatile=True) * w
                    num += tl.load(po_ptr + (row0 + j * G + g[:, None]) * D + d[None, :], mask=gm[:, None], other=0.0,
                                   volatile=True) * w[:, None]
                tl.store(out_ptr + ((b * KV + h) * G + g[:, None]) * D + d[None, :],
                         (num / den[:, None]).to(out_ptr.dtype.element_ty), mask=gm[:, None])

    @triton.jit
    def attn_combine_kernel(po_ptr, pm_ptr, pl_ptr, out_ptr, splits, s_ptr, KV: tl.constexpr, G: tl.constexpr,
                            D: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False, SIGNAL: tl.constexpr = False):
        if PDL:  # see decode_ops.PDL
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        # one (row, query head): softmax-weighted sum of the splits' partial outputs
        b = tl.program_id(0)
        head = tl.program_id(1)
        h = head // G
        g = head % G
        sp = tl.arange(0, SP)
        d = tl.arange(0, D)
        sm = sp < splits
        idx = ((b * KV + h) * splits + sp) * G + g
        m = tl.load(pm_ptr + idx, mask=sm, other=float("-inf"))
        l = tl.load(pl_ptr + idx, mask=sm, other=0.0)
        big = tl.max(m, axis=0)
        big = tl.where(big == float("-inf"), 0.0, big)
        w = tl.exp(m - big)
        o = tl.load(po_ptr + idx[:, None] * D + d[None, :], mask=sm[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + (b * KV * G + head) * D + d, out.to(out_ptr.dtype.element_ty))
        _signal(s_ptr, SIGNAL)

    @triton.jit
    def rope_rows_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, sx, H, D: tl.constexpr, HB: tl.constexpr):
        # (rotary_rows) row r's heads hb*HB.. of x (row stride sx, heads D apart) rotated with row r
        # of cos / sin, `rotary`'s roundings (_rope_rows); out [R, H, D] contiguous
        r = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * HB + tl.arange(0, HB)
        d = tl.arange(0, D)
        y = _rope_rows(x_ptr + r * sx, x_ptr, cos_ptr + r * D, sin_ptr + r * D, tl.minimum(heads, H - 1), d, D,
                       False, out_ptr.dtype.element_ty)
        tl.store(out_ptr + (r * H + heads[:, None]) * D + d[None, :], y, mask=(heads < H)[:, None])

    @triton.jit
    def advance_kernel(slot_ptr, step_ptr, valid_ptr, valid_b, rows, RB: tl.constexpr, PDL: tl.constexpr = False):
        # (advance) one program: slot += 1, step += 1, valid[r, slot] = True for rows r < rows
        if PDL:  # see decode_ops.PDL
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        slot = tl.load(slot_ptr) + 1
        tl.store(slot_ptr, slot)
        tl.store(step_ptr, tl.load(step_ptr) + 1)
        r = tl.arange(0, RB)
        tl.store(valid_ptr + r * valid_b + slot, tl.full([RB], 1, tl.int8), mask=r < rows)

    return (add_rms_norm_kernel, rope_cache_kernel, silu_mul_kernel, attn_partial_kernel, attn_combine_kernel,
            rope_rows_kernel, advance_kernel)


def _next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


# --------------------------------------------------------------------------- dispatch


# `extra` (optional, the shape of the first input) is added to it first, rounded once: the LoRA
# delta of the linear that produced it (rollout engine: computed beside the base product).


def _same_dtype(ref, *ts) -> bool:
    return all(t is None or t.dtype == ref.dtype for t in ts)


def add_rms_norm(delta, h, weight, eps, extra=None, signal=None):
    """(h + delta, RMSNorm(h + delta) * weight); delta None = no residual add (h returned as is).
    `extra` (a tensor or a Ready) is added to delta first; `signal` (a Signal): counted when written."""
    if not _on_gpu(h, "norm") or not _same_dtype(h, weight, delta, _delta(extra)):
        _no_signal(signal, "add_rms_norm")
        return add_rms_norm_reference(delta, h, weight, eps, joined(extra))
    return add_rms_norm_triton(delta, h, weight, eps, extra, signal=signal)


def embed_rms_norm(ids, table, weight, eps, signal=None, gate=None):
    """(table[ids], RMSNorm(table[ids]) * weight): the embedding lookup of the decode step's tokens
    inside the first norm's launch (no gather kernel of its own). It is the step's first kernel, so
    it starts the step's PDL chain: launched without PDL, it waits for everything before it
    (decode_ops.PDL). `gate` (a Ready, its delta unused): its counter is waited for before anything
    (the resident LoRA kernel's programs counting themselves in, so all are resident before the
    step's chain can fill the SMs with kernels that wait on them)."""
    if not _on_gpu(table, "norm") or table.dtype != weight.dtype or not table.is_contiguous():
        _no_signal(signal, "embed_rms_norm")
        if gate is not None:
            gate.join()
        return add_rms_norm_reference(None, torch.nn.functional.embedding(ids, table), weight, eps)
    kw = {"gate": gate} if gate is not None else {}
    return add_rms_norm_triton(None, table, weight, eps, ids=ids, chain_start=True, signal=signal, **kw)


def rotary_rows(x, cos, sin):
    """x [R, H, D] (unit stride in D, heads D apart, any row stride: e.g. the q or k columns of a
    q/k/v projection) rotated with cos / sin [R, D], one launch, out [R, H, D] contiguous: `rotary`
    as torch rounds it op by op (bf16(bf16(x cos) + bf16(rotate_half(x) sin))); `rotary` itself off
    the GPU."""
    d = x.shape[-1]
    if (not _on_gpu(x, "rope") or d & (d - 1) or d < 16 or x.stride(2) != 1 or x.stride(1) != d
            or not _same_dtype(x, cos, sin)):
        return rotary(x, cos[:, None], sin[:, None])
    return rotary_rows_triton(x, cos, sin)


def advance(slot, step, valid):
    """The decode state one token on: slot += 1, step += 1 (long [1] each), then valid[:, slot] =
    True ([rows, L] bool); one launch on a GPU."""
    if not _on_gpu(valid, "advance") or valid.stride(1) != 1:
        return advance_reference(slot, step, valid)
    advance_triton(slot, step, valid)


def rope_to_cache(qkv, cos, sin, k_cache, v_cache, slot, heads: int, kv_heads: int, extra=None):
    d = cos.shape[-1]
    extra = joined(extra)  # its kernel does not poll a Ready (the engine's decode uses decode_attention_rope)
    if (not _on_gpu(qkv, "rope") or not qkv.is_contiguous() or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
            or d & (d - 1) or not _same_dtype(qkv, extra)):
        return rope_to_cache_reference(qkv, cos, sin, k_cache, v_cache, slot, heads, kv_heads, extra)
    return rope_to_cache_triton(qkv, cos, sin, k_cache, v_cache, slot, heads, kv_heads, extra)


def silu_mul(gate_up, extra=None, signal=None):
    """silu(gate) * up for gate_up = [.., 2I] (gate first, as fuse.LinearGroup stacks gate/up);
    `extra` (a tensor or a Ready) is added to gate_up first; `signal`: as add_rms_norm's."""
    if _on_gpu(gate_up, "silu") and _same_dtype(gate_up, _delta(extra)):
        return silu_mul_triton(gate_up, extra, signal)
    _no_signal(signal, "silu_mul")
    return silu_mul_reference(gate_up, joined(extra))


def decode_attention_rope(qkv, cos, sin, k_cache, v_cache, slot, valid, keys: int, scale: float, heads: int,
                          kv_heads: int, extra=None, counters=None, pos=None, lead=None, shared=None, signal=None):
    """rope_to_cache then decode_attention, one kernel on a GPU (ATTN_ROPE): the attention's
    programs rotate q themselves and the one whose key chunk holds `slot` writes the new key and
    value; with `counters` (int32 zeros, >= B * kv_heads, kept at zero) the combine runs in the
    same launch (ATTN_COMBINE). With `pos` (long [B]) cos / sin are the whole [L, D] tables and
    row b takes row pos[b] of them (inside the kernel: no gather launch). With `lead` (int32 [B])
    and `shared` (long [1]), on a GPU, key blocks wholly below slot shared[0] are read from row
    lead[b] of the caches (the engine's SHARE_PROMPT_KEYS: the caller guarantees that those rows
    hold the same keys and values there; the reference path reads row b, which is then the same).
    Returns [B, heads * D], as decode_attention. `signal` (a Signal): counted as the output is
    written (the combine's programs; not with ATTN_COMBINE)."""
    d = cos.shape[-1]
    if (ATTN_ROPE and _on_gpu(qkv, "attention") and _on_gpu(qkv, "rope") and qkv.is_contiguous() and d >= 16
            and not d & (d - 1) and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and valid.is_contiguous()
            and _same_dtype(qkv, _delta(extra), k_cache, v_cache)):
        return decode_attention_rope_triton(qkv, cos, sin, k_cache, v_cache, slot, valid, keys, scale, heads,
                                            kv_heads, extra, counters, pos, lead, shared, signal)
    _no_signal(signal, "decode_attention_rope")
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    q = rope_to_cache(qkv, cos, sin, k_cache, v_cache, slot, heads, kv_heads, joined(extra))
    return decode_attention(q, k_cache, v_cache, valid, keys, scale, slot)


def decode_attention(q, k_cache, v_cache, valid, keys: int, scale: float, slot=None):
    """Attention of one query per row over cache slots [0, keys); `slot` ([1] long, optional) is the
    slot written in this step (ATTN_PREFETCH reads every other slot before the PDL wait)."""
    d = q.shape[-1]
    if (not _on_gpu(q, "attention") or d & (d - 1) or d < 16 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1
            or not valid.is_contiguous()):
        return decode_attention_reference(q, k_cache, v_cache, valid, keys, scale)
    return decode_attention_triton(q, k_cache, v_cache, valid, keys, scale, slot)


# The launches (called directly by the interpreter tests, which run them on CPU tensors).


ATTN_BLOCK = 64
ATTN_PROGRAMS = 264  # about two per SM on an H100: enough key splits to keep the chip busy
# Keys per inner step when 64-key blocks would give fewer than ATTN_PROGRAMS programs (batch 1 on
# a few KV heads: 32B at batch 1 has 8 x 8 programs at 512 keys): 32-key blocks double the
# splits. Measured (H100, 32B nvfp4 batch 1, step time): +1.2% alone, +2.5% with the GEMV's late
# PDL trigger (benchmarks/NOTES_rollout.md section 7).
ATTN_BLOCK_SMALL = 32
# At most this many key blocks per program, as long as that takes no more than 2 x ATTN_PROGRAMS
# programs: with many (row, KV head) pairs and long contexts ATTN_PROGRAMS alone leaves each
# program a long serial walk (7B at 16 rows and 2048 keys: 7 blocks of 64). Measured (H100, nvfp4
# decode step at the 2048-key bucket, same process, benchmarks/NOTES_rollout.md section 16): 7B 16
# rows 4.273 -> 3.985 ms, 32 rows 5.747 -> 5.463, 14B 8 rows 6.782 -> 6.221; at 64 rows more splits
# were 2-6% slower, hence the cap (64 rows keep theirs). Unchanged: 4 KV heads (7B) at batch 1 and
# 8 up to 2048 keys, 8 KV heads at batch 8 up to 1280, and every shape of bench_rollout.py (768
# keys at most). 0: ATTN_PROGRAMS alone.
ATTN_MAX_BLOCKS = env_int("QERL_ATTN_MAX_BLOCKS", 4)
# Key buckets up to this many keys take ATTN_BLOCK_SMALL-key blocks where those keep to ATTN_PROGRAMS
# programs of at most ATTN_MAX_BLOCKS blocks, and read their first block before the PDL wait
# (`attention_prefetch`): shorter serial walks, and half the registers held through the wait.
# Measured (H100, nvfp4 decode steps, same process, against 64-key blocks without the prefetch,
# benchmarks/NOTES_rollout.md section 23): 7B batch 8 at 512 / 768 keys +4.0% / +4.7%, 14B batch 8
# +1.2%, 32B batch 1 / 8 +1.1% / +1.8%, 7B / 14B batch 1 +1.8% / +1.2% (the prefetch alone); 7B batch 64
# +-0 (it keeps 64-key blocks by the rule); at 2048 keys the same change was 1.1-1.2% slower (7B batch
# 8 / 16), hence the bound.
ATTN_SHORT_KEYS = 1024
# Load each key block's V together with its K (two DRAM round trips in flight, not one after the
# other). Measured (H100, 14B nvfp4, medians of 3 interleaved rounds): batch 1 +0.7%, batch 8 +2.1%,
# within the call's drift (benchmarks/NOTES_rollout.md section 9), so off unless QERL_ATTN_EARLY_V=1.
ATTN_EARLY_V = os.environ.get("QERL_ATTN_EARLY_V", "0") == "1"
# With the step's cache slot given (the engine's decode): each program reads its first K / V block,
# all but that slot, before its PDL wait (they were final before the step began), so the DRAM
# round trip overlaps the kernels before it; the slot's row (this step's RoPE writes it) after.
# None = `attention_prefetch` (short key buckets in small blocks); QERL_ATTN_PREFETCH=1 / 0 forces it
# on / off. Session 10 (an older chain): 14B batch 8 +2.0%, 14B / 32B batch 1 +-0.
ATTN_PREFETCH = {"1": True, "0": False}.get(os.environ.get("QERL_ATTN_PREFETCH", ""))
# The decode step's GEMM inputs (the norms' outputs, the attention's, SiLU's) as the first rows of buffers of whole
# ROW_TILE-row tiles, so that rwg's XROWS (w4a16_rwg.XROWS) can read a whole last token tile from storage instead
# of a zero-filled TMA box past the rows (NOTES_w4a16.md section 53: a 64-token tile at 40 tokens ran 40% longer
# than at 64). The rows past M are never read back. 0: buffers of exactly M rows (ablation `noxrows`; the default
# since session 79: 14B 40-row decode step 11.013 -> 9.861 ms, NOTES_w4a16.md section 54).
ROW_TILE = env_int("QERL_DECODE_ROW_TILE", 64)
# Below this many rows the step's GEMMs are Gluon GEMVs (w4a16_triton.FRAG_GEMV_MAX_M = 8), which read x's own rows
# only, so their inputs stay exactly M rows: the batch-1 / batch-8 decode is the one measured before ROW_TILE.
ROW_TILE_MIN_ROWS = 9


def gemm_input(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(rows, cols); with ROW_TILE, from ROW_TILE_MIN_ROWS rows, the first `rows` rows of a buffer of
    whole ROW_TILE-row tiles."""
    if ROW_TILE and rows >= ROW_TILE_MIN_ROWS and rows % ROW_TILE:
        return torch.empty(-(-rows // ROW_TILE) * ROW_TILE, cols, dtype=dtype, device=device)[:rows]
    return torch.empty(rows, cols, dtype=dtype, device=device)


# The RMSNorm kernel reads its weight before the PDL wait (no kernel of a step writes it; AQN
# rewrites it between steps), so nothing after the reduction waits on a load. False: after the
# reduction (the A/B switch of benchmarks/NOTES_rollout.md section 10).
NORM_W_EARLY = True
# RoPE (q, and the new key to the cache) done inside the attention kernel's programs instead of
# its own launch before it (decode_attention_rope), and the split combine done by the last program
# of each (row, KV head) instead of a second launch after it: two kernels fewer per layer on the
# decode chain (benchmarks/NOTES_rollout.md section 14). ATTN_ROPE measured (H100, 7B nvfp4, same
# process): +0.9% at batch 1, +1.5% at batch 8. ATTN_COMBINE: its first form (all splits' partials
# as one [splits, G, D] tile) was 15% slower at batch 8, and the split-by-split form that replaced
# it 5.6% slower at batch 1 and 2.8% at batch 8 (the last program's serial sum costs more than the
# launch it saves), so it stays off unless QERL_ATTN_COMBINE=1. False: separate launches (the A/B
# switches).
ATTN_ROPE = True
ATTN_COMBINE = os.environ.get("QERL_ATTN_COMBINE", "0") == "1"
# Warps per attention program, and Triton's software-pipelining depth for its key loop (QERL_ATTN_STAGES;
# None or 0: Triton's default, 3 on Hopper). Two stages hold 38 KB of shared memory instead of 70 KB and
# 128-138 registers instead of 143-148 (sm_90 builds without the engine's LEAD, `probe_attention.py
# --compile-only`; with LEAD 141-144, hence ATTN_MAXNREG below), so 3-4 programs fit an SM instead of 3. Measured (H200, the attention alone with ATTN_SLOT_FIRST,
# benchmarks/probe_attention.py, 7B / 14B at 8 / 32 / 64 rows x 512 / 1280 / 2048 keys): never more than
# 1% slower than three, 17-24% less time at 2048 keys from 32 rows (14B 32 rows 92.0 -> 71.5 us). In the 7B
# 32-row decode step: +1.3% at 1280 keys, -0.8% at 2048 (one round) (NOTES_rollout.md section 42). Not
# measured on the H100.
ATTN_WARPS = 4
ATTN_STAGES: int | None = env_int("QERL_ATTN_STAGES", 2) or None
# A register cap for the RoPE form's programs (ATTN_ROPE) on the plans of ATTN_BLOCK-key blocks without the
# prefetch that launch more programs than one wave holds at ATTN_UNCAPPED_PER_SM per SM (None or 0: ptxas's
# choice everywhere).
# Residency is what the attention's speed follows (benchmarks/probe_attention.py --compile-only,
# NOTES_rollout.md section 43): at 4 warps, with the engine's LEAD (SHARE_PROMPT_KEYS), the RoPE form takes
# 141-144 registers on those plans (3 programs per SM); capped at 128, 4 per SM, with no stack or 16 B of it (at
# 3 / 5 / 10 / 20 blocks per program). Where the launch fits one wave at 3 per SM the cap only costs (the
# attention alone 2-4% slower at 7B 8 rows x 1280 / 2048 keys, 224 / 256 programs; the 7B 8-row step -3.7%).
# Left uncapped: the 32-key-block plans (batch 1: 72-124 registers, which the cap would raise to ~100; the
# prefetch path: 168-217, where the cap spills 64-128 B and the attention alone ran 11-13% slower at 8 rows x
# 512 keys). Measured (H200, the 512-program launches): the attention alone never slower beyond the probe's ~2.6%
# noise, up to 27% less time (7B 64 rows x 2048 keys 99.9 -> 72.8 us, 14B 64 rows x 1280 115.5 -> 88.5, 7B 32 rows
# x 1280 36.2 -> 30.5); the decode step (benchmarks/ablate_rollout.py, `anr0` is the uncapped form) 7B 32 rows x
# 1280 keys +5.0% (LoRA on +4.1%), 14B 32 rows x 2048 keys +14.0%, 14B 16 rows x 1280 keys with LoRA +4.7%
# (NOTES_rollout.md sections 43-44). Not measured on the H100. QERL_ATTN_MAXNREG=0: off.
ATTN_MAXNREG: int | None = env_int("QERL_ATTN_MAXNREG", 128) or None
ATTN_UNCAPPED_PER_SM = 3  # the uncapped builds' programs per SM on those plans (sm_90, 4 warps, 38 KB)
# The step's new key (its cache slot given) taken as the online softmax's first key, before the block loop,
# instead of (with RoPE inside the attention, ATTN_ROPE) selected into its loaded K / V block. That select
# between load and dot took each block through registers and back to shared memory: 16 KB more shared memory
# and 185 registers instead of 143-148 (sm_90 builds at three stages), 2 programs per SM instead of 3, so
# fewer K / V loads in flight. The launch without RoPE takes the slot first too (reading it from the cache),
# so both launches still give the same bits. Measured (H200, the attention alone, benchmarks/probe_attention.py,
# NOTES_rollout.md section 42): 7B 32 rows x 1280 keys 42.7 -> 37.3 us, 14B 8 rows x 1280 keys 29.4 -> 20.1 us;
# the 7B 32-row decode step +3.6%. False: the select (the form before session 47; QERL_ATTN_SLOT_FIRST=0).
ATTN_SLOT_FIRST = os.environ.get("QERL_ATTN_SLOT_FIRST", "1") == "1"


def attention_launch_options(block: int | None = None, prefetch: bool = False, programs: int | None = None,
                             sms: int = 132, rope: bool = True) -> dict:
    """Triton launch options of the attention's partial kernel beyond num_warps: ATTN_STAGES, and ATTN_MAXNREG
    for the RoPE form on plans of ATTN_BLOCK-key blocks (block None: ATTN_BLOCK) without the prefetch whose
    programs (None: many) overrun one wave of ATTN_UNCAPPED_PER_SM per SM on `sms` SMs. (The launch without
    RoPE builds at 87-110 registers there, 4-5 per SM; capped, ptxas takes all 128.)"""
    opts = {} if ATTN_STAGES is None else {"num_stages": ATTN_STAGES}
    capped = (ATTN_MAXNREG is not None and rope and (block is None or block == ATTN_BLOCK) and not prefetch
              and (programs is None or programs > ATTN_UNCAPPED_PER_SM * sms))
    return {**opts, "maxnreg": ATTN_MAXNREG} if capped else opts


def partial_constexprs(rows: int, kv: int, group: int, d: int, keys: int, slot_given: bool, rope: bool = False,
                       extra: bool = False, combine: bool = False, pos: bool = False, lead: bool = False,
                       pdl: bool = False, sms: int = 132) -> tuple[int, dict]:
    """(splits, the constexpr arguments and launch options of the attention's partial kernel) for one launch on
    a device of `sms` SMs: attention_splits' plan and this module's switches. benchmarks/probe_attention.py
    --compile-only builds from the same dict."""
    block, chunk, splits = attention_splits(rows, kv, keys)
    prefetch = slot_given and attention_prefetch(block, keys)
    return splits, dict(CHUNK=chunk, KV=kv, G=group, GP=max(16, _next_pow2(group)), D=d, BLOCK=block,
                        num_warps=ATTN_WARPS, PDL=pdl, EARLY_V=ATTN_EARLY_V,
                        PREFETCH=prefetch, ROPE=rope, HAS_EXTRA=extra,
                        COMBINE=combine, POS=rope and pos, LEAD=lead, SLOT_FIRST=slot_given and ATTN_SLOT_FIRST,
                        **attention_launch_options(block, prefetch, rows * kv * splits, sms, rope))


def attention_splits(rows: int, kv: int, keys: int) -> tuple[int, int, int]:
    """(key block, keys per program, programs per (row, KV head)) of the split decode attention:
    ~ATTN_PROGRAMS programs in all, more where that leaves a program over ATTN_MAX_BLOCKS blocks
    (up to 2 x ATTN_PROGRAMS). Blocks of ATTN_BLOCK_SMALL keys where ATTN_BLOCK-key blocks give
    fewer than ATTN_PROGRAMS programs, and on key buckets up to ATTN_SHORT_KEYS where the small
    blocks keep to ATTN_PROGRAMS programs of at most ATTN_MAX_BLOCKS blocks."""
    pairs = rows * kv
    if pairs * -(-keys // ATTN_BLOCK) < ATTN_PROGRAMS:
        return _split_plan(pairs, keys, ATTN_BLOCK_SMALL)
    if keys <= ATTN_SHORT_KEYS:
        small = _split_plan(pairs, keys, ATTN_BLOCK_SMALL)
        if small[1] <= max(1, ATTN_MAX_BLOCKS) * ATTN_BLOCK_SMALL and pairs * small[2] <= ATTN_PROGRAMS:
            return small
    return _split_plan(pairs, keys, ATTN_BLOCK)


def _split_plan(pairs: int, keys: int, block: int) -> tuple[int, int, int]:
    blocks = -(-keys // block)
    want = -(-ATTN_PROGRAMS // pairs)
    if ATTN_MAX_BLOCKS > 0:
        want = max(want, min(-(-blocks // ATTN_MAX_BLOCKS), 2 * ATTN_PROGRAMS // pairs))
    splits = max(1, min(blocks, want))
    chunk = -(-blocks // splits) * block
    return block, chunk, -(-keys // chunk)


def attention_prefetch(block: int, keys: int) -> bool:
    """ATTN_PREFETCH = None: read the first K / V block before the PDL wait on key buckets up to
    ATTN_SHORT_KEYS in ATTN_BLOCK_SMALL-key blocks (`attention_splits`). With 64-key blocks it lost
    (14B batch 8 -3.2%, 7B batch 64 -7.5%: twice the registers held through the wait)."""
    if ATTN_PREFETCH is not None:
        return ATTN_PREFETCH
    return keys <= ATTN_SHORT_KEYS and block == ATTN_BLOCK_SMALL


def decode_attention_triton(q, k_cache, v_cache, valid, keys: int, scale: float, slot=None):
    """Flash-decoding: the keys split over programs (partial softmax each), then one combine."""
    return _attention_launch(q, q.shape[1], k_cache, v_cache, valid, keys, scale, slot)


def decode_attention_rope_triton(qkv, cos, sin, k_cache, v_cache, slot, valid, keys: int, scale: float,
                                 heads: int, kv_heads: int, extra=None, counters=None, pos=None, lead=None, shared=None,
                                 signal=None):
    """rope_to_cache + decode_attention as one launch (ATTN_ROPE); with ATTN_COMBINE and
    `counters` (int32 [>= B * KV], zeros; left at zero) the combine rides in it too; `pos`, `lead`,
    `shared`: decode_attention_rope's."""
    d = cos.shape[-1]
    extra, flag, target, ready = _ready_args(extra, qkv)
    rope = (qkv.contiguous(), extra.contiguous() if extra is not None else None, cos.contiguous(), sin.contiguous())
    return _attention_launch(qkv.view(qkv.shape[0], heads + 2 * kv_heads, d), heads, k_cache, v_cache, valid, keys,
                             scale, slot, rope, counters if ATTN_COMBINE else None, pos, lead, shared, (flag, target, ready),
                             signal)


def _attention_launch(q, heads: int, k_cache, v_cache, valid, keys: int, scale: float, slot=None, rope=None,
                      counters=None, pos=None, lead=None, shared=None, ready=None, signal=None):
    from qerl.kernels.w4a16_triton import _num_sms

    if signal is not None and counters is not None:
        raise ValueError("decode_ops: a Signal is counted by the combine kernel, which ATTN_COMBINE leaves out")

    partial, combine = _triton_kernels()[3:5]
    b, d = q.shape[0], q.shape[2]
    kv = k_cache.shape[1]
    group = heads // kv
    q = q.contiguous()
    qkv, e, cos, sin = rope if rope is not None else (q, None, q, q)
    use_lead = lead is not None and shared is not None
    if not use_lead:  # placeholders the kernel does not read
        lead = shared = valid
    splits, consts = partial_constexprs(b, kv, group, d, keys, slot is not None, rope=rope is not None,
                                        extra=e is not None, combine=counters is not None, pos=pos is not None,
                                        lead=use_lead, pdl=pdl_on(q), sms=_num_sms(q.device.index or 0))
    po = torch.empty(b, kv, splits, group, d, dtype=torch.float32, device=q.device)
    pm = torch.empty(b, kv, splits, group, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    out = gemm_input(b, heads * d, q.dtype, q.device)
    sp = max(2, _next_pow2(splits))
    # (the RoPE launch always has its slot; a placeholder where none is given, which the kernel then does not read)
    partial[(b, kv, splits)](qkv, k_cache, v_cache, valid, slot if slot is not None else valid, po, pm, pl,
                             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), valid.stride(0),
                             keys, splits, float(scale), e if e is not None else qkv, cos, sin,
                             counters if counters is not None else valid, out, pos if pos is not None else valid,
                             lead, shared, *(ready or (valid, 0, False))[:2],
                             HAS_READY=bool(ready and ready[2] and e is not None),
                             launch_pdl=pdl_on(q), **consts)
    if counters is None:
        s_flag, s_on = _signal_args(signal, pm, b * heads)
        combine[(b, heads)](po, pm, pl, out, splits, s_flag, KV=kv, G=group, D=d, SP=sp, num_warps=1,
                            PDL=pdl_on(q), SIGNAL=s_on, launch_pdl=pdl_on(q))
    return out


def add_rms_norm_triton(delta, h, weight, eps, extra=None, ids=None, chain_start=False, signal=None, gate=None):
    """add_rms_norm's kernel; with `ids` (long [B]) h is the embedding table and row b is its
    row ids[b] (embed_rms_norm): returns (those rows, their norm). chain_start: launched without
    the PDL attribute (the first kernel of a decode step: it starts once everything before it has
    finished), while still letting the next kernel launch early."""
    kern = _triton_kernels()[0]
    n = h.shape[-1]
    h2 = h.reshape(-1, n).contiguous()
    d2 = delta.reshape(-1, n).contiguous() if delta is not None else h2
    extra, flag, target, ready = _ready_args(extra, h2)
    e2 = extra.reshape(-1, n).contiguous() if extra is not None else d2
    rows = h2.shape[0] if ids is None else ids.shape[0]
    h_out = torch.empty(rows, n, dtype=h2.dtype, device=h2.device) if delta is not None or ids is not None else h2
    x_out = gemm_input(rows, n, h_out.dtype, h_out.device)
    block = _next_pow2(n)
    pdl = pdl_on(h2)  # chain_start: still triggers its successor early; nothing for its wait to wait on
    has_extra = delta is not None and extra is not None
    has_ready = bool(ready and has_extra)
    if gate is not None:  # (embed_rms_norm) the kernel's one wait is the gate's
        if has_ready:
            raise ValueError("decode_ops: a norm waits on a gate or on a Ready delta, not both")
        flag, target, has_ready = gate.flag, int(gate.target), True
    s_flag, s_on = _signal_args(signal, flag, rows)
    kern[(rows,)](d2, e2, h2, weight, h_out, x_out, n, float(eps), ids if ids is not None else h2, flag, target, s_flag,
                  HAS_DELTA=delta is not None, HAS_EXTRA=has_extra,
                  BLOCK=block, num_warps=min(16, max(1, block // 256)), PDL=pdl, W_EARLY=NORM_W_EARLY,
                  HAS_IDS=ids is not None, HAS_READY=has_ready,
                  SIGNAL=s_on, launch_pdl=pdl and not chain_start)
    if ids is not None:
        return h_out, x_out
    return h_out.view(h.shape), x_out.view(h.shape)


def rope_to_cache_triton(qkv, cos, sin, k_cache, v_cache, slot, heads: int, kv_heads: int, extra=None):
    kern = _triton_kernels()[1]
    b, d = qkv.shape[0], cos.shape[-1]
    q = torch.empty(b, heads, d, dtype=qkv.dtype, device=qkv.device)
    e = extra.contiguous() if extra is not None else qkv
    kern[(b, heads + 2 * kv_heads)](qkv, e, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache, slot,
                                    k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                    v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                    HEADS=heads, KV=kv_heads, D=d, HAS_EXTRA=extra is not None, num_warps=1,
                                    PDL=pdl_on(qkv), launch_pdl=pdl_on(qkv))
    return q


def rotary_rows_triton(x, cos, sin):
    r, h, d = x.shape
    out = torch.empty(r, h, d, dtype=x.dtype, device=x.device)
    hb = min(8, _next_pow2(h))
    _triton_kernels()[5][(r, -(-h // hb))](x, cos.contiguous(), sin.contiguous(), out, x.stride(0), h, D=d, HB=hb,
                                           num_warps=4)
    return out


def advance_triton(slot, step, valid):
    rows = valid.shape[0]
    _triton_kernels()[6][(1,)](slot, step, valid.view(torch.int8), valid.stride(0), rows,
                               RB=max(2, _next_pow2(rows)), num_warps=1, PDL=pdl_on(valid), launch_pdl=pdl_on(valid))


def silu_mul_triton(gate_up, extra=None, signal=None):
    kern = _triton_kernels()[2]
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter).contiguous()
    extra, flag, target, ready = _ready_args(extra, gu)
    e = extra.reshape(-1, 2 * inter).contiguous() if extra is not None else gu
    out = gemm_input(gu.shape[0], inter, gu.dtype, gu.device)
    block = 1024
    grid = (gu.shape[0], -(-inter // block))
    s_flag, s_on = _signal_args(signal, flag, grid[0] * grid[1])
    kern[grid](gu, e, out, inter, flag, target, s_flag, HAS_EXTRA=extra is not None, BLOCK=block, num_warps=4,
               PDL=pdl_on(gu), HAS_READY=ready, SIGNAL=s_on, launch_pdl=pdl_on(gu))
    return out.view(*gate_up.shape[:-1], inter)
