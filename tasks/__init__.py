"""Prefect tasks of the pipeline: thin wrappers that call one `qerl.pipeline` function each.

    from tasks import quantize, train, evaluate, report

Retries: quantize, train and evaluate retry once, except on bad input (a ValueError such as
RecipeError, FormatError, DataError, ModelError), which would only fail again.
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

__all__ = ["evaluate", "quantize", "report", "retry_unless_bad_input", "run_tags", "train"]
