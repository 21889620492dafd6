"""farthest_point: farthest-point sampling of each block's keys, within per-slot row ranges.

ltri-stream's `pick: cover` chooses a stored block's index vectors with it. CUDA tensors go to the Triton
kernel (one launch for every block and slot); everything else, or a machine without Triton, goes to the
pure-torch reference.
"""

from __future__ import annotations

import functools

import torch

from kernels.farthest_point.reference import farthest_point_reference

__all__ = ["farthest_point", "farthest_point_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.farthest_point.triton import farthest_point_triton
    except ImportError:
        return None
    return farthest_point_triton


def farthest_point(keys: torch.Tensor, votes: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """keys [m, n, F], votes [m, n], ranges [m, S, 2] int64 -> picks [m, S] int64 (-1: none); see
    reference.farthest_point_reference."""
    impl = _triton_impl() if keys.is_cuda else None
    return (impl or farthest_point_reference)(keys, votes, ranges)
