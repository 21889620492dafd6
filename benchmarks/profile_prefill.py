"""Where prefill time goes: torch.profiler over chunked prefill of a random-weight model (GPU)."""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engines import ENGINES
from longctx_cli.home import longctx_home
from longctx_cli.models import load_model
from longctx_cli.units import parse_count
from longctx_cli.profiles import resolve_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--length", default="32k")
    ap.add_argument("--chunks", default="2048,8192")
    args = ap.parse_args()
    lm = load_model(args.model, device="cuda", dtype="bfloat16")
    n = parse_count(args.length)
    ids = torch.randint(1000, 20000, (n,))
    for chunk in map(int, args.chunks.split(",")):
        prof = resolve_profile("dense", {"chunk_size": chunk})
        engine = ENGINES["dense"](lm, prof.engine_config, prof.run, home=longctx_home())
        t = time.perf_counter()
        engine.prefill(ids, reserve=16)  # warm-up: compilation, kernel plans for every chunk's shapes
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        t = time.perf_counter()
        engine.prefill(ids, reserve=16)
        print(f"chunk {chunk}: prefill {time.perf_counter() - t:.2f} s (first in this process: {first:.2f} s)",
              flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            engine.prefill(ids, reserve=16)
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
