"""Where prefill time goes: chunked prefill of a random-weight model, kernel by kernel and function by function (GPU).

    python benchmarks/profile_prefill.py --profile ltri-stream --length 32k --chunks 512 --json out.json

Per chunk size: a warm-up prefill (compilation, kernel plans), a timed one, one under torch.profiler (the sum of
kernel times against the wall: what the device was busy for) and, with --python, one under cProfile (which
Python functions the host spends the rest in; waits for the device show up in the function that copies to the
host). Host-bound engines are those whose kernel sum is far below the wall.

`--census` counts instead, per decoder layer and chunk, the ATen operators the prefill dispatches (on a GPU each is
a launch, or host work of the same order: ~30 us of host time a small operation on these machines), by the code
that issued them, and the calls that wait for the device (.tolist(), .item(), .cpu(), ...). A kernel of kernels/
counts as one call whatever its CPU reference dispatches. It runs on CPU as well, on a preset cut to a few layers
(`--layers 2 --intermediate 256`: the counts per layer do not depend on the depth or the MLP's width):

    python benchmarks/profile_prefill.py --device cpu --profile ltri-stream --length 16k --chunks 512 \
        --census --layers 2 --intermediate 256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from engines import ENGINES
from longctx_cli.home import longctx_home
from longctx_cli.models import load_model
from longctx_cli.options import profile_from_flags
from longctx_cli.presets import RANDOM_PRESETS
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


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Operators that launch no kernel (views, shapes, allocations): little host time each.
_METADATA = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
             "squeeze", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
             "diagonal", "flatten", "reshape", "_reshape_alias", "lift_fresh", "view_as_real", "numel", "sym_size",
             "sym_stride", "sym_numel", "sym_storage_offset", "is_pinned", "empty_strided", "empty", "dim"}
# Tensor methods that bring values to the host: on a GPU, a wait for every launch before them.
_WAITS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


def _site(frame) -> tuple[str, object]:
    """Who issued an operator: the innermost kernels/<op> dispatch on the stack (one launch on a GPU; its frame is
    returned too, it identifies the call), else the innermost frame of this repository outside kernels/, else of
    transformers' model code."""
    first = model = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_ROOT) and "/site-packages/" not in path and "/benchmarks/" not in path:
            rel = path[len(_ROOT) + 1:]
            if rel.startswith("kernels/") and rel.endswith("__init__.py"):
                return f"kernel {rel.split('/')[1]}.{frame.f_code.co_name}", frame
            if first is None and not rel.startswith("kernels/"):
                first = f"{rel}:{frame.f_code.co_name}"
        elif model is None and "/transformers/" in path:
            model = f"transformers/{path.rsplit('/', 1)[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return first or model or "other", None


class _Census(TorchDispatchMode):
    """Counts dispatched operators by site: launches, metadata-only ones, and kernel calls (once each)."""

    def __init__(self):
        super().__init__()
        self.ops, self.meta, self.kernels = Counter(), Counter(), Counter()
        self._last_kernel_frame = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        site, kernel_frame = _site(sys._getframe(1))
        name = func.overloadpacket.__name__
        if kernel_frame is not None:
            # One launch per call of the dispatch function: counted at the first of its operators.
            if kernel_frame is not self._last_kernel_frame:
                self._last_kernel_frame = kernel_frame
                self.kernels[site] += 1
        elif name in _METADATA:
            self.meta[site] += 1
        else:
            self.ops[f"{site} [{name}]"] += 1
        return func(*args, **(kwargs or {}))


class _Waits(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.waits = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _WAITS or (name == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))):
            site, kernel_frame = _site(sys._getframe(1))
            if kernel_frame is None:  # inside a kernel: a CPU reference's own; the CUDA launchers do not wait
                self.waits[f"{site} [{name}]"] += 1
        return func(*args, **(kwargs or {}))


def _census(run, per: int, rows: int) -> dict:
    census, waits = _Census(), _Waits()
    with waits, census:
        run()

    def table(counter: Counter) -> list[dict]:
        return [{"site": k, "per_layer_chunk": round(v / per, 2)} for k, v in counter.most_common(rows)]
    return {"operators_per_layer_chunk": round(sum(census.ops.values()) / per, 1),
            "kernel_calls_per_layer_chunk": round(sum(census.kernels.values()) / per, 1),
            "metadata_ops_per_layer_chunk": round(sum(census.meta.values()) / per, 1),
            "waits_per_layer_chunk": round(sum(waits.waits.values()) / per, 2),
            "operators": table(census.ops), "kernels": table(census.kernels), "waits": table(waits.waits),
            "metadata": table(census.meta)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--profile", default="dense")
    ap.add_argument("--set", action="append", default=[], help="key=value profile override (repeatable)")
    ap.add_argument("--length", default="32k")
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--python", action="store_true", help="also one prefill under cProfile")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="skip the prefill under torch.profiler (long documents: its events take minutes to sum)")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--census", action="store_true", help="count operators and waits per layer and chunk instead "
                    "of timing under the profiler")
    ap.add_argument("--layers", type=int, default=None, help="a random preset cut to this many layers")
    ap.add_argument("--intermediate", type=int, default=None, help="a random preset's MLP width")
    args = ap.parse_args()
    if args.layers or args.intermediate:
        if not args.model.startswith("random:"):
            ap.error("--layers and --intermediate change random presets only")
        shape = RANDOM_PRESETS[args.model[7:]]
        shape.update({k: v for k, v in (("num_hidden_layers", args.layers), ("intermediate_size", args.intermediate))
                      if v})
        if "layer_types" in shape:
            shape["layer_types"] = shape["layer_types"][:shape["num_hidden_layers"]]
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
        row = {"profile": args.profile, "settings": args.set, "chunk_size": chunk, "tokens": n}
        if not (args.census and args.device == "cpu"):
            t = time.perf_counter()
            run()  # warm-up: compilation, kernel plans for every chunk's shapes
            row["first_prefill_s"] = round(time.perf_counter() - t, 3)
        if args.census:
            row["census"] = c = _census(run, lm.config.num_hidden_layers * -(-n // chunk), args.rows)
            print(f"{args.profile} chunk {chunk}: per layer and chunk {c['operators_per_layer_chunk']} operators, "
                  f"{c['kernel_calls_per_layer_chunk']} kernel calls, {c['waits_per_layer_chunk']} waits "
                  f"({c['metadata_ops_per_layer_chunk']} metadata operators)", flush=True)
            for part in ("operators", "kernels", "waits"):
                for r in c[part]:
                    print(f"  {part[:-1]:8s} {r['per_layer_chunk']:8.2f}  {r['site']}")
        else:
            t = time.perf_counter()
            run()
            wall = time.perf_counter() - t
            row.update({"prefill_s": round(wall, 3), "tokens_per_s": round(n / wall)})
            print(f"{args.profile} chunk {chunk}: prefill {wall:.2f} s ({n / wall:,.0f} tok/s), first prefill "
                  f"{row['first_prefill_s']:.2f} s", flush=True)
            if args.kernels:
                activity = ProfilerActivity.CUDA if args.device == "cuda" else ProfilerActivity.CPU
                with profile(activities=[activity]) as p:
                    run()
                kernel_ms, launches, top = _kernels(p, args.rows)
                row.update({"kernel_s": round(kernel_ms / 1e3, 3), "kernel_launches": launches, "top_kernels": top})
                print(f"  kernels {kernel_ms / 1e3:.2f} s in {launches:,} launches", flush=True)
                for k in top[:12]:
                    print(f"  {k['ms']:10.1f} ms {k['count']:8d}  {k['kernel']}")
            if args.python:
                row["python_top"] = _python_top(run, args.rows)
                for f in row["python_top"]:
                    print(f"  {f['self_s']:8.3f} s self {f['cum_s']:8.3f} s cum {f['calls']:8d}  {f['function']}")
        results.append(row)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        meta = {**run_stamp(), "random_weights": args.model.startswith("random:"), "results": results}
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
