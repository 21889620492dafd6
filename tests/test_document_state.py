"""Read once, ask many: several questions from one state, and states saved to disk and read back.

Every engine that says it can reuse its state (`reusable`) must give, token for token, the greedy answers of
fresh prefills: question after question in one run (checkpoint and restore), and from a state exported and
imported again. Engines that cannot yet are read again per question; the report says so.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engines import ENGINES
from engines.decoding import Sampler
from tests.conftest import make_engine, run_cli

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).parent.parent / "samples" / "lighthouse.txt"
QUESTIONS = ["What was the name of the schooner?", "Who kept the lighthouse?", "What did Ada carry?"]
NEW = 6
# Shipped engines, with settings that make the document long enough for each engine to approximate (sas: ring
# slots the question overwrites, and an H2O pool it changes).
CASES = [pytest.param("dense", {}, id="dense"),
         pytest.param("resa", {"block_size": 16, "min_blocks": 2}, id="resa"),
         pytest.param("sas-pattern", {"pattern": "Rect(keys=0:16) + Diag(window=96)"}, id="sas-streaming"),
         pytest.param("sas-pattern", {"pattern": "(Rect(keys=0:16) + Diag(window=96)) + Dynamic(budget=64)"},
                      id="sas-h2o", marks=pytest.mark.long),
         pytest.param("star", {"blocks": 3, "min_block_size": 64}, id="star"),
         pytest.param("ltri-stream", {"n_init": 32, "n_local": 128, "block_size": 32, "top_k": 2}, id="ltri"),
         pytest.param("ltri-stream", {"n_init": 32, "n_local": 128, "block_size": 32, "top_k": 2,
                                      "context_memory": "fp8"}, id="ltri-fp8", marks=pytest.mark.long),
         pytest.param("ltri-stream", {"n_init": 32, "n_local": 128, "block_size": 32, "top_k": 2,
                                      "decode_summaries": True}, id="ltri-summaries", marks=pytest.mark.long)]
REUSABLE = sorted(name for name, cls in ENGINES.items() if cls.reusable)


def _ids(lm, text: str):
    return torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def document(lm):
    story = SAMPLE.read_text(encoding="utf-8")
    # 560 tokens: past Gemma 3's 512-token sliding window, and long enough for every case to approximate.
    doc = torch.tensor([lm.tokenizer.bos_token_id, *_ids(lm, story).tolist()[:560]])
    questions = [_ids(lm, f"\n\nQuestion: {q}\nAnswer:") for q in QUESTIONS]
    return doc, questions


@pytest.fixture(scope="module")
def fresh_runs(lm, document):
    """Per case, computed once for the checks below: the engine, the greedy answer to each question from a fresh
    prefill of its own, and the first question's state, exported before it was answered (the tensors copied
    after the answer, as a saved state would be) and kept as the answer left it."""
    doc, questions = document
    reserve = max(q.numel() for q in questions) + NEW
    runs = {}

    def run(name, settings):
        key = (name, tuple(sorted(settings.items())))
        if key not in runs:
            engine = make_engine(lm, name, chunk_size=256, **settings)
            want, first = [], None
            for q in questions:
                state = engine.prefill(doc, reserve=reserve)
                exported = engine.export_state(state) if first is None else None
                want.append(list(engine.answer(state, q, NEW, Sampler())))
                if first is None:
                    tensors, meta = exported
                    first = SimpleNamespace(state=state, tensors={k: v.clone() for k, v in tensors.items()},
                                            meta=meta)
            runs[key] = SimpleNamespace(engine=engine, reserve=reserve, want=want, first=first)
        return runs[key]

    return run


def test_reusable_engines_are_covered():
    assert {case.values[0] for case in CASES} == set(REUSABLE)


@pytest.mark.parametrize("name, settings", CASES)
def test_questions_in_a_row_equal_fresh_runs(document, fresh_runs, name, settings):
    doc, questions = document
    fresh = fresh_runs(name, settings)
    engine, want = fresh.engine, fresh.want
    state = engine.prefill(doc, reserve=fresh.reserve)
    checkpoint = engine.checkpoint(state)
    got = []
    for q in [*questions, questions[0]]:
        got.append(list(engine.answer(state, q, NEW, Sampler())))
        engine.restore(state, checkpoint)
    assert got == [*want, want[0]]
    assert len({tuple(t) for t in want}) > 1  # the questions really differ


@pytest.mark.parametrize("name, settings", CASES)
def test_exported_state_answers_as_a_fresh_prefill(document, fresh_runs, name, settings):
    doc, questions = document
    fresh = fresh_runs(name, settings)
    engine, reserve = fresh.engine, fresh.reserve
    copy = {k: v.clone() for k, v in fresh.first.tensors.items()}
    json.dumps(fresh.first.meta)  # the scalars go into a JSON header
    if name == "sas-pattern":
        from engines.sas.analyzer import _plan_cache

        _plan_cache.cache_clear()
    restored = engine.import_state(copy, fresh.first.meta, reserve + 5)  # other questions may need more room
    if name == "sas-pattern":  # the plans came with the state: nothing was analysed again
        assert _plan_cache.cache_info().misses == 0
    assert restored.n_tokens == doc.numel() and restored.cache.capacity >= doc.numel() + reserve + 5
    assert list(engine.answer(restored, questions[0], NEW, Sampler())) == fresh.want[0]


def test_saved_sliding_window_layers_keep_their_last_window(lm, document, fresh_runs):
    """Gemma 3's sliding-window layers never attend a document's keys before its last window again, so a saved
    state keeps only those rows there; a state saved whole (as before) still reads back to the same answer."""
    doc, questions = document
    fresh = fresh_runs("dense", {})
    engine, reserve, state, want = fresh.engine, fresh.reserve, fresh.first.state, fresh.want[0]
    tensors, meta = fresh.first.tensors, fresh.first.meta
    window = lm.model.config.get_text_config(decoder=True).sliding_window
    n = doc.numel()
    assert window < n
    rows = {layer.is_sliding: tensors[f"layers.{i}.keys"].shape[2] for i, layer in enumerate(state.cache.layers)}
    assert rows == {True: window, False: n}
    whole = {k: v.clone() for k, v in tensors.items()}
    for i, layer in enumerate(state.cache.layers):
        whole[f"layers.{i}.keys"] = layer.keys[:, :, :n].clone()
        whole[f"layers.{i}.values"] = layer.values[:, :, :n].clone()
    for saved in ({k: v.clone() for k, v in tensors.items()}, whole):
        assert list(engine.answer(engine.import_state(saved, meta, reserve), questions[0], NEW, Sampler())) == want
    short = {**tensors, "layers.0.keys": tensors["layers.0.keys"][:, :, 1:],
             "layers.0.values": tensors["layers.0.values"][:, :, 1:]}
    with pytest.raises(ValueError, match="saved layer 0 holds"):
        engine.import_state(short, meta, reserve)


@pytest.fixture
def states_home():
    """The test's own saved-state folder (conftest's `_own_saved_states`)."""
    from longctx_cli.states import StateStore

    return StateStore().root


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> Path:
    """The sample story's first third (479 tokens): the command line's questions and states, not the engines'
    approximations (above), are what the tests below check."""
    path = tmp_path_factory.mktemp("doc") / "story.txt"
    text = SAMPLE.read_text(encoding="utf-8")
    path.write_text(text[: text.index("\n", len(text) // 3)], encoding="utf-8")
    return path


def _run(capsys, monkeypatch, story, *args):
    code, out, err = run_cli(["ask", str(story), *args, "-n", str(NEW), "--json"], capsys, monkeypatch)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()], err


@pytest.mark.parametrize("profile", ["dense", pytest.param("sas-pattern", marks=pytest.mark.long),
                                     pytest.param("ltri-stream", marks=pytest.mark.long)])
def test_cli_three_questions_equal_three_runs_and_reuse_the_saved_state(capsys, monkeypatch, states_home, story,
                                                                         profile):
    asked = [arg for q in QUESTIONS for arg in ("-q", q)]
    together, _ = _run(capsys, monkeypatch, story, *asked, "--profile", profile, "--state", "off")
    alone = [_run(capsys, monkeypatch, story, "-q", q, "--profile", profile, "--state", "off")[0][0]
             for q in QUESTIONS]
    assert [o["answer_ids"] for o in together] == [o["answer_ids"] for o in alone]
    assert [o["question"] for o in together] == QUESTIONS
    # The document is tokenized once, for the first question.
    assert together[0]["timings"]["tokenize_s"] > 0 and together[1]["timings"]["tokenize_s"] == 0.0
    reusable = ENGINES[together[0]["engine"]].reusable
    if reusable:
        assert together[0]["state"].startswith("computed") and together[1]["state"].startswith("kept")
        assert together[1]["timings"]["prefill_s"] == 0.0
    else:
        assert all("keeps no saved state" in o["state"] for o in together)
    first, _ = _run(capsys, monkeypatch, story, "-q", QUESTIONS[1], "--profile", profile)
    again, _ = _run(capsys, monkeypatch, story, "-q", QUESTIONS[1], "--profile", profile)
    assert again[0]["answer_ids"] == first[0]["answer_ids"] == together[1]["answer_ids"]
    if reusable:
        assert first[0]["state"].startswith("computed, saved") and again[0]["state"].startswith("reused")
        assert again[0]["timings"]["prefill_s"] == 0.0
    else:
        assert not states_home.exists() or not any(states_home.iterdir())


def _save_file_held_until(monkeypatch, done) -> list[str]:
    """safetensors' save_file held until done() (a minute at most: a file written too early is what the test
    then finds); returns the names of the threads that wrote."""
    import threading

    import safetensors.torch

    real, writers = safetensors.torch.save_file, []

    def held(tensors, filename, metadata=None):
        writers.append(threading.current_thread().name)
        for _ in range(600):
            if done():
                break
            threading.Event().wait(0.1)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", held)
    return writers


def test_the_state_is_written_beside_the_answers(capsys, monkeypatch, states_home, story):
    """The document's state goes to disk on a thread of its own while the questions are answered: here its file
    is held until the last answer is done, and the run still answers both. The first report says it is being
    saved, the document's last one when it was done and how long the run waited for it (a `state write` part of
    its wall clock)."""
    import longctx_cli.ask as ask

    answered, real_answer = [], ask.answer_question

    def answer(*args, **kwargs):
        real_answer(*args, **kwargs)
        answered.append(True)

    monkeypatch.setattr(ask, "answer_question", answer)
    writers = _save_file_held_until(monkeypatch, lambda: len(answered) == 2)
    both, _ = _run(capsys, monkeypatch, story, "-q", QUESTIONS[0], "-q", QUESTIONS[1])
    assert len(answered) == 2 and writers and writers[0].startswith("longctx-state-")
    assert both[0]["state"].startswith("computed, saving") and "beside the answers" in both[0]["state"]
    assert both[1]["state"].startswith("kept") and "the state saved" in both[1]["state"]
    assert "waited" in both[1]["state"] and both[1]["timings"]["wall"]["state_write_s"] > 0
    assert len(list(states_home.glob("*.safetensors"))) == 1
    assert not list(states_home.glob("*.partial"))
    again, _ = _run(capsys, monkeypatch, story, "-q", QUESTIONS[1])
    assert again[0]["state"].startswith("reused") and again[0]["answer_ids"] == both[1]["answer_ids"]


def test_a_state_is_written_beside_the_next_documents_prefill(capsys, monkeypatch, states_home, story, tmp_path):
    """A run over several documents writes each one's state beside the next document's prefill: here the first
    file is held until the second document has been read, and both states end up saved; the last document's
    report waits for its own."""
    from engines.dense import DenseEngine

    prefilled, real_prefill = [], DenseEngine.prefill

    def prefill(self, *args, **kwargs):
        state = real_prefill(self, *args, **kwargs)
        prefilled.append(True)
        return state

    monkeypatch.setattr(DenseEngine, "prefill", prefill)
    writers = _save_file_held_until(monkeypatch, lambda: len(prefilled) == 2)
    second = tmp_path / "second.txt"
    second.write_text(story.read_text(encoding="utf-8") + "\nThe keeper's cat was called Tom.\n", encoding="utf-8")
    code, out, err = run_cli(["ask", str(story), str(second), "-q", QUESTIONS[0], "-n", str(NEW), "--json"], capsys,
                             monkeypatch)
    assert code == 0, err
    first, last = [json.loads(line) for line in out.splitlines()]
    assert len(prefilled) == 2 and len(writers) == 2
    assert first["state"].startswith("computed, saving") and first["state"].endswith("beside the next document")
    assert last["state"].startswith("computed, saved") and last["timings"]["wall"]["state_write_s"] > 0
    assert len(list(states_home.glob("*.safetensors"))) == 2 and not list(states_home.glob("*.partial"))
    # A last document read from its saved state: its report names the earlier document whose write it joined.
    third = tmp_path / "third.txt"
    third.write_text(story.read_text(encoding="utf-8") + "\nThe keeper's dog was called Rex.\n", encoding="utf-8")
    code, out, err = run_cli(["ask", str(third), str(second), "-q", QUESTIONS[0], "-n", str(NEW), "--json"], capsys,
                             monkeypatch)
    assert code == 0, err
    first, last = [json.loads(line) for line in out.splitlines()]
    assert first["state"].startswith("computed, saving") and last["state"].startswith("reused")
    assert f"; {first['path']}'s state saved" in last["state"]
    assert len(list(states_home.glob("*.safetensors"))) == 3


def test_a_state_that_cannot_be_written_is_one_warning(capsys, monkeypatch, states_home, story):
    """A full disk while the state is written beside the answer: the answer stands, one warning line names the
    folder and the reason, the report says the state was not saved, and no partial file is left."""
    import errno

    import safetensors.torch

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    [report], err = _run(capsys, monkeypatch, story, "-q", QUESTIONS[0])
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot save the document's state" in warnings[0]
    assert "No space left on device" in warnings[0] and report["answer"].strip()
    assert report["state"] == "computed, not saved (see the warning)"
    assert not [p for p in states_home.glob("*") if p.is_file()]  # pathlib's * matches the hidden partial files


@pytest.mark.parametrize("change", [["--chunk-size", "512"], ["--profile", "resa"], ["--dtype", "bfloat16"],
                                    ["--set", "max_new_tokens=9"]],
                         ids=["chunk-size", "engine", "dtype", "run-key-outside-the-state"])
def test_a_state_is_reused_only_for_the_same_inputs(capsys, monkeypatch, states_home, story, change):
    _run(capsys, monkeypatch, story, "-q", QUESTIONS[0])
    other, _ = _run(capsys, monkeypatch, story, "-q", QUESTIONS[0], *change)
    # max_new_tokens does not shape the document's state: that one is reused.
    assert other[0]["state"].startswith("reused" if "max_new_tokens=9" in change else "computed")


def test_a_damaged_state_is_reported_and_recomputed(capsys, monkeypatch, states_home, story):
    first, _ = _run(capsys, monkeypatch, story, "-q", QUESTIONS[0])
    [path] = states_home.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    again, err = _run(capsys, monkeypatch, story, "-q", QUESTIONS[0])
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "reading the document again" in warnings[0]
    assert again[0]["state"].startswith("computed, saved") and again[0]["answer_ids"] == first[0]["answer_ids"]
    truncated = path.read_bytes()[:1000]
    path.write_bytes(truncated)
    third, err = _run(capsys, monkeypatch, story, "-q", QUESTIONS[0])
    assert "reading the document again" in err and third[0]["answer_ids"] == first[0]["answer_ids"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", REUSABLE)
def test_gpu_questions_in_a_row_and_saved_state_equal_fresh_runs(name, tmp_path):
    """The GPU path (captured decode graphs, resa's rectification graph) answers question after question from
    one state, and from a state saved and read back, as fresh prefills do."""
    from longctx_cli.models import load_model
    from longctx_cli.states import StateStore

    lm = load_model("random:llama-3.1-8b", device="cuda", dtype="bfloat16")
    # resa: the paper's floor of 16 blocks, so that a 3K-token document decodes sparsely.
    engine = make_engine(lm, name, chunk_size=1024, rectify_every=4, min_blocks=16) if name == "resa" else \
        make_engine(lm, name, chunk_size=1024)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 250, (3000,), generator=g)
    questions = [torch.randint(3, 250, (n,), generator=g) for n in (9, 14, 5)]
    reserve = 14 + 12
    want = []
    for q in questions:
        state = engine.prefill(doc, reserve=reserve)
        want.append(list(engine.answer(state, q, 12, Sampler())))
    state = engine.prefill(doc, reserve=reserve)
    checkpoint = engine.checkpoint(state)
    got = []
    for q in questions:
        got.append(list(engine.answer(state, q, 12, Sampler())))
        engine.restore(state, checkpoint)
    assert got == want
    assert engine.counters(state)["decode_cuda_graph"] is True
    tensors, meta = engine.export_state(state)
    store = StateStore(tmp_path)
    store.save("k" * 32, {"x": 1}, tensors, meta)
    loaded, meta, _ = store.load("k" * 32, {"x": 1}, device="cuda")
    restored = engine.import_state(loaded, meta, reserve)
    assert list(engine.answer(restored, questions[1], 12, Sampler())) == want[1]


@pytest.mark.gpu
@pytest.mark.parametrize("name, overrides", [("dense", {}), ("resa", {"min_blocks": 16, "rectify_every": 8})])
def test_gpu_memory_stays_flat_from_document_to_document(name, overrides):
    """Each document's first answer captures its decode graph (resa's also its rectification's). Read one after
    another in one process (a folder, a benchmark's samples), documents leave the GPU memory allocated where the
    first one left it once their states are gone: a capture's side stream is the process's, not a new one each
    time (cuBLAS keeps a 32 MiB workspace for every stream it has run on)."""
    from longctx_cli.models import load_model

    lm = load_model("random:qwen3-1.7b", device="cuda", dtype="bfloat16")
    engine = make_engine(lm, name, **overrides)
    gen = torch.Generator().manual_seed(4)
    question = torch.randint(1000, 20000, (9,), generator=gen)
    allocated = []
    for n in (3000, 2903, 2806, 2709):
        state = engine.prefill(torch.randint(1000, 20000, (n,), generator=gen), reserve=question.numel() + 24)
        tokens = list(engine.answer(state, question, 24, Sampler()))
        assert len(tokens) == 24
        if name == "resa":
            assert engine.counters(state)["rectifications"] > 0
        del state
        gc.collect()  # what captures leave behind is checked here; a state's own cycles, in the contract tests
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert max(allocated[1:]) - allocated[1] < 1 << 20, [a / 2**20 for a in allocated]
