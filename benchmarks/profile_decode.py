"""Where decode time goes: one graph-captured decode step of a random-weight model, kernel by kernel (GPU).

    python benchmarks/profile_decode.py --model random:llama-3.1-8b --length 4k --profile dense

Prints the replayed step's ms/token (CUDA events over --steps replays) and torch.profiler's table of the same
step run eagerly (kernel count and the sum of kernel times: the difference to the replay is what the graph's
kernel boundaries cost). --compile blocks is the profile key compile_decode (the layers' MLPs and norms compiled
inside the captured step); --compile layer, an experiment, compiles whole decoder layers with the attention
left eager (a graph break), for prefill too. --trace N profiles N replays of the captured step itself: each
kernel's time inside the graph, by family (GEMMs, compiled kernels, each of the project's kernels), the time
no kernel ran, and which kernels that idle time lies between. --selection-phases N (resa, softmax pooling) stamps
the one-launch selection's programs at its phase boundaries inside the captured step (GPU global timer) and
summarises N replays: how long each phase and each barrier takes within the step, a profiler seeing one kernel.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engines import ENGINES
from engines.decoding import Sampler, swapped
from kernels.block_select import record_phases
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


def _category(name: str) -> str:
    """A kernel's family: cuBLAS GEMM/GEMV, torch.compile's fused kernels, the project's Triton kernels, other."""
    if re.search(r"gemm|gemv|nvjet|xmma|cutlass|splitK|sm90_", name):
        return "gemm"
    if name.startswith("triton_"):
        return "compiled"
    if name.startswith("_") and name.endswith("kernel"):
        return name
    return "other"


def _replay_trace(replay, n: int) -> dict:
    """torch.profiler over `n` graph replays: the kernels as they ran inside the graph, per step (µs), by family
    and by name, and how much of the step no kernel ran (launch gaps)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not spans:
        return {"error": "no kernel records for graph replays"}
    # A kernel launched early (programmatic dependent launch) spends its first part waiting for the one before:
    # it is charged from the later of its start and the end of everything before it ("own" time), so the own
    # times and the idle time add up to the wall clock.
    busy, reach = 0.0, spans[0][0]
    by_name: dict[str, list[tuple[float, float]]] = {}
    gaps: dict[tuple[str, str], float] = {}  # idle time by the kernels on either side of it
    before = ""
    for start, end, name in spans:
        own = max(0.0, end - max(start, reach))
        if start > reach:
            pair = (before[:60], name[:60])
            gaps[pair] = gaps.get(pair, 0.0) + start - reach
        busy += own
        if end > reach:
            before = name
        reach = max(reach, end)
        by_name.setdefault(name[:100], []).append((end - start, own))
    families: dict[str, float] = {}
    for name, times in by_name.items():
        families[_category(name)] = families.get(_category(name), 0.0) + sum(o for _, o in times) / n
    rows = sorted(({"kernel": k, "per_step": len(v) / n, "own_us_per_step": round(sum(o for _, o in v) / n, 1),
                    "us_per_step": round(sum(d for d, _ in v) / n, 1)} for k, v in by_name.items()),
                  key=lambda r: -r["own_us_per_step"])
    wall = (reach - spans[0][0]) / n
    return {"replays": n, "wall_us": round(wall, 1), "busy_us": round(busy / n, 1),
            "idle_us": round(wall - busy / n, 1), "kernels_per_step": len(spans) / n,
            "families_own_us": {k: round(v, 1) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
            "idle_between": [{"after": a, "before": b, "us_per_step": round(t / n, 1)}
                             for (a, b), t in sorted(gaps.items(), key=lambda kv: -kv[1])[:12]],
            "kernels": rows}


def selection_breakdown(stamps: torch.Tensor) -> dict:
    """Where one selection's time goes, in µs, from its programs' stamps [rows, parts, len(PHASE_STAMPS)] (ns):
    early = resident before the kernel ahead finished (programmatic launch); from that kernel's end, each phase's
    work (the median program and the slowest) and each barrier's wait (from a row's last arrival to its first
    program passing, and the arrivals' spread apart, averaged over rows); total = to the last program's end."""
    s = stamps.double() / 1e3
    out = {"early": (s[..., 1].amin() - s[..., 0].amin()).item(),
           "total_from_dependency": (s[..., 8].amax() - s[..., 1].amax()).item()}
    for k, (begin, done) in enumerate(((1, 2), (3, 4), (5, 6), (7, 8)), start=1):
        work = (s[..., done] - s[..., begin]).flatten()
        out[f"phase{k}_median"], out[f"phase{k}_slowest"] = work.median().item(), work.max().item()
    for k, (reached, passed) in enumerate(((2, 3), (4, 5), (6, 7)), start=1):
        out[f"barrier{k}_release"] = (s[..., passed].amin(1) - s[..., reached].amax(1)).mean().item()
        out[f"barrier{k}_spread"] = (s[..., reached].amax(1) - s[..., reached].amin(1)).mean().item()
    return out


def _selection_phases(replay, stamps: dict, n: int) -> dict:
    """selection_breakdown averaged over `n` replays of the step and its selections (one a layer)."""
    sums: dict[str, float] = {}
    count = 0
    for _ in range(n):
        replay()
        torch.cuda.synchronize()
        for buffer in stamps.values():
            for key, value in selection_breakdown(buffer.cpu()).items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
    return {"selections": count, **{k: round(v / max(1, count), 2) for k, v in sums.items()}}


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
    ap.add_argument("--rectify", action="store_true", help="resa: also time and profile the rectifying step")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="also profile N graph replays: kernel times inside the graph and the idle time between")
    ap.add_argument("--selection-phases", type=int, default=0, metavar="N",
                    help="resa: stamp the one-launch selection's phases inside the captured step, N replays")
    ap.add_argument("--out", help="append the JSON row to this file (one object per line)")
    args = ap.parse_args()
    stamps: dict = {}
    if args.selection_phases:
        record_phases(stamps)  # before the capture: the captured selections write these stamps at each replay
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
        # resa: the sparse step alone here (no step of the rectifying form among the replays); that form below.
        rectifying = "rectify" in state.cache.decode_variants()
        if rectifying:
            state.cache.rectifying = False
        for _ in range(3):
            step.step()
        torch.cuda.synchronize()
        result["graph_ms_per_token"] = _replay_ms(step.step, args.steps)
        if args.trace:
            result["graph_trace"] = _replay_trace(step.step, args.trace)
        if args.selection_phases:
            if not stamps:
                raise SystemExit("no one-launch selection ran in the step (resa with softmax pooling only)")
            result["selection_phases_us"] = _selection_phases(step.step, stamps, args.selection_phases)
            result["selection_phases_note"] = "the step's times above were taken with the stamps on"
        kernel_ms, count, top, table = _kernel_table(step._step, step.blocks, args.rows)
        print(table)
        result.update(eager_kernel_ms=kernel_ms, kernels=count, top_kernels=top)
        if args.rectify and rectifying:
            # The rectifying form of the step (its tokens are whatever its buffer holds: the timing does not
            # depend on them); each replay writes K/V up to one slot further, inside the reserve.
            state.cache.decode_variant = "rectify"
            again = step.graphs["rectify"].replay if "rectify" in step.graphs else step._step
            result["rectify_graph_ms"] = _replay_ms(again, 10)
            trace = _replay_trace(again, 3) if args.trace else None
            kernel_ms, count, top, table = _kernel_table(step._step, step.blocks, args.rows)
            print(table)
            result["rectify"] = {"tokens": state.cache.decode_width("rectify"), "eager_kernel_ms": kernel_ms,
                                 "kernels": count, "top_kernels": top, **({"graph_trace": trace} if trace else {})}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
