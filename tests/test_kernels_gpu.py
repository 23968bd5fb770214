"""GPU tests of the fused 4-bit kernels (marked `gpu`; skipped without CUDA + triton).

Run: python -m pytest tests/test_kernels_gpu.py -q -x      (a few minutes on an H100, mostly compiles)

For every linear layer of Qwen2.5-3B/7B/14B/32B-Instruct (q/k/v fused, o, gate/up fused, down)
and M in 1..4096: fresh random inputs (never zeros), output poisoned with NaN first, relative
Frobenius error against an fp32 reference (weights dequantised in fp32, fp32 matmul, TF32 off)
<= 1e-2 and no NaN. bf16 inputs with fp32 accumulation land near 2-4e-3 (the bf16 rounding of
the output); 1e-2 leaves room for nothing else. Backward (grad_x) at a few M. Weights are drawn
N(0, 0.02) in bf16 and quantised on the GPU with qerl.formats.quantize_weight.
"""

from __future__ import annotations

import pytest
import torch

from qerl.formats import quantize_weight
from qerl.kernels import available, linear, prepare, reference
from qerl.kernels.shapes import M_SWEEP, linear_shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not available(), reason="needs a CUDA GPU and triton"),
]

FORMATS = ("nvfp4", "mxfp4")
BWD_MS = (16, 256, 4096)
TOL = 1e-2


def _unique_shapes():
    seen, out = set(), []
    for model, layer, n, k in linear_shapes():
        if (n, k) not in seen:
            seen.add((n, k))
            out.append((f"{model}.{layer}", n, k))
    return out


SHAPES = _unique_shapes()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _layer(fmt: str, n: int, k: int, seed: int, order: str | None = None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    t = quantize_weight(w, fmt)
    return t, prepare(fmt, t, order=order), reference.dequant(fmt, t, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
def test_forward_all_m(fmt, name, n, k):
    from qerl.kernels import w4a16_triton as W

    t, st, w32 = _layer(fmt, n, k, seed=n * 7 + k)
    failures = []
    for m in M_SWEEP:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        W.forward(x, st, out=y)
        ref = x.float() @ w32.T
        err = _rel(y, ref)
        if not (err <= TOL) or torch.isnan(y).any():
            failures.append((m, err, bool(torch.isnan(y).any())))
    assert not failures, f"{fmt} {name} N={n} K={k}: (M, rel err, NaN) {failures}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,n,k", SHAPES, ids=[s[0] for s in SHAPES])
def test_backward(fmt, name, n, k):
    from qerl.kernels import w4a16_triton as W

    t, st, w32 = _layer(fmt, n, k, seed=n * 11 + k)
    failures = []
    for m in BWD_MS:
        dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        dx = torch.full((m, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        W.backward(dy, st, out=dx)
        err = _rel(dx, dy.float() @ w32)
        if not (err <= TOL) or torch.isnan(dx).any():
            failures.append((m, err, bool(torch.isnan(dx).any())))
    assert not failures, f"{fmt} {name} N={n} K={k}: (M, rel err, NaN) {failures}"


@pytest.mark.parametrize("decode_f32", (False, True), ids=("bf16-decode", "fp32-decode"))
@pytest.mark.parametrize("m_rows", (16, 512), ids=("decode-tiles", "prefill-tiles"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_is_exact_per_element(fmt, m_rows, decode_f32):
    """x = identity rows: y[i, n] = W[n, i]. Every code (incl. +-0.5 and 0, which the kernel
    builds as bf16 subnormals) and every scale must come out as the reference dequantisation.
    If only the bf16-decode case fails, the GPU flushes bf16 subnormals: set
    QERL_W4A16_DECODE_F32=1 (slower fallback) and fix the decode."""
    from qerl.kernels import w4a16_triton as W

    n, k = 256, 512
    t, st, w32 = _layer(fmt, n, k, seed=5)
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    ys = []
    for r0 in range(0, k, m_rows):
        x = eye[r0:r0 + m_rows]
        cfg = dict(W._fwd_config(x.shape[0], n, k, fmt), DECODE_F32=decode_f32, PATH="fused")
        ys.append(W.forward(x, st, config=cfg).float())
    y = torch.cat(ys)  # [K, N] = W^T
    ref = w32.T.to(torch.bfloat16).float()
    # mxfp4: power-of-two scales, exact. nvfp4: alpha = 2^8/g is rounded once in fp32 (as
    # the reference's s/g is), so allow one bf16 ulp.
    tol = 0.0 if fmt == "mxfp4" else 2.0**-7
    bad = (y - ref).abs() > tol * ref.abs()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ, e.g. {y[bad][:5]} vs {ref[bad][:5]}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_portable_form_on_hopper(fmt, monkeypatch):
    """The pre-Hopper form of the Triton kernels (w4a16_triton.PORTABLE: fp32 decode, no packed multiply, no PDL,
    nvfp4 scales by integer E4M3 decode), forced on this GPU: identity rows give every dequantised weight as
    the default form does, and the fused kernel (forward, backward), the GEMV and the dequantise kernel agree
    with the default form's outputs on random inputs within bf16 rounding of the sums."""
    from qerl.kernels import w4a16_gemv as V
    from qerl.kernels import w4a16_triton as W

    n, k = 256, 512
    t, st, w32 = _layer(fmt, n, k, seed=7, order="rows")
    runs = {}
    for port in (False, True):
        monkeypatch.setattr(W, "PORTABLE", port)
        assert W.fmt_id(st) == (W.SOFT_E4M3_FMT if port and fmt == "nvfp4" else W.FMT_ID[fmt])
        g = torch.Generator(device="cuda").manual_seed(1)
        x16 = torch.randn(16, k, device="cuda", generator=g).to(torch.bfloat16)
        dy = torch.randn(16, n, device="cuda", generator=g).to(torch.bfloat16)
        eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)[:16]
        runs[port] = dict(
            eye=W.forward(eye, st, config=dict(W._fwd_config(16, n, k, fmt), PATH="fused")),
            fwd=W.forward(x16, st, config=dict(W._fwd_config(16, n, k, fmt), PATH="fused")),
            bwd=W.backward(dy, st),
            gemv=V.forward(x16[:1], st),
            deq=W.dequant_bf16(st),
        )
    a, b = runs[False], runs[True]
    assert torch.equal(a["deq"], b["deq"]) and torch.equal(a["eye"], b["eye"])
    ref = w32.T[:16].to(torch.bfloat16).float()  # (nvfp4: alpha rounded once in fp32, one bf16 ulp)
    assert not ((b["eye"].float() - ref).abs() > (0.0 if fmt == "mxfp4" else 2.0**-7) * ref.abs()).any()
    for key in ("fwd", "bwd", "gemv"):
        assert torch.isfinite(b[key]).all(), key
        torch.testing.assert_close(b[key].float(), a[key].float(), rtol=2e-2, atol=2e-2, msg=key)


@pytest.mark.parametrize("acc2d", (False, True), ids=("reduce-per-step", "reduce-at-end"))
@pytest.mark.parametrize("decode_f32", (False, True), ids=("bf16-decode", "fp32-decode"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_exact_per_element_deterministic_and_graph(fmt, decode_f32, acc2d):
    """The CUDA-core GEMV (w4a16_gemv.py): identity rows give every dequantised weight exactly;
    random inputs at M = 1..8 on a split layer are within tolerance, bit-identical across runs
    and S values, leave the counters at zero, and replay from a CUDA graph on new data."""
    from qerl.kernels import w4a16_triton as W

    n, k = 256, 512
    t, st, w32 = _layer(fmt, n, k, seed=5, order="rows")  # the CUDA-core GEMV reads rows-ordered words only
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    cfg = dict(PATH="gemv", DECODE_F32=decode_f32, ACC2D=acc2d)
    rows = 1 if acc2d else 4  # ACC2D only serves M = 1
    y = torch.cat([W.forward(eye[r0:r0 + rows], st, config=cfg).float() for r0 in range(0, k, rows)])
    ref = w32.T.to(torch.bfloat16).float()
    tol = 0.0 if fmt == "mxfp4" else 2.0**-7
    bad = (y - ref).abs() > tol * ref.abs()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ, e.g. {y[bad][:5]} vs {ref[bad][:5]}"

    n, k = 3584, 3584
    t, st, w32 = _layer(fmt, n, k, seed=9, order="rows")
    for m in (1, 2, 3, 4, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        W.forward(x, st, bias=bias, config=cfg)  # the first launch of a config fixes S (measured occupancy)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        base = W.forward(x, st, bias=bias, out=out, config=cfg).clone()
        assert _rel(base, x.float() @ w32.T + bias.float()) <= TOL and not torch.isnan(base).any(), m
        for s in (1, 3, 14):
            y = W.forward(x, st, bias=bias, config=dict(cfg, S=s))
            assert _rel(y, base) < 1e-2
            assert torch.equal(W.forward(x, st, bias=bias, config=dict(cfg, S=s)), y), (m, s)
        assert torch.equal(W.forward(x, st, bias=bias, config=cfg), base), m
        assert st["locks"].abs().sum().item() == 0
    x = torch.randn(2, k, device="cuda").to(torch.bfloat16)
    y = W.forward(x, st, config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = W.forward(x, st, config=cfg)
    x.copy_(torch.randn(2, k, device="cuda").to(torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, W.forward(x, st, config=cfg)) and not torch.equal(yg, y)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_path_matches_reference(fmt):
    """The large-M path: one-pass bf16 weight (exact for mxfp4, one rounding for nvfp4)."""
    from qerl.kernels import w4a16_triton as W

    t, st, w32 = _layer(fmt, 3584, 5120, seed=21)
    wb = W.dequant_bf16(st).float()
    ref = w32.to(torch.bfloat16).float()
    if fmt == "mxfp4":
        assert torch.equal(wb, ref)
    else:
        assert ((wb - ref).abs() <= 2.0**-7 * ref.abs()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_overlapped_path_chunks_streams_and_graph(fmt):
    """The overlapped large-M path (chunked dequant on a side stream + cuBLAS per output-column
    slice): block dequant equals the slice of the whole-layer dequant bit for bit; forward (with
    bias) and backward match the fp32 reference for several chunk counts (uneven last chunk),
    with and without the side stream, on a non-default caller stream, and replayed from a CUDA
    graph on new data (no host sync inside)."""
    from qerl.kernels import w4a16_triton as W

    n, k, m = 4608, 3584, 1024
    t, st, w32 = _layer(fmt, n, k, seed=31, order="rows")  # (row blocks from 1000: fragment words start at 16s)
    full = W.dequant_bf16(st)
    assert torch.equal(W.dequant_bf16(st, rows=(1000, 3000), cols=(512, 2048)), full[1000:3000, 512:2048])
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    ref_y, ref_dx = x.float() @ w32.T + bias.float(), dy.float() @ w32
    side = torch.cuda.Stream()
    variants = [{"CHUNKS": c, "SIDE": s} for c in (2, 3, 5, 8) for s in (True, False)]
    for extra in variants:
        cfg = dict(extra, PATH="overlap")
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        dx = torch.full((m, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the caller on a non-default stream
            W.forward(x, st, bias=bias, out=y, config=cfg)
            W.backward(dy, st, out=dx, config=cfg)
        torch.cuda.current_stream().wait_stream(side)
        assert _rel(y, ref_y) <= TOL and not torch.isnan(y).any(), (extra, "forward")
        assert _rel(dx, ref_dx) <= TOL and not torch.isnan(dx).any(), (extra, "backward")
    cfg = {"PATH": "overlap", "CHUNKS": 4}
    W.forward(x, st, config=cfg), W.backward(dy, st, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy = W.forward(x, st, config=cfg)
        gdx = W.backward(dy, st, config=cfg)
    x.copy_(torch.randn(m, k, device="cuda").to(torch.bfloat16))
    dy.copy_(torch.randn(m, n, device="cuda").to(torch.bfloat16))
    gy.fill_(float("nan")), gdx.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(gy, x.float() @ w32.T) <= TOL and not torch.isnan(gy).any()
    assert _rel(gdx, dy.float() @ w32) <= TOL and not torch.isnan(gdx).any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,n,k", SHAPES[:8], ids=[s[0] for s in SHAPES[:8]])
def test_fused_kernel_at_large_m(fmt, name, n, k):
    """The fused kernel itself at prefill sizes (the default dispatch uses the bf16 path there)."""
    from qerl.kernels import w4a16_triton as W

    t, st, w32 = _layer(fmt, n, k, seed=n * 3 + k)
    for m in (128, 1024):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        W.forward(x, st, out=y, config={"PATH": "fused"})
        assert _rel(y, x.float() @ w32.T) <= TOL and not torch.isnan(y).any(), (m, "forward")
        dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        dx = W.backward(dy, st, config={"PATH": "fused"})
        assert _rel(dx, dy.float() @ w32) <= TOL and not torch.isnan(dx).any(), (m, "backward")


@pytest.mark.parametrize("fmt", FORMATS)
def test_shared_tiles_are_deterministic_and_race_free(fmt):
    """Many programs per tile (PROGRAMS large) stress the workspace + counter fixup: the result
    must be bit-identical across runs and equal for every program count."""
    from qerl.kernels import w4a16_triton as W

    n, k, m = 3584, 3584, 8
    t, st, w32 = _layer(fmt, n, k, seed=9)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    base = W.forward(x, st)
    for progs in (1, 7, 132, 529, 4000):
        cfg = dict(W._fwd_config(m, n, k, fmt), PROGRAMS=progs)
        for _ in range(3):
            y = W.forward(x, st, config=cfg)
            assert _rel(y, base) < 1e-2
        assert torch.equal(W.forward(x, st, config=cfg), y), f"non-deterministic with {progs} programs"
    # the split schedule (default for this layer: S slices per tile, uneven when S does not
    # divide the steps), also with more slices than fit at once (WAVES)
    for extra in ({}, {"WAVES": 3}, {"WAVES": 7}):
        cfg = dict(W._fwd_config(m, n, k, fmt), SCHEDULE="split", **extra)
        y = W.forward(x, st, config=cfg)
        assert _rel(y, base) < 1e-2
        assert torch.equal(W.forward(x, st, config=cfg), y), f"split schedule non-deterministic {extra}"
    assert torch.equal(W.forward(x, st), base)
    assert st["locks"].abs().sum().item() == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_autograd_and_cuda_graph(fmt):
    n, k = 1024, 2048
    t, st, w32 = _layer(fmt, n, k, seed=13)
    x = torch.randn(4, 8, k, device="cuda").to(torch.bfloat16).requires_grad_(True)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    y = linear(x, st, fmt, bias=bias)
    assert _rel(y, x.detach().float() @ w32.T + bias.float()) < TOL
    dy = torch.randn_like(y)
    y.backward(dy)
    assert _rel(x.grad, dy.float() @ w32) < TOL

    # CUDA graph: capture forward + backward, replay on new data (no host syncs inside).
    static_x = torch.randn(16, k, device="cuda").to(torch.bfloat16)
    static_dy = torch.randn(16, n, device="cuda").to(torch.bfloat16)
    from qerl.kernels import w4a16_triton as W

    W.forward(static_x, st), W.backward(static_dy, st)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy = W.forward(static_x, st)
        gdx = W.backward(static_dy, st)
    static_x.copy_(torch.randn(16, k, device="cuda").to(torch.bfloat16))
    static_dy.copy_(torch.randn(16, n, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(gy, static_x.float() @ w32.T) < TOL
    assert _rel(gdx, static_dy.float() @ w32) < TOL


def test_nf4_baseline_dequant_kernel():
    from qerl.kernels import nf4_triton

    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(512, 1024, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    for dq in (False, True):
        t = quantize_weight(w, "nf4", double_quant=dq)
        assert torch.equal(nf4_triton.dequant_bf16(t), reference.dequant("nf4", t, torch.bfloat16))
        x = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
        assert _rel(nf4_triton.dequant_matmul(x, t), reference.matmul_ref(x, t, "nf4")) < TOL


@pytest.mark.parametrize("dq", (False, True))
@pytest.mark.parametrize("decode", ("prmt", "table"))
def test_fused_nf4_kernel_decodes_as_it_says_and_multiplies_within_tolerance(dq, decode):
    """nf4_triton.fused_matmul (issue 4's labelled fused NF4 kernel): one-hot rows of x pick columns of W out of
    the product exactly, so the decode must give, bit for bit over several 16-row blocks and with split-K too,
    bf16(code) * bf16(absmax) for the register decode (inline PTX: bitsandbytes' GEMV rounding) and
    dequant_bf16's weight for the code book table; on fresh random x (M 1 / 7 / 16 / 40) both match the fp32
    reference within the bf16 GEMMs' tolerance, as the baseline does."""
    from qerl.formats import nf4
    from qerl.kernels import nf4_triton

    g = torch.Generator(device="cuda").manual_seed(11)
    n, k = 192, 768
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    t = quantize_weight(w, "nf4", double_quant=dq)
    dense = nf4.dequantize_bf16_products(t) if decode == "prmt" else nf4_triton.dequant_bf16(t)
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    for cfg in ({}, {"BN": 64, "SPLIT": 1}, {"BN": 16, "SPLIT": 8}):
        assert torch.equal(nf4_triton.fused_matmul(eye, t, config=dict(cfg, DECODE=decode)), dense.T.contiguous())
    for m in (1, 7, 16, 40):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        want = reference.matmul_ref(x, t, "nf4")
        assert _rel(nf4_triton.fused_matmul(x, t, config={"DECODE": decode}), want) < TOL
        assert _rel(nf4_triton.dequant_matmul(x, t), want) < TOL


def test_nf4_quantlinear_takes_the_fused_kernel_only_where_asked(monkeypatch):
    """QERL_NF4_FUSED_MAX_M (quant_linear.NF4_FUSED_MAX_M): an nf4 layer sends bf16 inference calls of at most that
    many rows to the fused NF4 kernel (bit-equal to fused_matmul plus the bias); more rows, an input that needs
    a gradient, or the default 0 keep the QLoRA baseline (bit-equal to F.linear on dequant_bf16's weight)."""
    import torch.nn.functional as F

    from qerl.kernels import nf4_triton
    from qerl.nn import QuantLinear, quant_linear

    lin = torch.nn.Linear(1024, 768, bias=True).to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nf4").cuda()
    t = q.quant_tensors()
    bias = q.bias.to(torch.bfloat16)
    x = torch.randn(2, 3, 1024, device="cuda").to(torch.bfloat16)
    wide = torch.randn(5, 8, 1024, device="cuda").to(torch.bfloat16)
    fused = nf4_triton.fused_matmul(x.reshape(6, 1024), t).reshape(2, 3, 768) + bias
    baseline = F.linear(x, nf4_triton.dequant_bf16(t), bias)
    assert not torch.equal(fused, baseline)  # the two roundings differ, so each check below can tell them apart
    monkeypatch.setattr(quant_linear, "NF4_FUSED_MAX_M", 16)
    with torch.no_grad():
        assert torch.equal(q(x), fused)
        assert torch.equal(q(wide), F.linear(wide, nf4_triton.dequant_bf16(t), bias))
    assert torch.equal(q(x.clone().requires_grad_()).detach(), baseline)
    monkeypatch.setattr(quant_linear, "NF4_FUSED_MAX_M", 0)
    with torch.no_grad():
        assert torch.equal(q(x), baseline)


@pytest.mark.parametrize("autocast", (False, True))
def test_nf4_quantlinear_on_the_gpu_keeps_only_the_packed_weight_for_the_backward(autocast):
    """The QLoRA baseline's layer on the GPU (one Triton dequantisation, cuBLAS, as bitsandbytes runs it):
    output and input gradient equal F.linear on the dequantised weight bit for bit, under bf16 autocast too,
    and autograd saves nothing for the backward (the weight is dequantised again there), so an
    uncheckpointed decoder layer does not hold its weights in bf16 until the backward."""
    import torch.nn.functional as F

    from qerl.kernels import nf4_triton
    from qerl.nn import QuantLinear

    lin = torch.nn.Linear(1024, 768, bias=True).to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, "nf4").cuda()
    x_dtype = torch.float32 if autocast else torch.bfloat16
    x = torch.randn(3, 40, 1024, device="cuda", dtype=x_dtype)
    dy = torch.randn(3, 40, 768, device="cuda", dtype=torch.bfloat16)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    saved = []
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            y = q(xs[0])
        w = nf4_triton.dequant_bf16(q.quant_tensors()).to(x_dtype)
        want = F.linear(xs[1], w, q.bias.to(x_dtype))
    assert sum(saved) == 0
    assert y.dtype == want.dtype == torch.bfloat16 and torch.equal(y, want)
    y.backward(dy)
    want.backward(dy)
    assert xs[0].grad.dtype == x_dtype and torch.equal(xs[0].grad, xs[1].grad)


@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4"))
def test_torch_backend_on_the_gpu_dequantises_in_the_inputs_dtype_forward_and_backward(fmt):
    """backend="torch" on a GPU (DequantLinear over dequantized_weight): float32 x meets the weight
    dequantised straight to float32, in the forward and the backward, bit for bit as F.linear on it."""
    import torch.nn.functional as F

    from qerl.nn import QuantLinear

    q = QuantLinear.from_linear(torch.nn.Linear(512, 384, bias=True).float(), fmt, backend="torch").cuda()
    x = torch.randn(7, 512, device="cuda")
    dy = torch.randn(7, 384, device="cuda")
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    y = q(xs[0])
    want = F.linear(xs[1], q.dequantized_weight(torch.float32), q.bias)
    assert y.dtype == torch.float32 and torch.equal(y, want)
    y.backward(dy)
    want.backward(dy)
    assert torch.equal(xs[0].grad, xs[1].grad)


@pytest.mark.parametrize("m", (1, 4, 16, 64))
@pytest.mark.parametrize("fmt", FORMATS)
def test_pdl_chain_waits_for_its_input(fmt, m):
    """Programmatic dependent launch: layer i+1 starts while layer i still runs and must wait for
    its output before reading it. A chain of dependent calls (x -> L1 -> L2 ... over square layers,
    the last one also reading the same weight as the first), captured in a CUDA graph with PDL,
    replayed on fresh inputs: each replay must equal the eager chain without PDL for that input.
    A missing wait would read the previous replay's intermediates (stale, from another x)."""
    from qerl.kernels import w4a16_triton as W

    n = 3584
    # (M = 1 also runs PATH "ws", which reads rows-ordered words only; other M take the default word order)
    layers = [_layer(fmt, n, n, seed=40 + i, order="rows" if m == 1 else None)[1] for i in range(3)]
    order = [0, 1, 2, 0, 1, 2, 0]

    def chain_ref(x):
        y = x
        for i in order:
            y = W.forward(y, layers[i])
        return y

    # the default dispatch with PDL, its dependents let in at the start and after the main loop; at
    # M = 1 (nvfp4) also the warp-specialised GEMV with PDL
    configs = [{"PDL": True}, {"PDL": True, "PDL_LATE": True}, {"PDL": True, "PDL_LATE": False}] + ([{"PDL": True, "PATH": "ws"}] if m == 1 and fmt == "nvfp4" else [])
    configs += [{"PDL": True, "PATH": "wgmma"}] if m >= 16 and torch.cuda.get_device_capability()[0] == 9 else []
    for cfg in configs:
        def chain_pdl(x):
            y = x
            for i in order:
                y = W.forward(y, layers[i], config=cfg)
            return y

        static_x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        chain_pdl(static_x)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain_pdl(static_x)
        for seed in range(4):
            x = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(torch.bfloat16)
            static_x.copy_(x)
            g.replay()
            ref = chain_ref(x)
            assert not out.isnan().any()
            assert _rel(out, ref) < 1e-2, f"{cfg} replay {seed}: PDL chain differs from the eager chain"
            eager = chain_pdl(x)  # PDL launches outside a graph too
            assert _rel(eager, ref) < 1e-2
    for st in layers:
        assert st["locks"].abs().sum().item() == 0


WS_CASES = [("ws", {}), ("ws", {"NS": 2}), ("ws", {"NS": 8, "S": 1}), ("ws", {"S": 3}),
            ("ws", {"CPT": 4, "maxnreg": 128, "NS": 6}), ("ws", {"num_warps": 8, "CPT": 2, "maxnreg": 80}),
            ("ws", {"num_warps": 16, "CPT": 2, "maxnreg": 56}), ("ws", {"PDL": True}),
            ("wsmma", {}), ("wsmma", {"NUM_STAGES": 6}), ("wsmma", {"S": 1}), ("wsmma", {"S": 3}),
            ("wsmma", {"num_warps": 8}), ("wsmma", {"PDL": True}), ("wsmma", {"maxnreg": 80}),
            ("wsmma", {"XPF": True}), ("wsmma", {"XPF": True, "S": 1, "PDL": True}), ("wsmma", {"PER_SM": 2, "NUM_STAGES": 6})]


@pytest.mark.parametrize("path,cfg", WS_CASES, ids=[f"{p}-{'-'.join(f'{k}{v}' for k, v in c.items()) or 'default'}"
                                                   for p, c in WS_CASES])
@pytest.mark.parametrize("name,n,k", [("3B.o", 2048, 2048), ("7B.qkv", 4608, 3584), ("32B.qkv", 7168, 5120),
                                      ("7B.down", 3584, 18944), ("odd-n", 1000, 1024)],
                         ids=("3B.o", "7B.qkv", "32B.qkv", "7B.down", "odd-n"))
def test_warp_specialised_gemv(name, n, k, path, cfg):
    """The Gluon GEMVs (PATH="ws": CUDA-core reduction, M = 1; "wsmma": tensor-core reduction, the
    default for M = 1 nvfp4 layers >= 60M on Hopper, M = 2..8 with one token per MMA column): fp32
    reference within 1e-2 on a NaN-poisoned output with bias, N not a multiple of 64, bit-identical
    re-run, counters back at 0, and a CUDA-graph replay on new data."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    # rows-ordered words: PATH "ws" and 8 / 16-warp "wsmma" read only those (test_gluon_gemv_fragment_words: frag)
    t, st, w32 = _layer("nvfp4", n, k, seed=11, order="rows")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    conf = dict(cfg, PATH=path)
    for m in (1, 3, 8) if path == "wsmma" else (1,):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        W.forward(x, st, config=conf)  # the first launch measures occupancy, which may change the split
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        W.forward(x, st, bias=bias, config=conf, out=y)
        ref = x.float() @ w32.T + bias.float()
        assert not y.isnan().any() and _rel(y, ref) < TOL, (m, _rel(y, ref))
        for row in range(m):  # every token is right, not only the norm over all of them
            assert _rel(y[row:row + 1], ref[row:row + 1]) < TOL, (m, row)
        assert torch.equal(W.forward(x, st, bias=bias, config=conf), y)
        assert st["locks"].abs().sum().item() == 0
        _graph_replay_matches(W, x, st, w32, conf)


def _checked_launches(W, st, w32, bias, conf, m: int, repeats: int):
    """An m-token launch of `conf` (after one that measures occupancy) on a NaN-poisoned output with bias ->
    (x, y, the worst per-token rel. error against the fp32 reference (inf with a NaN left), how many of
    `repeats` more launches differ from y in any bit)."""
    x = torch.randn(m, st["k"], device="cuda").to(torch.bfloat16)
    W.forward(x, st, config=conf)
    y = torch.full((m, st["n"]), float("nan"), device="cuda", dtype=torch.bfloat16)
    W.forward(x, st, bias=bias, config=conf, out=y)
    ref = x.float() @ w32.T + bias.float()
    worst = float("inf") if y.isnan().any() else max(_rel(y[r:r + 1], ref[r:r + 1]) for r in range(m))
    differ = sum(not torch.equal(W.forward(x, st, bias=bias, config=conf), y) for _ in range(repeats))
    return x, y, worst, differ


def _poisoned_launch(W, st, w32, bias, conf, m):
    """An M-token launch of W.forward with `conf` (after one that measures occupancy) into a NaN-poisoned output
    -> (x, y, the fp32 reference with the bias)."""
    n, k = w32.shape
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    W.forward(x, st, config=conf)  # the first launch measures occupancy
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    W.forward(x, st, bias=bias, config=conf, out=y)
    return x, y, x.float() @ w32.T + bias.float()


def _graph_replay_matches(W, x, st, w32, conf):
    """A CUDA graph of one launch, replayed on new x, matches the fp32 reference."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = W.forward(x, st, config=conf)
    x.copy_(torch.randn(*x.shape, device="cuda").to(torch.bfloat16))
    g.replay()
    assert _rel(out, x.float() @ w32.T) < TOL, x.shape[0]


def test_gluon_gemv_xpf_same_bits():
    """x loaded a step ahead (XPF) changes when x arrives, not the arithmetic: on the 7B gate/up
    shape (one K slice per row block, more programs than one wave: XPF on by the auto rule on an
    H100) the XPF rule, XPF on and XPF off give the same bits, and match the fp32 reference. XS
    off: x beside the weight stages (on there by default) pairs the MMAs' K slots differently."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer("nvfp4", 37888, 3584, seed=5)
    x = torch.randn(1, 3584, device="cuda").to(torch.bfloat16)
    outs = []
    for xpf in (None, True, False):
        conf = {"PATH": "wsmma", "XPF": xpf, "XS": False}
        W.forward(x, st, config=conf)  # occupancy measured on the first launch
        outs.append(W.forward(x, st, config=conf))
    assert _rel(outs[0], x.float() @ w32.T) < TOL
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


SCHED_CASES = [(37888, 3584, {"STREAMK": True}), (37888, 3584, {"STREAMK": True, "PER_SM": 1}),
               (4608, 3584, {"STREAMK": True, "PER_SM": 2, "PDL": True}), (3584, 18944, {"STREAMK": True, "XPF": True, "XS": False}),
               (1000, 1024, {"STREAMK": True, "NUM_STAGES": 6, "PDL": True}),
               (37888, 3584, {"TAIL_SPLIT": True}), (37888, 3584, {"TAIL_SPLIT": True, "PER_SM": 1, "PDL": True}),
               (37888, 3584, {"TAIL_SPLIT": True, "PER_SM": 2, "XPF": True, "XS": False}), (9000, 1024, {"TAIL_SPLIT": True, "PER_SM": 1}),
               (37888, 3584, {"STREAMK": True, "PWA": True, "PDL": True}), (37888, 3584, {"TAIL_SPLIT": True, "PWA": True}),
               (3584, 18944, {"STREAMK": True, "XPF": True, "PWA": True})]


@pytest.mark.parametrize("n,k,cfg", SCHED_CASES,
                         ids=[f"{n}x{k}-" + "-".join(f"{key}{v}" for key, v in c.items()) for n, k, c in SCHED_CASES])
def test_gluon_gemv_schedules(n, k, cfg):
    """The Gluon GEMV's schedules for layers past one wave, forced on: stream-K (programs that run
    across row-block boundaries; PER_SM 1 / 2: several whole blocks per program too) and the split
    tail (the last wave's blocks in K slices; 9000 rows at PER_SM 1: 141 blocks on 132 slots, slices
    of one step). M = 1 / 3 / 8 with a bias and N not a multiple of 64 where the shape allows: fp32
    reference within 1e-2 per token on a NaN-poisoned output, bit-identical re-runs, counters back
    at 0, a CUDA-graph replay on new data, and agreement with the plain split schedule."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer("nvfp4", n, k, seed=7)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    conf = dict(cfg, PATH="wsmma")
    for m in (1, 3, 8):
        x, y, ref = _poisoned_launch(W, st, w32, bias, conf, m)
        assert not y.isnan().any()
        for row in range(m):
            assert _rel(y[row:row + 1], ref[row:row + 1]) < TOL, (m, row, _rel(y[row:row + 1], ref[row:row + 1]))
        for _ in range(3):
            assert torch.equal(W.forward(x, st, bias=bias, config=conf), y)
        assert st["locks"].abs().sum().item() == 0
        split = W.forward(x, st, bias=bias, config=dict(conf, STREAMK=False, TAIL_SPLIT=False))
        assert _rel(y, split.float()) < 1e-2
        _graph_replay_matches(W, x, st, w32, conf)
        assert st["locks"].abs().sum().item() == 0


@pytest.mark.parametrize("n,k", [(37888, 3584), (7168, 5120), (1000, 1024)])
def test_gluon_gemv_scale_bits(n, k, monkeypatch):
    """The integer scale conversion (on layers whose scales are all normal) gives the same bits as
    the float conversion: the Gluon GEMV (SBITS) at M = 1 / 3 / 8 and the wgmma GEMM (FMT 2) at
    M = 40 / 256, with a bias; a layer with one subnormal scale is flagged off by prepare and still
    matches the fp32 reference."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G
    from qerl.kernels import w4a16_triton as W
    from qerl.kernels import w4a16_wgmma as WG

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer("nvfp4", n, k, seed=13)
    assert st["scale_bits"] is True
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for m in (1, 3, 8, 40, 256):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        path = "wsmma" if m <= 8 else "wgmma"
        ys = []
        for on in (True, False):
            monkeypatch.setattr(G, "SCALE_BITS", on)
            monkeypatch.setattr(WG, "SCALE_BITS", on)
            W.forward(x, st, bias=bias, config={"PATH": path})  # the first launch measures residency (schedule)
            ys.append(W.forward(x, st, bias=bias, config={"PATH": path}))
        assert torch.equal(ys[0], ys[1]), m
        assert _rel(ys[0], x.float() @ w32.T + bias.float()) < TOL
    monkeypatch.setattr(G, "SCALE_BITS", True)
    monkeypatch.setattr(WG, "SCALE_BITS", True)
    t2 = dict(t)
    sc = t["weight_scale"].view(torch.uint8).clone()
    sc[1, 2] = 0x03  # one subnormal scale
    t2["weight_scale"] = sc.view(t["weight_scale"].dtype)
    st2 = prepare("nvfp4", t2)
    assert st2["scale_bits"] is False
    for m, path in ((3, "wsmma"), (64, "wgmma")):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = W.forward(x, st2, config={"PATH": path})
        assert _rel(y, x.float() @ reference.dequant("nvfp4", t2, torch.float32).T) < TOL


@pytest.mark.parametrize("n,k", [(4608, 3584), (27648, 5120), (1000, 1024)])
def test_gluon_gemv_epilogues(n, k, monkeypatch):
    """M = 1..8 on the Gluon GEMV: the shared-memory epilogues (EPI_SMEM, the default) and the
    per-accumulator ones agree with the fp32 reference and with each other, per token, with a bias,
    split (4608x3584) and unsplit (27648x5120), N not a multiple of 64, counters back at 0."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer("nvfp4", n, k, seed=3)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for m in (1, 2, 5, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ w32.T + bias.float()
        ys = []
        for epi in (True, False):
            monkeypatch.setattr(G, "EPI_SMEM", epi)
            W.forward(x, st, bias=bias, config={"PATH": "wsmma"})
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            W.forward(x, st, bias=bias, config={"PATH": "wsmma"}, out=y)
            for row in range(m):
                assert _rel(y[row:row + 1], ref[row:row + 1]) < TOL, (epi, m, row)
            assert torch.equal(W.forward(x, st, bias=bias, config={"PATH": "wsmma"}), y)
            assert st["locks"].abs().sum().item() == 0
            ys.append(y)
        assert _rel(ys[0], ys[1].float()) < 1e-2


WG_CASES = [{}, {"NSW": 2, "NSD": 2, "NSX": 2}, {"S": 1}, {"S": 3}, {"BM": 16}, {"PDL": True}, {"DW": 8, "LAG": 2},
            {"CPS": 2, "NSD": 3}, {"CPS": 4, "NSD": 2, "NSX": 3}, {"CPS": 4, "NSD": 2, "DW": 8}, {"C0": 2},
            {"LOADS": 1}, {"LOADS": 1, "DW": 8, "PDL": True, "C0": 2}, {"BN": 128, "LOADS": 1, "NSD": 2, "NSX": 3},
            {"BN": 128, "LOADS": 1, "NSD": 2, "NSX": 3, "S": 3, "PDL": True},
            {"BN": 128, "LOADS": 1, "BM": 64, "NSD": 2, "NSX": 3, "C0": 2},
            {"BN": 128, "LOADS": 1, "CPS": 1, "NSD": 4, "NSX": 3, "S": 2},
            {"maxnreg": 80, "DEC_REGS": 96, "NSW": 3, "NSD": 2, "NSX": 3, "BM": 64},
            {"BN": 128, "NSD": 2, "NSX": 3, "BM": 128}]


@pytest.mark.parametrize("cfg", [{}, {"R": 1}, {"BM": 64}, {"NSW": 2, "NSX": 2}, {"PDL": True},
                                 {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104}, {"XREL": 1},
                                 {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1, "PDL": True},
                                 {"BM": 128, "NSX": 2}, {"BM": 128, "R": 1, "NSX": 2, "XREL": 1, "PDL": True},
                                 {"PWA": 1}, {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1, "PDL": True, "PWA": 1},
                                 {"BM": 128, "NSX": 2, "PWA": 1}, {"BM": 128, "R": 1, "NSX": 2, "XREL": 1, "PWA": 1},
                                 {"BM": 32, "R": 1, "NSW": 2, "NSX": 2, "maxnreg": 80, "XREL": 1, "PWA": 1},
                                 {"R": 1, "KP": 2, "XREL": 1, "NSX": 4}, {"R": 1, "KP": 2, "NSX": 4, "S": 3, "PDL": True},
                                 {"BM": 32, "R": 1, "KP": 2, "NSX": 4, "XREL": 1},
                                 {"BM": 32, "R": 1, "NSW": 2, "NSX": 2, "maxnreg": 80, "XREL": 1, "S": 2},
                                 {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1, "PDL": True, "S": 2}],
                         ids=["default", "R1", "BM64", "shallow", "pdl", "R1-two-per-SM", "xrel", "R1-two-xrel-pdl",
                              "BM128", "BM128-R1-xrel-pdl", "pwa", "R1-two-xrel-pdl-pwa", "BM128-pwa", "BM128-R1-xrel-pwa",
                              "BM32-R1-three-per-SM", "R1-KP2-xrel", "R1-KP2-S3-pdl", "BM32-R1-KP2-xrel",
                              "BM32-R1-three-per-SM-S2", "R1-two-xrel-pdl-S2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rwg_kernel(fmt, cfg):
    """The register-operand wgmma GEMM (PATH="rwg", nvfp4 and mxfp4), M from 1 to 300, through
    _check_gluon_gemm (reference, NaN poison, bias, determinism, counters, graph replay), plus the
    float scale conversion giving the same bits as the integer one."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W
    from qerl.kernels import w4a16_wgmma as WG

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, wgmma, warp specialisation)")

    def float_scales_equal(x, st, bias, y):  # the float scale conversion gives the same bits
        old, WG.SCALE_BITS = WG.SCALE_BITS, False
        try:
            return torch.equal(W.forward(x, st, bias=bias, config=dict(cfg, PATH="rwg")), y)
        finally:
            WG.SCALE_BITS = old

    # M per token tile; BM 32 is the three-per-SM form (w4a16_triton.RWG_THREE_PER_SM): 17..32 tokens in
    # one tile, 64 in two. KP 2 (two MMA warpgroups on alternate K steps): S 3 makes odd-length slices.
    # S 2 on the wide forms: RWG_WAVE_SPLIT's K halves
    tokens = {128: (65, 128, 300), 32: (17, 32, 64)}
    ms = (1, 5, 16, 17, 33, 64, 100) if not cfg else tokens.get(cfg.get("BM"), (16, 64))
    _check_gluon_gemm(fmt, dict(cfg, PATH="rwg"), ms, 1, float_scales_equal)


FRAG_CASES = [{}, {"R": 1, "KP": 2, "XREL": 1, "NSX": 4}, {"BM": 32, "R": 1, "NSW": 2, "NSX": 2, "maxnreg": 80, "XREL": 1},
              {"R": 1, "NSW": 3, "NSX": 2, "maxnreg": 104, "XREL": 1, "PDL": True}]


@pytest.mark.parametrize("cfg", FRAG_CASES, ids=["default", "R1-KP2-xrel", "BM32-R1-three-per-SM", "R1-two-xrel-pdl"])
def test_rwg_frag_kernel(cfg):
    """rwg on fragment-ordered words (FRAG, nvfp4): the same A operand values in the same wgmma order, so the
    output is bit-identical to rwg on today's words, besides _check_gluon_gemm's reference, poison, graph checks."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, wgmma, warp specialisation)")

    def same_as_todays_words(x, st, bias, y):
        return torch.equal(W.forward(x, st, bias=bias, config=dict(cfg, PATH="rwg")), y)

    ms = (16, 17, 33, 64) if cfg.get("BM") != 32 else (17, 32, 64)
    _check_gluon_gemm("nvfp4", dict(cfg, PATH="rwg", FRAG=1), ms, 2, same_as_todays_words)


@pytest.mark.parametrize("order", ["rows", "frag"])
def test_rwg_first_launch_sums_as_later_launches(order, monkeypatch):
    """A launch key's first rwg launch (before its occupancy is measured) gives the same bits as the next ones:
    two identical layers, fresh process state, 16 and 48 tokens."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_rwg as R

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("rwg runs on sm_90")
    monkeypatch.setattr(R, "_RESIDENT", {})
    t = quantize_weight(torch.randn(4096, 4096) * 0.05, "nvfp4")
    st = prepare("nvfp4", {key: v.cuda() for key, v in t.items()}, order=order)
    for m in (16, 48):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        first = R.forward(x, st)
        assert torch.equal(R.forward(x, st), first), m


@pytest.mark.parametrize("order", ["rows", "frag"])
def test_rwg_xrows_reads_the_storage_rows(order):
    """XROWS: where x = buf[:M] and M is not a multiple of the token tile, the last tile reads the rows past M from
    buf (NaN here) instead of zero-filling them, and the output is bit for bit the zero-filled launch's, without a
    NaN: the rule's forms (KP or R by fill on the narrow layer, two / three per SM on the wide one, 128-token tiles
    above 64) and R = 2."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_rwg as R
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("rwg runs on sm_90")
    slots = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((7168, 5120), (27648, 2048)):
        t = quantize_weight(torch.randn(n, k) * 0.05, "nvfp4")
        st = prepare("nvfp4", {key: v.cuda() for key, v in t.items()}, order=order)
        for m in (20, 40, 56, 100):
            buf = torch.randn(128, k, device="cuda", dtype=torch.bfloat16)
            buf[m:] = float("nan")
            x = buf[:m]
            for cfg in (W._rwg_config(n, k, m, slots), {"R": 2}):
                plain = R.forward(x.clone(), st, config=cfg)
                rows = R.forward(x, st, config={**cfg, "XROWS": 1})
                assert not rows.isnan().any() and torch.equal(rows, plain), (n, k, m, cfg)


@pytest.mark.parametrize("routes", [{"FRAG_WGMMA": 0, "FRAG_BWD_DEQUANT": 0}, {"FRAG_WGMMA": 1, "FRAG_BWD_DEQUANT": 1}],
                         ids=["dequant-fused_bwd", "wgmma-bwd_dequant"])
def test_fragment_order_layer(routes, monkeypatch):
    """A layer prepared with order="frag" (its only copy of the words fragment-ordered) through the default
    routing: rwg at 1..128 tokens (bit-identical to the rows-ordered layer from 17 tokens, where both run rwg's
    rule; within 1e-2 of the fp32 reference below), above that the wgmma GEMM by the rows layers' rules
    (FRAG_WGMMA, the default) or the bf16 buffer + cuBLAS; the input gradient (the bf16 buffer, FRAG_BWD_DEQUANT
    the default, or the Triton kernel) within 1e-2 and the dense weight the same bits as on rows-ordered words;
    NaN-poisoned outputs, counters back at 0, and a CUDA-graph replay at 4 and 32 tokens (no copy is built: the
    graph reads the layer's words)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, wgmma, warp specialisation)")
    for name, value in routes.items():
        monkeypatch.setattr(W, name, value)
    failures = []
    for n, k in ((1058, 1024), (4608, 3584), (3584, 18944)):
        t, rows, w32 = _layer("nvfp4", n, k, seed=n + k)
        frag = prepare("nvfp4", t, order="frag")
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for m in (1, 4, 8, 12, 16, 17, 32, 64, 100, 128, 300, 700):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            W.forward(x, frag)  # the first launch measures occupancy
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            W.forward(x, frag, bias=bias, out=y)
            err = _rel(y, x.float() @ w32.T + bias.float())
            same = not 17 <= m <= 128 or torch.equal(y, W.forward(x, rows, bias=bias))
            dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
            dx = torch.full((m, k), float("nan"), device="cuda", dtype=torch.bfloat16)
            W.backward(dy, frag, out=dx)  # (not bit-equal to rows: the split follows each compiled kernel's occupancy)
            err_dx = _rel(dx, dy.float() @ w32)
            if not (err <= TOL) or y.isnan().any() or not same or not (err_dx <= TOL):
                failures.append((n, k, m, err, bool(y.isnan().any()), same, err_dx))
        if not torch.equal(W.dequant_bf16(frag), W.dequant_bf16(rows)):
            failures.append((n, k, "dequant"))
        assert frag["locks"].abs().sum().item() == 0 and frag["locks_bwd"].abs().sum().item() == 0
        assert frag["_frag"][1] is frag["words"]  # rwg read the layer's own words
    assert not failures, f"(N, K, M, rel err, NaN, same as rows order, dx rel err) {failures}"
    for m in (4, 32):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = W.forward(x, frag)
        x.copy_(torch.randn(m, k, device="cuda").to(torch.bfloat16))
        g.replay()
        assert _rel(out, x.float() @ w32.T) < TOL


# The layers and token counts each frag-only refinement of rwg's 17..64-token rule moves (the sets that
# tests/test_kernels.py::test_fragment_order_rule_refinements pins on 132 SMs): FRAG_THREE_MAX_K (two per SM),
# FRAG_KP_MARGIN_PCT (KP), FRAG_R2_WIDE_MAX_M (R = 2 at 33..48), FRAG_THREE64_MAX_K (three per SM at BM 64, 49..64).
FRAG_REFINED = {(27648, 5120): (24, 32), (5120, 5120): (20, 64), (37888, 3584): (33,), (22016, 2048): (48, 49, 56, 61, 64)}


def test_fragment_rule_refinements_route_and_match_reference():
    """The configs the four frag refinements give, through the default routing of a fragment-ordered layer: the
    route is rwg with _frag_rwg_config's config (on a 132-SM GPU one that _rwg_config alone would not give), and
    _check_gluon_gemm's checks with no config (fp32 reference on a NaN-poisoned output, the same bits again, a graph
    replay at 64 tokens)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, wgmma, warp specialisation)")
    slots = W._num_sms(torch.cuda.current_device())
    wrong = []
    for (n, k), ms in FRAG_REFINED.items():
        for m in ms:
            state = {"n": n, "k": k, "kb": k // 256, "fmt": "nvfp4", "order": "frag"}  # what the route reads
            route = W._fused_route(m, state, torch.device("cuda"), None)
            rule = W._frag_rwg_config(n, k, W._frag_rule_tokens(m, k), slots)
            if route != ("rwg", rule) or (slots == 132 and rule == W._rwg_config(n, k, m, slots)):
                wrong.append((n, k, m, route, rule))
    assert not wrong, f"(N, K, M, route, frag rule) {wrong}"
    for (n, k), ms in FRAG_REFINED.items():
        _check_gluon_gemm("nvfp4", None, ms, 3 * k, order="frag", layers=((n, k),))


FRAG_GEMV_CASES = [(1058, 1024, {}), (4608, 3584, {"S": 2, "XS": False}), (37888, 3584, {"STREAMK": True, "PDL": True}),
                   (37888, 3584, {"TAIL_SPLIT": True, "XPF": True, "XS": False}), (3584, 18944, {}),
                   (7168, 5120, {"XS": True, "PDL": True}), (37888, 3584, {"XS": True})]


@pytest.mark.parametrize("n,k,cfg", FRAG_GEMV_CASES,
                         ids=[f"{n}x{k}-" + "-".join(f"{key}{v}" for key, v in c.items()) for n, k, c in FRAG_GEMV_CASES])
def test_gluon_gemv_fragment_words(n, k, cfg):
    """The Gluon GEMV on a layer prepared with order="frag" (w4a16_gluon WF 2: each word one mma.sync A fragment):
    M = 1 / 3 / 8 with a bias (N = 1058: a partial last block) in the split, forced-S, stream-K and split-tail
    schedules, x from global memory and in the ring (XS): fp32 reference within 1e-2 per token on a NaN-poisoned output, bit-identical re-runs, counters back
    at 0, a CUDA-graph replay; and GLU (silu(gate) * up) on a [gate; up] layer within 1e-2 per token."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, _rows, w32 = _layer("nvfp4", n, k, seed=n + 3 * k)
    st = prepare("nvfp4", t, order="frag")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    conf = dict(cfg, PATH="wsmma")
    bad = []
    for m in (1, 3, 8):
        x, y, ref = _poisoned_launch(W, st, w32, bias, conf, m)
        errs = [_rel(y[r:r + 1], ref[r:r + 1]) for r in range(m)]
        again = all(torch.equal(W.forward(x, st, bias=bias, config=conf), y) for _ in range(3))
        if y.isnan().any() or not max(errs) <= TOL or not again:
            bad.append((m, max(errs), again))
        assert st["locks"].abs().sum().item() == 0
    assert not bad, f"(M, worst rel err per token, re-runs equal) {bad}"
    _graph_replay_matches(W, x, st, w32, conf)
    if n % 128 == 0 and not cfg:
        for m in (2, 8):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            assert G.glu_usable(x, st)
            G.forward(x, st, glu=True)
            y = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
            G.forward(x, st, out=y, glu=True)
            ref = x.float() @ w32.T
            ref = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            assert not y.isnan().any() and max(_rel(y[r:r + 1], ref[r:r + 1]) for r in range(m)) <= TOL


WG_FRAG_CASES = [{}, {"BN": 128, "BM": 128}, {"CPS": 4, "NSD": 2}, {"LOADS": 1, "BN": 128, "NSW": 4, "PDL": True}]


@pytest.mark.parametrize("cfg", WG_FRAG_CASES, ids=["-".join(f"{k}{v}" for k, v in c.items()) or "default"
                                                     for c in WG_FRAG_CASES])
def test_wgmma_kernel_fragment_words(cfg):
    """The wgmma GEMM on layers prepared with order="frag" (w4a16_wgmma FMT 4 / 5: the decoder warps read the
    fragment words as rwg does and store each chunk's rows of pairs): _check_gluon_gemm's reference, poison,
    re-run and graph checks, and bit-identical to the same launch on the rows-ordered layer (the same bf16 values
    land in the same decoded stage)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import state_tensors
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, wgmma, warp specialisation)")
    conf = dict(cfg, PATH="wgmma")

    def same_as_rows(x, st, bias, y):
        rows = prepare("nvfp4", state_tensors(st), order="rows")
        return torch.equal(W.forward(x, rows, bias=bias, config=conf), y)

    # 33 / 100 tokens (BM 64 / 128) for the other configs: at 130+ tokens (BM 256) CPS 4 / NSD 2 and LOADS 1 /
    # BN 128 / NSW 4 need more than the H100's 232448 B of shared memory (kernel_args refuses them)
    _check_gluon_gemm("nvfp4", conf, (33, 100) if cfg else (33, 130, 256, 512), 4, same_as_rows, order="frag")


@pytest.mark.parametrize("cfg", WG_CASES, ids=["-".join(f"{k}{v}" for k, v in c.items()) or "default" for c in WG_CASES])
@pytest.mark.parametrize("fmt", FORMATS)
def test_wgmma_kernel(fmt, cfg):
    """The warp-specialised Gluon GEMM (PATH="wgmma": TMA loaders, decoder warps, async wgmma;
    BN = 128: two MMA warpgroups and two row tiles per program; LOADS: copies issued by the MMA warps):
    for M from 2 to 512 (the default config; two M for the others) over shapes with N not a multiple of 64 or 128 and one K slice per
    program or several: fp32 reference within 1e-2 on a NaN-poisoned output with bias, a
    bit-identical re-run, counters back at 0, and a CUDA-graph replay on new data."""
    pytest.importorskip("triton.experimental.gluon")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, wgmma, warp specialisation)")
    ms = (2, 16, 33, 64, 100, 256, 300, 512) if not cfg else (
        33, 100 if "BM" in cfg or (cfg.get("DW") == 8 and not cfg.get("LOADS")) else 300)
    _check_gluon_gemm(fmt, dict(cfg, PATH="wgmma"), ms, 0)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_per_warp_arrive_same_bits(pdl):
    """Per-warp stage release (PWA, qerl/kernels/ptx_pwa.py) changes only who frees a ring stage and
    when, not the arithmetic: through the default routing (Gluon GEMV at M <= 8 in its split,
    stream-K and split-tail schedules, rwg at 17..128 in its 64- and 128-token forms; M = 12 on the
    fused Triton kernel, which ignores the key) the outputs with PWA equal those without bit for
    bit, over 20 back-to-back launches (a stage freed early would show as a wrong or varying
    output), and match the fp32 reference."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    base = {"PDL": True} if pdl else {}
    bad = []
    for n, k in ((37888, 3584), (7168, 5120), (3584, 18944), (1000, 1024)):
        t, st, w32 = _layer("nvfp4", n, k, seed=n + k)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for m in (1, 3, 8, 12, 17, 64, 100, 128):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for conf in (dict(base, PWA=0), dict(base, PWA=1)):  # the first launch measures occupancy
                W.forward(x, st, bias=bias, config=conf)
            ref = W.forward(x, st, bias=bias, config=dict(base, PWA=0))
            outs = [W.forward(x, st, bias=bias, config=dict(base, PWA=1)) for _ in range(20)]
            err = _rel(outs[0], x.float() @ w32.T + bias.float())
            if not (err <= TOL) or not all(torch.equal(o, ref) for o in outs):
                bad.append((n, k, m, err, sum(not torch.equal(o, ref) for o in outs)))
        assert st["locks"].abs().sum().item() == 0
    assert not bad, f"(N, K, M, rel err, launches differing from PWA off) {bad}"


XS_CASES = [(37888, 3584, {}), (37888, 3584, {"STREAMK": True, "PDL": True}), (37888, 3584, {"TAIL_SPLIT": True}),
            (3584, 18944, {"PDL": True}), (3584, 18944, {"S": 3, "PWA": False}), (7168, 5120, {"NUM_STAGES": 6}),
            (1000, 1024, {"PDL": True, "num_warps": 8}), (4608, 3584, {"STREAMK": True, "PER_SM": 2, "PWA": True})]


@pytest.mark.parametrize("n,k,cfg", XS_CASES,
                         ids=[f"{n}x{k}-" + "-".join(f"{key}{v}" for key, v in c.items()) for n, k, c in XS_CASES])
def test_gluon_gemv_x_smem(n, k, cfg):
    """XS: the producer copies x beside each weight stage (TMA, rows past M zero-filled) and the
    consumers read it from shared memory. At M = 1 / 2 / 5 / 8 in the split, stream-K and
    split-tail schedules, with and without PDL: fp32 reference within 1e-2 per token on a
    NaN-poisoned output with bias, 20 back-to-back launches bit-identical (a stage refilled before
    its x was read would vary), within 1e-2 of the register path, counters back at 0, a CUDA-graph
    replay on new data; an x TMA cannot read (base not 16-byte aligned) takes the register path."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer("nvfp4", n, k, seed=n + 3 * k, order="rows" if cfg.get("num_warps") == 8 else None)
    # (the Gluon GEMV reads fragment-ordered words with 4 consumer warps only)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    conf = dict(cfg, PATH="wsmma", XS=True)
    bad = []
    for m in (1, 2, 5, 8):
        x, y, worst, differ = _checked_launches(W, st, w32, bias, conf, m, 20)
        regs = W.forward(x, st, bias=bias, config=dict(conf, XS=False))
        if not worst <= TOL or differ or not _rel(y, regs.float()) <= TOL:
            bad.append((m, worst, differ, _rel(y, regs.float())))
        assert st["locks"].abs().sum().item() == 0
        _graph_replay_matches(W, x, st, w32, conf)
        assert st["locks"].abs().sum().item() == 0
    assert not bad, f"(M, worst rel err per token, launches differing, rel diff to XS off) {bad}"
    flat = torch.randn(8 * k + 2, device="cuda").to(torch.bfloat16)
    x = flat[2:].view(8, k)  # contiguous, base 4 bytes past a 16-byte boundary
    assert _rel(W.forward(x, st, config=conf), x.float() @ w32.T) < TOL


MX_CASES = [(27648, 5120, {}), (37888, 3584, {"STREAMK": True, "PDL": True}), (37888, 3584, {"TAIL_SPLIT": True}),
            (3584, 18944, {"PDL": True, "XS": True}), (7168, 5120, {"S": 3, "XS": False}),
            (1000, 1024, {"num_warps": 8}), (4608, 3584, {"XPF": True, "XS": False})]


@pytest.mark.parametrize("n,k,cfg", MX_CASES,
                         ids=[f"{n}x{k}-" + "-".join(f"{key}{v}" for key, v in c.items()) for n, k, c in MX_CASES])
def test_gluon_gemv_mxfp4(n, k, cfg, monkeypatch):
    """The Gluon GEMV on mxfp4 (E8M0 scales in [32, 16] TMA boxes, w4a16_gluon._decode_mx) at M = 1 / 2 / 5 / 8
    in the split, stream-K and split-tail schedules, with and without XS / PDL: fp32 reference within 1e-2 per
    token on a NaN-poisoned output with bias, within 1e-2 of the default mxfp4 path, 10 launches bit-identical,
    the integer scale conversion (`scale_bits`) bit-identical to the exp2 one, counters back at 0, a CUDA-graph
    replay on new data."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer("mxfp4", n, k, seed=n + 5 * k)
    assert st["scale_bits"]
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    conf = dict(cfg, PATH="wsmma")
    bad = []
    for m in (1, 2, 5, 8):
        x, y, worst, differ = _checked_launches(W, st, w32, bias, conf, m, 10)
        other = W.forward(x, st, bias=bias)  # the default route (the fused Triton kernel or the GEMV)
        with monkeypatch.context() as mp:
            mp.setattr(G, "SCALE_BITS", False)
            floats = W.forward(x, st, bias=bias, config=conf)
        if not worst <= TOL or differ or not _rel(y, other.float()) <= TOL or not torch.equal(floats, y):
            bad.append((m, worst, differ, _rel(y, other.float()), torch.equal(floats, y)))
        assert st["locks"].abs().sum().item() == 0
        _graph_replay_matches(W, x, st, w32, conf)
        assert st["locks"].abs().sum().item() == 0
    assert not bad, f"(M, worst rel err per token, launches differing, rel diff to the default, exp2 path equal) {bad}"


GLU_CASES = [(4096, 1024, {}, "nvfp4"), (8192, 2048, {"XS": True}, "nvfp4"), (8192, 2048, {"XS": False, "S": 4}, "nvfp4"),
             (37888, 3584, {"STREAMK": True, "XS": True}, "nvfp4"), (37888, 3584, {"TAIL_SPLIT": True}, "nvfp4"),
             (4096, 1024, {"num_warps": 8, "PDL": True}, "nvfp4"), (27648, 5120, {"XS": False}, "nvfp4"),
             (8192, 2048, {"XS": True}, "mxfp4"), (37888, 3584, {"STREAMK": True, "XS": True}, "mxfp4"),
             (4096, 1024, {"num_warps": 8, "PDL": True, "S": 3}, "mxfp4")]


@pytest.mark.parametrize("n,k,cfg,fmt", GLU_CASES,
                         ids=[f"{f}-{n}x{k}-" + "-".join(f"{key}{v}" for key, v in c.items()) for n, k, c, f in GLU_CASES])
def test_gluon_gemv_glu(n, k, cfg, fmt):
    """GLU on a [gate; up] layer (N = 2 I): silu(gate) * up [M, I] from one launch, at M = 2 / 5 / 8 in
    the split, forced-S, stream-K and split-tail schedules, XS on and off, 8 warps, PDL: within 1e-2
    of the fp32 reference per token on a NaN-poisoned output; equal to decode_ops.silu_mul of the
    plain launch's [M, N] product (bit for bit in the split schedules, where every row sums its K
    slices in the same order; within 1e-2 in stream-K and split tail, whose segments fall
    elsewhere); 5 relaunches bit-identical, counters back at 0. mxfp4: its [2, 16, 16] scale boxes."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import decode_ops
    from qerl.kernels import w4a16_gluon as G

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    t, st, w32 = _layer(fmt, n, k, seed=n + 5 * k, order="rows" if cfg.get("num_warps") == 8 else None)
    exact = "STREAMK" not in cfg and "TAIL_SPLIT" not in cfg
    bad = []
    for m in (2, 5, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert G.glu_usable(x, st)
        G.forward(x, st, config=cfg, glu=True)  # the first launch measures occupancy
        y = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        G.forward(x, st, config=cfg, out=y, glu=True)
        plain = decode_ops.silu_mul(G.forward(x, st, config=cfg))
        ref = x.float() @ w32.T
        ref = torch.nn.functional.silu(ref[:, :n // 2]) * ref[:, n // 2:]
        errs = [_rel(y[r:r + 1], ref[r:r + 1]) for r in range(m)]
        again = [G.forward(x, st, config=cfg, glu=True) for _ in range(5)]
        same = torch.equal(y, plain) if exact else _rel(y, plain.float()) <= TOL
        if y.isnan().any() or not max(errs) <= TOL or not same or not all(torch.equal(a, y) for a in again):
            bad.append((m, max(errs), same, sum(not torch.equal(a, y) for a in again)))
        assert st["locks"].abs().sum().item() == 0
    assert not bad, f"(M, worst rel err per token, equal to silu_mul of the plain launch, relaunches differing) {bad}"
    with pytest.raises(ValueError):
        G.forward(torch.randn(1, k, device="cuda").to(torch.bfloat16), st, glu=True)  # one token: no GLU


@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4"))
def test_gluon_gemv_norm_fold(fmt):
    """NORM_FOLD (w4a16_gluon.forward fold): the producer's epilogue ("res") writes r = bf16(h + y) and
    bf16(r w) bit-equal to those roundings of its plain output y, and per 64-column block the sums of
    r^2 (fp32, to 1e-5); the consumer ("scale", plain with a bias, and GLU) multiplies each token by
    1 / sqrt(mean r^2 + eps): within 1e-2 per token of the fp32 reference and of the unfused path
    (the RMSNorm reference, then the plain launch), at M = 2 / 5 / 8, NaN-poisoned outputs; nvfp4 and mxfp4."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import decode_ops
    from qerl.kernels import w4a16_gluon as G

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    hid, k_in, eps = 1024, 2048, 1e-6
    _t, st_o, w_o = _layer(fmt, hid, k_in, seed=11)
    _t, st_q, w_q = _layer(fmt, 1536, hid, seed=12)
    _t, st_g, w_g = _layer(fmt, 4096, hid, seed=13)
    g = torch.Generator(device="cuda").manual_seed(14)
    bias = (torch.randn(1536, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    bad = []
    for m in (2, 5, 8):
        a = torch.randn(m, k_in, device="cuda", generator=g).to(torch.bfloat16)
        h = torch.randn(m, hid, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.rand(hid, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        y = G.forward(a, st_o)
        h_out = torch.full_like(h, float("nan"))
        ss = torch.full((hid // 64, 8), float("nan"), device="cuda")
        rw = G.forward(a, st_o, fold=("res", h, w, h_out, ss))
        r = (h.float() + y.float()).to(torch.bfloat16)
        ok_res = torch.equal(h_out, r) and torch.equal(rw, (r.float() * w.float()).to(torch.bfloat16))
        ss_ref = r.float().pow(2).view(m, hid // 64, 64).sum(-1).T
        ok_ss = torch.allclose(ss[:, :m], ss_ref, rtol=1e-5, atol=0)
        inv = torch.rsqrt(r.float().pow(2).mean(-1) + eps)[:, None]
        scale = ("scale", ss, hid // 64, eps, hid)
        normed = decode_ops.add_rms_norm_reference(None, r, w, eps)[1]
        yq = torch.full((m, 1536), float("nan"), device="cuda", dtype=torch.bfloat16)
        G.forward(rw, st_q, bias=bias, out=yq, fold=scale)
        ref_q = (rw.float() @ w_q.T) * inv + bias.float()
        unfused_q = G.forward(normed, st_q, bias=bias)
        yg = G.forward(rw, st_g, glu=True, fold=scale)
        full = (rw.float() @ w_g.T) * inv
        ref_g = torch.nn.functional.silu(full[:, :2048]) * full[:, 2048:]
        unfused_g = G.forward(normed, st_g, glu=True)
        errs = [max(_rel(o[i:i + 1], rf[i:i + 1]) for i in range(m))
                for o, rf in ((yq, ref_q), (yq, unfused_q.float()), (yg, ref_g), (yg, unfused_g.float()))]
        if not (ok_res and ok_ss and max(errs) <= TOL) or yq.isnan().any() or yg.isnan().any():
            bad.append((m, ok_res, ok_ss, errs))
    assert not bad, f"(M, res bit-equal, sums, [q vs fp32, q vs unfused, glu vs fp32, glu vs unfused]) {bad}"


@pytest.mark.parametrize("cfg", [{}, {"STREAMK": True}, {"S": 2}, {"nap": 200}], ids=["default", "sk", "split2", "nap200"])
def test_gluon_gemv_sync_epilogues(cfg, monkeypatch):
    """sync (the resident LoRA kernel's delta, w4a16_gluon.forward): with the flag already at its
    target, GLU adds the delta to gate and up before the silu, equal to decode_ops.silu_mul of the
    plain launch's product with the delta as its extra (bit for bit where every row sums its K slices
    as the plain launch does; within 1e-2 in stream-K), and RES adds it to the product before the
    residual (r = bf16(h + bf16(y + delta)), bf16(r w)); each launch counts N / 64 blocks out on its
    signal; rows past M of the delta are not read (NaN there); the delta moves the outputs."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import decode_ops
    from qerl.kernels import w4a16_gluon as G

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    cfg = dict(cfg)
    monkeypatch.setattr(G, "SYNC_NAP", cfg.pop("nap", 0))  # (the build with naps in the wait; the flag is already set)
    hid, k_in = 1024, 2048
    _t, st_o, _w = _layer("nvfp4", hid, k_in, seed=21)
    _t, st_g, _w = _layer("nvfp4", 4096, hid, seed=22)
    g = torch.Generator(device="cuda").manual_seed(23)
    exact = "STREAMK" not in cfg
    bad = []
    for m in (2, 5, 8):
        flags = torch.tensor([3, 0, 3, 0], dtype=torch.int32, device="cuda")  # [delta ready, signal] x 2
        x = torch.randn(m, hid, device="cuda", generator=g).to(torch.bfloat16)
        dg = torch.full((16, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
        dg[:m] = torch.randn(m, 4096, device="cuda", generator=g) * 0.5
        G.forward(x, st_g, config=cfg, glu=True, sync=(dg, flags[0:1], 3, flags[1:2]))  # occupancy measured
        flags[1] = 0
        yg = G.forward(x, st_g, config=cfg, glu=True, sync=(dg, flags[0:1], 3, flags[1:2]))
        prod = G.forward(x, st_g, config=cfg)
        want_g = decode_ops.silu_mul_reference(prod, dg[:m])
        ok_g = torch.equal(yg, want_g) if exact else _rel(yg, want_g.float()) <= TOL
        moved_g = _rel(decode_ops.silu_mul_reference(prod), want_g.float()) > 0.05

        a = torch.randn(m, k_in, device="cuda", generator=g).to(torch.bfloat16)
        h = torch.randn(m, hid, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.rand(hid, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        do = torch.full((16, hid), float("nan"), device="cuda", dtype=torch.bfloat16)
        do[:m] = torch.randn(m, hid, device="cuda", generator=g)
        h_out = torch.full_like(h, float("nan"))
        ss = torch.full((hid // 64, 8), float("nan"), device="cuda")
        fold = ("res", h, w, h_out, ss)
        G.forward(a, st_o, config=cfg, fold=fold, sync=(do, flags[2:3], 3, flags[3:4]))
        flags[3] = 0
        rw = G.forward(a, st_o, config=cfg, fold=fold, sync=(do, flags[2:3], 3, flags[3:4]))
        y = G.forward(a, st_o, config=cfg)
        r = (h.float() + (y.float() + do[:m].float()).to(torch.bfloat16).float()).to(torch.bfloat16)
        rw_want = (r.float() * w.float()).to(torch.bfloat16)
        ok_o = (torch.equal(h_out, r) and torch.equal(rw, rw_want)) if exact else max(_rel(h_out, r.float()), _rel(rw, rw_want.float())) <= TOL
        counts = flags[[1, 3]].tolist()
        if not (ok_g and ok_o and moved_g and counts == [4096 // 64, hid // 64]) or yg.isnan().any() or rw.isnan().any():
            bad.append((m, ok_g, ok_o, moved_g, counts))
    assert not bad, f"(M, glu as silu_mul with the delta, res as the norm's add with it, delta moved glu, counts) {bad}"
    with pytest.raises(ValueError, match="sync"):
        G.forward(x, st_g, sync=(dg, flags[0:1], 3, flags[1:2]))  # a plain launch takes no delta


@pytest.mark.parametrize("cfg", [{"rank": 16}, {"rank": 32, "STREAMK": True}, {"rank": 64, "S": 2}, {"rank": 32, "nap": 200}],
                         ids=["r16", "r32-sk", "r64-split2", "r32-nap200"])
def test_gluon_gemv_expand_epilogues(cfg, monkeypatch):
    """sync with a lora_resident.Expand (engine.LORA_RESIDENT_EXPAND): with the flag already at its target,
    each block's writer adds sum over segments of bf16(h[:, seg]) @ B[seg rows]^T to its fp32 product
    before alpha, in a plain launch (three segments), with a folded norm's scale (times the token's 1 / rms),
    before the residual add (RES) and before the GLU (with a scale): against the fp32 reference of the
    dequantised weights within 1e-2 per token; the delta moves the outputs; rows of h past M are not read
    (NaN there); each launch counts N / 64 blocks out; what the expand cannot take is refused."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G
    from qerl.kernels.lora_resident import Expand

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    cfg = dict(cfg)
    rank = cfg.pop("rank")
    monkeypatch.setattr(G, "SYNC_NAP", cfg.pop("nap", 0))
    hid, k_in = 1024, 2048
    _t, st_q, w_q = _layer("nvfp4", 1536, hid, seed=31)
    _t, st_o, w_o = _layer("nvfp4", hid, k_in, seed=32)
    _t, st_g, w_g = _layer("nvfp4", 4096, hid, seed=33)
    g = torch.Generator(device="cuda").manual_seed(34)

    def expand(n, bounds):
        h = torch.full((16, 4 * rank), float("nan"), device="cuda")
        h[:8] = torch.randn(8, 4 * rank, device="cuda", generator=g)
        b = (torch.randn(n, rank, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
        edges = [0, bounds[0], bounds[1], n]
        delta = torch.zeros(8, n, device="cuda")
        for i in range(3):
            if edges[i + 1] > edges[i]:
                seg = h[:8, i * rank:(i + 1) * rank].to(torch.bfloat16).float()
                delta[:, edges[i]:edges[i + 1]] = seg @ b[edges[i]:edges[i + 1]].float().t()
        return Expand(h, b, bounds, rank), delta

    bad = []
    flags = torch.zeros(8, dtype=torch.int32, device="cuda")
    for m in (2, 5, 8):
        x = torch.randn(m, hid, device="cuda", generator=g).to(torch.bfloat16)
        ss = torch.rand(hid // 64 + 1, 8, device="cuda", generator=g) * 60 + 1
        scale = ("scale", ss, hid // 64, 1e-5, hid)
        inv = 1.0 / torch.sqrt(ss[:hid // 64, :m].sum(0) / hid + 1e-5)[:, None]
        errs, moved, counts = [], [], []

        def run(i, *args, **kw):  # twice: the first launch measures occupancy; the count of the second
            flags[2 * i] = 3
            G.forward(*args, config=cfg, **kw)
            flags[2 * i + 1] = 0
            out = G.forward(*args, config=cfg, **kw)
            counts.append(int(flags[2 * i + 1]))
            return out

        eq, dq = expand(1536, (1024, 1280))  # q / k / v: three segments
        sync = (eq, flags[0:1], 3, flags[1:2])
        yq = run(0, x, st_q, sync=sync)
        want = x.float() @ w_q.T + dq[:m]
        errs.append(_rel(yq, want))
        moved.append(_rel(G.forward(x, st_q), want))
        ys = run(0, x, st_q, fold=scale, sync=sync)
        want = (x.float() @ w_q.T + dq[:m]) * inv
        errs.append(_rel(ys, want))
        a = torch.randn(m, k_in, device="cuda", generator=g).to(torch.bfloat16)
        hr = torch.randn(m, hid, device="cuda", generator=g).to(torch.bfloat16)
        wn = (torch.rand(hid, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        h_out = torch.full_like(hr, float("nan"))
        ss_o = torch.full((hid // 64, 8), float("nan"), device="cuda")
        eo, do = expand(hid, (hid, hid))
        rw = run(1, a, st_o, fold=("res", hr, wn, h_out, ss_o), sync=(eo, flags[2:3], 3, flags[3:4]))
        r = hr.float() + a.float() @ w_o.T + do[:m]
        errs += [_rel(h_out, r), _rel(rw, r * wn.float())]
        moved.append(_rel(hr.float() + G.forward(a, st_o).float(), r))
        eg, dg = expand(4096, (2048, 4096))
        yg = run(2, x, st_g, glu=True, fold=scale, sync=(eg, flags[4:5], 3, flags[5:6]))
        full = (x.float() @ w_g.T + dg[:m]) * inv
        want = torch.nn.functional.silu(full[:, :2048]) * full[:, 2048:]
        errs.append(max(_rel(yg[i:i + 1], want[i:i + 1]) for i in range(m)))
        moved.append(_rel(G.forward(x, st_g, glu=True, fold=scale), want))
        nan = any(t.isnan().any() for t in (yq, ys, rw, h_out, yg))
        if max(errs) > TOL or min(moved) < 0.05 or nan or counts != [1536 // 64] * 2 + [hid // 64, 4096 // 64]:
            bad.append((m, errs, moved, counts, nan))
    assert not bad, f"(M, [q, q scaled, res h_out, res rw, glu] vs fp32, delta moved [q, res, glu], counts, NaN) {bad}"
    with pytest.raises(ValueError, match="Expand"):
        G.forward(x, st_q, sync=(Expand(eq.h, eq.b[:, :8].contiguous(), eq.bounds, 8), flags[0:1], 3, flags[1:2]))
    with pytest.raises(ValueError, match="Expand"):
        G.forward(x, st_g, glu=True, sync=(Expand(eq.h, eg.b, (1024, 4096), rank), flags[0:1], 3, flags[1:2]))


def _graphed_chain_matches(m: int, cfg: dict, eager_cfg: dict, seed: int, same) -> None:
    """A chain of 7 dependent 3584 x 3584 nvfp4 launches with `cfg`, captured in a CUDA graph and replayed on
    fresh inputs: same(replayed output, the eager chain with `eager_cfg`) for every input."""
    from qerl.kernels import w4a16_triton as W

    n = 3584
    layers = [_layer("nvfp4", n, n, seed=seed + i)[1] for i in range(3)]
    order = [0, 1, 2, 0, 1, 2, 0]

    def chain(x, c):
        for i in order:
            x = W.forward(x, layers[i], config=c)
        return x

    static_x = torch.randn(m, n, device="cuda").to(torch.bfloat16)
    chain(static_x, cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(static_x, cfg)
    for s in range(4):
        x = torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(s)).to(torch.bfloat16)
        static_x.copy_(x)
        g.replay()
        assert same(out, chain(x, eager_cfg)), s


@pytest.mark.parametrize("m", (1, 4, 8))
def test_gluon_gemv_x_smem_pdl_chain(m):
    """XS with PDL: the producer copies its weights before the wait and x only after it. A chain of
    dependent 3584 x 3584 launches captured in a CUDA graph, replayed on fresh inputs, equals the
    eager chain without PDL for that input (an x copied before the wait would read the previous
    replay's intermediates)."""
    pytest.importorskip("triton.experimental.gluon")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (TMA, warp specialisation)")
    _graphed_chain_matches(m, {"PATH": "wsmma", "XS": True, "PDL": True}, {"PATH": "wsmma", "XS": True, "PDL": False},
                           60, lambda a, b: _rel(a, b) < TOL)


GEMM_LAYERS = ((1058, 1024), (4608, 3584), (7168, 5120))


def _check_gluon_gemm(fmt: str, conf: dict | None, ms, seed: int, also=None, order: str = "rows", layers=GEMM_LAYERS):
    """W.forward with `conf` (None: the default routing) on `layers` (by default three: 1058 x 1024: 17 row tiles, the
    last one partly past N; 4608 x 3584; 7168 x 5120; prepared in `order`, rows unless a fragment-order test asks) at
    each M in ms: fp32 reference within TOL on a NaN-poisoned
    output with bias, a bit-identical re-run, also(x, state, bias, y) true where given, counters back at 0;
    then a CUDA-graph replay of the last layer at M = 64 on new data."""
    from qerl.kernels import w4a16_triton as W

    failures = []
    for n, k in layers:
        t, st, w32 = _layer(fmt, n, k, seed=n + k + seed, order=order)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            W.forward(x, st, config=conf)  # the first launch measures occupancy, which may change the split
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            W.forward(x, st, bias=bias, config=conf, out=y)
            err = _rel(y, x.float() @ w32.T + bias.float())
            same = torch.equal(W.forward(x, st, bias=bias, config=conf), y)
            extra = also is None or also(x, st, bias, y)
            if not (err <= TOL) or y.isnan().any() or not same or not extra:
                failures.append((n, k, m, err, bool(y.isnan().any()), same, extra))
        assert st["locks"].abs().sum().item() == 0
    assert not failures, f"{fmt} {conf}: (N, K, M, rel err, NaN, deterministic, extra check) {failures}"
    x = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = W.forward(x, st, config=conf)
    x.copy_(torch.randn(64, k, device="cuda").to(torch.bfloat16))
    g.replay()
    assert _rel(out, x.float() @ w32.T) < TOL


CLUSTER_CASES = [(3584, 3584, (2, 3, 8, None)), (1058, 1024, (4,)), (7168, 5120, (None,))]


@pytest.mark.parametrize("n,k,ss", CLUSTER_CASES, ids=[f"{n}x{k}" for n, k, _ in CLUSTER_CASES])
def test_gluon_gemv_cluster_fixup(n, k, ss):
    """The split fixup through the cluster's shared memory (CLUSTER, qerl/kernels/ptx_cluster.py) adds the
    same partials in the same order as the global workspace: for S = 2 / 3 / 4 / 8 forced and the rule's S
    (None: 7 on 3584^2, 4 on 7168 x 5120 at 4 programs per SM), M = 1 / 3 / 8 (the M = 1 and the 8-token
    epilogues), with a bias (N = 1058: the last block part past N), PDL off (and on for the rule's S), the output on a NaN-poisoned buffer is bit-identical to CLUSTER off, within 1e-2 of the
    fp32 reference, and equal on a re-run; the launches really ran as clusters (CLUSTERS records each
    size the device can hold; none of these layers has more blocks than co-resident clusters)."""
    pytest.importorskip("triton.experimental.gluon")
    from qerl.kernels import w4a16_gluon as G
    from qerl.kernels import w4a16_triton as W

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (clusters, TMA, warp specialisation)")
    t, st, w32 = _layer("nvfp4", n, k, seed=n + k)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    bad = []
    for m in (1, 3, 8):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ w32.T + bias.float()
        for s in ss:
            for pdl in (False, True) if s is None else (False,):
                base = {"PATH": "wsmma", "PDL": pdl, **({"S": s} if s else {})}
                W.forward(x, st, config=dict(base, CLUSTER=False))  # the first launch measures occupancy
                plain = W.forward(x, st, bias=bias, config=dict(base, CLUSTER=False))
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                W.forward(x, st, bias=bias, config=dict(base, CLUSTER=True), out=y)
                again = W.forward(x, st, bias=bias, config=dict(base, CLUSTER=True))
                err = _rel(y, ref)
                if not (torch.equal(y, plain) and torch.equal(again, y) and err < TOL):
                    bad.append((m, s, pdl, err, torch.equal(y, plain), torch.equal(again, y)))
    assert not bad, bad
    sizes = {cl for cl, _mt, _most in G.CLUSTERS.values()}
    assert sizes and all(most > 0 for _cl, _mt, most in G.CLUSTERS.values()), G.CLUSTERS
    assert max(sizes) >= 2


@pytest.mark.parametrize("m", (1, 4))
def test_gluon_gemv_cluster_fixup_pdl_chain(m):
    """Cluster launches chained with PDL in a CUDA graph (the decode step's form: the next launch's clusters
    start while this one runs): a chain of dependent 3584 x 3584 launches (S = 7) replayed on fresh inputs
    equals the eager chain with the global fixup, bit for bit."""
    pytest.importorskip("triton.experimental.gluon")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper (clusters, TMA, warp specialisation)")
    _graphed_chain_matches(m, {"PATH": "wsmma", "PDL": True, "CLUSTER": True},
                           {"PATH": "wsmma", "PDL": False, "CLUSTER": False}, 90, torch.equal)
