"""Benchmark and training-set loaders: GSM8K, MATH-500, AIME 2024/2025, AMC 2023, MATH train.

Every loader returns a list of `Problem(id, question, answer, benchmark)` with the gold answer
as a string (grading in `qerl.eval.grading` decides how to compare it).

Where the data comes from, in order:
  1. an explicit `data_dir` argument (the recipe's `data_dir`),
  2. the environment variable `QERL_DATA_DIR`,
  3. the Hugging Face hub (only if `datasets` is importable and `HF_HUB_OFFLINE` is not set).
A data directory has the layout of /work/shared/data (see its README):

    gsm8k/test.jsonl  gsm8k/train.jsonl  math500/test.jsonl  aime24/test.jsonl
    aime25/test.jsonl amc23/test.jsonl   math_train/math.json

Anything that goes wrong is a `DataError` with one line saying where we looked and how to fix
it. Try it:  python -c "from qerl.data import load_benchmark; print(load_benchmark('gsm8k', limit=1))"
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

BENCHMARKS = ("gsm8k", "math500", "aime24", "aime25", "amc23")
TRAIN_SETS = ("gsm8k", "math")

DATA_DIR_ENV = "QERL_DATA_DIR"
_FIX = f"set data_dir in the recipe or {DATA_DIR_ENV}"

# Relative file path inside a data directory, per (name, split).
_LOCAL_FILES: dict[tuple[str, str], str] = {
    ("gsm8k", "test"): "gsm8k/test.jsonl",
    ("gsm8k", "train"): "gsm8k/train.jsonl",
    ("math500", "test"): "math500/test.jsonl",
    ("aime24", "test"): "aime24/test.jsonl",
    ("aime25", "test"): "aime25/test.jsonl",
    ("amc23", "test"): "amc23/test.jsonl",
    ("math", "train"): "math_train/math.json",
}

# Hub fallback: (repository, config, split). The MATH training set has no hub copy with the
# same content as the local file, so it needs a data directory.
_HUB_SOURCES: dict[tuple[str, str], tuple[str, str | None, str]] = {
    ("gsm8k", "test"): ("openai/gsm8k", "main", "test"),
    ("gsm8k", "train"): ("openai/gsm8k", "main", "train"),
    ("math500", "test"): ("HuggingFaceH4/MATH-500", None, "test"),
    ("aime24", "test"): ("HuggingFaceH4/aime_2024", None, "train"),
    ("aime25", "test"): ("math-ai/aime25", None, "test"),
    ("amc23", "test"): ("math-ai/amc23", None, "test"),
}


class DataError(ValueError):
    """A benchmark or training file could not be found or read (message: one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str
    benchmark: str


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The data directory to read: explicit argument > env QERL_DATA_DIR > None (hub)."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return None


def load_benchmark(
    name: str,
    data_dir: str | os.PathLike | None = None,
    split: str = "test",
    limit: int | None = None,
) -> list[Problem]:
    """Load an evaluation benchmark (`BENCHMARKS`); `limit` keeps the first N rows."""
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")
    if (name, split) not in _LOCAL_FILES:
        splits = sorted(s for (n, s) in _LOCAL_FILES if n == name)
        raise DataError(f"benchmark {name!r} has no split {split!r}; valid splits: {', '.join(splits)}")
    return _load(name, split, data_dir, limit)


def load_train(
    name: str, data_dir: str | os.PathLike | None = None, limit: int | None = None
) -> list[Problem]:
    """Load a training set: "gsm8k" (gsm8k/train.jsonl) or "math" (math_train/math.json).

    Rows with an empty gold answer are skipped (the MATH file has 4 of them).
    """
    if name not in TRAIN_SETS:
        raise DataError(f"unknown training set {name!r}; valid names: {', '.join(TRAIN_SETS)}")
    return _load(name, "train", data_dir, limit)


# ----------------------------------------------------------------------------- internals


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise DataError(f"limit must be None or an integer >= 0, got {limit!r}")


def _load(name: str, split: str, data_dir, limit: int | None) -> list[Problem]:
    _check_limit(limit)
    root = resolve_data_dir(data_dir)
    rel = _LOCAL_FILES[(name, split)]
    if root is not None:
        source = "argument data_dir" if data_dir not in (None, "") else f"env {DATA_DIR_ENV}"
        path = root / rel
        if not root.is_dir():
            raise DataError(
                f"data directory {root} (from {source}) does not exist; {_FIX} to a folder "
                f"holding {rel}"
            )
        if not path.is_file():
            raise DataError(f"missing file {path} (data directory from {source}); {_FIX} to a folder holding {rel}")
        rows = _read_local(path)
    else:
        rows = _read_hub(name, split, rel)
    return _to_problems(name, split, rows, limit)


def _read_local(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}; {_FIX}") from e
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); {_FIX} to an intact copy") from e
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON at line {e.lineno} ({e.msg}); {_FIX} to an intact copy") from e
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    return data


def _hub_disabled() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _read_hub(name: str, split: str, rel: str) -> list[dict[str, Any]]:
    where = f"no data directory for {rel} (no data_dir argument, {DATA_DIR_ENV} unset)"
    source = _HUB_SOURCES.get((name, split))
    if source is None:
        raise DataError(f"{where} and {name}/{split} has no hub fallback; {_FIX}")
    if _hub_disabled():
        raise DataError(f"{where} and the hub fallback is off (HF_HUB_OFFLINE=1); {_FIX}")
    try:
        import datasets  # noqa: F401  (optional: only for the hub fallback)
    except Exception:
        raise DataError(f"{where} and the hub fallback needs the `datasets` package; {_FIX}") from None
    repo, config, hub_split = source
    try:
        ds = datasets.load_dataset(repo, config, split=hub_split) if config else datasets.load_dataset(repo, split=hub_split)
        return [dict(r) for r in ds]
    except Exception as e:  # network, auth, schema: all reported the same way
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(
            f"{where}; hub fallback {repo} ({hub_split}) failed: {type(e).__name__}: {msg[:200]}; {_FIX}"
        ) from e


def _first(row: dict[str, Any], keys: Iterable[str]) -> Any:
    for k in keys:
        if k in row and row[k] is not None:
            return row[k]
    return None


def _answer_str(value: Any) -> str:
    if value is None:
        return ""
    # JSON numbers become their Python text: AIME25's 70 -> "70", AMC's 27.0 -> "27.0"
    # (grading compares numbers, so "27.0" matches a model's "27").
    return str(value).strip()


def gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K solution: the text after the last "####", commas removed."""
    tail = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    return tail.strip().replace(",", "")


def _to_problems(name: str, split: str, rows: list[dict[str, Any]], limit: int | None) -> list[Problem]:
    out: list[Problem] = []
    for i, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(row, dict):
            raise DataError(f"{name}/{split} row {i}: expected a JSON object, got {type(row).__name__}")
        question = _first(row, ("problem", "question", "Problem", "Question"))
        raw_answer = _first(row, ("answer", "Answer"))
        if question is None:
            raise DataError(f"{name}/{split} row {i}: no 'problem' or 'question' field (has {sorted(row)})")
        if name == "gsm8k":
            answer = gsm8k_gold(str(raw_answer or ""))
        else:
            answer = _answer_str(raw_answer)
        if not answer:
            if split == "train":
                continue  # MATH train has a few rows without a gold answer
            raise DataError(f"{name}/{split} row {i}: empty gold answer")
        pid = _first(row, ("id", "unique_id", "ID"))
        out.append(Problem(id=str(pid) if pid is not None else str(i), question=str(question), answer=answer, benchmark=name))
    return out


__all__ = [
    "BENCHMARKS",
    "TRAIN_SETS",
    "DATA_DIR_ENV",
    "DataError",
    "Problem",
    "gsm8k_gold",
    "load_benchmark",
    "load_train",
    "resolve_data_dir",
]
