"""Semantic span division (Ltri-LLM section 3.2, appendices D-E) and dynamic index counts (section 3.3.2).

NumPy on the host, batched over the blocks of a chunk: a block's map is a few hundred tokens square, the greedy
NMS is sequential by nature, and per-op torch overhead on such small arrays cost ~10x more (measured). The paper's equations are not in our copy of the text; what follows is
our reading of its prose, stated where it is a choice:

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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Span:
    start: int  # first token, relative to the map
    end: int  # last token, inclusive
    score: float  # thresholded triangle score (0 for the whole-map fallback)
    confidence: float  # x in [0, 1]

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def _np(a) -> np.ndarray:
    return a.detach().cpu().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)


def prefix_sums(a) -> np.ndarray:
    """a: [..., n, n] -> P [..., n + 1, n + 1] with P[r + 1, c + 1] = sum of a[:r + 1, :c + 1] (float64)."""
    a = _np(a)
    p = np.zeros((*a.shape[:-2], a.shape[-2] + 1, a.shape[-1] + 1))
    p[..., 1:, 1:] = a.cumsum(-2).cumsum(-1)
    return p


def triangle_scores(a, theta) -> np.ndarray:
    """TA [..., n, n] indexed [j, i] (span [i, j]); -inf where i > j. a: [..., n, n] causal maps (rows:
    queries); theta: a number or one per map [...]."""
    a = _np(a)
    n = a.shape[-1]
    causal = np.tril(np.ones((n, n), dtype=bool))
    theta = np.asarray(theta, dtype=np.float64)[..., None, None]
    p = prefix_sums(np.where(causal, a - theta, 0.0))
    diag = np.diagonal(p, axis1=-2, axis2=-1)[..., 1:]  # P[j, j] (shifted by the zero row/column)
    ta = diag[..., :, None] - p[..., 1:, :-1]  # [j, i] = P[j, j] - P[j, i - 1]
    return np.where(causal, ta, -np.inf)


def quantile_threshold(a, q: float) -> np.ndarray:
    """The q-quantile of the causal cells of each map a [..., n, n]."""
    a = _np(a)
    n = a.shape[-1]
    return np.quantile(a[..., np.tril(np.ones((n, n), dtype=bool))], q, axis=-1)


def nms(intervals, scores, iou_threshold: float) -> np.ndarray:
    """Greedy NMS on inclusive intervals [m, 2]; returns kept indices, best first (torchvision's semantics)."""
    intervals, scores = np.asarray(intervals, dtype=np.int64), _np(scores)
    order = np.argsort(-scores, kind="stable")
    kept: list[int] = []
    spans: list[tuple[int, int]] = []
    for k in order.tolist():
        s0, e0 = int(intervals[k, 0]), int(intervals[k, 1])
        for s1, e1 in spans:
            inter = min(e0, e1) - max(s0, s1) + 1
            if inter > 0 and inter / ((e0 - s0 + 1) + (e1 - s1 + 1) - inter) > iou_threshold:
                break
        else:
            kept.append(k)
            spans.append((s0, e0))
    return np.asarray(kept, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _antidiagonals(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For midpoints s = i + j in 0..2n-2 and i in 0..n-1: j = s - i, and whether (i, j) is a span (i <= j < n)."""
    s = np.arange(2 * n - 1)[:, None]
    i = np.arange(n)[None, :]
    j = s - i
    valid = (j >= i) & (j < n)
    return np.where(valid, j, 0), np.broadcast_to(i, valid.shape), valid


def best_per_antidiagonal(ta) -> np.ndarray:
    """Appendix E's filter on TA [n, n]: among spans with TA > 0, the best per midpoint i + j. -> [m, 3] (i, j, TA)."""
    return _best_per_antidiagonal(_np(ta)[None])[0]


def _best_per_antidiagonal(ta: np.ndarray) -> list[np.ndarray]:
    j, i, valid = _antidiagonals(ta.shape[-1])
    scores = np.where(valid, ta[:, j, i], -np.inf)  # [m, 2n-1, n]
    best_i = scores.argmax(axis=-1)  # [m, 2n-1]
    best = np.take_along_axis(scores, best_i[..., None], axis=-1)[..., 0]
    out = []
    for b in range(ta.shape[0]):
        mids = np.nonzero(best[b] > 0)[0]
        ii = best_i[b, mids]
        out.append(np.stack([ii, mids - ii, best[b, mids]], axis=1).astype(np.float64))
    return out


def divide(a, threshold: float, iou: float, ratio_mode: str = "row") -> list[Span]:
    """Spans of a causal attention map a [n, n] (summed over heads), best first; never empty. threshold: the
    quantile of the map's causal cells subtracted before scoring."""
    return divide_many(_np(a)[None], threshold, iou, ratio_mode)[0]


def divide_many(maps, threshold: float, iou: float, ratio_mode: str = "row") -> list[list[Span]]:
    """`divide` for several maps of one size at once: maps [m, n, n]."""
    maps = _np(maps)
    return _divide(maps, quantile_threshold(maps, threshold), iou, ratio_mode)


def divide_at(a, theta: float, iou: float, ratio_mode: str = "row") -> list[Span]:
    """`divide` with the threshold theta given as a value, not a quantile."""
    return _divide(_np(a)[None], np.asarray([theta]), iou, ratio_mode)[0]


def _divide(maps: np.ndarray, theta: np.ndarray, iou: float, ratio_mode: str) -> list[list[Span]]:
    n = maps.shape[-1]
    raw = prefix_sums(maps)
    out = []
    for b, cands in enumerate(_best_per_antidiagonal(triangle_scores(maps, theta))):
        if cands.shape[0] == 0:
            out.append([Span(0, n - 1, 0.0, _confidence(raw[b], 0, n - 1, n, ratio_mode))])
            continue
        keep = nms(cands[:, :2].astype(np.int64), cands[:, 2], iou)
        out.append([Span(int(cands[k, 0]), int(cands[k, 1]), float(cands[k, 2]),
                         _confidence(raw[b], int(cands[k, 0]), int(cands[k, 1]), n, ratio_mode)) for k in keep])
    return out


def _rect(p: np.ndarray, r0: int, r1: int, c0: int, c1: int) -> float:
    """Sum of the map over rows r0..r1 and columns c0..c1 (inclusive; empty ranges give 0)."""
    if r1 < r0 or c1 < c0:
        return 0.0
    return float(p[r1 + 1, c1 + 1] - p[r0, c1 + 1] - p[r1 + 1, c0] + p[r0, c0])


def _confidence(p: np.ndarray, i: int, j: int, n: int, mode: str) -> float:
    """x = T / (T + N) for the span [i, j] (see the module docstring); 1 when the neighbours hold nothing."""
    tri = _rect(p, i, j, i, j)  # the map is causal: the square's upper part is zero
    row = _rect(p, i, j, 0, i - 1) if mode in ("row", "rowcol") else 0.0
    col = _rect(p, j + 1, n - 1, i, j) if mode in ("col", "rowcol") else 0.0
    total = tri + row + col
    return 1.0 if total <= 0 else tri / total


def span_count(length: int, confidence: float, lam: float) -> int:
    """Eq. 7: round(length * x ** lam), at most the span's length."""
    return min(length, round(length * confidence ** lam))


def allocate(found: list[Span], votes: torch.Tensor, lam: float, lo: int, hi: int) -> list[int]:
    """Rows (of the map) whose keys index it. found: spans, best first; votes: [n] attention each token got."""
    votes = _np(votes)
    rows: list[int] = []
    for span in found:
        n = span_count(span.length, span.confidence, lam)
        if n:
            best = span.start + np.argsort(-votes[span.start:span.end + 1], kind="stable")[:n]
            rows.extend(r for r in best.tolist() if r not in rows)
        if len(rows) >= hi:
            break
    rows = rows[:hi]
    if len(rows) < lo:
        rest = [r for r in np.argsort(-votes, kind="stable").tolist() if r not in rows]
        rows.extend(rest[: lo - len(rows)])
    return sorted(rows)


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
