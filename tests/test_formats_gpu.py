"""Formats on CUDA tensors give the same bytes as on the CPU (the GPU tests and benchmarks
quantise on the device to save time). Skipped without a GPU.

Seeded over several seeds, plus planted group maxima where a multiply by a rounded 1/6 flips the
FP8 scale (issue 4, task B: CUDA computes `tensor / python_scalar` as `tensor * (1 / scalar)`,
which made nvfp4 from fp32 weights differ in ~1 scale per 1M groups)."""

import pytest
import torch

from qerl.formats import dequantize_weight, quantize_weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RECIPROCAL_TRAPS = (1027155090, 1019665262, 1018766482)  # as tests/test_formats.py


def _weight(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3584, 4096, generator=gen) * 0.02
    w.view(-1)[torch.randint(0, w.numel(), (100,), generator=gen)] = 1.5  # outliers; amax 1.5
    traps = torch.tensor(RECIPROCAL_TRAPS, dtype=torch.int32).view(torch.float32)
    for i, a in enumerate(traps):  # groups whose maximum is a reciprocal trap
        row, col = 7 + 11 * i, 32 * (i + 1)
        w[row, col : col + 32] *= 0.2
        w[row, col + 5] = a
    return w.to(dtype)


def _first_diffs(a, b, n=5):
    idx = (a != b).nonzero()[:n].tolist()
    return [(i, a[tuple(i)].item(), b[tuple(i)].item()) for i in idx]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quantisation_is_bit_identical_to_cpu(fmt, dtype, seed):
    w = _weight(seed, dtype)
    cpu = quantize_weight(w, fmt)
    gpu = quantize_weight(w.cuda(), fmt)
    for k, v in cpu.items():
        g = gpu[k].cpu()
        if v.dtype == torch.float8_e4m3fn:
            v, g = v.view(torch.uint8), g.view(torch.uint8)
        assert torch.equal(v, g), (fmt, k, int((v != g).sum()), _first_diffs(v, g))
    assert torch.equal(dequantize_weight(cpu, fmt), dequantize_weight(gpu, fmt).cpu())

