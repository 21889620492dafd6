"""decode_attention: the newest token (or few tokens) of a sequence against a static, preallocated KV cache.

CUDA tensors go to the split-KV Triton kernel (CUDA-graph capturable); one fp32 token per sequence on the CPU
goes to SDPA over exactly the keys it sees; everything else, or a machine without Triton, goes to the pure-torch
reference. A few queries at once (T > 1) is the dense re-encoding step of
engines that rewrite their newest K/V (resa's rectification). `merge_partials` combines results over key
shards by log-sum-exp.
"""

from __future__ import annotations

import functools

import torch

from kernels.decode_attention.reference import PositionMask, PositionRule
from kernels.decode_attention.reference import decode_attention as decode_attention_reference
from kernels.lse_combine import merge_partials

__all__ = ["PositionMask", "PositionRule", "decode_attention", "decode_attention_reference", "decode_backend", "merge_partials"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.decode_attention.triton import decode_attention_triton
    except ImportError:
        return None
    return decode_attention_triton


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    q_first: torch.Tensor | None = None,
    mask: torch.Tensor | PositionMask | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the tokens at positions length-T .. length-1 (or q_first..) over their valid keys.

    q: [B, Hq, D] (one token) or [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, S, D] (Hq % Hkv == 0); length: [B]
    int64 on q's device, T <= length <= S; keys at index >= length are never read into the result. window:
    None for all earlier keys, else only keys with index > position - window. q_first: [B] int64, the index
    of the first query when it is not length - T. mask: the keys each KV head may see at all ([B, Hkv, S]
    bool), or a PositionMask computed from token positions inside the kernel (see the reference). Returns out
    shaped like q in q's dtype, plus lse ([B, Hq] or [B, Hq, T]) fp32 (natural log) with return_lse.
    """
    if not q.is_cuda and q.dim() == 3 and q.dtype == torch.float32 and mask is None and q_first is None \
            and not return_lse:
        return _cpu_one_query(q, k_cache, v_cache, length, scale, window)
    impl = _triton_impl() if q.is_cuda else None
    impl = impl or decode_attention_reference
    return impl(q, k_cache, v_cache, length, scale=scale, window=window, q_first=q_first, mask=mask,
                return_lse=return_lse)


def _cpu_one_query(q, k_cache, v_cache, length, scale: float, window: int | None) -> torch.Tensor:
    """One new token per sequence on the CPU (fp32): SDPA over exactly the keys it sees, [length - window,
    length), with no mask. The reference reads the whole valid prefix and masks it, which for a windowed layer
    is most of the work of a decode step (the reference stays the definition; tests compare the two)."""
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    outs = []
    for b, hi in enumerate(length.tolist()):
        lo = 0 if window is None else max(0, hi - window)
        if hi <= lo:
            outs.append(torch.zeros_like(q[b:b + 1]))
            continue
        out = torch.nn.functional.scaled_dot_product_attention(
            q[b:b + 1, :, None], k_cache[b:b + 1, :, lo:hi], v_cache[b:b + 1, :, lo:hi], scale=scale,
            enable_gqa=Hq != Hkv)
        outs.append(out[:, :, 0])
    return torch.cat(outs)


def decode_backend(device: torch.device, one_token: bool = False) -> str:
    """The implementation `decode_attention` uses for tensors on `device` (for reports); one_token: for calls
    with one fp32 query per sequence, no mask, no lse (dense decoding)."""
    if device.type == "cuda" and _triton_impl():
        return "triton split-KV"
    return "torch SDPA over the keys each new token sees" if one_token else "torch reference"
