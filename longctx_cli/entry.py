"""The process boundary of `longctx`: signals and errors become one line on stderr and a documented exit code."""

from __future__ import annotations

import os
import signal
import sys
import time

import typer
from rich.markup import escape

from longctx_cli.clock import CLOCK
from longctx_cli.errors import (EXIT_INTERRUPTED, EXIT_PIPE, EXIT_TERMINATED, Interrupted, LongctxError, Terminated,
                                message)
from longctx_cli.options import DEBUG, err


def run() -> None:
    """The process's entry point (the `longctx` script and `python -m longctx_cli`): `main`, and an interrupted run
    ends with its own code. CPython 3.11 marks a KeyboardInterrupt that leaves code run by exec() on a string
    (dataclasses build their methods that way, so a Ctrl-C during an import often lands there) as unhandled even
    once it is handled, and then ends the process by SIGINT (-2) after finalization instead of with 130. So an
    interrupted process runs its exit handlers, flushes and ends itself."""
    try:
        main()
    except SystemExit as exc:
        if exc.code not in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            raise
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(exc.code)


def main() -> None:
    # The interpreter's start and the command modules' imports, up to here.
    CLOCK.add("startup", time.time() - CLOCK.mark)
    from longctx_cli.session import StdoutClosed
    from longctx_cli.cli import app

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
