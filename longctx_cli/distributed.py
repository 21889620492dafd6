"""Ranks for the star engine: a torch.distributed world, from torchrun's environment or spawned here.

`longctx ask --profile star --gpus N` starts N local copies of the same command through torch.distributed.elastic,
as `torchrun --standalone --nproc-per-node N` would, and waits for them. Across hosts, torchrun starts them:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m longctx_cli ask --profile star book.txt "question"

Every rank reads and tokenises the input itself (the input must be readable on every host; the engine checks
that the ranks agree) and holds a model replica. The query rank (the last) prints the answer and the report;
the others stay silent. NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

from longctx_cli.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, ConfigError


def in_world() -> bool:
    """Whether this process is one rank of several (set up by torchrun or `launch`)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_query_rank() -> bool:
    """The rank that prints: the last one (it holds the document's end and the answer's K/V)."""
    return not in_world() or rank() == int(os.environ["WORLD_SIZE"]) - 1


def rank_device(device: str) -> str:
    """The device this rank uses: its own GPU (LOCAL_RANK) unless the run is on the CPU."""
    import torch

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if device.startswith("cuda:"):
        raise ConfigError(f"--device {device} names one GPU; with several ranks each takes its own (cuda or auto)")
    return f"cuda:{local}"


def init(device: str) -> None:
    """Join the world (idempotent): NCCL for GPU ranks, gloo for CPU ranks."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device == "cpu":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.init_process_group("gloo")
    else:
        dev = torch.device(device)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)


def prepare_model(spec: str | None) -> None:
    """Convert / unpack the model once per host before the ranks load it (local rank 0 first, the rest wait)."""
    import torch.distributed as dist

    from longctx_cli.models import resolve_model_dir

    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        resolve_model_dir(spec)
    dist.barrier()


def quiet_unless_query_rank() -> bool:
    """On ranks other than the query rank, stdout goes nowhere; returns whether this rank should be quiet."""
    if is_query_rank():
        return False
    from transformers.utils import logging

    logging.disable_progress_bar()
    sys.stdout = open(os.devnull, "w")
    return True


def command(argv: list[str]) -> str:
    """The command line as the user typed it (a spawned rank's own argv lacks --gpus)."""
    return os.environ.get("LONGCTX_COMMAND") or " ".join(["longctx", *argv[1:]])


def finish() -> None:
    """Leave the world together: no rank's exit pulls the rendezvous store from under a rank still working."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def strip_option(argv: list[str], name: str) -> list[str]:
    """argv without `name VALUE` / `name=VALUE`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def launch(args: list[str], n: int, device: str) -> int:
    """Run `longctx ARGS` as n local ranks under torch.distributed.elastic (what `torchrun --standalone` does);
    returns the exit code: the first failing rank's, else 0.

    Standard input ("-") is read here once and handed to every rank as a file. Every failing rank leaves its
    one-line error in a folder of this launch (`record_error`); a rank other than the query rank that failed
    first has its line printed here.
    """
    import dataclasses
    import logging
    import uuid

    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--gpus {n} with --device {device}: use auto, cuda or cpu (each rank takes its own GPU)")
    gpus = torch.cuda.device_count()
    if device != "cpu" and gpus and n > gpus:
        raise ConfigError(f"--gpus {n}: only {gpus} GPU(s) here")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # failures: one line, ours
    os.environ.update(LONGCTX_COMMAND=" ".join(["longctx", *sys.argv[1:]]),
                      OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    stdin_file = None
    if "-" in args:
        stdin_file = tempfile.NamedTemporaryFile(prefix="longctx-stdin-", delete=False)
        stdin_file.write(sys.stdin.buffer.read())
        stdin_file.close()
        os.environ["LONGCTX_STDIN_FILE"] = stdin_file.name
    # Ranks stopped after a failure get 10 s to leave before SIGKILL where torch takes it as a setting (2.13 does;
    # 2.11 does not and keeps its own).
    later = {"shutdown_timeout": 10} if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05, **later)
    with tempfile.TemporaryDirectory(prefix="longctx-ranks-") as errors:
        os.environ["LONGCTX_RANK_ERRORS"] = errors
        try:
            elastic_launch(config, sys.executable)("-m", "longctx_cli", *args)
            return 0
        except ChildFailedError as exc:
            return _first_failure(errors, {r: f.exitcode for r, f in exc.failures.items()}, n)
        except SignalException as exc:
            # Ctrl-C or SIGTERM reached the agent; it passed the signal on and the ranks flushed and left. A second
            # one from here on is ignored: Python's finalization resets a handled signal to its default action, so
            # a Ctrl-C pressed again while the launcher exits would kill it (-2) instead of letting it exit 130.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            return EXIT_TERMINATED if exc.sigval == signal.SIGTERM else EXIT_INTERRUPTED
        finally:
            if stdin_file is not None:
                os.unlink(stdin_file.name)


def record_error(text: str, code: int) -> None:
    """On a rank, leave the one-line error where the launcher reads it (and in torch elastic's error file, which
    torchrun reports)."""
    record = {"message": text, "timestamp": int(time.time()), "longctx": {"code": code, "at": time.time()}}
    folder = os.environ.get("LONGCTX_RANK_ERRORS")
    paths = [os.environ.get("TORCHELASTIC_ERROR_FILE")]
    paths += [os.path.join(folder, f"rank-{rank()}.json")] if folder else []
    for path in filter(None, paths):
        with open(path, "w") as f:
            json.dump(record, f)


def _first_failure(folder: str, codes: dict[int, int], n: int) -> int:
    """The exit code of the rank that failed first on its own (the earliest error it recorded); ranks stopped
    after it by a signal do not count. Prints that rank's line unless the query rank printed the same failure.
    codes: the exit codes the launcher saw (rank -> code), for ranks that recorded nothing."""
    recorded = {}
    for r in range(n):
        try:
            with open(os.path.join(folder, f"rank-{r}.json")) as f:
                recorded[r] = json.load(f)
        except (OSError, ValueError):
            pass
    if not recorded:
        own = [c for c in codes.values() if c > 0]
        return own[0] if own else 1
    first = min(recorded, key=lambda r: recorded[r]["longctx"]["at"])
    code = recorded[first]["longctx"]["code"]
    query = recorded.get(n - 1)
    if first != n - 1 and (query is None or query["longctx"]["code"] != code):
        sys.stderr.write(f"error: rank {first}: {recorded[first]['message']}\n")
    return code
