"""Shared fixtures: the embedded model, loaded once per test session (converted on first use).

Device tests carry a marker and skip cleanly where they cannot run:
- `@pytest.mark.gpu`: needs CUDA;
- `@pytest.mark.triton`: a Triton kernel against its reference, on CUDA, or on CPU through Triton's interpreter
  (TRITON_INTERPRET=1 with Triton installed); tensors go to TRITON_DEVICE. Also selected by `-m gpu`.
- `@pytest.mark.long`: a real-model test of a minute or more on two CPU cores, or a further variant of a mechanism
  a default test already covers on the real model; it runs with LONGCTX_LONG_TESTS=1 (or `-m long`), so the
  default run stays within the CI budget.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from longctx_cli.home import longctx_home
from longctx_cli.models import load_model

CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
LONG = os.environ.get("LONGCTX_LONG_TESTS") == "1"
TRITON_DEVICE = "cuda" if CUDA else "cpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: a Triton kernel test (CUDA, or TRITON_INTERPRET=1 on CPU)")
    if INTERPRETER:
        _interpreter_reads_one_element_indices()


def _interpreter_reads_one_element_indices() -> None:
    """Triton's interpreter turns a scalar used as an index (a loop bound read from memory) into an int with
    int() on a one-element array, which NumPy 2 refuses; read its element instead."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:  # another Triton: its interpreter is taken as it is
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def pytest_collection_modifyitems(config, items):
    run_long = LONG or "long" in (config.getoption("markexpr") or "")
    for item in items:
        if "long" in item.keywords and not run_long:
            item.add_marker(pytest.mark.skip(reason="a long test: LONGCTX_LONG_TESTS=1 runs it"))
        if "triton" in item.keywords:
            item.add_marker(pytest.mark.gpu)
            if not (CUDA or INTERPRETER):
                item.add_marker(pytest.mark.skip(reason="needs CUDA, or Triton's interpreter (TRITON_INTERPRET=1)"))
        elif "gpu" in item.keywords and not CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(autouse=True)
def _own_saved_states(tmp_path_factory, monkeypatch):
    """Saved document states go to a folder of the test's own: a state another run saved is never reused."""
    folder = tmp_path_factory.mktemp("home")
    monkeypatch.setattr("longctx_cli.states.longctx_home", lambda: folder)


@pytest.fixture(scope="session")
def lm():
    """The embedded Gemma 3 270M on CPU, fp32."""
    return load_model(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def story_text() -> str:
    from pathlib import Path

    return (Path(__file__).parent.parent / "samples" / "lighthouse.txt").read_text()


def run_cli(args: list[str], capsys, monkeypatch, stdin_text: str | None = None):
    """Runs `longctx ARGS` in-process; returns (exit code, stdout, stderr)."""
    import io

    from longctx_cli import entry

    monkeypatch.setattr(sys, "argv", ["longctx", *args])
    if stdin_text is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin_text.encode())))
    code = 0
    try:
        entry.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


QUESTION = "\n\nQuestion: What was the name of the schooner?\nAnswer:"


def make_engine(lm, name, **overrides):
    """An engine from a profile name plus overrides, on the given loaded model."""
    from engines import ENGINES
    from longctx_cli.profiles import resolve_profile

    profile = resolve_profile(name, overrides)
    return ENGINES[profile.engine](lm, profile.engine_config, profile.run, home=longctx_home())


def story_ids(lm, text: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BOS + the text repeated to n tokens, and the schooner question's ids."""
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    doc = torch.tensor([lm.tokenizer.bos_token_id, *(ids * (n // len(ids) + 1))[: n - 1]])
    return doc, torch.tensor(lm.tokenizer(QUESTION, add_special_tokens=False)["input_ids"])


def greedy_answer(engine, doc, question, n):
    """Prefill doc, then n greedy tokens after the question: (token ids, state)."""
    from engines.decoding import Sampler

    state = engine.prefill(doc, reserve=question.numel() + n)
    return list(engine.answer(state, question, n, Sampler())), state


def shipped_heads_match_scoring(model) -> None:
    """The package's scores for this model equal a fresh `score_heads` with its defaults."""
    import json

    from engines.ltri.heads import SHIPPED, heads_key, score_heads

    shipped = json.loads((SHIPPED / f"{heads_key(model.model, model.name)}.json").read_text())["scores"]
    fresh = score_heads(model.model, model.tokenizer, [int(layer) for layer in shipped])
    assert sorted(fresh) == sorted(int(layer) for layer in shipped)
    for layer, scores in fresh.items():
        assert scores == pytest.approx(shipped[str(layer)], abs=1e-6), layer


class Owner(SimpleNamespace):
    """A stand-in for the cache that owns a layer (layers hold their cache weakly: a SimpleNamespace cannot be)."""
