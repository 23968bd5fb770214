"""Triton kernels of qerl.nn.fused_train (imported on first use): RMSNorm and SiLU-gated product,
forward and backward, one program per row, rounding where Hugging Face's modules round.

- RMSNorm (Qwen2 / Llama): y = w * bf16(x * rsqrt(mean(x^2) + eps)), the statistics in float32;
  the backward gives dx (float32 math, one rounding); dw is left to the caller.
- SiLU-gated product (the SwiGLU MLP): y = bf16(silu(g)) * u, as `act_fn(gate) * up` rounds;
  the backward gives dg and du in one pass over dy, g, u.
- LoRA update: y = c + scale * h @ B^T, one pass over c (the backward is cuBLAS's).
- Token log-probs: log softmax(x / T)[t] per row of logits, read once (online logsumexp), and its
  backward (onehot - softmax) / T written once in the logits' dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    from qerl.kernels.w4a16_triton import _patch_interpreter

    _patch_interpreter()


@triton.jit
def _rms_fwd(x_ptr, w_ptr, y_ptr, r_ptr, N, sx, sy, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    xhat = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, (w * xhat).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + row, r)


@triton.jit
def _rms_bwd(dy_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, N, sdy, sx, sdx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(dy_ptr + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row)
    g = dy * w
    xhat = x * r
    dx = r * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
    tl.store(dx_ptr + row * sdx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_fwd(g_ptr, u_ptr, y_ptr, N, sg, su, sy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, sdy, sg, su, sdg, sdu, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(dy_ptr + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = (g * sig).to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(du_ptr + row * sdu + cols, (dy * s).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + row * sdg + cols, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty),
             mask=mask)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def rms_norm_fwd(x2, w, out_dtype, eps):
    """x2 [M, N] (unit stride along N) -> (y [M, N] out_dtype, rstd [M] float32)."""
    m, n = x2.shape
    y = x2.new_empty((m, n), dtype=out_dtype)
    r = x2.new_empty((m,), dtype=torch.float32)
    block = triton.next_power_of_2(n)
    _rms_fwd[(m,)](x2, w, y, r, n, x2.stride(0), y.stride(0), eps, BLOCK=block, num_warps=_warps(block))
    return y, r


def rms_norm_bwd(dy2, x2, w, r):
    m, n = x2.shape
    dx = x2.new_empty((m, n))
    block = triton.next_power_of_2(n)
    _rms_bwd[(m,)](dy2, x2, w, r, dx, n, dy2.stride(0), x2.stride(0), dx.stride(0), BLOCK=block,
                   num_warps=_warps(block))
    return dx


SILU_BLOCK = 1024


def silu_mul_fwd(g2, u2):
    m, n = g2.shape
    y = g2.new_empty((m, n))
    _silu_mul_fwd[(m, triton.cdiv(n, SILU_BLOCK))](g2, u2, y, n, g2.stride(0), u2.stride(0), y.stride(0),
                                                   BLOCK=SILU_BLOCK, num_warps=4)
    return y


def silu_mul_bwd(dy2, g2, u2):
    m, n = g2.shape
    dg, du = g2.new_empty((m, n)), u2.new_empty((m, n))
    _silu_mul_bwd[(m, triton.cdiv(n, SILU_BLOCK))](dy2, g2, u2, dg, du, n, dy2.stride(0), g2.stride(0),
                                                   u2.stride(0), dg.stride(0), du.stride(0), BLOCK=SILU_BLOCK,
                                                   num_warps=4)
    return dg, du


@triton.jit
def _lora_expand_add(c_ptr, h_ptr, b_ptr, y_ptr, M, N, R, scale, sc, sh, sb, sy,
                     BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, F32DOT: tl.constexpr):
    # y[BM, BN] = c + scale * h[BM, :R] @ b[BN, :R]^T: reads c once, writes y once
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rn = pn * BN + tl.arange(0, BN)
    rr = tl.arange(0, BR)
    h = tl.load(h_ptr + rm[:, None] * sh + rr[None, :], mask=(rm < M)[:, None] & (rr < R)[None, :], other=0.0)
    b = tl.load(b_ptr + rn[None, :] * sb + rr[:, None], mask=(rn < N)[None, :] & (rr < R)[:, None], other=0.0)
    if F32DOT:  # the interpreter's bf16 dot is wrong (triton 3.6); exact products in fp32 there
        acc = tl.dot(h.to(tl.float32), b.to(tl.float32))
    else:
        acc = tl.dot(h, b)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    c = tl.load(c_ptr + rm[:, None] * sc + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None] * sy + rn[None, :], (c + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand_add(c2, h2, b, scale: float):
    """c2 [M, N] + scale * h2 [M, R] @ b [N, R]^T, one rounding, into a new [M, N] tensor (c2's dtype);
    h2 and b in c2's dtype."""
    m, n = c2.shape
    r = h2.shape[1]
    y = c2.new_empty((m, n))
    br = max(16, triton.next_power_of_2(r))
    bm, bn = 64, 128
    _lora_expand_add[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        c2, h2, b, y, m, n, r, float(scale), c2.stride(0), h2.stride(0), b.stride(0), y.stride(0),
        BM=bm, BN=bn, BR=br, F32DOT=INTERPRETED, num_warps=4)
    return y


@triton.jit
def _token_logprob_fwd(x_ptr, t_ptr, lp_ptr, lse_ptr, V, sx, inv_t, BV: tl.constexpr):
    # one row of logits: lse = logsumexp(x / T) online over blocks of BV, logp = x[t] / T - lse
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * sx
    cols = tl.arange(0, BV)
    m = tl.full([BV], float("-inf"), tl.float32)
    s = tl.zeros([BV], tl.float32)
    for v0 in range(0, V, BV):
        x = tl.load(base + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        live = m_new > float("-inf")  # a lane that has seen no logit yet (vocab < BV) stays at 0
        s = tl.where(live, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    mx = tl.max(m, axis=0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    t = tl.load(t_ptr + row)
    xt = tl.load(base + t).to(tl.float32) * inv_t
    tl.store(lse_ptr + row, lse)
    tl.store(lp_ptr + row, xt - lse)


@triton.jit
def _token_logprob_bwd(x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, V, sx, sdx, inv_t, BV: tl.constexpr):
    # d logp / d x = (onehot(t) - softmax(x / T)) / T, times the row's incoming gradient
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BV)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row) * inv_t
    t = tl.load(t_ptr + row)
    for v0 in range(0, V, BV):
        v = v0 + cols
        x = tl.load(x_ptr + row * sx + v, mask=v < V, other=0.0).to(tl.float32) * inv_t
        d = g * (tl.where(v == t, 1.0, 0.0) - tl.exp(x - lse))
        tl.store(dx_ptr + row * sdx + v, d.to(dx_ptr.dtype.element_ty), mask=v < V)


LOGP_BLOCK = 2048


def token_logprob_fwd(x2, t, inv_t: float):
    """x2 [M, V] logits (unit stride along V), t [M] int64 -> (logp [M], lse [M]) float32."""
    m, v = x2.shape
    lp = x2.new_empty((m,), dtype=torch.float32)
    lse = x2.new_empty((m,), dtype=torch.float32)
    _token_logprob_fwd[(m,)](x2, t, lp, lse, v, x2.stride(0), float(inv_t), BV=LOGP_BLOCK, num_warps=8)
    return lp, lse


def token_logprob_bwd(x2, t, lse, g, inv_t: float):
    m, v = x2.shape
    dx = x2.new_empty((m, v))
    _token_logprob_bwd[(m,)](x2, t, lse, g, dx, v, x2.stride(0), dx.stride(0), float(inv_t), BV=LOGP_BLOCK,
                             num_warps=8)
    return dx


@triton.jit
def _to_bf16_rne(x):
    # float32 -> the nearest bfloat16 (ties to even), still held in float32: integer operations, which
    # no compiler pass can merge with the products around them (finite inputs; RoPE's are)
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rope_fwd(x_ptr, c_ptr, s_ptr, y_ptr, H, T, sxb, sxh, sxt, syb, syh, syt, scb, sct,
              HB: tl.constexpr, HALF: tl.constexpr, BWD: tl.constexpr, BF16: tl.constexpr):
    # one (batch, position) row, HB heads: y = x * cos + rotate_half(x) * sin, each product and the
    # sum rounded to x's dtype as torch's three ops round (forward); the backward (BWD) is the
    # transpose, dx = dy * cos - rotate_half(dy * sin), in float32 with one rounding
    row = tl.program_id(0)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, HALF)
    mask = (h < H)[:, None]
    xo = x_ptr + b * sxb + t * sxt + h[:, None].to(tl.int64) * sxh + d[None, :]
    yo = y_ptr + b * syb + t * syt + h[:, None].to(tl.int64) * syh + d[None, :]
    co = b * scb + t * sct + d
    x1 = tl.load(xo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xo + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + co).to(tl.float32)[None, :]
    c2 = tl.load(c_ptr + co + HALF).to(tl.float32)[None, :]
    s1 = tl.load(s_ptr + co).to(tl.float32)[None, :]
    s2 = tl.load(s_ptr + co + HALF).to(tl.float32)[None, :]
    dt = y_ptr.dtype.element_ty
    if BWD:
        y1 = (x1 * c1 + x2 * s2).to(dt)
        y2 = (x2 * c2 - x1 * s1).to(dt)
    elif BF16:  # each rounding made by hand: the compiler folds a cast pair away (measured, H100)
        y1 = _to_bf16_rne(_to_bf16_rne(x1 * c1) - _to_bf16_rne(x2 * s1)).to(dt)
        y2 = _to_bf16_rne(_to_bf16_rne(x2 * c2) + _to_bf16_rne(x1 * s2)).to(dt)
    else:
        y1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
        y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(yo, y1, mask=mask)
    tl.store(yo + HALF, y2, mask=mask)


ROPE_HEADS = 8


def rope(x, cos, sin, backward: bool = False):
    """x [B, H, T, D] (any strides, unit stride along D), cos / sin [B, T, D] (batch stride may be 0)
    -> y like x (same strides): x * cos + rotate_half(x) * sin, or with backward the gradient map."""
    bsz, heads, t, d = x.shape
    y = torch.empty_like(x)
    _rope_fwd[(bsz * t, triton.cdiv(heads, ROPE_HEADS))](
        x, cos, sin, y, heads, t, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        cos.stride(0), cos.stride(1), HB=ROPE_HEADS, HALF=d // 2, BWD=backward, BF16=x.dtype == torch.bfloat16,
        num_warps=4, enable_fp_fusion=False)
    return y
