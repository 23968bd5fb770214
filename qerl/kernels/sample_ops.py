"""The rollout engine's per-step sampling epilogue as one Triton kernel (CUDA), torch elsewhere.

    sample_step(logits, temperature, state)   # state: the engine's decode buffers, see below

What one decode step does after the lm_head, for every row r (one program per row):
    u      = uniform[step, row_map[r]]                    (drawn up front for the whole rollout)
    z      = logits[r] / T                                (T = 1 for greedy)
    lp, H  = log softmax(z)[token], entropy of softmax(z) (nats)
    token  = argmax z (greedy) or the first index whose running sum of exp(z - max) reaches
             (1 - u) of the total (inverse CDF; argmax should rounding leave it unreached)
    token  = pad if the row had already finished;  outputs[row_map[r], step] = token, lp, H, alive
    finished[r] |= is_stop[token];  tok[r] = token;  pos[r] += 1
The shared counters (step, cache slot, key mask) advance after it, in torch.

Why: as torch ops this is ~20 kernels per step (softmax, log-softmax, the entropy's product and
sum, a cumsum over B x V, a search, gathers, index copies); at batch 8 with a 152k vocabulary the
cumsum alone took 0.19 ms of a 3.6 ms step. Here it is two kernels: per (row, 4096-logit chunk) the
chunk's max, sum of exp and entropy term and argmax (38 programs per row at 152k); then per row
the chunks combined, and the inverse-CDF scan over the one chunk where the running mass reaches
the target. (A first version with one program per row reading the vocabulary twice took 100 us at
batch 8: a serial chain of 74 block loads and reductions.) Plain temperature sampling and greedy
only; top-k / top-p keep the torch path (qerl.rollout.sampling).

Numerics: the same quantities as qerl.rollout.sampling.sample_next in fp32, summed in another
order (online max / sum-exp, entropy as log S - sum(e (z - m)) / S), so logprobs and entropies
agree to ~1e-6 relative and the token differs only when (1 - u) lands within rounding of a CDF
step. tests/test_sample_ops.py checks it under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["sample_step", "sample_step_reference", "SampleState"]


class SampleState:
    """The engine's decode buffers the epilogue reads and writes (all on one device):
    uniform [L, B] f32, step [1] long, row_map [B] long, finished [B] bool, is_stop [V] bool,
    pad [1] long, out_tok [B, L] long, out_lp / out_ent [B, L] f32, out_alive [B, L] bool,
    tok [B] long, pos [B] long."""

    def __init__(self, **buffers):
        self.__dict__.update(buffers)


def sample_step_reference(logits: torch.Tensor, temperature: float, s: SampleState, top_k: int = 0,
                          top_p: float = 1.0) -> None:
    from qerl.rollout.sampling import sample_next

    rows = logits.shape[0]
    out_rows = s.row_map[:rows]
    u = s.uniform.index_select(0, s.step)[0].index_select(0, out_rows)
    tok, lp, ent = sample_next(logits, temperature, top_k, top_p, u)
    finished = s.finished[:rows]
    tok = torch.where(finished, s.pad, tok)
    at = out_rows * s.out_tok.shape[1] + s.step  # flat [row, step] positions
    s.out_tok.view(-1).index_copy_(0, at, tok)
    s.out_lp.view(-1).index_copy_(0, at, lp)
    s.out_ent.view(-1).index_copy_(0, at, ent)
    s.out_alive.view(-1).index_copy_(0, at, ~finished)
    finished.logical_or_(s.is_stop[tok])
    s.tok[:rows].copy_(tok)
    s.pos[:rows].add_(1)


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") == "1":
        from qerl.kernels.w4a16_triton import _patch_interpreter

        _patch_interpreter()  # numpy >= 2.4 and the interpreter's handling of scalar bounds

    import triton.language.extra.cuda  # noqa: F401  (gdc_* for PDL)

    @triton.jit
    def sample_partial_kernel(logits_ptr, stride_l, vocab, temperature, ws_ptr, P, CHUNK: tl.constexpr,
                              GREEDY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        # program (row, chunk): max m, S = sum exp(z - m), W = sum exp(z - m) (z - m), argmax of
        # its CHUNK logits -> ws[row, 5, chunk]
        if PDL:  # see decode_ops.PDL
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        c = tl.program_id(1)
        base = logits_ptr + r.to(tl.int64) * stride_l
        offs = tl.arange(0, BLOCK)
        m = -1.0e30
        s_sum = 0.0
        w_sum = 0.0
        best = -float("inf")
        best_i = 0
        for k0 in tl.static_range(0, CHUNK, BLOCK):
            idx = c * CHUNK + k0 + offs
            z = tl.load(base + idx, mask=idx < vocab, other=-float("inf")).to(tl.float32)
            if not GREEDY:
                z = z / temperature
            bm = tl.max(z, axis=0)
            bi = tl.argmax(z, axis=0, tie_break_left=True)
            better = bm > best
            best_i = tl.where(better, c * CHUNK + k0 + bi, best_i)
            best = tl.where(better, bm, best)
            m_new = tl.maximum(m, bm)
            scale = tl.exp(m - m_new)
            e = tl.exp(z - m_new)
            ez = e * tl.where(e > 0, z - m_new, 0.0)
            w_sum = scale * (w_sum + s_sum * (m - m_new)) + tl.sum(ez, axis=0)
            s_sum = scale * s_sum + tl.sum(e, axis=0)
            m = m_new
        out = ws_ptr + (r * 5) * P + c
        tl.store(out, m)
        tl.store(out + P, s_sum)
        tl.store(out + 2 * P, w_sum)
        tl.store(out + 3 * P, best)
        tl.store(out + 4 * P, best_i.to(tl.float32))  # exact below 2^24

    @triton.jit
    def sample_finish_kernel(logits_ptr, stride_l, vocab, temperature, ws_ptr, P, uniform_ptr, stride_u, step_ptr,
                             row_map_ptr, finished_ptr, is_stop_ptr, pad_ptr, out_tok_ptr, out_lp_ptr, out_ent_ptr,
                             out_alive_ptr, max_len, tok_ptr, pos_ptr, CHUNK: tl.constexpr, PP: tl.constexpr,
                             GREEDY: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        # program row: combine the chunks; the token is the argmax (greedy) or found by scanning
        # only the chunk where the running mass reaches (1 - u) of the total
        if PDL:  # see decode_ops.PDL
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        r = tl.program_id(0)
        base = logits_ptr + r.to(tl.int64) * stride_l
        p = tl.arange(0, PP)
        pm = p < P
        ws = ws_ptr + (r * 5) * P + p
        m_c = tl.load(ws, mask=pm, other=-1.0e30)
        s_c = tl.load(ws + P, mask=pm, other=0.0)
        w_c = tl.load(ws + 2 * P, mask=pm, other=0.0)
        best_c = tl.load(ws + 3 * P, mask=pm, other=-float("inf"))
        idx_c = tl.load(ws + 4 * P, mask=pm, other=0.0)
        m = tl.max(m_c, axis=0)
        scale = tl.exp(m_c - m)
        mass = s_c * scale
        s_sum = tl.sum(mass, axis=0)
        w_sum = tl.sum(scale * (w_c + s_c * (m_c - m)), axis=0)
        log_s = tl.log(s_sum)
        entropy = log_s - w_sum / s_sum
        first_best = tl.argmax(best_c, axis=0, tie_break_left=True)  # chunks in order: the first maximum
        best_i = tl.sum(tl.where(p == first_best, idx_c, 0.0), axis=0).to(tl.int32)
        step = tl.load(step_ptr)
        out_row = tl.load(row_map_ptr + r)
        token = best_i
        if not GREEDY:
            u = tl.load(uniform_ptr + step * stride_u + out_row)
            target = (1.0 - u) * s_sum
            upto = tl.cumsum(mass, axis=0)
            chunk = tl.min(tl.where((upto >= target) & pm, p, PP), axis=0)
            ok_chunk = chunk < P
            chunk = tl.minimum(chunk, P - 1)
            run = tl.sum(tl.where(p < chunk, mass, 0.0), axis=0)
            offs = tl.arange(0, BLOCK)
            found = 0
            pick = 0
            for k0 in tl.static_range(0, CHUNK, BLOCK):
                idx = chunk * CHUNK + k0 + offs
                ok = idx < vocab
                z = tl.load(base + idx, mask=ok, other=-float("inf")).to(tl.float32) / temperature
                e = tl.exp(z - m)
                cum = tl.cumsum(e, axis=0) + run
                first = tl.min(tl.where((cum >= target) & ok, idx, vocab), axis=0)
                take = (found == 0) & (first < vocab)
                pick = tl.where(take, first, pick)
                found = tl.where(take, 1, found)
                run += tl.sum(e, axis=0)
            token = tl.where((found != 0) & ok_chunk, pick, best_i)
        z_tok = tl.load(base + token).to(tl.float32)
        if not GREEDY:
            z_tok = z_tok / temperature
        logprob = z_tok - m - log_s
        fin = tl.load(finished_ptr + r) != 0
        token = tl.where(fin, tl.load(pad_ptr), token.to(tl.int64))
        at = out_row * max_len + step
        tl.store(out_tok_ptr + at, token)
        tl.store(out_lp_ptr + at, logprob)
        tl.store(out_ent_ptr + at, entropy)
        tl.store(out_alive_ptr + at, (~fin).to(tl.int8))
        stop = tl.load(is_stop_ptr + token) != 0
        tl.store(finished_ptr + r, (fin | stop).to(tl.int8))
        tl.store(tok_ptr + r, token)
        tl.store(pos_ptr + r, tl.load(pos_ptr + r) + 1)

    return sample_partial_kernel, sample_finish_kernel


SAMPLE_BLOCK = 2048  # logits per load
SAMPLE_CHUNK = 4096  # logits per first-pass program (152k vocabulary: 38 programs per row)


def sample_step_triton(logits: torch.Tensor, temperature: float, s: SampleState) -> None:
    rows, vocab = logits.shape
    greedy = temperature == 0.0
    block = min(SAMPLE_BLOCK, 1 << (vocab - 1).bit_length())
    chunk = max(block, min(SAMPLE_CHUNK, block * (-(-vocab // block))))
    chunks = -(-vocab // chunk)
    t = float(temperature or 1.0)
    ws = torch.empty(rows, 5, chunks, dtype=torch.float32, device=logits.device)
    partial, finish = _kernel()
    from qerl.kernels.decode_ops import pdl_on

    pdl = pdl_on(logits)
    partial[(rows, chunks)](logits, logits.stride(0), vocab, t, ws, chunks, CHUNK=chunk, GREEDY=greedy, BLOCK=block,
                            num_warps=4, PDL=pdl, launch_pdl=pdl)
    # bool buffers are written through int8 views (same bytes)
    finish[(rows,)](logits, logits.stride(0), vocab, t, ws, chunks, s.uniform, s.uniform.stride(0),
                    s.step, s.row_map, s.finished.view(torch.int8), s.is_stop.view(torch.int8), s.pad,
                    s.out_tok, s.out_lp, s.out_ent, s.out_alive.view(torch.int8), s.out_tok.shape[1], s.tok, s.pos,
                    CHUNK=chunk, PP=max(2, 1 << (chunks - 1).bit_length()), GREEDY=greedy, BLOCK=block, num_warps=4,
                    PDL=pdl, launch_pdl=pdl)


def sample_step(logits: torch.Tensor, temperature: float, s: SampleState, top_k: int = 0, top_p: float = 1.0) -> None:
    """One row-parallel sampling epilogue (module docstring): Triton on CUDA for plain temperature
    and greedy sampling; torch with top-k / top-p, off CUDA, or with `sample` in
    QERL_DECODE_OPS_TORCH."""
    from qerl.kernels.decode_ops import _on_gpu

    if not (top_k or top_p < 1.0) and _on_gpu(logits, "sample") and logits.stride(-1) == 1:
        sample_step_triton(logits, temperature, s)
    else:
        sample_step_reference(logits, temperature, s, top_k, top_p)
