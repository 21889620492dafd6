"""The Python API answers as the command line does, reading the document once for several questions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longctx_cli.api import Longctx
from longctx_cli.errors import InputError, UsageError
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).parent.parent / "samples" / "lighthouse.txt"
QUESTIONS = ["What was the name of the schooner?", "Who kept the lighthouse?"]


def test_api_answers_as_the_cli_and_reads_once(capsys, monkeypatch, tmp_path):
    # The story's first six paragraphs (~620 tokens): the keeper, and the storm that brings the schooner.
    doc = tmp_path / "story.txt"
    doc.write_text("\n\n".join(SAMPLE.read_text(encoding="utf-8").split("\n\n")[:6]) + "\n", encoding="utf-8")
    code, out, err = run_cli(["ask", str(doc), *[a for q in QUESTIONS for a in ("-q", q)], "-n", "8", "--json",
                              "--state", "off"], capsys, monkeypatch)
    assert code == 0, err
    cli = [json.loads(line) for line in out.splitlines()]
    lc = Longctx("dense", settings={"max_new_tokens": 8}, state="off")
    book = lc.read(doc)
    first, second = (book.ask(q) for q in QUESTIONS)
    assert [first.report.answer_ids, second.report.answer_ids] == [o["answer_ids"] for o in cli]
    assert "Margaret" in first.text and first.report.timings.prefill_s > 0
    assert second.report.timings.prefill_s == 0.0 and second.report.state.startswith("kept")


def test_api_refuses_bad_input(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    lc = Longctx("dense")
    with pytest.raises(InputError, match="empty document"):
        lc.read(empty)
    with pytest.raises(UsageError):
        lc.read_text("Some text.").ask("  ")
