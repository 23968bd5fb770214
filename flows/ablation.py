"""Prefect flow `ablation`: the reproduce-table recipe once per seed, then mean +- std per variant.

    python -m flows.ablation smoke 0,1                      # in-process, one seed after the other
    prefect deployment run ablation/formats                 # prefect.yaml: per seed a run of reproduce-table/qwen2.5-3b
    prefect deployment run ablation/aqn                     # every format with AQN off and on, seeds 0-2

Fan-out: one reproduce-table run per seed (the recipe with `seed` overridden, its own report
directory <report_dir>/seed<s>), either
- as in-process subflows, one after the other (`deployment` unset: laptops, tests), or
- as flow runs of a deployment (`deployment: reproduce-table/qwen2.5-3b`), all submitted at
  once: each is its own flow-run process, picked up by whichever GPU worker is free (one
  worker per GPU, CUDA_VISIBLE_DEVICES, `--limit 1`; docs/deployments.md), so the seeds run in
  parallel over the GPUs and queue when there are more seeds than GPUs. A rerun of a failed
  ablation finds its seed runs again (idempotency keys) and retries only the failed ones.

Each seed quantises nothing new after the first (checkpoints are cached on disk by model +
revision + format + quantizer version). The aggregate reads every seed's MLflow runs (the
evaluate and train runs under its parent run) and writes <report_dir>/ablation/ablation.json
(`{"rows": [{"variant", "format", "aqn", "n_seeds", "<metric>_mean", "<metric>_std", ...}],
"aqn_effects": [{"format", "aqn_off", "aqn_on", "<metric>_diff_mean", "<metric>_diff_std", ...}]}`: AQN on - off
per format, paired by seed, where both variants of a format ran), ablation.md and ablation.png (accuracy grouped by
format: base, trained, trained + AQN), and logs them to an MLflow run `ablation/<recipe>` (metrics
`<variant>.<metric>_mean` / `_std`, `aqn_effect.<format>.<metric>_diff_mean` / `_std`). The aggregation is
qerl.ablation's. A seed that failed is left out and named; the flow then fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from qerl.ablation import aggregate, aqn_effects, render_markdown, render_plot, seed_rows
from qerl.recipe import Recipe, load_recipe, parse_seeds  # noqa: F401  (parse_seeds: this module's CLI and qerl.cli)

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def seed_overrides(recipe: Recipe, base: dict[str, Any], seed: int) -> dict[str, Any]:
    return {**base, "seed": seed, "report_dir": str(Path(recipe.report_dir) / f"seed{seed}")}


def _wait_for(flow_run_ids: list, logger) -> dict:
    """Poll the API until every flow run is in a terminal state -> {id: FlowRun}."""
    from prefect import get_client

    done: dict = {}
    with get_client(sync_client=True) as client:
        while len(done) < len(flow_run_ids):
            for fid in flow_run_ids:
                if fid in done:
                    continue
                fr = client.read_flow_run(fid)
                if fr.state and fr.state.type.value in TERMINAL:
                    done[fid] = fr
                    logger.info("seed run %s: %s", fr.name, fr.state.type.value)
            if len(done) < len(flow_run_ids):
                time.sleep(10)
    return done


def _run_seeds_on_deployment(recipe_path, recipe, base, seeds, deployment, logger) -> tuple[dict[int, str], dict[int, str]]:
    """Submit one flow run of `deployment` per seed, wait for all -> ({seed: flow run id} completed, {seed: error})."""
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.runtime import flow_run
    from prefect.states import Scheduled

    runs = {}
    for s in seeds:
        fr = run_deployment(
            deployment,
            parameters={"recipe_path": recipe_path, "overrides": seed_overrides(recipe, base, s)},
            timeout=0,
            idempotency_key=f"{flow_run.id}:{deployment}:seed{s}",  # a rerun finds the same run
            tags=["ablation", f"seed:{s}"],
        )
        if fr.state and fr.state.type.value in ("FAILED", "CRASHED", "CANCELLED"):
            with get_client(sync_client=True) as client:  # rerun it: its completed tasks are cached
                client.set_flow_run_state(fr.id, Scheduled(message="retried by ablation"), force=True)
        runs[s] = fr.id
        logger.info("seed %d: flow run %s of %s", s, fr.name, deployment)
    finished = _wait_for(list(runs.values()), logger)
    ok, failed = {}, {}
    for s, fid in runs.items():
        state = finished[fid].state
        if state.type.value == "COMPLETED":
            ok[s] = str(fid)
        else:
            failed[s] = f"flow run {fid} {state.type.value}: {state.message}"
    return ok, failed


def _parent_of(recipe: Recipe, flow_run_id: str) -> str | None:
    from qerl.tracking import Tracker

    tracker = Tracker(recipe.mlflow)
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.step = 'flow'",
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


@flow(name="ablation", log_prints=True)
def ablation(
    recipe_path: str,
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    formats: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    deployment: str | None = None,
) -> dict[str, Any]:
    """Run `recipe_path` once per seed (default 0, 1, 2), optionally restricted to `variants` and
    `formats`; aggregate mean +- std per variant; -> {"ablation_json", "ablation_md", "rows", ...}."""
    from qerl import deploy
    from qerl.tracking import Tracker

    logger = get_run_logger()
    seeds = list(seeds if seeds is not None else [0, 1, 2])
    base = dict(overrides or {})
    if variants is not None:
        base["train.variants"] = list(variants)
    if formats is not None:
        base["formats"] = list(formats)
    try:
        recipe = load_recipe(recipe_path, base)
        if not deployment:
            deploy.check_device(recipe)  # the seeds run here
    except Exception as exc:
        logger.error("cannot run ablation of recipe %r: %s", recipe_path, exc)
        raise
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and non-empty, got {seeds}")

    parents: dict[int, str] = {}
    failed: dict[int, str] = {}
    if deployment:
        ok, failed = _run_seeds_on_deployment(recipe_path, recipe, base, seeds, deployment, logger)
        for s, fid in ok.items():
            parent = _parent_of(recipe, fid)
            if parent:
                parents[s] = parent
            else:
                failed[s] = f"no MLflow parent run tagged prefect.flow_run_id={fid} in {recipe.mlflow.tracking_uri}"
    else:
        from flows.reproduce_table import reproduce_table

        for s in seeds:
            logger.info("seed %d: reproduce-table %s", s, recipe.name)
            state = reproduce_table.with_options(flow_run_name=f"{recipe.name}-seed{s}")(
                recipe_path, seed_overrides(recipe, base, s), return_state=True
            )
            if state.is_completed():
                parents[s] = state.result()["parent_run_id"]
            else:
                failed[s] = f"{state.type.value}: {state.message}"
                logger.error("seed %d failed: %s", s, state.message)

    per_seed = {s: seed_rows(load_recipe(recipe_path, seed_overrides(recipe, base, s)), p) for s, p in parents.items()}
    rows = aggregate(recipe, per_seed)
    effects = aqn_effects(recipe, per_seed)
    out = Path(recipe.report_dir) / "ablation"
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "recipe": recipe.name,
        "model": recipe.model.name,
        "seeds": seeds,
        "completed_seeds": sorted(parents),
        "failed_seeds": {str(s): m for s, m in failed.items()},
        "parent_runs": {str(s): p for s, p in parents.items()},
        "rows": rows,
        "aqn_effects": effects,
    }
    paths = {"ablation_json": out / "ablation.json", "ablation_md": out / "ablation.md"}
    paths["ablation_json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["ablation_md"].write_text(render_markdown(recipe, rows, seeds, failed, effects))
    png = render_plot(recipe, rows, out / "ablation.png")
    if png:
        paths["ablation_png"] = png

    from prefect.runtime import flow_run

    tracker = Tracker(recipe.mlflow)
    run_id = tracker.start_run(
        recipe,
        f"ablation/{recipe.name}",
        tags={"step": "ablation", "seeds": ",".join(map(str, seeds)), "prefect.flow_run_id": str(flow_run.id or "")},
        params={"ablation.seeds": ",".join(map(str, seeds)), "ablation.deployment": deployment or "in-process"},
    )
    with tracker.tracked(run_id):
        metrics = {}
        for r in rows:
            for k, v in r.items():
                if k.endswith(("_mean", "_std")) and isinstance(v, float):
                    metrics[f"{r['variant']}.{k}"] = v
            metrics[f"{r['variant']}.n_seeds"] = r["n_seeds"]
        for e in effects:  # e.g. aqn_effect.nvfp4.gsm8k_accuracy_diff_mean
            for k, v in e.items():
                if k.endswith(("_diff_mean", "_diff_std")):
                    metrics[f"aqn_effect.{e['format']}.{k}"] = v
        tracker.log_metrics(run_id, metrics)
        for p in paths.values():
            tracker.log_artifact(run_id, p, "ablation")
        for s, parent in parents.items():
            tracker.set_tags(parent, {"ablation_run_id": run_id})
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(seeds)} seed(s) failed: " + "; ".join(f"seed {s}: {m}" for s, m in sorted(failed.items())))
    print(f"ablation: {paths['ablation_md']}\nMLflow run {run_id}")
    return {"mlflow_run_id": run_id, "rows": rows, **{k: str(v) for k, v in paths.items()}, "parent_runs": parents}


if __name__ == "__main__":
    ablation(
        sys.argv[1] if len(sys.argv) > 1 else "smoke",
        parse_seeds(sys.argv[2]) if len(sys.argv) > 2 else None,
    )
