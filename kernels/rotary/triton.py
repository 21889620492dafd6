"""rotate_rows in Triton: a program per tile of rows of one (batch, head) reads both halves of each key and its
position's cos/sin table rows, and writes the rotated key.

rotate_qk: a decode step's q and k rotated (after their per-head norms, if any) in one launch, a program per
(batch, head), launched ahead of the kernel before it (programmatic dependent launch): cos / sin and the norms'
weights are loaded before waiting for it, since that kernel (the q/k/v projection) writes only q and k.

Products and sums round one at a time (no fused multiply-add, a correctly rounded division), as the reference's
separate PyTorch operations do, so both give the same bits (but for the norm's sum of squares, summed in another
order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import cdiv
from kernels._gdc import grid_dependency_wait, use_pdl
from kernels._triton_common import check_device, launch, launch_context


@triton.jit
def _rotate_rows_fwd_kernel(
    X, Pos, Cos, Sin, Out,
    R, H, n_table, stride_xb, stride_xh, stride_xr, stride_ob, stride_oh, stride_or, stride_t,
    INVERSE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    at = tl.load(Pos + rows, mask=ok, other=0)
    at = tl.minimum(tl.maximum(at, 0), n_table - 1).to(tl.int64)
    c = tl.arange(0, HALF)
    x_at = X + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + rows.to(tl.int64)[:, None] * stride_xr
    x_lo = tl.load(x_at + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(x_at + HALF + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    t_at = at[:, None] * stride_t + c[None, :]
    cos_lo = tl.load(Cos + t_at, mask=ok[:, None], other=1.0)
    cos_hi = tl.load(Cos + t_at + HALF, mask=ok[:, None], other=1.0)
    sin_lo = tl.load(Sin + t_at, mask=ok[:, None], other=0.0)
    sin_hi = tl.load(Sin + t_at + HALF, mask=ok[:, None], other=0.0)
    if INVERSE:
        lo = tl.div_rn(x_lo * cos_lo + x_hi * sin_lo, cos_lo * cos_lo + sin_lo * sin_lo)
        hi = tl.div_rn(x_hi * cos_hi - x_lo * sin_hi, cos_hi * cos_hi + sin_hi * sin_hi)
    else:
        lo = x_lo * cos_lo - x_hi * sin_lo
        hi = x_hi * cos_hi + x_lo * sin_hi
    o_at = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows.to(tl.int64)[:, None] * stride_or
    tl.store(o_at + c[None, :], lo.to(Out.dtype.element_ty), mask=ok[:, None])
    tl.store(o_at + HALF + c[None, :], hi.to(Out.dtype.element_ty), mask=ok[:, None])


def rotate_rows_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       inverse: bool = False) -> torch.Tensor:
    """Same contract as reference.rotate_rows_reference; CUDA tensors (or any under the interpreter)."""
    if x.dim() != 4:
        raise ValueError(f"expected x of shape [B, H, R, D], got {tuple(x.shape)}")
    B, H, R, D = x.shape
    if D < 2 or D & (D - 1):
        raise ValueError(f"expected a power-of-two head dim, got {D}")
    if positions.shape != (R,) or positions.dtype != torch.int64:
        raise ValueError(f"expected positions of shape [{R}] int64, got {tuple(positions.shape)} {positions.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != D or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"expected {name} of shape [n, {D}] float32, contiguous, got {tuple(t.shape)} {t.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"expected cos and sin of one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, t in (("x", x), ("positions", positions), ("cos", cos), ("sin", sin)):
        check_device(name, t, x.device)
    out = torch.empty(B, H, R, D, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_r = max(1, min(64, 4096 // D))
    with launch_context(x.device):
        launch(_rotate_rows_fwd_kernel, (cdiv(R, block_r), B * H),
            x, positions, cos, sin, out, R, H, cos.shape[0], x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out.stride(1), out.stride(2), cos.stride(0),
            INVERSE=inverse, HALF=D // 2, BLOCK_R=block_r, num_warps=4, enable_fp_fusion=False,
        )
    return out


@triton.jit
def _halves(X, HALF: tl.constexpr):
    c = tl.arange(0, HALF)
    return tl.load(X + c).to(tl.float32), tl.load(X + HALF + c).to(tl.float32)


@triton.jit
def _rotate_qk_fwd_kernel(
    Q, K, Cos, Sin, Wq, Wk, Qo, Ko, eps_q, eps_k, Hq, Hkv, stride_qb, stride_qh, stride_kb, stride_kh, stride_cb,
    stride_sb, NORM: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (batch, head), q's heads then k's: grid [B * (Hq + Hkv)]."""
    b = tl.program_id(0) // (Hq + Hkv)
    h = tl.program_id(0) % (Hq + Hkv)
    if h < Hq:
        x_at = Q + b.to(tl.int64) * stride_qb + h * stride_qh
        o_at = Qo + (b.to(tl.int64) * Hq + h) * (2 * HALF)
        w_at = Wq
        eps = eps_q
    else:
        x_at = K + b.to(tl.int64) * stride_kb + (h - Hq) * stride_kh
        o_at = Ko + (b.to(tl.int64) * Hkv + h - Hq) * (2 * HALF)
        w_at = Wk
        eps = eps_k
    cos_lo, cos_hi = _halves(Cos + b.to(tl.int64) * stride_cb, HALF)
    sin_lo, sin_hi = _halves(Sin + b.to(tl.int64) * stride_sb, HALF)
    if NORM:
        w_lo, w_hi = _halves(w_at, HALF)
    grid_dependency_wait(PDL)
    x_lo, x_hi = _halves(x_at, HALF)
    if NORM:
        # The Llama family's RMSNorm: the normalised row rounded to the model's dtype, times the weight, rounded.
        r = tl.math.rsqrt((tl.sum(x_lo * x_lo, 0) + tl.sum(x_hi * x_hi, 0)) / (2 * HALF) + eps)
        dt = Qo.dtype.element_ty
        x_lo = (w_lo * (x_lo * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x_hi = (w_hi * (x_hi * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c = tl.arange(0, HALF)
    tl.store(o_at + c, (x_lo * cos_lo - x_hi * sin_lo).to(Qo.dtype.element_ty))
    tl.store(o_at + HALF + c, (x_hi * cos_hi + x_lo * sin_hi).to(Qo.dtype.element_ty))


def rotate_qk_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_norm: tuple[torch.Tensor, float] | None = None,
                     k_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.rotate_qk_reference; CUDA tensors (or any under the interpreter), CUDA-graph
    capturable."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"expected q of shape [B, Hq, 1, D], got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    if D < 2 or D & (D - 1):
        raise ValueError(f"expected a power-of-two head dim, got {D}")
    if k.dim() != 4 or k.shape[0] != B or k.shape[2:] != (1, D) or k.dtype != q.dtype:
        raise ValueError(f"expected k of shape [{B}, Hkv, 1, {D}] in {q.dtype}, got {tuple(k.shape)} {k.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (B, 1, D) or not t.is_floating_point():
            raise ValueError(f"expected {name} of shape [{B}, 1, {D}], got {tuple(t.shape)} {t.dtype}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("expected both the q and the k norm, or neither")
    norms = (q_norm[0], k_norm[0]) if q_norm is not None else ()
    for name, w in zip(("q norm weight", "k norm weight"), norms):
        if w.shape != (D,) or w.dtype != q.dtype:
            raise ValueError(f"expected the {name} of shape [{D}] in {q.dtype}, got {tuple(w.shape)} {w.dtype}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin), *zip(("q norm weight", "k norm weight"), norms)):
        check_device(name, t, q.device)
    Hkv = k.shape[1]
    qo = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(B, Hkv, 1, D, dtype=q.dtype, device=q.device)
    wq, wk = norms or (q, k)  # never read without NORM
    eps_q, eps_k = (q_norm[1], k_norm[1]) if q_norm is not None else (0.0, 0.0)
    pdl = use_pdl(q.device)
    with launch_context(q.device):
        launch(_rotate_qk_fwd_kernel, (B * (Hq + Hkv),),
            q, k, cos, sin, wq, wk, qo, ko, float(eps_q), float(eps_k), Hq, Hkv, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            NORM=q_norm is not None, HALF=D // 2, PDL=pdl, launch_pdl=pdl, num_warps=1, enable_fp_fusion=False,
        )
    return qo, ko
