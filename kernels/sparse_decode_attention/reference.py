"""Reference block-sparse decode attention in plain PyTorch: gather the listed blocks, then attend."""

from __future__ import annotations

import torch


def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                            length: torch.Tensor, *, block_size: int, scale: float,
                            return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """See kernels.sparse_decode_attention. Blocks are read in list order (ascending from block_select)."""
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    W = blocks.shape[-1]
    listed = blocks >= 0  # [B, Hkv, W]
    tok = blocks.clamp_min(0).long()[..., None] * block_size + torch.arange(block_size, device=q.device)
    valid = listed[..., None] & (tok < length[:, None, None, None]) & (tok < S)  # [B, Hkv, W, bs]
    tok = torch.where(valid, tok, 0).view(B, Hkv, W * block_size)
    valid = valid.view(B, Hkv, 1, W * block_size)
    gather = tok[..., None].expand(-1, -1, -1, D)
    k = torch.gather(k_cache, 2, gather).float()  # [B, Hkv, W * bs, D]
    v = torch.gather(v_cache, 2, gather).float().masked_fill(~valid.transpose(-1, -2), 0.0)
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hkv, G, W * bs]
    s = s.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    out = torch.matmul(p, v).view(B, Hq, D).to(q.dtype)
    lse = lse.view(B, Hq)
    return (out, lse) if return_lse else out
