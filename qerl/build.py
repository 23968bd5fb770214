"""build_model: build a causal LM directly in a 4-bit format, one decoder layer at a time.

A full bf16 copy of a large model (Qwen2.5-32B: 61 GiB) never exists: the model is created
on the meta device, the parts outside the decoder layers (embeddings, final norm, lm_head,
rotary embedding) are materialised on `device`, and then each decoder layer in turn is
materialised in bf16, filled (random init or its tensors from a safetensors checkpoint) and
its linears quantised in place before the next layer is touched. Peak memory = the model
built so far (already 4-bit) + one decoder layer in bf16.
Seen on an H100: random:qwen2.5-32b in nvfp4 built in 7 s, 19.4 GiB allocated at the end,
19.4 + 2.6 GiB at the peak (one bf16 layer, 0.9 GiB, plus quantisation temporaries).

    model = build_model("random:qwen2.5-32b", "nvfp4", "cuda")      # random weights, seeded
    model = build_model("/models/Qwen2.5-7B-Instruct", "nf4")        # local safetensors dir
    model = build_model("Qwen/Qwen2.5-7B-Instruct", "mxfp4", "cuda") # hub id (downloads)

build_model(source, fmt, device="cpu", *, dtype=torch.bfloat16, seed=0, backend="auto",
            progress=True, on_layer=None, revision=None, summary=None,
            allow_bf16_fallback=False, mxfp4_scale_rule="ct", nf4_double_quant=False)

- source: "random:<preset>" (qerl.model.random_config presets), a local directory with
  config.json + safetensors weights (model.safetensors, or shards listed in
  model.safetensors.index.json), or a hub id (snapshot_download of json/safetensors/tokenizer
  files only). Pickles are never read; trust_remote_code stays off.
- fmt: bf16 | nf4 | mxfp4 | nvfp4. bf16 builds the same way without quantising.
- dtype: the model's dtype (from_config's `dtype`): its compute dtype and that of every
  tensor that is not a packed 4-bit one (the rotary inv_freq stays float32, as in HF).
- seed: random sources only; decoder layer i draws from its own generator on `device`,
  seeded from (seed, i), so a layer's weights do not depend on the others (they do depend
  on the device type: CPU and CUDA generators differ).
- the quantisation options are quantize_'s, with the same meaning (`allow_bf16_fallback`
  keeps linears whose input dimension the group size does not divide in bf16; without it
  such a model is refused with quantize_'s FormatError before anything is allocated).
  They are explicit keywords, so a misspelt option is a TypeError, not silently ignored.
- on_layer(i, model) is called after decoder layer i is filled and quantised.
- revision: a hub id's branch, tag or commit (snapshot_download's revision).
- summary: a QuantSummary of `fmt` to fill with the quantised and skipped layers (what
  quantize_ returns); the pipeline's quantize step logs it.

The result is in eval mode, with no meta tensors left, and has the structure that
load_model + quantize_ give (same module tree, state_dict names and dtypes, tied lm_head),
so qerl.nn.lora.apply_lora, the rollout engine and qerl.checkpoint.save_quantized take it.
From a checkpoint it is bit-identical to from_pretrained + quantize_ (tests/test_build.py).

Run the tests: .venv/bin/python -m pytest tests/test_build.py -q
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qerl.formats import check_format
from qerl.model import ModelError, random_config
from qerl.quantize import QuantSummary, check_group_sizes, decoder_linears, quantize_linears_
from qerl.threads import INIT_LOCK

# What a hub download fetches: configs, weights, tokenizer files. Never *.bin / *.pt pickles.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

__all__ = ["HUB_PATTERNS", "build_model"]


def build_model(
    source: str,
    fmt: str,
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    backend: str = "auto",
    progress: bool = True,
    on_layer: Callable[[int, nn.Module], None] | None = None,
    revision: str | None = None,
    summary: QuantSummary | None = None,
    allow_bf16_fallback: bool = False,
    mxfp4_scale_rule: str = "ct",
    nf4_double_quant: bool = False,
) -> nn.Module:
    check_format(fmt)
    device = torch.device(device)
    if summary is not None and summary.format != fmt:
        raise ValueError(f"summary is for {summary.format}, the build for {fmt}")
    config, directory = _resolve(source, revision)
    model = _skeleton(config, dtype)
    layers_name, layers = _decoder_layers(model)
    # refuse an unquantisable shape now, as quantize_ would, before anything is allocated
    skip = check_group_sizes(decoder_linears(model), fmt, allow_bf16_fallback)
    summary = summary if summary is not None else QuantSummary(format=fmt)
    in_layers = f"{layers_name}."
    with contextlib.ExitStack() as stack, torch.no_grad():
        if directory is None:
            fill = _RandomFill(config, seed, device)
        else:
            fill = _CheckpointFill(directory, device, stack)
        base = [(n, m) for n, m in model.named_modules() if n != layers_name and not n.startswith(in_layers)]
        base_memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        _materialise(model, base, device, base_memo, fill, key="base")

        bar = range(len(layers))
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(bar, desc=f"build {fmt}", unit="layer", leave=False)
        for i in bar:
            prefix = f"{layers_name}.{i}"
            _materialise(model, list(layers[i].named_modules(prefix=prefix)), device, dict(base_memo), fill, key=i)
            if fmt != "bf16":
                # quantize_'s choice of linears (decoder_linears), within this layer; the dict
                # is consumed, so each bf16 linear is freed as soon as it is replaced
                linears = {n: m for n, m in decoder_linears(model).items() if n.startswith(prefix + ".")}
                quantize_linears_(
                    model, linears, fmt, summary, skip=skip, mxfp4_scale_rule=mxfp4_scale_rule,
                    nf4_double_quant=nf4_double_quant, backend=backend,
                )
            if on_layer is not None:
                on_layer(i, model)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:  # a module of an architecture we do not know how to fill
        raise ModelError(f"build_model left {len(left)} tensors unmaterialised, first {left[0]}")
    if directory is not None and (directory / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model.eval()


# ---- source -> (config, checkpoint directory or None) -------------------------------------


def _resolve(source: str, revision: str | None = None):
    if source.startswith("random:"):
        return random_config(source.split(":", 1)[1]), None
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model path {path} is not a directory")
    elif source.startswith((".", "/", "~")) or source.strip("/").count("/") > 1:
        raise ModelError(f"model directory {source} does not exist")
    else:
        path = _download(source, revision)
    return _local_config(path), path


def _download(repo: str, revision: str | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(f"cannot download {repo!r} from the Hugging Face hub: {type(e).__name__}: {first}") from None


def _local_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelError(f"no config.json in {path}")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"no *.safetensors weights in {path} (only safetensors are loaded, never pickles)")
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read the config in {path}: {first}") from None


# ---- skeleton ------------------------------------------------------------------------------


def _skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device: shapes, dtypes, module tree and tied weights, no storage."""
    from transformers import AutoModelForCausalLM

    try:
        with INIT_LOCK, torch.device("meta"):  # qerl.threads: why the lock
            return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot build a causal LM from this config: {first}") from None


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.rsplit(".", 1)[-1] == "layers"]
    if len(found) != 1:
        raise ModelError(f"expected one decoder `layers` list in {type(model).__name__}, found {len(found)}")
    return found[0]


# ---- materialise + fill --------------------------------------------------------------------


def _materialise(model, modules, device, memo, fill, key) -> None:
    """Give the meta tensors owned directly by `modules` (qualified name, module) storage on
    `device` and fill them. Tensors shared in the skeleton (a tied lm_head) stay shared:
    `memo` maps id(meta tensor) -> (meta tensor, its replacement)."""
    entries: dict[int, list] = {}  # id(new tensor) -> [tensor, [(qualified name, owner, attr)]]
    computed = []  # modules with non-persistent buffers (rotary inv_freq): computed, not read
    for mname, mod in modules:
        for store, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for attr, t in store.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in memo:
                    new = torch.empty_like(t, device=device)
                    if is_param:
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    memo[id(t)] = (t, new)
                new = memo[id(t)][1]
                store[attr] = new
                qualified = f"{mname}.{attr}" if mname else attr
                if not is_param and attr in mod._non_persistent_buffers_set:
                    if mod not in computed:
                        computed.append(mod)
                    continue
                entries.setdefault(id(new), [new, []])[1].append((qualified, mod, attr))
    for mod in computed:
        _compute_buffers(model, mod)
    fill(key, [(t, owners) for t, owners in entries.values()])


def _compute_buffers(model, mod: nn.Module) -> None:
    """Non-persistent buffers are not in checkpoints; their module's __init__ computed them
    (on meta, so no values). HF's own _init_weights recomputes them (the rotary embedding's
    inv_freq, as from_pretrained does). NaN first, so a buffer it does not know stays
    detectable instead of holding uninitialised memory."""
    bufs = {n: b for n, b in mod._buffers.items() if n in mod._non_persistent_buffers_set and b is not None}
    for b in bufs.values():
        if b.is_floating_point():
            b.fill_(float("nan"))
    model._init_weights(mod)
    for n, b in bufs.items():
        if not b.is_floating_point() or torch.isnan(b).any():
            raise ModelError(f"cannot compute buffer {n} of {type(mod).__name__} (not in checkpoints, no HF init)")


def _layer_seed(seed: int, key) -> int:
    digest = hashlib.sha256(f"qerl.build:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _RandomFill:
    """HF's init for Llama/Qwen2: Linear and Embedding weights N(0, initializer_range), biases
    0, norm weights 1, the embedding's padding row 0; one generator per layer (and one for
    the rest), seeded from (seed, layer)."""

    def __init__(self, config, seed: int, device: torch.device):
        self.std = getattr(config, "initializer_range", None) or 0.02
        self.seed, self.device = seed, device

    def __call__(self, key, tensors) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(_layer_seed(self.seed, key))
        for t, owners in tensors:
            name, mod, attr = owners[0]
            if attr == "bias":
                t.zero_()
            elif attr == "weight" and isinstance(mod, (nn.Linear, nn.Embedding)):
                t.normal_(0.0, self.std, generator=gen)
                if isinstance(mod, nn.Embedding) and mod.padding_idx is not None:
                    t[mod.padding_idx].zero_()
            elif attr == "weight" and "Norm" in type(mod).__name__:
                t.fill_(1.0)
            else:
                raise ModelError(f"no random init for {name} ({type(mod).__name__}.{attr})")


class _CheckpointFill:
    """Reads each tensor by its name from the safetensors file that holds it (safe_open on
    `device`, one tensor at a time). A tied tensor is read under any of its names."""

    def __init__(self, directory: Path, device: torch.device, stack: contextlib.ExitStack):
        self.directory, self.stack = directory, stack
        self.device = str(device) if device.type != "cuda" or device.index is not None else f"cuda:{torch.cuda.current_device()}"
        self.where = _weight_map(directory)
        self.handles: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self.handles:
            from safetensors import safe_open

            path = self.directory / file
            if not path.is_file():
                raise ModelError(f"checkpoint shard {path} is missing")
            self.handles[file] = self.stack.enter_context(safe_open(str(path), framework="pt", device=self.device))
        return self.handles[file]

    def __call__(self, key, tensors) -> None:
        for t, owners in tensors:
            names = [name for name, _, _ in owners]
            name = next((n for n in names if n in self.where), None)
            if name is None:
                raise ModelError(f"checkpoint {self.directory} has no tensor {names[0]}")
            f = self._handle(self.where[name])
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(t.shape):
                raise ModelError(f"checkpoint tensor {name} has shape {shape}, the model expects {tuple(t.shape)}")
            src = f.get_tensor(name)
            t.copy_(src)
            del src


def _weight_map(directory: Path) -> dict[str, str]:
    """tensor name -> safetensors file name (relative to `directory`)."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"unreadable {index}: {type(e).__name__}: {e}") from None
    from safetensors import safe_open

    files = [directory / SINGLE_FILE] if (directory / SINGLE_FILE).is_file() else sorted(directory.glob("*.safetensors"))
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({k: path.name for k in f.keys()})
    return where
