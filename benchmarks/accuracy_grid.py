"""Accuracy tables of several engines over many tasks and lengths, as `longctx bench --tasks` processes that
share one GPU, and the merged result.

A small model leaves a GPU mostly idle between its kernel launches, so one `longctx bench` process per profile and
task (or per length too), several at a time, finishes a table several times sooner than one process. Each process
runs its profile and the dense baseline on the cell's samples (the samples depend only on task, length, index and
seed, so every profile meets the same prompts). The streaming engines' cells start first; at the deadline the
running ones are stopped and keep the samples they finished (bench writes its file after each one; rows cut short
say `partial`, and the table marks them). Merging joins the rows and, per sample, every
profile's result; dense runs in every cell of its task and length, and the merged file counts the samples where
those runs answered differently.

The speed columns of a table made this way are not speed measurements (the processes share the GPU); the merged
file says so.

    python benchmarks/accuracy_grid.py --model qwen2.5-coder-0.5b --profiles resa,star,ltri-stream-4k,sas-pattern \
        --tasks all --lengths 2k,4k,8k,16k,32k --samples 20 --jobs 8 --deadline 560 --out qwen.json
    python benchmarks/accuracy_grid.py --merge qwen.json more.json --out both.json   # join two grids' files

`--profiles resa+star,ltri-stream` runs resa and star in one process per cell, next to one dense run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.accuracy_table import read_result  # noqa: E402

from longctx_cli.tasks import TASKS
from longctx_cli.units import parse_count

SHARED_NOTE = ("cells ran as separate `longctx bench` processes sharing one GPU: the prefill and decode times are "
               "not speed measurements")


def _cells(args) -> list[tuple[str, str, str]]:
    """(profile, task, lengths): one process each; with --split length one per length too."""
    tasks = list(TASKS) if args.tasks == "all" else args.tasks.split(",")
    lengths = sorted(parse_count(x) for x in args.lengths.split(","))
    spans = [str(n) for n in reversed(lengths)] if args.split == "length" else [",".join(map(str, lengths))]
    cells = [(p, t, span) for span in spans for p in args.profiles.split(",") for t in tasks]
    # The streaming engines (the slowest per token) first.
    return sorted(cells, key=lambda c: not c[0].startswith("ltri"))


def _command(args, profile: str, task: str, lengths: str, out: Path) -> list[str]:
    # "a+b" is one process running both profiles next to one dense run (half the dense work of two processes).
    cmd = [sys.executable, "-m", "longctx_cli", "bench", "--profile", profile.replace("+", ","), "--tasks", task,
           "--lengths", lengths, "--samples", str(args.samples), "--seed", str(args.seed), "--json", str(out)]
    if args.model:
        cmd += ["--model", args.model]
    for item in args.set or []:
        cmd += ["--set", item]
    return cmd


def run_grid(args) -> list[Path]:
    """Run the cells, `jobs` at a time, until done or the deadline; the finished cells' JSON paths."""
    work = Path(tempfile.mkdtemp(prefix="accuracy_grid_"))
    skip = _done_cells(args.resume)
    pending, running, done = [], [], []
    for profile, task, span in _cells(args):
        if left := _left(profile, task, span, skip):
            pending.append((profile, task, ",".join(left)))
    deadline = time.monotonic() + args.deadline
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.jobs))}
    while pending or running:
        while pending and len(running) < args.jobs:
            cell = pending.pop(0)
            group = "+".join(Path(p).stem for p in cell[0].split("+"))
            if len(group) > 100:  # many profiles in one process: file names must stay under the file system's limit
                group = f"{group[:60]}-{hashlib.sha1(group.encode()).hexdigest()[:12]}"
            name = "_".join((group, *cell[1:])).replace(",", "-")
            out, log = work / f"{name}.json", open(work / f"{name}.log", "w")
            proc = subprocess.Popen(_command(args, *cell, out), stdout=subprocess.DEVNULL, stderr=log, env=env)
            running.append((proc, out, log, name, time.monotonic()))
        time.sleep(1)
        for item in list(running):
            proc, out, log, name, start = item
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            stopped = proc.poll() is None
            if stopped:
                proc.kill()
                proc.wait()
            log.close()
            running.remove(item)
            # A stopped cell keeps the lengths it finished (bench rewrites its file after each one).
            status = "done" if proc.returncode == 0 else "stopped at the deadline" if stopped else f"exit {proc.returncode}"
            rows = len(json.loads(out.read_text())["rows"]) if out.exists() else 0
            print(f"{name}: {status} in {time.monotonic() - start:.0f} s, {rows} rows", file=sys.stderr, flush=True)
            if rows:
                done.append(out)
            if status.startswith("exit"):
                print((work / f"{name}.log").read_text()[-800:], file=sys.stderr)
        if time.monotonic() >= deadline:
            for cell in pending:
                print(f"{' '.join(cell)}: not started (deadline)", file=sys.stderr)
            pending = []
    return done


def _left(profile: str, task: str, span: str, skip: set) -> list[str]:
    """The lengths of a cell still to run: those some member of the profile group has not finished."""
    return [n for n in span.split(",") if any((Path(p).stem, task, n) not in skip for p in profile.split("+"))]


def _done_cells(path: str | None) -> set[tuple[str, str, str]]:
    if not path:
        return set()
    return {(r["profile"], r["task"], str(r["length"])) for r in read_result(path)["rows"]}


def _joined(rows: list[dict]) -> dict:
    """One row from rows of the same cell on different seeds: samples added, scores and times averaged over
    the samples."""
    if len(rows) == 1:
        return rows[0]
    n = sum(r["samples"] for r in rows)
    out = {**rows[0], "samples": n}
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("samples", "length"):
            values = [r.get(key) for r in rows]
            out[key] = None if None in values else sum(v * r["samples"] for v, r in zip(values, rows)) / n
    if any(r.get("partial") for r in rows):
        out["partial"] = True
    return out


def merge(paths: list[Path], commands: list[str] | None = None, order: list[str] | None = None) -> dict:
    """One accuracy result from several: rows joined, each sample's results joined; the model and each profile's
    settings must agree."""
    parts = [read_result(p) for p in paths]
    if not parts:
        raise SystemExit("no finished cell to merge")
    first, settings = parts[0], {}
    for part in parts:
        for key in ("model", "mode"):
            if part[key] != first[key]:
                raise SystemExit(f"cannot merge: {key} differs between results")
        for name, value in part["engine_settings"].items():
            if settings.setdefault(name, value) != value:
                raise SystemExit(f"cannot merge: the settings of {name} differ between results")
    order = [n for n in (order or []) if n in settings] + [n for n in settings if n not in (order or [])]
    # Dense last, where the parts ran it (`--compare none` parts have no dense column).
    order = [n for n in order if n != "dense"] + (["dense"] if "dense" in settings else [])
    # A cell that ran twice (a group resumed after one member finished it) keeps its first run, like its samples;
    # parts that split a cell by seed join into one row.
    unique: dict[tuple, dict] = {}
    for part in parts:
        seeds = tuple(sorted({s["seed"] for s in part["samples"]}))
        for r in part["rows"]:
            unique.setdefault((r["profile"], r["task"], r["length"]), {}).setdefault(seeds, r)
    rows = sorted((_joined(list(runs.values())) for runs in unique.values()),
                  key=lambda r: (order.index(r["profile"]), r["task"], r["length"]))
    samples, differ = {}, 0
    for part in parts:
        for record in part["samples"]:
            key = (record["task"], record["length"], record["index"], record["seed"])
            held = samples.setdefault(key, {**record, "results": {}})
            if held["prompt_hash"] != record["prompt_hash"]:
                raise SystemExit(f"cannot merge: sample {key} has two prompts")
            for name, result in record["results"].items():
                if name in held["results"]:
                    differ += name == "dense" and held["results"][name]["answer"] != result["answer"]
                    continue
                held["results"][name] = result
    dates = sorted(d for p in parts for d in (p.get("date"), p.get("last_date")) if d)
    return {**{k: v for k, v in first.items() if k not in ("rows", "samples", "command", "commands", "partial")},
            "date": dates[0] if dates else None, "last_date": dates[-1] if dates else None,
            "commands": commands or sorted({c for p in parts for c in p.get("commands", [p.get("command")])}),
            "engine_settings": {n: settings[n] for n in order}, "cells": sum(p.get("cells", 1) for p in parts),
            "dense_answers_differing": differ, "note": SHARED_NOTE, "rows": rows,
            "samples": sorted(samples.values(), key=lambda r: (r["task"], r["length"], r["index"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--profiles", default="resa")
    parser.add_argument("--tasks", default="all")
    parser.add_argument("--lengths", default="4k,8k,16k,32k")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--split", choices=("task", "length"), default="task",
                        help="one process per profile and task (its lengths shortest first), or per length too")
    parser.add_argument("--deadline", type=float, default=3600, help="seconds; running cells are stopped and keep the lengths they finished")
    parser.add_argument("--merge", nargs="+", help="merge these result files instead of running")
    parser.add_argument("--resume", help="a merged file of an earlier run: its cells are kept, not run again")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.merge:
        result = merge([Path(p) for p in args.merge])
    else:
        grid = " ".join(a if " " not in a else repr(a) for a in sys.argv[1:])
        earlier = [Path(args.resume)] if args.resume else []
        commands = [f"python benchmarks/accuracy_grid.py {grid}"]
        if earlier:
            commands = json.loads(earlier[0].read_text())["commands"] + commands
        result = merge(earlier + run_grid(args), commands=commands,
                       order=[Path(p).stem for p in args.profiles.split(",")])
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{len(result['rows'])} rows from {result['cells']} cells -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
