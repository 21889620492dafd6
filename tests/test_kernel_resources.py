"""benchmarks/kernel_resources.py: resa's decode kernels compiled for sm_90 without a GPU keep the programs an SM
their launch plans count on (skipped where Triton is not installed, as in CI, or runs as the interpreter)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs Triton, compiling (not interpreting)")


def test_decode_kernels_fit_the_programs_an_sm_their_launches_plan():
    from benchmarks.kernel_resources import decode_kernels, programs_per_sm as per_sm

    found = {row["kernel"]: row for row in decode_kernels(16, 8, 128, 131072)}
    assert set(found) == {"_fused_select_kernel", "_sparse_decode_fwd_kernel", "_lse_combine_kernel"}
    assert all(0 < row["registers"] <= 255 for row in found.values())
    # The sparse kernel's splits are planned for _PROGRAMS_PER_SM programs an SM; the one-launch selection asks for
    # _FUSED_PROGRAMS_PER_SM, and its row's programs must all be resident to meet.
    from kernels.block_select.triton import _FUSED_PROGRAMS_PER_SM
    from kernels.sparse_decode_attention.triton import _PROGRAMS_PER_SM

    assert per_sm(found["_sparse_decode_fwd_kernel"]) >= _PROGRAMS_PER_SM
    assert per_sm(found["_fused_select_kernel"]) >= _FUSED_PROGRAMS_PER_SM
