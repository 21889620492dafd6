"""resa's cache: K/V plus each full-attention layer's block descriptors and selection buffers (stacked over the
covered layers on one device), the forms of its decode step, and the document state it belongs to."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from engines.base import DocumentState
from engines.cache import StaticKVCache, StaticKVLayer
from engines.config import ResaConfig
from engines.streams import side_stream
from kernels import cdiv
from kernels.block_select import HIST_BINS, SYNC_WORDS, select_blocks
from kernels.kv_append import append_kv


class ResaKVLayer(StaticKVLayer):
    """A static KV layer that, on full-attention layers, also holds the block descriptors [B, Hkv, NB, D] (max
    and min keys; with the centroid rule, each plus the block's mean key; int8 codes of kscale [B, Hkv, NB] with
    descriptor_dtype int8, else kscale is None) and the selection's score histogram and sync words (scratch kept
    between steps, kernels/block_select); with select_ahead, the next step's blocks [B, Hkv, width] int32 and the
    step's query [B, Hq, D]. In a stacked cache each is this layer's slice of one tensor for every covered layer."""

    kscale: torch.Tensor | None = None
    ahead: torch.Tensor | None = None
    query: torch.Tensor | None = None  # with select_ahead, the step's query kept for the stacked selection
    slot: int = 0  # index among the cache's covered (full-attention) layers
    appending: torch.cuda.Stream | None = None  # the stream a decode step's K/V write runs on, until joined

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if not self.is_sliding:
            owner = self.owner
            batch, heads, _, dim = key_states.shape
            n_blocks = cdiv(self.capacity, owner.block_size)
            int8 = owner.descriptor_dtype == "int8"
            buffer = functools.partial(owner.layer_buffer, self, device=self.device)
            self.kmax = buffer("kmax", (batch, heads, n_blocks, dim), torch.int8 if int8 else self.dtype)
            self.kmin = buffer("kmin", (batch, heads, n_blocks, dim), self.kmax.dtype)
            if int8:
                self.kscale = buffer("kscale", (batch, heads, n_blocks), torch.float32)
            self.score_bins = buffer("score_bins", (batch, heads, HIST_BINS), torch.int32)
            self.select_sync = buffer("select_sync", (batch, heads, SYNC_WORDS), torch.int32)
            if owner.select_ahead:
                self.ahead = buffer("ahead", (batch, heads, owner.width), torch.int32, fill=-1)
                self.query = buffer("query", (batch, owner.query_heads, dim), self.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """A decode step's one new token on a full-attention layer: K/V written and its block's descriptors
        refreshed in one launch; anything else as the static layer does (the attention describes it). While every
        block is kept nothing reads the descriptors: the step writes K/V only (the checkpoint's restore brings the
        answer's blocks back)."""
        owner = self.owner
        if not (owner.decoding and self.is_initialized and not self.is_sliding and key_states.shape[2] == 1) \
                or owner.every_block_kept:
            return super().update(key_states, value_states, *args, **kwargs)
        # On CUDA the write runs beside the selection, which reads neither the new K/V nor the descriptors of the
        # local block it lands in: the attention joins it before the sparse kernel reads the kept blocks.
        side = side_stream(self.device, "kv-write") if self.device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            append_kv(self.keys, self.values, key_states, value_states, owner.position_on(self.device),
                      descriptors=(self.kmax, self.kmin, None), length=owner.length_on(self.device),
                      block_size=owner.block_size, fold_mean=owner.rule.centroid, descriptor_scale=self.kscale)
        self.appending = side
        return self.keys, self.values

    def select(self, query: torch.Tensor, length: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks query [B, Hq, D] keeps among those of the first `length` keys: [B, Hkv, width] int32 (into
        `out` where given)."""
        owner = self.owner
        return select_blocks(query, self.kmax, self.kmin, length, block_size=owner.block_size, rule=owner.rule,
                             width=owner.width, scale=scale, folded=owner.rule.centroid, histogram=self.score_bins,
                             descriptor_scale=self.kscale, sync=self.select_sync, out=out)

    def select_ahead(self, query: torch.Tensor, length: torch.Tensor, scale: float) -> None:
        """The next token's blocks into self.ahead, from this one's query [B, Hq, D] and `length` keys: scored as
        the next step will see them (length + 1 keys, whose newest block is kept anyway). While decoding on CUDA
        (one device: decode_variants) on a stream of its own that starts after what the current stream has
        queued (the K/V write joined; this layer's sparse attention, which reads the blocks it overwrites) and
        that the step joins at its end (ResaKVCache.end_decode). With the layers' buffers stacked (one device), a
        decode step keeps the query and the last covered layer selects for every layer at once
        (ResaKVCache.select_stacked)."""
        owner = self.owner
        side = None
        if owner.decoding and self.device.type == "cuda":
            side = side_stream(self.device, "select-ahead")
            side.wait_stream(torch.cuda.current_stream(self.device))
            owner.selecting[self.device] = side
            # The query is the step's, freed on its stream once this layer is done: its memory must not go to the
            # next layers' tensors while this stream, joined only at the step's end, may still read it.
            query.record_stream(side)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if owner.decoding and owner.stacked:
                if owner._scale not in (None, scale):
                    raise ValueError(f"expected one attention scale on every covered layer, got {owner._scale} and "
                                     f"{scale}")
                owner._scale = scale
                self.query.copy_(query)
                if self.slot == owner.covered - 1:
                    owner.select_stacked(length, scale)
                return
            # The next step's key count, made here in each layer rather than once a step. Made once a step, the
            # selection was the first kernel on this stream after the wait on the step's own, and the captured step
            # ran as if the selection were in its chain again (H200, Qwen3-1.7B shape, 128K: 2.40-2.42 ms a token
            # against 2.25-2.27); here two small kernels come first.
            following = torch.clamp(length + 1, max=owner.capacity)
            self.select(query, following, scale, out=self.ahead)

    def join_append(self) -> None:
        """Order what follows on the current stream after this step's K/V write (see update)."""
        if self.appending is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.appending)
            self.appending = None

    def nbytes(self) -> int:
        extra = 0
        if self.is_initialized and not self.is_sliding:
            extra = sum(t.nbytes for t in (self.kmax, self.kmin, self.kscale, self.score_bins, self.select_sync,
                                           self.ahead, self.query) if t is not None)
        return super().nbytes() + extra


class ResaKVCache(StaticKVCache):
    layer_class = ResaKVLayer
    # Where the rule keeps every block at every length the cache can reach (up to min_blocks blocks, or keep_ratio
    # 1), decode steps attend with the dense kernel, with no selection and no rectification: the same attention,
    # without reading the descriptors. Tests turn it off to run the sparse kernels over every block.
    dense_when_every_block_kept = True

    @classmethod
    def keeps_every_block(cls, rule, n_blocks: int) -> bool:
        """Whether a cache of n_blocks blocks decodes with the dense kernel: the rule keeps every one of them."""
        return cls.dense_when_every_block_kept and rule.keep(n_blocks) >= n_blocks

    def __init__(self, config, capacity: int, resa: ResaConfig, stacked: bool = False):
        """stacked: the covered layers' descriptors, selection scratch and select_ahead buffers as slices of one
        tensor each (a model on one device), so that one selection serves every layer (select_stacked)."""
        self.block_size, self.rule, self.descriptor_dtype = resa.block_size, resa.rule, resa.descriptor_dtype
        self.select_ahead, self.ahead_after = resa.select_ahead, resa.ahead_after
        self.rectify_every = resa.rectify_every
        self.stacked = stacked
        self.query_heads = config.get_text_config(decoder=True).num_attention_heads
        self.rectifying = False  # whether this answer's steps rectify (ResaEngine._on_decode_start)
        self.encoding_question = False  # chunks of the question: their last query selects the first step's blocks
        self.selecting: dict[torch.device, torch.cuda.Stream] = {}  # select_ahead's streams, until the step's end
        # Static selection width: the blocks kept at full capacity (never fewer than at any shorter length).
        self.width = self.rule.keep(cdiv(capacity, resa.block_size))
        self.every_block_kept = self.keeps_every_block(self.rule, cdiv(capacity, resa.block_size))
        self.timed = False  # CPU: time estimation and sparse attention (synchronous there)
        self.times = {"estimation_s": 0.0, "sparse_attention_s": 0.0}
        self._stacks: dict[str, torch.Tensor] = {}
        self._scale: float | None = None  # the attention's scale, the same on every covered layer
        super().__init__(config, capacity)
        covered = [layer for layer in self.layers if not layer.is_sliding]
        for slot, layer in enumerate(covered):
            layer.slot = slot
        self.covered = len(covered)

    def layer_buffer(self, layer: ResaKVLayer, name: str, shape: tuple, dtype: torch.dtype, *, device,
                     fill: int = 0) -> torch.Tensor:
        """A covered layer's buffer, filled with `fill`: its slice of the stack of every covered layer's where the
        cache is stacked (made by the first layer to ask), a tensor of its own otherwise."""
        if not self.stacked:
            return torch.full(shape, fill, dtype=dtype, device=device)
        stack = self._stacks.get(name)
        if stack is None:
            stack = self._stacks[name] = torch.full((self.covered, *shape), fill, dtype=dtype, device=device)
        if stack.shape[1:] != shape or stack.dtype != dtype or stack.device != torch.device(device):
            raise ValueError(f"expected every covered layer's {name} as {tuple(stack.shape[1:])} {stack.dtype} on "
                             f"{stack.device}, got {shape} {dtype} on {device}")
        return stack[layer.slot]

    def select_stacked(self, length: torch.Tensor, scale: float) -> None:
        """Every covered layer's next-step blocks (their `ahead`) from the queries they kept this step, in one
        selection over the stacked rows (layers x batch): the per-row work is the per-layer selection's, and the
        fixed cost of a launch, its barriers and its tail is paid once a step instead of once a layer."""
        stack = {name: t.flatten(0, 1) for name, t in self._stacks.items()}
        following = torch.clamp(length + 1, max=self.capacity).repeat(self.covered)
        select_blocks(stack["query"], stack["kmax"], stack["kmin"], following, block_size=self.block_size,
                      rule=self.rule, width=self.width, scale=scale, folded=self.rule.centroid,
                      histogram=stack["score_bins"], descriptor_scale=stack.get("kscale"), sync=stack["select_sync"],
                      out=stack["ahead"])

    def end_decode(self) -> None:
        for device, side in self.selecting.items():
            torch.cuda.current_stream(device).wait_stream(side)
        self.selecting = {}

    def step_outputs(self, start: int, n: int) -> list[torch.Tensor]:
        """The next step's blocks, and the descriptors of the blocks the slots lie in: a capture's scratch K/V
        there would otherwise stay in them (the selection reads the block the step writes to)."""
        lo, hi = start // self.block_size, cdiv(start + n, self.block_size)
        described = [getattr(layer, name)[:, :, lo:hi] for layer in self.layers
                     if layer.is_initialized and not layer.is_sliding for name in ("kmax", "kmin", "kscale")
                     if getattr(layer, name) is not None]
        return [layer.ahead for layer in self.layers if layer.ahead is not None] + described

    def _selecting_forms(self) -> tuple:
        """With select_ahead: "own" (the step's blocks from its own query; with "ahead" among the forms, it also
        selects the next step's), then "ahead" (from the step before's). A model split over GPUs has no stream
        beside its steps' chains: every step selects with its own query there."""
        if not self.select_ahead or self.every_block_kept:
            return (None,)
        if self.mirrored:
            return ("own",)
        return ("own", "ahead") if self.ahead_after else ("ahead",)

    def decode_variants(self) -> tuple:
        """The selecting forms, then "rectify" (rectify_every tokens wide: the f - 1 tokens of the sparse steps
        before it and its own, dense) where the steps rectify."""
        rectify = ("rectify",) if self.rectify_every and not self.every_block_kept else ()
        return self._selecting_forms() + rectify

    def decode_width(self, variant) -> int:
        return self.rectify_every if variant == "rectify" else 1

    def variant_for(self, step: int):
        """Every f-th step rectifies while `rectifying` (with select_ahead its last query selects the next step's
        blocks, as a step's does)."""
        every = self.rectify_every
        if self.rectifying and step % every == every - 1:
            return "rectify"
        forms = self._selecting_forms()
        return forms[-1] if step >= self.ahead_after else forms[0]

    def begin_chunk(self, offset: int, n: int) -> None:
        super().begin_chunk(offset, n)
        # The descriptor update reads the valid length from a tensor, in chunks as in decode steps.
        self._length = {torch.device("cpu"): torch.tensor([offset + n])}


@dataclass
class ResaState(DocumentState):
    """A document's state under resa: the cache (descriptors included) and what decoding did since the
    question: the tokens the next rectification feeds again, and the report's tallies."""

    pending: list[int] = field(default_factory=list)  # tokens of the sparse steps since the last rectification
    steps: int = 0
    kept_tokens: int = 0  # summed over steps: tokens of the blocks kept, and of the whole context
    context_tokens: int = 0
    rectifications: int = 0
    rectify_s: float = 0.0  # CPU; on GPU the events' times
    rectify_events: list = field(default_factory=list)
    rectify_began: object = None  # the open rectification's start: an event on GPU, a clock reading on CPU

    def start_decoding(self) -> None:
        self.pending, self.rectify_events, self.rectify_began = [], [], None
        self.steps = self.kept_tokens = self.context_tokens = self.rectifications = 0
        self.rectify_s = 0.0
