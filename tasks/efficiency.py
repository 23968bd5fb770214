"""Prefect tasks of the `efficiency` flow: run one benchmark (holding a GPU slot on a GPU), log result files as
MLflow runs, rebuild the efficiency tables from those runs (each calls qerl.efficiency)."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from qerl import deploy, efficiency


@task(name="benchmark", cache_policy=NO_CACHE)
def benchmark(kind: str, args: list[str], out_dir: str) -> list[str]:
    logger = get_run_logger()
    with deploy.device_slot(efficiency.benchmark_device(args)):  # the "gpu" limit's slot, unless on the CPU
        return [str(p) for p in efficiency.run_benchmark(kind, args, out_dir, log=logger.info)]


@task(name="log-benchmarks", cache_policy=NO_CACHE)
def log_benchmarks(paths: list[str], tracking_uri: str, experiment: str) -> list[dict]:
    return efficiency.log_results(efficiency.expand_files(paths), tracking_uri, experiment)


@task(name="efficiency-table", cache_policy=NO_CACHE)
def efficiency_table(tracking_uri: str, experiment: str, out_dir: str) -> dict[str, str]:
    tables = efficiency.build_tables(tracking_uri, experiment)
    paths = efficiency.write_report(tables, Path(out_dir))
    return {**paths, "report_run_id": efficiency.log_report(paths, tracking_uri, experiment)}
