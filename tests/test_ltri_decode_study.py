"""benchmarks/ltri_decode_study.py's attention: the rows it keeps, and its summary rows' weight."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks.ltri_decode_study import Rows, study_attention

HQ, HKV, D, N_DOC, T = 4, 2, 16, 96, 3


def _inputs(seed: int = 42):
    g = torch.Generator().manual_seed(seed)
    s = N_DOC + T
    q = torch.randn(1, HQ, T, D, generator=g)
    k = torch.randn(1, HKV, s, D, generator=g)
    v = torch.randn(1, HKV, s, D, generator=g)
    return q, k, v


def _causal(q, k, v):
    s = k.shape[2]
    mask = torch.arange(s)[None, :] <= torch.arange(s - T, s)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def _run(mode: str, q, k, v, kept=None, summary=None):
    Rows.mode, Rows.n_doc = mode, N_DOC
    Rows.kept = {0: kept if kept is not None else torch.arange(N_DOC)}
    Rows.summary = {0: summary} if summary is not None else {}
    return study_attention(SimpleNamespace(layer_idx=0), q, k, v, None, scaling=D**-0.5)[0]


def test_every_row_kept_is_causal_attention():
    q, k, v = _inputs()
    want = _causal(q, k, v)
    torch.testing.assert_close(_run("dense", q, k, v), want)
    torch.testing.assert_close(_run("rows", q, k, v), want)
    torch.testing.assert_close(_run("measure", q, k, v), want)
    assert Rows.mass[0].shape == (N_DOC,)
    # Each question query's probabilities sum to 1 over every key; the document's share is below that.
    assert 0 < float(Rows.mass[0].sum()) < HQ * T


def test_a_summary_row_stands_for_a_block_of_equal_keys_exactly():
    """A left-out block whose keys and values are all alike: its mean key and value with a log(count) bias give
    the block's exact share of the softmax (in general Jensen's lower bound of it)."""
    q, k, v = _inputs(7)
    block = slice(32, 64)
    k[:, :, block] = k[:, :, 32:33]
    v[:, :, block] = v[:, :, 32:33]
    want = _causal(q, k, v)
    kept = torch.cat([torch.arange(32), torch.arange(64, N_DOC)])
    summary = (k[:, :, 32:33], v[:, :, 32:33], torch.tensor([math.log(32)]))
    torch.testing.assert_close(_run("rows", q, k, v, kept, summary), want)
    assert not torch.allclose(_run("rows", q, k, v, kept), want, atol=1e-3)  # without it the block is missed
