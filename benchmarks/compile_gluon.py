"""Compile the Gluon kernels offline for sm_90a, no GPU: the warp-specialised GEMV
(qerl/kernels/w4a16_gluon.py, default) or the warp-specialised GEMM (--kernel wgmma,
qerl/kernels/w4a16_wgmma.py).

    .venv/bin/python benchmarks/compile_gluon.py [--n 7168] [--k 5120] [--stages 6] [--warps 4]
        [--maxnreg R (default 64, 0 = none)] [--producer-regs 24] [--bias] [--pdl] [--xpf] [--streamk] [--tail] [--scale-bits] [--pwa] [--xs] [--glu] [--cluster S] [--dump DIR]
    .venv/bin/python benchmarks/compile_gluon.py --kernel wgmma [--fmt nvfp4] [--m 64]
        [--config '{"CPS": 4, "NSD": 2}'] [--bias] [--scale-bits] [--dump DIR]

Builds the kernel's GluonASTSource with a concrete signature (TMA descriptor types from CPU
tensors), runs triton.compile for GPUTarget("cuda", 90, 32) (ptxas included), and prints
registers, shared memory, the stage count, the split (S) the wrapper would pick on a 132-SM H100,
the PTX barrier / mma / mbarrier counts, and SASS instruction counts of the consumer main loop
(nvdisasm/cuobjdump from triton/backends/nvidia/bin).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from qerl.kernels import w4a16_gluon as G  # noqa: E402
from qerl.kernels import w4a16_ws as WS  # noqa: E402


def _signature(n: int, k: int, has_bias: bool, mt: int = 1, xs: bool = False, glu: bool = False, lexp: int = 0,
               fmt: str = "nvfp4"):
    kb = k // 256
    state = {"words": torch.zeros(triton.cdiv(n, 64), kb, 64, 32, dtype=torch.int32), "fmt": fmt,
             "scale": torch.zeros(triton.cdiv(n, 64), kb, 64, 16 if fmt == "nvfp4" else 8, dtype=torch.uint8), "n": n,
             "kb": kb}
    w_desc, s_desc = G.glu_descriptors(state) if glu else WS.descriptors(state)
    return {
        "xw_ptr": "*i32", "w_desc": mangle_type(w_desc), "s_desc": mangle_type(s_desc),
        "x_desc": mangle_type(G.x_descriptor(torch.zeros(mt, k, dtype=torch.bfloat16), mt) if xs else w_desc),
        "alpha_ptr": "*fp32",
        "bias_ptr": "*bf16", "c_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
        "stamp_ptr": "*i64", "h_ptr": "*bf16", "hout_ptr": "*bf16", "nw_ptr": "*bf16", "ss_ptr": "*fp32",
        "M": "i32", "N": "i32", "KB": "i32", "S": "i32", "NW": "i32", "CS": "i32", "NSS": "i32", "eps": "fp32",
        "KN": "i32", "EB": "i32", "dl_ptr": "*fp32" if lexp else "*bf16", "dflag_ptr": "*i32", "sig_ptr": "*i32",
        "DT": "i32", "lb_ptr": "*i32", "LN1": "i32", "LN2": "i32", "LHS": "i32",
    }


def compile_kernel(n: int, k: int, stages: int, warps: int, maxnreg, producer_regs: int, bias: bool, pdl: bool,
                   mt: int = 1, xpf: bool = False, stamp: bool = False, epi: bool = G.EPI_SMEM, sk: bool = False, tail: bool = False,
                   sbits: bool = False, pwa: bool = False, xs: bool = False, glu: bool = False, fold: int = 0,
                   fmt: str = "nvfp4", sync: int = 0, lexp: int = 0, cluster: int = 0, frag: bool = False):
    fn = G._gluon_gemv_kernel
    sig = _signature(n, k, bias, mt, xs, glu, lexp, fmt=fmt)
    l5, l2w, l2s = G._layouts(warps, fmt, frag)  # frag: fragment-ordered nvfp4 words (WF 2)
    # SP: the fixup's unrolled partial count (the wrapper passes next_power_of_2(S); 8 covers S <= 8)
    constexprs = {"NUM_STAGES": stages, "HAS_BIAS": bias, "PDL": pdl, "MT": mt, "XPF": xpf, "STAMP": stamp, "SP": 8,
                  "HOIST": True, "EPI": epi, "SK": sk, "TAIL": tail, "SBITS": sbits, "PWA": pwa, "XS": xs, "GLU": glu, "FOLD": fold, "SYNC": sync, "LEXP": lexp, "CL": cluster, "SSP": 64, "WF": 2 if frag else int(fmt == "mxfp4"), "LX": G._x_layout(warps, mt, frag), "PRODUCER_REGS": producer_regs, "L5": l5, "L2W": l2w, "L2S": l2s, "num_warps": warps}
    for name in constexprs:
        sig[name] = "constexpr"
    # pointers 16-byte aligned, as the JIT would specialise them on a GPU
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in ("xw_ptr", "alpha_ptr", "bias_ptr", "c_ptr", "ws_ptr", "lock_ptr")}
    src = GluonASTSource(fn, sig, constexprs, attrs)
    opts = {"num_warps": warps}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _sass(cubin: bytes) -> str | None:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tool = os.path.join(bindir, "nvdisasm")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, "-c", path], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(path)


def _resources(cubin: bytes):
    """(registers, spill bytes) of the kernel from cuobjdump -res-usage (CompiledKernel.n_regs needs a GPU)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    regs = re.search(r"REG:(\d+)", out)
    spill = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else -1), (int(spill.group(1)) if spill else -1)


def _loops(sass: str):
    """Backward branches (BRA to an earlier label) -> (label, lines of the loop body)."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b[^;]*?(\.L_x_\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((m.group(1), lines[labels[m.group(1)]:i + 1]))
    return loops


def _opcodes(body):
    ops = collections.Counter()
    for line in body:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return ops


def main_wgmma(a):
    from qerl.kernels import w4a16_wgmma as WG

    config = json.loads(a.config) if a.config else {}
    a.m = a.m or 64
    if a.pdl:
        config["PDL"] = True
    try:
        ck = WG.compile_offline(a.fmt, a.m, a.n, a.k, config=config, bias=a.bias, sbits=a.scale_bits)
    except Exception as e:  # noqa: BLE001
        print(f"compile FAILED: {type(e).__name__}: {e}")
        sys.exit(1)
    consts, _ = WG.kernel_args(a.fmt, a.m, config)
    n_regs, n_spills = _resources(ck.asm["cubin"])
    print(f"ptxas: OK (sm_90a)  {a.fmt} N={a.n} K={a.k} M={a.m} " +
          " ".join(f"{key}={consts[key]}" for key in ("BM", "NSW", "NSD", "CPS", "NSX", "LAG", "DW", "PDL")))
    print(f"registers/thread (kernel): {n_regs}  spills: {n_spills}  shared memory: {ck.metadata.shared} B  "
          f"num_warps (total): {ck.metadata.num_warps}")
    ptx = ck.asm["ptx"]
    for pat in ("wgmma.mma_async", "mul.rn.bf16x2", "fence.proxy.async", "bar.sync", "mbarrier.try_wait",
                "mbarrier.arrive", "cp.async.bulk.tensor", "setmaxnreg", "ldmatrix", "st.shared.v4", "ld.shared"):
        print(f"  ptx {pat:22s} {ptx.count(pat)}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"wgmma.{ext}"), "w") as f:
                f.write(ck.asm[ext])
        sass = _sass(ck.asm["cubin"])
        if sass is not None:  # to read beside ncu's SASS-level stall samples (--page source --print-source sass)
            with open(os.path.join(a.dump, "wgmma.sass"), "w") as f:
                f.write(sass)
        print(f"dumped to {a.dump}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("gemv", "wgmma"), default="gemv")
    ap.add_argument("--fmt", default="nvfp4", help="nvfp4 or mxfp4 (gemv: --scale-bits is either format's integer scale conversion; --glu and --fold take both)")
    ap.add_argument("--m", type=int, default=None, help="tokens (wgmma: default 64; gemv: 1, or 2..8)")
    ap.add_argument("--config", default=None, help="wgmma: JSON config (w4a16_wgmma.forward keys)")
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--stages", type=int, default=G.DEFAULT["NUM_STAGES"])
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int, default=G.DEFAULT["maxnreg"], help="0: no cap")
    ap.add_argument("--producer-regs", type=int, default=24)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--pdl", action="store_true")
    ap.add_argument("--xpf", action="store_true", help="gemv: x loaded one step ahead")
    ap.add_argument("--streamk", action="store_true", help="gemv: the stream-K schedule (SK)")
    ap.add_argument("--tail", action="store_true", help="gemv: the split-tail schedule (TAIL)")
    ap.add_argument("--scale-bits", action="store_true", help="gemv / wgmma nvfp4: scales by integer arithmetic (SBITS / FMT 2)")
    ap.add_argument("--old-epi", action="store_true", help="gemv, M > 1: the per-accumulator epilogue (EPI off)")
    ap.add_argument("--pwa", action="store_true", help="gemv: per-warp stage release (qerl/kernels/ptx_pwa.py)")
    ap.add_argument("--xs", action="store_true", help="gemv: x copied beside each weight stage (XS)")
    ap.add_argument("--glu", action="store_true", help="gemv, M > 1: silu(gate) * up of a [gate; up] layer (GLU)")
    ap.add_argument("--frag", action="store_true", help="gemv: fragment-ordered nvfp4 words (qerl/kernels/layout.py)")
    ap.add_argument("--fold", type=int, default=0, help="gemv, M > 1: NORM_FOLD epilogue, 1 = RES, 2 = SCALE")
    ap.add_argument("--sync", type=int, default=0, help="gemv, with --glu or --fold 1: the resident LoRA kernel's "
                    "delta wait and signal in the epilogue (SYNC = 1 + ns naps between polls; 0: off)")
    ap.add_argument("--lexp", type=int, default=0, help="gemv, with --sync: the epilogue expands the LoRA delta at this "
                    "rank from the resident kernel's shrink sums (LEXP, lora_resident.Expand; any product)")
    ap.add_argument("--cluster", type=int, default=0, help="gemv: the split fixup through a cluster of this many "
                    "programs' shared memory (CL, qerl/kernels/ptx_cluster.py; 0: the global workspace)")
    ap.add_argument("--dump", default=None, help="write ttgir / llir / ptx / sass here")
    a = ap.parse_args()
    if a.kernel == "wgmma":
        return main_wgmma(a)
    try:
        ck = compile_kernel(a.n, a.k, a.stages, a.warps, a.maxnreg, a.producer_regs, a.bias, a.pdl,
                            1 if (a.m or 1) == 1 else G.MAX_M, a.xpf, epi=not a.old_epi, sk=a.streamk, tail=a.tail, sbits=a.scale_bits,
                            pwa=a.pwa, xs=a.xs, glu=a.glu, fold=a.fold, fmt=a.fmt, sync=a.sync, lexp=a.lexp,
                            cluster=a.cluster, frag=a.frag)
    except Exception as e:  # noqa: BLE001
        print(f"compile FAILED: {type(e).__name__}: {e}")
        sys.exit(1)
    md = ck.metadata
    n_regs, n_spills = _resources(ck.asm["cubin"])
    print(f"ptxas: OK (sm_90a)  N={a.n} K={a.k} stages={a.stages} consumer warps={a.warps} "
          f"maxnreg={a.maxnreg} producer regs={a.producer_regs} bias={a.bias} pdl={a.pdl} xpf={a.xpf} streamk={a.streamk} tail={a.tail} scale_bits={a.scale_bits} pwa={a.pwa} xs={a.xs} glu={a.glu}")
    print(f"registers/thread (kernel): {n_regs}  spills: {n_spills}  shared memory: {md.shared} B  "
          f"(ring {a.stages} x {64 * 32 * 4 + 64 * 16} B)  num_warps (total): {md.num_warps}")
    warps_total = -(-a.warps // 4) * 4 + 4  # registers are handed out per warpgroup
    regs = a.maxnreg or n_regs
    by_regs = 65536 // (max(regs, 24) * warps_total * 32)
    by_smem = 233472 // (md.shared + 1024)
    per_sm = max(1, min(by_regs, by_smem))
    blocks, kb = triton.cdiv(a.n, 64), a.k // 256
    s_max = max(1, min(kb, per_sm * 132 // blocks))
    steps = -(-kb // s_max)
    s = -(-kb // steps)
    print(f"programs/SM: {per_sm} (by regs {by_regs}, by smem {by_smem}); H100 split S={s}, grid={blocks * s}, "
          f"steps/program <= {steps}, weight bytes in flight/SM <= {per_sm * a.stages * 9216}")
    ptx = ck.asm["ptx"]
    for pat in ("mma.sync", "mul.rn.bf16x2", "bar.sync", "barrier.sync", "bar.arrive", "mbarrier.try_wait",
                "mbarrier.arrive", "cp.async.bulk.tensor", "setmaxnreg", "st.shared", "ld.shared"):
        print(f"  ptx {pat:22s} {ptx.count(pat)}")
    sass = _sass(ck.asm["cubin"])
    if sass is None:
        print("nvdisasm not found: no SASS counts")
    else:
        # the shortest backward-branch span holding an HMMA is the consumer main loop, one holding a
        # UTMALDG the producer loop (longer spans are the mbarrier try-wait retry branches)
        for name, op in (("consumer main loop", "HMMA"), ("producer loop", "UTMALDG")):
            cands = [(label, body) for label, body in _loops(sass) if _opcodes(body).get(op)]
            if not cands:
                print(f"SASS {name}: not found")
                continue
            label, body = min(cands, key=lambda lb: len(lb[1]))
            ops = _opcodes(body)
            top = ", ".join(f"{o} {c}" for o, c in ops.most_common(20))
            print(f"SASS {name} ({label}): {sum(ops.values())} instructions per step: {top}")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "llir", "ptx"):
            with open(os.path.join(a.dump, f"gemv.{ext}"), "w") as f:
                f.write(ck.asm[ext])
        if sass:
            with open(os.path.join(a.dump, "gemv.sass"), "w") as f:
                f.write(sass)
        print(f"dumped to {a.dump}")


if __name__ == "__main__":
    if shutil.which("ptxas") is None:
        os.environ.setdefault("TRITON_PTXAS_PATH", os.path.join(os.path.dirname(triton.__file__), "backends",
                                                                 "nvidia", "bin", "ptxas"))
    main()
