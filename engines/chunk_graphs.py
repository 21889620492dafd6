"""A prefill chunk's fixed-shape work replayed as CUDA graphs.

Chunked prefill calls the same small functions with the same shapes at every chunk of a long document, and on a
GPU such a prefill is bound by the host issuing them: a small PyTorch operation costs 10-11 us of host time on an
H200 host (benchmarks/README.md) against a few us of GPU time. A `ChunkGraph` captures a function once for
inputs of one shape and replays it at later calls: the new inputs are copied into the captured ones (one copy
each), the graph is launched (one call), and the outputs are the captured ones, written again at each replay.

Rules for what may be graphed: the function reads only its tensor inputs and tensors that keep their address
(weights, settings made once), waits for nothing on the host, and its results are consumed before the same graph
is replayed again. The graphs of a device draw on one private memory pool (while one of them lives); graphs are
replayed one at a time on one stream, so one graph's scratch memory may be another's.

`torch.cuda.graph` (the context manager) empties PyTorch's device and pinned-host caches at every capture; the
captures here use CUDAGraph's capture_begin / capture_end directly, in "thread_local" mode so that threads pinning
host memory meanwhile are not refused.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch

from engines.streams import side_stream

# Full chunks a prefill needs before its work is captured: a capture took 0.7-3.4 ms on an H200 (the eager run it
# starts with included), the host time of 20-40 eager calls of a norm (8 operations of 10-11 us).
PAYBACK_CHUNKS = 32

# Per device, a live graph whose memory pool the next capture shares. A pool lives as long as a graph captured into
# it: once every such graph is gone, a capture starts a new pool (PyTorch refuses a handle whose graphs all died).
_POOL_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _pool(device: torch.device) -> tuple | None:
    owner = _POOL_OWNERS.get(device)
    return owner.graph.pool() if owner is not None else None


def graphable(*tensors: torch.Tensor) -> bool:
    """Whether work on these tensors can be captured now: CUDA tensors, and no capture under way already."""
    return all(t.is_cuda for t in tensors) and not torch.cuda.is_current_stream_capturing()


class ChunkGraph:
    """fn(*inputs) -> a tensor or a tuple of tensors, captured as a CUDA graph for inputs of the shapes and dtypes
    of its first call and replayed afterwards. The returned tensors are the graph's own: valid until its next
    replay. Calls with other shapes run fn eagerly (`captured` says whether the graph exists).

    inputs: a dict shared by graphs that are replayed one after another (a model's layers): their captured inputs
    of one position, shape and dtype are one tensor, since a graph reads its inputs only while it replays."""

    def __init__(self, fn: Callable, name: str = "", inputs: dict | None = None):
        self.fn, self.name, self.shared = fn, name, inputs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs = None
        self.key: tuple | None = None
        self.replays = 0

    @staticmethod
    def _key(inputs) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def matches(self, *inputs: torch.Tensor) -> bool:
        return self.key is None or self.key == self._key(inputs)

    def __call__(self, *inputs: torch.Tensor):
        if not graphable(*inputs) or not self.matches(*inputs):
            return self.fn(*inputs)
        if self.graph is None:
            return self._capture(inputs)
        for static, new in zip(self.inputs, inputs):
            static.copy_(new)
        self.graph.replay()
        self.replays += 1
        return self.outputs

    def _capture(self, inputs):
        device = inputs[0].device
        current = torch.cuda.current_stream(device)
        side = side_stream(device, "chunk-capture")
        key = self._key(inputs)
        if self.shared is None:
            self.inputs = [t.clone() for t in inputs]
        else:
            self.inputs = [self.shared.setdefault((i, k), torch.empty_like(t))
                           for i, (k, t) in enumerate(zip(key, inputs))]
            for static, new in zip(self.inputs, inputs):
                static.copy_(new)
        # A run outside the capture first: kernels compile and load, libraries make their handles and workspaces
        # (none of which may happen while capturing). Its results are this call's.
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = self.fn(*self.inputs)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=_pool(device), capture_error_mode="thread_local")
            try:
                self.outputs = self.fn(*self.inputs)
            except BaseException:
                # The capture's own error (out of memory, Ctrl-C) is the one to report, not the failed capture's.
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass
                raise
            graph.capture_end()
        current.wait_stream(side)
        self.graph, self.key = graph, key
        _POOL_OWNERS[device] = self
        return result


_GRAPHED_SUFFIXES = ("MLP", "RMSNorm")
# Largest chunk input ([tokens, hidden]) whose modules are graphed (bytes): past it a chunk's products are long
# enough to hide the host's launches, and each graph keeps an output of that size.
_MAX_INPUT_BYTES = 8 << 20


class _Graphed(torch.nn.Module):
    """A decoder layer's norm or MLP, replayed as a ChunkGraph for inputs of `tokens` tokens (one graph per chunk
    length asked for); other inputs (the question, a document's last chunk) run the module itself."""

    def __init__(self, module: torch.nn.Module, inputs: dict):
        super().__init__()
        self.module, self.inputs = module, inputs
        self.graphs: dict[int, ChunkGraph] = {}
        self.tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] != self.tokens:
            return self.module(x)
        graph = self.graphs.get(self.tokens)
        if graph is None:
            graph = self.graphs[self.tokens] = ChunkGraph(self.module, type(self.module).__name__, self.inputs)
        return graph(x)


class PrefillModules:
    """The decoder layers' norms and MLPs (the model's own modules outside the attention: ~20 PyTorch operations a
    layer and chunk) as CUDA graphs, swapped in by `swapped()` for the chunks of a long prefill. One per model
    (`for_model`), shared by the engines on it; each module's graph keeps its output ([1, tokens, hidden]), and the
    graphs share their inputs."""

    def __init__(self, model: torch.nn.Module):
        self.slots: list[tuple[torch.nn.Module, str, torch.nn.Module, _Graphed]] = []
        inputs: dict = {}  # one captured input per shape for every module (ChunkGraph)
        for layer in getattr(model.get_decoder(), "layers", None) or []:
            for name, child in layer.named_children():
                if type(child).__name__.endswith(_GRAPHED_SUFFIXES):
                    self.slots.append((layer, name, child, _Graphed(child, inputs)))
        self.weights = self._weights()

    def _weights(self) -> tuple:
        return tuple(p.data_ptr() for _, _, module, _ in self.slots for p in module.parameters())

    @contextlib.contextmanager
    def swapped(self, tokens: int):
        """The graphed modules in place for inputs of `tokens` tokens (a chunk)."""
        if self._weights() != self.weights:
            # Weights moved since the captures (fused projections share one buffer): capture afresh.
            for *_, graphed in self.slots:
                graphed.graphs.clear()
            self.weights = self._weights()
        for parent, name, _, graphed in self.slots:
            graphed.tokens = tokens
            setattr(parent, name, graphed)
        try:
            yield
        finally:
            for parent, name, original, _ in self.slots:
                setattr(parent, name, original)

    def replays(self) -> int:
        """Graph replays so far, every module and chunk length."""
        return sum(g.replays for *_, graphed in self.slots for g in graphed.graphs.values())


def kept_bytes(config, tokens: int, dtype_bytes: int) -> int:
    """Device bytes a model's prefill graphs keep for chunks of `tokens` tokens, before its weights are loaded (for
    `longctx plan`): each decoder layer's norm and MLP outputs and one shared input; 0 where the modules stay eager.
    Gemma 2 and 3 layers have four norms, the other supported families two."""
    text = config.get_text_config(decoder=True)
    one = tokens * text.hidden_size * dtype_bytes
    if one > _MAX_INPUT_BYTES:
        return 0
    norms = 4 if text.model_type.startswith(("gemma2", "gemma3")) else 2
    return (text.num_hidden_layers * (norms + 1) + 1) * one


def graphed(config, run, n_tokens: int, dtype_bytes: int) -> bool:
    """Whether a prefill of n_tokens replays the layers' norms and MLPs as graphs, on one GPU (run: the run settings):
    the run key is on, enough full chunks repay the captures, and a chunk is small enough (`kept_bytes`)."""
    return (run.prefill_graphs and n_tokens // run.chunk_size >= PAYBACK_CHUNKS
            and kept_bytes(config, run.chunk_size, dtype_bytes) > 0)


_PREFILL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def for_model(model: torch.nn.Module) -> PrefillModules:
    if model not in _PREFILL:
        _PREFILL[model] = PrefillModules(model)
    return _PREFILL[model]
