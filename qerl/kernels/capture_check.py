"""Which Triton / Gluon kernels are loaded while a CUDA graph is being captured.

The rollout engine runs the first decode step of a shape and the first prefill of a shape eagerly
and captures the second, so every kernel a capture launches should already be compiled and loaded
in the process. A kernel whose binary is loaded inside a capture means the warm-up and the capture
launched different specialisations (a launch plan that changes after the first launch's occupancy
measurement, a switch read between the two, ...): a compile (seconds) inside the capture, and a module
load that some drivers refuse there. Session 61 saw captures invalidated with no known cause in the
resident-LoRA tests (benchmarks/NOTES_rollout.md section 53); this is the check that tells whether
such a mismatch is behind it.

Used by tests on the GPU; imports Triton only when entered, so `import qerl` stays light.
"""

from __future__ import annotations

import contextlib

__all__ = ["loads_during_capture"]


@contextlib.contextmanager
def loads_during_capture():
    """Yields a list that collects the name of every Triton / Gluon kernel whose binary is loaded
    while the current stream is capturing a CUDA graph (Triton's kernel_load_start_hook, which
    fires when a compiled kernel is first launched in this process). A kernel loaded earlier in
    the process is not loaded again, so a process that already ran the same variant elsewhere
    hides a mismatch: the check can miss one, never invent one."""
    import torch
    from triton import knobs

    seen: list[str] = []

    def hook(module, function, name, metadata_group, hash_):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            seen.append(name)

    knobs.runtime.kernel_load_start_hook.add(hook)
    try:
        yield seen
    finally:
        knobs.runtime.kernel_load_start_hook.remove(hook)
