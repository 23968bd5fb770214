"""Plots of the committed speed evidence, one figure per issue, every GPU's file side by side.

    python benchmarks/plot_results.py                 # the default evidence files -> results/plots/
    python benchmarks/plot_results.py --w4a16 a.json b.json --rollout r.json --grpo g.json --out DIR

- w4a16_speedup.png (issue 4): the median over layer shapes of bf16_us / us by M, forward and
  backward, one line per format and GPU, the issue's goals as marks.
- rollout_ratio.png (issue 6): tok/s over the bf16 engine's in the same run, per model and batch,
  one bar per format, a panel per GPU; the goal (1.7) as a line.
- lora_cost.png (issue 6): tok/s with LoRA rank 16 / 32 / 64 over the same run's no-LoRA tok/s;
  the goal (0.9, "LoRA costs <= 10%") as a line.
- grpo_step.png (issue 9): GRPO step time over bf16 LoRA's in the same process, per model and
  batch, the newest pair in each file; the goal (1.5) as a line.
- attention_bandwidth.png (issues 6 / 9): the decode attention alone (benchmarks/probe_attention.py), its K / V
  read rate over the same run's copy bandwidth per shape (model, rows x keys), one bar per candidate.
- nf4_kernels.png (issue 4): as w4a16_speedup.png, forward, for the NF4 comparison the issue asks for: the QLoRA
  baseline (nf4), the labelled fused NF4 kernel (nf4-fused) and nvfp4 / mxfp4 from the same run.
- w4a16_ceiling.png (issue 4): per layer shape at M = 1, nvfp4's speedup in the sweep beside the single-launch
  streaming ceiling (`bench_w4a16.py --stream --stream-ms`: bf16 us over the fastest launch that only reads the
  layer's 4-bit bytes), the M <= 16 goal as a line.

Every number is read from the files (the same fields RESULTS.md quotes); nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

from qerl.efficiency import short_gpu  # the GPU names of these figures are those of qerl bench table

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DEFAULTS = {
    "w4a16": ["w4a16.json", "h200/w4a16.json"],
    "rollout": ["rollout.json", "h200/rollout.json", "h200/rollout_32b.json"],
    "grpo": ["grpo_step.json", "h200/grpo_step_cap79_b2_7b.json", "h200/grpo_step_cap79_b2_14b.json",
             "h200/grpo_step_cap79_b4.json", "h200/grpo_step_cap79_b2_7b_nf4.json",
             "h200/grpo_step_cap79_b2_14b_nf4.json", "h200/grpo_step_cap79_b8.json",
             "h200/grpo_step_cap79_b4_7b_nf4.json"],  # nf4: the QLoRA baseline (the *_nf4_fused files are labelled apart)
    "attention": ["h200/attention_probe_8_rule.json", "h200/attention_probe_9_rows16.json"],
    "nf4": ["h200/w4a16_nf4_fused_all.json"],
    "ceiling": ["w4a16.json", "h100/stream_ceiling_s70_h100.json"],  # the sweep, then the streaming ceiling
}
FORMATS = ("nvfp4", "mxfp4", "nf4")
NF4_FORMATS = ("nvfp4", "mxfp4", "nf4", "nf4-fused")  # the NF4 figure: the baseline, the labelled fused kernel, FP4
COLORS = {"nvfp4": "tab:green", "mxfp4": "tab:blue", "nf4": "tab:red", "nf4-fused": "tab:purple", "bf16": "tab:gray",
          "r16": "tab:olive", "r32": "tab:orange", "r64": "tab:brown"}
LORA_RANKS = ("r16", "r32", "r64")
# issue 4's goals, forward: (M values it covers, ratio)
W4A16_GOALS = [((1, 2, 4, 8, 16), 3.0), ((64,), 2.0), ((256,), 1.0), ((1024, 4096), 0.85)]


def load(path: str) -> dict:
    if not os.path.exists(path):
        raise SystemExit(f"plot_results: no such evidence file: {path}")
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"plot_results: {path} is not a benchmark file (a JSON object with a 'rows' list)")
    return data


def row_gpu(data: dict, row: dict) -> str:
    return short_gpu(row.get("gpu") or data.get("gpu", ""))


def w4a16_medians(rows: list[dict], formats=FORMATS) -> dict[tuple[str, str], dict[int, float]]:
    """{(format, op): {M: median speedup over the shapes}} for `formats` (bf16's own rows are not among them)."""
    cells: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for r in rows:
        if r.get("format") in formats and r.get("speedup"):
            cells[r["format"], r.get("op", "forward"), int(r["m"])].append(float(r["speedup"]))
    out: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for (fmt, op, m), v in sorted(cells.items()):
        out[fmt, op][m] = statistics.median(v)
    return dict(out)


def _fused_nf4(r: dict) -> bool:
    """A row of nf4 with the labelled fused NF4 decode (its `nf4_decode` field): not the QLoRA baseline that
    these figures' nf4 bars show (the NF4 figure compares the two kernels)."""
    return str(r.get("nf4_decode") or "").startswith("fused")


def rollout_ratios(rows: list[dict]) -> dict[tuple[str, int, str], float]:
    """{(model, batch, format): tok/s over bf16's in the same run}, no-LoRA rows with a baseline."""
    out = {}
    for r in rows:
        if r.get("lora_rank", 0) == 0 and r.get("format") in FORMATS and r.get("bf16_tokens_per_s") and not _fused_nf4(r):
            out[r["model"], int(r["batch"]), r["format"]] = r["tokens_per_s"] / r["bf16_tokens_per_s"]
    return out


def lora_ratios(rows: list[dict]) -> dict[tuple[str, int, str], float]:
    """{(model, batch, 'r<rank>'): tok/s with LoRA over the same run's tok/s without}."""
    return {(r["model"], int(r["batch"]), f"r{r['lora_rank']}"): r["tokens_per_s"] / r["lora0_tokens_per_s"]
            for r in rows if r.get("lora_rank") and r.get("lora0_tokens_per_s")}


def grpo_speedups(rows: list[dict]) -> dict[tuple[str, int, str], float]:
    """{(model, batch, format): step speedup over bf16}, the newest paired row of each (by its date)."""
    best: dict[tuple[str, int, str], tuple[str, float]] = {}
    for r in rows:
        if r.get("format") in FORMATS and r.get("speedup") and not _fused_nf4(r):
            key = (r["model"], int(r["batch"]), r["format"])
            date = r.get("date") or ""
            if key not in best or date >= best[key][0]:
                best[key] = (date, float(r["speedup"]))
    return {k: v for k, (_, v) in best.items()}


def _by_gpu(datas: list[dict]) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = defaultdict(list)
    for data in datas:
        for r in data["rows"]:
            rows[row_gpu(data, r)].append(r)
    return dict(rows)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_w4a16(datas: list[dict], path: str) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 1]})
    styles = ["-", "--", ":", "-."]
    for i, (gpu, rows) in enumerate(sorted(_by_gpu(datas).items())):
        for (fmt, op), by_m in sorted(w4a16_medians(rows).items()):
            ax = axes[0] if op == "forward" else axes[1]
            ms = sorted(by_m)
            ax.plot(ms, [by_m[m] for m in ms], styles[i % len(styles)], marker="o", ms=3.5, color=COLORS[fmt],
                    label=f"{fmt} {gpu}")
    for ms, goal in W4A16_GOALS:
        axes[0].plot(ms, [goal] * len(ms), "k_", ms=14, mew=2)
    axes[0].plot([], [], "k_", ms=14, mew=2, label="goal (issue 4)")
    axes[1].plot([4096], [0.85], "k_", ms=14, mew=2)
    for ax, title in ((axes[0], "forward: y = x @ W^T"), (axes[1], "backward: grad_x = grad_y @ W")):
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="0.6", lw=0.8)
        ax.set_xlabel("M (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("median speedup over bf16 (same process)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("4-bit x bf16 GEMM, median over the Qwen2.5 layer shapes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ceiling_pairs(sweep: list[dict], stream: list[dict], m: int = 1, fmt: str = "nvfp4") -> list[tuple]:
    """[(n, k, the sweep's speedup, the streaming ceiling)] per layer shape at M = m, smallest first: the ceiling is
    the stream file's bf16 us at that M over the fastest 4-bit streaming launch of the layer (its "us4" rows)."""
    fastest: dict[tuple[int, int], float] = {}
    bf16: dict[tuple[int, int], float] = {}
    for r in stream:
        key = (r["n"], r["k"])
        if "us4" in r:
            fastest[key] = min(fastest.get(key, float("inf")), r["us4"])
        elif r.get("cfg") == "bf16" and r.get("m") == m:
            bf16[key] = r["bf16_us"]
    ours = {(r["n"], r["k"]): r["speedup"] for r in sweep
            if r.get("format") == fmt and r.get("op") == "forward" and r.get("m") == m and r.get("speedup")}
    keys = sorted(set(ours) & set(fastest) & set(bf16), key=lambda s: s[0] * s[1])
    return [(n, k, ours[(n, k)], bf16[(n, k)] / fastest[(n, k)]) for n, k in keys]


def plot_ceiling(datas: list[dict], path: str, goal: float = 3.0) -> str:
    """Issue 4, M = 1: the sweep's nvfp4 speedup per layer beside what a kernel that only streams the bytes reaches."""
    if len(datas) != 2:
        raise SystemExit("plot_results: --ceiling takes two files: the sweep (w4a16.json), then the stream ceiling")
    pairs = ceiling_pairs(datas[0]["rows"], datas[1]["rows"])
    if not pairs:
        raise SystemExit(f"no rows to plot for {os.path.basename(path)}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    xs = range(len(pairs))
    ax.bar([x - 0.2 for x in xs], [p[3] for p in pairs], 0.4, color="0.7", label="streaming ceiling (bytes only)")
    ax.bar([x + 0.2 for x in xs], [p[2] for p in pairs], 0.4, color=COLORS["nvfp4"], label="nvfp4 (the sweep)")
    ax.axhline(goal, color="k", lw=1.2, ls="--", label=f"goal, median over M <= 16 ({goal})")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{n}x{k}" for n, k, _, _ in pairs], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("speedup over bf16 at M = 1 (same process)")
    gpu = short_gpu(datas[1].get("gpu", ""))
    ax.set_title(f"4-bit GEMV in single launches against a kernel that only reads the bytes ({gpu})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_nf4(datas: list[dict], path: str) -> str:
    """Issue 4's NF4 comparison: the QLoRA baseline, the labelled fused NF4 kernel and the FP4 formats by M."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-."]
    drawn = 0
    for i, (gpu, rows) in enumerate(sorted(_by_gpu(datas).items())):
        for (fmt, op), by_m in sorted(w4a16_medians(rows, NF4_FORMATS).items()):
            if op != "forward":
                continue
            ms = sorted(by_m)
            label = {"nf4": "nf4 baseline (dequantise + cuBLAS)", "nf4-fused": "nf4-fused (labelled)"}.get(fmt, fmt)
            ax.plot(ms, [by_m[m] for m in ms], styles[i % len(styles)], marker="o", ms=3.5, color=COLORS[fmt],
                    label=f"{label} {gpu}")
            drawn += 1
    if not drawn:
        raise SystemExit(f"plot_results: no rows to plot for {os.path.basename(path)}")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("median speedup over bf16 (same process)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("NF4 against the FP4 formats, median over the Qwen2.5 layer shapes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _size(model: str) -> float:
    """'qwen2.5-14b' -> 14.0 (the sort key of the bar groups); a name without a size sorts last."""
    tail = model.rsplit("-", 1)[-1].lower().rstrip("b")
    try:
        return float(tail)
    except ValueError:
        return float("inf")


def _bars(ax, values: dict[tuple[str, int, str], float], formats, goal: float, ylabel: str):
    groups = sorted({k[:2] for k in values}, key=lambda g: (_size(g[0]), g))
    width = 0.8 / max(1, len(formats))
    for j, fmt in enumerate(formats):
        xs = [i + (j - (len(formats) - 1) / 2) * width for i, g in enumerate(groups) if (*g, fmt) in values]
        ys = [values[(*g, fmt)] for g in groups if (*g, fmt) in values]
        bars = ax.bar(xs, ys, width, color=COLORS[fmt], label=fmt)
        for b, y in zip(bars, ys):
            ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(goal, color="k", ls="--", lw=1, label=f"goal {goal}")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m.replace('qwen2.5-', '')}\nb{b}" for m, b in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def plot_panels(datas: list[dict], path: str, values_of, formats, goal: float, ylabel: str, title: str) -> str:
    plt = _pyplot()
    rows_by_gpu = _by_gpu(datas)
    per_gpu = {gpu: values_of(rows) for gpu, rows in sorted(rows_by_gpu.items())}
    per_gpu = {gpu: v for gpu, v in per_gpu.items() if v}
    if not per_gpu:
        raise SystemExit(f"plot_results: no rows to plot for {os.path.basename(path)}")
    fig, axes = plt.subplots(1, len(per_gpu), figsize=(6.5 * len(per_gpu), 4.2), squeeze=False, sharey=True)
    caps = {gpu: sorted({r["device_memory_gib"] for r in rows if r.get("device_memory_gib")})
            for gpu, rows in rows_by_gpu.items()}
    for ax, (gpu, values) in zip(axes[0], per_gpu.items()):
        _bars(ax, values, [f for f in formats if any(k[2] == f for k in values)], goal, ylabel)
        cap = caps.get(gpu)  # rows run under --device-memory-gib (an 80 GB card's budget on a larger one)
        ax.set_title(gpu + (f" (memory capped at {', '.join(f'{c:g}' for c in cap)} GiB)" if cap else ""))
        ax.legend(fontsize=7, loc="upper center", ncol=4)
    top = max(goal, *(v for values in per_gpu.values() for v in values.values()))
    axes[0][0].set_ylim(0, top * 1.25)  # room for the legend above the bars (the panels share the axis)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def attention_fractions(rows: list[dict]) -> dict[tuple[str, int, int], dict[str, float]]:
    """(model, rows, keys) -> {candidate: of_copy} from probe_attention.py rows, candidates in file order."""
    out: dict = defaultdict(dict)
    for r in rows:
        if r.get("of_copy") is not None:
            out[(r["model"], int(r["rows"]), int(r["keys"]))][r["cand"]] = float(r["of_copy"])
    return dict(out)


def plot_attention(datas: list[dict], path: str) -> str:
    plt = _pyplot()
    per_gpu = {gpu: attention_fractions(rows) for gpu, rows in sorted(_by_gpu(datas).items())}
    per_gpu = {gpu: v for gpu, v in per_gpu.items() if v}
    if not per_gpu:
        raise SystemExit(f"plot_results: no rows to plot for {os.path.basename(path)}")
    fig, axes = plt.subplots(len(per_gpu), 1, figsize=(13, 4.2 * len(per_gpu)), squeeze=False)
    for ax, (gpu, values) in zip(axes[:, 0], per_gpu.items()):
        groups = sorted(values, key=lambda g: (_size(g[0]), g))
        cands = list(dict.fromkeys(c for g in groups for c in values[g]))
        width = 0.8 / len(cands)
        for j, cand in enumerate(cands):
            xs = [i + (j - (len(cands) - 1) / 2) * width for i, g in enumerate(groups) if cand in values[g]]
            ax.bar(xs, [values[g][cand] for g in groups if cand in values[g]], width, label=cand)
        ax.axhline(1.0, color="k", ls="--", lw=1, label="copy bandwidth")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m.replace('qwen2.5-', '')}\n{r}x{k}" for m, r, k in groups], fontsize=7)
        ax.set_ylabel("K / V read rate over copy")
        ax.set_ylim(0, 1.15)
        ax.set_title(gpu + " (shape: model, rows x keys)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(cands) + 1, loc="upper left")
    fig.suptitle("Decode attention alone (probe_attention.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, files in DEFAULTS.items():
        ap.add_argument(f"--{key}", nargs="+", default=[os.path.join(RESULTS, f) for f in files],
                        help=f"evidence files (default: results/{', results/'.join(files)})")
    ap.add_argument("--out", default=os.path.join(RESULTS, "plots"))
    args = ap.parse_args(argv)
    loaded = {key: [load(p) for p in getattr(args, key)] for key in DEFAULTS}
    os.makedirs(args.out, exist_ok=True)
    written = [
        plot_w4a16(loaded["w4a16"], os.path.join(args.out, "w4a16_speedup.png")),
        plot_panels(loaded["rollout"], os.path.join(args.out, "rollout_ratio.png"), rollout_ratios,
                    ("nvfp4", "mxfp4", "nf4"), 1.7, "tok/s over the bf16 engine (same run)",
                    "Rollout engine, no LoRA (issue 6)"),
        plot_panels(loaded["rollout"], os.path.join(args.out, "lora_cost.png"), lora_ratios, LORA_RANKS, 0.9,
                    "tok/s with LoRA over without (same run)", "Rollout engine, nvfp4 with unmerged LoRA (issue 6)"),
        plot_panels(loaded["grpo"], os.path.join(args.out, "grpo_step.png"), grpo_speedups, ("nvfp4", "nf4"), 1.5,
                    "GRPO step speedup over bf16 LoRA (same process)", "GRPO step, 8 x 2048 tokens (issue 9)"),
        plot_attention(loaded["attention"], os.path.join(args.out, "attention_bandwidth.png")),
        plot_nf4(loaded["nf4"], os.path.join(args.out, "nf4_kernels.png")),
        plot_ceiling(loaded["ceiling"], os.path.join(args.out, "w4a16_ceiling.png")),
    ]
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
