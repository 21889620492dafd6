"""sparse_decode_attention: one decode query per sequence over selected key blocks only (block-sparse).

The blocks come from kernels/block_select: per KV head a fixed-width list of block indices, -1 for none; every
query head of the GQA group reads the same blocks. Triton on CUDA (split-KV over the list, merged by
log-sum-exp; CUDA-graph safe), the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.sparse_decode_attention.reference import sparse_decode_attention as sparse_decode_attention_reference

__all__ = ["sparse_decode_attention", "sparse_decode_attention_reference", "sparse_decode_backend"]


@functools.cache
def _triton_impl():
    try:
        from kernels.sparse_decode_attention.triton import sparse_decode_attention_triton
    except ImportError:
        return None
    return sparse_decode_attention_triton


def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                            length: torch.Tensor, *, block_size: int, scale: float,
                            return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, S, D]; blocks: [B, Hkv, W] int32 (-1 = none); length: [B].

    Attention over the keys of the listed blocks that lie before `length`. Returns out [B, Hq, D] in q's
    dtype (and lse [B, Hq] fp32 with return_lse; -inf and out 0 if no key is selected).
    """
    impl = (_triton_impl() if q.is_cuda else None) or sparse_decode_attention_reference
    return impl(q, k_cache, v_cache, blocks, length, block_size=block_size, scale=scale, return_lse=return_lse)


def sparse_decode_backend(device: torch.device) -> str:
    return "triton block-sparse split-KV" if device.type == "cuda" and _triton_impl() else "torch reference"
