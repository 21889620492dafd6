"""kv_append: a decode step's new keys and values written into the cache at device-held positions, in one launch
(and, for resa, the touched block's descriptors recomputed in the same launch).

`keys[b, h, position[t]] = key_states[b, h, t]` (and the same for values), as two `index_copy_` calls would do;
with `descriptors`, a single new token (T = 1) also refreshes the max, min (and mean, or both plus the mean) of
the block that position `length - 1` falls in, as kernels/block_descriptors does after the write. Triton on CUDA
(no host synchronisation: CUDA-graph safe), the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.kv_append.reference import append_kv as append_kv_reference

__all__ = ["append_kv", "append_kv_reference"]


@functools.cache
def _triton_impl():
    try:
        from kernels.kv_append.triton import append_kv_triton
    except ImportError:
        return None
    return append_kv_triton


def append_kv(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
              position: torch.Tensor, *, descriptors: tuple | None = None, length: torch.Tensor | None = None,
              block_size: int = 16, fold_mean: bool = False, descriptor_scale: torch.Tensor | None = None) -> None:
    """keys: [B, Hkv, S, D], values: [B, Hkv, S, Dv] (any strides with a contiguous last dimension);
    key_states: [B, Hkv, T, D], value_states: [B, Hkv, T, Dv]; position: [T] int64 (device), the rows written.

    descriptors: (kmax, kmin, kmean or None), each [B, Hkv, ceil(S / block_size), D] in keys' dtype, refreshed
    for the block of key `length[b] - 1` (length: [B] int64, the valid keys after the write); T must be 1.
    fold_mean: the descriptors hold max + mean and min + mean (kernels/block_descriptors), kmean None.
    descriptor_scale: [B, Hkv, ceil(S / block_size)] fp32 with int8 kmax and kmin (kernels/block_descriptors'
    scale), kmean None.
    """
    if descriptors is not None and (length is None or key_states.shape[2] != 1):
        raise ValueError(f"expected one new token and a length with descriptors, got {key_states.shape[2]} tokens"
                         f"{'' if length is not None else ' and no length'}")
    if fold_mean and (descriptors is None or descriptors[2] is not None):
        raise ValueError("fold_mean writes the mean into kmax and kmin: expected descriptors (kmax, kmin, None)")
    if descriptor_scale is not None and (descriptors is None or descriptors[2] is not None):
        raise ValueError("int8 descriptors (descriptor_scale) need descriptors (kmax, kmin, None)")
    impl = (_triton_impl() if keys.is_cuda else None) or append_kv_reference
    impl(keys, values, key_states, value_states, position, descriptors=descriptors, length=length,
         block_size=block_size, fold_mean=fold_mean, descriptor_scale=descriptor_scale)
