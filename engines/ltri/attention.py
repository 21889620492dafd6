"""`ltri-stream`'s attention over a layer's bounded rows [init | retrieved | window | chunk] (engines/ltri/cache.py):
prefill chunks in retrieving layers through kernels/vote_attention (its probabilities give the window's votes and
the chunk's own map for span division; `compensate: exact` keeps an explicit softmax that also attends the stored
blocks the rows leave out), the model's own sliding-window layers over their window, and decode steps over all
rows with a validity mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.explicit import score_slices
from engines.ltri.cache import LtriCache, LtriLayer
from kernels.decode_attention import decode_attention
from kernels.vote_attention import vote_attention


def _softmax_state(s, v):
    """Online softmax over scores s [..., t, W] and values v [..., W, D]: (running max, mass, weighted values)."""
    top = s.amax(-1, keepdim=True)
    e = torch.exp(s - top)
    return top, e.sum(-1, keepdim=True), torch.matmul(e, v)


def _softmax_add(state, s, v):
    """The state of _softmax_state with further keys (scores s [..., t, Wi], values v [..., Wi, D]) merged in."""
    top, mass, acc = state
    new = torch.maximum(top, s.amax(-1, keepdim=True))
    old, e = torch.exp(top - new), torch.exp(s - new)
    return new, mass * old + e.sum(-1, keepdim=True), acc * old + torch.matmul(e, v)


def _stored_batches(layer: LtriLayer, device):
    """compensate: exact: K and V [1, Hkv, 1, n * block, D] (fp32) of the stored blocks the rows do not hold, n
    at most the layer's slot count per batch. The bytes loaded count in the cache's host_to_device_bytes."""
    held = {b for b in layer.slots if b >= 0}
    ids = [b for b in range(layer.memory.n_blocks) if b not in held]
    per, block = max(1, layer.n_retrieved // layer.block), layer.block
    hkv, dim = layer.keys.shape[1], layer.keys.shape[3]
    for lo in range(0, len(ids), per):
        batch = ids[lo:lo + per]
        k = torch.empty(hkv, len(batch) * block, dim, dtype=layer.dtype, device=device)
        v = torch.empty_like(k)
        for j, b in enumerate(batch):
            layer.owner.stats["host_to_device_bytes"] += layer.memory.load(b, k[:, j * block:(j + 1) * block],
                                                                           v[:, j * block:(j + 1) * block])
        yield k.float()[None, :, None], v.float()[None, :, None]


def softmax_attention(layer: LtriLayer, query, key, value, scaling, offset, n_own: int, exact: bool = False):
    """Softmax attention over the layer's rows; adds each row's votes; returns out [B, Hq, T, D] and the
    chunk's own map [n_own, n_own] (its last n_own queries on its own window rows, summed over heads).
    exact: the output also attends the stored blocks the rows leave out (LtriConfig.compensate); the votes
    and maps stay those of the rows."""
    width = layer.width
    kp = layer.key_pos[:width]
    if not exact:
        out, votes, own = vote_attention(query, key[:, :, :width], value[:, :, :width], kp, offset, scale=scaling,
                                         n_own=n_own)
        layer.votes[:width] += votes
        return out, own
    return _compensated_attention(layer, query, key, value, scaling, offset, n_own)


def _compensated_attention(layer: LtriLayer, query, key, value, scaling, offset, n_own: int):
    """compensate: exact: explicit softmax over the rows, then every stored block merged into each query
    slice's online-softmax state; votes and the own map from the rows' probabilities alone."""
    B, Hq, T, D = query.shape
    width = layer.width
    kp = layer.key_pos[:width]
    v = value[:, :, :width].float()
    own0 = width - n_own
    out = torch.empty_like(query)
    own = torch.zeros(n_own, n_own, dtype=torch.float32, device=query.device)
    slices = []  # per query slice (lo, t, q, online-softmax state over the rows)

    # Built once for the chunk's queries [T, width] and sliced, rather than once per query slice.
    seen = (kp >= 0) & (kp <= torch.arange(offset, offset + T, device=query.device)[:, None])
    for lo, t, q, s in score_slices(query, key[:, :, :width], scaling, lambda lo, t: seen[lo:lo + t]):
        p = torch.softmax(s, dim=-1)
        # Finished below, once every stored block has been merged in.
        slices.append((lo, t, q, _softmax_state(s, v[:, :, None])))
        heads = p.sum(dim=(0, 1, 2))  # [t, width]
        layer.votes[:width] += heads.sum(dim=0)
        first = max(lo, T - n_own)
        if first < lo + t:
            own[first - (T - n_own):lo + t - (T - n_own)] = heads[first - lo:, own0:]
    # Each stored block is loaded once for all the query slices.
    states = [state for *_, state in slices]
    for k_b, v_b in _stored_batches(layer, query.device):
        states = [_softmax_add(state, torch.matmul(q, k_b.transpose(-1, -2)) * scaling, v_b)
                  for state, (_, _, q, _) in zip(states, slices)]
    for (lo, t, _, _), (_, mass, acc) in zip(slices, states):
        out[:, :, lo:lo + t] = (acc / mass).view(B, Hq, t, D).to(query.dtype)
    return out, own


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
    out = decode_attention(query[:, :, 0], key, value, layer.rows_t, scale=scaling, mask=mask)
    return out.unsqueeze(1)
