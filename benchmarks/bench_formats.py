"""Format accuracy and storage, measured: relative RMS error on Gaussian weights, and bits per
weight read back from the saved checkpoint of the embedded model.

    python benchmarks/bench_formats.py --out benchmarks/results/formats.json

Rows: {format, rel_rms_error, bits_per_weight, checkpoint_bytes}. bits_per_weight counts the
bytes the checkpoint stores for the decoder linear layers (codes, group scales, global scales)
over their number of weights; checkpoint_bytes is the size of model.safetensors (embeddings,
norms and lm_head included, in bf16). CPU only; ~1 minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from qerl import FORMATS
from qerl.checkpoint import WEIGHTS, save_quantized
from qerl.formats import dequantize_weight, quantize_weight
from qerl.model import ModelSpec, load_model
from qerl.quantize import decoder_linears, quantize_


def rel_rms_error(fmt: str, shape=(4096, 4096), seed=0, **options) -> float:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    err = dequantize_weight(quantize_weight(w, fmt, **options), fmt, torch.float32) - w
    return (err.norm() / w.norm()).item()


def checkpoint_bits(path: Path, linear_names: list[str], n_weights: int) -> float:
    nbytes = 0
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        for key in f.keys():
            if key.rsplit(".", 1)[0] in linear_names:
                t = f.get_slice(key)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                nbytes += numel * torch.empty(0, dtype=f.get_tensor(key).dtype).element_size()
    return 8 * nbytes / n_weights


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/formats.json")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            model, tok = load_model(ModelSpec())
            linears = decoder_linears(model)
            names = list(linears)
            n_weights = sum(m.weight.numel() for m in linears.values())
            quantize_(model, fmt, progress=False)
            path = save_quantized(model, tok, Path(tmp) / fmt, fmt)
            rows.append(
                {
                    "format": fmt,
                    "rel_rms_error": round(rel_rms_error(fmt), 5),
                    "bits_per_weight": round(checkpoint_bits(path, names, n_weights), 4),
                    "checkpoint_bytes": (path / WEIGHTS).stat().st_size,
                }
            )
            print(rows[-1], flush=True)
    result = {
        "date": dt.date.today().isoformat(),
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "torch": torch.__version__,
        "model": "embedded SmolLM2-135M-Instruct (30 layers x 7 linears)",
        "gaussian_shape": [4096, 4096],
        "mxfp4_floor_rule_rel_rms_error": round(rel_rms_error("mxfp4", scale_rule="floor"), 5),
        "nf4_double_quant_rel_rms_error": round(rel_rms_error("nf4", double_quant=True), 5),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print("\n| format | rel. RMS error | bits/weight | checkpoint bytes |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['rel_rms_error']:.4f} | {r['bits_per_weight']:.3f} | {r['checkpoint_bytes']:,} |")


if __name__ == "__main__":
    main()
