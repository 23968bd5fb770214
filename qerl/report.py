"""The report: Table 1's rows (base models and RL-trained variants) from the MLflow runs of one
flow run, beside the paper's.

    paths = build_report(recipe, parent_run_id)
    # -> {"table_md", "table_html", "summary_json", "plot_png", "curves_png"}

Reads the runs nested under `parent_run_id` (tag mlflow.parentRunId): one row per base format
and per trained variant (the latest FINISHED evaluate run of that variant, plus its train run's
reward summary; a column whose runs all failed shows "failed" and the error), and writes into
recipe.report_dir:

- table.md      markdown table: our accuracy (95% Wilson CI), n, mean entropy, RL steps and the
                training reward (first -> last fifth of the steps) per row, and the paper's
                cells for the recipe's benchmarks: GSM8K, Table 1 for Qwen2.5-3B/7B-Instruct
                (PAPER_TABLE1, PAPER_TABLE1_TRAINED); MATH500, 7B after RL (PAPER_MATH500_TRAINED);
- table.html    the same, self-contained (inline CSS, the plots embedded);
- accuracy_entropy.png   accuracy with CI error bars and entropy per variant (matplotlib Agg);
- training_curves.png    training reward and policy entropy per RL step, one line per variant;
- summary.json  {"rows": [{"variant", "format", "gsm8k_accuracy", "n", "entropy", ...}]}, trained
                rows also with "reward_first_fifth", "reward_last_fifth", "steps"; rows are
                merged by variant: rows of other variants already in the file stay.

Accuracies are fractions (0-1) in summary.json and MLflow, percentages in the tables (as in
the paper). The files are logged as artifacts of the parent run under report/.
Run it again for a finished flow run with:  qerl report RECIPE --run-id PARENT_RUN_ID
"""

from __future__ import annotations

import base64
import datetime as _dt
import functools
import html
import json
import os
from pathlib import Path
from typing import Any, Callable

from qerl import FORMATS
from qerl.recipe import VARIANTS, Recipe
from qerl.tracking import Tracker, ui_command

__all__ = ["PAPER_MATH500_TRAINED", "PAPER_TABLE1", "PAPER_TABLE1_TRAINED", "build_report", "collect_rows", "merge_summary"]

# GSM8K accuracy (%) of the untrained models, per weight format: the "base" columns of Table 1
# of QeRL (arXiv 2510.11696), as listed in /work/shared/paper.md ("Accuracy, GSM8K with GRPO
# (Table 1 ...)"; cells from a published summary of the paper). Facts, not tuning targets.
PAPER_TABLE1: dict[str, dict[str, float]] = {
    "Qwen2.5-3B-Instruct": {"bf16": 61.2, "nf4": 57.5, "mxfp4": 59.8, "nvfp4": 59.4},
    "Qwen2.5-7B-Instruct": {"bf16": 76.3, "nf4": 70.5, "mxfp4": 71.3, "nvfp4": 73.4},
}
# The trained columns of the same table and source (used by later reports): GSM8K accuracy (%)
# after GRPO training. "QeRL + AQN" 3B 83.7 is confirmed by the authors (paper.md).
PAPER_TABLE1_TRAINED: dict[str, dict[str, float]] = {
    "Qwen2.5-3B-Instruct": {
        "full FT": 84.4, "LoRA bf16": 76.1, "QLoRA nf4": 76.1, "LoRA mxfp4": 73.4,
        "QeRL nvfp4": 83.3, "QeRL nvfp4 + AQN": 83.7,
    },
    "Qwen2.5-7B-Instruct": {
        "full FT": 91.2, "LoRA bf16": 88.1, "QLoRA nf4": 85.0, "LoRA mxfp4": 86.4,
        "QeRL nvfp4": 88.5, "QeRL nvfp4 + AQN": 90.8,
    },
}
PAPER_SOURCE = "QeRL (arXiv 2510.11696), Table 1 (base and GRPO-trained), full GSM8K test (1,319 problems)"
# MATH500 accuracy (%) of Qwen2.5-7B-Instruct after RL, from the project's figure (paper.md: "MATH500, 7B (project
# figure)"); trained columns only. "QeRL nvfp4" is the figure's "QeRL", which does not say whether AQN was on.
PAPER_MATH500_TRAINED: dict[str, dict[str, float]] = {
    "Qwen2.5-7B-Instruct": {"full FT": 77.4, "LoRA bf16": 77.0, "QLoRA nf4": 76.4, "QeRL nvfp4": 77.4,
                            "QeRL nvfp4 + AQN": 77.4},
}
PAPER_MATH500_SOURCE = ("QeRL's project figure, MATH500 after RL, Qwen2.5-7B-Instruct (its \"QeRL\" bar is shown on "
                        "both QeRL rows: the figure does not say whether AQN was on)")
# benchmark -> (source, base cells by model, trained cells by model): the paper columns a recipe's report shows
PAPER_COLUMNS: dict[str, tuple[str, dict[str, dict[str, float]], dict[str, dict[str, float]]]] = {
    "gsm8k": (PAPER_SOURCE, PAPER_TABLE1, PAPER_TABLE1_TRAINED),
    "math500": (PAPER_MATH500_SOURCE, {}, PAPER_MATH500_TRAINED),
}
# Our variant names -> the labels of PAPER_TABLE1_TRAINED.
PAPER_VARIANT_NAMES = {
    "lora-bf16": "LoRA bf16",
    "qlora-nf4": "QLoRA nf4",
    "lora-mxfp4": "LoRA mxfp4",
    "qerl-nvfp4": "QeRL nvfp4",
    "qerl-nvfp4-aqn": "QeRL nvfp4 + AQN",
}

FILES = {
    "table_md": "table.md",
    "table_html": "table.html",
    "summary_json": "summary.json",
    "plot_png": "accuracy_entropy.png",
    "curves_png": "training_curves.png",
}
_PRIMARY = "gsm8k"  # summary.json's n / entropy refer to it (or to the first benchmark)


# ----------------------------------------------------------------------------- rows


def _pick(runs: list, step: str, fmt: str) -> list:
    return [r for r in runs if r.data.tags.get("step") == step and r.data.tags.get("format") == fmt]


def _pick_variant(runs: list, step: str, variant: str) -> list:
    return [r for r in runs if r.data.tags.get("step") == step and r.data.tags.get("variant") == variant]


def table_columns(recipe: Recipe) -> list[tuple[str, str, bool]]:
    """(variant, format, trained) per table row: base-<format> rows, then the trained variants."""
    cols = [(f"base-{f}", f, False) for f in recipe.formats]
    cols += [(v, VARIANTS[v][0], True) for v in recipe.variants()]
    return cols


_TRAIN_KEYS = (
    "reward_first_fifth", "reward_last_fifth", "accuracy_first_fifth", "accuracy_last_fifth",
    "entropy_first_fifth", "entropy_last_fifth", "train_seconds",
)


def collect_rows(recipe: Recipe, parent_run_id: str, tracker: Tracker | None = None) -> list[dict[str, Any]]:
    """One row per table column (base formats, trained variants) from the child runs of `parent_run_id`."""
    tracker = tracker or Tracker(recipe.mlflow)
    runs = tracker.child_runs(parent_run_id)
    rows = []
    for variant, fmt, trained in table_columns(recipe):
        evals = _pick_variant(runs, "evaluate", variant)
        done = [r for r in evals if r.info.status == "FINISHED"]
        row: dict[str, Any] = {"variant": variant, "format": fmt, "trained": trained}
        if trained:
            row["aqn"] = VARIANTS[variant][1]
            train_done = [r for r in _pick_variant(runs, "train", variant) if r.info.status == "FINISHED"]
            if train_done:
                t = train_done[-1]
                tm = t.data.metrics
                row["train"] = {k: tm.get(k) for k in _TRAIN_KEYS}
                row["train"]["steps"] = None if tm.get("steps") is None else int(tm["steps"])
                row["train"]["mlflow_run_id"] = t.info.run_id
        if done:
            run = done[-1]
            m = run.data.metrics
            row.update(
                status="ok",
                mlflow_run_id=run.info.run_id,
                bits_per_weight=m.get("bits_per_weight"),
                compute_dtype=run.data.tags.get("compute_dtype"),
                device=run.data.tags.get("device"),
                device_name=run.data.tags.get("device_name"),
            )
            for b in recipe.benchmark_names():
                row[b] = {
                    "accuracy": m.get(f"{b}_accuracy"),
                    "ci_low": m.get(f"{b}_ci_low"),
                    "ci_high": m.get(f"{b}_ci_high"),
                    "n": None if m.get(f"{b}_n") is None else int(m[f"{b}_n"]),
                    "entropy": m.get(f"{b}_entropy"),
                    "completion_tokens": m.get(f"{b}_completion_tokens"),
                }
        else:
            tried = evals + _pick(runs, "quantize", fmt) + (_pick_variant(runs, "train", variant) if trained else [])
            tried.sort(key=lambda r: r.info.start_time or 0)
            failed = [r for r in tried if r.info.status in ("FAILED", "KILLED")]
            if failed:
                run = failed[-1]
                row.update(
                    status="failed",
                    mlflow_run_id=run.info.run_id,
                    error=f"{run.data.tags.get('step', '?')}: {run.data.tags.get('error', run.info.status)}",
                )
            elif tried:
                row.update(status=tried[-1].info.status.lower(), mlflow_run_id=tried[-1].info.run_id)
            else:
                row.update(status="missing")
        rows.append(row)
    return rows


def training_curves(rows: list[dict], tracker: Tracker, keys=("reward_mean", "entropy")) -> dict[str, dict[str, list]]:
    """{variant: {key: [(step, value), ...]}} from the train runs' metric histories (latest value per step)."""
    out: dict[str, dict[str, list]] = {}
    for r in rows:
        run_id = (r.get("train") or {}).get("mlflow_run_id")
        if not run_id:
            continue
        curves = {}
        for key in keys:
            with _tracking_lock():
                hist = tracker.client.get_metric_history(run_id, key)
            by_step: dict[int, tuple[int, float]] = {}
            for m in hist:
                if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                    by_step[m.step] = (m.timestamp, m.value)
            curves[key] = [(st, v) for st, (_, v) in sorted(by_step.items())]
        out[r["variant"]] = curves
    return out


def _tracking_lock():
    from qerl.tracking import _LOCK

    return _LOCK


# ----------------------------------------------------------------------------- formatting


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}"


def _acc_cell(cell: dict | None) -> str:
    if not cell or cell.get("accuracy") is None:
        return "-"
    return f"{_pct(cell['accuracy'])} [{_pct(cell['ci_low'])}, {_pct(cell['ci_high'])}]"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _paper_columns(recipe: Recipe) -> list[tuple[str, Callable[[dict], float | None]]]:
    """(header, row -> the paper's accuracy % or None) for each model of each PAPER_COLUMNS benchmark the recipe
    evaluates: GSM8K (Table 1, 3B and 7B, base and trained), MATH500 (7B, trained)."""
    cols: list[tuple[str, Callable[[dict], float | None]]] = []
    for bench, (_, base, trained) in PAPER_COLUMNS.items():
        if bench in recipe.benchmark_names():
            cols += [(f"paper {m.replace('-Instruct', '')} {bench.upper()} %",
                      functools.partial(_paper_cell, base.get(m, {}), trained[m])) for m in trained]
    return cols


def _columns(recipe: Recipe) -> list[str]:
    cols = ["variant", "format"]
    for b in recipe.benchmark_names():
        label = b.upper() if b == "gsm8k" else b
        cols += [f"{label} accuracy % [95% CI]", f"{label} n", f"{label} entropy (nats/token)", f"{label} mean tokens"]
    if recipe.variants():
        cols += ["RL steps", "train reward first -> last 1/5"]
    cols += ["bits/weight"] + [header for header, _ in _paper_columns(recipe)]
    return cols


def _paper_cell(base: dict[str, float], trained: dict[str, float], row: dict) -> float | None:
    """The paper's accuracy (%) for this row: its trained variant's cell, or its base format's."""
    if row.get("trained"):
        return trained.get(PAPER_VARIANT_NAMES.get(row["variant"], ""))
    return base.get(row["format"])


def paper_value(model: str, row: dict) -> float | None:
    """The paper's GSM8K accuracy (%) for this row's column (base format or trained variant)."""
    return _paper_cell(PAPER_TABLE1[model], PAPER_TABLE1_TRAINED[model], row)


def _cells(recipe: Recipe, row: dict) -> list[str]:
    cells = [row["variant"], row["format"]]
    for b in recipe.benchmark_names():
        cell = row.get(b)
        if row["status"] != "ok":
            cells += [row["status"].upper(), "-", "-", "-"]
            continue
        cells += [
            _acc_cell(cell),
            _num(cell.get("n"), "d"),
            _num(cell.get("entropy"), ".3f"),
            _num(cell.get("completion_tokens"), ".0f"),
        ]
    if recipe.variants():
        t = row.get("train") or {}
        cells.append(_num(t.get("steps"), "d"))
        first, last = t.get("reward_first_fifth"), t.get("reward_last_fifth")
        cells.append("-" if first is None or last is None else f"{first:.3f} -> {last:.3f}")
    cells.append(_num(row.get("bits_per_weight"), ".2f"))
    cells += [_num(value(row), ".1f") for _, value in _paper_columns(recipe)]
    return cells


def _context_lines(recipe: Recipe, parent_run_id: str, tracker: Tracker, rows: list[dict] | None = None) -> list[str]:
    g = recipe.generation
    decoding = "greedy" if g.temperature == 0 else f"T={g.temperature}, top_p={g.top_p}, top_k={g.top_k}"
    benches = ", ".join(
        f"{b.name} test, first {b.limit} problems" if b.limit else f"{b.name} test, all problems"
        for b in recipe.benchmarks
    )
    return [
        f"model: `{recipe.model.name}` ({recipe.model.dtype})",
        f"benchmarks: {benches}",
        f"decoding: {decoding}, max_new_tokens={g.max_new_tokens}, samples/problem={g.num_samples}, "
        f"batch={g.batch_size}, seed={g.seed}",
        f"compute: {_compute(rows or [])}",
        f"MLflow: experiment `{tracker.experiment_name}`, parent run `{parent_run_id}`, "
        f"store `{tracker.tracking_uri}`",
        f"browse: `{ui_command(tracker.tracking_uri)}` (or `make ui`), then http://127.0.0.1:5000",
    ]


def _compute(rows: list[dict]) -> str:
    def where(r: dict) -> str:  # "cuda (NVIDIA H200)"; runs from before the device_name tag: the device
        dev, name = r.get("device") or "?", r.get("device_name")
        return f"{dev} ({name})" if name and name != dev else dev

    seen = sorted({(where(r), r.get("compute_dtype") or "?") for r in rows if r.get("status") == "ok"})
    if not seen:
        return "-"
    return "; ".join(f"{dt} activations on {dev}" for dev, dt in seen) + " (weights hold their format's exact values)"


_ARITH_NOTE = (
    "arith: one-step arithmetic word problems generated by the project (qerl.rl.arith, fixed "
    "seeds, test and train disjoint). GSM8K is out of reach for a 135M model in a CPU budget "
    "(base accuracy ~0-3%), so the embedded recipe trains on arith and evaluates on both; the "
    "GSM8K columns stay for comparison with the paper."
)
_TRAIN_NOTE = (
    "trained rows: LoRA adapters trained by GRPO/DAPO (settings in the recipe's train section "
    "and in each train/<variant> MLflow run) on the frozen base of their format, then evaluated "
    "with the adapter applied; 'train reward first -> last 1/5' is the mean training reward "
    "over the first and the last fifth of the RL steps."
)


def _notes(recipe: Recipe) -> list[str]:
    notes = list(_NOTES)
    sources = [src for bench, (src, _, _) in PAPER_COLUMNS.items() if bench in recipe.benchmark_names()]
    notes.append(f"paper columns: {'; '.join(sources)}; different (larger) models than ours unless the recipe names "
                 "them: compare how accuracy moves across formats, not absolute values." if sources else
                 "paper columns: none (the paper's numbers we hold are for GSM8K and 7B MATH500).")
    if recipe.variants():
        notes.insert(2, _TRAIN_NOTE)
    uses_arith = "arith" in recipe.benchmark_names() or (recipe.train is not None and recipe.train.dataset == "arith")
    if uses_arith:
        notes.insert(0, _ARITH_NOTE)
    return notes


# The paper's Table 2 evaluates RL-trained models on these (DAPO on BigMath; Table 1 is GSM8K).
_TABLE2_BENCHMARKS = ("math500", "aime24", "aime25", "amc23")


def _title(recipe: Recipe) -> str:
    """Named after the paper's table whose benchmarks the recipe evaluates; a recipe on neither (e.g. arith
    alone) gets no table name."""
    what = "base and RL-trained" if recipe.variants() else "base models"
    names = recipe.benchmark_names()
    table = ("Table 1, " if "gsm8k" in names else
             "Table 2 setting, " if any(b in names for b in _TABLE2_BENCHMARKS) else "")
    title = f"{table}{what}: accuracy by weight format (recipe `{recipe.name}`)"
    return title[0].upper() + title[1:]


_NOTES = [
    "accuracy: pass@1 on the problems named above, 95% Wilson interval over problems.",
    "entropy: mean per-token entropy (nats) of the model's next-token distribution over the "
    "generated tokens (the paper's exploration measure).",
    "bits/weight: stored bits per weight of the decoder linear layers (codes + scales).",
]


def _base_of(rows: list[dict], fmt: str) -> dict | None:
    for r in rows:
        if r["variant"] == f"base-{fmt}" and r["status"] == "ok":
            return r
    return None


def trained_vs_base(recipe: Recipe, rows: list[dict]) -> list[str]:
    """One line per trained row: its accuracy minus its format's base accuracy, per benchmark."""
    out = []
    for r in rows:
        if not r.get("trained") or r["status"] != "ok":
            continue
        base = _base_of(rows, r["format"])
        if base is None:
            continue
        parts = []
        for b in recipe.benchmark_names():
            a, a0 = r[b].get("accuracy"), base[b].get("accuracy")
            if a is not None and a0 is not None:
                parts.append(f"{b} {100 * a0:.1f} -> {100 * a:.1f} ({100 * (a - a0):+.1f})")
        out.append(f"{r['variant']} vs base-{r['format']}: " + ", ".join(parts))
    return out


def render_markdown(
    recipe: Recipe, rows: list[dict], parent_run_id: str, tracker: Tracker, plot_name: str | None,
    curves_name: str | None = None,
) -> str:
    cols = _columns(recipe)
    lines = [f"# {_title(recipe)}", ""]
    lines += [f"- {c}" for c in _context_lines(recipe, parent_run_id, tracker, rows)]
    lines += ["", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cells(recipe, row)) + " |")
    deltas = trained_vs_base(recipe, rows)
    if deltas:
        lines += ["", "Trained vs the base model of the same format (accuracy points):"]
        lines += [f"- {d}" for d in deltas]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "Not measured:"]
        lines += [f"- {r['variant']}: {r['status']} {r.get('error', '')} (run `{r.get('mlflow_run_id', '-')}`)" for r in failed]
    lines += ["", "Notes:"] + [f"- {n}" for n in _notes(recipe)]
    if plot_name:
        lines += ["", f"![accuracy and entropy per variant]({plot_name})"]
    if curves_name:
        lines += ["", f"![training reward and entropy per step, per variant]({curves_name})"]
    lines += ["", f"_generated {_now()} by `qerl report`_", ""]
    return "\n".join(lines)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:72rem;
color:#222;line-height:1.45;padding:0 1rem}
h1{font-size:1.35rem} table{border-collapse:collapse;margin:1rem 0;font-size:.92rem}
th,td{border:1px solid #ccc;padding:.35rem .6rem;text-align:right} th{background:#f3f3f3}
td:first-child,td:nth-child(2),th:first-child,th:nth-child(2){text-align:left}
td.paper,th.paper{background:#f7f7fb;color:#446} tr.failed td{color:#a00}
code{background:#f3f3f3;padding:0 .2rem} ul{padding-left:1.2rem} img{max-width:100%}
small{color:#666}
"""


def _md_inline(text: str) -> str:
    """`code` spans -> <code>, everything escaped."""
    parts = text.split("`")
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(parts))


def render_html(
    recipe: Recipe, rows: list[dict], parent_run_id: str, tracker: Tracker, plot_png: Path | None,
    curves_png: Path | None = None,
) -> str:
    cols = _columns(recipe)
    n_paper = len(_paper_columns(recipe))
    head = "".join(
        f'<th class="paper">{html.escape(c)}</th>' if i >= len(cols) - n_paper else f"<th>{html.escape(c)}</th>"
        for i, c in enumerate(cols)
    )
    body = []
    for row in rows:
        cells = _cells(recipe, row)
        tds = "".join(
            f'<td class="paper">{html.escape(c)}</td>' if i >= len(cells) - n_paper else f"<td>{html.escape(c)}</td>"
            for i, c in enumerate(cells)
        )
        cls = "" if row["status"] == "ok" else ' class="failed"'
        title = f' title="{html.escape(row.get("error", ""))}"' if row.get("error") else ""
        body.append(f"<tr{cls}{title}>{tds}</tr>")
    context = "".join(f"<li>{_md_inline(c)}</li>" for c in _context_lines(recipe, parent_run_id, tracker, rows))
    notes = "".join(f"<li>{_md_inline(n)}</li>" for n in _notes(recipe))
    failed = [r for r in rows if r["status"] != "ok"]
    failed_html = ""
    if failed:
        items = "".join(
            f"<li>{html.escape(r['variant'])}: {html.escape(r['status'])} {html.escape(r.get('error', ''))}</li>" for r in failed
        )
        failed_html = f"<p>Not measured:</p><ul>{items}</ul>"
    deltas = trained_vs_base(recipe, rows)
    if deltas:
        items = "".join(f"<li>{html.escape(d)}</li>" for d in deltas)
        failed_html = f"<p>Trained vs the base model of the same format (accuracy points):</p><ul>{items}</ul>" + failed_html
    img = ""
    for png, alt in ((plot_png, "accuracy and entropy per variant"), (curves_png, "training reward and entropy per step")):
        if png is not None and png.is_file():
            data = base64.b64encode(png.read_bytes()).decode("ascii")
            img += f'<p><img alt="{alt}" src="data:image/png;base64,{data}"></p>'
    title = _title(recipe).replace("`", "")
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n<ul>{context}</ul>\n"
        f"<table><thead><tr>{head}</tr></thead><tbody>\n" + "\n".join(body) + "\n</tbody></table>\n"
        f"{failed_html}<p>Notes:</p><ul>{notes}</ul>\n{img}\n"
        f"<p><small>generated {_now()} by qerl report</small></p>\n</body></html>\n"
    )


def render_plot(recipe: Recipe, rows: list[dict], path: Path) -> Path | None:
    """Bar chart: accuracy (%) with 95% CI error bars per benchmark, and entropy, per variant."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    benches = recipe.benchmark_names()
    fig, axes = plt.subplots(1, len(benches) + 1, figsize=(4.6 * (len(benches) + 1), 4.0), squeeze=False)
    axes = axes[0]
    names = [r["variant"] for r in ok]
    x = list(range(len(ok)))
    rot = 30 if len(ok) > 4 else 0
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for ax, b in zip(axes, benches):
        acc = [100 * (r[b]["accuracy"] or 0) for r in ok]
        lo = [max(0.0, a - 100 * (r[b]["ci_low"] or 0)) for a, r in zip(acc, ok)]
        hi = [max(0.0, 100 * (r[b]["ci_high"] or 0) - a) for a, r in zip(acc, ok)]
        ax.bar(x, acc, yerr=[lo, hi], capsize=4, color=[colors[i % len(colors)] for i in x])
        ax.set_xticks(x, names, rotation=rot, ha="right" if rot else "center", fontsize=8)
        ax.set_ylabel("accuracy % (95% CI)")
        n = ok[0][b]["n"]
        ax.set_title(f"{b} (n={n})")
        top = max(100 * (r[b]["ci_high"] or 0) for r in ok)
        ax.set_ylim(0, min(100.0, max(10.0, 1.15 * top)))
    ax = axes[-1]
    first = benches[0]
    ax.bar(x, [r[first]["entropy"] or 0 for r in ok], color=[colors[i % len(colors)] for i in x])
    ax.set_xticks(x, names, rotation=rot, ha="right" if rot else "center", fontsize=8)
    ax.set_ylabel("mean entropy (nats/token)")
    ax.set_title(f"{first} entropy")
    fig.suptitle(f"recipe {recipe.name}, model {recipe.model.name}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve_style(variant: str, i: int) -> tuple[str, str]:
    """(colour, line style) of a variant's curve: its format's colour, dashed with AQN, so a format's two
    variants read as a pair; a name outside VARIANTS takes the colours after the formats'."""
    if variant in VARIANTS:
        fmt, aqn = VARIANTS[variant]
        return f"C{FORMATS.index(fmt)}", ("--" if aqn else "-")
    return f"C{len(FORMATS) + i}", "-"


def render_curves(recipe: Recipe, curves: dict[str, dict[str, list]], path: Path) -> Path | None:
    """Line plots: training reward (mean over the step's completions) and policy entropy per
    RL step, one colour per weight format, dashed with AQN (raw steps faint, 5-step running mean bold)."""
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0))
    labels = {"reward_mean": "training reward (mean)", "entropy": "policy entropy (nats/token)"}
    for ax, key in zip(axes, ("reward_mean", "entropy")):
        for i, (variant, c) in enumerate(curves.items()):
            pts = c.get(key) or []
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            color, dashes = _curve_style(variant, i)
            # raw per-step values faint, a running mean over 5 steps on top (one step is 16 samples)
            ax.plot(xs, ys, marker=".", color=color, alpha=0.3, linewidth=0.8, linestyle=dashes)
            smooth = [sum(ys[max(0, j - 4): j + 1]) / len(ys[max(0, j - 4): j + 1]) for j in range(len(ys))]
            ax.plot(xs, smooth, color=color, linewidth=2, label=variant, linestyle=dashes)
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_xlabel("RL step")
        ax.set_ylabel(labels[key])
        ax.set_title(labels[key] + " (bold: 5-step running mean)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"recipe {recipe.name}, model {recipe.model.name}: RL training curves", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- summary.json


def summary_rows(recipe: Recipe, rows: list[dict], parent_run_id: str) -> list[dict[str, Any]]:
    """The measured rows in summary.json's shape (failed formats are left out)."""
    benches = recipe.benchmark_names()
    primary = _PRIMARY if _PRIMARY in benches else benches[0]
    now = _now()
    out = []
    for r in rows:
        if r["status"] != "ok":
            continue
        p = r[primary]
        s: dict[str, Any] = {
            "variant": r["variant"],
            "format": r["format"],
            "gsm8k_accuracy": r["gsm8k"]["accuracy"] if "gsm8k" in r else None,
            "n": p["n"],
            "entropy": p["entropy"],
        }
        if r.get("trained"):
            t = r.get("train") or {}
            base = _base_of(rows, r["format"])
            if base is not None:
                for b in benches:
                    s[f"base_{b}_accuracy"] = base[b]["accuracy"]
            s.update(
                reward_first_fifth=t.get("reward_first_fifth"),
                reward_last_fifth=t.get("reward_last_fifth"),
                steps=t.get("steps"),
                aqn=r.get("aqn", False),
                accuracy_first_fifth=t.get("accuracy_first_fifth"),
                accuracy_last_fifth=t.get("accuracy_last_fifth"),
                train_entropy_first_fifth=t.get("entropy_first_fifth"),
                train_entropy_last_fifth=t.get("entropy_last_fifth"),
                train_seconds=t.get("train_seconds"),
                train_mlflow_run_id=t.get("mlflow_run_id"),
            )
        for b in benches:
            s[f"{b}_accuracy"] = r[b]["accuracy"]
            s[f"{b}_ci_low"] = r[b]["ci_low"]
            s[f"{b}_ci_high"] = r[b]["ci_high"]
            s[f"{b}_n"] = r[b]["n"]
            s[f"{b}_entropy"] = r[b]["entropy"]
        s.update(
            model=recipe.model.name,
            recipe=recipe.name,
            bits_per_weight=r.get("bits_per_weight"),
            mlflow_run_id=r["mlflow_run_id"],
            parent_run_id=parent_run_id,
            updated=now,
        )
        out.append(s)
    return out


def merge_summary(path: Path, new_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Write summary.json: rows of `new_rows` replace same-variant rows; other rows stay."""
    existing: list[dict] = []
    extra: dict[str, Any] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                existing = [r for r in data.get("rows", []) if isinstance(r, dict) and "variant" in r]
                extra = {k: v for k, v in data.items() if k != "rows"}
        except (OSError, json.JSONDecodeError):
            existing = []
    by_variant = {r["variant"]: r for r in new_rows}
    merged = [by_variant.pop(r["variant"], r) for r in existing]
    merged += list(by_variant.values())
    order = {name: i for i, name in enumerate([f"base-{f}" for f in FORMATS] + list(VARIANTS))}
    merged.sort(key=lambda r: (order.get(r["variant"], len(order)), ))
    data = {
        **extra,
        "units": {
            "gsm8k_accuracy": "fraction of problems correct (0-1), pass@1",
            "n": "number of problems (of gsm8k, else of the first benchmark)",
            "entropy": "mean per-token policy entropy in nats over generated tokens",
            "reward_first_fifth": "trained rows: mean training reward over the first fifth of the RL steps",
            "reward_last_fifth": "trained rows: mean training reward over the last fifth of the RL steps",
            "steps": "trained rows: RL steps (one generation batch each)",
        },
        "rows": merged,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return data


# ----------------------------------------------------------------------------- entry point


def build_report(recipe: Recipe, parent_run_id: str, tracker: Tracker | None = None) -> dict[str, str]:
    """Write table.md, table.html, accuracy_entropy.png and summary.json; log them to the parent run."""
    tracker = tracker or Tracker(recipe.mlflow)
    rows = collect_rows(recipe, parent_run_id, tracker)
    out = Path(recipe.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / v for k, v in FILES.items()}
    plot = render_plot(recipe, rows, paths["plot_png"])
    if plot is None:
        paths["plot_png"].unlink(missing_ok=True)
    curves = training_curves(rows, tracker)
    curves_png = render_curves(recipe, curves, paths["curves_png"])
    if curves_png is None:
        paths["curves_png"].unlink(missing_ok=True)
    paths["table_md"].write_text(
        render_markdown(
            recipe, rows, parent_run_id, tracker, FILES["plot_png"] if plot else None,
            FILES["curves_png"] if curves_png else None,
        ),
        encoding="utf-8",
    )
    paths["table_html"].write_text(render_html(recipe, rows, parent_run_id, tracker, plot, curves_png), encoding="utf-8")
    merge_summary(paths["summary_json"], summary_rows(recipe, rows, parent_run_id))
    for key, p in paths.items():
        if p.is_file():
            tracker.log_artifact(parent_run_id, p, "report")
    tracker.log_dict(parent_run_id, {"rows": rows, "curves": curves}, "report/rows.json")
    result = {k: str(p.resolve()) for k, p in paths.items() if p.is_file()}
    return result


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
