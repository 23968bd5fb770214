"""The paper's efficiency claims (Table 3's GRPO step speedups, rollout throughput, the 4-bit kernels, peak
memory) as tables regenerated from MLflow runs of the benchmark result files.

    qerl bench log benchmarks/results/grpo_step.json benchmarks/results/h200/*.json   # one run per file
    qerl bench table --out reports/efficiency                                          # from the runs
    # -> table.md, efficiency.json, step_speedup.png, also logged to a run `efficiency/report` (tag step=report)

The benchmarks (`benchmarks/bench_*.py`) run on GPU machines that may have no MLflow; each writes one JSON
file. `log_results` turns each file into a FINISHED run of the experiment `qerl-benchmarks` (tag
`step=benchmark`): the file itself as the artifact `benchmark/<name>`, its GPU, torch, triton, date and
command as params, and its numbers as metrics (one per row and quantity, e.g.
`qwen2.5-7b/nvfp4/b8/speedup`; for the kernel sweep the medians over the layer shapes per M). A file
already logged (the same bytes: tag `benchmark.sha256`) is not logged twice. `build_tables` reads the
files back from the runs' artifacts, never from the disk, so the tables are what the store holds.

Where several runs hold the same cell (the same GPU, memory cap, model, format, batch, micro-batch, LoRA
rank), the newest row wins (its date, else its file's). nf4 rows measured with the fused NF4 decode
(`nf4_decode: fused<=N`) are a labelled column of their own, `nf4 (fused decode)`, never the QLoRA
baseline's. The paper's cells (PAPER_STEP_SPEEDUP, PAPER_ROLLOUT_*) come from ../shared/paper.md.

`import qerl.efficiency` imports neither MLflow nor matplotlib; they are imported by the calls that need them.
"""

from __future__ import annotations

import datetime as _dt
import glob
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "BenchmarkError",
    "check_benchmark",
    "EXPERIMENT",
    "PAPER_ROLLOUT_BY_RANK",
    "PAPER_ROLLOUT_7B_B8",
    "PAPER_STEP_SPEEDUP",
    "PAPER_WEIGHTS_GB",
    "build_tables",
    "detect_kind",
    "expand_files",
    "load_result",
    "log_report",
    "log_results",
    "result_metrics",
    "run_benchmark",
    "short_gpu",
    "write_report",
]

EXPERIMENT = "qerl-benchmarks"
KINDS = ("grpo_step", "memory", "rollout", "w4a16")

# QeRL (arXiv 2510.11696), end-to-end GRPO step speedup over bf16 LoRA on one H100-80GB, prompt 256,
# completion 2048, at batch 2 / 4 / 8 (QLoRA = nf4, QeRL = nvfp4)
PAPER_STEP_SPEEDUP: dict[str, dict[str, dict[int, float]]] = {
    "qwen2.5-7b": {"nf4": {2: 0.8, 4: 0.8, 8: 0.7}, "nvfp4": {2: 1.5, 4: 1.4, 8: 1.2}},
    "qwen2.5-14b": {"nf4": {2: 0.9, 4: 0.7, 8: 0.7}, "nvfp4": {2: 1.4, 4: 1.2, 8: 1.2}},
}
# rollout tokens/s: 7B at batch 8 (the project figure, batch per a summary); LoRA = bf16, QLoRA = nf4, QeRL = nvfp4
PAPER_ROLLOUT_7B_B8: dict[str, float] = {"bf16": 1641.0, "nf4": 1362.0, "nvfp4": 2092.0}
# rollout tokens/s at LoRA rank 16 / 32 / 64, probably batch 1
PAPER_ROLLOUT_BY_RANK: dict[str, dict[str, dict[int, float]]] = {
    "qwen2.5-14b": {"bf16": {16: 65.4, 32: 63.1, 64: 61.2}, "nf4": {16: 45.1, 32: 44.2, 64: 42.8},
                    "nvfp4": {16: 95.3, 32: 92.9, 64: 86.0}},
    "qwen2.5-32b": {"bf16": {16: 34.0, 32: 33.3, 64: 31.9}, "nf4": {16: 25.2, 32: 25.6, 64: 23.0},
                    "nvfp4": {16: 58.0, 32: 56.0, 64: 51.3}},
}
# model weights in GPU memory, GB (the paper's summary): bf16, NF4 and NVFP4
PAPER_WEIGHTS_GB: dict[str, dict[str, float]] = {
    "qwen2.5-7b": {"bf16": 15.2, "nf4": 5.7, "nvfp4": 5.9},
    "qwen2.5-14b": {"bf16": 29.6, "nf4": 10.2, "nvfp4": 10.6},
    "qwen2.5-32b": {"bf16": 62.3, "nvfp4": 20.7},
}
PAPER_SOURCE = ("QeRL (arXiv 2510.11696): GRPO step speedup over bf16 LoRA on one H100-80GB (prompt 256, completion "
                "2048); rollout tokens/s of 7B at batch 8 (project figure) and of 14B / 32B at LoRA rank 16 / 32 / 64 "
                "(probably batch 1)")
# issue 4's goals for the kernel sweep: (label, forward M values or "bwd4096", goal ratio)
KERNEL_BUCKETS: tuple[tuple[str, Any, float], ...] = (
    ("M<=16", (1, 2, 4, 8, 16), 3.0), ("M=64", (64,), 2.0), ("M=256", (256,), 1.0),
    ("M>=1024", (1024, 4096), 0.85), ("backward M=4096", "bwd4096", 0.85),
)
FUSED_NF4 = "nf4 (fused decode)"


class BenchmarkError(ValueError):
    """A benchmark file that cannot be read, or a store without benchmark runs (bad input: one line)."""


# ----------------------------------------------------------------------------- reading the files


def detect_kind(data: dict) -> str:
    """grpo_step | memory | rollout | w4a16, from the fields of the file's rows."""
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows or not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise BenchmarkError("no rows: not a benchmark result file (benchmarks/bench_*.py writes {\"rows\": [...]})")
    keys = set().union(*(r.keys() for r in rows))
    if {"op", "us", "bf16_us"} <= keys:
        return "w4a16"
    if {"tokens_per_s", "bf16_tokens_per_s"} <= keys:
        return "rollout"
    if {"peak_gib", "status"} <= keys:
        return "memory"
    if {"step_s", "bf16_step_s", "speedup"} <= keys:
        return "grpo_step"
    raise BenchmarkError(f"rows with fields {sorted(keys)[:8]}...: not one of {', '.join(KINDS)}")


def load_result(path: str | os.PathLike) -> tuple[str, dict, bytes]:
    """(kind, data, the file's bytes) of a benchmark JSON file; BenchmarkError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise BenchmarkError(f"{p}: no such benchmark file")
    raw = p.read_bytes()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchmarkError(f"{p}: not JSON ({exc})") from None
    try:
        return detect_kind(data), data, raw
    except BenchmarkError as exc:
        raise BenchmarkError(f"{p}: {exc}") from None


def _latest(value: Any) -> str:
    """A file's date: a combined file lists its calls' dates (the newest counts)."""
    if isinstance(value, list):
        value = max((str(v) for v in value if v), default="")
    return str(value or "")


def short_gpu(name: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'; unknown names pass through."""
    for tag in ("H200", "H100", "A100", "L40S", "B200"):
        if tag in (name or ""):
            return tag
    return name or "?"


def _gpu_label(data: dict, row: dict) -> str:
    """'H200', or 'H200 (79 GiB cap)' for a step measured under --device-memory-gib."""
    label = short_gpu(row.get("gpu") or data.get("gpu"))
    cap = row.get("device_memory_gib")
    return f"{label} ({cap:g} GiB cap)" if cap else label


def _step_format(row: dict, data: dict | None = None) -> str:
    """The row's format; nf4 with the fused NF4 decode is FUSED_NF4: its `nf4_decode` field says so, or (files from
    before that field) the command that produced it set QERL_NF4_FUSED_MAX_M above 0."""
    if row.get("format") != "nf4":
        return str(row.get("format"))
    if row.get("nf4_decode"):
        return FUSED_NF4 if str(row["nf4_decode"]).startswith("fused") else "nf4"
    command = row.get("command") or (data or {}).get("command")
    command = command if isinstance(command, str) else ""
    fused = re.search(r"QERL_NF4_FUSED_MAX_M=(\d+)", command)
    return FUSED_NF4 if fused and int(fused.group(1)) > 0 else "nf4"


# bench_grpo_step: the first step compiles kernels and captures graphs, the second re-captures them (and keeps them
# if they fit), the third is the first steady one (its default --steps)
STEADY_STEPS = 3


def _steps(row: dict, data: dict | None = None) -> int | None:
    """How many GRPO steps the row's configuration ran (its last is reported): the row's `steps` (rows since session
    56), else the --steps of the command that made it (a combined file lists its calls' commands beside their dates:
    the call of the row's date), else None (not known: an old default)."""
    if row.get("steps") is not None:
        return int(row["steps"])
    command = row.get("command") or (data or {}).get("command")
    if isinstance(command, list):
        dates = (data or {}).get("date")
        dates = dates if isinstance(dates, list) and len(dates) == len(command) else [None] * len(command)
        command = [c for c, d in zip(command, dates) if d == row.get("date")]
        command = command[0] if len(command) == 1 else None
    found = re.findall(r"--steps[= ](\d+)", command) if isinstance(command, str) else []
    return int(found[-1]) if found else None


def _model_tag(row: dict) -> str:
    return str(row.get("model", "?")).lower()


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def kernel_medians(rows: list[dict]) -> dict[tuple[str, str], float]:
    """{(format, bucket label): median speedup over the shapes' cells} for the 4-bit formats of a kernel sweep."""
    out: dict[tuple[str, str], float] = {}
    for fmt in sorted({r["format"] for r in rows if r.get("format") != "bf16"}):
        for label, ms, _ in KERNEL_BUCKETS:
            if ms == "bwd4096":
                vals = [r["speedup"] for r in rows if r["format"] == fmt and r["op"] == "backward" and r["m"] == 4096]
            else:
                vals = [r["speedup"] for r in rows if r["format"] == fmt and r["op"] == "forward" and r["m"] in ms]
            vals = [v for v in (_finite(x) for x in vals) if v is not None]
            if vals:
                out[fmt, label] = statistics.median(vals)
    return out


def _metric_name(key: str) -> str:
    """'nvfp4/M<=16/median_speedup' -> 'nvfp4/M_le_16/median_speedup' (MLflow's metric name characters)."""
    key = key.replace("<=", "_le_").replace(">=", "_ge_").replace("=", "_").replace(" ", "_")
    return re.sub(r"[^A-Za-z0-9_\-./:]", "", key)


def result_metrics(kind: str, data: dict) -> dict[str, float]:
    """The file's numbers as MLflow metrics: one per row and quantity (kernel sweeps: medians per M bucket)."""
    out: dict[str, float] = {}

    def put(key: str, value: Any) -> None:
        v = _finite(value)
        if v is not None:
            out[_metric_name(key)] = v

    if kind == "w4a16":
        for (fmt, label), v in kernel_medians(data["rows"]).items():
            put(f"{fmt}/{label}/median_speedup", v)
        put("copy_gbps", data.get("copy_gbps"))
        return out
    for r in data["rows"]:
        base = f"{_model_tag(r)}/{_step_format(r, data)}/b{r.get('batch')}"
        if kind == "grpo_step":
            for q in ("step_s", "bf16_step_s", "speedup"):
                put(f"{base}/mb{r.get('micro_batch', '')}/{q}", r.get(q))
        elif kind == "memory":
            put(f"{base}/mb{r.get('micro_batch', '')}/peak_gib", r.get("peak_gib"))
            put(f"{base}/mb{r.get('micro_batch', '')}/step_s", r.get("step_s"))
        else:  # rollout
            for q in ("tokens_per_s", "bf16_tokens_per_s", "hf_generate_tokens_per_s"):
                put(f"{base}/r{r.get('lora_rank', 0)}/{q}", r.get(q))
    return out


# ----------------------------------------------------------------------------- running a benchmark

# the benchmark scripts of a checkout (benchmarks/), by the kind of result they write, and how each is told where
BENCHMARKS: dict[str, tuple[str, str]] = {
    "grpo_step": ("bench_grpo_step.py", "--out-dir"),  # memory.json + grpo_step.json in that folder
    "rollout": ("bench_rollout.py", "--out"),          # one file
    "w4a16": ("bench_w4a16.py", "--out"),
}


def benchmarks_dir() -> Path:
    """The checkout's benchmarks/ folder (the scripts are not part of the installed package)."""
    return Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_device(args: list[str]) -> str:
    """The device a benchmark's arguments name (--device X or --device=X); the scripts' default is cuda."""
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            return str(args[i + 1])
        if str(a).startswith("--device="):
            return str(a).split("=", 1)[1]
    return "cuda"


def expand_files(patterns: Iterable[str]) -> list[Path]:
    """Result files named by paths or glob patterns (relative to the working directory), each once, in order;
    BenchmarkError for a pattern that matches nothing."""
    out: list[Path] = []
    for pat in patterns:
        hits = sorted(Path(h) for h in glob.glob(pat)) if any(c in pat for c in "*?[") else [Path(pat)]
        if not hits or not all(h.is_file() for h in hits):
            raise BenchmarkError(f"{pat}: no such benchmark file")
        out += [h for h in hits if h not in out]
    return out


def check_benchmark(kind: str, args: list[str]) -> Path:
    """The script of a benchmark spec; BenchmarkError for an unknown kind, a checkout without the script, or args that
    set the output themselves."""
    if kind not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {kind!r}: one of {', '.join(BENCHMARKS)}")
    path = benchmarks_dir() / BENCHMARKS[kind][0]
    if not path.is_file():
        raise BenchmarkError(f"{path}: not found; benchmarks run from a clone of the project")
    if any(str(a).split("=")[0] in ("--out", "--out-dir") for a in args):
        raise BenchmarkError(f"benchmark {kind}: leave --out / --out-dir out of the arguments (the run sets them)")
    return path


def run_benchmark(kind: str, args: list[str], out_dir: str | os.PathLike, log=print) -> list[Path]:
    """Run benchmarks/<script> of `kind` (grpo_step | rollout | w4a16) with `args` in a child process that writes into
    `out_dir`; its output goes line by line to `log`. Returns the benchmark result files it wrote. BenchmarkError for
    an unknown kind, args that set the output themselves, or a checkout without the script; RuntimeError naming the
    exit code when the benchmark fails."""
    path = check_benchmark(kind, args)
    out_flag = BENCHMARKS[kind][1]
    device = benchmark_device(args)
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BenchmarkError(f"benchmark {kind} runs on {device} and this machine has no CUDA GPU"
                                 + (" (bench_grpo_step.py runs tiny models with --device cpu)" if kind == "grpo_step" else ""))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = str(out) if out_flag == "--out-dir" else str(out / f"{kind}.json")
    cmd = [sys.executable, str(path), *[str(a) for a in args], out_flag, target]
    log("$ " + " ".join(cmd))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          cwd=str(benchmarks_dir().parent)) as proc:
        for line in proc.stdout:
            log(line.rstrip("\n"))
    if proc.returncode:
        raise RuntimeError(f"benchmark {kind} ({path.name}) exited with code {proc.returncode}; its output is above")
    found = []
    for f in sorted(out.glob("*.json")):
        try:
            load_result(f)
        except BenchmarkError:
            continue
        found.append(f)
    if not found:
        raise RuntimeError(f"benchmark {kind} wrote no result file into {out}")
    return found


# ----------------------------------------------------------------------------- MLflow


def _tracker(tracking_uri: str, experiment: str):
    from qerl.recipe import MlflowSettings
    from qerl.tracking import Tracker

    return Tracker(MlflowSettings(tracking_uri=tracking_uri, experiment=experiment))


def _benchmark_runs(tracker) -> list:
    """Every FINISHED benchmark run of the tracker's experiment, oldest first."""
    return [r for r in tracker.search_runs("tags.step = 'benchmark'") if r.info.status == "FINISHED"]


def log_results(paths: Iterable[str | os.PathLike], tracking_uri: str = "sqlite:///mlflow.db",
                experiment: str = EXPERIMENT) -> list[dict[str, Any]]:
    """One FINISHED MLflow run per benchmark file (files already in the store are skipped);
    [{"path", "kind", "run_id", "logged": bool}]. Every file is read and checked before anything is logged."""
    from qerl.tracking import git_commit

    loaded = [(Path(p), *load_result(p)) for p in paths]
    if not loaded:
        raise BenchmarkError("no benchmark files given")
    tracker = _tracker(tracking_uri, experiment)
    known = {r.data.tags.get("benchmark.sha256"): r.info.run_id for r in _benchmark_runs(tracker)}
    out = []
    for path, kind, data, raw in loaded:
        sha = hashlib.sha256(raw).hexdigest()
        if sha in known:
            out.append({"path": str(path), "kind": kind, "run_id": known[sha], "logged": False})
            continue
        gpu = data.get("gpu") or next((r.get("gpu") for r in data["rows"] if r.get("gpu")), None)
        tags = {"step": "benchmark", "benchmark.kind": kind, "benchmark.file": path.name, "benchmark.sha256": sha,
                "device_name": gpu or "?"}
        if git_commit():
            tags["git_commit"] = git_commit()
        run_id = tracker.start_plain_run(f"benchmark/{kind}/{path.stem}", tags)
        with tracker.tracked(run_id):
            command = data.get("command")
            tracker.log_params(run_id, {
                "gpu": gpu, "torch": data.get("torch"), "triton": data.get("triton"), "date": _latest(data.get("date")),
                "command": "\n".join(command) if isinstance(command, list) else command, "rows": len(data["rows"]),
            })
            tracker.log_metrics(run_id, result_metrics(kind, data))
            tracker.log_artifact(run_id, path, "benchmark")
        known[sha] = run_id
        out.append({"path": str(path), "kind": kind, "run_id": run_id, "logged": True})
    return out


def _results_from_store(tracker) -> list[tuple[str, dict, str]]:
    """[(kind, data, run_id)] read back from the runs' artifacts."""
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR

    out = []
    runs = _benchmark_runs(tracker)
    # one small file per run: a progress bar per download would bury the command's own output
    os.environ.setdefault(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.name, "false")
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            name = run.data.tags.get("benchmark.file")
            local = tracker.download_artifacts(run.info.run_id, f"benchmark/{name}", Path(tmp) / run.info.run_id)
            data = json.loads(Path(local).read_text())
            out.append((run.data.tags.get("benchmark.kind") or detect_kind(data), data, run.info.run_id))
    return out


# ----------------------------------------------------------------------------- the tables


def _newest(cells: dict[tuple, dict], key: tuple, row: dict) -> None:
    """Keep the newest row per cell; a steady-state step (row["steady"], GRPO steps only) beats any warm-up one."""
    old = cells.get(key)
    if old is None or (row.get("steady", True), row["date"]) >= (old.get("steady", True), old["date"]):
        cells[key] = row


def _sort_key(row: dict) -> tuple:
    return (row["gpu"], _model_size(row["model"]), row.get("batch", 0), row.get("micro_batch", 0),
            str(row.get("format")), row.get("lora_rank", 0))


def _model_size(model: str) -> float:
    digits = "".join(c for c in model.split("-")[-1] if c.isdigit() or c == ".")
    try:
        return float(digits)
    except ValueError:
        return 0.0


def step_rows(results: list[tuple[str, dict, str]]) -> list[dict[str, Any]]:
    """Table 3: one row per (GPU label, model, format, batch, micro-batch), the newest measurement, with the paper's
    cell where it has one. A measurement from fewer than STEADY_STEPS steps (its last step still re-captured graphs)
    stands only where no steady one exists, and says how many steps it ran (blank: not recorded)."""
    cells: dict[tuple, dict] = {}
    for kind, data, run_id in results:
        if kind != "grpo_step":
            continue
        for r in data["rows"]:
            if r.get("format") == "bf16" or _finite(r.get("speedup")) is None:
                continue
            fmt = _step_format(r, data)
            row = {"gpu": _gpu_label(data, r), "model": _model_tag(r), "format": fmt, "batch": int(r["batch"]),
                   "micro_batch": r.get("micro_batch"), "step_s": _finite(r.get("step_s")),
                   "bf16_step_s": _finite(r.get("bf16_step_s")), "speedup": _finite(r["speedup"]),
                   "paper": PAPER_STEP_SPEEDUP.get(_model_tag(r), {}).get(fmt, {}).get(int(r["batch"])),
                   "steps": _steps(r, data), "date": str(r.get("date") or _latest(data.get("date"))), "run_id": run_id}
            row["steady"] = row["steps"] is None or row["steps"] >= STEADY_STEPS
            _newest(cells, (row["gpu"], row["model"], fmt, row["batch"], row["micro_batch"]), row)
    return sorted(cells.values(), key=_sort_key)


def rollout_rows(results: list[tuple[str, dict, str]]) -> list[dict[str, Any]]:
    """Rollout tokens/s per (GPU, model, format, batch, LoRA rank), the newest, x bf16 in the same process, and the
    paper's number for the nearest setting it reports (7B batch 8; 14B / 32B at the same rank, probably batch 1)."""
    cells: dict[tuple, dict] = {}
    for kind, data, run_id in results:
        if kind != "rollout":
            continue
        for r in data["rows"]:
            tps, bf = _finite(r.get("tokens_per_s")), _finite(r.get("bf16_tokens_per_s"))
            if tps is None:
                continue
            model, fmt, batch, rank = _model_tag(r), _step_format(r, data), int(r["batch"]), int(r.get("lora_rank") or 0)
            paper, paper_setting = None, ""
            if model == "qwen2.5-7b" and batch == 8 and fmt in PAPER_ROLLOUT_7B_B8:
                paper, paper_setting = PAPER_ROLLOUT_7B_B8[fmt], "batch 8"
            elif batch == 1 and fmt in PAPER_ROLLOUT_BY_RANK.get(model, {}):
                by_rank = PAPER_ROLLOUT_BY_RANK[model][fmt]
                if rank in by_rank:
                    paper, paper_setting = by_rank[rank], f"LoRA r{rank}, probably batch 1"
                else:  # our row has no adapter: the paper's lowest rank, the nearest setting it reports
                    low = min(by_rank)
                    paper, paper_setting = by_rank[low], f"LoRA r{low}, probably batch 1"
            lora0 = _finite(r.get("lora0_tokens_per_s"))
            row = {"gpu": short_gpu(r.get("gpu") or data.get("gpu")), "model": model, "format": fmt, "batch": batch,
                   "lora_rank": rank, "tokens_per_s": tps, "bf16_tokens_per_s": bf,
                   "x_bf16": tps / bf if bf else None,
                   "x_no_lora": tps / lora0 if rank and lora0 else None,
                   "hf_generate_tokens_per_s": _finite(r.get("hf_generate_tokens_per_s")),
                   "completion_len": r.get("completion_len"), "paper_tokens_per_s": paper, "paper_setting": paper_setting,
                   "date": _latest(data.get("date")), "run_id": run_id}
            _newest(cells, (row["gpu"], model, fmt, batch, rank), row)
    return sorted(cells.values(), key=_sort_key)


def kernel_rows(results: list[tuple[str, dict, str]]) -> list[dict[str, Any]]:
    """Issue 4's goals per (GPU, format): the median speedup over the layer shapes per M bucket, newest sweep."""
    cells: dict[tuple, dict] = {}
    for kind, data, run_id in results:
        if kind != "w4a16":
            continue
        date = _latest(data.get("date"))
        for (fmt, label), v in kernel_medians(data["rows"]).items():
            goal = next(g for lab, _, g in KERNEL_BUCKETS if lab == label)
            if fmt == "mxfp4" and label == "M<=16":
                goal = 3.1
            row = {"gpu": short_gpu(data.get("gpu")), "format": fmt, "bucket": label, "median_speedup": v,
                   "goal": goal if fmt in ("nvfp4", "mxfp4") else None, "date": date, "run_id": run_id}
            _newest(cells, (row["gpu"], fmt, label), row)
    order = {lab: i for i, (lab, _, _) in enumerate(KERNEL_BUCKETS)}
    return sorted(cells.values(), key=lambda r: (r["gpu"], r["format"], order[r["bucket"]]))


def memory_rows(results: list[tuple[str, dict, str]]) -> list[dict[str, Any]]:
    """Peak memory of the GRPO step per (GPU label, model, format, batch, micro-batch), the newest; 'oom' kept."""
    cells: dict[tuple, dict] = {}
    for kind, data, run_id in results:
        if kind != "memory":
            continue
        for r in data["rows"]:
            row = {"gpu": _gpu_label(data, r), "model": _model_tag(r), "format": _step_format(r, data),
                   "batch": int(r.get("batch") or 1), "micro_batch": r.get("micro_batch"), "status": r.get("status"),
                   "peak_gib": _finite(r.get("peak_gib")), "step_s": _finite(r.get("step_s")),
                   "weights_gb": None if _finite(r.get("weights_gib")) is None else r["weights_gib"] * 2**30 / 1e9,
                   "paper_weights_gb": PAPER_WEIGHTS_GB.get(_model_tag(r), {}).get(str(r.get("format"))),
                   "generations": r.get("generations"), "completion_len": r.get("completion_len"),
                   "date": str(r.get("date") or _latest(data.get("date"))), "run_id": run_id}
            _newest(cells, (row["gpu"], row["model"], row["format"], row["batch"], row["micro_batch"]), row)
    return sorted(cells.values(), key=_sort_key)


def build_tables(tracking_uri: str = "sqlite:///mlflow.db", experiment: str = EXPERIMENT) -> dict[str, Any]:
    """{"step", "rollout", "kernels", "memory": rows, "runs": n, "tracking_uri", "experiment"} from the store."""
    tracker = _tracker(tracking_uri, experiment)
    results = _results_from_store(tracker)
    if not results:
        raise BenchmarkError(f"no benchmark runs in experiment {experiment!r} at {tracker.tracking_uri}; "
                             "log result files first: qerl bench log benchmarks/results/*.json")
    return {"step": step_rows(results), "rollout": rollout_rows(results), "kernels": kernel_rows(results),
            "memory": memory_rows(results), "runs": len(results), "tracking_uri": tracker.tracking_uri,
            "experiment": experiment}


# ----------------------------------------------------------------------------- rendering


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def _near_goal(x: float | None, goal: float | None) -> str:
    """x to 2 decimals, or to 3 where 2 would print the goal itself while x misses it (0.845 against 0.85)."""
    text = _f(x)
    if x is not None and goal is not None and x < goal and text == _f(goal):
        return _f(x, ".3f")
    return text


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(tables: dict[str, Any]) -> str:
    out = ["# Efficiency: GRPO step, rollouts, kernels, memory (from the benchmark runs in MLflow)", "",
           f"Regenerated from {tables['runs']} MLflow runs of experiment `{tables['experiment']}` "
           f"(`qerl bench table`). Every ratio is against bf16 timed in the same process; the newest measurement "
           "of each cell is shown. Models are random-initialised at the Qwen2.5 shapes (honest for speed, not for "
           "accuracy). Paper cells: " + PAPER_SOURCE + ".", ""]
    out += ["## GRPO step speedup over bf16 LoRA (the paper's Table 3)", "",
            "8 generations x 2048 tokens after a 256-token prompt, LoRA rank 32; `batch` = prompts per step.", ""]
    if any(not r["steady"] for r in tables["step"]):
        out += [f"`steps` below {STEADY_STEPS}: no steady-state measurement of that cell was logged; its last step still "
                "re-captured the CUDA graphs.", ""]
    out += _md(["GPU", "model", "format", "batch", "micro-batch", "steps", "step s", "bf16 step s", "x bf16",
                "paper (H100)"],
               [[r["gpu"], r["model"], r["format"], str(r["batch"]), str(r["micro_batch"] or ""),
                 "" if r["steps"] is None else str(r["steps"]) + ("" if r["steady"] else " (warm-up)"),
                 _f(r["step_s"]), _f(r["bf16_step_s"]),
                 f"**{_f(r['speedup'])}**", _f(r["paper"], ".1f")] for r in tables["step"]])
    out += ["", "## Rollout throughput (tokens/s)", "",
            "`x no-LoRA`: the same format and batch without adapters. The paper's 14B / 32B cells are at a LoRA rank; "
            "our batch-1 rows are without LoRA.", ""]
    out += _md(["GPU", "model", "format", "batch", "LoRA rank", "completion", "tok/s", "x bf16", "x no-LoRA",
                "HF generate tok/s", "paper tok/s (setting)"],
               [[r["gpu"], r["model"], r["format"], str(r["batch"]), str(r["lora_rank"] or "-"),
                 str(r["completion_len"] or ""), _f(r["tokens_per_s"], ".1f"), _f(r["x_bf16"]), _f(r["x_no_lora"], ".3f"),
                 _f(r["hf_generate_tokens_per_s"], ".1f"),
                 f"{_f(r['paper_tokens_per_s'], '.1f')} ({r['paper_setting']})" if r["paper_tokens_per_s"] else ""]
                for r in tables["rollout"]])
    out += ["", "## 4-bit x bf16 GEMM: median speedup over bf16 across the Qwen2.5 3B-32B layer shapes", ""]
    out += _md(["GPU", "format", "M", "median x bf16", "goal (H100)", "met"],
               [[r["gpu"], r["format"], r["bucket"], _near_goal(r["median_speedup"], r["goal"]), _f(r["goal"]),
                 "" if r["goal"] is None else ("yes" if r["median_speedup"] >= r["goal"] else "no")]
                for r in tables["kernels"]])
    out += ["", "## Peak GPU memory of the GRPO step", "",
            "The memory plans (`checkpoint_layers` / `rollout_memory: auto`) keep what fits, so a peak near the card's "
            "size says the step fits, not what it needs; `weights` is the model as held on the GPU (GB = 1e9 bytes, "
            "as the paper counts).", ""]
    out += _md(["GPU", "model", "format", "batch", "micro-batch", "status", "peak GiB", "step s", "weights GB",
                "paper weights GB"],
               [[r["gpu"], r["model"], r["format"], str(r["batch"]), str(r["micro_batch"] or ""), str(r["status"]),
                 _f(r["peak_gib"]), _f(r["step_s"]), _f(r["weights_gb"], ".1f"), _f(r["paper_weights_gb"], ".1f")]
                for r in tables["memory"]])
    return "\n".join(out) + "\n"


def render_plot(step: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars of the step speedup per (model, batch), one panel per GPU label, the paper's cells as black ticks."""
    rows = [r for r in step if r["format"] in ("nvfp4", "nf4")]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    gpus = sorted({r["gpu"] for r in rows})
    widest = max(len({(r["model"], r["batch"], r["micro_batch"]) for r in rows if r["gpu"] == g}) for g in gpus)
    fig, axes = plt.subplots(1, len(gpus), figsize=((0.8 * widest + 1.5) * len(gpus), 4.5), squeeze=False, sharey=True)
    top = max(max(r["speedup"] for r in rows), max((r["paper"] or 0) for r in rows))
    colors = {"nvfp4": "tab:green", "nf4": "tab:red"}
    for ax, gpu in zip(axes[0], gpus):
        mine = [r for r in rows if r["gpu"] == gpu]
        groups = sorted({(r["model"], r["batch"], r["micro_batch"]) for r in mine}, key=lambda g: (_model_size(g[0]), g[1]))
        width, labelled = 0.38, set()
        for j, fmt in enumerate(("nvfp4", "nf4")):
            for i, g in enumerate(groups):
                cell = next((r for r in mine if (r["model"], r["batch"], r["micro_batch"]) == g and r["format"] == fmt), None)
                if cell is None:
                    continue
                x = i + (j - 0.5) * width
                ax.bar(x, cell["speedup"], width, color=colors[fmt], label=None if fmt in labelled else fmt)
                labelled.add(fmt)
                ax.text(x, cell["speedup"] + 0.02, f"{cell['speedup']:.2f}", ha="center", fontsize=7)
                if cell["paper"] is not None:
                    ax.plot([x - width / 2, x + width / 2], [cell["paper"]] * 2, color="black", lw=2)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m.split('-')[-1]}\nb{b}" for m, b, _ in groups], fontsize=8)
        ax.set_title(gpu)
        handles, labels = ax.get_legend_handles_labels()
        handles.append(Line2D([], [], color="black", lw=2))
        ax.legend(handles, labels + ["paper (H100)"], fontsize=8, loc="upper center", ncol=3)
        ax.set_ylim(0, top * 1.25)
    axes[0][0].set_ylabel("GRPO step speedup over bf16 LoRA (same process)")
    fig.suptitle("GRPO step, 8 x 2048 tokens: ours (bars) and the paper's Table 3 (ticks)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_report(paths: dict[str, str], tracking_uri: str = "sqlite:///mlflow.db", experiment: str = EXPERIMENT) -> str:
    """The report's files as artifacts (report/) of a new FINISHED run `efficiency/report` (tag step=report) of the
    benchmark experiment, so the tables can be read in the MLflow UI beside the runs they come from; its run id."""
    from qerl.tracking import git_commit

    tracker = _tracker(tracking_uri, experiment)
    commit = git_commit()  # a git subprocess: once
    tags = {"step": "report", **({"git_commit": commit} if commit else {})}
    run_id = tracker.start_plain_run("efficiency/report", tags)
    with tracker.tracked(run_id):
        for path in paths.values():
            tracker.log_artifact(run_id, path, "report")
    return run_id


def write_report(tables: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, str]:
    """table.md, efficiency.json and step_speedup.png into out_dir; {"table_md", "json", "plot_png"}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "table.md"
    md.write_text(render_markdown(tables))
    js = out / "efficiency.json"
    payload = {k: v for k, v in tables.items() if k != "tracking_uri"}
    payload["generated"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    js.write_text(json.dumps(payload, indent=1) + "\n")
    paths = {"table_md": str(md), "json": str(js)}
    png = render_plot(tables["step"], out / "step_speedup.png")
    if png:
        paths["plot_png"] = str(png)
    return paths
