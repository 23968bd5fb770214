"""Shared test fixtures: the offline data directory, a local Qwen2 tokenizer, a tiny Llama.

- `data_dir`: /work/shared/data (found next to the checkout) or $QERL_DATA_DIR; skips if absent.
- `tiny_tokenizer`: a Qwen2 byte-level BPE tokenizer built from shared/tokenizers/qwen2
  (vocab.json + merges.txt) with <|endoftext|>=151643, <|im_start|>=151644, <|im_end|>=151645
  and a ChatML chat template. No hub access.
- `tiny_model`: a randomly initialised 2-layer Llama (hidden 64) over that vocabulary, float32,
  eval mode, fixed seed. Tests that change it must work on a copy (copy.deepcopy).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def _first_existing(*candidates: Path | None) -> Path | None:
    for c in candidates:
        if c is not None and c.is_dir():
            return c
    return None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    env = os.environ.get("QERL_DATA_DIR")
    found = _first_existing(SHARED / "data", Path(env) if env else None)
    if found is None or not (found / "gsm8k" / "test.jsonl").is_file():
        pytest.skip("no offline data directory (shared/data next to the checkout, or QERL_DATA_DIR)")
    return found


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from transformers import Qwen2Tokenizer

    env = os.environ.get("QERL_TOKENIZER_DIR")
    tok_dir = _first_existing(SHARED / "tokenizers" / "qwen2", Path(env) if env else None)
    if tok_dir is None or not (tok_dir / "vocab.json").is_file():
        pytest.skip("no Qwen2 vocab.json/merges.txt (shared/tokenizers/qwen2 or QERL_TOKENIZER_DIR)")
    vocab = json.loads((tok_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = []
    with open(tok_dir / "merges.txt", encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if line and not line.startswith("#version"):
                merges.append(tuple(line.split(" ")))
    # eos/pad/unk = <|endoftext|> is added first (151643), then the two chat tokens in order.
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML_TEMPLATE
    got = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_IDS}
    assert got == QWEN_SPECIAL_IDS, got
    assert len(tok) == 151646
    return tok


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=QWEN_SPECIAL_IDS["<|im_end|>"],
        pad_token_id=QWEN_SPECIAL_IDS["<|endoftext|>"],
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.to(torch.float32).eval()
    return model


@pytest.fixture(autouse=True)
def _autograd_stays_on():
    """Every test starts with autograd on, whatever an earlier test (or a library it imported:
    lighteval switches it off at import) left behind."""
    import torch

    torch.set_grad_enabled(True)
    yield
