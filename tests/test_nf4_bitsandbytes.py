"""The nf4 format against bitsandbytes, whose NF4 is QLoRA's: the same code book, and for the same weights the
same 4-bit codes, the same per-64 absmax and the same dequantised values, bit for bit (bitsandbytes' CPU path,
`quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=False)`). Two documented differences stay
out of the comparison (qerl/formats/nf4.py): bitsandbytes packs the first of two codes into the high nibble, we
into the low one; its double quantisation uses an 8-bit dynamic code, ours a linear int8 one."""

from __future__ import annotations

import pytest
import torch

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from qerl.formats import nf4  # noqa: E402
from qerl.formats.fp4 import unpack_nibbles  # noqa: E402


def _their_codes(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    flat = packed.reshape(-1)
    return torch.stack([flat >> 4, flat & 15], dim=1).reshape(shape)  # high nibble first


def test_the_code_book_is_bitsandbytes():
    assert torch.equal(bnb_functional.get_4bit_type("nf4", device="cpu").float(), nf4.codebook())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codes_absmax_and_dequantised_weights_equal_bitsandbytes(dtype):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(192, 512, generator=g) * 0.02).to(dtype)
    w[5, :64] = 0  # an all-zero block
    w[9, 64:128] *= 40  # a block of outliers
    w[11, 3] = w[11].abs().max() * -3  # an element at -absmax: code 0 exactly
    theirs, state = bnb_functional.quantize_4bit(w, blocksize=nf4.GROUP_SIZE, quant_type="nf4",
                                                 compress_statistics=False)
    ours = nf4.quantize(w)
    assert torch.equal(unpack_nibbles(ours["weight_packed"]), _their_codes(theirs, tuple(w.shape)))
    assert torch.equal(ours["weight_absmax"], state.absmax.reshape(ours["weight_absmax"].shape))
    back = bnb_functional.dequantize_4bit(theirs, state)
    assert back.dtype == dtype and torch.equal(nf4.dequantize(ours, dtype), back)
