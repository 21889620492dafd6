"""vote_attention: a prefill chunk's attention over unordered rows, with the attention each row received.

Returns the attention output together with the probabilities summed per key ("votes") and the chunk's own map
(its last queries on its own rows, summed over heads), which engines that divide the context into spans read
(ltri-stream). CUDA tensors go to the two-pass Triton kernel; everything else, or a machine without Triton,
goes to the pure-torch reference.
"""

from __future__ import annotations

import functools

import torch

from kernels.vote_attention.reference import vote_attention_reference

__all__ = ["vote_attention", "vote_attention_backend", "vote_attention_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.vote_attention.triton import vote_attention_triton
    except ImportError:
        return None
    return vote_attention_triton


def vote_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_pos: torch.Tensor,
    offset: int,
    *,
    scale: float,
    n_own: int,
    return_lse: bool = False,
    votes: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Attention of queries at positions offset.. over rows at key_pos, with votes and the own map.

    q: [B, Hq, T, D]; k, v: [B, Hkv, W, D] (Hq % Hkv == 0); key_pos: [W] int64 (-1: empty row); query i sees
    row j iff 0 <= key_pos[j] <= offset + i. Returns out [B, Hq, T, D] in q's dtype, votes [W] fp32 (the
    probabilities summed over batch, heads and queries) and own [n_own, n_own] fp32 (the last n_own queries on
    the last n_own rows, summed over batch and heads). return_lse: also lse [B, Hq, T] fp32 (natural log, -inf
    for a query that sees no row). votes=False: the attention alone, votes and own returned as None (on CUDA
    half the work: no second pass). See reference.vote_attention_reference.
    """
    impl = _triton_impl() if q.is_cuda else None
    impl = impl or vote_attention_reference
    return impl(q, k, v, key_pos, offset, scale=scale, n_own=n_own, return_lse=return_lse, votes=votes)


def vote_attention_backend(device: torch.device) -> str:
    """The implementation `vote_attention` uses for tensors on `device` (for reports)."""
    return "triton flash attention + votes pass" if device.type == "cuda" and _triton_impl() else "torch reference"
