"""Next-token sampling on the logits' device, with no host synchronisation.

    u = torch.rand(batch, generator=g)                 # one uniform per row, drawn by the caller
    tok, logprob, entropy = sample_next(logits, temperature=1.0, top_k=0, top_p=1.0, uniform=u)

- the recorded logprob is log softmax(logits / T) at the chosen token, before top-k / top-p
  truncation (the quantity the trainer recomputes, as in TRL); the entropy is that
  distribution's entropy in nats; temperature 0 means greedy (argmax, T treated as 1);
- a token is drawn by inverting the CDF of the truncated distribution at (1 - u) * total mass:
  the first token whose cumulative probability reaches it. (1 - u) is in (0, 1], so a token of
  probability 0 is never chosen (a guard falls back to the argmax should float rounding of the
  parallel cumsum ever land on one). One uniform per row means the random numbers of a whole
  rollout can be drawn up front (T x B values), so a decode step captured in a CUDA graph needs
  no generator, and a resumed run that restores the generator draws the same tokens.
"""

from __future__ import annotations

import torch

__all__ = ["draw_uniform", "sample_next", "truncate"]


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
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], uniform [B] in [0, 1) -> (token [B] long, logprob [B] float32, entropy [B] float32)."""
    greedy = temperature == 0.0
    scaled = logits.float() if greedy or temperature == 1.0 else logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    if greedy:
        tok = scaled.argmax(-1)
    else:
        if uniform is None:
            raise ValueError("sampling needs one uniform random number per row (temperature > 0)")
        probs = torch.softmax(truncate(scaled, top_k, top_p), dim=-1) if (top_k or top_p < 1.0) else logp.exp()
        cdf = probs.cumsum(-1)
        target = (1.0 - uniform.to(cdf.dtype))[:, None] * cdf[:, -1:]
        tok = torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
        tok = torch.where(probs.gather(-1, tok[:, None]).squeeze(-1) > 0, tok, probs.argmax(-1))
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), entropy


def draw_uniform(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """U[0, 1) float32 of `shape` from `generator` (on the generator's own device), moved to `device`."""
    gen_device = generator.device if generator is not None else "cpu"
    return torch.rand(shape, generator=generator, device=gen_device).to(device)
