"""Can a Gluon kernel add partial sums across the CTAs of a thread-block cluster (distributed shared memory)?
Offline, no GPU: compiles two tiny kernels for sm_90a with num_ctas = 2 (a cluster of two CTAs, the launcher's
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) and reports, for each, whether it builds and how many cluster instructions
(mapa, shared::cluster, barrier.cluster) its PTX holds, or the first line of the compiler's error.

    .venv/bin/python benchmarks/probe_cluster_reduce.py

Why: the split fixup of the 4-bit GEMVs goes through global memory (a counter and the S - 1 partials), and in a
PDL chain it is the last program's critical path (NOTES_w4a16.md section 43). With the S programs of a row block in
one cluster the partials could meet in shared memory instead. The two forms asked of the compiler:
- "sum": a [2, 64] fp32 tile whose rows sit in the two CTAs (cga_layout [[1, 0]]), summed over the rows;
- "convert": the same tile moved to a layout whose columns sit in the two CTAs (cga_layout [[0, 1]]), then summed
  over the rows inside each CTA (what a fixup would do: each CTA ends with half of the row block's sums).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

KINDS = ("sum", "convert")


def build(kind: str) -> dict:
    """Compile the `kind` kernel offline; {"kind", "ok", "ptx_counts" | "error"}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    rows_split = gl.constexpr(gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0], [[1, 0]]))
    cols_split = gl.constexpr(gl.BlockedLayout([2, 1], [1, 32], [1, 1], [1, 0], [[0, 1]]))
    convert = gl.constexpr(kind == "convert")

    @gluon.jit
    def reduce_kernel(p_ptr, y_ptr):
        r = gl.arange(0, 2, layout=gl.SliceLayout(1, rows_split))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, rows_split))
        v = gl.load(p_ptr + r[:, None] * 64 + c[None, :])
        if convert:
            w = gl.convert_layout(v, cols_split)
            gl.store(y_ptr + gl.arange(0, 64, layout=gl.SliceLayout(0, cols_split)), gl.sum(w, axis=0))
        else:
            gl.store(y_ptr + c, gl.sum(v, axis=0))

    src = GluonASTSource(reduce_kernel, {"p_ptr": "*fp32", "y_ptr": "*fp32"}, {}, {})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_ctas": 2})
    except Exception as exc:  # the compiler's own error (an MLIR verifier message, say)
        return {"kind": kind, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    ptx = k.asm["ptx"]
    return {"kind": kind, "ok": True,
            "ptx_counts": {w: len(re.findall(re.escape(w), ptx)) for w in ("mapa", "shared::cluster", "barrier.cluster")}}


def main(argv=None) -> int:
    """Each kind in a child process: an assertion inside the compiler aborts the process that hit it."""
    if argv and argv[0] == "--one":
        print(build(argv[1]))
        return 0
    for kind in KINDS:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", kind], capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
        result = ast.literal_eval(line) if line else {"kind": kind, "ok": False, "error": f"exit {out.returncode}"}
        if not result["ok"]:  # the compiler's own words: its assertion or the MLIR verifier's first error
            why = next((ln for ln in out.stderr.splitlines() if "Assertion" in ln or ": error:" in ln), None)
            if why:
                result["compiler"] = why.strip()[:400]
        print(result, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
