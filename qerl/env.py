"""Integer switches read from the environment at import (the kernels' and the rollout engine's
`QERL_*` tuning knobs), with a one-line error that names the variable when its value is not an
integer. Standard library only, so any module can use it without making `import qerl` heavier."""

from __future__ import annotations

import os

__all__ = ["env_int", "switches", "switches_prefix"]


def env_int(name: str, default: int | None) -> int | None:
    """int(os.environ[name]); `default` where it is unset or empty; ValueError naming it otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer (unset it for the default, {default})") from None


def switches() -> dict[str, str]:
    """The `QERL_*` switches set in this process's environment, sorted by name. Paths (names ending in _DIR)
    are left out; they say where, not what ran."""
    return dict(sorted((k, v) for k, v in os.environ.items() if k.startswith("QERL_") and not k.endswith("_DIR")))


def switches_prefix() -> str:
    """switches() as a shell prefix ("QERL_A=1 QERL_B=0 "; "" when none), for the command line a benchmark
    records: the same command then reproduces its row."""
    return "".join(f"{k}={v} " for k, v in switches().items())
