"""Recipes: the YAML experiment configs, validated by a pydantic schema (unknown keys are errors).

    recipe = load_recipe("recipes/embedded.yaml", {"generation.max_new_tokens": 32})

A recipe names the model, the weight formats, the benchmarks (each with an optional limit),
the generation settings, the seed, the data directory, where MLflow tracks runs, and where
checkpoints and reports go. Every problem with a recipe is a `RecipeError` whose message is
ONE line naming the bad key and the valid choices, e.g.

    recipes/x.yaml: unknown key 'model.nme'; valid keys of model: name, revision, trust_remote_code, dtype

String values may use `${VAR}` or `${VAR:-default}` (environment variables), so a recipe can
say `data_dir: ${QERL_DATA_DIR:-../shared/data}`. Relative paths (data_dir, output_dir,
report_dir, a sqlite tracking store) are relative to the working directory.

Try it:  python -c "from qerl.recipe import load_recipe; print(load_recipe('embedded'))"
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qerl import FORMATS
from qerl.data import BENCHMARKS
from qerl.eval.generate import GenerationSettings
from qerl.model import ModelSpec
from qerl.nn.aqn import AQNSettings
from qerl.nn.lora_settings import LoraSettings
from qerl.rl.grpo import GRPOSettings

__all__ = [
    "BenchmarkSpec",
    "MlflowSettings",
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "flatten",
    "load_recipe",
    "parse_overrides",
    "recipe_from_dict",
    "resolve_recipe_path",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPES_DIR = REPO_ROOT / "recipes"
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_DEVICE_RE = r"^(auto|cpu|mps|cuda(:\d+)?)$"


class RecipeError(ValueError):
    """A recipe that cannot be read or validated. The message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class BenchmarkSpec(BaseModel):
    """One evaluation benchmark; `limit` keeps its first N problems (None = all)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    limit: int | None = Field(None, ge=1)
    # This benchmark's generation budget (None: generation.max_new_tokens); e.g. the short
    # answers of the generated arith task need 32 tokens where GSM8K reasoning needs 256+.
    max_new_tokens: int | None = Field(None, ge=1)
    # Samples per problem for pass@1 averaged over k (None: generation.num_samples).
    num_samples: int | None = Field(None, ge=1)
    # Sampling for this benchmark (None: generation's), e.g. T 0.6 / top_p 0.95 for the math sets.
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Who evaluates this benchmark (None: the recipe's `harness`): qerl's own evaluator, lm-eval
    # (gsm8k) or lighteval (math500, aime24, aime25, amc23); see docs/evaluation.md.
    harness: Literal["qerl", "lm-eval", "lighteval"] | None = None

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {v!r}; valid benchmarks: {', '.join(BENCHMARKS)}")
        return v


# Trained variants: name -> (weight format, AQN on). Names as in summary.json. The first five are the trained
# columns of the paper's Table 1 (a train section's default); the other three put AQN on the other formats, so an
# ablation can cross every format with AQN off and on (AQN only touches the RMSNorm weights: any format takes it).
VARIANTS: dict[str, tuple[str, bool]] = {
    "lora-bf16": ("bf16", False),
    "qlora-nf4": ("nf4", False),
    "lora-mxfp4": ("mxfp4", False),
    "qerl-nvfp4": ("nvfp4", False),
    "qerl-nvfp4-aqn": ("nvfp4", True),
    "lora-bf16-aqn": ("bf16", True),
    "qlora-nf4-aqn": ("nf4", True),
    "lora-mxfp4-aqn": ("mxfp4", True),
}
TABLE1_VARIANTS = ["lora-bf16", "qlora-nf4", "lora-mxfp4", "qerl-nvfp4", "qerl-nvfp4-aqn"]


class TrainSpec(BaseModel):
    """RL training of LoRA adapters per variant (qerl.rl.trainer.train): the recipe's `train:`.

    `grpo`, `lora` and `aqn` take the fields of GRPOSettings (TRL GRPOConfig names), LoraSettings
    (peft.LoraConfig names) and AQNSettings; AQN's `enabled` is decided by the variant.
    `learning_rate_by_format` overrides grpo.learning_rate per weight format (the paper uses a
    larger rate for NVFP4 than for bf16 LoRA).
    """

    model_config = ConfigDict(extra="forbid")

    variants: list[str] = Field(default_factory=lambda: list(TABLE1_VARIANTS), min_length=1)
    dataset: Literal["gsm8k", "math", "arith"] = "gsm8k"  # training problems (qerl.data.load_train)
    limit: int | None = Field(None, ge=1)  # first N training problems (None: all; arith: 2000)
    # Rewards: correctness (qerl.rl.rewards.accuracy, the grader of the problem's benchmark)
    # and the format reward, weighted [1, format_weight] unless grpo.reward_weights says otherwise.
    format_weight: float = Field(0.0, ge=0.0)  # 0: the format reward is logged, not rewarded
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    lora: LoraSettings = Field(default_factory=LoraSettings)
    aqn: AQNSettings = Field(default_factory=AQNSettings)
    learning_rate_by_format: dict[str, float] = Field(default_factory=dict)
    resume: bool = True  # continue from the newest complete checkpoint of the same settings

    @field_validator("variants", mode="before")
    @classmethod
    def _variants_shorthand(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("variants")
    @classmethod
    def _known_variants(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in VARIANTS:
                raise ValueError(f"unknown variant {name!r}; valid variants: {', '.join(VARIANTS)}")
        if len(set(v)) != len(v):
            raise ValueError("a variant is listed twice")
        return v

    @field_validator("learning_rate_by_format")
    @classmethod
    def _lr_formats(cls, v: dict[str, float]) -> dict[str, float]:
        for f, lr in v.items():
            if f not in FORMATS:
                raise ValueError(f"unknown format {f!r}; valid formats: {', '.join(FORMATS)}")
            if not lr > 0:
                raise ValueError(f"learning rate for {f} must be > 0, got {lr}")
        return v

    def settings_for(self, variant: str, seed: int) -> tuple[GRPOSettings, LoraSettings, AQNSettings]:
        """The trainer settings of one variant (its format's learning rate, its AQN switch)."""
        fmt, aqn_on = VARIANTS[variant]
        update: dict[str, Any] = {
            "learning_rate": self.learning_rate_by_format.get(fmt, self.grpo.learning_rate),
            "seed": seed,
        }
        if self.grpo.reward_weights is None:
            update["reward_weights"] = [1.0, self.format_weight]
        grpo = self.grpo.model_copy(update=update)
        aqn = self.aqn.model_copy(update={"enabled": aqn_on, "seed": seed})
        return grpo, self.lora, aqn


class MlflowSettings(BaseModel):
    """Where runs are tracked. artifact_location: None = next to a sqlite store (./mlruns)."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "qerl"
    artifact_location: str | None = None


class Recipe(BaseModel):
    """An experiment: model x formats x benchmarks, plus generation settings and where things go.

    Later issues add sections (training, aqn); until then an unknown section is an error.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=_NAME_RE)
    description: str = ""
    model: ModelSpec = Field(default_factory=ModelSpec)
    formats: list[str] = Field(default_factory=lambda: list(FORMATS), min_length=1)
    benchmarks: list[BenchmarkSpec] = Field(
        default_factory=lambda: [BenchmarkSpec(name="gsm8k")], min_length=1
    )
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    seed: int = Field(0, ge=0)
    # None: QERL_DATA_DIR, else the Hugging Face hub (see qerl.data.resolve_data_dir).
    data_dir: str | None = None
    device: str = Field("auto", pattern=_DEVICE_RE)  # auto = cuda if available, else cpu
    # Activations' dtype during evaluation (weights keep their format). auto: bfloat16 on a GPU,
    # float32 on a CPU, where bf16 matmuls without native support run several times slower.
    compute_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    max_workers: int = Field(2, ge=1)  # formats processed at once by the flow
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    output_dir: str = ".qerl"  # checkpoints and per-problem results
    # Who builds the nvfp4/mxfp4 checkpoints: our exact quantizer (default; no calibration,
    # also nf4) or llm-compressor's oneshot (NVFP4A16/MXFP4A16). Both give identical tensors.
    quantizer: Literal["qerl", "llm-compressor"] = "qerl"
    report_dir: str | None = None  # None = reports/<name>
    # Default evaluation harness of the benchmarks (see BenchmarkSpec.harness).
    harness: Literal["qerl", "lm-eval", "lighteval"] = "qerl"
    # RL training (None: only the base-model rows). Each variant trains LoRA on its format's
    # checkpoint, then is evaluated like the base models.
    train: TrainSpec | None = None

    @field_validator("formats", mode="before")
    @classmethod
    def _formats_shorthand(cls, v: Any) -> Any:
        # `formats: bf16,nvfp4` (handy with --set) is short for `formats: [bf16, nvfp4]`
        if isinstance(v, str):
            return [f.strip() for f in v.split(",") if f.strip()]
        return v

    @field_validator("formats")
    @classmethod
    def _formats(cls, v: list[str]) -> list[str]:
        for f in v:
            if f not in FORMATS:
                raise ValueError(f"unknown format {f!r}; valid formats: {', '.join(FORMATS)}")
        dup = sorted({f for f in v if v.count(f) > 1})
        if dup:
            raise ValueError(f"format {dup[0]!r} is listed twice; valid formats: {', '.join(FORMATS)}")
        return v

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _benchmark_shorthand(cls, v: Any) -> Any:
        # `benchmarks: [gsm8k]` is short for `benchmarks: [{name: gsm8k}]`
        if isinstance(v, list):
            return [{"name": b} if isinstance(b, str) else b for b in v]
        return v

    @field_validator("benchmarks")
    @classmethod
    def _unique_benchmarks(cls, v: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        names = [b.name for b in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"benchmark {dup[0]!r} is listed twice")
        return v

    @model_validator(mode="after")
    def _harness_tasks(self) -> "Recipe":
        supported = {"lm-eval": ("gsm8k",), "lighteval": ("math500", "aime24", "aime25", "amc23")}
        for b in self.benchmarks:
            h = b.harness or self.harness
            if h in supported and b.name not in supported[h]:
                raise ValueError(
                    f"benchmark {b.name!r} cannot be evaluated with harness {h!r}; it has: {', '.join(supported[h])}"
                )
        return self

    @model_validator(mode="after")
    def _defaults(self) -> "Recipe":
        if self.report_dir is None:
            self.report_dir = str(Path("reports") / self.name)
        # One seed for the whole recipe unless generation names its own.
        if "seed" not in self.generation.model_fields_set:
            self.generation = self.generation.model_copy(update={"seed": self.seed})
        return self

    # --------------------------------------------------------------- derived values
    def benchmark_names(self) -> list[str]:
        return [b.name for b in self.benchmarks]

    def variants(self) -> list[str]:
        """The trained variants (empty without a train section)."""
        return list(self.train.variants) if self.train else []

    def all_formats(self) -> list[str]:
        """Formats to quantise: the base rows' and those the trained variants need, in order."""
        need = list(self.formats)
        for v in self.variants():
            fmt = VARIANTS[v][0]
            if fmt not in need:
                need.append(fmt)
        return need

    def resolved_device(self) -> str:
        return resolve_device(self.device)

    def resolved_compute_dtype(self) -> str:
        if self.compute_dtype != "auto":
            return self.compute_dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def resolve_device(device: str) -> str:
    """"auto" -> cuda when a GPU is present, else cpu; any other device name as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2]; ValueError (one line) unless distinct integers, at least one."""
    try:
        seeds = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds takes distinct integers such as 0,1,2 (got {text!r})")
    return seeds


# ----------------------------------------------------------------------------- loading


def resolve_recipe_path(recipe: str | os.PathLike) -> Path:
    """A path to a YAML file, or a bare name ("embedded") -> recipes/<name>.yaml.

    Bare names are looked up in ./recipes first, then in the recipes/ folder of this checkout.
    """
    p = Path(recipe).expanduser()
    if p.is_file():
        return p
    s = str(recipe)
    if p.suffix not in (".yaml", ".yml") and "/" not in s and os.sep not in s:
        for base in (Path.cwd() / "recipes", RECIPES_DIR):
            for ext in (".yaml", ".yml"):
                cand = base / f"{s}{ext}"
                if cand.is_file():
                    return cand
    names = sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    raise RecipeError(
        f"recipe {s!r} not found (a YAML path or a name in recipes/); valid names: {', '.join(names) or 'none'}"
    )


_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand_env(value: Any) -> Any:
    """${VAR} / ${VAR:-default} in string values; an unset ${VAR} without default is an error."""
    if isinstance(value, dict):
        return {k: _expand_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(m: re.Match) -> str:
        env = os.environ.get(m.group(1), "")
        if env:
            return env
        if m.group(2) is not None:
            return m.group(2)
        raise RecipeError(f"environment variable {m.group(1)} is not set (used as ${{{m.group(1)}}}); set it or write ${{{m.group(1)}:-default}}")

    out = _ENV_RE.sub(sub, value)
    # a whole-value substitution may spell null ("${X:-null}"): read it as YAML would
    return None if out in ("null", "~", "") and value.strip().startswith("${") else out


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """["generation.max_new_tokens=32", "formats=[bf16,nvfp4]"] -> {dotted key: YAML value}."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {item!r} must look like key=value (e.g. generation.max_new_tokens=32)")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Set dotted keys ("generation.max_new_tokens", "benchmarks.0.limit") in a raw recipe dict."""
    data = dict(data)
    for dotted, value in (overrides or {}).items():
        parts = str(dotted).split(".")
        node: Any = data
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise RecipeError(f"override {dotted!r}: {part!r} is not an index of a {len(node)}-item list")
                idx = int(part)
                if last:
                    node[idx] = value
                else:
                    if isinstance(node[idx], str):  # benchmark shorthand
                        node[idx] = {"name": node[idx]}
                    node[idx] = dict(node[idx]) if isinstance(node[idx], dict) else node[idx]
                    node = node[idx]
                continue
            if not isinstance(node, dict):
                raise RecipeError(f"override {dotted!r}: {'.'.join(parts[:i])!r} is not a section")
            if last:
                node[part] = value
            else:
                child = node.get(part)
                if child is None and i == 0:
                    child = _default_of(part)  # e.g. benchmarks.0.limit without a benchmarks key
                if child is None:
                    child = {}
                elif isinstance(child, list):
                    child = list(child)
                elif isinstance(child, dict):
                    child = dict(child)
                node[part] = child
                node = child
    return data


def _default_of(field: str) -> Any:
    """The JSON form of a top-level field's default (None if unknown or without default)."""
    info = Recipe.model_fields.get(field)
    if info is None:
        return None
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return None


def recipe_from_dict(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Validate a raw dict; every error becomes a one-line RecipeError."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping of keys to values, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_one_line(e, source)) from None


def load_recipe(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read, expand ${VAR}s, apply dotted overrides, validate. `name` defaults to the file stem."""
    p = resolve_recipe_path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise RecipeError(f"cannot read recipe {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{p}:{where} invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe must be a YAML mapping of keys to values, got {type(data).__name__}")
    data.setdefault("name", p.stem)
    data = _expand_env(data)
    data = apply_overrides(data, overrides)
    return recipe_from_dict(data, source=_display(p))


def _display(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


# ----------------------------------------------------------------------------- errors


def _field_model(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the key at `loc` (the section), or None."""
    cur: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return None
        field = cur.model_fields.get(part)
        if field is None:
            return None
        cur = _inner_model(field.annotation)
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def _inner_model(annotation: Any) -> Any:
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _where(error: dict) -> str:
    """The dotted recipe key a validation error is about ("(recipe)" for the whole recipe)."""
    return _dotted(tuple(error.get("loc", ()))) or "(recipe)"


def _one_line(e: ValidationError, source: str) -> str:
    errors = e.errors(include_url=False)
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    key = _where(first)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        section_loc = loc[:-1]
        section = _field_model(Recipe, section_loc)
        valid = ", ".join(section.model_fields) if section else "?"
        where = f"of {_dotted(section_loc)}" if section_loc else "at the top level"
        msg = f"unknown key {key!r}; valid keys {where}: {valid}"
    elif kind == "missing":
        msg = f"missing key {key!r}"
    else:
        text = str(first.get("msg", "invalid value"))
        text = text.removeprefix("Value error, ")
        given = first.get("input")
        if kind not in ("value_error",) and not isinstance(given, (dict, list)):
            text += f" (got {given!r})"
        msg = f"{key}: {text}"
    more = ""
    if len(errors) > 1:
        # name where the others are, so one run shows every key to fix (the line stays one line)
        rest = list(dict.fromkeys(_where(err) for err in errors[1:]))
        more = f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''}, at {', '.join(rest)})"
    return f"{source}: {msg}{more}"


# ----------------------------------------------------------------------------- flattening


def flatten(recipe: Recipe | dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested recipe -> {"generation.max_new_tokens": "256", "formats": "bf16,nf4", ...}.

    Lists of scalars are joined with commas; lists of sections are indexed ("benchmarks.0.name").
    """
    data = recipe.model_dump(mode="json") if isinstance(recipe, BaseModel) else recipe
    out: dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}")
        elif isinstance(value, list):
            out[key] = ",".join(str(v) for v in value)
        else:
            out[key] = "None" if value is None else str(value)

    walk(data, prefix)
    return out

