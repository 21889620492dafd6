"""Decode steps of a model split over several GPUs: each device's run of layers (a segment) replays one CUDA graph.

A CUDA graph is captured on one device, so one graph cannot hold a step that crosses devices. The model's own
forward still runs the step: its embedding, rotary embedding, final norm and LM head eagerly (a few kernels),
and accelerate's hooks around them. The decoder layers, which are nearly all of the step's kernels, are replaced
while a step runs by stand-ins: every stand-in of a segment but the last only takes note of its inputs; the last
copies the segment's inputs into static buffers on the segment's device (the hidden state from the previous
device, and the step's position tensors: the rotation, the position ids) and replays the segment's graph, whose
output the next segment reads. So per step the host launches a few copies and one graph per device, and never
waits for a device inside the step.

Capture: one eager step (the modules' lazy allocations, cuBLAS workspaces), then one step in which each segment,
at its last stand-in, captures its layers over static copies of what it was given and replays them at once. The
layers' tensors that stay the same from step to step (the cache's state, its per-device position mirrors) are
read in place; tensors the model makes afresh every step are matched by which stand-in and argument brought them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from engines.streams import side_stream


class CudaGraph:
    """A CUDA graph captured on `device` (its own capture stream: torch's default one belongs to one device)."""

    def __init__(self, run, device: torch.device):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            stream = side_stream(device, "capture")
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.graph(self.graph, stream=stream):
                run()
            torch.cuda.current_stream(device).wait_stream(stream)

    def replay(self) -> None:
        self.graph.replay()


class _StandIn(torch.nn.Module):
    def __init__(self, segment: "Segment", k: int):
        super().__init__()
        self.segment, self.k = [segment], k  # a list: not a submodule of the stand-in

    def forward(self, hidden, *args, **kwargs):
        return self.segment[0].call(self.k, hidden, args, kwargs)


class Segment:
    """Decoder layers `layers` (modules, in order) on `device`, run as one graph once captured."""

    def __init__(self, layers: list[torch.nn.Module], device: torch.device, graph_class):
        self.layers, self.device, self.graph_class = layers, device, graph_class
        self.mode = "eager"
        self.graph = None
        self.pending: list = []  # this step's (args, kwargs) per stand-in, and the hidden state the first was given
        self.first: torch.Tensor | None = None
        self.hidden_in: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.loads: list[tuple[int, int, torch.Tensor]] = []  # (stand-in, leaf, static buffer) copied per step

    def call(self, k: int, hidden, args, kwargs):
        if self.mode == "eager":
            return self.layers[k](hidden, *args, **kwargs)
        if k == 0:
            self.pending, self.first = [], hidden
        self.pending.append((args, kwargs))
        if k < len(self.layers) - 1:
            return hidden  # the segment runs as a whole at its last layer
        if self.mode == "capture":
            self._capture()
        else:
            self._load()
        self.graph.replay()
        return self.out

    def _capture(self) -> None:
        """Static copies of the step's tensors (one per distinct tensor), then the layers captured over them."""
        self.hidden_in = self.first.to(self.device, copy=True)
        statics: dict[int, torch.Tensor] = {}
        calls, self.loads = [], []
        for k, (args, kwargs) in enumerate(self.pending):
            leaves, spec = tree_flatten((args, kwargs))
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and id(leaf) not in statics:
                    statics[id(leaf)] = leaf.to(self.device, copy=True)
                    self.loads.append((k, i, statics[id(leaf)]))
            calls.append(tree_unflatten([statics.get(id(x), x) if isinstance(x, torch.Tensor) else x
                                         for x in leaves], spec))

        def run() -> None:
            hidden = self.hidden_in
            for layer, (args, kwargs) in zip(self.layers, calls):
                hidden = layer(hidden, *args, **kwargs)
            self.out = hidden

        self.graph = self.graph_class(run, self.device)

    def _load(self) -> None:
        self.hidden_in.copy_(self.first, non_blocking=True)
        flat: dict[int, list] = {}
        for k, i, static in self.loads:
            if k not in flat:
                flat[k] = tree_flatten(self.pending[k])[0]
            static.copy_(flat[k][i], non_blocking=True)


def device_runs(layer_devices: list[torch.device]) -> list[range]:
    """The runs of consecutive layers on one device, in order."""
    runs, start = [], 0
    for i in range(1, len(layer_devices) + 1):
        if i == len(layer_devices) or layer_devices[i] != layer_devices[start]:
            runs.append(range(start, i))
            start = i
    return runs


class SegmentedRun:
    """A static-shape forward (one form of a decode step) over a model split in device segments, with
    each segment's layers replayed from its own graph. `layer_devices[i]`: the device of decoder layer i."""

    def __init__(self, model: torch.nn.Module, layer_devices: list[torch.device], graph_class=CudaGraph,
                 runs: list[range] | None = None):
        """runs: the segments' layers (default: each device's run of layers)."""
        self.args = (model, layer_devices, graph_class, runs)
        self.decoder = model.get_decoder()
        layers = self.decoder.layers
        self.segments: list[Segment] = []
        stand_ins: list[_StandIn] = []
        for run in runs or device_runs(layer_devices):
            segment = Segment(list(layers[run.start:run.stop]), layer_devices[run.start], graph_class)
            self.segments.append(segment)
            stand_ins += [_StandIn(segment, k) for k in range(len(run))]
        self.stand_ins = torch.nn.ModuleList(stand_ins)
        self.captured = False

    def fresh(self) -> "SegmentedRun":
        """Another run over the same segments, for a forward of other shapes (its own graphs)."""
        return SegmentedRun(*self.args)

    @property
    def devices(self) -> list[torch.device]:
        return [segment.device for segment in self.segments]

    @contextlib.contextmanager
    def _installed(self, mode: str):
        """The stand-ins in the layers' place (one attribute swapped: a step's host work stays small)."""
        for segment in self.segments:
            segment.mode = mode
        layers, self.decoder.layers = self.decoder.layers, self.stand_ins
        try:
            yield
        finally:
            self.decoder.layers = layers

    def capture(self, run, restore, swapped=contextlib.nullcontext) -> None:
        """An eager run, `restore()`, then a run that captures (and replays) every segment, and `restore()`:
        `run` writes the step's K/V twice to the same slots, as the single-device capture does."""
        with swapped(), self._installed("eager"):
            run()
        restore()
        with swapped(), self._installed("capture"):
            run()
        restore()
        self.captured = True

    def replay(self, run) -> None:
        with self._installed("replay"):
            run()
