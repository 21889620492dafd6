"""Command line: `longctx ask | bench | plan | profiles`. Answers on stdout, everything else on stderr."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from longctx_cli import __version__
from longctx_cli.clock import CLOCK
from longctx_cli.errors import (EXIT_INTERRUPTED, EXIT_PIPE, EXIT_TERMINATED, ConfigError, Interrupted, LongctxError,
                                Terminated, UsageError, clip, message)

app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Ask questions of very long documents.", pretty_exceptions_enable=False)
profiles_app = typer.Typer(help="List profiles, or show one's resolved settings.", invoke_without_command=True)
app.add_typer(profiles_app, name="profiles")
states_app = typer.Typer(help="List or remove saved document states ($LONGCTX_HOME/states).",
                         invoke_without_command=True)
app.add_typer(states_app, name="states")
err = Console(stderr=True)
DEBUG = {"on": False}

ProfileOpt = Annotated[str, typer.Option("--profile", "-p", help="Profile name (see `longctx profiles`) or YAML path.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="HF folder, cached hub id, .gguf file or random:PRESET (default: embedded Gemma 3 270M).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override any profile key: --set chunk_size=4096.")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16.")]
ChunkOpt = Annotated[Optional[int], typer.Option("--chunk-size", help="Prefill chunk length in tokens.")]
GpusOpt = Annotated[int, typer.Option(
    "--gpus", help="Star only: run N ranks on this host, one per GPU (gloo processes with --device cpu).")]
MaxNewOpt = Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Answer length limit.")]


def _signals(command):
    """Ctrl-C and SIGTERM inside a command reach `main` as Interrupted, which says so and exits 130 / 143."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise Interrupted(isinstance(exc, Terminated)) from None

    return run


def _version(value: bool):
    if value:
        print(f"longctx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")]
    = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
):
    DEBUG["on"] = debug or bool(os.environ.get("LONGCTX_DEBUG"))


def _profile(name: str, sets: list[str] | None, only_known: bool = False, **flags):
    """Resolve a profile with --set overrides and flags; only_known (a bench baseline) drops the --set keys its
    engine does not have, so `--set block_size=...` tunes the engine under test without breaking dense."""
    from engines.config import CONFIGS
    from longctx_cli.profiles import RunSettings, parse_override, resolve_profile

    overrides = dict(parse_override(s) for s in sets or [])
    if only_known:
        engine = resolve_profile(name, {}).engine
        known = {f.name for f in dataclasses.fields(RunSettings)} | {
            f.name for f in dataclasses.fields(CONFIGS[engine])}
        overrides = {k: v for k, v in overrides.items() if k in known}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return resolve_profile(name, overrides)


def _ranks(prof, gpus: int, model: str | None) -> bool:
    """--gpus N: start N ranks running this same command (and exit with their code), or, inside a rank, join
    the world. Returns whether this process must stay quiet (a rank other than the query rank)."""
    from longctx_cli import distributed

    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, not {gpus}")
    if (gpus > 1 or distributed.in_world()) and prof.engine != "star":
        raise ConfigError(f"several ranks (--gpus {gpus}) need the star engine, not {prof.engine!r}: --profile star")
    if gpus > 1 and not distributed.in_world():
        from longctx_cli.models import resolve_model_dir

        resolve_model_dir(model)  # convert the embedded model once, before the ranks load it
        raise typer.Exit(distributed.launch(distributed.strip_option(sys.argv[1:], "--gpus"), gpus,
                                            prof.run.device))
    if not distributed.in_world():
        return False
    prof.run.device = distributed.rank_device(prof.run.device)
    distributed.init(prof.run.device)
    distributed.prepare_model(model)
    return distributed.quiet_unless_query_rank()


@app.command()
@_signals
def ask(
    paths: Annotated[Optional[list[str]], typer.Argument(
        help="Files, folders or - (stdin); without -q, the question comes last.", show_default=False)] = None,
    questions: Annotated[Optional[list[str]], typer.Option(
        "--question", "-q", help="A question (repeatable: each is answered about every document).")] = None,
    questions_file: Annotated[Optional[str], typer.Option(
        "--questions", help="A file of questions, one per line (- reads them from stdin).")] = None,
    profile: ProfileOpt = "dense",
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = None,
    chunk_size: ChunkOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy.")] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    sets: SetOpt = None,
    glob: Annotated[str, typer.Option(help="Patterns for files inside folders, comma-separated.")] = "*.txt,*.md",
    concat: Annotated[bool, typer.Option(help="Treat all inputs as one document.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per answer on stdout.")] = False,
    encoding_errors: Annotated[str, typer.Option(help="strict, replace or ignore for invalid UTF-8.")] = "strict",
    layout: Annotated[str, typer.Option(help="auto, chat (template) or plain (Question:/Answer:).")] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", help="No report, no progress bars.")] = False,
    state: Annotated[str, typer.Option(
        help="Saved document states: auto (reuse if saved, else compute and save), off, read or write.")] = "auto",
    gpus: GpusOpt = 1,
):
    """Answer each question about each document (or about all of them with --concat)."""
    from longctx_cli import distributed
    from longctx_cli.ask import AskOptions, check_ask, run_ask
    from longctx_cli.home import check_home
    from longctx_cli.models import check_model_spec
    paths, asked = _questions(list(paths or []), questions, questions_file)
    if encoding_errors not in ("strict", "replace", "ignore"):
        raise UsageError(f"--encoding-errors must be strict, replace or ignore, not {clip(encoding_errors)}")
    if layout not in ("auto", "chat", "plain"):
        raise UsageError(f"--layout must be auto, chat or plain, not {clip(layout)}")
    if state not in ("auto", "off", "read", "write"):
        raise UsageError(f"--state must be auto, off, read or write, not {clip(state)}")
    check_home()
    opts = AskOptions(paths, asked, None, model=model, glob=glob, concat=concat, json=json_out,
                      encoding_errors=encoding_errors, layout=layout, quiet=quiet, state=state)
    with CLOCK.part("checks"):
        check_ask(opts)
        check_model_spec(model)
        # Profiles are read from the engines' configurations alone, before torch and transformers load.
        opts.profile = _profile(profile, sets, max_new_tokens=max_new_tokens, chunk_size=chunk_size,
                                device=device, dtype=dtype, temperature=temperature, top_p=top_p, seed=seed)
    with CLOCK.part("imports"):
        from engines import ENGINES  # noqa: F401 - torch and transformers come with it: seconds, counted as such
    opts.quiet = _ranks(opts.profile, gpus, model) or quiet
    code = run_ask(opts)
    distributed.finish()
    raise typer.Exit(code)


def _questions(paths: list[str], questions: list[str] | None, questions_file: str | None) -> tuple[list[str],
                                                                                                    list[str]]:
    """(document paths, questions) from the positional arguments, -q and --questions (usage errors: exit 2)."""
    asked = list(questions or [])
    if questions_file is not None:
        if questions_file == "-" and "-" in paths:
            raise UsageError("stdin cannot hold both the document and the questions: give the questions with -q "
                             "or --questions FILE")
        asked += _read_questions(questions_file)
    if not asked:
        if len(paths) < 2:
            raise UsageError("give a document path and then the question (longctx ask FILE QUESTION), or the "
                             "question with -q: longctx ask -q QUESTION FILE...")
        question = paths.pop()
        if os.path.exists(question):
            raise UsageError(f"the last argument {clip(question)} is a file, so the question seems to be missing; "
                             "give it last or with -q: longctx ask FILE... -q QUESTION")
        asked = [question]
    if not paths:
        raise UsageError("no document given: longctx ask FILE|FOLDER|- -q QUESTION")
    if any(not q.strip() for q in asked):
        raise UsageError("empty question: ask something, e.g. -q \"Who hid the letter?\"")
    return paths, asked


def _read_questions(source: str) -> list[str]:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--questions {clip(source)}: cannot read it ({exc})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"--questions {clip(source)}: no question in it (one per line)")
    return lines


@app.command()
@_signals
def bench(
    profile: ProfileOpt = "dense",
    model: ModelOpt = None,
    lengths: Annotated[str, typer.Option(help="Context lengths, e.g. 4k,32k,128k.")] = "1k,4k",
    compare: Annotated[Optional[str], typer.Option(help="Baseline profile run on the same inputs ('none' to skip).")]
    = "dense",
    steps: Annotated[int, typer.Option(help="Decode steps timed per length (after warm-up).")] = 32,
    warmup: Annotated[str, typer.Option(
        help="Speed mode: tokens of the warm-up run before each measured one: 'same' (the whole context), a count "
             "such as 16k (its first tokens: enough for engines whose shapes do not grow with the document, e.g. "
             "ltri-stream at 1M; an engine that compiles per length then compiles inside the measured run), "
             "or 0 (none).")] = "same",
    sets: SetOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    chunk_size: ChunkOpt = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the results as JSON to this file (- = stdout).")]
    = None,
    tasks: Annotated[Optional[str], typer.Option(
        help="Accuracy mode: RULER-style tasks, comma-separated (niah_single_1..3, niah_multikey, niah_multivalue, "
             "niah_multiquery, vt, cwe, fwe, or 'all').")] = None,
    samples: Annotated[int, typer.Option(help="Accuracy mode: samples per task and length.")] = 10,
    seed: Annotated[int, typer.Option(help="Accuracy mode: sample seed.")] = 0,
    depths: Annotated[Optional[str], typer.Option(help="Accuracy mode: needle depths 0..1, comma-separated.")] = None,
    plot: Annotated[Optional[str], typer.Option(help="Accuracy mode: write charts to this PNG/PDF (matplotlib).")]
    = None,
    max_new_tokens: MaxNewOpt = None,
    layout: Annotated[str, typer.Option(help="auto, chat (template) or plain (Question:/Answer:).")] = "auto",
    gpus: GpusOpt = 1,
):
    """Speed (synthetic contexts) or, with --tasks, accuracy of a profile's engine next to the dense baseline."""
    from longctx_cli.home import check_home

    check_home()
    from longctx_cli import distributed
    from longctx_cli.bench import run_bench
    from longctx_cli.tasks import TASKS

    task_list = None
    if tasks:
        task_list = list(TASKS) if tasks == "all" else [t.strip() for t in tasks.split(",") if t.strip()]
        unknown = [t for t in task_list if t not in TASKS]
        if unknown:
            raise ConfigError(f"unknown task {unknown[0]!r}; choose from: {', '.join(TASKS)} (or all)")
    if plot:
        from longctx_cli.accuracy import pyplot

        pyplot()
    try:
        depth_list = [float(d) for d in depths.split(",")] if depths else None
    except ValueError:
        raise ConfigError(f"--depths takes numbers between 0 and 1, comma-separated, not {depths!r}") from None
    from longctx_cli.units import parse_count

    warmup_tokens = None if warmup == "same" else parse_count(warmup)
    if warmup_tokens is not None and warmup_tokens < 0:
        raise ConfigError(f"--warmup takes 'same' or a token count such as 16k, not {warmup!r}")
    prof = _profile(profile, sets, device=device, dtype=dtype, chunk_size=chunk_size, max_new_tokens=max_new_tokens)
    _ranks(prof, gpus, model)
    base = None if compare in (None, "none", "") or compare == profile else _profile(
        compare, sets, only_known=True, device=device, dtype=dtype, chunk_size=chunk_size, max_new_tokens=max_new_tokens)
    run_bench(prof, base, model=model, lengths=lengths, steps=steps, warmup_tokens=warmup_tokens, json_path=json_out,
              argv=sys.argv, tasks=task_list, samples=samples, seed=seed, depths=depth_list, plot_path=plot, layout=layout)
    distributed.finish()


@app.command()
@_signals
def plan(
    paths: Annotated[Optional[list[str]], typer.Argument(help="Documents (or give --tokens).")] = None,
    profile: ProfileOpt = "dense",
    model: ModelOpt = None,
    tokens: Annotated[Optional[str], typer.Option(help="Plan for this many tokens instead, e.g. 128k.")] = None,
    sets: SetOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    chunk_size: ChunkOpt = None,
    max_new_tokens: MaxNewOpt = None,
):
    """Predict memory per device before loading any weights, with a verdict."""
    from longctx_cli.home import check_home

    check_home()
    from longctx_cli.plan import run_plan

    prof = _profile(profile, sets, device=device, dtype=dtype, chunk_size=chunk_size, max_new_tokens=max_new_tokens)
    raise typer.Exit(run_plan(prof, model=model, paths=paths or [], tokens=tokens))


@profiles_app.callback()
def profiles_list(ctx: typer.Context):
    """List the built-in profiles."""
    if ctx.invoked_subcommand is None:
        from longctx_cli.profiles import list_profiles

        for name, description in list_profiles():
            print(f"{name:<24} {description}")


@profiles_app.command("show")
def profiles_show(name: Annotated[str, typer.Argument(help="Profile name or YAML path.")],
                  sets: SetOpt = None):
    """Print a profile's resolved settings (defaults < profile < --set)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    # Stop strings hold newlines: print them escaped ("\n\n"), not as folded multi-line scalars.
    Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                                style='"' if "\n" in s else None))
    print(yaml.dump(_profile(name, sets).as_dict(), Dumper=Dumper, sort_keys=False), end="")


@states_app.callback()
def states_list(ctx: typer.Context):
    """List saved states, least recently used first: key, size, last use, engine, model, document."""
    if ctx.invoked_subcommand is not None:
        return
    import datetime as dt

    from longctx_cli.home import check_home
    from longctx_cli.report import gib
    from longctx_cli.states import StateStore

    check_home()
    store = StateStore()
    entries = store.entries()
    for e in entries:
        inputs = e.header.get("inputs", {})
        used = dt.datetime.fromtimestamp(e.used).strftime("%Y-%m-%d %H:%M")
        print(f"{e.key}  {gib(e.bytes):>10}  {used}  {inputs.get('engine', '?'):<12} {inputs.get('model', '?')}  "
              f"{e.header.get('meta', {}).get('document', '?')} ({inputs.get('tokens', '?')} tokens)")
    err.print(f"{len(entries)} states, {gib(sum(e.bytes for e in entries))} in {store.root}")


@states_app.command("rm")
def states_rm(keys: Annotated[Optional[list[str]], typer.Argument(help="Keys (or unique prefixes) to remove.")]
              = None,
              all_: Annotated[bool, typer.Option("--all", help="Remove every saved state.")] = False):
    """Remove saved states by key, or all of them."""
    from longctx_cli.home import check_home
    from longctx_cli.states import StateStore

    check_home()
    if not keys and not all_:
        raise UsageError("give the keys to remove (see `longctx states`) or --all")
    store = StateStore()
    known = [e.key for e in store.entries()]
    chosen = known if all_ else []
    for key in keys or []:
        matches = [k for k in known if k.startswith(key)]
        if len(matches) != 1:
            raise UsageError(f"{'no' if not matches else 'more than one'} saved state matches {clip(key)}")
        chosen += matches
    for key in chosen:
        store.remove(key)
    err.print(f"removed {len(chosen)} state{'s' * (len(chosen) != 1)}")


def main() -> None:
    # The interpreter's start and this module's imports, up to here.
    CLOCK.add("startup", time.time() - CLOCK.mark)
    from longctx_cli.ask import StdoutClosed

    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, _terminate)
    try:
        # Without standalone mode, click returns a command's `typer.Exit(code)` instead of raising it.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except LongctxError as exc:
        _rank_failed(message(exc), exc.exit_code)
        if DEBUG["on"]:
            err.print_exception()
        # One line whatever the terminal width; the message is text, not rich markup (paths may hold "[...]").
        err.print(f"[red]error:[/] {escape(message(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except Interrupted as exc:
        _interrupted(exc.terminated)
    except KeyboardInterrupt as exc:
        _interrupted(isinstance(exc, Terminated))
    except StdoutClosed:
        _stdout_closed()
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # noqa: BLE001 - the CLI boundary
        import click

        # Click turns Ctrl-C into Abort; the KeyboardInterrupt (or SIGTERM) is its cause.
        if isinstance(exc, (click.exceptions.Abort, typer.Abort)):
            _interrupted(isinstance(exc.__cause__ or exc.__context__, Terminated))
        # Newer Typer vendors click: its usage errors are typer.TyperException, not click.ClickException.
        if isinstance(exc, (click.ClickException, typer.TyperException)):
            # One line, like every other error (click's own layout is a usage box over several lines).
            text = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            usage = " (see --help)" if getattr(exc, "exit_code", 1) == 2 else ""
            err.print(f"[red]error:[/] {escape(message(text))}{usage}", highlight=False, soft_wrap=True)
            sys.exit(getattr(exc, "exit_code", 2))
        if isinstance(exc, StdoutClosed) or isinstance(exc.__cause__, StdoutClosed):
            _stdout_closed()
        _rank_failed(f"internal error: {type(exc).__name__}: {message(exc)}", 1)
        if DEBUG["on"]:
            err.print_exception()
        err.print(f"[red]internal error:[/] {type(exc).__name__}: {escape(message(exc))} (run with --debug for the "
                  "traceback)", highlight=False, soft_wrap=True)
        sys.exit(1)


def _rank_failed(text: str, code: int) -> None:
    """Inside a world of ranks: leave the error for the launcher; ranks other than the query rank then exit
    silently (when every rank hits the same error, the query rank says it once)."""
    from longctx_cli import distributed

    if not distributed.in_world():
        return
    distributed.record_error(text, code)
    if not distributed.is_query_rank():
        sys.exit(code)


def _terminate(signum, frame):
    raise Terminated


def _interrupted(terminated: bool) -> None:
    """Ctrl-C or SIGTERM: what was answered is already out; say so in one line and exit 130 / 143."""
    try:
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass
    err.print(f"[yellow]{'terminated' if terminated else 'interrupted'}[/]")
    sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def _stdout_closed() -> None:
    """The reader of stdout went away: leave quietly (the report went to stderr), as `yes | head` does."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout must not fail again
    except (OSError, ValueError, AttributeError):
        pass
    sys.exit(EXIT_PIPE)
