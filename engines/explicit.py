"""Attention scores formed explicitly, a slice of queries at a time, for engines that read the probabilities
(sas-pattern's H2O scores, ltri-stream's votes and span maps) and so cannot use a fused kernel."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

QUERY_SLICE = 256  # queries per slice: bounds the [.., t, keys] score tensor


def score_slices(query: torch.Tensor, key: torch.Tensor, scale: float,
                 visible: Callable[[int, int], torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Scaled, masked scores per slice of queries, in fp32, the query heads grouped by their KV head.

    query: [B, Hq, T, D]; key: [B, Hkv, W, D]; visible(lo, t): bool mask of queries lo..lo+t-1 over the W keys,
    broadcastable to [B, Hkv, 1, t, W]. Yields (lo, t, q [B, Hkv, G, t, D], s [B, Hkv, G, t, W]), masked
    scores -inf.
    """
    B, Hq, T, D = query.shape
    hkv = key.shape[1]
    k_t = key.float()[:, :, None].transpose(-1, -2)
    for lo in range(0, T, QUERY_SLICE):
        t = min(QUERY_SLICE, T - lo)
        q = query[:, :, lo:lo + t].float().view(B, hkv, Hq // hkv, t, D)
        # In place: the [.., t, W] scores are the largest temporaries of the attention; one of them per slice.
        s = torch.matmul(q, k_t).mul_(scale)
        yield lo, t, q, s.masked_fill_(~visible(lo, t), float("-inf"))
