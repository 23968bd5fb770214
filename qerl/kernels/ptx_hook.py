"""One Triton compile-stage hook for the project's PTX rewrites (`ptx_pwa`, `ptx_cluster`).

Triton keeps a single `knobs.runtime.add_stages_inspection_hook`; this module installs one that wraps the
"ptx" stage so every registered rewrite runs on each kernel's PTX, in the order registered, after any hook
that was there before ours. A rewrite leaves PTX without its own mark unchanged.
"""

from __future__ import annotations

from typing import Callable

_REWRITES: list[Callable[[str], str]] = []
_PREVIOUS = None
_INSTALLED = False


def _hook(backend, stages, options, language, capability):
    if _PREVIOUS is not None:
        _PREVIOUS(backend, stages, options, language, capability)
    if "ptx" not in stages:
        return
    make_ptx = stages["ptx"]

    def ptx_stage(src, metadata):
        ptx = make_ptx(src, metadata)
        for rewrite in _REWRITES:
            ptx = rewrite(ptx)
        return ptx

    stages["ptx"] = ptx_stage


def add(rewrite: Callable[[str], str]) -> None:
    """Run `rewrite` on the PTX of every kernel compiled from now on; idempotent."""
    global _PREVIOUS, _INSTALLED
    if rewrite not in _REWRITES:
        _REWRITES.append(rewrite)
    if _INSTALLED:
        return
    import triton.knobs as knobs

    _PREVIOUS = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _hook
    _INSTALLED = True
