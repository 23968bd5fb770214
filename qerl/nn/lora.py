"""LoRA over the frozen 4-bit QuantLinear, through PEFT (a standard PEFT adapter on disk).

    model = apply_lora(model, LoraSettings(r=16, lora_alpha=16))   # -> peft.PeftModel
    model.save_pretrained(out_dir)                                 # adapter_model.safetensors + adapter_config.json
    model = load_lora(base_model, out_dir, is_trainable=True)      # the same adapter, back on a fresh base

How: `QuantLoraLinear` is a PEFT `LoraLayer` for `QuantLinear`, registered with PEFT's
custom-module hook (`LoraConfig._register_custom_module`, experimental in PEFT 0.21, so the
version is pinned by the tests). Its forward is the 4-bit product plus the unmerged low-rank
path `x @ A^T @ B^T * (alpha / r)`; the packed base tensors are buffers, so they never get a
gradient and the optimiser never sees them. Merging is refused: a 4-bit weight cannot absorb a
bf16 delta without re-quantising, which would change the policy.

Two PEFT details need care, both handled here:
- `LoraConfig._custom_modules` is not written to adapter_config.json, so a plain
  `PeftModel.from_pretrained` does not know about QuantLinear: load with `load_lora`. On a plain
  model holding the dequantised (or the original bf16) weights, plain PEFT loads the same file
  (tests/test_lora.py checks the logits).
- While injecting, PEFT looks for the base layer's device through `.weight` / `.qweight` and
  otherwise calls `next(child.parameters())`, which fails for a bias-free QuantLinear (it has only
  buffers). PEFT's own AQLM support sets `target.qweight` for this; we set it only for the duration
  of the injection (`_peft_injection`) and remove it afterwards, so nothing stale is kept.

Trainable RMSNorm weights (`train_norms`) use PEFT's `modules_to_save`: the norms are copied
into the adapter, trained, and saved in adapter_model.safetensors.

Try it:  pytest tests/test_lora.py -q
"""

from __future__ import annotations

import contextlib
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import VARIANT_KWARG_KEYS as _VARIANT_KEYS
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from qerl.nn import fused_train
from qerl.nn.lora_settings import DEFAULT_NORM_MODULES, DEFAULT_TARGET_MODULES, LoraSettings
from qerl.nn.quant_linear import QuantLinear
from qerl.threads import INIT_LOCK

__all__ = [
    "DEFAULT_NORM_MODULES",
    "DEFAULT_TARGET_MODULES",
    "LoraSettings",
    "QuantLoraLinear",
    "apply_lora",
    "lora_config",
    "load_lora",
    "lora_state_dict",
    "trainable_parameters",
]


class QuantLoraLinear(nn.Module, LoraLayer):
    """PEFT LoRA layer over a QuantLinear: y = Q(x) + B(A(dropout(x))) * scaling, never merged."""

    def __init__(
        self,
        base_layer: nn.Module,
        adapter_name: str,
        config: LoraConfig,
        r: int = 0,
        lora_alpha: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer, **kwargs)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        if getattr(config, "use_dora", False):
            raise ValueError("DoRA is not supported over a 4-bit QuantLinear (it needs the dense weight norm)")
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    # PEFT asks these of the base layer; a QuantLinear has no `.weight`.
    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        return base.in_features, base.out_features

    def _get_base_layer_device_and_dtype(self, base_layer: nn.Module):
        return base_layer.storage_device, getattr(base_layer, "compute_dtype", None)

    @property
    def weight(self) -> torch.Tensor:  # some HF code reads `.weight.dtype/.device` of a linear
        raise AttributeError(
            "a LoRA layer over a 4-bit QuantLinear has no dense weight; use get_base_layer().dequantized_weight()"
        )

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise NotImplementedError(
            "LoRA over a 4-bit QuantLinear stays unmerged: merging would re-quantise the weight and change the policy"
        )

    def unmerge(self) -> None:
        if self.merged:  # pragma: no cover - merge() never succeeds
            raise RuntimeError("unexpected merged adapters on a QuantLoraLinear")

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """B @ A * scaling (float32), for inspection; never added to the 4-bit weight."""
        a = self.lora_A[adapter].weight.float()
        b = self.lora_B[adapter].weight.float()
        return (b @ a) * self.scaling[adapter]

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if self.disable_adapters:
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        return _base_plus_adapters(self, x, *args, **kwargs)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def add_lora(result: torch.Tensor, x: torch.Tensor, lora_a: nn.Module, lora_b: nn.Module, scaling: float) -> torch.Tensor:
    """result + lora_b(lora_a(x)) * scaling, fused into the expand product where possible.

    The low-rank update goes inside the expand product (C + scaling * h @ B^T, one rounding, no
    separate scale and add passes over the [tokens x out] result) when the operands share a dtype
    (always under bf16 autocast): on a GPU under autocast one Triton pass over C
    (fused_train.lora_expand_add: cuBLAS's K = r addmm moves C at ~1.1 TB/s), else torch.addmm;
    otherwise, or with fused_train.ENABLED_LORA_ADD off, PEFT's expression."""
    h = lora_a(x)
    if not fused_train.ENABLED_LORA_ADD or type(lora_b) is not nn.Linear or lora_b.bias is not None:
        return result + lora_b(h) * scaling
    dev = result.device.type
    cast = torch.is_autocast_enabled(dev) if dev in ("cuda", "cpu") else False
    if not cast and not (result.dtype == h.dtype == lora_b.weight.dtype):
        return result + lora_b(h) * scaling
    if cast and result.is_cuda:
        out = fused_train.lora_expand_add(result, h, lora_b.weight, scaling)
        if out is not None:
            return out
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]), lora_b.weight.t(),
                      alpha=scaling)
    return out.view(result.shape)


def _base_plus_adapters(layer: LoraLayer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The base layer's output plus each active adapter's update (add_lora), in the base's dtype."""
    result = layer.base_layer(x, *args, **kwargs)
    out_dtype = result.dtype
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        xa = layer._cast_input_dtype(x, lora_a.weight.dtype)
        result = add_lora(result, layer.lora_dropout[name](xa), lora_a, lora_b, layer.scaling[name])
    return result.to(out_dtype)


class FusedLoraLinear(LoraLinear):
    """PEFT's LoRA Linear (bf16 bases) with the same fused update as QuantLoraLinear, so the bf16
    LoRA baseline and the 4-bit runs train through one LoRA code path. Anything but plain LoRA
    (DoRA and other variants, mixed-batch adapters, merged weights) is PEFT's own forward."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = (fused_train.ENABLED_LORA_ADD and not self.disable_adapters and not self.merged and not self.lora_variant
                 and "adapter_names" not in kwargs and not any(k in kwargs for k in _VARIANT_KEYS))
        if not plain:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        return _base_plus_adapters(self, x, *args, **kwargs)


# QuantLinear first: the first isinstance match wins
_CUSTOM_MODULES = {QuantLinear: QuantLoraLinear, nn.Linear: FusedLoraLinear}


def lora_config(settings: LoraSettings, inference_mode: bool = False) -> LoraConfig:
    """A peft.LoraConfig for `settings`, with QuantLinear registered."""
    cfg = LoraConfig(
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        lora_dropout=settings.lora_dropout,
        target_modules=list(settings.target_modules),
        modules_to_save=list(settings.norm_modules) if settings.train_norms else None,
        use_rslora=settings.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        inference_mode=inference_mode,
    )
    cfg._register_custom_module(_CUSTOM_MODULES)
    return cfg


@contextlib.contextmanager
def _peft_injection(model: nn.Module):
    """Give each QuantLinear a `qweight` (an empty uint8 tensor where its weight lives) while PEFT injects adapters.

    PEFT reads the device of a target layer from `.weight`/`.qweight`, else from its first
    parameter; bias-free QuantLinears have none. The attribute is removed afterwards so no
    stale reference survives a later `.to(device)`."""
    tagged = []
    for mod in model.modules():
        if isinstance(mod, QuantLinear) and "qweight" not in mod.__dict__ and not hasattr(type(mod), "qweight"):
            mod.__dict__["qweight"] = torch.empty(0, dtype=torch.uint8, device=mod.storage_device)
            tagged.append(mod)
    try:
        yield
    finally:
        for mod in tagged:
            mod.__dict__.pop("qweight", None)


def _check_targets(model: nn.Module, settings: LoraSettings) -> None:
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (nn.Linear, QuantLinear))}
    missing = [t for t in settings.target_modules if t not in names]
    if missing:
        raise ValueError(
            f"LoRA target modules {missing} are not linear layers of this model; "
            f"its linear layers are named {sorted(names)}"
        )


def apply_lora(model: nn.Module, settings: LoraSettings | None = None, adapter_name: str = "default",
               seed: int | None = None) -> PeftModel:
    """Wrap `model` (bf16 nn.Linear or 4-bit QuantLinear decoder) with trainable LoRA adapters.

    Only the LoRA matrices (and the norm copies with `train_norms`) require grad afterwards. With `seed`, the A
    matrices are drawn from a private generator (`seeded_adapter_init`) instead of the process-wide RNG."""
    settings = settings or LoraSettings()
    _check_targets(model, settings)
    cfg = lora_config(settings)
    with INIT_LOCK, _peft_injection(model), warnings.catch_warnings():  # qerl.threads: why the lock
        warnings.filterwarnings("ignore", message=".*custom.*", category=UserWarning)
        peft_model = get_peft_model(model, cfg, adapter_name=adapter_name)
    if seed is not None:
        seeded_adapter_init(peft_model, seed, adapter_name)
    _freeze_base(peft_model)
    return peft_model


def seeded_adapter_init(peft_model: nn.Module, seed: int, adapter_name: str = "default") -> None:
    """Draw every lora_A of `adapter_name` again from PEFT's default distribution (kaiming-uniform with a = sqrt(5):
    U(-1/sqrt(in_features), +1/sqrt(in_features))) with a private CPU generator seeded with `seed`, in parameter
    name order; lora_B stays zero. PEFT draws from the process-wide RNG, which other threads reseed and draw from
    while the flow trains variants side by side (lm-eval seeds it, other trainers seed it and init their own
    adapters), so the same recipe and seed gave different adapters, and different trained rows, run to run."""
    g = torch.Generator().manual_seed(int(seed))
    key = f".lora_A.{adapter_name}.weight"
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if name.endswith(key):
                bound = 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-bound, bound, generator=g))


def load_lora(
    model: nn.Module, path: str | Path, is_trainable: bool = False, adapter_name: str = "default"
) -> PeftModel:
    """Load a PEFT adapter saved by `save_pretrained` onto `model` (QuantLinear-aware)."""
    path = Path(path)
    if not (path / "adapter_config.json").exists():
        raise FileNotFoundError(f"{path} holds no PEFT adapter (adapter_config.json missing)")
    cfg = LoraConfig.from_pretrained(str(path))
    cfg._register_custom_module(_CUSTOM_MODULES)
    cfg.inference_mode = not is_trainable
    with INIT_LOCK, _peft_injection(model):
        peft_model = PeftModel.from_pretrained(
            model, str(path), adapter_name=adapter_name, is_trainable=is_trainable, config=cfg
        )
    if is_trainable:
        _freeze_base(peft_model)
    return peft_model


def _freeze_base(peft_model: nn.Module) -> None:
    """Belt and braces: no QuantLinear tensor is ever trainable (bias included)."""
    for mod in peft_model.modules():
        if isinstance(mod, QuantLinear):
            for p in mod.parameters(recurse=False):
                p.requires_grad_(False)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors as PEFT saves them (keys without the adapter name)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)
