"""`resa`: ReSA, "Rectified Sparse Attention" (Sun et al., 2025).

- Prefill: dense and chunked, as `dense`; every chunk also refreshes the min/max key descriptors of the blocks
  it wrote (kernels/block_descriptors). With the centroid rule they hold max + mean and min + mean: the bound and
  the centroid's product from two descriptors instead of three, a third fewer bytes to read per step. With
  descriptor_dtype int8 they are int8 codes of a scale per block and KV head, rounded outwards: half the bytes.
- Decode, on every full-attention layer: the new key updates its block's descriptors (in the launch that writes
  its K/V, kernels/kv_append; on CUDA on a side stream, beside the selection), the GQA group's mean query scores
  all blocks with Quest's bound and keeps the top k (the local blocks always; kernels/block_select), and attention
  reads only those blocks (kernels/sparse_decode_attention). Sliding-window layers (Gemma 3) stay exact: they
  already read only their window.
- Rectification: every `rectify_every` (f) tokens, a step feeds the f - 1 tokens of the sparse steps before it
  again with its own, in one dense pass (kernels/decode_attention with f queries): their K/V and descriptors are
  overwritten, its own written exact, and its logits come from that pass. Batched with the step, the
  rectification reads the weights the step reads anyway and takes that step's place: f tokens re-encoded in
  one pass that reads the whole cache once, instead of a pass of f tokens and a sparse step. On GPU each form
  of the step is a captured CUDA graph.
- select_ahead: each decode step selects the next step's blocks with its own query, after its sparse attention;
  on CUDA on a stream of its own, which the step joins at its end, so the selection leaves the path from one
  layer to the next (the first decoded token's blocks come from the question's last query). On one device the
  covered layers' descriptors and selection buffers are slices of stacked tensors: each layer keeps its query
  and the last one selects for all of them in one call, the launches' fixed costs paid once a step.
- Where the rule keeps every block at every length the cache can reach (a document and its answer under the
  floor), decode steps attend with the dense kernel: no selection and no rectification, as `dense` decodes.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch

from engines.base import DocumentState, Engine
from engines.config import ResaConfig
from engines.cache import StaticKVCache, StaticKVLayer, full_layers, head_dim, kv_token_bytes, layer_types
from engines.streams import side_stream
from kernels import cdiv
from kernels.block_descriptors import update_block_descriptors
from kernels.block_select import HIST_BINS, SYNC_WORDS, barrier_timeouts, new_histogram, new_sync, select_blocks
from kernels.chunk_attention import chunk_attention, chunk_attention_backend
from kernels.decode_attention import decode_attention, decode_backend
from kernels.kv_append import append_kv
from kernels.sparse_decode_attention import sparse_decode_attention, sparse_decode_backend


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


def events_seconds(events: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    """Seconds between each (begin, end) pair of timing events, summed. Waits for each end first: an answer that
    stops on a rectifying step is reported while that step may still run."""
    total_ms = 0.0
    for begin, end in events:
        end.synchronize()
        total_ms += begin.elapsed_time(end)
    return total_ms / 1000


def _selection_note(cache: ResaKVCache, device: torch.device) -> str:
    """How select_ahead ran, for the report."""
    variants = cache.decode_variants()
    if "ahead" not in variants:
        return "select_ahead not applied: a model split over GPUs selects with each step's own query"
    n = cache.ahead_after
    first = (f"from the answer's step {n + 1} on (its first {n} select with their own query)" if n
             else "from the answer's first step on (its blocks by the question's last query)")
    when = ("for every layer at once after the step's last one" if cache.stacked
            else "after each layer's sparse attention")
    where = ", on a stream beside the step" if device.type == "cuda" else ""
    return f"one step ahead {first}: each step's blocks chosen by the step before's query, {when}{where}"


def _describe(layer: ResaKVLayer, key: torch.Tensor, length: torch.Tensor, n_new: int, block_size: int) -> None:
    update_block_descriptors(key, layer.kmax, layer.kmin, length, n_new, block_size,
                             fold_mean=layer.owner.rule.centroid, scale=layer.kscale)


def _block_bytes(config: ResaConfig, model_config, dtype_bytes: int) -> int:
    """One block's descriptors over a layer's KV heads: two keys' worth (one token's K and V), or in int8 half
    that plus a float32 scale per KV head."""
    token = kv_token_bytes(model_config, dtype_bytes)
    if config.descriptor_dtype != "int8":
        return token
    return token // dtype_bytes + 4 * model_config.get_text_config(decoder=True).num_key_value_heads


def _clock(cache: ResaKVCache, key: str, start: float) -> float:
    now = time.perf_counter()
    if cache.timed:
        cache.times[key] += now - start
    return now


class ResaEngine(Engine):
    name = "resa"
    Config = ResaConfig
    State = ResaState

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        layer = longctx.layers[module.layer_idx]
        length = longctx.length_on(query.device)
        n_new = query.shape[2]
        if not longctx.decoding:
            out = chunk_attention(query, key, value, longctx.offset, scale=scaling, window=sliding_window,
                                  compiled=longctx.compile_windows)
            if not layer.is_sliding:
                _describe(layer, key, length, n_new, longctx.block_size)
                if longctx.encoding_question:
                    layer.select_ahead(query[:, :, -1], length, scaling)
            return out.transpose(1, 2), None
        if layer.is_sliding or n_new > 1 or longctx.every_block_kept:
            layer.join_append()
            # Exact layers, the rectifying step (the pending tokens fed again with its own, dense), and every layer
            # while every block is kept (no descriptor reads then). Otherwise a decode step's token refreshed its
            # block's descriptors with its K/V write.
            if not layer.is_sliding and n_new > 1:
                _describe(layer, key, length, n_new, longctx.block_size)
            out = decode_attention(query, key, value, length, scale=scaling, window=sliding_window)
            if longctx.decode_variant == "rectify" and "ahead" in longctx.decode_variants() and not layer.is_sliding:
                layer.select_ahead(query[:, :, -1], length, scaling)
            return out.transpose(1, 2), None
        # The new key's block descriptors were refreshed with its K/V write (ResaKVLayer.update).
        start = time.perf_counter()
        variant = longctx.decode_variant
        blocks = layer.ahead if variant == "ahead" else layer.select(query[:, :, 0], length, scaling)
        start = _clock(longctx, "estimation_s", start)
        layer.join_append()
        out = sparse_decode_attention(query[:, :, 0], key, value, blocks, length, block_size=longctx.block_size,
                                      scale=scaling)
        start = _clock(longctx, "sparse_attention_s", start)
        if "ahead" in longctx.decode_variants():  # this step, whichever its form, selects the next one's
            layer.select_ahead(query[:, :, 0], length, scaling)
            _clock(longctx, "estimation_s", start)
        return out.unsqueeze(1), None

    def make_cache(self, capacity: int, reserve: int) -> ResaKVCache:
        cache = ResaKVCache(self.model.config, capacity, self.config, stacked=self.single_device)
        cache.timed = self.device.type == "cpu"
        return cache

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None, *, chunk_size: int,
                    reserve: int) -> int:
        """The KV cache plus, on full-attention layers, two descriptors per block (2/block_size of the keys; the
        centroid is folded into them; int8 with a float32 scale per block and KV head), and the selection's
        histogram and sync words (int32, HIST_BINS + SYNC_WORDS per KV head); with select_ahead, the next step's
        blocks (int32, the selection's width per KV head) and the step's query (one token's, per query head)."""
        cfg = engine_config or ResaConfig()
        n_blocks = cdiv(n_tokens, cfg.block_size)
        kv_heads = model_config.get_text_config(decoder=True).num_key_value_heads
        descriptors = len(full_layers(model_config)) * _block_bytes(cfg, model_config, dtype_bytes) * n_blocks
        descriptors += len(full_layers(model_config)) * kv_heads * (HIST_BINS + SYNC_WORDS) * 4
        if cfg.select_ahead:  # the next step's blocks, int32, and the query they are chosen by
            q_heads = model_config.get_text_config(decoder=True).num_attention_heads
            descriptors += len(full_layers(model_config)) * (kv_heads * cfg.rule.keep(n_blocks) * 4
                                                             + q_heads * head_dim(model_config) * dtype_bytes)
        return super().memory_plan(model_config, n_tokens, dtype_bytes, chunk_size=chunk_size,
                                   reserve=reserve) + descriptors

    def kv_read_bytes(self, model_config, n_tokens: int, dtype_bytes: int) -> int:
        """Per decode step, averaged over the f steps from one rectification to the next: on covered layers f - 1
        sparse steps read the kept blocks and the descriptors, the rectifying step the whole cache; windows
        elsewhere. Where every block is kept, dense's bytes (ResaKVCache.every_block_kept, with n_tokens for the
        cache's capacity)."""
        block, every = self.config.block_size, self.config.rectify_every
        n_blocks = cdiv(n_tokens, block)
        if ResaKVCache.keeps_every_block(self.config.rule, n_blocks):
            return Engine.kv_read_bytes(model_config, n_tokens, dtype_bytes)
        token = kv_token_bytes(model_config, dtype_bytes)
        read = token * min(n_tokens, self.config.rule.keep(n_blocks) * block) \
            + _block_bytes(self.config, model_config, dtype_bytes) * n_blocks
        if every:
            read = ((every - 1) * read + token * n_tokens) // every
        per_layer = read - token * n_tokens
        return Engine.kv_read_bytes(model_config, n_tokens, dtype_bytes) + len(full_layers(model_config)) * per_layer

    def backends(self) -> dict[str, str]:
        return {"prefill_attention": chunk_attention_backend(self.device, self.has_sliding_layers, self.head_dim),
                "decode_attention": f"{sparse_decode_backend(self.device)} (sparse layers), "
                                    f"{decode_backend(self.device)} (exact layers, rectification)"}

    def _encode_question(self, state: ResaState, question_ids: torch.Tensor, n_new: int) -> torch.Tensor:
        """With select_ahead from the first step on (ahead_after 0) the question's last query selects the first
        decoded token's blocks."""
        cache = state.cache
        if not self.config.select_ahead or self.config.ahead_after or cache.every_block_kept:
            return super()._encode_question(state, question_ids, n_new)
        if not question_ids.numel():
            raise ValueError("resa's select_ahead selects the first decoded token's blocks with the question's last "
                             "query: expected a question of at least one token")
        cache.encoding_question = True
        try:
            return super()._encode_question(state, question_ids, n_new)
        finally:
            cache.encoding_question = False

    def _on_decode_start(self, state: ResaState) -> None:
        # Decoding every block densely, the steps write the K/V a rectification would: none is needed. A step that
        # rectifies writes its f slots up to its own, so the first needs them past the answer's start.
        cache, f = state.cache, self.config.rectify_every
        cache.rectifying = bool(f) and not cache.every_block_kept and state.position + f <= cache.capacity
        state.start_decoding()

    def _after_step(self, state: ResaState, fed_token: int) -> None:
        cache = state.cache
        length = state.position + 1
        rectified = cache.variant_for(state.steps) == "rectify"
        state.steps += 1
        if rectified:
            if self.device.type == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                state.rectify_events.append((state.rectify_began, end))
            else:
                state.rectify_s += time.perf_counter() - state.rectify_began
            state.pending = []
            state.rectifications += 1
            return
        # What the sparse steps read (a rectifying step reads the whole cache).
        state.context_tokens += length
        state.kept_tokens += min(length, self.config.rule.keep(cdiv(length, self.config.block_size))
                                 * self.config.block_size)
        if not cache.rectifying:
            return
        state.pending.append(fed_token)
        if cache.variant_for(state.steps) == "rectify":  # the next step feeds these tokens again with its own
            state.decode.refeed(state.pending)
            if self.device.type == "cuda":
                state.rectify_began = torch.cuda.Event(enable_timing=True)
                state.rectify_began.record()
            else:
                state.rectify_began = time.perf_counter()

    reusable = True

    @property
    def _descriptor_names(self) -> tuple[str, ...]:
        return ("kmax", "kmin", "kscale") if self.config.descriptor_dtype == "int8" else ("kmax", "kmin")

    def state_inputs(self, n_tokens: int, reserve: int) -> dict:
        # What the descriptors hold, and how they are stored, changes what a saved state means.
        held = "max+mean, min+mean" if self.config.centroid else "max, min"
        return {"descriptors": held + (", int8 codes of a scale per block" if self.config.descriptor_dtype == "int8"
                                       else "")}

    def _descriptor_layers(self, cache: ResaKVCache) -> list[tuple[int, ResaKVLayer]]:
        return [(i, layer) for i, layer in enumerate(cache.layers) if not layer.is_sliding and layer.is_initialized]

    @torch.inference_mode()
    def checkpoint(self, state: ResaState) -> tuple:
        """The position and the descriptors of the blocks from the document's last one on: the question and
        the answer write only there (their K/V land past the document, which the base checkpoint covers)."""
        first = state.n_tokens // self.config.block_size
        saved = [(layer, name, getattr(layer, name)[:, :, first:].clone())
                 for _, layer in self._descriptor_layers(state.cache) for name in self._descriptor_names]
        return state.position, first, saved

    @torch.inference_mode()
    def restore(self, state: ResaState, checkpoint) -> None:
        state.position, first, saved = checkpoint
        for layer, name, blocks in saved:
            getattr(layer, name)[:, :, first:] = blocks

    @torch.inference_mode()
    def export_state(self, state: ResaState) -> tuple[dict, dict]:
        tensors, meta = super().export_state(state)
        used = cdiv(state.n_tokens, self.config.block_size)
        for i, layer in self._descriptor_layers(state.cache):
            for name in self._descriptor_names:
                tensors[f"layers.{i}.{name}"] = getattr(layer, name)[:, :, :used]
        return tensors, meta

    @torch.inference_mode()
    def import_state(self, tensors: dict, meta: dict, reserve: int) -> ResaState:
        state = super().import_state(tensors, meta, reserve)
        used = cdiv(state.n_tokens, self.config.block_size)
        for i, layer in self._descriptor_layers(state.cache):
            for name in self._descriptor_names:
                getattr(layer, name)[:, :, :used] = tensors[f"layers.{i}.{name}"]
        return state

    def counters(self, state: ResaState) -> dict:
        covered, total = len(full_layers(self.model.config)), len(layer_types(self.model.config))
        out = {**super().counters(state),
               "sparse_layers": f"{covered}/{total}" + ("" if covered == total else
                                                       " (sliding-window layers stay exact)"),
               "block_size": self.config.block_size, "sink_blocks": self.config.sink_blocks,
               "group_pooling": self.config.pooling,
               "block_centroid": self.config.centroid,
               "descriptor_dtype": self.config.descriptor_dtype,
               "selection_width_blocks": state.cache.width}
        if self.config.select_ahead and not state.cache.every_block_kept:
            out["selection"] = _selection_note(state.cache, self.device)
        if not state.steps:
            return out
        rectify_s = state.rectify_s + events_seconds(state.rectify_events)
        n_blocks = cdiv(state.position, self.config.block_size)
        kept = self.config.rule.keep(n_blocks)
        if state.cache.every_block_kept:
            out["resa_decode"] = (f"dense: every block kept up to the cache's {state.cache.width} blocks (min_blocks "
                                  f"{self.config.min_blocks}, keep_ratio {self.config.keep_ratio}): the dense decode "
                                  f"kernel, no selection, no rectification")
        elif kept >= n_blocks:
            out["resa_decode"] = (f"dense: every block kept ({n_blocks} blocks; min_blocks {self.config.min_blocks}, "
                                  f"keep_ratio {self.config.keep_ratio}), through the selection and sparse kernels")
        out.update(decode_steps=state.steps, blocks_kept_last_step=kept, blocks_total_last_step=n_blocks,
                   kv_fraction_read=round(state.kept_tokens / state.context_tokens, 4),
                   rectifications=state.rectifications, rectification_s=round(rectify_s, 4))
        if state.cache.rectifying:
            f = self.config.rectify_every
            out["rectification"] = (f"one step in {f} feeds the {f - 1} tokens before it again with its own, dense "
                                    f"(rectification_s: those steps' time; kv_fraction_read: the sparse steps')")
        given_up = sum(barrier_timeouts(layer.select_sync) for _, layer in self._descriptor_layers(state.cache))
        if given_up:  # the device did not run a row's selection programs at once: those selections are suspect
            out["selection_barriers_given_up"] = given_up
        if state.cache.timed:
            out.update({k: round(v, 4) for k, v in state.cache.times.items()})
        else:
            out["estimation_vs_attention"] = "not separable inside one CUDA graph; see benchmarks/bench_resa_kernels.py"
        return out
