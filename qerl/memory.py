"""Memory accounting: bytes per decoder linear layer and in total, by format.

bits_per_weight counts every byte a linear layer stores (packed codes, group scales, global
scales) over its number of weights: nvfp4 4.5 (+32 bits per tensor), mxfp4 4.25, nf4 4.5
(4.127 with double quantisation), bf16 16.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

from torch import nn

from qerl.nn.quant_linear import QuantLinear


def _linear_bytes_and_weights(mod: nn.Module) -> tuple[int, int]:
    if isinstance(mod, QuantLinear):
        return mod.storage_bytes(), mod.in_features * mod.out_features
    w = mod.weight
    return w.numel() * w.element_size(), w.numel()


def memory_report(model: nn.Module) -> dict:
    """{'per_layer': {name: {'bytes', 'weights', 'bits_per_weight', 'format'}}, 'linear_bytes',
    'linear_weights', 'bits_per_weight', 'total_bytes'} for the decoder linear layers
    (QuantLinear or nn.Linear under `.layers.`); total_bytes counts every parameter and buffer
    once (tied embeddings counted once)."""
    from qerl.quantize import decoder_linears

    layers = dict(decoder_linears(model))
    layers.update({n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)})
    per_layer = {}
    for name, mod in layers.items():
        nbytes, nweights = _linear_bytes_and_weights(mod)
        per_layer[name] = {
            "bytes": nbytes,
            "weights": nweights,
            "bits_per_weight": 8 * nbytes / nweights,
            "format": mod.fmt if isinstance(mod, QuantLinear) else str(mod.weight.dtype).replace("torch.", ""),
        }
    linear_bytes = sum(v["bytes"] for v in per_layer.values())
    linear_weights = sum(v["weights"] for v in per_layer.values())
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    # a weight held only in the kernels' layout (QuantLinear.compacted) counts at its format's size
    total += sum(m.storage_bytes() - sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
                 for m in model.modules() if isinstance(m, QuantLinear) and m.compacted)
    return {
        "per_layer": per_layer,
        "linear_bytes": linear_bytes,
        "linear_weights": linear_weights,
        "bits_per_weight": 8 * linear_bytes / max(linear_weights, 1),
        "total_bytes": total,
    }


def checkpoint_bytes(path: str | Path) -> int:
    """Size of the weight files (*.safetensors) of a saved checkpoint."""
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


def device_name(device: str) -> str:
    """What a run's numbers were measured on, for its MLflow tags, the report and the demo's summary: the
    accelerator's name ("NVIDIA H200") for a CUDA device, "cpu" otherwise. Speed and memory results differ between
    accelerators (an H200's bandwidth is 1.4x an H100's), so a table regenerated from runs needs it. Call it
    where the device is already in use: for CUDA it reads the device's properties."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return dev.type
    return torch.cuda.get_device_name(dev)


def _clear_error_frames(exc: BaseException) -> None:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # frames still running (the caller's) are left as they are
        todo += [e.__cause__, e.__context__]


def release_on_error(step):
    """Decorator for the pipeline's steps: when `step` raises, the local variables of the frames its error went
    through are cleared (along the error's cause / context chain) before the error goes on. A failed step's model,
    optimiser, KV cache and activations are then freed at once instead of living on in the error's traceback for as
    long as someone holds the error: a Prefect flow holds a failed task's exception until the flow ends, so the
    formats after a step that ran out of memory would otherwise run out too. The error's type, message and
    traceback text are unchanged."""

    @functools.wraps(step)
    def run(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except BaseException as exc:
            _clear_error_frames(exc)
            raise

    return run
