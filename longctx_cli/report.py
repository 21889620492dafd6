"""The per-document report: measured timings, memory and engine counters, as a rich table or JSON."""

from __future__ import annotations

import platform
import resource
import statistics
import sys
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.markup import escape
from rich.table import Table

RANDOM_NOTE = "random weights: speed only"


@dataclass
class Timings:
    load_s: float = 0.0
    tokenize_s: float = 0.0
    prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the start of prefill to the first answer token
    decode_step_s: list[float] = field(default_factory=list)
    # The wall clock since the previous report (the first: since the process started), by part, with `other`
    # for what no part claimed and `total`; the parts add up to `total`.
    wall: dict[str, float] = field(default_factory=dict)

    @property
    def decode_ms_per_token(self) -> float | None:
        """Mean time per decoded token after the first (what the decode part of the wall clock divides into)."""
        return 1000 * statistics.fmean(self.decode_step_s) if self.decode_step_s else None

    @property
    def decode_ms_median(self) -> float | None:
        return 1000 * statistics.median(self.decode_step_s) if self.decode_step_s else None


@dataclass
class Report:
    path: str
    question: str
    engine: str
    model: str
    random_weights: bool
    answer: str = ""
    tokens_in: int = 0
    tokens_out: int = 0
    answer_ids: list[int] = field(default_factory=list)  # generated token ids (exact comparisons between runs)
    stopped: str = ""  # stop | length | interrupted | stdout closed | error
    state: str = ""  # how the document's state came about: computed / saved / reused
    prefilled: int = 0  # document tokens through prefill so far (how far an interrupted prefill got)
    prefill_total: int = 0
    timings: Timings = field(default_factory=Timings)
    memory: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)
    error: str | None = None

    def as_json(self) -> dict:
        data = asdict(self)
        steps = data["timings"].pop("decode_step_s")
        data["timings"]["decode_ms_per_token"] = self.timings.decode_ms_per_token
        data["timings"]["decode_ms_median"] = self.timings.decode_ms_median
        data["timings"]["decode_steps"] = len(steps)
        data["timings"]["wall"] = {f"{k.replace(' ', '_')}_s": round(v, 4) for k, v in self.timings.wall.items()}
        prefill = self.timings.prefill_s
        data["timings"]["prefill_tok_s"] = self.tokens_in / prefill if prefill else None
        if self.random_weights:
            data["note"] = RANDOM_NOTE
        return data


def reset_peaks(host: bool = False) -> bool:
    """GPU peaks start again from what is held now; with `host`, on Linux, the host's peak resident set (VmHWM) too
    (a report of `ask` keeps the process's own, model load included). Returns whether the host's peak was reset."""
    import torch

    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.reset_peak_memory_stats(i)
    if not host:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM only (proc(5)); the pages' referenced bits stay
    except OSError:
        return False
    return True


def host_rss() -> tuple[int, int]:
    """(resident bytes now, peak since `reset_peaks(host=True)` or start) of this process; without /proc, the
    lifetime peak (ru_maxrss) for both."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            fields = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                      if k in ("VmRSS", "VmHWM")}
    except OSError:
        pass
    if len(fields) == 2:
        return fields["VmRSS"], fields["VmHWM"]
    scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return peak, peak


def memory_snapshot(kv_bytes: int = 0) -> dict:
    """Peak GPU bytes per device and host peak RSS of this process since their last reset, KV-cache bytes."""
    import torch

    gpus = {}
    if torch.cuda.is_available():
        gpus = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())}
    return {"peak_gpu_bytes": gpus, "host_peak_rss_bytes": host_rss()[1], "kv_cache_bytes": kv_bytes}


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def render(report: Report, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    t, m = report.timings, report.memory
    table = Table(title=f"longctx report: {escape(report.path)}", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    model = report.model + (f"  [yellow]({RANDOM_NOTE})[/]" if report.random_weights else "")
    rows = [
        ("question", escape(report.question)),
        ("engine / model", f"{report.engine} / {model}"),
        ("tokens in / out", f"{report.tokens_in:,} / {report.tokens_out:,}  (stopped: {report.stopped or '-'})"),
        ("model load", f"{t.load_s:.2f} s"),
        ("tokenize", f"{t.tokenize_s:.2f} s"),
        ("document state", report.state or "-"),
        ("prefill", f"{t.prefill_s:.2f} s  ({report.tokens_in / t.prefill_s:,.0f} tok/s)" if t.prefill_s else
         f"interrupted after {report.prefilled:,} of {report.prefill_total:,} tokens" if report.prefill_total else "-"),
        ("first token", f"{t.first_token_s:.2f} s" if t.first_token_s else "-"),
        ("decode", f"{t.decode_ms_per_token:.1f} ms/token (mean of {len(t.decode_step_s)}, median "
         f"{t.decode_ms_median:.1f})" if t.decode_step_s else "-"),
    ]
    if t.wall:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in t.wall.items() if k != "total" and v >= 0.005)
        rows.append(("wall clock", f"{t.wall['total']:.2f} s: {parts}"))
    for dev, peak in m.get("peak_gpu_bytes", {}).items():
        rows.append((f"peak {dev}", gib(peak)))
    rows += [("host peak RSS", gib(m.get("host_peak_rss_bytes"))), ("KV cache", gib(m.get("kv_cache_bytes")))]
    for key, value in report.counters.items():
        if key == "kv_cache_bytes":
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            # Per-rank (or per-part) records: one line each.
            rows += [(f"{key.replace('_', ' ')} [{i}]", _record(v)) for i, v in enumerate(value)]
        else:
            rows.append((key.replace("_", " "), str(value)))
    if report.error:
        rows.append(("error", f"[red]{escape(report.error)}[/]"))
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)


def _record(record: dict) -> str:
    """A flat record on one line: seconds and bytes in readable units."""
    def fmt(key: str, value) -> str:
        if isinstance(value, float) and key.endswith("_s"):
            return f"{value:.2f} s"
        if isinstance(value, int) and key.endswith("bytes"):
            return f"{value / 2**20:,.1f} MiB"
        return str(value)

    return ", ".join(f"{k.replace('_', ' ')} {fmt(k, v)}" for k, v in record.items())


def environment() -> dict:
    """Versions and device, stamped on every JSON result."""
    import torch
    import transformers

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
           "device": "cpu", "platform": platform.platform()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return env


def run_stamp(command: str | None = None) -> dict:
    """What a result file says about its run: the command line, the date (UTC) and the environment."""
    import datetime as dt

    return {"command": command or " ".join(["python3", *sys.argv]),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "environment": environment()}
