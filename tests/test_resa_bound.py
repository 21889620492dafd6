"""benchmarks/resa_bound.py on hand-made measurements: the model's shape and the kept share set the bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("resa_bound", Path(__file__).resolve().parents[1] / "benchmarks"
                                               / "resa_bound.py")
resa_bound = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(resa_bound)

CTX, BANDWIDTH = 131072, 3e12


def _inputs():
    dense = {"context_tokens": CTX, "decode_ms_per_token": 9.0, "roofline_ms": 8.0}
    resa = {"decode_ms_per_token": 6.0, "decode_ms_median": 5.9,
            "counters": {"rectification_s": 0.1, "rectifications": 2}}
    kernels = {"ms": {"dense_attention": 0.1, "estimation": 0.02, "sparse_attention": 0.02},
               "estimation_plus_sparse_ms": 0.04}
    return dense, resa, kernels


@pytest.mark.parametrize("shape, layers", [("llama-3.1-8b", 32), ("qwen3-1.7b", 28)])
@pytest.mark.parametrize("min_blocks, kept", [(16, 0.1), (1024, 0.125)])
def test_bound_reads_the_shape_and_the_kept_share(shape, layers, min_blocks, kept):
    row = resa_bound.bound(*_inputs(), centroid=True, bandwidth=BANDWIDTH, keep=0.1, rectify_every=32, shape=shape,
                           min_blocks=min_blocks)
    k_bytes = 8 * 128 * CTX * 2
    layer_bytes = 3 * k_bytes / 16 + kept * 2 * k_bytes
    assert row["kept_share"] == pytest.approx(kept)
    assert row["resa_attention_floor_ms"] == pytest.approx(1000 * layers * layer_bytes / BANDWIDTH)
    assert row["dense_attention_ms"] == pytest.approx(layers * 0.1)
    assert row["max_speedup_shared_as_measured"] == pytest.approx(9.0 / (
        9.0 - layers * 0.1 + row["resa_attention_floor_ms"] + row["rectification_floor_ms_per_token"]))
