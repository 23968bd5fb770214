"""Prefect task `report`: qerl.pipeline.report_step (MLflow runs -> table.md/html, summary.json)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from qerl import pipeline
from qerl.recipe import Recipe
from tasks import run_tags


@task(name="report", cache_policy=NO_CACHE)
def report(recipe: Recipe, parent_run_id: str) -> dict[str, str]:
    return pipeline.report_step(recipe, parent_run_id, tags=run_tags())
