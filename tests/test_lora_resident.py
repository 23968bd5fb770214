"""qerl.kernels.lora_resident: the resident LoRA kernel (Triton's interpreter, one program, in a
subprocess, CPU float32) against its torch reference and lora_ops' reference on fresh random inputs:
one, two and three segments, two K tiles, a row stride that is not K, rows that are no power of two;
the flags it leaves (arrival, output counts) and a wait that gives up is counted, not hung; a group
whose input is a folded norm's (the rows' 1 / rms applied from per-block sums, NORM_FOLD); groups
the kernel only sums (table_row expand=False: their GEMV expands)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from interpreted import run_interpreted
from qerl.kernels import lora_ops, lora_resident

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from qerl.kernels import lora_ops, lora_resident as lr
    torch.manual_seed(int(__import__("os").environ.get("SEED", "0")))
    rank, m = 16, 5
    lr.BN = 64  # the segments here are 64 wide
    shapes = [(128, [128, 64, 64]), (256, [128]), (384, [64, 64])]  # (K, segment sizes)
    base = torch.zeros(4)
    table, keep, want, outs = [], [], [], []
    keep_x, keep_a = [], []
    for k, sizes in shapes:
        n, bounds = sum(sizes), lora_ops.segment_bounds(sizes)
        x = torch.randn(m, k + 8)[:, :k]  # a row stride that is not K
        a = torch.randn(len(sizes) * rank, k) * 0.1
        b = torch.randn(n, rank) * 0.1
        out = torch.full((lr.MP, n), float("nan"))
        scale, xn = None, x.contiguous()
        if k == 256:  # a folded norm's input: the kernel applies each row's 1 / rms from per-block sums
            ss = torch.rand(k // 64 + 1, 8) * 50  # one block more than the input has: not read
            scale = ("scale", ss, k // 64, 1e-5, k)
            keep.append(ss)
            xn = x / torch.sqrt(ss[:k // 64, :m].sum(0) / k + 1e-5)[:, None]
        table.append(lr.table_row(base, x, a, b, out, bounds, 3, scale))
        keep += [x, a, b]
        keep_x.append(x)
        keep_a.append(a)
        outs.append(out)
        want.append((lr.resident_reference(x, a, b, bounds, rank, scale), lora_ops.lora_delta_reference(xn, a, b, bounds, rank)))
    g = len(shapes)
    res = []
    for missing, lr.BK, lr.STAGES in ((False, 64, 1), (True, 64, 1), (False, 128, 2)):
        flags = torch.zeros(3 * g + 2, dtype=torch.int32)
        flags[0:3 * g:3] = 3  # every producer (3 programs) has signalled
        if missing:
            flags[3] = 2  # group 1's producer is one program short
        xa = torch.zeros(g, lr.MP, 64)
        lr.resident_lora(base, torch.tensor(table, dtype=torch.int64), flags, xa, g, m, rank, 1, cap=8)
        errs = [float((o[:m] - r).abs().max() / r.abs().max()) for o, (r, _) in zip(outs, want)]
        errs_ops = [float((r - o).abs().max() / o.abs().max()) for r, o in want]
        res.append({"errs": errs, "errs_ops": errs_ops, "flags": flags.tolist(),
                    "untouched": all(bool(o[m:].isnan().all()) for o in outs)})
    # WORK off (timing only): the same waits and counts, nothing written
    lr.WORK = False
    for o in outs:
        o.fill_(float("nan"))
    flags = torch.zeros(3 * g + 2, dtype=torch.int32)
    flags[0:3 * g:3] = 3
    lr.resident_lora(base, torch.tensor(table, dtype=torch.int64), flags, torch.zeros(g, lr.MP, 64), g, m, rank, 1, cap=8)
    res.append({"flags": flags.tolist(), "untouched": all(bool(o.isnan().all()) for o in outs)})
    # expand=False (the GEMV expands, engine.LORA_RESIDENT_EXPAND): only the shrink sums, unscaled, and the arrival
    lr.WORK = True
    rows_ = [r[:-(lr.FIELDS - 14)] + [0] * (lr.FIELDS - 14) for r in table]  # field 14 (expand) = 0
    flags = torch.zeros(3 * g + 2, dtype=torch.int32)
    flags[0:3 * g:3] = 3
    xa = torch.full((g, lr.MP, 64), 0.0)
    lr.resident_lora(base, torch.tensor(rows_, dtype=torch.int64), flags, xa, g, m, rank, 1, cap=8)
    sums = [float((xa[i, :m, :a.shape[0]] - x @ a.t()).abs().max() / (x @ a.t()).abs().max())
            for i, (x, a) in enumerate(zip(keep_x, keep_a))]
    res.append({"errs": sums, "flags": flags.tolist(), "untouched": all(bool(o.isnan().all()) for o in outs),
                "rest_zero": all(bool((xa[i, m:] == 0).all() and (xa[i, :, a.shape[0]:] == 0).all())
                                 for i, a in enumerate(keep_a))})
    print("RESULTS" + json.dumps(res))
    """
)


@pytest.mark.parametrize("seed", [0, 1])
def test_resident_kernel_under_interpreter(seed):
    done, short, wide, idle, sums = run_interpreted(_SCRIPT, seed)
    # expand=False: the shrink's sums (unscaled, also for the folded norm's input) in xa and nothing past M / rt,
    # the arrival counted, no delta written and no output count
    assert max(sums["errs"]) <= 1e-6 and sums["rest_zero"] and sums["untouched"], sums
    assert sums["flags"] == [3, 1, 0] * 3 + [0, 1], sums
    assert idle["flags"] == [3, 1, 1] * 3 + [0, 1] and idle["untouched"], idle  # waits only: counted, nothing written
    assert max(wide["errs"]) <= 1e-6 and wide["flags"] == [3, 1, 1] * 3 + [0, 1], wide  # BK 128, two stages
    assert max(done["errs"]) <= 1e-6, done  # float32: the kernel's sums against torch's
    assert max(done["errs_ops"]) <= 1e-6, done  # the reference is lora_ops' product
    # per group: input count as set, one arrival, one output count (one program); no wait gave up
    assert done["flags"] == [3, 1, 1] * 3 + [0, 1], done  # ... no wait gave up, the one program counted in
    assert done["untouched"]  # rows past M are not written
    assert short["flags"][-2] == 1 and short["flags"][3:6] == [2, 1, 1], short  # counted, and it went on
    assert max(short["errs"]) <= 1e-6  # (the input was there: only the count was short)


def test_table_row_refuses_what_the_kernel_cannot_take(monkeypatch):
    monkeypatch.setattr(lora_resident, "BN", 64)
    base = torch.zeros(4, dtype=torch.bfloat16)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    a = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 64"):
        lora_resident.table_row(base, x, a, torch.zeros(96, 16, dtype=torch.bfloat16),
                                torch.zeros(16, 96, dtype=torch.bfloat16), (96, 96), 1)
    with pytest.raises(ValueError, match="K 96 of 64"):
        lora_resident.table_row(base, torch.zeros(2, 96, dtype=torch.bfloat16), torch.zeros(16, 96, dtype=torch.bfloat16),
                                torch.zeros(64, 16, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16),
                                (64, 64), 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        lora_resident.table_row(base, torch.zeros(2, 68, dtype=torch.bfloat16)[:, 4:], a,
                                torch.zeros(64, 16, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16),
                                (64, 64), 1)
    with pytest.raises(ValueError, match="table's base"):
        lora_resident.table_row(base, x.float(), a, torch.zeros(64, 16, dtype=torch.bfloat16),
                                torch.zeros(16, 64, dtype=torch.bfloat16), (64, 64), 1)
    row = lora_resident.table_row(base, x, a, torch.zeros(64, 16, dtype=torch.bfloat16),
                                  torch.zeros(16, 64, dtype=torch.bfloat16), (64, 64), 7)
    assert len(row) == lora_resident.FIELDS and row[4:11] == [64, 64, 64, 64, 16, 64, 7] and row[14] == 1
    row = lora_resident.table_row(base, x, a, torch.zeros(64, 16, dtype=torch.bfloat16),
                                  torch.zeros(16, 64, dtype=torch.bfloat16), (64, 64), 7, expand=False)
    assert len(row) == lora_resident.FIELDS and row[14] == 0  # the GEMV expands
    with pytest.raises(ValueError, match="ranks 16"):
        lora_resident.resident_lora(base, torch.zeros(1, 16, dtype=torch.int64), torch.zeros(4, dtype=torch.int32),
                                    torch.zeros(1, 16, 64), 1, 2, 8, 1)
