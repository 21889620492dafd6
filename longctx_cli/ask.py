"""`longctx ask`: documents in, one streamed answer and one report per (document, question) out.

`check_ask` refuses what can be refused before anything heavy loads (inputs, questions); `run_ask` then loads the
tokenizer, the model and the engine once and answers every question about every document.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from longctx_cli.clock import CLOCK
from longctx_cli.errors import (EXIT_PARTIAL, ConfigError, ContextTooLongError, InputError, LongctxError, ModelError,
                                OutOfMemoryError, is_out_of_memory, message)
from longctx_cli.inputs import Document, collect_documents, iter_text, sniff, tokenize_stream
from longctx_cli.report import Report

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


class StdoutClosed(Exception):
    """The reader of stdout went away (`| head`): stop quietly, the report still goes to stderr."""


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


class Session:
    """Tokenizer, model and engine, loaded once and shared by every document and question of a run."""

    def __init__(self, opts: AskOptions):
        from longctx_cli.models import check_dtype, load_config, load_tokenizer, max_context, quiet_libraries

        self.opts, self.run = opts, opts.profile.run
        if opts.quiet or not err.is_terminal:
            quiet_libraries()
        self.say = (lambda msg: None) if opts.quiet else (lambda msg: err.print(f"[dim]{escape(msg)}...[/]"))
        with CLOCK.part("config"):
            self.config = config = load_config(opts.model, progress=self.say)
        check_dtype(config, self.run.dtype, self.run.device)
        with CLOCK.part("tokenizer"):
            self.tokenizer = load_tokenizer(opts.model, progress=self.say)
        self.max_context = max_context(config)
        self.lm = None
        self.engine = None
        self.load_s = 0.0
        from longctx_cli.states import DocumentStates

        self.states = DocumentStates(opts.state, opts.model, opts.profile, self.run.state_cache_gib)

    def ensure_engine(self):
        if self.engine is None:
            from engines import ENGINES
            from engines.base import EngineInputError
            from longctx_cli.home import longctx_home
            from longctx_cli.models import load_model

            with CLOCK.part("model load"):
                self.lm = load_model(self.opts.model, device=self.run.device, dtype=self.run.dtype,
                                     tokenizer=self.tokenizer, progress=self.say)
            self.load_s = self.lm.load_s
            cls = ENGINES[self.opts.profile.engine]
            try:
                with CLOCK.part("engine build"):
                    self.engine = cls(self.lm, self.opts.profile.engine_config, self.run, home=longctx_home())
            except EngineInputError as exc:
                raise ConfigError(f"profile {self.opts.profile.name}: {exc}") from None
            except NotImplementedError as exc:
                raise ModelError(f"{exc} (model {self.lm.name})") from None
        return self.engine


def document_ids(session: Session, docs: list[Document], layout):
    import torch

    pieces = itertools.chain.from_iterable(
        itertools.chain(iter_text(d, encoding_errors=session.opts.encoding_errors), ["\n\n"]) if i < len(docs) - 1
        else iter_text(d, encoding_errors=session.opts.encoding_errors) for i, d in enumerate(docs))
    ids = tokenize_stream(pieces, session.tokenizer, add_bos=False)
    return torch.cat([layout.prefix_ids.to(ids.dtype), ids])


def check_length(n_doc: int, n_question: int, run, max_context: int, name: str) -> None:
    if not max_context or n_doc + n_question + run.max_new_tokens <= max_context:
        return
    if n_question + run.max_new_tokens >= max_context:
        raise ContextTooLongError(
            f"{name}: max_new_tokens {run.max_new_tokens:,} leaves no room for the document in the model's maximum "
            f"context of {max_context:,} tokens; lower --max-new-tokens")
    raise ContextTooLongError(
        f"{name}: prompt of {n_doc + n_question:,} tokens + {run.max_new_tokens} new tokens is longer than the "
        f"model's maximum context of {max_context:,} tokens; shorten or split the document (no engine reads past "
        "the model's trained context yet)")


def check_engine(session: Session, n_doc: int, reserve: int, name: str) -> None:
    """What the engine refuses for this model and document, found from the model's config before the weights
    load (e.g. a pattern that selects no key, a layer that does not retrieve)."""
    from engines import ENGINES
    from engines.base import EngineInputError

    profile = session.opts.profile
    try:
        ENGINES[profile.engine].check(session.config, profile.engine_config, profile.run, n_doc, reserve)
    except EngineInputError as exc:
        raise ConfigError(f"{name}: {exc}") from None


class AnswerOutput:
    """stdout for answers: the label goes out with the first piece (a failed document prints nothing), and a
    closed pipe becomes StdoutClosed."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled, self.started = label, enabled, False

    def write(self, piece: str, end: bool = False) -> None:
        if not self.enabled or not (piece or end or self.started):
            return
        try:
            if not self.started:
                sys.stdout.write(self.label)
                self.started = True
            sys.stdout.write(piece + ("\n" if end else ""))
            sys.stdout.flush()
        except BrokenPipeError:
            raise StdoutClosed from None


def read_document(session: Session, ids, reserve: int, report: Report):
    """The document's state: read from the saved-state store when it holds one for exactly these inputs,
    otherwise computed by prefill (and saved, for engines whose state can be reused)."""
    import torch

    from engines.base import EngineInputError
    from longctx_cli.report import reset_peaks

    opts = session.opts
    engine = session.ensure_engine()
    report.timings.load_s, session.load_s = session.load_s, 0.0  # the load shows in the first report only
    reset_peaks()
    saved = session.states.find(engine, ids, reserve, report)
    if saved is not None:
        return saved
    report.prefill_total = ids.numel()
    with _progress(opts.quiet) as bar:
        task = bar.add_task(escape(report.path), total=ids.numel())

        def advance(n: int) -> None:
            report.prefilled += n
            bar.advance(task, n)

        try:
            with CLOCK.part("prefill"):
                state = engine.prefill(ids, reserve=reserve, progress=advance)
        except EngineInputError as exc:
            raise ConfigError(f"{report.path}: {exc}") from None
    report.timings.prefill_s = state.prefill_s
    if not bool(torch.isfinite(state.last_logits).all()):
        dtype = str(session.lm.model.dtype).removeprefix("torch.")
        raise ConfigError(f"{report.path}: the model's activations overflowed in {dtype} "
                          "(non-finite logits after prefill); use --dtype bfloat16 or float32")
    session.states.keep(engine, state, ids, reserve, report)
    return state


def answer_question(session: Session, state, layout, report: Report, out: AnswerOutput) -> None:
    from engines.decoding import Sampler
    from longctx_cli.prompt import AnswerText
    from longctx_cli.report import memory_snapshot

    run, engine = session.run, session.engine
    text = AnswerText(session.tokenizer, layout.stop_strings, layout.stop_ids)
    sampler = Sampler(run.temperature, run.top_p, run.seed)
    start = time.perf_counter() - report.timings.prefill_s
    stream = engine.answer(state, layout.question_ids, run.max_new_tokens, sampler)
    report.stopped = "length"
    try:
        last = time.perf_counter()
        for i, token in enumerate(stream):
            now = time.perf_counter()
            if i == 0:
                report.timings.first_token_s = now - start
                CLOCK.add("question", now - last)
            else:
                report.timings.decode_step_s.append(now - last)
                CLOCK.add("decode", now - last)
            last = now
            report.tokens_out += 1
            report.answer_ids.append(token)
            out.write(text.feed(token))
            if text.done:
                report.stopped = "stop"
                break
    finally:
        stream.close()
        report.answer = text.answer
        with CLOCK.part("report"):
            report.counters = engine.counters(state)
            report.memory = memory_snapshot(state.cache.nbytes())
        out.write(text.finish(), end=True)


def _progress(quiet: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    # Logs and pipes get no bar (it would print a line per refresh).
    return Progress(TextColumn("prefill {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeRemainingColumn(), console=err, transient=True, disable=quiet or not err.is_terminal)


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
    for name, members in groups:
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
                check_length(ids.numel(), layout.question_ids.numel(), profile.run, session.max_context, name)
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
                _emit(report, opts)
        except (InputError, ContextTooLongError, ConfigError) as exc:
            failures.append(exc)
            for report in reports:
                if not report.stopped:
                    report.stopped, report.error = "error", message(exc)
                    if opts.json:
                        _emit(report, opts)
            if len(groups) == 1:
                raise
            err.print(f"[red]error:[/] {escape(message(exc))}", highlight=False, soft_wrap=True)
    if failures:
        err.print(f"[red]{len(failures)} of {len(groups)} documents failed[/]")
        return failures[0].exit_code if len(failures) == len(groups) else EXIT_PARTIAL
    return 0


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
