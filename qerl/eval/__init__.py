"""Evaluation: answer grading (math-verify), batched generation with entropy, benchmark runs.

    from qerl.data import load_benchmark
    from qerl.eval import GenerationSettings, evaluate_benchmark, grade

Note: `qerl.eval.generate` (the package attribute) is the function; import the module's other
names with `from qerl.eval.generate import ...`.
"""

from qerl.eval.grading import (
    extract_answer,
    extract_boxed,
    extract_gsm8k_answer,
    grade,
    grade_gsm8k,
    grade_math,
    grade_numeric,
)
from qerl.eval.generate import Generation, GenerationSettings, build_prompt, stop_token_ids
from qerl.eval.generate import generate  # noqa: E402  (shadows the submodule attribute on purpose)
from qerl.eval.evaluate import EvalResult, evaluate_benchmark, to_jsonl, wilson_interval

__all__ = [
    "EvalResult",
    "Generation",
    "GenerationSettings",
    "build_prompt",
    "evaluate_benchmark",
    "extract_answer",
    "extract_boxed",
    "extract_gsm8k_answer",
    "generate",
    "grade",
    "grade_gsm8k",
    "grade_math",
    "grade_numeric",
    "stop_token_ids",
    "to_jsonl",
    "wilson_interval",
]
