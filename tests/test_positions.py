"""Positions re-assigned past the model's context (engines/positions.py): the rotation is the model's own, the
assignment follows the rule worked out by hand, the embedded model reads a document longer than its (shortened)
context without a position past it, and below the context nothing changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engines.positions import Positions, reassigns, rotary_module
from tests.conftest import Owner, greedy_answer, make_engine, run_cli


@pytest.fixture(scope="module")
def positions(lm):
    return Positions(rotary_module(lm.model), 32768)


@pytest.mark.slow
@pytest.mark.parametrize("sliding", [False, True], ids=["global", "sliding"])
def test_rotation_is_the_models_own_and_unrotate_inverts_it(lm, positions, sliding):
    import transformers.models.gemma3.modeling_gemma3 as gemma3

    torch.manual_seed(42)
    k = torch.randn(1, 2, 7, 256)
    at = torch.tensor([0, 1, 63, 1000, 4097, 20000, 32767])
    cos, sin = positions.rotary(k, at[None], "sliding_attention" if sliding else "full_attention")
    _, rotated = gemma3.apply_rotary_pos_emb(k, k, cos, sin)
    torch.testing.assert_close(positions.rotate(k, at, sliding), rotated, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(positions.unrotate(rotated, at, sliding), k, atol=1e-5, rtol=1e-5)


def test_modes():
    assert not reassigns("auto", 32768, 32768) and reassigns("auto", 32769, 32768)
    assert reassigns("cache", 10, 32768) and not reassigns("document", 10**6, 32768)
    assert not reassigns("auto", 10**6, 0)  # a model that states no context


class _Shift:
    """The position map's shift alone (what the assignment rules read)."""

    def __init__(self, shift: int):
        self.shift = shift

    def shift_on(self, device):
        return torch.tensor([self.shift])


def test_ltri_assignment_worked_by_hand():
    """2 init rows, 2 retrieval slots of 2, a window of 6 rows from document position 20 on, 2 empty rows."""
    from engines.ltri.cache import LtriLayer

    owner = Owner(positions=_Shift(14))
    layer = LtriLayer(owner, n_init=2, n_retrieved=4, n_local=4, block=2, room=2, window=None, retrieve=True)
    assert layer.rows == 14 and layer.local0 == 6
    layer.device, layer.front_at = torch.device("cpu"), torch.arange(6)
    layer.key_pos = torch.tensor([0, 1, 12, 13, 8, 9, 20, 21, 22, 23, 24, 25, -1, -1])
    layer.slots = [5, 3]  # slot 0 holds block 5 (positions 12, 13), slot 1 block 3 (8, 9)
    layer.order_slots()
    # shift 14 = window start 20 - local0 6: the window keeps its distances at positions 6..11, the retrieved
    # blocks sit in front of it in document order (block 3, then block 5), the init tokens at their own.
    assert layer.assigned().tolist()[:12] == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11]
    owner.positions = _Shift(0)  # before the window passes local0: the document's own positions
    assert layer.assigned().tolist()[:12] == [0, 1, 12, 13, 8, 9, 20, 21, 22, 23, 24, 25]
    sliding = LtriLayer(owner, n_init=0, n_retrieved=0, n_local=4, block=2, room=0, window=4, retrieve=False)
    sliding.device, sliding.key_pos = torch.device("cpu"), torch.tensor([22, 23, 24, 25, -1, -1])
    owner.positions = _Shift(14)
    assert sliding.assigned().tolist()[:4] == [8, 9, 10, 11]  # a sliding layer: true distances only


def test_sas_assignment_worked_by_hand():
    """Recent keys keep their distances, the first `lead` tokens their positions, older kept keys sit at lead."""
    from engines.sas.cache import SasLayer

    owner = Owner(positions=_Shift(100), lead=2)
    layer = SasLayer.__new__(SasLayer)
    layer.owner = owner
    layer.device = torch.device("cpu")
    layer.key_pos = torch.tensor([[[0, 1, 130, 105, 40, 101, -1]]])  # sinks, recent, an H2O key from long ago
    assert layer.assigned().tolist() == [[[0, 1, 30, 5, 2, 2, -1]]]


NEEDLE_LIMIT = 768  # the embedded model's context, shortened for these tests
SMALL_LTRI = dict(n_init=64, block_size=64, top_k=4, n_local=256, chunk_size=128)  # 704 + 64 + room rows


@pytest.fixture
def short_context(lm, monkeypatch):
    """Calling the fixture's value tells the embedded model its context is NEEDLE_LIMIT positions and starts
    recording every position handed to the rotary embedding (by the model or by the engine's own rotation),
    each checked against the context; it returns the list of the largest position of each call. (Engines made
    before the call find the model's shipped retrieval heads, which are keyed by its whole configuration.)"""
    seen, hooks = [], []

    def check(module, args):
        top = int(args[1].max())
        seen.append(top)
        assert top < NEEDLE_LIMIT, f"position {top} past the context of {NEEDLE_LIMIT}"

    def watch() -> list[int]:
        monkeypatch.setattr(lm.model.config.get_text_config(decoder=True), "max_position_embeddings", NEEDLE_LIMIT)
        hooks.append(rotary_module(lm.model).register_forward_pre_hook(check))
        return seen

    yield watch
    for hook in hooks:
        hook.remove()


def _niah(lm, depth: float):
    from longctx_cli.tasks import generate, prompt_tail

    tok = lm.tokenizer
    sample = generate("niah_single_2", 2920, 1, tok, seed=1, depths=[depth], budget=32)[0]
    doc = torch.tensor([tok.bos_token_id] + tok(sample.document, add_special_tokens=False)["input_ids"])
    question = torch.tensor(tok(prompt_tail(sample.question, sample.answer_prefix), add_special_tokens=False)["input_ids"])
    assert doc.numel() > 3.5 * NEEDLE_LIMIT
    return doc, question, sample.expected[0]


@pytest.mark.slow
@pytest.mark.parametrize("name, depth, settings", [
    pytest.param("ltri-stream", 0.6, SMALL_LTRI, id="ltri-needle-mid-document"),
    pytest.param("sas-pattern", 0.93, dict(pattern="Rect(keys=0:32) + Diag(window=512)", chunk_size=128),
                 id="streaming-llm-needle-in-window"),
])
def test_a_document_four_times_the_context(lm, short_context, name, depth, settings):
    doc, question, expected = _niah(lm, depth)
    engine = make_engine(lm, name, **settings)
    seen = short_context()
    answer, state = greedy_answer(engine, doc, question, 12)
    assert expected in lm.tokenizer.decode(answer)
    counters = engine.counters(state)
    assert counters["positions"] == "re-assigned"
    # The rotary module sees each position the model is given and the engine's rotation table (positions
    # 0..n-1, n at most the context), so the largest it sees bounds the largest used.
    assert counters["largest_position"] <= max(seen) < NEEDLE_LIMIT
    top = type(engine).largest_position(lm.model.config, engine.config, doc.numel() + question.numel() + 12,
                                         chunk_size=engine.run.chunk_size, reserve=question.numel() + 12)
    assert counters["largest_position"] <= top < NEEDLE_LIMIT  # what `longctx plan` states


@pytest.mark.slow
@pytest.mark.parametrize("name, settings", [
    pytest.param("ltri-stream", dict(SMALL_LTRI, top_k=40), id="ltri"),
    pytest.param("sas-pattern", dict(pattern="(Rect(keys=0:32) + Diag(window=1024)) + Dynamic(budget=512)",
                                     chunk_size=128), id="sas-h2o", marks=pytest.mark.long),
])
def test_below_the_context_nothing_changes(lm, story_text, name, settings):
    """auto keeps the document's positions; and re-assigned positions that still equal them (the window has
    not passed its first row) give the same answer: keys kept un-rotated and rotated back are the same keys."""
    from tests.conftest import story_ids

    # 600 tokens: blocks leave ltri's 256-token window for the retrieval slots.
    doc, question = story_ids(lm, story_text, 600)
    auto = make_engine(lm, name, **settings)
    answer, state = greedy_answer(auto, doc, question, 8)
    assert state.cache.positions is None and "positions" not in auto.counters(state)
    forced = make_engine(lm, name, positions="cache", **settings)
    again, state = greedy_answer(forced, doc, question, 8)
    assert state.cache.positions is not None and state.cache.positions.shift == 0
    assert again == answer


def test_engines_that_cannot_go_past_the_context_name_those_that_can(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("longctx_cli.models.max_context", lambda config: 256)
    path = tmp_path / "long.txt"
    path.write_text("The keeper wrote the wind in his logbook every evening. " * 60)
    code, out, err = run_cli(["ask", str(path), "What did the keeper write?", "--profile", "resa"], capsys,
                             monkeypatch)
    assert code == 6 and out == ""
    assert "ltri-stream or sas-pattern" in err and "maximum context of 256" in err


@pytest.mark.slow
def test_plan_states_the_largest_position(capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--profile", "ltri-stream", "--tokens", "100k"], capsys, monkeypatch)
    assert code == 0, err
    assert "positions re-assigned" in err and "up to 6,911" in err  # 128 + 16 x 128 + 4096 + 128 + 512 rows
    code, out, err = run_cli(["plan", "--profile", "dense", "--tokens", "100k"], capsys, monkeypatch)
    assert code == 6 and "ltri-stream or sas-pattern" in err


@pytest.mark.slow
@pytest.mark.long
def test_the_embedded_model_past_its_own_context(lm):
    """33K tokens, past the embedded model's own 32K context (about a minute on two cores): ltri-stream finds the
    needle on re-assigned positions, where the document's own positions (past the context) lose it."""
    from longctx_cli.tasks import generate, prompt_tail

    tok = lm.tokenizer
    sample = generate("niah_single_2", 33500, 1, tok, seed=3, depths=[0.4], budget=32)[0]
    doc = torch.tensor([tok.bos_token_id] + tok(sample.document, add_special_tokens=False)["input_ids"])
    question = torch.tensor(tok(prompt_tail(sample.question, sample.answer_prefix), add_special_tokens=False)["input_ids"])
    assert doc.numel() > lm.model.config.get_text_config(decoder=True).max_position_embeddings
    engine = make_engine(lm, "ltri-stream", n_init=64, block_size=64, top_k=16, n_local=1024, chunk_size=512)
    answer, state = greedy_answer(engine, doc, question, 12)
    assert sample.expected[0] in tok.decode(answer)
    assert engine.counters(state)["largest_position"] < 2700  # the device rows: 64 + 1024 + 1024 + 64 + 512


def test_bench_leaves_engines_that_cannot_read_past_the_context_out_of_longer_samples():
    from engines.config import CONFIGS
    from longctx_cli.accuracy import _past_context, _row

    def profile(engine):
        return SimpleNamespace(engine=engine, engine_config=CONFIGS[engine](), name=engine)

    text = SimpleNamespace(max_position_embeddings=1000)
    engine = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder: text)))
    assert _past_context(profile("dense"), engine, 1000) is None
    assert _past_context(profile("dense"), engine, 1001) == "past the model's context of 1,000 tokens"
    assert _past_context(profile("ltri-stream"), engine, 10**6) is None
    ran = {"score": 100.0, "prefill_s": 1.0, "decode_ms_per_token": 2.0}
    skipped = {"skipped": "past the model's context of 1,000 tokens", "score": None, "prefill_s": None,
               "decode_ms_per_token": None}
    row = _row("niah_single_1", 4096, profile("ltri-stream"), [ran, ran], [skipped, skipped])
    assert row["score"] == 100.0 and row["samples"] == 2
    assert row["dense_score"] is None and row["ratio"] is None
    assert row["dense_skipped"] == "past the model's context of 1,000 tokens" and "skipped" not in row
