"""Formats on CUDA tensors give the same bytes as on the CPU (the GPU tests and benchmarks
quantise on the device to save time). Skipped without a GPU."""

import pytest
import torch

from qerl.formats import dequantize_weight, quantize_weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quantisation_is_bit_identical_to_cpu(fmt, dtype):
    w = (torch.randn(3584, 4096) * 0.02).to(dtype)
    w.view(-1)[torch.randint(0, w.numel(), (100,))] = 1.5  # outliers
    cpu = quantize_weight(w, fmt)
    gpu = quantize_weight(w.cuda(), fmt)
    for k, v in cpu.items():
        g = gpu[k].cpu()
        if v.dtype == torch.float8_e4m3fn:
            v, g = v.view(torch.uint8), g.view(torch.uint8)
        assert torch.equal(v, g), (fmt, k)
    assert torch.equal(dequantize_weight(cpu, fmt), dequantize_weight(gpu, fmt).cpu())
