"""The `qerl` command line.

    qerl reproduce embedded                 # the Prefect flow: quantize -> evaluate -> report
    qerl reproduce smoke --set generation.max_new_tokens=8 --set formats=bf16,nvfp4
    qerl quantize embedded -f nvfp4         # one step at a time (own MLflow runs)
    qerl evaluate embedded -f nvfp4
    qerl report embedded                    # rebuild the table from the latest flow run
    qerl ablation embedded --seeds 0,1,2 --set train.grpo.bf16_autocast=true   # mean +- std over seeds
    qerl ui                                 # MLflow UI on http://127.0.0.1:5000
    qerl validate recipes/qwen2.5-7b.yaml   # check a recipe, print it resolved
    qerl bench log benchmarks/results/grpo_step.json   # a benchmark result file -> an MLflow run
    qerl bench table --out reports/efficiency          # Table 3 etc. from those runs

A RECIPE is a YAML path or a name in recipes/ ("embedded" -> recipes/embedded.yaml).
Bad input (unknown recipe key, format, benchmark; missing data or model) prints one line
`error: ...` and exits with code 2. Prefect and MLflow are imported only by the commands that
need them, so `qerl --help` stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator, Optional

import typer

app = typer.Typer(
    name="qerl",
    help="QeRL pipeline: quantize LLMs to bf16/nf4/mxfp4/nvfp4, train LoRA adapters with GRPO/DAPO (+ AQN), "
    "evaluate, report the paper's tables (Prefect flows, MLflow tracking).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

RECIPE_HELP = 'Recipe: a YAML path, or a name in recipes/ (e.g. "embedded", "smoke").'
SET_HELP = (
    "Override a recipe key, dotted, value in YAML (repeatable): "
    "--set generation.max_new_tokens=32 --set benchmarks.0.limit=10 --set formats=bf16,nvfp4"
)


def _user_errors() -> tuple[type[BaseException], ...]:
    from qerl.data import DataError
    from qerl.deploy import GPUUnavailableError
    from qerl.efficiency import BenchmarkError
    from qerl.eval.harness import HarnessError
    from qerl.formats import FormatError
    from qerl.model import ModelError
    from qerl.recipe import RecipeError

    return (RecipeError, FormatError, DataError, ModelError, HarnessError, GPUUnavailableError, BenchmarkError)


def _run_failures() -> tuple[type[BaseException], ...]:
    # only classes of modules this run imported: a failure of a kind never imported cannot have happened
    found = []
    if "torch" in sys.modules:
        found.append(sys.modules["torch"].OutOfMemoryError)
    if "qerl.rl.trainer" in sys.modules:
        found.append(sys.modules["qerl.rl.trainer"].TrainingError)
    return tuple(found)


@contextmanager
def _errors_in_one_line() -> Iterator[None]:
    """Bad input (RecipeError / FormatError / DataError / ModelError / HarnessError, or a device this machine lacks)
    -> `error: <one line>`, exit code 2; a step that ran out of memory or could not train on (TrainingError) ->
    `error: <one line>` and where its traceback is, exit code 1. Anything else keeps its traceback."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        bad_input = isinstance(exc, _user_errors())
        if not bad_input and not isinstance(exc, _run_failures()):
            raise
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        if not bad_input:
            typer.echo("the failed step's MLflow run has the traceback in its error.txt (qerl ui); checkpoints on "
                       "disk are kept, and a rerun reuses them", err=True)
        raise typer.Exit(2 if bad_input else 1) from None


def _load(recipe: str, overrides: Optional[list[str]], *, runs: bool = False):
    """(path, overrides, recipe); `runs`: the command is about to run steps on the recipe's device, so a device
    this machine lacks (device: cuda on a CPU-only machine, cuda:3 with two GPUs) stops it here in one line."""
    from qerl.recipe import load_recipe, parse_overrides, resolve_recipe_path

    path = resolve_recipe_path(recipe)
    ov = parse_overrides(overrides)
    rec = load_recipe(path, ov)
    if runs:
        from qerl.deploy import check_device

        check_device(rec)
    return path, ov, rec


def _quiet_prefect_defaults() -> None:
    # An offline machine cannot send Prefect's telemetry: don't log an error about it.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _print_result(result: dict) -> None:
    rows = result.get("rows", [])
    if rows:
        typer.echo("")
        for row in rows:
            accs = ", ".join(
                f"{k[: -len('_accuracy')]} {100 * v:.1f}%" for k, v in row.items() if k.endswith("_accuracy")
            )
            typer.echo(f"  {row['variant']:<15} {accs}")
    typer.echo("")
    for key, label in (("table_md", "table"), ("table_html", "html"), ("summary_json", "summary"), ("plot_png", "plot"), ("curves_png", "curves")):
        if result.get(key):
            typer.echo(f"{label + ':':<9}{result[key]}")
    typer.echo(f"MLflow:  parent run {result.get('parent_run_id')}; browse with `make ui` or")
    typer.echo(f"         {result.get('mlflow_ui')}")


@app.command()
def reproduce(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
    local: bool = typer.Option(False, "--local", help="Run the steps in this process without Prefect (debugging)."),
) -> None:
    """Run the reproduce-table flow: per format quantize -> evaluate; with a train section, per variant train
    (GRPO/DAPO LoRA on its format's checkpoint) -> evaluate; then the report."""
    with _errors_in_one_line():
        path, overrides, rec = _load(recipe, set_, runs=True)  # bad recipe or device: exit 2 before any run exists
        typer.echo(f"recipe {rec.name} ({path}): model {rec.model.name}, formats {', '.join(rec.formats)}")
        if local:
            from qerl.pipeline import run_local

            result = run_local(rec)
        else:
            _quiet_prefect_defaults()
            from flows.reproduce_table import run

            result = run(str(path), overrides or None)
    _print_result(result)


@app.command()
def ablation(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Distinct integer seeds, comma-separated."),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
) -> None:
    """Run the recipe once per seed (the reproduce-table flow, one seed after the other, in this
    process), then write mean +- std per variant to <report_dir>/ablation/ (json, md, png)."""
    with _errors_in_one_line():
        path, overrides, rec = _load(recipe, set_, runs=True)
        _quiet_prefect_defaults()
        from flows.ablation import ablation as ablation_flow
        from qerl.recipe import parse_seeds

        try:
            seed_list = parse_seeds(seeds)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"recipe {rec.name} ({path}): seeds {', '.join(map(str, seed_list))}")
        result = ablation_flow(str(path), seed_list, overrides=overrides or None)
    typer.echo(f"ablation: {result['ablation_md']}")
    typer.echo(f"MLflow:  run {result['mlflow_run_id']}; browse with `make ui`")


@app.command()
def quantize(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    fmt: Optional[list[str]] = typer.Option(None, "--format", "-f", help="Format(s) to build (default: the recipe's)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a complete checkpoint exists."),
    parent_run_id: Optional[str] = typer.Option(None, "--parent-run-id", help="Nest the MLflow run under this run."),
    quantizer: Optional[str] = typer.Option(
        None, "--quantizer", help="qerl (default, exact, no calibration) or llm-compressor (oneshot NVFP4A16/MXFP4A16)."
    ),
) -> None:
    """Quantize the recipe's model and save a checkpoint per format (one MLflow run each)."""
    with _errors_in_one_line():
        from qerl.formats import check_format

        _, _, rec = _load(recipe, [*(set_ or []), *([f"quantizer={quantizer}"] if quantizer else [])], runs=True)
        formats = [check_format(f) for f in (fmt or rec.formats)]
        from qerl.pipeline import preload, quantize_step

        preload()
        for f in formats:
            path = quantize_step(rec, f, parent_run_id=parent_run_id, force=force)
            typer.echo(f"{f}: {path}")


@app.command()
def evaluate(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    fmt: Optional[list[str]] = typer.Option(None, "--format", "-f", help="Format(s) to evaluate (default: the recipe's)."),
    checkpoint: Optional[str] = typer.Option(
        None, "--checkpoint", "-c", help="Checkpoint directory (default: the recipe's, built first if missing)."
    ),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
    parent_run_id: Optional[str] = typer.Option(None, "--parent-run-id", help="Nest the MLflow runs under this run."),
) -> None:
    """Evaluate checkpoints on the recipe's benchmarks (quantizing first where needed)."""
    with _errors_in_one_line():
        from qerl.formats import check_format

        _, _, rec = _load(recipe, set_, runs=True)
        formats = [check_format(f) for f in (fmt or rec.formats)]
        if checkpoint and len(formats) != 1:
            typer.echo("error: --checkpoint needs exactly one --format", err=True)
            raise typer.Exit(2)
        from qerl.checkpoint import is_complete
        from qerl.pipeline import checkpoint_dir, evaluate_step, preload, quantize_step

        preload()
        for f in formats:
            ckpt = checkpoint or str(checkpoint_dir(rec, f))
            if not checkpoint and not is_complete(ckpt):
                ckpt = quantize_step(rec, f, parent_run_id=parent_run_id)
            row = evaluate_step(rec, f, ckpt, parent_run_id)
            accs = ", ".join(
                f"{b} {100 * row[f'{b}_accuracy']:.1f}% (n={int(row[f'{b}_n'])}, entropy {row[f'{b}_entropy']:.3f})"
                for b in rec.benchmark_names()
            )
            typer.echo(f"{row['variant']}: {accs}  [MLflow run {row['mlflow_run_id']}]")


@app.command()
def report(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    run_id: Optional[str] = typer.Option(
        None, "--run-id", help="Parent (flow) MLflow run id (default: the recipe's latest flow run)."
    ),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
) -> None:
    """Write reports/<recipe>/table.md, table.html, summary.json from a flow run's MLflow runs."""
    with _errors_in_one_line():
        _, _, rec = _load(recipe, set_)
        from qerl.report import build_report
        from qerl.tracking import Tracker

        tracker = Tracker(rec.mlflow)
        parent = run_id or tracker.latest_parent_run(rec.name)
        if parent is None:
            typer.echo(
                f"error: no flow run of recipe {rec.name!r} in experiment {rec.mlflow.experiment!r} "
                f"at {rec.mlflow.tracking_uri}; run `qerl reproduce {recipe}` first",
                err=True,
            )
            raise typer.Exit(2)
        paths = build_report(rec, parent, tracker)
    for key, path in paths.items():
        typer.echo(f"{key}: {path}")


@app.command()
def validate(
    recipe: str = typer.Argument(..., help=RECIPE_HELP),
    set_: Optional[list[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
) -> None:
    """Check a recipe and print it with every default filled in."""
    with _errors_in_one_line():
        path, _, rec = _load(recipe, set_)
    typer.echo(f"# {path}: valid")
    typer.echo(rec.to_yaml().rstrip())


@app.command()
def ui(
    recipe: Optional[str] = typer.Argument(None, help="Recipe whose tracking store to open (default: sqlite:///mlflow.db)."),
    uri: Optional[str] = typer.Option(None, "--uri", help="Backend store URI (overrides the recipe's)."),
    port: int = typer.Option(5000, "--port", help="Port on 127.0.0.1."),
) -> None:
    """Start the MLflow UI on the tracking store (Ctrl-C stops it)."""
    with _errors_in_one_line():
        if uri is None:
            uri = _load(recipe, None)[2].mlflow.tracking_uri if recipe else "sqlite:///mlflow.db"
    from qerl.tracking import resolve_tracking_uri

    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", resolve_tracking_uri(uri),
           "--host", "127.0.0.1", "--port", str(port)]
    typer.echo(f"MLflow UI: http://127.0.0.1:{port}  ({' '.join(cmd[2:])})")
    try:
        raise typer.Exit(subprocess.call(cmd))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


bench_app = typer.Typer(help="Benchmark result files (benchmarks/bench_*.py JSON) in MLflow, and the efficiency "
                          "tables (the paper's Table 3, rollouts, kernels, memory) rebuilt from those runs.",
                         no_args_is_help=True)
app.add_typer(bench_app, name="bench")
BENCH_URI_HELP = "MLflow backend store URI."
BENCH_EXPERIMENT_HELP = "MLflow experiment of the benchmark runs."


@bench_app.command("log")
def bench_log(
    files: list[str] = typer.Argument(..., help="Benchmark result JSON files (grpo_step, memory, rollout, w4a16) or "
                                      "quoted glob patterns."),
    uri: str = typer.Option("sqlite:///mlflow.db", "--uri", help=BENCH_URI_HELP),
    experiment: str = typer.Option("qerl-benchmarks", "--experiment", help=BENCH_EXPERIMENT_HELP),
) -> None:
    """Log each file as one MLflow run (params, per-row metrics, the file as artifact); files already logged are skipped."""
    with _errors_in_one_line():
        from qerl.efficiency import expand_files, log_results

        done = log_results(expand_files(files), uri, experiment)
    for d in done:
        typer.echo(f"{'logged' if d['logged'] else 'already logged'}  {d['kind']:<9} {d['path']}  [MLflow run {d['run_id']}]")


@bench_app.command("table")
def bench_table(
    out: str = typer.Option("reports/efficiency", "--out", help="Folder for table.md, efficiency.json, step_speedup.png."),
    uri: str = typer.Option("sqlite:///mlflow.db", "--uri", help=BENCH_URI_HELP),
    experiment: str = typer.Option("qerl-benchmarks", "--experiment", help=BENCH_EXPERIMENT_HELP),
) -> None:
    """Rebuild the efficiency tables from the benchmark runs in MLflow (newest measurement per cell)."""
    with _errors_in_one_line():
        from qerl.efficiency import build_tables, log_report, write_report

        tables = build_tables(uri, experiment)
        paths = write_report(tables, out)
        run_id = log_report(paths, uri, experiment)
    typer.echo(f"{len(tables['step'])} GRPO step cells, {len(tables['rollout'])} rollout cells, "
               f"{len(tables['kernels'])} kernel cells, {len(tables['memory'])} memory cells from {tables['runs']} runs")
    for key, path in paths.items():
        typer.echo(f"{key}: {path}")
    typer.echo(f"MLflow:  run {run_id} (efficiency/report) holds them; browse with `qerl ui --uri {uri}`")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
