"""Reference span selection: a map's span candidates -> the rows whose queries (or keys) index it.

ltri-stream divides a block's attention map into spans (engines/ltri/spans.py): per midpoint the best candidate
span, then greedy NMS over the candidates best first, then each kept span's Eq. 7 count of its most-voted rows,
within a block's bounds. `rank_candidates` is plain torch on any device (no host wait); the NMS and the row
picking here run on the host in numpy and define correctness for the Triton kernel.
"""

from __future__ import annotations

import numpy as np
import torch


def span_counts(cands: torch.Tensor, lam: float) -> torch.Tensor:
    """cands [m, C, 4] -> [m, C] int64 Eq. 7's count of each candidate span: min(length, round(length *
    confidence ** lam)), rounded half to even as Python rounds."""
    length = cands[..., 1] - cands[..., 0] + 1
    return torch.minimum(length, torch.round(length * cands[..., 3] ** lam)).long()


def rank_candidates(cands: torch.Tensor, lam: float) -> tuple[torch.Tensor, ...]:
    """cands [m, C, 4] (start, end, score, confidence) per midpoint, score <= 0 where there is no span, C = 2n - 1
    -> (start, end, count, alive), each [m, C], best score first (ties in midpoint order): the inclusive row
    range, `span_counts` and whether the candidate takes part. A map without any candidate gets the whole map at
    confidence 1."""
    m, C, _ = cands.shape
    n = (C + 1) // 2
    score = cands[..., 2]
    valid = score > 0
    order = torch.sort(torch.where(valid, -score, float("inf")), dim=1, stable=True).indices
    ranked = cands.gather(1, order[..., None].expand(-1, -1, 4))
    # No candidate: the whole map, which has no neighbours inside it, so fully confident.
    whole = ~valid.any(dim=1, keepdim=True) & (torch.arange(C, device=cands.device) == 0)
    ranked[..., 0] = torch.where(whole, 0.0, ranked[..., 0])
    ranked[..., 1] = torch.where(whole, n - 1.0, ranked[..., 1])
    ranked[..., 3] = torch.where(whole, 1.0, ranked[..., 3])
    return ranked[..., 0].long(), ranked[..., 1].long(), span_counts(ranked, lam), valid.gather(1, order) | whole


def greedy_nms(start: np.ndarray, end: np.ndarray, alive: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy NMS of many maps at once. start, end: [m, C] inclusive intervals, each map's best first; alive:
    [m, C] those taking part. Returns [m, K] the kept positions, best first (-1 past a map's last).

    Each round keeps every map's best candidate still alive and drops those it overlaps by IoU above the
    threshold: the picks of the one-by-one greedy loop (a candidate survives exactly when no better kept one
    suppresses it), in as many rounds as the most spans a map keeps; the IoU is the loop's float64 quotient."""
    alive = alive.copy()
    rows = np.arange(start.shape[0])
    length = end - start + 1
    kept = []
    while True:
        has = alive.any(axis=1)
        if not has.any():
            break
        best = alive.argmax(axis=1)
        kept.append(np.where(has, best, -1))
        s0, e0 = start[rows, best][:, None], end[rows, best][:, None]
        inter = np.minimum(end, e0) - np.maximum(start, s0) + 1
        union = length + length[rows, best][:, None] - inter
        alive &= ~((inter > 0) & (inter / union > iou_threshold))  # the best suppresses itself too
    return np.stack(kept, axis=1) if kept else np.full((start.shape[0], 0), -1)


def allocate_rows(starts, ends, counts, votes: np.ndarray, lo: int, hi: int) -> list[int]:
    """The rows of one map chosen by its kept spans (best first; each the inclusive range starts[i]..ends[i]
    with its count): each span's `count` most-voted rows (ties to the lowest row) less those already taken,
    served until hi rows; a map left with fewer than lo is topped up with its most-voted remaining rows.
    Returns the rows sorted."""
    taken = np.zeros(votes.shape[0], dtype=bool)
    rows: list[int] = []
    for start, end, count in zip(starts, ends, counts):
        if count:
            best = start + np.argsort(-votes[start:end + 1], kind="stable")[:count]
            best = best[~taken[best]]
            taken[best] = True
            rows.extend(best.tolist())
        if len(rows) >= hi:
            break
    rows = rows[:hi]
    if len(rows) < lo:
        taken[:] = False
        taken[rows] = True
        rest = np.argsort(-votes, kind="stable")
        rows.extend(rest[~taken[rest]][: lo - len(rows)].tolist())
    return sorted(rows)


def span_rows_reference(cands: torch.Tensor, votes: torch.Tensor, lam: float, lo: int, hi: int,
                        iou: float) -> torch.Tensor:
    """cands [m, 2n - 1, 4] (start, end, score, confidence per midpoint; score <= 0: none) and votes [m, n] ->
    [m, n] bool, the rows the map's spans choose: `rank_candidates`, greedy NMS at `iou`, then `allocate_rows`
    with the bounds lo, hi."""
    start, end, count, alive = (t.cpu().numpy() for t in rank_candidates(cands, lam))
    kept = greedy_nms(start, end, alive, iou)
    v = votes.detach().cpu().double().numpy()
    out = torch.zeros(votes.shape, dtype=torch.bool)
    for i, k in enumerate(kept):
        k = k[k >= 0]
        out[i, allocate_rows(start[i, k], end[i, k], count[i, k], v[i], lo, hi)] = True
    return out.to(votes.device)
