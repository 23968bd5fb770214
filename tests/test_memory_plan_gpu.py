"""The checkpoint plan's probe on the GPU (qerl/rl/memory_plan.py layer_bytes_per_token): what it
says one decoder layer keeps per token, against what the caching allocator holds after a real
training forward with every layer uncheckpointed minus the same forward with every layer
checkpointed, for a Qwen2.5-3B-shaped LoRA policy in bf16, nvfp4 and nf4 under bf16 autocast and the
fused training ops, as the trainer prepares it (nf4 held each uncheckpointed layer's bf16 weights until
quant_linear.DequantLinear, which the probe's per-token slope cannot see). Skipped without a CUDA GPU (CPU side:
tests/test_checkpoint_plan.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nf4"])
def test_probe_matches_the_allocator(fmt, qwen3b_policy):
    import functools

    from qerl.rl.memory_plan import decoder_layers, layer_bytes_per_token
    from qerl.rl.rollout import RolloutBatch, policy_logprobs
    from qerl.rl.trainer import _probe_context

    policy, settings = qwen3b_policy(fmt, layers=4, rank=32, alpha=32)
    policy.train()
    context = functools.partial(_probe_context, policy, settings)
    per_token = layer_bytes_per_token(policy, context)
    layers = decoder_layers(policy)

    batch = RolloutBatch.random(4, 256, 768, 150000, seed=5, logprob=0.0)
    tokens = 4 * (256 + 768)

    def held(checkpointed: bool) -> int:
        for layer in layers:
            layer.gradient_checkpointing = checkpointed
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with context():
            lp = policy_logprobs(policy, batch, None, 1.0, False, 1024)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        del lp
        return after - before

    measured = (held(False) - held(True)) / (len(layers) * tokens)
    for layer in layers:
        layer.gradient_checkpointing = True
    # the probe also counts the layer's input, which a checkpointed layer keeps too: a few % high,
    # never low by more than the allocator's rounding
    assert measured > 0
    assert 0.95 * measured <= per_token <= 1.3 * measured, (per_token, measured)


def test_a_device_memory_cap_makes_the_allocator_refuse_beyond_it():
    """cap_device_memory: the plans' view of the card (_CudaMemory.total) becomes the cap, and an allocation
    that would take the allocator's reserved memory past it raises out-of-memory, while one under it succeeds.
    A later call without a cap lifts it (the other tests share the worker). The device is a bare "cuda", as
    the trainer and bench_grpo_step.py pass it (torch's fraction getter wants an index: session 43's first
    32B call failed on that)."""
    from qerl.rl.memory_plan import _CudaMemory, cap_device_memory

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.empty_cache()  # no cached free blocks that the allocator could give back to make room
    gib = (torch.cuda.memory_reserved(dev) + 4 * 2**30) / 2**30
    try:
        cap = cap_device_memory(dev, gib)
        assert cap == int(gib * 2**30) and abs(_CudaMemory(dev).total - cap) <= 1
        x = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)  # 2 GiB: fits
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device=dev)  # 5 GiB more than before: does not
        del x
        assert cap_device_memory(dev, None) is None  # a later uncapped run in the same process: lifted
        assert _CudaMemory(dev).total == total
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        torch.cuda.empty_cache()
