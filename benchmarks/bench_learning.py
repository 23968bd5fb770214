"""Learning runs of the embedded recipe, several variants x seeds, on one device: does RL learn?

Each run is `python -m qerl.rl.demo` (the embedded SmolLM2-135M-Instruct, LoRA trained by DAPO on
the generated arithmetic task, greedy held-out accuracy before and after) in its own process;
`--jobs` of them at once share the device. On a GPU this is the whole GPU training path of the
product (the 4-bit kernels in the forward and backward, the rollout engine with its graphs, AQN,
the fused log-probs), judged by what it learns rather than by time.

    python benchmarks/bench_learning.py --variants bf16,nf4,mxfp4,nvfp4,nvfp4+aqn,nvfp4@autocast \\
        --seeds 0,1,2 --steps 60 --device cuda --jobs 6 --runs-dir /tmp/learn \\
        --out benchmarks/results/learning/gpu.json
    python benchmarks/bench_learning.py --combine a.json b.json --out benchmarks/results/learning/gpu.json
    python benchmarks/bench_learning.py --report benchmarks/results/learning/gpu.json --report-dir reports/learning

A variant is FORMAT[+aqn][@autocast] (FORMAT one of bf16, nf4, mxfp4, nvfp4; `@autocast` trains
under bf16 autocast, GRPOSettings.bf16_autocast). Runs whose summary.json is already in
--runs-dir are not run again (a call cut off by its time limit goes on where it stopped); --out is
written after every finished run, so it always holds what has finished. A run that fails is
recorded with status "failed" and the end of its log.

JSON: {"device", "torch", "triton", "date", "command", "steps", "rows": [one per run: "variant",
"format", "aqn", "bf16_autocast", "seed", "status", "heldout_before", "heldout_after",
"reward_first_fifth", "reward_last_fifth", "entropy_last_fifth", "train_s_per_step", "wall_s",
"rewards", "entropies"], "variants": [mean and std over the seeds of each]}.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl import FORMATS  # noqa: E402
from qerl.env import switches_prefix  # noqa: E402
from qerl.recipe import parse_seeds  # noqa: E402
from qerl.rl.demo import variant_dir  # noqa: E402


def parse_variant(text: str) -> dict:
    """FORMAT[+aqn][@autocast] -> {"variant", "format", "aqn", "bf16_autocast"}; ValueError on
    anything else."""
    v = text.strip()
    body, _, mod = v.partition("@")
    if mod not in ("", "autocast"):
        raise ValueError(f"variant {text!r}: unknown modifier @{mod} (only @autocast)")
    fmt, _, extra = body.partition("+")
    if fmt not in FORMATS:
        raise ValueError(f"variant {text!r}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if extra not in ("", "aqn"):
        raise ValueError(f"variant {text!r}: unknown option +{extra} (only +aqn)")
    return {"variant": v, "format": fmt, "aqn": extra == "aqn", "bf16_autocast": mod == "autocast"}


def run_dir(runs_dir: Path, v: dict, seed: int) -> Path:
    return runs_dir / v["variant"].replace("+", "-").replace("@", "-") / f"seed{seed}"


def summary_path(runs_dir: Path, v: dict, seed: int) -> Path:
    return variant_dir(run_dir(runs_dir, v, seed), v["format"], v["aqn"]) / "summary.json"


def demo_command(v: dict, seed: int, args, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "qerl.rl.demo", "--format", v["format"], "--seed", str(seed),
           "--steps", str(args.steps), "--device", args.device, "--num-eval", str(args.num_eval), "--out", str(out)]
    if v["aqn"]:
        cmd.append("--aqn")
    cmd += ["--bf16-autocast", "on" if v["bf16_autocast"] else "off"]  # never the device-dependent auto
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fifth(xs: list[float], last: bool) -> float | None:
    if not xs:
        return None
    n = max(1, len(xs) // 5)
    part = xs[-n:] if last else xs[:n]
    return sum(part) / len(part)


def row_from_summary(v: dict, seed: int, s: dict) -> dict:
    steps = len(s.get("rewards", []))
    return {
        **{k: v[k] for k in ("variant", "format", "aqn", "bf16_autocast")}, "seed": seed, "status": "ok",
        "device_name": s.get("device_name"), "steps": steps,
        "heldout_before": s["heldout_accuracy_before"], "heldout_after": s["heldout_accuracy_after"],
        "reward_first_fifth": s["reward_first_fifth"], "reward_last_fifth": s["reward_last_fifth"],
        "entropy_last_fifth": _fifth(s.get("entropies", []), last=True),
        "train_s_per_step": s["train_time_s"] / max(1, steps), "wall_s": s["wall_time_s"],
        "rewards": s.get("rewards", []), "entropies": s.get("entropies", []),
    }


def variant_stats(rows: list[dict], variants: list[dict]) -> list[dict]:
    out = []
    for v in variants:
        ok = [r for r in rows if r["variant"] == v["variant"] and r["status"] == "ok"]
        st = {"variant": v["variant"], "runs": len(ok),
              "failed": sum(1 for r in rows if r["variant"] == v["variant"] and r["status"] != "ok")}
        for key in ("heldout_before", "heldout_after", "reward_first_fifth", "reward_last_fifth",
                    "entropy_last_fifth", "train_s_per_step"):
            st[key], st[key + "_std"] = _mean_std([r[key] for r in ok])
        out.append(st)
    return out


def sweep(args, variants: list[dict], seeds: list[int]) -> dict:
    import torch

    runs_dir = Path(args.runs_dir)
    jobs = [(v, s) for s in seeds for v in variants]
    lock = threading.Lock()
    rows: dict[tuple[str, int], dict] = {}
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "triton": _triton_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": switches_prefix() + "python benchmarks/bench_learning.py " + " ".join(args.argv), "steps": args.steps,
    }

    def write():
        ordered = [rows[(v["variant"], s)] for v in variants for s in seeds if (v["variant"], s) in rows]
        result["rows"] = ordered
        result["variants"] = variant_stats(ordered, variants)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))

    def one(v: dict, seed: int) -> None:
        sp = summary_path(runs_dir, v, seed)
        if not sp.exists():
            out = run_dir(runs_dir, v, seed)
            out.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            with open(out / "log.txt", "w") as logf:
                try:
                    proc = subprocess.run(demo_command(v, seed, args, out), stdout=logf, stderr=subprocess.STDOUT,
                                          cwd=ROOT, timeout=args.run_timeout)
                    rc = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            if not sp.exists():
                tail = (out / "log.txt").read_text(errors="replace")[-1500:]
                with lock:
                    rows[(v["variant"], seed)] = {**{k: v[k] for k in ("variant", "format", "aqn", "bf16_autocast")},
                                                 "seed": seed, "status": "failed", "returncode": rc, "log_tail": tail}
                    write()
                print(f"[learning] {v['variant']} seed {seed}: FAILED ({rc}) after {time.perf_counter() - t0:.0f} s",
                      flush=True)
                return
            print(f"[learning] {v['variant']} seed {seed}: done in {time.perf_counter() - t0:.0f} s", flush=True)
        r = row_from_summary(v, seed, json.loads(sp.read_text()))
        with lock:
            rows[(v["variant"], seed)] = r
            write()

    print(f"[learning] {len(jobs)} runs, {args.jobs} at a time, on {result['device']}", flush=True)
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as ex:
        for f in [ex.submit(one, v, s) for v, s in jobs]:
            f.result()
    write()
    return result


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001 - no Triton on a CPU box
        return None


def _pct(x: float | None, sd: float | None = None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}" + (f" +- {100 * sd:.1f}" if sd is not None else "")


def table(result: dict) -> str:
    lines = [
        f"{result['device']}, torch {result['torch']}, {result['steps']} DAPO steps per run, {result['date']}",
        "",
        "| variant | runs | held-out before | held-out after | reward first 1/5 | reward last 1/5 | entropy last 1/5 | train s / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in result["variants"]:
        ent = "-" if s["entropy_last_fifth"] is None else f"{s['entropy_last_fifth']:.3f} +- {s['entropy_last_fifth_std']:.3f}"
        tps = "-" if s["train_s_per_step"] is None else f"{s['train_s_per_step']:.2f}"
        runs = f"{s['runs']}" + (f" ({s['failed']} failed)" if s["failed"] else "")
        lines.append(
            f"| {s['variant']} | {runs} | {_pct(s['heldout_before'], s['heldout_before_std'])} | "
            f"{_pct(s['heldout_after'], s['heldout_after_std'])} | "
            f"{_pct(s['reward_first_fifth'], s['reward_first_fifth_std'])} | "
            f"{_pct(s['reward_last_fifth'], s['reward_last_fifth_std'])} | {ent} | {tps} |"
        )
    per_seed = ["", "train s / step: wall time of the training steps with the other runs of the call sharing the "
                "device and the CPU cores; not a speed measurement.", "",
                "Held-out accuracy after training, per seed:", ""]
    for s in result["variants"]:
        accs = [f"{r['seed']}: {_pct(r['heldout_after'])}" for r in result["rows"]
                if r["variant"] == s["variant"] and r["status"] == "ok"]
        per_seed.append(f"- {s['variant']}: " + ", ".join(accs))
    return "\n".join(lines + per_seed + paired(result, "autocast") + paired(result, "aqn")) + "\n"


def _without(variant: str, option: str) -> str | None:
    """The variant `variant` is compared with: the same without `option` ("autocast" or "aqn"), or
    None when it does not have that option."""
    v = parse_variant(variant)
    if not v[{"autocast": "bf16_autocast", "aqn": "aqn"}[option]]:
        return None
    return v["format"] + ("+aqn" if v["aqn"] and option != "aqn" else "") + (
        "@autocast" if v["bf16_autocast"] and option != "autocast" else "")


def paired(result: dict, option: str) -> list[str]:
    """Variants with `option` ("autocast": bf16 autocast, "aqn": AQN) against the same variant without
    it, on the seeds both ran: mean difference (with - without) of the held-out accuracy and of the
    last fifth's reward, with its standard error, per variant and over all pairs."""
    ok = {(r["variant"], r["seed"]): r for r in result["rows"] if r["status"] == "ok"}
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    for (variant, seed), on in ok.items():
        base = _without(variant, option)
        if base is not None and (base, seed) in ok:
            pairs.setdefault(variant, []).append((ok[(base, seed)], on))
    if not pairs:
        return []
    what = {"autocast": "bf16 autocast", "aqn": "AQN"}[option]
    out = ["", f"{what} on - off, paired by seed (mean +- standard error, points):", "",
           "| variant | pairs | held-out after | reward last 1/5 |", "|---|---|---|---|"]

    def cell(ps, key):
        m, sd = _mean_std([on[key] - off[key] for off, on in ps])
        se = sd / math.sqrt(len(ps)) if len(ps) > 1 else float("nan")
        return f"{100 * m:+.1f} +- {100 * se:.1f}"

    everything = [p for ps in pairs.values() for p in ps]
    for variant, ps in list(pairs.items()) + [("all", everything)]:
        out.append(f"| {variant} | {len(ps)} | {cell(ps, 'heldout_after')} | {cell(ps, 'reward_last_fifth')} |")
    return out


def _smooth(xs: list[float], w: int) -> list[float]:
    return [sum(xs[max(0, i - w + 1) : i + 1]) / len(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def plot(result: dict, path: Path, window: int = 5) -> Path | None:
    """Reward per step (mean over seeds, running mean over `window` steps) and entropy per variant."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bases = list(dict.fromkeys(s["variant"].partition("@")[0] for s in result["variants"]))
    for s in result["variants"]:
        base, _, mod = s["variant"].partition("@")
        style = {"color": f"C{bases.index(base) % 10}", "linestyle": "--" if mod else "-"}
        ok = [r for r in result["rows"] if r["variant"] == s["variant"] and r["status"] == "ok" and r["rewards"]]
        if not ok:
            continue
        n = min(len(r["rewards"]) for r in ok)
        rew = [sum(r["rewards"][i] for r in ok) / len(ok) for i in range(n)]
        ent = [sum(r["entropies"][i] for r in ok) / len(ok) for i in range(min(len(r["entropies"]) for r in ok))]
        label = f"{s['variant']} ({len(ok)} seeds)"
        ax1.plot(range(1, n + 1), _smooth(rew, window), label=label, **style)
        ax2.plot(range(1, len(ent) + 1), _smooth(ent, window), label=label, **style)
    ax1.set(xlabel="step", ylabel=f"reward (mean over seeds, running mean of {window})", title="reward")
    ax2.set(xlabel="step", ylabel="sampling entropy", title="entropy (dashed: bf16 autocast)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Embedded RL runs on {result['device']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def combine(paths: list[str]) -> dict:
    """One sweep from several (e.g. more seeds in a later call): rows of every file, a (variant,
    seed) measured twice kept from the later file, variants in first-seen order, statistics
    recomputed. Device and software must agree; each row keeps the command and date of its call."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    for r in results[1:]:
        for key in ("device", "torch", "steps"):
            if r[key] != results[0][key]:
                raise ValueError(f"cannot combine: {key} {r[key]!r} differs from {results[0][key]!r}")
    rows: dict[tuple[str, int], dict] = {}
    order: list[str] = []
    for r in results:
        for row in r["rows"]:
            rows[(row["variant"], row["seed"])] = {"command": r["command"], "date": r["date"], **row}
            if row["variant"] not in order:
                order.append(row["variant"])
    ordered = sorted(rows.values(), key=lambda x: (order.index(x["variant"]), x["seed"]))
    variants = [parse_variant(v) for v in order]
    return {**{k: results[0][k] for k in ("device", "torch", "triton", "steps")},
            "date": results[-1]["date"], "command": " ; ".join(r["command"] for r in results),
            "combined_from": [str(p) for p in paths], "rows": ordered, "variants": variant_stats(ordered, variants)}


def report(paths: list[str], report_dir: str) -> None:
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for p in paths:
        result = json.loads(Path(p).read_text())
        stem = Path(p).stem
        parts.append(f"## {stem} (`{p}`)\n\n`{result['command']}`\n\n" + table(result))
        png = plot(result, out / f"{stem}_curves.png")
        if png:
            parts.append(f"![reward and entropy per step]({png.name})\n")
    (out / "learning.md").write_text("# Embedded RL learning runs\n\n" + "\n".join(parts))
    print("\n".join(parts))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bf16,nvfp4,nvfp4+aqn")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per run (0: torch's default)")
    ap.add_argument("--num-eval", type=int, default=64)
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--runs-dir", default="runs/learning")
    ap.add_argument("--out", default=None, help="JSON written after each finished run")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="render tables and plots of finished sweeps")
    ap.add_argument("--report-dir", default="reports/learning")
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="merge finished sweeps into --out")
    args = ap.parse_args(argv)
    args.argv = argv
    if args.combine:
        if not args.out:
            print("bench_learning: --combine needs --out", file=sys.stderr)
            return 2
        try:
            result = combine(args.combine)
        except (ValueError, KeyError, OSError) as e:
            print(f"bench_learning: {e}", file=sys.stderr)
            return 2
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(table(result))
        return 0
    if args.report:
        report(args.report, args.report_dir)
        return 0
    try:
        variants = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        print(f"bench_learning: {e}", file=sys.stderr)
        return 2
    if not variants:
        print("bench_learning: --variants is empty", file=sys.stderr)
        return 2
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result = sweep(args, variants, seeds)
    print(table(result))
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
