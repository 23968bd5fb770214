"""qerl.kernels.decode_ops: the Triton kernels (run by Triton's interpreter in a subprocess, on
CPU float32 tensors) against their torch references on fresh random inputs (decode attention: the
split-K kernel against torch's SDPA with the key mask), and the references against Hugging Face's
own modules (RMSNorm, apply_rotary_pos_emb, the SwiGLU MLP gate).

float32 in the interpreter (its bf16 arithmetic works on raw bits and truncates); the bf16
rounding points are exercised on the GPU by benchmarks/bench_rollout.py --check. Tolerance 1e-5:
fp32 arithmetic with a different summation order in the norm.
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from interpreted import run_interpreted
from qerl.kernels import decode_ops as ops

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from qerl.kernels import decode_ops as ops
    torch.manual_seed(int(__import__("os").environ.get("SEED", "0")))
    out = []
    def err(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    for rows, n in ((1, 64), (3, 96), (2, 576)):
        h, d, w = torch.randn(rows, n), torch.randn(rows, n), torch.rand(n) + 0.5
        e = torch.randn(rows, n) * 0.1
        for delta, extra in ((d, None), (None, None), (d, e)):
            h_t, x_t = ops.add_rms_norm_triton(delta, h, w, 1e-6, extra)
            h_r, x_r = ops.add_rms_norm_reference(delta, h, w, 1e-6, extra)
            out.append(("norm", rows, n, delta is None, max(err(h_t, h_r), err(x_t, x_r))))
    for b, heads, kv, dim in ((1, 4, 2, 16), (3, 6, 2, 32), (2, 4, 4, 64)):
        qkv = torch.randn(b, (heads + 2 * kv) * dim)
        ang = torch.rand(b, dim // 2) * 6.28
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        kc_t, vc_t = torch.randn(b + 1, kv, 10, dim), torch.randn(b + 1, kv, 10, dim)
        kc_r, vc_r = kc_t.clone(), vc_t.clone()
        slot = torch.tensor([7])
        extra = torch.randn_like(qkv) if heads == 6 else None
        q_t = ops.rope_to_cache_triton(qkv, cos, sin, kc_t[:b], vc_t[:b], slot, heads, kv, extra)
        q_r = ops.rope_to_cache_reference(qkv, cos, sin, kc_r[:b], vc_r[:b], slot, heads, kv, extra)
        out.append(("rope", b, heads, kv, max(err(q_t, q_r), err(kc_t, kc_r), err(vc_t, vc_r))))
    for rows, inter in ((1, 128), (5, 1500)):
        gu = torch.randn(rows, 2 * inter) * 3
        e = torch.randn_like(gu) if rows == 5 else None
        out.append(("silu", rows, inter, 0, err(ops.silu_mul_triton(gu, e), ops.silu_mul_reference(gu, e))))
    cases = ((1, 4, 2, 16, 300, 200), (3, 6, 2, 32, 130, 130), (2, 5, 1, 16, 70, 9))
    # the small-batch 32-key blocks, the 64-key blocks, V loaded with K, the first block prefetched
    for small, early_v, prefetch in ((32, False, False), (64, False, False), (32, True, False), (32, False, True),
                                     (64, False, True)):
        ops.ATTN_BLOCK_SMALL, ops.ATTN_EARLY_V, ops.ATTN_PREFETCH = small, early_v, prefetch
        for b, heads, kv, dim, length, keys in cases:
            q = torch.randn(b, heads, dim)
            kc, vc = torch.randn(b + 1, kv, length, dim), torch.randn(b + 1, kv, length, dim)
            valid = torch.rand(b + 1, length) > 0.3
            valid[:, 0] = True
            slot = torch.tensor([keys // 2])
            got = ops.decode_attention_triton(q, kc[:b], vc[:b], valid[:b], keys, dim ** -0.5, slot)
            ref = ops.decode_attention_reference(q, kc[:b], vc[:b], valid[:b], keys, dim ** -0.5)
            out.append(("attention", b, heads, keys, small, early_v, prefetch, err(got, ref)))
    # RoPE inside the attention kernel: output and caches against rope_to_cache_reference + the
    # attention reference, with and without the prefetch. The combine inside it (ATTN_COMBINE) is
    # covered on the GPU only (test_rollout_kernels_gpu): Triton's interpreter cannot run its loop
    # over the runtime split count. With it off, counters passed in must stay untouched.
    # ATTN_SLOT_FIRST off: the slot's key and value selected into the loaded blocks (the form before)
    ops.ATTN_BLOCK_SMALL, ops.ATTN_COMBINE = 32, False
    # ATTN_PROGRAMS 2: chunks of several blocks, so the slot can sit in a block after the prefetched one
    for prefetch, with_counters, slot_first, programs in ((False, False, True, 264), (True, True, True, 264),
                                                          (False, True, True, 264), (False, False, False, 264),
                                                          (True, False, False, 264), (True, False, True, 2),
                                                          (False, False, True, 2)):
        ops.ATTN_PREFETCH, ops.ATTN_SLOT_FIRST, ops.ATTN_PROGRAMS = prefetch, slot_first, programs
        for b, heads, kv, dim, length, keys in cases:
            qkv = torch.randn(b, (heads + 2 * kv) * dim)
            extra = torch.randn_like(qkv) * 0.1 if heads == 6 else None
            ang = torch.rand(b, dim // 2) * 6.28
            cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
            kc_t, vc_t = torch.randn(b + 1, kv, length, dim), torch.randn(b + 1, kv, length, dim)
            kc_r, vc_r = kc_t.clone(), vc_t.clone()
            valid = torch.rand(b + 1, length) > 0.3
            valid[:, 0] = True
            slot = torch.tensor([keys - 1 if heads == 4 else keys // 3])
            valid[:, slot] = True
            cnt = torch.zeros(b * kv + 3, dtype=torch.int32) if with_counters else None
            got = ops.decode_attention_rope_triton(qkv, cos, sin, kc_t[:b], vc_t[:b], slot, valid[:b], keys,
                                                   dim ** -0.5, heads, kv, extra, cnt)
            q = ops.rope_to_cache_reference(qkv, cos, sin, kc_r[:b], vc_r[:b], slot, heads, kv, extra)
            ref = ops.decode_attention_reference(q, kc_r[:b], vc_r[:b], valid[:b], keys, dim ** -0.5)
            zero = 0.0 if cnt is None or not cnt.any() else 1.0
            out.append(("attention_rope", b, heads, keys, prefetch, with_counters, slot_first, programs,
                        ops.attention_splits(b, kv, keys)[1], max(err(got, ref), err(kc_t, kc_r), err(vc_t, vc_r), zero)))
    ops.ATTN_SLOT_FIRST, ops.ATTN_PROGRAMS = True, 264
    # the same with cos / sin as whole tables read at each row's position (pos)
    for b, heads, kv, dim, length, keys in cases[:2]:
        qkv = torch.randn(b, (heads + 2 * kv) * dim)
        ang = torch.rand(40, dim // 2) * 6.28
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        pos = torch.randint(0, 40, (b,))
        kc_t, vc_t = torch.randn(b, kv, length, dim), torch.randn(b, kv, length, dim)
        kc_r, vc_r = kc_t.clone(), vc_t.clone()
        valid = torch.rand(b, length) > 0.3
        valid[:, 0] = True
        slot = torch.tensor([keys // 3])
        valid[:, slot] = True
        got = ops.decode_attention_rope_triton(qkv, cos, sin, kc_t, vc_t, slot, valid, keys, dim ** -0.5, heads, kv,
                                               pos=pos)
        q = ops.rope_to_cache_reference(qkv, cos[pos], sin[pos], kc_r, vc_r, slot, heads, kv)
        ref = ops.decode_attention_reference(q, kc_r, vc_r, valid, keys, dim ** -0.5)
        out.append(("attention_rope_pos", b, heads, keys, max(err(got, ref), err(kc_t, kc_r), err(vc_t, vc_r))))
    # LEAD (the engine's SHARE_PROMPT_KEYS): key blocks wholly below `shared` come from row lead[b].
    # The other rows' copies of those blocks are garbage here, so a read of them would show; the
    # result must equal the reference over caches where every row holds its lead's keys there
    # (shared 64: block-aligned; 45 and 100: a block straddles it and is read from the row's own copy)
    ops.ATTN_PREFETCH = None
    for prefetch in (False, True):
        ops.ATTN_PREFETCH = prefetch
        for b, heads, kv, dim, length, keys, lead, shared in ((4, 4, 2, 16, 200, 160, [0, 0, 2, 2], 64),
                                                              (3, 6, 2, 32, 140, 130, [0, 0, 0], 45),
                                                              (5, 4, 1, 16, 300, 256, [0, 0, 0, 3, 3], 100)):
            lead_t, shared_t = torch.tensor(lead, dtype=torch.int32), torch.tensor([shared])
            qkv = torch.randn(b, (heads + 2 * kv) * dim)
            ang = torch.rand(b, dim // 2) * 6.28
            cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
            kc_r, vc_r = torch.randn(b, kv, length, dim), torch.randn(b, kv, length, dim)
            kc_r[:, :, :shared], vc_r[:, :, :shared] = kc_r[lead_t.long(), :, :shared], vc_r[lead_t.long(), :, :shared]
            block = ops.attention_splits(b, kv, keys)[0]
            whole = shared // block * block
            kc_t, vc_t = kc_r.clone(), vc_r.clone()
            others = torch.tensor([r for r in range(b) if lead[r] != r])
            kc_t[others, :, :whole], vc_t[others, :, :whole] = torch.randn(len(others), kv, whole, dim) * 5, torch.randn(len(others), kv, whole, dim) * 5
            valid = torch.rand(b, length) > 0.3
            valid[:, :shared] = valid[lead_t.long(), :shared]
            valid[:, 0] = True
            slot = torch.tensor([keys - 3])
            valid[:, slot] = True
            got = ops.decode_attention_rope_triton(qkv, cos, sin, kc_t, vc_t, slot, valid, keys, dim ** -0.5, heads, kv,
                                                   lead=lead_t, shared=shared_t)
            q = ops.rope_to_cache_reference(qkv, cos, sin, kc_r, vc_r, slot, heads, kv)
            ref = ops.decode_attention_reference(q, kc_r, vc_r, valid, keys, dim ** -0.5)
            out.append(("attention_lead", b, heads, keys, prefetch, shared,
                        max(err(got, ref), err(kc_t[:, :, whole:], kc_r[:, :, whole:]),
                            err(vc_t[:, :, whole:], vc_r[:, :, whole:]))))
    # the embedding lookup inside the norm, RoPE over rows of heads (a strided view), the advance
    table, w = torch.randn(50, 96), torch.rand(96) + 0.5
    ids = torch.tensor([3, 49, 0, 3])
    h_t, x_t = ops.add_rms_norm_triton(None, table, w, 1e-6, ids=ids)
    h_r, x_r = ops.add_rms_norm_reference(None, table[ids], w, 1e-6)
    out.append(("embed_norm", 4, 96, 0, max(err(h_t, h_r), err(x_t, x_r))))
    for rows, heads, dim in ((6, 5, 16), (3, 8, 32)):
        qkv = torch.randn(rows, (heads + 3) * dim)
        x = qkv.view(rows, heads + 3, dim)[:, 1:heads + 1]
        ang = torch.rand(rows, dim // 2) * 6.28
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        out.append(("rotary_rows", rows, heads, dim,
                    err(ops.rotary_rows_triton(x, cos, sin), ops.rotary(x, cos[:, None], sin[:, None]))))
    slot, step = torch.tensor([4]), torch.tensor([9])
    valid = torch.zeros(5, 12, dtype=torch.bool)
    ops.advance_triton(slot, step, valid[:3])
    want = torch.zeros(5, 12, dtype=torch.bool)
    want[:3, 5] = True
    out.append(("advance", 3, 12, 0, float(slot.item() != 5 or step.item() != 10 or not torch.equal(valid, want))))
    print("RESULTS" + json.dumps(out))
    """
)


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_decode_ops_under_interpreter(seed):
    results = run_interpreted(_SCRIPT, seed)
    assert len(results) == 62
    bad = [r for r in results if not r[-1] <= 1e-5]
    assert not bad, bad


def test_references_equal_hugging_face_modules():
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb
    from transformers import LlamaConfig

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        h, d = torch.randn(4, 96, dtype=dtype), torch.randn(4, 96, dtype=dtype)
        h_sum, x = ops.add_rms_norm(d, h, norm.weight.detach(), 1e-5)
        assert torch.equal(h_sum, h + d)
        assert torch.equal(x, norm(h + d))
        q = torch.randn(3, 4, 32, dtype=dtype)  # [B, heads, D], one token per row
        ang = torch.rand(3, 16) * 6.28
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
        hf_q, _ = apply_rotary_pos_emb(q[:, :, None], q[:, :, None], cos[:, None], sin[:, None])
        assert torch.equal(ops.rope_reference(q, cos, sin), hf_q[:, :, 0])
        mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48)).to(dtype)
        x = torch.randn(5, 32, dtype=dtype)
        gu = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)
        with torch.no_grad():  # HF's SiLU module vs F.silu: last-bit differences in float32
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
            torch.testing.assert_close(mlp.down_proj(ops.silu_mul(gu)), mlp(x), **tol)


def test_attention_splits_rule(monkeypatch):
    """The split decode attention's key splits (attention_splits): ~ATTN_PROGRAMS programs; where
    that leaves a program more than ATTN_MAX_BLOCKS key blocks, more splits, up to 2 x ATTN_PROGRAMS
    programs (the shapes measured in benchmarks/NOTES_rollout.md section 16: 7B has 4 KV heads,
    14B 8)."""
    monkeypatch.setattr(ops, "ATTN_PROGRAMS", 264)
    monkeypatch.setattr(ops, "ATTN_BLOCK", 64)
    monkeypatch.setattr(ops, "ATTN_BLOCK_SMALL", 32)
    monkeypatch.setattr(ops, "ATTN_MAX_BLOCKS", 4)
    monkeypatch.setattr(ops, "ATTN_SHORT_KEYS", 0)  # the short-bucket rule: test_attention_short_buckets
    # (rows, kv, keys) -> (block, keys per program, splits)
    assert ops.attention_splits(16, 4, 2048) == (64, 256, 8)  # was 5 splits of 448 keys
    assert ops.attention_splits(32, 4, 2048) == (64, 512, 4)  # capped at 528 programs
    assert ops.attention_splits(8, 8, 2048) == (64, 256, 8)
    assert ops.attention_splits(64, 4, 2048) == (64, 1024, 2)  # the cap keeps the old split
    assert ops.attention_splits(64, 8, 512) == (64, 512, 1)
    assert ops.attention_splits(8, 4, 512) == (32, 64, 8)  # unchanged where walks are short
    assert ops.attention_splits(1, 4, 512) == (32, 32, 16)
    for rows, kv, keys in ((1, 4, 2048), (8, 4, 2048), (8, 4, 1024), (16, 4, 1024), (1, 8, 4096)):
        on = ops.attention_splits(rows, kv, keys)
        monkeypatch.setattr(ops, "ATTN_MAX_BLOCKS", 0)
        assert ops.attention_splits(rows, kv, keys) == on, (rows, kv, keys)
        monkeypatch.setattr(ops, "ATTN_MAX_BLOCKS", 4)
    for rows, kv, keys in ((16, 4, 2304), (3, 4, 5000), (64, 4, 4096)):
        block, chunk, splits = ops.attention_splits(rows, kv, keys)
        assert splits * chunk >= keys > (splits - 1) * chunk and chunk % block == 0
        assert chunk // block <= 4 or rows * kv * splits > 264


def test_attention_short_buckets(monkeypatch):
    """Key buckets up to ATTN_SHORT_KEYS: 32-key blocks where they keep to ATTN_PROGRAMS programs of
    at most ATTN_MAX_BLOCKS blocks, and the first block read before the PDL wait (attention_prefetch);
    longer buckets and wide batches keep 64-key blocks without it (NOTES_rollout.md section 23)."""
    for name, value in (("ATTN_PROGRAMS", 264), ("ATTN_BLOCK", 64), ("ATTN_BLOCK_SMALL", 32),
                        ("ATTN_MAX_BLOCKS", 4), ("ATTN_SHORT_KEYS", 1024), ("ATTN_PREFETCH", None)):
        monkeypatch.setattr(ops, name, value)
    # (rows, kv, keys) -> (block, keys per program, splits), prefetch
    cases = {(8, 4, 512): ((32, 64, 8), True),  # 7B batch 8 (32-key blocks by the programs rule already)
             (8, 4, 768): ((32, 96, 8), True),  # 64-key blocks before: (64, 128, 6)
             (8, 8, 512): ((32, 128, 4), True),  # 14B / 32B batch 8: (64, 128, 4) before
             (8, 8, 768): ((64, 192, 4), False),  # 32-key blocks would walk 5 blocks
             (64, 4, 512): ((64, 256, 2), False),  # 32-key blocks would walk 8
             (32, 4, 512): ((64, 192, 3), False),  # 32-key blocks would take 512 programs
             (1, 4, 512): ((32, 32, 16), True),
             (1, 4, 2048): ((32, 32, 64), False),  # past ATTN_SHORT_KEYS: as before, no prefetch
             (8, 4, 2048): ((64, 256, 8), False)}
    for (rows, kv, keys), (plan, prefetch) in cases.items():
        assert ops.attention_splits(rows, kv, keys) == plan, (rows, kv, keys)
        assert ops.attention_prefetch(plan[0], keys) is prefetch, (rows, kv, keys)
    monkeypatch.setattr(ops, "ATTN_SHORT_KEYS", 0)
    assert ops.attention_splits(8, 4, 768) == (64, 128, 6)
    assert ops.attention_prefetch(32, 512) is False
    monkeypatch.setattr(ops, "ATTN_PREFETCH", True)  # forced (QERL_ATTN_PREFETCH=1)
    assert ops.attention_prefetch(64, 4096) is True


def test_register_cap_follows_rows_and_key_buckets(monkeypatch):
    """Which of the engine's attention launches take ATTN_MAXNREG (partial_constexprs, as the engine builds
    them: RoPE inside, the slot given, LEAD, 132 SMs): on Qwen2.5-7B / 14B shapes, every key bucket from the
    first one whose plan launches more programs than 3 per SM hold, never at batch 1. Measured on the H200
    (NOTES_rollout.md sections 43-44): capped launches 14-27% shorter alone, the 7B 32-row step +4.9% at 1280
    keys, the 14B 16-row GRPO step +4.7%; the 7B 8-row launches, one wave either way, lost 2-4% capped."""
    monkeypatch.setattr(ops, "ATTN_MAXNREG", 128)
    monkeypatch.setattr(ops, "ATTN_UNCAPPED_PER_SM", 3)
    first_capped = {("qwen2.5-7b", 4, 7): {1: None, 8: 3328, 16: 1792, 32: 1024, 64: 256},
                    ("qwen2.5-14b", 8, 5): {1: None, 8: 1792, 16: 1024, 32: 256, 64: 256}}
    for (model, kv, group), by_rows in first_capped.items():
        for rows, first in by_rows.items():
            for keys in range(256, 4097, 256):
                splits, opts = ops.partial_constexprs(rows, kv, group, 128, keys, True, rope=True, lead=True)
                capped = first is not None and keys >= first
                assert (opts.get("maxnreg") == 128) is capped, (model, rows, keys, splits)
                if capped:
                    assert rows * kv * splits > 3 * 132 and opts["BLOCK"] == ops.ATTN_BLOCK and not opts["PREFETCH"]
    # the launch without RoPE and a device with more SMs keep ptxas's allocation
    assert "maxnreg" not in ops.partial_constexprs(32, 4, 7, 128, 2048, True, rope=False)[1]
    assert "maxnreg" not in ops.partial_constexprs(16, 8, 5, 128, 1024, True, rope=True, lead=True, sms=264)[1]


def test_the_decode_step_starts_its_pdl_chain(monkeypatch):
    """decode_ops.PDL: the decode step's first kernel (embed_rms_norm) is launched without the PDL
    attribute, so the state the attention reads before its wait (slot, positions) is final; a norm
    inside the step keeps it. Both kernels still trigger their successor early (PDL=True inside).
    The launch arguments are recorded with PDL forced on (the GPU test
    test_eager_rollouts_repeat_beside_other_processes checks the effect)."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append({k: kw[k] for k in ("PDL", "launch_pdl", "HAS_IDS")})

    monkeypatch.setattr(ops, "_triton_kernels", lambda: (Kernel(),))
    monkeypatch.setattr(ops, "pdl_on", lambda t: True)
    table, w = torch.randn(10, 8), torch.rand(8)
    ops.add_rms_norm_triton(None, table, w, 1e-6, ids=torch.tensor([1, 2]), chain_start=True)
    ops.add_rms_norm_triton(torch.randn(2, 8), torch.randn(2, 8), w, 1e-6)
    assert launches == [{"PDL": True, "launch_pdl": False, "HAS_IDS": True},
                        {"PDL": True, "launch_pdl": True, "HAS_IDS": False}]
    # embed_rms_norm asks for it (on a GPU it takes the kernel; here it is checked by its call)
    calls = []
    monkeypatch.setattr(ops, "_on_gpu", lambda t, op: True)
    monkeypatch.setattr(ops, "add_rms_norm_triton", lambda *a, **kw: calls.append(kw))
    ops.embed_rms_norm(torch.tensor([1]), table, w, 1e-6)
    assert calls == [{"ids": calls[0]["ids"], "chain_start": True, "signal": None}]


def test_attention_switches_from_the_environment():
    """QERL_ATTN_STAGES (0: Triton's default depth) and QERL_ATTN_SLOT_FIRST=0 (the select inside the loop)
    reach decode_ops at import; unset, two stages and the slot first."""
    import subprocess
    import sys

    code = "from qerl.kernels import decode_ops as d; print(d.ATTN_STAGES, d.ATTN_SLOT_FIRST)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QERL_ATTN_")}
    for extra, want in (({}, "2 True"), ({"QERL_ATTN_STAGES": "0"}, "None True"),
                        ({"QERL_ATTN_STAGES": "4", "QERL_ATTN_SLOT_FIRST": "0"}, "4 False")):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr


_READY_SIGNAL_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from qerl.kernels import decode_ops as ops
    torch.manual_seed(int(__import__("os").environ.get("SEED", "0")))
    out = []
    joins = []
    def ready(t, count=7):  # a delta whose producer has counted up to its target (7) already
        return ops.Ready(t, torch.tensor([count], dtype=torch.int32), 7, lambda: joins.append(1))
    def same(a, b):
        return bool(torch.equal(a, b))
    def signal(start=5):
        return ops.Signal(torch.full((1,), start, dtype=torch.int32))
    h, d, w = torch.randn(3, 96), torch.randn(3, 96), torch.rand(96) + 0.5
    e = torch.randn(3, 96) * 0.1
    got = ops.add_rms_norm_triton(d, h, w, 1e-6, ready(e, 9))
    ref = ops.add_rms_norm_triton(d, h, w, 1e-6, e)
    out.append(("norm", same(got[0], ref[0]) and same(got[1], ref[1])))
    gu = torch.randn(5, 2 * 1300) * 3  # two column blocks of 1024: a grid of 5 x 2 programs
    eg = torch.randn_like(gu)
    out.append(("silu", same(ops.silu_mul_triton(gu, ready(eg)), ops.silu_mul_triton(gu, eg))))
    b, heads, kv, dim, keys = 3, 6, 2, 32, 130
    qkv = torch.randn(b, (heads + 2 * kv) * dim)
    extra = torch.randn_like(qkv) * 0.1
    ang = torch.rand(b, dim // 2) * 6.28
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    kc, vc = torch.randn(b, kv, 140, dim), torch.randn(b, kv, 140, dim)
    valid = torch.rand(b, 140) > 0.3
    slot = torch.tensor([40])
    valid[:, 0] = valid[:, 40] = True
    res, sigs = [], []
    for e_ in (ready(extra), extra):
        k1, v1 = kc.clone(), vc.clone()
        sigs.append(signal())
        res.append((ops.decode_attention_rope_triton(qkv, cos, sin, k1, v1, slot, valid, keys, dim ** -0.5, heads, kv,
                                                     e_, signal=sigs[-1]), k1, v1))
    out.append(("attention_rope", all(same(x, y) for x, y in zip(*res))))
    # Signal: each program adds one after its stores, and the launch records how many programs count
    out.append(("attention combine counts", all(int(s.flag[0]) == 5 + b * heads and s.programs == b * heads
                                                 for s in sigs)))
    s = signal()
    got = ops.add_rms_norm_triton(d, h, w, 1e-6, e, signal=s)
    out.append(("norm counts", int(s.flag[0]) == 5 + 3 and s.programs == 3 and same(got[1], ref[1])))
    s = signal(0)
    table, ids = torch.randn(50, 96), torch.tensor([3, 49, 0, 3])
    got = ops.add_rms_norm_triton(None, table, w, 1e-6, ids=ids, chain_start=True, signal=s)
    out.append(("embed norm counts", int(s.flag[0]) == 4 and s.programs == 4
                and same(got[1], ops.add_rms_norm_reference(None, table[ids], w, 1e-6)[1])))
    # a gate (the resident LoRA kernel's programs counted in) is waited for, then the same bits; not with a delta
    got = ops.add_rms_norm_triton(None, table, w, 1e-6, ids=ids, chain_start=True, gate=ready(torch.zeros(1)))
    ok = same(got[1], ops.add_rms_norm_reference(None, table[ids], w, 1e-6)[1])
    try:
        ops.add_rms_norm_triton(d, h, w, 1e-6, ready(e), gate=ready(torch.zeros(1)))
        ok = False
    except ValueError:
        pass
    out.append(("embed norm gate", ok))
    s = signal(0)
    got = ops.silu_mul_triton(gu, eg, s)
    out.append(("silu counts", int(s.flag[0]) == 10 and s.programs == 10 and same(got, ops.silu_mul_triton(gu, eg))))
    out.append(("no joins on the polling paths", not joins))
    # a delta that is not contiguous would be copied on this stream first: it is joined instead
    wide = torch.randn(3, 192) * 0.1
    got = ops.add_rms_norm_triton(d, h, w, 1e-6, ready(wide[:, ::2]))
    out.append(("strided delta joined", len(joins) == 1 and same(got[1], ops.add_rms_norm_triton(d, h, w, 1e-6, wide[:, ::2].contiguous())[1])))
    # the torch paths join and read the tensor, and refuse a Signal (nothing there would count it)
    out.append(("reference joins", same(ops.silu_mul(gu.double(), ops.Ready(eg.double(), None, 7, lambda: joins.append(2))),
                                        ops.silu_mul_reference(gu.double(), eg.double())) and joins[-1] == 2))
    try:
        ops.silu_mul(gu.double(), None, signal())
        refused = False
    except ValueError as err:
        refused = "Signal" in str(err)
    out.append(("reference refuses a signal", refused))
    print("RESULTS" + json.dumps(out))
    """
)


def test_ready_and_signal_under_interpreter():
    """decode_ops.Ready (a LoRA delta another stream or the resident LoRA kernel writes): the norm,
    SiLU and attention kernels poll its counter, then compute the same bits as with the plain tensor;
    a strided delta and the torch paths join the producer instead. decode_ops.Signal (how the resident
    kernel learns a group's input is written): the norm, embedding norm, SiLU and attention-combine
    kernels each count their programs once, after their stores, and change nothing they write; the
    torch path refuses a Signal rather than leave a reader waiting."""
    results = run_interpreted(_READY_SIGNAL_SCRIPT, 0)
    assert len(results) == 12
    assert all(ok for _, ok in results), results
