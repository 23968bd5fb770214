"""Evaluate a model on one benchmark: prompts -> generations -> grades -> accuracy with a CI.

`evaluate_benchmark(model, tokenizer, benchmark, problems, settings)` builds the chat prompts,
generates settings.num_samples completions per problem, grades each one, and returns an
`EvalResult`: pass@1 accuracy (averaged over the samples of a problem), its 95% Wilson interval
over problems, the token-weighted mean policy entropy, the mean completion length, and one
record per problem x sample (write them with `to_jsonl`).

Try it:  pytest tests/test_generate.py -q -m slow   (SmolLM2-135M on 4 GSM8K problems)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from qerl.data import Problem
from qerl.eval.generate import GenerationSettings, build_prompt, generate
from qerl.eval.grading import extract_answer, grade


class EvaluationOOM(torch.OutOfMemoryError):
    """Out of accelerator memory while loading or evaluating a checkpoint; one line naming the knobs."""


def evaluation_oom_hint(variant: str, device: str, batch_size: int, max_new_tokens: int, max_workers: int) -> str:
    return (f"out of GPU memory evaluating {variant} on {device}: lower generation.batch_size (now {batch_size}) or "
            f"generation.max_new_tokens (now {max_new_tokens}), or evaluate fewer formats at once (max_workers, now "
            f"{max_workers})")


@dataclass
class EvalResult:
    benchmark: str
    n: int  # number of problems
    correct: float  # sum over problems of the fraction of their samples graded correct
    accuracy: float  # correct / n  (pass@1, averaged over samples)
    ci_low: float  # 95% Wilson interval of the accuracy, over problems
    ci_high: float
    mean_entropy: float  # nats per generated token, averaged over all generated tokens
    mean_completion_tokens: float
    records: list[dict] = field(default_factory=list, repr=False)
    num_samples: int = 1

    def summary(self) -> dict[str, Any]:
        """Everything but the records (for logging / tables)."""
        d = asdict(self)
        d.pop("records")
        return d


def wilson_interval(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes out of n (k may be fractional); (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    if k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def evaluate_benchmark(
    model,
    tokenizer,
    benchmark: str,
    problems: Sequence[Problem],
    settings: GenerationSettings | None = None,
    progress: bool = True,
) -> EvalResult:
    """Generate, grade and summarise `problems` of `benchmark` (see module docstring)."""
    settings = settings or GenerationSettings()
    problems = list(problems)
    k = settings.num_samples
    prompts = [build_prompt(tokenizer, p.question, benchmark) for p in problems]
    # problem-major order, so the samples of one problem share a batch (and its prompt length)
    expanded = [prompt for prompt in prompts for _ in range(k)]
    generations = generate(model, tokenizer, expanded, settings, progress=progress)

    records: list[dict] = []
    for pi, problem in enumerate(problems):
        for s in range(k):
            g = generations[pi * k + s]
            records.append(
                {
                    "id": problem.id,
                    "sample": s,
                    "question": problem.question,
                    "gold": problem.answer,
                    "completion": g.text,
                    "extracted": extract_answer(benchmark, g.text),
                    "correct": bool(grade(benchmark, g.text, problem.answer)),
                    "num_tokens": g.num_tokens,
                    "entropy": g.mean_entropy,
                    "finished": g.finished,
                }
            )
    return records_summary(benchmark, records, k, len(problems))


def records_summary(benchmark: str, records: list[dict], num_samples: int, n_problems: int):
    """EvalResult from per-sample records (accuracy = mean over problems of the sample mean)."""
    by_problem: dict[str, list[bool]] = {}
    for r in records:
        by_problem.setdefault(str(r["id"]), []).append(bool(r["correct"]))
    correct = sum(sum(v) / len(v) for v in by_problem.values())
    n = n_problems
    low, high = wilson_interval(correct, n) if n else (0.0, 1.0)
    tokens = [r.get("num_tokens") for r in records if r.get("num_tokens") is not None]
    ent = [(r.get("entropy"), r.get("num_tokens")) for r in records if r.get("entropy") is not None and r.get("num_tokens")]
    tok_sum = sum(t for _, t in ent)
    return EvalResult(
        benchmark=benchmark,
        n=n,
        correct=correct,
        accuracy=correct / n if n else 0.0,
        ci_low=low,
        ci_high=high,
        mean_entropy=sum(e * t for e, t in ent) / tok_sum if tok_sum else 0.0,
        mean_completion_tokens=sum(tokens) / len(tokens) if tokens else 0.0,
        records=records,
        num_samples=num_samples,
    )


def to_jsonl(records: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write one JSON object per line (UTF-8), creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
    return path


__all__ = ["EvalResult", "evaluate_benchmark", "records_summary", "to_jsonl", "wilson_interval"]
