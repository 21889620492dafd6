"""rotate_rows in plain PyTorch: the definition the Triton kernel is held to (and the CPU path)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_rows_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          inverse: bool = False) -> torch.Tensor:
    """x [B, H, R, D] keys, positions [R] int64, cos / sin [n, D] fp32 tables of the rotary embedding at
    positions 0..n-1 -> [B, H, R, D] in x's dtype: x rotated at each row's position (positions outside the table
    are clamped to it: empty rows carry -1), computed in fp32. inverse: the rotation undone, the rotary's
    attention scaling (cos^2 + sin^2) divided out."""
    at = positions.clamp(0, cos.shape[0] - 1)
    c, s = cos[at][None, None], sin[at][None, None]
    xf = x.float()
    if inverse:
        return ((xf * c - rotate_half(xf) * s) / (c * c + s * s)).to(x.dtype)
    return (xf * c + rotate_half(xf) * s).to(x.dtype)
