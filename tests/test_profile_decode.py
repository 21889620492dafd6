"""benchmarks/profile_decode.py's reading of the one-launch selection's phase stamps (the stamps come from a GPU;
the arithmetic is checked here on made-up ones)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernels.block_select import PHASE_STAMPS

_SPEC = importlib.util.spec_from_file_location(
    "profile_decode", Path(__file__).resolve().parents[1] / "benchmarks" / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(profile_decode)


def test_selection_breakdown_reads_phases_and_barriers():
    """Two rows of two programs, stamps in ns: every barrier lets its row through at the same time (10.5, 14.5, 18.5
    µs), 2.5 µs after the programs reach it, but program (0, 1) starts 1 µs late and reaches each barrier 2 µs after
    the others, so row 0 waits 0.5 µs at each from its last arrival."""
    assert len(PHASE_STAMPS) == 9
    base = torch.tensor([0, 3000, 8000, 10500, 12000, 14500, 16000, 18500, 20000], dtype=torch.int64)
    stamps = base.repeat(2, 2, 1)
    late = torch.tensor([1000, 3000, 10000, 10500, 14000, 14500, 18000, 18500, 20000])
    stamps[0, 1] = late
    got = profile_decode.selection_breakdown(stamps)
    assert got["early"] == pytest.approx(3.0)
    assert got["total_from_dependency"] == pytest.approx(17.0)
    # Phase 1 of the late program: 7 µs, the others 5; the median of four programs (5, 7, 5, 5) is 5 in torch.
    assert got["phase1_median"] == pytest.approx(5.0) and got["phase1_slowest"] == pytest.approx(7.0)
    assert got["phase4_median"] == pytest.approx(1.5)
    # From the last arrival: 0.5 µs in row 0, 2.5 in row 1; the arrivals' spread: 2 µs and 0.
    assert got["barrier1_release"] == pytest.approx(1.5)
    assert got["barrier1_spread"] == pytest.approx(1.0)
    assert got["barrier3_spread"] == pytest.approx(1.0)
