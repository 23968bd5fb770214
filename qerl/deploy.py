"""Deployment helpers: GPU checks, the "gpu" concurrency limit, work pools, and the MLflow
parent run of a (re)run flow run. Used by the flows and by `make work-pools` / `make deploy`.

    python -m qerl.deploy setup                 # work pools + the "gpu" limit (one slot per GPU)
    python -m qerl.deploy setup --gpus 8        # a GPU host other than this one
    python -m qerl.deploy check-gpu qwen2.5-7b --set device=cuda
    python -m qerl.deploy templates             # rewrite docker/work-pools/*.json from Prefect's defaults

How GPUs are scheduled (docs/deployments.md): one process worker per GPU on the pool
`qerl-gpu`, each started with CUDA_VISIBLE_DEVICES=<i> and `--limit 1`, so every flow run is
its own process that sees exactly one GPU; on top, every GPU-heavy task (quantize, train,
evaluate on cuda) holds a slot of the Prefect global concurrency limit "gpu" (one slot per
GPU), so GPU work started any other way (an ablation's in-process seeds, `qerl reproduce`
against the same server) queues instead of fighting over memory.

Prefect and torch are imported where used: this module is imported by the flows only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from qerl.recipe import Recipe

REPO_ROOT = Path(__file__).resolve().parents[1]
WORK_POOL_DIR = REPO_ROOT / "docker" / "work-pools"
GPU_LIMIT = "gpu"
# name -> (worker type, template file): `qerl-process` is the default (CPU recipes, the ablation
# driver); `qerl-gpu` is a process pool with one worker per GPU; docker / kubernetes run the
# same deployments in the images of docker/.
WORK_POOLS: dict[str, tuple[str, str]] = {
    "qerl-process": ("process", "process.json"),
    "qerl-gpu": ("process", "process.json"),
    "qerl-docker": ("docker", "docker.json"),
    "qerl-k8s": ("kubernetes", "kubernetes.json"),
}

__all__ = [
    "GPU_LIMIT",
    "device_slot",
    "GPUUnavailableError",
    "WORK_POOLS",
    "check_device",
    "ensure_gpu_limit",
    "ensure_work_pools",
    "ensure_zombie_automation",
    "flow_parent_run",
    "gpu_count",
    "gpu_slot",
]


class GPUUnavailableError(RuntimeError):
    """A recipe asks for a CUDA device that this worker does not have (one readable line)."""


# ----------------------------------------------------------------------------- GPUs


def gpu_count() -> int:
    """CUDA devices visible to this process (after CUDA_VISIBLE_DEVICES); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_device(recipe: "Recipe") -> None:
    """Fail fast when the recipe says device: cuda[:i] and this process sees no such GPU.

    (device: auto falls back to the CPU; the GPU deployments in prefect.yaml set device=cuda so
    a 7B recipe never starts on a CPU worker by mistake.)
    """
    dev = recipe.device
    if not dev.startswith("cuda"):
        return
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    where = f"this worker ({socket.gethostname()}, torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES={visible})"
    hint = "run it on the GPU work pool (qerl-gpu, docs/deployments.md) or override device=cpu"
    if not torch.cuda.is_available():
        raise GPUUnavailableError(f"recipe {recipe.name!r} needs device {dev} but {where} has no usable CUDA GPU; {hint}")
    if ":" in dev and int(dev.split(":", 1)[1]) >= torch.cuda.device_count():
        raise GPUUnavailableError(
            f"recipe {recipe.name!r} needs device {dev} but {where} sees only {torch.cuda.device_count()} GPU(s); {hint}"
        )


@contextmanager
def gpu_slot(recipe: "Recipe") -> Iterator[bool]:
    """Hold one slot of the global concurrency limit "gpu" while a GPU-heavy step runs.

    A no-op (yields False) on a CPU. Waits as long as it takes for a slot; if the limit does not
    exist (no `qerl.deploy setup` on this server), runs without one. The slot is a lease that
    Prefect renews while the step runs and frees on its own if the process dies.
    """
    with device_slot(recipe.resolved_device(), recipe.max_workers) as held:
        yield held


@contextmanager
def device_slot(device: str, max_workers: int = 1) -> Iterator[bool]:
    """gpu_slot for work that names its device without a recipe (e.g. a benchmark's --device)."""
    if not device.startswith("cuda"):
        yield False
        return
    from prefect.concurrency.sync import concurrency

    # In one flow-run process (one GPU), at most max_workers GPU steps at once, whatever the task
    # runner's thread count; across processes, the "gpu" limit.
    with _process_gate(max_workers):
        with concurrency(GPU_LIMIT, occupy=1, strict=False, raise_on_lease_renewal_failure=False):
            yield True


_GATES: dict[int, threading.BoundedSemaphore] = {}
_GATES_LOCK = threading.Lock()


def _process_gate(n: int) -> threading.BoundedSemaphore:
    with _GATES_LOCK:
        return _GATES.setdefault(n, threading.BoundedSemaphore(n))


def ensure_gpu_limit(slots: int | None = None) -> int:
    """Create (or resize) the global concurrency limit "gpu": `slots` or one per visible GPU (min 1)."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    slots = slots if slots is not None else max(gpu_count(), 1)
    with get_client(sync_client=True) as client:
        try:
            gcl = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=slots))
        else:
            if gcl.limit != slots or not gcl.active:
                client.update_global_concurrency_limit(GPU_LIMIT, GlobalConcurrencyLimitUpdate(limit=slots, active=True))
    return slots


ZOMBIE_AUTOMATION = "qerl: crash zombie flow runs"


def ensure_zombie_automation(within_s: int = 90) -> bool:
    """The automation of Prefect's "detect zombie flows" guide: a flow run whose heartbeats stop
    for `within_s` seconds (its worker or machine died) is marked CRASHED, so it can be rerun
    (`prefect flow-run retry`). Needs PREFECT_FLOWS_HEARTBEAT_FREQUENCY (>= 30 s) in the
    workers' environment. -> True if created now."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        Automation.read(name=ZOMBIE_AUTOMATION)
        return False
    except ValueError:
        pass
    Automation(
        name=ZOMBIE_AUTOMATION,
        description="flow runs whose heartbeats stopped (worker or machine died) -> Crashed",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=f"no heartbeat for {within_s} s: worker or machine lost")],
    ).create()
    return True


# ----------------------------------------------------------------------------- work pools


def work_pool_template(kind: str) -> dict[str, Any]:
    """Our base job template of a worker type: Prefect's shipped default plus the project's defaults."""
    import prefect

    views = Path(prefect.__file__).parent / "server" / "api" / "collections_data" / "views" / "aggregate-worker-metadata.json"
    data = json.loads(views.read_text())
    default = next(w for ws in data.values() for t, w in ws.items() if t == kind)["default_base_job_configuration"]
    tpl = json.loads(json.dumps(default))
    props = tpl["variables"]["properties"]
    env_default = {"QERL_DATA_DIR": "/data/shared"}
    if kind == "process":
        env_default = {}
        props["stream_output"]["default"] = True
    elif kind == "docker":
        # the volumes and network of docker/compose.yaml: /state holds the MLflow store, the
        # checkpoint cache and Prefect's persisted results (the image links its paths there)
        props["image"]["default"] = "qerl-gpu:latest"
        props["volumes"]["default"] = ["qerl-state:/state", "qerl-data:/data", "qerl-reports:/opt/qerl/reports"]
        props["networks"]["default"] = ["qerl"]
        props["auto_remove"]["default"] = True
        # GPUs: prefect-docker has no device_requests variable; the docker worker's host runs
        # Docker with the NVIDIA runtime as default (docs/deployments.md).
    elif kind == "kubernetes":
        props["image"]["default"] = "qerl-gpu:latest"
        props["namespace"]["default"] = "qerl"
        props["gpu_count"] = {"title": "GPUs", "description": "nvidia.com/gpu limit of the flow-run pod", "type": "integer", "default": 1}
        container = tpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
        container.setdefault("resources", {}).setdefault("limits", {})["nvidia.com/gpu"] = "{{ gpu_count }}"
    if env_default:
        props["env"]["default"] = env_default
    return tpl


def write_work_pool_templates(out_dir: Path = WORK_POOL_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in sorted({k for k, _ in WORK_POOLS.values()}):
        path = out_dir / f"{kind}.json"
        path.write_text(json.dumps(work_pool_template(kind), indent=2) + "\n")
        paths.append(path)
    return paths


def ensure_work_pools(names: list[str] | None = None) -> list[str]:
    """Create the work pools of WORK_POOLS (from docker/work-pools/*.json) that do not exist yet."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    created = []
    with get_client(sync_client=True) as client:
        for name in names or list(WORK_POOLS):
            kind, file = WORK_POOLS[name]
            template = json.loads((WORK_POOL_DIR / file).read_text())
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template))
                created.append(name)
            except ObjectAlreadyExists:
                pass
    return created


# ----------------------------------------------------------------------------- MLflow parent


@contextmanager
def flow_parent_run(recipe: "Recipe", tags: dict[str, Any] | None = None) -> Iterator[str]:
    """The flow run's MLflow parent run: new, or, when this Prefect flow run is a rerun
    (`prefect flow-run retry`, a flow retry), the parent it started before, reopened.

    Reusing the parent is what lets the tasks' cache keys (tasks.step_cache_key, which include
    the parent run id) hit on a rerun: completed tasks are skipped and their child runs stay
    where the report looks for them. Children the dead attempt left RUNNING are marked KILLED.
    FINISHED on success, FAILED with the error on exception (qerl.tracking.Tracker.tracked).
    """
    from qerl import pipeline
    from qerl.tracking import _LOCK, PARENT_TAG, Tracker

    tags = dict(tags or {})
    tracker = Tracker(recipe.mlflow)
    flow_run_id = tags.get("prefect.flow_run_id")
    run_id = None
    if flow_run_id:
        with _LOCK:
            found = tracker.client.search_runs(
                [tracker.experiment_id],
                filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.step = 'flow'",
                max_results=1,
                order_by=["attributes.start_time ASC"],
            )
        if found:
            run_id = found[0].info.run_id
            with _LOCK:
                tracker.client.update_run(run_id, status="RUNNING")
                stale = tracker.client.search_runs(
                    [tracker.experiment_id],
                    filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and attributes.status = 'RUNNING'",
                )
            for run in stale:
                tracker.finish(run.info.run_id, "KILLED")
            attempts = int(found[0].data.tags.get("prefect.attempts", "1")) + 1
            tracker.set_tags(run_id, {"prefect.attempts": attempts, "resumed": "true"})
    if run_id is None:
        run_id = pipeline.start_parent_run(recipe, tags)
    with tracker.tracked(run_id):
        yield run_id


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl.deploy", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="create the work pools and the 'gpu' global concurrency limit")
    s.add_argument("--gpus", type=int, default=None, help="slots of the 'gpu' limit (default: GPUs visible here, min 1)")
    s.add_argument("--pool", action="append", choices=list(WORK_POOLS), help="only these pools (repeatable)")
    s.add_argument("--zombie-seconds", type=int, default=90, help="crash flow runs silent this long (0: no automation)")
    c = sub.add_parser("check-gpu", help="exit 1 with a readable message if RECIPE needs a GPU this machine lacks")
    c.add_argument("recipe")
    c.add_argument("--set", action="append", default=[], dest="sets")
    sub.add_parser("templates", help="rewrite docker/work-pools/*.json from Prefect's shipped defaults")
    args = parser.parse_args(argv)
    if args.cmd == "setup":
        created = ensure_work_pools(args.pool)
        slots = ensure_gpu_limit(args.gpus)
        print(f"work pools: {', '.join(args.pool or WORK_POOLS)} (created now: {', '.join(created) or 'none'})")
        print(f"global concurrency limit {GPU_LIMIT!r}: {slots} slot(s)")
        if args.zombie_seconds:
            ensure_zombie_automation(args.zombie_seconds)
            print(f"automation {ZOMBIE_AUTOMATION!r}: no heartbeat for {args.zombie_seconds} s -> Crashed "
                  "(workers need PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30)")
    elif args.cmd == "check-gpu":
        from qerl.recipe import load_recipe, parse_overrides

        try:
            check_device(load_recipe(args.recipe, parse_overrides(args.sets)))
        except (GPUUnavailableError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("ok")
    elif args.cmd == "templates":
        for p in write_work_pool_templates():
            print(p.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
