"""Prefect task `quantize`: qerl.pipeline.quantize_step (model -> <format> checkpoint directory)."""

from __future__ import annotations

from prefect import task

from qerl import pipeline
from qerl.deploy import gpu_slot
from qerl.recipe import Recipe
from tasks import retry_unless_bad_input, run_tags, step_cache_key


@task(name="quantize", task_run_name="quantize-{fmt}", retries=1, retry_condition_fn=retry_unless_bad_input, cache_key_fn=step_cache_key, persist_result=True)
def quantize(recipe: Recipe, fmt: str, parent_run_id: str | None = None) -> str:
    with gpu_slot(recipe):
        return pipeline.quantize_step(recipe, fmt, parent_run_id=parent_run_id, tags=run_tags())
