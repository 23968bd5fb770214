"""Reward functions for RL: plain functions `(completions, **kwargs) -> list[float]`.

`completions` are the decoded completion texts; keyword arguments are lists aligned with them
(`answer` = gold answers, `benchmark`, `problem_id`, `prompts`, `truncated`, ...) and unknown
ones are ignored, as with TRL's reward functions. The trainer sums them with `reward_weights`.

- `gsm8k_accuracy`  1.0 if the final number equals the gold number (qerl.eval.grading.grade_gsm8k);
                    also used for the generated arithmetic task (qerl.rl.arith).
- `math_accuracy`   1.0 if math-verify finds the answer equivalent to the gold LaTeX answer.
- `accuracy`        picks the grader from each row's `benchmark` (gsm8k/arith exact number,
                    math/math500 math-verify, aime/amc numeric).
- `format_reward`   1.0 if the completion states a final answer in the requested format
                    ("#### <number>" for GSM8K-style rows, a \\boxed{} for MATH-style rows).

A function with the attribute `is_accuracy = True` is what the trainer reports as `accuracy`.

Try it:  python -c "from qerl.rl.rewards import gsm8k_accuracy; print(gsm8k_accuracy(['so #### 7'], answer=['7']))"
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

RewardFn = Callable[..., list[float]]

# Row benchmarks graded like GSM8K (final number, exact match).
NUMBER_TASKS = ("gsm8k", "arith")

_HASH_NUMBER = re.compile(r"####\s*\$?\s*-?[\d,]*\.?\d+")


def _golds(answer, n: int) -> list[str]:
    if answer is None:
        raise ValueError("reward function needs the gold answers as `answer=[...]`")
    if isinstance(answer, str):
        answer = [answer] * n
    if len(answer) != n:
        raise ValueError(f"got {n} completions but {len(answer)} gold answers")
    return [str(a) for a in answer]


def _texts(completions: Sequence) -> list[str]:
    """Plain strings, also from TRL's conversational form [[{"role": ..., "content": ...}], ...]."""
    out = []
    for c in completions:
        if isinstance(c, list):
            c = c[-1]["content"] if c else ""
        elif isinstance(c, dict):
            c = c.get("content", "")
        out.append(str(c))
    return out


def gsm8k_accuracy(completions, answer=None, **kwargs) -> list[float]:
    from qerl.eval.grading import grade_gsm8k

    texts = _texts(completions)
    return [1.0 if grade_gsm8k(t, g) else 0.0 for t, g in zip(texts, _golds(answer, len(texts)))]


gsm8k_accuracy.is_accuracy = True


def math_accuracy(completions, answer=None, **kwargs) -> list[float]:
    from qerl.eval.grading import grade_math

    texts = _texts(completions)
    return [1.0 if grade_math(t, g) else 0.0 for t, g in zip(texts, _golds(answer, len(texts)))]


math_accuracy.is_accuracy = True


def accuracy(completions, answer=None, benchmark=None, **kwargs) -> list[float]:
    """Correctness with each row's benchmark grader (default gsm8k)."""
    from qerl.eval.grading import grade

    texts = _texts(completions)
    golds = _golds(answer, len(texts))
    benches = benchmark if isinstance(benchmark, (list, tuple)) else [benchmark or "gsm8k"] * len(texts)
    out = []
    for t, g, b in zip(texts, golds, benches):
        b = b or "gsm8k"
        out.append(1.0 if grade("gsm8k" if b in NUMBER_TASKS else b, t, g) else 0.0)
    return out


accuracy.is_accuracy = True


def format_reward(completions, benchmark=None, **kwargs) -> list[float]:
    """1.0 if the final answer is given in the asked-for format, else 0.0."""
    from qerl.eval.grading import extract_boxed

    texts = _texts(completions)
    benches = benchmark if isinstance(benchmark, (list, tuple)) else [benchmark or "gsm8k"] * len(texts)
    out = []
    for t, b in zip(texts, benches):
        if (b or "gsm8k") in NUMBER_TASKS:
            out.append(1.0 if _HASH_NUMBER.search(t) else 0.0)
        else:
            out.append(1.0 if extract_boxed(t) else 0.0)
    return out


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k_accuracy": gsm8k_accuracy,
    "math_accuracy": math_accuracy,
    "accuracy": accuracy,
    "format": format_reward,
}


def get_reward_functions(names: Sequence[str]) -> list[RewardFn]:
    """Reward functions by name (for recipes): gsm8k_accuracy, math_accuracy, accuracy, format."""
    try:
        return [REWARD_FUNCTIONS[n] for n in names]
    except KeyError as e:
        raise ValueError(f"unknown reward function {e.args[0]!r}; valid: {', '.join(REWARD_FUNCTIONS)}") from None


__all__ = [
    "NUMBER_TASKS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "accuracy",
    "format_reward",
    "get_reward_functions",
    "gsm8k_accuracy",
    "math_accuracy",
]
