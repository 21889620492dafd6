"""The resa engine on the real embedded model (CPU), compared with dense."""

from __future__ import annotations

import pytest
import torch

from engines.resa.cache import ResaKVCache
from kernels import cdiv
from kernels.block_descriptors import update_block_descriptors_reference
from longctx_cli.errors import ConfigError
from longctx_cli.profiles import resolve_profile
from tests.conftest import greedy_answer, make_engine, story_ids

pytestmark = pytest.mark.slow


@pytest.mark.long
@pytest.mark.parametrize("centroid", [False, True], ids=["bound", "centroid"])
def test_keep_ratio_one_equals_dense_token_for_token(lm, story_text, centroid, monkeypatch):
    """Every block kept, through the sparse path (select, sparse kernel, rectification; the dense kernel's
    shortcut turned off): it must reproduce dense exactly. The default tier runs the sparse kernels over every
    block in test_short_document_is_exactly_dense and rectification in
    test_rectification_rewrites_exact_kv_and_descriptors."""
    monkeypatch.setattr(ResaKVCache, "dense_when_every_block_kept", False)
    doc, question = story_ids(lm, story_text, 1500)
    dense, _ = greedy_answer(make_engine(lm, "dense", chunk_size=512), doc, question, 20)
    resa, state = greedy_answer(make_engine(lm, "resa", chunk_size=512, keep_ratio=1.0, rectify_every=8,
                                            centroid=centroid), doc, question, 20)
    assert resa == dense
    counters = make_engine(lm, "resa").counters(state)
    assert counters["rectifications"] == 19 // 8 and counters["kv_fraction_read"] == 1.0


# The paper's floor (16 blocks of 16 = 256 tokens): the shipped profile's 1,024 would keep every block here.
SPARSE = {"min_blocks": 16}


@pytest.mark.parametrize("kernel", ["dense", "sparse"], ids=["dense-kernel", "sparse-kernels"])
@pytest.mark.parametrize("n, settings", [pytest.param(200, SPARSE, id="paper-floor-200"),
                                         pytest.param(1500, {}, id="shipped-floor-1500", marks=pytest.mark.long)])
def test_short_document_is_exactly_dense(lm, story_text, n, settings, kernel, monkeypatch):
    """Up to min_blocks blocks every block is kept, and the report says the decode was dense: through the dense
    decode kernel with no selection and no rectification, or (turned off) the selection and sparse kernels
    over every block with their rectifications: dense's tokens either way."""
    monkeypatch.setattr(ResaKVCache, "dense_when_every_block_kept", kernel == "dense")
    doc, question = story_ids(lm, story_text, n)
    dense, _ = greedy_answer(make_engine(lm, "dense"), doc, question, 12)
    engine = make_engine(lm, "resa", rectify_every=4, **settings)
    resa, state = greedy_answer(engine, doc, question, 12)
    assert resa == dense
    counters = engine.counters(state)
    assert counters["resa_decode"].startswith("dense: every block kept")
    assert counters["rectifications"] == (0 if kernel == "dense" else 11 // 4)
    assert (counters["estimation_s"] == 0) == (kernel == "dense")
    assert ("no selection" in counters["resa_decode"]) == (kernel == "dense")


class _EagerReplay:
    """Stands in for a captured graph on the CPU: a replay runs the step eagerly."""

    def __init__(self, step):
        self.step = step

    def replay(self) -> None:
        self.step._step()


@pytest.mark.parametrize("ahead", [{"select_ahead": False}, {"select_ahead": True, "ahead_after": 3}],
                         ids=["same-step", "select-ahead"])
def test_steps_launched_ahead_give_the_plain_loops_tokens(lm, story_text, ahead):
    """The answer loop's order with captured steps (each launched before the previous token is read, a
    rectifying step's tokens given in between), run on the CPU with the eager step standing in for each form's
    graph (the sparse step and the rectifying one; with select_ahead, the sparse step's two: the first steps' and
    the later ones'): the plain loop's tokens and rectifications, and an answer closed after 5 tokens has run 5
    steps (one more than needed)."""
    from engines.decoding import Sampler

    doc, question = story_ids(lm, story_text, 600)
    engine = make_engine(lm, "resa", rectify_every=4, **ahead, **SPARSE)
    state = engine.prefill(doc, reserve=question.numel() + 12)
    checkpoint = engine.checkpoint(state)
    plain = list(engine.answer(state, question, 12, Sampler()))
    assert engine.counters(state)["rectifications"] == 11 // 4
    engine.restore(state, checkpoint)
    step = engine._decode_step(state, Sampler())
    step.graphs = {variant: _EagerReplay(step) for variant in state.cache.decode_variants()}
    assert len(step.graphs) == (3 if ahead["select_ahead"] else 2) and "rectify" in step.graphs
    assert list(engine.answer(state, question, 12, Sampler())) == plain
    assert engine.counters(state)["rectifications"] == 11 // 4
    engine.restore(state, checkpoint)
    start = state.position
    stream = engine.answer(state, question, 12, Sampler())
    first = [next(stream) for _ in range(5)]
    stream.close()
    assert first == plain[:5] and state.position == start + question.numel() + 5


def test_bytes_a_step_are_denses_where_every_block_is_kept(lm):
    """The roofline's bytes: dense's up to the floor (the dense kernel, no descriptors, no rectification), and
    below dense's past it."""
    from engines.base import Engine

    engine = make_engine(lm, "resa", **SPARSE)
    config, floor = lm.model.config, 16 * 16
    for n in (100, floor):
        assert engine.kv_read_bytes(config, n, 4) == Engine.kv_read_bytes(config, n, 4)
    assert engine.kv_read_bytes(config, 40 * floor, 4) < Engine.kv_read_bytes(config, 40 * floor, 4)


def test_sparse_decoding_reads_a_tenth_and_answers(lm, story_text):
    """~3K tokens: 10% of the blocks on the 3 global layers; the report says what was read and rectified."""
    doc, question = story_ids(lm, story_text, 3000)
    engine = make_engine(lm, "resa", rectify_every=8, **SPARSE)
    tokens, state = greedy_answer(engine, doc, question, 12)
    counters = engine.counters(state)
    assert "resa_decode" not in counters
    assert counters["sparse_layers"].startswith("3/18")
    n_blocks = cdiv(state.position, 16)
    assert counters["blocks_kept_last_step"] == cdiv(n_blocks, 10) < n_blocks
    assert 0.09 < counters["kv_fraction_read"] < 0.12
    assert counters["rectifications"] == 1 and counters["rectification_s"] > 0
    assert counters["rectification"].startswith("one step in 8 feeds the 7 tokens before it again with its own")
    assert counters["estimation_s"] > 0 and counters["sparse_attention_s"] > 0
    text = lm.tokenizer.decode(tokens)
    assert text.strip(), "no answer"
    assert "selection_barriers_given_up" not in counters
    # A GPU whose selection programs could not all meet (kernels/block_select/triton_fused.py) counts it in the
    # layers' sync words: the report must say so.
    layer = next(layer for layer in state.cache.layers if not layer.is_sliding)
    with torch.inference_mode():
        layer.select_sync[..., 2] = 3
    assert engine.counters(state)["selection_barriers_given_up"] == 3 * layer.select_sync.shape[1]


@pytest.mark.parametrize("after", [0, 3], ids=["ahead_after0", "ahead_after3"])
def test_select_ahead_reads_the_blocks_the_query_before_chose(lm, story_text, monkeypatch, after):
    """select_ahead: after the answer's first `after` steps (which read the blocks their own query keeps), each
    decode step's sparse attention reads the blocks that the layer's query one position earlier keeps among the
    step's blocks (with after 0, the question's last query's for the first step), and every step selects for the
    next one; the answer differs from the same-step rule's by at most a few tokens here, and the report says how
    the selection ran. Rebuilt at the end from the final descriptors: with no rectification only each step's
    newest block, always kept, changed after its selection."""
    import engines.resa.cache as resa_cache
    import engines.resa.engine as resa_engine

    doc, question = story_ids(lm, story_text, 2000)
    used, chosen = [], []
    sparse = resa_engine.sparse_decode_attention
    select_ahead = resa_cache.ResaKVLayer.select_ahead

    def record_sparse(q, key, value, blocks, length, **kwargs):
        used.append((key.data_ptr(), q.clone(), blocks.clone(), int(length[0])))
        return sparse(q, key, value, blocks, length, **kwargs)

    def record_ahead(layer, query, length, scale):
        chosen.append((layer.keys.data_ptr(), query.clone(), int(length[0]), scale))
        return select_ahead(layer, query, length, scale)

    monkeypatch.setattr(resa_engine, "sparse_decode_attention", record_sparse)
    monkeypatch.setattr(resa_cache.ResaKVLayer, "select_ahead", record_ahead)
    engine = make_engine(lm, "resa", rectify_every=0, select_ahead=True, ahead_after=after, **SPARSE)
    tokens, state = greedy_answer(engine, doc, question, 12)
    layers = {layer.keys.data_ptr(): layer for layer in state.cache.layers if not layer.is_sliding}
    n = len(layers)
    from_question = 0 if after else n  # the question's last chunk selects the first step's blocks
    assert len(used) == 11 * n and len(chosen) == from_question + 11 * n
    before = {ptr: (query, length, scale) for ptr, query, length, scale in chosen[:from_question]}
    for i, (ptr, q, blocks, length) in enumerate(used):
        if i < after * n:
            query, scale = q, chosen[from_question + i][3]
        else:
            query, selected_at, scale = before[ptr]
            assert selected_at + 1 == length
            if i >= n:
                assert torch.equal(query, used[i - n][1])
        with torch.inference_mode():
            want = layers[ptr].select(query, torch.tensor([length]), scale)
        assert torch.equal(blocks, want), i
        before[ptr] = chosen[from_question + i][1:]
    same_step, _ = greedy_answer(make_engine(lm, "resa", rectify_every=0, select_ahead=False, **SPARSE), doc,
                                 question, 12)
    assert sum(a != b for a, b in zip(tokens, same_step)) <= 3, (tokens, same_step)
    if after:
        assert tokens[:after + 1] == same_step[:after + 1]
    counters = engine.counters(state)
    assert counters["selection"].startswith("one step ahead") and counters["selection"].endswith(
        "for every layer at once after the step's last one")
    assert (f"its first {after} select with their own query" in counters["selection"]) == bool(after)
    assert "selection" not in make_engine(lm, "resa", select_ahead=False).counters(state)


def test_one_selection_a_step_serves_every_layer(lm, story_text, monkeypatch):
    """On one device the covered layers' descriptors and select_ahead buffers are slices of stacked tensors, and
    a decode step selects the next step's blocks for every layer in one call over the stacked rows (layers x
    batch): the same blocks, hence the same tokens, as one selection a layer (the cache unstacked)."""
    import engines.resa.cache as resa_cache

    doc, question = story_ids(lm, story_text, 2000)
    rows = []
    select = resa_cache.select_blocks

    def record(q, *args, **kwargs):
        rows.append(q.shape[0])
        return select(q, *args, **kwargs)

    monkeypatch.setattr(resa_cache, "select_blocks", record)
    engine = make_engine(lm, "resa", rectify_every=4, select_ahead=True, ahead_after=2, **SPARSE)
    tokens, state = greedy_answer(engine, doc, question, 12)
    cache = state.cache
    covered = [layer for layer in cache.layers if not layer.is_sliding]
    assert cache.stacked and cache.covered == len(covered) == 3
    for name in ("kmax", "kmin", "kscale", "score_bins", "select_sync", "ahead", "query"):
        stack = cache._stacks[name]
        assert all(getattr(layer, name).data_ptr() == stack[i].data_ptr() for i, layer in enumerate(covered)), name
    # Steps 0-1 select their own blocks a layer at a time and the next step's in one call; the rectifying steps
    # (3, 7) and the other sparse steps select the next step's in one call of 3 rows (3 layers x batch 1); 11 decode
    # steps make the 12 tokens.
    assert rows == [1, 1, 1, 3] * 2 + [3] * 9, rows

    monkeypatch.setattr(resa_cache, "select_blocks", select)
    unstacked = make_engine(lm, "resa", rectify_every=4, select_ahead=True, ahead_after=2, **SPARSE)
    monkeypatch.setattr(unstacked, "single_device", False)
    plain, plain_state = greedy_answer(unstacked, doc, question, 12)
    assert not plain_state.cache.stacked and not plain_state.cache._stacks
    assert tokens == plain
    for layer, other in zip(covered, (layer for layer in plain_state.cache.layers if not layer.is_sliding)):
        assert torch.equal(layer.ahead, other.ahead) and torch.equal(layer.kmax, other.kmax)


def test_rectifying_step_selects_the_next_steps_blocks(lm, story_text, monkeypatch):
    """select_ahead with rectification: a rectifying step (every 4th with rectify_every 4) reads no blocks and
    its last query selects the next step's, so each layer alternates between a step's read and its selection
    for the next, the question's last query selecting the first step's blocks."""
    import engines.resa.cache as resa_cache
    import engines.resa.engine as resa_engine

    doc, question = story_ids(lm, story_text, 2000)
    events: dict[int, list[str]] = {}
    sparse = resa_engine.sparse_decode_attention
    select_ahead = resa_cache.ResaKVLayer.select_ahead

    def record_sparse(q, key, value, blocks, length, **kwargs):
        events.setdefault(key.data_ptr(), []).append("read")
        return sparse(q, key, value, blocks, length, **kwargs)

    def record_ahead(layer, query, length, scale):
        events.setdefault(layer.keys.data_ptr(), []).append(
            layer.owner.decode_variant if layer.owner.decoding else "question")
        return select_ahead(layer, query, length, scale)

    monkeypatch.setattr(resa_engine, "sparse_decode_attention", record_sparse)
    monkeypatch.setattr(resa_cache.ResaKVLayer, "select_ahead", record_ahead)
    engine = make_engine(lm, "resa", rectify_every=4, select_ahead=True, ahead_after=0, **SPARSE)
    _, state = greedy_answer(engine, doc, question, 12)
    assert engine.counters(state)["rectifications"] == 2
    sparse_steps = ["read", "ahead"] * 3
    want = ["question"] + sparse_steps + ["rectify"] + sparse_steps + ["rectify"] + sparse_steps
    assert len(events) == 3 and all(got == want for got in events.values()), events


def test_select_ahead_with_every_block_kept_equals_dense(lm, story_text, monkeypatch):
    """keep_ratio 1.0 through the sparse kernels: blocks chosen a step ahead are still every block, so dense's
    tokens, with the rectifications (which re-encode the steps' tokens) in between."""
    monkeypatch.setattr(ResaKVCache, "dense_when_every_block_kept", False)
    doc, question = story_ids(lm, story_text, 600)
    dense, _ = greedy_answer(make_engine(lm, "dense"), doc, question, 12)
    resa, state = greedy_answer(make_engine(lm, "resa", keep_ratio=1.0, rectify_every=4, select_ahead=True,
                                            **SPARSE), doc, question, 12)
    assert resa == dense


def _dense_kv(lm, ids: torch.Tensor):
    """K/V of every layer after a dense forward over ids (the exact cache rectification must reproduce)."""
    engine = make_engine(lm, "dense", chunk_size=4096)
    return engine.prefill(ids, reserve=1).cache


def test_rectification_rewrites_exact_kv_and_descriptors(lm, story_text):
    """After a rectification the rewritten K/V equal a dense encoding of the same tokens, descriptors match
    a rebuild; without rectification the sparse-written K/V differ (so the check is not vacuous), and their
    descriptors, written by the decode steps alone, match a rebuild too."""
    doc, question = story_ids(lm, story_text, 1000)
    # The same 16 tokens fed through 16 decode steps of both runs (teacher forcing): with rectify_every=16 the
    # 16th step rectifies (the 15 tokens before it fed again with its own), none with 0.
    targets = doc[1:18].tolist()
    states = {}
    # Tokens the first and the last layer's MLP saw while decoding: the rectifying step is a whole pass.
    seen = {0: [], -1: []}
    for every in (16, 0):
        engine = make_engine(lm, "resa", rectify_every=every, **SPARSE)
        states[every] = engine.prefill(doc, reserve=question.numel() + len(targets))
        cache = states[every].cache
        layers = engine.model.get_decoder().layers
        hooks = [layers[i].mlp.register_forward_hook(
            lambda m, args, out, i=i: seen[i].append(args[0].shape[1]) if cache.decoding else None) for i in seen]
        try:
            engine.teacher_forced_nll(states[every], question, targets)
        finally:
            for hook in hooks:
                hook.remove()
    assert seen[0] == seen[-1] and sorted(set(seen[0])) == [1, 16], seen
    state = states[16]
    assert engine.counters(state)["rectifications"] == 1 and engine.counters(states[0])["rectifications"] == 0
    start = doc.numel() + question.numel()
    dense = _dense_kv(lm, torch.cat([doc, question, torch.tensor(targets[:16])]))
    errors = {}
    for every, st in states.items():
        worst = 0.0
        for layer, ref in zip(st.cache.layers, dense.layers):
            for got, want in ((layer.keys, ref.keys), (layer.values, ref.values)):
                got, want = got[:, :, start:start + 16], want[:, :, start:start + 16]
                worst = max(worst, (got - want).abs().max().item() / want.abs().max().item())
        errors[every] = worst
    assert errors[16] < 1e-4, errors
    assert errors[0] > 1e-3, errors
    # Descriptors match a rebuild from the cached keys: after the rectification's rewrite, and where only the
    # decode steps wrote them (refreshed inside the K/V write, kernels/kv_append).
    end = start + 16
    for st in states.values():
        for layer in st.cache.layers:
            if layer.is_sliding:
                continue
            kmax, kmin = layer.kmax.clone(), layer.kmin.clone()
            scale = None if layer.kscale is None else layer.kscale.clone()
            update_block_descriptors_reference(layer.keys, kmax, kmin, torch.tensor([end]), end, 16,
                                               fold_mean=layer.owner.rule.centroid, scale=scale)
            used = cdiv(end, 16)
            assert torch.equal(kmax[:, :, :used], layer.kmax[:, :, :used])
            assert torch.equal(kmin[:, :, :used], layer.kmin[:, :, :used])
            if scale is not None:
                assert torch.equal(scale[:, :, :used], layer.kscale[:, :, :used])


@pytest.mark.parametrize("key,value,message", [
    ("keep_ratio", 0, "keep_ratio"), ("keep_ratio", 1.5, "keep_ratio"), ("block_size", 12, "block_size"),
    ("local_blocks", 0, "local_blocks"), ("min_blocks", 1, "min_blocks"), ("rectify_every", -1, "rectify_every"),
    ("rectify_every", 1, "rectify_every"),
    ("sink_blocks", -1, "sink_blocks"), ("pooling", "max", "pooling"), ("ahead_after", -1, "ahead_after"),
])
def test_bad_config_names_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        resolve_profile("resa", {key: value})


def test_shipped_profiles_pooling():
    """resa ships softmax pooling, block centroids and a sink block (beyond the paper); resa-paper is the
    paper's exact rule."""
    ours, paper = resolve_profile("resa", {}).engine_config, resolve_profile("resa-paper", {}).engine_config
    assert (ours.pooling, ours.centroid, ours.sink_blocks) == ("softmax", True, 1)
    assert (paper.pooling, paper.centroid, paper.sink_blocks, paper.keep_ratio, paper.min_blocks, paper.block_size,
            paper.rectify_every) == ("mean", False, 0, 0.1, 16, 16, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("centroid, ahead", [(False, False), (True, False), (True, True)],
                         ids=["bound", "centroid", "centroid-select-ahead"])
def test_gpu_graph_decode_scores_as_eager(centroid, ahead):
    """On CUDA, the captured decode + rectification graphs score a continuation as the eager path does (random
    Gemma shape): teacher-forced NLLs, not greedy tokens, which a random model's near-ties send apart after a few
    steps (the captured step's one-row projections are the project's GEMVs, the eager step's cuBLAS's)."""
    from longctx_cli.models import load_model

    lm = load_model("random:gemma3-270m", device="cuda", dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(1000, lm.config.vocab_size, (6000,), generator=gen)
    question, targets = doc[:9], doc[100:140].tolist()
    nlls, rectifications = [], []
    for graph in (True, False):
        engine = make_engine(lm, "resa", decode_graph=graph, rectify_every=8, centroid=centroid,
                             select_ahead=ahead, **SPARSE)
        state = engine.prefill(doc, reserve=question.numel() + len(targets))
        nlls.append(torch.tensor(engine.teacher_forced_nll(state, question, targets)))
        assert state.decode.use_graph == graph
        rectifications.append(engine.counters(state)["rectifications"])
    assert rectifications[0] == rectifications[1] == 39 // 8
    torch.testing.assert_close(nlls[0], nlls[1], atol=3e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_every_block_kept_decodes_like_dense():
    """On CUDA, captured steps (random Qwen3 shape, bf16): under the shipped floor resa decodes with dense's
    kernel and gives dense's tokens, with no rectification."""
    from longctx_cli.models import load_model

    lm = load_model("random:qwen3-1.7b", device="cuda", dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(1000, lm.config.vocab_size, (3000,), generator=gen)
    question = torch.randint(1000, lm.config.vocab_size, (9,), generator=gen)
    dense, _ = greedy_answer(make_engine(lm, "dense"), doc, question, 40)
    engine = make_engine(lm, "resa")
    resa, state = greedy_answer(engine, doc, question, 40)
    assert resa == dense
    counters = engine.counters(state)
    assert counters["rectifications"] == 0 and "no selection" in counters["resa_decode"]


@pytest.mark.gpu
def test_gpu_rectification_time_waits_for_a_running_rectification():
    """The report may be taken while the last rectification still runs (an answer that stops on the step that
    launched it): its time is waited for, not an error."""
    from engines.resa.engine import events_seconds

    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles, still running when the events are read
    end.record()
    assert not end.query()
    assert events_seconds([(begin, end)]) > 0.01


def test_select_ahead_forms_of_the_decode_step(lm, story_text):
    """The forms a decode step takes: with select_ahead the first ahead_after steps on their own query, then
    ahead; ahead from the first step with ahead_after 0; on a model split over GPUs (mirrored devices, no stream
    beside the step) only the own query's, and the report says select_ahead was not applied. Without it, one.
    Where the answer rectifies, every f-th step is the rectifying form, f tokens wide."""
    doc, _ = story_ids(lm, story_text, 600)
    for after, forms in ((4, ("own", "ahead")), (0, ("ahead",))):
        engine = make_engine(lm, "resa", select_ahead=True, ahead_after=after, rectify_every=8, **SPARSE)
        state = engine.prefill(doc, reserve=8)
        cache = state.cache
        assert cache.decode_variants() == forms + ("rectify",)
        assert cache.decode_width("rectify") == 8 and {cache.decode_width(f) for f in forms} == {1}
        assert [cache.variant_for(i) for i in (0, 3, 4, 8, 40)] == [forms[0]] * 2 + [forms[-1]] * 3
        cache.rectifying = True
        assert [cache.variant_for(i) for i in (3, 6, 7, 8, 15, 23, 24)] == \
            [forms[0], forms[-1], "rectify", forms[-1], "rectify", "rectify", forms[-1]]
    cache.mirrored = [torch.device("cpu")]
    assert cache.decode_variants() == ("own", "rectify") and cache.variant_for(40) == "own"
    assert engine.counters(state)["selection"].startswith("select_ahead not applied")
    plain = make_engine(lm, "resa", rectify_every=0, select_ahead=False, **SPARSE).prefill(doc, reserve=8).cache
    assert plain.decode_variants() == (None,) and plain.variant_for(7) is None
