"""The Python API, on the command line's own path (the same Session, prefill, saved states and answer loop):
load a model and a profile once, read documents (or their saved states), ask any number of questions.

    from longctx_cli.api import Longctx

    lc = Longctx(profile="resa")                 # the embedded model; model="./Llama-3.1-8B-Instruct" etc.
    book = lc.read("book.txt")                   # or lc.read_text("...")
    for question in ("Who hid the letter?", "When?"):
        answer = book.ask(question)
        print(answer.text, answer.report.timings.first_token_s)

Errors are the command line's (`longctx_cli.errors.LongctxError` and its subclasses, each with `exit_code`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from longctx_cli.ask import AskOptions, check_ask
from longctx_cli.session import (AnswerOutput, Session, answer_question, check_engine, check_length, document_ids,
                                 read_document)
from longctx_cli.report import Report

# Room kept after the document for questions up to this many tokens (a longer one reads the document again, from
# its saved state where there is one).
QUESTION_ROOM = 256


@dataclass
class Answer:
    text: str
    report: Report  # timings (wall-clock parts included), memory, the engine's counters, the state line


class Longctx:
    """One model and one profile, loaded on first use and kept for every document and question."""

    def __init__(self, profile: str = "dense", model: str | None = None, *, settings: dict | None = None,
                 state: str = "auto", layout: str = "auto", encoding_errors: str = "strict"):
        """settings: profile keys, as `--set` takes them (e.g. {"chunk_size": 4096, "max_new_tokens": 32});
        state: saved document states, auto | off | read | write."""
        from longctx_cli.home import check_home, keep_compile_caches
        from longctx_cli.models import check_model_spec
        from longctx_cli.profiles import resolve_profile

        keep_compile_caches(check_home())
        check_model_spec(model)
        self.opts = AskOptions([], [], resolve_profile(profile, dict(settings or {})), model=model, json=True,
                               encoding_errors=encoding_errors, layout=layout, quiet=True, state=state)
        self._session: Session | None = None

    @property
    def session(self) -> Session:
        if self._session is None:
            self._session = Session(self.opts)
        return self._session

    def read(self, *paths: str | Path) -> "Document":
        """Files (several: one document, joined by blank lines, as `--concat`); read on the first question."""
        opts = AskOptions([str(p) for p in paths], [], self.opts.profile, encoding_errors=self.opts.encoding_errors,
                          concat=True)
        check_ask(opts)
        name = " + ".join(d.name for d in opts.documents)
        return Document(self, name, opts.documents)

    def read_text(self, text: str, name: str = "<text>") -> "Document":
        folder = Path(tempfile.mkdtemp(prefix="longctx-"))
        path = folder / "document.txt"
        path.write_text(text, encoding="utf-8")
        document = self.read(path)
        document.name = name
        return document


class Document:
    """A document read once: its state is computed (or loaded) on the first question and kept for the next."""

    def __init__(self, lc: Longctx, name: str, members: list):
        self.lc, self.name, self.members = lc, name, members
        self.ids = None
        self.state = None
        self.checkpoint = None
        self.reserve = 0

    def ask(self, question: str) -> Answer:
        from longctx_cli.errors import UsageError
        from longctx_cli.prompt import build_layout

        if not question.strip():
            raise UsageError("empty question")
        session = self.lc.session
        run = session.run
        layout = build_layout(session.tokenizer, question, run.stop, layout=self.lc.opts.layout)
        report = Report(self.name, question, self.lc.opts.profile.engine, self.lc.opts.model or "gemma3-270m",
                        bool(self.lc.opts.model and self.lc.opts.model.startswith("random:")))
        if self.ids is None:
            began = time.perf_counter()
            self.ids = document_ids(session, self.members, layout)
            report.timings.tokenize_s = time.perf_counter() - began
        report.tokens_in = self.ids.numel() + layout.question_ids.numel()
        need = layout.question_ids.numel() + run.max_new_tokens
        if self.state is None or need > self.reserve:
            self.reserve = max(need, QUESTION_ROOM + run.max_new_tokens)
            check_length(self.ids.numel(), layout.question_ids.numel(), run, session.max_context, self.name,
                         self.lc.opts.profile)
            check_engine(session, self.ids.numel(), self.reserve, self.name)
            self.state = read_document(session, self.ids, self.reserve, report)
            engine = session.engine
            self.checkpoint = engine.checkpoint(self.state) if engine.reusable else None
        else:
            report.state = "kept from an earlier question (checkpoint and restore)"
        answer_question(session, self.state, layout, report, AnswerOutput("", False))
        session.states.wait(report)  # the state saved beside the answer
        if self.checkpoint is not None:
            session.engine.restore(self.state, self.checkpoint)
        else:
            self.state = None  # this engine's answer changes its state: the next question reads again
        return Answer(report.answer, report)
