"""Neural-network pieces: QuantLinear (frozen 4-bit weight), later LoRA over it and AQN."""

from qerl.nn.quant_linear import QuantLinear

__all__ = ["QuantLinear"]
