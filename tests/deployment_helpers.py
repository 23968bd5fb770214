"""A real Prefect stack for tests/test_deployment.py: `prefect server start` on 127.0.0.1 with a
temporary SQLite database, process workers, `prefect deploy`, the REST API, and teardown.

Everything is a subprocess with an explicit environment (PREFECT_HOME, PREFECT_API_URL, the
database URL and the result storage all under one temporary directory), so it neither reads nor
changes the user's Prefect profile, and a prefect_test_harness elsewhere in the session does not
interfere. Processes start in their own sessions and are killed by process group, plus every
descendant (flow-run processes start their own sessions too).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]  # the CLI of this interpreter's prefect
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectStack:
    """One temporary Prefect server + its workers. Use as a context manager (teardown on exit)."""

    def __init__(self, base: Path, startup_timeout: float = 420):
        self.base = base
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.startup_timeout = startup_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        home = base / "prefect-home"
        home.mkdir(parents=True, exist_ok=True)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{base / 'prefect.db'}",
            "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(base / "prefect-results"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_CLI_PROMPT": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",  # for the zombie automation
            "PYTHONUNBUFFERED": "1",
        }
        self.http = httpx.Client(base_url=self.api, timeout=60)

    # ---- processes
    def _spawn(self, key: str, args: list[str], cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.base / f"{key}.log"
        self.logs[key] = log
        proc = subprocess.Popen(
            ["nice", "-n", "5", *args], cwd=cwd, env={**self.env, **(env or {})}, stdout=open(log, "ab"),
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.procs[key] = proc
        return proc

    def start_server(self) -> None:
        proc = self._spawn("server", [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)])
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{self.tail('server')}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"prefect server not healthy after {self.startup_timeout}s:\n{self.tail('server')}")

    def start_worker(self, pool: str, name: str, env: dict[str, str] | None = None, limit: int | None = None) -> subprocess.Popen:
        args = [*PREFECT, "worker", "start", "--pool", pool, "--name", name] + (["--limit", str(limit)] if limit else [])
        return self._spawn(f"worker-{name}", args, env=env)

    def kill(self, key: str, sig: int = signal.SIGKILL) -> list[int]:
        """Kill a process, its process group and every descendant (flow runs included) -> pids killed."""
        import psutil

        proc = self.procs.pop(key, None)
        if proc is None or proc.poll() is not None:
            return []
        try:
            victims = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            victims = []
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        killed = []
        for p in victims:
            try:
                p.send_signal(sig)
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=30)
        return killed

    def cli(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run(
            ["nice", "-n", "5", *PREFECT, *args], cwd=ROOT, env=self.env,
            capture_output=True, text=True, timeout=timeout,
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} -> {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def python(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run(["nice", "-n", "5", sys.executable, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"python {' '.join(args)} -> {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
        return out

    def tail(self, key: str, n: int = 60) -> str:
        path = self.logs.get(key)
        if not path or not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])

    def close(self) -> None:
        for key in [k for k in self.procs if k != "server"] + (["server"] if "server" in self.procs else []):
            self.kill(key, signal.SIGTERM if key == "server" else signal.SIGKILL)
        for key in list(self.procs):
            self.kill(key, signal.SIGKILL)
        self.http.close()

    def __enter__(self) -> "PrefectStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- REST API
    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        r = self.http.get(f"/flow_runs/{flow_run_id}")
        r.raise_for_status()
        return r.json()

    def state(self, flow_run_id: str) -> str:
        return self.flow_run(flow_run_id)["state"]["type"]

    def task_runs(self, flow_run_id: str) -> list[dict[str, Any]]:
        r = self.http.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})
        r.raise_for_status()
        return r.json()

    def gcl(self, name: str) -> dict[str, Any]:
        r = self.http.get(f"/v2/concurrency_limits/{name}")
        r.raise_for_status()
        return r.json()

    def logs_of(self, flow_run_id: str) -> str:
        r = self.http.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})
        r.raise_for_status()
        return "\n".join(x["message"] for x in r.json())

    def wait_for_log(self, flow_run_id: str, text: str, timeout: float = 90) -> str:
        """The flow run's logs once they contain `text` (logs reach the API in batches, after the state)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = self.logs_of(flow_run_id)
            if text in logs or time.monotonic() > deadline:
                assert text in logs, f"{text!r} not in the logs of flow run {flow_run_id}:\n{logs}"
                return logs
            time.sleep(1)

    def set_state(self, flow_run_id: str, state_type: str, message: str) -> None:
        r = self.http.post(
            f"/flow_runs/{flow_run_id}/set_state",
            json={"state": {"type": state_type, "message": message}, "force": True},
        )
        r.raise_for_status()

    def wait(self, flow_run_id: str, timeout: float, until=TERMINAL) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.state(flow_run_id)
            if st in until:
                return st
            time.sleep(2)
        raise TimeoutError(f"flow run {flow_run_id} still {self.state(flow_run_id)} after {timeout}s")

    def run_deployment(self, name: str, params: dict[str, Any], watch: bool = True, timeout: float = 1800) -> tuple[str, subprocess.CompletedProcess]:
        """`prefect deployment run NAME --params JSON [--watch]` -> (flow run id, the CLI result)."""
        args = ["deployment", "run", name, "--params", json.dumps(params)]
        if watch:
            args += ["--watch", "--watch-timeout", str(int(timeout))]
        out = self.cli(*args, timeout=timeout + 120, check=False)
        m = re.search(r"UUID:\s*(" + UUID_RE.pattern + ")", out.stdout) or UUID_RE.search(out.stdout)
        if not m:
            raise RuntimeError(f"no flow run id in `prefect {' '.join(args)}` output:\n{out.stdout}\n{out.stderr}")
        return m.group(1), out
