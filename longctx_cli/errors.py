"""One error family for the whole tool; the CLI maps each class to a documented exit code.

Exit codes (also in README.md):
  0   success
  1   unexpected internal error (run with --debug for the traceback)
  2   bad command-line usage: unknown option, missing or empty question, a question that names a file
  3   input error: missing path, empty / binary / mis-encoded document
  4   configuration error: unknown profile, engine or key, bad value, malformed YAML
  5   model error: model not found or not loadable
  6   document too long for the chosen engine and model
  7   out of memory on a device
  8   partial failure: some documents of a multi-document run failed, the others were answered
      (when every document fails: the first failure's code)
  130 interrupted (Ctrl-C); partial output and report were flushed
  141 standard output closed early (e.g. `| head`): the report still goes to stderr
  143 terminated (SIGTERM); flushed as for Ctrl-C
"""

from __future__ import annotations


class LongctxError(Exception):
    """Base class: a message for the user (one line) and an exit code."""

    exit_code = 1


class UsageError(LongctxError):
    exit_code = 2


class InputError(LongctxError):
    exit_code = 3


class ConfigError(LongctxError):
    exit_code = 4


class ModelError(LongctxError):
    exit_code = 5


class ContextTooLongError(LongctxError):
    exit_code = 6


class OutOfMemoryError(LongctxError):
    exit_code = 7


def is_out_of_memory(exc: BaseException) -> bool:
    """A device or host allocation failure (the CPU allocator reports one as a plain RuntimeError)."""
    import torch

    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or
                                              "out of memory" in str(exc).lower())


EXIT_PARTIAL = 8
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the signal lands so it unwinds (and flushes) exactly as Ctrl-C does."""


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM leaving a command, past Typer (which would turn it into a silent exit 130)."""

    def __init__(self, terminated: bool):
        super().__init__("terminated" if terminated else "interrupted")
        self.terminated = terminated


def message(exc: BaseException, limit: int = 400) -> str:
    """One line for the user: newlines folded, long echoes of user input capped."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clip(value, limit: int = 60) -> str:
    """repr() of a user-supplied value for an error message, capped (a 100 KB token is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…" + text[-3:]
