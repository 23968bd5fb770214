"""QuantLinear, quantize_, checkpoints and memory accounting on a tiny random Llama."""

import json

import pytest
import torch
import torch.nn.functional as F

from qerl.checkpoint import is_complete, load_quantized, save_quantized
from qerl.formats import FormatError, dequantize_weight
from qerl.memory import checkpoint_bytes, memory_report
from qerl.model import ModelSpec, build_random, load_model
from qerl.nn import QuantLinear
from qerl.quantize import decoder_linears, quantize_


@pytest.fixture
def tiny():
    return build_random("tiny-llama", torch.bfloat16, seed=1).eval()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_quantlinear_equals_linear_on_dequantised_weight(fmt):
    lin = torch.nn.Linear(128, 48, bias=True).to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(3, 7, 128, dtype=torch.bfloat16)
    want = F.linear(x, q.dequantized_weight(torch.bfloat16), q.bias)
    assert torch.equal(q(x), want)
    assert torch.equal(q(x), want)  # second call hits the CPU cache: same result


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_gradient_reaches_input_and_nothing_else(fmt):
    q = QuantLinear.from_linear(torch.nn.Linear(64, 32).float(), fmt)
    assert not any(p.requires_grad for p in q.parameters())
    x = torch.randn(5, 64, requires_grad=True)
    q(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    w = q.dequantized_weight(torch.float32)
    y = x.detach().clone().requires_grad_()
    F.linear(y, w, q.bias.float()).square().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert all(b.grad is None for b in q.buffers())


@pytest.mark.parametrize("autocast", [False, True])
def test_dequant_linear_keeps_no_dense_weight_for_the_backward(autocast):
    """DequantLinear (the GPU's nf4 / torch-backend path; a CPU QuantLinear caches its dense weight instead):
    the output and the input and bias gradients of F.linear on the dequantised weight, also under bf16
    autocast, while autograd saves nothing weight-sized: the weight is rebuilt in the backward (twice in all)."""
    from qerl.nn.quant_linear import DequantLinear

    q = QuantLinear.from_linear(torch.nn.Linear(128, 160, bias=True).float(), "nf4")
    calls = []

    def dequant(dtype):
        calls.append(dtype)
        return q.dequantized_weight(dtype)

    saved = []
    x = torch.randn(4, 5, 128)
    bias = torch.randn(160)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    bs = [bias.clone().requires_grad_(), bias.clone().requires_grad_()]
    dy = torch.randn(4, 5, 160)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            y = DequantLinear.apply(xs[0], bs[0], dequant)
        want = F.linear(xs[1], dequant(torch.float32), bs[1])
    assert y.dtype == want.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(y, want)
    assert sum(saved) == 0  # the input is not needed (the weight is frozen) and the weight is rebuilt
    y.backward(dy.to(y.dtype))
    want.backward(dy.to(want.dtype))
    assert calls == [torch.float32] * 3  # forward, reference, backward: in x's dtype (autocast casts after)
    assert xs[0].grad.dtype == torch.float32 and bs[0].grad.dtype == torch.float32
    assert torch.equal(xs[0].grad, xs[1].grad)
    torch.testing.assert_close(bs[0].grad, bs[1].grad)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_quantize_replaces_decoder_linears_only(tiny, fmt):
    n_linears = len(decoder_linears(tiny))
    summary = quantize_(tiny, fmt, progress=False)
    assert len(summary.layers_quantized) == n_linears == 14
    assert isinstance(tiny.model.layers[0].self_attn.q_proj, QuantLinear)
    assert isinstance(tiny.lm_head, torch.nn.Linear) and tiny.lm_head.weight.dtype == torch.bfloat16
    assert tiny.model.embed_tokens.weight.dtype == torch.bfloat16
    assert tiny.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    want = {"nvfp4": 4.5, "mxfp4": 4.25, "nf4": 4.5}[fmt]
    # nvfp4 adds one float32 global scale per tensor: 32 bits over a tiny 64x64 layer
    assert want <= summary.bits_per_weight <= want + 0.02


def test_nvfp4_fused_groups_share_global_scale(tiny):
    quantize_(tiny, "nvfp4", progress=False)
    attn, mlp = tiny.model.layers[1].self_attn, tiny.model.layers[1].mlp
    g = {n: getattr(attn, n).weight_global_scale.item() for n in ("q_proj", "k_proj", "v_proj")}
    assert len(set(g.values())) == 1
    assert mlp.gate_proj.weight_global_scale.item() == mlp.up_proj.weight_global_scale.item()


def test_quantize_bad_inputs(tiny):
    with pytest.raises(FormatError, match="valid formats"):
        quantize_(tiny, "fp4", progress=False)
    lin = torch.nn.Linear(40, 8)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Module()])
    m.layers[0].proj = lin
    with pytest.raises(FormatError, match=r"layers\.0\.proj has input dimension 40"):
        quantize_(m, "nvfp4", progress=False)
    s = quantize_(m, "nvfp4", allow_bf16_fallback=True, progress=False)
    assert s.layers_skipped == ["layers.0.proj"] and isinstance(m.layers[0].proj, torch.nn.Linear)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4", "nf4"])
def test_save_load_roundtrip_is_lossless(tiny, tmp_path, fmt):
    quantize_(tiny, fmt, progress=False)
    x = torch.randint(0, 49152, (2, 9))
    want = tiny(x).logits
    save_quantized(tiny, None, tmp_path / fmt, fmt)
    assert is_complete(tmp_path / fmt)
    back, _ = load_quantized(tmp_path / fmt)
    assert torch.equal(back(x).logits, want)
    sd_a, sd_b = tiny.state_dict(), back.state_dict()
    for k, v in sd_a.items():
        assert torch.equal(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
                           sd_b[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else sd_b[k]), k


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compressed_tensors_decompresses_our_checkpoint(tiny, tmp_path, fmt):
    """transformers + compressed-tensors (the loader vLLM's ecosystem uses) read our files and
    give back exactly our dequantised weights."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    quantize_(tiny, fmt, progress=False)
    save_quantized(tiny, None, tmp_path, fmt)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == f"{fmt}-pack-quantized" and cfg["quant_method"] == "compressed-tensors"
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.bfloat16
    )
    for name, q in tiny.named_modules():
        if isinstance(q, QuantLinear):
            w = theirs.get_submodule(name).weight
            assert torch.equal(w.to(torch.bfloat16), q.dequantized_weight(torch.bfloat16)), name


def test_checkpoint_config_mismatch_is_a_clear_error(tiny, tmp_path):
    quantize_(tiny, "nvfp4", progress=False)
    save_quantized(tiny, None, tmp_path, "nvfp4")
    marker = json.loads((tmp_path / "qerl_checkpoint.json").read_text())
    marker["format"] = "mxfp4"
    (tmp_path / "qerl_checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(FormatError, match="config says mxfp4 but .*weight_scale"):
        load_quantized(tmp_path)


@pytest.mark.parametrize("fmt,bits", [("nvfp4", 4.5), ("mxfp4", 4.25), ("nf4", 4.5), ("bf16", 16.0)])
def test_memory_report_matches_bits_and_file_size(tiny, tmp_path, fmt, bits):
    quantize_(tiny, fmt, progress=False)
    rep = memory_report(tiny)
    assert abs(rep["bits_per_weight"] - bits) < 0.02
    save_quantized(tiny, None, tmp_path, fmt)
    # the file holds every tensor once, plus a small safetensors header
    size = checkpoint_bytes(tmp_path)
    assert rep["total_bytes"] <= size <= rep["total_bytes"] + 64 * 1024


def test_nf4_double_quant_bits(tiny):
    quantize_(tiny, "nf4", nf4_double_quant=True, progress=False)
    rep = memory_report(tiny)
    assert 4.12 < rep["bits_per_weight"] < 4.16


@pytest.mark.slow
def test_llm_compressor_oneshot_matches_our_quantizer(tmp_path):
    """llm-compressor's NVFP4A16 oneshot (no calibration data) and our quantize_ produce the
    same tensors on the same model."""
    from qerl.llmcompressor_quantizer import quantize_with_llmcompressor

    ours = build_random("tiny-llama", torch.bfloat16, seed=3).eval()
    theirs = build_random("tiny-llama", torch.bfloat16, seed=3).eval()
    quantize_(ours, "nvfp4", progress=False)
    out = quantize_with_llmcompressor(theirs, None, tmp_path / "lc", "nvfp4")
    back, _ = load_quantized(out)
    for name, q in ours.named_modules():
        if isinstance(q, QuantLinear):
            b = back.get_submodule(name)
            assert torch.equal(q.weight_packed, b.weight_packed), name
            assert torch.equal(q.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8)), name
            assert torch.equal(q.weight_global_scale, b.weight_global_scale), name


def test_casting_a_quantised_model_keeps_packed_dtypes(tiny):
    from qerl.model import to_inference

    quantize_(tiny, "nvfp4", progress=False)
    x = torch.randint(0, 49152, (1, 6))
    ref = tiny(x).logits.float()
    to_inference(tiny, "cpu")
    q = tiny.model.layers[0].self_attn.q_proj
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_packed.dtype == torch.uint8
    assert q.weight_global_scale.dtype == torch.float32 and q.compute_dtype == torch.float32
    out = tiny(x).logits
    assert out.dtype == torch.float32
    # same stored weights, float32 arithmetic instead of bf16: close, not equal
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2
