"""FlexAttention prefill over the compacted cache: the pattern itself is the mask_mod.

Keys are the layer's whole buffer [B, Hkv, rows, D] (static shapes: one compile per chunk length and cache
size); `key_pos` maps a row to the token it holds, so the mask_mod evaluates the pattern at (query position,
key position). The block mask is built once per chunk for all layers that share a plan (their rows hold the
same positions) on each device that holds such layers (a model split over GPUs), and skips every tile of rows
no query of the tile can see.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask

from kernels.chunk_attention.flex import compiled_flex


def _block_mask(layer, t: int, offset: int, device: torch.device):
    owner = layer.owner
    key = (id(layer.plan), offset, t, device)
    if owner.block_masks.get("chunk") != (offset, t):
        owner.block_masks = {"chunk": (offset, t)}
    if key not in owner.block_masks:
        key_pos = layer.key_pos[0, 0].clone()  # head-independent for static patterns
        first = torch.tensor(offset, device=device)
        static = layer.plan.static

        def mask_mod(b, h, q_idx, kv_idx):
            return static.visible(q_idx + first, key_pos[kv_idx])

        owner.block_masks[key] = create_block_mask(mask_mod, None, None, t, layer.rows, device=device)
    return owner.block_masks[key]


def flex_prefill(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                 offset: int) -> torch.Tensor:
    """query: [B, Hq, T, D] at positions offset..; key/value: the layer's buffers -> [B, Hq, T, D]."""
    block_mask = _block_mask(layer, query.shape[2], offset, query.device)
    return compiled_flex()(query, key, value, block_mask=block_mask, scale=scaling,
                           enable_gqa=query.shape[1] != key.shape[1])
