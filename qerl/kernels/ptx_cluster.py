"""The split fixup of the Gluon GEMV through distributed shared memory (a thread-block cluster per row block).

Why: in the split schedule the S programs of a 64-row block each write a partial to global memory, count
themselves on an atomic counter, and the last to arrive reads all S partials back. That is three round trips
through L2 on the critical path of every split launch: 2.2-2.4 us of epilogue in single launches and 3.4-4.9 us
inside the decode chain (NOTES_w4a16.md section 43). Here the S programs of a block run as one cluster
(S <= 8): each program other than the block's first (its cluster rank 0, the leader) stores its partial
straight into the leader's shared memory and arrives on an mbarrier there; the leader waits on that mbarrier
(try_wait: suspended, not spinning, beside the programs still in their main loops on its SM) and sums the
partials in program order, as the global path does (bit-identical).

What triton 3.6 cannot say, and how it is said here:
- Gluon has no cross-CTA form that builds (benchmarks/probe_cluster_reduce.py) and no shared-memory address,
  so the region lives above triton's own allocation: the launch asks for `extra_bytes` more dynamic shared
  memory, the mbarrier sits in the top 16 bytes (`%dynamic_smem_size` from `global_smem`) and peer rank r's
  slot of WS floats below it at top - 16 - r * 4 WS.
- The leader must initialise its mbarrier (S - 1 arrivals) before any peer arrives on it, across CTAs. A
  cluster barrier orders that, but
  `barrier.cluster.wait` waits for every live thread of the cluster, and in a warp-specialised kernel only the
  default partition runs the kernel's own code (the worker and padding warps branch away at entry). So `rewrite`
  puts the initialisation and `barrier.cluster.arrive.release` at the kernel's entry, where every warp passes, and the
  consumer warps `wait` just before the fixup (long after the barrier completed). Warps that never wait simply
  exit, which PTX allows.
- Triton compiles the kernel for one CTA per program (`num_ctas` 1: program id = ctaid.x, so program
  blk * S + r is cluster rank r); `prepare` then makes its launcher start clusters of S (the packed
  metadata's num_ctas, with the grid divided by S by the caller) with the larger shared memory.

A kernel opts in by emitting `mark()`; `rewrite` raises on marked PTX it cannot place the entry code in.
The mark carries a version: a change to this rewrite must bump it, so Triton's cache compiles again.
"""

from __future__ import annotations

import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MARK = "qerl-cluster-v2"
BARRIER_BYTES = 16  # the leader's mbarrier at the top of the dynamic shared memory (16-byte aligned slots below)
MAX_CLUSTER = 8  # the portable cluster size


def extra_bytes(cluster: int, ws: int) -> int:
    """Dynamic shared memory a launch of clusters of `cluster` programs with WS-float partials adds."""
    return BARRIER_BYTES + (cluster - 1) * ws * 4


# Every asm below starts from the top of this CTA's dynamic shared memory (a 32-bit shared address) in %qt:
# "mov.u32 %qt, %dynamic_smem_size; mov.u32 %qs, global_smem; add.u32 %qt, %qt, %qs;" (literal strings:
# a JIT function takes no global string).


@gluon.jit
def mark():
    """Emit the opt-in mark (a PTX comment carrying MARK; the output register is unused)."""
    gl.inline_asm_elementwise("// qerl-cluster-v2 $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)  # = MARK


@gluon.jit
def wait():
    """barrier.cluster.wait: the phase every warp arrived at on entry (the leader's mbarrier initialised)."""
    gl.inline_asm_elementwise("barrier.cluster.wait.acquire; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _below_top(off, rank, WS: gl.constexpr):
    """Bytes below the top of the dynamic shared memory of float `off` in peer `rank`'s slot of WS floats."""
    return (off * 0 + rank) * (WS * 4) + 16 - off * 4


@gluon.jit
def put(part, off, rank, WS: gl.constexpr):
    """Store this peer's partial (fp32, element at float offset `off`) into the leader's slot for `rank`."""
    gl.inline_asm_elementwise(
        "{ .reg .b32 %qt, %qs; "
        "mov.u32 %qt, %dynamic_smem_size; mov.u32 %qs, global_smem; add.u32 %qt, %qt, %qs; "
        "sub.u32 %qt, %qt, $2; mapa.shared::cluster.u32 %qt, %qt, 0; st.shared::cluster.f32 [%qt], $1; "
        "mov.u32 $0, 0; }",
        "=r,f,r", [part, _below_top(off, rank, WS)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def get(off, rank, WS: gl.constexpr):
    """The leader's read of the partial peer `rank` stored at float offset `off` of its slot."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 %qt, %qs; "
        "mov.u32 %qt, %dynamic_smem_size; mov.u32 %qs, global_smem; add.u32 %qt, %qt, %qs; "
        "sub.u32 %qt, %qt, $1; ld.shared.f32 $0, [%qt]; }",
        "=f,r", [_below_top(off, rank, WS)], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def fence():
    """This thread's stores into the leader's shared memory are visible in the cluster before what follows."""
    gl.inline_asm_elementwise("fence.acq_rel.cluster; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def signal():
    """Thread 0 arrives on the leader's mbarrier (release, cluster scope: after the CTA barrier, every thread's
    stores before it)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred %qp; .reg .b32 %qt, %qs; mov.u32 %qt, %tid.x; setp.eq.u32 %qp, %qt, 0; "
        "mov.u32 %qt, %dynamic_smem_size; mov.u32 %qs, global_smem; add.u32 %qt, %qt, %qs; "
        "sub.u32 %qt, %qt, 16; mapa.shared::cluster.u32 %qt, %qt, 0; "
        "@%qp mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%qt]; mov.u32 $0, 0; }",
        "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def arrived():
    """The leader's poll of its mbarrier (acquire, cluster scope): 1 once all peers have arrived. try_wait
    suspends the thread for a while before it returns 0, so a waiting leader takes few issue slots from the
    programs that share its SM."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred %qp; .reg .b32 %qt, %qs; "
        "mov.u32 %qt, %dynamic_smem_size; mov.u32 %qs, global_smem; add.u32 %qt, %qt, %qs; "
        "sub.u32 %qt, %qt, 16; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 %qp, [%qt], 0; "
        "selp.u32 $0, 1, 0, %qp; }",
        "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def split_sum(part, off, rank, CL: gl.constexpr, WS: gl.constexpr):
    """The cluster's fixup -> (the sum of the CL partials in program order at the leader, the own partial
    elsewhere; leader?). Every consumer thread of every program of the cluster calls it once."""
    done = rank == 0
    wait()
    if rank > 0:
        put(part, off, rank, WS)
        fence()
        gl.thread_barrier()  # every thread's stores before thread 0's release
        signal()
    else:
        ok = arrived()
        while ok == 0:
            ok = arrived()
        total = gl.zeros_like(part) + part  # 0 + p0 + p1 + ..., the global path's order
        for r in gl.static_range(1, CL):
            total += get(off, r, WS)
        part = total
    return part, done


_ENTRY = re.compile(r"^(\s*)mov\.u32\s+%r\d+,\s*%tid\.x;\s*$")
_ENTRY_CODE = """\t{{
\t.reg .pred %qcl_p;
\t.reg .b32 %qcl_a, %qcl_b;
\tmov.u32 %qcl_a, %cluster_ctarank;
\tmov.u32 %qcl_b, %tid.x;
\tor.b32 %qcl_a, %qcl_a, %qcl_b;
\tsetp.eq.u32 %qcl_p, %qcl_a, 0;
\tmov.u32 %qcl_a, %dynamic_smem_size;
\tmov.u32 %qcl_b, global_smem;
\tadd.u32 %qcl_a, %qcl_a, %qcl_b;
\tsub.u32 %qcl_a, %qcl_a, {barrier};
\tmov.u32 %qcl_b, %cluster_nctarank;
\tsub.u32 %qcl_b, %qcl_b, 1;
\t@%qcl_p mbarrier.init.shared::cta.b64 [%qcl_a], %qcl_b;
\t@%qcl_p fence.mbarrier_init.release.cluster;
\tbarrier.cluster.arrive.release.aligned;
\t}}  // {mark}: the leader's mbarrier set for its peers, every warp arrived"""


class RewriteError(RuntimeError):
    pass


def rewrite(ptx: str) -> str:
    """For PTX carrying MARK: the leader's mbarrier initialised for its cluster's other programs (cluster rank 0,
    thread 0) and every thread's
    `barrier.cluster.arrive.release` at the kernel's entry, before the first instruction that reads %tid.x
    (the warp-specialised kernel's branch of the worker warps follows it). Other PTX unchanged."""
    if MARK not in ptx:
        return ptx
    lines = ptx.split("\n")
    entry = next((i for i, s in enumerate(lines) if ".entry" in s), None)
    if entry is None:
        raise RewriteError("cluster fixup: the marked PTX has no .entry")
    at = next((i for i in range(entry, len(lines)) if _ENTRY.match(lines[i])), None)
    if at is None:
        raise RewriteError("cluster fixup: no %tid.x read at the kernel's entry to put the cluster barrier before")
    branch = next((i for i in range(entry, at) if re.search(r"\bbra\b|^\$L__BB", lines[i])), None)
    if branch is not None:
        raise RewriteError("cluster fixup: control flow before the entry's %tid.x read")
    code = _ENTRY_CODE.format(barrier=BARRIER_BYTES, mark=MARK)
    return "\n".join(lines[:at] + [code] + lines[at:])


def _prefer_shared(function: int) -> None:
    """The largest shared-memory carveout for the function (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    = 100 %). Without it the driver may keep the smaller carveout that held the kernel without the region,
    and with the region only 2-3 programs fit an SM instead of 4 (a cluster of S then waits for S slots)."""
    import ctypes

    global _CUDA
    if _CUDA is None:
        _CUDA = ctypes.CDLL("libcuda.so.1")
    rc = _CUDA.cuFuncSetAttribute(ctypes.c_void_p(function), ctypes.c_int(9), ctypes.c_int(100))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT) failed: CUresult {rc}")


_CUDA = None


def prepare(compiled, cluster: int, extra: int) -> int:
    """Make a compiled kernel (triton.CompiledKernel, one CTA per program) launch as clusters of `cluster`
    programs with `extra` more bytes of dynamic shared memory -> the device's most co-resident clusters of it.
    Idempotent. The caller passes grid / cluster as the launch grid (the launcher multiplies by num_ctas)."""
    from triton.runtime import driver

    compiled._init_handles()
    shared = -(-compiled.metadata.shared // 16) * 16 + extra
    _prefer_shared(compiled.function)
    most = driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared, cluster)
    compiled.packed_metadata = (compiled.metadata.num_warps, cluster, shared)
    return most


def install() -> None:
    """Put the rewrite into Triton's pipeline (qerl/kernels/ptx_hook.py); idempotent."""
    from qerl.kernels import ptx_hook

    ptx_hook.add(rewrite)
