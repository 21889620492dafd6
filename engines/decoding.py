"""Sampling and the decode step: eager on CPU, captured once as a CUDA graph and replayed on GPU (one graph per
device's run of layers where the model is split over GPUs: engines/segments.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from engines.decode_blocks import DecodeBlocks
from engines.segments import SegmentedRun
from engines.streams import side_stream


@dataclass
class Sampler:
    """Greedy when temperature == 0; otherwise temperature + nucleus (top-p) sampling.

    Sampling uses the Gumbel-max trick (argmax of logits/T + Gumbel noise) so that it runs inside a CUDA
    graph: no multinomial, no host synchronisation.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] -> token ids [B] (int64)."""
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        logits = logits.float() / self.temperature
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token once the mass before it already reaches top_p (the first token always stays).
            drop = (cum - sorted_logits.softmax(dim=-1)) >= self.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        noise = torch.rand_like(logits).clamp_(min=1e-10).log_().neg_().log_().neg_()
        return (logits + noise).argmax(dim=-1)


def swapped(blocks: DecodeBlocks | None):
    """`blocks` in place (fused projections, compiled blocks), or nothing to swap."""
    return blocks.swapped() if blocks is not None else contextlib.nullcontext()


def capture_graph(run, device: torch.device) -> torch.cuda.CUDAGraph:
    """Run `run` once on a side stream (compilation, allocations), then capture it as a CUDA graph.

    The warm-up run executes (and writes whatever `run` writes); the capture does not.
    """
    side = side_stream(device, "capture")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


class DecodeStep:
    """One token through the model with static shapes: `token` in, next token left in `token`.

    Static device tensors: token [1, 1], position [1] (where the token's K/V go), length [1] (valid keys),
    logits [1, V] fp32 (the step's output, for teacher-forced scoring). `forward(token, position_ids)` must
    return logits [1, 1, V] and write K/V through the cache.
    """

    def __init__(self, forward, cache, sampler: Sampler, device: torch.device, use_graph: bool,
                 blocks: DecodeBlocks | None = None, segments: SegmentedRun | None = None):
        """segments: a model split over devices, its layers replayed per device (then use_graph is False)."""
        self.forward, self.cache, self.sampler, self.blocks = forward, cache, sampler, blocks
        self.segments = segments
        if segments is not None:
            cache.mirrored = segments.devices
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.length = torch.ones(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.use_graph = use_graph and device.type == "cuda"
        self.graphs: dict = {}  # one per form of the step (cache.decode_variants)
        self.steps = 0  # taken since start(): which form the next one takes (cache.variant_for)
        # On GPU, page-locked slots the steps' tokens are copied to, each with the event that says it has arrived:
        # two, for the step being read and the one launched ahead of it (AnswerLoop.answer).
        self.outbox = [(torch.zeros(1, dtype=torch.long, pin_memory=True), torch.cuda.Event())
                       for _ in range(2)] if device.type == "cuda" else []
        self.launched = 0

    def _step(self) -> None:
        self.cache.begin_decode(self.position, self.length)
        logits = self.forward(self.token, self.position.view(1, 1))[:, -1]
        if self.logits is None:
            self.logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        self.logits.copy_(logits)
        self.token.copy_(self.sampler(logits).view(1, 1))
        self.position.add_(1)
        self.length.add_(1)
        self.cache.end_decode()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def start(self, token: int, position: int) -> None:
        self.token.fill_(token)
        self.position.fill_(position)
        self.length.fill_(position + 1)
        self.steps = 0
        if self.use_graph and not self.graphs:
            self._capture()
        elif self.segments is not None and not self.segments.captured:
            self.cache.decode_variant = self.cache.variant_for(0)  # one capture: its caches have one form
            self.segments.capture(self._step, self._restorer(), lambda: swapped(self.blocks))
        if self.sampler.temperature > 0:
            # The steps of every answer draw from their own stream, seeded here, after any capture (whose warm-up
            # draws too): an answer's samples depend on its seed alone, not on whether this step was made and
            # captured for it or for an earlier question. Seeds the CPU and CUDA default generators; the CUDA one
            # is graph-safe (a replay reads its seed and offset).
            torch.manual_seed(self.sampler.seed + 1)

    def _restorer(self):
        """A function that puts the step's inputs, and what a step leaves for the next one, back as they are now (a
        capture's warm-up advances them)."""
        inputs = (self.token, self.position, self.length, *self.cache.step_outputs())
        saved = [t.clone() for t in inputs]

        def restore() -> None:
            for dst, src in zip(inputs, saved):
                dst.copy_(src)
        return restore

    def _capture(self) -> None:
        # Each warm-up writes this step's K/V once and advances the inputs; the first replay writes the same
        # slot again from the restored inputs.
        for variant in self.cache.decode_variants():
            restore = self._restorer()
            self.cache.decode_variant = variant
            with swapped(self.blocks):
                self.graphs[variant] = capture_graph(self._step, self.token.device)
            restore()

    def launch(self):
        """One step, queued; returns a function that gives its token once it is computed. The token's copy to the
        host is queued behind the step, so the next step may be launched before this one's token is read."""
        self.step()
        if not self.outbox:
            token = int(self.token.item())
            return lambda: token
        host, arrived = self.outbox[self.launched % 2]
        self.launched += 1
        host.copy_(self.token.view(1), non_blocking=True)
        arrived.record(torch.cuda.current_stream(self.token.device))

        def read() -> int:
            arrived.synchronize()
            return int(host.item())
        return read

    def step(self) -> None:
        variant = self.cache.decode_variant = self.cache.variant_for(self.steps)
        self.steps += 1
        if self.graphs:
            self.graphs[variant].replay()
        elif self.segments is not None and self.segments.captured:
            self.segments.replay(self._step)
        else:
            self._step()


class StaticForward:
    """`n` known tokens through the model at positions start .. start+n-1, K/V written in place; static shapes.

    For engines that re-encode their newest tokens (resa's rectification). Static device tensors: ids [1, n],
    position [n], length [1] = start + n. `forward(ids, position_ids)` must write K/V through the cache; what it
    returns is discarded. On GPU the step is captured once as a CUDA graph (`capture(start)` writes scratch K/V
    at [start, start + n): call it where those slots are not yet valid) and replayed, with `blocks` in place.
    Loading the tokens never waits for the device: the decode steps queued before it keep it busy.
    """

    def __init__(self, forward, cache, n: int, device: torch.device, use_graph: bool,
                 blocks: DecodeBlocks | None = None, segments: SegmentedRun | None = None):
        self.forward, self.cache, self.n, self.blocks, self.segments = forward, cache, n, blocks, segments
        if segments is not None:
            cache.mirrored = segments.devices
        self.ids = torch.zeros(1, n, dtype=torch.long, device=device)
        self.offsets = torch.arange(n, device=device)
        self.position = self.offsets.clone()
        # The tokens go up from page-locked memory without a sync; the event says the last copy has left it.
        pinned = device.type == "cuda"
        self.staged = torch.zeros(1, n, dtype=torch.long, pin_memory=pinned)
        self.sent = torch.cuda.Event() if pinned else None
        self.length = torch.full((1,), n, dtype=torch.long, device=device)
        self.use_graph = use_graph and device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None

    def _run(self) -> None:
        self.cache.begin_decode(self.position, self.length)
        self.forward(self.ids, self.position.view(1, -1))

    def _load(self, ids: list[int], start: int) -> None:
        if len(ids) != self.n:
            raise ValueError(f"expected {self.n} tokens, got {len(ids)}")
        if self.sent is not None:
            self.sent.synchronize()
        self.staged.copy_(torch.tensor(ids, dtype=torch.long).view(1, -1))
        self.ids.copy_(self.staged, non_blocking=True)
        if self.sent is not None:
            self.sent.record(torch.cuda.current_stream(self.ids.device))
        torch.add(self.offsets, start, out=self.position)
        self.length.fill_(start + self.n)

    def capture(self, start: int) -> None:
        if self.segments is not None and not self.segments.captured:
            self._load([0] * self.n, start)
            self.segments.capture(self._run, lambda: None, lambda: swapped(self.blocks))
        if not self.use_graph or self.graph is not None:
            return
        self._load([0] * self.n, start)
        with swapped(self.blocks):
            self.graph = capture_graph(self._run, self.ids.device)

    def __call__(self, ids: list[int], start: int) -> None:
        self._load(ids, start)
        if self.graph is not None:
            self.graph.replay()
        elif self.segments is not None and self.segments.captured:
            self.segments.replay(self._run)
        else:
            self._run()
