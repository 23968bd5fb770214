"""QeRL pipeline library: 4-bit formats, quantised linear layers, kernels, RL and evaluation.

`import qerl` stays light: it imports torch only, never Prefect, MLflow, Triton or vLLM,
and never initialises CUDA. Heavy pieces live in submodules that are imported where used.
"""

__version__ = "0.1.0"

# The weight formats the whole project speaks of, by these names everywhere
# (CLI, recipes, MLflow params, report columns).
FORMATS = ("bf16", "nf4", "mxfp4", "nvfp4")

__all__ = ["FORMATS", "__version__"]
