"""Prefect task `evaluate`: qerl.pipeline.evaluate_step (checkpoint [+ adapter] -> accuracy/entropy row)."""

from __future__ import annotations

from typing import Any

from prefect import task

from qerl import pipeline
from qerl.deploy import gpu_slot
from qerl.recipe import Recipe
from tasks import retry_unless_bad_input, run_tags, step_cache_key


@task(name="evaluate", task_run_name="evaluate-{label}", retries=1, retry_condition_fn=retry_unless_bad_input, cache_key_fn=step_cache_key, persist_result=True)
def evaluate(
    recipe: Recipe, fmt: str, checkpoint: str, parent_run_id: str | None = None,
    trained: dict[str, Any] | None = None, label: str = "",
) -> dict[str, Any]:
    """`trained`: the train task's result (its adapter is applied); `label`: the task run's name."""
    with gpu_slot(recipe):
        return pipeline.evaluate_step(recipe, fmt, checkpoint, parent_run_id, trained=trained, tags=run_tags())
