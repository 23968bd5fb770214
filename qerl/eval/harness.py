"""One entry point for evaluating a checkpoint (+ LoRA adapter) with qerl, lm-eval or lighteval.

    from qerl.eval.harness import evaluate_with_harness
    result, meta = evaluate_with_harness(
        "lm-eval", checkpoint, adapter, "gsm8k",
        data_dir="../shared/data", limit=40, generation=GenerationSettings(max_new_tokens=256),
    )
    # meta = {"harness", "harness_version", "task", "task_version", "metric", ...}

- "qerl":      qerl.eval.evaluate.evaluate_benchmark (the fast in-house evaluator; every benchmark).
- "lm-eval":   lm-evaluation-harness through the `qerl` model class (qerl.eval.lm_eval_model);
               GSM8K only, lm-eval's own `gsm8k` task config with its data read from data_dir.
- "lighteval": lighteval's Pipeline through qerl's lighteval model (qerl.eval.lighteval_model) and
               the local tasks math_500 / aime24 / aime25 / amc23 (qerl.eval.lighteval_tasks).

All three load the model the same way (`load_for_eval`): the quantised checkpoint
(qerl.checkpoint.load_quantized), the activation dtype of the device (float32 on CPU, bf16 on
GPU: qerl.pipeline.set_compute_dtype), then the adapter through qerl.nn.lora.load_lora (PEFT does
not know QuantLinear on its own). The adapter is checked against the checkpoint first
(`check_adapter`): module names and LoRA shapes must fit, else HarnessError.

Every result is an `EvalResult` whose records hold one row per problem x sample (completion,
extracted answer, correct, tokens, entropy), as the pipeline logs them to MLflow.

Bad input raises a ValueError subclass with a one-line message: `HarnessError` (unknown harness
or task, missing / foreign adapter, bad settings) or `qerl.data.DataError` (data directory
without the task's file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Sequence

from qerl.eval.evaluate import records_summary  # noqa: E402,F401  (re-exported)

HARNESSES = ("qerl", "lm-eval", "lighteval")
# benchmark (qerl.data name) -> task name, per external harness
LM_EVAL_TASKS = {"gsm8k": "gsm8k"}
LIGHTEVAL_TASKS = {"math500": "math_500", "aime24": "aime24", "aime25": "aime25", "amc23": "amc23"}

Harness = Literal["qerl", "lm-eval", "lighteval"]


class HarnessError(ValueError):
    """Bad input for a harness run (message: one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# ----------------------------------------------------------------------------- adapter checks


def _skeleton(checkpoint: Path):
    """The checkpoint's model on the meta device (names and shapes, no weights, no time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def _arch(cfg: dict) -> dict:
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    return {k: cfg.get(k) for k in keys}


def check_adapter(adapter: str | os.PathLike, checkpoint: str | os.PathLike) -> Path:
    """Validate a PEFT LoRA adapter against a checkpoint before anything heavy loads.

    Raises HarnessError when the adapter dir or its files are missing, or when it was trained
    for another base: a LoRA module the checkpoint does not have, or a lora_A / lora_B shape
    that does not fit the checkpoint's layer, or (when adapter_config.json's
    base_model_name_or_path is a local checkpoint) a different architecture.
    """
    from safetensors import safe_open
    from torch import nn

    from qerl.nn.quant_linear import QuantLinear

    path = Path(adapter).expanduser()
    ckpt = Path(checkpoint).expanduser()
    if not path.exists():
        raise HarnessError(f"adapter {path} does not exist")
    if not path.is_dir():
        raise HarnessError(f"adapter {path} is not a directory (expected a PEFT adapter folder)")
    cfg_path = path / "adapter_config.json"
    weights = path / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise HarnessError(f"adapter {path} has no adapter_config.json (not a PEFT adapter)")
    if not weights.is_file():
        raise HarnessError(f"adapter {path} has no adapter_model.safetensors (only safetensors adapters are loaded)")
    try:
        acfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HarnessError(f"adapter {cfg_path} is not readable JSON: {one_line(e)}") from None
    if str(acfg.get("peft_type", "LORA")).upper() != "LORA":
        raise HarnessError(f"adapter {path} is a {acfg.get('peft_type')} adapter; only LoRA is supported")
    if not (ckpt / "config.json").is_file():
        raise HarnessError(f"checkpoint {ckpt} has no config.json")
    config, skeleton = _skeleton(ckpt)

    base = acfg.get("base_model_name_or_path")
    if base and (Path(base) / "config.json").is_file():
        theirs = _arch(json.loads((Path(base) / "config.json").read_text()))
        ours = _arch(config.to_dict())
        if theirs != ours:
            diff = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
            raise HarnessError(
                f"adapter {path} was trained for another base ({base}): architecture differs from checkpoint {ckpt} "
                f"(adapter base vs checkpoint: {diff})"
            )

    modules = dict(skeleton.named_modules())
    params = dict(skeleton.named_parameters())
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            shape = tuple(f.get_slice(key).get_shape())
            name = key.removeprefix("base_model.model.")
            for part in (".lora_A.weight", ".lora_B.weight"):
                if name.endswith(part):
                    mod_name = name[: -len(part)]
                    mod = modules.get(mod_name)
                    if not isinstance(mod, (nn.Linear, QuantLinear)):
                        raise HarnessError(
                            f"adapter {path} was trained for another base: it has LoRA weights for {mod_name}, "
                            f"which checkpoint {ckpt} does not have"
                        )
                    want_in = mod.in_features if part == ".lora_A.weight" else None
                    want_out = mod.out_features if part == ".lora_B.weight" else None
                    if (want_in is not None and shape[-1] != want_in) or (want_out is not None and shape[0] != want_out):
                        raise HarnessError(
                            f"adapter {path} was trained for another base: {key} has shape {list(shape)}, "
                            f"but {mod_name} in checkpoint {ckpt} is {mod.in_features}->{mod.out_features}"
                        )
                    break
            else:  # modules_to_save copies (e.g. trained RMSNorm weights)
                pname = name.replace(".modules_to_save.default", "").replace(".modules_to_save", "")
                p = params.get(pname)
                if p is None or tuple(p.shape) != shape:
                    have = list(p.shape) if p is not None else "nothing"
                    raise HarnessError(
                        f"adapter {path} was trained for another base: {key} has shape {list(shape)}, "
                        f"checkpoint {ckpt} has {have} there"
                    )
    return path


# ----------------------------------------------------------------------------- model loading


def default_compute_dtype(device: str) -> str:
    import torch

    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_for_eval(
    checkpoint: str | os.PathLike,
    adapter: str | os.PathLike | None = None,
    device: str = "cpu",
    compute_dtype: str | None = None,
):
    """-> (model in eval mode, tokenizer): checkpoint, compute dtype, then the adapter (unmerged)."""
    from qerl.checkpoint import load_quantized
    from qerl.formats import FormatError
    from qerl.pipeline import set_compute_dtype

    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir():
        raise HarnessError(f"checkpoint {ckpt} does not exist (expected a qerl checkpoint directory)")
    if adapter:
        check_adapter(adapter, ckpt)
    try:
        model, tokenizer = load_quantized(ckpt, device=device)
    except FormatError as e:
        raise HarnessError(one_line(e)) from None
    if tokenizer is None:
        raise HarnessError(f"checkpoint {ckpt} has no tokenizer: it cannot be evaluated")
    set_compute_dtype(model, compute_dtype or default_compute_dtype(device))
    if adapter:
        from qerl.nn.lora import load_lora

        model = load_lora(model, Path(adapter).expanduser())
    return model.eval(), tokenizer


# ----------------------------------------------------------------------------- shared helpers


def truncate_at(text: str, stops: Sequence[str] | str | None) -> str:
    """`text` cut before the earliest occurrence of any stop string."""
    if not stops:
        return text
    cut = len(text)
    for s in [stops] if isinstance(stops, str) else stops:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def score_continuations(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 8, max_length: int | None = None):
    """Log-probability of each continuation given its context, from one forward pass per batch.

    `pairs`: (context_ids, continuation_ids), context non-empty. Returns [(sum logprob, greedy)]
    where greedy is True when every continuation token is the argmax. Inputs longer than
    max_length + 1 keep their last tokens (the continuation is always kept).
    """
    import torch

    from qerl.eval.generate import _model_device

    device = _model_device(model)
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    seqs = []
    for ctx, cont in pairs:
        if not cont:
            raise HarnessError("empty continuation: nothing to score")
        full = list(ctx) + list(cont)
        if max_length is not None and len(full) > max_length + 1:
            full = full[-(max_length + 1) :]
        seqs.append((full[:-1], len(cont)))
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for b in range(0, len(order), batch_size):
                idx = order[b : b + batch_size]
                width = max(len(seqs[i][0]) for i in idx)
                ids = torch.zeros((len(idx), width), dtype=torch.long)
                att = torch.zeros((len(idx), width), dtype=torch.long)
                for r, i in enumerate(idx):  # right padding: positions stay 0..n-1
                    s = seqs[i][0]
                    ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
                    att[r, : len(s)] = 1
                logits = model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.float()
                logp = torch.log_softmax(logits, dim=-1)
                for r, i in enumerate(idx):
                    inp, n_cont = seqs[i]
                    full_len = len(inp)
                    target = torch.tensor(pairs[i][1], dtype=torch.long, device=logp.device)
                    rows = logp[r, full_len - n_cont : full_len]
                    lp = rows.gather(-1, target[:, None]).squeeze(-1)
                    greedy = bool((rows.argmax(-1) == target).all())
                    out[i] = (float(lp.sum()), greedy)
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


# ----------------------------------------------------------------------------- entry point


def _check_common(harness: str, benchmark: str, checkpoint, adapter) -> None:
    if harness not in HARNESSES:
        raise HarnessError(f"unknown harness {harness!r}; valid harnesses: {', '.join(HARNESSES)}")
    if harness == "lm-eval" and benchmark not in LM_EVAL_TASKS:
        raise HarnessError(
            f"unknown task {benchmark!r} for lm-eval; valid: {', '.join(LM_EVAL_TASKS)} "
            f"(math500/aime24/aime25/amc23 run through lighteval)"
        )
    if harness == "lighteval" and benchmark not in LIGHTEVAL_TASKS:
        raise HarnessError(
            f"unknown task {benchmark!r} for lighteval; valid: {', '.join(LIGHTEVAL_TASKS)} (gsm8k runs through lm-eval)"
        )
    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir():
        raise HarnessError(f"checkpoint {ckpt} does not exist (expected a qerl checkpoint directory)")
    if adapter:
        check_adapter(adapter, ckpt)


def evaluate_with_harness(
    harness: Harness,
    checkpoint: str,
    adapter: str | None,
    benchmark: str,
    *,
    data_dir: str | os.PathLike | None,
    limit: int | None,
    generation,
    device: str = "cpu",
    num_samples: int = 1,
    compute_dtype: str | None = None,
    model=None,
    tokenizer=None,
    progress: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Evaluate `checkpoint` (+ `adapter`) on `benchmark` with `harness` -> (EvalResult, meta).

    meta: {"harness", "harness_version", "task", "task_version", "metric", "checkpoint",
    "adapter", "num_samples", ...}. `generation` is a GenerationSettings (its num_samples is
    replaced by `num_samples`). `model`/`tokenizer`: an already loaded model (checkpoint +
    adapter applied), to skip loading; `checkpoint`/`adapter` are then only recorded.
    Errors in the input (see module docstring) are raised before the model loads.
    """
    from qerl.data import load_benchmark

    _check_common(harness, benchmark, checkpoint, adapter if model is None else None)
    if num_samples < 1:
        raise HarnessError(f"num_samples must be >= 1, got {num_samples}")
    try:
        generation = generation.model_copy(update={"num_samples": num_samples})
        type(generation).model_validate(generation.model_dump())
    except Exception as e:  # pydantic: e.g. num_samples > 1 with greedy decoding
        raise HarnessError(f"bad generation settings: {one_line(e)}") from None
    base_meta = {
        "checkpoint": str(checkpoint),
        "adapter": str(adapter) if adapter else None,
        "num_samples": num_samples,
        "limit": limit,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "max_new_tokens": generation.max_new_tokens,
    }
    if adapter:
        try:
            acfg = json.loads((Path(adapter).expanduser() / "adapter_config.json").read_text())
            base_meta["adapter_base"] = acfg.get("base_model_name_or_path")
        except (OSError, ValueError):
            pass

    if harness == "qerl":
        import qerl
        from qerl.eval.evaluate import evaluate_benchmark

        problems = load_benchmark(benchmark, data_dir=data_dir, limit=limit)  # data first
        if model is None:
            model, tokenizer = load_for_eval(checkpoint, adapter, device, compute_dtype)
        res = evaluate_benchmark(model, tokenizer, benchmark, problems, generation, progress=progress)
        meta = {
            "harness": "qerl",
            "harness_version": qerl.__version__,
            "task": benchmark,
            "task_version": "qerl.eval.evaluate",
            "metric": "pass@1" if num_samples == 1 else f"pass@1 (mean over {num_samples} samples)",
            **base_meta,
        }
        return res, meta

    if harness == "lm-eval":
        from qerl.eval.lm_eval_model import run_lm_eval

        return run_lm_eval(
            checkpoint, adapter, LM_EVAL_TASKS[benchmark], data_dir=data_dir, limit=limit, generation=generation,
            device=device, compute_dtype=compute_dtype, model=model, tokenizer=tokenizer, base_meta=base_meta,
            progress=progress,
        )

    from qerl.eval.lighteval_model import run_lighteval

    return run_lighteval(
        checkpoint, adapter, benchmark, data_dir=data_dir, limit=limit, generation=generation, device=device,
        compute_dtype=compute_dtype, model=model, tokenizer=tokenizer, base_meta=base_meta, progress=progress,
    )


__all__ = [
    "HARNESSES",
    "HarnessError",
    "LIGHTEVAL_TASKS",
    "LM_EVAL_TASKS",
    "check_adapter",
    "evaluate_with_harness",
    "load_for_eval",
    "score_continuations",
    "truncate_at",
]
