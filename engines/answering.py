"""The question and the decode loop every engine shares (engines/base.py Engine): the question through the chunk
path, then one static-shape DecodeStep per token (a CUDA graph on one GPU, one per GPU for a model split over
several), with the hooks engines use around steps (resa's rectification) and teacher forcing for drift
measurements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from engines.decode_blocks import DecodeBlocks
from engines.decoding import DecodeStep, Sampler
from engines.segments import SegmentedRun

if TYPE_CHECKING:
    from engines.base import DocumentState


class AnswerLoop:
    # Launch each decode step before reading the token of the one before (the step reads that token on the
    # device): the GPU then never waits for the host between steps. An answer stopped early (a stop string)
    # has computed one step more than it yields. Engines whose steps need the host between them opt out.
    decode_ahead = True

    @torch.inference_mode()
    def answer(self, state: DocumentState, question_ids: torch.Tensor, max_new_tokens: int,
               sampler: Sampler) -> Iterator[int]:
        """Yields generated token ids; the caller stops early by closing the generator."""
        logits = self._encode_question(state, question_ids, max_new_tokens)
        if sampler.temperature > 0:
            torch.manual_seed(sampler.seed)
        token = int(sampler(logits).item())
        step = self._decode_step(state, sampler) if max_new_tokens > 1 else None
        yield token
        if step is None:
            return
        step.start(token, state.position)
        self._on_decode_start(state)
        ahead = self.decode_ahead and step.captured
        read = step.launch()
        self._stepped(state, token)
        for produced in range(1, max_new_tokens):
            last = produced + 1 == max_new_tokens
            following = step.launch() if ahead and not last else None
            token = read()
            if following is not None:
                self._stepped(state, token)
            yield token
            if last:
                break
            if following is None:
                following = step.launch()
                self._stepped(state, token)
            read = following

    def _stepped(self, state: DocumentState, fed_token: int) -> None:
        """The host's share of a decode step that fed `fed_token` (queued on the device, maybe not yet run)."""
        self._after_step(state, fed_token)
        state.position += 1
        if state.cache.positions is not None:
            state.cache.positions.note(state.position - 1)

    @torch.inference_mode()
    def teacher_forced_nll(self, state: DocumentState, question_ids: torch.Tensor, targets: list[int]) -> list[float]:
        """Negative log-likelihood of each target token, fed one decode step at a time (teacher forcing).

        The same path as `answer` (question through the chunk path, then the engine's decode step and hooks,
        e.g. resa's rectification), but the fed token is the given target instead of the sampled one: how far
        an engine's next-token distribution drifts from dense over a long generation (the ReSA paper's
        language-modelling setup). Returns len(targets) values.
        """
        logits = self._encode_question(state, question_ids, len(targets))
        nll = [-torch.log_softmax(logits.float(), dim=-1)[0, targets[0]]]
        step = self._decode_step(state, Sampler())
        for i, token in enumerate(targets[:-1]):
            if i == 0:
                step.start(token, state.position)
                self._on_decode_start(state)
            else:
                step.token.fill_(token)
            step.step()
            self._after_step(state, token)
            state.position += 1
            nll.append(-torch.log_softmax(step.logits, dim=-1)[0, targets[i + 1]])
        return torch.stack(nll).tolist()

    def _on_decode_start(self, state: DocumentState) -> None:
        """Hook: the decode step is ready and nothing has been decoded yet (capture other graphs here)."""

    def _after_step(self, state: DocumentState, fed_token: int) -> None:
        """Hook: `fed_token` went through one decode step at `state.position` (its K/V are in the cache)."""

    def _decode_step(self, state: DocumentState, sampler: Sampler) -> DecodeStep:
        if state.decode is None or state.decode.sampler != sampler:
            use_graph = self.run.decode_graph and self.single_device and self.device.type == "cuda"
            segments = self._segmented_run()
            cache = state.cache  # not `state`: a state -> step -> state cycle would keep GiBs alive until gc
            blocks = self._decode_blocks(use_graph or segments is not None, self.run.compile_decode)
            state.decode = DecodeStep(lambda ids, pos: self._forward(cache, ids, pos), cache, sampler,
                                      self.device, use_graph, blocks, segments)
        return state.decode

    def _segmented_run(self) -> SegmentedRun | None:
        """For a model split over several GPUs: its layers replayed per device (one graph each), else None."""
        if not self.run.decode_graph or self.single_device or any(d.type != "cuda" for d in self.devices):
            return None
        return SegmentedRun(self.model, [self.layer_device(i) for i in range(len(self.model.get_decoder().layers))])

    def _decode_blocks(self, use_graph: bool, compile: bool) -> DecodeBlocks | None:
        """The modules a captured step swaps in (one set per `compile`, shared by the engine's documents);
        None where nothing is captured or nothing is asked for."""
        if not use_graph or not (compile or self.run.fuse_projections):
            return None
        if compile not in self._blocks:
            self._blocks[compile] = DecodeBlocks(self.model, fuse=self.run.fuse_projections, compile=compile)
        return self._blocks[compile]
