"""Prefect flow `reproduce-table`: quantize -> (train) -> evaluate per table column, then a report.

    python -m flows.reproduce_table recipes/smoke.yaml        # or: qerl reproduce smoke

Columns: the base model in each of recipe.formats (quantize, evaluate), and, with a `train:`
section, each trained variant (lora-bf16, qlora-nf4, lora-mxfp4, qerl-nvfp4, qerl-nvfp4-aqn):
train LoRA by GRPO/DAPO on its format's checkpoint, then evaluate with the adapter applied.
Each format is quantised once and shared by its base row and its variants.

Without a Prefect server this runs on Prefect's local ephemeral engine. The recipe is validated
first (a bad recipe fails before any MLflow run exists); then one parent MLflow run is opened
for the flow run (FAILED if the flow fails) and every task logs a run nested under it. Tasks
run recipe.max_workers at a time; they are submitted in dependency order (quantize, train,
evaluate), so a bounded thread pool never blocks on work queued behind it; on a CPU the cores
are split between them. A column that fails does not stop the others: the report is written
for what was measured, then the flow raises the first error.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from qerl import deploy, pipeline
from qerl.recipe import VARIANTS, load_recipe
from tasks import evaluate, quantize, report, train


def _flow_tags() -> dict[str, str]:
    from prefect.runtime import flow_run

    tags = {"orchestrator": "prefect"}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_run_name"] = str(flow_run.name)
    return tags


@flow(name="reproduce-table", task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def reproduce_table(recipe_path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Quantize, train (if the recipe trains) and evaluate every column, then write the report."""
    logger = get_run_logger()
    try:
        recipe = load_recipe(recipe_path, overrides)  # RecipeError here: no MLflow run yet
        deploy.check_device(recipe)  # device: cuda on a worker without a GPU: stop here, one line
    except Exception as exc:
        logger.error("cannot run recipe %r: %s", recipe_path, exc)
        raise
    pipeline.preload()  # before any thread imports transformers
    threads = pipeline.configure_threads(recipe)  # cores / concurrent tasks, on a CPU
    if threads:
        logger.info("CPU: %d torch thread(s) per task, %d task(s) at once", threads, recipe.max_workers)
    rows: list[dict[str, Any]] = []
    failures: list[tuple[str, BaseException]] = []
    with deploy.flow_parent_run(recipe, tags=_flow_tags()) as parent:  # reopened on a rerun: cache hits
        logger.info("MLflow parent run %s (%s)", parent, recipe.mlflow.tracking_uri)
        # submitted in dependency order: every task's inputs were submitted before it
        ckpt = {fmt: quantize.submit(recipe, fmt, parent) for fmt in recipe.all_formats()}
        trains = {
            v: train.submit(recipe, v, ckpt[VARIANTS[v][0]], parent) for v in recipe.variants()
        }
        columns = {
            pipeline.variant_name(fmt): (
                evaluate.submit(recipe, fmt, ckpt[fmt], parent, label=pipeline.variant_name(fmt)),
                [ckpt[fmt]],
            )
            for fmt in recipe.formats
        }
        for v, fut in trains.items():
            fmt = VARIANTS[v][0]
            columns[v] = (evaluate.submit(recipe, fmt, ckpt[fmt], parent, trained=fut, label=v), [ckpt[fmt], fut])
        for name, (future, upstream) in columns.items():
            try:
                rows.append(future.result())
            except Exception as exc:  # the task's MLflow run is already FAILED with the error
                failures.append((name, _root_error(upstream, exc)))
                logger.error("column %s failed: %s", name, exc)
        paths = report.submit(recipe, parent).result()
        if failures:
            raise failures[0][1]
    result = pipeline.result_dict(recipe, parent, paths, rows)
    print(f"table: {paths.get('table_md')}\nhtml:  {paths.get('table_html')}\nMLflow UI: {result['mlflow_ui']}")
    return result


def _root_error(upstream: list, exc: BaseException) -> BaseException:
    """If evaluate never ran because quantize or train failed, that error is the one to show."""
    for fut in upstream:
        try:
            fut.result()
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
