"""Batched text generation for evaluation, with per-token policy entropy.

`generate(model, tokenizer, prompts, settings)` runs its own decode loop over a Hugging Face
causal LM (KV cache, left padding, greedy or temperature / top-k / top-p sampling) and returns
one `Generation` per prompt: the text up to the first stop token, its token ids (the stop token
included), and the mean entropy (nats) of softmax(logits / T) over those tokens (T = 1 for
greedy), measured on the raw logits before top-k / top-p truncation. That entropy is how we
check the paper's claim that quantised weights raise the policy's sampling entropy.

Its own loop (rather than `model.generate`) keeps memory flat (no [steps, batch, vocab] logits
kept), draws samples from a private `torch.Generator` (no global RNG side effects) and is not
steered by a checkpoint's `generation_config` defaults. With `engine: qerl` (the default) the
batches run through the rollout engine of `qerl/rollout` for the model types it supports (the
same tokens under greedy decoding; sampling draws one uniform per token, so sampled texts differ
from the `hf` loop's for the same seed); `engine: hf` keeps this module's loop.

Try it:  pytest tests/test_generate.py -q
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Literal, Sequence

import pydantic
import torch
from tqdm.auto import tqdm

_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class GenerationSettings(pydantic.BaseModel, extra="forbid"):
    """Decoding settings. temperature 0 means greedy decoding."""

    max_new_tokens: int = pydantic.Field(256, ge=1)
    temperature: float = pydantic.Field(0.0, ge=0.0)
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0)
    top_k: int = pydantic.Field(0, ge=0)  # 0 = no top-k truncation
    num_samples: int = pydantic.Field(1, ge=1)  # samples per problem (pass@1 averaged over them)
    batch_size: int = pydantic.Field(8, ge=1)
    seed: int = pydantic.Field(0, ge=0)
    # "qerl": the rollout engine (qerl/rollout: static KV cache, CUDA graphs, fused 4-bit decode)
    # for the model types it supports; "hf": this module's Hugging Face KV-cache loop
    engine: Literal["qerl", "hf"] = "qerl"

    @pydantic.model_validator(mode="after")
    def _check(self) -> "GenerationSettings":
        if self.num_samples > 1 and self.temperature == 0.0:
            raise ValueError(
                "num_samples > 1 needs temperature > 0 (greedy decoding gives the same sample every time)"
            )
        return self

    @property
    def do_sample(self) -> bool:
        return self.temperature > 0.0


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    num_tokens: int
    mean_entropy: float
    finished: bool  # True if it ended with a stop token, False if cut at max_new_tokens
    token_entropies: list[float] = field(default_factory=list, repr=False)


# ----------------------------------------------------------------------------- prompts and tokens

_INSTRUCTIONS = {
    "gsm8k": "Let's think step by step and output the final answer after \"####\".",
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
}


def instruction_for(benchmark: str) -> str:
    """The answer-format instruction appended to a question of `benchmark`."""
    return _INSTRUCTIONS["gsm8k" if benchmark == "gsm8k" else "math"]


def build_prompt(tokenizer, question: str, benchmark: str) -> str:
    """The chat-formatted prompt (generation prompt added) asking for step-by-step reasoning
    (for the generated "arith" task: its short-answer few-shot prompt, qerl.rl.arith)."""
    if benchmark == "arith":
        from qerl.rl.arith import build_arith_prompt

        return build_arith_prompt(tokenizer, question)
    content = f"{question.strip()}\n{instruction_for(benchmark)}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    warnings.warn("tokenizer has no chat template: using the plain question as the prompt", stacklevel=2)
    return content + "\n"


def _token_id(tokenizer, token: str) -> int | None:
    """Id of `token` if the vocabulary has it (unknown tokens map to unk: rejected by the round trip)."""
    try:
        i = tokenizer.convert_tokens_to_ids(token)
        if i is None or isinstance(i, list) or tokenizer.convert_ids_to_tokens(int(i)) != token:
            return None
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return int(i)


def stop_token_ids(tokenizer) -> list[int]:
    """eos id(s) plus <|im_end|>, <|endoftext|> and <|eot_id|> where the vocabulary has them.

    (The SmolLM2 GGUF tokenizer reports eos "<|im_start|>", so "<|im_end|>" must be added.)
    """
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for i in eos if isinstance(eos, (list, tuple)) else [eos]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    for tok in _STOP_TOKENS:
        i = _token_id(tokenizer, tok)
        if i is not None and i not in ids:
            ids.append(i)
    return ids


def _model_stop_ids(model) -> list[int]:
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _accepts_kwarg(model, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


# ----------------------------------------------------------------------------- decoding


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).nan_to_num().sum(dim=-1)


def _sample(logits: torch.Tensor, settings: GenerationSettings, generator) -> torch.Tensor:
    """Draw one token per row from softmax(logits / T) after top-k / top-p truncation."""
    from qerl.rollout.sampling import truncate

    scores = truncate(logits / settings.temperature, settings.top_k, settings.top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _forward(model, **kwargs) -> tuple[torch.Tensor, object]:
    out = model(**kwargs)
    return out.logits[:, -1, :].float(), out.past_key_values


def _generate_batch(
    model,
    seqs: list[list[int]],
    settings: GenerationSettings,
    stop_ids: torch.Tensor,
    pad_id: int,
    generator,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode one left-padded batch. Returns tokens [B, S], entropies [B, S], alive [B, S]."""
    bsz, width = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attention = torch.zeros((bsz, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        attention[i, width - len(s) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)

    prefill = dict(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=True)
    if _accepts_kwarg(model, "logits_to_keep"):
        prefill["logits_to_keep"] = 1  # only the last position's logits: no [B, L, vocab] tensor
    logits, cache = _forward(model, **prefill)

    temperature = settings.temperature if settings.do_sample else 1.0
    next_pos = position_ids[:, -1:] + 1
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    tokens, entropies, alive = [], [], []
    for step in range(settings.max_new_tokens):
        entropies.append(_entropy(logits / temperature))
        tok = _sample(logits, settings, generator) if settings.do_sample else logits.argmax(dim=-1)
        tok = tok.masked_fill(finished, pad_id)
        tokens.append(tok)
        alive.append(~finished)
        finished = finished | torch.isin(tok, stop_ids)
        if step == settings.max_new_tokens - 1 or bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones((bsz, 1), dtype=attention.dtype, device=device)], dim=-1)
        logits, cache = _forward(
            model,
            input_ids=tok[:, None],
            attention_mask=attention,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        next_pos = next_pos + 1
    return torch.stack(tokens, 1).cpu(), torch.stack(entropies, 1).cpu(), torch.stack(alive, 1).cpu()


def _engine_batch(model, seqs, settings: GenerationSettings, stops: list[int], pad_id: int, generator):
    """One batch through the rollout engine (kept on the model between batches and calls):
    the same tokens [B, S], entropies [B, S] and alive mask [B, S] as `_generate_batch`."""
    from qerl.rl.rollout import RolloutSettings
    from qerl.rollout.engine import engine_rollouts

    rs = RolloutSettings(num_generations=1, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                         top_p=settings.top_p, top_k=settings.top_k, stop_ids=stops, pad_id=pad_id, share_prompt=False)
    out = engine_rollouts(model, seqs, rs, generator)
    return out.completion_ids, out.entropies, out.completion_mask.bool()


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    settings: GenerationSettings | None = None,
    progress: bool = True,
) -> list[Generation]:
    """Generate one completion per prompt (settings.num_samples is applied by the evaluator).

    Prompts are tokenized without extra special tokens (the chat template has them), sorted by
    length into batches of settings.batch_size, left padded, and decoded until every row hit a
    stop token or max_new_tokens. Results come back in the order of `prompts`. Sampling is
    seeded with settings.seed through a private torch.Generator, so a run is reproducible for
    the same prompts, settings and hardware.
    """
    settings = settings or GenerationSettings()
    prompts = list(prompts)
    if not prompts:
        return []
    device = _model_device(model)
    stops = stop_token_ids(tokenizer)
    stops += [i for i in _model_stop_ids(model) if i not in stops]
    if not stops:
        raise ValueError("the tokenizer has no eos token and no <|im_end|>/<|endoftext|>: cannot tell where to stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    stop_tensor = torch.tensor(stops, dtype=torch.long, device=device)
    stop_set = set(stops)

    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization")
    order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
    batches = [order[i : i + settings.batch_size] for i in range(0, len(order), settings.batch_size)]

    generator = None
    if settings.do_sample:
        generator = torch.Generator(device=device)
        generator.manual_seed(settings.seed)

    from qerl.rollout.engine import supports

    use_engine = settings.engine == "qerl" and supports(model)
    results: list[Generation | None] = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in tqdm(batches, desc="generate", unit="batch", disable=not progress):
                seqs = [encoded[i] for i in batch]
                if use_engine:
                    toks, ents, alive = _engine_batch(model, seqs, settings, stops, pad_id, generator)
                else:
                    toks, ents, alive = _generate_batch(model, seqs, settings, stop_tensor, pad_id, generator, device)
                for row, idx in enumerate(batch):
                    n = int(alive[row].sum())
                    ids = toks[row, :n].tolist()
                    ent = ents[row, :n]
                    done = bool(ids) and ids[-1] in stop_set
                    text_ids = ids[:-1] if done else ids
                    results[idx] = Generation(
                        text=tokenizer.decode(text_ids, skip_special_tokens=True),
                        token_ids=ids,
                        num_tokens=n,
                        mean_entropy=float(ent.mean()) if n else 0.0,
                        finished=done,
                        token_entropies=ent.tolist(),
                    )
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


__all__ = [
    "Generation",
    "GenerationSettings",
    "build_prompt",
    "generate",
    "instruction_for",
    "stop_token_ids",
]
