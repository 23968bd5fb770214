"""Prefect task `quantize`: qerl.pipeline.quantize_step (model -> <format> checkpoint directory)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from qerl import pipeline
from qerl.recipe import Recipe
from tasks import retry_unless_bad_input, run_tags


@task(name="quantize", task_run_name="quantize-{fmt}", retries=1, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def quantize(recipe: Recipe, fmt: str, parent_run_id: str | None = None) -> str:
    return pipeline.quantize_step(recipe, fmt, parent_run_id=parent_run_id, tags=run_tags())
