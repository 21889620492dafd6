"""span_rows: a block map's span candidates -> the rows its spans choose (greedy NMS, then Eq. 7's most-voted
rows of each kept span within a block's bounds), for ltri-stream's query-side index vectors.

`span_rows(cands, votes, ...)` runs the Triton kernel on CUDA (no host wait) or the numpy reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.span_rows.reference import allocate_rows, greedy_nms, span_rows_reference

__all__ = ["allocate_rows", "greedy_nms", "span_rows", "span_rows_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.span_rows.triton import span_rows_triton
    except ImportError:
        return None
    return span_rows_triton


def span_rows(cands: torch.Tensor, votes: torch.Tensor, *, lam: float, lo: int, hi: int,
              iou: float) -> torch.Tensor:
    """cands [m, 2n - 1, 4] (start, end, score, confidence per midpoint; score <= 0: none), votes [m, n] ->
    [m, n] bool, the chosen rows; see reference.span_rows_reference."""
    impl = _triton_impl() if cands.is_cuda else None
    return (impl or span_rows_reference)(cands, votes, lam, lo, hi, iou)
