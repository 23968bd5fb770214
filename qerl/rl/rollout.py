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
equals a full forward over prompt + completion (tests check this). The decoder runs once; the
lm_head and log-softmax run LOGPROB_CHUNK_TOKENS positions at a time, each chunk checkpointed, so
the [tokens x vocab] logits never exist whole, in the forward or the backward pass (a 2048-token
completion of a 152k-word vocabulary would be 1.2 GB of float32 logits per row).

Try it:  pytest tests/test_grpo.py -q -k rollout
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from qerl.nn.fused_train import token_logprobs
from qerl.rollout.sampling import draw_uniform, sample_next

__all__ = [
    "LOGPROB_CHUNK_TOKENS",
    "RolloutBatch",
    "RolloutFn",
    "RolloutSettings",
    "chunked_logprobs",
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

    @classmethod
    def random(cls, rows: int, prompt_len: int, completion: int, vocab: int, seed: int = 0,
               logprob: float = -3.0) -> "RolloutBatch":
        """`rows` completions of `completion` random token ids after one prompt of `prompt_len`, every
        token real and none finished, rollout log-probs `logprob`: what the training phase needs
        without sampling anything (its benchmarks and tests)."""
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab, (1, prompt_len), generator=g)
        comp = torch.randint(0, vocab, (rows, completion), generator=g)
        return cls(prompt, torch.ones_like(prompt), torch.zeros(rows, dtype=torch.long), comp, torch.ones_like(comp),
                   torch.full((rows, completion), float(logprob)), torch.zeros(rows, completion),
                   torch.zeros(rows, dtype=torch.bool))

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

# Tokens per chunk of the lm_head + log-softmax in `policy_logprobs`: the [tokens x vocab] logits
# exist one chunk at a time (Qwen2.5's 152064-word vocabulary: 1024 tokens = 0.6 GB in float32),
# and the backward pass recomputes each chunk from its hidden states instead of keeping them.
LOGPROB_CHUNK_TOKENS = 1024


def _head_chunk(head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
    """(logprob of each token, entropy of its distribution or None) for one chunk of hidden states.
    The entropy is one more pass over [chunk x vocab] (and again in a checkpointed backward), so
    it is computed only when asked for. Without it, on a GPU, qerl.nn.fused_train.token_logprobs
    reads the logits once (no float32 copy; the same float32 math)."""
    logits = head(hidden)
    if not with_entropy:
        lp = token_logprobs(logits, tokens, temperature if temperature not in (0.0, 1.0) else 1.0)
        if lp is not None:  # on a GPU: the logits read once, never copied to float32
            return lp, None
    scaled = logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    with torch.no_grad():  # entropy is a metric: no gradient, so nothing of it is kept for backward
        entropy = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return logp, entropy


def chunked_logprobs(
    head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / T)[tokens] and the entropies (None unless `entropy`),
    [*tokens.shape] float32 each, `chunk_tokens` positions at a time (<= 0: all at once). Under
    autograd each chunk is checkpointed: only its hidden states are kept, its logits are rebuilt
    in the backward pass."""
    from torch.utils.checkpoint import checkpoint

    shape = tokens.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = tokens.reshape(-1)
    n = t.numel()
    step = n if chunk_tokens <= 0 else int(chunk_tokens)
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    lps, ents = [], []
    for s in range(0, max(n, 1), max(step, 1)):
        hs, ts = h[s:s + step], t[s:s + step]
        if grad and step < n:
            lp, ent = checkpoint(_head_chunk, head, hs, ts, temperature, entropy, use_reentrant=False)
        else:
            lp, ent = _head_chunk(head, hs, ts, temperature, entropy)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps).reshape(shape), (torch.cat(ents).reshape(shape) if entropy else None)


def _decoder_and_head(model):
    """(the decoder stack returning hidden states, the lm_head) of a causal LM or a PeftModel over
    one, or None for a model without that split (then the full logits are computed)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        decoder, head = base.get_decoder(), base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or head is None or decoder is base:
        return None
    return decoder, head


def policy_logprobs(
    model,
    batch: RolloutBatch,
    rows: torch.Tensor | Sequence[int] | None = None,
    temperature: float = 1.0,
    share_prompt: bool = True,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [len(rows), T] of the sampled completion tokens under `model` (autograd on), and
    with `return_entropy` the entropies [len(rows), T] of the same distributions (no gradient).

    The distribution is softmax(logits / temperature) (temperature 0 is treated as 1). The
    decoder runs once over the rows; the lm_head and the log-softmax run `chunk_tokens`
    positions at a time (`chunked_logprobs`), so the [tokens x vocab] logits never exist whole."""
    device = _device(model)
    rows = torch.arange(batch.num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    comp = batch.completion_ids[rows].to(device)
    cmask = batch.completion_mask[rows].to(device)
    pidx = batch.prompt_index[rows]
    n, t = comp.shape
    temp = temperature if temperature > 0 else 1.0
    split = _decoder_and_head(model)
    if split is None:  # no decoder / head split: full logits (small or exotic models)
        lp = _full_logprobs(model, batch, pidx, comp, cmask, temp, device)
        if not return_entropy:
            return lp
        raise ValueError("return_entropy needs a model with get_decoder() / get_output_embeddings()")
    decoder, head = split

    def heads(hidden, tokens):
        return chunked_logprobs(head, hidden, tokens, temp, chunk_tokens, entropy=return_entropy)

    if share_prompt:
        uniq, inv = torch.unique(pidx, return_inverse=True)
        p_ids = batch.prompt_ids[uniq].to(device)
        p_mask = batch.prompt_mask[uniq].to(device)
        out = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=_positions(p_mask), use_cache=True)
        inv_d = inv.to(device)
        lp, ent = heads(out.last_hidden_state[:, -1, :][inv_d][:, None, :], comp[:, :1])
        if t > 1:
            cache = out.past_key_values
            cache.reorder_cache(inv_d)
            attention = torch.cat([p_mask[inv_d], cmask[:, :-1]], dim=-1)
            positions = p_mask[inv_d].sum(-1, keepdim=True) + torch.arange(t - 1, device=device)[None, :]
            rest = decoder(
                input_ids=comp[:, :-1], attention_mask=attention, position_ids=positions,
                past_key_values=cache, use_cache=True,
            )
            lp2, ent2 = heads(rest.last_hidden_state, comp[:, 1:])
            lp = torch.cat([lp, lp2], dim=1)
            ent = torch.cat([ent, ent2], dim=1) if return_entropy else None
    else:
        out = decoder(**_whole_sequences(batch, pidx, comp, cmask, device))
        lp, ent = heads(out.last_hidden_state[:, -(t + 1):-1, :], comp)
    return (lp, ent) if return_entropy else lp


def _whole_sequences(batch, pidx, comp, cmask, device) -> dict:
    """Forward kwargs for each row's prompt + completion as one left-padded sequence."""
    ids = torch.cat([batch.prompt_ids[pidx].to(device), comp], dim=1)
    attention = torch.cat([batch.prompt_mask[pidx].to(device), cmask], dim=1)
    return dict(input_ids=ids, attention_mask=attention, position_ids=_positions(attention), use_cache=False)


def _full_logprobs(model, batch, pidx, comp, cmask, temp, device) -> torch.Tensor:
    t = comp.shape[1]
    kwargs = _whole_sequences(batch, pidx, comp, cmask, device)
    if "logits_to_keep" in _base_forward_params(model):
        kwargs["logits_to_keep"] = t + 1
    logits = model(**kwargs).logits[:, -(t + 1):-1, :]
    return _head_chunk(torch.nn.Identity(), logits, comp, temp, False)[0]
