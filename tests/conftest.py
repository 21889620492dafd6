"""Shared fixtures: the embedded model, loaded once per test session (converted on first use)."""

from __future__ import annotations

import sys

import pytest
import torch

from longctx_cli.models import load_model



def gpu(test):
    """Marks a test `gpu` (selected by `-m gpu` on the device) and skips it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


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

    from longctx_cli import cli

    monkeypatch.setattr(sys, "argv", ["longctx", *args])
    if stdin_text is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin_text.encode())))
    code = 0
    try:
        cli.main()
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
    return ENGINES[profile.engine](lm, profile.engine_config, profile.run)


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
