"""The GRPO / DAPO training loop over LoRA adapters (4-bit or bf16 base), with AQN.

    result = train(model, tokenizer, GRPOSettings(...), AQNSettings(enabled=True),
                   problems, [gsm8k_accuracy], "runs/x", log_fn=print)

Per step (= one generation batch, `settings.prompts_per_step` prompts x `num_generations`):
  1. AQN draws this step's norm noise (sigma from the stage schedule);
  2. rollout: the next prompts (chat template, `qerl.eval.generate.build_prompt`) are sampled by
     `rollout_fn` (default: the engine of `qerl.rollout` (`rollout_engine`), else `qerl.rl.rollout.sample_rollouts`) with the noisy norms applied
     (AQN place "rollout" or "both"); it returns per-token logprobs and entropies;
  3. rewards (weighted sum of the reward functions, plus the optional overlong penalty);
     DAPO dynamic sampling drops zero-variance groups and samples more prompts to refill;
  4. advantages, then `num_iterations` AdamW updates of the LoRA (and optional norm) parameters
     over micro-batches; importance weights correct for the rollout policy differing from the
     training one (AQN noise, another engine); beta > 0 adds the k3 KL to the base model
     (adapters disabled);
  5. the memory plan (qerl/rl/memory_plan.py) decides from this step's measured peak whether the
     next rollout keeps the engine's KV cache and graphs and, with checkpoint_layers "auto", how
     many decoder layers the next training phase runs without activation checkpointing;
  6. metrics -> `log_fn(step, metrics)`; every `save_steps` a checkpoint.

Checkpoints: out_dir/checkpoint-<step>/ holds the adapter in PEFT format
(adapter_model.safetensors + adapter_config.json), trainer_state.pt (optimizer, scheduler, RNG
states; read back with torch.load(weights_only=True)), trainer_state.json (step, metrics
history, settings) and COMPLETE, written last: a checkpoint without it is ignored. It is
written to a temporary directory and renamed, so a crash never leaves half a checkpoint behind.
`train(..., resume=True)` continues from the newest complete checkpoint with the same step
count and metrics history. The final adapter is also saved to out_dir/adapter.

A NaN/Inf reward, loss or gradient raises `TrainingError` before the optimiser touches the
weights (the last checkpoint stays the last good one). A CUDA out-of-memory error is re-raised
as `TrainingOOM` (also a torch.OutOfMemoryError) naming the knobs that reduce memory.

Try it:  python -m qerl.rl.demo --help
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import resource
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from qerl.nn.aqn import AdaptiveQuantNoise, AQNSettings
from qerl.nn.lora import LoraSettings, apply_lora
from qerl.rl.grpo import (
    GRPOSettings,
    autocast_enabled,
    group_advantages,
    grpo_loss,
    importance_weights,
    loss_mask,
    overlong_penalty,
    zero_variance_groups,
)
from qerl.rl.memory_plan import CheckpointPlan, RolloutMemoryPlan, cap_device_memory, layer_bytes_per_token
from qerl.rl.rewards import NUMBER_TASKS
from qerl.rl.rollout import RolloutBatch, RolloutSettings, policy_logprobs, sample_rollouts

CHECKPOINT_PREFIX = "checkpoint-"
COMPLETE = "COMPLETE"
STATE_PT = "trainer_state.pt"
STATE_JSON = "trainer_state.json"

# Every step logs these keys (kl only with beta > 0).
METRIC_KEYS = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "entropy",
    "clip_ratio_low",
    "clip_ratio_high",
    "completion_length",
    "truncated_frac",
    "zero_variance_groups_frac",
    "aqn_sigma",
    "rollout_tokens_per_s",
    "step_time_s",
    "rollout_s",
    "logprob_s",
    "backward_s",
    "optimizer_s",
    "peak_memory_bytes",
    "rollout_memory_released",
    "uncheckpointed_layers",
    "loss",
    "grad_norm",
    "learning_rate",
    "is_weight_mean",
    "groups_trained",
    "sampling_rounds",
)

OOM_HINT = (
    "out of GPU memory during RL training: lower num_generations, max_completion_length, "
    "per_device_train_batch_size (prompts per step), enable gradient_checkpointing, or set "
    "release_rollout_memory: true"
)

__all__ = [
    "METRIC_KEYS",
    "PhaseTimer",
    "TrainResult",
    "TrainingError",
    "TrainingOOM",
    "latest_checkpoint",
    "make_optimizer",
    "optimise",
    "optimise_planned",
    "plan_next_step_memory",
    "prepare_policy",
    "run_rollout",
    "sequence_lengths",
    "train",
]


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite reward/loss/gradient, bad inputs); one readable line."""


class TrainingOOM(TrainingError, torch.OutOfMemoryError):
    """Out of accelerator memory, with a hint naming the knobs."""


@dataclass
class TrainResult:
    steps: int
    history: list[dict]
    out_dir: Path
    adapter_dir: Path | None
    last_checkpoint: Path | None
    wall_time_s: float
    resumed_from: int | None = None
    model: nn.Module | None = field(default=None, repr=False)

    def reward_fifths(self, key: str = "reward_mean") -> tuple[float, float]:
        """Mean of `key` over the first and the last fifth of the steps."""
        vals = [h[key] for h in self.history if key in h]
        if not vals:
            return float("nan"), float("nan")
        k = max(1, len(vals) // 5)
        return sum(vals[:k]) / k, sum(vals[-k:]) / k


# ----------------------------------------------------------------------------- small pieces


class _PromptStream:
    """Problems in a seeded random order, epoch after epoch; its position is checkpointed."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise TrainingError("no training problems")
        self.n, self.seed, self.epoch, self.pos = n, seed, 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append(self._perm[self.pos])
            self.pos += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()


def sequence_lengths(batches: Sequence[RolloutBatch], settings: GRPOSettings) -> tuple[int, int]:
    """(the longest sequence, prompt + completion, in `batches`; the longest the settings allow:
    the widest prompt, or max_prompt_length where set, + max_completion_length)."""
    if not batches:
        return 1, 1
    prompt = max(int(b.prompt_ids.shape[1]) for b in batches)
    trained = max(int(b.prompt_ids.shape[1] + b.completion_ids.shape[1]) for b in batches)
    return trained, max(prompt, settings.max_prompt_length or 0) + settings.max_completion_length


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _prompt_text(tokenizer, problem) -> str:
    """The chat prompt of a problem: qerl.eval.generate.build_prompt (the evaluation prompt), or
    the short-answer prompt of the generated arithmetic task."""
    from qerl.eval.generate import build_prompt

    if problem.benchmark == "arith":
        from qerl.rl.arith import build_arith_prompt

        return build_arith_prompt(tokenizer, problem.question)
    bench = "gsm8k" if problem.benchmark in NUMBER_TASKS else problem.benchmark
    return build_prompt(tokenizer, problem.question, bench)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def _finite_or_raise(value: torch.Tensor | float, what: str, step: int) -> None:
    v = torch.as_tensor(value)
    if not bool(torch.isfinite(v).all()):
        raise TrainingError(
            f"non-finite {what} at step {step}: training stopped; the last checkpoint is the last good one"
        )


class PhaseTimer:
    """Wall time per phase of a step (seconds, summed over its uses). On a GPU the device is
    synchronised at each phase's end, so a phase's time includes its kernels, not just launches."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def prepare_policy(model: nn.Module, settings: GRPOSettings, lora_settings: LoraSettings | None = None) -> nn.Module:
    """The trained policy: `model` with LoRA adapters (`apply_lora`, unless it is a PeftModel
    already), with `settings.fused_training_ops` the fused RMSNorm / MLP forms (used on a GPU only),
    and with `settings.gradient_checkpointing` activation checkpointing per layer."""
    if not _is_peft(model):  # the adapters' start from settings.seed alone, not from the process-wide RNG
        model = apply_lora(model, lora_settings or LoraSettings(), seed=settings.seed)
    if settings.fused_training_ops:
        from qerl.nn.fused_train import fuse_training_ops

        fuse_training_ops(model)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    return model


def shares_prompt_in_training(settings: GRPOSettings) -> bool:
    """Whether the training forwards run each group's prompt once (share_prompt_prefix) and
    expand it to the group's completions: only without gradient checkpointing, whose recomputed
    layers take one sequence per row."""
    return settings.share_prompt_prefix and not settings.gradient_checkpointing


def _decay_parameter_names(model: nn.Module) -> list[str]:
    """The parameters transformers' Trainer decays (Trainer.get_decay_parameter_names: not in a LayerNorm, no
    bias / norm in the name); tests/test_grpo_trl.py holds this to TRL's optimizer groups."""
    from transformers.trainer_pt_utils import get_parameter_names

    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    return get_parameter_names(model, [nn.LayerNorm], forbidden)


def regrouped_optimizer_state(saved: dict, optimizer, model: nn.Module) -> dict:
    """A checkpoint's optimizer state laid out in `optimizer`'s parameter groups. Checkpoints from before session 53
    hold one group (every trainable parameter decayed); with trainable norms or biases the optimizer now has two.
    The saved group's order is model.parameters()' (trainable ones), the state moves with its parameter."""
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != 1 or len(groups) == 1:
        return saved
    new_index = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
    old_order = [p for p in model.parameters() if p.requires_grad]
    remap = {old: new_index[id(p)] for old, p in enumerate(old_order)}
    hyper = {k: v for k, v in saved["param_groups"][0].items() if k not in ("params", "weight_decay")}
    param_groups, start = [], 0
    for g in groups:
        param_groups.append(dict(hyper, weight_decay=g["weight_decay"], params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    return {"state": {remap[int(k)]: v for k, v in saved["state"].items()}, "param_groups": param_groups}


def make_optimizer(model: nn.Module, settings: GRPOSettings):
    """AdamW over the trainable (LoRA / norm) parameters and its LR schedule over all updates."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise TrainingError("the model has no trainable parameters (expected LoRA adapters)")
    # weight decay as the HF Trainer under TRL applies it: not to norm weights (trainable with train_norms) or biases
    decay = set(_decay_parameter_names(model))
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": settings.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=settings.learning_rate, betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_epsilon,
    )
    total_updates = settings.max_steps * settings.num_iterations
    # transformers' own schedules, as the HF Trainer under TRL builds them (tests/test_grpo_trl.py compares)
    from transformers import get_scheduler

    scheduler = get_scheduler(settings.lr_scheduler_type, optimizer,
                              num_warmup_steps=settings.warmup_updates(total_updates), num_training_steps=total_updates)
    return optimizer, scheduler


def run_rollout(model, rollout_fn, prompt_ids, rollout_settings: RolloutSettings, generator, aqn: AdaptiveQuantNoise,
                noisy: bool) -> RolloutBatch:
    """One rollout call in eval + inference mode, with AQN's noisy norms applied when `noisy`."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), aqn.applied(noisy):
            return rollout_fn(model, prompt_ids, rollout_settings, generator)
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------- checkpoints


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint-<step> directory in out_dir, or None."""
    out = Path(out_dir)
    best, best_step = None, -1
    if not out.is_dir():
        return None
    for d in out.iterdir():
        if d.is_dir() and d.name.startswith(CHECKPOINT_PREFIX) and (d / COMPLETE).exists():
            try:
                s = int(d.name[len(CHECKPOINT_PREFIX):])
            except ValueError:
                continue
            if s > best_step:
                best, best_step = d, s
    return best


def _save_checkpoint(out_dir: Path, step: int, model, optimizer, scheduler, rng: dict, extra: dict, limit) -> Path:
    final = out_dir / f"{CHECKPOINT_PREFIX}{step}"
    tmp = out_dir / f".tmp-{CHECKPOINT_PREFIX}{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))  # adapter_model.safetensors + adapter_config.json
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng}, tmp / STATE_PT)
    (tmp / STATE_JSON).write_text(json.dumps(extra, indent=1, default=str))
    (tmp / COMPLETE).write_text(str(step))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if limit:
        done = sorted(
            (int(d.name[len(CHECKPOINT_PREFIX):]), d)
            for d in out_dir.iterdir()
            if d.is_dir() and d.name.startswith(CHECKPOINT_PREFIX) and (d / COMPLETE).exists()
        )
        for _, d in done[:-limit]:
            shutil.rmtree(d, ignore_errors=True)
    return final


def _load_adapter_weights(model, ckpt: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(ckpt / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise TrainingError(f"{ckpt}: adapter tensors do not match the model (e.g. {unexpected[:2]})")


# ----------------------------------------------------------------------------- rewards


def _score(
    reward_fns: Sequence[Callable], weights: Sequence[float], texts: list[str], problems, batch: RolloutBatch,
    prompts: list[str], step: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """-> (total reward [N], accuracy [N], per-function means)."""
    rows = batch.num_rows
    kwargs = dict(
        prompts=prompts,
        answer=[p.answer for p in problems],
        benchmark=[p.benchmark for p in problems],
        problem_id=[p.id for p in problems],
        question=[p.question for p in problems],
        truncated=(~batch.finished).tolist(),
        completion_length=batch.lengths.tolist(),
        step=step,
    )
    total = torch.zeros(rows, dtype=torch.float64)
    acc = None
    means = {}
    for fn, w in zip(reward_fns, weights):
        vals = fn(texts, **kwargs)
        if vals is None or len(vals) != rows:
            raise TrainingError(f"reward function {getattr(fn, '__name__', fn)} returned {0 if vals is None else len(vals)} values for {rows} completions")
        t = torch.tensor([float("nan") if v is None else float(v) for v in vals], dtype=torch.float64)
        name = getattr(fn, "__name__", "reward")
        _finite_or_raise(t, f"reward from {name}", step)
        total += w * t
        means[f"reward/{name}"] = float(t.mean())
        if acc is None and getattr(fn, "is_accuracy", False):
            acc = t
    if acc is None:
        acc = torch.tensor([float(v) for v in reward_fns[0](texts, **kwargs)], dtype=torch.float64)
    return total, acc, means


# ----------------------------------------------------------------------------- train


def train(
    model: nn.Module,
    tokenizer,
    settings: GRPOSettings,
    aqn_settings: AQNSettings | None,
    train_problems: Sequence,
    reward_fns: Sequence[Callable],
    out_dir: str | Path,
    log_fn: Callable[[int, dict], None] | None = None,
    resume: bool = True,
    *,
    lora_settings: LoraSettings | None = None,
    rollout_fn: Callable[..., RolloutBatch] | None = None,
) -> TrainResult:
    """Train LoRA adapters with GRPO/DAPO; see the module docstring. `model` is a PeftModel, or a
    plain causal LM that gets `apply_lora(model, lora_settings)`."""
    from qerl.eval.generate import stop_token_ids

    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not reward_fns:
        raise TrainingError("at least one reward function is needed")
    weights = list(settings.reward_weights) if settings.reward_weights is not None else [1.0] * len(reward_fns)
    if len(weights) != len(reward_fns):
        raise TrainingError(f"{len(weights)} reward_weights for {len(reward_fns)} reward functions")
    problems = list(train_problems)
    aqn_settings = aqn_settings or AQNSettings(enabled=False)
    if rollout_fn is None:
        from qerl.rollout.engine import engine_rollouts, supports

        rollout_fn = engine_rollouts if settings.rollout_engine == "qerl" and supports(model) else sample_rollouts

    torch.manual_seed(settings.seed)
    random.seed(settings.seed)
    model = prepare_policy(model, settings, lora_settings)
    device = _device(model)
    cap_device_memory(device, settings.device_memory_gib)  # before the optimiser state and the engine's buffers
    share_train = shares_prompt_in_training(settings)
    optimizer, scheduler = make_optimizer(model, settings)
    stream = _PromptStream(len(problems), settings.seed)
    gen = torch.Generator(device="cpu" if device.type != "cuda" else device)
    gen.manual_seed(settings.seed)
    aqn = AdaptiveQuantNoise(model, aqn_settings, total_steps=settings.max_steps)

    for stale in out.glob(f".tmp-{CHECKPOINT_PREFIX}*"):  # half-written by a killed run
        shutil.rmtree(stale, ignore_errors=True)
    history: list[dict] = []
    start_step = 0
    resumed_from = None
    last_ckpt = None
    if resume:
        ckpt = latest_checkpoint(out)
        if ckpt is not None:
            _load_adapter_weights(model, ckpt)
            state = torch.load(ckpt / STATE_PT, map_location=device, weights_only=True)
            optimizer.load_state_dict(regrouped_optimizer_state(state["optimizer"], optimizer, model))
            scheduler.load_state_dict(state["scheduler"])
            rng = state["rng"]
            torch.set_rng_state(rng["torch"].cpu())
            random.setstate(_to_tuple(rng["python"]))
            gen.set_state(rng["rollout"].cpu())
            if device.type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"].cpu(), device)
            meta = json.loads((ckpt / STATE_JSON).read_text())
            stream.load(meta["stream"])
            history = list(meta["history"])
            start_step = int(meta["step"])
            resumed_from = start_step
            last_ckpt = ckpt
            if start_step > settings.max_steps:
                raise TrainingError(f"{ckpt} is at step {start_step}, beyond max_steps={settings.max_steps}")

    stops = stop_token_ids(tokenizer)
    if not stops:
        raise TrainingError("the tokenizer has no stop token (eos / <|im_end|>)")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    rollout_settings = RolloutSettings(
        num_generations=settings.num_generations, max_new_tokens=settings.max_completion_length,
        temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
        stop_ids=stops, pad_id=pad_id, share_prompt=settings.share_prompt_prefix,
    )
    noise_in_training = aqn_settings.enabled and aqn_settings.place == "both"
    G = settings.num_generations
    P = settings.prompts_per_step

    def rng_state() -> dict:
        st = {"torch": torch.get_rng_state(), "python": random.getstate(), "rollout": gen.get_state().cpu()}
        if device.type == "cuda":
            st["cuda"] = torch.cuda.get_rng_state(device)
        return st

    def checkpoint(step: int) -> Path:
        extra = {
            "step": step, "history": history, "stream": stream.state(),
            "settings": settings.model_dump(), "aqn": aqn_settings.model_dump(),
        }
        return _save_checkpoint(out, step, model, optimizer, scheduler, rng_state(), extra, settings.save_total_limit)

    def tokenize(texts: list[str]) -> list[list[int]]:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        if settings.max_prompt_length:
            ids = [x[-settings.max_prompt_length:] for x in ids]
        return ids

    memory_plan = RolloutMemoryPlan(settings.release_rollout_memory, device)
    checkpoint_plan = CheckpointPlan(settings.checkpoint_layers, device)
    for step in range(start_step, settings.max_steps):
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timer = PhaseTimer(device)
        try:
            sigma = aqn.resample(step)
            # ---- rollout (+ DAPO refill) ------------------------------------------------
            kept: list[tuple[RolloutBatch, list, torch.Tensor, torch.Tensor]] = []  # (batch, problems, rewards, adv)
            all_rewards, all_acc, all_ent, all_len, all_trunc = [], [], [], [], []
            zero_groups = total_groups = 0
            gen_tokens, gen_time = 0, 0.0
            fn_means: dict[str, list[float]] = {}
            rounds = 0
            need = P
            while True:
                idx = stream.take(need)
                probs = [problems[i] for i in idx]
                prompts = [_prompt_text(tokenizer, p) for p in probs]
                with timer("rollout_s"):
                    batch = run_rollout(model, rollout_fn, tokenize(prompts), rollout_settings, gen, aqn, aqn_settings.enabled)
                gen_time += batch.elapsed_s
                gen_tokens += int(batch.completion_mask.sum())
                rows_p = [probs[int(i)] for i in batch.prompt_index]
                rows_prompt = [prompts[int(i)] for i in batch.prompt_index]
                texts = _decode(tokenizer, batch, set(stops))
                rewards, acc, means = _score(reward_fns, weights, texts, rows_p, batch, rows_prompt, step + 1)
                if settings.overlong_buffer_length:
                    rewards = rewards + overlong_penalty(
                        batch.lengths, settings.max_completion_length, settings.overlong_buffer_length,
                        settings.overlong_penalty_factor,
                    ).double()
                _finite_or_raise(rewards, "reward", step + 1)
                if settings.log_completions:
                    with open(out / "completions.jsonl", "a") as f:
                        for p_, t_, r_, fin_ in zip(rows_p, texts, rewards.tolist(), batch.finished.tolist()):
                            f.write(json.dumps({"step": step + 1, "id": p_.id, "answer": p_.answer, "reward": r_,
                                                "finished": fin_, "completion": t_}) + "\n")
                for k, v in means.items():
                    fn_means.setdefault(k, []).append(v)
                all_rewards.append(rewards)
                all_acc.append(acc)
                all_ent.append(batch.entropies.sum() / batch.completion_mask.sum().clamp(min=1))
                all_len.append(batch.lengths.float())
                all_trunc.append((~batch.finished).float())
                zv = zero_variance_groups(rewards, G)
                zero_groups += int(zv.sum())
                total_groups += int(zv.numel())
                rounds += 1
                if settings.dynamic_sampling:
                    good = (~zv).nonzero().flatten().tolist()
                    if good:
                        rows = torch.cat([torch.arange(g * G, (g + 1) * G) for g in good])
                        sub = batch.select(rows)
                        kept.append((sub, [rows_p[int(r)] for r in rows], rewards[rows], None))
                    have = sum(k[0].num_rows for k in kept) // G
                    if have >= P or rounds > settings.max_dynamic_sampling_rounds:
                        break
                    need = P - have
                else:
                    kept.append((batch, rows_p, rewards, None))
                    break

            memory_plan.after_rollout(model)
            # ---- training batch ---------------------------------------------------------
            groups_trained = sum(k[0].num_rows for k in kept) // G
            if settings.dynamic_sampling and groups_trained > P:  # keep exactly P groups
                trimmed, left = [], P
                for b, rp, r, _ in kept:
                    g_here = b.num_rows // G
                    take = min(g_here, left)
                    if take:
                        rows = torch.arange(take * G)
                        trimmed.append((b.select(rows), rp[: take * G], r[: take * G], None))
                    left -= take
                kept, groups_trained = trimmed, P
            parts = []
            for b, rp, r, _ in kept:
                adv = group_advantages(r, G, settings.reward_scaling)
                parts.append((b, r, adv))
            if settings.reward_scaling == "batch" and parts:  # batch std over the whole trained batch
                r_all = torch.cat([r for _, r, _ in parts])
                std = r_all.float().std() if r_all.numel() > 1 else torch.tensor(0.0)
                parts = [
                    (b, r, group_advantages(r, G, "none") / (std + 1e-4)) for b, r, _ in parts
                ]
            stats = optimise_planned(model, parts, settings, optimizer, scheduler, aqn, noise_in_training,
                                     share_train, step + 1, timer, memory_plan, checkpoint_plan)
            uncheckpointed = checkpoint_plan.applied
            plan_next_step_memory(model, settings, [p[0] for p in parts], memory_plan, checkpoint_plan)

            # ---- metrics ----------------------------------------------------------------
            r_all = torch.cat(all_rewards)
            lengths = torch.cat(all_len)
            metrics = {
                "reward_mean": float(r_all.mean()),
                "reward_std": float(r_all.std()) if r_all.numel() > 1 else 0.0,
                "accuracy": float(torch.cat(all_acc).mean()),
                "entropy": float(torch.stack(all_ent).mean()),
                "completion_length": float(lengths.mean()),
                "truncated_frac": float(torch.cat(all_trunc).mean()),
                "zero_variance_groups_frac": zero_groups / max(1, total_groups),
                "aqn_sigma": float(sigma),
                "rollout_tokens_per_s": gen_tokens / max(gen_time, 1e-9),
                "groups_trained": groups_trained,
                "sampling_rounds": rounds,
                **{k: sum(v) / len(v) for k, v in fn_means.items()},
                **stats,
            }
            metrics["step_time_s"] = time.perf_counter() - t0
            for phase in ("rollout_s", "logprob_s", "backward_s", "optimizer_s"):
                metrics[phase] = timer.seconds.get(phase, 0.0)
            metrics["peak_memory_bytes"] = _peak_memory(device)
            metrics["rollout_memory_released"] = float(memory_plan.released)
            metrics["uncheckpointed_layers"] = float(uncheckpointed)
            metrics["bf16_autocast"] = float(autocast_enabled(settings.bf16_autocast, device))  # as resolved
        except torch.OutOfMemoryError as e:
            if isinstance(e, TrainingOOM):
                raise
            cap = settings.device_memory_gib
            raise TrainingOOM(OOM_HINT + (f"; the GPU is capped at {cap:g} GiB (device_memory_gib): raise or remove it"
                                          if cap and device.type == "cuda" else "")) from e
        metrics["step"] = step + 1
        history.append(metrics)
        if log_fn is not None:
            log_fn(step + 1, dict(metrics))
        if (step + 1) % settings.save_steps == 0 or step + 1 == settings.max_steps:
            last_ckpt = checkpoint(step + 1)

    adapter_dir = out / "adapter"
    model.save_pretrained(str(adapter_dir))
    (out / "metrics.json").write_text(json.dumps(history, indent=1))
    return TrainResult(
        steps=len(history), history=history, out_dir=out, adapter_dir=adapter_dir, last_checkpoint=last_ckpt,
        wall_time_s=time.perf_counter() - t_start, resumed_from=resumed_from, model=model,
    )


def _to_tuple(x):
    """random.setstate wants tuples; a JSON/weights-only round trip may hand back lists."""
    if isinstance(x, list):
        return tuple(_to_tuple(v) for v in x)
    if isinstance(x, tuple):
        return tuple(_to_tuple(v) for v in x)
    return x


def _decode(tokenizer, batch: RolloutBatch, stops: set[int]) -> list[str]:
    texts = []
    for ids, n in zip(batch.completion_ids.tolist(), batch.lengths.tolist()):
        ids = ids[: int(n)]
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def optimise_planned(model, parts, settings: GRPOSettings, optimizer, scheduler, aqn: AdaptiveQuantNoise,
                     noise_in_training: bool, share_train: bool, step: int, timer: PhaseTimer,
                     memory_plan: RolloutMemoryPlan, checkpoint_plan: CheckpointPlan | None = None) -> dict[str, float]:
    """`optimise`, with the decoder layers checkpointed as `checkpoint_plan` says (gradient
    checkpointing on). When it runs out of memory before any optimiser step, the plans give memory
    back for the rest of the run and the update runs again from the same weights: first layers that
    ran without checkpointing are checkpointed again, else the rollout engine's kept KV cache and
    graphs are freed. Any other out-of-memory error propagates."""
    if checkpoint_plan is not None and settings.gradient_checkpointing:
        checkpoint_plan.apply(model)
    update = functools.partial(optimise, model, parts, settings, optimizer, scheduler, aqn, noise_in_training,
                               share_train, step, timer)
    first_update = scheduler.last_epoch
    try:
        return update()
    except torch.OutOfMemoryError:
        # the adapters are unchanged until the scheduler has stepped: the update can start over
        if scheduler.last_epoch != first_update:
            raise
        if checkpoint_plan is not None and checkpoint_plan.recompute_all_after_oom(model):
            what = ("with decoder layers kept from checkpointing (checkpoint_layers: auto); every layer is "
                    "checkpointed from now on")
        elif memory_plan.free_after_oom(model):
            what = ("with the rollout engine's KV cache and CUDA graphs kept (release_rollout_memory: auto); they "
                    "are freed after every rollout from now on")
        else:
            raise
    warnings.warn(f"step {step}: training ran out of memory {what}, and this step trains again", RuntimeWarning,
                  stacklevel=2)
    if _device(model).type == "cuda":
        torch.cuda.empty_cache()  # what the failed attempt's activations held
    return update()


def plan_next_step_memory(model, settings: GRPOSettings, batches: Sequence[RolloutBatch],
                          memory_plan: RolloutMemoryPlan, checkpoint_plan: CheckpointPlan) -> None:
    """After a training phase (train() and the GRPO bench): the rollout memory plan decides whether
    the next step keeps the engine's KV cache and graphs, then the checkpoint plan how many layers
    it runs without checkpointing in the memory left (qerl/rl/memory_plan.py)."""
    trained, longest = sequence_lengths(batches, settings)
    rows = settings.per_device_train_batch_size
    memory_plan.after_training(trained, longest, checkpoint_plan.applied_bytes(rows, trained))
    if settings.gradient_checkpointing:
        probe = functools.partial(layer_bytes_per_token, model, functools.partial(_probe_context, model, settings))
        checkpoint_plan.after_training(model, memory_plan, rows, longest, probe)


@contextlib.contextmanager
def training_context(model, settings: GRPOSettings):
    """What a training phase runs inside (optimise): the adapters' input casting off under bf16
    autocast (PEFT's disable_input_dtype_casting), the fused training ops as the settings say, the
    fused RoPE patched in. Yields whether autocast is on."""
    from peft.helpers import disable_input_dtype_casting

    from qerl.nn.fused_train import rope_patched, switched

    cast = autocast_enabled(settings.bf16_autocast, _device(model))
    with disable_input_dtype_casting(model, active=cast), switched(settings.fused_training_ops), rope_patched():
        yield cast


@contextlib.contextmanager
def _probe_context(model, settings: GRPOSettings):
    with training_context(model, settings) as cast:
        with torch.autocast(device_type=_device(model).type, dtype=torch.bfloat16, enabled=cast):
            yield


def optimise(
    model, parts, settings: GRPOSettings, optimizer, scheduler, aqn: AdaptiveQuantNoise,
    noise_in_training: bool, share_train: bool, step: int, timer: PhaseTimer | None = None,
) -> dict[str, float]:
    """num_iterations AdamW updates over the kept groups `parts` = [(RolloutBatch, rewards,
    advantages)]; returns loss statistics. `timer` gets the phases logprob_s (training-policy
    forwards), backward_s and optimizer_s (clip + step).

    With bf16_autocast the LoRA layers keep their input as it comes (PEFT's
    disable_input_dtype_casting) for the whole update, forwards and backward: otherwise each
    adapter copies its bf16 input to fp32 (the masters' dtype) for autocast to copy it back, and a
    checkpointed layer's recomputation in the backward must see the same dtypes as its forward."""
    with training_context(model, settings) as cast:
        return _optimise_steps(model, parts, settings, optimizer, scheduler, aqn, noise_in_training, share_train,
                               step, timer, cast)


def advance_schedule(scheduler) -> None:
    """Step the learning-rate schedule for a step that trained nothing (every advantage 0, or no
    completion token): the schedule follows steps, trained or not. Torch warns when a schedule's first
    step comes before any optimizer step; here that is intended, so that one warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before",
                                category=UserWarning)
        scheduler.step()


def _optimise_steps(
    model, parts, settings: GRPOSettings, optimizer, scheduler, aqn: AdaptiveQuantNoise,
    noise_in_training: bool, share_train: bool, step: int, timer: PhaseTimer | None, cast: bool,
) -> dict[str, float]:
    timer = timer or PhaseTimer(torch.device("cpu"))
    mb = settings.per_device_train_batch_size
    # Micro-batches: (batch, rows, advantages[rows], loss mask[rows]). The normalisers count every
    # row; with beta = 0 a row whose advantage is exactly 0 (e.g. a zero-variance group) has a
    # zero loss and gradient, so it is left out of the forward/backward (exact, and cheaper).
    micro = []
    num_seqs, num_tokens = 0, 0.0
    for b, _, adv in parts:
        mask = loss_mask(b.completion_mask, b.finished, settings.mask_truncated_completions)
        num_seqs += b.num_rows
        num_tokens += float(mask.sum())
        live = torch.arange(b.num_rows)
        if settings.beta == 0.0:
            live = live[(adv != 0) & (mask.sum(-1) > 0)]
        for s in range(0, len(live), mb):
            rows = live[s : s + mb]
            micro.append((b, rows, adv[rows].float(), mask[rows]))
    device = _device(model)
    temp = settings.temperature
    stats = {"loss": 0.0, "grad_norm": 0.0, "learning_rate": scheduler.get_last_lr()[0], "clip_ratio_low": 0.0,
             "clip_ratio_high": 0.0, "is_weight_mean": 1.0}
    if settings.beta > 0:
        stats["kl"] = 0.0
    if not micro or num_tokens == 0:
        advance_schedule(scheduler)
        return stats

    model.train()
    need_old = settings.num_iterations > 1
    chunk = settings.logprob_chunk_tokens
    # policy_logprobs under bf16 autocast when on (GRPOSettings.bf16_autocast, autocast_enabled);
    # the backward follows the dtypes autocast recorded, and checkpointed layers recompute under
    # the same state
    autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16, enabled=cast)
    old, ref = [], []
    if need_old or settings.beta > 0:
        with torch.no_grad(), timer("logprob_s"):
            for b, rows, _, _ in micro:
                if need_old:
                    with aqn.applied(noise_in_training), autocast():
                        old.append(policy_logprobs(model, b, rows, temp, share_train, chunk).float())
                if settings.beta > 0:
                    with model.disable_adapter(), autocast():
                        ref.append(policy_logprobs(model, b, rows, temp, share_train, chunk).float())

    tot = {"tokens": 0.0, "clip_low_tokens": 0.0, "clip_high_tokens": 0.0, "kl_sum": 0.0, "is_weight_sum": 0.0}
    loss_sum, gnorm = 0.0, 0.0
    for _ in range(settings.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for i, (b, rows, adv, mask) in enumerate(micro):
            mask = mask.to(device)
            with aqn.applied(noise_in_training), timer("logprob_s"), autocast():
                logp = policy_logprobs(model, b, rows, temp, share_train, chunk)
            logp_old = old[i].to(device) if need_old else logp.detach()
            isw = None
            if settings.vllm_importance_sampling_correction:
                isw = importance_weights(
                    logp_old, b.logprobs[rows].to(device), mask, settings.vllm_importance_sampling_mode,
                    settings.vllm_importance_sampling_clip_max, settings.vllm_importance_sampling_clip_min,
                )
            loss, st = grpo_loss(
                logp, logp_old, adv.to(device), mask, loss_type=settings.loss_type, epsilon=settings.epsilon,
                epsilon_high=settings.eps_high, beta=settings.beta, ref_logp=ref[i].to(device) if ref else None,
                use_bias_correction_kl=settings.use_bias_correction_kl, is_weights=isw, max_completion_length=settings.max_completion_length,
                num_sequences=num_seqs, num_tokens=num_tokens,
            )
            _finite_or_raise(loss.detach(), "loss", step)
            # checkpointed layers recompute their forward in here: under the same AQN noise as the
            # forward (place "both"), or the recomputed activations differ from the forward's
            with timer("backward_s"), aqn.applied(noise_in_training):
                loss.backward()
            loss_sum += float(loss.detach())
            for k in tot:
                tot[k] += st.get(k, 0.0)
        with timer("optimizer_s"):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            gn = torch.nn.utils.clip_grad_norm_(params, settings.max_grad_norm)
            _finite_or_raise(gn, "gradient norm", step)
            gnorm += float(gn)
            optimizer.step()
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    it = settings.num_iterations
    toks = max(tot["tokens"], 1.0)
    stats.update(
        loss=loss_sum / it,
        grad_norm=gnorm / it,
        clip_ratio_low=tot["clip_low_tokens"] / toks,
        clip_ratio_high=tot["clip_high_tokens"] / toks,
        is_weight_mean=(tot["is_weight_sum"] / toks) if settings.vllm_importance_sampling_correction else 1.0,
    )
    if settings.beta > 0:
        stats["kl"] = tot["kl_sum"] / toks
    return stats
