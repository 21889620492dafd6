"""Reference chunk (prefill) attention: T queries at positions offset..offset+T-1 against a static KV cache.

Plain PyTorch: slice the valid part of the cache and run SDPA with an explicit causal (and sliding-window)
mask. Defines correctness for the FlexAttention path and is the CPU production path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_chunk(q: torch.Tensor, k_cache: torch.Tensor, offset: int) -> int:
    """Validates the chunk's place in the cache for every implementation; returns offset + T."""
    end = offset + q.shape[2]
    if offset < 0 or end > k_cache.shape[2]:
        raise ValueError(f"expected 0 <= offset and offset + T <= S, got offset {offset}, T {q.shape[2]}, "
                         f"S {k_cache.shape[2]}")
    return end


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk of queries over the cache prefix that ends with the chunk itself.

    q: [B, Hq, T, D] at absolute positions offset..offset+T-1; k_cache, v_cache: [B, Hkv, S, D] with
    Hq % Hkv == 0 and offset + T <= S, valid below offset + T (the chunk's own K/V already written), garbage
    (even NaN) above, which is never read. The query at position p sees keys kv <= p and, with a window,
    kv > p - window. Returns out [B, Hq, T, D] in q's dtype.

    Memory: the mask is [T, offset + T] bool (or [T, window + T] with a window), fine for T <= 4096.
    """
    end = check_chunk(q, k_cache, offset)
    # With a window the first query (position offset) sees nothing below offset - window + 1.
    start = 0 if window is None else max(0, offset - window + 1)
    k = k_cache[:, :, start:end]
    v = v_cache[:, :, start:end]
    q_pos = torch.arange(offset, end, device=q.device)[:, None]
    kv_pos = torch.arange(start, end, device=q.device)[None, :]
    mask = kv_pos <= q_pos  # [T, end - start]
    if window is not None:
        mask &= kv_pos > q_pos - window
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
