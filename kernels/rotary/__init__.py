"""rotary: keys rotated (or un-rotated) at per-row positions from a cos/sin table, as streaming engines re-assign
positions to the rows they keep (engines/positions.py); and a decode step's q and k rotated at its position,
after their per-head norms where the model has them (engines/decode_folds.py).

`rotate_rows(...)` runs one Triton launch on CUDA, where the reference takes about ten (a gather per table, the
half rotation's negate and concatenation, the products, the casts), or the reference elsewhere. `rotate_qk(...)`
runs one launch on CUDA for what a compiled step ran as two kernels (q's and k's).
"""

from __future__ import annotations

import functools

import torch

from kernels.rotary.reference import rotate_half, rotate_qk_reference, rotate_rows_reference

__all__ = ["rotate_half", "rotate_qk", "rotate_qk_reference", "rotate_rows", "rotate_rows_reference"]


@functools.cache
def _triton_module():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        import kernels.rotary.triton as module
    except ImportError:
        return None
    return module


def rotate_rows(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                inverse: bool = False) -> torch.Tensor:
    """x [B, H, R, D], positions [R], cos / sin [n, D] fp32 -> [B, H, R, D]; see reference.rotate_rows_reference."""
    d = x.shape[-1]
    module = _triton_module() if x.is_cuda and d >= 2 and d & (d - 1) == 0 else None
    return (module.rotate_rows_triton if module else rotate_rows_reference)(x, positions, cos, sin, inverse)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              q_norm: tuple[torch.Tensor, float] | None = None,
              k_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, 1, D], k [B, Hkv, 1, D], cos / sin [B, 1, D] -> (q, k); see reference.rotate_qk_reference."""
    d = q.shape[-1]
    module = _triton_module() if q.is_cuda and d >= 2 and d & (d - 1) == 0 else None
    return (module.rotate_qk_triton if module else rotate_qk_reference)(q, k, cos, sin, q_norm, k_norm)
