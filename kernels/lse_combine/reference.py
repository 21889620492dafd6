"""Reference log-sum-exp merge of attention partials, in plain PyTorch (any device, CUDA-graph safe)."""

from __future__ import annotations

import torch


def merge_partials(
    outs: list[torch.Tensor] | tuple[torch.Tensor, ...], lses: list[torch.Tensor] | tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint key shards by log-sum-exp.

    outs: n tensors [..., D] (any float dtype); lses: n tensors [...] (natural log, -inf for an empty shard).
    Returns (out [..., D] in outs[0]'s dtype, lse [...] fp32). Shards with lse = -inf contribute nothing; if
    every shard is empty, out is 0 and lse is -inf.
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


def combine_splits(out_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """out_part: [R, S, D] fp32; lse_part: [R, S] fp32 -> (out [R, D] in out_dtype, lse [R] fp32)."""
    out, lse = merge_partials(out_part.unbind(1), lse_part.unbind(1))
    return out.to(out_dtype), lse
