"""Save and load quantised models as safetensors, in the compressed-tensors layout.

A checkpoint directory holds:
- model.safetensors   every tensor of the model; decoder linears as weight_packed /
                      weight_scale / weight_global_scale (nvfp4) or weight_packed /
                      weight_scale (mxfp4), exactly as compressed-tensors names them;
- config.json         the model config, with compressed-tensors' `quantization_config`
                      (formats nvfp4-pack-quantized, mxfp4-pack-quantized) so that
                      compressed-tensors, transformers and vLLM can read nvfp4/mxfp4 checkpoints;
                      nf4 uses a qerl-specific block ({"quant_method": "qerl", "format": "nf4"});
- tokenizer files;
- qerl_checkpoint.json  format, quantised module names, options; written last, so its presence
                      marks a complete checkpoint (a crashed save is not mistaken for one).

Loading never unpickles: safetensors only. Checkpoints written by llm-compressor (NVFP4A16 /
MXFP4A16) load too, since they share the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import qerl
from qerl.formats import COMPRESSED_TENSORS_FORMAT, FormatError, check_format
from qerl.nn.quant_linear import QuantLinear

WEIGHTS = "model.safetensors"
MARKER = "qerl_checkpoint.json"
_CT_PRESET = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}


def quantization_config(fmt: str, ignore: list[str], double_quant: bool = False) -> dict | None:
    """The config.json block for a format (None for bf16)."""
    if fmt == "bf16":
        return None
    if fmt == "nf4":
        return {"quant_method": "qerl", "format": "nf4", "group_size": 64, "double_quant": double_quant, "ignore": ignore}
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(_CT_PRESET[fmt], ["Linear"])
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=COMPRESSED_TENSORS_FORMAT[fmt],
        quantization_status="compressed",
        ignore=ignore,
    )
    return qc.model_dump(mode="json")


def _dedup_tied(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = v.data_ptr()
        if v.numel() and ptr in seen:
            continue  # tied (lm_head == embed_tokens): stored once, re-tied on load
        seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out


def save_quantized(model: nn.Module, tokenizer, out_dir: str | Path, fmt: str, options: dict | None = None) -> Path:
    check_format(fmt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    quantised = sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear))
    from qerl.quantize import decoder_linears

    left_bf16 = sorted(n for n in decoder_linears(model) if n not in quantised)
    options = dict(options or {})
    save_file(_dedup_tied(model, model.state_dict()), str(out / WEIGHTS), metadata={"format": "pt", "qerl_format": fmt})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    qc = quantization_config(fmt, ["lm_head", *left_bf16], bool(options.get("nf4_double_quant")))
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    marker = {"format": fmt, "quantized_modules": quantised, "options": options, "qerl_version": qerl.__version__}
    (out / MARKER).write_text(json.dumps(marker, indent=2))
    return out


def is_complete(path: str | Path) -> bool:
    return (Path(path) / MARKER).exists() and (Path(path) / WEIGHTS).exists()


def _read_meta(path: Path) -> tuple[str, list[str] | None, dict]:
    """(format, quantised module names or None = every decoder linear not ignored, options)."""
    if (path / MARKER).exists():
        m = json.loads((path / MARKER).read_text())
        return check_format(m["format"]), m["quantized_modules"], m.get("options", {})
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if qc is None:
        return "bf16", [], {}
    by_ct = {v: k for k, v in COMPRESSED_TENSORS_FORMAT.items()}
    if qc.get("format") in by_ct:
        return by_ct[qc["format"]], None, {}
    raise FormatError(f"{path}: unsupported quantization_config format {qc.get('format')!r}")


def _empty_model(config) -> nn.Module:
    """The model skeleton without random initialisation (every tensor is loaded next)."""
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    from qerl.threads import INIT_LOCK

    with INIT_LOCK, no_init_weights():  # the window patches torch.nn.init in every thread
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def load_quantized(path: str | Path, device: str | torch.device = "cpu", backend: str = "auto"):
    """-> (model in eval mode, tokenizer or None). Validates tensors against the config."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").exists() or not (path / WEIGHTS).exists():
        raise FormatError(f"{path} is not a qerl/compressed-tensors checkpoint (needs config.json and {WEIGHTS})")
    fmt, modules, options = _read_meta(path)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = _empty_model(config)
    from qerl.quantize import decoder_linears

    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        keys = set(f.keys())
        state = {k: f.get_tensor(k) for k in keys}
    if modules is None:  # e.g. an llm-compressor checkpoint: whatever has weight_packed
        modules = sorted(n for n in decoder_linears(model) if f"{n}.weight_packed" in keys)
    for name in modules:
        lin = model.get_submodule(name)
        q = QuantLinear(
            lin.in_features, lin.out_features, fmt, bias=lin.bias is not None,
            double_quant=bool(options.get("nf4_double_quant")), backend=backend,
        )
        for tname, buf in q.quant_tensors().items():
            key = f"{name}.{tname}"
            if key not in state:
                raise FormatError(f"{path}: config says {fmt} but tensor {key} is missing")
            t = state[key]
            if t.shape != buf.shape or t.dtype != buf.dtype:
                raise FormatError(
                    f"{path}: config says {fmt} but {key} is {tuple(t.shape)} {t.dtype}, expected {tuple(buf.shape)} {buf.dtype}"
                )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise FormatError(f"{path}: tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if tied:
        model.tie_weights()
    tok = None
    if (path / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(path)
    return model.to(device).eval(), tok
