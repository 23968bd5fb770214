"""The rollout ablation tool's CPU-side logic (benchmarks/ablate_rollout.py): variant flags that
set kernel configs per layer kind, and the per-program clock summary of `--stamp` (the GPU writes
the clocks; here a synthetic buffer stands in for one replay)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from qerl.kernels import w4a16_gluon, w4a16_triton

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ablate():
    bench = os.path.join(HERE, "..", "benchmarks")
    spec = importlib.util.spec_from_file_location("ablate_rollout", os.path.join(bench, "ablate_rollout.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, bench)  # the script imports its sibling scripts
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(bench)
    return mod


class _Engine:
    """What variant_of touches on an engine."""

    def __init__(self):
        self._graphs, self._pool, self._lora_buffers, self._side = {"x": 1}, object(), {"y": 2}, "side"

    def _linear(self, group, x, kind):  # the class method variant_of restores
        return None


class _Group:
    def base_forward(self, x):
        return dict(w4a16_gluon.DEFAULT)


def test_rwg_three_per_sm_flags_apply_and_restore(ablate):
    """norwg3 turns the three-per-SM rwg form off, rwg3all routes every 17..32-token rwg launch to it,
    rwg3b32 33..64-token ones too (as 32-token tiles); larger launches and the defaults after the
    variant are untouched."""
    engine = _Engine()
    form, route = dict(w4a16_triton.RWG_THREE_PER_SM), w4a16_triton._rwg_config
    three = {"R": 1, **form}
    wide, narrow = (27648, 5120), (7168, 5120)  # 432 / 112 row tiles of 64 on 132 SMs
    assert route(*wide, 32, 132) == three and route(*narrow, 32, 132) != three
    with ablate.variant_of(engine, "base@norwg3"):
        assert w4a16_triton._rwg_config(*wide, 32, 132) == {"R": 1, **w4a16_triton.RWG_TWO_PER_SM[32]}
    with ablate.variant_of(engine, "base@rwg3all"):
        assert w4a16_triton._rwg_config(*narrow, 17, 132) == three
        assert w4a16_triton._rwg_config(*wide, 64, 132) == route(*wide, 64, 132)
        assert w4a16_triton._rwg_config(*wide, 100, 132) == route(*wide, 100, 132)
    with ablate.variant_of(engine, "base@rwg3b32"):
        assert w4a16_triton._rwg_config(*narrow, 32, 132) == three
        assert w4a16_triton._rwg_config(*wide, 64, 132) == dict(three, BM=32)
        assert w4a16_triton._rwg_config(*wide, 65, 132) == route(*wide, 65, 132)
    assert w4a16_triton.RWG_THREE_PER_SM == form and w4a16_triton._rwg_config is route
    with ablate.variant_of(engine, "base@rwg2n"):  # the narrow layers' two-per-SM form; wide and > 64 tokens as before
        assert w4a16_triton._rwg_config(*narrow, 32, 132) == {"R": 1, **w4a16_triton.RWG_TWO_PER_SM[32]}
        assert w4a16_triton._rwg_config(3584, 3584, 64, 132) == {"R": 1, **w4a16_triton.RWG_TWO_PER_SM[64]}
        assert w4a16_triton._rwg_config(*wide, 32, 132) == three
        assert w4a16_triton._rwg_config(*narrow, 100, 132) == route(*narrow, 100, 132)
    assert w4a16_triton._rwg_config is route
    with ablate.variant_of(engine, "base@nodec"):  # every nvfp4 rwg launch on its own tiles without the decode
        for shape, m in ((narrow, 32), (wide, 64), (narrow, 100)):
            assert w4a16_triton._rwg_config(*shape, m, 132) == dict(route(*shape, m, 132), DIAG=1)
        assert w4a16_triton._rwg_config(*wide, 32, 132, "mxfp4") == route(*wide, 32, 132, "mxfp4")
    assert w4a16_triton._rwg_config is route
    with ablate.variant_of(engine, "base@frag"):  # the same tiles on fragment-ordered words
        assert w4a16_triton._rwg_config(*wide, 64, 132) == dict(route(*wide, 64, 132), FRAG=1)
        assert w4a16_triton._rwg_config(*wide, 32, 132, "mxfp4") == route(*wide, 32, 132, "mxfp4")
    assert w4a16_triton._rwg_config is route


def test_rwg_kp_flags_apply_and_restore(ablate):
    """kp turns rwg's KP form on where its rule says (the default since session 42), nokp off, kpall routes every
    layer whose 64-row tiles fit one wave to it (2048^2: two-step slices, no KP by the rule); the wide layers and the
    defaults after the variant are untouched."""
    engine = _Engine()
    form, rule = dict(w4a16_triton.RWG_KP), w4a16_triton._rwg_kp_wins
    kp = {"R": 1, **w4a16_triton.RWG_KP_FORM}
    route = w4a16_triton._rwg_config
    assert form == w4a16_triton.RWG_KP_FORM and route(7168, 5120, 32, 132) == kp
    with ablate.variant_of(engine, "base@kp"):
        assert w4a16_triton._rwg_config(7168, 5120, 32, 132) == kp
        assert w4a16_triton._rwg_config(2048, 2048, 32, 132) == {"R": 1}
    with ablate.variant_of(engine, "base@nokp"):
        assert w4a16_triton._rwg_config(7168, 5120, 32, 132) == {"R": 1}
    with ablate.variant_of(engine, "base@kpall"):
        assert w4a16_triton._rwg_config(2048, 2048, 32, 132) == kp
        assert w4a16_triton._rwg_config(5120, 13824, 64, 132) == kp
        assert w4a16_triton._rwg_config(27648, 5120, 32, 132) == route(27648, 5120, 32, 132)
    assert w4a16_triton.RWG_KP == form and w4a16_triton._rwg_kp_wins is rule


def test_rwg_wave_split_flag_and_rule(ablate):
    """wsplit turns RWG_WAVE_SPLIT on (off by default): a wide layer's form gets S = 2 where two K halves fill
    the last wave of its slots (3 or 2 programs per SM x 132 SMs) better by >= 0.1 and each half keeps >= 4
    steps; the narrow layers' routes are untouched, and the default comes back after the variant."""
    engine = _Engine()
    route = w4a16_triton._rwg_config
    assert w4a16_triton.RWG_WAVE_SPLIT == 0 and "S" not in route(37888, 3584, 32, 132)
    with ablate.variant_of(engine, "base@wsplit"):
        # 592 tiles on 396 slots: 0.75 of the two waves filled; split, 1184 on 3 waves: 0.997
        assert route(37888, 3584, 32, 132) == {"R": 1, **w4a16_triton.RWG_THREE_PER_SM, "S": 2}
        # 432 tiles: 0.545 at three per SM -> 0.727 split; at two per SM (264 slots) 0.818 either way
        assert route(27648, 5120, 32, 132)["S"] == 2 and "S" not in route(27648, 5120, 64, 132)
        # 344 tiles: one wave of 396 either way at three per SM; at two per SM 0.65 -> 0.87 with 4-step halves
        assert "S" not in route(22016, 2048, 32, 132) and route(22016, 2048, 17, 132)["S"] == 2
        assert "S" not in route(22016, 1024, 17, 132)  # halves of 2 steps: too short
        assert route(7168, 5120, 32, 132) == {"R": 1, **w4a16_triton.RWG_KP_FORM}  # fits one wave: KP, no split
    assert w4a16_triton.RWG_WAVE_SPLIT == 0 and route(37888, 3584, 32, 132) == {"R": 1, **w4a16_triton.RWG_THREE_PER_SM}


def test_gluon44_flag_restores_the_old_thresholds(ablate):
    """gluon44 puts the Gluon GEMV's thresholds back to those before session 45 (M = 1 from 60M weights, 20M in
    the decode chain; 2..8 tokens standalone only on N >= 16384 and K >= 4096) and the defaults come back."""
    names = ("WSMMA_MIN_NK", "WSMMA_MIN_NK_PDL", "WSMMA_TOKENS_MIN_N", "WSMMA_TOKENS_MIN_K")
    before = [getattr(w4a16_triton, n) for n in names]
    assert before == [8_000_000, 8_000_000, 1, 0]
    with ablate.variant_of(_Engine(), "base@gluon44"):
        assert [getattr(w4a16_triton, n) for n in names] == [60_000_000, 20_000_000, 16384, 4096]
    assert [getattr(w4a16_triton, n) for n in names] == before


def test_gluon_flags_apply_per_kind_and_restore(ablate):
    before = dict(w4a16_gluon.DEFAULT)
    engine = _Engine()
    with ablate.variant_of(engine, "base@g:qkv+o:p2s6@g:down:p4s3w8k2x"):
        seen = {kind: engine._linear(_Group(), None, kind)[0] for kind in ablate.KINDS}
        assert engine._graphs == {} and engine._pool is None  # graphs re-captured for the variant
    assert seen["qkv"]["PER_SM"] == 2 and seen["qkv"]["NUM_STAGES"] == 6 and seen["o"] == seen["qkv"]
    assert seen["down"]["num_warps"] == 8 and seen["down"]["S"] == 2 and seen["down"]["XPF"] is True
    assert seen["gate_up"] == before  # kinds not named keep the defaults
    assert w4a16_gluon.DEFAULT == before and engine._side == "side"
    with ablate.variant_of(engine, "base@xpf@nohoist"):
        assert w4a16_gluon.DEFAULT["XPF"] is True and w4a16_gluon.HOIST_CONSTS is False
    assert w4a16_gluon.DEFAULT == before and w4a16_gluon.HOIST_CONSTS is True
    with ablate.variant_of(engine, "base@nocl@g:o:p2s6@cl:o+down"):
        seen = {kind: engine._linear(_Group(), None, kind)[0] for kind in ablate.KINDS}
        assert w4a16_gluon.CLUSTER_FIXUP is False
    assert seen["o"]["CLUSTER"] is True and seen["o"]["PER_SM"] == 2 and seen["down"]["CLUSTER"] is True
    assert seen["qkv"]["CLUSTER"] is None and seen["gate_up"] == before
    assert w4a16_gluon.DEFAULT == before and w4a16_gluon.CLUSTER_FIXUP is None
    for bad in ("base@g:qkv:x2", "base@g:attn:p2s6", "base@nosuchflag", "base@cl:attn"):
        with pytest.raises(SystemExit):
            with ablate.variant_of(_Engine(), bad):
                pass


def test_rwg9_per_kind_flag(ablate):
    """r9:KIND+KIND routes 9..16-token products to rwg (RWG_MIN_M = 9) only while those kinds' linears run; the
    other kinds and the default afterwards keep RWG_MIN_M = 17; an unknown kind is refused."""
    class Group:
        def base_forward(self, x):
            return w4a16_triton.RWG_MIN_M

    before = w4a16_triton.RWG_MIN_M
    engine = _Engine()
    with ablate.variant_of(engine, "base@r9:qkv+o+down"):
        seen = {kind: engine._linear(Group(), None, kind)[0] for kind in ablate.KINDS}
        assert w4a16_triton.RWG_MIN_M == before
    assert seen == {"qkv": 9, "o": 9, "gate_up": before, "down": 9} and before == 17
    assert w4a16_triton.RWG_MIN_M == before
    with pytest.raises(SystemExit):
        with ablate.variant_of(_Engine(), "base@r9:attn"):
            pass


def test_timeline_lines_sum_the_streams(ablate):
    """A replayed graph puts each LoRA branch on a stream of its own: the printed summary sums busy time and
    critical-path adds per kernel over every stream ("side: " prefixes merged), largest first."""
    tl = {"span_us": 100.0, "streams": {
        "main": {"kernels": 3, "busy_us": 60.0, "by_kernel_us": {"gemm": [2, 50.0], "norm": [1, 10.0]},
                 "adds_us": {"gemm": [2, 40.0], "side: shrink": [2, 30.0], "norm": [1, 5.0]}},
        "side7": {"kernels": 1, "busy_us": 20.0, "by_kernel_us": {"shrink": [1, 20.0]}},
        "side8": {"kernels": 2, "busy_us": 45.0, "by_kernel_us": {"shrink": [1, 25.0], "gemm": [1, 20.0]}}}}
    head, busy, adds = ablate.timeline_lines(tl, "t")
    assert head == "  t: span 100.0 us, 6 kernels on 3 streams"
    assert busy == "    busy us: gemm 3x 70, shrink 2x 45, norm 1x 10"
    assert adds == "    critical-path adds us: gemm 2x 40, shrink 2x 30, norm 1x 5"


def test_stamp_slices_and_summary(ablate, monkeypatch):
    monkeypatch.setattr(w4a16_triton, "STAMP", {"buf": torch.empty(64, dtype=torch.int64), "used": 0, "calls": []})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    assert w4a16_triton.stamp_slice(4, 128, 256, 2, 1, "gluon").numel() == 64
    assert w4a16_triton.stamp_slice(2, 64, 256, 1, 8, "fused").numel() == 32
    with pytest.raises(RuntimeError, match="full"):
        w4a16_triton.stamp_slice(3, 64, 256, 1, 8, "fused")
    buf = w4a16_triton.STAMP["buf"]

    class Replay:  # one graph replay: what the kernels would write (clock64 at 1000 MHz = 1 cycle per ns)
        def replay(self):
            for p in range(4):  # gluon: start, past the wait, loop done, end, smid, gtimer start / end, producer
                buf[p * 8:(p + 1) * 8] = torch.tensor([0, 2000, 5000, 6000 + 1000 * p, p % 2, 100 * p, 6000 + 1000 * p,
                                                       1000])
            for p in range(2):
                buf[32 + p * 8:32 + (p + 1) * 8] = torch.tensor([0, 1000, 3000, 4000, p, 0, 4000, -1])

    out = ablate.stamp_summary(Replay(), 1000.0)
    g = out["gluon 128x256 M1 S2 grid4"]
    assert g["layers"] == 1 and g["sms"] == 2 and g["programs_per_sm_max"] == 2
    assert g["start_last"] == pytest.approx(0.3) and g["wait_last"] == pytest.approx(2.3)
    assert g["loop_median"] == pytest.approx(3.0) and g["epilogue_max"] == pytest.approx(4.0)
    assert g["end"] == pytest.approx(9.0) and g["after_last_wait"] == pytest.approx(6.7)
    assert g["producer_done_vs_wait_median"] == pytest.approx(-1.0)  # the last copy issued before the wait
    f = out["fused 64x256 M8 S1 grid2"]
    assert f["loop_median"] == pytest.approx(2.0) and f["producer_done_vs_wait_max"] == 0.0


def test_lora_flags_restore(ablate):
    from qerl.kernels import lora_ops
    from qerl.rollout import engine as engine_mod

    engine = _Engine()
    before = (engine_mod.LORA_GEMV_PER_SM, lora_ops.FUSED, dict(engine_mod.LORA_GEMV_PER_SM_KIND))
    with ablate.variant_of(engine, "lora@lsm2@lora1k"):
        assert engine_mod.LORA_GEMV_PER_SM == 2 and lora_ops.FUSED is True
    with ablate.variant_of(engine, "lora@sprold"):
        assert lora_ops.shrink_splits(5120, 64) == lora_ops.shrink_splits(5120) == (128, 40)
    with ablate.variant_of(engine, "lora@sp1024"):
        assert lora_ops.shrink_splits(5120, 32) == (256, 20) and lora_ops.shrink_splits(5120, 64) == (512, 10)
    assert lora_ops.shrink_splits(5120, 64) == (1024, 5)
    with ablate.variant_of(engine, "lora@lsmk:qkv+o=2@lsmk:down=4"):
        assert engine_mod.LORA_GEMV_PER_SM_KIND == {"qkv": 2, "o": 2, "down": 4}
    assert (engine_mod.LORA_GEMV_PER_SM, lora_ops.FUSED, engine_mod.LORA_GEMV_PER_SM_KIND) == before
    with pytest.raises(SystemExit):
        with ablate.variant_of(engine, "lora@lsmk:attn=2"):
            pass


def test_base_variant_turns_the_adapters_off(ablate):
    """`base` on a model with adapters runs with them disabled (the real no-LoRA step, NORM_FOLD and GLU
    included); `lora` keeps them; both leave them as they were."""
    import contextlib

    state = []

    class _Peft:
        @contextlib.contextmanager
        def disable_adapter(self):
            state.append("off")
            try:
                yield
            finally:
                state.append("on")

    engine = _Engine()
    engine.model = _Peft()
    with ablate.variant_of(engine, "base"):
        assert state == ["off"]
    assert state == ["off", "on"]
    with ablate.variant_of(engine, "lora"):
        assert state == ["off", "on"]


def test_lora_gemv_per_sm_kind_parses_and_refuses_typos():
    from qerl.rollout import engine as engine_mod

    assert engine_mod._kind_values("qkv=2, o=2,,down=0") == {"qkv": 2, "o": 2, "down": 0}
    assert engine_mod._kind_values("") == {}
    for bad in ("qvk=2", "gate=2", "o", "o=", "o=two", "o=-1"):
        with pytest.raises(ValueError, match="QERL_LORA_GEMV_PER_SM_KIND: bad item") as err:
            engine_mod._kind_values(bad)
        assert "\n" not in str(err.value) and "gate_up" in str(err.value)


def test_lora_gemv_plan_applies_per_sm_inside_only(monkeypatch):
    """The LoRA groups' Gluon GEMV plan: 2 programs per SM below 96M hidden x intermediate size (7B,
    14B), 3 from it (32B), one value for all with LORA_GEMV_PER_SM, none at 0; only inside the block."""
    from types import SimpleNamespace

    from qerl.rollout import engine as engine_mod

    def model(hidden, intermediate):
        return SimpleNamespace(config=SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate))

    before = dict(w4a16_gluon.DEFAULT)
    for hidden, intermediate, per_sm in ((3584, 18944, 2), (5120, 13824, 2), (5120, 27648, 3), (8192, 29568, 3)):
        with engine_mod.RolloutEngine._lora_gemv_plan(model(hidden, intermediate)):
            assert w4a16_gluon.DEFAULT["PER_SM"] == per_sm
            assert w4a16_gluon.DEFAULT["STREAMK"] is False  # LoRA groups keep the split tail (no stream-K)
            assert {k: v for k, v in w4a16_gluon.DEFAULT.items() if k not in ("PER_SM", "STREAMK")} == {
                k: v for k, v in before.items() if k != "PER_SM"}
        assert w4a16_gluon.DEFAULT == before
    monkeypatch.setattr(engine_mod, "LORA_GEMV_PER_SM", 4)
    assert engine_mod.lora_gemv_per_sm(3584, 18944) == engine_mod.lora_gemv_per_sm(5120, 27648) == 4
    monkeypatch.setattr(engine_mod, "LORA_GEMV_PER_SM_KIND", {"o": 1})
    assert engine_mod.lora_gemv_per_sm(5120, 27648, "o") == 1 and engine_mod.lora_gemv_per_sm(5120, 27648, "qkv") == 4
    with engine_mod.RolloutEngine._lora_gemv_plan(model(5120, 27648), "o"):
        assert w4a16_gluon.DEFAULT["PER_SM"] == 1
    monkeypatch.setattr(engine_mod, "LORA_GEMV_PER_SM_KIND", {})
    monkeypatch.setattr(engine_mod, "LORA_GEMV_PER_SM", 0)
    with engine_mod.RolloutEngine._lora_gemv_plan(model(3584, 18944)):
        assert w4a16_gluon.DEFAULT == before
    with pytest.raises(RuntimeError), w4a16_gluon.defaults(PER_SM=2):
        raise RuntimeError  # restored on the way out of a failed launch too
    assert w4a16_gluon.DEFAULT == before


@pytest.fixture(scope="module")
def probe():
    bench = os.path.join(HERE, "..", "benchmarks")
    spec = importlib.util.spec_from_file_location("probe_attention", os.path.join(bench, "probe_attention.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, bench)  # it times with bench_w4a16's time_per_call, counts registers with compile_gluon's
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(bench)


def test_attention_probe_candidates_and_copies(probe):
    """probe_attention.py: a typo in a setting name stops with one line naming the known ones; enough
    cache copies that a pass overruns the L2 four times, at least two, bounded by the byte cap."""
    assert probe.parse_cands('[["w8", {"ATTN_WARPS": 8}], ["d", null]]') == [("w8", {"ATTN_WARPS": 8}), ("d", {})]
    with pytest.raises(SystemExit, match="ATTN_WARP.*known: ATTN_PROGRAMS"):
        probe.parse_cands('[["typo", {"ATTN_WARP": 8}]]')
    assert probe.kv_bytes(32, 4, 1280) == 32 * 4 * 1280 * 128 * 4
    l2 = 60 << 20
    assert probe.copies_for(32, 4, 1280, l2) == 3  # 84 MB each: 3 x 84 >= 4 x 63
    assert probe.copies_for(8, 4, 512, l2) * probe.kv_bytes(8, 4, 512) >= 4 * l2
    assert probe.copies_for(64, 8, 4096, l2) == 2
    assert probe.copies_for(8, 4, 512, l2, cap_bytes=probe.kv_bytes(8, 4, 512) * 5) == 5
    for name in probe.SETTINGS:
        assert hasattr(__import__("qerl.kernels.decode_ops", fromlist=["x"]), name)


def test_attention_slot_first_build_holds_more_programs_per_sm(probe):
    """Offline sm_90 builds of the decode attention (no GPU): the slot-first form at two stages (the default)
    takes less shared memory and fewer registers than the select form at Triton's three, so more of its
    programs fit an SM (the reason it reads K / V faster, NOTES_rollout.md section 42); its loads are
    cp.async copies either way; a register cap is honoured (the switch the probe offers)."""
    pytest.importorskip("triton")
    old = probe.compile_stats("qwen2.5-7b", 32, 1280, {"ATTN_SLOT_FIRST": False, "ATTN_STAGES": None,
                                                      "ATTN_MAXNREG": None})
    uncapped = probe.compile_stats("qwen2.5-7b", 32, 1280, {"ATTN_MAXNREG": None})
    new = probe.compile_stats("qwen2.5-7b", 32, 1280, {})
    assert uncapped["smem_bytes"] < old["smem_bytes"] and uncapped["regs"] < old["regs"]
    assert uncapped["per_sm"] > old["per_sm"] >= 1
    assert old["cp_async"] > 0 and uncapped["cp_async"] > 0
    # the default caps the 64-key-block plans at 128 registers: 4 programs per SM, at most 16 B of stack
    assert new["regs"] <= 128 and new["stack_bytes"] <= 16 and new["per_sm"] == 4 > uncapped["per_sm"]
    assert new["programs"] == 512 and new["blocks_per_program"] == 5
    short = probe.compile_stats("qwen2.5-14b", 8, 512, {})  # the prefetch path stays uncapped: no stack
    assert short["block"] == 32 and short["regs"] > 128 and short["stack_bytes"] == 0
    one = probe.compile_stats("qwen2.5-7b", 1, 1280, {})  # batch 1's 32-key blocks: uncapped, 7 per SM
    assert one["block"] == 32 and one["regs"] < 96 and one["per_sm"] > 4
    eight = probe.compile_stats("qwen2.5-7b", 8, 1280, {})  # 224 programs fit one wave at 3 per SM: uncapped
    assert eight["block"] == 64 and eight["programs"] == 224 and eight["regs"] > 128
    plain = probe.compile_stats("qwen2.5-7b", 32, 2048, {"ATTN_ROPE": False})  # without RoPE: uncapped, 5 per SM
    assert plain["regs"] < 100 and plain["per_sm"] == 5


def test_attention_flags_apply_and_restore(ablate):
    """The attention switches of session 47 (oldslot, ast*, anr*, aw8) set decode_ops for one variant and
    put the defaults back; the launch options follow them."""
    from qerl.kernels import decode_ops

    engine = _Engine()
    before = (decode_ops.ATTN_SLOT_FIRST, decode_ops.ATTN_STAGES, decode_ops.ATTN_MAXNREG, decode_ops.ATTN_WARPS)
    assert decode_ops.attention_launch_options() == {"num_stages": 2, "maxnreg": 128}
    assert decode_ops.attention_launch_options(decode_ops.ATTN_BLOCK, prefetch=True) == {"num_stages": 2}
    assert decode_ops.attention_launch_options(decode_ops.ATTN_BLOCK_SMALL) == {"num_stages": 2}
    # one wave at 3 programs per SM holds the launch: no cap (7B 8 rows x 1280 keys: 224 programs)
    assert decode_ops.attention_launch_options(decode_ops.ATTN_BLOCK, programs=396) == {"num_stages": 2}
    assert decode_ops.attention_launch_options(decode_ops.ATTN_BLOCK, programs=397)["maxnreg"] == 128
    assert decode_ops.attention_launch_options(decode_ops.ATTN_BLOCK, programs=200, sms=66)["maxnreg"] == 128
    assert decode_ops.attention_launch_options(decode_ops.ATTN_BLOCK, rope=False) == {"num_stages": 2}
    with ablate.variant_of(engine, "base@oldslot@ast3@anr96@aw8"):
        assert (decode_ops.ATTN_SLOT_FIRST, decode_ops.ATTN_STAGES, decode_ops.ATTN_MAXNREG,
                decode_ops.ATTN_WARPS) == (False, 3, 96, 8)
        assert decode_ops.attention_launch_options() == {"num_stages": 3, "maxnreg": 96}
    with ablate.variant_of(engine, "base@anr0"):
        assert decode_ops.ATTN_MAXNREG is None and decode_ops.attention_launch_options() == {"num_stages": 2}
    assert (decode_ops.ATTN_SLOT_FIRST, decode_ops.ATTN_STAGES, decode_ops.ATTN_MAXNREG, decode_ops.ATTN_WARPS) == before


def test_layer_intervals_name_each_gap_between_gemv_ends(ablate, tmp_path, capsys):
    """`layer_intervals` on a synthetic timeline of 3 layers: each layer's four Gluon GEMVs end 10, 20, 35
    and 40 us into a 50 us layer, LoRA expands end 2 us after q/k/v's and 1 us before the others';
    the intervals, the period and the expand offsets come back per group kind. A bf16 step (cuBLAS, no Gluon
    GEMVs) gives {}; `--intervals` prints them from a result file."""
    kernels, ends = [], (10.0, 20.0, 35.0, 40.0)
    for layer in range(3):
        for end, lag in zip(ends, (2.0, -1.0, -1.0, -1.0)):
            t = 50.0 * layer + end
            kernels += [["_gluon_gemv_kernel", "main", t - 6.0, 6.0], ["lora_expand_kernel", "side", t - 3.0, 3.0 + lag],
                        ["add_rms_norm_kernel", "main", t + 0.5, 1.0]]
    kernels.sort(key=lambda k: k[2])
    iv = ablate.layer_intervals(kernels)
    assert iv["layers"] == 3 and iv["layer_us"] == 50.0
    assert iv["intervals_us"] == {"qkv->o": 10.0, "o->gate_up": 15.0, "gate_up->down": 5.0, "down->qkv": 20.0}
    assert iv["expand_end_after_gemv_us"] == {"qkv": 2.0, "o": -1.0, "gate_up": -1.0, "down": -1.0}
    assert "shrink_end_after_gemv_us" not in iv  # no shrinks in this timeline
    assert ablate.layer_intervals([k for k in kernels if not k[0].startswith("_gluon")]) == {}
    last_gemv = max(i for i, k in enumerate(kernels) if k[0] == "_gluon_gemv_kernel")
    assert ablate.layer_intervals(kernels[:last_gemv] + kernels[last_gemv + 1:]) == {}  # 11 GEMVs: not 4 a layer
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"rows": [{"batch": 8, "variant": "lora", "timeline": {"span_us": 150.0, "kernels": kernels}},
                                         {"batch": 8, "variant": "base", "step_ms": 2.0}]}))
    ablate.print_intervals([str(path)])
    out = capsys.readouterr().out
    assert "batch 8, lora" in out and "o->gate_up 15.0" in out and "expand ends after its GEMV by: qkv 2.0" in out
    assert "base" not in out
    with pytest.raises(SystemExit, match="cannot read the rows"):
        ablate.print_intervals([str(tmp_path / "missing.json")])


def test_ldrop_forks_each_lora_group_once_per_step_and_restores(ablate, monkeypatch):
    """The `ldrop` timing bound on a small random Qwen2 with LoRA, on CPU with a stand-in side stream: every
    decode-step product of a group with adapters launches that group's real LoRA delta (4 groups x 2 layers a
    step, none in the prefill), the step joins the side stream once, the decode steps' logprobs lose the
    adapters (nothing reads the delta) while the prefill's keep them, and leaving the variant restores
    LinearGroup and the engine."""
    import contextlib as cl

    from transformers import AutoModelForCausalLM, Qwen2Config

    from qerl.nn.lora import LoraSettings, apply_lora
    from qerl.rl.rollout import RolloutSettings
    from qerl.rollout import fuse

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(cfg).eval(), LoraSettings(r=4, lora_alpha=8)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that move the rollout
    prompts = [[3, 5, 7], [11, 13]]
    settings = RolloutSettings(num_generations=1, max_new_tokens=5, temperature=1.0, stop_ids=[10**9], pad_id=0)

    def rollout(engine):
        with torch.inference_mode():
            return engine.generate(prompts, settings, torch.Generator().manual_seed(0)).logprobs

    engine = ablate.RolloutEngine(model, max_batch=2, max_len=32)
    with_lora = rollout(engine)
    with model.disable_adapter():
        without = rollout(engine)
    assert not torch.equal(with_lora, without)

    joins, launched = [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            joins.append((self.name, other.name))

    main = Stream("main")
    real_lora = fuse.LinearGroup.lora
    monkeypatch.setattr(fuse.LinearGroup, "lora", lambda self, x, ws=None: launched.append(id(self)) or real_lora(self, x, ws))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: cl.nullcontext())
    saved = {k: fuse.LinearGroup.__dict__[k] for k in ("has_lora", "base_forward", "res_forward", "glu_forward")}
    engine._side = Stream("side")
    with ablate.variant_of(engine, "ldrop"):
        assert not engine.layers[0].qkv.has_lora
        dropped = rollout(engine)
    groups = {id(g) for layer in engine.layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    steps = settings.max_new_tokens - 1  # the prefill samples the first token
    assert set(launched) == groups and len(launched) == steps * len(groups)
    assert joins.count(("main", "side")) == steps and joins.count(("side", "main")) == steps * len(groups)
    # the prefill keeps the adapters (its first token's logprobs), the decode steps drop their delta
    assert torch.equal(dropped[:, 0], with_lora[:, 0]) and not torch.equal(dropped[:, 0], without[:, 0])
    assert (dropped[:, 1:] - with_lora[:, 1:]).abs().max() > 1e-3
    assert {k: fuse.LinearGroup.__dict__[k] for k in saved} == saved and "_decode_logits" not in vars(engine)
    assert engine.layers[0].qkv.has_lora


def test_hold_flags_parse_fork_a_hold_stream_per_step_and_restore(ablate, monkeypatch):
    """hold:N:US forks a stream of its own at each decode step's start, launches N hold programs spinning US
    microseconds there and joins it at the step's end; sms:M plans the kernels' grids for M SMs; both are
    undone after the variant, and malformed forms are refused in one line."""
    import contextlib as cl

    assert ablate._hold_flags(["hold:8:1800", "sms:124", "x"], "v") == (8, 1800, 0, 124)
    assert ablate._hold_flags(["hold:8:1800:162"], "v") == (8, 1800, 162, 0)
    for bad in ("hold:8", "hold:0:100", "hold:8:0", "hold:8:9:x", "sms:0", "sms:x"):
        with pytest.raises(SystemExit, match="bad flag"):
            ablate._hold_flags([bad], "v")

    events = []

    class Stream:
        def __init__(self, name="hold"):
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    class Launcher:
        def __getitem__(self, grid):
            def launch(out, src, ns, words, rows, stream, block, unroll, num_warps):
                events.append(("hold", grid, ns, rows, tuple(out.shape), stream, words * grid[0] >= src.numel() // 2))
                assert words % (block * unroll) == 0 and src.numel() >= words * grid[0]

            return launch

    class Engine(_Engine):
        device = torch.device("cpu")

        def _decode_logits(self, rows, keys):
            events.append(("step", rows, keys))
            return "logits"

    main = Stream("main")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: cl.nullcontext())
    monkeypatch.setattr(ablate, "_hold_kernel", lambda: Launcher())
    engine, sms = Engine(), w4a16_triton._num_sms
    with ablate.variant_of(engine, "base@hold:8:1800@sms:124"):
        assert w4a16_triton._num_sms(0) == 124
        assert engine._decode_logits(16, 512) == "logits"
    assert events == [("wait", "hold", "main"), ("hold", (8,), 1_800_000, ablate.HOLD_WORDS // 128, (16,), False, False),
                      ("step", 16, 512), ("wait", "main", "hold")]
    with ablate.variant_of(engine, "base@hold:4:100:3"):  # 3 MiB read between 4 programs, whole unrolled reads
        events.clear()
        engine._decode_logits(8, 512)
        assert events[1][:6] == ("hold", (4,), 100_000, ablate.HOLD_WORDS // 128, (8,), True) and events[1][6]
        ablate.HELD["out"][1::2] = torch.tensor([1000, 2000, 1500, 1200], dtype=torch.int32)
        read = ablate.held_read()
        assert read["hold_read_us_max"] == 2.0 and read["hold_read_mib"] >= 3
        assert read["hold_read_gbps"] == round(ablate.HELD["bytes"] / 2000, 1)
    assert ablate.held_read() == {}
    assert w4a16_triton._num_sms is sms and "_decode_logits" not in vars(engine)
    with ablate.variant_of(engine, "base@sms:100"):  # sms alone holds nothing
        events.clear()
        engine._decode_logits(1, 512)
        assert events == [("step", 1, 512)] and w4a16_triton._num_sms(0) == 100
    with pytest.raises(SystemExit, match="bad flag"):
        with ablate.variant_of(engine, "base@hold:8"):
            pass


def test_lres_flags_set_the_resident_kernel_and_restore(ablate):
    """lres16 / lres:P:BK:BN:S:W turn engine.LORA_RESIDENT on with that many programs (and the kernel's tiles,
    stages and warps) for the variant only; malformed forms are refused in one line."""
    from qerl.kernels import lora_resident as lr
    from qerl.rollout import engine as engine_mod

    before = (engine_mod.LORA_RESIDENT, engine_mod.LORA_RESIDENT_PROGRAMS, lr.BK, lr.BN, lr.STAGES, lr.WARPS,
              lr.PREFETCH)
    engine = _Engine()
    with ablate.variant_of(engine, "lora@lres16"):
        assert (engine_mod.LORA_RESIDENT, engine_mod.LORA_RESIDENT_PROGRAMS) == (True, 16)
    with ablate.variant_of(engine, "lora@lres:24:128:256:3:8"):
        got = (engine_mod.LORA_RESIDENT, engine_mod.LORA_RESIDENT_PROGRAMS, lr.BK, lr.BN, lr.STAGES, lr.WARPS,
               lr.PREFETCH)
        assert got == (True, 24, 128, 256, 3, 8, False)
    with ablate.variant_of(engine, "lora@lres:16:64:128:2:4:p"):
        assert (lr.BN, lr.PREFETCH, lr.WORK) == (128, True, True)
    with ablate.variant_of(engine, "lora@lres:32:64:128:2:4:n"):
        assert (lr.PREFETCH, lr.WORK, lr.SLEEP) == (False, False, 0)
    with ablate.variant_of(engine, "lora@lres:32:64:128:2:4:p:s200"):
        assert (lr.PREFETCH, lr.WORK, lr.SLEEP) == (True, True, 200)
    with ablate.variant_of(engine, "lora@lres:8:64:128:2:4:n:c"):
        assert (lr.WORK, engine_mod.LORA_RESIDENT_WAIT, engine_mod.LORA_RESIDENT_KERNEL) == (False, False, True)
    with ablate.variant_of(engine, "lora@lres:8:64:128:2:4:n:x"):
        assert (engine_mod.LORA_RESIDENT_WAIT, engine_mod.LORA_RESIDENT_KERNEL) == (False, False)
        assert not engine_mod.LORA_RESIDENT_FUSED
    with ablate.variant_of(engine, "lora@lres:32:64:128:2:4:p:f"):
        assert (engine_mod.LORA_RESIDENT_FUSED, lr.PREFETCH, lr.WORK) == (True, True, True)
        assert w4a16_gluon.SYNC_NAP == 0
    with ablate.variant_of(engine, "lora@lres:32:64:128:2:4:p:s100:f:w200"):
        assert (engine_mod.LORA_RESIDENT_FUSED, lr.SLEEP, w4a16_gluon.SYNC_NAP) == (True, 100, 200)
        assert not engine_mod.LORA_RESIDENT_EXPAND
    with ablate.variant_of(engine, "lora@lres:32:256:512:2:8:p:f:e"):
        assert (engine_mod.LORA_RESIDENT_FUSED, engine_mod.LORA_RESIDENT_EXPAND, lr.BN) == (True, True, 512)
        assert not engine_mod.LORA_RESIDENT_RESERVE
    with ablate.variant_of(engine, "lora@lres:32:256:512:2:8:p:f:r:w100"):
        assert (engine_mod.LORA_RESIDENT_EXPAND, engine_mod.LORA_RESIDENT_RESERVE, w4a16_gluon.SYNC_NAP) == (False, True, 100)
    assert w4a16_gluon.SYNC_NAP == 0 and not engine_mod.LORA_RESIDENT_EXPAND and not engine_mod.LORA_RESIDENT_RESERVE
    assert lr.WORK and lr.SLEEP == 0 and engine_mod.LORA_RESIDENT_WAIT and engine_mod.LORA_RESIDENT_KERNEL
    assert not engine_mod.LORA_RESIDENT_FUSED
    assert (engine_mod.LORA_RESIDENT, engine_mod.LORA_RESIDENT_PROGRAMS, lr.BK, lr.BN, lr.STAGES, lr.WARPS,
            lr.PREFETCH) == before
    for bad in ("lres:8:64:64:1", "lres:8:48:64:1:4", "lres:8:64:8:1:4", "lres:0:64:64:1:4", "lres:8:64:64:0:4",
                "lres:8:64:64:1:3", "lres:8:64:64:1:4:q", "lres:8:64:64:1:4:s", "lres:8:64:64:1:4:f:w",
                "lres:8:64:64:1:4:e"):
        with pytest.raises(SystemExit, match="bad flag"):
            with ablate.variant_of(engine, f"lora@{bad}"):
                pass


def test_resident_stamp_summary_per_group_kind(ablate, monkeypatch):
    """--stamp with the resident LoRA kernel: lora_resident.stamp_times reads its clocks per group (first /
    last program's input seen, last sums, meet, delta out, SMs), and resident_stamp_summary turns them into
    per-kind medians (us) paired with the k-th stamped Gluon launch of the replay (launches of other graphs,
    left at -1, are skipped); without a resident state in the graph's entry it returns None."""
    from qerl.kernels import lora_resident
    from qerl.rollout import engine as engine_mod

    groups, programs, layers = 8, 3, 2  # two layers of qkv / o / gate_up / down
    stamps = torch.zeros(groups, programs, 8, dtype=torch.int64)
    gemv = []
    t = 0
    for g in range(groups):
        width = 1000 * (g % 4 + 1)  # each kind its own shape: shrink = width, meet = 500, expand = 2 * width
        for p in range(programs):
            stamps[g, p, 0] = t + 100 * p  # the last program sees the input 200 ns after the first
            stamps[g, p, 1] = t + width - 50 * p
            stamps[g, p, 2] = t + width + 500 - 10 * p
            stamps[g, p, 3] = t + 3 * width + 500 - p
            stamps[g, p, 4] = p % 2  # two SMs
        gemv.append((t - 300, t + 3 * width + 700))  # the GEMV starts 300 ns before the input, ends 200 after the delta
        t += 3 * width + 500 + 4000  # the next input 4 us after this delta
    times = lora_resident.stamp_times(stamps.view(-1), groups, programs)
    assert times[1] == {"in_first": 7500, "in_last": 7700, "sums": 9500, "met": 10000, "out": 14000, "sms": 2}

    calls, buf = [], torch.full((4096,), -1, dtype=torch.int64)
    calls.append((0, 2, 64, 64, 1, 8, "gluon"))  # a launch of another graph: never written
    for g, (start, end) in enumerate(gemv):
        off = 16 + g * 16
        a = buf[off:off + 16].view(2, 8)
        a.zero_()
        a[:, 5] = torch.tensor([start, start + 50])
        a[:, 6] = torch.tensor([end - 70, end])
        calls.append((off, 2, 64, 64, 1, 8, "gluon"))
    monkeypatch.setattr(w4a16_triton, "STAMP", {"buf": buf, "used": 0, "calls": calls})
    res = engine_mod._Resident.__new__(engine_mod._Resident)
    res.stamps, res.groups, res.programs = stamps.view(-1), groups, programs
    graph = object()
    engine = _Engine()
    engine._graphs = {512: (graph, None, res), 256: (object(), None, None)}
    out = ablate.resident_stamp_summary(engine, graph)
    assert out["paired_with_gemvs"] and out["programs"] == programs
    assert out["o"] == {"expand": 4.0, "gemv": 7.0, "gemv_end_after_out": 0.2, "in_to_out": 6.5, "meet": 0.5,
                        "out_after_gemv_start": 6.8, "shrink": 2.0, "wait": 4.0}
    assert out["qkv"]["shrink"] == 1.0 and out["qkv"]["wait"] == 4.0  # layer 0's first group has no wait
    assert len(out) == 3 + layers * 2  # programs, paired, step_us + the four kinds
    assert ablate.resident_stamp_summary(engine, engine._graphs[256][0]) is None
