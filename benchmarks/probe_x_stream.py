"""How fast can programs pull the activation block through TMA alone, and does it matter that they pull it in step?

Why (NOTES_w4a16.md section 40): at M = 256 every program of the wgmma GEMM streams the whole 256-token activation
block x [256, K] bf16 from L2 into shared memory, 32 KB per 64-K chunk against 2.3 KB of 4-bit weights. With all
programs on the same chunk at once the L2 served 4.83 M sectors for 7168x5120; stream-K's scattered K offsets
made it 11.18 M and doubled each step's cycles. This probe takes the weights, the decoder and the tensor cores
away: P programs (one per SM at the GEMM's shared memory) each copy the chunks of x [BM, K] into a ring of NSX
stages and a consumer warpgroup only waits for each stage and frees it. Program p starts at chunk (p * SHIFT) mod
the chunk count and wraps around, so SHIFT 0 is the data-parallel schedule's lockstep and SHIFT > 0 scatters the
programs over K as stream-K does.

    python benchmarks/probe_x_stream.py [--k 5120] [--bm 256] [--programs 80,112,132] [--shifts 0,17] [--out F]

If the lockstep copy alone takes about as long as the GEMM (7168x5120, M = 256: 31.4 us on 112 programs), the
GEMM's M = 256 speed is set by the activation traffic into each SM, and only forms that feed more weight rows
from each copied chunk can move it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_w4a16 import time_per_call, write_probe  # noqa: E402
from qerl.kernels.w4a16_wgmma import _x_layout  # noqa: E402
from qerl.kernels.w4a16_ws import _ring_barriers  # noqa: E402


@gluon.jit
def _consume(x_ready, x_empty, n, NSX: gl.constexpr):
    for i in range(n):
        mbarrier.wait(x_ready.index(i % NSX), (i // NSX) & 1)
        mbarrier.arrive(x_empty.index(i % NSX), count=1)


@gluon.jit
def _copy(x_desc, x_bufs, x_ready, x_empty, n, start, NSX: gl.constexpr):
    for i in range(n):
        ix = i % NSX
        mbarrier.wait(x_empty.index(ix), ((i // NSX) & 1) ^ 1)  # stages start free
        mbarrier.expect(x_ready.index(ix), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [0, ((start + i) % n) * 64], x_ready.index(ix), x_bufs.index(ix))


@gluon.jit
def _x_stream_kernel(x_desc, n, SHIFT, NSX: gl.constexpr, num_warps: gl.constexpr):
    """Program p copies the n chunks [BM, 64] of x, from chunk (p * SHIFT) mod n on, through NSX stages."""
    start = (gl.program_id(0) * SHIFT) % n
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NSX] + x_desc.block_type.shape, x_desc.layout)
    x_ready, x_empty = _ring_barriers(NSX)
    gl.warp_specialize([(_consume, (x_ready, x_empty, n, NSX)), (_copy, (x_desc, x_bufs, x_ready, x_empty, n, start, NSX))],
                       [1], [24])


def descriptor(x: torch.Tensor, bm: int) -> TensorDescriptor:
    """x in [BM, 64] boxes with the GEMM's own shared layout (w4a16_wgmma.descriptors)."""
    return TensorDescriptor.from_tensor(x, [bm, 64], _x_layout(bm))


def launch(x_desc, n: int, programs: int, shift: int, nsx: int):
    return _x_stream_kernel[(programs,)](x_desc, n, shift, NSX=nsx, num_warps=4)


def compile_offline(k: int = 5120, bm: int = 256, nsx: int = 4):
    """sm_90a build without a GPU (ptxas included), for tests/test_kernels.py."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x_desc = descriptor(torch.zeros(bm, k, dtype=torch.bfloat16), bm)
    sig = {"x_desc": mangle_type(x_desc), "n": "i32", "SHIFT": "i32", "NSX": "constexpr", "num_warps": "constexpr"}
    src = GluonASTSource(_x_stream_kernel, sig, {"NSX": nsx, "num_warps": 4}, {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--bm", type=int, default=256, help="tokens per copied chunk (the GEMM's token tile)")
    ap.add_argument("--nsx", type=int, default=4, help="ring stages (the GEMM's NSX at M = 256: 4)")
    ap.add_argument("--programs", default="80,112,132")
    ap.add_argument("--shifts", default="0,17", help="chunk offset step between programs (0: all in step)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    x = torch.randn(a.bm, a.k, device="cuda", dtype=torch.bfloat16)
    x_desc = descriptor(x, a.bm)
    n = a.k // 64
    chunk = a.bm * 64 * 2
    rows = []
    for programs in (int(v) for v in a.programs.split(",")):
        for shift in (int(v) for v in a.shifts.split(",")):
            us = time_per_call(lambda i: launch(x_desc, n, programs, shift, a.nsx), 200)
            per_sm = n * chunk / us / 1e3  # GB/s into one program's shared memory
            rows.append(dict(programs=programs, shift=shift, k=a.k, bm=a.bm, nsx=a.nsx, us=us,
                             per_program_gbps=per_sm, total_gbps=per_sm * programs))
            print(f"programs {programs:4d} shift {shift:3d}: {us:7.2f} us  {per_sm:6.1f} GB/s per program, "
                  f"{per_sm * programs / 1e3:5.2f} TB/s in all", flush=True)
    write_probe(a.out, rows, triton=triton.__version__)


if __name__ == "__main__":
    main()
