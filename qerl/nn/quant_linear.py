"""QuantLinear: a linear layer whose weight is frozen in a 4-bit format (nvfp4, mxfp4, nf4).

The packed tensors are buffers named as in the checkpoint (weight_packed, weight_scale, ...),
so a model's state_dict is the compressed-tensors layout. They never receive gradients;
inputs do, so LoRA adapters and anything before the layer train normally.

Forward, by backend (`auto` | `torch` | `triton`):
- torch (always on CPU): F.linear with the dequantised weight. On CPU the dequantised weight
  is cached (weights are frozen, CPU runs are small); on a GPU the weight is dequantised on
  every call on purpose: for nf4 that is the honest QLoRA baseline, done as bitsandbytes does
  it (one Triton pass to a transient bf16 weight, then cuBLAS) where triton is available.
- triton (CUDA, nvfp4/mxfp4): the fused 4-bit x bf16 kernels of qerl.kernels, which read the
  packed weight and never build a bf16 copy, in forward or backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl.formats import QUANTIZED_FORMATS, FormatError, dequantize_weight, quantize_weight

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
        for name, (shape, dtype) in spec.items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False) if bias else None
        self._cache: dict = {}

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
        for name, buf in self.quant_tensors().items():
            src = tensors[name]
            if src.shape != buf.shape or src.dtype != buf.dtype:
                raise FormatError(
                    f"{self.fmt} tensor {name}: expected {tuple(buf.shape)} {buf.dtype}, got {tuple(src.shape)} {src.dtype}"
                )
            buf.copy_(src)
        self._cache.clear()

    def quant_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_buffers(recurse=False))

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
        key = ("kernel", self.weight_packed.device)
        if key not in self._cache:
            from qerl import kernels

            with _outside_inference_mode():
                self._cache[key] = kernels.prepare(self.fmt, self.quant_tensors())
        return self._cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._resolved_backend(x) == "triton":
            from qerl import kernels

            return kernels.linear(x, self.kernel_state(), self.fmt, self.bias, backend="triton")
        if x.device.type == "cuda" and self.fmt == "nf4" and self.backend != "torch" and _triton_ready():
            # the QLoRA baseline as bitsandbytes runs it: one dequantisation pass to a transient
            # bf16 weight, then cuBLAS (the multi-pass torch dequantisation is ~20x slower)
            from qerl.kernels import nf4_triton

            w = nf4_triton.dequant_bf16(self.quant_tensors()).to(x.dtype)
            return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        if x.device.type == "cpu":
            key = ("dense", x.dtype)
            if key not in self._cache:
                with _outside_inference_mode():
                    self._cache[key] = self.dequantized_weight(x.dtype)
            w = self._cache[key]
        else:
            w = self.dequantized_weight(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    # ---- housekeeping -------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Moves follow the module; casts (model.float(), .half()) do not touch the packed
        tensors, whose dtypes are the format. They change the compute dtype instead."""
        self._cache.clear()  # moved or cast: cached dense / kernel layouts are stale
        packed = {name: buf.dtype for name, buf in self.quant_tensors().items()}
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

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache.clear()
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, bias={self.bias is not None}"


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
