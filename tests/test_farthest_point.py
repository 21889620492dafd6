"""farthest_point: farthest-point sampling of each block's keys within per-slot row ranges (ltri-stream's
`pick: cover`).

The reference is held to a one-block-at-a-time Python definition on CPU; `triton` tests hold the Triton kernel to
the reference (on CUDA, or on CPU through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

from kernels.farthest_point import farthest_point, farthest_point_reference
from tests.conftest import TRITON_DEVICE

# Under Triton's interpreter a lane that reads outside its tensor reads whatever lies there, and arithmetic on it
# warns (inf - inf, NaN); on a GPU the same read can fault. The warnings are errors here, so such a read fails.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def cover_brute(keys, votes, ranges) -> list[int]:
    """One block in plain Python: the definition the reference batches."""
    picks = []
    for lo, hi in ranges:
        free = [t for t in range(lo, hi + 1) if t not in picks]
        if not free:
            picks.append(-1)
            continue
        if not [p for p in picks if p >= 0]:
            picks.append(max(free, key=lambda t: (votes[t].item(), -t)))
            continue

        def far(t):
            return min(((keys[t] - keys[p]) ** 2).sum().item() for p in picks if p >= 0)
        picks.append(max(free, key=lambda t: (far(t), -t)))
    return picks


RANGES = [[(0, 9)] * 4 + [(20, 39)] * 6, [(5, 7)] * 5 + [(0, 39)] * 2 + [(0, -1)] * 3,
          [(0, 39)] * 3 + [(0, -1)] * 7]


def test_reference_equals_brute_force():
    g = torch.Generator().manual_seed(42)
    keys = torch.randn(3, 40, 6, generator=g)
    votes = torch.rand(3, 40, generator=g)
    got = farthest_point_reference(keys, votes, torch.tensor(RANGES))
    for i in range(3):
        assert got[i].tolist() == cover_brute(keys[i], votes[i], RANGES[i])
    assert got[1, 3].item() == -1 and got[1, 4].item() == -1  # a 3-token range holds 3 picks
    assert (got[1, 5:7] >= 0).all() and (got[1, 7:] == -1).all()
    assert (got[2, 3:] == -1).all()  # padding slots stay empty


def _case(m, n, F, S, dtype, seed=42):
    """Random keys and votes, and each block's ranges as ltri-stream builds them: one slot inside each of a few
    spans, the others over the whole block, then padding."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(m, n, F, generator=g).to(dtype)
    votes = torch.rand(m, n, generator=g)
    ranges = torch.empty(m, S, 2, dtype=torch.long)
    for i in range(m):
        used = int(torch.randint(1, S + 1, (1,), generator=g))
        for s in range(S):
            if s >= used:
                ranges[i, s] = torch.tensor([0, -1])
            elif s % 3 == 0:
                a, b = sorted(torch.randint(0, n, (2,), generator=g).tolist())
                ranges[i, s] = torch.tensor([a, b])
            else:
                ranges[i, s] = torch.tensor([0, n - 1])
    return keys, votes, ranges


@pytest.mark.triton
@pytest.mark.parametrize("m,n,F,S,dtype", [
    pytest.param(3, 40, 6, 10, torch.float32, id="m3-n40-F6-S10"),
    pytest.param(5, 63, 100, 17, torch.float32, id="m5-n63-F100-S17"),
    pytest.param(4, 128, 1024, 48, torch.bfloat16, id="m4-n128-F1024-S48-llama"),
    pytest.param(2, 128, 256, 48, torch.bfloat16, id="m2-n128-F256-S48-gemma"),
])
def test_triton_matches_reference(m, n, F, S, dtype):
    from kernels.farthest_point.triton import farthest_point_triton

    if TRITON_DEVICE == "cpu" and F > 256:
        pytest.skip("model-sized case: CUDA only (the interpreter takes minutes)")
    keys, votes, ranges = _case(m, n, F, S, dtype)
    want = farthest_point_reference(keys, votes, ranges)
    got = farthest_point_triton(keys.to(TRITON_DEVICE), votes.to(TRITON_DEVICE), ranges.to(TRITON_DEVICE))
    assert torch.equal(got.cpu(), want)


@pytest.mark.triton
def test_triton_reads_strided_keys_and_the_paper_ranges():
    """Keys as ltri-stream hands them over (a permuted view), the brute-force definition's ranges."""
    from kernels.farthest_point.triton import farthest_point_triton

    g = torch.Generator().manual_seed(42)
    keys = torch.randn(40, 3, 6, generator=g).transpose(0, 1)  # [3, 40, 6], rows strided
    votes = torch.rand(3, 40, generator=g)
    got = farthest_point_triton(keys.to(TRITON_DEVICE), votes.to(TRITON_DEVICE),
                                torch.tensor(RANGES, device=TRITON_DEVICE))
    assert got.cpu().tolist() == [cover_brute(keys[i], votes[i], RANGES[i]) for i in range(3)]


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.farthest_point.triton import farthest_point_triton

    keys = torch.randn(2, 8, 4, device=TRITON_DEVICE)
    votes = torch.rand(2, 8, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"expected ranges of shape \[2, S, 2\] int64"):
        farthest_point_triton(keys, votes, torch.zeros(2, 3, 2, dtype=torch.int32, device=TRITON_DEVICE))
    with pytest.raises(ValueError, match=r"expected votes of shape \[2, 8\]"):
        farthest_point_triton(keys, votes[:, :4], torch.zeros(2, 3, 2, dtype=torch.long, device=TRITON_DEVICE))


def test_dispatch_on_cpu_is_the_reference():
    keys, votes, ranges = _case(2, 16, 4, 5, torch.float32)
    assert torch.equal(farthest_point(keys, votes, ranges), farthest_point_reference(keys, votes, ranges))
