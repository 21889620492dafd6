"""chunk_attention: a chunk of T prefill queries against a static, preallocated KV cache.

On CUDA every layer goes to FlexAttention over the full static buffer; elsewhere to the SDPA reference with an
explicit mask. LONGCTX_CHUNK_ATTENTION=sdpa sends layers without a sliding window to SDPA with a lower-right
causal bias instead (measured on an H100, Llama-3.1-8B shape, 128K tokens: 16.8 s vs Flex's 15.1 s at chunk
8192), =reference forces the reference, for comparisons.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.chunk_attention.reference import chunk_attention as chunk_attention_reference
from kernels.chunk_attention.sdpa import chunk_attention_sdpa

__all__ = ["chunk_attention", "chunk_attention_backend", "chunk_attention_reference"]



@functools.cache
def _flex_impl():
    try:
        from kernels.chunk_attention.flex import chunk_attention_flex
    except ImportError:
        return None
    return chunk_attention_flex


def _choice() -> str:
    choice = os.environ.get("LONGCTX_CHUNK_ATTENTION", "auto")
    if choice not in ("auto", "flex", "sdpa", "reference"):
        raise ValueError(f"LONGCTX_CHUNK_ATTENTION must be auto, flex, sdpa or reference, not {choice!r}")
    return choice


def _pick(device: torch.device, window: int | None):
    choice = _choice()
    if device.type != "cuda" or choice == "reference":
        return chunk_attention_reference
    if window is None and choice == "sdpa":
        return chunk_attention_sdpa
    return _flex_impl() or chunk_attention_reference


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
    On CUDA with a window the cache past offset + T must hold finite values (see flex.py).
    """
    return _pick(q.device, window)(q, k_cache, v_cache, offset, scale=scale, window=window)


def chunk_attention_backend(device: torch.device, windows: bool = False) -> str:
    """Which implementations `chunk_attention` uses on `device` (for reports)."""
    names = {chunk_attention_reference: "sdpa reference (explicit mask)",
             chunk_attention_sdpa: "sdpa lower-right causal", _flex_impl(): "flex attention"}
    full = names[_pick(device, None)]
    sliding = names[_pick(device, 512)]
    return full if not windows or sliding == full else f"{full}; sliding-window layers: {sliding}"
