"""`ltri-stream`'s attention over a layer's bounded rows [init | retrieved | window | chunk] (engines/ltri/cache.py):
prefill chunks in retrieving layers through kernels/vote_attention (its probabilities give the window's votes and
the chunk's own map for span division; `compensate: exact` merges in attention over the stored blocks the rows
leave out, by log-sum-exp), the model's own sliding-window layers over their window, and decode steps over all
rows with a validity mask."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engines.ltri.cache import LtriCache, LtriLayer
from kernels.decode_attention import decode_attention
from kernels.lse_combine import merge_partials
from kernels.vote_attention import vote_attention


def _stored_batches(layer: LtriLayer, device):
    """compensate: exact: K and V [1, Hkv, n * block, D] of the stored blocks the rows do not hold, n at most the
    layer's slot count per batch, each batch loaded by one gather. The bytes count in host_to_device_bytes."""
    held = {b for b in layer.slots if b >= 0}
    ids = [b for b in range(layer.memory.n_blocks) if b not in held]
    per, block = max(1, layer.n_retrieved // layer.block), layer.block
    hkv, dim = layer.keys.shape[1], layer.keys.shape[3]
    for lo in range(0, len(ids), per):
        batch = ids[lo:lo + per]
        k = torch.empty(hkv, len(batch) * block, dim, dtype=layer.dtype, device=device)
        v = torch.empty_like(k)
        layer.memory.gather(k, v, batch)
        layer.owner.stats["host_to_device_bytes"] += len(batch) * layer.memory.block_bytes
        yield k[None], v[None]


def softmax_attention(layer: LtriLayer, query, key, value, scaling, offset, n_own: int, exact: bool = False):
    """Softmax attention over the layer's rows; adds each row's votes; returns out [B, Hq, T, D] and the
    chunk's own map [n_own, n_own] (its last n_own queries on its own window rows, summed over heads).
    exact: the output also attends the stored blocks the rows leave out (LtriConfig.compensate); the votes
    and maps stay those of the rows."""
    width = layer.width
    kp = layer.key_pos[:width]
    got = vote_attention(query, key[:, :, :width], value[:, :, :width], kp, offset, scale=scaling, n_own=n_own,
                         return_lse=exact)
    layer.votes[:width] += got[1]
    if not exact:
        return got[0], got[2]
    # Every stored block precedes the chunk, so each query sees all of a batch: attention over it (no votes)
    # merged with the rows' by log-sum-exp.
    outs, lses = [got[0]], [got[3]]
    # A batch's positions (at most a slot count of blocks): 0, seen by every query.
    at_zero = torch.zeros(max(layer.n_retrieved, layer.block), dtype=torch.long, device=query.device)
    for k_b, v_b in _stored_batches(layer, query.device):
        o_b, _, _, lse_b = vote_attention(query, k_b, v_b, at_zero[:k_b.shape[2]], offset, scale=scaling, n_own=1,
                                          return_lse=True, votes=False)
        outs.append(o_b)
        lses.append(lse_b)
    return merge_partials(outs, lses)[0], got[2]


def window_attention(layer: LtriLayer, query, key, value, scaling, offset):
    """A sliding-window layer of the model: SDPA over its window rows, exact."""
    width = layer.width
    kp = layer.key_pos[:width]
    q_pos = torch.arange(offset, offset + query.shape[2], device=query.device)[:, None]
    mask = (kp >= 0) & (kp <= q_pos) & (q_pos - kp < layer.window)
    return F.scaled_dot_product_attention(query, key[:, :, :width], value[:, :, :width], attn_mask=mask,
                                          scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


def decode_rows(layer: LtriLayer, query, key, value, scaling, cache: LtriCache):
    """One token over the layer's rows: valid ones (and, on sliding layers, inside the window)."""
    mask = layer.key_pos >= 0
    if layer.window is not None:
        mask = mask & (cache.position_on(query.device) - layer.key_pos < layer.window)
    mask = mask.view(1, 1, -1).expand(key.shape[0], key.shape[1], -1).contiguous()
    if layer.summary_keys is None:
        return decode_attention(query[:, :, 0], key, value, layer.rows_t, scale=scaling, mask=mask).unsqueeze(1)
    # LtriConfig.decode_summaries: the stored blocks the rows leave out, a mean row each standing for its
    # block_size tokens (log(block_size) added to its log-sum-exp), merged with the rows' attention.
    out, lse = decode_attention(query[:, :, 0], key, value, layer.rows_t, scale=scaling, mask=mask, return_lse=True)
    s_out, s_lse = decode_attention(query[:, :, 0], layer.summary_keys, layer.summary_values, layer.summary_length,
                                    scale=scaling, mask=layer.summary_mask, return_lse=True)
    return merge_partials([out, s_out], [lse, s_lse + math.log(layer.block)])[0].unsqueeze(1)
