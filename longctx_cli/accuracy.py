"""`longctx bench --tasks ...`: RULER-style accuracy of an engine next to dense, on the same samples.

Every sample is generated once (token-exact length, seeded) and run through each engine with greedy decoding;
the answer is the text up to the first stop string (base models) or end-of-turn (chat models), scored as RULER
does. Rows: task x length with both engines' mean scores (0-100), their ratio, and their speed on the way.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from engines.decoding import Sampler
from longctx_cli.prompt import AnswerText, build_layout
from longctx_cli.tasks import ANSWER_BUDGET, base_overhead, generate, prompt_tail, score

err = Console(stderr=True)


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


class PromptBuilder:
    """Token ids of a sample's prompt in the model's layout, and the matching length overhead for generate()."""

    def __init__(self, tokenizer, layout: str, stop: list[str]):
        self.tokenizer = tokenizer
        probe = build_layout(tokenizer, "?", stop, layout=layout)
        self.chat, self.stop_strings, self.stop_ids = probe.chat, probe.stop_strings, probe.stop_ids
        self.prefix = probe.prefix_ids

    def tail(self, question: str, answer_prefix: str) -> torch.Tensor:
        if not self.chat:
            return _ids(self.tokenizer, prompt_tail(question, answer_prefix))
        layout = build_layout(self.tokenizer, question, [], layout="chat")
        return torch.cat([layout.question_ids, _ids(self.tokenizer, answer_prefix)])

    def overhead(self):
        if not self.chat:
            return base_overhead(self.tokenizer)
        return lambda question, prefix: self.prefix.numel() + self.tail(question, prefix).numel()


def _past_context(prof, engine, n_tokens: int) -> str | None:
    """Why this engine does not run a prompt of n_tokens (with its answer): past the model's context, which only
    the engines that re-assign positions read (engines/positions.py); None when it runs."""
    from engines.config import reads_past_context
    from engines.positions import context_limit

    limit = context_limit(engine.model.config)
    if not limit or n_tokens <= limit or reads_past_context(prof.engine, prof.engine_config):
        return None
    return f"past the model's context of {limit:,} tokens"


def _run(prof, engine, builder: PromptBuilder, sample, budget: int) -> dict:
    doc = torch.cat([builder.prefix, _ids(builder.tokenizer, sample.document)])
    tail = builder.tail(sample.question, sample.answer_prefix)
    skipped = _past_context(prof, engine, doc.numel() + tail.numel() + budget)
    if skipped:
        return {"skipped": skipped, "score": None, "prefill_s": None, "decode_ms_per_token": None,
                "prompt_tokens": doc.numel() + tail.numel()}
    state = engine.prefill(doc, reserve=tail.numel() + budget)
    text = AnswerText(builder.tokenizer, builder.stop_strings, builder.stop_ids)
    stream = engine.answer(state, tail, budget, Sampler())
    steps, last = [], time.perf_counter()
    try:
        for token in stream:
            now = time.perf_counter()
            steps.append(now - last)
            last = now
            text.feed(token)
            if text.done:
                break
    finally:
        stream.close()
    return {"answer": text.text.strip(), "score": 100 * score(sample, text.text), "prefill_s": state.prefill_s,
            "decode_ms_per_token": 1000 * statistics.fmean(steps[1:]) if len(steps) > 1 else None,
            "prompt_tokens": doc.numel() + tail.numel(), "counters": engine.counters(state)}


def run_accuracy(engines: list, tokenizer, *, baseline: str | None, tasks: list[str], lengths: list[int],
                 samples: int, seed: int, depths: list[float] | None, max_new_tokens: int, layout: str,
                 stop: list[str], on_rows=None) -> dict:
    """engines: [(profile, engine)], each run on every sample; baseline: the name of the profile among them
    (dense, last) whose scores every other profile's row is compared with, or None. on_rows(result so far) is
    called after each sample, so that a long run that is stopped keeps every sample it finished: the rows of the
    task and length in progress then count the samples done so far and carry "partial": true."""
    builder = PromptBuilder(tokenizer, layout, stop)
    records, rows = [], []
    total = len(tasks) * len(lengths) * samples * len(engines)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        job = bar.add_task("accuracy", total=total)
        for task in tasks:
            budget = min(ANSWER_BUDGET[task], max_new_tokens)
            for length in lengths:
                batch = generate(task, length, samples, tokenizer, seed=seed, depths=depths, budget=budget,
                                 overhead=builder.overhead())
                per_engine = {prof.name: [] for prof, _ in engines}
                for i, sample in enumerate(batch, 1):
                    record = {"task": task, "length": length, "index": sample.index, "seed": seed,
                              "prompt_hash": sample.prompt_hash, "depths": sample.depths,
                              "expected": sample.expected, "results": {}}
                    for prof, engine in engines:
                        bar.update(job, description=f"{task} {length:,} #{sample.index} {prof.name}")
                        result = _run(prof, engine, builder, sample, budget)
                        record["results"][prof.name] = result
                        per_engine[prof.name].append(result)
                        bar.advance(job)
                    records.append(record)
                    if on_rows and i < len(batch):  # the last sample's save comes with its finished rows
                        so_far = [{**row, "partial": True} for row in _rows(task, length, engines, per_engine, baseline)]
                        on_rows({"rows": rows + so_far, "samples": list(records)})
                rows += _rows(task, length, engines, per_engine, baseline)
                if on_rows:
                    on_rows({"rows": list(rows), "samples": list(records)})
    return {"rows": rows, "samples": records}


def _rows(task: str, length: int, engines: list, per_engine: dict[str, list], baseline: str | None) -> list[dict]:
    """Every profile's row of one task and length but the baseline's, over the samples answered so far."""
    base = per_engine[baseline] if baseline else None
    return [_row(task, length, prof, per_engine[prof.name], base) for prof, _ in engines if prof.name != baseline]


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _row(task: str, length: int, prof, mine: list[dict], dense: list[dict] | None) -> dict:
    """One profile's row: its mean score and speed next to the baseline's on the same samples."""
    # Without a baseline (--compare none) the dense columns stay empty, unless the engine is dense itself.
    if dense is None:
        dense = mine if prof.engine == "dense" else []
    # Engines that cannot read past the model's context skip longer samples: their columns stay empty.
    row = {"task": task, "length": length, "engine": prof.engine, "profile": prof.name,
           "samples": sum(r["score"] is not None for r in mine),
           "score": _mean([r["score"] for r in mine]), "dense_score": _mean([r["score"] for r in dense]),
           "prefill_s": _mean([r["prefill_s"] for r in mine]),
           "decode_ms_per_token": _mean([r["decode_ms_per_token"] for r in mine]),
           "dense_prefill_s": _mean([r["prefill_s"] for r in dense]),
           "dense_decode_ms_per_token": _mean([r["decode_ms_per_token"] for r in dense])}
    row["ratio"] = row["score"] / row["dense_score"] if row["dense_score"] else None
    for key, results in (("skipped", mine), ("dense_skipped", dense)):
        reasons = sorted({r["skipped"] for r in results if r.get("skipped")})
        if reasons:
            row[key] = "; ".join(reasons)
    return row


def render(result: dict, title: str) -> None:
    table = Table(title=title, title_justify="left")
    profiles = list(dict.fromkeys(r["profile"] for r in result["rows"]))
    if len(profiles) > 1:
        table.add_column("profile", no_wrap=True)
    table.add_column("task", no_wrap=True, min_width=15)
    for col in ("length", "score", "dense", "ratio", "prefill s", "dense prefill", "ms/tok", "dense ms/tok"):
        table.add_column(col, justify="right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lead = (lambda name: [name]) if len(profiles) > 1 else (lambda name: [])  # noqa: E731
    for name in profiles:
        rows = [r for r in result["rows"] if r["profile"] == name]
        for r in rows:
            table.add_row(*lead(name), r["task"], f"{r['length']:,}", fmt(r["score"], ".1f"),
                          fmt(r["dense_score"], ".1f"), fmt(r["ratio"], ".2f"), fmt(r["prefill_s"], ".2f"),
                          fmt(r["dense_prefill_s"], ".2f"), fmt(r["decode_ms_per_token"], ".1f"),
                          fmt(r["dense_decode_ms_per_token"], ".1f"))
        mine, dense = _mean([r["score"] for r in rows]), _mean([r["dense_score"] for r in rows])
        table.add_row(*lead(name), "mean", "", fmt(mine, ".1f"), fmt(dense, ".1f"), "", "", "", "", "",
                      end_section=len(profiles) > 1)
    err.print(table)
    for r in result["rows"]:
        for key, who in (("skipped", r["profile"]), ("dense_skipped", "dense")):
            if r.get(key):
                err.print(f"{who} not run on {r['task']} at {r['length']:,} tokens: {r[key]}")


def pyplot():
    """matplotlib.pyplot on a file backend, or a ConfigError saying how to install it (checked before a run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from longctx_cli.errors import ConfigError

        raise ConfigError("--plot needs matplotlib: pip install 'longctx[plot]'") from None
    return plt


def plot(result: dict, path: str) -> None:
    """Accuracy-vs-length (per task, engine and dense) and decode-ms-vs-length charts in one PNG/PDF."""
    plt = pyplot()
    # Cells an engine did not run (past the model's context) are gaps.
    rows = [{k: float("nan") if v is None else v for k, v in r.items()} for r in result["rows"]]
    fig, (acc, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        for name in dict.fromkeys(r["profile"] for r in mine):
            own = [r for r in mine if r["profile"] == name]
            acc.plot([r["length"] for r in own], [r["score"] for r in own], marker="o", label=f"{task} ({name})")
        dense = list({r["length"]: r for r in mine}.values())  # the baseline's scores, once per length
        acc.plot([r["length"] for r in dense], [r["dense_score"] for r in dense], ls="--", color="gray",
                 label=f"{task} (dense)")
    by_length = sorted({r["length"] for r in rows})
    series = [(f"{name}", "decode_ms_per_token", name) for name in dict.fromkeys(r["profile"] for r in rows)]
    for label, key, name in series + [("dense", "dense_decode_ms_per_token", None)]:
        own = [r for r in rows if name is None or r["profile"] == name]
        speed.plot(by_length, [_mean([r[key] for r in own if r["length"] == n]) for n in by_length], marker="o",
                   label=label)
    acc.set(xscale="log", xlabel="context tokens", ylabel="score (0-100)", title="accuracy vs length")
    speed.set(xscale="log", xlabel="context tokens", ylabel="ms / token", title="decode vs length")
    acc.legend(fontsize=7)
    speed.legend()
    fig.tight_layout()
    fig.savefig(path)
