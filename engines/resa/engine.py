"""resa's engine: its attention function (chunks dense, decode steps block-sparse or, rectifying, dense), memory
plan, answer hooks (rectification, select_ahead's forms), state export and report."""

from __future__ import annotations

import time

import torch

from engines.base import Engine
from engines.cache import full_layers, head_dim, kv_token_bytes, layer_types
from engines.config import ResaConfig
from engines.resa.cache import ResaKVCache, ResaKVLayer, ResaState
from kernels import cdiv
from kernels.block_descriptors import update_block_descriptors
from kernels.block_select import HIST_BINS, SYNC_WORDS, barrier_timeouts
from kernels.chunk_attention import chunk_attention, chunk_attention_backend
from kernels.decode_attention import decode_attention, decode_backend
from kernels.sparse_decode_attention import sparse_decode_attention, sparse_decode_backend


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
