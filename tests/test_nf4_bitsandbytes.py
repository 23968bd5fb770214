"""The nf4 format against bitsandbytes, whose NF4 is QLoRA's: the same code book, and for the same weights the
same 4-bit codes, the same per-64 absmax and the same dequantised values, bit for bit (bitsandbytes' CPU path,
`quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=False)`). Two documented differences stay
out of the comparison (qerl/formats/nf4.py): bitsandbytes packs the first of two codes into the high nibble, we
into the low one; its double quantisation uses an 8-bit dynamic code, ours a linear int8 one.

bitsandbytes is a test reference only. `make setup` installs it into <venv>/reference-packages, off the
environment's import path (peft and transformers import it whenever they find it, and its CPU backend logs a
warning on import), and it runs here in a subprocess. QERL_REFERENCE_PACKAGES names another folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.formats import nf4
from qerl.formats.fp4 import unpack_nibbles

REFERENCE = Path(os.environ.get("QERL_REFERENCE_PACKAGES") or Path(sys.prefix) / "reference-packages")

pytestmark = pytest.mark.skipif(not (REFERENCE / "bitsandbytes").is_dir(),
                                reason=f"no bitsandbytes under {REFERENCE} (make setup installs it)")

BNB = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import load_file, save_file
    from bitsandbytes import functional as F

    out = {"codebook": F.get_4bit_type("nf4", device="cpu").float().contiguous()}
    for name, w in load_file(sys.argv[1]).items():
        packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        out[name + ".packed"] = packed.contiguous()
        out[name + ".absmax"] = state.absmax.contiguous()
        out[name + ".dequantized"] = F.dequantize_4bit(packed, state).contiguous()
    save_file(out, sys.argv[2])
""")


def _bitsandbytes(weights: dict[str, torch.Tensor], tmp_path: Path) -> dict[str, torch.Tensor]:
    src, dst = tmp_path / "weights.safetensors", tmp_path / "bnb.safetensors"
    save_file(weights, src)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REFERENCE), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", BNB, str(src), str(dst)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return load_file(dst)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(192, 512, generator=g) * 0.02
    w[5, :64] = 0  # an all-zero block
    w[9, 64:128] *= 40  # a block of outliers
    w[11, 3] = w[11].abs().max() * -3  # an element at -absmax: code 0 exactly
    return {str(dt).removeprefix("torch."): w.to(dt).contiguous() for dt in (torch.float32, torch.bfloat16, torch.float16)}


def test_codebook_codes_absmax_and_dequantised_weights_equal_bitsandbytes(tmp_path):
    weights = _weights()
    theirs = _bitsandbytes(weights, tmp_path)
    assert torch.equal(theirs["codebook"], nf4.codebook())
    for name, w in weights.items():
        ours = nf4.quantize(w)
        packed = theirs[name + ".packed"].reshape(-1)
        their_codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(w.shape)  # high nibble first
        assert torch.equal(unpack_nibbles(ours["weight_packed"]), their_codes), name
        assert torch.equal(ours["weight_absmax"], theirs[name + ".absmax"].reshape(ours["weight_absmax"].shape)), name
        back = theirs[name + ".dequantized"]
        assert back.dtype == w.dtype and torch.equal(nf4.dequantize(ours, w.dtype), back), name
