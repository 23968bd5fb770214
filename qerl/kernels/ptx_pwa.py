"""Per-warp release of shared-memory ring stages in the Gluon kernels (PWA), by a PTX rewrite.

Why: triton 3.6 lowers Gluon's `mbarrier.arrive` to one thread of the partition, after a CTA
barrier (`bar.sync 0, <threads>`) that makes every warp's reads of the stage happen first, and its
membar pass adds another CTA barrier before each `mbarrier.try_wait` in the MMA loop. So the
consumer warps of the GEMV (mma.sync, warp-level: independent warps) and of the register-operand
GEMM meet twice or three times per 256-K step, and a warp that waits on its loads stalls the
others. Gluon exposes no shared-memory address for an inline-asm arrive, so the change is made on
the PTX. Measured (NOTES_w4a16.md section 22): outputs bit-identical, decode steps 0.5-1.3% faster
at 8-64 rows; Nsight's large CTA-barrier stall count for these kernels is mostly the producer and
padding warps idling at the partition join, which this does not touch.

A kernel opts in by initialising its "empty" barriers with one arrival per consumer warp through
`w4a16_ws._ring_barriers`, which emits `mark()` with that count. `rewrite` then, for PTX that carries the mark:
- turns every plain `mbarrier.arrive.shared::cta.b64` whose predicate is the partition's thread-0
  predicate (the one the `mbarrier.init`s use), or that predicate AND a user predicate (one set
  constant false is left as it is: it never fires), into
  `bar.warp.sync -1` (the warp's reads are ordered before its lane 0) plus an arrive by lane 0 of
  every warp (the user predicate kept). The producers' `arrive.expect_tx` are left alone;
- deletes the CTA barriers (`bar.sync 0, n`) inside the innermost loops that hold MMAs and no
  generic shared-memory stores: there they only order mbarrier operations, which the per-warp
  arrivals order by themselves. Barriers outside those loops (epilogues, the split's fixup,
  stream-K segment ends) stay.

Anything unexpected (no arrive rewritten, an arrive predicate it cannot read, a store in an MMA
loop) raises, so a kernel never runs with its empty barriers waiting for arrivals that never come.
The mark carries a version: a change to this rewrite must bump it, so Triton's cache (keyed on the
source, not on this hook) compiles again.
"""

from __future__ import annotations

import re

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MARK = "qerl-pwa-v1"

_ARRIVE = re.compile(r"^(\s*)@(%p\d+) mbarrier\.arrive\.shared::cta\.b64 _, \[(%r\d+)\];\s*$")
_INIT_PRED = re.compile(r"@(%p\d+) mbarrier\.init\.")
_FALSE_PRED = re.compile(r"^\s*mov\.pred\s+(%p\d+),\s*0;")
_AND_PRED = re.compile(r"^\s*and\.pred\s+(%p\d+),\s*(%p\d+),\s*(%p\d+);")
_CTA_BAR = re.compile(r"^\s*bar\.sync\s+0,\s*\d+;\s*$")
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BACK = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_MMA = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\b")
_SMEM_WRITE = re.compile(r"\b(?:st\.shared|atom\.shared|red\.shared|stmatrix|cp\.async\.(?!bulk))")


@gluon.jit
def mark():
    """Emit the opt-in mark (a PTX comment carrying MARK; the output register is unused)."""
    gl.inline_asm_elementwise("// qerl-pwa-v1 $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)  # = MARK


class RewriteError(RuntimeError):
    pass


def _mma_loops(lines: list[str]) -> list[tuple[int, int]]:
    """[label, backward branch] line ranges of the innermost loops that hold an MMA; raises if such a
    loop also stores to shared memory (its CTA barriers may then order those stores)."""
    labels = {}
    loops = []
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
            continue
        m = _BACK.search(line)
        if m and m.group(1) in labels:
            loops.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in loops if not any(a < c and d < b for c, d in loops if (c, d) != (a, b))]
    out = []
    for a, b in inner:
        body = lines[a:b + 1]
        if not any(_MMA.search(s) for s in body):
            continue
        bad = [s.strip() for s in body if _SMEM_WRITE.search(s) and not s.lstrip().startswith("//")]
        if bad:
            raise RewriteError(f"per-warp arrive: shared-memory store in an MMA loop: {bad[0]}")
        out.append((a, b))
    return out


def rewrite(ptx: str) -> str:
    """The PTX with per-warp arrivals if it carries MARK, else unchanged (see the module text)."""
    if MARK not in ptx:
        return ptx
    base = set(_INIT_PRED.findall(ptx))
    if not base:
        raise RewriteError("per-warp arrive: no mbarrier.init predicate found")
    ands, false = {}, set()
    for line in ptx.splitlines():
        m = _AND_PRED.match(line)
        if m:
            ands[m.group(1)] = (m.group(2), m.group(3))
        m = _FALSE_PRED.match(line)
        if m:
            false.add(m.group(1))
    lines = ptx.split("\n")
    drop = set()
    for a, b in _mma_loops(lines):
        drop.update(i for i in range(a, b + 1) if _CTA_BAR.match(lines[i]))
    out, arrives = [], 0
    for i, line in enumerate(lines):
        if i in drop:
            continue
        m = _ARRIVE.match(line)
        if not m:
            out.append(line)
            continue
        ind, pred, addr = m.groups()
        if pred in false:  # an arrive that never fires (e.g. a peeled first step's `pred=i > 0`)
            out.append(line)
            continue
        if pred in base:
            user = None
        elif pred in ands and (set(ands[pred]) & base):
            x, y = ands[pred]
            user = y if x in base else x
        else:
            raise RewriteError(f"per-warp arrive: cannot read the predicate of: {line.strip()}")
        setp = (f"setp.eq.and.b32 %pwa_p, %pwa_r, 0, {user};" if user else "setp.eq.b32 %pwa_p, %pwa_r, 0;")
        out.append(f"{ind}bar.warp.sync -1;")
        out.append(f"{ind}{{ .reg .pred %pwa_p; .reg .b32 %pwa_r; mov.u32 %pwa_r, %laneid; {setp} "
                   f"@%pwa_p mbarrier.arrive.shared::cta.b64 _, [{addr}]; }}")
        arrives += 1
    if arrives == 0:
        raise RewriteError("per-warp arrive: the PTX is marked but has no consumer arrive")
    return "\n".join(out)


def install() -> None:
    """Put the rewrite into Triton's pipeline (qerl/kernels/ptx_hook.py); idempotent."""
    from qerl.kernels import ptx_hook

    ptx_hook.add(rewrite)
