"""FlexAttention path for chunk (prefill) attention over the full static cache.

The compiled kernel always sees K/V of the whole buffer [0, S), so its shapes stay the same from chunk to
chunk and it compiles once per (T, S, D, dtype, window). The block mask, built in closed form (never by
evaluating the mask over T x S), lists only the key blocks below offset + T (and inside the window), so
blocks past the chunk cost nothing. The offset reaches the mask_mod as a captured device tensor: a new
offset is new data for the compiled graph, not a recompile.

NOT safe on NaN garbage (seen on an H100, torch 2.11): keys past offset + T that share a key block with valid
keys are loaded; their scores are masked to -inf, but their V rows still enter p @ v, and 0 * NaN = NaN, which
poisons whole output rows. Blocks wholly past offset + T are never read. So the cache past the valid prefix
must be finite: zero-initialise it once (torch.zeros, not torch.empty); written rows are only overwritten.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kernels.chunk_attention.reference import check_chunk

# Sparse block size of the mask (queries x keys); the kernel's own tiles must divide it.
BLOCK = 128


@functools.cache
def compiled_flex():
    # One compile per (T, S, D, dtype, window, heads): a long run over many documents (each with its own cache
    # capacity) or several models passes Dynamo's default limit of 8, after which fullgraph raises.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dense: [nq, nk] bool -> (counts [1, 1, nq] int32, column indices [1, 1, nq, nk] int32, listed first)."""
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


def _mask_mod(offset: torch.Tensor, window: int | None):
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    def sliding(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        return (kv_idx <= pos) & (kv_idx > pos - window)

    return causal if window is None else sliding


@functools.lru_cache(maxsize=4)
def block_mask_for(T: int, S: int, offset: int, window: int | None, device: torch.device) -> BlockMask:
    """Block mask for queries at offset..offset+T-1 over keys 0..S-1; cached since every layer of a chunk
    asks for the same one."""
    q_first = offset + torch.arange(0, T, BLOCK, device=device)[:, None]  # [nq, 1]
    q_last = torch.clamp(q_first + BLOCK - 1, max=offset + T - 1)
    k_first = torch.arange(0, S, BLOCK, device=device)[None, :]  # [1, nk]
    k_last = k_first + BLOCK - 1
    touched = k_first <= q_last  # some key of the block is visible to some query of the block
    full = k_last <= q_first  # every key is visible to every query
    if window is not None:
        touched &= k_last > q_first - window
        full &= k_first > q_last - window
    kv_num, kv_idx = _ordered(touched & ~full)
    full_num, full_idx = _ordered(full)
    offset_t = torch.full((), offset, dtype=torch.int32, device=device)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
        mask_mod=_mask_mod(offset_t, window), seq_lengths=(T, S),
    )


def chunk_attention_flex(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.chunk_attention, on CUDA, except that the cache past offset + T must be finite.

    q: [B, Hq, T, D] at positions offset..offset+T-1; k_cache, v_cache: [B, Hkv, S, D], valid below
    offset + T. Returns out [B, Hq, T, D] in q's dtype.
    """
    B, Hq, T, D = q.shape
    S = k_cache.shape[2]
    check_chunk(q, k_cache, offset)
    block_mask = block_mask_for(T, S, offset, window, q.device)
    return compiled_flex()(
        q, k_cache, v_cache, block_mask=block_mask, scale=scale, enable_gqa=Hq != k_cache.shape[1]
    )
