"""The plain-Python steps of the reproduce-table pipeline: quantize -> (train) -> evaluate -> report.

The Prefect tasks in tasks/ are thin wrappers of these; `run_local` chains them without
Prefect (for debugging). Every step logs to its own MLflow run, nested under the flow's parent
run when given one; a step that raises leaves its run FAILED with the error (see qerl.tracking).

    recipe = load_recipe("smoke")
    with parent_run(recipe) as parent:
        ckpt = quantize_step(recipe, "nvfp4", parent_run_id=parent)
        row = evaluate_step(recipe, "nvfp4", ckpt, parent)                # base-nvfp4
        trained = train_step(recipe, "qerl-nvfp4-aqn", ckpt, parent)       # needs recipe.train
        row = evaluate_step(recipe, "nvfp4", ckpt, parent, trained=trained)
        paths = report_step(recipe, parent)

or simply `run_local(recipe)`. Checkpoints live in <output_dir>/checkpoints/<model_key>/<format>
and are reused when complete (pass force=True to rebuild); training writes to `train_dir`
(<output_dir>/train/<model_key>/<variant>-seed<seed>-<settings hash>) and resumes there.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from qerl.memory import release_on_error
from qerl.recipe import Recipe
from qerl.tracking import Tracker, ui_command

__all__ = [
    "checkpoint_dir",
    "evaluate_step",
    "train_dir",
    "train_step",
    "parent_run",
    "preload",
    "quantize_step",
    "report_step",
    "run_local",
    "variant_name",
]

STEP_MARKER = "qerl_quantize_step.json"  # our summary of a finished quantize step
# Model loading runs one at a time: transformers' lazy imports are not thread-safe, and two
# loads at once double the peak memory for no gain. Quantising and generating run in parallel.
_LOAD_LOCK = threading.Lock()


def preload() -> None:
    """Import the heavy modules once, in the calling thread, before tasks run in threads.

    (Two threads importing from `transformers` for the first time at once can fail with
    "cannot import name 'AutoModelForCausalLM'"; seen with Prefect's thread pool.)
    """
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import qerl.checkpoint  # noqa: F401
    import qerl.data  # noqa: F401
    import qerl.eval.evaluate  # noqa: F401
    import qerl.eval.harness  # noqa: F401
    import qerl.memory  # noqa: F401
    import qerl.model  # noqa: F401
    import qerl.quantize  # noqa: F401
    import qerl.report  # noqa: F401


def variant_name(fmt: str) -> str:
    """The report/summary name of an untrained model in a format: base-<format>."""
    return f"base-{fmt}"


def checkpoint_dir(recipe: Recipe, fmt: str) -> Path:
    """<output_dir>/checkpoints/<model key>/<format>[-<quantizer>]/<quantizer version>.

    The path is the cache key of a quantised checkpoint (reused when complete): model name +
    revision + dtype (model_key), format, quantizer, and the quantizer's version: qerl's version
    plus a hash of its quantisation code (qerl/formats, quantize.py, checkpoint.py, build.py), and
    llm-compressor's package version when it quantises. Changed code -> a new checkpoint.
    """
    import hashlib
    from importlib import metadata

    import qerl
    from qerl.model import model_key

    src = Path(qerl.__file__).resolve().parent
    code = hashlib.sha256()
    for f in sorted([*src.glob("formats/*.py"), src / "quantize.py", src / "checkpoint.py", src / "build.py"]):
        code.update(f.name.encode() + b"\0" + f.read_bytes())
    version = f"qerl{qerl.__version__}-{code.hexdigest()[:8]}"
    base = Path(recipe.output_dir) / "checkpoints" / model_key(recipe.model)
    if recipe.quantizer != "qerl" and fmt in ("nvfp4", "mxfp4"):
        try:
            version += f"-llmcompressor{metadata.version('llmcompressor')}"
        except metadata.PackageNotFoundError:
            version += "-llmcompressor-missing"
        return base / f"{fmt}-{recipe.quantizer}" / version
    return base / fmt / version


def _step_tags(fmt: str, step: str, extra: dict[str, Any] | None, variant: str | None = None) -> dict[str, Any]:
    from qerl.recipe import VARIANTS

    aqn = VARIANTS[variant][1] if variant in VARIANTS else False
    return {"step": step, "format": fmt, "variant": variant or variant_name(fmt), "aqn": str(aqn).lower(), **(extra or {})}


def _start_step_run(recipe: Recipe, fmt: str, step: str, checkpoint, parent_run_id, tags, variant=None, params=None):
    """The child MLflow run of one step (quantize/train/evaluate) of one format or variant -> (tracker, run id)."""
    tracker = Tracker(recipe.mlflow)
    run_id = tracker.start_run(
        recipe,
        f"{step}/{variant or fmt}",
        parent_run_id=parent_run_id,
        tags=_step_tags(fmt, step, tags, variant),
        params={"format": fmt, "checkpoint": str(checkpoint), **(params or {})},
    )
    return tracker, run_id


# ----------------------------------------------------------------------------- parent run


def start_parent_run(recipe: Recipe, tags: dict[str, Any] | None = None) -> str:
    """The flow's top-level MLflow run (RUNNING), with the resolved recipe as recipe.yaml."""
    tracker = Tracker(recipe.mlflow)
    run_id = tracker.start_run(
        recipe, f"reproduce-table/{recipe.name}", tags={"step": "flow", **(tags or {})}
    )
    tracker.log_text(run_id, recipe.to_yaml(), "recipe.yaml")
    return run_id


@contextmanager
def parent_run(recipe: Recipe, tags: dict[str, Any] | None = None) -> Iterator[str]:
    """Start the parent run; FINISHED on success, FAILED with the error on exception."""
    tracker = Tracker(recipe.mlflow)
    run_id = start_parent_run(recipe, tags)
    with tracker.tracked(run_id):
        yield run_id


# ----------------------------------------------------------------------------- steps


@contextmanager
def _out_of_memory_as(error: type[BaseException], hint: str) -> Iterator[None]:
    """Re-raise torch's out-of-memory error as `error(hint)`, a line that names the recipe keys to change (torch's
    own message stays in the chain, and in the step run's error.txt)."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        if isinstance(exc, error):
            raise
        raise error(hint) from exc


@release_on_error
def quantize_step(
    recipe: Recipe,
    fmt: str,
    *,
    parent_run_id: str | None = None,
    force: bool = False,
    progress: bool = True,
    tags: dict[str, Any] | None = None,
) -> str:
    """Load the recipe's model, quantise it to `fmt`, save the checkpoint; -> its directory.

    Logs params (format, checkpoint), memory metrics and the quantisation summary to a child
    run. An existing complete checkpoint of the same model and format is reused.
    """
    from qerl.quantize import QuantizeOOM, check_format, quantize_oom_hint

    check_format(fmt)
    out = checkpoint_dir(recipe, fmt)
    tracker, run_id = _start_step_run(recipe, fmt, "quantize", out, parent_run_id, tags)
    hint = quantize_oom_hint(recipe.model.name, fmt, recipe.resolved_device())
    with tracker.tracked(run_id), _out_of_memory_as(QuantizeOOM, hint):
        info = None if force else _reusable(out)
        reused = info is not None
        if info is None:
            info = _quantize_and_save(recipe, fmt, out, progress)
        tracker.set_tags(run_id, {"checkpoint": str(out.resolve()), "reused_checkpoint": str(reused).lower()})
        metrics = {
            "layers_quantized": info["layers_quantized"],
            "layers_skipped": info["layers_skipped"],
            "bits_per_weight": info["bits_per_weight"],
            "linear_bytes": info["linear_bytes"],
            "total_bytes": info["total_bytes"],
            "checkpoint_bytes": info["checkpoint_bytes"],
        }
        if not reused:
            metrics["quantize_seconds"] = info["seconds"]
        tracker.log_metrics(run_id, metrics)
        tracker.log_dict(run_id, info, "quantize_summary.json")
    return str(out)


def _reusable(out: Path) -> dict | None:
    from qerl.checkpoint import is_complete

    marker = out / STEP_MARKER
    if not (is_complete(out) and marker.is_file()):
        return None
    try:
        return json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _quantize_and_save(recipe: Recipe, fmt: str, out: Path, progress: bool) -> dict:
    from qerl.checkpoint import save_quantized
    from qerl.model import builds_layerwise, load_model, load_tokenizer, torch_dtype
    from qerl.quantize import QuantSummary, quantize_

    t0 = time.perf_counter()
    # no global seeding here: nothing below draws from the process-wide RNG (random presets seed their own), and
    # reseeding it would change what trainers in other threads draw
    (out / STEP_MARKER).unlink(missing_ok=True)
    llm_compressor = recipe.quantizer == "llm-compressor" and fmt in ("nvfp4", "mxfp4")
    if builds_layerwise(recipe.model) and not llm_compressor:
        # a checkpoint is built in its format one decoder layer at a time: the peak is the model built so far (4-bit)
        # plus one bf16 layer, never the whole model in bf16 (the same tensors, bit for bit: tests/test_build.py)
        from qerl.build import build_model

        with _LOAD_LOCK:
            tokenizer = load_tokenizer(recipe.model)
        summary = QuantSummary(format=fmt)
        model = build_model(recipe.model.name, fmt, recipe.resolved_device(), dtype=torch_dtype(recipe.model),
                            revision=recipe.model.revision, progress=progress, summary=summary)
        save_quantized(model, tokenizer, out, fmt)
        return _finish_quantize(recipe, fmt, out, model, summary, t0)
    with _LOAD_LOCK:
        model, tokenizer = load_model(recipe.model, device=recipe.resolved_device())
    if llm_compressor:
        from qerl.checkpoint import load_quantized
        from qerl.llmcompressor_quantizer import quantize_with_llmcompressor
        from qerl.quantize import decoder_linears

        names = list(decoder_linears(model))
        quantize_with_llmcompressor(model, tokenizer, out, fmt)
        model, _ = load_quantized(out)
        summary = QuantSummary(format=fmt, layers_quantized=names)
    else:
        summary = quantize_(model, fmt, progress=progress)
        save_quantized(model, tokenizer, out, fmt)
    return _finish_quantize(recipe, fmt, out, model, summary, t0)


def _finish_quantize(recipe: Recipe, fmt: str, out: Path, model, summary, t0: float) -> dict:
    """The quantize step's summary, written beside the checkpoint as its completion marker."""
    from qerl.memory import checkpoint_bytes, memory_report

    mem = memory_report(model)
    info = {
        "format": fmt,
        "quantizer": recipe.quantizer if fmt in ("nvfp4", "mxfp4") else "qerl",
        "model": recipe.model.name,
        "layers_quantized": len(summary.layers_quantized),
        "layers_skipped": len(summary.layers_skipped),
        "skipped": list(summary.layers_skipped),
        "bits_per_weight": mem["bits_per_weight"],
        "linear_bytes": mem["linear_bytes"],
        "total_bytes": mem["total_bytes"],
        "checkpoint_bytes": checkpoint_bytes(out),
        "seconds": time.perf_counter() - t0,
    }
    (out / STEP_MARKER).write_text(json.dumps(info, indent=2))
    del model
    return info


@release_on_error
def evaluate_step(
    recipe: Recipe,
    fmt: str,
    checkpoint: str,
    parent_run_id: str | None = None,
    *,
    trained: dict[str, Any] | None = None,
    progress: bool = True,
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint (with the LoRA adapter of `trained`, train_step's result, if given)
    on every benchmark of the recipe; -> one summary row (variant base-<fmt> or the trained one).

    Logs metrics <bench>_accuracy, <bench>_ci_low, <bench>_ci_high, <bench>_entropy, <bench>_n,
    <bench>_completion_tokens, <bench>_seconds, the model's memory, and the per-problem results
    as results/<bench>.jsonl artifacts.
    """
    from qerl.checkpoint import load_quantized
    from qerl.data import load_benchmark
    from qerl.eval.evaluate import EvaluationOOM, evaluation_oom_hint, to_jsonl
    from qerl.eval.harness import evaluate_with_harness
    from qerl.memory import device_name, memory_report
    from qerl.model import ModelError

    variant = trained["variant"] if trained else None
    adapter = trained["adapter"] if trained else None
    tracker, run_id = _start_step_run(
        recipe, fmt, "evaluate", checkpoint, parent_run_id, tags, variant, {"adapter": str(adapter)} if adapter else None
    )
    row: dict[str, Any] = {
        "variant": variant or variant_name(fmt),
        "format": fmt,
        "quantizer": recipe.quantizer if fmt in ("nvfp4", "mxfp4") else "qerl",
        "model": recipe.model.name,
        "mlflow_run_id": run_id,
    }
    hint = evaluation_oom_hint(row["variant"], recipe.resolved_device(), recipe.generation.batch_size,
                               recipe.generation.max_new_tokens, recipe.max_workers)
    with tracker.tracked(run_id), _out_of_memory_as(EvaluationOOM, hint):
        if adapter:  # a missing or foreign adapter fails here, before the model loads
            from qerl.eval.harness import check_adapter

            check_adapter(adapter, checkpoint)
        # Data first: a bad data directory fails in a second, not after loading the model.
        problems = {
            b.name: load_benchmark(b.name, data_dir=recipe.data_dir, limit=b.limit) for b in recipe.benchmarks
        }
        with _LOAD_LOCK:
            model, tokenizer = load_quantized(checkpoint, device=recipe.resolved_device())
        if tokenizer is None:
            raise ModelError(f"checkpoint {checkpoint} has no tokenizer: model {recipe.model.name!r} can be quantized but not evaluated")
        mem = memory_report(model)  # before the cast below: the format's own storage
        compute_dtype = set_compute_dtype(model, recipe.resolved_compute_dtype())
        if adapter:
            from qerl.nn.lora import load_lora

            model = load_lora(model, adapter)  # unmerged: the 4-bit base stays as it was
            model.eval()
        tracker.set_tags(run_id, {"compute_dtype": compute_dtype, "device": recipe.resolved_device(),
                                  "device_name": device_name(recipe.resolved_device())})
        tracker.log_metrics(
            run_id,
            {"bits_per_weight": mem["bits_per_weight"], "linear_bytes": mem["linear_bytes"], "total_bytes": mem["total_bytes"]},
        )
        row["bits_per_weight"] = mem["bits_per_weight"]
        results_dir = Path(recipe.output_dir) / "results" / run_id
        specs = {b.name: b for b in recipe.benchmarks}
        for bench, probs in problems.items():
            t0 = time.perf_counter()
            spec = specs[bench]
            own = {k: getattr(spec, k) for k in ("max_new_tokens", "num_samples", "temperature", "top_p")}
            gen = recipe.generation.model_copy(update={k: v for k, v in own.items() if v is not None})
            res, meta = evaluate_with_harness(
                spec.harness or recipe.harness, checkpoint, adapter, bench, data_dir=recipe.data_dir,
                limit=spec.limit, generation=gen, device=recipe.resolved_device(), num_samples=gen.num_samples,
                compute_dtype=compute_dtype, model=model, tokenizer=tokenizer, progress=progress,
            )
            tracker.set_tags(run_id, {f"{bench}_{k}": meta.get(k) for k in ("harness", "harness_version", "task", "task_version", "metric")})
            tracker.log_dict(run_id, meta, f"results/{bench}_harness.json")
            seconds = time.perf_counter() - t0
            metrics = {
                f"{bench}_accuracy": res.accuracy,
                f"{bench}_ci_low": res.ci_low,
                f"{bench}_ci_high": res.ci_high,
                f"{bench}_entropy": res.mean_entropy,
                f"{bench}_n": res.n,
                f"{bench}_correct": res.correct,
                f"{bench}_completion_tokens": res.mean_completion_tokens,
                f"{bench}_seconds": seconds,
            }
            tracker.log_metrics(run_id, metrics)
            path = to_jsonl(res.records, results_dir / f"{bench}.jsonl")
            tracker.log_artifact(run_id, path, "results")
            row.update(metrics)
        del model
    return row


def train_dir(recipe: Recipe, variant: str) -> Path:
    """Where a variant's training writes checkpoints and its final adapter.

    The name carries a hash of everything that shapes the training (model, quantizer, settings,
    data, seed), so a rerun with the same recipe resumes or reuses it, and a changed recipe
    starts fresh instead of resuming an incompatible checkpoint.
    """
    import hashlib

    from qerl.model import model_key

    spec = recipe.train
    if spec is None:
        raise ValueError(f"recipe {recipe.name!r} has no train section")
    grpo, lora, aqn = spec.settings_for(variant, recipe.seed)
    key = json.dumps(
        {
            "model": model_key(recipe.model),
            "quantizer": recipe.quantizer,
            "dataset": spec.dataset,
            "limit": spec.limit,
            "data_dir": str(recipe.data_dir),
            "grpo": grpo.model_dump(mode="json"),
            "lora": lora.model_dump(mode="json"),
            "aqn": aqn.model_dump(mode="json"),
            "compute_dtype": recipe.resolved_compute_dtype(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return Path(recipe.output_dir) / "train" / model_key(recipe.model) / f"{variant}-seed{recipe.seed}-{digest}"


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _close_stale_runs(tracker: Tracker, out: Path, run_id: str) -> None:
    """Train runs of the same train_dir still RUNNING belong to a killed process (SIGKILL, power
    loss) that could not close them: mark them KILLED, pointing at the run that resumes them."""
    from qerl.tracking import _LOCK

    exp = tracker.experiment_id
    with _LOCK:
        stale = tracker.client.search_runs(
            [exp],
            filter_string=f"tags.train_dir = '{out.resolve()}' and attributes.status = 'RUNNING'",
        )
    for run in stale:
        if run.info.run_id != run_id:
            tracker.set_tags(run.info.run_id, {"resumed_by": run_id})
            tracker.finish(run.info.run_id, "KILLED")


@release_on_error
def train_step(
    recipe: Recipe,
    variant: str,
    checkpoint: str,
    parent_run_id: str | None = None,
    *,
    progress: bool = True,
    tags: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the LoRA adapters of `variant` with GRPO/DAPO on its format's checkpoint.

    Logs every step's metrics (reward mean/std, accuracy, entropy, clip ratios, completion
    length, zero-variance groups, AQN sigma, rollout tokens/s, step time, peak memory, ...) to a
    child run "train/<variant>" with step numbers, the per-variant settings as params, and
    reward_first_fifth / reward_last_fifth / steps at the end. Checkpoints every
    grpo.save_steps; a rerun resumes from the newest complete one (same step count; the
    metrics of the steps before the resume are logged again into the new run, so its curves
    are whole). A NaN/Inf stops the run (TrainingError): the run is FAILED, the checkpoints stay.
    -> {"variant", "format", "aqn", "adapter", "train_dir", "steps", "reward_first_fifth", ...}
    """
    from qerl.checkpoint import load_quantized
    from qerl.data import load_train
    from qerl.memory import device_name
    from qerl.recipe import VARIANTS, flatten
    from qerl.rl.rewards import accuracy, format_reward
    from qerl.rl.trainer import train

    spec = recipe.train
    if spec is None:
        raise ValueError(f"recipe {recipe.name!r} has no train section: add `train:` to train variants")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    fmt, aqn_on = VARIANTS[variant]
    grpo, lora, aqn = spec.settings_for(variant, recipe.seed)
    out = train_dir(recipe, variant)
    params = {
        "dataset": spec.dataset,
        "train_limit": spec.limit,
        "train_dir": str(out),
        **flatten(grpo.model_dump(mode="json"), "grpo"),
        **flatten(lora.model_dump(mode="json"), "lora"),
        **flatten(aqn.model_dump(mode="json"), "aqn"),
    }
    tracker, run_id = _start_step_run(
        recipe, fmt, "train", checkpoint, parent_run_id, {**(tags or {}), "train_dir": str(out.resolve())}, variant, params
    )
    with tracker.tracked(run_id):
        _close_stale_runs(tracker, out, run_id)
        problems = load_train(spec.dataset, data_dir=recipe.data_dir, limit=spec.limit)  # data first
        with _LOAD_LOCK:
            model, tokenizer = load_quantized(checkpoint, device=recipe.resolved_device())
        compute_dtype = set_compute_dtype(model, recipe.resolved_compute_dtype())
        tracker.set_tags(run_id, {"compute_dtype": compute_dtype, "device": recipe.resolved_device(),
                                  "device_name": device_name(recipe.resolved_device())})
        logged: set[int] = set()
        t0 = time.perf_counter()

        def log_step(step: int, m: dict) -> None:
            tracker.log_metrics(run_id, _numeric(m), step=step)
            logged.add(step)
            if progress:
                elapsed = time.perf_counter() - t0
                print(
                    f"[train {variant}] step {step}/{grpo.max_steps} reward {m['reward_mean']:.3f} "
                    f"acc {m['accuracy']:.3f} H {m['entropy']:.3f} len {m['completion_length']:.1f} "
                    f"sigma {m['aqn_sigma']:.1e} {m['step_time_s']:.1f}s/step ({elapsed:.0f}s)",
                    flush=True,
                )

        result = train(
            model, tokenizer, grpo, aqn, problems, [accuracy, format_reward], out,
            log_fn=log_step, resume=spec.resume, lora_settings=lora,
        )
        for h in result.history:  # steps done before a resume, so this run's curves are whole
            if int(h["step"]) not in logged:
                tracker.log_metrics(run_id, _numeric(h), step=int(h["step"]))
        first, last = result.reward_fifths("reward_mean")
        acc_first, acc_last = result.reward_fifths("accuracy")
        ent_first, ent_last = result.reward_fifths("entropy")
        summary = {
            "reward_first_fifth": first,
            "reward_last_fifth": last,
            "accuracy_first_fifth": acc_first,
            "accuracy_last_fifth": acc_last,
            "entropy_first_fifth": ent_first,
            "entropy_last_fifth": ent_last,
            "steps": result.steps,
            "train_seconds": sum(h["step_time_s"] for h in result.history),
        }
        tracker.log_metrics(run_id, summary, step=result.steps)
        tracker.set_tags(run_id, {"adapter": str(result.adapter_dir), "resumed_from": str(result.resumed_from)})
        tracker.log_dict(run_id, {"history": result.history}, "train_history.json")
        for f in sorted(Path(result.adapter_dir).iterdir()):
            if f.is_file():
                tracker.log_artifact(run_id, f, "adapter")
        del model, result
    return {
        "variant": variant,
        "format": fmt,
        "aqn": aqn_on,
        "adapter": str(out / "adapter"),
        "train_dir": str(out),
        "mlflow_run_id": run_id,
        **summary,
    }


def set_compute_dtype(model, dtype: str) -> str:
    """Cast the activations' path (embeddings, norms, lm_head, unquantised linears) to `dtype`.

    QuantLinear layers keep their packed tensors and dequantise to the input's dtype, so every
    weight keeps the exact values of its format; only the arithmetic precision changes.
    """
    import torch

    from qerl.nn.quant_linear import QuantLinear

    target = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    for module in model.modules():
        if isinstance(module, QuantLinear):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype not in (target, torch.float32):
                module._buffers[name] = b.to(target)
    if getattr(model, "config", None) is not None:
        model.config.dtype = target
    return dtype


def configure_threads(recipe: Recipe) -> int | None:
    """On a CPU, split the cores between the formats that run at once (no oversubscription).

    Returns the torch thread count set, or None when left alone (GPU, or OMP_NUM_THREADS set).
    """
    if recipe.resolved_device() != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    workers = max(1, min(recipe.max_workers, len(recipe.all_formats()) + len(recipe.variants())))
    n = max(1, cores // workers)
    torch.set_num_threads(n)
    return n


def report_step(recipe: Recipe, parent_run_id: str, *, tags: dict[str, Any] | None = None) -> dict[str, str]:
    """Build table.md / table.html / summary.json / plot from the parent's runs (qerl.report).

    The files are logged as artifacts of the parent run; the step itself has a child run
    ("report") that records where they were written, and fails visibly if the report does.
    """
    from qerl.report import build_report

    tracker = Tracker(recipe.mlflow)
    run_id = tracker.start_run(
        recipe, "report", parent_run_id=parent_run_id, tags={"step": "report", **(tags or {})}
    )
    with tracker.tracked(run_id):
        paths = build_report(recipe, parent_run_id, tracker)
        tracker.set_tags(run_id, paths)
    return paths


# ----------------------------------------------------------------------------- without Prefect


def run_local(recipe: Recipe, *, progress: bool = True, force: bool = False) -> dict[str, Any]:
    """The whole reproduce-table pipeline in this process, column after column (no Prefect).

    A column that fails does not stop the others; the report is written anyway and then the
    first error is raised (the parent run is FAILED).
    """
    rows: list[dict] = []
    failures: list[tuple[str, BaseException]] = []
    preload()
    local = recipe.model_copy(update={"max_workers": 1})
    configure_threads(local)  # one format at a time: all cores to it
    with parent_run(recipe, tags={"orchestrator": "local"}) as parent:
        ckpts: dict[str, str] = {}
        for fmt in recipe.all_formats():
            try:
                ckpts[fmt] = quantize_step(recipe, fmt, parent_run_id=parent, force=force, progress=progress)
                if fmt in recipe.formats:
                    rows.append(evaluate_step(recipe, fmt, ckpts[fmt], parent, progress=progress))
            except Exception as exc:  # recorded in the step's FAILED run
                failures.append((fmt, exc))
        from qerl.recipe import VARIANTS

        for variant in recipe.variants():
            fmt = VARIANTS[variant][0]
            if fmt not in ckpts:
                continue  # its quantize step failed (recorded above)
            try:
                trained = train_step(recipe, variant, ckpts[fmt], parent, progress=progress)
                rows.append(evaluate_step(recipe, fmt, ckpts[fmt], parent, trained=trained, progress=progress))
            except Exception as exc:
                failures.append((variant, exc))
        paths = report_step(recipe, parent)
        if failures:
            raise failures[0][1]
    return result_dict(recipe, parent, paths, rows)


def result_dict(recipe: Recipe, parent_run_id: str, paths: dict[str, str], rows: list[dict]) -> dict[str, Any]:
    return {
        "parent_run_id": parent_run_id,
        **paths,
        "rows": rows,
        "mlflow_ui": ui_command(recipe.mlflow.tracking_uri),
    }
