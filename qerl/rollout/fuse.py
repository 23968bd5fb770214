"""One product for the linears that share an input (q/k/v, gate/up), with no second weight copy.

    group = LinearGroup([attn.q_proj, attn.k_proj, attn.v_proj])
    q, k, v = group(x)

Decoding runs at small M, where every kernel launch and every pass over x costs about as much as
the bytes it moves: one fused q/k/v product and one gate/up product save 3 of the 7 launches per
layer. The fused weight is built once from the modules' own base weights and then *becomes*
their storage: each module's tensors are re-pointed at row slices of the fused ones, so the
trainer (which calls the modules) and the engine (which calls the group) read one copy.

- nn.Linear (bf16): weight rows concatenated; each module's `.weight` a view of the rows.
- QuantLinear (nvfp4 / mxfp4 / nf4 without double quantisation): the packed checkpoint tensors
  concatenated along the rows, which is exact because quantisation is per row group (nvfp4's
  per-tensor global scale is shared by q/k/v and by gate/up at quantisation time, see
  qerl.quantize; a group whose scales differ is not fused). On the GPU the kernel layout of the
  fused weight is prepared once and each module's kernel state becomes a slice of it (tiles of
  64 rows, so every module's row count must be a multiple of 64; otherwise it keeps its own).
- Anything else (a LoRA-wrapped base is unwrapped first; mixed kinds or dtypes, nf4 with
  double quantisation): no fusion, the modules are called one by one.

LoRA adapters stay outside: the group adds `B(A(x)) * scaling` for each module that has them,
reading PEFT's own parameters, so an optimiser step is seen by the next call with no copy.
"""

from __future__ import annotations

import torch
from torch import nn

from qerl.nn.quant_linear import QuantLinear

__all__ = ["LinearGroup", "base_layer", "lora_delta"]

_ROW_TENSORS = {"nvfp4": ("weight_packed", "weight_scale"), "mxfp4": ("weight_packed", "weight_scale"),
                "nf4": ("weight_packed", "weight_absmax")}


def base_layer(mod: nn.Module) -> nn.Module:
    """The frozen layer under a PEFT LoRA wrapper (the module itself otherwise)."""
    return mod.get_base_layer() if hasattr(mod, "get_base_layer") and hasattr(mod, "lora_A") else mod


def lora_delta(mod: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """sum over active adapters of B(A(x)) * scaling, as PEFT's forward adds it (eval mode: no
    dropout); None for a module without LoRA or with adapters disabled."""
    if not hasattr(mod, "lora_A") or getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False):
        return None
    out = None
    for name in mod.active_adapters:
        if name not in mod.lora_A:
            continue
        a, b = mod.lora_A[name], mod.lora_B[name]
        d = b(a(x.to(a.weight.dtype))) * mod.scaling[name]
        out = d if out is None else out + d
    return out


def _fuse_dense(bases: list[nn.Linear]) -> nn.Module | None:
    w0 = bases[0].weight
    if any(b.weight.dtype != w0.dtype or b.weight.device != w0.device
           or b.in_features != bases[0].in_features for b in bases):
        return None
    with torch.no_grad():
        weight = torch.cat([b.weight for b in bases], 0)
        has_bias = [b.bias is not None for b in bases]
        bias = None
        if any(has_bias):
            bias = torch.cat([b.bias if b.bias is not None else torch.zeros(b.out_features, dtype=w0.dtype, device=w0.device)
                              for b in bases])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    row = 0
    # The modules now read rows of the fused weight: one copy in memory. A row view keeps its
    # module's requires_grad, and an optimiser's in-place update of it lands in the fused weight.
    for b in bases:
        n = b.out_features
        b.weight = nn.Parameter(weight[row:row + n], requires_grad=b.weight.requires_grad)
        if b.bias is not None:
            b.bias = nn.Parameter(bias[row:row + n], requires_grad=b.bias.requires_grad)
        row += n
    return fused


def _same(tensors: list[torch.Tensor]) -> bool:
    return all(t.shape == tensors[0].shape and torch.equal(t, tensors[0]) for t in tensors[1:])


def _fuse_quant(bases: list[QuantLinear]) -> nn.Module | None:
    first = bases[0]
    fmt = first.fmt
    names = _ROW_TENSORS.get(fmt)
    if names is None or any(b.fmt != fmt or b.in_features != first.in_features or b.backend != first.backend
                            or set(b.quant_tensors()) != set(first.quant_tensors()) for b in bases):
        return None  # e.g. nf4 with double quantisation: its absmax blocks run across rows
    if fmt == "nvfp4" and not _same([b.weight_global_scale for b in bases]):
        return None
    n_total = sum(b.out_features for b in bases)
    with torch.no_grad():
        tensors = {name: torch.cat([getattr(b, name) for b in bases], 0) for name in names}
        if fmt == "nvfp4":
            tensors["weight_global_scale"] = first.weight_global_scale.clone()
        fused = QuantLinear(first.in_features, n_total, fmt, bias=any(b.bias is not None for b in bases),
                            backend=first.backend, device=first.weight_packed.device, compute_dtype=first.compute_dtype)
        for name, t in tensors.items():  # adopt, not copy: the modules will point into these
            fused._buffers[name] = t
        if fused.bias is not None:
            fused.bias.data.copy_(torch.cat([b.bias if b.bias is not None else torch.zeros(b.out_features, dtype=fused.bias.dtype, device=fused.bias.device)
                                             for b in bases]))
    row = 0
    for b in bases:
        n = b.out_features
        for name in names:
            b._buffers[name] = tensors[name][row:row + n]
        b._cache.clear()
        row += n
    return fused


def _share_kernel_state(fused: QuantLinear, bases: list[QuantLinear]) -> None:
    """On the GPU: prepare the fused kernel layout once; modules whose rows fill whole 64-row
    tiles get a slice of it as their own kernel state (the trainer's forward reads it)."""
    if fused.weight_packed.device.type != "cuda" or fused.fmt not in ("nvfp4", "mxfp4"):
        return
    from qerl import kernels

    if not kernels.available():
        return
    state = fused.kernel_state()
    tile = 64
    row = 0
    for b in bases:
        n = b.out_features
        if n % tile == 0 and row % tile == 0:
            sub = dict(state)
            sub["n"] = n
            sub["words"] = state["words"][row // tile:(row + n) // tile]
            sub["scale"] = state["scale"][row // tile:(row + n) // tile]
            sub["locks"] = torch.zeros_like(state["locks"])
            sub["locks_bwd"] = torch.zeros_like(state["locks_bwd"])
            b._cache[("kernel", b.weight_packed.device)] = sub
        row += n


class LinearGroup:
    """Modules that read the same input, run as one base product plus their LoRA deltas."""

    def __init__(self, modules: list[nn.Module], fuse: bool = True):
        self.modules = list(modules)
        bases = [base_layer(m) for m in self.modules]
        self.sizes = [b.out_features for b in bases]
        self.fused: nn.Module | None = None
        if fuse and len(bases) > 1:
            if all(type(b) is nn.Linear for b in bases):
                self.fused = _fuse_dense(bases)
            elif all(isinstance(b, QuantLinear) for b in bases):
                self.fused = _fuse_quant(bases)
                if self.fused is not None:
                    _share_kernel_state(self.fused, bases)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fused is None:
            return [m(x) for m in self.modules]
        outs = list(self.fused(x).split(self.sizes, -1))
        for i, m in enumerate(self.modules):
            d = lora_delta(m, x)
            if d is not None:
                outs[i] = (outs[i] + d).to(outs[i].dtype)
        return outs

