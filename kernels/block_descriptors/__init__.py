"""block_descriptors: per KV head and per block of `block_size` keys, the element-wise max and min of the keys
(and, optionally, their mean: the block's centroid), or max + mean and min + mean (`fold_mean`): Quest's bound plus
the centroid's product in two descriptors instead of three (kernels/block_select's `folded`).

They are kept up to date incrementally: after new keys are written at [length - n_new, length), only the
blocks those positions touch are recomputed (one block per decode step; a chunk's worth in prefill). Quest's
upper bound on q.k over a block is computed from them (kernels/block_select). Triton on CUDA (CUDA-graph safe:
`length` stays on the device), the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.block_descriptors.reference import CODE_MAX, quantize_outwards
from kernels.block_descriptors.reference import update_block_descriptors as update_block_descriptors_reference

__all__ = ["CODE_MAX", "quantize_outwards", "update_block_descriptors", "update_block_descriptors_reference"]


@functools.cache
def _triton_impl():
    try:
        from kernels.block_descriptors.triton import update_block_descriptors_triton
    except ImportError:
        return None
    return update_block_descriptors_triton


def update_block_descriptors(keys: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, length: torch.Tensor,
                             n_new: int, block_size: int, kmean: torch.Tensor | None = None,
                             fold_mean: bool = False, scale: torch.Tensor | None = None) -> None:
    """Recompute, in place, the descriptors of the blocks that keys [length - n_new, length) fall in.

    keys: [B, Hkv, S, D]; kmax, kmin: [B, Hkv, ceil(S / block_size), D] in keys' dtype; length: [B] int64
    (valid keys after the write, on keys' device); 1 <= n_new <= length. Keys at index >= length are ignored.
    kmean: like kmax, the mean of each block's valid keys (None: not kept). fold_mean (kmean None): kmax and kmin
    receive max + mean and min + mean, summed in fp32 and rounded once.
    scale: [B, Hkv, NB] fp32 with kmax and kmin int8: each block's two descriptors as codes of one scale per block
    and head (`quantize_outwards`: the max rounded up, the min down), half the bytes of bf16 descriptors.
    """
    if fold_mean and kmean is not None:
        raise ValueError("fold_mean writes the mean into kmax and kmin: expected no kmean")
    if scale is not None and kmean is not None:
        raise ValueError("int8 descriptors (scale) hold max and min, or both with the mean folded in: expected no kmean")
    impl = (_triton_impl() if keys.is_cuda else None) or update_block_descriptors_reference
    impl(keys, kmax, kmin, length, n_new, block_size, kmean, fold_mean, scale)
