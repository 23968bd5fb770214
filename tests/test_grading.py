"""Answer extraction and grading: GSM8K numbers, math-verify for MATH, AIME/AMC numbers; Wilson CI."""

from __future__ import annotations

import threading

import pytest

from qerl.eval.evaluate import wilson_interval
from qerl.eval.grading import (
    extract_answer,
    extract_boxed,
    extract_gsm8k_answer,
    grade,
    grade_gsm8k,
    grade_math,
    to_number,
)

# ----------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The total is 1,234 dollars.", "1234"),
        ("#### 1,234", "1234"),
        ("#### $5", "5"),
        ("She pays $5.", "5"),
        ("It costs 5 dollars", "5"),
        ("#### 007", "007"),
        ("The temperature drops to -3.", "-3"),
        ("The change is −4 degrees", "-4"),  # unicode minus
        ("So 10-3 = 7", "7"),  # a "-" after a digit is a subtraction
        ("It weighs 3.50 kg", "3.50"),
        ("#### 72\nLater I computed 5 more things", "72"),  # "####" wins over the last number
        ("48 + 24 = 72 clips", "72"),  # no "####": the last number
        ("First 5 #### 3 #### 9", "9"),  # the last "####"
        ("Earlier 12 and then 13. #### unknown", "13"),  # no number after ####: the last number
        ("The answer is \\boxed{18}. Hope that helps with step 2", "18"),
        ("#### 1{,}000", "1000"),
        ("It is 50%", "50"),
        ("no digits at all", None),
        ("", None),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "completion, gold, ok",
    [
        ("The total is 1,234.", "1234", True),
        ("#### 1234", "1,234", True),
        ("#### $5", "5", True),
        ("He earned 5 dollars", "5", True),
        ("#### 007", "7", True),
        ("#### 5.0", "5", True),
        ("#### 3.50", "3.5", True),
        ("#### -8", "-8", True),
        ("#### 8", "-8", False),
        ("#### 72\nthen 5", "72", True),
        ("#### 72\nthen 5", "5", False),
        ("48/2 = 24 so 72 in total", "72", True),
        ("#### 73", "72", False),
        ("I don't know", "72", False),
        # the gold may also be the raw GSM8K solution
        ("#### 18", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18", True),
    ],
)
def test_grade_gsm8k(completion, gold, ok):
    assert grade_gsm8k(completion, gold) is ok
    assert grade("gsm8k", completion, gold) is ok


def test_to_number():
    assert to_number("025") == to_number("25")
    assert to_number("27.0") == to_number("27")
    assert to_number("1,000") == 1000
    assert to_number("$5") == 5
    assert to_number("5.") == 5
    assert to_number("\\frac{1}{2}") is None
    assert to_number("x+1") is None
    assert to_number(None) is None


# ----------------------------------------------------------------------------- MATH (math-verify)


def test_extract_boxed():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"answer: \boxed 5$") == "5"
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None  # cut off inside the box
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "completion, gold, ok",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", True),
        (r"The answer is $\boxed{0.5}$.", r"\frac{1}{2}", True),
        (r"so \boxed{\dfrac12}", r"\frac{1}{2}", True),
        (r"so \boxed{\frac{1}{3}}", r"\frac{1}{2}", False),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", True),
        (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", True),
        (r"\boxed{90}", r"90^\circ", True),
        (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", True),
        (r"\boxed{p-q}", "p - q", True),
        (r"\boxed{q-p}", "p - q", False),
        (r"\boxed{10\%}", r"10\%", True),
        (r"\boxed{\frac{14}{3}}", r"\frac{14}{3}", True),
        (r"\boxed{4.6667}", r"\frac{14}{3}", False),  # math-verify compares to 6 digits
        ("I give up", r"\frac{14}{3}", False),
        ("", "9", False),
    ],
)
def test_grade_math(completion, gold, ok):
    assert grade_math(completion, gold) is ok
    assert grade("math500", completion, gold) is ok


def test_grade_math_works_off_the_main_thread():
    # math_verify 0.5.2 uses SIGALRM, which fails in threads and then grades everything False;
    # qerl.eval.grading makes its timeout a no-op there.
    results = {}

    def work():
        results["ok"] = grade_math(r"\boxed{\frac{3}{4}}", "0.75")
        results["bad"] = grade_math(r"\boxed{\frac{3}{5}}", "0.75")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results == {"ok": True, "bad": False}


# ----------------------------------------------------------------------------- AIME / AMC


@pytest.mark.parametrize(
    "benchmark, completion, gold, ok",
    [
        ("aime24", r"\boxed{25}", "025", True),
        ("aime24", r"\boxed{025}", "25", True),
        ("aime24", r"\boxed{26}", "025", False),
        ("aime25", r"so the answer is $\boxed{70}$", "70", True),
        ("amc23", r"\boxed{27}", "27.0", True),
        ("amc23", r"\boxed{27.5}", "27.0", False),
        ("amc23", r"\boxed{\frac{54}{2}}", "27.0", True),  # not a plain number: math-verify
        ("aime24", "The answer is 25.", "025", True),  # no box: math-verify fallback
    ],
)
def test_grade_numeric(benchmark, completion, gold, ok):
    assert grade(benchmark, completion, gold) is ok


def test_grade_unknown_benchmark():
    with pytest.raises(ValueError, match="gsm8k"):
        grade("mmlu", "x", "y")


def test_extract_answer():
    assert extract_answer("gsm8k", "#### 1,000") == "1000"
    assert extract_answer("math500", r"thus \boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert extract_answer("aime24", "nothing") is None


# ----------------------------------------------------------------------------- Wilson interval


@pytest.mark.parametrize(
    "k, n, low, high",
    [
        (0, 10, 0.0, 0.277540),
        (5, 10, 0.236590, 0.763410),
        (10, 10, 0.722460, 1.0),
        (81, 100, 0.722210, 0.874853),  # = statsmodels proportion_confint(81, 100, method="wilson")
    ],
)
def test_wilson_interval(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-5)
    assert hi == pytest.approx(high, abs=1e-5)
    assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_interval_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(2.5, 5)  # fractional k (pass@1 averaged over samples)
    assert lo < 0.5 < hi
    with pytest.raises(ValueError):
        wilson_interval(6, 5)
