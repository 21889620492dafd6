"""Reference span candidates: a block's attention map -> per midpoint the best span and its confidence.

Defines correctness for the Triton kernel and is the CPU path (plain torch, batched over maps, on any device).
The definitions are ltri-stream's reading of the Ltri-LLM paper (engines/ltri/spans.py says which choices are
ours): A' = A - theta on the causal cells, the triangle score TA(i, j) = the sum of A' over i <= key <= query <=
j, read off 2-D prefix sums (float64), per anti-diagonal (same midpoint i + j) the best span, and its confidence
T / (T + N) with N the neighbouring rows and/or columns of the raw map.
"""

from __future__ import annotations

import functools

import torch


def prefix_sums(a: torch.Tensor) -> torch.Tensor:
    """a: [..., n, n] -> P [..., n + 1, n + 1] with P[r + 1, c + 1] = sum of a[:r + 1, :c + 1] (float64)."""
    p = a.new_zeros((*a.shape[:-2], a.shape[-2] + 1, a.shape[-1] + 1), dtype=torch.float64)
    p[..., 1:, 1:] = a.double().cumsum(-2).cumsum(-1)
    return p


def causal(n: int, device) -> torch.Tensor:
    """[n, n] True on and below the diagonal."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def triangle_scores(a: torch.Tensor, theta) -> torch.Tensor:
    """TA [..., n, n] indexed [j, i] (span [i, j]); -inf where i > j. a: [..., n, n] causal maps (rows:
    queries); theta: a number or a tensor with one value per map [...]."""
    n = a.shape[-1]
    below = causal(n, a.device)
    theta = torch.as_tensor(theta, dtype=torch.float64, device=a.device)[..., None, None]
    p = prefix_sums(torch.where(below, a.double() - theta, 0.0))
    diag = p.diagonal(dim1=-2, dim2=-1)[..., 1:]  # P[j, j] (shifted by the zero row/column)
    ta = diag[..., :, None] - p[..., 1:, :-1]  # [j, i] = P[j, j] - P[j, i - 1]
    return ta.masked_fill(~below, float("-inf"))


@functools.lru_cache(maxsize=16)
def _antidiagonals(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For midpoints s = i + j in 0..2n-2 and i in 0..n-1: j = s - i, i, and whether (i, j) is a span."""
    s = torch.arange(2 * n - 1, device=device)[:, None]
    i = torch.arange(n, device=device)[None, :]
    j = s - i
    valid = (j >= i) & (j < n)
    return j.where(valid, 0), i.expand_as(j), valid


def rect(p: torch.Tensor, r0, r1, c0, c1) -> torch.Tensor:
    """Sums over rows r0..r1 and columns c0..c1 (inclusive; [m, k] index tensors; empty ranges give 0).
    p: [m, n + 1, n + 1] prefix sums."""
    def at(r, c):
        return torch.gather(p.flatten(1), 1, r * p.shape[-1] + c)
    return at(r1 + 1, c1 + 1) - at(r0, c1 + 1) - at(r1 + 1, c0) + at(r0, c0)


def span_candidates_reference(maps: torch.Tensor, theta: torch.Tensor, ratio_mode: str) -> torch.Tensor:
    """Per map and midpoint, the best span: [m, 2n - 1, 4] (i, j, TA, confidence), TA <= 0 where none.

    maps: [m, n, n] causal maps; theta: [m] thresholds. Confidence x = T / (T + N) (module docstring).
    """
    n = maps.shape[-1]
    j, i, valid = _antidiagonals(n, maps.device)
    scores = triangle_scores(maps, theta)[:, j, i].masked_fill(~valid, float("-inf"))  # [m, 2n-1, n]
    best, bi = scores.max(dim=-1)
    bj = torch.arange(2 * n - 1, device=maps.device) - bi
    p = prefix_sums(maps)
    tri = rect(p, bi, bj, bi, bj)
    zero = torch.zeros_like(bi)
    row = rect(p, bi, bj, zero, bi - 1) if ratio_mode in ("row", "rowcol") else torch.zeros_like(tri)
    col = rect(p, bj + 1, zero + n - 1, bi, bj) if ratio_mode in ("col", "rowcol") else torch.zeros_like(tri)
    total = tri + row + col
    conf = torch.where(total > 0, tri / total.clamp(min=1e-300), 1.0)
    return torch.stack([bi.double(), bj.double(), best, conf], dim=-1)
