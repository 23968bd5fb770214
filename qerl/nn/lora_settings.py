"""LoRA hyper-parameters, importable without PEFT (recipes validate them before anything loads)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Norm modules made trainable with `train_norms` (PEFT modules_to_save names: suffix match).
DEFAULT_NORM_MODULES = ("input_layernorm", "post_attention_layernorm", "norm")


class LoraSettings(BaseModel):
    """LoRA hyper-parameters (names as in peft.LoraConfig)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    train_norms: bool = False  # also train the RMSNorm weights (PEFT modules_to_save)
    norm_modules: list[str] = Field(default_factory=lambda: list(DEFAULT_NORM_MODULES))
    use_rslora: bool = False


__all__ = ["DEFAULT_NORM_MODULES", "DEFAULT_TARGET_MODULES", "LoraSettings"]
