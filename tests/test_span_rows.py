"""span_rows: a block map's span candidates -> the rows its spans choose.

On CPU the reference is held to ltri-stream's definitions (spans_of's NMS, then allocate per map); `triton`
tests hold the Triton kernel to the reference on the same maps, tied scores and votes included (on CUDA, or on
CPU through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

from engines.ltri import spans as sp
from kernels.span_rows import span_rows, span_rows_reference
from tests.conftest import TRITON_DEVICE
from tests.test_ltri_spans import _maps

# Under Triton's interpreter a lane that reads outside its tensor reads whatever lies there, and arithmetic on it
# warns (inf - inf, NaN); on a GPU the same read can fault. The warnings are errors here, so such a read fails.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CASES = [pytest.param(m, n, kind, id=f"m{m}-n{n}-{kind}")
         for m, n, kind in [(1, 1, "softmax"), (3, 2, "softmax"), (8, 63, "softmax"), (4, 128, "softmax"),
                            (6, 128, "blocks"), (5, 77, "ties"), (1, 128, "flat")]]
BOUNDS = [pytest.param(*b, id=f"lam{b[0]}-lo{b[1]}-hi{b[2]}")
          for b in [(3.0, 12, 48), (20.0, 12, 48), (0.5, 4, 12), (3.0, 200, 300)]]


def _inputs(m, n, kind, threshold=0.9, ratio_mode="row"):
    """Candidates and votes as ltri-stream's query side makes them from a chunk's maps."""
    maps = torch.ones(m, n, n).tril() if kind == "flat" else _maps(m, n, 11 + n, kind).float()
    votes = maps.sum(dim=1)
    if kind == "ties":
        votes = votes.round()  # tied votes: the lowest row first
    return sp.threshold_candidates(maps, threshold, ratio_mode), votes


def _engine_rows(cands, votes, lam, lo, hi, iou) -> list[list[int]]:
    """ltri-stream's definitions, map by map: spans_of, then allocate."""
    return [sp.allocate(found, v, lam, lo, hi) for found, v in zip(sp.spans_of(cands.numpy(), iou), votes)]


@pytest.mark.parametrize("m, n, kind", CASES)
@pytest.mark.parametrize("lam, lo, hi", BOUNDS)
def test_reference_equals_spans_then_allocate(m, n, kind, lam, lo, hi):
    cands, votes = _inputs(m, n, kind)
    got = span_rows(cands, votes, lam=lam, lo=lo, hi=hi, iou=0.1)
    assert got.dtype == torch.bool and got.shape == (m, n)
    assert [torch.nonzero(r).flatten().tolist() for r in got] == _engine_rows(cands, votes, lam, lo, hi, 0.1)


def test_a_map_without_spans_is_served_whole():
    """No candidate scores above zero: the whole map is the one span (confidence 1), its hi most-voted rows."""
    n = 16
    cands = torch.zeros(1, 2 * n - 1, 4, dtype=torch.float64)
    votes = torch.arange(n, dtype=torch.float32).flip(0)
    got = span_rows(cands, votes[None], lam=3.0, lo=2, hi=5, iou=0.1)
    assert torch.nonzero(got[0]).flatten().tolist() == [0, 1, 2, 3, 4]


@pytest.mark.triton
@pytest.mark.parametrize("m, n, kind", CASES)
@pytest.mark.parametrize("lam, lo, hi", BOUNDS)
@pytest.mark.parametrize("iou", [0.01, 0.5])
def test_triton_matches_reference(m, n, kind, lam, lo, hi, iou):
    from kernels.span_rows.triton import span_rows_triton

    cands, votes = _inputs(m, n, kind, ratio_mode="rowcol")
    want = span_rows_reference(cands, votes, lam, lo, hi, iou)
    got = span_rows_triton(cands.to(TRITON_DEVICE), votes.to(TRITON_DEVICE), lam, lo, hi, iou)
    assert torch.equal(got.cpu(), want)


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.span_rows.triton import span_rows_triton

    cands, votes = _inputs(2, 8, "softmax")
    cands, votes = cands.to(TRITON_DEVICE), votes.to(TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"expected cands of shape \[m, C, 4\] float64"):
        span_rows_triton(cands.float(), votes, 3.0, 4, 12, 0.1)
    with pytest.raises(ValueError, match=r"expected votes of shape \[2, n\]"):
        span_rows_triton(cands, votes[:1], 3.0, 4, 12, 0.1)
