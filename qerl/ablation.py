"""Seed ablations: per-seed rows of reproduce-table runs -> mean +- std per variant, AQN on - off per format.

The flow `ablation` (flows/ablation.py) runs a recipe once per seed and calls these to aggregate:

    per_seed = {s: seed_rows(recipe_for_seed_s, parent_run_id_s) for s in seeds}
    rows = aggregate(recipe, per_seed)          # mean / sample std per variant and metric
    effects = aqn_effects(recipe, per_seed)     # per format with both variants: AQN on - off, paired by seed
    render_markdown(recipe, rows, seeds, failed, effects); render_plot(recipe, rows, path)

AQN pairs are the two trained variants of one weight format (qerl.recipe.VARIANTS: e.g. qerl-nvfp4 and
qerl-nvfp4-aqn, lora-bf16 and lora-bf16-aqn). Runs of the same seed share the LoRA initialisation, the
problem order and the sampling seeds, so the per-seed difference isolates the noise; its mean and sample std
over the seeds that completed both are reported.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from qerl.recipe import VARIANTS, Recipe

__all__ = ["aggregate", "aqn_effects", "aqn_pairs", "metric_keys", "render_markdown", "render_plot", "seed_rows"]


def metric_keys(recipe: Recipe) -> list[str]:
    """What is aggregated: per benchmark accuracy and entropy; the training reward and accuracy fields."""
    keys = [f"{b}_{m}" for b in recipe.benchmark_names() for m in ("accuracy", "entropy")]
    if recipe.train:
        keys += ["reward_first_fifth", "reward_last_fifth", "accuracy_first_fifth", "accuracy_last_fifth"]
    return keys


def seed_rows(recipe: Recipe, parent_run_id: str) -> dict[str, dict[str, Any]]:
    """variant -> {metric: value} of one seed's reproduce-table run (FINISHED columns only)."""
    from qerl.report import collect_rows

    out = {}
    for row in collect_rows(recipe, parent_run_id):
        if row.get("status") != "ok":
            continue
        vals: dict[str, Any] = {"format": row["format"], "aqn": row.get("aqn", False)}
        for b in recipe.benchmark_names():
            cell = row.get(b) or {}
            vals[f"{b}_accuracy"] = cell.get("accuracy")
            vals[f"{b}_entropy"] = cell.get("entropy")
        for k, v in (row.get("train") or {}).items():
            vals[k] = v
        out[row["variant"]] = vals
    return out


def _mean_std(vals: list[float]) -> tuple[float, float]:
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def aggregate(recipe: Recipe, per_seed: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """mean and sample std (n-1; 0.0 for one seed) over seeds, per variant and metric."""
    variants = [f"base-{f}" for f in recipe.formats] + recipe.variants()
    rows = []
    for variant in variants:
        seeds = sorted(s for s, rows_s in per_seed.items() if variant in rows_s)
        if not seeds:
            continue
        first = per_seed[seeds[0]][variant]
        row: dict[str, Any] = {"variant": variant, "format": first["format"], "aqn": bool(first.get("aqn")), "n_seeds": len(seeds), "seeds": seeds}
        for key in metric_keys(recipe):
            vals = [per_seed[s][variant].get(key) for s in seeds]
            vals = [float(v) for v in vals if v is not None]
            if not vals:
                continue
            row[f"{key}_mean"], row[f"{key}_std"] = _mean_std(vals)
            row[f"{key}_values"] = vals
        rows.append(row)
    return rows


def aqn_pairs(variants: list[str]) -> list[tuple[str, str, str]]:
    """(format, AQN-off variant, AQN-on variant) for every format both of whose trained variants are listed,
    in the order the formats first appear in `variants`."""
    by_format: dict[str, dict[bool, str]] = {}
    for v in variants:
        fmt, aqn = VARIANTS[v]
        by_format.setdefault(fmt, {})[aqn] = v
    return [(fmt, pair[False], pair[True]) for fmt, pair in by_format.items() if len(pair) == 2]


def aqn_effects(recipe: Recipe, per_seed: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per AQN pair: for each metric, the per-seed difference on - off over the seeds where both variants have a
    value, with its mean and sample std (`<metric>_diff_mean`, `_diff_std`, `_diffs`, `_seeds`)."""
    out = []
    for fmt, off, on in aqn_pairs(recipe.variants()):
        row: dict[str, Any] = {"format": fmt, "aqn_off": off, "aqn_on": on}
        for key in metric_keys(recipe):
            seeds = sorted(s for s, r in per_seed.items()
                           if r.get(off, {}).get(key) is not None and r.get(on, {}).get(key) is not None)
            if not seeds:
                continue
            diffs = [float(per_seed[s][on][key]) - float(per_seed[s][off][key]) for s in seeds]
            row[f"{key}_diff_mean"], row[f"{key}_diff_std"] = _mean_std(diffs)
            row[f"{key}_diffs"], row[f"{key}_seeds"] = diffs, seeds
        out.append(row)
    return out


def _cell(key: str, mean: float, std: float, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if "entropy" in key:
        return f"{mean:{sign}.3f} +- {std:.3f}"
    return f"{100 * mean:{sign}.1f} +- {100 * std:.1f}"


def render_markdown(recipe: Recipe, rows: list[dict[str, Any]], seeds: list[int], failed: dict[int, str],
                    effects: list[dict[str, Any]] | None = None) -> str:
    keys = [k for k in metric_keys(recipe) if any(f"{k}_mean" in r for r in rows)]
    lines = [
        f"# Ablation: {recipe.name} ({recipe.model.name}), seeds {', '.join(map(str, seeds))}",
        "",
        "mean +- sample std over seeds (accuracy and reward in %, entropy in nats)",
        "",
        "| variant | format | AQN | seeds | " + " | ".join(keys) + " |",
        "|---|---|---|---|" + "---|" * len(keys),
    ]
    for r in rows:
        cells = [_cell(k, r[f"{k}_mean"], r[f"{k}_std"]) if f"{k}_mean" in r else "-" for k in keys]
        lines.append(f"| {r['variant']} | {r['format']} | {'on' if r['aqn'] else 'off'} | {r['n_seeds']} | " + " | ".join(cells) + " |")
    effects = [e for e in effects or [] if any(f"{k}_diff_mean" in e for k in keys)]
    if effects:
        lines += [
            "",
            "## AQN on - off, per format, paired by seed",
            "",
            "mean +- sample std of the per-seed differences (points of accuracy and reward, nats of entropy); the two "
            "runs of a seed share the adapter initialisation, the problem order and the sampling seeds",
            "",
            "| format | variants (off -> on) | seeds | " + " | ".join(keys) + " |",
            "|---|---|---|" + "---|" * len(keys),
        ]
        for e in effects:
            n = max((len(e.get(f"{k}_seeds", [])) for k in keys), default=0)
            cells = [_cell(k, e[f"{k}_diff_mean"], e[f"{k}_diff_std"], signed=True) if f"{k}_diff_mean" in e else "-"
                     for k in keys]
            lines.append(f"| {e['format']} | {e['aqn_off']} -> {e['aqn_on']} | {n} | " + " | ".join(cells) + " |")
    if failed:
        lines += ["", "Seeds left out (failed):", *[f"- seed {s}: {msg}" for s, msg in sorted(failed.items())]]
    return "\n".join(lines) + "\n"


_KINDS = ("base", "trained", "trained + AQN")


def _kind(row: dict[str, Any]) -> str:
    if row["variant"].startswith("base-"):
        return _KINDS[0]
    return _KINDS[2] if row.get("aqn") else _KINDS[1]


def render_plot(recipe: Recipe, rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars of the first benchmark's accuracy, grouped by weight format: base, trained, trained + AQN
    (whichever ran), each with its std over seeds as the error bar."""
    bench = recipe.benchmark_names()[0]
    key = f"{bench}_accuracy"
    pts = [r for r in rows if f"{key}_mean" in r]
    if not pts:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(r["format"] for r in pts))
    kinds = [k for k in _KINDS if any(_kind(r) == k for r in pts)]
    width = 0.8 / len(kinds)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(formats) * len(kinds) + 1.5), 3.8))
    for j, kind in enumerate(kinds):
        sel = [(formats.index(r["format"]), r) for r in pts if _kind(r) == kind]
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i, _ in sel]
        bars = ax.bar(xs, [100 * r[f"{key}_mean"] for _, r in sel], width, yerr=[100 * r[f"{key}_std"] for _, r in sel],
                      capsize=3, label=kind)
        for b, (_, r) in zip(bars, sel):
            ax.annotate(r["variant"], (b.get_x() + b.get_width() / 2, 0), xytext=(0, 2), textcoords="offset points",
                        rotation=90, ha="center", va="bottom", fontsize=7, color="white")
    ax.set_xticks(range(len(formats)), formats)
    ax.set_ylabel(f"{bench} accuracy (%)")
    n_seeds = max(r["n_seeds"] for r in pts)
    ax.set_title(f"{recipe.name}: mean +- std over {n_seeds} seed(s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
