"""Recipe schema and bad-input handling: one-line errors naming the key and the valid choices,
exit code 2 from the CLI before any MLflow run exists, and every shipped recipe validates.

    python -m pytest tests/test_recipe.py -q
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import yaml

from qerl import FORMATS
from qerl.data import BENCHMARKS
from qerl.recipe import (
    TABLE1_VARIANTS,
    VARIANTS,
    Recipe,
    RecipeError,
    flatten,
    load_recipe,
    parse_overrides,
    recipe_from_dict,
    resolve_recipe_path,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))


def write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data), encoding="utf-8")
    return p


def error_of(tmp_path: Path, data: dict, overrides: dict | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, data), overrides)
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------- schema errors


def test_unknown_top_level_key_lists_valid_keys(tmp_path):
    msg = error_of(tmp_path, {"name": "x", "modle": {"name": "embedded"}})
    assert "unknown key 'modle'" in msg
    for key in ("model", "formats", "benchmarks", "generation", "seed", "data_dir", "mlflow"):
        assert key in msg


@pytest.mark.parametrize(
    "data, key, valid",
    [
        ({"model": {"nme": "embedded"}}, "model.nme", ["name", "revision", "trust_remote_code", "dtype"]),
        ({"generation": {"max_tokens": 8}}, "generation.max_tokens", ["max_new_tokens", "temperature", "batch_size"]),
        ({"mlflow": {"uri": "sqlite:///x.db"}}, "mlflow.uri", ["tracking_uri", "experiment"]),
        ({"benchmarks": [{"name": "gsm8k", "lmit": 3}]}, "benchmarks[0].lmit", ["name", "limit"]),
    ],
)
def test_unknown_nested_key_lists_valid_keys_of_its_section(tmp_path, data, key, valid):
    msg = error_of(tmp_path, {"name": "x", **data})
    assert f"unknown key '{key}'" in msg
    for v in valid:
        assert v in msg


def test_bad_format_lists_valid_formats(tmp_path):
    msg = error_of(tmp_path, {"name": "x", "formats": ["bf16", "fp8"]})
    assert "'fp8'" in msg
    assert all(f in msg for f in FORMATS)


def test_bad_benchmark_lists_valid_benchmarks(tmp_path):
    msg = error_of(tmp_path, {"name": "x", "benchmarks": [{"name": "mmlu"}]})
    assert "'mmlu'" in msg and "benchmarks[0].name" in msg
    assert all(b in msg for b in BENCHMARKS)


def test_bad_values_name_the_key(tmp_path):
    assert "model.dtype" in error_of(tmp_path, {"name": "x", "model": {"dtype": "fp16"}})
    assert "benchmarks[0].limit" in error_of(tmp_path, {"name": "x", "benchmarks": [{"name": "gsm8k", "limit": 0}]})
    assert "generation.max_new_tokens" in error_of(tmp_path, {"name": "x", "generation": {"max_new_tokens": 0}})
    assert "listed twice" in error_of(tmp_path, {"name": "x", "formats": ["nf4", "nf4"]})


def test_overrides_are_validated_too(tmp_path):
    path = write(tmp_path, {"name": "x"})
    assert load_recipe(path, {"generation.max_new_tokens": 7}).generation.max_new_tokens == 7
    assert load_recipe(path, {"formats": "bf16,nvfp4"}).formats == ["bf16", "nvfp4"]
    assert load_recipe(path, {"benchmarks.0.limit": 3}).benchmarks[0].limit == 3
    with pytest.raises(RecipeError, match="unknown key 'generation.max_tokens'"):
        load_recipe(path, {"generation.max_tokens": 7})
    with pytest.raises(RecipeError, match="unknown format 'int4'"):
        load_recipe(path, parse_overrides(["formats=[bf16,int4]"]))


def test_unreadable_recipes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(lst)
    with pytest.raises(RecipeError, match="not found"):
        resolve_recipe_path("no-such-recipe")


# ----------------------------------------------------------------------------- defaults, env, flattening


def test_defaults_and_name_from_file(tmp_path):
    r = load_recipe(write(tmp_path, {}, "my-run.yaml"))
    assert r.name == "my-run"
    assert r.report_dir == str(Path("reports") / "my-run")
    assert r.formats == list(FORMATS)
    assert r.mlflow.tracking_uri == "sqlite:///mlflow.db"
    assert r.output_dir == ".qerl"
    # one seed for everything unless generation names its own
    assert load_recipe(write(tmp_path, {"seed": 5})).generation.seed == 5
    assert load_recipe(write(tmp_path, {"seed": 5, "generation": {"seed": 1}})).generation.seed == 1


def test_env_expansion(tmp_path, monkeypatch):
    path = write(tmp_path, {"name": "x", "data_dir": "${QERL_TEST_DIR:-../shared/data}"})
    monkeypatch.delenv("QERL_TEST_DIR", raising=False)
    assert load_recipe(path).data_dir == "../shared/data"
    monkeypatch.setenv("QERL_TEST_DIR", "/somewhere/data")
    assert load_recipe(path).data_dir == "/somewhere/data"
    with pytest.raises(RecipeError, match="QERL_UNSET_VAR"):
        load_recipe(write(tmp_path, {"name": "x", "data_dir": "${QERL_UNSET_VAR}"}))


def test_flatten_gives_dotted_params():
    flat = flatten(recipe_from_dict({"name": "x", "benchmarks": [{"name": "gsm8k", "limit": 4}]}))
    assert flat["model.name"] == "embedded"
    assert flat["formats"] == "bf16,nf4,mxfp4,nvfp4"
    assert flat["benchmarks.0.name"] == "gsm8k" and flat["benchmarks.0.limit"] == "4"
    assert flat["generation.max_new_tokens"] == "256"
    assert flat["mlflow.tracking_uri"] == "sqlite:///mlflow.db"
    assert len(flat) < 100  # one MLflow log_batch


# ----------------------------------------------------------------------------- shipped recipes


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    assert isinstance(r, Recipe) and r.name == path.stem


def test_shipped_recipe_contents(monkeypatch):
    monkeypatch.delenv("QERL_DATA_DIR", raising=False)
    names = {p.stem for p in SHIPPED}
    assert {"embedded", "smoke", "qwen2.5-3b", "qwen2.5-7b"} <= names
    emb = load_recipe("embedded")
    assert emb.model.name == "embedded" and emb.formats == list(FORMATS)
    assert emb.report_dir == "reports/embedded" and emb.generation.temperature == 0
    assert emb.data_dir == "../shared/data"
    monkeypatch.setenv("QERL_DATA_DIR", "/data/elsewhere")
    assert load_recipe("embedded").data_dir == "/data/elsewhere"
    smoke = load_recipe("smoke")
    assert smoke.model.name == "random:tiny-llama" and smoke.formats == list(FORMATS)
    assert smoke.benchmarks[0].limit == 4 and smoke.generation.max_new_tokens == 16
    for size in ("3B", "7B"):
        q = load_recipe(f"qwen2.5-{size.lower()}")
        assert q.model.name == f"Qwen/Qwen2.5-{size}-Instruct"
        assert q.benchmarks[0].name == "gsm8k" and q.benchmarks[0].limit is None  # full test set
        # Table 1 columns trained with GRPO on GSM8K, reference settings of shared/paper.md
        assert q.variants() == TABLE1_VARIANTS and q.train.dataset == "gsm8k"
        g, lora, aqn = q.train.settings_for("qerl-nvfp4-aqn", 0)
        assert (g.loss_type, g.learning_rate, g.epsilon_high, g.beta, g.temperature) == ("grpo", 1e-5, 0.28, 0.0, 1.0)
        assert (g.max_completion_length, g.max_grad_norm, g.weight_decay, g.warmup_ratio) == (2048, 0.2, 0.1, 0.1)
        assert g.generation_batch_size == 4 and g.num_generations == 2  # 2 prompts x 2 generations
        assert (lora.r, lora.lora_alpha, lora.train_norms) == (16, 16, True)
        assert aqn.enabled and (aqn.sigma_start, aqn.sigma_end, aqn.num_stages) == (1e-2, 1e-4, 10)
        assert not q.train.settings_for("qerl-nvfp4", 0)[2].enabled
        assert q.train.settings_for("lora-bf16", 0)[0].learning_rate == pytest.approx(1e-6)  # ~10x lower
    for size in ("7B", "14B", "32B"):
        d = load_recipe(f"qwen2.5-{size.lower()}-dapo")
        assert d.train.dataset == "math" and "qerl-nvfp4-aqn" in d.variants()
        g = d.train.settings_for("qerl-nvfp4", 0)[0]
        assert g.loss_type == "dapo" and g.dynamic_sampling and g.mask_truncated_completions
        assert {b.name for b in d.benchmarks} == {"math500", "aime24", "aime25", "amc23"}
        assert d.generation.temperature == 0.6 and d.generation.top_p == 0.95
    # the embedded default trains all five variants on the generated arith task
    assert emb.variants() == TABLE1_VARIANTS and emb.train.dataset == "arith"
    assert emb.benchmark_names() == ["gsm8k", "arith"]


def test_every_format_has_a_variant_with_aqn_and_one_without(tmp_path):
    """VARIANTS crosses the four formats with AQN off / on; a train section without `variants` trains the paper's
    five Table 1 columns; each variant's settings carry its AQN switch and its format's learning rate."""
    assert sorted(VARIANTS.values()) == sorted((f, a) for f in FORMATS for a in (False, True))
    assert TABLE1_VARIANTS == ["lora-bf16", "qlora-nf4", "lora-mxfp4", "qerl-nvfp4", "qerl-nvfp4-aqn"]
    assert all(v.endswith("-aqn") == VARIANTS[v][1] for v in VARIANTS)
    data = yaml.safe_load((ROOT / "recipes" / "smoke.yaml").read_text())
    del data["train"]["variants"]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    assert load_recipe(tmp_path / "r.yaml").variants() == TABLE1_VARIANTS
    r = load_recipe("smoke", {"train.variants": "lora-bf16-aqn,qlora-nf4-aqn,lora-mxfp4-aqn", "formats": "nvfp4",
                              "train.learning_rate_by_format": {"bf16": 2e-6}})
    assert r.all_formats() == ["nvfp4", "bf16", "nf4", "mxfp4"]  # each variant's format is quantised
    for v in r.variants():
        grpo, _, aqn = r.train.settings_for(v, 3)
        assert aqn.enabled and aqn.seed == 3
        assert grpo.learning_rate == (2e-6 if v == "lora-bf16-aqn" else r.train.grpo.learning_rate)
    assert not r.train.settings_for("lora-bf16", 3)[2].enabled


def test_train_section_errors():
    with pytest.raises(RecipeError, match="unknown variant 'qerl-fp8'"):
        load_recipe("smoke", {"train.variants": "qerl-fp8"})
    with pytest.raises(RecipeError, match="train.grpo.lr"):
        load_recipe("smoke", {"train.grpo.lr": 1e-5})
    with pytest.raises(RecipeError, match="unknown format 'fp8'"):
        load_recipe("smoke", {"train.learning_rate_by_format": {"fp8": 1e-5}})
    with pytest.raises(RecipeError, match="multiple of"):
        load_recipe("smoke", {"train.grpo.num_generations": 3})
    assert load_recipe("smoke", {"train": None}).variants() == []


# ----------------------------------------------------------------------------- CLI: exit 2, one line, no runs


def _runs_in(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        try:
            return con.execute("select count(*) from runs").fetchone()[0]
        except sqlite3.OperationalError:
            return 0


@pytest.mark.parametrize(
    "data, args, expected",
    [
        ({"colour": "red"}, [], ["unknown key 'colour'", "valid keys"]),
        ({"formats": ["bf16", "fp8"]}, [], ["'fp8'", *FORMATS]),
        ({"benchmarks": [{"name": "mmlu"}]}, [], ["'mmlu'", *BENCHMARKS]),
        ({}, ["--set", "formats=bf16,int4"], ["'int4'", *FORMATS]),
        ({}, ["--set", "generation.max_tokens=3"], ["generation.max_tokens", "max_new_tokens"]),
        # several mistakes: the first explained, every other one located, still one line
        ({"formats": ["bf16", "fp8"], "colour": "red", "generation": {"max_tokens": 3}}, [],
         ["'fp8'", "2 more errors, at ", "colour", "generation.max_tokens"]),
    ],
)
def test_cli_bad_input_exits_2_with_one_line_before_any_run(tmp_path, data, args, expected):
    from typer.testing import CliRunner

    from qerl.cli import app

    db = tmp_path / "mlflow.db"
    recipe = {"name": "bad", "model": {"name": "random:tiny-llama"}, "mlflow": {"tracking_uri": f"sqlite:///{db}"}}
    path = write(tmp_path, {**recipe, **data})
    result = CliRunner().invoke(app, ["reproduce", str(path), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for e in expected:
        assert e in lines[0]
    assert _runs_in(db) == 0


@pytest.mark.parametrize("command", [["reproduce"], ["reproduce", "--local"], ["ablation", "--seeds", "0"], ["quantize"],
                                     ["evaluate"]])
def test_cli_refuses_a_device_this_machine_lacks_in_one_line(tmp_path, command):
    """device: cuda:99 (no machine has 100 GPUs; with none at all the message says so): every command that runs steps
    stops with exit code 2 and one line naming the device, before Prefect, MLflow or a checkpoint folder starts."""
    from typer.testing import CliRunner

    from qerl.cli import app

    db, out = tmp_path / "mlflow.db", tmp_path / "out"
    recipe = {"name": "gpu", "model": {"name": "random:tiny-llama"}, "device": "cuda:99", "output_dir": str(out),
              "report_dir": str(tmp_path / "reports"),
              "mlflow": {"tracking_uri": f"sqlite:///{db}"}}
    path = write(tmp_path, recipe)
    result = CliRunner().invoke(app, [command[0], str(path), *command[1:]])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: recipe 'gpu' needs device cuda:99 but this worker"), lines
    assert "device=cpu" in lines[0] and not db.exists() and not out.exists() and not (tmp_path / "reports").exists()


def test_cli_unknown_format_option_exits_2(tmp_path):
    from typer.testing import CliRunner

    from qerl.cli import app

    path = write(tmp_path, {"name": "x", "model": {"name": "random:tiny-llama"}})
    result = CliRunner().invoke(app, ["quantize", str(path), "--format", "int3"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: ") and "nvfp4" in result.output


def test_cli_help_lists_commands():
    from typer.testing import CliRunner

    from qerl.cli import app

    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in ("reproduce", "quantize", "evaluate", "report", "ablation", "ui"):
        assert cmd in result.output
