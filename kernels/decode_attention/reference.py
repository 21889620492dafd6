"""Reference decode attention: one query token per sequence against a static KV cache, in plain PyTorch.

Defines correctness for the Triton kernel and is the CPU production path. It reads the valid prefix only,
so it asks the host for `length.max()` and is not CUDA-graph safe; the Triton kernel is.
"""

from __future__ import annotations

import torch


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of the token at position length-1 over keys [0, length), or the last `window` of them.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, S, D] with Hq % Hkv == 0; length: [B] int, 0 <= length <= S
    (0 gives an empty shard: out 0, lse -inf). Keys at index >= length may hold anything, NaN included.
    Returns out [B, Hq, D] in q's dtype, and with return_lse also lse [B, Hq] fp32 (natural log of the sum
    of exp(scaled scores)), computed in fp32.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    # One host sync: read only up to the longest valid prefix instead of the whole buffer.
    hi = int(length.max()) if B else 0
    k = k_cache[:, :, :hi].float()
    v = v_cache[:, :, :hi].float()
    pos = torch.arange(hi, device=q.device)
    valid = pos < length[:, None]  # [B, hi]
    if window is not None:
        valid &= pos > (length[:, None] - 1) - window
    mask = valid[:, None, None, :]  # [B, 1, 1, hi]: broadcasts over kv heads and the GQA group

    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, hi]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for an empty shard
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    # Zero the garbage rows of V: p is 0 there, but 0 * NaN would still be NaN.
    v = v.masked_fill(~valid[:, None, :, None], 0.0)
    out = torch.matmul(p, v).view(B, Hq, D).to(q.dtype)
    return (out, lse.view(B, Hq)) if return_lse else out


def merge_partials(
    outs: list[torch.Tensor] | tuple[torch.Tensor, ...], lses: list[torch.Tensor] | tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint key shards by log-sum-exp.

    outs: n tensors [..., D] (any float dtype); lses: n tensors [...] (natural log, -inf for an empty shard).
    Returns (out [..., D] in outs[0]'s dtype, lse [...] fp32). Shards with lse = -inf contribute nothing; if
    every shard is empty, out is 0 and lse is -inf. Pure torch ops, so it runs on any device (and in graphs).
    """
    lse = torch.stack([x.float() for x in lses])  # [n, ...]
    m = lse.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)  # [n, ...]; 0 for empty shards
    total = w.sum(dim=0)
    acc = torch.zeros_like(outs[0], dtype=torch.float32)
    for wi, oi in zip(w, outs):
        # where(), not a product: an empty shard's out may be NaN and 0 * NaN is NaN.
        acc += torch.where(wi[..., None] > 0, wi[..., None] * oi.float(), 0.0)
    out = acc / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.to(outs[0].dtype), m + torch.log(total)
