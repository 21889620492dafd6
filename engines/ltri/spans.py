"""Semantic span division (Ltri-LLM section 3.2, appendices D-E) and dynamic index counts (section 3.3.2).

Scoring runs on the maps' own device for every map of a batch at once (the threshold here; triangle scores, the
anti-diagonal filter and every candidate's confidence in kernels/span_candidates); for the stored side only the
candidates, at most 2n - 1 per map, go to the host for the greedy NMS, run for every map at once in numpy rounds
(kernels/span_rows.greedy_nms); the query side keeps them on the device (kernels/span_rows). The paper's
equations are not in our copy of the text; what follows is our reading of its prose, stated where it is a
choice:

- The map A [n, n] is the block's causal attention (queries x keys of the same tokens), summed over heads.
- Threshold (Eq. 5): theta is the `threshold` quantile of A's causal cells (the paper: ~90th percentile);
  A' = A - theta on the causal cells, 0 above the diagonal.
- Triangle score (Eq. 4) of the span [i, j]: the sum of A' over the triangle i <= key <= query <= j, read off
  2-D prefix sums: TA(i, j) = P[j, j] - P[j, i - 1], because A' is zero above the diagonal.
- Candidates are spans with TA > 0; per anti-diagonal (same midpoint i + j) only the best one is kept
  (appendix E); greedy NMS with an IoU threshold on the intervals then picks the spans (torchvision's rule:
  a box is dropped when its IoU with a kept, better box is above the threshold). No candidate: the whole map
  is one span.
- Confidence (Eq. 7): x = T / (T + N), T the span's triangle mass (unthresholded) and N its neighbours' mass
  inside the block: `row` = the span's queries on earlier keys, `col` = later queries on the span's keys,
  `rowcol` = both. The share of the span's tokens kept as index vectors is x ** lam (grows with x; a larger
  lam restricts harder, as the paper's Figure 6 describes): its round(length * x ** lam) most-voted tokens.
- Bounds: min_vectors and max_vectors (appendix B: 4 and 12, "M = 12") bound a block's vectors in total;
  spans are served best first until the block holds max_vectors, and a block with fewer than min_vectors is
  topped up with its most-voted remaining tokens.
- Which tokens (`pick`): each span's most-voted ones, the paper's (`allocate`), or farthest-point samples of the
  block's keys (`cover`, ours, kernels/farthest_point: the same count per block, one inside each span; on the
  embedded model votes favoured a UUID's characters over the words the question matches, and the first global
  layer lost the needle's block).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from kernels.span_candidates import span_candidates as candidates
from kernels.span_candidates.reference import causal as _causal
from kernels.span_rows import allocate_rows, greedy_nms


class Span(NamedTuple):
    """A span of a map (a tuple: the batched division makes thousands per chunk)."""
    start: int  # first token, relative to the map
    end: int  # last token, inclusive
    score: float  # thresholded triangle score (0 for the whole-map fallback)
    confidence: float  # x in [0, 1]

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def _np(a) -> np.ndarray:
    return a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)


def diagonal_blocks(a: torch.Tensor, lo: int, count: int, b: int) -> torch.Tensor:
    """The maps of `count` consecutive b-token blocks on the diagonal of a [n, n], from row/column lo: [count,
    b, b], gathered in one copy (a stack of slices takes one per block)."""
    square = a[lo:lo + count * b, lo:lo + count * b].unflatten(0, (count, b)).unflatten(2, (count, b))
    return square.diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()


@functools.lru_cache(maxsize=16)
def _causal_cells(n: int, device: torch.device) -> torch.Tensor:
    return torch.nonzero(_causal(n, device).flatten()).flatten()


def quantile_threshold(a: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of the causal cells of each map a [m, n, n] -> [m] (torch.quantile's linear
    interpolation). The cells are gathered by a fixed index, not a boolean mask, so the device never waits on
    the host. Two order statistics by selection (kthvalue), not a sort of every cell: the same values, in a few
    launches where a CUDA sort takes about a dozen."""
    cells = a.flatten(1).index_select(1, _causal_cells(a.shape[-1], a.device))
    pos = q * (cells.shape[-1] - 1)
    lo = int(pos)
    hi = min(lo + 1, cells.shape[-1] - 1)
    low = cells.kthvalue(lo + 1, dim=-1).values.double()
    high = cells.kthvalue(hi + 1, dim=-1).values.double() if hi != lo else low
    return low + (high - low) * (pos - lo)


def nms(intervals, scores, iou_threshold: float) -> np.ndarray:
    """Greedy NMS on inclusive intervals [m, 2]; returns kept indices, best first (torchvision's semantics)."""
    intervals, scores = np.asarray(intervals, dtype=np.int64).reshape(-1, 2), _np(scores)
    order = np.argsort(-scores, kind="stable")
    ranked = intervals[order]
    kept = greedy_nms(ranked[None, :, 0], ranked[None, :, 1], np.ones((1, len(order)), dtype=bool), iou_threshold)
    return order[kept[0][kept[0] >= 0]]


def divide_many(maps: torch.Tensor, threshold: float, iou: float, ratio_mode: str = "row") -> list[list[Span]]:
    """Spans of each causal attention map of maps [m, n, n] (summed over heads, any device), best first; never
    empty. threshold: the quantile of a map's causal cells subtracted before scoring."""
    return _divide(maps, quantile_threshold(maps, threshold), iou, ratio_mode)


def divide_at(a: torch.Tensor, theta: float, iou: float, ratio_mode: str = "row") -> list[Span]:
    """The spans of one map a [n, n], with the threshold theta given as a value, not a quantile."""
    return _divide(a[None], torch.tensor([theta], dtype=torch.float64, device=a.device), iou, ratio_mode)[0]


def _divide(maps: torch.Tensor, theta: torch.Tensor, iou: float, ratio_mode: str) -> list[list[Span]]:
    return spans_of(candidates(maps, theta, ratio_mode).cpu().numpy(), iou)  # one device -> host copy


def threshold_candidates(maps: torch.Tensor, threshold: float, ratio_mode: str = "row") -> torch.Tensor:
    """divide_many's device half: `candidates` [m, 2n - 1, 4] at each map's `threshold` quantile, for callers that
    bring them to the host along with other tensors, in one copy (`spans_of` is the host half)."""
    return candidates(maps, quantile_threshold(maps, threshold), ratio_mode)


def whole_block(n: int) -> np.ndarray:
    """The spans of a block never divided: the whole block, fully confident ([1, 4], as `kept_spans` gives)."""
    return np.array([[0, n - 1, 0.0, 1.0]])


def kept_spans(cands: np.ndarray, iou: float) -> tuple[np.ndarray, np.ndarray]:
    """The spans of each map from its candidates [m, 2n - 1, 4] on the host (`candidates`): NMS over those with
    TA > 0, best first -> spans [m, K, 4] (start, end, score, confidence as float64; rows past a map's count are
    padding) and counts [m] >= 1: a map without any candidate is one whole-map span."""
    m, n = cands.shape[0], (cands.shape[1] + 1) // 2
    score = cands[..., 2]
    valid = score > 0
    # Best first; the stable sort keeps ties in midpoint order, and the others (key +inf) go last.
    order = np.argsort(np.where(valid, -score, np.inf), axis=1, kind="stable")
    order = order[:, :max(1, int(valid.sum(axis=1).max(initial=0)))]  # the candidates taking part lead
    ranked = np.take_along_axis(cands, order[..., None], axis=1)
    kept = greedy_nms(ranked[..., 0].astype(np.int32), ranked[..., 1].astype(np.int32),
                       np.take_along_axis(valid, order, axis=1), iou)
    if kept.shape[1] == 0:
        kept = np.full((m, 1), -1)
    spans = np.take_along_axis(ranked, np.maximum(kept, 0)[..., None], axis=1).astype(np.float64, copy=False)
    counts = (kept >= 0).sum(axis=1)
    # No candidate: the whole map, which has no neighbours inside it, so fully confident.
    spans[counts == 0, 0] = whole_block(n)[0]
    return spans, np.maximum(counts, 1)


def as_spans(rows: np.ndarray) -> list[Span]:
    """Span tuples from `kept_spans` rows [k, 4]."""
    return list(map(Span._make, zip(rows[:, 0].astype(np.int64).tolist(), rows[:, 1].astype(np.int64).tolist(),
                                    rows[:, 2].tolist(), rows[:, 3].tolist())))


def spans_of(cands: np.ndarray, iou: float) -> list[list[Span]]:
    """`kept_spans` as a list of Span tuples per map."""
    spans, counts = kept_spans(cands, iou)
    return [as_spans(rows[:k]) for rows, k in zip(spans, counts.tolist())]


def span_count(length: int, confidence: float, lam: float) -> int:
    """Eq. 7: round(length * x ** lam), at most the span's length."""
    return min(length, round(length * confidence ** lam))


def allocate(found: list[Span], votes: torch.Tensor, lam: float, lo: int, hi: int) -> list[int]:
    """Rows (of the map) whose keys index it. found: spans, best first; votes: [n] attention each token got
    (kernels/span_rows.allocate_rows with Eq. 7's count per span)."""
    return allocate_rows([s.start for s in found], [s.end for s in found],
                         [span_count(s.length, s.confidence, lam) for s in found], _np(votes), lo, hi)


def slot_ranges(found: list[Span], lam: float, lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    """The token range [start, end] of each index vector of an n-token block, in picking order (for `cover`):
    Eq. 7's count for every span, best span first, at most hi in all, then whole-block slots up to lo
    (`allocate`'s bounds). A span's first vector comes from inside it, its others from anywhere in the block:
    restricted to their spans, they went to the spans Eq. 7 favours (a UUID's characters) and the words a
    question matches stayed unindexed (the needle's block ranked 22nd instead of 1st on one sample)."""
    out: list[tuple[int, int]] = []
    for span in found:
        k = span_count(span.length, span.confidence, lam)
        out.extend([(span.start, span.end)] * min(k, 1) + [(0, n - 1)] * (k - 1))
        if len(out) >= hi:
            break
    out = out[:hi]
    return out + [(0, n - 1)] * max(0, min(lo, n) - len(out))


def slot_table(spans: np.ndarray, counts: np.ndarray, lam, lo: int, hi: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`slot_ranges` of many n-token blocks at once: spans [B, K, 4] best first with counts [B] (`kept_spans`), lam
    a float or [B] ->
    ranges [B, W, 2] int64, W the most slots of any block, (0, -1) past a block's slots, and slots [B]. Each span
    has Eq. 7's count of slots, served best first, hi in all; the span's own range takes its first slot, the whole
    block every other, then whole-block slots up to lo."""
    B, K = spans.shape[:2]
    length = spans[..., 1] - spans[..., 0] + 1
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64).reshape(-1, 1), (B, 1))
    k = np.minimum(length, np.round(length * spans[..., 3] ** lam))  # span_count, rounded half to even
    k = np.where(np.arange(K) < counts[:, None], k, 0).astype(np.int64)
    first = np.cumsum(k, axis=1) - k  # each span's first slot
    slots = np.maximum(np.minimum(hi, k.sum(axis=1)), min(lo, n))
    width = max(1, int(slots.max(initial=0)))
    ranges = np.zeros((B, width, 2), dtype=np.int64)
    ranges[..., 1] = n - 1
    ranges[np.arange(width) >= slots[:, None]] = (0, -1)
    b, i = np.nonzero((k > 0) & (first < hi))
    ranges[b, first[b, i]] = spans[b, i, :2].astype(np.int64)
    return ranges, slots


def calibrate_lambda(lengths: torch.Tensor, confidence: torch.Tensor, target: float,
                     grid: torch.Tensor | None = None) -> float:
    """The smallest lam on the grid whose expected compression (tokens per index vector) reaches `target`.

    lengths, confidence: [m] spans seen so far on one layer (section 3.3.2's per-layer lookup table, built
    from the spans this document has produced); counts per span by Eq. 7, before the per-block bounds. The
    largest lam on the grid when none reaches the target.
    """
    grid = torch.linspace(0.5, 40.0, 80, dtype=torch.float64) if grid is None else grid
    n = (lengths.double()[None] * confidence.double()[None] ** grid[:, None]).round()
    ratio = lengths.double().sum() / torch.minimum(n, lengths.double()[None]).sum(dim=1).clamp(min=1)
    ok = torch.nonzero(ratio >= target)
    return float(grid[ok[0, 0]] if ok.numel() else grid[-1])
