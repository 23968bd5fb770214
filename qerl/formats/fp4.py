"""E2M1 (FP4) codes and nibble packing, shared by the nvfp4 and mxfp4 formats.

E2M1: 1 sign bit (code bit 3), 2 exponent bits, 1 mantissa bit. Magnitudes of codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6. Rounding is to the nearest magnitude with ties going to the even
code, and values beyond 6 saturate. The sign bit follows the sign of the input, so a small
negative value that rounds to zero is stored as code 8 (negative zero): compressed-tensors does
the same, and we match its bytes exactly.

Packing: two codes per byte along the last dimension, the element with the even index in the
low nibble.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
# Magnitude of each code 0..7; codes 8..15 are the negatives.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """All 16 code values, index = code (8..15 negative, 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags]).to(dtype)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8, one code per element).

    Decision points are the midpoints between neighbouring magnitudes; at an exact midpoint
    the even code wins (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0).
    """
    a = x.abs()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Code (uint8, 0..15) -> value."""
    return e2m1_table(codes.device, dtype)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes (0..15) -> [..., K/2] bytes, even index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of 4-bit codes along the last dim ({codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)
