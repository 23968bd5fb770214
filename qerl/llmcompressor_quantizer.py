"""The llm-compressor quantizer: llm-compressor's `oneshot` with the NVFP4A16 / MXFP4A16
scheme (weight-only, lm_head ignored, no calibration data: weight-only FP4 schemes need none).

    qerl quantize --quantizer llm-compressor ...

Our own quantizer (qerl.quantize) stays the default: it needs no llm-compressor install and also
covers nf4. Both write the same compressed-tensors checkpoint; tests/test_quantize.py proves the
tensors are identical. llm-compressor is an optional extra (`pip install qerl[llmcompressor]`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from torch import nn

import qerl
from qerl.formats import FormatError

SCHEMES = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}


def quantize_with_llmcompressor(model: nn.Module, tokenizer, out_dir: str | Path, fmt: str) -> Path:
    """Quantise `model` in place with llm-compressor and save it to out_dir (compressed)."""
    if fmt not in SCHEMES:
        raise FormatError(f"the llm-compressor quantizer handles {', '.join(SCHEMES)}, not {fmt!r}")
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError:
        raise FormatError("the llm-compressor quantizer needs llmcompressor: pip install 'qerl[llmcompressor]'") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # oneshot re-reads the config from model.config.name_or_path; a model built in memory
    # (random, or the embedded GGUF) has no such directory, so give it a bf16 copy to read.
    source = Path(getattr(model.config, "name_or_path", "") or "")
    tmp_source = None
    if not (source / "config.json").exists():
        from qerl.checkpoint import save_quantized

        tmp_source = Path(tempfile.mkdtemp(prefix="qerl-lc-src-"))
        save_quantized(model, None, tmp_source, "bf16")
        model.config._name_or_path = str(tmp_source)
    try:
        recipe = QuantizationModifier(targets="Linear", scheme=SCHEMES[fmt], ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(out, save_compressed=True)
    finally:
        if tmp_source is not None:
            shutil.rmtree(tmp_source, ignore_errors=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    from qerl.checkpoint import MARKER
    from qerl.quantize import decoder_linears

    marker = {
        "format": fmt,
        "quantized_modules": sorted(n for n, m in model.named_modules() if hasattr(m, "weight_packed") or n in decoder_linears(model)),
        "options": {"quantizer": "llm-compressor"},
        "qerl_version": qerl.__version__,
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2))
    return out
