"""Reference farthest-point sampling of a block's keys, batched over blocks (plain torch, any device).

Defines correctness for the Triton kernel and is the CPU path. Used by ltri-stream's `pick: cover` to choose a
stored block's index vectors.
"""

from __future__ import annotations

import torch


def farthest_point_reference(keys: torch.Tensor, votes: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Rows picked by farthest-point sampling of the keys, one block per leading index.

    keys: [m, n, F]; votes: [m, n]; ranges: [m, S, 2] int64, the inclusive row range of each slot (end < start:
    no slot). Returns [m, S] int64 rows (-1: slot empty or its range used up). A block's first pick is the
    most-voted row of its first slot's range; every later pick is the unpicked row of its slot's range farthest
    (Euclidean, fp32) from all picks so far; ties go to the lowest row.
    """
    m, n, _ = keys.shape
    keys, votes = keys.float(), votes.float()
    pos = torch.arange(n, device=keys.device)
    allowed = (pos >= ranges[..., :1]) & (pos <= ranges[..., 1:])  # [m, S, n]
    picks = torch.full(ranges.shape[:2], -1, dtype=torch.long, device=keys.device)
    chosen = torch.zeros(m, n, dtype=torch.bool, device=keys.device)
    dist = torch.full((m, n), float("inf"), device=keys.device)
    rows = torch.arange(m, device=keys.device)
    for s in range(ranges.shape[1]):
        ok = allowed[:, s] & ~chosen
        crit = torch.where(chosen.any(dim=1, keepdim=True), dist, votes).masked_fill(~ok, float("-inf"))
        best = crit.argmax(dim=1)
        found = ok.any(dim=1)
        picks[:, s] = torch.where(found, best, -1)
        chosen[rows, best] |= found
        step = (keys - keys[rows, best][:, None]).square().sum(dim=-1)
        dist = torch.where(found[:, None], torch.minimum(dist, step), dist)
    return picks
