"""`longctx ask`: documents in, one streamed answer and one report per (document, question) out.

`check_ask` refuses what can be refused before anything heavy loads (inputs, questions); `run_ask` then loads the
tokenizer, the model and the engine once and answers every question about every document.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from longctx_cli.clock import CLOCK
from longctx_cli.errors import (EXIT_PARTIAL, ConfigError, ContextTooLongError, InputError, LongctxError,
                                OutOfMemoryError, is_out_of_memory, message)
from longctx_cli.inputs import Document, collect_documents, sniff
from longctx_cli.report import Report
from longctx_cli.session import (AnswerOutput, Session, StdoutClosed, answer_question, check_engine, check_length,
                                 document_ids, read_document)

err = Console(stderr=True)


@dataclass
class AskOptions:
    paths: list[str]
    questions: list[str]
    profile: object  # profiles.Profile
    model: str | None = None
    glob: str = "*.txt,*.md"
    concat: bool = False
    json: bool = False
    encoding_errors: str = "strict"
    layout: str = "auto"
    quiet: bool = False
    state: str = "auto"  # saved document states: auto, off, read or write
    documents: list[Document] = field(default_factory=list)  # filled by check_ask


def check_ask(opts: AskOptions) -> None:
    """Everything about the inputs that needs no model: paths exist, files are not empty, binary or mis-encoded
    at their start. A document found bad is kept with its error (a multi-document run reports it and goes on);
    when every document is bad, the first error is raised here, before any weights load."""
    docs = collect_documents(opts.paths, glob=opts.glob, strict=False)
    for doc in docs:
        doc.error = sniff(doc, opts.encoding_errors)
    bad = [d for d in docs if d.error is not None]
    if bad and (len(bad) == len(docs) or opts.concat):
        raise bad[0].error
    opts.documents = docs


def _oom_error(exc: BaseException, session: Session, n_tokens: int) -> OutOfMemoryError:
    from longctx_cli.models import load_config
    from longctx_cli.plan import estimate

    try:
        est = estimate(session.opts.profile, load_config(session.opts.model), n_tokens)
        per_device = [f"{d} needs ~{est['need'][d] / 2**30:.1f} GiB, {est['free'][d] / 2**30:.1f} GiB free now"
                      for d in est["need"]]
    except Exception:  # noqa: BLE001 - the estimate is advice; the OOM is the error to report
        per_device = []
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return OutOfMemoryError(
        f"out of memory ({first[:160]}); {'; '.join(per_device) or 'no estimate'}. Lower chunk_size (--chunk-size), "
        "use a sparser profile, run `longctx plan` first, or spread the model over more GPUs")


def run_ask(opts: AskOptions) -> int:
    """Answers every question about every document; returns the exit code: 0; 8 when some documents failed and
    others were answered; the first failure's code when all failed. Raises for errors that end the run."""
    from longctx_cli.prompt import build_layout

    docs = opts.documents or collect_documents(opts.paths, glob=opts.glob, strict=False)
    groups = [(" + ".join(d.name for d in docs), docs)] if opts.concat else [(d.name, [d]) for d in docs]
    session = Session(opts)
    profile = opts.profile
    with CLOCK.part("prompt layout"):
        layouts = [build_layout(session.tokenizer, q, profile.run.stop, layout=opts.layout) for q in opts.questions]
    failures: list[LongctxError] = []
    for g, (name, members) in enumerate(groups):
        last_document = g == len(groups) - 1
        reports = [Report(name, q, profile.engine, opts.model or "gemma3-270m",
                          bool(opts.model and opts.model.startswith("random:"))) for q in opts.questions]
        try:
            if members[0].error is not None:
                raise members[0].error
            began = time.perf_counter()
            with CLOCK.part("tokenize"):
                ids = document_ids(session, members, layouts[0])
            reports[0].timings.tokenize_s = time.perf_counter() - began  # the document is tokenized once
            for layout, report in zip(layouts, reports):
                report.tokens_in = ids.numel() + layout.question_ids.numel()
                # Refused before any weights are loaded.
                check_length(ids.numel(), layout.question_ids.numel(), profile.run, session.max_context, name,
                             profile)
            reserve = max(layout.question_ids.numel() for layout in layouts) + profile.run.max_new_tokens
            check_engine(session, ids.numel(), reserve, name)
            state = checkpoint = None
            for layout, report in zip(layouts, reports):
                labels = [name] if len(groups) > 1 else []
                labels += [report.question] if len(layouts) > 1 else []
                out = AnswerOutput("".join(f"{x}: " for x in labels), not opts.json)
                if state is None:
                    state = _guarded(session, report, lambda: read_document(session, ids, reserve, report))
                    checkpoint = session.engine.checkpoint(state) if session.engine.reusable else None
                else:
                    report.state = "kept from the first question (checkpoint and restore)"
                    report.timings.load_s = 0.0
                _guarded(session, report, lambda: answer_question(session, state, layout, report, out))
                if checkpoint is not None:
                    session.engine.restore(state, checkpoint)
                else:
                    state = None  # this engine's answer changes its state: the next question reads again
                if report is reports[-1]:
                    _state_written(session, report, last_document)
                _emit(report, opts)
        except (InputError, ContextTooLongError, ConfigError) as exc:
            failures.append(exc)
            if last_document:
                session.states.wait()  # the state before, counted in this document's report
            for report in reports:
                if not report.stopped:
                    report.stopped, report.error = "error", message(exc)
                    if opts.json:
                        _emit(report, opts)
            if len(groups) == 1:
                raise
            err.print(f"[red]error:[/] {escape(message(exc))}", highlight=False, soft_wrap=True)
    session.states.wait()  # one left by a last document that failed
    if failures:
        err.print(f"[red]{len(failures)} of {len(groups)} documents failed[/]")
        return failures[0].exit_code if len(failures) == len(groups) else EXIT_PARTIAL
    return 0


def _state_written(session: Session, report: Report, last_document: bool) -> None:
    """The document's state is written beside its answers: the last document's last report waits for it; an
    earlier document's write goes on beside the next document's prefill (its keep joins it, and its report's
    wall clock holds the wait)."""
    if last_document:
        _guarded(session, report, lambda: session.states.wait(report))
    else:
        session.states.carry_on(report)


def _guarded(session: Session, report: Report, step):
    """Runs step(); on Ctrl-C, SIGTERM or a closed stdout the partial answer and report go out before it ends
    the run; out of memory becomes the error that says what to change."""
    opts = session.opts
    try:
        return step()
    except (KeyboardInterrupt, StdoutClosed) as exc:
        report.stopped = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stdout closed"
        _emit(report, opts, stdout=not isinstance(exc, StdoutClosed))
        raise
    except (MemoryError, RuntimeError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        if is_out_of_memory(exc):
            raise _oom_error(exc, session, report.tokens_in) from None
        raise


def _emit(report: Report, opts: AskOptions, stdout: bool = True) -> None:
    from longctx_cli.report import render

    report.timings.wall = CLOCK.take()
    if opts.json and stdout:
        try:
            sys.stdout.write(json.dumps(report.as_json()) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            raise StdoutClosed from None
    elif not opts.quiet and not opts.json:
        render(report, err)
