"""`longctx bench`: speed of a profile's engine next to a baseline, on the same synthetic contexts.

Per engine and length: prefill seconds (after a warm-up prefill that absorbs compilation; `--warmup` can make
it shorter), decode ms/token (the mean over `steps` steps after warm-up steps that absorb graph capture: a
mean, so that periodic work such as resa's rectification is amortised; median and deciles too), peak memory,
and on GPU the decode memory roofline = (weight bytes + KV bytes read per step) / measured copy bandwidth.
With tasks, accuracy rows (`task`, `length`, `score`, `dense_score`) instead (longctx_cli/accuracy.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from engines import ENGINES
from engines.base import EngineInputError
from engines.decoding import Sampler
from longctx_cli import distributed
from longctx_cli.errors import ConfigError, is_out_of_memory
from longctx_cli.home import longctx_home
from longctx_cli.models import load_model
from longctx_cli.units import parse_count
from longctx_cli.report import RANDOM_NOTE, host_rss, memory_snapshot, reset_peaks, run_stamp

err = Console(stderr=True)
WARMUP_STEPS = 4
RUN_KEYS_RECORDED = ("chunk_size", "dtype", "decode_graph", "compile_decode", "fuse_projections",
                     "prefill_graphs")  # next to each engine's keys


def copy_bandwidth(device: torch.device, n_bytes: int = 2 << 30) -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (read + write counted)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * n_bytes / statistics.median(times)


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _reserve(steps: int) -> int:
    """Tokens measure() adds to the context: an 8-token question and WARMUP_STEPS + steps + 1 decoded."""
    return 8 + WARMUP_STEPS + steps + 1


def measure(engine, ids: torch.Tensor, steps: int) -> dict:
    """Prefill ids [N] (the context), ask 8 more tokens, decode WARMUP_STEPS + steps tokens; the row's fields."""
    gen = torch.Generator().manual_seed(1)
    question = torch.randint(int(ids.min()), int(ids.max()) + 1, (8,), generator=gen)
    host_reset = reset_peaks(host=True)
    rss_before = host_rss()[0]
    state = engine.prefill(ids, reserve=_reserve(steps))
    stream = engine.answer(state, question, WARMUP_STEPS + steps + 1, Sampler())
    times, last = [], None
    for i, _ in enumerate(stream):
        now = time.perf_counter()
        if i > WARMUP_STEPS:
            times.append(now - last)
        last = now
    deciles = statistics.quantiles(times, n=10) if len(times) > 1 else [None]
    row = {"prefill_s": state.prefill_s, "prefill_tok_s": ids.numel() / state.prefill_s,
           "decode_ms_per_token": 1000 * statistics.fmean(times), "decode_ms_median": 1000 * statistics.median(times),
           "decode_ms_p10": deciles[0] and 1000 * deciles[0], "decode_ms_p90": deciles[-1] and 1000 * deciles[-1]}
    mem = memory_snapshot(state.cache.nbytes())
    peak = max(mem["peak_gpu_bytes"].values()) if mem["peak_gpu_bytes"] else mem["host_peak_rss_bytes"]
    # The host's share of a run: resident memory before the prefill, and the most the prefill and answer added
    # (None where the host's peak could not be reset: it would hold the model's load too).
    added = (mem["host_peak_rss_bytes"] - rss_before) / 2**30 if host_reset else None
    row.update(peak_gib=peak / 2**30, kv_cache_bytes=mem["kv_cache_bytes"], host_rss_before_gib=rss_before / 2**30,
               host_peak_added_gib=added, counters=engine.counters(state))
    del state, stream
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def _out_of_memory(message: str, engine, model, length: int, steps: int) -> dict:
    """The fields of a row whose run ran out of memory: the error, the engine's planned state and what was free."""
    gc.collect()
    dtype_bytes = next(model.parameters()).element_size()
    planned = engine.memory_plan(model.config, length + _reserve(steps), dtype_bytes, engine.config,
                                 chunk_size=engine.run.chunk_size, reserve=_reserve(steps))
    row = {"out_of_memory": message,
           "planned_state_gib": planned / 2**30, "weights_gib": _weight_bytes(model) / 2**30}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        row["free_gib_after_weights"] = {f"cuda:{i}": torch.cuda.mem_get_info(i)[0] / 2**30
                                         for i in range(torch.cuda.device_count())}
    return row


@contextlib.contextmanager
def _engine_input_errors():
    """A document an engine's settings cannot take (too many ranks for its blocks, more context memory than
    the host has, ...) is the user's to fix: one line, exit 4, as in `ask`."""
    try:
        yield
    except EngineInputError as exc:
        raise ConfigError(str(exc)) from None


def _layer_state(profile, model: str | None, n_tokens: int) -> list[int] | None:
    """The profile's planned state per layer at the longest length, for a model split over GPUs."""
    if not (profile.run.gpus_model or 1) > 1:
        return None
    from longctx_cli.models import load_config
    from longctx_cli.split import layer_state_bytes

    run = profile.run
    return layer_state_bytes(ENGINES[profile.engine], load_config(model), n_tokens + run.max_new_tokens,
                             4 if run.dtype == "float32" else 2, profile.engine_config, chunk_size=run.chunk_size,
                             reserve=run.max_new_tokens)


def run_bench(profiles: list, baseline, *, model: str | None, lengths: str, steps: int, json_path: str | None,
              argv: list[str], warmup_tokens: int | None = None, tasks: list[str] | None = None, samples: int = 10, seed: int = 0,
              depths: list[float] | None = None, plot_path: str | None = None, layout: str = "auto") -> dict:
    """Each profile's engine, then the baseline's, on the same inputs; the model is loaded once."""
    profile = profiles[0]
    lm = load_model(model, device=profile.run.device, dtype=profile.run.dtype, gpus_model=profile.run.gpus_model,
                    layer_state=_layer_state(profile, model, max(parse_count(x) for x in lengths.split(","))),
                    progress=lambda m: err.print(f"[dim]{m}...[/]"))
    # Several ranks (star --gpus N): every rank runs the engine, the baseline runs on the query rank alone (one
    # GPU), which also prints and writes the results.
    lead = distributed.is_query_rank()
    with _engine_input_errors():  # settings the model refuses (e.g. a layer it does not have), as in `ask`
        engines = [(prof, ENGINES[prof.engine](lm, prof.engine_config, prof.run, home=longctx_home()))
                   for prof in [*profiles, baseline if lead else None] if prof is not None]
    # The parameters in effect, not just profile names: a profile file may change after the run.
    # Engine keys, then the run keys that shape what is measured (decoding's graph and compilation, chunking).
    settings = {prof.name: {"engine": prof.engine, **dataclasses.asdict(prof.engine_config),
                            **{k: getattr(prof.run, k) for k in RUN_KEYS_RECORDED}} for prof, _ in engines}
    if tasks:
        from longctx_cli import accuracy

        with _engine_input_errors():
            stamp = {**run_stamp(distributed.command(argv)), "model": model or "gemma3-270m",
                     "random_weights": lm.random_weights, "mode": "accuracy", "engine_settings": settings}

            def partial(so_far: dict) -> None:
                if lead and json_path != "-":
                    _write({**stamp, "partial": True, **so_far}, json_path)

            # One answer budget for every profile, so that they all see the same prompts.
            result = accuracy.run_accuracy(engines, lm.tokenizer, baseline=baseline and baseline.name,
                                           tasks=tasks, lengths=[parse_count(x) for x in lengths.split(",")],
                                           samples=samples, seed=seed, depths=depths,
                                           max_new_tokens=min(p.run.max_new_tokens for p in profiles),
                                           layout=layout, stop=profile.run.stop, on_rows=partial)
        result = {**stamp, **result}
        if lead:
            accuracy.render(result, f"accuracy: {result['model']}" + (f" ({RANDOM_NOTE})" if lm.random_weights else ""))
            if plot_path:
                accuracy.plot(result, plot_path)
            _write(result, json_path)
        return result
    on_gpu = engines[0][1].device.type == "cuda"
    bandwidth = copy_bandwidth(engines[0][1].device) if on_gpu else None
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for length in [parse_count(x) for x in lengths.split(",")]:
        ids = torch.randint(min(1000, vocab // 2), vocab, (length,), generator=gen)
        for prof, engine in engines:
            # An identical warm-up run absorbs kernel compilation (per shape) and graph capture; --warmup N runs
            # it on the first N tokens instead (0: none).
            warm = ids if warmup_tokens is None else ids[:warmup_tokens]
            row = {"engine": prof.engine, "profile": prof.name, "context_tokens": length,
                   "ranks": getattr(engine, "world", 1)}
            oom = None
            try:
                with _engine_input_errors():
                    if warm.numel():
                        measure(engine, warm, steps)
                    err.print(f"[dim]{prof.name}: {length:,} tokens...[/]")
                    row.update(measure(engine, ids, steps))
            except (MemoryError, RuntimeError) as exc:
                if not is_out_of_memory(exc):
                    raise
                oom = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            if oom is not None:
                # Where an engine runs out of memory is a result (dense at 1M tokens): a row, and on to the next.
                # Measured here, once the exception and the frames holding the failed run's tensors are gone.
                row.update(_out_of_memory(oom, engine, lm.model, length, steps))
                err.print(f"[yellow]{prof.name}: {length:,} tokens: {oom}[/]")
                rows.append(row)
                continue
            if bandwidth:
                dtype_bytes = next(lm.model.parameters()).element_size()
                read = _weight_bytes(lm.model) + engine.kv_read_bytes(lm.model.config, length, dtype_bytes)
                row["roofline_ms"] = 1000 * read / bandwidth
                row["roofline_ratio"] = row["decode_ms_per_token"] / row["roofline_ms"]
            rows.append(row)
    result = {**run_stamp(distributed.command(argv)), "model": model or "gemma3-270m",
              "random_weights": lm.random_weights, "engine_settings": settings, "hbm_bytes_per_s": bandwidth, "decode_steps": steps,
              "warmup_tokens": "same" if warmup_tokens is None else warmup_tokens, "rows": rows}
    if lm.random_weights:
        result["note"] = RANDOM_NOTE
    if lead:
        _table(result)
        _write(result, json_path)
    return result


def _write(result: dict, json_path: str | None) -> None:
    if json_path == "-":
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    elif json_path:
        # Written whole under a temporary name and renamed: a run stopped while writing leaves the last file.
        tmp = f"{json_path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(tmp, json_path)


def _table(result: dict) -> None:
    title = f"bench: {result['model']}" + (f" ({RANDOM_NOTE})" if result["random_weights"] else "")
    table = Table(title=title, title_justify="left")
    for col in ("engine", "context", "prefill s", "tok/s", "decode ms/tok", "peak GiB", "roofline ms", "ratio"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        # A profile other than the engine's own name (two profiles of one engine side by side) is named with it.
        profile = r.get("profile", r["engine"])
        engine = r["engine"] + ("" if profile == r["engine"] else f" ({profile})") + (
            f" x{r['ranks']} ranks" if r.get("ranks", 1) > 1 else "")
        if "out_of_memory" in r:
            table.add_row(engine, f"{r['context_tokens']:,}", "[red]out of memory[/]",
                          f"state {r['planned_state_gib']:.1f} GiB", "-", "-", "-", "-")
            continue
        table.add_row(engine, f"{r['context_tokens']:,}", f"{r['prefill_s']:.2f}", f"{r['prefill_tok_s']:,.0f}",
                      f"{r['decode_ms_per_token']:.2f}", f"{r['peak_gib']:.2f}",
                      f"{r['roofline_ms']:.2f}" if "roofline_ms" in r else "-",
                      f"{r['roofline_ratio']:.2f}x" if "roofline_ratio" in r else "-")
    err.print(table)
