"""Prefect tasks of the pipeline: thin wrappers that call one `qerl.pipeline` function each.

    from tasks import quantize, train, evaluate, report

Retries: quantize, train and evaluate retry once, except on bad input (a ValueError such as
RecipeError, FormatError, DataError, ModelError), which would only fail again.
Caching: quantize, train and evaluate results are persisted and keyed by step_cache_key, so a
rerun of a failed flow run skips the tasks that completed. GPU-heavy steps hold a slot of the
global concurrency limit "gpu" (qerl.deploy.gpu_slot; a no-op on a CPU).
"""

from __future__ import annotations

from typing import Any


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Prefect retry_condition_fn: retry unexpected errors, not bad input (ValueError)."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception:
        return True
    return not isinstance(exc, ValueError)


def step_cache_key(context, parameters: dict[str, Any]) -> str | None:
    """Prefect cache key of quantize / train / evaluate: the task, its inputs and the MLflow parent run.

    With persisted results (persist_result=True, under PREFECT_RESULTS_LOCAL_STORAGE_PATH), a
    rerun of the same flow run (`prefect flow-run retry`: same flow-run id -> same MLflow parent,
    see qerl.deploy.flow_parent_run) skips every task that completed before and returns its
    stored result; a new flow run has a new parent, so it recomputes (quantize still reuses the
    checkpoint on disk and train resumes from its own checkpoints). None (no caching) outside a
    parent run.
    """
    import hashlib
    import json

    if not parameters.get("parent_run_id"):
        return None
    payload = {k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in parameters.items()}
    payload["task"] = context.task.name
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def run_tags() -> dict[str, Any]:
    """Prefect ids of the current task run, as MLflow tags (empty outside Prefect)."""
    from prefect.runtime import flow_run, task_run

    tags = {}
    if task_run.id:
        tags["prefect.task_run_id"] = str(task_run.id)
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
    return tags


from tasks.evaluate import evaluate  # noqa: E402
from tasks.quantize import quantize  # noqa: E402
from tasks.report import report  # noqa: E402
from tasks.train import train  # noqa: E402

__all__ = ["evaluate", "quantize", "report", "retry_unless_bad_input", "run_tags", "step_cache_key", "train"]
