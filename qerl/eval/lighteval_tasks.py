"""lighteval tasks math_500, aime24, aime25, amc23 on the local data directory, graded by math-verify.

    from qerl.eval.lighteval_tasks import make_task_configs
    configs = make_task_configs("../shared/data", ["aime24"], num_samples=4)   # LightevalTaskConfig list

Each task reads <data_dir>/<folder>/test.jsonl (math500, aime24, aime25, amc23; the layout of
../shared/data) through `datasets` with the local folder as the dataset path, so nothing goes
to the hub. What is the same as lighteval's built-in tasks of these names: the task names, the
Doc / LightevalTask / Pipeline machinery, lighteval's PassAtK estimator (pass@k:k=1&n=K, i.e.
pass@1 averaged over K samples). What differs, on purpose:
- the prompt is qerl's (the problem + "Please reason step by step, and put your final answer
  within \\boxed{}.", rendered with the model's chat template by the qerl lighteval model), the
  one the paper's evaluation uses, not lighteval's "ANSWER: $ANSWER" (math_500) or
  "Therefore, the final answer is: $\\boxed{ANSWER}$" (aime) prompts;
- grading is qerl.eval.grading.grade (math_verify parse + verify for MATH-500; AIME/AMC as
  numbers when both sides are plain numbers, "025" == "25", "27.0" == "27", else math_verify),
  with math_verify's timeouts made thread-safe (lighteval's own extractive-match copy uses
  SIGALRM and fails silently off the main thread, where the Prefect evaluate task runs);
- the dataset is the local file; the version is TASK_VERSION of this module.

Sampling (../shared/paper.md): temperature 0.6, top_p 0.95, up to 8192 new tokens, chat
template on: PAPER_SAMPLING. K (num_samples) comes from the recipe.

lighteval's own CLI cannot load these offline: its task registry imports every built-in task
module, and one of them (tiny_benchmarks) downloads a file at import time; it also refuses
custom tasks named like built-ins. qerl.eval.lighteval_model.run_lighteval therefore builds the
registry from these configs only (see there).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch

_GRAD_MODE = torch.is_grad_enabled()  # lighteval imports may switch autograd off (see lighteval_model)
from lighteval.metrics.metrics_sample import PassAtK  # noqa: E402
from lighteval.metrics.utils.metric_utils import SampleLevelMetric
from lighteval.tasks.lighteval_task import LightevalTaskConfig
from lighteval.tasks.requests import Doc, SamplingMethod  # noqa: E402

torch.set_grad_enabled(_GRAD_MODE)

TASK_VERSION = 1
PAPER_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 8192}

# lighteval task name -> qerl benchmark name (qerl.data / qerl.eval.grading)
TASKS = {"math_500": "math500", "aime24": "aime24", "aime25": "aime25", "amc23": "amc23"}


def _folder(benchmark: str) -> str:
    from qerl.data import _LOCAL_FILES

    return str(Path(_LOCAL_FILES[(benchmark, "test")]).parent)


class QerlMathVerifyScore:
    """Sample scoring function for lighteval's PassAtK: 1 if qerl's grader accepts the completion."""

    def __init__(self, benchmark: str):
        self.benchmark = benchmark

    def __call__(self, doc: Doc, model_response) -> int:
        from qerl.eval.grading import grade

        return int(bool(grade(self.benchmark, model_response.final_text[0], doc.get_golds()[0])))


def pass_at_1_metric(benchmark: str, num_samples: int) -> SampleLevelMetric:
    """lighteval's pass@k estimator with k=1 over n=num_samples samples (= mean accuracy of the samples)."""
    import numpy as np

    metric = SampleLevelMetric(
        metric_name="pass@k",
        sample_level_fn=PassAtK(strip_strings=True, sample_scoring_function=QerlMathVerifyScore(benchmark)),
        category=SamplingMethod.GENERATIVE,
        corpus_level_fn=np.mean,
        higher_is_better=True,
    )
    return metric({"k": 1, "n": num_samples})


def _prompt_function(benchmark: str, limit: int | None):
    from qerl.data import _answer_str
    from qerl.eval.generate import instruction_for

    def prompt(line: dict, task_name: str | None = None) -> Doc | None:
        if limit is not None and int(line.get("__index", 0)) >= limit:
            return None  # lighteval skips None docs: the first `limit` rows, as qerl.data does
        question = line.get("problem") or line.get("question")
        answer = _answer_str(line.get("answer"))
        if question is None or not answer:
            return None
        pid = line.get("id", line.get("unique_id", line.get("__index")))
        return Doc(
            task_name=task_name or "",
            query=f"{str(question).strip()}\n{instruction_for(benchmark)}",
            choices=[answer],
            gold_index=0,
            specific={"id": str(pid), "question": str(question)},
        )

    return prompt


def make_task_configs(
    data_dir: str | os.PathLike | None,
    tasks: Iterable[str] | None = None,
    *,
    num_samples: int = 1,
    max_new_tokens: int = PAPER_SAMPLING["max_new_tokens"],
    limit: int | None = None,
) -> list[LightevalTaskConfig]:
    """LightevalTaskConfig for each of `tasks` (lighteval names; default all four).

    Raises HarnessError for an unknown task and DataError when the data directory lacks the
    task's file.
    """
    from qerl.data import DataError, _check_limit, resolve_data_dir
    from qerl.eval.harness import HarnessError

    names = list(tasks) if tasks is not None else list(TASKS)
    for t in names:
        if t not in TASKS:
            raise HarnessError(f"unknown lighteval task {t!r}; valid: {', '.join(TASKS)}")
    if num_samples < 1:
        raise HarnessError(f"num_samples must be >= 1, got {num_samples}")
    _check_limit(limit)
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError("no data directory for the lighteval tasks (no data_dir given, QERL_DATA_DIR unset)")
    root = root.resolve()
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist")
    configs = []
    for t in names:
        bench = TASKS[t]
        folder = root / _folder(bench)
        if not (folder / "test.jsonl").is_file():
            raise DataError(f"missing file {folder / 'test.jsonl'}: data directory {root} has no {_folder(bench)}/test.jsonl (task {t})")
        configs.append(
            LightevalTaskConfig(
                name=t,
                prompt_function=_prompt_function(bench, limit),
                hf_repo=str(folder),  # a local folder: datasets builds it from test.jsonl, no hub
                hf_subset="default",
                hf_avail_splits=["test"],
                evaluation_splits=["test"],
                few_shots_split=None,
                few_shots_select=None,
                generation_size=max_new_tokens,
                stop_sequence=None,
                metrics=[pass_at_1_metric(bench, num_samples)],
                version=TASK_VERSION,
            )
        )
    return configs


def _table_from_env() -> list[LightevalTaskConfig]:
    """TASKS_TABLE for lighteval's --custom-tasks convention, when QERL_DATA_DIR is set."""
    if not os.environ.get("QERL_DATA_DIR"):
        return []
    try:
        return make_task_configs(None)
    except ValueError:
        return []


TASKS_TABLE = _table_from_env()

__all__ = ["PAPER_SAMPLING", "TASKS", "TASK_VERSION", "make_task_configs", "pass_at_1_metric"]
