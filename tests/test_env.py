import os

import pytest

from qerl.env import env_int


def test_env_int_reads_defaults_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv("QERL_TEST_KNOB", raising=False)
    assert env_int("QERL_TEST_KNOB", 7) == 7 and env_int("QERL_TEST_KNOB", None) is None
    monkeypatch.setenv("QERL_TEST_KNOB", "")
    assert env_int("QERL_TEST_KNOB", 7) == 7
    monkeypatch.setenv("QERL_TEST_KNOB", " 12 ")
    assert env_int("QERL_TEST_KNOB", 7) == 12
    monkeypatch.setenv("QERL_TEST_KNOB", "0")
    assert env_int("QERL_TEST_KNOB", 7) == 0
    monkeypatch.setenv("QERL_TEST_KNOB", "2e7")
    with pytest.raises(ValueError, match=r"^QERL_TEST_KNOB='2e7': expected an integer") as err:
        env_int("QERL_TEST_KNOB", 7)
    assert "\n" not in str(err.value)


def test_a_bad_kernel_switch_fails_at_import_naming_it():
    import os
    import subprocess
    import sys

    env = dict(os.environ, QERL_W4A16_RWG_MIN_M="seventeen")
    out = subprocess.run([sys.executable, "-c", "import qerl.kernels.w4a16_triton"], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: QERL_W4A16_RWG_MIN_M='seventeen': expected an integer (unset it for the default, 17)")


def test_switches_prefix_lists_the_set_qerl_switches_sorted_and_leaves_paths_out(monkeypatch):
    from qerl.env import switches_prefix

    for k in [k for k in os.environ if k.startswith("QERL_")]:
        monkeypatch.delenv(k)
    assert switches_prefix() == ""
    monkeypatch.setenv("QERL_ROLLOUT_PDL", "0")
    monkeypatch.setenv("QERL_FUSED_ROPE", "1")
    monkeypatch.setenv("QERL_DATA_DIR", "/data")
    monkeypatch.setenv("OTHER", "x")
    assert switches_prefix() == "QERL_FUSED_ROPE=1 QERL_ROLLOUT_PDL=0 "


def test_runs_are_tagged_with_the_word_order_and_the_set_switches(monkeypatch):
    """Every MLflow run's tags (tracking.base_tags) name the nvfp4 word-order setting and the QERL_* switches set,
    so an ablation over kernel settings (e.g. QERL_W4A16_ORDER=rows against the default) is filterable."""
    from qerl.tracking import kernel_tags

    for k in [k for k in os.environ if k.startswith("QERL_")]:
        monkeypatch.delenv(k)
    assert kernel_tags() == {"w4a16_order": "auto"}  # layout.DEFAULT_ORDER
    monkeypatch.setenv("QERL_W4A16_ORDER", "rows")
    monkeypatch.setenv("QERL_FUSED_ROPE", "0")
    monkeypatch.setenv("QERL_DATA_DIR", "/data")
    assert kernel_tags() == {"w4a16_order": "rows", "switch.QERL_FUSED_ROPE": "0", "switch.QERL_W4A16_ORDER": "rows"}


def test_gluon_formats_switch_reads_a_list_and_refuses_an_unknown_format():
    """QERL_W4A16_WSMMA_FORMATS: the formats w4a16_triton routes to the Gluon GEMV (default both, since
    mxfp4 was timed there in session 44; a list narrows it), read at import; an unknown name stops the import with one line naming it."""
    import subprocess
    import sys

    show = "import qerl.kernels.w4a16_triton as W; print(','.join(W.WSMMA_FORMATS))"
    base = {k: v for k, v in os.environ.items() if k != "QERL_W4A16_WSMMA_FORMATS"}
    for value, want in ((None, "nvfp4,mxfp4"), ("nvfp4, mxfp4", "nvfp4,mxfp4"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"),
                        ("", "nvfp4,mxfp4")):
        env = base if value is None else dict(base, QERL_W4A16_WSMMA_FORMATS=value)
        out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == want, (value, out.stderr[-300:])
    out = subprocess.run([sys.executable, "-c", show], env=dict(base, QERL_W4A16_WSMMA_FORMATS="nvfp4,nf4"),
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "ValueError: QERL_W4A16_WSMMA_FORMATS='nvfp4,nf4': expected a comma list of nvfp4, mxfp4 (unset it for the "
        "default, nvfp4,mxfp4)")
