"""Prefect flow `efficiency`: run benchmarks, log their result files as MLflow runs, rebuild the efficiency tables.

    python -m flows.efficiency                              # only the table, from the runs already in ./mlflow.db
    python -m flows.efficiency --deployment evidence        # a prefect.yaml deployment's parameters, here (make efficiency)
    prefect deployment run efficiency/table3                # prefect.yaml: the GRPO steps of the paper's Table 3 on a GPU
    prefect deployment run efficiency/evidence              # the committed evidence files -> runs -> reports/efficiency

Parameters: `benchmarks`, a list of {"kind": grpo_step | rollout | w4a16, "args": [...]} (the arguments of
benchmarks/bench_<kind>.py, without --out / --out-dir: each benchmark writes into its own folder under
`work_dir`/<flow run>/<i>), run one after the other, each holding a slot of the "gpu" limit on a GPU; `files`,
result files already on disk; then every result file becomes one MLflow run of `experiment` (a file already there
is skipped) and the tables of qerl.efficiency are rebuilt from all the runs of the experiment into `out_dir`. A
benchmark that fails fails the flow after the files of the others were logged and the tables rebuilt.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from qerl.efficiency import BenchmarkError, check_benchmark, expand_files
from tasks.efficiency import benchmark, efficiency_table, log_benchmarks


def _run_folder(work_dir: str) -> Path:
    from prefect.runtime import flow_run

    return Path(work_dir) / (str(flow_run.id) if flow_run.id else time.strftime("local-%Y%m%d-%H%M%S"))


@flow(name="efficiency", log_prints=True)
def efficiency(benchmarks: list[dict[str, Any]] | None = None, files: list[str] | None = None,
               tracking_uri: str = "sqlite:///mlflow.db", experiment: str = "qerl-benchmarks",
               out_dir: str = "reports/efficiency", work_dir: str = ".qerl/benchmarks") -> dict[str, Any]:
    logger = get_run_logger()
    try:  # bad input fails here, before an hour of benchmarks
        paths = [str(p) for p in expand_files(files or [])]
        for spec in benchmarks or []:
            check_benchmark(spec.get("kind", ""), list(spec.get("args") or []))
    except BenchmarkError as exc:
        logger.error("cannot run: %s", exc)
        raise
    failures: list[BaseException] = []
    folder = _run_folder(work_dir)
    for i, spec in enumerate(benchmarks or []):
        try:
            paths += benchmark(spec["kind"], list(spec.get("args") or []), str(folder / str(i)))
        except Exception as exc:  # the others still run, and what was measured is logged
            logger.error("benchmark %d (%s) failed: %s", i, spec.get("kind"), exc)
            failures.append(exc)
    logged = log_benchmarks(paths, tracking_uri, experiment) if paths else []
    report = efficiency_table(tracking_uri, experiment, out_dir)
    for d in logged:
        logger.info("%s %s -> MLflow run %s", "logged" if d["logged"] else "already logged", d["path"], d["run_id"])
    if failures:
        raise failures[0]
    return {"logged": logged, **report}


def deployment_parameters(name: str, spec_path: str | Path = Path(__file__).resolve().parents[1] / "prefect.yaml"
                          ) -> dict[str, Any]:
    """The parameters of prefect.yaml's deployment efficiency/<name>, to run it here without a server."""
    import yaml

    for d in yaml.safe_load(Path(spec_path).read_text())["deployments"]:
        if d["entrypoint"] == "flows/efficiency.py:efficiency" and d["name"] == name:
            return dict(d.get("parameters") or {})
    raise SystemExit(f"error: prefect.yaml has no deployment efficiency/{name}")


def main(argv: list[str]) -> None:
    """python -m flows.efficiency [--deployment NAME] [FILE ...]: the flow on Prefect's local engine, with the
    parameters of a prefect.yaml deployment (make efficiency: --deployment evidence) or with result files."""
    if argv[:1] == ["--deployment"] and len(argv) >= 2:
        params = deployment_parameters(argv[1])
        params["files"] = list(params.get("files") or []) + argv[2:]
    else:
        params = {"files": argv or None}
    result = efficiency(**params)
    for key in ("table_md", "json", "plot_png"):
        if result.get(key):
            print(f"{key}: {result[key]}")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
