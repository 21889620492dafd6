"""SDPA path for chunk (prefill) attention without a sliding window: lower-right causal over the valid prefix.

PyTorch's `causal_lower_right(T, offset + T)` bias makes SDPA align the causal diagonal with the last key, which
is exactly "query at offset + i sees keys <= offset + i"; SDPA runs it with the flash kernel (GQA included)
on a strided view of the cache, so nothing is copied and nothing past offset + T is read (NaN-safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.chunk_attention.reference import check_chunk


def chunk_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.chunk_attention; window must be None.

    q: [B, Hq, T, D] at positions offset..offset+T-1; k_cache, v_cache: [B, Hkv, S, D], valid below offset + T.
    Returns out [B, Hq, T, D] in q's dtype.
    """
    if window is not None:
        raise ValueError("chunk_attention_sdpa has no sliding window; use the flex path for windowed layers")
    T, end = q.shape[2], check_chunk(q, k_cache, offset)
    k, v = k_cache[:, :, :end], v_cache[:, :, :end]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, end), scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
