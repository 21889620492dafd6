"""rotate_rows and rotate_qk in plain PyTorch: the definitions the Triton kernels are held to (and the CPU path)."""

from __future__ import annotations

import torch

from kernels.gemv import rms_norm


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


def rotate_qk_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        q_norm: tuple[torch.Tensor, float] | None = None,
                        k_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's q [B, Hq, 1, D] and k [B, Hkv, 1, D] rotated at the step's position, cos / sin [B, 1, D] (the
    model's rotary embedding output), as transformers' apply_rotary_pos_emb computes it but in fp32, rounded once
    to q's dtype. q_norm / k_norm: (weight [D], eps) of a per-head RMSNorm applied first, rounded as the Llama
    family's RMSNorm rounds (kernels.gemv's rms_norm)."""
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def one(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None) -> torch.Tensor:
        if norm is not None:
            x = rms_norm(x, *norm)
        xf = x.float()
        return (xf * c + rotate_half(xf) * s).to(q.dtype)

    return one(q, q_norm), one(k, k_norm)
