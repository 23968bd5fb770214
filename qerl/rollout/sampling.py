"""Next-token sampling on the logits' device, with no host synchronisation.

    tok, logprob, entropy = sample_next(logits, temperature=1.0, top_k=0, top_p=1.0, generator=g)

- the recorded logprob is log softmax(logits / T) at the chosen token, before top-k / top-p
  truncation (the quantity the trainer recomputes, as in TRL); the entropy is that
  distribution's entropy in nats; temperature 0 means greedy (argmax, T treated as 1);
- a token is drawn as argmax(p / E) with E ~ Exp(1) i.i.d., which picks i with probability p_i.
  It is the algorithm torch.multinomial uses for one sample, without multinomial's validity check
  that reads a value back to the host on every call (a sync per token on a GPU).
"""

from __future__ import annotations

import torch

__all__ = ["sample_next", "truncate"]


def truncate(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Scores with everything outside the top-k and the top-p nucleus set to -inf."""
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = before >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop[..., 0] = False
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scores


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token [B] long, logprob [B] float32, entropy [B] float32)."""
    greedy = temperature == 0.0
    scaled = logits.float() if greedy or temperature == 1.0 else logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    if greedy:
        tok = scaled.argmax(-1)
    else:
        probs = torch.softmax(truncate(scaled, top_k, top_p), dim=-1)
        tok = (probs / torch.empty_like(probs).exponential_(1.0, generator=generator)).argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), entropy
