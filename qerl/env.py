"""Integer switches read from the environment at import (the kernels' and the rollout engine's
`QERL_*` tuning knobs), with a one-line error that names the variable when its value is not an
integer. Standard library only, so any module can use it without making `import qerl` heavier."""

from __future__ import annotations

import os

__all__ = ["env_int"]


def env_int(name: str, default: int | None) -> int | None:
    """int(os.environ[name]); `default` where it is unset or empty; ValueError naming it otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer (unset it for the default, {default})") from None
