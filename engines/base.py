"""The engine contract and the data path every engine shares.

An engine plugs into a stock transformers model through two public extension points: an attention function
registered with `AttentionInterface` (selected with `set_attn_implementation`) and a Cache whose layers hold
the engine's per-layer state. The template methods here do the rest:

    prefill(ids)  -> DocumentState     chunked: `chunk_size` tokens per forward, logits of the last token only
    answer(state, question_ids, ...)   question through the same chunk path, then one DecodeStep per token

A subclass sets `name` and `Config` (a dataclass validated in `__post_init__` with `require`) and overrides:

    attention            (static) the registered attention function; it sees only the cache, which transformers
                         passes as `longctx`: whatever it reads per layer or per document lives on the cache
    make_cache           when it keeps other per-layer state (its own cache layers, engine settings they read)
    State                when decoding keeps per-document state of its own: a DocumentState subclass, typed
    memory_plan          when its state is not a plain KV cache (it must equal what prefill allocates)
    backends, counters   what the report shows
and, where its data path differs, prefill / _encode_question (streaming, ranks), _on_decode_start and
_after_step (work around decode steps, e.g. resa's rectification), plan_notes and kv_read_bytes (for `plan`
and the roofline). Per-document state lives in the state and its cache, never on the engine.

Read once, ask many: an engine with `reusable = True` answers any number of questions from one state, each
between `checkpoint` (what the question and its answer may overwrite, O(question + answer)) and `restore`;
`export_state` / `import_state` turn a state into tensors and scalars for the saved-state store and back
(`state_inputs`: what else shapes the state, for its key; `agree`: every rank found its part). The defaults
fit a cache the answer only appends to (engines/reuse.py); the question and decode loop is engines/answering.py.
Positions past the model's context: `positions_for` (engines/positions.py).
`check` refuses, from the model's config alone (before weights load), what the engine cannot take.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from transformers.modeling_utils import AttentionInterface

from engines import chunk_graphs
from engines.answering import AnswerLoop
from engines.cache import StaticKVCache, head_dim, kv_token_bytes, layer_types
from engines.positions import Positions, context_limit, reassigns, rotary_module
from engines.reuse import Reuse
from kernels.chunk_attention import chunk_attention, windowed_compile_pays
from kernels.decode_attention import decode_attention

if TYPE_CHECKING:
    from engines.decode_blocks import DecodeBlocks
    from engines.decoding import DecodeStep


@dataclass
class DocumentState:
    """What prefill leaves behind: the KV cache, where the next token goes and the last logits [1, V].
    counters: what prefill measured, for the report. Engines with more per-document state subclass it."""

    cache: StaticKVCache
    n_tokens: int
    position: int
    last_logits: torch.Tensor
    prefill_s: float
    decode: DecodeStep | None = None
    counters: dict = field(default_factory=dict)


def exact_attention(query, key, value, scaling, sliding_window, cache):
    """Dense attention over a static cache: the chunk path in prefill, the split-KV decode kernel in decode.

    query: [B, Hq, T, D]; key/value: the cache's whole buffers [B, Hkv, S, D] -> [B, T, Hq, D].
    """
    if cache.decoding:
        out = decode_attention(query[:, :, 0], key, value, cache.length_on(query.device), scale=scaling,
                               window=sliding_window)
        return out.unsqueeze(1)
    return chunk_attention(query, key, value, cache.offset, scale=scaling, window=sliding_window,
                           compiled=cache.compile_windows).transpose(1, 2)


class EngineInputError(ValueError):
    """A document this engine's configuration cannot take (e.g. star: more ranks than blocks); one line."""


class DocumentTooLong(EngineInputError):
    """A document longer than this engine can take on this model (the CLI's exit 6)."""


def _inside_engine(attention):
    """The attention function registered with transformers: refuses calls without an engine's cache.

    transformers builds no mask for a registered attention function, so running it outside an engine's own
    forward (e.g. `model.generate`) would silently drop causal and sliding-window masking."""

    def guarded(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                **kwargs):
        if longctx is None:
            raise RuntimeError("longctx attention called outside an engine's forward; switch the model back "
                               "first: model.set_attn_implementation('sdpa')")
        return attention(module, query, key, value, attention_mask, scaling=scaling,
                         sliding_window=sliding_window, longctx=longctx, **kwargs)

    return guarded


class Engine(Reuse, AnswerLoop, ABC):
    name: ClassVar[str]
    Config: ClassVar[type]
    State: ClassVar[type[DocumentState]] = DocumentState

    def __init__(self, lm, config, run, *, home: Path | None = None):
        """home: where the engine may keep what it derives once per model (e.g. ltri's retrieval heads);
        None: nothing is kept on disk."""
        self.lm, self.config, self.run, self.home = lm, config, run, home
        self.model = lm.model
        self.text_config = self.model.config.get_text_config(decoder=True)
        if getattr(self.text_config, "attn_logit_softcapping", None):
            raise NotImplementedError(f"{self.name}: attention logit soft-capping is not supported")
        self._impl = f"longctx_{self.name.replace('-', '_')}"
        AttentionInterface.register(self._impl, _inside_engine(type(self).attention))
        self.activate()
        self.device = self.model.get_input_embeddings().weight.device
        self.head_dim = head_dim(self.model.config)
        self.has_sliding_layers = "sliding_attention" in layer_types(self.model.config)
        # A model split over devices (accelerate's device_map) keeps each layer's state on its layer's device.
        self.devices = sorted({p.device for p in self.model.parameters()}, key=str)
        self.single_device = len(self.devices) == 1
        self._blocks: dict[bool, DecodeBlocks] = {}

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        """query: [B, Hq, T, D]; key/value: the cache's whole buffers [B, Hkv, S, D] -> ([B, T, Hq, D], None)."""
        raise NotImplementedError

    def activate(self) -> None:
        """Route the model's attention to this engine (several engines may share one loaded model)."""
        if self.model.config._attn_implementation != self._impl:
            self.model.set_attn_implementation(self._impl)

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None, *, chunk_size: int,
                    reserve: int) -> int:
        """Bytes of engine state (here the KV cache) for n_tokens (prompt + answer), summed over devices: what
        `prefill(ids, reserve=reserve)` of n_tokens - reserve tokens allocates with this chunk_size."""
        return len(layer_types(model_config)) * kv_token_bytes(model_config, dtype_bytes) * n_tokens

    @classmethod
    def plan_notes(cls, model_config, n_tokens: int, engine_config=None) -> list[str]:
        """Lines `longctx plan` prints about this engine's state for n_tokens (e.g. sas's cache sizes)."""
        return []

    @classmethod
    def kv_read_bytes(cls, model_config, n_tokens: int, dtype_bytes: int) -> int:
        """Bytes of KV one decode step reads at context n_tokens (sliding-window layers read their window)."""
        window = getattr(model_config.get_text_config(decoder=True), "sliding_window", None) or n_tokens
        return kv_token_bytes(model_config, dtype_bytes) * sum(
            min(window, n_tokens) if t == "sliding_attention" else n_tokens for t in layer_types(model_config))

    @classmethod
    def largest_position(cls, model_config, engine_config, n_tokens: int, *, chunk_size: int, reserve: int) -> int:
        """The largest position the model is given for n_tokens when positions are re-assigned (engines that
        read past the model's context); by default the document's own."""
        return n_tokens - 1

    @classmethod
    def _reassigned(cls, model_config, engine_config, run, n_tokens: int | None, reserve: int, advice: str) -> bool:
        """Whether a document of n_tokens (and `reserve` more) runs on re-assigned positions (`positions`); refuses
        it (DocumentTooLong) where even those would pass the model's context."""
        limit = context_limit(model_config)
        if n_tokens is None or not reassigns(engine_config.positions, n_tokens + reserve, limit):
            return False
        top = cls.largest_position(model_config, engine_config, n_tokens + reserve, chunk_size=run.chunk_size,
                                   reserve=reserve)
        if limit and top >= limit:
            raise DocumentTooLong(f"{cls.name} needs positions up to {top:,} for a {n_tokens:,}-token document, past "
                                  f"the model's context of {limit:,}; {advice}")
        return True

    @classmethod
    def check(cls, model_config, engine_config, run, n_tokens: int | None = None, reserve: int = 0) -> None:
        """Raise EngineInputError for what this configuration cannot take on this model (and, given n_tokens,
        for a document of n_tokens with `reserve` more): called before the weights load."""

    def windows_compiled(self, n_tokens: int) -> bool:
        """Whether the windowed layers of a document of n_tokens run FlexAttention (compiled per shape) or an
        uncompiled kernel: compilation pays only for documents with enough windowed attention."""
        window = getattr(self.text_config, "sliding_window", None)
        types = layer_types(self.model.config)
        if not window or "sliding_attention" not in types:
            return True
        return windowed_compile_pays(types.count("sliding_attention"), self.text_config.num_attention_heads,
                                     self.head_dim, window, n_tokens, self.run.chunk_size)

    def layer_device(self, index: int) -> torch.device:
        """The device of decoder layer `index` (accelerate may spread the layers over several GPUs)."""
        try:
            return next(self.model.get_decoder().layers[index].parameters()).device
        except (AttributeError, IndexError, StopIteration):
            return self.device

    def positions_for(self, capacity: int):
        """engines/positions.py Positions for a document of `capacity` tokens (question and answer included) when
        this engine re-assigns its positions (config `positions`), else None."""
        mode = getattr(self.config, "positions", "document")
        limit = context_limit(self.model.config)
        if not reassigns(mode, capacity, limit):
            return None
        rotary = rotary_module(self.model)
        if rotary is None:
            raise EngineInputError(f"{self.name}: positions cannot be re-assigned on this model (no rotary "
                                   "embedding of the rotate-half form); use positions: document")
        return Positions(rotary, limit)

    def make_cache(self, capacity: int, reserve: int) -> StaticKVCache:
        """The cache for a document of capacity - reserve tokens and reserve more (the question, the answer)."""
        return StaticKVCache(self.model.config, capacity)

    def backends(self) -> dict[str, str]:
        """Which kernels run prefill and decode attention, for the report."""
        return {}

    def _forward(self, cache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions: [1, T] -> logits of the last position [1, 1, V]."""
        out = self.model(input_ids=ids, position_ids=cache.model_positions(positions), past_key_values=cache, use_cache=True,
                         logits_to_keep=1, longctx=cache)
        return out.logits

    @torch.inference_mode()
    def _extend(self, cache, ids: torch.Tensor, start: int, progress: Callable[[int], None] | None = None, *,
                slot: int | None = None) -> torch.Tensor:
        """Encode ids [N] at positions start.. in chunks of `chunk_size`, their K/V into cache slots slot..
        (default: the positions); returns the last logits [1, V]."""
        chunk = self.run.chunk_size
        slot = start if slot is None else slot
        logits = None
        # Sent once: a copy from pageable host memory per chunk would wait for the device to drain each time.
        ids = ids.to(self.device, torch.long)
        graphs = self._prefill_graphs(ids.numel())
        if graphs is not None:
            cache.prefill_graphs = True
        with graphs.swapped(chunk) if graphs is not None else contextlib.nullcontext():
            for lo in range(0, ids.numel(), chunk):
                piece = ids[lo:lo + chunk].view(1, -1)
                positions = torch.arange(start + lo, start + lo + piece.shape[1], device=self.device).view(1, -1)
                cache.begin_chunk(slot + lo, piece.shape[1])
                logits = self._forward(cache, piece, positions)
                if progress is not None:
                    progress(piece.shape[1])
        return logits[:, -1].float()

    def _prefill_graphs(self, n_tokens: int) -> chunk_graphs.PrefillModules | None:
        """The layers' norms and MLPs as CUDA graphs (engines/chunk_graphs.py) for a prefill of n_tokens on one GPU
        (`chunk_graphs.graphed`); None: the model's own modules (also for a model split over GPUs, whose layers
        would each need their device made current around a replay)."""
        if (self.device.type == "cuda" and self.single_device
                and chunk_graphs.graphed(self.model.config, self.run, n_tokens, self.model.dtype.itemsize)):
            return chunk_graphs.for_model(self.model)
        return None

    def prefill(self, ids: torch.Tensor, *, reserve: int,
                progress: Callable[[int], None] | None = None) -> DocumentState:
        """ids: [N] token ids of the document; reserve: room for the question and the answer."""
        self.activate()
        start = time.perf_counter()
        cache = self.make_cache(ids.numel() + reserve, reserve)
        cache.compile_windows = self.windows_compiled(ids.numel())
        logits = self._extend(cache, ids, 0, progress)
        synchronize(self.devices)
        return self.State(cache, ids.numel(), ids.numel(), logits, time.perf_counter() - start)

    def _encode_question(self, state: DocumentState, question_ids: torch.Tensor, n_new: int) -> torch.Tensor:
        """The question through the chunk path after the document; checks room for n_new more tokens.

        Returns the logits after the question [1, V] (the document's last logits for an empty question).
        """
        self.activate()
        logits = self._extend(state.cache, question_ids, state.position) if question_ids.numel() else state.last_logits
        state.position += question_ids.numel()
        if state.position + n_new > state.cache.capacity:
            raise ValueError(f"KV cache of {state.cache.capacity} tokens has no room for {n_new} new tokens")
        return logits

    def counters(self, state: DocumentState) -> dict:
        decode = state.decode
        segments = decode.segments if decode is not None else None
        per_device = segments is not None and segments.captured
        graph = decode is not None and decode.captured or per_device
        blocks = decode.blocks if graph else None
        return {"kv_cache_bytes": state.cache.nbytes(), "kv_capacity_tokens": state.cache.capacity,
                "decode_cuda_graph": f"one per device ({len(segments.segments)})" if per_device else graph,
                "decode_compiled_blocks": blocks is not None and blocks.compiled,
                "decode_fused_projections": "+".join(sorted(blocks.fused)) if blocks and blocks.fused else "none",
                "decode_projections": blocks.projections if blocks else "torch linear",
                "prefill_cuda_graphs": state.cache.prefill_graphs,
                **self.backends(), **state.counters,
                **(state.cache.positions.counters() if state.cache.positions is not None else {})}


def synchronize(devices: torch.device | list[torch.device]) -> None:
    """Wait for the work queued on a device (or on each of several: a model split over GPUs)."""
    for device in devices if isinstance(devices, list) else [devices]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
