"""index_scores in plain PyTorch: the definition the Triton kernel is held to (and the CPU path)."""

from __future__ import annotations

import torch


def index_scores_reference(query: torch.Tensor, vectors: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
                           n_blocks: int, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [A, Hkv, D] (any float dtype, matched in fp32), vectors [N, Hkv, D] with block [N] (their block ids,
    < n_blocks; -1: an entry that holds no vector, skipped) and offset [N] (their token within the block) -> scores
    [n_blocks] fp32, each block's best dot product (summed over the KV heads) of one of its vectors with one query
    vector whose chosen [A] is set (None: all), -inf for blocks without vectors; and where [n_blocks] int64, the
    offset of the vector that scored it (the largest offset among ties; -1 for blocks without vectors)."""
    sims = torch.einsum("akd,nkd->an", query.float(), vectors.float())
    if chosen is not None:
        sims.masked_fill_(~chosen[:, None], float("-inf"))
    held = block >= 0
    sims = sims.amax(dim=0).masked_fill(~held, float("-inf"))
    block = block.clamp(min=0)  # the skipped entries fold -inf and -1 into block 0: no change
    out = torch.full((n_blocks,), float("-inf"), dtype=torch.float32, device=sims.device)
    out = out.scatter_reduce(0, block, sims, reduce="amax")
    best = torch.where(held & (sims == out[block]), offset, -1)
    where = torch.full((n_blocks,), -1, dtype=torch.long, device=sims.device)
    return out, where.scatter_reduce(0, block, best, reduce="amax")
