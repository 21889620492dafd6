"""Ranks for the star engine: a torch.distributed world, from torchrun's environment or spawned here.

`longctx ask --profile star --gpus N` starts N local copies of the same command, each with the environment
torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT; rendezvous by torch.distributed's
env:// store), and waits for them. Across hosts, torchrun starts them instead:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m longctx_cli ask --profile star book.txt "question"

Every rank reads and tokenises the input itself (the input must be readable on every host; the engine checks
that the ranks agree) and holds a model replica. The query rank (the last) prints the answer and the report;
the others stay silent. NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from longctx_cli.errors import ConfigError


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Run `longctx ARGS` as n local ranks; returns the exit code (the first failure's, else the query rank's).

    Standard input ("-") is read here once and handed to every rank as a file.
    """
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--gpus {n} with --device {device}: use auto, cuda or cpu (each rank takes its own GPU)")
    gpus = torch.cuda.device_count()
    if device != "cpu" and gpus and n > gpus:
        raise ConfigError(f"--gpus {n}: only {gpus} GPU(s) here")
    env = dict(os.environ, LONGCTX_COMMAND=" ".join(["longctx", *sys.argv[1:]]), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(n),
               LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    stdin_file = None
    if "-" in args:
        stdin_file = tempfile.NamedTemporaryFile(prefix="longctx-stdin-", delete=False)
        stdin_file.write(sys.stdin.buffer.read())
        stdin_file.close()
        env["LONGCTX_STDIN_FILE"] = stdin_file.name
    procs = []
    try:
        for r in range(n):
            procs.append(subprocess.Popen([sys.executable, "-m", "longctx_cli", *args],
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.DEVNULL))
        codes = _wait(procs)
    except KeyboardInterrupt:
        # The terminal's Ctrl-C reached the ranks too: they flush and exit 130.
        for p in procs:
            p.send_signal(signal.SIGINT)
        _wait(procs)
        return 130
    finally:
        if stdin_file is not None:
            os.unlink(stdin_file.name)
    # A rank's own exit code (> 0) says what went wrong; negative ones are ranks stopped after it.
    failed = [c for c in codes if c > 0]
    return failed[0] if failed else (1 if any(codes) else 0)


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    """Wait for every rank; once one fails, the others (stuck in a collective) are stopped."""
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):
            time.sleep(2.0)  # let the others fail on their own first (their messages are clearer)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            return [p.wait() for p in procs]
        time.sleep(0.05)
