"""chunk_attention: a chunk of T prefill queries against a static, preallocated KV cache.

CUDA tensors go to FlexAttention over the full static buffer (set LONGCTX_NO_FLEX=1 to opt out); everything
else, or a torch without FlexAttention, goes to the SDPA reference.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.chunk_attention.reference import chunk_attention as chunk_attention_reference

__all__ = ["chunk_attention", "chunk_attention_backend", "chunk_attention_reference"]


@functools.cache
def _flex_impl():
    try:
        from kernels.chunk_attention.flex import chunk_attention_flex
    except ImportError:
        return None
    return chunk_attention_flex


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions offset..offset+T-1 over the cache prefix [0, offset + T).

    q: [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, S, D] (Hq % Hkv == 0), valid below offset + T. The query at
    position p sees keys kv <= p and, with a window, kv > p - window. Returns out [B, Hq, T, D] in q's dtype.
    On CUDA the cache past offset + T must hold finite values (see flex.py); the reference never reads it.
    """
    impl = None
    if q.is_cuda and os.environ.get("LONGCTX_NO_FLEX") != "1":
        impl = _flex_impl()
    impl = impl or chunk_attention_reference
    return impl(q, k_cache, v_cache, offset, scale=scale, window=window)


def chunk_attention_backend(device: torch.device) -> str:
    """The implementation `chunk_attention` uses for tensors on `device` (for reports)."""
    flex = device.type == "cuda" and os.environ.get("LONGCTX_NO_FLEX") != "1" and _flex_impl()
    return "flex attention" if flex else "sdpa reference"
