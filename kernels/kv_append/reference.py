"""Reference KV append in plain PyTorch: two `index_copy_` calls, then the block-descriptor reference (CPU path
and test oracle)."""

from __future__ import annotations

import torch

from kernels.block_descriptors.reference import update_block_descriptors


def append_kv(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
              position: torch.Tensor, *, descriptors: tuple | None = None, length: torch.Tensor | None = None,
              block_size: int = 16, fold_mean: bool = False, descriptor_scale: torch.Tensor | None = None) -> None:
    """See kernels.kv_append.append_kv."""
    keys.index_copy_(2, position, key_states)
    values.index_copy_(2, position, value_states)
    if descriptors is not None:
        kmax, kmin, kmean = descriptors
        update_block_descriptors(keys, kmax, kmin, length, 1, block_size, kmean, fold_mean, descriptor_scale)
