"""GRPO / DAPO: settings (TRL GRPOConfig field names) and the loss pieces as pure functions.

The trainer (qerl.rl.trainer) strings these together; each piece is tested against
hand-computed values (tests/test_grpo.py). Semantics follow TRL 1.16's GRPOTrainer:

- advantages: A_i = (r_i - mean_group) / (std_group + 1e-4) with `scale_rewards="group"`;
  "batch" divides by the batch std; "none" does not scale (the Dr. GRPO choice, and the default
  for loss_type "dr_grpo"). std is the unbiased sample std, as in TRL.
- per-token ratio rho = exp(logp_new - logp_old); surrogate
  -min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A) (clip-higher: epsilon_high, DAPO 0.28).
- loss_type "grpo": per-sequence mean over its tokens, then mean over sequences;
  "dapo": sum over all tokens / number of active tokens in the whole (accumulated) batch;
  "dr_grpo": sum over all tokens / (sequences * max_completion_length).
  Normalisers are global over the step's batch, so micro-batching does not change the gradient.
- beta > 0 adds beta * k3 KL to the reference policy per token:
  exp(ref - new) - (ref - new) - 1, times rho with `use_bias_correction_kl` (TRL 1.16's default:
  the KL gradient is then the unbiased reverse-KL one, DeepSeek-V3.2; rho keeps its gradient).
- importance sampling (rollout policy != training policy, e.g. AQN noise in the rollout or
  another engine): per-token weight w = exp(logp_train_old - logp_rollout), "token_truncate":
  min(w, C) (TRL's vllm_importance_sampling_* options, also "token_mask",
  "sequence_truncate", "sequence_mask"); the per-token loss is multiplied by w (no gradient).
- DAPO dynamic sampling: groups whose rewards are all equal carry no signal (A = 0) and are
  dropped; the trainer refills from further prompts. Overlong filtering: with
  `mask_truncated_completions` a completion that hit max_completion_length without a stop token
  gets a zero loss mask. Optional DAPO soft overlong punishment (`overlong_buffer_length`).

Try it:  pytest tests/test_grpo.py -q
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ADV_EPS = 1e-4

__all__ = [
    "ADV_EPS",
    "GRPOSettings",
    "IS_MODES",
    "LOSS_TYPES",
    "aggregate_loss",
    "clipped_surrogate",
    "group_advantages",
    "grpo_loss",
    "importance_weights",
    "k3_kl",
    "loss_mask",
    "overlong_penalty",
    "zero_variance_groups",
]


class GRPOSettings(BaseModel):
    """RL training settings. Field names follow TRL's GRPOConfig / TrainingArguments.

    One training step = one generation batch of `per_device_train_batch_size *
    gradient_accumulation_steps` completions (= prompts_per_step * num_generations), processed
    in micro-batches of per_device_train_batch_size, then `num_iterations` optimiser updates."""

    model_config = ConfigDict(extra="forbid")

    # optimisation
    learning_rate: float = Field(1e-5, gt=0)
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "cosine", "linear"] = "constant"
    # transformers 5 / TRL 1.16: warmup_steps is an int (steps) or a float in [0, 1) (a fraction of the updates);
    # warmup_ratio is the older transformers name for the fraction, kept for recipes that use it (not both)
    warmup_steps: float = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_steps: int = Field(100, ge=1)
    seed: int = 0
    # batch
    num_generations: int = Field(8, ge=2)
    per_device_train_batch_size: int = Field(8, ge=1)  # completions per micro-batch
    gradient_accumulation_steps: int = Field(1, ge=1)
    num_iterations: int = Field(1, ge=1)  # optimiser updates per generation batch (mu)
    # generation
    max_prompt_length: int | None = Field(None, ge=1)  # longer prompts are cut from the left
    max_completion_length: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    # loss
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    beta: float = Field(0.0, ge=0.0)
    use_bias_correction_kl: bool = True  # the KL term times rho, as TRL 1.16 (only with beta > 0)
    epsilon: float = Field(0.2, gt=0.0, lt=1.0)
    epsilon_high: float | None = Field(None, gt=0.0)  # None: = epsilon (DAPO: 0.28)
    scale_rewards: Literal["group", "batch", "none"] | None = None  # None: "none" for dr_grpo, else "group"
    reward_weights: list[float] | None = None
    mask_truncated_completions: bool = False
    # DAPO
    dynamic_sampling: bool = False  # drop groups with equal rewards, refill from further prompts
    max_dynamic_sampling_rounds: int = Field(3, ge=0)  # extra generation rounds per step to refill
    overlong_buffer_length: int = Field(0, ge=0)  # DAPO soft overlong punishment (0: off)
    overlong_penalty_factor: float = Field(1.0, ge=0.0)
    # rollout vs training policy
    vllm_importance_sampling_correction: bool = True  # applies to any rollout engine
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        "token_truncate"
    )
    vllm_importance_sampling_clip_max: float | None = Field(2.0, gt=0.0)
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0.0)
    # memory / speed
    share_prompt_prefix: bool = True  # one prompt pass per group in rollout and training
    # "qerl": qerl.rollout's engine (static KV cache, CUDA graphs, fused 4-bit decode) for the
    # model types it supports, else the Hugging Face KV-cache loop; "hf": always that loop
    rollout_engine: Literal["qerl", "hf"] = "qerl"
    gradient_checkpointing: bool = False
    # with gradient_checkpointing, which decoder layers recompute their forward in the backward:
    # "all" (the smallest peak); "auto": the last layers that fit in the memory a measured step leaves
    # free (under 90% of the GPU, beside the rollout plan's KV cache) keep their activations instead,
    # so the backward skips their recomputation (qerl/rl/memory_plan.py CheckpointPlan; a GPU only:
    # elsewhere "auto" checkpoints every layer). Default since session 35: GRPO steps on an H100 gained
    # in both formats at 7B / 14B batch 2, 4, 8 (benchmarks/RESULTS.md)
    checkpoint_layers: Literal["all", "auto"] = "auto"
    # the lm_head + log-softmax of the training forward run this many tokens at a time, each chunk
    # recomputed in the backward pass, so [tokens x vocab] logits never exist whole (0: all at once)
    logprob_chunk_tokens: int = Field(1024, ge=0)
    # free the rollout engine's KV cache and CUDA graphs after each rollout phase, so the training
    # phase gets that memory (they are re-made at the next rollout: costs the graph captures).
    # "auto": free after the first rollout, then keep them while the measured training peak leaves
    # room for them (qerl/rl/memory_plan.py); true: always free; false: never
    release_rollout_memory: bool | Literal["auto"] = "auto"
    # treat the GPU as one of this many GiB: PyTorch's allocator raises out-of-memory beyond it and the memory
    # plans above size against it (qerl/rl/memory_plan.py cap_device_memory), so a larger card reproduces a
    # smaller one's run, e.g. 79 for the paper's one 80 GB GPU on a 141 GB H200. None: the whole card
    device_memory_gib: float | None = Field(None, gt=0)
    # run the training forwards (and so their backward) under torch.autocast(bfloat16), as TRL /
    # accelerate do with bf16=True: the LoRA matmuls and adds run in bf16 over the fp32 adapter
    # weights, which stay the optimiser's master copy, and the adapters take their bf16 input
    # without an fp32 copy (trainer.optimise). Off: the adapters compute in fp32 (a 7B profile put
    # that fp32 path at ~45% of the training phase, benchmarks/NOTES_grpo.md). "auto": on for a
    # model on a CUDA device, off elsewhere (a CPU runs bf16 matmuls ~50x slower than fp32);
    # chosen from the GPU learning runs in qerl/rl/DESIGN_NOTES.md (autocast_enabled)
    bf16_autocast: bool | Literal["auto"] = "auto"
    # fused Triton kernels in the training forwards and backwards on a GPU (qerl.nn.fused_train):
    # RMSNorm, the SiLU-gated MLP, the LoRA update's expand + add and the token log-probs, each one
    # pass instead of an elementwise chain (x1.12-1.13 on the training phase at 7B / 14B,
    # benchmarks/NOTES_grpo.md section 18); outputs round where the modules round. A CPU always
    # runs the modules' own code
    fused_training_ops: bool = True
    # logging
    log_completions: bool = False  # append every sampled completion to out_dir/completions.jsonl
    # checkpoints
    save_steps: int = Field(50, ge=1)
    save_total_limit: int | None = Field(2, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "GRPOSettings":
        gen = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if gen % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size * gradient_accumulation_steps ({gen}) must be a multiple of "
                f"num_generations ({self.num_generations}): each prompt's group must be complete"
            )
        if self.overlong_buffer_length >= self.max_completion_length:
            raise ValueError("overlong_buffer_length must be smaller than max_completion_length")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both (warmup_steps < 1 is a ratio)")
        if self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps):
            raise ValueError(f"warmup_steps must be a whole number of steps or a ratio below 1, got {self.warmup_steps}")
        return self

    def warmup_updates(self, total: int) -> int:
        """Warm-up length in optimiser updates, as transformers' TrainingArguments.get_warmup_steps computes it."""
        frac = self.warmup_ratio or (self.warmup_steps if self.warmup_steps < 1 else 0.0)
        return math.ceil(total * frac) if frac else int(self.warmup_steps)

    @property
    def generation_batch_size(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def reward_scaling(self) -> str:
        if self.scale_rewards is not None:
            return self.scale_rewards
        return "none" if self.loss_type == "dr_grpo" else "group"


# ----------------------------------------------------------------------------- rewards -> advantages


def _groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {num_generations}")
    return rewards.view(-1, num_generations)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = ADV_EPS
) -> torch.Tensor:
    """(r - group mean) / (std + eps); std per group ("group"), over the batch ("batch") or 1 ("none")."""
    r = rewards.float()
    g = _groups(r, num_generations)
    centred = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    if scale_rewards == "group":
        std = g.std(dim=1, keepdim=True).expand_as(g).reshape(-1)
    elif scale_rewards == "batch":
        std = r.std().expand_as(r) if r.numel() > 1 else torch.zeros_like(r)
    elif scale_rewards == "none":
        return centred
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return centred / (std + eps)


def zero_variance_groups(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Bool [num_groups]: True where every reward of the group is equal (no learning signal)."""
    g = _groups(rewards.float(), num_generations)
    return (g.max(dim=1).values - g.min(dim=1).values) == 0


def overlong_penalty(lengths: torch.Tensor, max_completion_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to L_max - buffer, then linearly down to -factor at L_max."""
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_completion_length - buffer
    return -((lengths - start).clamp(min=0) / buffer).clamp(max=1.0) * factor


def loss_mask(completion_mask: torch.Tensor, finished: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The loss mask: generated tokens, minus whole truncated completions when mask_truncated."""
    mask = completion_mask.float()
    if mask_truncated:
        mask = mask * finished.float().unsqueeze(-1)
    return mask


# ----------------------------------------------------------------------------- per-token pieces


def importance_weights(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_truncate",
    clip_max: float | None = 2.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """Rollout -> training policy correction weights (no gradient), shape [N, T] or [N, 1]."""
    diff = ((logp_train.detach() - logp_rollout) * mask).nan_to_num(0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    w = torch.exp(diff.clamp(max=50.0))
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return w.clamp(min=lo, max=hi) if (clip_min is not None or clip_max is not None) else w
    if mode.endswith("mask"):
        return w.masked_fill((w < lo) | (w > hi), 0.0)
    raise ValueError(f"importance sampling mode must be one of {IS_MODES}, got {mode!r}")


def clipped_surrogate(
    logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) per token, and rho."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - logp_old)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -torch.min(ratio * adv, clipped * adv), ratio


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce [N, T] token losses. num_sequences / num_tokens: totals over the whole step's batch
    when this is one micro-batch of it (default: this batch's own)."""
    mask = mask.float()
    n = per_token_loss.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":
        per_seq = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(n, 1)
    if loss_type == "dapo":
        tokens = mask.sum() if num_tokens is None else torch.as_tensor(float(num_tokens))
        return (per_token_loss * mask).sum() / tokens.clamp(min=1.0)
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("dr_grpo needs max_completion_length")
        return (per_token_loss * mask).sum() / (max(n, 1) * max_completion_length)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    use_bias_correction_kl: bool = True,
    is_weights: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of one (micro-)batch and its statistics (sums, for exact averaging)."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    per_token, ratio = clipped_surrogate(logp, logp_old, advantages, epsilon, eps_high)
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = None
    if beta > 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs the reference logprobs")
        kl = k3_kl(logp, ref_logp)
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    loss = aggregate_loss(per_token, mask, loss_type, max_completion_length, num_sequences, num_tokens)
    with torch.no_grad():
        m = mask.float()
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        low = ((ratio < 1.0 - epsilon) & (adv < 0)).float()
        high = ((ratio > 1.0 + eps_high) & (adv > 0)).float()
        stats = {
            "tokens": float(m.sum()),
            "clip_low_tokens": float((low * m).sum()),
            "clip_high_tokens": float((high * m).sum()),
            "ratio_sum": float((ratio * m).sum()),
        }
        if kl is not None:
            stats["kl_sum"] = float((kl * m).sum())
        if is_weights is not None:
            stats["is_weight_sum"] = float((is_weights.expand_as(m) * m).sum())
    return loss, stats


def autocast_enabled(setting: bool | str, device: torch.device | str) -> bool:
    """Whether the training forwards run under bf16 autocast: GRPOSettings.bf16_autocast for a
    model on `device` ("auto" = on for CUDA, off elsewhere)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return bool(setting)
