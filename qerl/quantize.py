"""quantize_: convert a Hugging Face causal LM's decoder linear layers to QuantLinear in place.

lm_head, embeddings and norms stay in their dtype (bf16). For nvfp4, the tensors that a
serving engine fuses share one global scale: q/k/v of each attention block and gate/up of each
MLP (the smallest g of the group, i.e. from the group's largest amax), as vLLM expects.

    summary = quantize_(model, "nvfp4")

`check_group_sizes` and `quantize_linears_` are its two steps, usable on a subset of the
linears (qerl.build quantises one decoder layer at a time with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from qerl.formats import GROUP_SIZE, NOMINAL_BITS, FormatError, check_format, nvfp4
from qerl.nn.quant_linear import QuantLinear

# Children of one module whose weights vLLM fuses into one matrix.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
NOT_QUANTISED = ("lm_head",)

__all__ = [
    "FormatError", "QuantSummary", "check_format", "check_group_sizes", "decoder_linears", "quantize_",
    "quantize_linears_",
]


class QuantizeOOM(torch.OutOfMemoryError):
    """Out of accelerator memory while building or quantising a model; one line saying what to do."""


def quantize_oom_hint(model: str, fmt: str, device: str) -> str:
    return (f"out of GPU memory quantizing {model} to {fmt} on {device}: quantize on the CPU first (qerl quantize "
            f"RECIPE --format {fmt} --set device=cpu; the checkpoint does not depend on the device, and the flow "
            f"reuses it), or free the GPU")


@dataclass
class QuantSummary:
    format: str
    layers_quantized: list[str] = field(default_factory=list)
    layers_skipped: list[str] = field(default_factory=list)  # left bf16 (allowed fallback)
    bits_per_weight: float = 16.0


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear of the decoder blocks, by qualified name (lm_head and others excluded)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in f".{name}" and name.split(".")[-1] not in NOT_QUANTISED:
            out[name] = mod
    return out


def _set_child(model: nn.Module, qualified: str, new: nn.Module) -> None:
    parent_name, _, child = qualified.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _fused_global_scales(linears: dict[str, nn.Linear]) -> dict[str, object]:
    scales = {}
    parents: dict[str, dict[str, str]] = {}
    for name in linears:
        parent, _, child = name.rpartition(".")
        parents.setdefault(parent, {})[child] = name
    for parent, children in parents.items():
        for group in FUSED_GROUPS:
            names = [children[c] for c in group if c in children]
            if len(names) > 1:
                g = nvfp4.shared_global_scale([linears[n].weight for n in names])
                scales.update({n: g for n in names})
    return scales


def check_group_sizes(linears: dict[str, nn.Linear], fmt: str, allow_bf16_fallback: bool = False) -> set[str]:
    """Names of the linears whose input dimension the format's group size does not divide.
    FormatError (naming the first, counting all) unless `allow_bf16_fallback` keeps them bf16."""
    if fmt == "bf16":
        return set()
    group = GROUP_SIZE[fmt]
    bad = {n: m for n, m in linears.items() if m.in_features % group}
    if bad and not allow_bf16_fallback:
        name, mod = next(iter(bad.items()))
        raise FormatError(
            f"layer {name} has input dimension {mod.in_features}, not divisible by the {fmt} group size {group} "
            f"({len(bad)} such layers); set allow_bf16_fallback to keep them bf16"
        )
    return set(bad)


def quantize_linears_(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    fmt: str,
    summary: QuantSummary,
    *,
    skip: set[str] = frozenset(),
    mxfp4_scale_rule: str = "ct",
    nf4_double_quant: bool = False,
    backend: str = "auto",
    progress: bool = False,
) -> None:
    """Replace the given linears of `model` (qualified name -> module, e.g. one decoder layer's)
    by QuantLinear in place; names in `skip` stay bf16. `linears` is consumed (emptied) so that
    each bf16 layer is freed once replaced. nvfp4 fused groups (q/k/v, gate/up) share one global
    scale when all members are in `linears`. Records names in `summary`."""
    gscales = _fused_global_scales(linears) if fmt == "nvfp4" else {}
    names = list(linears)
    if progress:
        from tqdm.auto import tqdm

        names = tqdm(names, desc=f"quantize {fmt}", unit="layer", leave=False)
    for name in names:
        # popped, so the bf16 layer is freed once replaced: peak memory = the model + one layer
        # (a 32B bf16 model that fills most of an 80 GB GPU can be quantised in place)
        lin = linears.pop(name)
        if name in skip:
            summary.layers_skipped.append(name)
            continue
        options = {}
        if fmt == "nvfp4" and name in gscales:
            options["weight_global_scale"] = gscales[name]
        elif fmt == "mxfp4":
            options["scale_rule"] = mxfp4_scale_rule
        elif fmt == "nf4":
            options["double_quant"] = nf4_double_quant
        try:
            q = QuantLinear.from_linear(lin, fmt, backend=backend, **options)
        except FormatError as e:
            raise FormatError(f"layer {name}: {e}") from None
        _set_child(model, name, q)
        summary.layers_quantized.append(name)


def quantize_(
    model: nn.Module,
    fmt: str,
    *,
    allow_bf16_fallback: bool = False,
    mxfp4_scale_rule: str = "ct",
    nf4_double_quant: bool = False,
    backend: str = "auto",
    progress: bool = True,
) -> QuantSummary:
    check_format(fmt)
    summary = QuantSummary(format=fmt)
    linears = decoder_linears(model)
    if fmt == "bf16":
        summary.layers_skipped = []
        return summary
    bad = check_group_sizes(linears, fmt, allow_bf16_fallback)
    quantize_linears_(
        model, linears, fmt, summary, skip=bad, mxfp4_scale_rule=mxfp4_scale_rule,
        nf4_double_quant=nf4_double_quant, backend=backend, progress=progress,
    )
    from qerl.memory import memory_report

    summary.bits_per_weight = memory_report(model)["bits_per_weight"] if summary.layers_quantized else NOMINAL_BITS["bf16"]
    return summary


def dequantize_(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every QuantLinear in `model` with a plain nn.Linear holding its dequantised weight (in `dtype`,
    default the dtype of the model's own parameters: embeddings, norms), in place; -> how many were replaced. What a plain Hugging Face or PEFT
    user needs: the model then loads adapters with `peft.PeftModel.from_pretrained`, runs in any harness and
    saves as an ordinary checkpoint. In float32 the weights are the 4-bit values exactly; in bf16 they are rounded
    once, as the bf16 dequantisation of the GPU's torch backend rounds them."""
    from qerl.nn.quant_linear import QuantLinear

    if any(type(m).__name__ == "QuantLoraLinear" for m in model.modules()):
        raise ValueError("dequantize_ takes the model without its LoRA adapters: dequantise the base, then load the "
                         "adapter onto it (peft.PeftModel.from_pretrained)")
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantLinear)]
    want = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    for name, q in found:
        linear = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device=q.storage_device, dtype=want)
        with torch.no_grad():
            linear.weight.copy_(q.dequantized_weight(want))
            if q.bias is not None:
                linear.bias.copy_(q.bias)
        _set_child(model, name, linear)
    return len(found)
