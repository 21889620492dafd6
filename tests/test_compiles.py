"""Compilations are their own part of the wall clock and each report says what was compiled for it
(longctx_cli/compiles.py, longctx_cli/clock.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from longctx_cli.clock import Clock
from longctx_cli.compiles import CompileWatch


def test_a_claim_inside_a_part_is_counted_once():
    clock = Clock(start=time.time())
    with clock.part("prefill"):
        time.sleep(0.2)
        clock.claim("compile", 0.15)
    clock.claim("compile", 0.1)  # no part open: taken from the next span
    clock.add_span("decode", 0.25)
    parts = clock.take()
    assert parts["compile"] == pytest.approx(0.25)
    assert parts["prefill"] == pytest.approx(0.05, abs=0.03)
    assert parts["decode"] == pytest.approx(0.15)


class _Handler:
    """Dynamo's callback handler, as far as the watch uses it."""

    def __init__(self):
        self.start, self.end = [], []

    def register_start_callback(self, fn):
        self.start.append(fn)

    def register_end_callback(self, fn):
        self.end.append(fn)


def test_triton_kernels_and_graphs_are_timed_and_named(monkeypatch):
    clock = Clock(start=time.time())
    monkeypatch.setattr("longctx_cli.compiles.CLOCK", clock)
    seen = []
    runtime = SimpleNamespace(jit_cache_hook=lambda **kw: seen.append(("pre", kw["key"])),
                              jit_post_compile_hook=lambda **kw: seen.append(("post", kw["key"])))
    handler = _Handler()
    watch = CompileWatch()
    watch.install(runtime=runtime, dynamo=handler)
    assert watch.installed == ["triton", "torch.compile"]
    assert watch.take() == "none"
    assert runtime.jit_cache_hook(key="k1") is False
    time.sleep(0.05)
    runtime.jit_post_compile_hook(key="k1")
    assert seen == [("pre", "k1"), ("post", "k1")]  # the hooks set before stay in the chain
    handler.start[0](None)
    runtime.jit_cache_hook(key="inside")  # a kernel Inductor builds inside the graph counts with the graph
    runtime.jit_post_compile_hook(key="inside")
    time.sleep(0.05)
    handler.end[0](None)
    text = watch.take()
    assert text.startswith("1 Triton kernel + 1 torch.compile graph (")
    assert clock.take()["compile"] >= 0.1
    assert watch.take() == "none"


def test_a_hook_that_skips_the_compilation_is_obeyed():
    runtime = SimpleNamespace(jit_cache_hook=lambda **kw: True, jit_post_compile_hook=None)
    watch = CompileWatch()
    watch.install(runtime=runtime, dynamo=_Handler())
    assert runtime.jit_cache_hook(key="k") is True


def test_a_real_torch_compile_is_seen(monkeypatch):
    from torch._dynamo.callback import callback_handler

    clock = Clock(start=time.time())
    monkeypatch.setattr("longctx_cli.compiles.CLOCK", clock)
    watch = CompileWatch()
    watch.install(runtime=SimpleNamespace(), dynamo=callback_handler)
    try:
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        assert "1 torch.compile graph" in watch.take()
    finally:
        for callbacks, fn in ((callback_handler.start_callbacks, watch._graph_started),
                              (callback_handler.end_callbacks, watch._graph_ended)):
            if fn in callbacks:
                callbacks.remove(fn)
