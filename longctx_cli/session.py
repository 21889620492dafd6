"""One run's loaded pieces and the two steps every document and question go through: read the document (prefill,
or its saved state) and answer one question. `longctx ask` and the Python API (api.py) both run on them."""

from __future__ import annotations

import itertools
import sys
import time

from rich.console import Console
from rich.markup import escape

from longctx_cli.clock import CLOCK
from longctx_cli.compiles import WATCH
from longctx_cli.errors import ConfigError, ContextTooLongError, ModelError
from longctx_cli.inputs import Document, iter_text, tokenize_stream
from longctx_cli.report import Report

err = Console(stderr=True)


class StdoutClosed(Exception):
    """The reader of stdout went away (`| head`): stop quietly, the report still goes to stderr."""


class Session:
    """Tokenizer, model and engine, loaded once and shared by every document and question of a run."""

    def __init__(self, opts):  # ask.AskOptions
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

    def ensure_engine(self, n_tokens: int | None = None):
        """The engine on the loaded model (loaded on first use; n_tokens: the first document's, question and
        answer included, which a model split over GPUs balances its layers' state for)."""
        if self.engine is None:
            from engines import ENGINES
            from engines.base import EngineInputError
            from longctx_cli.home import longctx_home
            from longctx_cli.models import load_model

            WATCH.install()
            with CLOCK.part("model load"):
                self.lm = load_model(self.opts.model, device=self.run.device, dtype=self.run.dtype,
                                     gpus_model=self.run.gpus_model, layer_state=self._layer_state(n_tokens),
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

    def _layer_state(self, n_tokens: int | None) -> list[int] | None:
        """The engine's planned bytes per layer for n_tokens, where the model is split over GPUs."""
        if not (self.run.gpus_model or 1) > 1 or n_tokens is None:
            return None
        from engines import ENGINES
        from longctx_cli.split import layer_state_bytes

        profile = self.opts.profile
        dtype_bytes = 4 if self.run.dtype == "float32" else 2  # auto is bf16 on the GPUs a split runs on
        return layer_state_bytes(ENGINES[profile.engine], self.config, n_tokens, dtype_bytes, profile.engine_config,
                                 chunk_size=self.run.chunk_size, reserve=self.run.max_new_tokens)


def document_ids(session: Session, docs: list[Document], layout):
    import torch

    pieces = itertools.chain.from_iterable(
        itertools.chain(iter_text(d, encoding_errors=session.opts.encoding_errors), ["\n\n"]) if i < len(docs) - 1
        else iter_text(d, encoding_errors=session.opts.encoding_errors) for i, d in enumerate(docs))
    ids = tokenize_stream(pieces, session.tokenizer, add_bos=False)
    return torch.cat([layout.prefix_ids.to(ids.dtype), ids])


def check_length(n_doc: int, n_question: int, run, max_context: int, name: str, profile=None) -> None:
    """Refuses (exit 6) a document longer than the model's context, unless the profile's engine re-assigns
    positions (ltri-stream, sas-pattern: engines/positions.py)."""
    from engines.config import STREAMING, reads_past_context

    if not max_context or n_doc + n_question + run.max_new_tokens <= max_context:
        return
    if profile is not None and reads_past_context(profile.engine, profile.engine_config):
        return
    if n_question + run.max_new_tokens >= max_context:
        raise ContextTooLongError(
            f"{name}: max_new_tokens {run.max_new_tokens:,} leaves no room for the document in the model's maximum "
            f"context of {max_context:,} tokens; lower --max-new-tokens")
    raise ContextTooLongError(
        f"{name}: prompt of {n_doc + n_question:,} tokens + {run.max_new_tokens} new tokens is longer than the "
        f"model's maximum context of {max_context:,} tokens; shorten or split the document, or use an engine that "
        f"reads past it: {' or '.join(STREAMING)} (--profile ltri-stream)")


def check_engine(session: Session, n_doc: int, reserve: int, name: str) -> None:
    """What the engine refuses for this model and document, found from the model's config before the weights
    load (e.g. a pattern that selects no key, a layer that does not retrieve)."""
    from engines import ENGINES
    from engines.base import DocumentTooLong, EngineInputError

    profile = session.opts.profile
    try:
        ENGINES[profile.engine].check(session.config, profile.engine_config, profile.run, n_doc, reserve)
    except DocumentTooLong as exc:
        raise ContextTooLongError(f"{name}: {exc}") from None
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
    engine = session.ensure_engine(ids.numel() + reserve)
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
                CLOCK.add_span("question", now - last)
            else:
                report.timings.decode_step_s.append(now - last)
                CLOCK.add_span("decode", now - last)
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
            report.counters = {**engine.counters(state), "compiled": WATCH.take()}
            report.memory = memory_snapshot(state.cache.nbytes())
        out.write(text.finish(), end=True)


def _progress(quiet: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    # Logs and pipes get no bar (it would print a line per refresh).
    return Progress(TextColumn("prefill {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeRemainingColumn(), console=err, transient=True, disable=quiet or not err.is_terminal)
