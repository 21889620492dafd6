"""What the commands share: the stderr console, the common options, profile resolution and Ctrl-C handling."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
from typing import Annotated, Optional

import typer
from rich.console import Console

from longctx_cli.errors import Interrupted, Terminated

err = Console(stderr=True)
DEBUG = {"on": False}

ProfileOpt = Annotated[str, typer.Option("--profile", "-p", help="Profile name (see `longctx profiles`) or YAML path.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="gemma3-270m (default), qwen2.5-coder-0.5b, an HF folder, a cached hub id, a .gguf file or "
    "random:PRESET (see `longctx models`).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override any profile key: --set chunk_size=4096.")]
DeviceOpt = Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[Optional[str], typer.Option(help="auto, float32, bfloat16 or float16.")]
ChunkOpt = Annotated[Optional[int], typer.Option("--chunk-size", help="Prefill chunk length in tokens.")]
GpusOpt = Annotated[int, typer.Option(
    "--gpus", help="Star only: run N ranks on this host, one per GPU (gloo processes with --device cpu).")]
GpusModelOpt = Annotated[Optional[int], typer.Option(
    "--gpus-model", help="Split the model's layers over N local GPUs (one model copy; profile key gpus_model).")]
MaxNewOpt = Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", help="Answer length limit.")]


def signals(command):
    """Ctrl-C and SIGTERM inside a command reach `main` as Interrupted, which says so and exits 130 / 143."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            raise Interrupted(isinstance(exc, Terminated)) from None

    return run


@contextlib.contextmanager
def signals_after():
    """Ctrl-C and SIGTERM during the block take effect when it ends. For the imports of torch and transformers
    (seconds): a KeyboardInterrupt raised inside them can pass through a C++ extension's boundary and abort the
    process (-6), or leave CPython 3.11's mark of an unhandled interrupt (exec() in dataclasses; see entry.run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: got.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        raise Terminated if got[0] == signal.SIGTERM else KeyboardInterrupt


def _known_keys(engine: str) -> set[str]:
    from engines.config import CONFIGS
    from longctx_cli.profiles import RunSettings

    return {f.name for f in dataclasses.fields(RunSettings)} | {f.name for f in dataclasses.fields(CONFIGS[engine])}


def unknown_sets(sets: list[str] | None, engines: list[str]) -> list[str]:
    """The --set keys that none of these engines (nor the run settings) has."""
    from longctx_cli.profiles import parse_override

    known = set().union(*(_known_keys(e) for e in engines))
    return [key for key, _ in (parse_override(s) for s in sets or []) if key not in known]


def profile_from_flags(name: str, sets: list[str] | None, only_known: bool = False, **flags):
    """Resolve a profile with --set overrides and flags; only_known (a bench baseline, or one of several
    profiles) drops the --set keys its engine does not have, so `--set block_size=...` tunes the engine under
    test without breaking dense."""
    from longctx_cli.profiles import parse_override, resolve_profile

    overrides = dict(parse_override(s) for s in sets or [])
    if only_known:
        known = _known_keys(resolve_profile(name, {}).engine)
        overrides = {k: v for k, v in overrides.items() if k in known}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return resolve_profile(name, overrides)
