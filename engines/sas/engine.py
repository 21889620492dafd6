"""`sas-pattern`: SAS, the sparse attention synthesizer (a pattern language compiled into cache plans and kernels).

A profile's `pattern` (engines/sas/pattern.py) says which keys each query sees. Before prefill the analyzer
(engines/sas/analyzer.py) sizes a compacted KV cache for the whole sequence (document + question + answer)
and hands out its slots; every layer then keeps only the keys its pattern can still reach (engines/sas/cache.py).
Gemma-style sliding-window layers keep their own window exactly, as a Diag(window=w) pattern of their own.

- Prefill, per chunk: the chunk's K/V go to staging rows, its queries attend to [compacted cache | chunk] under
  the pattern (FlexAttention with a block mask built from the pattern on GPU, SDPA with the explicit mask on
  CPU and for chunks of fewer than 128 tokens), then the keys still needed move to their slots.
- Decode: the new key goes to its slot, and the split-KV decode kernel reads the compacted cache, masking each
  row by the pattern at the row's key position. On GPU the pattern is generated into the kernel as a Triton
  function (engines/sas/codegen.py, the paper's code generation): no mask kernel, no host sync, inside the
  CUDA graph. H2O layers compute the mask once (their scores need it too) and pass it as flags.
- Dynamic (H2O): attention probabilities (from the kernel's log-sum-exp) accumulate per key; keys the static
  part lets go of compete for the pool by accumulated score (top-k, on the device). In prefill the pool is
  updated once per chunk (not per token); `pool(w)` smooths a chunk's scores over neighbouring keys.
"""

from __future__ import annotations

import time

from engines.base import DocumentState, Engine, EngineInputError
from engines.cache import kv_token_bytes, layer_types
from engines.config import SasConfig
from engines.positions import scalars, set_scalars
from engines.sas import state as document_state
from engines.sas.analyzer import describe_index, plan_cache
from engines.sas.attention import admit, decode, prefill_reference
from engines.sas.cache import SasCache
from engines.sas.flex import flex_prefill
from engines.sas.parse import parse_pattern
from engines.sas.pattern import Diag
from kernels.decode_attention import decode_backend

# Below this many queries a chunk runs the SDPA path (FlexAttention's query tile is 128).
_FLEX_MIN_QUERIES = 128
_EXACT_UP_TO = 65536  # plans (memory, roofline) analyse exactly up to this many tokens
ROOM_GRAIN = 256  # question + answer room, in tokens, is planned in multiples of this


def _layer_patterns(model_config, config: SasConfig) -> list:
    """Per decoder layer, the pattern it runs: the profile's, or the model's own window on sliding layers."""
    window = getattr(model_config.get_text_config(decoder=True), "sliding_window", None)
    pattern = parse_pattern(config.pattern)
    return [Diag(window=window) if t == "sliding_attention" else pattern for t in layer_types(model_config)]


def plan_capacity(n_document: int, reserve: int) -> int:
    """The sequence length a document's plans are made for: room for the question and the answer, rounded up
    so that later questions of other lengths find the same plans (and the same saved state)."""
    return n_document + -(-max(reserve, 1) // ROOM_GRAIN) * ROOM_GRAIN


def _staging_rows(chunk_size: int, capacity: int) -> int:
    """Rows a prefill chunk's own K/V take before they move to their slots."""
    return min(chunk_size, capacity)


def cache_slots(pattern, n: int) -> int:
    """Cache rows for n tokens; past 64K tokens extrapolated linearly from 32K and 64K (exact for bounded
    patterns, whose size stops growing, and for those that grow linearly), so that plans stay cheap."""
    if n <= _EXACT_UP_TO:
        return plan_cache(pattern, n).slots
    # The longer first: a pattern too irregular to analyse is refused before the shorter analysis runs.
    b = plan_cache(pattern, _EXACT_UP_TO).slots
    a = plan_cache(pattern, _EXACT_UP_TO // 2).slots
    return min(n, b + (b - a) * (n - _EXACT_UP_TO) // (_EXACT_UP_TO // 2))


class SasEngine(Engine):
    name = "sas-pattern"
    Config = SasConfig

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        layer = longctx.layers[module.layer_idx]
        key = layer.attended(key)
        if longctx.decoding:
            return decode(layer, query, key, value, scaling, longctx), None
        offset, t = longctx.offset, query.shape[2]
        if query.is_cuda and t >= _FLEX_MIN_QUERIES and layer.dynamic is None:
            out = flex_prefill(layer, query, key, value, scaling, offset)
        else:
            out = prefill_reference(layer, query, key, value, scaling, offset)
        if layer.dynamic is not None:
            admit(layer, layer.enter_keys[layer.enter_start[offset + 1]:layer.enter_start[offset + t + 1]], offset)
        layer.commit_chunk(offset, t)
        return out.transpose(1, 2), None

    def layer_patterns(self) -> list:
        return _layer_patterns(self.model.config, self.config)

    @classmethod
    def check(cls, model_config, engine_config, run, n_tokens: int | None = None, reserve: int = 0) -> None:
        """A pattern that gives no query any key would answer from zero attention outputs: refused."""
        if n_tokens is None:
            return
        try:
            plan = plan_cache(engine_config.pattern, plan_capacity(n_tokens, reserve))
        except ValueError as exc:  # a pattern too irregular to analyse at this length
            raise EngineInputError(str(exc)) from None
        if plan.slots == 0:
            raise EngineInputError(f"pattern {engine_config.pattern!r} gives no query any key in a document of "
                                   f"{n_tokens:,} tokens (every attention output would be zero); widen it")
        cls._reassigned(model_config, engine_config, run, n_tokens, reserve,
                        f"pattern {engine_config.pattern!r} keeps too many keys; use one with a bounded cache (e.g. "
                        "--profile sas-pattern) or ltri-stream")

    def make_cache(self, capacity: int, reserve: int) -> SasCache:
        start = time.perf_counter()
        self.check(self.model.config, self.config, self.run, capacity - reserve, reserve)
        capacity = plan_capacity(capacity - reserve, reserve)
        plans = [plan_cache(p, capacity) for p in self.layer_patterns()]
        cache = SasCache(self.model.config, plans, capacity, _staging_rows(self.run.chunk_size, capacity))
        cache.positions = self.positions_for(capacity)
        cache.analysis_s = time.perf_counter() - start
        cache.kernel_dir = None if self.home is None else self.home / "sas_kernels"
        return cache

    def prefill(self, ids, *, reserve, progress=None) -> DocumentState:
        state = super().prefill(ids, reserve=reserve, progress=progress)
        state.counters["analysis_s"] = round(state.cache.analysis_s, 3)
        return state

    reusable = True

    def checkpoint(self, state: DocumentState) -> tuple:
        """The rows the question and the answer may overwrite (engines/sas/state.py) and the position shift."""
        return state.position, document_state.checkpoint(state.cache, state.position), scalars(state.cache)

    def restore(self, state: DocumentState, checkpoint) -> None:
        state.position, kept, shift = checkpoint
        document_state.restore(state.cache, kept)
        set_scalars(state.cache, shift)

    def state_inputs(self, n_tokens: int, reserve: int) -> dict:
        """The plans (so the slots of every key) depend on the length they were made for."""
        return {"plan_capacity": plan_capacity(n_tokens, reserve)}

    def export_state(self, state: DocumentState) -> tuple[dict, dict]:
        return self._with_document(state, *document_state.export(state.cache))

    def import_state(self, tensors: dict, meta: dict, reserve: int) -> DocumentState:
        n = meta["n_tokens"]
        document_state.adopt_plans(set(self.layer_patterns()), tensors, meta)
        cache = self.make_cache(n + reserve, reserve)
        document_state.load(cache, tensors, meta, self.layer_device)
        return self._state_from(cache, tensors, meta)

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None, *, chunk_size: int,
                    reserve: int) -> int:
        """Compacted K/V per layer (slots, a staging chunk and a trash row) plus each row's key position, and on
        H2O layers each row's score."""
        per_layer = kv_token_bytes(model_config, dtype_bytes)
        heads = model_config.get_text_config(decoder=True).num_key_value_heads
        n_tokens = plan_capacity(n_tokens - reserve, reserve)
        staging = _staging_rows(chunk_size, n_tokens) + 1
        return sum((cache_slots(p, n_tokens) + staging) * (per_layer + heads * (12 if p.dynamic() else 8))
                   for p in _layer_patterns(model_config, engine_config or SasConfig()))

    @classmethod
    def largest_position(cls, model_config, engine_config, n_tokens: int, *, chunk_size: int, reserve: int) -> int:
        """Re-assigned positions reach the rows before staging plus a chunk, or the question and its answer
        (SasCache.largest_position)."""
        n = plan_capacity(n_tokens - reserve, reserve)
        reach = max(cache_slots(p, n) for p in _layer_patterns(model_config, engine_config or SasConfig()))
        return reach + max(_staging_rows(chunk_size, n), reserve) - 1

    @classmethod
    def plan_notes(cls, model_config, n_tokens: int, engine_config=None) -> list[str]:
        patterns = _layer_patterns(model_config, engine_config or SasConfig())
        kinds = {}
        for p, t in zip(patterns, layer_types(model_config)):
            kinds.setdefault((t, p), 0)
            kinds[(t, p)] += 1
        lines = []
        for (t, p), count in kinds.items():
            lines.append(f"sas-pattern KV cache: {cache_slots(p, n_tokens):,} of {n_tokens:,} tokens per layer on "
                         f"{count} {t.replace('_attention', '')} layers ({p})")
            if n_tokens <= _EXACT_UP_TO:
                lines.append(f"  cache index of key k: {describe_index(plan_cache(p, n_tokens).slot_of)}")
        return lines

    def kv_read_bytes(self, model_config, n_tokens: int, dtype_bytes: int) -> int:
        """Per decode step every layer reads its compacted cache (slots + one staging row)."""
        per_layer = kv_token_bytes(model_config, dtype_bytes)
        return sum((cache_slots(p, n_tokens) + 1) * per_layer for p in self.layer_patterns())

    def backends(self) -> dict[str, str]:
        flex = "flex attention (pattern block mask)" if self.device.type == "cuda" else "sdpa reference (explicit mask)"
        return {"prefill_attention": f"{flex}; short chunks and H2O layers: sdpa/explicit softmax",
                "decode_attention": f"{decode_backend(self.device)} over the compacted cache, the pattern "
                                    + ("generated into the kernel" if self.device.type == "cuda"
                                       else "evaluated per row") + " (H2O layers: a per-row mask)"}

    def counters(self, state: DocumentState) -> dict:
        out = super().counters(state)
        types = layer_types(self.model.config)
        plans = {}
        for layer, kind in zip(state.cache.layers, types):
            plans.setdefault(kind, layer.plan)
        out["pattern"] = self.config.pattern
        out["kv_cache_slots"] = "; ".join(
            f"{plan.describe()} ({sum(t == kind for t in types)} {kind.replace('_attention', '')} layers"
            + (", the model's own window, exact)" if kind == "sliding_attention" else ")")
            for kind, plan in plans.items())
        return out
