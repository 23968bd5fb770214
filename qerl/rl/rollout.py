"""Rollouts for RL: batched sampling with per-token logprobs and entropies, and policy logprobs.

`sample_rollouts(model, prompt_ids, settings, generator)` is the one generation function the
trainer calls (a GPU engine can replace it: any callable with the same signature returning a
`RolloutBatch`). It runs a KV-cache decode loop over a Hugging Face causal LM:

- each distinct prompt is pre-filled once and its KV cache is repeated for its
  `num_generations` samples (`share_prompt=True`), so the prompt costs 1/G of a naive rollout;
- tokens are drawn from softmax(logits / T) after top-k / top-p truncation with a private
  torch.Generator (no global RNG side effects);
- the logprob recorded for each token is log softmax(logits / T) at that token, before top-k /
  top-p (the same quantity `policy_logprobs` recomputes for training, as in TRL), and the entropy
  is that distribution's entropy (nats);
- a row stops at its first stop token (kept in the completion, like an eos) or at
  `max_new_tokens` (then `finished` is False: a truncated completion).

`policy_logprobs(model, batch, rows, temperature)` recomputes the logprobs of the sampled
completions under the current (training) policy, with autograd. With `share_prompt=True` the
prompt is run once per distinct prompt and its KV cache (with its graph) is gathered for the
rows, so training costs one prompt pass per group plus the completion tokens; the result
equals a full forward over prompt + completion (tests check this).

Try it:  pytest tests/test_grpo.py -q -k rollout
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from qerl.rollout.sampling import draw_uniform, sample_next

__all__ = [
    "RolloutBatch",
    "RolloutFn",
    "RolloutSettings",
    "pad_prompts",
    "policy_logprobs",
    "sample_rollouts",
]


@dataclass
class RolloutSettings:
    num_generations: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: Sequence[int] = ()
    pad_id: int = 0
    share_prompt: bool = True


@dataclass
class RolloutBatch:
    """P prompts x G samples = N rows, grouped: rows g*G .. g*G+G-1 belong to prompt g."""

    prompt_ids: torch.Tensor  # [P, Lp] left padded
    prompt_mask: torch.Tensor  # [P, Lp] 1 = real token
    prompt_index: torch.Tensor  # [N] row -> prompt
    completion_ids: torch.Tensor  # [N, T] right padded with pad_id (stop token included when finished)
    completion_mask: torch.Tensor  # [N, T] 1 = generated token
    logprobs: torch.Tensor  # [N, T] float32, rollout policy (0 where masked)
    entropies: torch.Tensor  # [N, T] float32 (0 where masked)
    finished: torch.Tensor  # [N] bool: ended with a stop token
    elapsed_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def select(self, rows: torch.Tensor | Sequence[int]) -> "RolloutBatch":
        """The sub-batch of `rows` (prompts are kept whole; prompt_index still points into them)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return RolloutBatch(
            self.prompt_ids, self.prompt_mask, self.prompt_index[rows], self.completion_ids[rows],
            self.completion_mask[rows], self.logprobs[rows], self.entropies[rows], self.finished[rows],
            self.elapsed_s, dict(self.extra),
        )


RolloutFn = Callable[..., RolloutBatch]


# ----------------------------------------------------------------------------- helpers


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _base_forward_params(model) -> set[str]:
    m = model
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    try:
        return set(inspect.signature(m.forward).parameters)
    except (TypeError, ValueError):
        return set()


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists -> (ids [P, L], mask [P, L])."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor, keep_last: bool):
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), use_cache=True)
    if keep_last and "logits_to_keep" in _base_forward_params(model):
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs)
    return out.logits[:, -1, :], out.past_key_values


# ----------------------------------------------------------------------------- sampling


@torch.no_grad()
def sample_rollouts(
    model,
    prompt_ids: Sequence[Sequence[int]],
    settings: RolloutSettings,
    generator: torch.Generator | None = None,
) -> RolloutBatch:
    """Sample `num_generations` completions for each prompt (token id lists, chat template applied)."""
    t0 = time.perf_counter()
    device = _device(model)
    g = settings.num_generations
    stops = torch.as_tensor(list(settings.stop_ids), dtype=torch.long, device=device)
    if stops.numel() == 0:
        raise ValueError("rollouts need at least one stop token id")
    p_ids, p_mask = pad_prompts(prompt_ids, settings.pad_id)
    index = torch.arange(len(prompt_ids)).repeat_interleave(g)
    was_training = model.training
    model.eval()
    try:
        if settings.share_prompt:
            logits, cache = _prefill(model, p_ids.to(device), p_mask.to(device), True)
            dev_index = index.to(device)
            cache.reorder_cache(dev_index)
            logits = logits[dev_index]
        else:
            logits, cache = _prefill(model, p_ids[index].to(device), p_mask[index].to(device), True)
        attention = p_mask[index].to(device)
        next_pos = attention.sum(-1, keepdim=True)  # real prompt length = position of the first new token
        n = attention.shape[0]
        finished = torch.zeros(n, dtype=torch.bool, device=device)
        toks, lps, ents, alive = [], [], [], []
        for step in range(settings.max_new_tokens):
            u = draw_uniform(n, generator, device) if settings.temperature else None
            tok, lp, ent = sample_next(logits, settings.temperature, settings.top_k, settings.top_p, u)
            ents.append(ent)
            lps.append(lp)
            tok = tok.masked_fill(finished, settings.pad_id)
            toks.append(tok)
            alive.append(~finished)
            finished = finished | torch.isin(tok, stops)
            if step == settings.max_new_tokens - 1 or bool(finished.all()):
                break
            attention = torch.cat([attention, torch.ones((n, 1), dtype=attention.dtype, device=device)], dim=-1)
            out = model(
                input_ids=tok[:, None], attention_mask=attention, position_ids=next_pos,
                past_key_values=cache, use_cache=True,
            )
            logits, cache = out.logits[:, -1, :], out.past_key_values
            next_pos = next_pos + 1
    finally:
        model.train(was_training)
    mask = torch.stack(alive, 1).cpu()
    comp = torch.stack(toks, 1).cpu()
    fin = torch.zeros(n, dtype=torch.bool)
    lengths = mask.sum(-1)
    has = lengths > 0
    last = comp[torch.arange(n), (lengths - 1).clamp(min=0)]
    fin[has] = torch.isin(last[has], stops.cpu())
    return RolloutBatch(
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        prompt_index=index,
        completion_ids=comp,
        completion_mask=mask.long(),
        logprobs=(torch.stack(lps, 1).float().cpu() * mask),
        entropies=(torch.stack(ents, 1).float().cpu() * mask),
        finished=fin,
        elapsed_s=time.perf_counter() - t0,
    )


# ----------------------------------------------------------------------------- training logprobs


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[token], in float32, without keeping a second [.., V] tensor."""
    scaled = logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def policy_logprobs(
    model,
    batch: RolloutBatch,
    rows: torch.Tensor | Sequence[int] | None = None,
    temperature: float = 1.0,
    share_prompt: bool = True,
) -> torch.Tensor:
    """Logprobs [len(rows), T] of the sampled completion tokens under `model` (autograd on).

    The distribution is softmax(logits / temperature) (temperature 0 is treated as 1)."""
    device = _device(model)
    rows = torch.arange(batch.num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    comp = batch.completion_ids[rows].to(device)
    cmask = batch.completion_mask[rows].to(device)
    pidx = batch.prompt_index[rows]
    n, t = comp.shape
    temp = temperature if temperature > 0 else 1.0
    if share_prompt:
        uniq, inv = torch.unique(pidx, return_inverse=True)
        p_ids = batch.prompt_ids[uniq].to(device)
        p_mask = batch.prompt_mask[uniq].to(device)
        first_logits, cache = _prefill(model, p_ids, p_mask, True)
        inv_d = inv.to(device)
        first = _token_logprobs(first_logits[inv_d], comp[:, 0], temp)[:, None]
        if t == 1:
            return first
        cache.reorder_cache(inv_d)
        attention = torch.cat([p_mask[inv_d], cmask[:, :-1]], dim=-1)
        positions = p_mask[inv_d].sum(-1, keepdim=True) + torch.arange(t - 1, device=device)[None, :]
        out = model(
            input_ids=comp[:, :-1], attention_mask=attention, position_ids=positions,
            past_key_values=cache, use_cache=True,
        )
        rest = _token_logprobs(out.logits, comp[:, 1:], temp)
        return torch.cat([first, rest], dim=1)
    p_ids = batch.prompt_ids[pidx].to(device)
    p_mask = batch.prompt_mask[pidx].to(device)
    ids = torch.cat([p_ids, comp], dim=1)
    attention = torch.cat([p_mask, cmask], dim=1)
    kwargs = dict(input_ids=ids, attention_mask=attention, position_ids=_positions(attention), use_cache=False)
    if "logits_to_keep" in _base_forward_params(model):
        kwargs["logits_to_keep"] = t + 1
    logits = model(**kwargs).logits[:, -(t + 1):-1, :]
    return _token_logprobs(logits, comp, temp)
