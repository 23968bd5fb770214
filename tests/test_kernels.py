"""CPU tests for qerl.kernels: kernel layout, torch references, backend dispatch, and the Triton
kernels run by Triton's interpreter (TRITON_INTERPRET=1) on tiny shapes.

Run: python -m pytest tests/test_kernels.py -q        (about a minute on 2 cores)

The interpreter runs in a subprocess so its environment variable cannot leak into other test
modules that import triton. Under the interpreter the kernels take their fp32 emulation path for
bf16 arithmetic (the interpreter computes bf16 on raw uint16 bits, flushes bf16 subnormals and
truncates fp32 -> bf16), so these tests check indexing, the bit layout, masking, the persistent
schedule and the split-tile fixup; tests/test_kernels_gpu.py checks the real bf16 path.
Tolerance 1e-2 relative (Frobenius): the kernels' only rounding is the final bf16 store (~4e-3).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qerl.formats import dequantize_weight, quantize_weight
from qerl.formats.fp4 import pack_nibbles
from qerl.kernels import (
    KernelUnavailable,
    available,
    layout,
    linear,
    prepare,
    resolve_backend,
    state_tensors,
)
from qerl.kernels import reference

FORMATS = ("nvfp4", "mxfp4")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)


# --------------------------------------------------------------------------- layout


def test_layout_round_trip_and_bit_tiling():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 96), generator=g, dtype=torch.uint8)
    words = layout.codes_to_words(codes)
    assert words.dtype == torch.int32 and words.shape == (37, 12)
    assert torch.equal(layout.words_to_codes(words), codes)
    packed = pack_nibbles(codes)
    assert torch.equal(layout.packed_to_words(packed), words)
    assert torch.equal(layout.words_to_packed(words), packed)
    # every (element, code bit) has its own bit of the word
    assert sorted(layout._POS.flatten().tolist()) == list(range(32))


def test_layout_decode_rule_in_torch():
    """Apply the kernel's shift/mask decode in torch and check every code value exactly."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    u = layout.codes_to_words(codes).to(torch.int64) & 0xFFFFFFFF

    def rotr(w, r):
        return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w

    pairs = [(rotr(u, layout.ROT_MAG[j]) & layout.MAG_MASK) | (rotr(u, layout.ROT_SIGN[j]) & layout.SIGN_MASK) for j in range(4)]
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    for t, (j, half) in enumerate(layout._T_TO_SLOT):
        bits = (pairs[j] >> (16 * half)) & 0xFFFF
        f32 = (bits << 16).to(torch.int32).view(torch.float32)  # the bf16 pattern, widened exactly
        assert torch.equal(f32 * 2.0**126, table[codes[:, t::8].long()])


def test_rwg_lane_rule_builds_the_wgmma_register_operand():
    """w4a16_rwg: quad lane t decodes, from each word, only the pair at K offsets (2t, 2t + 1), with
    per-lane rotations (R_t, S_t); the four lanes together must give every weight of the word once,
    low half = the lower K, exactly as the wgmma register fragment (lane t: K 2t, 2t + 1) wants."""
    from qerl.kernels import w4a16_rwg  # Gluon is only traced at launch: importable on CPU

    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    u = layout.codes_to_words(codes).to(torch.int64) & 0xFFFFFFFF

    def rotr(w, r):
        return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w

    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    rot_mag, rot_sign = w4a16_rwg.lane_rotations()
    assert sorted(zip(rot_mag, rot_sign)) == sorted(zip(layout.ROT_MAG, layout.ROT_SIGN))  # every pair once
    for t in range(4):
        p = (rotr(u, rot_mag[t]) & layout.MAG_MASK) | (rotr(u, rot_sign[t]) & layout.SIGN_MASK)
        for half in range(2):
            bits = (p >> (16 * half)) & 0xFFFF
            f32 = (bits << 16).to(torch.int32).view(torch.float32)
            assert torch.equal(f32 * 2.0**126, table[codes[:, 2 * t + half::8].long()])


def test_fragment_words_hold_each_threads_wgmma_pairs():
    """layout.py's fragment-ordered words (rwg FRAG): the word of (warp w, lane 4g + t, 16-K slice s) decoded by the
    kernel's integer rule gives, in register order h + 2 kh, the bf16 pairs of rows 16w + g (+8 h) at
    K = 16s + 2t (+8 kh), (+1): the wgmma A fragment; every value exact, nothing outside the target bits; the
    copy built from today's tiled words equals the one built from the codes; the round trip is exact (padding
    included)."""
    g = torch.Generator().manual_seed(5)
    n, k = 70, 520  # two row blocks, three K blocks, both padded
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    tiles = layout.codes_to_frag_tiles(codes)
    assert tiles.shape == (2, 3, 64, 32) and tiles.dtype == torch.int32
    assert torch.equal(layout.frag_tiles_to_codes(tiles, n, k), codes)
    assert torch.equal(layout.tiles_to_frag_tiles(layout.to_tiles(layout.codes_to_words(codes), 32)), tiles)
    assert sorted(layout._FRAG_POS.flatten().tolist()) == list(range(32))
    pairs = layout.frag_decode_reference(tiles.reshape(2, 3, 4, 4, 8, 4, 4))  # nb, kb, w, j, g, t, q, pi
    assert int((pairs & ~layout.FRAG_TARGET).abs().max()) == 0
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    padded = torch.zeros(128, 768, dtype=torch.uint8)
    padded[:n, :k] = codes
    for pi in range(4):
        h, kh = pi % 2, pi // 2
        for half in range(2):
            bits = (pairs[..., pi] >> (16 * half)) & 0xFFFF
            value = (bits << 16).to(torch.int32).view(torch.float32) * 2.0**126  # nb, kb, w, j, g, t, q
            ref = padded.reshape(2, 4, 2, 8, 3, 4, 4, 2, 4, 2)[:, :, h, :, :, :, :, kh, :, half]  # nb w g kb j q t
            assert torch.equal(value, table[ref.permute(0, 3, 1, 4, 2, 6, 5).long()])


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4", "nf4"))
def test_reference_matches_formats(fmt):
    w = _weight(48, 128, 2)
    t = quantize_weight(w, fmt)
    dense = dequantize_weight(t, fmt)
    assert torch.equal(reference.dequant(fmt, t), dense)
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.allclose(reference.matmul_ref(x, t, fmt), x.float() @ dense.T, rtol=1e-5, atol=1e-6)
    dy = torch.randn(5, 48).to(torch.bfloat16)
    assert torch.allclose(reference.matmul_grad_ref(dy, t, fmt), dy.float() @ dense, rtol=1e-5, atol=1e-6)
    if fmt == "nf4":
        y = reference.nf4_dequant_matmul(x, t)
        assert y.dtype == torch.bfloat16
        assert _rel(y, reference.matmul_ref(x, t, fmt)) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_prepare_round_trips_to_checkpoint_tensors(fmt):
    t = quantize_weight(_weight(64, 256, 3), fmt)
    st = prepare(fmt, t)
    back = state_tensors(st)
    for name, value in t.items():
        assert torch.equal(back[name].view(torch.uint8) if value.dtype == torch.float8_e4m3fn else back[name],
                           value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value), name
    assert st["words"].shape == (1, 1, 64, 32) and st["kb"] == 1 and st["locks"].abs().sum() == 0


def test_prepare_fragment_order(monkeypatch):
    """order="frag" (nvfp4) stores the fragment-ordered words as the state's only copy; they go back to the
    same checkpoint tensors, the torch backend multiplies the same, and bad orders fail in one line."""
    t = quantize_weight(_weight(80, 512, 5), "nvfp4")  # a partial second row tile, two K blocks
    rows, frag = prepare("nvfp4", t, order="rows"), prepare("nvfp4", t, order="frag")
    assert (rows["order"], frag["order"]) == ("rows", "frag") and frag["words"].shape == rows["words"].shape
    assert torch.equal(frag["words"], layout.tiles_to_frag_tiles(rows["words"]))
    assert not torch.equal(frag["words"], rows["words"])
    for name, value in t.items():
        assert torch.equal(state_tensors(frag)[name].view(torch.uint8), value.view(torch.uint8)), name
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert torch.equal(linear(x, frag, backend="torch"), linear(x, rows, backend="torch"))
    monkeypatch.setenv("QERL_W4A16_ORDER", "frag")
    assert prepare("nvfp4", t)["order"] == "frag"
    assert prepare("mxfp4", quantize_weight(_weight(64, 256, 5), "mxfp4"))["order"] == "rows"  # nvfp4 only
    with pytest.raises(ValueError, match="built for nvfp4"):
        prepare("mxfp4", quantize_weight(_weight(64, 256, 5), "mxfp4"), order="frag")
    with pytest.raises(ValueError, match="unknown word order"):
        prepare("nvfp4", t, order="cols")
    assert (layout.order_setting(), layout.order_setting("mxfp4")) == ("frag", None)  # what benchmark rows record
    monkeypatch.setenv("QERL_W4A16_ORDER", "diag")
    with pytest.raises(ValueError, match="QERL_W4A16_ORDER"):
        prepare("nvfp4", t)
    # "auto" (the default, DEFAULT_ORDER): frag only where the sm_90 kernels read it (an sm_90 GPU, K % 256 == 0),
    # rows on CPU and elsewhere
    assert layout.DEFAULT_ORDER == "auto"
    monkeypatch.delenv("QERL_W4A16_ORDER")
    assert layout.order_setting() == "auto"
    assert prepare("nvfp4", t)["order"] == "rows"  # CPU tensors
    for cap, k, want in (((9, 0), 512, "frag"), ((9, 0), 576, "rows"), ((8, 0), 512, "rows"), ((10, 0), 512, "rows")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert layout.default_order("nvfp4", torch.device("cuda", 0), k) == want, (cap, k)
        assert layout.default_order("mxfp4", torch.device("cuda", 0), k) == "rows"


# --------------------------------------------------------------------------- dispatch


def test_backend_resolution_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, "nvfp4") == "torch"
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", cpu, "mxfp4") == "torch"
    assert resolve_backend("auto", cpu, "nf4") == "torch"
    with pytest.raises(KernelUnavailable, match=r"needs a CUDA GPU of compute capability >= 8.0 \(9.0, Hopper, for the "
                                                 r"fast kernels\) and triton"):
        resolve_backend("triton", cpu, "nvfp4")
    with pytest.raises(KernelUnavailable):
        resolve_backend("triton", cpu, "nf4")
    with pytest.raises(ValueError):
        resolve_backend("cutlass", cpu)
    if not torch.cuda.is_available():
        assert available() is False


def test_pre_hopper_gpus_take_the_torch_backend(monkeypatch):
    """On a GPU below compute capability 9.0 (here an A100's 8.0, simulated) the fast kernels are reported
    unavailable with one warning and `auto` resolves to torch; `triton`, asked for, runs the portable form there
    (with its own warning), and below 8.0 fails in one line."""
    from qerl import kernels

    has_triton = importlib.util.find_spec("triton") is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    kernels.available.cache_clear()
    kernels.portable_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="compute capability >= 9.0 .*this GPU is 8.0: using the torch backend"):
            assert kernels.available() is False
        assert resolve_backend("auto", torch.device("cuda", 0), "nvfp4") == "torch"
        if has_triton:
            with pytest.warns(UserWarning, match="portable form"):
                assert resolve_backend("triton", torch.device("cuda", 0), "nvfp4") == "triton"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
        kernels.available.cache_clear()
        kernels.portable_available.cache_clear()
        with pytest.warns(UserWarning):
            assert kernels.available() is False
        with pytest.raises(KernelUnavailable, match="compute capability >= 8.0"):
            resolve_backend("triton", torch.device("cuda", 0), "nvfp4")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        kernels.available.cache_clear()
        kernels.portable_available.cache_clear()
        assert kernels.available() is has_triton
    finally:
        kernels.available.cache_clear()
        kernels.portable_available.cache_clear()


_PORTABLE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from qerl.formats import quantize_weight
    from qerl.kernels import prepare
    from qerl.kernels import w4a16_gemv as V, w4a16_triton as W
    torch.manual_seed(0)
    t = quantize_weight(torch.randn(64, 512) * 0.1, "nvfp4")
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # every E4M3 bit pattern but the two NaNs
    st = prepare("nvfp4", t)
    flat = st["scale"].view(-1)
    flat.copy_(codes.repeat(-(-flat.numel() // codes.numel()))[: flat.numel()])
    x1, x3, dy = torch.randn(1, 512).to(torch.bfloat16), torch.randn(3, 512).to(torch.bfloat16), torch.randn(3, 64)
    out = {}
    for portable in (False, True):
        W.PORTABLE = portable
        out[portable] = (W.fmt_id(st), W.dequant_bf16(st), V.forward(x1, st), W.forward(x3, st),
                         W.backward(dy.to(torch.bfloat16), st))
    same = [torch.equal(a, b) for a, b in zip(out[False][1:], out[True][1:])]
    print("RESULTS" + json.dumps(dict(fmts=[out[False][0], out[True][0]], same=same,
                                      finite=bool(torch.isfinite(out[True][1]).all()))))
    """
)


def test_portable_e4m3_scales_match_the_conversion():
    """The portable form's integer E4M3 decode (FMT 3, pre-sm_89 GPUs) gives the same dequantised weight and
    the same GEMV / fused-kernel outputs, bit for bit, as the hardware conversion, over every E4M3 pattern
    (subnormals and negatives included), in the interpreter."""
    from interpreted import run_interpreted

    r = run_interpreted(_PORTABLE_SCRIPT, 0, timeout=600)
    assert r["fmts"] == [0, 3]
    assert r["same"] == [True, True, True, True] and r["finite"], r


def _compile_for(fn, arch: int, sig: dict, consts: dict):
    """An offline triton.compile of a Triton kernel for sm_<arch> (ptxas included) with pointers 16-byte aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **{name: "constexpr" for name in consts})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": 4})


@pytest.mark.parametrize("arch", [80, 86, 89])
def test_portable_kernels_build_before_hopper(arch):
    """The portable form of the Triton kernels (fp32 decode, no packed bf16x2 multiply; integer E4M3 scales
    below sm_89) builds for Ampere / Ada: the fused kernel forward and backward, the dequantise kernel and
    the CUDA-core GEMV, for nvfp4 and mxfp4."""
    pytest.importorskip("triton")
    from qerl.kernels import w4a16_gemv as V
    from qerl.kernels import w4a16_triton as W

    nv = W.SOFT_E4M3_FMT if arch < 89 else 0
    ptrs = ["*bf16", "*i32", "*u8", "*fp32", "*bf16", "*bf16", "*fp32", "*i32"]
    fused = dict(zip(["a_ptr", "w_ptr", "s_ptr", "alpha_ptr", "bias_ptr", "c_ptr", "ws_ptr", "lock_ptr", "stamp_ptr"],
                     ptrs + ["*i32"]))
    fused.update({n: "i32" for n in ["M", "NOUT", "RED", "stride_am", "stride_cm", "KB", "exp_bias", "S"]})
    gemv = dict(zip(["x_ptr", "w_ptr", "s_ptr", "alpha_ptr", "bias_ptr", "c_ptr", "ws_ptr", "lock_ptr"], ptrs))
    gemv.update({n: "i32" for n in ["M", "N", "K", "stride_xm", "stride_cm", "KB", "exp_bias", "S"]})
    deq = {"w_ptr": "*i32", "s_ptr": "*u8", "alpha_ptr": "*fp32", "o_ptr": "*bf16"}
    deq.update({n: "i32" for n in ["N", "K", "KB", "exp_bias", "ROW0", "ROW1", "COL0", "LDO"]})
    for fmt in (nv, 1):
        for bwd, bm in ((False, 16), (True, 64)):
            _compile_for(W._w4a16_kernel, arch, fused, dict(
                BWD=bwd, FMT=fmt, HAS_BIAS=not bwd, EVEN_O=True, EVEN_R=True, BM=bm, BO=64, BR=128, GROUP_M=8,
                INTERPRETED=False, DECODE_F32=True, SWAP=False, SPLIT=not bwd, PACKED=False, PDL=False, LATE=False,
                STAMP=False))
        _compile_for(W._w4_to_bf16_kernel, arch, deq, dict(FMT=fmt, BR=32, BK=256, F32=True))
        _compile_for(V._gemv_kernel, arch, gemv, dict(FMT=fmt, HAS_BIAS=False, EVEN_K=True, BM=1, BN=32, BK=256,
                                                       F32=True, PACKED=False, ACC2D=True, CH=32, PDL=False, PF=0,
                                                       LATE=False))


@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4", "nf4"))
def test_linear_torch_backend_forward_backward(fmt):
    t = quantize_weight(_weight(40, 128, 4), fmt)
    st = prepare(fmt, t)
    x = torch.randn(2, 3, 128).to(torch.bfloat16).requires_grad_(True)
    bias = torch.randn(40).to(torch.bfloat16).requires_grad_(True)
    y = linear(x, st, fmt, bias=bias)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref = reference.matmul_ref(x.detach(), t, fmt) + bias.detach().float()
    assert _rel(y.detach(), ref) < 1e-2
    dy = torch.randn_like(y)
    y.backward(dy)
    assert _rel(x.grad, reference.matmul_grad_ref(dy, t, fmt)) < 1e-2
    assert torch.allclose(bias.grad.float(), dy.float().sum((0, 1)), rtol=2e-2, atol=2e-2)
    assert all(not v.requires_grad for v in st.values() if isinstance(v, torch.Tensor))


def test_import_is_light():
    code = "import sys, qerl, qerl.kernels; import torch; print(int('triton' in sys.modules), int(torch.cuda.is_initialized()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "0"]


# --------------------------------------------------------------------------- Triton interpreter

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    from qerl.formats import quantize_weight
    from qerl.kernels import prepare, reference
    from qerl.kernels import w4a16_triton as W, nf4_triton

    torch.manual_seed(0)
    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    results = []
    cases = [(m, n, k) for m in (1, 5, 33) for (n, k) in ((64, 128), (96, 256))]
    for fmt in ("nvfp4", "mxfp4"):
        for m, n, k in cases:
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            t = quantize_weight(w, fmt)
            st = prepare(fmt, t)
            x = (torch.randn(m, k) * 2).to(torch.bfloat16)
            dy = torch.randn(m, n).to(torch.bfloat16)
            bias = torch.randn(n).to(torch.bfloat16) if m == 5 else None
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
            W.forward(x, st, bias=bias, out=y)
            dx = torch.full((m, k), float("nan"), dtype=torch.bfloat16)
            W.backward(dy, st, out=dx)
            ref = reference.matmul_ref(x, t, fmt) + (bias.float() if bias is not None else 0)
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op="forward", rel=rel(y, ref), nan=bool(y.isnan().any())))
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op="backward", rel=rel(dx, reference.matmul_grad_ref(dy, t, fmt)),
                                nan=bool(dx.isnan().any())))
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op="locks", rel=float(st["locks"].abs().sum() + st["locks_bwd"].abs().sum()), nan=False))
        # the persistent schedule: 1 program, a few (tiles shared by several programs), many
        m, n, k = 17, 160, 512
        t = quantize_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16), fmt)
        st = prepare(fmt, t)
        x = torch.randn(m, k).to(torch.bfloat16)
        dy = torch.randn(m, n).to(torch.bfloat16)
        b17 = torch.randn(n).to(torch.bfloat16)  # a program walking several tiles loads each tile's bias
        for progs in (1, 3, 7, 1000):
            fc = dict(W._fwd_config(m, n, k, fmt), PROGRAMS=progs)
            bc = dict(W._bwd_config(m, n, k, fmt), PROGRAMS=progs)
            y = W.forward(x, st, bias=b17, config=fc)
            dx = W.backward(dy, st, config=bc)
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op=f"forward/programs={progs}+bias", rel=rel(y, reference.matmul_ref(x, t, fmt) + b17.float()), nan=bool(y.isnan().any())))
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op=f"backward/programs={progs}", rel=rel(dx, reference.matmul_grad_ref(dy, t, fmt)), nan=bool(dx.isnan().any())))
        # the split schedule with uneven slices: 1 tile, KI = 5 steps over S = 3 programs (1/2/2)
        m, n, k = 3, 64, 1280
        t = quantize_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16), fmt)
        st = prepare(fmt, t)
        x = torch.randn(m, k).to(torch.bfloat16)
        fc = dict(W._fwd_config(m, n, k, fmt), PER_SM=1, SCHEDULE="split")
        y = W.forward(x, st, config=fc)
        results.append(dict(fmt=fmt, m=m, n=n, k=k, op="forward/split-uneven", rel=rel(y, reference.matmul_ref(x, t, fmt)), nan=bool(y.isnan().any())))
        results.append(dict(fmt=fmt, m=m, n=n, k=k, op="locks", rel=float(st["locks"].abs().sum()), nan=False))
        # the CUDA-core GEMV (w4a16_gemv.py): tiny M, split-K fixup (uneven S), partial row
        # block, K not a multiple of 256, bias, M = 1 with the end-of-loop reduction (ACC2D)
        for m, n, k, cfg in ((1, 64, 256, {}), (1, 100, 1280, {"S": 3, "BN": 16}), (3, 100, 1280, {"S": 3}),
                             (4, 96, 800, {"BN": 64}), (8, 40, 768, {"S": 2}), (1, 64, 800, {"ACC2D": False}),
                             # PF: weights loaded one step ahead (the PDL path's loop), uneven S
                             (1, 100, 1280, {"S": 3, "PF": 1}), (3, 64, 768, {"S": 2, "PF": 2}), (1, 64, 1536, {"S": 2, "PF": 3})):
            t = quantize_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16), fmt)
            st = prepare(fmt, t)
            x = (torch.randn(m, k) * 2).to(torch.bfloat16)
            bias = torch.randn(n).to(torch.bfloat16) if m == 3 else None
            y = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
            W.forward(x, st, bias=bias, out=y, config=dict(cfg, PATH="gemv"))
            ref = reference.matmul_ref(x, t, fmt) + (bias.float() if bias is not None else 0)
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op=f"forward/gemv{cfg}", rel=rel(y, ref), nan=bool(y.isnan().any())))
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op="locks", rel=float(st["locks"].abs().sum()), nan=False))
        # prefill-sized tiles (BM=128) on a small problem, and the large-M bf16 + matmul path
        m, n, k = 130, 96, 256
        x = torch.randn(m, k).to(torch.bfloat16)
        t = quantize_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16), fmt)
        st = prepare(fmt, t)
        ref = reference.matmul_ref(x, t, fmt)
        for path in ("fused", "dequant"):
            y = W.forward(x, st, config={"PATH": path})
            results.append(dict(fmt=fmt, m=m, n=n, k=k, op=f"forward/{path}", rel=rel(y, ref), nan=bool(y.isnan().any())))
        dy = torch.randn(m, n).to(torch.bfloat16)
        dx = W.backward(dy, st, config={"PATH": "dequant"})
        results.append(dict(fmt=fmt, m=m, n=n, k=k, op="backward/dequant", rel=rel(dx, reference.matmul_grad_ref(dy, t, fmt)), nan=bool(dx.isnan().any())))
        # the overlapped path (chunked dequant + matmul per output-column slice; uneven last
        # chunk over a partial 64-row tile forward, 256-column chunks backward; with bias)
        m2, n2, k2 = 70, 600, 512
        x2 = torch.randn(m2, k2).to(torch.bfloat16)
        t2 = quantize_weight((torch.randn(n2, k2) * 0.02).to(torch.bfloat16), fmt)
        st2 = prepare(fmt, t2)
        b2 = torch.randn(n2).to(torch.bfloat16)
        y = W.forward(x2, st2, bias=b2, config={"PATH": "overlap", "CHUNKS": 3})
        results.append(dict(fmt=fmt, m=m2, n=n2, k=k2, op="forward/overlap+bias", rel=rel(y, reference.matmul_ref(x2, t2, fmt) + b2.float()), nan=bool(y.isnan().any())))
        dy2 = torch.randn(m2, n2).to(torch.bfloat16)
        dx = W.backward(dy2, st2, config={"PATH": "overlap", "CHUNKS": 2})
        results.append(dict(fmt=fmt, m=m2, n=n2, k=k2, op="backward/overlap", rel=rel(dx, reference.matmul_grad_ref(dy2, t2, fmt)), nan=bool(dx.isnan().any())))
        o2 = torch.empty(300, 256)
        W.dequant_bf16(st2, out=o2, rows=(300, 600), cols=(256, 512))
        results.append(dict(fmt=fmt, m=0, n=n2, k=k2, op="dequant_bf16/block", rel=rel(o2, reference.dequant(fmt, t2)[300:600, 256:512]), nan=bool(o2.isnan().any())))
        o = torch.empty(n, k)
        W.dequant_bf16(st, out=o)
        results.append(dict(fmt=fmt, m=0, n=n, k=k, op="dequant_bf16", rel=rel(o, reference.dequant(fmt, t)), nan=bool(o.isnan().any())))
    # fragment-ordered nvfp4 words (order "frag", FMT 2): the same bits as the rows order on every Triton path,
    # N with a partial 16-row group (72) and a partial 64-row tile under BO = 128 (160)
    for m, n, k in ((1, 72, 256), (5, 160, 512), (33, 96, 768), (130, 72, 512), (3, 64, 576)):  # 576: SmolLM2's K
        t = quantize_weight((torch.randn(n, k) * 0.02).to(torch.bfloat16), "nvfp4")
        sf, sr = prepare("nvfp4", t, order="frag"), prepare("nvfp4", t, order="rows")
        x = (torch.randn(m, k) * 2).to(torch.bfloat16)
        dy = torch.randn(m, n).to(torch.bfloat16)
        b = torch.randn(n).to(torch.bfloat16)
        pairs = [("forward", lambda s: W.forward(x, s, bias=b, config={"PATH": "fused"})),
                 ("backward", lambda s: W.backward(dy, s, config={"PATH": "fused"})),
                 ("backward/dequant", lambda s: W.backward(dy, s, config={"PATH": "dequant"})),
                 ("forward/dequant", lambda s: W.forward(x, s, config={"PATH": "dequant"})),
                 ("backward/overlap", lambda s: W.backward(dy, s, config={"PATH": "overlap", "CHUNKS": 2})),
                 ("dequant_bf16/rows16", lambda s: W.dequant_bf16(s, out=torch.empty(n - 16, k), rows=(16, n)))]
        for op, f in pairs:
            same = torch.equal(f(sf), f(sr))
            results.append(dict(fmt="nvfp4/frag", m=m, n=n, k=k, op=op, rel=0.0 if same else 1.0, nan=False))
    # the NF4 baseline's dequant kernel (fp32 output: the interpreter's bf16 cast truncates)
    t = quantize_weight(torch.randn(64, 256) * 0.02, "nf4", double_quant=True)
    o = torch.empty(64, 256)
    nf4_triton.dequant_bf16(t, out=o)
    exact = torch.equal(o, reference.dequant("nf4", t))
    results.append(dict(fmt="nf4", m=0, n=64, k=256, op="dequant", rel=0.0 if exact else 1.0, nan=False))
    print("RESULTS" + json.dumps(results))
    """
)


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULTS")][-1]
    results = json.loads(line[len("RESULTS"):])
    bad = [r for r in results if r["nan"] or (r["op"] == "locks" and r["rel"] != 0) or r["rel"] > 1e-2]
    assert not bad, bad
    assert len(results) > 40


def _benchmark_module(name: str):
    """benchmarks/<name>.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile_gluon():
    """benchmarks/compile_gluon.py as a module (the offline sm_90a build helpers)."""
    return _benchmark_module("compile_gluon")


WGMMA_BUILDS = [("nvfp4", 64, None), ("mxfp4", 256, None), ("nvfp4", 16, {"CPS": 4, "NSD": 2, "DW": 8}),
                ("mxfp4", 128, {"CPS": 1, "NSD": 4, "LAG": 2, "PDL": True}),
                ("nvfp4", 256, {"BN": 128, "LOADS": 1, "NSD": 2, "NSX": 3, "PDL": True}),
                ("mxfp4", 256, {"DW": 8, "LOADS": 1}),
                # fragment-ordered words (w4a16_frag): the decoder reads them as rwg does and stores rows of pairs
                ("nvfp4-frag", 256, None), ("nvfp4-frag", 128, {"CPS": 4, "NSD": 2}),
                ("nvfp4-frag", 512, {"CPS": 1, "PDL": True}), ("nvfp4-frag", 256, {"BN": 128, "BM": 128})]


@pytest.mark.parametrize("fmt,m,cfg", WGMMA_BUILDS, ids=[f"{f}-M{m}-{c or 'default'}" for f, m, c in WGMMA_BUILDS])
def test_wgmma_kernel_builds_for_hopper(fmt, m, cfg):
    """Offline sm_90a build of the Gluon GEMM (w4a16_wgmma, no GPU needed): the decoder's register
    layouts convert trivially (assert_trivial fails the build otherwise), ptxas accepts it without
    spills, the rings fit in an H100's shared memory, and the PTX holds one proxy fence per decoded
    stage (4 / CPS per weight step) and per raw tile released, and four wgmmas (one per 16-K slice
    of a chunk); on fragment-ordered words too (nvfp4-frag: FMT 4, built with integer scales)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_wgmma as G

    frag = fmt == "nvfp4-frag"
    fmt = "nvfp4" if frag else fmt
    ck = G.compile_offline(fmt, m, config=cfg, bias=True, sbits=frag, frag=frag)
    consts, _ = G.kernel_args(fmt, m, cfg, frag)
    assert consts["FMT"] == (4 if frag else 0 if fmt == "nvfp4" else 1)
    cg = _compile_gluon()
    regs, spills = cg._resources(ck.asm["cubin"])
    assert spills == 0 and 0 < regs <= 168
    assert ck.metadata.shared <= 232448
    ptx = ck.asm["ptx"]
    # one fence per decoded stage, and one per raw weight tile read before it is handed back to TMA
    assert ptx.count("fence.proxy.async") == 4 // consts["CPS"] + consts["num_warps"] // 4  # R = BN / 64 tiles
    assert ptx.count("wgmma.mma_async") == 4
    assert ptx.count("griddepcontrol") == (3 if consts["PDL"] else 0)


def test_x_stream_probe_builds_for_hopper():
    """benchmarks/probe_x_stream.py (the activation copies of the M = 256 GEMM with nothing else) builds for sm_90a:
    one TMA copy and two ring waits in the PTX, no spills, the ring within an H100's shared memory."""
    pytest.importorskip("triton.experimental.gluon")
    ck = _benchmark_module("probe_x_stream").compile_offline()
    regs, spills = _compile_gluon()._resources(ck.asm["cubin"])
    assert spills == 0 and regs > 0
    assert 4 * 256 * 64 * 2 <= ck.metadata.shared <= 232448
    ptx = ck.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor") == 1 and ptx.count("mbarrier.try_wait") == 2


def test_cluster_reduce_probe_reports_each_form(capsys):
    """benchmarks/probe_cluster_reduce.py compiles its two cross-CTA forms offline in child processes (a compiler
    assertion must not take the probe down) and prints one result per form: built, with its cluster instructions
    counted, or not, with the compiler's error."""
    pytest.importorskip("triton.experimental.gluon")
    import ast

    probe = _benchmark_module("probe_cluster_reduce")
    assert probe.main([]) == 0
    results = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in results] == list(probe.KINDS)
    for r in results:
        assert set(r["ptx_counts"]) == {"mapa", "shared::cluster", "barrier.cluster"} if r["ok"] else r["error"]


def test_profile_rollout_counts_every_4bit_kernel_as_a_4bit_gemm():
    """benchmarks/profile_rollout.py groups kernel times by name; every Triton / Gluon kernel of the 4-bit products
    (the w4a16 modules and the NF4 ones) must land in "4-bit GEMM". Session 64's first 32-row profiles put rwg's KP
    kernel (`_rwg_kp_kernel`) under "other": half of the 7B step's 4-bit time."""
    pytest.importorskip("triton.experimental.gluon")
    import importlib

    kind_of = _benchmark_module("profile_rollout").kind_of
    names = set()
    for mod in ("w4a16_triton", "w4a16_wgmma", "w4a16_rwg", "w4a16_ws", "w4a16_gluon", "w4a16_gemv", "nf4_triton"):
        m = importlib.import_module(f"qerl.kernels.{mod}")
        names |= {n for n, f in vars(m).items() if n.endswith("kernel") and type(f).__name__ in ("JITFunction", "GluonJITFunction")}
    assert {"_rwg_kernel", "_rwg_kp_kernel", "_wgmma_kernel", "_gluon_gemv_kernel", "_nf4_fused_kernel"} <= names
    assert {n: kind_of(n) for n in names} == {n: "4-bit GEMM" for n in names}
    assert kind_of("attn_partial_kernel") == "attention" and kind_of("lora_shrink_kernel") == "LoRA"


# the three-programs-per-SM rwg form the routing picks at 24..32 tokens (w4a16_triton.RWG_THREE_PER_SM, R = 1),
# built offline below and checked against the routing in test_rwg_three_per_sm_rule
THREE_PER_SM = {"R": 1, "NSW": 2, "NSX": 2, "maxnreg": 80, "XREL": 1}


@pytest.mark.parametrize("fmt,m,cfg", [("nvfp4", 64, {}), ("nvfp4", 32, {}), ("nvfp4", 16, {"R": 1}),
                                       ("nvfp4", 64, {"PDL": True}),
                                       ("nvfp4", 64, {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1}),
                                       ("mxfp4", 64, {}), ("mxfp4", 32, {"R": 1, "NSW": 4, "NSX": 3, "maxnreg": 104}),
                                       ("nvfp4", 128, {"BM": 128, "NSX": 2}),
                                       ("nvfp4", 128, {"BM": 128, "R": 1, "NSX": 2, "XREL": 1}),
                                       ("nvfp4", 64, {"PWA": 1}),
                                       ("nvfp4", 64, {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1, "PWA": 1}),
                                       ("mxfp4", 64, {"PWA": 1, "PDL": True}),
                                       ("nvfp4", 128, {"BM": 128, "NSX": 2, "PWA": 1}),
                                       ("nvfp4", 32, {**THREE_PER_SM, "PWA": 1}),
                                       ("nvfp4", 32, {"R": 1, "KP": 2, "XREL": 1, "NSX": 4}),
                                       ("mxfp4", 64, {"R": 1, "KP": 2, "NSX": 4, "PDL": True}),
                                       ("nvfp4", 32, {"R": 1, "KP": 2, "XREL": 1, "NSX": 4, "DIAG": 1}),
                                       ("nvfp4", 32, {"R": 1, "KP": 2, "XREL": 1, "NSX": 4, "FRAG": 1}),
                                       ("nvfp4", 64, {"FRAG": 1, "PDL": True})],
                         ids=["M64", "M32", "M16-R1", "M64-pdl", "M64-two-per-SM-xrel", "mxfp4-M64", "mxfp4-M32-two",
                              "BM128", "BM128-R1", "M64-pwa", "M64-two-xrel-pwa", "mxfp4-M64-pwa-pdl", "BM128-pwa",
                              "M32-three-per-SM", "M32-KP2", "mxfp4-M64-KP2-pdl", "M32-KP2-nodecode", "M32-KP2-frag",
                              "M64-frag-pdl"])
def test_rwg_kernel_builds_for_hopper(fmt, m, cfg):
    """Offline sm_90a build of w4a16_rwg (no GPU needed): the register layouts convert trivially to
    the wgmma register operand (assert_trivial fails the build otherwise), no spills, the rings fit,
    16 wgmmas per step (peeled first step + loop; twice with KP = 2, one loop per MMA warpgroup), and
    ptxas does not serialise the wgmmas (C7515: a path reaching the final wait with re-defined
    accumulator registers does that)."""
    pytest.importorskip("triton.experimental.gluon")
    import subprocess
    import tempfile

    import triton

    from qerl.kernels import w4a16_rwg as R

    ck = R.compile_offline(m, config=cfg, bias=True, sbits=fmt == "nvfp4", fmt=fmt)
    cg = _compile_gluon()
    regs, spills = cg._resources(ck.asm["cubin"])
    consts, _ = R.kernel_args(m, cfg, fmt)
    kp = cfg.get("KP", 1)
    rings = R.smem_bytes(consts["BM"], consts["num_warps"] // 4, consts["NSW"], consts["NSX"], kp)
    assert consts["BM"] == cfg.get("BM", consts["BM"]) and rings - 1024 <= ck.metadata.shared <= 232448
    assert spills == 0
    if cfg.get("maxnreg"):  # the 104 / 80-register forms fit 2 / 3 programs per SM (WG._resident's count)
        fit = min(65536 // (regs * ck.metadata.num_warps * 32), 233472 // (ck.metadata.shared + 1024))
        assert fit == {104: 2, 80: 3}[cfg["maxnreg"]]
    ptx = ck.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 32 * kp and ptx.count("griddepcontrol") == (3 if cfg.get("PDL") else 0)
    if kp == 2:  # one program per SM: the two MMA warpgroups, the loaders' (padded) one, ~100 KB of rings
        assert ck.metadata.num_warps == 12 and 65536 // (regs * 12 * 32) == 1
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True)
    assert "C7515" not in info.stdout + info.stderr
    if cfg.get("PWA"):  # per-warp stage release: no CTA barrier left in the MMA loop
        assert _mma_loop_bars(cg, ck.asm["cubin"], "HGMMA") == 0
        nw = consts["num_warps"]
        assert _init_counts(ptx) == [1, nw] * (consts["NSW"] + consts["NSX"])  # ready: the copy; empty: every warp


def test_rwg_diag_skips_only_the_decode():
    """DIAG = 1 (timing only): FMT 3, whose step feeds the raw words to the wgmma with no funnel shift, no bf16
    multiply and no scale load, and the same wgmmas; the scale_bits switch must not turn it back into FMT 2;
    mxfp4 is refused (its stages differ)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_rwg as R

    kp2 = {"R": 1, "KP": 2, "XREL": 1, "NSX": 4}
    assert R.kernel_args(32, dict(kp2, DIAG=1))[0]["FMT"] == 3 and R.kernel_args(32, kp2)[0]["FMT"] == 0
    plain, diag = (R.compile_offline(32, 3584, 3584, config=c, sbits=True).asm["ptx"] for c in (kp2, dict(kp2, DIAG=1)))
    assert plain.count("shf.r.wrap") > 0 and plain.count("mul.rn.bf16x2") + plain.count("mul.bf16x2") > 0
    assert diag.count("shf.r.wrap") == 0 and diag.count("mul.rn.bf16x2") + diag.count("mul.bf16x2") == 0
    assert diag.count("wgmma.mma_async") == plain.count("wgmma.mma_async") == 64
    with pytest.raises(ValueError, match="DIAG"):
        R.kernel_args(32, dict(kp2, DIAG=1), "mxfp4")


def test_rwg_frag_reads_fragment_words_with_fewer_loads_and_shifts():
    """FRAG = 1: FMT 4 (5 with scale_bits), its stage read as 16-byte rows (a quarter of the shared-memory loads),
    no per-lane rotation (every funnel shift by an immediate), the same 16 wgmmas per step; mxfp4 and DIAG
    refused; a path key like DIAG, so the rule's tiles stay."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_rwg as R
    from qerl.kernels import w4a16_triton as W

    kp2 = {"R": 1, "KP": 2, "XREL": 1, "NSX": 4}
    assert R.kernel_args(32, dict(kp2, FRAG=1))[0]["FMT"] == 4 and "FRAG" in W._PATH_KEYS
    plain, frag = (R.compile_offline(32, 3584, 3584, config=c, sbits=True).asm["ptx"] for c in (kp2, dict(kp2, FRAG=1)))
    assert frag.count("wgmma.mma_async") == plain.count("wgmma.mma_async") == 64
    assert 0 < frag.count("ld.shared") < plain.count("ld.shared") / 2
    assert frag.count("shf.r.wrap.b32") > 0 and all(line.split(",")[-1].strip(" ;").isdigit()
                                                   for line in frag.splitlines() if "shf.r.wrap.b32" in line)
    # all scales normal: a word's two rows' multipliers in one register (one PRMT per two scales), each multiply
    # selecting its half; SASS (session 73): 2600 -> 2464 instructions
    assert R.FRAG_SCALE_PAIRS.value and frag.count("prmt.b32") == frag.count("mad.lo.u32 ") > 0
    for bad in (dict(FRAG=1, DIAG=1), dict(FRAG=1)):
        with pytest.raises(ValueError, match="FRAG"):
            R.kernel_args(32, bad, "mxfp4" if "DIAG" not in bad else "nvfp4")
    with pytest.raises(ValueError, match="NaN"):  # KP on rings of 2 (NaN in 3 of 48 H100 cells, session 72)
        R.kernel_args(32, dict(kp2, NSW=2, NSX=2, FRAG=1))


def test_diag_is_a_path_key_that_keeps_the_rules_tiles():
    """{"DIAG": 1} (timing only, rwg's) must not replace any kernel's own tile heuristic: it is a path key, dropped
    from the fused kernel's tile config, while a real tile key still replaces the default."""
    from qerl.kernels import w4a16_triton as W

    default = W._fwd_config(16, 3584, 3584, "nvfp4")
    assert "DIAG" in W._PATH_KEYS
    assert W._kernel_config({"DIAG": 1}, default) == default
    assert W._kernel_config({"DIAG": 1, "PDL": True}, default) == dict(default, PDL=True)
    assert W._kernel_config({"BM": 16, "BO": 64, "BR": 256, "PER_SM": 2}, default) != default


_PWA_PTX = """
	// qerl-pwa-v1 %r1
	setp.eq.b32 	%p1, %r9, 0;
	@%p1 mbarrier.init.shared::cta.b64 [%r2], 1;
	@%p1 mbarrier.init.shared::cta.b64 [%r3], 4;
	bar.sync 	0, 128;
	mov.pred 	%p7, 0;
	@%p7 mbarrier.arrive.shared::cta.b64 _, [%r3];
$L__BB0_4:
	bar.sync 	0, 128;
	mbarrier.try_wait.parity.shared.b64 complete, [%r2], %r5;
	ld.shared.v2.b32 	{%r6, %r7}, [%r8];
	fence.proxy.async.shared::cta;
	bar.sync 	0, 128;
	@%p1 mbarrier.arrive.shared::cta.b64 _, [%r3];
	and.pred 	%p3, %p1, %p4;
	@%p3 mbarrier.arrive.shared::cta.b64 _, [%r4];
	@%p5 mbarrier.arrive.expect_tx.shared.b64 _, [%r2], 9216;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r10}, {%r11}, {%r12}, {%r13};
	@%p2 bra 	$L__BB0_4;
	bar.sync 	0, 128;
	st.shared.b32 	[%r8], %r6;
"""


def test_ptx_pwa_rewrite_rules():
    """The per-warp arrive rewrite on a small PTX text: unmarked PTX is untouched; marked, the
    thread-0 arrives become a warp sync plus a lane-0 arrive in every warp (a user predicate kept,
    a constant-false one left alone, the producer's expect_tx untouched), the CTA barriers inside the
    MMA loop go and the ones outside stay; anything it cannot read raises."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import ptx_pwa

    unmarked = _PWA_PTX.replace("// qerl-pwa-v1 %r1", "")
    assert ptx_pwa.rewrite(unmarked) == unmarked
    assert ptx_pwa.MARK in _PWA_PTX
    out = ptx_pwa.rewrite(_PWA_PTX)
    lines = out.split("\n")
    loop = lines[lines.index("$L__BB0_4:"):next(i for i, s in enumerate(lines) if "bra 	$L__BB0_4" in s)]
    assert not any("bar.sync" in s for s in loop)
    assert out.count("bar.sync") == 2  # after the inits, and before the store after the loop
    assert out.count("bar.warp.sync -1;") == 2
    assert "setp.eq.b32 %pwa_p, %pwa_r, 0; @%pwa_p mbarrier.arrive.shared::cta.b64 _, [%r3];" in out
    assert "setp.eq.and.b32 %pwa_p, %pwa_r, 0, %p4; @%pwa_p mbarrier.arrive.shared::cta.b64 _, [%r4];" in out
    assert "@%p7 mbarrier.arrive.shared::cta.b64 _, [%r3];" in out  # never fires: as it was
    assert "@%p5 mbarrier.arrive.expect_tx.shared.b64 _, [%r2], 9216;" in out
    with pytest.raises(ptx_pwa.RewriteError, match="predicate"):
        ptx_pwa.rewrite(_PWA_PTX.replace("@%p3 mbarrier", "@%p6 mbarrier"))
    with pytest.raises(ptx_pwa.RewriteError, match="store"):
        ptx_pwa.rewrite(_PWA_PTX.replace("	ld.shared.v2", "	st.shared.b32 [%r8], %r6;\n	ld.shared.v2"))
    no_arrive = "\n".join(s for s in _PWA_PTX.split("\n") if "mbarrier.arrive.shared::cta" not in s)
    with pytest.raises(ptx_pwa.RewriteError, match="no consumer arrive"):
        ptx_pwa.rewrite(no_arrive)


_CLUSTER_PTX = """
.extern .shared .align 16 .b8 global_smem[];
.visible .entry k(
	.param .u64 k_param_0
)
{
	.reg .b32 	%r<4>;
	mov.b64 	%rd1, k_param_0;
	mov.u32 	%r1, %tid.x;
	shr.u32 	%r2, %r1, 5;
	@%p1 bra 	$L__BB0_2;
	// qerl-cluster-v2 %r3
$L__BB0_2:
	mov.u32 	%r3, %tid.x;
	ret;
}
"""


def test_ptx_cluster_rewrite_rules():
    """The cluster fixup's entry code (qerl/kernels/ptx_cluster.py) on a small PTX text: unmarked PTX is
    untouched; marked, the leader's mbarrier initialisation and every thread's cluster arrive go in once, right before the
    entry's first %tid.x read (before the warp-specialised branch); a text without such a read, or with a
    branch before it, raises. The region's size matches what a launch adds."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import ptx_cluster

    unmarked = _CLUSTER_PTX.replace("// qerl-cluster-v2 %r3", "")
    assert ptx_cluster.rewrite(unmarked) == unmarked
    out = ptx_cluster.rewrite(_CLUSTER_PTX)
    lines = out.split("\n")
    arrive = next(i for i, s in enumerate(lines) if "barrier.cluster.arrive.release.aligned;" in s)
    assert out.count("barrier.cluster.arrive") == 1 and out.count("%cluster_ctarank") == 1
    assert lines[arrive + 2].strip().startswith("mov.u32 \t%r1, %tid.x;")
    assert "@%qcl_p mbarrier.init.shared::cta.b64 [%qcl_a], %qcl_b;" in out and "sub.u32 %qcl_a, %qcl_a, 16;" in out
    assert "@%qcl_p fence.mbarrier_init.release.cluster;" in out
    with pytest.raises(ptx_cluster.RewriteError, match="tid"):
        ptx_cluster.rewrite(_CLUSTER_PTX.replace("%tid.x", "%ctaid.x"))
    with pytest.raises(ptx_cluster.RewriteError, match="control flow"):
        ptx_cluster.rewrite(_CLUSTER_PTX.replace("\tmov.b64 \t%rd1, k_param_0;", "\t@%p2 bra \t$L__BB0_2;"))
    assert ptx_cluster.extra_bytes(7, 64) == 16 + 6 * 256 and ptx_cluster.extra_bytes(2, 512) == 16 + 2048


def test_gluon_gemv_cluster_rule_and_fit():
    """Which launches take the cluster fixup (w4a16_gluon.cluster_size) and when its clusters fit
    (cluster_fits), on the H100 cases measured in NOTES_w4a16.md section 44: by the rule, M = 1 in a PDL chain
    with <= 4 K steps a program (3584^2 S 7, 5120^2 S 5), not 5120 x 13824 (9 steps), not 2..8 tokens, not
    single launches, not the split tail / stream-K or S > 8; forced, any M and steps. 72 clusters of 7 (4608 x
    3584, 504 of 528 slots) do not fit though the driver counted 101; 56 of 7 and 112 of 4 do."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G

    assert G.cluster_size("split", 7, 14, 1, True, None) == 7
    assert G.cluster_size("split", 5, 20, 1, True, None) == 5
    assert G.cluster_size("split", 6, 54, 1, True, None) == 0  # 9 steps a program
    assert G.cluster_size("split", 7, 14, 8, True, None) == 0  # 2..8 tokens
    assert G.cluster_size("split", 7, 14, 1, False, None) == 0  # a single launch
    assert G.cluster_size("split", 6, 54, 8, False, True) == 6  # forced
    assert G.cluster_size("split", 9, 74, 1, True, True) == 0  # more than 8 slices
    assert G.cluster_size("split", 1, 14, 1, True, True) == 0
    assert G.cluster_size("tail", 7, 14, 1, True, True) == G.cluster_size("sk", 4, 14, 1, True, True) == 0
    assert G.cluster_size("split", 7, 14, 1, True, False) == 0
    assert G.cluster_fits(392, 7, 101, 528) and G.cluster_fits(448, 4, 186, 528)
    assert not G.cluster_fits(504, 7, 101, 528)
    assert not G.cluster_fits(392, 7, 47, 528)  # the driver's count at 2..8 tokens


@pytest.mark.parametrize("mt,cl", [(1, 7), (8, 4), (8, 8)])
def test_gluon_gemv_cluster_fixup_builds(mt, cl):
    """Offline sm_90a build of the Gluon GEMV with the cluster fixup (CL): the entry code sits before the
    worker warps' branch, the consumers wait on the cluster barrier once, peers store their partials
    into the leader's shared memory (mapa + st.shared::cluster) and arrive on its mbarrier (one remote arrive,
    release at cluster scope), the leader try_waits on it and reads CL - 1 slots; the global counter's atomics
    are gone; no spills at 64
    registers; CL = 0 builds carry none of it."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    for c in (0, cl):
        ck = cg.compile_kernel(3584, 3584, 3, 4, 64, 24, True, True, mt, False, sbits=True, pwa=mt > 1, cluster=c)
        regs, spills = cg._resources(ck.asm["cubin"])
        assert spills == 0 and regs <= 64
        ptx = ck.asm["ptx"]
        if not c:
            assert "cluster" not in ptx.replace("shared::cluster", "") and "atom.global" in ptx
            continue
        body = ptx.split("\n")
        arrive = next(i for i, s in enumerate(body) if "barrier.cluster.arrive" in s)
        branch = next(i for i, s in enumerate(body) if "shfl.sync.idx" in s)
        assert arrive < branch
        assert ptx.count("barrier.cluster.wait") == 1
        assert ptx.count("mbarrier.arrive.release.cluster.shared::cluster.b64") == 1
        assert ptx.count("mbarrier.try_wait.parity.acquire.cluster") == 1
        assert ptx.count("st.shared::cluster.f32") >= 1 and "mapa.shared::cluster" in ptx
        assert "atom.global" not in ptx  # no counter in global memory
        assert ptx.count("ld.shared.f32") >= cl - 1


def _init_counts(ptx: str) -> list[int]:
    """The arrival counts of the kernel's mbarrier.init, in PTX order."""
    import re

    return [int(c) for c in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (\d+);", ptx)]


def _mma_loop(cg, cubin: bytes, op: str) -> list[str]:
    """The SASS lines of the shortest loop holding `op` (the MMA main loop)."""
    return min((body for _, body in cg._loops(cg._sass(cubin)) if cg._opcodes(body).get(op)), key=len)


def _mma_loop_bars(cg, cubin: bytes, op: str) -> int:
    """CTA barriers (BAR) in the MMA main loop."""
    return cg._opcodes(_mma_loop(cg, cubin, op)).get("BAR", 0)


@pytest.mark.parametrize("mt,sched", [(1, "split"), (8, "split"), (8, "sk"), (8, "tail"), (1, "tail")])
def test_gluon_gemv_per_warp_arrive_builds(mt, sched):
    """Offline sm_90a build of the Gluon GEMV with PWA (qerl/kernels/ptx_pwa.py): the main loop
    keeps no CTA barrier (one per step before the wait and one before the arrive without it), the
    empty barriers wait for the 4 consumer warps, every warp arrives once per step, no spills."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    for pwa in (False, True):
        ck = cg.compile_kernel(37888, 3584, 3, 4, 64, 24, True, True, mt, mt == 1, sk=sched == "sk",
                               tail=sched == "tail", sbits=True, pwa=pwa)
        regs, spills = cg._resources(ck.asm["cubin"])
        assert spills == 0 and regs <= 64
        ptx = ck.asm["ptx"]
        assert _mma_loop_bars(cg, ck.asm["cubin"], "HMMA") == (0 if pwa else 2)
        assert _init_counts(ptx) == ([1, 4] * 3 if pwa else [1] * 6)  # 3 stages x (ready, empty)
        warp_arrives = ptx.count("@%pwa_p mbarrier.arrive")
        assert ptx.count("bar.warp.sync -1;") == warp_arrives and (warp_arrives > 0) == pwa


@pytest.mark.parametrize("mt,sched,warps", [(8, "split", 4), (8, "sk", 4), (8, "tail", 4), (1, "split", 4), (8, "split", 8)])
def test_gluon_gemv_x_smem_builds(mt, sched, warps):
    """Offline sm_90a build of the Gluon GEMV with XS (x copied by the producer beside each weight
    stage): no global load left in the consumer's main loop, x read with two 16-byte shared loads
    per thread and step, two 3-D TMA copy sites for x (the ring's first pass after the PDL wait and
    the steady loop beside the weight copies), no spills at 64 registers, and fewer main-loop
    instructions than the register path (the MMA's B pairs come from adjacent registers of one load)."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    counts = {}
    for xs in (False, True):
        ck = cg.compile_kernel(37888, 3584, 3, warps, 64, 24, True, True, mt, False, sk=sched == "sk",
                               tail=sched == "tail", sbits=True, pwa=mt > 1, xs=xs)
        regs, spills = cg._resources(ck.asm["cubin"])
        assert spills == 0 and regs <= 64
        loop = _mma_loop(cg, ck.asm["cubin"], "HMMA")
        ops = cg._opcodes(loop)
        counts[xs] = sum(ops.values())
        lds128 = sum("LDS.128" in line for line in loop)
        ptx = ck.asm["ptx"]
        assert lds128 == (2 if xs else 0)  # the weight tile is read with 64-bit loads
        if xs:
            assert ops.get("LDG", 0) == 0 and ptx.count("cp.async.bulk.tensor.3d") == 2
        else:
            assert ops.get("LDG", 0) > 0 and "cp.async.bulk.tensor.3d" not in ptx
    assert counts[True] < counts[False]


@pytest.mark.parametrize("sched", ["split", "sk", "tail"])
@pytest.mark.parametrize("xs", [False, True], ids=["x-regs", "x-smem"])
def test_gluon_gemv_glu_builds(sched, xs):
    """Offline sm_90a build of the Gluon GEMV's GLU form (a [gate; up] layer's 32 gate and 32 up rows
    per stage from one 3-D box each for words and scales, silu(gate) * up in the epilogue): no spills
    at 64 registers, the same main loop as the plain build (the stage's [2, 32, .] view is read as the
    [64, .] one), two 3-D weight copy sites more than the plain build (words and scales, first pass and
    steady loop with XS), and a 2 KB larger shared-memory footprint."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    built = {}
    for glu in (False, True):
        ck = cg.compile_kernel(37888, 3584, 3, 4, 64, 24, False, True, 8, False, sk=sched == "sk",
                               tail=sched == "tail", sbits=True, pwa=True, xs=xs, glu=glu)
        regs, spills = cg._resources(ck.asm["cubin"])
        assert spills == 0 and regs <= 64
        loop = _mma_loop(cg, ck.asm["cubin"], "HMMA")
        built[glu] = (cg._opcodes(loop), ck.asm["ptx"].count("cp.async.bulk.tensor.3d"), ck.metadata.shared)
    assert built[True][0] == built[False][0]
    assert built[True][1] == built[False][1] + (4 if xs else 2)
    assert built[True][2] == built[False][2] + 2048


@pytest.mark.parametrize("fold,n,k,bias,glu,sk", [(1, 3584, 3584, False, False, False), (1, 3584, 18944, False, False, False),
                                                  (2, 4608, 3584, True, False, False), (2, 37888, 3584, False, True, True)],
                         ids=["res-o", "res-down", "scale-qkv", "scale-glu-sk"])
def test_gluon_gemv_norm_fold_builds(fold, n, k, bias, glu, sk):
    """Offline sm_90a build of the Gluon GEMV's NORM_FOLD epilogues (RES: residual add, bf16(r w) and
    the partial sums of r^2; SCALE: the per-token RMS scale from those sums, loaded after the PDL wait):
    no spills at 64 registers and the very main loop of the build without them (the fold lives in the
    prologue and the epilogue only)."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    loops = {}
    for f in (0, fold):
        ck = cg.compile_kernel(n, k, 3, 4, 64, 24, bias, True, 8, False, sk=sk, sbits=True, pwa=True, xs=True,
                               glu=glu, fold=f)
        regs, spills = cg._resources(ck.asm["cubin"])
        assert spills == 0 and regs <= 64
        loops[f] = cg._opcodes(_mma_loop(cg, ck.asm["cubin"], "HMMA"))
    assert loops[fold] == loops[0]


@pytest.mark.parametrize("mt", [1, 8])
@pytest.mark.parametrize("xpf", [False, True], ids=["x-per-step", "x-ahead"])
def test_gluon_gemv_builds_for_hopper(mt, xpf):
    """Offline sm_90a build of the tensor-core Gluon GEMV (w4a16_gluon; MT = 8: one token per MMA
    column, both epilogues; XPF: x loaded a step ahead, built without a bias): no spills at its 64-register cap
    and 16 mma.sync per 64 x 256 step."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    for epi in (True, False):  # the shared-memory epilogue (the default) and the old one
        ck = cg.compile_kernel(7168, 5120, 3, 4, 64, 24, not xpf, False, mt, xpf, epi=epi)  # x-ahead: no bias
        regs, spills = cg._resources(ck.asm["cubin"])
        assert spills == 0 and regs <= 64
        assert ck.asm["ptx"].count("mma.sync.aligned.m16n8k16") == 16


def _linear_coords(lay, reg: int, lane: int, warp: int) -> list[int]:
    """The coordinate a DistributedLinearLayout gives register `reg` of lane `lane` in warp `warp`."""
    out = [0] * len(lay.shape)
    for idx, bases in ((reg, lay.reg_bases), (lane, lay.lane_bases), (warp, lay.warp_bases)):
        for bit, base in enumerate(bases):
            if idx >> bit & 1:
                out = [a ^ b for a, b in zip(out, base)]
    return out


def test_gluon_gemv_fragment_mapping_reads_the_layout():
    """The Gluon GEMV on fragment-ordered words (WF 2): every register the stage loads (_FRAG_W2, _FRAG_S2) and
    every B pair (the consumer's xoff, +4 / +16 / +20 in _x_step; with XS, _x_layout_frag's registers) is the one
    the MMA needs. Thread (g, t) of warp w,
    element (m, i), MMA u: the word's decoded pairs (layout.frag_decode_reference, the kernel's integer decode) are
    the codes of rows 16 m + g (+8) at K 16 s + 2 t (+1) and + 8 of slice s = 4 w + 2 u + i, the two scales are
    those rows' at slice s, and b0 / b1 are x pairs 8 s + t / + 4, on random codes laid out by codes_to_frag_tiles."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G

    codes = torch.randint(0, 16, (64, 256), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    flat = layout.codes_to_frag_tiles(codes).reshape(-1)  # one 64 x 256 tile: the stage's 2048 words
    scales = torch.arange(64 * 16).reshape(64, 16)  # stand-in bytes: each names its (row, slice)
    lw, ls, lx = G._FRAG_W2.value, G._FRAG_S2.value, G._x_layout_frag(8)
    bits = layout.frag_decode_reference(flat)  # [2048, 4] bit patterns of pairs h + 2 kh (no scale)
    bad = 0
    for warp in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for reg in range(16):  # words: register bits i, u, m0, m1
                i, u, m = reg & 1, reg >> 1 & 1, reg >> 2
                row, col = _linear_coords(lw, reg, lane, warp)
                word = row * 32 + col
                s_ = 4 * warp + 2 * u + i
                bad += word != m * 512 + warp * 128 + lane * 4 + 2 * u + i
                for h in range(2):
                    for kh in range(2):
                        pat = int(bits[word, h + 2 * kh])
                        for e in range(2):  # the half's code bits: (m, e0, e1) at 6..8, the sign at 15
                            half = pat >> (16 * e) & 0xFFFF
                            code = (half >> 6 & 7) | (half >> 12 & 8)
                            bad += code != int(codes[16 * m + 8 * h + g, 16 * s_ + 8 * kh + 2 * t + e])
                for h in range(2):  # scales: register bits i, u, h, m0, m1
                    srow, scol = _linear_coords(ls, i | u << 1 | h << 2 | m << 3, lane, warp)
                    bad += int(scales[srow, scol]) != (16 * m + 8 * h + g) * 16 + s_
                sc = 4 * warp + t  # the consumer's B offsets for element (sc, i)
                xoff = (sc // 4) * 32 + sc % 4 + i * 8 + 16 * u
                bad += (xoff, xoff + 4) != (8 * s_ + t, 8 * s_ + t + 4)
                for b in range(2):  # XS: the x stage [4 chunk, 8 token, 32 pair] register (b, i, u) of the thread
                    chunk, token, pair = _linear_coords(lx, b | i << 1 | u << 2, lane, warp)
                    bad += (chunk, token, 32 * chunk + pair) != (s_ // 4, g, 8 * s_ + t + 4 * b)
    assert bad == 0


def test_gluon_gemv_fragment_words_build():
    """Offline sm_90a build of the Gluon GEMV reading fragment-ordered words (WF 2; M = 1 and 8 tokens, 8 with x
    in the ring (XS), bias, PDL, all scales normal): every layout conversion is a register rename (the build asserts it), no spills at 64
    registers, 16 mma.sync per step, an integer decode below the rows order's (9 vs 11 ops per word), the four
    times as many scale conversions (each word spans two rows) paired two per PRMT + LEA with the halves selected
    by the multiplies (HMUL2 .H0_H0 / .H1_H1), and so fewer instructions per step than the rows order."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    for mt, xs in ((1, False), (8, False), (8, True)):
        ops = {}
        for frag in (False, True):
            ck = cg.compile_kernel(7168, 5120, 3, 4, 64, 24, True, True, mt, False, sbits=True, xs=xs, frag=frag)
            regs, spills = cg._resources(ck.asm["cubin"])
            assert spills == 0 and regs <= 64
            assert ck.asm["ptx"].count("mma.sync.aligned.m16n8k16") == 16
            ops[frag] = cg._opcodes(_mma_loop(cg, ck.asm["cubin"], "HMMA"))
        assert ops[True]["HMMA"] == ops[False]["HMMA"] == 16 and ops[True]["HMUL2"] == ops[False]["HMUL2"] == 64
        assert ops[True]["SHF"] + ops[True]["LOP3"] < ops[False]["SHF"] + ops[False]["LOP3"]
        assert ops[True]["PRMT"] == 16 and sum(ops[True].values()) < sum(ops[False].values())


def test_gluon_gemm_host_checks_and_buffers():
    """The host side the Gluon GEMMs (w4a16_wgmma, w4a16_rwg) share, on CPU tensors: one-line errors
    for a non-Gluon format, K off the 256 grid and a wrong x; a strided x made contiguous; the output
    written in place only when `out` is a dense bf16 [M, N]; fresh zeroed counters when the layer has
    too few; a workspace only with K slices."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_wgmma as WG

    state = {"fmt": "nvfp4", "n": 96, "k": 512, "kb": 2, "locks": torch.zeros(2, dtype=torch.int32)}
    x = torch.randn(512, 8).to(torch.bfloat16).T  # [8, 512], strided
    assert WG.checked_input(x, state, "rwg").is_contiguous()
    with pytest.raises(ValueError, match="rwg kernel takes nvfp4 / mxfp4"):
        WG.checked_input(x, dict(state, fmt="nf4"), "rwg")
    with pytest.raises(ValueError, match="multiple of 256"):
        WG.checked_input(x, dict(state, k=500), "wgmma")
    with pytest.raises(ValueError, match="bf16"):
        WG.checked_input(x.float(), state, "wgmma")
    x = x.contiguous()
    out = torch.empty(8, 96, dtype=torch.bfloat16)
    c, locks, ws = WG.launch_buffers(x, state, out, 2, 1, 64 * 16)
    assert c is out and locks is state["locks"] and ws.numel() == 1
    c, locks, ws = WG.launch_buffers(x, state, out.T.contiguous().T, 5, 3, 64 * 16)  # not dense: a new output
    assert c is not out and c.shape == (8, 96) and locks.numel() == 5 and not locks.any()
    assert ws.numel() == 5 * 3 * 64 * 16 and ws.dtype == torch.float32


def test_rwg_rows_rule():
    """w4a16_rwg's rows per program: the R whose programs fill their last wave better, ties to R = 2
    only where its tiles alone fill the SMs (132 SMs: the H100's); above 64 tokens by slice length."""
    from qerl.kernels import w4a16_triton as W

    assert W._rwg_rows(2560, 2048, 132) == 1  # 20 x 4 programs (61%) against 40 x 3 (91%)
    assert W._rwg_rows(5120, 13824, 132) == 2  # 40 x 3 (91%) against 80 x 1 (61%)
    assert W._rwg_rows(7168, 5120, 132) == 1  # 56 x 2 = 112 x 1: a tie, 56 tiles < 132
    assert W._rwg_rows(27648, 5120, 132) == 2  # 216 / 264 = 432 / 528: a tie, 216 tiles >= 132
    assert W._rwg_rows(37888, 3584, 132) == 1  # 592 / 660 (90%) against 296 / 396 (75%)
    # 592 row tiles overrun 132 SMs: R = 1 at two programs per SM, its ring depths by tokens per tile
    assert W._rwg_config(37888, 3584, 64, 132) == {"R": 1, **W.RWG_TWO_PER_SM[64]}
    assert W._rwg_config(37888, 3584, 20, 132) == {"R": 1, **W.RWG_TWO_PER_SM[32]}
    assert W._rwg_config(5120, 13824, 64, 132) == {"R": 2}  # 80 tiles: one per SM, the fill rule
    # 65..128 tokens: 128-token tiles; R = 2 where its K slices are long (54 steps in 3 slices), else R = 1
    assert W._rwg_config(5120, 13824, 100, 132) == {"BM": 128, "NSX": 2, "R": 2}
    assert W._rwg_config(5120, 5120, 128, 132) == {"BM": 128, "NSX": 2, "R": 1, "XREL": 1}  # 20 steps in 3 slices
    assert W._rwg_config(22016, 2048, 65, 132) == {"BM": 128, "NSX": 2, "R": 1, "XREL": 1}  # 8 steps


def test_rwg_three_per_sm_rule():
    """RWG_THREE_MIN_M..32 tokens on the layers whose 64-row tiles overrun the SMs: three rwg programs
    per SM (nvfp4 and mxfp4); fewer or more tokens and narrower layers keep the forms above. Off with
    RWG_THREE_PER_SM = {}."""
    from qerl.kernels import w4a16_triton as W

    three = {"R": 1, **W.RWG_THREE_PER_SM}
    assert three == THREE_PER_SM  # the form test_rwg_kernel_builds_for_hopper[M32-three-per-SM] builds
    for n, k in ((22016, 2048), (37888, 3584), (27648, 5120), (55296, 5120)):  # row tiles > 132 SMs
        assert W._rwg_config(n, k, 32, 132) == W._rwg_config(n, k, W.RWG_THREE_MIN_M, 132) == three
        assert W._rwg_config(n, k, W.RWG_THREE_MIN_M - 1, 132) == {"R": 1, **W.RWG_TWO_PER_SM[32]}
        assert W._rwg_config(n, k, 33, 132) == {"R": 1, **W.RWG_TWO_PER_SM[64]}
    # 56 / 112 / 80 row tiles: one program per SM, R by the fill rule, or its KP form where test_rwg_kp_rule
    # says (3584x18944 won standalone at three per SM but lost in the 7B decode chain)
    kp = {"R": 1, **W.RWG_KP_FORM} if W.RWG_KP else {"R": 1}
    assert W._rwg_config(3584, 18944, 32, 132) == kp and W._rwg_config(7168, 5120, 32, 132) == kp
    assert W._rwg_config(5120, 13824, 32, 132) == {"R": 2}
    assert W._rwg_config(27648, 5120, 32, 132, "mxfp4") == three  # mxfp4 timed on it in session 41
    assert W._rwg_config(27648, 5120, 23, 132, "mxfp4") == {"R": 1, **W.RWG_TWO_PER_SM[32]}
    old, W.RWG_THREE_PER_SM = W.RWG_THREE_PER_SM, {}
    try:
        assert W._rwg_config(27648, 5120, 32, 132) == {"R": 1, **W.RWG_TWO_PER_SM[32]}
    finally:
        W.RWG_THREE_PER_SM = old


@pytest.mark.parametrize("cfg", [{}, {"R": 1, "KP": 2, "NSX": 4}], ids=["rwg", "KP2"])
def test_rwg_launch_constexprs_match_the_kernel(cfg):
    """The constexpr arguments forward() passes (kernel_args' plus HAS_BIAS) are exactly the kernel's
    constexpr parameters, for both rwg kernels: the offline build fills in what it is given, so a parameter
    the wrapper stopped passing (session 41: PWA on the KP kernel) only failed at the first GPU launch."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_rwg as R

    consts, cfg_ = R.kernel_args(32, cfg)
    kernel = R.kernel_for(cfg_["KP"])
    assert {p.name for p in kernel.params if p.is_constexpr} == set(consts) | {"HAS_BIAS"}


def test_rwg_kp_rings_are_even():
    """rwg's KP form (two MMA warpgroups on alternate K steps) only with R = 1 and rings of an even number of
    stages, so each stage belongs to one warpgroup: with three activation stages a warpgroup can reach a stage
    two phases ahead of its last wait there, where mbarrier.try_wait.parity passes at once (on the H100 one
    output in 2000 differed, session 41). The wrapper cuts the split to slices of >= 2 steps."""
    from qerl.kernels import w4a16_rwg as R
    from qerl.kernels import w4a16_triton as W

    for bad in ({"R": 1, "KP": 2}, {"R": 1, "KP": 2, "NSX": 3}, {"R": 1, "KP": 2, "NSW": 3, "NSX": 4},
                {"R": 2, "KP": 2, "NSX": 4}, {"R": 1, "KP": 3, "NSX": 4}):
        with pytest.raises(ValueError, match="KP"):
            R.kernel_args(32, bad)
    consts, cfg = R.kernel_args(32, {"R": 1, **W.RWG_KP_FORM})
    assert cfg["KP"] == 2 and consts["NSW"] % 2 == consts["NSX"] % 2 == 0 and "PWA" not in consts
    assert R.smem_bytes(32, 1, 4, 4, 2) == R.smem_bytes(32, 1, 4, 4) + 64 * 32 * 4  # + the odd steps' sum


def test_rwg_kp_rule():
    """17..64 tokens on the layers whose 64-row tiles fit one wave: rwg's KP form (two MMA warpgroups on
    alternate K steps) where its slices run >= RWG_KP_MIN_STEPS steps and, against R = 2, the fitted time
    model favours it (the layers timed in session 41). On by default since session 42 (the even-ring form ran
    race-free on the GPU and gained in the 7B chain); RWG_KP = {} turns it off."""
    from qerl.kernels import w4a16_triton as W

    assert W.RWG_KP == W.RWG_KP_FORM
    _check_kp_rule(W, {"R": 1, **W.RWG_KP_FORM})
    old, W.RWG_KP = W.RWG_KP, {}
    try:
        assert W._rwg_config(7168, 5120, 32, 132) == {"R": 1}
        assert W._rwg_config(5120, 13824, 32, 132) == {"R": 2}
    finally:
        W.RWG_KP = old


def _check_kp_rule(W, kp):
    for m in (17, 32, 64):
        for n, k in ((7168, 5120), (4608, 3584), (3584, 18944), (3584, 3584), (2048, 11008)):  # won standalone
            assert W._rwg_config(n, k, m, 132) == kp, (n, k, m)
        assert W._rwg_config(2048, 2048, m, 132) == {"R": 1}  # 2-step slices: lost
        assert W._rwg_config(2560, 2048, m, 132) == {"R": 1}  # 3-step slices: lost
        assert W._rwg_config(5120, 13824, m, 132) == {"R": 2}  # R = 2 at 27 us against 34
        assert W._rwg_config(27648, 5120, m, 132)["R"] == 1 and "KP" not in W._rwg_config(27648, 5120, m, 132)
    assert W._rwg_kp_wins(4608, 3584, 132, 2) and not W._rwg_kp_wins(5120, 27648, 132, 2)


def test_small_m_wgmma_rule():
    """M = 17..64: the wgmma GEMM with one program per SM on the small layers, two per SM at
    M = 33..64 on the others up to N = 8192, else (None) the fused Triton kernel."""
    from qerl.kernels import w4a16_triton as W

    assert W._small_m_wgmma(2048, 2048, 32) == {} and W._small_m_wgmma(2048, 11008, 64) == {}
    assert W._small_m_wgmma(3584, 3584, 17) == {}
    assert W._small_m_wgmma(4608, 3584, 32) is None and W._small_m_wgmma(4608, 3584, 33) == W.WGMMA_TWO_PER_SM
    assert W._small_m_wgmma(7168, 5120, 64) == W.WGMMA_TWO_PER_SM
    assert W._small_m_wgmma(3584, 18944, 64) == W.WGMMA_TWO_PER_SM  # N*K 68M: not a small layer
    assert W._small_m_wgmma(22016, 2048, 64) is None and W._small_m_wgmma(55296, 5120, 48) is None


def test_wgmma_config_errors_are_one_line():
    """Configs the wgmma kernel cannot build are refused before compiling, with the reason."""
    from qerl.kernels.w4a16_wgmma import kernel_args

    with pytest.raises(ValueError, match="BM=256 needs maxnreg"):
        kernel_args("nvfp4", 300, {"maxnreg": 80})
    with pytest.raises(ValueError, match="BN must be 64 or 128"):
        kernel_args("nvfp4", 64, {"BN": 96})
    assert kernel_args("nvfp4", 64, {"maxnreg": 80})[0]["BM"] == 64  # the two-per-SM form builds


def test_wgmma_host_caches_follow_their_layer():
    """The wgmma launch's host caches: kernel arguments are memoised per (format, M, config) and
    follow a change of the PDL default; the weight / scale TMA descriptors live in the layer's
    state dict, are rebuilt for a state that points at other rows (a fused layer's slice), and die
    with the layer (a module-level cache kept freed 32B weights alive and ran out of memory)."""
    pytest.importorskip("triton.experimental.gluon")
    import gc
    import weakref

    from qerl.kernels import w4a16_triton as W
    from qerl.kernels import w4a16_wgmma as G

    assert G.kernel_args("nvfp4", 256) is G.kernel_args("nvfp4", 256)
    before = W.PDL
    try:
        W.PDL = not before
        assert G.kernel_args("nvfp4", 256)[0]["PDL"] is (not before)
    finally:
        W.PDL = before
    assert G.kernel_args("nvfp4", 256)[0]["PDL"] is before

    words = torch.zeros(4, 2, 64, 32, dtype=torch.int32)
    state = {"fmt": "nvfp4", "words": words, "scale": torch.zeros(4, 2, 64, 16, dtype=torch.uint8)}
    first = G._weight_descriptors(state)
    assert G._weight_descriptors(state)[0] is first[0]
    sub = dict(state, words=words[1:3], scale=state["scale"][1:3])  # as fuse._share_kernel_state slices
    other = G._weight_descriptors(sub)
    assert other[0] is not first[0] and other[0].base.data_ptr() == words[1:3].data_ptr()
    ref = weakref.ref(words)
    del state, sub, first, other, words
    gc.collect()
    assert ref() is None, "a cached descriptor kept the layer's weights alive"


def test_large_m_wgmma_rule_and_split():
    """The large-M dispatch picks the 128-row wgmma tiles where they fill >= 84% of the last wave,
    64-row ones where those fill >= 80%, else dequant + cuBLAS (None); the split rule."""
    from qerl.kernels import w4a16_triton as W
    from qerl.kernels.w4a16_wgmma import split

    assert W._large_m_wgmma(55296, 1024, 132) == W.WGMMA_BN128  # 1728 tiles: 14 waves, 94% full
    assert W._large_m_wgmma(7168, 1024, 132) == W.WGMMA_BN128  # 224 tiles: 2 waves, 85%
    assert W._large_m_wgmma(2048, 1024, 132) == {}  # 128-row: 64 tiles (48%); 64-row: 128 (97%)
    assert W._large_m_wgmma(5120, 1024, 132) == {}  # 64-row: 320 tiles, 3 waves, 81%
    assert W._large_m_wgmma(2560, 1024, 132) is None  # 160 / 80 tiles: 61% either way
    assert W._large_m_wgmma(4608, 512, 132) is None
    assert split(112, 20, 132) == 1 and split(32, 43, 132) == 4 and split(40, 8, 132) == 3
    assert split(80, 20, 132, c0=2.0) == 3 and split(864, 20, 132, c0=2.0) == 1


def test_capture_check_collects_loads_only_while_capturing(monkeypatch):
    """qerl.kernels.capture_check: its hook on Triton's kernel_load_start_hook chain records a kernel load
    only while the current stream captures, and leaves the chain as it found it."""
    pytest.importorskip("triton")
    from triton import knobs

    from qerl.kernels.capture_check import loads_during_capture

    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    before = list(knobs.runtime.kernel_load_start_hook.calls)
    with loads_during_capture() as loads:
        knobs.runtime.kernel_load_start_hook(None, None, "warm_kernel", None, "h0")
        capturing[0] = True
        knobs.runtime.kernel_load_start_hook(None, None, "late_kernel", None, "h1")
    knobs.runtime.kernel_load_start_hook(None, None, "after_kernel", None, "h2")
    assert loads == ["late_kernel"]
    assert knobs.runtime.kernel_load_start_hook.calls == before


def test_gluon_streamk_schedule():
    """The Gluon GEMV's stream-K schedule, simulated on the host with the kernel's formulas: every
    (row block, K step) is covered by exactly one program, each program's runs differ by at most
    one step, the programs that meet in a block are owner(first step) .. owner(last step), each
    writes its partial of that block to its own workspace slot (2q for its first segment, 2q + 1
    for its last), no two contributors share a slot, and streamk_plan's count of contributors is
    the largest one seen."""
    from qerl.kernels import w4a16_gluon as G

    def owner(f, p, t):
        return ((f + 1) * p - 1) // t

    for blocks, kb, slots in [(592, 14, 528), (864, 20, 528), (72, 14, 528), (16, 8, 528), (3, 5, 7), (56, 74, 528),
                              (1, 1, 528), (10, 3, 4)]:
        p, most = G.streamk_plan(blocks, kb, slots)
        t = blocks * kb
        assert p == min(slots, t)
        starts = [q * t // p for q in range(p + 1)]
        assert min(b - a for a, b in zip(starts, starts[1:])) >= 1
        assert max(b - a for a, b in zip(starts, starts[1:])) - min(b - a for a, b in zip(starts, starts[1:])) <= 1
        seen = {}
        for q in range(p):
            f = starts[q]
            while f < starts[q + 1]:  # the kernel's segment loop
                blk = f // kb
                s1 = min(starts[q + 1], blk * kb + kb) - blk * kb
                slot = 2 * q + (f != starts[q])
                seen.setdefault(blk, []).append((q, slot, f - blk * kb, s1))
                f = blk * kb + s1
        worst = 1
        for blk, segs in seen.items():
            steps = [k for _q, _s, a, b in segs for k in range(a, b)]
            assert steps == list(range(kb))  # each step once, the programs in order
            qs = [q for q, *_ in segs]
            assert qs == list(range(owner(blk * kb, p, t), owner(blk * kb + kb - 1, p, t) + 1))
            slots_used = [2 * q + (starts[q] // kb != blk) for q in qs]  # the fixup's reading of the slots
            assert slots_used == [slot for _q, slot, *_ in segs] and len(set(slots_used)) == len(slots_used)
            worst = max(worst, len(segs))
        assert worst == most
    assert G.STREAMK is None  # auto: inside PDL chains where a split tail would apply


def test_gemv_plan_reserves_slots(monkeypatch):
    """w4a16_ws._plan(reserve=): the split plan fills the slots another kernel's resident programs leave
    (w4a16_gluon.RESERVE, engine.LORA_RESIDENT_RESERVE). On an H100 at 4 per SM (528 slots) the 7B q/k/v GEMV
    (72 blocks x 14 steps) takes S = 7 (504 programs), with 32 slots reserved S = 5 (360, all at once in the
    496 left); the 7B down GEMV (56 x 74) 9 -> 8 slices (504 -> 448)."""
    from qerl.kernels import w4a16_triton as W
    from qerl.kernels import w4a16_ws as WS

    monkeypatch.setattr(W, "_num_sms", lambda index: 132)
    got = []
    for n, k in ((4608, 3584), (3584, 18944)):
        kb = k // 256
        st = {"words": torch.zeros(n // 64, kb, 64, 32, dtype=torch.int32), "n": n, "kb": kb, "fmt": "nvfp4",
              "scale": torch.zeros(n // 64, kb, 64, 16, dtype=torch.uint8), "locks": torch.zeros(n // 64, dtype=torch.int32)}
        x = torch.zeros(8, k, dtype=torch.bfloat16)
        got += [WS._plan(x, st, None, None, 4, 8)[:2], WS._plan(x, st, None, None, 4, 8, reserve=32)[:2]]
    assert got == [(7, 504), (5, 360), (9, 504), (8, 448)], got


def test_gluon_tail_split_plan():
    """The split-tail schedule: blocks below NW whole, the last wave's r = blocks % slots blocks in S
    slices of CS steps, as the kernel maps program p: every (block, step) once, the tail's programs
    fit the slots, and the fixup's contributors of a tail block are NW + (blk - NW) S .. + S - 1.
    On an H100 (528 slots at 4 per SM) the 7B gate/up GEMV (592 blocks x 14) gets 528 whole blocks
    and 64 in 7 slices of 2 steps; the 32B one (864 blocks, a 64%-full second wave), 14B's (432,
    one wave) and layers with fewer blocks than slots get none."""
    from qerl.kernels import w4a16_gluon as G

    assert G.TAIL_SPLIT is None  # auto
    slots = 4 * 132
    assert G.tail_plan(592, 14, slots) == (528, 7, 2)
    assert G.tail_plan(864, 20, slots) is None and G.tail_plan(432, 20, slots) is None
    assert G.tail_plan(72, 14, slots) is None and G.tail_plan(1056, 14, slots) is None
    for blocks, kb, sl in [(592, 14, 528), (141, 4, 132), (592, 14, 132), (600, 3, 528), (530, 80, 528)]:
        nw, s, cs = G.tail_plan(blocks, kb, sl)
        assert (blocks - nw) * s <= sl and s >= 2 and (s - 1) * cs < kb <= s * cs
        cover = {}
        for p in range(nw + (blocks - nw) * s):  # the kernel's mapping
            if p >= nw:
                q = p - nw
                blk, k0 = nw + q // s, (q % s) * cs
                k1 = min(k0 + cs, kb)
            else:
                blk, k0, k1 = p, 0, kb
            cover.setdefault(blk, []).append((p, k0, k1))
        assert sorted(cover) == list(range(blocks))
        for blk, segs in cover.items():
            assert [k for _p, a, b in segs for k in range(a, b)] == list(range(kb))
            if blk >= nw:
                assert [p for p, *_ in segs] == list(range(nw + (blk - nw) * s, nw + (blk - nw) * s + s))


def test_gluon_xpf_auto_rule():
    """XPF = None (the default) loads x a step ahead for M = 1 launches of one K slice per row
    block that take more than one wave of programs: on a 132-SM H100 at 4 programs per SM the 7B
    and 32B gate/up GEMVs (592 and 864 programs), not 14B's (432), nor split ones; and for M = 2..8
    launches with K >= XPF_TOKENS_MIN_K (4096): 14B / 32B layers and 7B's down, not 7B's K = 3584."""
    from qerl.kernels import w4a16_gluon as G

    assert G.DEFAULT["XPF"] is None and G.XPF_TOKENS_MIN_K == 4096
    slots = 4 * 132
    assert G.xpf_auto(1, 1, 37888 // 64, slots, 3584) and G.xpf_auto(1, 1, 55296 // 64, slots, 5120)
    assert not G.xpf_auto(1, 1, 27648 // 64, slots, 5120)
    assert not G.xpf_auto(1, 4, 112 * 4, slots, 5120) and not G.xpf_auto(1, 4, 112 * 4, slots, 18944)
    assert G.xpf_auto(8, 1, 864, slots, 5120) and G.xpf_auto(8, 7, 392, slots, 18944)
    assert not G.xpf_auto(8, 1, 592, slots, 3584) and not G.xpf_auto(8, 1, 72, slots, 3584)
    old, G.XPF_TOKENS_MIN_K = G.XPF_TOKENS_MIN_K, 0
    try:
        assert not G.xpf_auto(8, 1, 864, slots, 5120)
    finally:
        G.XPF_TOKENS_MIN_K = old


def test_gluon_xs_auto_rule():
    """XS = None (the default) copies x beside the weight stages for M = 2..8 launches except one
    wave of whole 64-row blocks (14B gate/up: 432 blocks on an H100's 528 slots at 4 programs per
    SM), and for M = 1 launches of layers with more blocks than slots (7B / 32B gate/up)."""
    from qerl.kernels import w4a16_gluon as G

    assert G.DEFAULT["XS"] is None and G.X_SMEM is None
    slots = 4 * 132
    assert all(G.xs_auto(8, n // 64, slots) for n in (37888, 55296, 3584, 4608, 5120, 7168, 264 * 64))
    assert not any(G.xs_auto(8, n // 64, slots) for n in (27648, 265 * 64, 528 * 64))
    assert G.xs_auto(1, 37888 // 64, slots) and G.xs_auto(1, 55296 // 64, slots)
    assert not any(G.xs_auto(1, n // 64, slots) for n in (27648, 4608, 3584, 7168))


def test_gluon_schedule_choice():
    """Which schedule a Gluon GEMV launch gets (w4a16_gluon.schedule), on a 132-SM H100 at 4 per SM:
    the 7B gate/up GEMV (592 blocks x 14) runs stream-K in a PDL chain and the split tail without
    one; a LoRA plan (3 per SM, stream-K off) keeps the tail where the blocks overrun the resident
    programs (7B) and the plain split where they fit (14B, 432 blocks); spare slots shrink the stream-K
    grid; split layers, a forced S and
    STREAMK / TAIL_SPLIT off keep the split plan; a forced tail with none to make is an error."""
    from qerl.kernels import w4a16_gluon as G

    full, lora = 4 * 132, 3 * 132
    assert G.schedule(592, 14, 1, 592, full, full, True, True, None, None) == ("sk", 528, 1, 0, 0, 2)
    # spare slots (the GLU launch's SK_SPARE_GLU): stream-K on 524 programs, still at most 2 per block
    assert G.schedule(592, 14, 1, 592, full, full, True, True, None, None, 4) == ("sk", 524, 1, 0, 0, 2)
    assert G.schedule(592, 14, 1, 592, full, full, False, True, None, None) == ("tail", 976, 7, 528, 2, 8)
    assert G.schedule(592, 14, 1, 592, lora, full, True, True, None, False)[0] == "tail"
    assert G.schedule(432, 20, 1, 432, lora, full, True, True, None, False) == ("split", 432, 1, 0, 0, 1)
    assert G.schedule(72, 14, 7, 504, full, full, True, True, None, None) == ("split", 504, 7, 0, 0, 8)
    assert G.schedule(592, 14, 1, 592, full, full, True, False, None, None)[0] == "split"  # forced S
    assert G.schedule(592, 14, 1, 592, full, full, True, True, False, False)[0] == "split"
    assert G.schedule(72, 14, 7, 504, full, full, True, True, None, True)[0] == "sk"  # forced stream-K
    with pytest.raises(ValueError, match="no split tail"):
        G.schedule(72, 14, 7, 504, full, full, False, True, True, None)


def test_routes_to_gluon_tokens(monkeypatch):
    """The GLU launch's gate (`routes_to_gluon_tokens`) follows forward's routing: with or without a PDL chain
    every 2..8-token layer runs on the Gluon GEMV (since session 45; the standalone thresholds still apply
    when set, e.g. the old N >= 16384 and K >= 4096), never M = 1 or 16 tokens, mxfp4 only where
    WSMMA_FORMATS names it, and nothing off sm_90 (here: _wsmma_ok)."""
    from qerl.kernels import w4a16_triton as W

    x = lambda m, k: torch.zeros(m, k, dtype=torch.bfloat16)  # noqa: E731
    gate_up = {"n": 37888, "k": 3584, "kb": 14, "fmt": "nvfp4"}
    wide = {"n": 55296, "k": 5120, "kb": 20, "fmt": "nvfp4"}
    assert not W.routes_to_gluon_tokens(x(8, 3584), gate_up)  # CPU: no Gluon kernels
    monkeypatch.setattr(W, "_wsmma_ok", lambda device, state: True)
    monkeypatch.setattr(W, "CHAIN_ROUTING", True)
    assert [W.routes_to_gluon_tokens(x(m, 3584), gate_up) for m in (1, 2, 5, 8, 16)] == [False, True, True, True, False]
    assert W.WSMMA_FORMATS == ("nvfp4", "mxfp4")  # the default since session 44
    assert W.routes_to_gluon_tokens(x(8, 3584), {**gate_up, "fmt": "mxfp4"})
    assert W._fused_route(1, {**wide, "fmt": "mxfp4"}, torch.device("cpu"), None)[0] == "wsmma"
    monkeypatch.setattr(W, "WSMMA_FORMATS", ("nvfp4",))  # ablate_rollout.py's `nowsmx`
    assert not W.routes_to_gluon_tokens(x(8, 3584), {**gate_up, "fmt": "mxfp4"})
    assert W._fused_route(1, {**wide, "fmt": "mxfp4"}, torch.device("cpu"), None)[0] != "wsmma"
    assert W.routes_to_gluon_tokens(x(8, 3584), gate_up)
    monkeypatch.setattr(W, "CHAIN_ROUTING", False)
    assert W.routes_to_gluon_tokens(x(8, 3584), gate_up)  # standalone too since session 45
    assert W.routes_to_gluon_tokens(x(2, 2048), {"n": 2048, "k": 2048, "kb": 8, "fmt": "nvfp4"})
    monkeypatch.setattr(W, "WSMMA_TOKENS_MIN_N", 16384)  # ablate_rollout.py's `gluon44`
    monkeypatch.setattr(W, "WSMMA_TOKENS_MIN_K", 4096)
    assert not W.routes_to_gluon_tokens(x(8, 3584), gate_up)  # K 3584 < 4096 without the chain
    assert W.routes_to_gluon_tokens(x(8, 5120), wide)
    monkeypatch.setattr(W, "CHAIN_ROUTING", True)
    assert W.routes_to_gluon_tokens(x(8, 3584), gate_up)  # the chain keeps its own rule


def test_fragment_order_routes(monkeypatch):
    """A "frag" layer (fragment-ordered words) runs rwg at every decode size on sm_90 (rwg's rule from
    RWG_MIN_M tokens, its defaults below; with FRAG_GEMV_MAX_M the Gluon GEMV up to that many tokens), the bf16
    buffer + cuBLAS above rwg's range (with FRAG_WGMMA the wgmma GEMM), the Triton kernel elsewhere, and never a
    kernel that reads only rows-ordered words (the CUDA-core GEMV refuses it in one line); the Gluon GEMV only with
    4 consumer warps, the wgmma GEMM with 4 decoder warps."""
    from qerl.kernels import w4a16_gemv, w4a16_gluon, w4a16_wgmma
    from qerl.kernels import w4a16_triton as W

    frag = {"n": 37888, "k": 3584, "kb": 14, "fmt": "nvfp4", "order": "frag"}
    cpu = torch.device("cpu")
    assert W._fused_route(4, frag, cpu, None) == ("fused", None)  # no Gluon kernels here
    monkeypatch.setattr(W, "_wsmma_ok", lambda device, state: True)
    monkeypatch.setattr(W, "_num_sms", lambda index: 132)
    assert W.FRAG_GEMV_MAX_M == 8 and W.FRAG_WGMMA and W.FRAG_BWD_DEQUANT  # the defaults (session 77)
    monkeypatch.setattr(W, "FRAG_GEMV_MAX_M", 0)  # rwg alone
    for m in (1, 8):
        assert W._fused_route(m, frag, cpu, None) == ("rwg", None), m
    for m in (9, 16):  # FRAG_SMALL_RULE: the 17..32-token rule (three per SM for this wide, K <= 4096 layer)
        assert W._fused_route(m, frag, cpu, None) == ("rwg", W._rwg_config(37888, 3584, W.RWG_THREE_MIN_M, 132)), m
        assert W._fused_route(m, {**frag, "k": 5120}, cpu, None) == ("rwg", W._rwg_config(37888, 5120, 17, 132)), m
        assert W._rwg_config(37888, 3584, W.RWG_THREE_MIN_M, 132)["NSW"] == 2  # (the two rules differ)
        assert W._rwg_config(37888, 5120, 17, 132)["NSW"] == 4
    monkeypatch.setattr(W, "FRAG_SMALL_RULE", 0)
    assert W._fused_route(16, frag, cpu, None) == ("rwg", None)
    monkeypatch.setattr(W, "FRAG_SMALL_RULE", 1)
    for m in (17, 32, 64, 128):
        path, cfg = W._fused_route(m, frag, cpu, {"PDL": 1})
        assert path == "rwg" and cfg == {**W._rwg_config(37888, 3584, m, 132), "PDL": 1}, m
    assert W._fused_route(129, frag, cpu, None)[0] == "wgmma"  # the wgmma GEMM's fragment path (the default)
    monkeypatch.setattr(W, "FRAG_WGMMA", 0)
    assert W._fused_route(129, frag, cpu, None)[0] == "dequant"
    monkeypatch.setattr(W, "FRAG_BWD_DEQUANT", 0)  # off: the fused kernel's input gradient below DEQUANT_MIN_M
    assert [W._bwd_path(m, frag, None) for m in (256, W.DEQUANT_MIN_M)] == ["fused", "dequant"]
    monkeypatch.setattr(W, "FRAG_BWD_DEQUANT", 1)
    assert [W._bwd_path(m, frag, None) for m in (1, 256, W.DEQUANT_MIN_M)] == ["dequant"] * 3
    assert W._bwd_path(256, {**frag, "order": "rows"}, None) == "fused"  # rows layers keep the fused kernel
    assert W._bwd_path(256, frag, {"PATH": "fused"}) == "fused"  # an explicit path or tile config keeps its kernel
    assert W._bwd_path(256, frag, {"BO": 64}) == "fused"
    assert not W.routes_to_gluon_tokens(torch.zeros(4, 3584, dtype=torch.bfloat16), frag)
    assert W.routes_to_gluon_tokens(torch.zeros(4, 3584, dtype=torch.bfloat16), {**frag, "order": "rows"})
    monkeypatch.setattr(W, "FRAG_GEMV_MAX_M", 8)  # the Gluon GEMV's fragment path (the default)
    assert [W._fused_route(m, frag, cpu, None)[0] for m in (1, 8, 9)] == ["wsmma", "wsmma", "rwg"]
    assert W.routes_to_gluon_tokens(torch.zeros(4, 3584, dtype=torch.bfloat16), frag)
    x = torch.zeros(4, 3584, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reads rows-ordered words"):
        w4a16_gemv.forward(x, frag)
    with pytest.raises(ValueError, match="4 decoder warps"):
        w4a16_wgmma.forward(x, frag, config={"DW": 8})
    with pytest.raises(ValueError, match="4 consumer warps"):
        w4a16_gluon.forward(x, frag, config={"num_warps": 8})


def test_fragment_order_rule_refinements(monkeypatch):
    """The four frag-only refinements of rwg's 17..64-token rule (on by default since sessions 79 / 80: 4096 / 5 /
    48 / 2048): all 0, the frag route gives _rwg_config's config; each alone moves exactly the layers its comment
    names: FRAG_THREE_MAX_K the wide K > 4096 layers at 24..32 tokens to the two-per-SM form, FRAG_KP_MARGIN_PCT
    5120^2 alone to KP, FRAG_R2_WIDE_MAX_M the wide layers at 33..48 tokens to R = 2, FRAG_THREE64_MAX_K 22016x2048
    alone at 49..64 tokens to three per SM at BM 64; the defaults move the union of the four. Rows-ordered layers
    never take them."""
    from qerl.kernels import w4a16_triton as W

    shapes = [(2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008), (4608, 3584), (3584, 3584), (37888, 3584),
              (3584, 18944), (7168, 5120), (5120, 5120), (27648, 5120), (5120, 13824), (55296, 5120), (5120, 27648)]
    monkeypatch.setattr(W, "_wsmma_ok", lambda device, state: True)
    monkeypatch.setattr(W, "_num_sms", lambda index: 132)
    cpu = torch.device("cpu")
    names = ("FRAG_THREE_MAX_K", "FRAG_KP_MARGIN_PCT", "FRAG_R2_WIDE_MAX_M", "FRAG_THREE64_MAX_K")
    defaults = {name: getattr(W, name) for name in names}
    assert defaults == {"FRAG_THREE_MAX_K": 4096, "FRAG_KP_MARGIN_PCT": 5, "FRAG_R2_WIDE_MAX_M": 48,
                        "FRAG_THREE64_MAX_K": 2048}
    ms = (17, 20, 24, 32, 33, 40, 48, 49, 56, 64)

    def routed(order="frag"):
        return {(n, k, m): W._fused_route(m, {"n": n, "k": k, "kb": k // 256, "fmt": "nvfp4", "order": order}, cpu,
                                          None)[1] for n, k in shapes for m in ms}

    on = routed()
    for name in names:
        monkeypatch.setattr(W, name, 0)
    base = routed()
    assert all(cfg == W._rwg_config(n, k, m, 132) for (n, k, m), cfg in base.items())
    union = {}
    two32 = {"R": 1, **W.RWG_TWO_PER_SM[32]}
    kp = {"R": 1, **W.RWG_KP}
    for name, value, moved in (
            ("FRAG_THREE_MAX_K", 4096, {(n, k, m): two32 for n, k in ((27648, 5120), (55296, 5120)) for m in (24, 32)}),
            ("FRAG_KP_MARGIN_PCT", 5, {(5120, 5120, m): kp for m in ms}),
            ("FRAG_R2_WIDE_MAX_M", 48, {(n, k, m): {"R": 2} for n, k in ((22016, 2048), (37888, 3584), (27648, 5120),
                                                                          (55296, 5120)) for m in (33, 40, 48)}),
            ("FRAG_THREE64_MAX_K", 2048, {(22016, 2048, m): W.FRAG_THREE64 for m in (49, 56, 64)})):
        monkeypatch.setattr(W, name, value)
        now = routed()
        assert {key: cfg for key, cfg in now.items() if cfg != base[key]} == moved, name
        rows = routed("rows")
        assert all(cfg == W._rwg_config(n, k, m, 132) for (n, k, m), cfg in rows.items()), name
        monkeypatch.setattr(W, name, 0)
        assert value == defaults[name] and not set(union) & set(moved)
        union.update(moved)
    assert {key: cfg for key, cfg in on.items() if cfg != base[key]} == union


def test_rows_in_storage():
    """rwg's XROWS view: x = buf[:M] seen as its first `rows` rows only where buf holds them from x's first row on
    (and x is row-major); the view's first M rows are x's own."""
    from qerl.kernels.w4a16_wgmma import rows_in_storage

    buf = torch.arange(64 * 8, dtype=torch.bfloat16).view(64, 8)
    x = buf[:40]
    v = rows_in_storage(x, 64)
    assert v.shape == (64, 8) and v.data_ptr() == x.data_ptr() and torch.equal(v[:40], x) and torch.equal(v, buf)
    assert rows_in_storage(x, 40) is x and rows_in_storage(x, 16) is x
    assert rows_in_storage(buf[8:48], 56).shape == (56, 8)  # an offset view: rows 8..63 are in the storage
    assert rows_in_storage(buf[8:48], 64) is None  # rows 64..71 are not
    assert rows_in_storage(torch.zeros(40, 8, dtype=torch.bfloat16), 64) is None  # a tensor of its own
    assert rows_in_storage(buf[:40, :4], 64) is None  # not row-major over its K
    from qerl.kernels import w4a16_rwg, w4a16_triton as W

    # unset in a config: w4a16_rwg.XROWS, on since session 79; a path key the Triton kernels drop
    assert w4a16_rwg.DEFAULT["XROWS"] is None and w4a16_rwg.XROWS == 1 and "XROWS" in W._PATH_KEYS
    assert W._kernel_config({"XROWS": 1}, {"BO": 64}) == {"BO": 64}


def test_decode_gemm_inputs_in_whole_tiles(monkeypatch):
    """decode_ops.gemm_input: with ROW_TILE (64 by default since session 79) the first M rows of a buffer of whole
    tiles from 9 rows (rwg's), so rwg's XROWS view of the last tile exists (rows_in_storage), and none for M already
    a whole number of tiles; exactly M rows at 1..8 rows (the Gluon GEMV's) and with ROW_TILE 0."""
    from qerl.kernels import decode_ops
    from qerl.kernels.w4a16_wgmma import rows_in_storage

    assert decode_ops.ROW_TILE == 64
    monkeypatch.setattr(decode_ops, "ROW_TILE", 0)
    x = decode_ops.gemm_input(40, 8, torch.bfloat16, "cpu")
    assert x.shape == (40, 8) and rows_in_storage(x, 64) is None
    monkeypatch.setattr(decode_ops, "ROW_TILE", 64)
    for m, rows in ((40, 64), (17, 64), (9, 64), (64, 64), (100, 128)):
        x = decode_ops.gemm_input(m, 8, torch.bfloat16, "cpu")
        assert x.shape == (m, 8) and x.is_contiguous() and x.untyped_storage().nbytes() == rows * 8 * 2, m
        assert rows_in_storage(x, rows) is not None and rows_in_storage(x, rows + 64) is None, m
    for m in (1, 8):  # the Gluon GEMV's rows: exactly M, as before ROW_TILE
        assert decode_ops.gemm_input(m, 8, torch.bfloat16, "cpu").untyped_storage().nbytes() == m * 8 * 2, m


def test_gluon_gemv_m1_threshold(monkeypatch):
    """M = 1 goes to the Gluon GEMV from WSMMA_MIN_NK weights (8M since session 45), the same threshold with or
    without a PDL chain; below it the CUDA-core GEMV; nf4 never; nothing off sm_90."""
    from qerl.kernels import w4a16_triton as W

    cpu = torch.device("cpu")
    layer = lambda n, k, fmt="nvfp4": {"n": n, "k": k, "kb": k // 256, "fmt": fmt}  # noqa: E731
    assert W._fused_route(1, layer(3584, 3584), cpu, None)[0] == "gemv"  # CPU: no Gluon kernels
    monkeypatch.setattr(W, "_wsmma_ok", lambda device, state: True)
    assert W.WSMMA_MIN_NK == W.WSMMA_MIN_NK_PDL == 8_000_000
    for chain in (False, True):
        monkeypatch.setattr(W, "CHAIN_ROUTING", chain)
        routes = [W._fused_route(1, layer(n, k), cpu, None)[0] for n, k in ((2048, 2048), (2560, 2048), (3584, 3584),
                                                                            (7168, 5120), (55296, 5120))]
        assert routes == ["gemv", "gemv", "wsmma", "wsmma", "wsmma"], (chain, routes)
        assert W._fused_route(1, layer(3584, 3584, "mxfp4"), cpu, None)[0] == "wsmma"
        assert W._fused_route(1, layer(3584, 3584, "nf4"), cpu, None)[0] != "wsmma"
    monkeypatch.setattr(W, "WSMMA_MIN_NK", 60_000_000)  # `gluon44`, standalone
    monkeypatch.setattr(W, "CHAIN_ROUTING", False)
    assert W._fused_route(1, layer(7168, 5120), cpu, None)[0] == "gemv"


def test_mxfp4_scale_bits():
    """prepare's mxfp4 `scale_bits` (the Gluon GEMV's integer E8M0 conversion, bits (e + exp_bias) << 7): equal
    to the float path's bf16 (exp2(e + exp_bias - 127), w4a16_triton._scales) for every exponent byte when the
    flag is set, i.e. whenever e + exp_bias stays in 1..254; the flag drops when a wide exponent spread (J > 8)
    sends the smallest groups below bf16's normal range."""
    from qerl.kernels import prepare

    t = quantize_weight(torch.randn(64, 256) * 0.02, "mxfp4")
    st = prepare("mxfp4", t)
    assert st["scale_bits"] is True and st["exp_bias"] == 118
    e = t["weight_scale"].view(torch.uint8).int()
    f = torch.exp2((e + st["exp_bias"] - 127).double()).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    assert torch.equal(f, (e + st["exp_bias"]) << 7)
    every = torch.arange(0, 256, dtype=torch.int32)  # J = 8: every byte converts exactly
    f = torch.exp2((every + 118 - 127).double()).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    assert torch.equal(f[:137], (every[:137] + 118) << 7)  # e_max <= 136 keeps J = 8
    wide = dict(t)
    s = t["weight_scale"].view(torch.uint8).clone()
    s[0, 0], s[0, 1] = 254, 0  # J = 126: exp_bias 0, and e = 0's multiplier 2^-127 is no normal bf16
    wide["weight_scale"] = s.view(t["weight_scale"].dtype)
    st = prepare("mxfp4", wide)
    assert st["exp_bias"] == 0 and st["scale_bits"] is False
    s[0, 1] = 1  # now the smallest e has e + exp_bias = 1
    st = prepare("mxfp4", wide)
    assert st["scale_bits"] is True


@pytest.mark.parametrize("mt,sched,warps,sbits,glu,fold", [
    (1, "split", 4, True, False, 0), (8, "split", 4, True, False, 0), (8, "sk", 4, True, False, 0),
    (8, "tail", 4, False, False, 0), (1, "tail", 4, False, False, 0), (8, "split", 8, True, False, 0),
    (8, "split", 4, True, True, 0), (8, "sk", 4, False, True, 2), (8, "split", 4, True, False, 1)])
def test_gluon_gemv_mxfp4_builds(mt, sched, warps, sbits, glu, fold):
    """Offline sm_90a build of the Gluon GEMV on mxfp4 (MX): the E8M0 scales' [32, 16] box and its register
    layout (`_layouts_mx`) convert trivially into the decode's [4, 2, 8, 8, 4] view (assert_trivial fails the
    build otherwise), no spills at nvfp4's 64 registers, as many MMAs and bf16x2 multiplies as nvfp4's build,
    a 512-byte scale stage (nvfp4: 1 KB; GLU's [2, 16, 16] boxes too), and with `scale_bits` no exp2 beyond
    nvfp4's build; plain, GLU and both NORM_FOLD ends."""
    pytest.importorskip("triton.experimental.gluon")
    cg = _compile_gluon()
    kw = dict(sk=sched == "sk", tail=sched == "tail", sbits=sbits, pwa=mt > 1, xs=mt > 1, glu=glu, fold=fold)
    bias = not (glu or fold)  # (GLU and NORM_FOLD launches carry no bias)
    ck = cg.compile_kernel(27648, 5120, 3, warps, 64, 24, bias, True, mt, False, fmt="mxfp4", **kw)
    nv = cg.compile_kernel(27648, 5120, 3, warps, 64, 24, bias, True, mt, False, **kw)
    regs, spills = cg._resources(ck.asm["cubin"])
    assert spills == 0 and regs <= 64
    ptx = ck.asm["ptx"]
    for op in ("mma.sync", "mul.rn.bf16x2"):
        assert ptx.count(op) == nv.asm["ptx"].count(op) > 0, op
    extra_ex2 = ptx.count("ex2.approx") - nv.asm["ptx"].count("ex2.approx")  # (GLU's silu has its own)
    assert (extra_ex2 == 0) == sbits and extra_ex2 >= 0
    assert nv.metadata.shared - ck.metadata.shared == 3 * 512  # three stages of 512 scale bytes fewer


def test_scale_bits_exact_flag():
    """prepare's nvfp4 `scale_bits`: the integer conversion (byte << 4) + 0x7700 gives the same bf16
    bits as the float path (FP8-E4M3 -> fp32 x 2^118 -> bf16) for every positive normal byte, and the
    flag is False as soon as one scale is subnormal, NaN or zero over a group with live codes."""
    from qerl.kernels import prepare, scale_bits_exact

    b = torch.arange(0, 128, dtype=torch.uint8)
    f = (b.view(torch.float8_e4m3fn).float() * 2.0**118).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    i = (b.int() << 4) + 0x7700
    assert torch.equal(f[8:127], i[8:127]) and not (f[:8] == i[:8]).any() and f[127] != i[127]
    w = torch.randn(64, 256) * 0.02
    t = quantize_weight(w, "nvfp4")
    assert prepare("nvfp4", t)["scale_bits"] is True
    packed, scale = t["weight_packed"].clone(), t["weight_scale"].view(torch.uint8).clone()
    assert scale_bits_exact(packed, scale)
    s2 = scale.clone()
    s2[3, 5] = 0x05  # subnormal
    assert not scale_bits_exact(packed, s2)
    s2 = scale.clone()
    s2[3, 5] = 0x7F  # NaN
    assert not scale_bits_exact(packed, s2)
    s2, p2 = scale.clone(), packed.clone()
    s2[3, 5] = 0  # a zero scale over live codes
    p2[3, 40:48] = 0x21
    assert not scale_bits_exact(p2, s2)
    p2[3, 40:48] = 0x88  # ... and over codes that are all +-0
    assert scale_bits_exact(p2, s2)


_NF4_FUSED_SCRIPT = textwrap.dedent(
    """
    import json, os, torch
    from qerl.formats import quantize_weight, nf4
    from qerl.kernels import nf4_triton, reference
    seed = int(os.environ["SEED"])
    g = torch.Generator().manual_seed(seed)
    configs = [{}, {"SPLIT": 2}, {"BN": 32, "BK": 128, "SPLIT": 3}, {"DECODE": "table"}, {"DECODE": "table", "SPLIT": 2},
               {"BN": 16, "SPLIT": 8}]
    results = []
    for dq in (False, True):
        for m, n, k in ((1, 96, 768), (5, 64, 256), (16, 130, 768), (19, 64, 768), (70, 48, 256)):
            w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
            t = quantize_weight(w, "nf4", double_quant=dq)
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            want = reference.matmul_ref(x, t, "nf4")
            for cfg in configs if m in (1, 19) else configs[:1]:
                y = nf4_triton.fused_matmul(x, t, config=cfg)
                rel = ((y.float() - want).norm() / want.norm()).item()
                results.append(dict(dq=dq, m=m, n=n, k=k, cfg=cfg, rel=rel, shape=list(y.shape), dtype=str(y.dtype)))
            if m != 1:
                continue
            # one-hot rows pick W's columns out exactly. DECODE "prmt" (its interpreter stand-in) must give
            # bf16(code) * bf16(absmax) bit for bit; "table" the reference's bf16 weight, checked through the
            # split-K path (torch rounds its output; the interpreter's own bf16 cast truncates)
            eye = torch.eye(k).to(torch.bfloat16)
            wants = {"prmt": nf4.dequantize_bf16_products(t).T.contiguous(),
                     "table": reference.dequant("nf4", t, torch.bfloat16).T.contiguous()}
            for cfg in configs[:3] + configs[4:]:
                y = nf4_triton.fused_matmul(eye, t, config=cfg)
                results.append(dict(dq=dq, n=n, k=k, cfg=cfg, exact=torch.equal(y, wants[cfg.get("DECODE", "prmt")])))
    errors = []
    for bad_x, cfg in ((torch.zeros(2, 200), {}), (torch.zeros(2, 256), {"SPLIT": 0}), (torch.zeros(2, 256), {"TILE": 1}),
                       (torch.zeros(2, 256), {"DECODE": "lut"})):
        try:
            nf4_triton.fused_matmul(bad_x.to(torch.bfloat16), quantize_weight(torch.randn(64, 256), "nf4"), config=cfg)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    results.append(dict(errors=errors))
    print("RESULTS" + json.dumps(results))
    """
)


@pytest.mark.parametrize("seed", [0])
def test_fused_nf4_kernel_under_interpreter(seed):
    """nf4_triton.fused_matmul (issue 4's labelled fused NF4 kernel, benchmarks only), in both decodes and the
    configs the bench times (split-K, capped at K / BK steps; smaller tiles): x @ dequant(W)^T against the fp32 reference on fresh random
    weights and inputs, absmax and double-quant, M below / at / past one 16-row block and past one 64-row block
    (the rows per program grow with M), N past a partial block, K
    over several steps (the interpreter's bf16 cast truncates: a tolerance); one-hot rows of x give each decode's
    bf16 weight bit for bit (the register decode's word order and joins; split-K); a K off the step, a SPLIT past
    the steps, an unknown key and an unknown decode are clear errors."""
    from interpreted import run_interpreted

    results = run_interpreted(_NF4_FUSED_SCRIPT, seed, timeout=600)
    *cases, errs = results
    products = [r for r in cases if "rel" in r]
    decodes = [r for r in cases if "exact" in r]
    assert len(products) == 30 and len(decodes) == 10
    for r in products:
        assert r["shape"] == [r["m"], r["n"]] and r["dtype"] == "torch.bfloat16", r
        assert r["rel"] < 1e-2, r
    assert all(r["exact"] for r in decodes), [r for r in decodes if not r["exact"]]
    bad_k, bad_split, bad_key, bad_decode = errs["errors"]
    assert "multiple of BK = 256" in bad_k and "SPLIT must be at least 1" in bad_split and "TILE" in bad_key
    assert "DECODE is one of prmt, table" in bad_decode


def _run_ptx(asm: str, inputs: dict[int, int]) -> dict[int, int]:
    """A small interpreter for the straight-line PTX that nf4_triton.PRMT_ASM uses (mov, and, shr, lop3, prmt in
    its default mode, mul.rn.bf16x2); $i operands from `inputs`, returns every $i written."""
    regs: dict[str, int] = {f"${i}": v for i, v in inputs.items()}

    def val(op: str) -> int:
        return int(op, 0) & 0xFFFFFFFF if op[0].isdigit() else regs[op]

    def bf16_mul(a: int, b: int) -> int:
        t = torch.tensor([a, b], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        return int((t[0] * t[1]).view(torch.int16).item()) & 0xFFFF

    for line in asm.strip().strip("{}").strip().splitlines():
        op, _, rest = line.rstrip(";").partition(" ")
        if op.startswith(".reg"):
            continue
        d, *src = [x.strip() for x in rest.split(",")]
        v = [val(x) for x in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "lop3.b32":
            r = sum(((v[3] >> (((v[0] >> i & 1) << 2) | ((v[1] >> i & 1) << 1) | (v[2] >> i & 1))) & 1) << i
                    for i in range(32))
        elif op == "prmt.b32":
            src64, r = v[0] | (v[1] << 32), 0
            for i in range(4):
                sel = (v[2] >> (4 * i)) & 0xF
                byte = (src64 >> (8 * (sel & 7))) & 0xFF
                if sel & 8:
                    byte = 0xFF if byte & 0x80 else 0
                r |= byte << (8 * i)
        elif op == "mul.rn.bf16x2":
            r = bf16_mul(v[0] & 0xFFFF, v[1] & 0xFFFF) | (bf16_mul(v[0] >> 16, v[1] >> 16) << 16)
        else:
            raise AssertionError(f"unexpected PTX: {line}")
        regs[d] = r & 0xFFFFFFFF
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$") and int(k[1:]) < 4}


def test_nf4_register_decode_ptx_gives_each_code_times_the_absmax_in_bf16():
    """The inline PTX of the fused NF4 kernel's register decode (GPU only), run by a small interpreter of its
    instructions: for words holding every code at every one of the 8 positions and random words, with random
    absmax values, output word j holds weights 2j and 2j + 1 as bf16(code) * bf16(absmax) bit for bit (as
    nf4.dequantize_bf16_products forms them), and no output is written before the last read of an input."""
    from qerl.formats import nf4
    from qerl.kernels import nf4_triton

    g = torch.Generator().manual_seed(5)
    words = [sum(((v + p) % 16) << (4 * p) for p in range(8)) for v in range(16)]
    words += torch.randint(0, 2**32, (48,), generator=g, dtype=torch.int64).tolist()
    amax = (torch.rand(len(words), generator=g) * 0.1 + 1e-4).to(torch.bfloat16)
    cb = nf4.codebook().to(torch.bfloat16)
    asm = nf4_triton.PRMT_ASM
    body = asm.splitlines()
    outs = [i for i, ln in enumerate(body) if ln.partition(" ")[2].startswith(("$0", "$1", "$2", "$3"))]
    ins = [i for i, ln in enumerate(body) if "$4" in ln or "$5" in ln]
    assert len(outs) == 4 and min(outs) > max(ins)
    for w, a in zip(words, amax):
        s2 = int(a.view(torch.int16).item()) & 0xFFFF
        out = _run_ptx(asm, {4: w, 5: s2 | (s2 << 16)})
        for t in range(8):
            want = int((cb[(w >> (4 * t)) & 0xF] * a).view(torch.int16).item()) & 0xFFFF
            got = (out[t // 2] >> (16 * (t % 2))) & 0xFFFF
            assert got == want, (hex(w), t, hex(got), hex(want))
