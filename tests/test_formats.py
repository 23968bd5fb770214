"""Formats: bit-exact against compressed-tensors, error bounds, packing, NF4 code book.

Relative RMS error ||W - deq(q(W))|| / ||W|| on N(0, 1) weights [512, 1024] (seed 0):

    format  rel. error   bits/weight
    nvfp4   ~0.096       4.5
    mxfp4   ~0.11 (ct rule), ~0.12 (OCP floor rule)   4.25
    nf4     ~0.092       4.5
    bf16    ~0.0017      16

The tests below assert ranges around these, so a change that makes a format worse fails.
"""

import pytest
import torch

from qerl.formats import FormatError, dequantize_weight, mxfp4, nf4, nvfp4, quantize_weight
from qerl.formats.fp4 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

ct = pytest.importorskip("compressed_tensors")


def _weights(kind: str, shape, dtype, gen):
    n, k = shape
    if kind == "normal":
        w = torch.randn(n, k, generator=gen)
    elif kind == "heavy":  # Student-t with 2 degrees of freedom: heavy tails
        w = torch.distributions.StudentT(2.0).sample((n, k))
    elif kind == "zero_rows":
        w = torch.randn(n, k, generator=gen) * 0.02
        w[::3] = 0.0
    elif kind == "outliers":
        w = torch.randn(n, k, generator=gen) * 0.02
        idx = torch.randint(0, n * k, (max(1, n * k // 500),), generator=gen)
        w.view(-1)[idx] = 30.0 * torch.sign(torch.randn(idx.numel(), generator=gen))
    elif kind == "tiny":
        w = torch.randn(n, k, generator=gen) * 1e-6
    else:
        raise AssertionError(kind)
    return w.to(dtype)


def _ct_compress(w: torch.Tensor, preset: str, compressor_format: str, global_absmax=None):
    """What compressed-tensors (as llm-compressor drives it) produces for this weight."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    n, k = w.shape
    groups = w.reshape(n, k // args.group_size, args.group_size)
    mins, maxs = groups.amin(dim=-1), groups.amax(dim=-1)
    sd = {"weight": w}
    g = None
    if preset.startswith("NVFP4"):
        amax = torch.max(maxs.max(), -mins.min()) if global_absmax is None else global_absmax
        g = generate_gparam(-amax.reshape(1), amax.reshape(1))
        sd["weight_global_scale"] = g
    scale, zp = calculate_qparams(mins, maxs, args, global_scale=g)
    sd["weight_scale"] = scale
    sd["weight_zero_point"] = zp
    compressor = BaseCompressor.get_value_from_registry(compressor_format)
    return compressor.compress(sd, scheme), compressor, scheme


KINDS = ["normal", "heavy", "zero_rows", "outliers", "tiny"]
SHAPES = [(64, 128), (96, 256), (192, 576)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_bit_exact_vs_compressed_tensors(kind, shape, dtype):
    gen = torch.Generator().manual_seed(hash((kind, shape, str(dtype))) % 2**31)
    w = _weights(kind, shape, dtype, gen)
    ref, _, _ = _ct_compress(w, "NVFP4A16", "nvfp4-pack-quantized")
    ours = quantize_weight(w, "nvfp4")
    assert ours["weight_global_scale"].dtype == torch.float32
    assert torch.equal(ours["weight_global_scale"].view(torch.int32), ref["weight_global_scale"].view(torch.int32))
    assert ours["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(ours["weight_scale"].view(torch.uint8), ref["weight_scale"].to(torch.float8_e4m3fn).view(torch.uint8))
    assert ours["weight_packed"].dtype == torch.uint8
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_mxfp4_bit_exact_vs_compressed_tensors(kind, dtype):
    gen = torch.Generator().manual_seed(hash((kind, "mx", str(dtype))) % 2**31)
    w = _weights(kind, (128, 512), dtype, gen)
    ref, _, _ = _ct_compress(w, "MXFP4A16", "mxfp4-pack-quantized")
    ours = quantize_weight(w, "mxfp4")
    assert torch.equal(ours["weight_scale"], ref["weight_scale"].to(torch.uint8))
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])


# Group maxima (float32 bit patterns) where g * (amax / 6) and g * (amax * fp32(1/6)) round to
# different FP8 scales at g = 1792 (weight amax 1.5): a multiply by the rounded reciprocal - what
# CUDA does for `tensor / python_scalar` - gets these scales wrong (issue 4, task B).
RECIPROCAL_TRAPS = (1027155090, 1019665262, 1018766482)


def reciprocal_trap_weight(n=64, k=256, seed=0):
    """float32 [n, k] weight, amax 1.5, whose first groups have the RECIPROCAL_TRAPS maxima."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.rand(n, k, generator=gen) * 2 - 1) * 0.02
    w[0, 0] = 1.5
    traps = torch.tensor(RECIPROCAL_TRAPS, dtype=torch.int32).view(torch.float32)
    for i, a in enumerate(traps):
        row, col = 1 + i, 16 * (i + 1)
        w[row, col : col + 16] *= 0.4  # the trap is the group's maximum
        w[row, col + 3] = -a if i % 2 else a
    return w


def test_nvfp4_scale_division_is_exact_regression():
    """The group scale divides amax by 6 exactly (as compressed-tensors does), not via 1/6."""
    w = reciprocal_trap_weight()
    ref, _, _ = _ct_compress(w, "NVFP4A16", "nvfp4-pack-quantized")
    ours = quantize_weight(w, "nvfp4")
    assert ours["weight_global_scale"].item() == 1792.0
    assert torch.equal(ours["weight_scale"].view(torch.uint8), ref["weight_scale"].to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(ours["weight_packed"], ref["weight_packed"])
    traps = torch.tensor(RECIPROCAL_TRAPS, dtype=torch.int32).view(torch.float32)
    inv6 = torch.tensor(1.0) / torch.tensor(6.0)
    for i, a in enumerate(traps):
        exact = (1792.0 * (a / 6.0)).to(torch.float8_e4m3fn).view(torch.uint8)
        via_reciprocal = (1792.0 * (a * inv6)).to(torch.float8_e4m3fn).view(torch.uint8)
        assert exact != via_reciprocal  # the trap is a real one
        assert ours["weight_scale"][1 + i, i + 1].view(torch.uint8) == exact


def test_nvfp4_fused_global_scale_matches_compressed_tensors():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, 128, generator=gen).to(torch.bfloat16) * s for n, s in [(128, 1.0), (32, 3.0), (32, 0.5)])
    g = nvfp4.shared_global_scale([q, k, v])
    # the group's largest amax gives the smallest g
    assert g.item() == min(nvfp4.global_scale(t).item() for t in (q, k, v))
    amax = torch.stack([t.abs().max() for t in (q, k, v)]).max()
    for t in (q, k, v):
        ref, _, _ = _ct_compress(t, "NVFP4A16", "nvfp4-pack-quantized", global_absmax=amax)
        ours = quantize_weight(t, "nvfp4", weight_global_scale=g)
        assert torch.equal(ours["weight_packed"], ref["weight_packed"])
        assert torch.equal(ours["weight_scale"].view(torch.uint8), ref["weight_scale"].to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt,preset,ctfmt", [("nvfp4", "NVFP4A16", "nvfp4-pack-quantized"), ("mxfp4", "MXFP4A16", "mxfp4-pack-quantized")])
def test_dequantize_matches_compressed_tensors_decompressor(fmt, preset, ctfmt):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ours = quantize_weight(w, fmt)
    _, compressor, scheme = _ct_compress(w, preset, ctfmt)
    theirs = compressor.decompress(dict(ours), scheme)["weight"]
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(dequantize_weight(ours, fmt, torch.bfloat16), theirs)


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.0, 0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.0, 100.0, -0.1, -0.75, -7.0])
    want = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -1.0, -6.0])
    got = e2m1_decode(e2m1_encode(x.clamp(-6, 6)))
    assert torch.equal(got, want)
    assert e2m1_encode(torch.tensor([-0.1]))[0] == 8  # negative zero keeps its sign bit


def test_pack_unpack_roundtrip_and_nibble_order():
    codes = torch.randint(0, 16, (5, 34), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 17)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert pack_nibbles(torch.tensor([[0x3, 0xA]], dtype=torch.uint8)).item() == 0xA3  # even index low


def test_nf4_codebook_published_values_and_nearest_rounding():
    cb = nf4.codebook()
    assert cb.numel() == 16 and cb[0] == -1.0 and cb[7] == 0.0 and cb[15] == 1.0
    assert abs(cb[8].item() - 0.07958029955625534) < 1e-12
    x = torch.rand(4096) * 2 - 1
    codes = nf4.encode(x)
    nearest = (x[:, None] - cb[None]).abs().argmin(dim=1)
    assert torch.equal(codes.long(), nearest)


@pytest.mark.parametrize(
    "fmt,lo,hi",
    [("nvfp4", 0.085, 0.105), ("mxfp4", 0.10, 0.125), ("nf4", 0.085, 0.10), ("bf16", 0.0, 0.003)],
)
def test_relative_error_on_gaussian_weights(fmt, lo, hi):
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    err = ((dequantize_weight(quantize_weight(w, fmt), fmt) - w).norm() / w.norm()).item()
    assert lo <= err <= hi, err


def test_mxfp4_ct_rule_beats_floor_rule():
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    errs = {}
    for rule in ("ct", "floor"):
        t = quantize_weight(w, "mxfp4", scale_rule=rule)
        errs[rule] = ((dequantize_weight(t, "mxfp4") - w).norm() / w.norm()).item()
    assert errs["ct"] < errs["floor"]


def test_nf4_double_quant_close_to_plain():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    plain = dequantize_weight(quantize_weight(w, "nf4"), "nf4")
    dq_t = quantize_weight(w, "nf4", double_quant=True)
    assert dq_t["weight_absmax_q"].dtype == torch.int8
    dq = dequantize_weight(dq_t, "nf4")
    e_plain = ((plain - w).norm() / w.norm()).item()
    e_dq = ((dq - w).norm() / w.norm()).item()
    assert e_dq < e_plain * 1.02


def test_bad_input_errors():
    with pytest.raises(FormatError, match="valid formats: bf16, nf4, mxfp4, nvfp4"):
        quantize_weight(torch.randn(4, 32), "int4")
    with pytest.raises(FormatError, match="divisible by 16"):
        quantize_weight(torch.randn(4, 40), "nvfp4")
    w = torch.randn(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(FormatError, match="NaN or Inf"):
        quantize_weight(w, "nvfp4")


def test_all_zero_tensor():
    w = torch.zeros(16, 64)
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        assert torch.equal(dequantize_weight(quantize_weight(w, fmt), fmt), w)
