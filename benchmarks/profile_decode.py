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
import contextlib
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engines import ENGINES
from engines.decoding import Sampler
from longctx_cli.models import load_model
from longctx_cli.plan import parse_count
from longctx_cli.profiles import resolve_profile


def compile_layers(engine) -> None:
    from transformers import AttentionInterface

    # The engine's attention (Triton launchers, the cache's Python state) stays eager: a graph break.
    AttentionInterface.register(engine._impl, torch.compiler.disable(type(engine).attention))
    layers = engine.model.get_decoder().layers
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer, dynamic=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--profile", default="dense")
    ap.add_argument("--length", default="4k")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compile", default="none", choices=("none", "blocks", "layer"))
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    lm = load_model(args.model, device="cuda", dtype="bfloat16")
    prof = resolve_profile(args.profile, {"compile_decode": args.compile == "blocks"})
    engine = ENGINES[prof.engine](lm, prof.engine_config, prof.run)
    ids = torch.randint(1000, 20000, (parse_count(args.length),))
    state = engine.prefill(ids, reserve=args.steps + 64)
    if args.compile == "layer":
        compile_layers(engine)
    with torch.inference_mode():
        t0 = time.perf_counter()
        step = engine._decode_step(state, Sampler())
        step.start(1234, state.position)
        engine._on_decode_start(state)
        capture_s = time.perf_counter() - t0
        for _ in range(3):
            step.step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step.step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.steps
        swapped = step.compiled.swapped() if step.compiled is not None else contextlib.nullcontext()
        with swapped, profile(activities=[ProfilerActivity.CUDA]) as p:
            step._step()
            torch.cuda.synchronize()
    events = [e for e in p.key_averages() if e.device_type.name == "CUDA"]
    kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    print(json.dumps({"model": args.model, "profile": args.profile, "length": args.length, "compile": args.compile,
                      "capture_s": capture_s, "graph_ms_per_token": ms, "eager_kernel_ms": kernel_ms,
                      "kernels": sum(e.count for e in events)}))


if __name__ == "__main__":
    main()
