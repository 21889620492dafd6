"""ltri-stream: span division (triangle scores, NMS, confidence), and the engine on the embedded model."""

from __future__ import annotations

import random

import pytest
import torch

from engines.ltri import spans as sp
from kernels.farthest_point import farthest_point
from kernels.span_candidates.reference import prefix_sums, rect, triangle_scores
from tests.conftest import Owner, greedy_answer, make_engine, run_cli, story_ids


def _causal_map(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, n, generator=g) ** 3).tril()


@pytest.mark.parametrize("n", [1, 7, 33, 64])
def test_triangle_scores_equal_brute_force(n):
    a = _causal_map(n, n)
    theta = float(a[a > 0].median()) if n > 1 else 0.1
    ta = triangle_scores(a, theta)
    for j in range(n):
        for i in range(n):
            if i > j:
                assert ta[j, i] == float("-inf")
                continue
            want = sum(float(a[r, c]) - theta for r in range(i, j + 1) for c in range(i, r + 1))
            assert ta[j, i].item() == pytest.approx(want, abs=1e-9)


def _nms_brute(intervals, scores, thr):
    order = sorted(range(len(scores)), key=lambda k: -scores[k])
    kept = []
    for k in order:
        s0, e0 = intervals[k]
        ok = True
        for m in kept:
            s1, e1 = intervals[m]
            inter = max(0, min(e0, e1) - max(s0, s1) + 1)
            if inter / ((e0 - s0 + 1) + (e1 - s1 + 1) - inter) > thr:
                ok = False
                break
        if ok:
            kept.append(k)
    return kept


@pytest.mark.parametrize("n", [1, 2, 77, 128], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_quantile_threshold_equals_torch_quantile(n, q, ties):
    """The fixed-index (sync-free) quantile over the causal cells equals torch.quantile on those cells, also
    where many cells are equal (integer maps)."""
    torch.manual_seed(42)
    maps = torch.randint(0, 4, (3, n, n)).float() if ties else torch.rand(3, n, n)
    cells = maps[:, torch.ones(n, n, dtype=torch.bool).tril()].double()
    torch.testing.assert_close(sp.quantile_threshold(maps, q), torch.quantile(cells, q, dim=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("thr", [0.01, 0.1, 0.5])
def test_nms_equals_brute_force(seed, thr):
    rng = random.Random(seed)
    intervals = []
    for _ in range(rng.randint(1, 40)):
        s = rng.randint(0, 100)
        intervals.append((s, s + rng.randint(0, 30)))
    scores = [rng.random() for _ in intervals]
    got = sp.nms(torch.tensor(intervals), torch.tensor(scores, dtype=torch.float64), thr).tolist()
    assert got == _nms_brute(intervals, scores, thr)


def test_known_triangles_are_found():
    """Three triangles of mutual attention (1 inside, 0 outside) at threshold 0.5 come back exactly."""
    bounds = [(0, 19), (20, 43), (44, 63)]
    a = torch.zeros(64, 64)
    for s, e in bounds:
        a[s:e + 1, s:e + 1] = 1.0
    found = sp.divide_at(a.tril(), 0.5, 0.01, "row")
    assert sorted((x.start, x.end) for x in found) == bounds
    # A looser IoU lets slivers inside a triangle through (IoU 2/20 is not above 0.1), after the triangles.
    loose = sp.divide_at(a.tril(), 0.5, 0.1, "row")
    assert sorted((x.start, x.end) for x in loose[:3]) == bounds and len(loose) == 5
    # Spans that share nothing with their row neighbours are fully confident; the best span comes first.
    assert all(x.confidence == pytest.approx(1.0) for x in found)
    assert (found[0].start, found[0].end) == (20, 43)


def test_confidence():
    a = torch.ones(8, 8).tril()  # uniform: span [4, 7] shares its queries with keys 0..3
    span = sp.divide_at(a, 2.0, 0.1, "row")[0]  # threshold above every cell: the whole map as one span
    assert (span.start, span.end, span.confidence) == (0, 7, 1.0)
    # Midpoint 11's best span at threshold 0.5 is [4, 7]: triangle 10 cells, rows 4..7 x keys 0..3 = 16.
    row = sp.candidates(a[None], torch.tensor([0.5]), "row")[0, 11].tolist()
    assert row == pytest.approx([4, 7, 5.0, 10 / 26])
    assert sp.candidates(a[None], torch.tensor([0.5]), "col")[0, 11, 3].item() == 1.0  # no later queries
    assert sp.span_count(40, 1.0, 3.0) == 40 and sp.span_count(40, 0.5, 3.0) == 5 and sp.span_count(40, 0.1, 3.0) == 0


def test_rect_sums_equal_brute_force():
    a = _causal_map(12, 3).double()
    p = prefix_sums(a)[None]
    g = torch.Generator().manual_seed(0)
    r0, c0 = torch.randint(0, 12, (2, 1, 40), generator=g)
    r1 = r0 + torch.randint(-1, 5, (1, 40), generator=g)  # -1: an empty range
    c1 = c0 + torch.randint(-1, 5, (1, 40), generator=g)
    r1, c1 = r1.clamp(max=11), c1.clamp(max=11)
    got = rect(p, r0, r1, c0, c1)[0]
    want = [a[r0[0, k]:r1[0, k] + 1, c0[0, k]:c1[0, k] + 1].sum().item() for k in range(40)]
    assert got.tolist() == pytest.approx(want, abs=1e-12)


def test_allocation_serves_spans_best_first_within_the_block_bounds():
    votes = torch.arange(32, dtype=torch.float32)  # later tokens got more attention
    best, second = sp.Span(0, 9, 5.0, 0.8), sp.Span(20, 31, 3.0, 1.0)  # 10 * 0.512 -> 5; 12 * 1 -> 12
    assert sp.allocate([best, second], votes, 3.0, 4, 100) == [5, 6, 7, 8, 9, *range(20, 32)]
    assert sp.allocate([best, second], votes, 3.0, 4, 8) == [5, 6, 7, 8, 9, 29, 30, 31]  # capped at 8
    quiet = sp.Span(0, 31, 1.0, 0.01)  # Eq. 7 gives none: topped up with the most-voted tokens
    assert sp.allocate([quiet], votes, 3.0, 4, 12) == [28, 29, 30, 31]


def test_slot_ranges_follow_the_allocation_bounds():
    best, second = sp.Span(0, 9, 5.0, 0.8), sp.Span(20, 31, 3.0, 1.0)  # Eq. 7: 5 and 12 vectors
    # A span's first vector from inside it, its others from the whole block.
    assert sp.slot_ranges([best, second], 3.0, 4, 100, 32) == [(0, 9)] + [(0, 31)] * 4 + [(20, 31)] + [(0, 31)] * 11
    assert sp.slot_ranges([best, second], 3.0, 4, 8, 32) == [(0, 9)] + [(0, 31)] * 4 + [(20, 31)] + [(0, 31)] * 2
    assert sp.slot_ranges([sp.Span(0, 31, 1.0, 0.01)], 3.0, 4, 12, 32) == [(0, 31)] * 4  # topped up


def test_cover_keeps_the_key_a_question_matches_where_votes_do_not():
    """A block whose most-attended tokens are near copies of one key (a UUID's characters, say) and one odd key
    that a query matches: the most-voted picks miss it, farthest-point sampling takes it."""
    g = torch.Generator().manual_seed(0)
    common = torch.randn(8, generator=g)
    keys = common + 0.05 * torch.randn(32, 8, generator=g)
    keys[17] = -3 * common  # the odd one
    votes = torch.linspace(1, 2, 32)
    votes[17] = 0.0
    by_votes = sp.allocate([sp.Span(0, 31, 1.0, 1.0)], votes, 3.0, 4, 4)
    by_cover = farthest_point(keys[None], votes[None], torch.tensor([[(0, 31)] * 4]))[0].tolist()
    assert 17 not in by_votes and 17 in by_cover
    query = -common
    assert (keys[by_cover] @ query).max() == (keys @ query).max()


def test_lambda_calibration_picks_the_smallest_that_compresses_enough():
    lengths = torch.tensor([32.0, 16.0, 64.0, 8.0] * 10)
    conf = torch.tensor([0.9, 0.5, 0.7, 0.95] * 10)
    grid = torch.linspace(0.5, 40.0, 80, dtype=torch.float64)
    lam = sp.calibrate_lambda(lengths, conf, 8.0, grid)

    def ratio(value):
        n = [min(int(l), round(l * c ** value)) for l, c in zip(lengths.tolist(), conf.tolist())]
        return lengths.sum().item() / max(1, sum(n))

    assert ratio(lam) >= 8.0
    smaller = grid[grid < lam]
    assert smaller.numel() == 0 or ratio(float(smaller[-1])) < 8.0


def test_voting_adds_earlier_retrieval_head_layers():
    from types import SimpleNamespace

    from engines.ltri import LtriConfig
    from engines.ltri.index import Indexer

    indexer = Indexer(LtriConfig(), SimpleNamespace(num_attention_heads=4), {5: (1, 0.9), 11: (2, 0.5)})
    cache = SimpleNamespace(chunk_votes={}, first_reading=None)
    first = indexer._vote(5, torch.tensor([0.0, 2.0, 4.0]), cache)  # own scores, min-max normalised
    assert first.tolist() == pytest.approx([0.0, 0.45, 0.9]) and len(cache.chunk_votes) == 1
    # A layer without a retrieval head weighs itself 0.1 and adds the earlier layer's vote, but casts none.
    plain = indexer._vote(8, torch.tensor([4.0, 0.0, float("-inf")]), cache)
    assert plain.tolist() == pytest.approx([0.1, 0.45, 0.9]) and len(cache.chunk_votes) == 1
    assert indexer.head_weights(11, torch.device("cpu")).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert indexer.head_weights(8, torch.device("cpu")).tolist() == [0.25] * 4


def test_second_question_reading_counts_every_retrieval_head_layer_of_the_first():
    """question_votes: all. While the question is read again, a layer adds the first reading's votes of every
    retrieval-head layer of the same chunk (later layers included, its own left out), not this reading's."""
    from types import SimpleNamespace

    from engines.ltri import LtriConfig
    from engines.ltri.index import Indexer

    indexer = Indexer(LtriConfig(question_votes="all"), SimpleNamespace(num_attention_heads=4),
                      {5: (1, 0.9), 11: (2, 0.5)})
    first = [{5: (0.9, torch.tensor([1.0, 0.0, 0.0])), 11: (0.5, torch.tensor([0.0, 0.0, 1.0]))}]
    cache = SimpleNamespace(chunk_votes={}, first_reading=first, question_chunks=[{}])
    lower = indexer._vote(5, torch.tensor([0.0, 2.0, 4.0]), cache)
    assert lower.tolist() == pytest.approx([0.0, 0.45, 0.9 + 0.5])  # its own now, and layer 11's first vote
    plain = indexer._vote(8, torch.tensor([4.0, 0.0, 2.0]), cache)  # not layer 5's second vote: its first
    assert plain.tolist() == pytest.approx([0.1 + 0.9, 0.0, 0.05 + 0.5])
    assert set(cache.chunk_votes) == {5}


def test_block_scores_report_where_each_block_matched():
    from engines.ltri.memory import IndexMemory

    index = IndexMemory(1, 2, torch.float32, torch.device("cpu"), limit=64)
    vectors = torch.tensor([[1.0, 0.0], [0.0, 1.5], [2.0, 0.0], [0.0, 3.0]])[:, None]  # [4, Hkv=1, 2]
    index.add(vectors, torch.tensor([0, 0, 1, 2]), torch.tensor([5, 30, 7, 0]))
    scores, where = index.block_scores(torch.tensor([[[0.0, 1.0]], [[1.0, 0.0]]]), 4)
    assert scores.tolist() == [1.5, 2.0, 3.0, float("-inf")]
    assert where.tolist() == [30, 7, 0, -1]  # block 0: its second vector (offset 30) scored it


def test_a_block_matched_in_its_tail_brings_its_successor():
    from kernels.slot_plan.reference import choose_blocks

    scores = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.7])
    where = torch.tensor([0, 100, 0, 10, 0, 127])  # block 1 matched at 100 (tail: >= 96), block 3 at 10

    def wanted(scores, where, k, tail=32):
        top = scores.topk(k).indices
        chosen, successors = choose_blocks(top.tolist(), where[top].tolist(), scores.numel(), 128, tail)
        return sorted(chosen), successors

    assert wanted(scores, where, 3) == ([1, 2, 3], 1)  # 2 displaces block 5
    assert wanted(scores, where, 2) == ([1, 2], 1)
    assert wanted(scores, where, 1) == ([1], 0)  # k reached: no room for the successor
    # The last stored block has no successor in memory (the next one is still in the window).
    assert wanted(torch.tensor([0.0, 1.0]), torch.tensor([0, 120]), 2) == ([0, 1], 0)
    assert wanted(scores, where, 3, tail=0) == ([1, 3, 5], 0)


def test_flush_outside_inference_mode_indexes_blocks_made_inside_it():
    """prefill's last flush runs outside inference mode on buffers made inside it (a 128K bench hit this)."""
    from types import SimpleNamespace

    from engines.ltri import LtriConfig
    from engines.ltri.cache import LtriLayer
    from engines.ltri.index import Indexer

    owner = Owner(decoding=False, offset=0, filled=0, capacity=4096, memory_blocks=None, positions=None)
    layer = LtriLayer(owner, n_init=4, n_retrieved=8, n_local=8, block=4, room=8, window=None, retrieve=True)
    with torch.inference_mode():
        layer.lazy_initialization(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
        keys, votes = torch.randn(2, 8, 3), torch.rand(8)
    config = LtriConfig(block_size=4, n_init=4, n_local=8, min_vectors=2, max_vectors=3, successor_tail=0)
    indexer = Indexer(config, SimpleNamespace(num_attention_heads=2))
    cache = SimpleNamespace(span_queue=[], dividing=[], pick_queue=[(layer, 0, 0, keys, votes)], lams={},
                            stats={"blocks_indexed": 0, "spans": 0})
    indexer.flush(cache)
    assert layer.index.block.used.tolist() == [0, 0, 0, 1, 1, 1] and cache.stats["blocks_indexed"] == 2
    assert not cache.pick_queue


def test_flush_divides_a_chunk_late_unless_a_pick_needs_the_spans():
    """A chunk's block maps are divided at the next flush (their candidates travel meanwhile), so a flush never waits
    for the chunk just issued; a pick of a block whose division was only just sent (a chunk longer than the window)
    divides it at once, and gets its spans' slots, not the undivided block's."""
    from types import SimpleNamespace

    import numpy as np

    from engines.ltri import LtriConfig
    from engines.ltri.cache import LtriLayer
    from engines.ltri.index import Indexer

    owner = Owner(decoding=False, offset=0, filled=0, capacity=4096, memory_blocks=None, positions=None)
    b = 16
    layer = LtriLayer(owner, n_init=4, n_retrieved=2 * b, n_local=2 * b, block=b, room=8, window=None, retrieve=True)
    layer.lazy_initialization(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    config = LtriConfig(block_size=b, n_init=b, n_local=2 * b, min_vectors=1, max_vectors=b, lam=20.0,
                        successor_tail=0)
    indexer = Indexer(config, SimpleNamespace(num_attention_heads=2))
    g = torch.Generator().manual_seed(42)
    # Two blocks of one chunk: causal attention maps (rows sum to 1).
    maps = torch.softmax(torch.randn(2, b, b, generator=g) * 3 + torch.full((b, b), float("-inf")).triu(1), -1)
    spans = [np.array([[s.start, s.end, s.score, s.confidence] for s in found])
             for found in sp.divide_many(maps, config.threshold, config.iou, config.ratio_mode)]
    cache = SimpleNamespace(span_queue=[(layer, 5, 0, maps)], dividing=[], pick_queue=[], lams={},
                            stats={"blocks_indexed": 0, "spans": 0})
    indexer.flush(cache)  # the next chunk's start: blocks 0 and 1 are sent, not divided
    assert len(cache.dividing) == 1 and not layer.pending and cache.stats["spans"] == 0
    indexer.flush(cache)  # a chunk later: divided
    assert not cache.dividing and sorted(layer.pending) == [0, 1]
    for got, want in zip((layer.pending[0], layer.pending[1]), spans):
        np.testing.assert_array_equal(got, want)
    # Blocks 2 and 3 queued in the chunk that also evicts block 2.
    want, undivided = (sp.slot_table(x[None], np.array([len(x)]), 20.0, 1, b, b)[1][0]
                       for x in (spans[0], sp.whole_block(b)))
    assert want != undivided  # block 2's slots tell whether its spans were used
    cache.span_queue.append((layer, 5, 2, maps))
    cache.pick_queue.append((layer, 5, 2, torch.randn(2, b, 8, generator=g), torch.rand(b, generator=g)))
    indexer.flush(cache)
    assert not cache.dividing and not cache.pick_queue and sorted(layer.pending) == [0, 1, 3]
    assert layer.index.n == want and cache.stats["spans"] == 2 * sum(map(len, spans))


def test_retrieval_slots_keep_blocks_already_loaded():
    from types import SimpleNamespace

    from engines.ltri.cache import LtriLayer

    owner = Owner(decoding=False, offset=0, filled=0, capacity=4096, memory_blocks=None, positions=None)
    layer = LtriLayer(owner, n_init=4, n_retrieved=3 * 4, n_local=8, block=4, room=8, window=None, retrieve=True)
    layer.lazy_initialization(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    for b in range(5):  # five evicted blocks, block b filled with the value b
        layer.memory.add(torch.full((2, 4, 3), float(b)), torch.full((2, 4, 3), -float(b)))
    assert layer.memory.block_bytes == 2 * 2 * 4 * 3 * 4  # K and V, 2 heads x 4 tokens x 3 dims, fp32
    layer.load_blocks(torch.tensor([0, 2, 4]), None, 5, 0)
    assert layer.tally.tolist() == [0, 3] and layer.n_held == 3
    layer.load_blocks(torch.tensor([2, 1]), None, 5, 0)
    assert layer.tally.tolist() == [0, 4] and layer.n_held == 2  # 2 stays where it is, 1 takes a freed slot
    assert sorted(b for b in layer.slots if b >= 0) == [1, 2]
    for s, b in enumerate(layer.slots):
        rows = slice(4 + 4 * s, 8 + 4 * s)
        if b < 0:
            assert (layer.key_pos[rows] == -1).all()
        else:
            assert (layer.keys[0, :, rows] == b).all() and (layer.values[0, :, rows] == -b).all()
            assert layer.key_pos[rows].tolist() == list(range(4 + 4 * b, 8 + 4 * b))



SMALL = dict(n_init=64, block_size=64, top_k=4, n_local=256, chunk_size=128)  # device budget 704 tokens


@pytest.mark.parametrize("context_memory, question_votes", [
    pytest.param("model", "earlier", id="model-dtype"),
    pytest.param("fp8", "all", id="fp8-question-read-twice", marks=pytest.mark.long)])
def test_needle_in_a_document_four_times_the_budget(lm, monkeypatch, context_memory, question_votes):
    """2.8K tokens through 704 device rows per layer: the needle is answered from retrieved blocks, the
    device never holds more than the budget, and every evicted token is in CPU memory (also in fp8).
    question_votes: all reads the question twice, the second time from the state the document left (the first
    reading's evictions, slots and votes undone): it retrieves what one reading of the same state does when
    given the first reading's votes."""
    from engines.ltri.engine import LtriEngine
    from longctx_cli.tasks import generate, prompt_tail

    tok = lm.tokenizer
    sample = generate("niah_single_2", 2920, 1, tok, seed=1, depths=[0.6], budget=32)[0]
    doc = torch.tensor([tok.bos_token_id] + tok(sample.document, add_special_tokens=False)["input_ids"])
    tail = prompt_tail(sample.question, sample.answer_prefix)
    question = torch.tensor(tok(tail, add_special_tokens=False)["input_ids"])
    budget = SMALL["n_init"] + SMALL["top_k"] * SMALL["block_size"] + SMALL["n_local"] + SMALL["chunk_size"]
    assert doc.numel() >= 4 * budget
    readings = []  # (the state before the reading, its votes, the slots after it)
    read = LtriEngine._read_question

    def recorded(self, state, *args):
        before = self.checkpoint(state)
        logits = read(self, state, *args)
        readings.append((before, state.cache.question_chunks,
                         [list(layer.slots) for layer in state.cache.layers if layer.retrieve]))
        return logits

    monkeypatch.setattr(LtriEngine, "_read_question", recorded)
    engine = make_engine(lm, "ltri-stream", context_memory=context_memory, question_votes=question_votes, **SMALL)
    answer, state = greedy_answer(engine, doc, question, 12)
    assert sample.expected[0] in tok.decode(answer)
    twice = question_votes == "all"
    assert len(readings) == 1 + twice and engine.counters(state)["ltri_question_readings"] == 1 + twice
    counters = engine.counters(state)
    assert counters["ltri_peak_valid_rows"] <= budget
    assert counters["ltri_blocks_retrieved_per_chunk"] > 0
    lo, hi = engine.config.min_vectors, engine.config.max_vectors
    for layer in state.cache.layers:  # min_vectors to max_vectors index vectors per evicted block
        if layer.retrieve:
            held = layer.index.block.used
            per_block = torch.bincount(held[held >= 0], minlength=layer.memory.n_blocks)  # -1: no vector
            assert int(per_block.min()) >= min(lo, SMALL["block_size"]) and int(per_block.max()) <= hi
    for layer in state.cache.layers:
        if layer.retrieve:
            assert SMALL["n_init"] + layer.memory.n_blocks * SMALL["block_size"] + layer.local_len == \
                doc.numel() + question.numel()
            assert layer.keys.shape[2] == layer.rows  # the device buffers never grew
        else:
            assert layer.local_len <= layer.window
    if twice:
        (before, votes, _), (_, _, slots) = readings
        assert votes and all(votes)  # the first reading voted in every chunk of the question
        engine.restore(state, before)
        state.cache.first_reading = votes
        try:
            read(engine, state, question, 12)
        finally:
            state.cache.first_reading = None
        assert [list(layer.slots) for layer in state.cache.layers if layer.retrieve] == slots


@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype", "fp8"])
def test_context_memory_round_trip(fp8):
    """Blocks come back exactly in the model's dtype; in fp8 within e4m3's precision of each (block, head)'s
    largest value, and at half the bytes."""
    from engines.ltri.memory import ContextMemory

    torch.manual_seed(42)
    keys = torch.randn(2, 3 * 16, 8) * torch.tensor([1.0, 30.0])[:, None, None]  # heads of different scales
    values = torch.randn(2, 3 * 16, 8)
    mem = ContextMemory(2, 16, 8, torch.float32, False, 1, fp8)
    sent = mem.add(keys, values)
    assert mem.n_blocks == 3 and sent == 3 * (2 * keys.numel() // 3 * (1 if fp8 else 4) + (16 if fp8 else 0))
    k, v = torch.empty(2, 16, 8), torch.empty(2, 16, 8)
    moved = mem.load(1, k, v)
    want_k, want_v = keys[:, 16:32], values[:, 16:32]
    if not fp8:
        assert torch.equal(k, want_k) and torch.equal(v, want_v) and moved == 2 * k.nbytes
        return
    for got, want in ((k, want_k), (v, want_v)):
        amax = want.abs().amax(dim=(1, 2), keepdim=True)
        assert ((got - want).abs() <= amax / 16).all()  # 3 mantissa bits: half a step is 1/16 relative
    assert moved == 2 * k.numel() + 2 * 2 * 4  # one byte per element plus the K and V scales per head


def test_retrieval_heads_found_on_the_embedded_model(lm):
    from engines.ltri.heads import best_heads, score_heads

    scores = score_heads(lm.model, lm.tokenizer, [5, 11, 17], samples=2, n_sentences=60)
    heads = best_heads(scores)
    assert heads and all(0.1 < s <= 1.0 for _, s in heads.values())
    assert lm.model.config._attn_implementation != "eager"  # switched back


def test_the_embedded_models_heads_ship_with_the_package(lm):
    """Found without scoring: the package's file for this model as the tests load it (float32, this transformers);
    a new transformers version changes the key, and this test says to score the heads again."""
    from engines.ltri.heads import SHIPPED, heads_key

    assert (SHIPPED / f"{heads_key(lm.model, lm.name)}.json").exists()


@pytest.mark.long
def test_shipped_heads_are_what_scoring_finds(lm):
    from tests.conftest import shipped_heads_match_scoring

    shipped_heads_match_scoring(lm)


def test_static_index_mode_runs(lm):
    doc, question = story_ids(lm, "The lamp burned all night. " * 40, 1200)
    engine = make_engine(lm, "ltri-stream", index="static", repr_topk=2, retrieval_heads="none", **SMALL)
    _, state = greedy_answer(engine, doc, question, 2)
    counters = engine.counters(state)
    assert counters["ltri_index_vectors"] == 2 * counters["ltri_cpu_blocks"] * 3  # 3 full layers


@pytest.mark.parametrize("setting, message", [
    ("n_local=100", "bad value for n_local: 100; expected a multiple of block_size (128)"),
    ("ratio_mode=diagonal", "bad value for ratio_mode: 'diagonal'"),
    ("threshold=1.5", "bad value for threshold: 1.5"),
    ("pick=random", "bad value for pick: 'random'; expected votes or cover"),
    ("successor_tail=200", "bad value for successor_tail: 200; expected 0 to block_size (128)"),
    ("compensate=moment", "bad value for compensate: 'moment'; expected none or exact"),
])
def test_bad_settings_are_one_line(setting, message, capsys, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    code, out, err = run_cli(["ask", str(doc), "Why?", "--profile", "ltri-stream", "--set", setting],
                             capsys, monkeypatch)
    assert code == 4 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_chunk_size_must_be_whole_blocks(capsys, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. " * 20)
    code, _, err = run_cli(["ask", str(doc), "Why?", "--profile", "ltri-stream", "--chunk-size", "100"],
                           capsys, monkeypatch)
    assert code == 4 and "chunk_size 100 is not a multiple of block_size 128" in err


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [
    {},
    {"compensate": "exact"},
    # ltri-stream-4k's settings: every layer compensated, the question's chunk too, the question read twice.
    {"compensate": "exact", "compensate_question": True, "question_votes": "all"},
    {"positions": "cache"},
    {"decode_summaries": True},
], ids=["document-positions", "compensate-exact", "compensate-question-read-twice", "positions-reassigned",
        "decode-summaries"])
def test_gpu_graph_decode_equals_cpu_reference(extra):
    """The captured decode graph answers as the CPU reference does, also where every step reads keys rotated to
    re-assigned positions (the rotated-keys buffer, and the one row each step writes)."""
    from longctx_cli.models import load_model

    gpu_lm = load_model(None, device="cuda", dtype="float32")
    cpu_lm = load_model(None, device="cpu", dtype="float32")
    doc, question = story_ids(cpu_lm, "The keeper counted the ships in the bay. " * 30, 1500)
    settings = {**SMALL, **extra}
    want, _ = greedy_answer(make_engine(cpu_lm, "ltri-stream", **settings), doc, question, 12)
    engine = make_engine(gpu_lm, "ltri-stream", **settings)
    got, state = greedy_answer(engine, doc, question, 12)
    assert engine.counters(state)["decode_cuda_graph"] is True
    assert got == want


@pytest.mark.parametrize("context_memory, advice", [("model", "--set context_memory=fp8"), ("fp8", "a shorter")])
def test_context_memory_larger_than_the_host_is_refused(context_memory, advice, capsys, monkeypatch, tmp_path):
    """Context memory is sized for the whole document up front: a host without room refuses with numbers."""
    import engines.ltri.engine as ltri_engine

    class Tiny:
        available = 1 << 10  # 1 KiB

    monkeypatch.setattr(ltri_engine.psutil, "virtual_memory", lambda: Tiny)
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. " * 20)
    for command in (["ask", str(doc), "Why?"], ["bench", "--lengths", "512", "--compare", "none"]):
        code, out, err = run_cli([*command, "--profile", "ltri-stream", "--set", f"context_memory={context_memory}"],
                                 capsys, monkeypatch)
        assert code == 4 and out == "", err
        line = err.strip().splitlines()[-1]
        assert "GiB of CPU context memory" in line and "0.0 GiB available" in line and advice in line
    cfg = ltri_engine.LtriConfig(context_memory=context_memory)
    from longctx_cli.models import load_config
    config = load_config("random:llama-3.1-8b")
    # 1M tokens of the 8B shape: 128 GiB in bf16, half that (plus scales) in fp8.
    got = ltri_engine.context_memory_bytes(config, cfg, 1 << 20, 2) / 2**30
    assert (got == pytest.approx(128.0, rel=1e-3)) if context_memory == "model" else (64.0 < got < 64.1)


def _answer_with_layer5_compensated(lm, story_text, monkeypatch, attention, question: bool) -> None:
    """Two answer tokens on the story with compensate: exact in layer 5, every retrieving layer's prefill
    attention going through `attention` (same signature as softmax_attention)."""
    import engines.ltri.attention as ltri_attention

    monkeypatch.setattr(ltri_attention, "softmax_attention", attention)
    doc, ask = story_ids(lm, story_text, 1500)
    engine = make_engine(lm, "ltri-stream", **SMALL, compensate="exact", compensate_layers=[5],
                         compensate_question=question)
    greedy_answer(engine, doc, ask, 2)


@pytest.mark.parametrize("question", [False, True], ids=["question-exempt", "question-compensated"])
def test_compensation_applies_only_to_the_listed_layers(lm, story_text, monkeypatch, question):
    """compensate_layers=[5]: every attention of layers 11 and 17 equals the uncompensated one on the same
    inputs, while layer 5's differs once blocks are stored; the question's chunk of layer 5 is compensated only
    with compensate_question."""
    import engines.ltri.attention as ltri_attention

    plain = ltri_attention.softmax_attention
    diffs: dict[tuple[int, bool], float] = {}

    def checked(layer, query, key, value, scaling, offset, n_own, exact=False):
        votes = layer.votes.clone()
        want, _ = plain(layer, query, key, value, scaling, offset, n_own, False)
        layer.votes.copy_(votes)
        out, own = plain(layer, query, key, value, scaling, offset, n_own, exact)
        at = (layer.owner.layers.index(layer), layer.owner.question)
        diffs[at] = max(diffs.get(at, 0.0), float((out - want).abs().max()))
        return out, own

    _answer_with_layer5_compensated(lm, story_text, monkeypatch, checked, question)
    assert {i for i, _ in diffs} == {5, 11, 17}  # the embedded model's retrieving layers
    assert diffs[11, False] == diffs[17, False] == diffs[11, True] == diffs[17, True] == 0.0
    assert diffs[5, False] > 1e-4
    assert (diffs[5, True] > 1e-4) if question else diffs[5, True] == 0.0


def test_compensated_attention_is_softmax_over_rows_and_left_out_blocks(lm, story_text, monkeypatch):
    """compensate: exact: a chunk's output equals one softmax over the rows it may see and every stored block
    its slots do not hold (loaded one by one here), while votes and the own map stay the rows' alone."""
    import torch.nn.functional as F

    import engines.ltri.attention as ltri_attention

    plain = ltri_attention.softmax_attention
    errors: list[float] = []

    def checked(layer, query, key, value, scaling, offset, n_own, exact=False):
        votes = layer.votes.clone()
        _, own_rows = plain(layer, query, key, value, scaling, offset, n_own, False)
        rows_votes = layer.votes - votes
        layer.votes.copy_(votes)
        out, own = plain(layer, query, key, value, scaling, offset, n_own, exact)
        if exact and layer.memory.n_blocks:
            assert torch.equal(own, own_rows) and torch.equal(layer.votes - votes, rows_votes)
            width, block, T = layer.width, layer.block, query.shape[2]
            held = {b for b in layer.slots if b >= 0}
            left = [b for b in range(layer.memory.n_blocks) if b not in held]
            k_st = torch.empty(key.shape[1], len(left) * block, key.shape[3], dtype=key.dtype)
            v_st = torch.empty_like(k_st)
            for j, b in enumerate(left):
                layer.memory.load(b, k_st[:, j * block:(j + 1) * block], v_st[:, j * block:(j + 1) * block])
            kp = layer.key_pos[:width]
            seen = (kp >= 0) & (kp <= torch.arange(offset, offset + T)[:, None])
            mask = torch.cat([torch.ones(T, k_st.shape[1], dtype=torch.bool), seen], dim=1)
            keys = torch.cat([k_st[None], key[:, :, :width]], dim=2).nan_to_num(0.0)
            values = torch.cat([v_st[None], value[:, :, :width]], dim=2).nan_to_num(0.0)
            want = F.scaled_dot_product_attention(query.double(), keys.double(), values.double(), attn_mask=mask,
                                                  scale=scaling, enable_gqa=True)
            errors.append(float((out.double() - want).abs().max()))
        return out, own

    _answer_with_layer5_compensated(lm, story_text, monkeypatch, checked, True)
    assert len(errors) >= 10 and max(errors) < 1e-4, errors


def test_compensate_layers_first_is_the_first_retrieving_layer(lm):
    """compensate_layers: first resolves to the model's first retrieving layer (5 in the embedded model); an
    unresolved config refuses to answer per layer."""
    from engines.ltri.engine import LtriConfig

    engine = make_engine(lm, "ltri-stream", compensate="exact", compensate_layers="first")
    assert engine.config.compensate_layers == [5] and engine.indexer.cfg.compensate_layers == [5]
    with pytest.raises(ValueError, match="resolved by for_layers"):
        LtriConfig(compensate="exact", compensate_layers="first").compensates(5)


@pytest.mark.parametrize("setting, message", [
    ("compensate_layers=last", "bad value for compensate_layers: 'last'"),
    ("compensate_layers=[5, -1]", "bad value for compensate_layers: [5, -1]"),
    ("compensate_layers=[4]", "bad value for compensate_layers: [4]; expected retrieving"),
])
def test_compensate_layers_must_name_retrieving_layers(setting, message, capsys, monkeypatch, tmp_path):
    """A bad layer list is a configuration error (exit 4) in ask and bench alike, whether the profile or the
    model (layer 4 is a sliding-window layer of the embedded model) refuses it."""
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    for command in (["ask", str(doc), "Why?"], ["bench", "--lengths", "512", "--compare", "none"]):
        code, out, err = run_cli([*command, "--profile", "ltri-stream", "--set", setting], capsys, monkeypatch)
        assert code == 4 and out == "", err
        assert message in err.strip().splitlines()[-1]


def test_exact_compensation_equals_attention_over_every_stored_key(monkeypatch):
    """compensate: exact: the rows' softmax merged with the stored blocks they leave out (loaded from context
    memory two blocks, the slot count, at a time) equals one causal softmax over the init tokens, every stored
    block and the window; with the queries in two slices, each block is still loaded once."""
    from types import SimpleNamespace

    from engines import explicit
    from engines.ltri.cache import LtriLayer
    from engines.ltri.attention import softmax_attention

    monkeypatch.setattr(explicit, "QUERY_SLICE", 2)  # the 3 queries in slices of 2 and 1

    torch.manual_seed(42)
    hkv, g, d, block, t = 2, 2, 8, 4, 3
    owner = Owner(decoding=False, offset=0, filled=0, capacity=4096, memory_blocks=None, positions=None,
                  stats={"host_to_device_bytes": 0})
    layer = LtriLayer(owner, n_init=4, n_retrieved=2 * block, n_local=8, block=block, room=8, window=None,
                      retrieve=True)
    layer.lazy_initialization(torch.zeros(1, hkv, 1, d), torch.zeros(1, hkv, 1, d))
    n = 4 + 5 * block + 6  # init, 5 stored blocks, 6 window tokens
    keys, values = torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    layer._write(0, keys[None, :, :4], values[None, :, :4], 0)
    layer.memory.add(keys[:, 4:24], values[:, 4:24])
    layer.local_start, layer.local_len = 24, 6
    layer._write(layer.local0, keys[None, :, 24:], values[None, :, 24:], 24)
    layer.load_blocks(torch.tensor([1, 3]), None, 5, 0)  # blocks 0, 2 and 4 left out: two batches
    query = torch.randn(1, hkv * g, t, d)  # the window's last t tokens
    out, _ = softmax_attention(layer, query, layer.keys, layer.values, 0.5, n - t, t, exact=True)
    s = torch.einsum("hgtd,hnd->hgtn", query[0].view(hkv, g, t, d), keys) * 0.5
    s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None], float("-inf"))
    want = torch.softmax(s, dim=-1) @ values[:, None]
    torch.testing.assert_close(out[0].view(hkv, g, t, d), want)
    assert owner.stats["host_to_device_bytes"] == 3 * 2 * hkv * block * d * 4  # the 3 blocks' K and V, once
    rows_only, _ = softmax_attention(layer, query, layer.keys, layer.values, 0.5, n - t, t, exact=False)
    assert (rows_only - out).abs().max() > 1e-3


def test_decode_summaries_attend_each_left_out_block_as_its_mean_row_weighted_by_its_size():
    """decode_summaries: a decode step's attention is one softmax over the rows (init, retrieved blocks, window)
    and a row per stored block the slots do not hold, its mean key with log(block_size) added to the logit and
    its mean value; the blocks the slots hold get no summary row."""
    from types import SimpleNamespace

    from engines.ltri.attention import decode_rows
    from engines.ltri.cache import LtriLayer

    torch.manual_seed(42)
    hkv, g, d, block = 2, 2, 8, 4
    owner = Owner(decoding=False, offset=0, filled=0, capacity=4096, memory_blocks=None, positions=None,
                  stats={"host_to_device_bytes": 0})
    layer = LtriLayer(owner, n_init=4, n_retrieved=2 * block, n_local=8, block=block, room=8, window=None,
                      retrieve=True, summaries=True)
    layer.lazy_initialization(torch.zeros(1, hkv, 1, d), torch.zeros(1, hkv, 1, d))
    n = 4 + 5 * block + 6  # init, 5 stored blocks, 6 window tokens
    keys, values = torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    layer._write(0, keys[None, :, :4], values[None, :, :4], 0)
    layer.memory.add(keys[:, 4:24], values[:, 4:24])
    layer.summarize(0, keys[:, 4:24], values[:, 4:24])
    layer.local_start, layer.local_len = 24, 6
    layer._write(layer.local0, keys[None, :, 24:], values[None, :, 24:], 24)
    layer.load_blocks(torch.tensor([1, 3]), None, 5, 0)
    layer.begin_decode()
    assert layer.summary_rows() == 3  # blocks 0, 2 and 4
    query = torch.randn(1, hkv * g, 1, d)
    out = decode_rows(layer, query, layer.keys, layer.values, 0.5, None)
    held = torch.cat([torch.arange(4), torch.arange(8, 12), torch.arange(16, 20), torch.arange(24, n)])
    mean_k = keys[:, 4:24].unflatten(1, (5, block)).mean(dim=2)[:, [0, 2, 4]]
    mean_v = values[:, 4:24].unflatten(1, (5, block)).mean(dim=2)[:, [0, 2, 4]]
    k_all, v_all = torch.cat([keys[:, held], mean_k], dim=1), torch.cat([values[:, held], mean_v], dim=1)
    bias = torch.cat([torch.zeros(held.numel()), torch.full((3,), torch.log(torch.tensor(float(block))))])
    q = query[0, :, 0].view(hkv, g, d)
    p = torch.softmax(torch.einsum("hgd,hnd->hgn", q, k_all) * 0.5 + bias, dim=-1)
    want = torch.einsum("hgn,hnd->hgd", p, v_all)
    torch.testing.assert_close(out[0, 0].view(hkv, g, d), want)  # out: [B, 1, Hq, D]
    layer.summary_mask.zero_()  # no summary row: the rows alone
    rows_only = decode_rows(layer, query, layer.keys, layer.values, 0.5, None)
    assert (rows_only - out).abs().max() > 1e-3


def test_decode_summaries_are_refused_past_the_context(capsys, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document. " * 20)
    code, _, err = run_cli(["ask", str(doc), "Why?", "--profile", "ltri-stream", "--set", "decode_summaries=true",
                            "--set", "positions=cache"], capsys, monkeypatch)
    assert code == 4 and "decode_summaries" in err and "past the model's context" in err


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_context_memory_adopts_saved_blocks_and_appends_after_them(fp8):
    """A state read back hands its blocks to the context memory as they are; blocks a question adds go to the
    slabs after them, and every block loads back as stored (fp8: as quantised)."""
    from engines.ltri.memory import ContextMemory

    g = torch.Generator().manual_seed(42)
    heads, block, dim = 2, 4, 8
    blocks = torch.randn(5, 2, heads, block * 1, dim, generator=g, dtype=torch.float32).to(torch.bfloat16)
    whole = ContextMemory(heads, block, dim, torch.bfloat16, pin=False, fp8=fp8)
    for b in blocks:
        whole.add(b[0], b[1])
    saved = whole.stored()
    part = ContextMemory(heads, block, dim, torch.bfloat16, pin=False, blocks=1, fp8=fp8)
    part.adopt(*(t[:3] for t in saved))
    for b in blocks[3:]:
        part.add(b[0], b[1])
    assert part.n_blocks == whole.n_blocks == 5
    for i in range(5):
        want = [torch.empty(heads, block, dim, dtype=torch.bfloat16) for _ in range(2)]
        got = [torch.empty_like(w) for w in want]
        whole.load(i, *want)
        part.load(i, *got)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(part.stored(), saved))


@pytest.mark.parametrize("lo, hi", [(4, 12), (12, 48), (4, 100), (40, 8)], ids=["lo4-hi12", "lo12-hi48", "lo4-hi100",
                                                                                "lo40-hi8"])
def test_slot_table_is_slot_ranges_for_every_block(lo, hi):
    """The batched slot table (the stored side's, one call per chunk) gives each block `slot_ranges`' slots, in its
    order, on spans divided from random maps and on blocks never divided (the whole block); lam per block."""
    import numpy as np

    from kernels.span_candidates.reference import span_candidates_reference

    g = torch.Generator().manual_seed(42)
    n = 32
    maps = torch.softmax(torch.randn(24, n, n, generator=g) * 3 + torch.full((n, n), float("-inf")).triu(1), -1)
    spans, counts = sp.kept_spans(span_candidates_reference(maps, sp.quantile_threshold(maps, 0.9), "row").numpy(),
                                  0.1)
    spans, counts = np.concatenate([spans, sp.whole_block(n)[None].repeat(spans.shape[1], 1)]), np.append(counts, 1)
    lams = np.linspace(0.5, 20.0, len(counts))
    table, slots = sp.slot_table(spans, counts, lams, lo, hi, n)
    for row, k, lam, got, m in zip(spans, counts, lams, table, slots):
        want = sp.slot_ranges(sp.as_spans(row[:k]), float(lam), lo, hi, n)
        assert m == len(want) and [tuple(r) for r in got[:m].tolist()] == want
        assert (got[m:] == np.array([0, -1])).all()
    assert counts.min() >= 1 and counts.max() >= 4 and (slots >= min(lo, n)).all()
