"""One Triton helper for a kernel that waits on the device for a count another kernel (or another
program of its own launch) adds to: the LoRA expand's wait for the shrink (lora_triton), the decode
kernels' wait for a Ready delta (decode_ops) and the resident LoRA kernel's waits (lora_resident).
Imports Triton: load it only where kernels are built."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_count(ptr, target, err_ptr, CAP: tl.constexpr):
    # wait until the int32 at ptr reaches target: volatile polls first (no atomic traffic), then an
    # acquire whose value is used (an unused one is dropped by the compiler, and then nothing orders
    # the caller's later loads after it). CAP > 0: give up after CAP polls and add one at err_ptr (a
    # producer that never came: the caller reads garbage instead of hanging); CAP = 0: wait for ever
    if CAP > 0:
        n = 0
        done = tl.load(ptr, volatile=True)
        while (done < target) & (n < CAP):
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
            done = tl.load(ptr, volatile=True)
        done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        while done < target:
            done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
