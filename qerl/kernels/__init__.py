"""4-bit weight x bf16 matmuls behind one dispatch: backend = auto | torch | triton.

    state = prepare("nvfp4", tensors)          # once per layer: checkpoint tensors -> kernel layout
    y = linear(x, state, "nvfp4", bias=None)    # x [..., K] -> y [..., N]; autograd gives dx only

`triton` runs the fused kernels of `w4a16_triton.py` (CUDA GPU + triton; nvfp4 and mxfp4).
`torch` dequantises and multiplies with plain torch (`reference.py`); it runs anywhere and is what
a CPU always gets. `auto` picks triton when it is available and the format has a fused kernel.

Importing this package does not import triton and does not initialise CUDA; `available()`
checks both lazily and caches the answer.
"""

from __future__ import annotations

import functools

import torch

from qerl.kernels import layout

BACKENDS = ("auto", "torch", "triton")
FUSED_FORMATS = ("nvfp4", "mxfp4")


# The kernels are built, tested and timed on Hopper (sm_90): their nvfp4 decode multiplies packed bf16x2 (sm_90)
# and converts FP8-E4M3 scales in hardware (sm_89+). On an older GPU `auto` takes the torch backend (dequantise +
# matmul), with one warning. From PORTABLE_CAPABILITY (Ampere) backend="triton" runs the 4-bit Triton kernels in
# their portable form (w4a16_triton.PORTABLE: fp32 decode, integer E4M3 scales below 8.9; built for sm_80 / 86 /
# 89, numerics checked on Hopper, speed not measured on such a GPU); the engine's other Triton ops stay off there.
MIN_CAPABILITY = (9, 0)
PORTABLE_CAPABILITY = (8, 0)


class KernelUnavailable(RuntimeError):
    """The triton backend was asked for but cannot run here."""

    def __init__(self, msg: str = "the triton backend needs a CUDA GPU of compute capability >= 8.0 (9.0, Hopper, "
                                  "for the fast kernels) and triton"):
        super().__init__(msg)


def _gpu_capability() -> tuple[int, int] | None:
    """The current CUDA GPU's compute capability; None without a usable one."""
    try:
        return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    except Exception:
        return None


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401  (importable is all we ask)
    except Exception:
        return False
    return True


def _warn(msg: str) -> None:
    import warnings

    warnings.warn(msg, stacklevel=3)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when a CUDA GPU of compute capability >= MIN_CAPABILITY is visible and triton imports (cached)."""
    cap = _gpu_capability()
    if cap is None:
        return False
    if cap < MIN_CAPABILITY:
        _warn(f"qerl: the fused 4-bit kernels need compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
              f"(Hopper); this GPU is {cap[0]}.{cap[1]}: using the torch backend (dequantise + matmul)")
        return False
    return _triton_imports()


@functools.lru_cache(maxsize=None)
def portable_available() -> bool:
    """True where backend="triton" can run the 4-bit Triton kernels: a CUDA GPU of compute capability >=
    PORTABLE_CAPABILITY and triton (cached); below MIN_CAPABILITY they take their portable form, with one warning."""
    cap = _gpu_capability()
    if cap is None or cap < PORTABLE_CAPABILITY or not _triton_imports():
        return False
    if cap < MIN_CAPABILITY:
        _warn("qerl: backend='triton' on a GPU below compute capability 9.0 runs the 4-bit Triton kernels in their "
              "portable form (fp32 decode; built for sm_80 / 86 / 89 and checked for numerics on Hopper, not timed "
              "on this GPU class)")
    return True


def resolve_backend(backend: str, device, fmt: str | None = None) -> str:
    """'auto' | 'torch' | 'triton' -> the backend that will run ('torch' or 'triton').

    CPU tensors always take torch under auto; asking for triton where it cannot run raises
    KernelUnavailable. `fmt` None means a format with a fused kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; valid: {', '.join(BACKENDS)}")
    device = torch.device(device)
    fused = fmt is None or fmt in FUSED_FORMATS
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not fused:
            raise KernelUnavailable(f"no fused triton kernel for {fmt!r}; use backend='torch' (dequantise, then matmul)")
        if device.type != "cuda" or not portable_available():
            raise KernelUnavailable()
        return "triton"
    return "triton" if (fused and device.type == "cuda" and available()) else "torch"


# --------------------------------------------------------------------------- kernel layout


def prepare(fmt: str, tensors: dict[str, torch.Tensor], locks: int | None = None, order: str | None = None) -> dict:
    """Convert checkpoint tensors ONCE into the state `linear` consumes (on their device).

    nvfp4 / mxfp4: `words` int32 and `scale` uint8 (the FP8-E4M3 bits or the E8M0 exponents),
    both tiled [N/64, K/256, 64, .] as layout.py describes; `kb` = K/256 blocks; `alpha`
    float32 [1] on the device (the per-tensor factor applied to the fp32 accumulator: 2^8 / g
    for nvfp4, 2^J for mxfp4); `exp_bias`
    (python int, mxfp4 only), `scale_bits` (every scale converts by integer arithmetic: nvfp4 by
    scale_bits_exact, mxfp4 where every exponent's multiplier is a normal bf16), and two int32 counter
    arrays for the split-reduction path.
    nf4 and bf16: the checkpoint tensors themselves (torch backend only).
    `order` (nvfp4): the words' order, "rows" or "frag" (layout.py; default layout.default_order(), i.e.
    QERL_W4A16_ORDER, where "auto" picks frag on sm_90 when K % 256 == 0): "frag" holds each thread's wgmma
    A-fragment pairs in one word (rwg reads them with 9 integer ops per word); kept in state["order"]. mxfp4 is
    always "rows".

    This costs one host sync (mxfp4 exponent range, nvfp4 scale check); do it before CUDA-graph capture.
    """
    if fmt == "bf16":
        return {"fmt": fmt, "weight": tensors["weight"], "n": tensors["weight"].shape[0], "k": tensors["weight"].shape[1]}
    if fmt == "nf4":
        n, k2 = tensors["weight_packed"].shape
        return {"fmt": fmt, "tensors": dict(tensors), "n": n, "k": 2 * k2}
    if fmt not in FUSED_FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    packed = tensors["weight_packed"]
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % 32:
        raise ValueError(f"the fused kernels need K % 32 == 0, got K={k}")
    device = packed.device
    group = 16 if fmt == "nvfp4" else 32
    order = layout.default_order(fmt, device, k) if order is None else order
    if order not in layout.ORDERS:
        raise ValueError(f"unknown word order {order!r}; valid: {', '.join(layout.ORDERS)}")
    if order == "frag":
        if fmt != "nvfp4":
            raise ValueError(f"the fragment word order is built for nvfp4, not {fmt!r}")
        from qerl.formats.fp4 import unpack_nibbles

        tiles = layout.codes_to_frag_tiles(unpack_nibbles(packed))
    else:
        tiles = layout.to_tiles(layout.packed_to_words(packed), layout.TILE_K // 8)
    state = {"fmt": fmt, "n": n, "k": k, "kb": layout.tile_shape(n, k)[1], "words": tiles, "order": order}
    scale_u8 = tensors["weight_scale"].contiguous().view(torch.uint8)
    state["scale"] = layout.to_tiles(scale_u8, layout.TILE_K // group)
    if fmt == "nvfp4":
        g = tensors["weight_global_scale"].to(device=device, dtype=torch.float32).reshape(1)
        state["global_scale"] = g
        state["alpha"] = (2.0 ** layout.NVFP4_EXP_OFFSET) / g
        state["exp_bias"] = 0
        state["scale_bits"] = scale_bits_exact(packed, scale_u8)
    else:
        # W' = q_sub * 2^(e + 126 - J - 127) must stay a normal bf16 and the multiplier
        # 2^(e - 1 - J) must not overflow: J = max(8, e_max - 128) covers any exponent spread
        # up to ~240 binades (groups below 2^(J+2-127) are ~0 anyway).
        e_min, e_max = (torch.stack([scale_u8.min(), scale_u8.max()]).tolist() if scale_u8.numel()
                        else (127, 127))  # one host sync
        j = max(8, e_max - 128)
        state["alpha"] = torch.full((1,), 2.0**j, dtype=torch.float32, device=device)
        state["exp_bias"] = 126 - j
        # every multiplier 2^(e + exp_bias - 127) a normal bf16 (e + exp_bias <= 254 holds by J's choice), so
        # its bits are (e + exp_bias) << 7: the Gluon GEMV's integer conversion (w4a16_gluon._decode_mx)
        state["scale_bits"] = e_min + state["exp_bias"] >= 1
    count = locks if locks is not None else 2048
    state["locks"] = torch.zeros(count, dtype=torch.int32, device=device)
    state["locks_bwd"] = torch.zeros(count, dtype=torch.int32, device=device)
    return state


def scale_bits_exact(packed: torch.Tensor, scale_u8: torch.Tensor) -> bool:
    """True when every nvfp4 group scale converts to the kernels' bf16 multiplier s * 2^118 by
    integer arithmetic alone, bits = (byte << 4) + 0x7700: the byte is a positive normal FP8-E4M3
    value (0x08..0x7E), or 0x00 in a group whose 16 codes are all +-0 (they decode to +-0 under any
    finite multiplier). Zero scales with non-zero codes, subnormal, negative or NaN scales keep the
    float conversion. One host sync."""
    if scale_u8.numel() == 0:
        return True
    n = packed.shape[0]
    mags = (packed & 0x77).reshape(n, -1, 8)  # the 16 codes of a group without their sign bits
    live = (mags != 0).any(dim=2)
    s = scale_u8.reshape(n, -1)
    bad = ((s < 0x08) & ((s != 0) | live)) | (s > 0x7E)
    return not bool(bad.any().item())


def state_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Back from a prepared state to checkpoint tensors (exact), for the torch path and tests."""
    fmt = state["fmt"]
    if fmt == "bf16":
        return {"weight": state["weight"]}
    if fmt == "nf4":
        return state["tensors"]
    n, k = state["n"], state["k"]
    group = 16 if fmt == "nvfp4" else 32
    from qerl.formats.fp4 import pack_nibbles

    packed = pack_nibbles(layout.tiles_to_codes(state["words"], n, k, state.get("order", "rows")))
    scale = layout.from_tiles(state["scale"], n, k // group)
    if fmt == "nvfp4":
        return {"weight_packed": packed, "weight_scale": scale.view(torch.float8_e4m3fn),
                "weight_global_scale": state["global_scale"]}
    return {"weight_packed": packed, "weight_scale": scale}


# --------------------------------------------------------------------------- matmuls


def _torch_weight(state: dict, dtype: torch.dtype) -> torch.Tensor:
    from qerl.kernels.reference import dequant

    if state["fmt"] == "bf16":
        return state["weight"].to(dtype)
    return dequant(state["fmt"], state_tensors(state), dtype)


def _mm_forward(x2: torch.Tensor, state: dict, bias, backend: str) -> torch.Tensor:
    if backend == "triton":
        from qerl.kernels import w4a16_triton

        y = w4a16_triton.forward(x2.to(torch.bfloat16), state, bias=bias)
        return y if x2.dtype == torch.bfloat16 else y.to(x2.dtype)
    y = x2 @ _torch_weight(state, x2.dtype).T
    return y if bias is None else y + bias.to(y.dtype)


def _mm_backward(dy2: torch.Tensor, state: dict, backend: str, dtype: torch.dtype) -> torch.Tensor:
    if backend == "triton":
        from qerl.kernels import w4a16_triton

        dx = w4a16_triton.backward(dy2.to(torch.bfloat16), state)
        return dx if dtype == torch.bfloat16 else dx.to(dtype)
    return dy2.to(dtype) @ _torch_weight(state, dtype)


class _W4Linear(torch.autograd.Function):
    """y = x @ W^T (+ b) with a frozen quantised W: backward gives grad_x (and grad_b) only."""

    @staticmethod
    def forward(ctx, x, bias, state, backend):
        k = state["k"]
        x2 = x.reshape(-1, k)
        y = _mm_forward(x2, state, bias, backend)
        ctx.state, ctx.backend, ctx.x_shape, ctx.x_dtype = state, backend, x.shape, x.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], state["n"])

    @staticmethod
    def backward(ctx, grad_y):
        state = ctx.state
        dy2 = grad_y.reshape(-1, state["n"])
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _mm_backward(dy2, state, ctx.backend, ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_b = dy2.sum(0)
        return grad_x, grad_b, None, None


def linear(x: torch.Tensor, state: dict, fmt: str | None = None, bias: torch.Tensor | None = None,
           backend: str = "auto") -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias) for x [..., K]; differentiable in x (and bias), never in W.

    No host sync on the triton path, so it can be captured in a CUDA graph (prepare first)."""
    fmt = state["fmt"] if fmt is None else fmt
    if fmt != state["fmt"]:
        raise ValueError(f"state was prepared for {state['fmt']!r}, not {fmt!r}")
    if x.shape[-1] != state["k"]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {state['k']}")
    resolved = resolve_backend(backend, x.device, fmt)
    return _W4Linear.apply(x, bias, state, resolved)


__all__ = [
    "BACKENDS",
    "FUSED_FORMATS",
    "KernelUnavailable",
    "available",
    "linear",
    "portable_available",
    "prepare",
    "resolve_backend",
    "state_tensors",
]
