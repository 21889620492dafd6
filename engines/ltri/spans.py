"""Semantic span division (Ltri-LLM section 3.2, appendices D-E) and dynamic index counts (section 3.3.2).

Plain PyTorch on small CPU tensors: a block's attention map is at most a few hundred tokens square, and the
greedy NMS is sequential by nature. The paper's equations are not in our copy of the text; what follows is
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

from dataclasses import dataclass

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


def prefix_sums(a: torch.Tensor) -> torch.Tensor:
    """a: [n, n] -> P [n + 1, n + 1] with P[r + 1, c + 1] = sum of a[:r + 1, :c + 1] (float64)."""
    p = torch.zeros(a.shape[0] + 1, a.shape[1] + 1, dtype=torch.float64)
    p[1:, 1:] = a.double().cumsum(0).cumsum(1)
    return p


def triangle_scores(a: torch.Tensor, theta: float) -> torch.Tensor:
    """TA [n, n] indexed [j, i] (span [i, j]); -inf where i > j. a: [n, n] causal map (rows: queries)."""
    n = a.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    p = prefix_sums(torch.where(causal, a.double() - theta, 0.0))
    diag = p.diagonal()[1:]  # P[j, j] for j = 0..n-1 (shifted by the zero row/column)
    ta = diag[:, None] - p[1:, :-1]  # [j, i] = P[j, j] - P[j, i - 1]
    return ta.masked_fill(~causal, float("-inf"))


def quantile_threshold(a: torch.Tensor, q: float) -> float:
    """The q-quantile of the causal cells of a [n, n]."""
    n = a.shape[0]
    cells = a[torch.ones(n, n, dtype=torch.bool).tril()].double()
    return float(torch.quantile(cells, q)) if cells.numel() <= 16_000_000 else float(cells.kthvalue(
        max(1, int(q * cells.numel()))).values)


def interval_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of inclusive integer intervals: a [m, 2], b [k, 2] -> [m, k]."""
    inter = (torch.minimum(a[:, None, 1], b[None, :, 1]) - torch.maximum(a[:, None, 0], b[None, :, 0]) + 1).clamp(min=0)
    len_a, len_b = a[:, 1] - a[:, 0] + 1, b[:, 1] - b[:, 0] + 1
    return inter / (len_a[:, None] + len_b[None, :] - inter)


def nms(intervals: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS on inclusive intervals [m, 2]; returns kept indices, best first (torchvision's semantics)."""
    order = torch.argsort(scores, descending=True, stable=True)
    iou = interval_iou(intervals[order].double(), intervals[order].double())
    alive = torch.ones(order.numel(), dtype=torch.bool)
    kept = []
    for r in range(order.numel()):
        if alive[r]:
            kept.append(r)
            alive &= ~(iou[r] > iou_threshold)
    return order[torch.tensor(kept, dtype=torch.long)]


def best_per_antidiagonal(ta: torch.Tensor) -> torch.Tensor:
    """Appendix E's filter: among spans with TA > 0, the best per midpoint i + j. Returns [m, 3] (i, j, TA)."""
    j, i = torch.nonzero(ta > 0, as_tuple=True)
    if j.numel() == 0:
        return torch.zeros(0, 3, dtype=torch.float64)
    score = ta[j, i]
    order = torch.argsort(score, descending=True, stable=True)
    # In descending score order, the first span of each midpoint is that midpoint's best.
    mids, inverse = torch.unique((i + j)[order], return_inverse=True)
    first = torch.full((mids.numel(),), order.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(order.numel()), reduce="amin")
    pick = order[first]
    return torch.stack([i[pick].double(), j[pick].double(), score[pick]], dim=1)


def divide(a: torch.Tensor, threshold: float, iou: float, ratio_mode: str = "row") -> list[Span]:
    """Spans of a causal attention map a [n, n] (summed over heads), best first; never empty. threshold: the
    quantile of the map's causal cells subtracted before scoring."""
    return divide_at(a, quantile_threshold(a.double(), threshold), iou, ratio_mode)


def divide_at(a: torch.Tensor, theta: float, iou: float, ratio_mode: str = "row") -> list[Span]:
    """`divide` with the threshold theta given as a value, not a quantile."""
    a = a.double()
    n = a.shape[0]
    cands = best_per_antidiagonal(triangle_scores(a, theta))
    raw = prefix_sums(a)
    if cands.shape[0] == 0:
        return [Span(0, n - 1, 0.0, _confidence(raw, 0, n - 1, n, ratio_mode))]
    keep = nms(cands[:, :2].long(), cands[:, 2], iou)
    return [Span(int(cands[k, 0]), int(cands[k, 1]), float(cands[k, 2]),
                 _confidence(raw, int(cands[k, 0]), int(cands[k, 1]), n, ratio_mode)) for k in keep.tolist()]


def _rect(p: torch.Tensor, r0: int, r1: int, c0: int, c1: int) -> float:
    """Sum of the map over rows r0..r1 and columns c0..c1 (inclusive; empty ranges give 0)."""
    if r1 < r0 or c1 < c0:
        return 0.0
    return float(p[r1 + 1, c1 + 1] - p[r0, c1 + 1] - p[r1 + 1, c0] + p[r0, c0])


def _confidence(p: torch.Tensor, i: int, j: int, n: int, mode: str) -> float:
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
    rows: list[int] = []
    for span in found:
        n = span_count(span.length, span.confidence, lam)
        if n:
            best = (span.start + votes[span.start:span.end + 1].topk(n).indices).tolist()
            rows.extend(r for r in best if r not in rows)
        if len(rows) >= hi:
            break
    rows = rows[:hi]
    if len(rows) < lo:
        rest = [r for r in votes.argsort(descending=True, stable=True).tolist() if r not in rows]
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
