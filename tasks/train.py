"""Prefect task `train`: qerl.pipeline.train_step (a format's checkpoint -> trained LoRA adapter).

A retry resumes from the variant's newest complete checkpoint (same step count), so a
transient failure costs at most save_steps steps.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from qerl import pipeline
from qerl.deploy import gpu_slot
from qerl.recipe import Recipe
from tasks import retry_unless_bad_input, run_tags, step_cache_key


@task(name="train", task_run_name="train-{variant}", retries=1, retry_condition_fn=retry_unless_bad_input, cache_key_fn=step_cache_key, persist_result=True)
def train(recipe: Recipe, variant: str, checkpoint: str, parent_run_id: str | None = None) -> dict[str, Any]:
    with gpu_slot(recipe):
        return pipeline.train_step(recipe, variant, checkpoint, parent_run_id, tags=run_tags())
