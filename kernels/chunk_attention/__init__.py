"""chunk_attention: a chunk of T prefill queries against a static, preallocated KV cache.

On CUDA, chunks of at most FEW_QUERIES tokens go to the split-KV decode kernel (T queries); longer ones,
on layers without a sliding window (head_dim <= 128), to cuDNN attention split into prefix + diagonal
and merged by log-sum-exp (cudnn.py; the fastest measured on an H100), windowed layers to FlexAttention over
the full static buffer; elsewhere the SDPA reference with an explicit mask runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.chunk_attention.reference import chunk_attention as chunk_attention_reference
from kernels.chunk_attention.cudnn import chunk_attention_cudnn
from kernels.decode_attention import decode_attention

__all__ = ["chunk_attention", "chunk_attention_backend", "chunk_attention_reference", "sdpa_without_plans",
           "windowed_compile_pays"]


@functools.cache
def _flex_impl():
    try:
        from kernels.chunk_attention.flex import chunk_attention_flex
    except ImportError:
        return None
    return chunk_attention_flex


# Chunks of at most this many queries (a question's tail, a rectification) go to the split-KV decode kernel:
# measured on an H100, FlexAttention's compiled kernel for head_dim 256 fails to lower at T = 38 ("no choices"),
# and few queries cannot fill the GPU with query tiles anyway, while split-KV spreads the keys over the SMs.
FEW_QUERIES = 64


def _few_queries(q, k_cache, v_cache, offset, *, scale, window=None):
    length = torch.full((q.shape[0],), offset + q.shape[2], dtype=torch.long, device=q.device)
    return decode_attention(q, k_cache, v_cache, length, scale=scale, window=window)


def _pick(device: torch.device, window: int | None, head_dim: int = 128, n_queries: int | None = None,
          dtype: torch.dtype = torch.bfloat16, compiled: bool = True):
    # cuDNN attention takes half precision only: fp32 runs (tests, --dtype float32) use the reference.
    picked = _pick_long(device, window, head_dim) if dtype != torch.float32 else chunk_attention_reference
    if picked is _flex_impl() and not compiled:
        picked = _windowed_uncompiled
    # Flex's query tile is 128: below it (head_dim 256) it failed to lower at every length tried (38, 65, 100).
    few = FEW_QUERIES if picked is not _flex_impl() else 127
    if device.type == "cuda" and n_queries is not None and n_queries <= few and head_dim <= 256:
        return _few_queries
    return picked


def _pick_long(device: torch.device, window: int | None, head_dim: int):
    if device.type != "cuda":
        return chunk_attention_reference
    if window is None and head_dim <= 128 and head_dim % 8 == 0:
        return chunk_attention_cudnn
    return _flex_impl() or chunk_attention_reference


def sdpa_without_plans(device: torch.device):
    """A context for masked SDPA calls of ever-new shapes (a question's length, a short document's windowed
    layers): on CUDA the memory-efficient kernel, which needs no per-shape plan, where SDPA would pick cuDNN (a
    plan per shape, over a second each on an H100); elsewhere SDPA's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _windowed_uncompiled(q, k_cache, v_cache, offset, *, scale, window=None):
    """Windowed layers without FlexAttention: SDPA with the band mask over the window's slice, no compilation."""
    with sdpa_without_plans(q.device):
        return chunk_attention_reference(q, k_cache, v_cache, offset, scale=scale, window=window)


# FlexAttention compiles per shape (2.2-15.6 s a shape measured on an H100) but then runs windowed chunks several
# times faster than SDPA with a mask (0.14 against 0.97 ms for a Gemma 3 270M chunk of 2,048, 0.36 against 11 ms
# for 32 heads, window 4,096). Compiling pays for a document whose windowed attention is this many FLOPs or more.
COMPILE_PAYS_FLOPS = 20e12


def windowed_compile_pays(n_layers: int, heads: int, head_dim: int, window: int, n_tokens: int,
                          chunk: int) -> bool:
    """Whether a document of n_tokens, read in chunks of `chunk`, does enough windowed attention over
    `n_layers` layers of `heads` query heads for FlexAttention's compilation to pay for itself."""
    return 4 * n_layers * heads * head_dim * n_tokens * (window + chunk) >= COMPILE_PAYS_FLOPS


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int,
    *,
    scale: float,
    window: int | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Causal attention of queries at positions offset..offset+T-1 over the cache prefix [0, offset + T).

    q: [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, S, D] (Hq % Hkv == 0), valid below offset + T. The query at
    position p sees keys kv <= p and, with a window, kv > p - window. Returns out [B, Hq, T, D] in q's dtype.
    On CUDA with a window the cache past offset + T must hold finite values (see flex.py). compiled=False: no
    FlexAttention for windowed layers (see windowed_compile_pays).
    """
    impl = _pick(q.device, window, q.shape[-1], q.shape[2], q.dtype, compiled)
    return impl(q, k_cache, v_cache, offset, scale=scale, window=window)


def chunk_attention_backend(device: torch.device, windows: bool = False, head_dim: int = 128) -> str:
    """Which implementations `chunk_attention` uses on `device` (for reports)."""
    names = {chunk_attention_reference: "sdpa reference (explicit mask)", chunk_attention_cudnn: "cudnn split",
             _flex_impl(): "flex attention (long documents; short ones: sdpa with the band mask, uncompiled)"}
    full = names[_pick(device, None, head_dim)]
    sliding = names[_pick(device, 512, head_dim)]
    text = full if not windows or sliding == full else f"{full}; sliding-window layers: {sliding}"
    few = _pick(device, None, head_dim, 1) is _few_queries
    return text + ("; short chunks: triton split-KV" if few else "")
