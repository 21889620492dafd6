"""`longctx ask`: documents in, one streamed answer and one report per document out."""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from engines import ENGINES
from engines.decoding import Sampler
from engines.base import EngineInputError
from longctx_cli.errors import ConfigError, ContextTooLongError, InputError, OutOfMemoryError, is_out_of_memory
from longctx_cli.inputs import Document, collect_documents, iter_text, tokenize_stream
from longctx_cli.models import load_config, load_model, load_tokenizer, max_context
from longctx_cli.prompt import AnswerText, build_layout
from longctx_cli.report import Report, memory_snapshot, render, reset_peaks

err = Console(stderr=True)


@dataclass
class AskOptions:
    paths: list[str]
    question: str
    profile: object  # profiles.Profile
    model: str | None = None
    glob: str = "*.txt,*.md"
    concat: bool = False
    json: bool = False
    encoding_errors: str = "strict"
    layout: str = "auto"
    quiet: bool = False


class Session:
    """Lazily loaded tokenizer, model and engine, shared by every document of a run."""

    def __init__(self, opts: AskOptions):
        self.opts, self.run = opts, opts.profile.run
        self.say = (lambda msg: None) if opts.quiet else (lambda msg: err.print(f"[dim]{msg}...[/]"))
        self.tokenizer = load_tokenizer(opts.model, progress=self.say)
        self.max_context = max_context(load_config(opts.model))
        self.lm = None
        self.engine = None

    def ensure_engine(self):
        if self.engine is None:
            self.lm = load_model(self.opts.model, device=self.run.device, dtype=self.run.dtype,
                                 tokenizer=self.tokenizer, progress=self.say)
            cls = ENGINES[self.opts.profile.engine]
            self.engine = cls(self.lm, self.opts.profile.engine_config, self.run)
        return self.engine


def _document_ids(session: Session, docs: list[Document], layout) -> torch.Tensor:
    pieces = itertools.chain.from_iterable(
        itertools.chain(iter_text(d, encoding_errors=session.opts.encoding_errors), ["\n\n"]) if i < len(docs) - 1
        else iter_text(d, encoding_errors=session.opts.encoding_errors) for i, d in enumerate(docs))
    ids = tokenize_stream(pieces, session.tokenizer, add_bos=False)
    return torch.cat([layout.prefix_ids.to(ids.dtype), ids])


def _check_length(n_doc: int, layout, run, max_context: int, engine: str, name: str) -> None:
    need = n_doc + layout.question_ids.numel() + run.max_new_tokens
    if max_context and need > max_context:
        raise ContextTooLongError(
            f"{name}: prompt of {n_doc + layout.question_ids.numel():,} tokens + {run.max_new_tokens} new tokens is "
            f"longer than the model's maximum context of {max_context:,} tokens for engine '{engine}'; "
            "shorten the document, or use an engine that streams past the model's context")


def _answer_one(session: Session, name: str, docs: list[Document], layout, report: Report, out) -> None:
    opts, run = session.opts, session.run
    t0 = time.perf_counter()
    ids = _document_ids(session, docs, layout)
    report.timings.tokenize_s = time.perf_counter() - t0
    report.tokens_in = ids.numel() + layout.question_ids.numel()
    # Refused before any weights are loaded.
    _check_length(ids.numel(), layout, run, session.max_context, opts.profile.engine, name)
    engine = session.ensure_engine()
    report.timings.load_s = session.lm.load_s
    reset_peaks()
    state = None
    with Progress(TextColumn("prefill {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=err, transient=True, disable=opts.quiet) as bar:
        task = bar.add_task(name, total=ids.numel())
        start = time.perf_counter()
        try:
            state = engine.prefill(ids, reserve=layout.question_ids.numel() + run.max_new_tokens,
                                   progress=lambda n: bar.advance(task, n))
        except EngineInputError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    report.timings.prefill_s = state.prefill_s
    text = AnswerText(session.tokenizer, layout.stop_strings, layout.stop_ids)
    sampler = Sampler(run.temperature, run.top_p, run.seed)
    stream = engine.answer(state, layout.question_ids, run.max_new_tokens, sampler)
    report.stopped = "length"
    try:
        last = time.perf_counter()
        for i, token in enumerate(stream):
            now = time.perf_counter()
            if i == 0:
                report.timings.first_token_s = now - start
            else:
                report.timings.decode_step_s.append(now - last)
            last = now
            report.tokens_out += 1
            report.answer_ids.append(token)
            piece = text.feed(token)
            if piece and not opts.json:
                out.write(piece)
                out.flush()
            if text.done:
                report.stopped = "stop"
                break
    finally:
        stream.close()
        if not opts.json:
            out.write(text.finish() + "\n")
            out.flush()
        report.answer = text.answer
        report.counters = engine.counters(state)
        report.memory = memory_snapshot(state.cache.nbytes())


def _oom_error(exc: BaseException, session: Session, n_tokens: int) -> OutOfMemoryError:
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
    """Answers every document; returns the exit code (0, or 8 when some documents failed)."""
    docs = collect_documents(opts.paths, glob=opts.glob)
    groups = [(" + ".join(d.name for d in docs), docs)] if opts.concat else [(d.name, [d]) for d in docs]
    session = Session(opts)
    profile = opts.profile
    layout = build_layout(session.tokenizer, opts.question, profile.run.stop, layout=opts.layout)
    failures = 0
    for name, members in groups:
        report = Report(name, opts.question, profile.engine, opts.model or "gemma3-270m",
                        bool(opts.model and opts.model.startswith("random:")))
        if len(groups) > 1 and not opts.json:
            sys.stdout.write(f"{name}: ")
        try:
            _answer_one(session, name, members, layout, report, sys.stdout)
        except KeyboardInterrupt:
            report.stopped = "interrupted"
            _emit(report, opts)
            raise
        except (MemoryError, RuntimeError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if is_out_of_memory(exc):
                raise _oom_error(exc, session, report.tokens_in) from None
            raise
        except (InputError, ContextTooLongError, ConfigError) as exc:
            if len(groups) == 1:
                raise
            failures += 1
            report.stopped, report.error = "error", str(exc)
            err.print(f"[red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            if not opts.json:
                sys.stdout.write("\n")
        _emit(report, opts)
    if failures:
        err.print(f"[red]{failures} of {len(groups)} documents failed[/]")
    return 8 if failures else 0


def _emit(report: Report, opts: AskOptions) -> None:
    if opts.json:
        sys.stdout.write(json.dumps(report.as_json()) + "\n")
        sys.stdout.flush()
    elif not opts.quiet:
        render(report, err)

