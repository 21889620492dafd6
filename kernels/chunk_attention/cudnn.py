"""cuDNN path for chunk (prefill) attention without a sliding window, on CUDA.

PyTorch's cuDNN attention only aligns the causal diagonal top-left, so a chunk at offset > 0 is split in
problems it handles at full speed: the chunk's queries against the prefix [0, offset) with no mask (in at
most two pieces, see PAST_GRAIN), and against the chunk's own keys [offset, offset + T) with a square causal
mask. The partial results are merged by their log-sum-exp. Measured on an H100 (Llama-3.1-8B shape, T 8192,
offset 120K): ~600 TFLOP/s against ~430 for FlexAttention. Nothing past offset + T is read, so the path is
NaN-safe.

The op is `aten._scaled_dot_product_cudnn_attention`, the kernel behind SDPA's cuDNN backend, called directly
because the public SDPA returns no log-sum-exp.
"""

from __future__ import annotations

import functools

import torch

from kernels.chunk_attention.reference import check_chunk


# Keys per whole piece of the prefix (0: the prefix in one piece). 16K balances the two plan counts for 128K
# documents in chunks of 2,048 (8 + 8 plans instead of 64).
PAST_GRAIN = 16384


def _canonical_batch_stride(t: torch.Tensor) -> torch.Tensor:
    """A batch of one addresses nothing through its batch stride, but cuDNN's plan cache keys on it: give it
    the span of one batch element, so that views of caches of different capacities share plans."""
    if t.shape[0] != 1:
        return t
    span = max(st * n for st, n in zip(t.stride()[1:], t.shape[1:]))
    return t.as_strided(t.shape, (span, *t.stride()[1:]))


def _attend(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, T, D]; k, v: [B, Hkv, L, D] -> (out [B, Hq, T, D], lse [B, Hq, T] fp32)."""
    q, k, v = _canonical_batch_stride(q), _canonical_batch_stride(k), _canonical_batch_stride(v)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse.view(q.shape[:3]).float()


@functools.cache
def _native_gqa_on(device: torch.device) -> bool:
    q = torch.randn(1, 4, 8, 64, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, 8, 64, device=device, dtype=torch.bfloat16)
    try:
        out, _ = _attend(q, kv, kv, False, 1.0)
    except RuntimeError:
        return False
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), kv.float(), kv.float(), scale=1.0,
                                                           enable_gqa=True)
    return bool(torch.allclose(out.float(), ref, atol=2e-2))


def _native_gqa(q, k, v) -> bool:
    """Whether cuDNN takes fewer KV heads than query heads as they are (checked once, numerically)."""
    return _native_gqa_on(q.device)


def chunk_attention_cudnn(
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
        raise ValueError("chunk_attention_cudnn has no sliding window; use the flex path for windowed layers")
    end = check_chunk(q, k_cache, offset)
    if k_cache.shape[1] != q.shape[1] and not _native_gqa(q, k_cache, v_cache):
        group = q.shape[1] // k_cache.shape[1]
        k_cache = k_cache[:, :, :end].repeat_interleave(group, dim=1)
        v_cache = v_cache[:, :, :end].repeat_interleave(group, dim=1)
    parts = [_attend(q, k_cache[:, :, offset:end], v_cache[:, :, offset:end], True, scale)]
    if offset == 0:
        return parts[0][0]
    # The prefix in at most two unmasked pieces, [0, whole grains) and the rest: cuDNN builds a plan per key
    # length, and this way a document of L tokens needs about L / grain + grain / chunk of them, not L / chunk.
    cut = offset - offset % PAST_GRAIN if PAST_GRAIN else 0
    for lo, hi in ((0, cut), (cut, offset)):
        if hi > lo:
            parts.append(_attend(q, k_cache[:, :, lo:hi], v_cache[:, :, lo:hi], False, scale))
    top = functools.reduce(torch.maximum, [lse for _, lse in parts])
    weights = [(lse - top).exp_() for _, lse in parts]
    out = sum(o.float() * w[..., None] for (o, _), w in zip(parts, weights))
    return (out / sum(weights)[..., None]).to(q.dtype)
