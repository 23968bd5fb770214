"""Answer extraction and grading for GSM8K, MATH-500, AIME 2024/2025, AMC 2023 (and MATH train).

- GSM8K: the number after the last "####" (else inside the last \\boxed{}, else the last number
  in the text), compared with the gold as an exact decimal number ("1,000" == "1000",
  "5.0" == "5", "007" == "7").
- MATH-500 / MATH: `math_verify` (parse gold and completion, then `verify`).
- AIME / AMC: compared as numbers when both the gold and the completion's last \\boxed{}
  answer are plain numbers ("025" == "25", "27.0" == "27"); math_verify otherwise.

`math_verify` 0.5.2 guards parsing and comparison with SIGALRM timeouts. Outside the main
thread `signal.signal` raises, and math_verify swallows the error: parse() returns [] and
verify() returns False, so every answer silently grades wrong. Its `timeout=None` options do
not help in 0.5.2 (`signal.alarm(None)` raises too, swallowed the same way). On import this
module therefore swaps math_verify's internal `timeout` decorator for one that keeps the signal
timeout in the main thread and runs without a timeout elsewhere (or when given None/0).

Try it:  python -c "from qerl.eval.grading import grade; print(grade('math500', r'\\boxed{\\dfrac12}', '0.5'))"
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

import math_verify
import math_verify.grader as _mv_grader
import math_verify.parser as _mv_parser
import math_verify.utils as _mv_utils

from qerl.data import gsm8k_gold

# Seconds math_verify may spend on one parse / one comparison (main thread only; see above).
MATH_VERIFY_TIMEOUT_S = 5

NUMERIC_BENCHMARKS = ("aime24", "aime25", "amc23")
MATH_BENCHMARKS = ("math500", "math")
GRADED_BENCHMARKS = ("gsm8k", "arith") + MATH_BENCHMARKS + NUMERIC_BENCHMARKS


# ----------------------------------------------------------------------------- math_verify timeouts

_ORIGINAL_TIMEOUT = getattr(_mv_utils, "timeout", None)


def _thread_safe_timeout(timeout_seconds: int | None = 10):
    """math_verify's `timeout` decorator, but a no-op off the main thread or for None/0."""
    if not timeout_seconds or threading.current_thread() is not threading.main_thread():
        return lambda func: func
    return _ORIGINAL_TIMEOUT(timeout_seconds)


def _install_thread_safe_timeout() -> None:
    if _ORIGINAL_TIMEOUT is None:  # a math_verify without the signal decorator: nothing to do
        return
    import math_verify.metric as _mv_metric

    for module in (_mv_parser, _mv_grader, _mv_metric):
        if getattr(module, "timeout", None) is _ORIGINAL_TIMEOUT:
            module.timeout = _thread_safe_timeout


_install_thread_safe_timeout()


# ----------------------------------------------------------------------------- numbers

# A number with optional thousands separators and decimals; the sign is decided separately
# (a "-" right after a digit, letter or ")" is a subtraction, not a sign).
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|-?\.\d+")
_PLAIN_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _clean_text(text: str) -> str:
    return (
        text.replace("\u2212", "-")  # unicode minus
        .replace("{,}", ",")  # LaTeX thousands separator 1{,}000
        .replace("\\!", "")
        .replace("\\$", "")
        .replace("$", "")
    )


def _numbers(text: str) -> list[str]:
    """All numbers in `text`, commas removed, with a sign only where it is a sign."""
    out = []
    for m in _NUMBER_RE.finditer(text):
        s = m.group(0)
        if s.startswith("-") and m.start() > 0 and (text[m.start() - 1].isalnum() or text[m.start() - 1] in ")]}"):
            s = s[1:]
        out.append(s.replace(",", ""))
    return out


def to_number(text: Any) -> Decimal | None:
    """Parse a plain number ("1,000", "$5", "027", "3.50", "-2", "5.", "27.0", "10\\%") or None."""
    if text is None:
        return None
    s = _clean_text(str(text)).strip()
    for junk in ("\\,", "\\ ", "\\%", "%", "^\\circ", "^{\\circ}", "\\circ"):
        s = s.replace(junk, "")
    s = re.sub(r"\\text\{\s*\}", "", s)
    s = s.replace(",", "").replace(" ", "").rstrip(".")
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def _numbers_equal(a: Decimal, b: Decimal) -> bool:
    return a == b  # Decimal equality is exact and ignores trailing zeros: 5.0 == 5, 007 == 7


# ----------------------------------------------------------------------------- extraction


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; else None."""
    if not text:
        return None
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = idx + (len("\\boxed") if text.startswith("\\boxed", idx) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # "\boxed 5"
        m = re.match(r"\s*([^\s$]+)", text[i:])
        return m.group(1) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the completion was cut off inside the box


def extract_gsm8k_answer(text: str) -> str | None:
    """The final number of a GSM8K completion, without commas, "$", units or a trailing ".".

    Order: the first number after the last "####"; else the last number inside the last
    \\boxed{}; else the last number anywhere in the text. None when there is no number.
    """
    if not text:
        return None
    text = _clean_text(text)
    if "####" in text:
        found = _numbers(text.rsplit("####", 1)[1])
        if found:
            return found[0]
    boxed = extract_boxed(text)
    if boxed is not None:
        found = _numbers(boxed)
        if found:
            return found[-1]
    found = _numbers(text)
    return found[-1] if found else None


def extract_answer(benchmark: str, completion: str) -> str | None:
    """The answer string a grader would look at (for records and debugging)."""
    if benchmark in ("gsm8k", "arith"):
        return extract_gsm8k_answer(completion)
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    parsed = _parse_completion(completion)
    strings = [p for p in parsed if isinstance(p, str)]
    if strings:
        return strings[-1]
    return str(parsed[0]) if parsed else None


# ----------------------------------------------------------------------------- graders


def grade_gsm8k(completion: str, gold: str) -> bool:
    """True if the completion's final number equals the gold number (a "####" gold is fine)."""
    pred = to_number(extract_gsm8k_answer(completion))
    ref = to_number(gsm8k_gold(str(gold)))
    if pred is None or ref is None:
        return False
    return _numbers_equal(pred, ref)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple:
    gold = str(gold).strip()
    if not gold:
        return ()
    candidates = [gold] if ("\\boxed" in gold or "$" in gold) else []
    candidates += [f"${gold}$", f"\\boxed{{{gold}}}", gold]
    for c in candidates:
        parsed = math_verify.parse(c, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
        if parsed:
            return tuple(parsed)
    return ()


def _parse_completion(completion: str) -> list:
    if not completion:
        return []
    return math_verify.parse(completion, parsing_timeout=MATH_VERIFY_TIMEOUT_S)


def grade_math(completion: str, gold: str) -> bool:
    """math_verify equivalence of the completion's final answer and the gold LaTeX answer."""
    gold_parsed = _parse_gold(str(gold))
    if not gold_parsed:
        return False
    pred = _parse_completion(completion)
    if not pred:
        return False
    return bool(math_verify.verify(list(gold_parsed), pred, timeout_seconds=MATH_VERIFY_TIMEOUT_S))


def grade_numeric(completion: str, gold: str) -> bool:
    """AIME / AMC: numbers compare as numbers ("025" == "25", "27.0" == "27"), else math_verify."""
    ref = to_number(gold)
    boxed = extract_boxed(completion)
    if ref is not None and boxed is not None:
        pred = to_number(boxed)
        if pred is not None:
            return _numbers_equal(pred, ref)
    return grade_math(completion, gold)


def grade(benchmark: str, completion: str, gold: str) -> bool:
    """Grade one completion against one gold answer with the benchmark's rule."""
    if benchmark in ("gsm8k", "arith"):  # arith: qerl.rl.arith, graded like GSM8K
        return grade_gsm8k(completion, gold)
    if benchmark in MATH_BENCHMARKS:
        return grade_math(completion, gold)
    if benchmark in NUMERIC_BENCHMARKS:
        return grade_numeric(completion, gold)
    raise ValueError(f"no grader for benchmark {benchmark!r}; valid names: {', '.join(GRADED_BENCHMARKS)}")


__all__ = [
    "GRADED_BENCHMARKS",
    "MATH_VERIFY_TIMEOUT_S",
    "extract_answer",
    "extract_boxed",
    "extract_gsm8k_answer",
    "grade",
    "grade_gsm8k",
    "grade_math",
    "grade_numeric",
    "to_number",
]
