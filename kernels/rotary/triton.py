"""rotate_rows in Triton: a program per tile of rows of one (batch, head) reads both halves of each key and its
position's cos/sin table rows, and writes the rotated key.

Products and sums round one at a time (no fused multiply-add, a correctly rounded division), as the reference's
separate PyTorch operations do, so both give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import cdiv
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
