"""One Triton helper for a kernel that waits on the device for a count another kernel (or another
program of its own launch) adds to: the LoRA expand's wait for the shrink (lora_triton), the decode
kernels' wait for a Ready delta (decode_ops) and the resident LoRA kernel's waits (lora_resident).
Imports Triton: load it only where kernels are built."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nap(ns: tl.constexpr):
    # PTX nanosleep (sm_70+): the warp gives up its issue slots for about ns nanoseconds (the hardware
    # picks a time in [0, 2 ns]); not in the interpreter, so SLEEP stays 0 there
    tl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, 0;", "=r,r", [tl.full([1], ns, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_count(ptr, target, err_ptr, CAP: tl.constexpr, SLEEP: tl.constexpr = 0):
    # wait until the int32 at ptr reaches target: volatile polls first (no atomic traffic), then an
    # acquire whose value is used (an unused one is dropped by the compiler, and then nothing orders
    # the caller's later loads after it). CAP > 0: give up after CAP polls and add one at err_ptr (a
    # producer that never came: the caller reads garbage instead of hanging); CAP = 0: wait for ever.
    # SLEEP > 0: each failed volatile poll first naps about SLEEP ns (a waiter that shares its SM with
    # other kernels' warps leaves them its issue slots)
    if CAP > 0:
        n = 0
        done = tl.load(ptr, volatile=True)
        while (done < target) & (n < CAP):
            if SLEEP > 0:
                _nap(SLEEP)
            done = tl.load(ptr, volatile=True)
            n += 1
        done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while (done < target) & (n < CAP):
            done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
            n += 1
        if done < target:
            tl.atomic_add(err_ptr, 1)
    else:
        done = tl.load(ptr, volatile=True)
        while done < target:
            if SLEEP > 0:
                _nap(SLEEP)
            done = tl.load(ptr, volatile=True)
        done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while done < target:
            done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
