"""`ltri-stream`: Ltri-LLM (streaming with dynamic triangular attention patterns), bounded device memory.

The document streams through in chunks. Every full-attention layer keeps on the device only the first
`n_init` tokens, the local window (>= `n_local` tokens), `top_k` retrieved blocks and the chunk in flight
(engines/ltri/cache.py); older tokens leave in blocks of `block_size` for CPU context memory, each block
indexed by the span index vectors of its semantic spans (engines/ltri/spans.py). Per chunk and layer:

1. Retrieval (section 3.4): the chunk's own causal attention map is divided into spans, whose top-voted
   queries are the query index vectors; every stored block scores the best dot product between them and its
   index vectors (on the layer's retrieval head, or all heads averaged); with collaborative voting the
   retrieval-head layers before this one add their normalised block scores, weighted by their head scores
   (section 3.5). The top_k blocks are loaded into the retrieval slots (blocks already there stay).
2. Attention over [init | retrieved | window | chunk] (engines/ltri/attention.py, kernels/vote_attention): its
   probabilities give each window key its votes (attention received, InfLLM's Eq. 6) and the chunk's own map,
   from which the spans of every block completed in this chunk are found while it is still on the device.
3. Eviction: whole blocks past the window go to CPU memory; per span the top-n voted tokens become index
   vectors, n from the span's confidence (Eq. 7), lam per layer fixed or calibrated to a target compression.

The question is the last prefill chunk (its retrieval is the persistent one); decode keeps that retrieval
(the persistent mechanism, 3.5) and appends generated tokens to the window, one static-shape step over the
layer's rows with a validity mask (CUDA-graph safe). Layers the model itself runs with a sliding window stay
exact, holding only their window.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from engines.base import DocumentState, Engine, EngineInputError
from engines.cache import full_layers, kv_token_bytes
from engines.ltri import attention
from engines.ltri import state as document_state
from engines.ltri.cache import LtriCache, LtriLayer, layer_specs
from engines.ltri.config import LtriConfig
from engines.ltri.heads import cached_heads
from engines.ltri.index import Indexer
from engines.ltri.memory import context_blocks
from engines.positions import context_limit, reassigns
from kernels.decode_attention import decode_backend
from kernels.vote_attention import vote_attention_backend


def context_memory_bytes(model_config, cfg: LtriConfig, n_tokens: int, dtype_bytes: int) -> int:
    """Host bytes of the context memory for a document of n_tokens: K and V of every block past the init
    tokens, on every full-attention layer (fp8: one byte per element plus a K and a V scale per block and head)."""
    per_token_layer = kv_token_bytes(model_config, dtype_bytes)
    full = len(full_layers(model_config))
    blocks = context_blocks(n_tokens, cfg.n_init, cfg.block_size)
    if cfg.context_memory != "fp8":
        return full * blocks * cfg.block_size * per_token_layer
    heads = model_config.get_text_config(decoder=True).num_key_value_heads
    return full * blocks * (cfg.block_size * per_token_layer // dtype_bytes + 2 * heads * 4)


_ROW_BYTES = 8 + 4  # a device row's position (int64) and votes (fp32), next to its K and V


def _room(chunk_size: int, reserve: int) -> int:
    """Window rows past n_local and a partial block: a prefill chunk in flight, or (after the question's chunk
    has been evicted down to the window) the tokens decoded after it."""
    return max(chunk_size, reserve)


def index_plan_bytes(model_config, cfg: LtriConfig, n_tokens: int, dtype_bytes: int) -> int:
    """Device bytes of the index memory at its bound (LtriConfig.vectors_per_block per stored block) in every
    retrieving layer, each vector a key of every KV head with its block id and offset (int64). A document uses
    what its spans ask for (min_vectors to max_vectors per block); the cache's nbytes counts what is allocated."""
    per_vector = kv_token_bytes(model_config, dtype_bytes) // 2 + 16
    blocks = context_blocks(n_tokens, cfg.n_init, cfg.block_size)
    return len(full_layers(model_config)) * blocks * cfg.vectors_per_block() * per_vector


class LtriEngine(Engine):
    name = "ltri-stream"
    Config = LtriConfig

    def __init__(self, lm, config, run, *, home: Path | None = None):
        full = full_layers(lm.model.config)
        self.check(lm.model.config, config, run)
        config = config.for_layers(full)
        super().__init__(lm, config, run, home=home)
        heads = {}
        if config.retrieval_heads == "auto" and not lm.random_weights:
            heads = cached_heads(self.model, lm.tokenizer, lm.name, full, self.home)
            self.activate()
        self.indexer = Indexer(config, self.text_config, heads, graphs=self.run.prefill_graphs and self.single_device)

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        layer = longctx.layers[module.layer_idx]
        if longctx.decoding:
            return attention.decode_rows(layer, query, layer.attended(key), value, scaling, longctx), None
        offset, t = longctx.offset, query.shape[2]
        if not layer.retrieve:
            out = attention.window_attention(layer, query, layer.attended(key), value, scaling, offset)
            excess = layer.local_len - layer.window
            if excess > 0:
                layer.take_oldest(excess)
            return out.transpose(1, 2), None
        indexer = longctx.indexer
        key = layer.attended(key)
        indexer.retrieve(layer, module.layer_idx, query, key, scaling, longctx)
        layer.reattend_slots(key)
        n_own = min(t, layer.local_len)
        cfg = indexer.cfg
        exact = cfg.compensates(module.layer_idx) and (cfg.compensate_question or not longctx.question)
        out, own = attention.softmax_attention(layer, query, key, value, scaling, offset, n_own, exact)
        indexer.note_spans(layer, module.layer_idx, own, offset + t - n_own, longctx)
        indexer.evict(layer, module.layer_idx, longctx)
        return out.transpose(1, 2), None

    def make_cache(self, capacity: int, reserve: int) -> LtriCache:
        specs = layer_specs(self.model.config, self.config, _room(self.run.chunk_size, reserve))
        cache = LtriCache(self.model.config, capacity, specs, self.indexer)
        cache.positions = self.positions_for(capacity)
        return cache

    @classmethod
    def check(cls, model_config, engine_config, run, n_tokens: int | None = None, reserve: int = 0) -> None:
        full = full_layers(model_config)
        layers = engine_config.for_layers(full).compensate_layers
        if layers is not None and not set(layers) <= set(full):
            raise EngineInputError(f"bad value for compensate_layers: {list(layers)}; expected retrieving "
                                   f"(full-attention) layers of the model: {full}")
        if run.chunk_size % engine_config.block_size:
            raise EngineInputError(f"chunk_size {run.chunk_size} is not a multiple of block_size "
                                   f"{engine_config.block_size}")
        reassigned = cls._reassigned(model_config, engine_config, run, n_tokens, reserve,
                                     "lower n_local, top_k or chunk_size (its rows per layer)")
        if reassigned and engine_config.compensate != "none":
            raise EngineInputError("ltri-stream: compensate attends stored blocks at their document positions; "
                                   "set compensate: none for documents past the model's context")
        if reassigned and engine_config.decode_summaries:
            raise EngineInputError("ltri-stream: decode_summaries attends stored blocks' mean keys at their document "
                                   "positions; set decode_summaries: false for documents past the model's context")

    def prefill(self, ids, *, reserve, progress=None) -> DocumentState:
        self.check(self.model.config, self.config, self.run, ids.numel(), reserve)
        self._check_host_memory(ids.numel() + reserve)
        state = super().prefill(ids, reserve=reserve, progress=progress)
        self.indexer.flush(state.cache, complete=True)  # the last chunk's blocks: the counters are complete
        return state

    def _check_host_memory(self, n_tokens: int) -> None:
        """Context memory is allocated for the whole document up front (pinned on GPU machines, so it cannot be
        swapped): refuse early, with numbers and the remedy, rather than fail inside the allocator."""
        need = context_memory_bytes(self.model.config, self.config, n_tokens,
                                    next(self.model.parameters()).element_size())
        free = psutil.virtual_memory().available
        if need > 0.9 * free:
            hint = "" if self.config.context_memory == "fp8" else "--set context_memory=fp8 (half), "
            raise EngineInputError(f"ltri-stream needs {need / 2**30:.1f} GiB of CPU context memory for "
                                   f"{n_tokens:,} tokens, and the host has {free / 2**30:.1f} GiB available; use "
                                   f"{hint}a shorter document or a host with more memory")

    def _encode_question(self, state, question_ids, n_new):
        cache = state.cache
        if self.config.question_votes == "all" and self.config.voting and self.indexer.heads:
            # The first reading's votes, then back to the document alone; its work stays in the counters.
            kept = self.checkpoint(state)
            self._read_question(state, question_ids, n_new)
            first, spent = cache.question_chunks, dict(cache.stats)
            self.restore(state, kept)
            cache.stats, cache.first_reading = spent, first
        try:
            logits = self._read_question(state, question_ids, n_new)
        finally:
            cache.first_reading = None
        for layer in cache.layers:
            if layer.local_len + n_new > layer.local_cap:
                raise ValueError(f"ltri-stream window has no room for {n_new} new tokens")
            # Decode: the token at position p goes to row p - shift, right after the window.
            layer.shift.fill_(state.position - (layer.local0 + layer.local_len))
            layer.begin_decode()
        return logits

    def _read_question(self, state, question_ids, n_new):
        """The question through the chunk path (the last prefill chunk: its retrieval is the one decoding keeps)."""
        cache = state.cache
        cache.question, cache.question_chunks = True, []
        try:
            logits = super()._encode_question(state, question_ids, n_new)
        finally:
            cache.question = False
        self.indexer.flush(cache, complete=True)  # index what the question's chunk evicted (the counters count it)
        # A state saved before this counter existed lacks it.
        cache.stats["question_readings"] = cache.stats.get("question_readings", 0) + 1
        return logits

    reusable = True

    def checkpoint(self, state: DocumentState) -> tuple:
        """The retrieval slots and window rows in use, and the stores' lengths (engines/ltri/state.py)."""
        return state.position, document_state.checkpoint(state.cache)

    def restore(self, state: DocumentState, checkpoint) -> None:
        state.position, kept = checkpoint
        document_state.restore(state.cache, kept)

    def state_inputs(self, n_tokens: int, reserve: int) -> dict:
        """The window's rows past n_local depend on the room asked for."""
        return {"room": _room(self.run.chunk_size, reserve)}

    def export_state(self, state: DocumentState) -> tuple[dict, dict]:
        return self._with_document(state, *document_state.export(state.cache))

    def import_state(self, tensors: dict, meta: dict, reserve: int) -> DocumentState:
        n = meta["n_tokens"]
        cache = self.make_cache(n + reserve, reserve)
        document_state.load(cache, tensors, meta, self.layer_device)
        return self._state_from(cache, tensors, meta)

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None, *, chunk_size: int,
                    reserve: int) -> int:
        """Device bytes: every layer's bounded rows (K, V, position and votes, and on re-assigned positions the
        rotated keys decode reads; room for a chunk, or the question and the answer), independent of the
        document's length, plus the index vectors at their bound, max_vectors per stored block (index_plan_bytes)."""
        cfg = engine_config or LtriConfig()
        per_row = kv_token_bytes(model_config, dtype_bytes) + _ROW_BYTES
        if reassigns(cfg.positions, n_tokens, context_limit(model_config)):
            per_row += kv_token_bytes(model_config, dtype_bytes) // 2  # the rotated keys decode reads (`attended`)
        rows = sum(LtriLayer.rows_for(**spec) for spec in layer_specs(model_config, cfg, _room(chunk_size, reserve)))
        summaries = 0
        if cfg.decode_summaries:  # a K and a V row per stored block, and its mask byte per KV head
            heads = model_config.get_text_config(decoder=True).num_key_value_heads
            per_block = kv_token_bytes(model_config, dtype_bytes) + heads
            summaries = len(full_layers(model_config)) * context_blocks(n_tokens, cfg.n_init, cfg.block_size) * per_block
        return rows * per_row + index_plan_bytes(model_config, cfg, n_tokens, dtype_bytes) + summaries

    @classmethod
    def largest_position(cls, model_config, engine_config, n_tokens: int, *, chunk_size: int, reserve: int) -> int:
        """Re-assigned positions stay below the device rows of a full layer (LtriLayer.assigned)."""
        specs = layer_specs(model_config, engine_config or LtriConfig(), _room(chunk_size, reserve))
        return max(LtriLayer.rows_for(**spec) for spec in specs if spec["retrieve"]) - 1

    @classmethod
    def plan_notes(cls, model_config, n_tokens: int, engine_config=None) -> list[str]:
        cfg = engine_config or LtriConfig()
        full = len(full_layers(model_config))
        return [f"ltri-stream device window per full layer: {cfg.n_init} init + {cfg.top_k} x {cfg.block_size} "
                f"retrieved + {cfg.n_local} local tokens + the chunk ({full} full layers)",
                f"ltri-stream CPU context memory: {context_memory_bytes(model_config, cfg, n_tokens, 2) / 2**30:.2f} "
                f"GiB ({'fp8' if cfg.context_memory == 'fp8' else 'bf16'}) for {n_tokens:,} tokens"]

    def kv_read_bytes(self, model_config, n_tokens: int, dtype_bytes: int) -> int:
        """A decode step reads every layer's rows (masked ones included): room for a chunk and the answer."""
        per_token_layer = kv_token_bytes(model_config, dtype_bytes)
        specs = layer_specs(model_config, self.config, _room(self.run.chunk_size, self.run.max_new_tokens))
        return per_token_layer * sum(LtriLayer.rows_for(**spec) for spec in specs)

    def backends(self) -> dict[str, str]:
        cfg = self.config
        exact = ""
        if cfg.compensate == "exact":
            layers = cfg.compensate_layers
            which = ("every retrieving layer" if layers is None else f"the {layers} retrieving layer"
                     if isinstance(layers, str) else f"layers {layers}")
            exact = (f"; compensate: exact in {which}, stored blocks merged by log-sum-exp"
                     + (", the question's chunk too" if cfg.compensate_question else ""))
        if cfg.question_votes == "all":
            exact += ("; the question read twice, every layer voting with every retrieval-head layer"
                      if cfg.voting and self.indexer.heads else "; question_votes: all has no retrieval heads "
                      "to count (voting off, or none found): the question is read once")
        return {"prefill_attention": f"{vote_attention_backend(self.device)} over init + retrieved + window "
                                     f"(votes, span maps{exact}); sliding layers: sdpa over their window",
                "decode_attention": f"{decode_backend(self.device)} over the bounded rows (validity mask)"}

    def counters(self, state: DocumentState) -> dict:
        out = super().counters(state)
        out.update(self.indexer.counters(state.cache))
        if self.config.decode_summaries:
            rows = [layer.summary_rows() for layer in state.cache.layers if layer.retrieve and layer.is_initialized]
            out["decode_summary_rows"] = (f"{max(rows, default=0)} per layer (a mean key and value per stored block "
                                          f"the rows leave out, weighted by {self.config.block_size})")
        return out
