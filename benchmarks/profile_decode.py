"""Where decode time goes: one graph-captured decode step of a random-weight model, kernel by kernel (GPU).

    python benchmarks/profile_decode.py --model random:llama-3.1-8b --length 4k --profile dense

Prints the replayed step's ms/token (CUDA events over --steps replays) and torch.profiler's table of the same
step run eagerly (kernel count and the sum of kernel times: the difference to the replay is what the graph's
kernel boundaries cost). --compile blocks is the profile key compile_decode (the layers' MLPs and norms compiled
inside the captured step); --compile layer, an experiment, compiles whole decoder layers with the attention
left eager (a graph break), for prefill too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engines import ENGINES
from engines.decoding import Sampler, swapped
from longctx_cli.home import longctx_home
from longctx_cli.models import load_model
from longctx_cli.units import parse_count
from longctx_cli.profiles import resolve_profile


def compile_layers(engine) -> None:
    from transformers import AttentionInterface

    # The engine's attention (Triton launchers, the cache's Python state) stays eager: a graph break.
    AttentionInterface.register(engine._impl, torch.compiler.disable(type(engine).attention))
    layers = engine.model.get_decoder().layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, dynamic=False)


def _kernel_table(run, blocks, rows: int) -> tuple[float, int, list, str]:
    """torch.profiler over one eager `run` with `blocks` swapped in: kernel ms, kernel count, top rows."""
    with swapped(blocks), profile(activities=[ProfilerActivity.CUDA]) as p:
        run()
        torch.cuda.synchronize()
    events = sorted((e for e in p.key_averages() if e.device_type.name == "CUDA"),
                    key=lambda e: -e.self_device_time_total)
    top = [{"kernel": e.key[:120], "count": e.count, "us": round(e.self_device_time_total, 1)} for e in events[:rows]]
    table = p.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    return sum(e.self_device_time_total for e in events) / 1e3, sum(e.count for e in events), top, table


def _replay_ms(replay, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--profile", default="dense")
    ap.add_argument("--length", default="4k")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compile", default="none", choices=("none", "blocks", "layer"))
    ap.add_argument("--no-fuse", action="store_true", help="fuse_projections=false")
    ap.add_argument("--rectify", action="store_true", help="resa: also time and profile the rectification step")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--out", help="append the JSON row to this file (one object per line)")
    args = ap.parse_args()
    lm = load_model(args.model, device="cuda", dtype="bfloat16")
    prof = resolve_profile(args.profile, {"compile_decode": args.compile == "blocks",
                                          "fuse_projections": not args.no_fuse})
    engine = ENGINES[prof.engine](lm, prof.engine_config, prof.run, home=longctx_home())
    ids = torch.randint(1000, 20000, (parse_count(args.length),))
    state = engine.prefill(ids, reserve=args.steps + 64)
    if args.compile == "layer":
        compile_layers(engine)
    result = {"model": args.model, "profile": args.profile, "length": args.length, "compile": args.compile,
              "fuse_projections": not args.no_fuse}
    with torch.inference_mode():
        t0 = time.perf_counter()
        step = engine._decode_step(state, Sampler())
        step.start(1234, state.position)
        engine._on_decode_start(state)
        result["capture_s"] = time.perf_counter() - t0
        for _ in range(3):
            step.step()
        torch.cuda.synchronize()
        result["graph_ms_per_token"] = _replay_ms(step.step, args.steps)
        kernel_ms, count, top, table = _kernel_table(step._step, step.blocks, args.rows)
        print(table)
        result.update(eager_kernel_ms=kernel_ms, kernels=count, top_kernels=top)
        rectify = getattr(state, "rectify", None) if args.rectify else None
        if rectify is not None:
            start = state.position + args.steps  # scratch slots inside the reserve
            result["rectify_graph_ms"] = _replay_ms(lambda: rectify(list(range(1000, 1000 + rectify.n)), start), 10)
            kernel_ms, count, top, table = _kernel_table(rectify._run, rectify.blocks, args.rows)
            print(table)
            result["rectify"] = {"tokens": rectify.n, "eager_kernel_ms": kernel_ms, "kernels": count,
                                 "top_kernels": top}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
