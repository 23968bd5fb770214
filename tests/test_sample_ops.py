"""qerl.kernels.sample_ops: the one-kernel sampling epilogue (run by Triton's interpreter in a
subprocess on CPU tensors) against its torch reference, on fresh random logits and decode state:
greedy and three temperatures, vocabularies of one to five 4096-logit chunks, not multiples of
the block, rows that had
finished, stop tokens, a permuted row map. Every buffer the step writes is compared: tokens,
finished flags, positions and alive flags exactly; logprobs and entropies to 1e-5."""

from __future__ import annotations

import textwrap

import pytest
import torch

from interpreted import run_interpreted
from qerl.kernels import sample_ops

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from qerl.kernels import sample_ops as so
    torch.manual_seed(int(__import__("os").environ.get("SEED", "0")))
    out = []
    def state(rows, vocab, length, step):
        g = dict(uniform=torch.rand(length, rows + 2), step=torch.tensor([step]),
                 row_map=torch.randperm(rows + 2)[:rows].clone(), finished=torch.rand(rows) < 0.25,
                 is_stop=torch.zeros(vocab, dtype=torch.bool), pad=torch.tensor([3]),
                 out_tok=torch.full((rows + 2, length), -1), out_lp=torch.zeros(rows + 2, length),
                 out_ent=torch.zeros(rows + 2, length), out_alive=torch.zeros(rows + 2, length, dtype=torch.bool),
                 tok=torch.zeros(rows + 1, dtype=torch.long), pos=torch.randint(0, 50, (rows + 1,)))
        g["is_stop"][torch.randint(0, vocab, (vocab // 50,))] = True
        return g
    for rows, vocab, temperature, sharp in ((4, 5000, 1.0, 3.0), (3, 4096, 0.7, 1.0), (5, 777, 0.0, 2.0), (6, 300, 1.3, 8.0),
                                         (5, 20000, 0.9, 0.5), (3, 20000, 0.0, 1.0)):
        logits = torch.randn(rows, vocab) * sharp
        # make some rows pick stop tokens with high probability
        buffers = state(rows, vocab, 9, 4)
        stop_ids = buffers["is_stop"].nonzero().squeeze(1)
        logits[0, stop_ids[0]] += 30.0
        a = so.SampleState(**{k: v.clone() for k, v in buffers.items()})
        b = so.SampleState(**{k: v.clone() for k, v in buffers.items()})
        so.sample_step_triton(logits, temperature, a)
        so.sample_step_reference(logits, temperature, b)
        exact = all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("out_tok", "out_alive", "finished", "tok", "pos"))
        close = max(float((getattr(a, k) - getattr(b, k)).abs().max()) for k in ("out_lp", "out_ent"))
        out.append((rows, vocab, temperature, exact, close, int(b.finished.sum())))
    print("RESULTS" + json.dumps(out))
    """
)


@pytest.mark.parametrize("seed", [0, 1])
def test_sample_step_kernel_under_interpreter(seed):
    results = run_interpreted(_SCRIPT, seed)
    assert len(results) == 6
    assert all(r[3] for r in results), results
    assert all(r[4] <= 1e-4 for r in results), results
    assert any(r[5] > 0 for r in results)  # some rows finished (stop token or already finished)


def test_reference_matches_sample_next():
    """The reference writes what qerl.rollout.sampling.sample_next draws, at [row_map[r], step]."""
    from qerl.rollout.sampling import sample_next

    torch.manual_seed(0)
    rows, vocab, length = 3, 50, 6
    logits = torch.randn(rows, vocab) * 2
    s = sample_ops.SampleState(uniform=torch.rand(length, rows), step=torch.tensor([2]), row_map=torch.tensor([2, 0, 1]),
                               finished=torch.tensor([False, True, False]), is_stop=torch.zeros(vocab, dtype=torch.bool),
                               pad=torch.tensor([7]), out_tok=torch.zeros(rows, length, dtype=torch.long),
                               out_lp=torch.zeros(rows, length), out_ent=torch.zeros(rows, length),
                               out_alive=torch.zeros(rows, length, dtype=torch.bool), tok=torch.zeros(rows, dtype=torch.long),
                               pos=torch.zeros(rows, dtype=torch.long))
    u = s.uniform[2, s.row_map]
    tok, lp, ent = sample_next(logits, 1.0, 0, 1.0, u)
    sample_ops.sample_step(logits, 1.0, s)
    assert s.out_tok[2, 2] == tok[0] and s.out_tok[0, 2] == 7 and s.out_tok[1, 2] == tok[2]
    assert torch.allclose(s.out_lp[[2, 0, 1], 2], lp) and torch.allclose(s.out_ent[[2, 0, 1], 2], ent)
    assert s.out_alive[:, 2].tolist() == [False, True, True]
    assert s.pos.tolist() == [1, 1, 1] and s.tok.tolist() == [int(tok[0]), 7, int(tok[2])]


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (50, 1.0), (50, 0.95), (0, 0.5), (5, 0.3), (1, 1.0)])
def test_truncation_keeps_the_tokens_transformers_warpers_keep(top_k, top_p):
    """sampling.truncate after the temperature keeps exactly the tokens Hugging Face generate's warpers keep
    (TemperatureLogitsWarper, then TopKLogitsWarper, then TopPLogitsWarper: the sampler TRL runs without vLLM)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from qerl.rollout.sampling import truncate

    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100))
    for _ in range(20):
        logits = torch.randn(8, 1000, generator=g) * 3
        theirs = TemperatureLogitsWarper(0.7)(None, logits.clone())
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1.0:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        ours = truncate(logits / 0.7, top_k, top_p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
        assert torch.equal(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])
