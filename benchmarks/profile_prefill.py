"""Where prefill time goes: chunked prefill of a random-weight model, kernel by kernel and function by function (GPU).

    python benchmarks/profile_prefill.py --profile ltri-stream --length 32k --chunks 512 --json out.json

Per chunk size: a warm-up prefill (compilation, kernel plans), a timed one, one under torch.profiler (the sum of
kernel times against the wall: what the device was busy for) and, with --python, one under cProfile (which
Python functions the host spends the rest in; waits for the device show up in the function that copies to the
host). Host-bound engines are those whose kernel sum is far below the wall.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engines import ENGINES
from longctx_cli.home import longctx_home
from longctx_cli.models import load_model
from longctx_cli.options import profile_from_flags
from longctx_cli.report import run_stamp
from longctx_cli.units import parse_count


def _kernels(p, rows: int) -> tuple[float, int, list]:
    events = sorted((e for e in p.key_averages() if e.device_type.name == "CUDA"),
                    key=lambda e: -e.self_device_time_total)
    top = [{"kernel": e.key[:120], "count": e.count, "ms": round(e.self_device_time_total / 1e3, 2)}
           for e in events[:rows]]
    return sum(e.self_device_time_total for e in events) / 1e3, sum(e.count for e in events), top


def _python_top(run, rows: int) -> list[dict]:
    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof, stream=io.StringIO())
    out = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        out.append({"function": f"{path.rsplit('/', 2)[-2:]}:{line}:{func}", "calls": calls,
                    "self_s": round(tottime, 3), "cum_s": round(cumtime, 3)})
    return sorted(out, key=lambda r: -r["self_s"])[:rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--profile", default="dense")
    ap.add_argument("--set", action="append", default=[], help="key=value profile override (repeatable)")
    ap.add_argument("--length", default="32k")
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--python", action="store_true", help="also one prefill under cProfile")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    lm = load_model(args.model, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    n = parse_count(args.length)
    ids = torch.randint(1000, 20000, (n,))
    results = []
    for chunk in map(int, args.chunks.split(",")):
        prof = profile_from_flags(args.profile, args.set, chunk_size=chunk)
        engine = ENGINES[prof.engine](lm, prof.engine_config, prof.run, home=longctx_home())

        def run(engine=engine):
            engine.prefill(ids, reserve=16)
            sync()
        t = time.perf_counter()
        run()  # warm-up: compilation, kernel plans for every chunk's shapes
        first = time.perf_counter() - t
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CUDA if args.device == "cuda" else ProfilerActivity.CPU]) as p:
            run()
        kernel_ms, launches, top = _kernels(p, args.rows)
        row = {"profile": args.profile, "settings": args.set, "chunk_size": chunk, "tokens": n,
               "prefill_s": round(wall, 3), "tokens_per_s": round(n / wall), "first_prefill_s": round(first, 3),
               "kernel_s": round(kernel_ms / 1e3, 3), "kernel_launches": launches, "top_kernels": top}
        print(f"{args.profile} chunk {chunk}: prefill {wall:.2f} s ({n / wall:,.0f} tok/s), kernels "
              f"{kernel_ms / 1e3:.2f} s in {launches:,} launches (first prefill {first:.2f} s)", flush=True)
        for k in top[:12]:
            print(f"  {k['ms']:10.1f} ms {k['count']:8d}  {k['kernel']}")
        if args.python:
            row["python_top"] = _python_top(run, args.rows)
            for f in row["python_top"]:
                print(f"  {f['self_s']:8.3f} s self {f['cum_s']:8.3f} s cum {f['calls']:8d}  {f['function']}")
        results.append(row)
        del engine
        torch.cuda.empty_cache()
    if args.json:
        meta = {**run_stamp(), "random_weights": args.model.startswith("random:"), "results": results}
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
