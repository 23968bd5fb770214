"""Benchmark loaders on the offline data directory (row counts from shared/data/README.md)."""

from __future__ import annotations

import json
import sys

import pytest

from qerl import data as qdata
from qerl.data import BENCHMARKS, DataError, Problem, load_benchmark, load_train, resolve_data_dir

# rows per file, from shared/data/README.md
EXPECTED_ROWS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40, "arith": 200}


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_row_counts(data_dir, name):
    problems = load_benchmark(name, data_dir)
    assert len(problems) == EXPECTED_ROWS[name]
    assert all(isinstance(p, Problem) and p.benchmark == name for p in problems)
    assert all(p.question.strip() and p.answer.strip() for p in problems)
    assert len({p.id for p in problems}) == len(problems)  # ids are unique


def test_arith_is_generated_deterministic_and_disjoint(tmp_path):
    # no data directory needed: the project generates it; test and train use different seeds
    test = load_benchmark("arith", tmp_path / "nowhere", limit=50)
    assert [p.question for p in test] == [p.question for p in load_benchmark("arith", limit=50)]
    train = load_train("arith", limit=500)
    assert len(train) == 500 and {p.benchmark for p in train} == {"arith"}
    assert not {p.id for p in test} & {p.id for p in train}
    assert len(load_train("arith")) == 2000


def test_train_row_counts(data_dir):
    assert len(load_train("gsm8k", data_dir)) == 7473
    math = load_train("math", data_dir)
    assert len(math) == 7474 - 4  # 4 rows have no answer (2 null, 2 empty) and are skipped
    assert all(p.answer for p in math) and {p.benchmark for p in math} == {"math"}


def test_gold_answers(data_dir):
    gsm = load_benchmark("gsm8k", data_dir, limit=3)
    assert gsm[0].answer == "18" and gsm[0].question.startswith("Janet")
    assert all("####" not in p.answer and "," not in p.answer for p in load_benchmark("gsm8k", data_dir))
    aime = {p.id: p.answer for p in load_benchmark("aime24", data_dir)}
    assert "025" in aime.values()  # leading zeros kept, grading compares numbers
    amc = load_benchmark("amc23", data_dir)
    assert amc[0].answer == "27.0"
    assert load_benchmark("aime25", data_dir)[0].answer == "70"
    m = load_benchmark("math500", data_dir, limit=1)[0]
    assert m.id == "test/precalculus/807.json" and m.answer == r"\left( 3, \frac{\pi}{2} \right)"


def test_limit_is_first_rows(data_dir):
    full = load_benchmark("math500", data_dir)
    assert load_benchmark("math500", data_dir, limit=5) == full[:5]
    assert load_benchmark("math500", data_dir, limit=0) == []
    assert len(load_train("gsm8k", data_dir, limit=7)) == 7
    with pytest.raises(DataError):
        load_benchmark("math500", data_dir, limit=-1)


def test_gsm8k_train_split(data_dir):
    assert len(load_benchmark("gsm8k", data_dir, split="train", limit=2)) == 2
    with pytest.raises(DataError, match="split"):
        load_benchmark("aime24", data_dir, split="train")


def test_resolve_data_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    assert resolve_data_dir(None) is None
    monkeypatch.setenv("QERL_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(None) == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "arg") == tmp_path / "arg"


def test_env_var_is_used(monkeypatch, data_dir):
    monkeypatch.setenv("QERL_DATA_DIR", str(data_dir))
    assert len(load_benchmark("aime25")) == 30


def test_unknown_benchmark_lists_names():
    with pytest.raises(DataError) as e:
        load_benchmark("mmlu")
    msg = str(e.value)
    assert all(name in msg for name in BENCHMARKS)
    with pytest.raises(DataError, match="gsm8k"):
        load_train("aime24")


def test_missing_directory_message(tmp_path, no_env):
    with pytest.raises(DataError) as e:
        load_benchmark("gsm8k", tmp_path / "nowhere")
    msg = str(e.value)
    assert "\n" not in msg and "nowhere" in msg and "QERL_DATA_DIR" in msg and "data_dir" in msg


def test_missing_file_message(tmp_path, no_env):
    (tmp_path / "gsm8k").mkdir()
    with pytest.raises(DataError) as e:
        load_benchmark("gsm8k", tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "gsm8k" / "test.jsonl") in msg and "QERL_DATA_DIR" in msg


def test_missing_file_via_env_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match="env QERL_DATA_DIR"):
        load_benchmark("amc23")


def test_no_dir_and_hub_offline(no_env):
    with pytest.raises(DataError) as e:
        load_benchmark("math500")
    msg = str(e.value)
    assert "\n" not in msg and "math500/test.jsonl" in msg and "HF_HUB_OFFLINE" in msg and "QERL_DATA_DIR" in msg


def test_math_train_has_no_hub_fallback(monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(DataError, match="no hub fallback"):
        load_train("math")


def test_hub_fallback_maps_rows(monkeypatch):
    """The hub path, with `datasets.load_dataset` replaced (never touches the network)."""
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    class FakeDatasets:
        @staticmethod
        def load_dataset(repo, config=None, split=None):
            calls.append((repo, config, split))
            return [{"question": "Q1", "answer": "work\n#### 1,200"}, {"question": "Q2", "answer": "#### 3"}]

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    problems = load_benchmark("gsm8k", limit=1)
    assert calls == [("openai/gsm8k", "main", "test")]
    assert problems == [Problem(id="0", question="Q1", answer="1200", benchmark="gsm8k")]


def test_hub_failure_is_one_line(monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    class FailingDatasets:
        @staticmethod
        def load_dataset(*args, **kwargs):
            raise ConnectionError("could not reach huggingface.co\nmore details")

    monkeypatch.setitem(sys.modules, "datasets", FailingDatasets)
    with pytest.raises(DataError) as e:
        load_benchmark("aime24")
    msg = str(e.value)
    assert "\n" not in msg and "HuggingFaceH4/aime_2024" in msg and "QERL_DATA_DIR" in msg


def test_bad_json_line(tmp_path, no_env):
    (tmp_path / "amc23").mkdir()
    (tmp_path / "amc23" / "test.jsonl").write_text(json.dumps({"problem": "p", "answer": 1}) + "\n{oops\n")
    with pytest.raises(DataError, match=r"test.jsonl:2"):
        load_benchmark("amc23", tmp_path)


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)
    assert "\n" not in str(qdata.DataError("a\nb"))
