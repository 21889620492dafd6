"""span_candidates: a block's attention map -> per midpoint the best span (start, end, triangle score,
confidence), for ltri-stream's span division.

CUDA maps of at most MAX_N rows go to the Triton kernel (one launch for every map); everything else, or a machine
without Triton, goes to the pure-torch reference.
"""

from __future__ import annotations

import functools

import torch

from kernels.span_candidates.reference import span_candidates_reference

__all__ = ["span_candidates", "span_candidates_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.span_candidates import triton as impl
    except ImportError:
        return None
    return impl


def span_candidates(maps: torch.Tensor, theta: torch.Tensor, ratio_mode: str) -> torch.Tensor:
    """maps [m, n, n] causal maps (rows: queries), theta [m] float64 thresholds -> [m, 2n - 1, 4] float64 (i, j,
    TA, confidence) per midpoint, TA <= 0 where no span; see reference.span_candidates_reference."""
    impl = _triton_impl() if maps.is_cuda else None
    if impl is not None and maps.shape[-1] <= impl.MAX_N:
        return impl.span_candidates_triton(maps, theta, ratio_mode)
    return span_candidates_reference(maps, theta, ratio_mode)
