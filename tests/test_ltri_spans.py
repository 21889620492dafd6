"""ltri-stream's span division and index-row choices, batched, against the one-at-a-time Python definitions
they replace: identical spans, picked rows and query index vectors on fixed random inputs (ties included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import Owner

from engines.ltri import spans as sp


def _nms_loop(intervals: np.ndarray, scores: np.ndarray, iou: float) -> list[int]:
    """Greedy NMS one candidate at a time (torchvision's rule): kept indices, best first."""
    kept, spans = [], []
    for k in np.argsort(-scores, kind="stable").tolist():
        s0, e0 = int(intervals[k, 0]), int(intervals[k, 1])
        for s1, e1 in spans:
            inter = min(e0, e1) - max(s0, s1) + 1
            if inter > 0 and inter / ((e0 - s0 + 1) + (e1 - s1 + 1) - inter) > iou:
                break
        else:
            kept.append(k)
            spans.append((s0, e0))
    return kept


def _spans_loop(cands: np.ndarray, iou: float) -> list[list[tuple]]:
    n = (cands.shape[1] + 1) // 2
    out = []
    for per_map in cands:
        per_map = per_map[per_map[:, 2] > 0]
        if per_map.shape[0] == 0:
            out.append([(0, n - 1, 0.0, 1.0)])
            continue
        keep = _nms_loop(per_map[:, :2].astype(np.int64), per_map[:, 2], iou)
        out.append([(int(per_map[k, 0]), int(per_map[k, 1]), float(per_map[k, 2]), float(per_map[k, 3]))
                    for k in keep])
    return out


def _allocate_loop(found, votes: np.ndarray, lam: float, lo: int, hi: int) -> list[int]:
    rows: list[int] = []
    for span in found:
        n = sp.span_count(span.length, span.confidence, lam)
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


def _maps(m: int, n: int, seed: int, kind: str) -> torch.Tensor:
    """[m, n, n] causal maps summed over 4 heads: softmax attention of random queries and keys (`softmax`),
    with repeated key groups (`blocks`: triangles), or small integers (`ties`: many equal scores)."""
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if kind == "ties":
        return torch.randint(0, 3, (m, n, n), generator=g).double().masked_fill(~causal, 0.0)
    q, k = torch.randn(m, 4, n, 16, generator=g), torch.randn(m, 4, n, 16, generator=g)
    if kind == "blocks":
        k = k[:, :, torch.arange(n) // 9 * 9] + 0.3 * k
        q = k + 0.5 * q
    s = (q @ k.transpose(-1, -2) / 4).masked_fill(~causal, float("-inf"))
    return torch.softmax(s, dim=-1).sum(dim=1)


CASES = [pytest.param(m, n, kind, id=f"m{m}-n{n}-{kind}")
         for m, n, kind in [(1, 1, "softmax"), (3, 2, "softmax"), (8, 63, "softmax"), (12, 128, "softmax"),
                            (6, 128, "blocks"), (5, 77, "ties"), (2, 200, "blocks")]]


@pytest.mark.parametrize("m, n, kind", CASES)
@pytest.mark.parametrize("iou", [0.01, 0.1, 0.5])
@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_spans_equal_the_one_at_a_time_nms(m, n, kind, iou, threshold):
    maps = _maps(m, n, 42 + n, kind)
    cands = sp.threshold_candidates(maps, threshold, "rowcol").numpy()
    got = [[(s.start, s.end, s.score, s.confidence) for s in spans] for spans in sp.spans_of(cands, iou)]
    assert got == _spans_loop(cands, iou)
    assert all(type(s.start) is int and type(s.score) is float for spans in sp.spans_of(cands, iou) for s in spans)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("iou", [0.01, 0.1, 0.5, 0.9])
def test_nms_equals_the_loop_with_tied_scores(seed, iou):
    rng = np.random.default_rng(seed)
    start = rng.integers(0, 100, 300)
    intervals = np.stack([start, start + rng.integers(0, 40, 300)], axis=1)
    scores = rng.integers(1, 6, 300).astype(np.float64)  # many ties: the stable order decides
    assert sp.nms(intervals, scores, iou).tolist() == _nms_loop(intervals, scores, iou)
    assert sp.nms(np.zeros((0, 2)), np.zeros(0), iou).tolist() == []


@pytest.mark.parametrize("m, n, kind", CASES)
@pytest.mark.parametrize("lam, lo, hi", [(3.0, 12, 48), (20.0, 12, 48), (0.5, 4, 12), (3.0, 200, 300)])
def test_allocated_rows_equal_the_loop(m, n, kind, lam, lo, hi):
    maps = _maps(m, n, 7 + n, kind)
    found = sp.divide_many(maps, 0.9, 0.1, "row")
    votes = maps.sum(dim=1)
    if kind == "ties":
        votes = votes.round()  # tied votes: the stable order decides
    for spans, v in zip(found, votes):
        assert sp.allocate(spans, v, lam, lo, hi) == _allocate_loop(spans, v.double().numpy(), lam, lo, hi)


def _layer(positions, fp8=False):
    from engines.ltri.cache import LtriLayer

    owner = Owner(decoding=False, offset=0, filled=0, capacity=4096, memory_blocks=None, positions=positions)
    layer = LtriLayer(owner, n_init=4, n_retrieved=5 * 4, n_local=8, block=4, room=8, window=None, retrieve=True,
                      fp8_memory=fp8)
    layer.stand_in = owner  # the layer holds its owner weakly
    layer.lazy_initialization(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    g = torch.Generator().manual_seed(0)
    for b in range(12):  # twelve evicted blocks of distinct random keys and values
        layer.memory.add(torch.randn(2, 4, 3, generator=g) + b, torch.randn(2, 4, 3, generator=g) - b)
    return layer


def _load_blocks_loop(layer, wanted):
    """load_blocks and order_slots one slot at a time: the definition the batched writes follow."""
    keep, slots = set(wanted), layer.slots
    free = [s for s, b in enumerate(slots) if b not in keep]
    missing = [b for b in wanted if b not in slots]
    for s, b in zip(free, missing):
        rows = slice(layer.n_init + s * layer.block, layer.n_init + (s + 1) * layer.block)
        layer.memory.load(b, layer.keys[0, :, rows], layer.values[0, :, rows])
        start = layer.n_init + b * layer.block
        layer.key_pos[rows] = torch.arange(start, start + layer.block)
        slots[s] = b
    for s in free[len(missing):]:
        layer.key_pos[layer.n_init + s * layer.block:layer.n_init + (s + 1) * layer.block] = -1
        slots[s] = -1
    layer.slots = slots
    rank = {b: k for k, b in enumerate(sorted(b for b in slots if b >= 0))}
    at = torch.arange(layer.local0)
    for s, b in enumerate(slots):
        if b >= 0:
            lo = layer.n_init + s * layer.block
            at[lo:lo + layer.block] = layer.n_init + rank[b] * layer.block + torch.arange(layer.block)
    layer.front_at.copy_(at)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
def test_slot_loads_and_positions_equal_the_loop(fp8):
    """Random retrievals (empty, partial, repeated, full): the same slots, rows, positions and `front_at`."""
    rng = np.random.default_rng(42)
    got, want = _layer(object(), fp8), _layer(object(), fp8)
    for step in range(40):
        wanted = sorted(rng.choice(12, size=int(rng.integers(0, 6)), replace=False).tolist())
        if step % 7 == 3:
            wanted = [b for b in got.slots if b >= 0][:2]  # blocks already held
        got.load_blocks(torch.tensor(wanted, dtype=torch.long), None, 12, 0)
        _load_blocks_loop(want, wanted)
        assert got.slots == want.slots
        for name in ("keys", "values", "key_pos", "front_at"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)


@pytest.mark.parametrize("n, lo, count, b", [(512, 0, 4, 128), (300, 44, 2, 128), (9, 1, 4, 2), (5, 0, 1, 5)])
def test_diagonal_blocks_equal_a_stack_of_slices(n, lo, count, b):
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(42))
    want = torch.stack([a[lo + k * b:lo + (k + 1) * b, lo + k * b:lo + (k + 1) * b] for k in range(count)])
    got = sp.diagonal_blocks(a, lo, count, b)
    assert torch.equal(got, want) and got.is_contiguous()


def _query_rows_loop(query, key, scaling, block, cfg, lam) -> list[int]:
    """The chunk's query index rows one map at a time: its own causal map as an explicit softmax over the chunk's
    keys, summed over heads, each block's map divided (`divide_many`) and allocated (`allocate`)."""
    _, Hq, T, D = query.shape
    hkv = key.shape[1]
    q = query[0].double().view(hkv, Hq // hkv, T, D)
    s = (q @ key[0, :, None].double().transpose(-1, -2)) * scaling
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    amap = torch.softmax(s, dim=-1).sum(dim=(0, 1)).float()
    votes = amap.sum(dim=0)
    rows = []
    for lo in range(0, T, block):
        width = min(block, T - lo)
        found = sp.divide_many(amap[None, lo:lo + width, lo:lo + width], cfg.threshold, cfg.iou, cfg.ratio_mode)[0]
        rows.extend(lo + r for r in sp.allocate(found, votes[lo:lo + width], lam, cfg.min_vectors, cfg.max_vectors))
    return rows


@pytest.mark.parametrize("T", [256, 300, 77], ids=["T256-two-blocks", "T300-with-a-short-piece", "T77-one-short"])
def test_query_vectors_are_the_rows_each_block_map_chooses(T):
    """The engine's query side (the chunk's map through vote_attention, span_rows per piece, a static count with a
    mask) chooses the rows the one-map-at-a-time definition chooses, ordered by row, each query vector weighted over
    the heads of its KV head (no retrieval heads: all alike)."""
    from types import SimpleNamespace

    from engines.ltri.config import LtriConfig
    from engines.ltri.index import Indexer

    g = torch.Generator().manual_seed(42)
    Hq, hkv, D, block, width = 4, 2, 16, 128, 1000
    cfg = LtriConfig(block_size=block, n_local=256, n_init=128)
    indexer = Indexer(cfg, SimpleNamespace(num_attention_heads=Hq))
    offset = 5000
    key = torch.randn(1, hkv, width, D, generator=g)
    key_pos = torch.cat([torch.arange(width - T), torch.arange(offset, offset + T)])
    query = torch.randn(1, Hq, T, D, generator=g)
    layer = SimpleNamespace(width=width, key_pos=key_pos, block=block)
    cache = SimpleNamespace(offset=offset, lams={})
    qw, chosen = indexer._query_vectors(layer, 7, query, key, D**-0.5, cache)
    assert qw.shape[0] == chosen.shape[0] <= T and qw.shape[1:] == (hkv, D)
    want = _query_rows_loop(query, key[:, :, width - T:], D**-0.5, block, cfg, indexer.lam(7, cache))
    rows = query[0][:, want].transpose(0, 1).float()  # [A, Hq, D]
    assert torch.equal(qw[chosen], (rows / Hq).view(len(want), hkv, Hq // hkv, D).sum(dim=2))
