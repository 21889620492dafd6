"""rotary: keys rotated (or un-rotated) at per-row positions from a cos/sin table, as streaming engines re-assign
positions to the rows they keep (engines/positions.py).

`rotate_rows(...)` runs one Triton launch on CUDA, where the reference takes about ten (a gather per table, the
half rotation's negate and concatenation, the products, the casts), or the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.rotary.reference import rotate_half, rotate_rows_reference

__all__ = ["rotate_half", "rotate_rows", "rotate_rows_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.rotary.triton import rotate_rows_triton
    except ImportError:
        return None
    return rotate_rows_triton


def rotate_rows(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inverse: bool = False) -> torch.Tensor:
    """x [B, H, R, D], positions [R], cos / sin [n, D] fp32 -> [B, H, R, D]; see reference.rotate_rows_reference."""
    d = x.shape[-1]
    impl = _triton_impl() if x.is_cuda and d >= 2 and d & (d - 1) == 0 else None
    return (impl or rotate_rows_reference)(x, positions, cos, sin, inverse)
