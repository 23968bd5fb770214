"""QuantLinear: a linear layer whose weight is frozen in a 4-bit format (nvfp4, mxfp4, nf4).

The packed tensors are buffers named as in the checkpoint (weight_packed, weight_scale, ...),
so a model's state_dict is the compressed-tensors layout. They never receive gradients;
inputs do, so LoRA adapters and anything before the layer train normally.

Forward, by backend (`auto` | `torch` | `triton`):
- torch (always on CPU): F.linear with the dequantised weight. On CPU the dequantised weight
  is cached (weights are frozen, CPU runs are small); on a GPU the weight is dequantised on
  every call on purpose, and again in the backward (`DequantLinear`: autograd keeps no dense
  copy): for nf4 that is the honest QLoRA baseline, done as bitsandbytes does it (one Triton
  pass to a transient bf16 weight, then cuBLAS) where triton is available. `QERL_NF4_FUSED_MAX_M` (default 0,
  off) sends small inference calls to the labelled fused NF4 kernel instead (benchmarks only).
- triton (CUDA, nvfp4/mxfp4): the fused 4-bit x bf16 kernels of qerl.kernels, which read the
  packed weight and never build a bf16 copy, in forward or backward.

One copy of the weight. The kernels read a re-packed, tiled layout (`kernel_state`), as large as
the checkpoint tensors. Once it exists on a GPU it becomes the only copy: `weight_packed` and
`weight_scale` are dropped and rebuilt from it (exactly, layout.py's mapping is a permutation
plus padding) whenever something asks for them: `state_dict`, `quant_tensors`,
`dequantized_weight`, attribute access, a move to another device. At 32B that is ~16 GiB less
in every phase of a GRPO step. `compact_()` does the same on any device (the tests' way on a
CPU); `SINGLE_COPY = False` keeps both copies (benchmarks measure the difference).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from qerl.env import env_int
from qerl.formats import QUANTIZED_FORMATS, FormatError, dequantize_weight, quantize_weight

# nf4 on a GPU, inference only (no input gradient), bf16 inputs of at most this many rows: the labelled fused NF4
# kernel (nf4_triton.fused_matmul, bitsandbytes' 4-bit GEMV rounding) instead of the QLoRA baseline. 0 (the
# default) keeps the baseline everywhere; benchmarks set QERL_NF4_FUSED_MAX_M=16 to time a fused NF4 rollout.
NF4_FUSED_MAX_M = env_int("QERL_NF4_FUSED_MAX_M", 0)
_NF4_SWITCH = re.compile(r"QERL_NF4_FUSED_MAX_M=(\d+)")


def nf4_decode(fmt: str, max_m: int | None = None) -> str | None:
    """The label benchmark rows carry for what nf4's small inference products ran: "baseline" (the QLoRA
    dequantise-then-cuBLAS path) or "fused<=N" (the fused NF4 kernel for calls of up to N rows); None for
    other formats. max_m: the QERL_NF4_FUSED_MAX_M in force (default: this process's)."""
    if fmt != "nf4":
        return None
    m = NF4_FUSED_MAX_M if max_m is None else max_m
    return f"fused<={m}" if m > 0 else "baseline"


def nf4_decode_of(row: dict, command: str | None = None) -> str | None:
    """A benchmark row's nf4_decode: its own field, or for rows from before the field existed, what the
    QERL_NF4_FUSED_MAX_M prefix of the command that measured it says (the row's, else `command`)."""
    if "nf4_decode" in row:
        return row["nf4_decode"]
    text = row.get("command") or command
    found = _NF4_SWITCH.search(text) if isinstance(text, str) else None  # a list: several calls, none known
    return nf4_decode(row.get("format", ""), int(found.group(1)) if found else 0)

# Whether a GPU kernel layout replaces the checkpoint tensors it was built from (module docstring).
SINGLE_COPY = True
# The checkpoint tensors the kernel layout holds in full (the per-tensor global scale stays a buffer).
KERNEL_OWNED = ("weight_packed", "weight_scale")
_KERNEL_FORMATS = ("nvfp4", "mxfp4")

# Shapes of each format's tensors for a weight [out, in]; used to allocate buffers so that
# load_state_dict can fill a freshly built model.
_BUFFER_SPECS = {
    "nvfp4": lambda n, k: {
        "weight_packed": ((n, k // 2), torch.uint8),
        "weight_scale": ((n, k // 16), torch.float8_e4m3fn),
        "weight_global_scale": ((1,), torch.float32),
    },
    "mxfp4": lambda n, k: {
        "weight_packed": ((n, k // 2), torch.uint8),
        "weight_scale": ((n, k // 32), torch.uint8),
    },
    "nf4": lambda n, k: {
        "weight_packed": ((n, k // 2), torch.uint8),
        "weight_absmax": ((n, k // 64), torch.float32),
    },
    "nf4-dq": lambda n, k: {
        "weight_packed": ((n, k // 2), torch.uint8),
        "weight_absmax_q": ((n, k // 64), torch.int8),
        "weight_absmax_scale": ((-(-(n * k // 64) // 256),), torch.float32),
        "weight_absmax_offset": ((1,), torch.float32),
    },
}


class DequantLinear(torch.autograd.Function):
    """y = x W^T + b for a frozen weight that `dequant(dtype)` rebuilds as a transient dense tensor (in
    x's dtype) in the forward and again in the backward, as bitsandbytes' MatMul4Bit runs QLoRA.
    Autograd keeps no dense copy: a plain F.linear on the dequantised weight would save it for the
    input gradient, so every decoder layer that trains without activation checkpointing would hold
    its whole weight in bf16 until the backward (0.57 GiB a layer at 14B), which the checkpoint
    plan's per-token probe cannot see. Under autocast the forward runs as F.linear would (bf16), and the backward repeats
    its product in the output's dtype. The weight gets no gradient (frozen); the bias does if it asks."""

    @staticmethod
    def forward(ctx, x, bias, dequant):
        y = F.linear(x, dequant(x.dtype), bias)
        ctx.dequant, ctx.x_dtype, ctx.dtype = dequant, x.dtype, y.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = dy.to(ctx.dtype).matmul(ctx.dequant(ctx.x_dtype).to(ctx.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_b = dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.b_dtype)
        return grad_x, grad_b, None


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        bias: bool = False,
        *,
        double_quant: bool = False,
        backend: str = "auto",
        device=None,
        compute_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if fmt not in QUANTIZED_FORMATS:
            raise FormatError(f"QuantLinear format must be one of {', '.join(QUANTIZED_FORMATS)}, got {fmt!r}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.backend = backend
        self.compute_dtype = compute_dtype
        spec = _BUFFER_SPECS["nf4-dq" if fmt == "nf4" and double_quant else fmt](out_features, in_features)
        self._spec = dict(spec)
        for name, (shape, dtype) in spec.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False) if bias else None
        self._cache: dict = {}  # CPU dense weights by dtype
        self._kernel: dict | None = None  # kernels.prepare's state, see kernel_state
        self._dropped: tuple[str, ...] = ()  # checkpoint tensors held only in the kernel layout

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, backend: str = "auto", **options) -> "QuantLinear":
        tensors = quantize_weight(linear.weight.detach(), fmt, **options)
        layer = cls(
            linear.in_features,
            linear.out_features,
            fmt,
            bias=linear.bias is not None,
            double_quant=bool(options.get("double_quant")),
            backend=backend,
            device=linear.weight.device,
            compute_dtype=linear.weight.dtype if linear.weight.dtype.is_floating_point else torch.bfloat16,
        )
        layer.load_tensors(tensors)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, (shape, dtype) in self._spec.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(shape) or src.dtype != dtype:
                raise FormatError(
                    f"{self.fmt} tensor {name}: expected {tuple(shape)} {dtype}, got {tuple(src.shape)} {src.dtype}"
                )
        self._restore_checkpoint_layout(fill=False)
        for name, buf in self.quant_tensors().items():
            buf.copy_(tensors[name])
        self._forget_layouts()

    def quant_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors by name, in the format's order (rebuilt from the kernel layout
        where that is the only copy: new tensors, so writing into them changes nothing)."""
        if not self._dropped:
            return dict(self.named_buffers(recurse=False))
        rebuilt = self._rebuilt()
        return {name: rebuilt[name] if name in rebuilt else self._buffers[name] for name in self._spec}

    @property
    def storage_device(self) -> torch.device:
        """Where the weight lives (also when only its kernel layout does)."""
        if self._dropped:
            return self._kernel["words"].device
        return next(iter(self._buffers.values())).device

    def storage_bytes(self) -> int:
        """Bytes of the checkpoint tensors (the format's size; the kernel layout, when it is the
        only copy, holds the same plus padding to whole 64 x 256 tiles)."""
        return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in self._spec.values())

    # ---- one copy: the kernel layout ----------------------------------------------------
    def compact_(self) -> "QuantLinear":
        """Keep only the kernel layout of the weight (nvfp4 / mxfp4; anything else is left as
        is). Automatic on a GPU the first time the kernels run (SINGLE_COPY); this does it on
        any device. The checkpoint tensors are rebuilt exactly when asked for."""
        if self.fmt in _KERNEL_FORMATS:
            self.kernel_state()
            self._drop_checkpoint_layout()
        return self

    @property
    def compacted(self) -> bool:
        return bool(self._dropped)

    def adopt_kernel_state(self, state: dict) -> None:
        """Use `state` (e.g. a row slice of a fused group's layout, fuse.py) as this module's
        kernel layout; it must encode this module's weight."""
        self._kernel = state
        self._drop_on_gpu()

    def share_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Point this module's checkpoint tensors at `tensors` (views of a fused weight, fuse.py),
        which must hold this module's values; any layout built from the old ones is forgotten."""
        kept = dict(self._buffers)
        self._buffers.clear()
        for name in self._spec:  # the format's order, so state_dict keys keep theirs
            self._buffers[name] = tensors[name] if name in tensors else kept[name]
        self._dropped = ()
        self._forget_layouts()

    def _drop_on_gpu(self) -> None:
        if SINGLE_COPY and self.storage_device.type == "cuda":
            self._drop_checkpoint_layout()

    def _drop_checkpoint_layout(self) -> None:
        if self._dropped or self._kernel is None or self.fmt not in _KERNEL_FORMATS:
            return
        for name in KERNEL_OWNED:
            del self._buffers[name]
        self._dropped = KERNEL_OWNED
        self._cache.clear()

    def _rebuilt(self) -> dict[str, torch.Tensor]:
        from qerl import kernels

        with _outside_inference_mode():
            tensors = kernels.state_tensors(self._kernel)
        return {name: tensors[name] for name in self._dropped}

    def _restore_checkpoint_layout(self, fill: bool = True) -> None:
        """Back to checkpoint buffers: rebuilt from the kernel layout, or (fill=False, about to
        be overwritten) just allocated. The kernel layout is then forgotten."""
        if not self._dropped:
            return
        device = self.storage_device
        tensors = self._rebuilt() if fill else {
            name: torch.empty(self._spec[name][0], dtype=self._spec[name][1], device=device) for name in self._dropped}
        self.share_tensors(tensors)

    def _forget_layouts(self) -> None:
        if self._dropped:
            raise AssertionError("the kernel layout is this layer's only weight copy")
        self._cache.clear()
        self._kernel = None

    def __getattr__(self, name: str):
        dropped = self.__dict__.get("_dropped")
        if dropped and name in dropped:
            return self._rebuilt()[name]
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if not self._dropped:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, param in self._parameters.items():
            if param is not None:
                destination[prefix + name] = param if keep_vars else param.detach()
        for name, t in self.quant_tensors().items():  # the format's order, as before the drop
            destination[prefix + name] = t if keep_vars else t.detach()

    # ---- compute ------------------------------------------------------------------------
    # Caches are built as normal tensors even when the first call runs under
    # torch.inference_mode (a rollout): an inference tensor could not be saved for the backward
    # pass of a later training forward (LoRA's grad_x goes through this weight).
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_weight(self.quant_tensors(), self.fmt, dtype or self.compute_dtype)

    def _resolved_backend(self, x: torch.Tensor) -> str:
        if x.device.type != "cuda" or self.backend == "torch":
            return "torch"
        from qerl import kernels  # imported lazily: keeps `import qerl` free of triton

        return kernels.resolve_backend(self.backend, x.device, self.fmt)

    def kernel_state(self) -> dict:
        """The fused kernels' layout of the weight (prepared once); on a GPU it then replaces
        the checkpoint tensors (SINGLE_COPY, module docstring)."""
        if self._kernel is None:
            from qerl import kernels

            with _outside_inference_mode():
                self._kernel = kernels.prepare(self.fmt, self.quant_tensors())
            self._drop_on_gpu()
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._resolved_backend(x) == "triton":
            from qerl import kernels

            return kernels.linear(x, self.kernel_state(), self.fmt, self.bias, backend="triton")
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if x.device.type == "cpu":
            key = ("dense", x.dtype)
            if key not in self._cache:
                with _outside_inference_mode():
                    self._cache[key] = self.dequantized_weight(x.dtype)
            return F.linear(x, self._cache[key], bias)
        if self.fmt == "nf4" and self.backend != "torch" and _triton_ready():
            # the QLoRA baseline as bitsandbytes runs it: one dequantisation pass to a transient
            # bf16 weight, then cuBLAS (the multi-pass torch dequantisation is ~20x slower)
            from qerl.kernels import nf4_triton

            if _takes_fused_nf4(x, nf4_triton.FUSED_CONFIG["BK"]):
                y = nf4_triton.fused_matmul(x.reshape(-1, x.shape[-1]), self.quant_tensors())
                y = y.reshape(*x.shape[:-1], -1)
                return y if bias is None else y + bias
            return DequantLinear.apply(x, bias, lambda dtype: nf4_triton.dequant_bf16(self.quant_tensors()).to(dtype))
        return DequantLinear.apply(x, bias, self.dequantized_weight)

    # ---- housekeeping -------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Moves follow the module; casts (model.float(), .half()) do not touch the packed
        tensors, whose dtypes are the format. They change the compute dtype instead."""
        if self._dropped and fn(self._kernel["words"]) is self._kernel["words"]:
            self._cache.clear()  # a cast: the packed layout is untouched and stays the only copy
        else:
            self._restore_checkpoint_layout(fill=True)  # a real move takes the checkpoint tensors along
            self._forget_layouts()  # moved or cast: cached dense / kernel layouts are stale
        packed = {name: buf.dtype for name, buf in self._buffers.items() if buf is not None}
        out = super()._apply(fn, recurse)
        for name, dtype in packed.items():
            buf = getattr(self, name)
            if buf.dtype != dtype:
                setattr(self, name, buf.to(dtype))
        if self.bias is not None:
            self.compute_dtype = self.bias.dtype
        else:
            probe = fn(torch.empty(0, dtype=self.compute_dtype))
            self.compute_dtype = probe.dtype
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        ours = [prefix + name for name in self._spec]
        if not any(key in state_dict for key in ours):
            # e.g. PEFT loading adapters with strict=False: this weight is not being loaded
            missing_keys.extend(prefix + name for name in self._dropped)
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        self._restore_checkpoint_layout(fill=True)
        self._forget_layouts()
        return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                             unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, bias={self.bias is not None}"


def _takes_fused_nf4(x: torch.Tensor, bk: int) -> bool:
    """Whether an nf4 call on a GPU goes to the fused NF4 kernel (NF4_FUSED_MAX_M): bf16 inference inputs of 1 to
    NF4_FUSED_MAX_M rows whose K is a multiple of the kernel's BK."""
    k = x.shape[-1]
    return (0 < x.numel() <= NF4_FUSED_MAX_M * k and x.dtype == torch.bfloat16 and k % bk == 0
            and not (torch.is_grad_enabled() and x.requires_grad))


def _triton_ready() -> bool:
    from qerl import kernels

    return kernels.available()


def _outside_inference_mode():
    """no_grad, with inference mode off: tensors made here are usable later by autograd."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.no_grad())
    return stack
