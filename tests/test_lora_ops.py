"""qerl.kernels.lora_ops: the grouped LoRA shrink / expand kernels (Triton's interpreter, in a
subprocess, on CPU float32 tensors) against the torch reference and against the per-module
definition (x @ A_i^T @ (s_i B_i)^T for each module's rows), on fresh random inputs with one, two
and three segments, ranks padded inside a group, and row counts that are not powers of two; the
one-launch kernel (ticketed roles) and the two kernels give the same bits."""

from __future__ import annotations

import textwrap

import pytest
import torch

from interpreted import run_interpreted
from qerl.kernels import lora_ops

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from qerl.kernels import lora_ops as lo
    torch.manual_seed(int(__import__("os").environ.get("SEED", "0")))
    out = []
    for m, k, sizes, rank in ((1, 200, [96], 16), (3, 384, [64, 32, 32], 16), (8, 1000, [160, 160], 32), (17, 300, [48, 80, 16], 8),
                            (40, 2400, [96, 32], 16)):
        n, bounds = sum(sizes), lo.segment_bounds(sizes)
        x = torch.randn(m, k + 5)[:, :k]  # a row stride that is not k
        a = torch.randn(len(sizes) * rank, k) * 0.1
        b = torch.randn(n, rank) * 0.1
        got = {}
        for fused in (True, False):
            lo.FUSED = fused
            ws = lo.workspace(m + 3, k, a.shape[0], n, x.dtype, x.device)
            lo.lora_delta_triton(x * 2, a, b, bounds, rank, ws)
            got[fused] = lo.lora_delta_triton(x, a, b, bounds, rank, ws).clone()  # the counters were reset
            assert int(ws[2].abs().sum()) == 0, ws[2]
        first = lo.lora_delta_triton(x, a, b, bounds, rank)  # its own fresh workspace
        ref = lo.lora_delta_reference(x.contiguous(), a, b, bounds, rank)
        err = float(max((first - ref).abs().max(), (got[True] - ref).abs().max()) / ref.abs().max())
        out.append((m, k, len(sizes), rank, err, bool(torch.equal(got[True], got[False]))))
    print("RESULTS" + json.dumps(out))
    """
)


@pytest.mark.parametrize("seed", [0, 1])
def test_lora_kernels_under_interpreter(seed):
    results = run_interpreted(_SCRIPT, seed)
    assert len(results) == 5  # the last: 40 rows take 5 slices of 512 K (four 128-K chunks each)
    assert all(r[-2] <= 1e-5 for r in results), results
    assert all(r[-1] for r in results), results  # fused == two kernels, bit for bit


def test_reference_is_the_per_module_product():
    torch.manual_seed(0)
    k, sizes, ranks = 64, [24, 8, 8], [4, 2, 4]
    rank, n = max(ranks), sum(sizes)
    x = torch.randn(5, k, dtype=torch.float64)
    mods = [(torch.randn(r, k, dtype=torch.float64), torch.randn(s, r, dtype=torch.float64), 0.5 * (i + 1))
            for i, (r, s) in enumerate(zip(ranks, sizes))]
    a = torch.zeros(3 * rank, k, dtype=torch.float64)
    b = torch.zeros(n, rank, dtype=torch.float64)
    n0 = 0
    for i, (ai, bi, si) in enumerate(mods):
        a[i * rank:i * rank + ai.shape[0]] = ai
        b[n0:n0 + bi.shape[0], :ai.shape[0]] = bi * si
        n0 += bi.shape[0]
    want = torch.cat([(x @ ai.t()) @ bi.t() * si for ai, bi, si in mods], -1)
    got = lora_ops.lora_delta_reference(x, a, b, (24, 32), rank)
    assert torch.allclose(got, want, atol=1e-10)


def test_shrink_splits_bound_the_partials():
    for k in (64, 896, 3584, 5120, 18944, 27648, 29568):
        bk, s = lora_ops.shrink_splits(k)
        assert bk >= 128 and bk & (bk - 1) == 0 and s <= 64 and (s - 1) * bk < k <= s * bk
        for m in (1, 8, 16, 17, 32, 33, 64):
            bk_m, s_m = lora_ops.shrink_splits(k, m)
            # up to 16 rows the split of one row; above, fewer slices (the reducing program's partials
            # stay S x MP <= 512 rows, or 8 slices), never more than the workspace sized by shrink_splits(k)
            mp = max(16, 1 << (m - 1).bit_length())
            assert s_m <= s
            if m <= 16:
                assert (bk_m, s_m) == (bk, s)
            else:
                assert s_m * mp <= lora_ops.SPLIT_PARTIAL_ROWS or s_m <= 8
            assert bk_m & (bk_m - 1) == 0 and (s_m - 1) * bk_m < k <= s_m * bk_m
    assert lora_ops.shrink_splits(5120, 8) == lora_ops.shrink_splits(5120) == (128, 40)
    assert lora_ops.shrink_splits(5120, 16) == (128, 40)
    assert lora_ops.shrink_splits(5120, 32) == (512, 10)
    assert lora_ops.shrink_splits(5120, 64) == (1024, 5)
    assert lora_ops.shrink_splits(13824, 32) == (1024, 14)


def test_workspace_too_small_for_the_split_is_refused():
    """The shrink writes S x M x R fp32 partials: a workspace made for fewer K slices (another
    MAX_SPLITS), rows or rank is refused before any launch, never written past."""
    from qerl.kernels import lora_ops

    k, r = 18944, 32
    s = lora_ops.shrink_splits(k)[1]
    ws = lora_ops.workspace(8, k, r, 64, torch.bfloat16, "cpu")
    lora_ops._check_partials(ws[0], s, 8, r)
    for bad in ((s + 1, 8, r), (s, 9, r), (s, 8, r + 1)):
        with pytest.raises(ValueError, match="too small"):
            lora_ops._check_partials(ws[0], *bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_in_place_matches_the_delta(dtype, monkeypatch):
    """The prefill's in-place form (one GEMM per segment with beta = 1 into the base product) adds
    what lora_delta computes: to fp32 rounding in fp32, within one bf16 rounding of the sum in bf16; off,
    it is the old write-then-add, bit for bit."""
    g = torch.Generator().manual_seed(5)
    m, k, rank, sizes = 96, 48, 8, (40, 16, 16)
    n = sum(sizes)
    bounds = (sizes[0], sizes[0] + sizes[1])
    x = torch.randn(m, k, generator=g).to(dtype)
    a = torch.randn(3 * rank, k, generator=g).to(dtype) / 4
    b = torch.randn(n, rank, generator=g).to(dtype) / 4
    y = torch.randn(m, n, generator=g).to(dtype)
    want = y.float() + lora_ops.lora_delta(x, a, b, bounds, rank).float()
    got = lora_ops.lora_add_(y.clone(), x, a, b, bounds, rank)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(got.float(), want, **tol)
    monkeypatch.setattr(lora_ops, "ADD_IN_PLACE", False)
    old = lora_ops.lora_add_(y.clone(), x, a, b, bounds, rank)
    assert torch.equal(old, y + lora_ops.lora_delta(x, a, b, bounds, rank))
    # one segment (o / down), and a group of two (gate / up)
    for bnd in ((n, n), (sizes[0], n)):
        want = y.float() + lora_ops.lora_delta(x, a, b, bnd, rank).float()
        monkeypatch.setattr(lora_ops, "ADD_IN_PLACE", True)
        torch.testing.assert_close(lora_ops.lora_add_(y.clone(), x, a, b, bnd, rank).float(), want, **tol)
