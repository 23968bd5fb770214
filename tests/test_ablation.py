"""qerl.ablation: mean +- std per variant over seeds, AQN on - off per format paired by seed, the table and the
figure (the flow's end-to-end runs are tests/test_flow.py's and tests/test_deployment.py's)."""

from __future__ import annotations

import statistics

import pytest

from qerl.ablation import aggregate, aqn_effects, aqn_pairs, render_markdown, render_plot
from qerl.recipe import load_recipe

VARIANTS = ["lora-bf16", "lora-bf16-aqn", "qerl-nvfp4", "qerl-nvfp4-aqn", "qlora-nf4"]


def _recipe():
    return load_recipe("smoke", {"train.variants": VARIANTS, "formats": "bf16,nvfp4"})


def _per_seed():
    """Three seeds; seed 2's lora-bf16-aqn column failed (absent), seed 1's qerl-nvfp4 has no reward logged."""
    acc = {  # variant -> gsm8k accuracy by seed
        "base-bf16": [0.25, 0.25, 0.25], "base-nvfp4": [0.20, 0.20, 0.20],
        "lora-bf16": [0.50, 0.60, 0.55], "lora-bf16-aqn": [0.55, 0.70, None],
        "qerl-nvfp4": [0.40, 0.45, 0.30], "qerl-nvfp4-aqn": [0.50, 0.45, 0.60], "qlora-nf4": [0.1, 0.2, 0.3],
    }
    fmt = {"base-bf16": "bf16", "base-nvfp4": "nvfp4", "lora-bf16": "bf16", "lora-bf16-aqn": "bf16",
           "qerl-nvfp4": "nvfp4", "qerl-nvfp4-aqn": "nvfp4", "qlora-nf4": "nf4"}
    per_seed = {}
    for s in range(3):
        rows = {}
        for v, values in acc.items():
            if values[s] is None:
                continue
            row = {"format": fmt[v], "aqn": v.endswith("-aqn"), "gsm8k_accuracy": values[s], "gsm8k_entropy": 0.5 + s / 10}
            if not v.startswith("base-"):
                row["reward_last_fifth"] = None if (v, s) == ("qerl-nvfp4", 1) else values[s] / 2
            rows[v] = row
        per_seed[s] = rows
    return per_seed


def test_aqn_pairs_are_the_two_trained_variants_of_a_format():
    assert aqn_pairs(VARIANTS) == [("bf16", "lora-bf16", "lora-bf16-aqn"), ("nvfp4", "qerl-nvfp4", "qerl-nvfp4-aqn")]
    assert aqn_pairs(["qerl-nvfp4-aqn", "lora-mxfp4-aqn", "lora-mxfp4", "qlora-nf4"]) == [
        ("mxfp4", "lora-mxfp4", "lora-mxfp4-aqn")]
    assert aqn_pairs(["qerl-nvfp4"]) == []


def test_aggregate_means_and_sample_stds_over_the_seeds_that_ran():
    rows = {r["variant"]: r for r in aggregate(_recipe(), _per_seed())}
    assert list(rows) == ["base-bf16", "base-nvfp4", *VARIANTS]
    assert rows["lora-bf16-aqn"]["seeds"] == [0, 1] and rows["lora-bf16-aqn"]["aqn"]
    assert rows["lora-bf16-aqn"]["gsm8k_accuracy_mean"] == pytest.approx(0.625)
    assert rows["lora-bf16-aqn"]["gsm8k_accuracy_std"] == pytest.approx(statistics.stdev([0.55, 0.70]))
    assert rows["qerl-nvfp4"]["reward_last_fifth_values"] == pytest.approx([0.20, 0.15])  # seed 1 logged none
    assert rows["base-bf16"]["gsm8k_accuracy_std"] == 0.0 and "reward_last_fifth_mean" not in rows["base-bf16"]


def test_aqn_effect_is_the_per_seed_difference_over_seeds_that_ran_both():
    effects = {e["format"]: e for e in aqn_effects(_recipe(), _per_seed())}
    assert set(effects) == {"bf16", "nvfp4"}  # nf4 has no AQN variant in this recipe
    bf16, nvfp4 = effects["bf16"], effects["nvfp4"]
    assert (bf16["aqn_off"], bf16["aqn_on"]) == ("lora-bf16", "lora-bf16-aqn")
    assert bf16["gsm8k_accuracy_seeds"] == [0, 1]  # seed 2's AQN column failed: unpaired, left out
    assert bf16["gsm8k_accuracy_diffs"] == pytest.approx([0.05, 0.10])
    assert bf16["gsm8k_accuracy_diff_mean"] == pytest.approx(0.075)
    assert bf16["gsm8k_accuracy_diff_std"] == pytest.approx(statistics.stdev([0.05, 0.10]))
    # on - off (not off - on), seed by seed
    assert nvfp4["gsm8k_accuracy_diffs"] == pytest.approx([0.10, 0.0, 0.30])
    assert nvfp4["reward_last_fifth_seeds"] == [0, 2] and nvfp4["reward_last_fifth_diffs"] == pytest.approx([0.05, 0.15])
    assert nvfp4["gsm8k_entropy_diff_mean"] == pytest.approx(0.0)


def test_markdown_has_the_per_variant_table_and_the_signed_aqn_effects():
    recipe, per_seed = _recipe(), _per_seed()
    md = render_markdown(recipe, aggregate(recipe, per_seed), [0, 1, 2], {2: "lora-bf16-aqn: out of memory"},
                         aqn_effects(recipe, per_seed))
    assert "| lora-bf16-aqn | bf16 | on | 2 | 62.5 +- 10.6 |" in md
    assert "## AQN on - off, per format, paired by seed" in md
    assert "| bf16 | lora-bf16 -> lora-bf16-aqn | 2 | +7.5 +- 3.5 | +0.000 +- 0.000 |" in md
    assert "| nvfp4 | qerl-nvfp4 -> qerl-nvfp4-aqn | 3 | +13.3 +- 15.3 |" in md
    assert "- seed 2: lora-bf16-aqn: out of memory" in md
    without = render_markdown(recipe, aggregate(recipe, per_seed), [0, 1, 2], {})
    assert "AQN on - off" not in without and "Seeds left out" not in without


def test_plot_groups_the_bars_by_format(tmp_path):
    recipe, per_seed = _recipe(), _per_seed()
    path = render_plot(recipe, aggregate(recipe, per_seed), tmp_path / "ablation.png")
    assert path == tmp_path / "ablation.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert render_plot(recipe, [], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
