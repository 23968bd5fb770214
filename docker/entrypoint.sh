#!/bin/sh
# Entry point of the qerl images: create the shared state folders (the volume may be new), fail
# fast with a readable line when a GPU worker has no GPU, then run the command.
#   QERL_REQUIRE_GPU=1   the container must see a CUDA GPU (GPU workers)
set -eu
mkdir -p /state/mlruns /state/qerl-cache /state/prefect-home /state/prefect-results 2>/dev/null || true
if [ "${QERL_REQUIRE_GPU:-0}" = "1" ]; then
    python - <<'PY'
import os, sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"qerl: this GPU worker sees no CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
             f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
             "start it with --gpus / the nvidia runtime, or use the CPU worker")
print(f"qerl: GPU worker on {torch.cuda.get_device_name(0)} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'all')})")
PY
fi
exec "$@"
