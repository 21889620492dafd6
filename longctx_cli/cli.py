"""Command line: `longctx ask | bench | plan`; `models`, `profiles` and `states` live in catalog.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from longctx_cli import __version__
from longctx_cli.catalog import models_list, profiles_app, states_app
from longctx_cli.clock import CLOCK
from longctx_cli.errors import ConfigError, UsageError, clip
from longctx_cli.options import (DEBUG, ChunkOpt, DeviceOpt, DtypeOpt, GpusModelOpt, GpusOpt, MaxNewOpt, ModelOpt,
                                 ProfileOpt, SetOpt, profile_from_flags, signals, signals_after)

app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                  help="Ask questions of very long documents.", pretty_exceptions_enable=False)
app.add_typer(profiles_app, name="profiles")
app.add_typer(states_app, name="states")
app.command("models")(models_list)


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


def _ranks(prof, gpus: int, model: str | None) -> bool:
    """--gpus N: start N ranks running this same command (and exit with their code), or, inside a rank, join
    the world. Returns whether this process must stay quiet (a rank other than the query rank)."""
    from longctx_cli import distributed

    from longctx_cli.split import check_gpus_model

    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, not {gpus}")
    check_gpus_model(prof.run.gpus_model, prof.run.device, gpus)
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
@signals
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
    gpus_model: GpusModelOpt = None,
):
    """Answer each question about each document (or about all of them with --concat)."""
    from longctx_cli import distributed
    from longctx_cli.ask import AskOptions, check_ask, run_ask
    from longctx_cli.home import check_home, keep_compile_caches
    from longctx_cli.models import check_model_spec
    paths, asked = _questions(list(paths or []), questions, questions_file)
    if encoding_errors not in ("strict", "replace", "ignore"):
        raise UsageError(f"--encoding-errors must be strict, replace or ignore, not {clip(encoding_errors)}")
    if layout not in ("auto", "chat", "plain"):
        raise UsageError(f"--layout must be auto, chat or plain, not {clip(layout)}")
    if state not in ("auto", "off", "read", "write"):
        raise UsageError(f"--state must be auto, off, read or write, not {clip(state)}")
    keep_compile_caches(check_home())
    opts = AskOptions(paths, asked, None, model=model, glob=glob, concat=concat, json=json_out,
                      encoding_errors=encoding_errors, layout=layout, quiet=quiet, state=state)
    with CLOCK.part("checks"):
        check_ask(opts)
        check_model_spec(model)
        # Profiles are read from the engines' configurations alone, before torch and transformers load.
        opts.profile = profile_from_flags(profile, sets, max_new_tokens=max_new_tokens, chunk_size=chunk_size,
                                          device=device, dtype=dtype, temperature=temperature, top_p=top_p, seed=seed,
                                          gpus_model=gpus_model)
    with CLOCK.part("imports"), signals_after():
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
@signals
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
    gpus_model: GpusModelOpt = None,
):
    """Speed (synthetic contexts) or, with --tasks, accuracy of a profile's engine next to the dense baseline;
    several profiles (--profile resa,star) run on the same inputs next to one baseline run."""
    from longctx_cli.home import check_home, keep_compile_caches

    keep_compile_caches(check_home())
    from longctx_cli import distributed
    from longctx_cli.tasks import TASKS

    with signals_after():
        from longctx_cli.bench import run_bench  # torch, transformers and the engines

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
    flags = dict(device=device, dtype=dtype, chunk_size=chunk_size, max_new_tokens=max_new_tokens,
                 gpus_model=gpus_model)
    profs, base = _bench_profiles(profile, compare, sets, flags)
    if len(profs) > 1 and gpus > 1:
        raise ConfigError("--gpus runs one star profile; give several profiles without --gpus")
    _ranks(profs[0], gpus, model)
    run_bench(profs, base, model=model, lengths=lengths, steps=steps, warmup_tokens=warmup_tokens, json_path=json_out,
              argv=sys.argv, tasks=task_list, samples=samples, seed=seed, depths=depth_list, plot_path=plot, layout=layout)
    distributed.finish()


def _bench_profiles(names: str, compare: str | None, sets: list[str] | None, flags: dict) -> tuple[list, object]:
    """`--profile a,b,c` and `--compare`: the profiles whose engines run on the same inputs, and the baseline
    run once next to them (None: --compare none, or the one profile is the baseline itself). With several
    profiles, `--set` keys go to those whose engine has them (a key none of them has is still an error); the
    baseline named among them runs once, as the baseline."""
    listed = [n.strip() for n in names.split(",") if n.strip()]
    if not listed:
        raise ConfigError("--profile needs a profile name")
    if len(listed) != len(set(listed)):
        raise ConfigError(f"--profile names a profile twice: {names}")
    with_base = compare not in (None, "none", "")
    if with_base and len(listed) > 1:
        listed = [n for n in listed if n != compare]
    base = profile_from_flags(compare, sets, only_known=True, **flags) if with_base and listed != [compare] else None
    if len(listed) == 1:
        return [profile_from_flags(listed[0], sets, **flags)], base
    profs = [profile_from_flags(n, sets, only_known=True, **flags) for n in listed]
    if len({p.name for p in profs}) != len(profs):
        raise ConfigError(f"--profile names two profiles of the same name: {names}")
    from longctx_cli.options import unknown_sets

    unknown = unknown_sets(sets, [p.engine for p in profs])
    if unknown:
        raise ConfigError(f"--set {unknown[0]}: no profile among {', '.join(listed)} has this key")
    return profs, base


@app.command()
@signals
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
    gpus_model: GpusModelOpt = None,
):
    """Predict memory per device before loading any weights, with a verdict."""
    from longctx_cli.home import check_home, keep_compile_caches

    keep_compile_caches(check_home())
    with signals_after():
        from longctx_cli.plan import run_plan

    prof = profile_from_flags(profile, sets, device=device, dtype=dtype, chunk_size=chunk_size,
                              max_new_tokens=max_new_tokens, gpus_model=gpus_model)
    raise typer.Exit(run_plan(prof, model=model, paths=paths or [], tokens=tokens))
