"""Adaptive Quantization Noise (AQN): stage-wise decayed Gaussian noise on the RMSNorm weights.

DESIGN.md section 3. Training of T optimiser steps is split into K equal stages; stage 0 adds
no noise, stage i >= 1 uses

    sigma_i = sigma_start * (sigma_end / sigma_start) ** ((i - 1) / (K - 2))

At every optimiser step a fresh z ~ N(0, sigma^2 I) of length hidden_size is drawn for each
decoder layer's `input_layernorm` (feeds q/k/v) and `post_attention_layernorm` (feeds
gate/up), and `w + z` is used as the norm weight: channel-wise multiplicative noise on the
inputs of the following quantised linears, with no extra parameter and no extra kernel.

    aqn = AdaptiveQuantNoise(model, AQNSettings(enabled=True), total_steps=100)
    aqn.resample(step)              # once per optimiser step
    with aqn.applied():             # noisy norms for the rollout policy ...
        rollouts = sample(model, ...)
    # ... clean weights here again: the very same tensor objects, bit for bit

Norm modules are found by attribute name (`norm_names`) on the decoder layers, not by class:
any module with a 1-D `.weight` (a Parameter, a buffer or a plain tensor) qualifies, so it also
fires for non-Hugging-Face RMSNorm implementations (the reference code only matched HF's
RMSNorm class, so in a vLLM rollout its hook may never fire). A norm wrapped by PEFT
(`modules_to_save` with `train_norms`) holds the original and a trainable copy; both get the
same z, so the noise follows whichever is active.

Noise is never added in place. `applied()` swaps a new tensor `w + z` into the module and puts
the original tensor object back on exit, so the clean weights never accumulate float error.
Inside a grad-enabled region `w + z` keeps the graph to `w`, so with `place="both"` trainable
norms still get their gradient. The noise for step s comes from a generator seeded by
(seed, s): a resumed run draws the same noise.

Precision note: in bf16 a weight near 1.0 has a spacing of 2^-7 ~ 7.8e-3, so w + z rounds
most noise below ~4e-3 away; in float32 all of it survives. This is how the noise behaves in a
bf16 rollout engine too (the paper's setting); the sigma we log is the nominal one.

Try it:  pytest tests/test_aqn.py -q -s   (prints the sigma table)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

DEFAULT_NORM_NAMES = ("input_layernorm", "post_attention_layernorm")

__all__ = [
    "AQNSettings",
    "AdaptiveQuantNoise",
    "NormTarget",
    "aqn_sigmas",
    "find_norm_targets",
    "sigma_at_step",
    "stage_at_step",
]


class AQNSettings(BaseModel):
    """AQN configuration (reference defaults: 1e-2 -> 1e-4 over 10 stages, rollout only)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    sigma_start: float = Field(1e-2, gt=0)
    sigma_end: float = Field(1e-4, gt=0)
    num_stages: int = Field(10, ge=2)
    place: Literal["rollout", "both"] = "rollout"  # noisy norms in the rollout only, or also in training
    norm_names: list[str] = Field(default_factory=lambda: list(DEFAULT_NORM_NAMES))
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "AQNSettings":
        if not self.norm_names:
            raise ValueError("norm_names must name at least one norm module of the decoder layers")
        return self


# ----------------------------------------------------------------------------- schedule


def aqn_sigmas(sigma_start: float = 1e-2, sigma_end: float = 1e-4, num_stages: int = 10) -> list[float]:
    """Sigma per stage: [0, sigma_start, ..., sigma_end] (geometric over stages 1..K-1)."""
    k = int(num_stages)
    if k < 2:
        raise ValueError(f"num_stages must be >= 2 (stage 0 is noise-free), got {num_stages}")
    if k == 2:
        return [0.0, float(sigma_start)]
    ratio = sigma_end / sigma_start
    return [0.0] + [float(sigma_start * ratio ** ((i - 1) / (k - 2))) for i in range(1, k)]


def stage_at_step(step: int, total_steps: int, num_stages: int = 10) -> int:
    """Stage of 0-based optimiser step `step` when `total_steps` are split into K equal stages."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    step = min(max(int(step), 0), total_steps - 1)
    return min(step * num_stages // total_steps, num_stages - 1)


def sigma_at_step(
    step: int, total_steps: int, sigma_start: float = 1e-2, sigma_end: float = 1e-4, num_stages: int = 10
) -> float:
    """The AQN sigma for 0-based optimiser step `step` of `total_steps`."""
    return aqn_sigmas(sigma_start, sigma_end, num_stages)[stage_at_step(step, total_steps, num_stages)]


# ----------------------------------------------------------------------------- targets


@dataclass
class NormTarget:
    """One noise site: a decoder layer's norm (one z shared by the leaf modules under it)."""

    name: str  # qualified name of the norm attribute, e.g. model.layers.3.input_layernorm
    modules: list[nn.Module] = field(default_factory=list)  # leaf modules whose `.weight` gets w + z
    hidden_size: int = 0


def _own_weight(mod: nn.Module) -> torch.Tensor | None:
    """The tensor the module itself holds as `weight` (a parameter, a buffer or a plain
    attribute), not one a wrapper forwards through a property."""
    for store in (mod._parameters, mod._buffers, mod.__dict__):
        w = store.get("weight")
        if isinstance(w, torch.Tensor):
            return w
    return None


def _leaf_norms(module: nn.Module) -> list[nn.Module]:
    """Modules under `module` (itself included) that hold a 1-D floating `weight` of their own
    (a PEFT ModulesToSaveWrapper yields the original and the trainable copy, not itself)."""
    out = []
    for sub in module.modules():
        w = _own_weight(sub)
        if w is not None and w.dim() == 1 and w.is_floating_point():
            out.append(sub)
    return out


def find_norm_targets(model: nn.Module, norm_names=DEFAULT_NORM_NAMES) -> list[NormTarget]:
    """Every `<layer>.<norm_name>` of the decoder layers (any class with a 1-D weight)."""
    targets = []
    for qual, mod in model.named_modules():
        for attr in norm_names:
            child = mod._modules.get(attr) if hasattr(mod, "_modules") else None
            if child is None:
                continue
            leaves = _leaf_norms(child)
            if not leaves:
                continue
            sizes = {int(m.weight.shape[0]) for m in leaves}
            if len(sizes) != 1:
                raise ValueError(f"{qual}.{attr}: norm copies disagree on the hidden size {sorted(sizes)}")
            targets.append(NormTarget(f"{qual}.{attr}" if qual else attr, leaves, sizes.pop()))
    return targets


# ----------------------------------------------------------------------------- noise


def _get_weight(mod: nn.Module) -> torch.Tensor:
    w = _own_weight(mod)
    if w is None:
        raise RuntimeError(f"{type(mod).__name__} lost its weight tensor")
    return w


def _set_weight(mod: nn.Module, tensor: torch.Tensor) -> None:
    # Written straight into the module's dicts: nn.Module.__setattr__ refuses a plain tensor
    # where a Parameter lives, and we must put back the very same object afterwards.
    if "weight" in mod._parameters:
        mod._parameters["weight"] = tensor
    elif "weight" in mod._buffers:
        mod._buffers["weight"] = tensor
    else:
        mod.__dict__["weight"] = tensor


class AdaptiveQuantNoise:
    """Per-step channel noise on the decoder norms, applied only inside `applied()`."""

    def __init__(self, model: nn.Module, settings: AQNSettings | None = None, total_steps: int = 1):
        self.settings = settings or AQNSettings(enabled=True)
        self.total_steps = int(total_steps)
        if self.total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {total_steps}")
        self.targets = find_norm_targets(model, self.settings.norm_names)
        if self.settings.enabled and not self.targets:
            raise ValueError(
                f"AQN found no norm modules named {self.settings.norm_names} with a 1-D weight in the model; "
                "set aqn.norm_names to the model's decoder-layer norm attribute names"
            )
        self.sigmas = aqn_sigmas(self.settings.sigma_start, self.settings.sigma_end, self.settings.num_stages)
        self.step = 0
        self.sigma = 0.0
        self._noise: list[torch.Tensor] | None = None
        self._active = False

    def sigma_at(self, step: int) -> float:
        if not self.settings.enabled:
            return 0.0
        return self.sigmas[stage_at_step(step, self.total_steps, self.settings.num_stages)]

    def stage_at(self, step: int) -> int:
        return stage_at_step(step, self.total_steps, self.settings.num_stages)

    @torch.no_grad()
    def resample(self, step: int) -> float:
        """Draw this step's z for every target (deterministic for (seed, step)); returns sigma."""
        if self._active:
            raise RuntimeError("AQN.resample() inside applied(): leave the noisy context first")
        self.step = int(step)
        self.sigma = self.sigma_at(step)
        if self.sigma == 0.0:
            self._noise = None
            return 0.0
        gen = torch.Generator(device="cpu")
        gen.manual_seed((int(self.settings.seed) * 1_000_003 + self.step * 7919 + 12345) % (2**63 - 1))
        noise = []
        for t in self.targets:
            z = torch.randn(t.hidden_size, generator=gen, dtype=torch.float32) * self.sigma
            noise.append(z)
        self._noise = noise
        return self.sigma

    def noise_vectors(self) -> list[torch.Tensor] | None:
        """This step's z per target (float32), or None at sigma 0."""
        return self._noise

    @property
    def active(self) -> bool:
        return self._active

    @contextlib.contextmanager
    def applied(self, enabled: bool = True) -> Iterator[float]:
        """Swap `w + z` in for every target norm weight; restore the original objects on exit.

        Yields the sigma in use (0.0: nothing is changed)."""
        if not enabled or self._noise is None or self.sigma == 0.0:
            yield 0.0
            return
        if self._active:
            raise RuntimeError("AQN noise is already applied (nested applied() contexts)")
        saved: list[tuple[nn.Module, torch.Tensor]] = []
        try:
            for target, z in zip(self.targets, self._noise):
                for mod in target.modules:
                    w = _get_weight(mod)
                    noisy = w + z.to(device=w.device, dtype=w.dtype)
                    saved.append((mod, w))
                    _set_weight(mod, noisy)
            self._active = True
            yield self.sigma
        finally:
            for mod, w in reversed(saved):
                _set_weight(mod, w)
            self._active = False

    def state(self) -> dict:
        return {"step": self.step, "sigma": self.sigma, "stage": self.stage_at(self.step)}
