"""Prefect task `evaluate`: qerl.pipeline.evaluate_step (checkpoint -> accuracy/entropy row)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from qerl import pipeline
from qerl.recipe import Recipe
from tasks import retry_unless_bad_input, run_tags


@task(name="evaluate", task_run_name="evaluate-{fmt}", retries=1, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def evaluate(recipe: Recipe, fmt: str, checkpoint: str, parent_run_id: str | None = None) -> dict[str, Any]:
    return pipeline.evaluate_step(recipe, fmt, checkpoint, parent_run_id, tags=run_tags())
