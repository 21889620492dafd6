"""The engine contract, checked the same way for every registered engine on the embedded model.

- memory_plan equals what prefill allocates (the cache's bytes), for several chunk sizes;
- each engine degenerates to dense where its approximation vanishes: the same greedy answer, and the same
  next-token distributions (teacher-forced through its own decode path) up to float error.
Documents are a few hundred tokens: these checks are about bookkeeping, not long-context quality.
"""

from __future__ import annotations

import pytest
import torch

from engines import ENGINES
from tests.conftest import greedy_answer, make_engine, story_ids

pytestmark = pytest.mark.slow

# Past Gemma 3's 512-token sliding window; star's 64-token blocks are four, ltri's 256-token window sheds blocks.
DOC_TOKENS, NEW_TOKENS = 600, 8

# Per engine: settings under which it computes exactly what dense computes.
EXACT = {
    "dense": {},
    "star": {"blocks": 1},
    "resa": {"keep_ratio": 1.0},
    "sas-pattern": {"pattern": "Diag()"},
    "ltri-stream": {"n_local": 1024},  # a window longer than the document: nothing leaves the device
}

# Per engine: (profile, settings) whose state the plan must match; several where the state takes other shapes.
PLANNED = [
    ("dense", {}),
    ("star", {"min_block_size": 64}),  # four blocks: a scratch [anchor | block] for the blocks after the first
    ("resa", {"centroid": True}),
    ("resa", {"centroid": True, "select_ahead": True}),  # the next step's blocks, per layer
    ("sas-pattern", {}),
    ("sas-streaming-llm-h2o", {}),  # an H2O pool: scores per row
    ("ltri-stream", {}),
    ("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 4, "n_local": 256}),  # blocks leave: an index
    # Positions re-assigned: the rotated keys decode reads.
    ("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 4, "n_local": 256, "positions": "cache"}),
    # A mean key and value row per stored block for decoding.
    ("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 4, "n_local": 256, "decode_summaries": True}),
]


def test_every_registered_engine_is_covered():
    assert set(EXACT) == set(ENGINES)
    assert {make_profile_engine(name) for name, _ in PLANNED} == set(ENGINES)


def make_profile_engine(profile: str) -> str:
    from longctx_cli.profiles import resolve_profile

    return resolve_profile(profile).engine


def _allocated(engine, state) -> int:
    """What prefill allocated for the document: the cache, plus star's scratch (freed after phase 1)."""
    return state.cache.nbytes() + state.counters.get("star_scratch_bytes", 0)


# Engines whose plan does not read the chunk size (their state is the cache, descriptors per block, star's
# scratch): the second chunk size repeats the first's check, so it runs in the long tier.
CHUNK_FREE = {"dense", "star", "resa"}


def _planned_cases():
    for profile, settings in PLANNED:
        label = ",".join(f"{k}={v}" for k, v in settings.items()) or "defaults"
        for chunk_size in (128, 256):
            marks = pytest.mark.long if chunk_size == 128 and profile in CHUNK_FREE else ()
            yield pytest.param(profile, settings, chunk_size, marks=marks, id=f"{profile}-{label}-{chunk_size}")


@pytest.mark.parametrize("profile, settings, chunk_size", list(_planned_cases()))
def test_memory_plan_equals_the_allocation(lm, story_text, profile, settings, chunk_size):
    doc, question = story_ids(lm, story_text, DOC_TOKENS)
    engine = make_engine(lm, profile, chunk_size=chunk_size, **settings)
    reserve = question.numel() + NEW_TOKENS
    state = engine.prefill(doc, reserve=reserve)
    plan = engine.memory_plan(lm.model.config, doc.numel() + reserve, 4, engine.config, chunk_size=chunk_size,
                              reserve=reserve)
    if engine.name == "ltri-stream":
        # The index memory grows with what the spans ask for, up to the bound the plan counts.
        from engines.ltri.engine import index_plan_bytes

        bound = index_plan_bytes(lm.model.config, engine.config, doc.numel() + reserve, 4)
        used = engine.counters(state)["ltri_index_bytes"]
        assert 0 < used <= bound
        plan, allocated = plan - bound, _allocated(engine, state) - used
    else:
        allocated = _allocated(engine, state)
    assert plan == allocated


@pytest.fixture(scope="module")
def dense_reference(lm, story_text):
    """Dense's greedy answer and the negative log-likelihoods of its tokens, fed back one decode step at a time."""
    doc, question = story_ids(lm, story_text, DOC_TOKENS)
    engine = make_engine(lm, "dense", chunk_size=256)
    tokens, _ = greedy_answer(engine, doc, question, NEW_TOKENS)
    nll = engine.teacher_forced_nll(engine.prefill(doc, reserve=question.numel() + NEW_TOKENS), question, tokens)
    return tokens, torch.tensor(nll)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_engine_degenerates_to_dense(lm, story_text, dense_reference, name):
    want_tokens, want_nll = dense_reference
    doc, question = story_ids(lm, story_text, DOC_TOKENS)
    engine = make_engine(lm, name, chunk_size=256, **EXACT[name])
    tokens, _ = greedy_answer(engine, doc, question, NEW_TOKENS)
    assert tokens == want_tokens
    nll = engine.teacher_forced_nll(engine.prefill(doc, reserve=question.numel() + NEW_TOKENS), question,
                                    want_tokens)
    torch.testing.assert_close(torch.tensor(nll), want_nll, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_a_documents_cache_is_freed_when_its_state_goes(lm, story_text, name):
    """A document's cache (its K/V) is freed as soon as the last reference to its state goes, not when Python's
    cyclic collector next runs: documents read one after another never hold two caches at once."""
    import gc
    import weakref

    engine = make_engine(lm, name)
    doc, question = story_ids(lm, story_text, DOC_TOKENS)
    gc.collect()
    gc.disable()
    try:
        _, state = greedy_answer(engine, doc, question, NEW_TOKENS)
        cache = weakref.ref(state.cache)
        del state
        assert cache() is None
    finally:
        gc.enable()
