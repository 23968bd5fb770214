"""The rollout engine's step kernels on the GPU against their torch references, fresh random
inputs at the real sizes (a 152k vocabulary, Qwen2.5-7B's LoRA groups at ranks 16-64, batch 1-64).
Skipped without a GPU.

- sample_ops.sample_step: tokens, finished flags, positions exactly equal (the inverse CDF lands
  on the same token unless (1 - u) falls within rounding of a CDF step, which these seeds do
  not); logprobs / entropies within 1e-4 (fp32, another summation order).
- lora_ops.lora_delta: bf16 against the torch reference with the same bf16 rounding of x @ A^T:
  relative error <= 1e-2 (bf16 level; the kernels round the fp32 sum once, torch after each mm),
  twice on one workspace (the arrival counters reset themselves).
"""

import pytest
import torch

from qerl.kernels import lora_ops, sample_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _state(rows, vocab, length, gen):
    dev = "cuda"
    s = dict(uniform=torch.rand(length, rows, generator=gen, device=dev), step=torch.tensor([5], device=dev),
             row_map=torch.randperm(rows, generator=gen, device=dev), finished=torch.rand(rows, generator=gen, device=dev) < 0.2,
             is_stop=torch.zeros(vocab, dtype=torch.bool, device=dev), pad=torch.tensor([0], device=dev),
             out_tok=torch.zeros(rows, length, dtype=torch.long, device=dev), out_lp=torch.zeros(rows, length, device=dev),
             out_ent=torch.zeros(rows, length, device=dev), out_alive=torch.zeros(rows, length, dtype=torch.bool, device=dev),
             tok=torch.zeros(rows, dtype=torch.long, device=dev), pos=torch.zeros(rows, dtype=torch.long, device=dev))
    s["is_stop"][torch.randint(0, vocab, (20,), generator=gen, device=dev)] = True
    return s


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_sample_step_kernel_matches_reference(rows, temperature):
    gen = torch.Generator(device="cuda").manual_seed(rows * 10 + int(temperature * 10))
    vocab = 152064
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * 4).bfloat16()
    buffers = _state(rows, vocab, 16, gen)
    a = sample_ops.SampleState(**{k: v.clone() for k, v in buffers.items()})
    b = sample_ops.SampleState(**{k: v.clone() for k, v in buffers.items()})
    sample_ops.sample_step_triton(logits, temperature, a)
    sample_ops.sample_step_reference(logits, temperature, b)
    for k in ("out_tok", "out_alive", "finished", "tok", "pos"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    for k in ("out_lp", "out_ent"):
        assert float((getattr(a, k) - getattr(b, k)).abs().max()) <= 1e-4, k


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
def test_lora_delta_kernels_match_reference(rows, rank, group):
    k, sizes = {"qkv": (3584, [3584, 512, 512]), "o": (3584, [3584]), "gate_up": (3584, [18944, 18944]),
                "down": (18944, [3584])}[group]
    gen = torch.Generator(device="cuda").manual_seed(rows + rank)
    n = sum(sizes)
    edges = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    bounds = (edges[0] if len(sizes) > 1 else n, edges[1] if len(sizes) > 2 else n)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    a = (torch.randn(len(sizes) * rank, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    b = (torch.randn(n, rank, generator=gen, device="cuda") * 0.05).bfloat16()
    buffers = lora_ops.workspace(64, k, a.shape[0], n, torch.bfloat16, "cuda")
    buffers[-1].fill_(float("nan"))  # poisoned output
    lora_ops.lora_delta_triton(x * 2, a, b, bounds, rank, buffers)  # a first call: its counters must reset
    got = lora_ops.lora_delta_triton(x, a, b, bounds, rank, buffers)
    ref = lora_ops.lora_delta_reference(x, a, b, bounds, rank)
    assert not torch.isnan(got).any()
    assert float((got.float() - ref.float()).norm() / ref.float().norm()) <= 1e-2
