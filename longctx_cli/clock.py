"""Where the wall clock goes, from the process's start to the last token: the parts every report lists.

A run's parts (start-up, imports, tokenizer, model load, prefill, decode, ...) accumulate in one `Clock`; each
report takes what accumulated since the previous report, so the reports of a run add up to its wall clock, and
whatever no part claimed shows as `other`.
"""

from __future__ import annotations

import contextlib
import time

import psutil


def process_start() -> float:
    """When this process started (seconds since the epoch; the kernel's record, to 10 ms)."""
    return psutil.Process().create_time()


class Clock:
    def __init__(self, start: float | None = None):
        self.mark = process_start() if start is None else start  # time.time() of the last take
        self.parts: dict[str, float] = {}
        self._open: list[list[float]] = []  # per open part: seconds its nested parts took
        self._claimed = 0.0  # claimed with no part open, for the next add_span

    @contextlib.contextmanager
    def part(self, name: str):
        """Time the block as `name`; a part opened inside it counts for itself only (no second count)."""
        began = time.perf_counter()
        self._open.append([0.0])
        try:
            yield
        finally:
            elapsed = time.perf_counter() - began
            nested = self._open.pop()[0]
            self.add(name, elapsed - nested)
            if self._open:
                self._open[-1][0] += elapsed

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + max(0.0, seconds)

    def claim(self, name: str, seconds: float) -> None:
        """`seconds` of `name` spent inside what is being timed now (a compilation inside prefill or a decode
        step): counted once, as `name`, and taken out of the open part or of the next `add_span`."""
        self.add(name, seconds)
        if self._open:
            self._open[-1][0] += seconds
        else:
            self._claimed += seconds

    def add_span(self, name: str, seconds: float) -> None:
        """A span timed outside `part` (a decode step) as `name`, less what was claimed inside it."""
        self.add(name, seconds - self._claimed)
        self._claimed = 0.0

    def take(self) -> dict[str, float]:
        """The parts since the last take, `other` (the rest) and `total` (wall clock); starts the next span."""
        now = time.time()
        parts, self.parts = self.parts, {}
        self._claimed = 0.0
        total = now - self.mark
        self.mark = now
        return {**parts, "other": max(0.0, total - sum(parts.values())), "total": total}


CLOCK = Clock()
