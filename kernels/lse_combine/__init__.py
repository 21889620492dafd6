"""lse_combine: merge attention results computed over disjoint key shards, weighting each by its log-sum-exp.

Split-KV kernels (decode_attention, sparse_decode_attention) leave one partial result per split; `combine_splits`
merges them (Triton on GPU, the reference elsewhere). `merge_partials` merges a list of shards of any shape.
"""

from __future__ import annotations

import functools

import torch

from kernels.lse_combine.reference import combine_splits as combine_splits_reference
from kernels.lse_combine.reference import merge_partials

__all__ = ["combine_splits", "combine_splits_reference", "merge_partials"]


@functools.cache
def _triton_impl():
    try:
        from kernels.lse_combine.triton import combine_splits_triton
    except ImportError:
        return None
    return combine_splits_triton


def combine_splits(out_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """out_part: [R, S, D] fp32, lse_part: [R, S] fp32 (-inf = empty split) -> (out [R, D] out_dtype, lse [R])."""
    impl = (_triton_impl() if out_part.is_cuda else None) or combine_splits_reference
    return impl(out_part, lse_part, out_dtype)
