"""One product for the linears that share an input (q/k/v, gate/up), with no second weight copy.

    group = LinearGroup([attn.q_proj, attn.k_proj, attn.v_proj])
    q, k, v = group(x).split(group.sizes, -1)

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

LoRA adapters stay unmerged: the group adds all its modules' low-rank products with two small
kernels (LinearGroup's docstring), from buffers refilled from PEFT's parameters at every rollout.
"""

from __future__ import annotations

import torch
from torch import nn

from qerl.kernels import bf16_gemv
from qerl.kernels.lora_ops import segment_bounds
from qerl.nn.quant_linear import QuantLinear, _outside_inference_mode

__all__ = ["LinearGroup", "base_layer"]

_ROW_TENSORS = {"nvfp4": ("weight_packed", "weight_scale"), "mxfp4": ("weight_packed", "weight_scale"),
                "nf4": ("weight_packed", "weight_absmax")}


def base_layer(mod: nn.Module) -> nn.Module:
    """The frozen layer under a PEFT LoRA wrapper (the module itself otherwise)."""
    return mod.get_base_layer() if hasattr(mod, "get_base_layer") and hasattr(mod, "lora_A") else mod


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
    # The modules now read rows of the fused weight: one copy in memory. Their Parameter objects
    # stay (only their data moves), so an optimiser that already holds them updates the fused rows.
    for b in bases:
        n = b.out_features
        b.weight.data = weight[row:row + n]
        if b.bias is not None:
            b.bias.data = bias[row:row + n]
        row += n
    return fused


def _same(tensors: list[torch.Tensor]) -> bool:
    return all(t.shape == tensors[0].shape and torch.equal(t, tensors[0]) for t in tensors[1:])


def _fuse_quant(bases: list[QuantLinear]) -> nn.Module | None:
    first = bases[0]
    fmt = first.fmt
    names = _ROW_TENSORS.get(fmt)
    if names is None or any(b.fmt != fmt or b.in_features != first.in_features or b.backend != first.backend
                            or set(b._spec) != set(first._spec) for b in bases):
        return None  # e.g. nf4 with double quantisation: its absmax blocks run across rows
    if fmt == "nvfp4" and not _same([b.weight_global_scale for b in bases]):
        return None
    n_total = sum(b.out_features for b in bases)
    device = first.storage_device
    with torch.no_grad():
        parts = [b.quant_tensors() for b in bases]  # rebuilt from a kernel layout where that is the only copy
        tensors = {name: torch.cat([p[name] for p in parts], 0) for name in names}
        del parts
        if fmt == "nvfp4":
            tensors["weight_global_scale"] = first.weight_global_scale.clone()
        fused = QuantLinear(first.in_features, n_total, fmt, bias=any(b.bias is not None for b in bases),
                            backend=first.backend, device="meta", compute_dtype=first.compute_dtype)
        fused.share_tensors(tensors)  # adopt, not copy: the modules will point into these
        if fused.bias is not None:
            fused.bias = nn.Parameter(torch.cat([b.bias if b.bias is not None else torch.zeros(b.out_features, dtype=first.compute_dtype, device=device)
                                                 for b in bases]), requires_grad=False)
    row = 0
    for b in bases:
        n = b.out_features
        b.share_tensors({name: tensors[name][row:row + n] for name in names})
        row += n
    return fused


def _share_kernel_state(fused: QuantLinear, bases: list[QuantLinear]) -> None:
    """On the GPU: prepare the fused kernel layout once; modules whose rows fill whole 64-row
    tiles get a slice of it as their own kernel state (the trainer's forward reads it). With
    QuantLinear.SINGLE_COPY that layout is then the group's only copy of the weights (a module
    whose rows do not fill whole tiles keeps its view of the fused checkpoint tensors, and with
    it their storage)."""
    if fused.storage_device.type != "cuda" or fused.fmt not in ("nvfp4", "mxfp4"):
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
            b.adopt_kernel_state(sub)
        row += n


def _lora_parts(mod: nn.Module):
    """[(A, B, scaling)] of the active adapters (PEFT LoRA layer), [] without LoRA."""
    if not hasattr(mod, "lora_A") or getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False):
        return []
    return [(mod.lora_A[n].weight, mod.lora_B[n].weight, mod.scaling[n]) for n in mod.active_adapters if n in mod.lora_A]


def _sync(sync: tuple | None, state: dict) -> tuple | None:
    """sync = (decode_ops.Ready of this group's LoRA delta, decode_ops.Signal of the next group's input),
    from the rollout engine's resident LoRA kernel (engine.LORA_RESIDENT): the launch waits for the delta
    on the device, adds it in its epilogue and counts its row blocks out on the Signal
    (w4a16_gluon.forward sync). None: no delta, no count."""
    if sync is None:
        return None
    from qerl.kernels import w4a16_gluon

    ready, signal = sync
    signal.programs = w4a16_gluon.sync_count(state)
    return ready.delta, ready.flag, ready.target, signal.flag


class LinearGroup:
    """Modules that read the same input (or one module), as one base product plus one low-rank
    product for all their LoRA adapters:

        y = base(x) + delta,   delta[:, rows of module i] = (x @ A_i^T) @ (s_i B_i)^T

    computed by qerl.kernels.lora_ops (two Triton kernels on a GPU for the whole group, torch
    elsewhere) from two engine buffers: A = [A_1; A_2; ..] (ranks stacked, each padded to the
    group's largest rank) and B = [s_1 B_1; s_2 B_2; ..] (output rows stacked, [N, rank]), refilled
    from PEFT's parameters by `refresh()` at the start of every rollout (r x (K + N) values per
    module, ~1% of a decode step's bytes); the base weight is never copied. The output is
    [.., sum of out_features]; `sizes` splits it.
    """

    def __init__(self, modules: list[nn.Module], fuse: bool = True):
        self.modules = list(modules)
        bases = [base_layer(m) for m in self.modules]
        self.sizes = [b.out_features for b in bases]
        self.in_features = bases[0].in_features
        self.base: nn.Module | None = bases[0] if len(bases) == 1 else None
        if fuse and len(bases) > 1:
            if all(type(b) is nn.Linear for b in bases):
                self.base = _fuse_dense(bases)
            elif all(isinstance(b, QuantLinear) for b in bases):
                self.base = _fuse_quant(bases)
                if self.base is not None:
                    _share_kernel_state(self.base, bases)
        self.fused = self.base if len(bases) > 1 else None
        self._a: torch.Tensor | None = None
        self._b: torch.Tensor | None = None
        self.rank = 0
        self.bounds = segment_bounds(self.sizes)
        self._per_module = self.base is None or len(self.sizes) > 3
        self.refresh()

    def refresh(self, dtype: torch.dtype | None = None) -> None:
        """Re-read the LoRA adapters (after an optimiser step, a new adapter, set_adapter)."""
        parts = [_lora_parts(m) for m in self.modules]
        if self.base is None or len(self.sizes) > 3 or any(len(p) > 1 for p in parts):
            self._per_module, self._a, self._b = True, None, None  # several adapters at once: PEFT's own path
            return
        self._per_module = False
        if not any(parts):
            self._a = self._b = None
            return
        rank = max(p[0][0].shape[0] for p in parts if p)
        ref = next(p[0][0] for p in parts if p)
        dtype = dtype or getattr(self.base, "compute_dtype", None) or self.base.weight.dtype
        shape_a, shape_b = (len(parts) * rank, self.in_features), (sum(self.sizes), rank)
        with _outside_inference_mode():
            if self._a is None or self._a.shape != shape_a or self._a.dtype != dtype:
                self._a = torch.zeros(shape_a, dtype=dtype, device=ref.device)
                self._b = torch.zeros(shape_b, dtype=dtype, device=ref.device)
            self._a.zero_()
            self._b.zero_()
            n0 = 0
            for i, (part, n) in enumerate(zip(parts, self.sizes)):
                if part:
                    a, b, scale = part[0]
                    r = a.shape[0]
                    self._a[i * rank:i * rank + r].copy_(a)
                    torch.mul(b, scale, out=self._b[n0:n0 + n, :r])
                n0 += n
        self.rank = rank

    @property
    def has_lora(self) -> bool:
        """True when the adapters run as this group's low-rank product (`lora`), not inside the modules."""
        return not self._per_module and self._a is not None

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product without this group's LoRA (with it, where the modules apply it themselves)."""
        return self(x) if self._per_module else bf16_gemv.dense(self.base, x)

    def fold_usable(self, rows: int, synced: bool = False) -> bool:
        """NORM_FOLD can take this group's product at `rows` tokens: one nvfp4 / mxfp4 QuantLinear (fused or
        single) without a LoRA delta (synced: or with one the resident LoRA kernel computes, `_sync`) whose
        2..8-token launch the 4-bit dispatch runs on the Gluon GEMV (the formats w4a16_triton.WSMMA_FORMATS
        routes there)."""
        base = self.base
        if (self._per_module or (self.has_lora and not synced) or not isinstance(base, QuantLinear) or not 2 <= rows <= 8
                or base.storage_device.type != "cuda"):
            return False
        from qerl.kernels import w4a16_triton

        if base.fmt not in w4a16_triton.WSMMA_FORMATS:  # the formats the routing sends to the Gluon GEMV
            return False
        probe = torch.empty(rows, self.in_features, dtype=torch.bfloat16, device=base.storage_device)
        if base._resolved_backend(probe) != "triton":
            return False
        state = base.kernel_state()
        return state["n"] % 64 == 0 and w4a16_triton.routes_to_gluon_tokens(probe, state)

    def res_forward(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, sync: tuple | None = None):
        """NORM_FOLD producer (`fold_usable`): (h + y, bf16((h + y) * weight), the consumer's scale
        spec) for y = this group's product, the residual add of the RMSNorm (weight, eps) that follows
        it done in the product's epilogue (w4a16_gluon.forward fold "res"). sync: see `_sync`."""
        from qerl.kernels import w4a16_gluon

        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        state = self.base.kernel_state()
        n = state["n"]
        h2 = h.reshape(-1, n)
        h_out = torch.empty_like(h2)
        ss = torch.empty(n // 64, 8, dtype=torch.float32, device=x.device)
        rw = w4a16_gluon.forward(x2, state, bias=self.base.bias, fold=("res", h2, weight, h_out, ss),
                                 sync=_sync(sync, state))
        return h_out.view(h.shape), rw.view(h.shape), ("scale", ss, n // 64, float(eps), n)

    def scale_forward(self, x: torch.Tensor, scale: tuple) -> torch.Tensor:
        """NORM_FOLD consumer (`fold_usable`): the product of x = bf16(r * weight) with each token's
        RMSNorm scale applied in the epilogue (`scale`: from res_forward)."""
        from qerl.kernels import w4a16_gluon

        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        return w4a16_gluon.forward(x2, self.base.kernel_state(), bias=self.base.bias,
                                   fold=scale).view(*x.shape[:-1], -1)

    def glu_usable(self, x: torch.Tensor, synced: bool = False) -> bool:
        """`glu_forward` takes x (synced: with the resident LoRA kernel's delta, `_sync`)."""
        base = self.fused
        if (self._per_module or (self.has_lora and not synced) or not isinstance(base, QuantLinear)
                or base.bias is not None or x.device.type != "cuda"):
            return False
        from qerl.kernels import w4a16_gluon, w4a16_triton

        # the formats the routing sends to the Gluon GEMV (checked first: the backend of another may refuse)
        if base.fmt not in w4a16_triton.WSMMA_FORMATS or base._resolved_backend(x) != "triton":
            return False
        x2 = x.reshape(-1, x.shape[-1])
        state = base.kernel_state()
        return w4a16_gluon.glu_usable(x2, state) and w4a16_triton.routes_to_gluon_tokens(x2, state)

    def glu_forward(self, x: torch.Tensor, scale: tuple | None = None, sync: tuple | None = None) -> torch.Tensor | None:
        """silu(gate) * up of a fused [gate; up] group in one Gluon GEMV launch (w4a16_gluon GLU), or
        None where that launch does not apply: a LoRA delta to add first (unless the resident LoRA
        kernel computes it: `sync`, see `_sync`), weights not fused into one nvfp4 / mxfp4 QuantLinear
        without bias, or a launch the 4-bit dispatch would not run on the Gluon GEMV (off the GPU among
        them; a format w4a16_triton.WSMMA_FORMATS does not name)."""
        if not self.glu_usable(x, sync is not None):
            return None
        from qerl.kernels import w4a16_gluon

        x2 = x.reshape(-1, x.shape[-1])
        state = self.fused.kernel_state()
        return w4a16_gluon.forward(x2.contiguous(), state, glu=True, fold=scale,
                                   sync=_sync(sync, state)).view(*x.shape[:-1], -1)

    def lora_workspace(self, rows: int) -> tuple[torch.Tensor, ...]:
        """Preallocated buffers for `lora` at up to `rows` rows (qerl.kernels.lora_ops.workspace)."""
        from qerl.kernels.lora_ops import workspace

        with _outside_inference_mode():
            return workspace(rows, self.in_features, self._a.shape[0], self._b.shape[0], self._a.dtype, self._a.device)

    def lora(self, x: torch.Tensor, workspace: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The LoRA delta [rows, sum of out_features] (has_lora must be True); `workspace` from
        `lora_workspace` (the engine's, so a side stream allocates nothing)."""
        from qerl.kernels.lora_ops import lora_delta

        x2 = x.reshape(-1, self.in_features).to(self._a.dtype)
        return lora_delta(x2, self._a, self._b, self.bounds, self.rank, workspace)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._per_module:
            outs = [m(x) for m in self.modules]
            return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        y = bf16_gemv.dense(self.base, x)
        if self._a is not None:
            from qerl.kernels.lora_ops import lora_add_

            x2 = x.reshape(-1, self.in_features).to(self._a.dtype)
            lora_add_(y.view(-1, y.shape[-1]), x2, self._a, self._b, self.bounds, self.rank)
        return y
