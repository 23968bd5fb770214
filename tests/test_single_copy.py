"""One copy of a 4-bit weight: once the kernels' tiled layout exists, the checkpoint tensors are
dropped and rebuilt from it on demand (QuantLinear's docstring).

On a CPU `compact_()` does what the first kernel call does on a GPU; everything a user reaches
through (state_dict, quant_tensors, attribute access, forward, loads, moves, deepcopy, saving,
fusion, PEFT) must see exactly the tensors it saw before. The GPU half (automatic drop, memory
actually freed, fused groups in the engine) is at the end and skips without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qerl.nn import quant_linear as QL
from qerl.nn.quant_linear import QuantLinear

FORMATS = ("nvfp4", "mxfp4")


def _layer(fmt: str, n: int = 96, k: int = 160, bias: bool = False, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return QuantLinear.from_linear(lin, fmt)


def _same_dict(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].view(torch.uint8) if a[key].dtype == torch.float8_e4m3fn else a[key],
                           b[key].view(torch.uint8) if b[key].dtype == torch.float8_e4m3fn else b[key]), key


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(96, 160), (64, 256), (130, 544)])  # partial and whole tiles
def test_compact_keeps_every_view_exact(fmt, n, k):
    layer = _layer(fmt, n, k, bias=True)
    before_sd = {key: t.clone() for key, t in layer.state_dict().items()}
    before_q = {key: t.clone() for key, t in layer.quant_tensors().items()}
    x = torch.randn(7, k)
    y = layer(x)
    nbytes = layer.storage_bytes()

    layer.compact_()
    assert layer.compacted
    assert set(QL.KERNEL_OWNED).isdisjoint(dict(layer.named_buffers()))  # the checkpoint copy is gone
    _same_dict(layer.state_dict(), before_sd)
    _same_dict(layer.quant_tensors(), before_q)
    assert torch.equal(layer.weight_packed, before_q["weight_packed"])  # attribute access rebuilds
    assert layer.storage_bytes() == nbytes
    assert layer.storage_device == torch.device("cpu")
    torch.testing.assert_close(layer(x), y, rtol=0, atol=0)

    twin = copy.deepcopy(layer)
    assert twin.compacted
    _same_dict(twin.state_dict(), before_sd)


def test_compact_leaves_nf4_alone():
    layer = _layer("nf4", 64, 128)
    layer.compact_()
    assert not layer.compacted and "weight_packed" in dict(layer.named_buffers())


@pytest.mark.parametrize("fmt", FORMATS)
def test_loads_into_a_compacted_layer(fmt):
    old, new = _layer(fmt, seed=1), _layer(fmt, seed=2)
    new_sd = new.state_dict()
    layer = copy.deepcopy(old).compact_()
    # a load that does not name this weight (PEFT's adapter loads): the weight stays, and stays compact
    result = layer.load_state_dict({}, strict=False)
    assert layer.compacted and set(result.missing_keys) >= set(QL.KERNEL_OWNED)
    _same_dict(layer.state_dict(), old.state_dict())
    # a full strict load: the new values everywhere, the kernel layout rebuilt from them
    layer.load_state_dict(new_sd, strict=True)
    assert not layer.compacted
    _same_dict(layer.state_dict(), new_sd)
    x = torch.randn(3, layer.in_features)
    torch.testing.assert_close(layer(x), new(x), rtol=0, atol=0)
    layer.compact_()
    _same_dict(layer.state_dict(), new_sd)
    # load_tensors (what quantize_ and build_model fill layers with)
    layer.load_tensors(old.quant_tensors())
    _same_dict(layer.state_dict(), old.state_dict())
    torch.testing.assert_close(layer.kernel_state()["words"], copy.deepcopy(old).compact_().kernel_state()["words"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_moves_and_casts_of_a_compacted_layer(fmt):
    ref = _layer(fmt, bias=True)
    layer = copy.deepcopy(ref).compact_()
    state = layer.kernel_state()
    layer.to(torch.float64)  # a cast: the packed tensors keep their dtypes, the layout stays
    assert layer.compacted and layer.kernel_state() is state and layer.compute_dtype == torch.float64
    _same_dict({k: v for k, v in layer.state_dict().items() if k != "bias"},
               {k: v for k, v in ref.state_dict().items() if k != "bias"})
    layer._apply(lambda t: t.clone())  # a real move: the checkpoint tensors travel, rebuilt
    assert not layer.compacted
    _same_dict({k: v for k, v in layer.state_dict().items() if k != "bias"},
               {k: v for k, v in ref.state_dict().items() if k != "bias"})


def test_memory_report_counts_a_compacted_layer_at_its_format_size(tiny_model):
    from qerl.memory import memory_report
    from qerl.quantize import quantize_

    model = copy.deepcopy(tiny_model)
    quantize_(model, "nvfp4", progress=False)
    before = memory_report(model)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.compact_()
    after = memory_report(model)
    assert after["linear_bytes"] == before["linear_bytes"]
    assert after["total_bytes"] == before["total_bytes"]
    assert after["per_layer"] == before["per_layer"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_load_fusion_and_lora_over_compacted_layers(tiny_model, tiny_tokenizer, tmp_path, fmt):
    from qerl.checkpoint import load_quantized, save_quantized
    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.quantize import quantize_
    from qerl.rollout.fuse import LinearGroup

    model = copy.deepcopy(tiny_model)
    quantize_(model, fmt, progress=False)
    ref = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.compact_()
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)

    out = save_quantized(model, tiny_tokenizer, tmp_path / "ckpt", fmt)
    loaded, _ = load_quantized(out)
    quant_keys = [key for key in ref.state_dict() if key.rsplit(".", 1)[-1].startswith(("weight_packed", "weight_scale", "weight_global"))]
    assert quant_keys
    _same_dict({key: loaded.state_dict()[key] for key in quant_keys}, {key: ref.state_dict()[key] for key in quant_keys})

    attn, ref_attn = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
    group = LinearGroup([attn.q_proj, attn.k_proj, attn.v_proj])
    assert group.fused is not None
    x = torch.randn(4, attn.q_proj.in_features)
    q, k, v = group(x).split(group.sizes, -1)
    torch.testing.assert_close(k, ref_attn.k_proj(x), rtol=0, atol=0)
    torch.testing.assert_close(q, ref_attn.q_proj(x), rtol=0, atol=0)
    _same_dict(attn.v_proj.state_dict(), ref_attn.v_proj.state_dict())

    peft_model = apply_lora(model, LoraSettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    assert trainable and all(p.device.type == "cpu" for p in trainable)
    assert not any(hasattr(m, "qweight") for m in peft_model.modules() if isinstance(m, QuantLinear))


# --------------------------------------------------------------------------- GPU


def _cuda_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from qerl import kernels

    if not kernels.available():
        pytest.skip("needs triton")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_first_kernel_call_drops_the_checkpoint_copy(fmt):
    _cuda_kernels()
    n, k = 4096, 4096
    ref = _layer(fmt, n, k).cuda()
    sd = {key: t.clone() for key, t in ref.state_dict().items()}
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    x_keep = x.clone().requires_grad_(True)
    try:
        QL.SINGLE_COPY = False
        y_keep = ref(x_keep)
        assert not ref.compacted
    finally:
        QL.SINGLE_COPY = True
    layer = _layer(fmt, n, k).cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        y = layer(x)  # prepares the kernel layout, then drops weight_packed / weight_scale
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - base
    assert layer.compacted
    packed_bytes = n * k // 2
    assert grown < packed_bytes // 2, (grown, packed_bytes)  # the old way grew by a whole second copy
    torch.testing.assert_close(y, y_keep, rtol=0, atol=0)
    dy = torch.randn_like(y)
    x_one = x.clone().requires_grad_(True)
    layer(x_one).backward(dy)  # the backward kernel reads the same (only) layout
    y_keep.backward(dy)
    # the backward's split reduction sums in a run-dependent order: equal up to bf16 rounding
    torch.testing.assert_close(x_one.grad, x_keep.grad, rtol=2**-7, atol=2**-7 * float(x_keep.grad.abs().max()))
    _same_dict(layer.state_dict(), sd)
    layer.cpu()
    assert not layer.compacted and layer.weight_packed.device.type == "cpu"
    _same_dict(layer.state_dict(), {key: t.cpu() for key, t in sd.items()})


def test_gpu_engine_groups_hold_one_copy():
    _cuda_kernels()
    from transformers import LlamaConfig, LlamaForCausalLM

    from qerl.quantize import quantize_
    from qerl.rollout.engine import RolloutEngine

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    quantize_(model, "nvfp4", progress=False)
    model.cuda()
    ref = copy.deepcopy(model)
    sd = {key: t.clone() for key, t in ref.state_dict().items()}
    engine = RolloutEngine(model, max_batch=2, max_len=64)
    attn = model.model.layers[0].self_attn
    group = engine.layers[0].qkv
    assert group.fused is not None and group.fused.compacted
    assert all(m.compacted for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    x = torch.randn(4, attn.q_proj.in_features, device="cuda", dtype=torch.bfloat16)
    q, k, v = group(x).split(group.sizes, -1)
    ref_attn = ref.model.layers[0].self_attn
    torch.testing.assert_close(k, ref_attn.k_proj(x), rtol=0, atol=0)
    torch.testing.assert_close(attn.q_proj(x), ref_attn.q_proj(x), rtol=0, atol=0)
    _same_dict(model.state_dict(), sd)
