"""Shared test fixtures: the offline data directory, a local Qwen2 tokenizer, a tiny Llama.

- `data_dir`: /work/shared/data (found next to the checkout) or $QERL_DATA_DIR; skips if absent.
- `tiny_tokenizer`: a Qwen2 byte-level BPE tokenizer built from shared/tokenizers/qwen2
  (vocab.json + merges.txt) with <|endoftext|>=151643, <|im_start|>=151644, <|im_end|>=151645
  and a ChatML chat template. No hub access.
- `tiny_model`: a randomly initialised 2-layer Llama (hidden 64) over that vocabulary, float32,
  eval mode, fixed seed. Tests that change it must work on a copy (copy.deepcopy).
- `--shard I/N`: run only the I-th of N interleaved parts of the collected tests (every N-th test
  from the I-th), so a test set longer than one machine's time limit (the GPU files take ~19 min on
  an H100) runs as N calls: `pytest tests/test_kernels_gpu.py --shard 1/3`, then 2/3 and 3/3.
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


@pytest.fixture
def qwen3b_policy(monkeypatch):
    """make(fmt, layers, rank, alpha) -> (policy, GRPOSettings): a Qwen2.5-3B-shaped model cut to
    `layers` decoder layers, built in `fmt` on the GPU with frozen weights, prepared by the trainer
    (LoRA, fused training ops, gradient checkpointing; micro-batches of 4)."""

    def make(fmt: str, layers: int, rank: int, alpha: int):
        from qerl import model as qmodel
        from qerl.build import build_model
        from qerl.nn.lora import LoraSettings
        from qerl.rl.grpo import GRPOSettings
        from qerl.rl.trainer import prepare_policy

        name = f"qwen2.5-3b-l{layers}"
        monkeypatch.setitem(qmodel.QWEN_PRESETS, name, {**qmodel.QWEN_PRESETS["qwen2.5-3b"], "num_hidden_layers": layers})
        model = build_model(f"random:{name}", fmt, "cuda", seed=0, progress=False)
        for p in model.parameters():
            p.requires_grad_(False)
        settings = GRPOSettings(num_generations=4, per_device_train_batch_size=4, gradient_checkpointing=True)
        return prepare_policy(model, settings, LoraSettings(r=rank, lora_alpha=alpha)), settings

    return make


@pytest.fixture(autouse=True)
def _autograd_stays_on():
    """Every test starts with autograd on, whatever an earlier test (or a library it imported:
    lighteval switches it off at import) left behind."""
    import torch

    torch.set_grad_enabled(True)
    yield


def shard_spec(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 1 <= I <= N; anything else raises ValueError with one line saying why."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N, e.g. 1/3 (got {text!r})") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {text}: I must be between 1 and N")
    return i, n


def shard_items(items: list, i: int, n: int) -> tuple[list, list]:
    """(kept, deselected): every n-th item from the i-th (1-based). Interleaved rather than contiguous,
    so a file's slow parametrisations spread over the shards; the n shards cover every item once."""
    kept = [it for j, it in enumerate(items) if j % n == i - 1]
    return kept, [it for j, it in enumerate(items) if j % n != i - 1]


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N interleaved parts of the collected tests (e.g. 1/3)")


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    try:
        i, n = shard_spec(spec)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    kept, dropped = shard_items(items, i, n)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
