"""The rollout engine: batched prefill + decode over a Llama / Qwen2-family model's own modules.

    engine = RolloutEngine(model, max_batch=64, max_len=2304)
    batch = engine.generate(prompt_ids, RolloutSettings(...), generator)   # -> qerl.rl.rollout.RolloutBatch
    # or, as the trainer's rollout_fn:  engine_rollouts(model, prompt_ids, settings, generator)

What it runs. The decoder is re-expressed here (embedding, RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP, lm_head) but every weight is the model's own: the linears are called as
modules (QuantLinear's fused 4-bit kernels for nvfp4 / mxfp4, the NF4 dequantise-then-matmul
path for nf4, cuBLAS for bf16), LoRA adapters stay unmerged (PEFT's parameters, read on every
call, so an optimiser step is seen with no copy), and q/k/v and gate/up run as one product each
(`fuse.LinearGroup`, which makes the modules' weights views of the fused ones: the trainer and
the engine share one copy). Supported: model_type llama, qwen2, qwen3, mistral (no sliding
window), i.e. Hugging Face's `model.model.layers[i].self_attn / mlp / *_layernorm` layout.

How a call runs.
- Prefill: each distinct prompt once (left padded, causal + padding mask), its K/V written to
  the preallocated cache rows of its `num_generations` samples.
- Decode: one token per row per step. The step reads only device buffers (token, position, cache
  slot, valid-key mask), so on a GPU it is captured once per (rows, key-length bucket) in a CUDA
  graph and replayed; attention reads only the first `bucket` cache slots (buckets of 256).
- Sampling (qerl.rollout.sampling) runs on the GPU between replays with no host sync; a row
  finishes at a stop token (kept) or at max_new_tokens; the host checks "all finished" once
  every `check_every` steps, not per token.
- AQN: the norm weights are read into the engine's buffers at the start of every call, so noise
  swapped in by `AdaptiveQuantNoise.applied()` (or trained norms) is what the rollout samples
  with, and the graphs stay valid.
- Returns token ids, per-token logprobs of softmax(logits / T) and its entropies (RolloutBatch).

On a CPU it runs the same code eagerly (no graphs): slow but exact, which is what the tests use.
Greedy output equals Hugging Face `generate` token for token; logprobs equal a fresh forward
(`qerl.rl.rollout.policy_logprobs`). Try it:  pytest tests/test_rollout_engine.py -q
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from qerl.rl.rollout import RolloutBatch, RolloutSettings, pad_prompts
from qerl.rollout.fuse import LinearGroup
from qerl.rollout.sampling import sample_next

__all__ = ["EngineError", "RolloutEngine", "engine_rollouts"]

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
LENGTH_BUCKET = 256


class EngineError(ValueError):
    """The model or the request does not fit the engine."""


def _active_norm(mod: nn.Module) -> nn.Module:
    """The norm a PEFT `modules_to_save` wrapper would run (the trained copy when active)."""
    if hasattr(mod, "modules_to_save") and hasattr(mod, "original_module"):
        if not getattr(mod, "disable_adapters", False):
            for name in getattr(mod, "active_adapters", [getattr(mod, "active_adapter", None)]):
                if name in mod.modules_to_save:
                    return mod.modules_to_save[name]
        return mod.original_module
    return mod


class _Norm:
    """RMSNorm with the engine's own copy of the weight (refreshed per call), computed exactly
    as Hugging Face's Llama / Qwen2 RMSNorm: fp32 statistics, cast back, times the weight."""

    def __init__(self, mod: nn.Module):
        self.mod = mod
        norm = _active_norm(mod)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise EngineError(f"{type(norm).__name__} has no epsilon; not an RMSNorm the engine knows")
        self.eps = float(eps)
        with torch.no_grad():
            self.weight = norm.weight.detach().clone()

    def refresh(self) -> None:
        with torch.no_grad():
            self.weight.copy_(_active_norm(self.mod).weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Layer:
    def __init__(self, layer: nn.Module, fuse: bool):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn_norm = _Norm(layer.input_layernorm)
        self.mlp_norm = _Norm(layer.post_attention_layernorm)
        self.qkv = LinearGroup([attn.q_proj, attn.k_proj, attn.v_proj], fuse=fuse)
        self.o = attn.o_proj
        self.gate_up = LinearGroup([mlp.gate_proj, mlp.up_proj], fuse=fuse)
        self.down = mlp.down_proj
        self.act = mlp.act_fn
        self.q_norm = _Norm(attn.q_norm) if getattr(attn, "q_norm", None) is not None else None
        self.k_norm = _Norm(attn.k_norm) if getattr(attn, "k_norm", None) is not None else None

    def norms(self) -> list[_Norm]:
        return [n for n in (self.attn_norm, self.mlp_norm, self.q_norm, self.k_norm) if n is not None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _outside_inference_mode():
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack


class RolloutEngine:
    """Static-cache generation over one model; see the module docstring."""

    def __init__(self, model: nn.Module, max_batch: int = 64, max_len: int = 2048, cuda_graphs: bool | None = None,
                 fuse: bool = True, check_every: int = 32):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cfg = base.config
        if getattr(cfg, "model_type", None) not in SUPPORTED:
            raise EngineError(f"the rollout engine supports model types {', '.join(SUPPORTED)}, not {getattr(cfg, 'model_type', None)!r}")
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise EngineError("sliding-window attention is not supported by the rollout engine")
        inner = base.model
        self.model = model
        self.config = cfg
        self.embed = inner.embed_tokens
        self.lm_head = base.lm_head
        self.device = self.embed.weight.device
        self.dtype = self.embed.weight.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.scaling = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs and self.device.type == "cuda")
        self.check_every = int(check_every) if self.device.type == "cuda" else 1
        with _outside_inference_mode():
            self.layers = [_Layer(layer, fuse) for layer in inner.layers]
            self.final_norm = _Norm(inner.norm)
            positions = torch.arange(self.max_len, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, positions)
            self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, head_dim]
            shape = (self.max_batch, self.n_kv, self.max_len, self.head_dim)
            # zeros, not empty: a masked key still multiplies its value by 0, and 0 * NaN = NaN
            self._k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            self._v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
            self._tok = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
            self._pos = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
            self._slot = torch.zeros(1, dtype=torch.long, device=self.device)
            self._valid = torch.zeros(self.max_batch, self.max_len, dtype=torch.bool, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.stats: dict = {}

    # ------------------------------------------------------------------ forward pieces

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [B, L, H] -> q [B, heads, L, D], k / v [B, kv_heads, L, D] (RoPE applied)."""
        b, length = h.shape[:2]
        q, k, v = layer.qkv(layer.attn_norm(h))
        q = q.view(b, length, self.n_heads, self.head_dim)
        k = k.view(b, length, self.n_kv, self.head_dim)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, length, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _finish_layer(self, layer: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, L, heads * D] -> the layer's output (o_proj, residual, MLP, residual)."""
        h = h + layer.o(attn)
        gate, up = layer.gate_up(layer.mlp_norm(h))
        return h + layer.down(layer.act(gate) * up)

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(h_last))

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Run the prompts [P, Lp] (left padded); cache row r gets the K/V of prompt source[r].
        Returns the last position's logits [P, V]."""
        p, length = ids.shape
        rows = torch.arange(source.shape[0], device=ids.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._cos[positions], self._sin[positions]
        keys = mask.bool()[:, None, None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(length, dtype=torch.bool, device=ids.device)
        attn_mask = (causal & keys) | eye  # a pad query sees itself: no all-masked row, no NaN
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            self._k[i][rows, :, :length] = k[source]
            self._v[i][rows, :, :length] = v[source]
            k = k.repeat_interleave(self.group, dim=1) if self.group > 1 else k
            v = v.repeat_interleave(self.group, dim=1) if self.group > 1 else v
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scaling)
            h = self._finish_layer(layer, h, attn.transpose(1, 2).reshape(p, length, -1))
        return self._logits(h[:, -1])

    def _decode_step(self, rows: int, keys: int) -> torch.Tensor:
        """One token for rows [0, rows) from the device buffers; attends cache slots [0, keys)."""
        tok, pos = self._tok[:rows], self._pos[:rows]
        cos, sin = self._cos[pos][:, None], self._sin[pos][:, None]
        valid = self._valid[:rows, None, None, :keys]
        h = self.embed(tok)[:, None]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            kc, vc = self._k[i][:rows], self._v[i][:rows]
            kc.index_copy_(2, self._slot, k)
            vc.index_copy_(2, self._slot, v)
            # grouped-query attention without repeating K/V: the `group` query heads that share a
            # KV head take the place of query positions (heads h = kv * group + g, as in HF)
            qg = q.reshape(rows, self.n_kv, self.group, self.head_dim)
            attn = F.scaled_dot_product_attention(qg, kc[:, :, :keys], vc[:, :, :keys], attn_mask=valid, scale=self.scaling)
            h = self._finish_layer(layer, h, attn.reshape(rows, 1, -1))
        return self._logits(h[:, 0])

    def _decode(self, rows: int, keys: int) -> torch.Tensor:
        if not self.cuda_graphs:
            return self._decode_step(rows, keys)
        key = (rows, keys)
        if key not in self._graphs:
            # The step is idempotent (it rewrites the same cache slot from the same inputs), so
            # the warm-up runs on the live buffers.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._decode_step(rows, keys)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._decode_step(rows, keys)
            self._graphs[key] = (graph, out)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _bucket(self, slot: int) -> int:
        return min(self.max_len, -(-(slot + 1) // LENGTH_BUCKET) * LENGTH_BUCKET)

    # ------------------------------------------------------------------ public

    def refresh(self) -> None:
        """Re-read the norm weights (AQN noise, trained norms); generate() calls this."""
        for layer in self.layers:
            for norm in layer.norms():
                norm.refresh()
        self.final_norm.refresh()

    def release_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], settings: RolloutSettings,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        t0 = time.perf_counter()
        g = settings.num_generations
        stops = torch.as_tensor(list(settings.stop_ids), dtype=torch.long, device=self.device)
        if stops.numel() == 0:
            raise ValueError("rollouts need at least one stop token id")
        p_ids, p_mask = pad_prompts(prompt_ids, settings.pad_id)
        n_prompts, plen = p_ids.shape
        n = n_prompts * g
        steps = int(settings.max_new_tokens)
        if n > self.max_batch:
            raise EngineError(f"{n_prompts} prompts x {g} generations = {n} rows > the engine's max_batch {self.max_batch}")
        if plen + steps > self.max_len:
            raise EngineError(f"prompt {plen} + {steps} new tokens > the engine's max_len {self.max_len}")
        gen = _device_generator(generator, self.device)
        self.refresh()
        index = torch.arange(n_prompts).repeat_interleave(g)
        dev_index = index.to(self.device)
        ids, mask = p_ids.to(self.device), p_mask.to(self.device)
        if settings.share_prompt:
            source = dev_index
        else:
            ids, mask = ids[dev_index], mask[dev_index]
            source = torch.arange(n, device=self.device)
        self._valid[:n].zero_()
        self._valid[:n, :plen] = mask[source].bool()
        t_prefill = time.perf_counter()
        logits = self._prefill(ids, mask, source)
        if settings.share_prompt:
            logits = logits[dev_index]
        real_len = self._valid[:n, :plen].sum(-1)

        tokens = torch.full((n, steps), settings.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(n, steps, dtype=torch.float32, device=self.device)
        entropies = torch.zeros(n, steps, dtype=torch.float32, device=self.device)
        alive = torch.zeros(n, steps, dtype=torch.bool, device=self.device)
        finished = torch.zeros(n, dtype=torch.bool, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_decode = time.perf_counter()
        done = 0
        for step in range(steps):
            tok, lp, ent = sample_next(logits, settings.temperature, settings.top_k, settings.top_p, gen)
            tok = tok.masked_fill(finished, settings.pad_id)
            tokens[:, step], logprobs[:, step], entropies[:, step] = tok, lp, ent
            alive[:, step] = ~finished
            finished |= torch.isin(tok, stops)
            done = step + 1
            if step == steps - 1 or ((step + 1) % self.check_every == 0 and bool(finished.all())):
                break
            slot = plen + step
            self._tok[:n].copy_(tok)
            torch.add(real_len, step, out=self._pos[:n])
            self._valid[:n, slot] = True
            self._slot.fill_(slot)
            logits = self._decode(n, self._bucket(slot))
        mask_out = alive[:, :done].cpu()
        comp = tokens[:, :done].cpu()
        t_end = time.perf_counter()
        lengths = mask_out.sum(-1)
        has = lengths > 0
        last = comp[torch.arange(n), (lengths - 1).clamp(min=0)]
        fin = torch.zeros(n, dtype=torch.bool)
        fin[has] = torch.isin(last[has], stops.cpu())
        self.stats = {"prefill_s": t_decode - t_prefill, "decode_s": t_end - t_decode, "steps": done,
                      "rows": n, "tokens": int(lengths.sum()), "graphs": len(self._graphs)}
        return RolloutBatch(
            prompt_ids=p_ids, prompt_mask=p_mask, prompt_index=index, completion_ids=comp,
            completion_mask=mask_out.long(), logprobs=logprobs[:, :done].cpu() * mask_out,
            entropies=entropies[:, :done].cpu() * mask_out, finished=fin, elapsed_s=time.perf_counter() - t0,
            extra={"engine": dict(self.stats)},
        )


def _device_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """The generator to sample with on `device`: the caller's if it lives there, else one seeded
    from it (deterministic: a resumed run that restores the caller's state draws the same)."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def engine_rollouts(model, prompt_ids: Sequence[Sequence[int]], settings: RolloutSettings,
                    generator: torch.Generator | None = None) -> RolloutBatch:
    """`rollout_fn` for the trainer: the model's engine (built on first use, rebuilt when the
    request outgrows it or the model's layers were replaced) generates the batch."""
    rows = len(prompt_ids) * settings.num_generations
    length = max(len(p) for p in prompt_ids) + settings.max_new_tokens
    engine = model.__dict__.get("_qerl_rollout_engine")
    first_q = model.get_base_model().model.layers[0].self_attn.q_proj if hasattr(model, "get_base_model") else model.model.layers[0].self_attn.q_proj
    if engine is None or engine.max_batch < rows or engine.max_len < length or engine.layers[0].qkv.modules[0] is not first_q:
        model.__dict__.pop("_qerl_rollout_engine", None)
        engine = RolloutEngine(model, max_batch=rows, max_len=-(-length // LENGTH_BUCKET) * LENGTH_BUCKET)
        model.__dict__["_qerl_rollout_engine"] = engine
    return engine.generate(prompt_ids, settings, generator)
