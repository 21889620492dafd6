"""Compilations during a run, for the report: Triton's JIT (the engines' kernels, and Inductor's) and torch.compile
(FlexAttention, compiled decode blocks), timed through their own hooks.

Each compilation's time is claimed from whatever the clock is timing (prefill, the question, a decode step), so
the report shows it as its own part, `compile`, and each document's report says what was compiled for it. A
Triton kernel Inductor builds inside a torch.compile is counted once, inside the torch.compile. A kernel read
back from Triton's disk cache passes the same hooks and counts too, with the little time it took.
"""

from __future__ import annotations

import importlib.util
import time

from longctx_cli.clock import CLOCK


class CompileWatch:
    def __init__(self):
        self.kernels = self.graphs = 0  # since the last `take`
        self.seconds = 0.0
        self._pending: dict = {}  # Triton kernel key -> start
        self._graph_start: float | None = None
        self.installed: list[str] = []

    def _claim(self, seconds: float) -> None:
        self.seconds += seconds
        CLOCK.claim("compile", seconds)

    def install(self, runtime=None, dynamo=None) -> None:
        """Hook Triton (`runtime`: triton.knobs.runtime, found when Triton is installed) and Dynamo (`dynamo`: its
        callback handler); the hooks already set stay in the chain. Once per process."""
        if self.installed:
            return
        if runtime is None and importlib.util.find_spec("triton") is not None:
            try:
                from triton import knobs
                runtime = knobs.runtime
            except ImportError:  # a Triton without knobs (before 3.4): not tracked
                runtime = None
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            self._hook_triton(runtime)
            self.installed.append("triton")
        if dynamo is None:
            from torch._dynamo.callback import callback_handler as dynamo
        dynamo.register_start_callback(self._graph_started)
        dynamo.register_end_callback(self._graph_ended)
        self.installed.append("torch.compile")

    def _hook_triton(self, runtime) -> None:
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def started(*args, **kwargs):
            if before is not None and before(*args, **kwargs):
                return True
            if self._graph_start is None:
                self._pending[kwargs.get("key")] = time.perf_counter()
            return False

        def finished(*args, **kwargs):
            began = self._pending.pop(kwargs.get("key"), None)
            if began is not None:
                self.kernels += 1
                self._claim(time.perf_counter() - began)
            return after(*args, **kwargs) if after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = started, finished

    def _graph_started(self, args=None) -> None:
        self._graph_start = time.perf_counter()

    def _graph_ended(self, args=None) -> None:
        if self._graph_start is not None:
            self.graphs += 1
            self._claim(time.perf_counter() - self._graph_start)
            self._graph_start = None

    def take(self) -> str:
        """What was compiled since the last take, for a report ("none" when nothing was)."""
        parts = []
        if self.kernels:
            parts.append(f"{self.kernels} Triton kernel{'s' * (self.kernels > 1)}")
        if self.graphs:
            parts.append(f"{self.graphs} torch.compile graph{'s' * (self.graphs > 1)}")
        text = f"{' + '.join(parts)} ({self.seconds:.2f} s)" if parts else "none"
        self.kernels = self.graphs = 0
        self.seconds = 0.0
        return text


WATCH = CompileWatch()
