"""Run a script under Triton's interpreter (TRITON_INTERPRET=1) in a subprocess and return the
JSON it prints after "RESULTS": the kernel tests' shared runner (the interpreter must be chosen
before triton is imported, hence the subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, seed: int, timeout: int = 300):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", SEED=str(seed))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULTS")][-1][len("RESULTS"):])
