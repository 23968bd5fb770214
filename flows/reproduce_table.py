"""Prefect flow `reproduce-table`: per format a quantize task then an evaluate task, then a report.

    python -m flows.reproduce_table recipes/smoke.yaml        # or: qerl reproduce smoke

Without a Prefect server this runs on Prefect's local ephemeral engine. The recipe is validated
first (a bad recipe fails before any MLflow run exists); then one parent MLflow run is opened
for the flow run (FAILED if the flow fails) and every task logs a run nested under it.
Formats run recipe.max_workers at a time, in waves (within a wave the quantize tasks are
queued before the evaluate tasks that wait on them, so a bounded thread pool never blocks on
work queued behind it); on a CPU the cores are split between them. A format that fails does
not stop the others: the report is written for what was measured, then the flow raises the
first error.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from qerl import pipeline
from qerl.recipe import load_recipe
from tasks import evaluate, quantize, report


def _flow_tags() -> dict[str, str]:
    from prefect.runtime import flow_run

    tags = {"orchestrator": "prefect"}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_run_name"] = str(flow_run.name)
    return tags


@flow(name="reproduce-table", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def reproduce_table(recipe_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Quantize and evaluate the recipe's model in each format, then write the report."""
    recipe = load_recipe(recipe_path, overrides)  # RecipeError here: no MLflow run yet
    logger = get_run_logger()
    pipeline.preload()  # before any thread imports transformers
    threads = pipeline.configure_threads(recipe)  # cores / concurrent formats, on a CPU
    if threads:
        logger.info("CPU: %d torch thread(s) per format, %d format(s) at once", threads, recipe.max_workers)
    rows: list[dict[str, Any]] = []
    failures: list[tuple[str, BaseException]] = []
    with pipeline.parent_run(recipe, tags=_flow_tags()) as parent:
        logger.info("MLflow parent run %s (%s)", parent, recipe.mlflow.tracking_uri)
        n = recipe.max_workers
        for wave in [recipe.formats[i : i + n] for i in range(0, len(recipe.formats), n)]:
            # quantize tasks are queued before the evaluate tasks that wait on them
            checkpoints = {fmt: quantize.submit(recipe, fmt, parent) for fmt in wave}
            evaluations = {fmt: evaluate.submit(recipe, fmt, checkpoints[fmt], parent) for fmt in wave}
            for fmt, future in evaluations.items():
                try:
                    rows.append(future.result())
                except Exception as exc:  # the task's MLflow run is already FAILED with the error
                    failures.append((fmt, _root_error(checkpoints[fmt], exc)))
                    logger.error("format %s failed: %s", fmt, exc)
        paths = report.submit(recipe, parent).result()
        if failures:
            raise failures[0][1]
    result = pipeline.result_dict(recipe, parent, paths, rows)
    print(f"table: {paths.get('table_md')}\nhtml:  {paths.get('table_html')}\nMLflow UI: {result['mlflow_ui']}")
    return result


def _root_error(upstream, exc: BaseException) -> BaseException:
    """If evaluate never ran because quantize failed, the quantize error is the one to show."""
    try:
        upstream.result()
    except Exception as up:
        return up
    return exc


def run(recipe_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate, then run the flow with the recipe's concurrency (max_workers)."""
    recipe = load_recipe(recipe_path, overrides)
    runner = ThreadPoolTaskRunner(max_workers=recipe.max_workers)
    return reproduce_table.with_options(task_runner=runner)(str(recipe_path), overrides)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "embedded")
