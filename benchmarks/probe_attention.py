"""The decode attention alone (RoPE + split attention + combine, as the engine launches it), timed against
the device's copy bandwidth, for settings of qerl.kernels.decode_ops.

    python benchmarks/probe_attention.py --models qwen2.5-7b qwen2.5-14b --rows 8 32 64 --keys 512 1280 2048 \
        --cands '[["default", {}], ["w8", {"ATTN_WARPS": 8}], ["st2", {"ATTN_STAGES": 2}]]' --out attn.json

Per (model shape, rows, keys): one K and one V cache per layer copy, [rows, KV heads, keys, 128] bf16 as the
engine allocates them, enough copies that a pass over them is >= 4x the L2 (so every launch reads DRAM, as a
decode step does). One CUDA graph per candidate launches the attention once per copy (the step's slot the last
key, every key valid), timed as bench_w4a16.py times its kernels (`time_per_call`: the median of 5-30 replays,
per launch). GB/s counts the K / V bytes the kernel must read (rows x KV x keys x 128 x 2 x 2 B), against a
1 GiB device copy (an elementwise kernel) timed in the same process. PDL is off unless --pdl (back-to-back
attention launches would otherwise overlap each other's start, which no decode step does). The launch carries
the engine's LEAD arguments (SHARE_PROMPT_KEYS, with no shared prefix: every row reads its own keys), which
change the build's registers. Each candidate's output is compared with the torch reference first (rel_err; the
table marks one over 1e-2, bf16 level). Keys are read whole: the kernel
does not skip invalid slots (valid only masks scores).

    python benchmarks/probe_attention.py --compile-only [--models ...] [--rows ...] [--keys ...] [--cands ...]

needs no GPU: it compiles the partial kernel each candidate would launch for sm_90 (ptxas included) and prints
its shared memory and registers, the programs per SM those leave (232448 B and 65536 registers per SM), the
programs launched, and PTX counts (cp.async copies, shared-memory loads and stores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from bench_w4a16 import time_per_call  # noqa: E402
from qerl.kernels import decode_ops  # noqa: E402
from qerl.model import QWEN_PRESETS  # noqa: E402
from qerl.rollout.engine import SHARE_PROMPT_KEYS  # noqa: E402

SETTINGS = ("ATTN_PROGRAMS", "ATTN_BLOCK", "ATTN_BLOCK_SMALL", "ATTN_MAX_BLOCKS", "ATTN_SHORT_KEYS", "ATTN_EARLY_V",
            "ATTN_PREFETCH", "ATTN_WARPS", "ATTN_STAGES", "ATTN_MAXNREG", "ATTN_COMBINE", "ATTN_ROPE", "ATTN_SLOT_FIRST")
HEAD_DIM = 128


def parse_cands(text: str) -> list[tuple[str, dict]]:
    """[[name, {SETTING: value}], ...] -> list; SystemExit on an unknown setting (one line)."""
    cands = [(str(n), dict(c or {})) for n, c in json.loads(text)]
    for name, conf in cands:
        bad = sorted(set(conf) - set(SETTINGS))
        if bad:
            raise SystemExit(f"candidate {name!r}: unknown settings {bad}; known: {', '.join(SETTINGS)}")
    return cands


def _settings(conf: dict):
    """The candidate's decode_ops settings for a with-block, restored after."""
    return mock.patch.multiple(decode_ops, **conf) if conf else contextlib.nullcontext()


def kv_bytes(rows: int, kv: int, keys: int) -> int:
    """K and V bytes one attention launch reads (bf16)."""
    return rows * kv * keys * HEAD_DIM * 2 * 2


def copies_for(rows: int, kv: int, keys: int, l2_bytes: int, cap_bytes: int = 8 << 30) -> int:
    """Cache copies such that a pass is >= 4x the L2 (at least 2), within cap_bytes."""
    per = kv_bytes(rows, kv, keys)
    return max(2, min(-(-4 * l2_bytes // per), max(2, cap_bytes // per)))


def copy_gbps() -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    # an elementwise kernel, not dst.copy_(src): timed that way in time_per_call's CUDA graph the copy read 2.69 /
    # 2.75 TB/s on the H200 (session 48) against 4.17 eager (session 47); a captured same-dtype copy_ is a memcpy
    # node, the likely cause. This form read 4.17-4.23 TB/s there (session 49).
    return 2 * src.numel() * 4 / time_per_call(lambda i: torch.mul(src, 1.0, out=dst), 1) / 1e3


class Case:
    """Caches, inputs and the launch of one (shape, rows, keys)."""

    def __init__(self, model: str, rows: int, keys: int, l2_bytes: int, seed: int = 0):
        cfg = QWEN_PRESETS[model]
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.rows, self.keys = rows, keys
        self.copies = copies_for(rows, self.kv, keys, l2_bytes)
        g = torch.Generator(device="cuda").manual_seed(seed)
        shape = (rows, self.kv, keys, HEAD_DIM)
        self.k = [torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16) for _ in range(self.copies)]
        self.v = [torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16) for _ in range(self.copies)]
        width = (self.heads + 2 * self.kv) * HEAD_DIM
        self.qkv = torch.randn(rows, width, device="cuda", generator=g).to(torch.bfloat16)
        ang = torch.rand(keys, HEAD_DIM // 2, device="cuda", generator=g) * 6.28
        ang = torch.cat([ang, ang], -1)
        self.cos, self.sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        self.pos = torch.full((rows,), keys - 1, dtype=torch.long, device="cuda")
        self.slot = torch.tensor([keys - 1], dtype=torch.long, device="cuda")
        self.valid = torch.ones(rows, keys, dtype=torch.bool, device="cuda")
        self.scale = HEAD_DIM ** -0.5
        # the engine's LEAD arguments (SHARE_PROMPT_KEYS) with no shared prefix: its build, every row's own keys
        self.shared = (torch.arange(rows, dtype=torch.int32, device="cuda"),
                       torch.zeros(1, dtype=torch.long, device="cuda")) if SHARE_PROMPT_KEYS else (None, None)

    def launch(self, i: int) -> torch.Tensor:
        return decode_ops.decode_attention_rope(self.qkv, self.cos, self.sin, self.k[i], self.v[i], self.slot,
                                                self.valid, self.keys, self.scale, self.heads, self.kv, pos=self.pos,
                                                lead=self.shared[0], shared=self.shared[1])

    def reference(self, i: int) -> torch.Tensor:
        k, v = self.k[i].clone(), self.v[i].clone()
        q = decode_ops.rope_to_cache_reference(self.qkv, self.cos[self.pos], self.sin[self.pos], k, v, self.slot,
                                               self.heads, self.kv)
        return decode_ops.decode_attention_reference(q, k, v, self.valid, self.keys, self.scale)


def run_case(case: Case, cands: list[tuple[str, dict]], gbps: float) -> list[dict]:
    rows = []
    ref = case.reference(0).float()
    for name, conf in cands:
        with _settings(conf):
            out = case.launch(0).float()
            err = ((out - ref).norm() / ref.norm()).item()
            us = time_per_call(case.launch, case.copies)
        plan = decode_ops.attention_splits(case.rows, case.kv, case.keys)  # with the default settings
        got = kv_bytes(case.rows, case.kv, case.keys) / us / 1e3
        rows.append({"cand": name, "config": conf, "rows": case.rows, "kv_heads": case.kv, "heads": case.heads,
                     "keys": case.keys, "copies": case.copies, "us": round(us, 2), "gbps": round(got, 1),
                     "of_copy": round(got / gbps, 3), "rel_err": float(f"{err:.3g}"), "plan_default": list(plan)})
    return rows


def compile_stats(model: str, rows: int, keys: int, conf: dict) -> dict:
    """The partial kernel's sm_90 build under `conf` for this shape (as _attention_launch would launch it,
    slot given, LEAD as the engine's SHARE_PROMPT_KEYS): shared memory, programs per SM by shared memory, programs, PTX counts."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = QWEN_PRESETS[model]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    with _settings(conf):  # the launch's own constexprs under the candidate's settings
        rope = bool(decode_ops.ATTN_ROPE)
        splits, consts = decode_ops.partial_constexprs(rows, kv, heads // kv, HEAD_DIM, keys, True, rope=rope,
                                                       pos=rope, lead=SHARE_PROMPT_KEYS, pdl=True)
    opts = {key: consts.pop(key) for key in ("num_warps", "num_stages", "maxnreg") if key in consts}
    consts.update(HAS_READY=False)  # no delta waited for on the device (engine.LORA_RESIDENT off)
    partial = decode_ops._triton_kernels()[3]
    sig = {name: "*bf16" for name in partial.arg_names}
    sig.update({name: "*fp32" for name in ("po_ptr", "pm_ptr", "pl_ptr")})
    sig.update({"valid_ptr": "*i1", "slot_ptr": "*i64", "cnt_ptr": "*i32", "pos_ptr": "*i64", "lead_ptr": "*i32",
                "shared_ptr": "*i64", "scale": "fp32", "r_ptr": "*i32", "r_target": "i32"})
    sig.update({name: "i32" for name in ("kc_b", "kc_h", "kc_l", "vc_b", "vc_h", "vc_l", "valid_b", "keys", "splits")})
    sig.update({name: "constexpr" for name in consts})
    aligned = ("q_ptr", "k_ptr", "v_ptr", "kc_b", "kc_h", "kc_l", "vc_b", "vc_h", "vc_l")  # as the JIT specialises
    attrs = {(partial.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    kernel = triton.compile(ASTSource(partial, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    from compile_gluon import _resources  # cuobjdump's register count (CompiledKernel.n_regs needs a GPU)

    ptx = kernel.asm["ptx"]
    smem = int(kernel.metadata.shared)
    regs, stack = _resources(kernel.asm["cubin"])
    by_regs = 65536 // (-(-max(regs, 1) // 8) * 8 * 32 * opts["num_warps"])  # allocated in 8s per thread
    return {"smem_bytes": smem, "regs": regs, "stack_bytes": stack, "per_sm": min(232448 // max(smem, 1), by_regs),
            "programs": rows * kv * splits,
            "block": consts["BLOCK"], "blocks_per_program": consts["CHUNK"] // consts["BLOCK"],
            "stages": opts.get("num_stages"), "maxnreg": opts.get("maxnreg"),
            "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)), "ld_shared": len(re.findall(r"ld\.shared", ptx)),
            "st_shared": len(re.findall(r"st\.shared", ptx))}


def compile_only(a, cands) -> int:
    print("| model | rows | keys | cand | smem B | regs (stack B) | cap | per SM | programs | blocks x block | cp.async | "
          "ld / st.shared |")
    res = {"target": "sm_90", "lead": SHARE_PROMPT_KEYS, "command": "python benchmarks/probe_attention.py " + shlex.join(a.argv), "rows": []}
    for model in a.models:
        for r in a.rows:
            for keys in a.keys:
                for name, conf in cands:
                    row = {"model": model, "rows": r, "keys": keys, "cand": name, "config": conf,
                           **compile_stats(model, r, keys, conf)}
                    res["rows"].append(row)
                    print(f"| {model} | {r} | {keys} | {name} | {row['smem_bytes']} | {row['regs']} ({row['stack_bytes']}) | {row['maxnreg'] or '-'} | {row['per_sm']} | "
                          f"{row['programs']} | {row['blocks_per_program']} x {row['block']} | {row['cp_async']} | "
                          f"{row['ld_shared']} / {row['st_shared']} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-14b"], choices=sorted(QWEN_PRESETS))
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 32, 64])
    ap.add_argument("--keys", nargs="+", type=int, default=[512, 1280, 2048])
    ap.add_argument("--cands", default='[["default", {}]]')
    ap.add_argument("--pdl", action="store_true", help="launch with PDL, as the engine does")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: the sm_90 build of each candidate")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    a.argv = list(argv if argv is not None else sys.argv[1:])
    cands = parse_cands(a.cands)
    if a.compile_only:
        return compile_only(a, cands)
    if not torch.cuda.is_available():
        raise SystemExit("probe_attention.py needs a CUDA GPU")
    decode_ops.PDL = bool(a.pdl)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    gbps = copy_gbps()
    print(f"{torch.cuda.get_device_name(0)}: copy {gbps:.0f} GB/s, L2 {l2 >> 20} MB, PDL {'on' if a.pdl else 'off'}",
          flush=True)
    import triton
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python benchmarks/probe_attention.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
           "copy_gbps": round(gbps, 1), "pdl": bool(a.pdl), "lead": SHARE_PROMPT_KEYS, "rows": []}
    print("| model | rows | keys | cand | us | GB/s | of copy | rel err |")
    for model in a.models:
        for r in a.rows:
            for keys in a.keys:
                case = Case(model, r, keys, l2)
                for row in run_case(case, cands, gbps):
                    row["model"] = model
                    res["rows"].append(row)
                    print(f"| {model} | {r} | {keys} | {row['cand']} | {row['us']} | {row['gbps']} | {row['of_copy']} | "
                          f"{row['rel_err']:.1e}{' OVER 1e-2' if row['rel_err'] > 1e-2 else ''} |", flush=True)
                del case
                torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
