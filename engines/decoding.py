"""Sampling and the decode step: eager on CPU, captured once per form as a CUDA graph and replayed on GPU (one graph
per device's run of layers where the model is split over GPUs: engines/segments.py)."""

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


class _Refeed:
    """The inputs of a step form `width` tokens wide: the `width - 1` tokens before the step's own fed again with
    it, at their positions. ids [1, width] (the last the step's token, copied on the device), positions [width]."""

    def __init__(self, width: int, device: torch.device):
        self.ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.back = torch.arange(1 - width, 1, device=device)
        self.positions = torch.zeros(width, dtype=torch.long, device=device)
        # The tokens go up from page-locked memory without a sync; the event says the last copy has left it.
        pinned = device.type == "cuda"
        self.staged = torch.zeros(1, width - 1, dtype=torch.long, pin_memory=pinned)
        self.sent = torch.cuda.Event() if pinned else None

    def load(self, ids: list[int]) -> None:
        if self.sent is not None:
            self.sent.synchronize()
        self.staged.copy_(torch.tensor(ids, dtype=torch.long).view(1, -1))
        self.ids[:, :-1].copy_(self.staged, non_blocking=True)
        if self.sent is not None:
            self.sent.record(torch.cuda.current_stream(self.ids.device))

    def inputs(self, token: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids[:, -1:].copy_(token)
        torch.add(self.back, position, out=self.positions)
        return self.ids, self.positions


class DecodeStep:
    """One token through the model with static shapes: `token` in, next token left in `token`.

    Static device tensors: token [1, 1], position [1] (where the token's K/V go), length [1] (valid keys),
    logits [1, V] fp32 (the step's output, for teacher-forced scoring). `forward(ids, position_ids)` must
    return the last position's logits [1, 1, V] and write K/V through the cache.

    A step takes one of the cache's forms (`cache.decode_variants`; one captured graph each). A form
    `cache.decode_width` makes w > 1 tokens wide feeds the w - 1 tokens before the step's own again with it, at
    their positions (resa's rectification, done by a step): `refeed` gives them before that step is launched.
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
        self.segmented: dict = {}  # the same on a model split over devices: a SegmentedRun per form
        self.refeeds: dict[int, _Refeed] = {}  # by width
        self.steps = 0  # taken since start(): which form the next one takes (cache.variant_for)
        # On GPU, page-locked slots the steps' tokens are copied to, each with the event that says it has arrived:
        # two, for the step being read and the one launched ahead of it (AnswerLoop.answer).
        self.outbox = [(torch.zeros(1, dtype=torch.long, pin_memory=True), torch.cuda.Event())
                       for _ in range(2)] if device.type == "cuda" else []
        self.launched = 0

    def _refeed(self, width: int) -> _Refeed:
        if width not in self.refeeds:
            self.refeeds[width] = _Refeed(width, self.token.device)
        return self.refeeds[width]

    def refeed(self, ids: list[int]) -> None:
        """The tokens the next step, of a form len(ids) + 1 wide, feeds again before its own (queued, no sync)."""
        self._refeed(len(ids) + 1).load(ids)

    def _step(self) -> None:
        width = self.cache.decode_width(self.cache.decode_variant)
        ids, position = ((self.token, self.position) if width == 1
                         else self._refeed(width).inputs(self.token, self.position))
        self.cache.begin_decode(position, self.length)
        logits = self.forward(ids, position.view(1, -1))[:, -1]
        if self.logits is None:
            self.logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        self.logits.copy_(logits)
        self.token.copy_(self.sampler(logits).view(1, 1))
        # Joined before the position and the length move on: work an engine left on a side stream may read them
        # (resa's selection for the next step reads the length), and may still run after the last layer.
        self.cache.end_decode()
        self.position.add_(1)
        self.length.add_(1)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def start(self, token: int, position: int) -> None:
        self.token.fill_(token)
        self.position.fill_(position)
        self.length.fill_(position + 1)
        self.steps = 0
        if self.use_graph or self.segments is not None:
            self._capture(position)
        if self.sampler.temperature > 0:
            # The steps of every answer draw from their own stream, seeded here, after any capture (whose warm-up
            # draws too): an answer's samples depend on its seed alone, not on whether this step was made and
            # captured for it or for an earlier question. Seeds the CPU and CUDA default generators; the CUDA one
            # is graph-safe (a replay reads its seed and offset).
            torch.manual_seed(self.sampler.seed + 1)

    def _restorer(self, start: int, n: int):
        """A function that puts the step's inputs, and what a step writing K/V at slots start .. start + n - 1
        leaves besides them, back as they are now (a capture's warm-up advances or overwrites them)."""
        inputs = (self.token, self.position, self.length, *self.cache.step_outputs(start, n))
        saved = [t.clone() for t in inputs]

        def restore() -> None:
            for dst, src in zip(inputs, saved):
                dst.copy_(src)
        return restore

    def _capture(self, position: int) -> None:
        """Each form not captured yet whose slots fit the cache from `position` on. Each warm-up writes its K/V
        once and advances the inputs; the first replay writes the same slots again from the restored inputs. A
        form w tokens wide is captured at position + w - 1, so that it writes slots from `position` on (not yet
        valid: the steps overwrite them before reading them), not the w - 1 before it."""
        done = self.graphs if self.segments is None else self.segmented
        for variant in self.cache.decode_variants():
            shift = self.cache.decode_width(variant) - 1
            if variant in done or (shift and position + shift >= self.cache.capacity):
                continue
            self.position.add_(shift)
            self.length.add_(shift)
            restore = self._restorer(position, shift + 1)
            self.cache.decode_variant = variant
            if self.segments is None:
                with swapped(self.blocks):
                    done[variant] = capture_graph(self._step, self.token.device)
            else:
                done[variant] = self.segments if not done else self.segments.fresh()
                done[variant].capture(self._step, restore, lambda: swapped(self.blocks))
            restore()
            self.position.sub_(shift)
            self.length.sub_(shift)

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
        if variant in self.graphs:
            self.graphs[variant].replay()
        elif variant in self.segmented:
            self.segmented[variant].replay(self._step)
        else:
            self._step()
