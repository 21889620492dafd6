"""span_candidates: a block's attention map -> per midpoint the best span and its confidence.

The reference itself is held to brute force in tests/test_ltri.py (triangle scores, rectangle sums, spans);
`triton` tests hold the Triton kernel to it on the maps ltri-stream divides (on CUDA, or on CPU through Triton's
interpreter). Maps of small integers have exact float64 prefix sums in any order, so there the kernel must agree
exactly; on softmax maps its parallel scans round differently by float64 ulps, which may only move a tie.
"""

from __future__ import annotations

import pytest
import torch

from engines.ltri import spans as sp
from kernels.span_candidates import span_candidates, span_candidates_reference
from tests.conftest import TRITON_DEVICE
from tests.test_ltri_spans import _maps

# Under Triton's interpreter a lane that reads outside its tensor reads whatever lies there, and arithmetic on it
# warns (inf - inf, NaN); on a GPU the same read can fault. The warnings are errors here, so such a read fails.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

CASES = [pytest.param(m, n, kind, id=f"m{m}-n{n}-{kind}")
         for m, n, kind in [(1, 1, "ties"), (3, 2, "softmax"), (8, 63, "softmax"), (4, 128, "softmax"),
                            (6, 128, "blocks"), (5, 77, "ties"), (2, 128, "ties"), (3, 20, "strided")]]


def _inputs(m, n, kind):
    if kind == "strided":  # a [m, n, n] view with padded rows, as a chunk's diagonal blocks may come
        maps = _maps(m, n + 3, 5, "softmax").float()[:, :n, :n]
    else:
        maps = _maps(m, n, 3 + n, kind).float()
    return maps, sp.quantile_threshold(maps, 0.9)


@pytest.mark.triton
@pytest.mark.parametrize("m, n, kind", CASES)
@pytest.mark.parametrize("ratio_mode", ["row", "col", "rowcol"])
def test_triton_matches_reference(m, n, kind, ratio_mode):
    from kernels.span_candidates.triton import span_candidates_triton

    maps, theta = _inputs(m, n, kind)
    want = span_candidates_reference(maps, theta, ratio_mode)
    got = span_candidates_triton(maps.to(TRITON_DEVICE), theta.to(TRITON_DEVICE), ratio_mode).cpu()
    assert got.shape == want.shape == (m, 2 * n - 1, 4)
    if kind == "ties" or TRITON_DEVICE == "cpu":  # exact sums (integers), or the interpreter's sequential scans
        assert torch.equal(got, want)
        return
    same = (got[..., :2] == want[..., :2]).all(dim=-1)
    assert same.float().mean() >= 0.99, f"{int((~same).sum())} of {same.numel()} midpoints chose another span"
    torch.testing.assert_close(got[same], want[same], rtol=1e-9, atol=1e-12)


@pytest.mark.triton
def test_triton_spans_match_the_reference_spans():
    """Through the NMS: the spans the engine keeps from the kernel's candidates are the reference's."""
    from kernels.span_candidates.triton import span_candidates_triton

    maps, theta = _inputs(6, 128, "blocks")
    want = sp.spans_of(span_candidates_reference(maps, theta, "row").numpy(), 0.1)
    got = sp.spans_of(span_candidates_triton(maps.to(TRITON_DEVICE), theta.to(TRITON_DEVICE), "row").cpu().numpy(), 0.1)
    assert [[(s.start, s.end) for s in spans] for spans in got] == [[(s.start, s.end) for s in spans] for spans in want]


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.span_candidates.triton import span_candidates_triton

    maps, theta = _inputs(2, 8, "softmax")
    maps, theta = maps.to(TRITON_DEVICE), theta.to(TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"expected theta of shape \[2\] float64"):
        span_candidates_triton(maps, theta.float(), "row")
    with pytest.raises(ValueError, match=r"expected maps of 1 to 128 rows, got 200"):
        span_candidates_triton(torch.zeros(1, 200, 200, device=TRITON_DEVICE), theta[:1], "row")
    with pytest.raises(ValueError, match=r"expected ratio_mode row, col or rowcol, got 'both'"):
        span_candidates_triton(maps, theta, "both")


def test_dispatch_on_cpu_is_the_reference():
    maps, theta = _inputs(2, 16, "softmax")
    assert torch.equal(span_candidates(maps, theta, "rowcol"), span_candidates_reference(maps, theta, "rowcol"))
