"""`star`: the engine (the algorithm is described in engines/star/__init__.py)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from engines.base import DocumentState, Engine, EngineInputError, exact_attention, synchronize
from engines.config import StarConfig
from engines.star.cache import RankTally, StarCache, StarState
from engines.star.layout import StarLayout, plan_blocks
from engines.star.ranks import AnchorSync, check_same_document, gather_merge
from kernels.chunk_attention import chunk_attention_backend
from kernels.decode_attention import decode_attention, decode_backend


class StarEngine(Engine):
    name = "star"
    Config = StarConfig
    State = StarState
    # Phase 2's byte tally counts one forward per token yielded after the first; the ranks decode in step.
    decode_ahead = False

    def __init__(self, lm, config, run, *, home: Path | None = None):
        super().__init__(lm, config, run, home=home)
        initialised = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if initialised else 1
        self.rank = dist.get_rank() if initialised else 0
        self.query_rank = self.world - 1

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        if longctx.phase == 1 and longctx.sync is not None:
            longctx.sync(key, value, sliding_window, is_source=longctx.kv_start == 0)
        if longctx.phase == 1 or longctx.world == 1:
            # Phase 1 is causal attention over [anchor | block] slots; with one process the blocks sit side by
            # side from slot 0, so phase 2 is dense attention too.
            return exact_attention(query, key, value, scaling, sliding_window, longctx), None
        return StarEngine._global_attention(query, key, value, scaling, sliding_window, longctx).transpose(1, 2), None

    @staticmethod
    def _global_attention(query, key, value, scaling, window, cache: StarCache) -> torch.Tensor:
        """Phase 2 over ranks: this rank's shard (out, lse), all-gathered and merged. query: [B, Hq, T, D]."""
        device, T = query.device, query.shape[2]
        if cache.decoding:
            first = cache.position_on(device)
        else:
            first = torch.full((1,), cache.offset, dtype=torch.long, device=device)
        first = first - cache.kv_start
        # The query rank's shard ends with the new tokens themselves (causal); a context rank's shard is its
        # blocks, all of them before the queries.
        length = first + T if cache.keeps_queries else cache.context_end_on(device)
        out, lse = decode_attention(query, key[:, :, cache.kv_start:], value[:, :, cache.kv_start:], length,
                                    scale=scaling, window=window, return_lse=True, q_first=first)
        return gather_merge(out, lse, cache.world)

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None, *, chunk_size: int,
                    reserve: int) -> int:
        """One process: the whole cache plus a scratch [anchor | block] for the blocks after the first."""
        try:
            layout = plan_blocks(n_tokens - reserve, engine_config or StarConfig())
        except EngineInputError:
            layout = None  # refused at prefill with the reason; plan the cache alone
        scratch = 0
        if layout is not None and len(layout.bounds) > 1:
            scratch = layout.anchor + max(hi - lo for lo, hi in layout.bounds[1:])
        return super().memory_plan(model_config, n_tokens + scratch, dtype_bytes, chunk_size=chunk_size,
                                   reserve=reserve)

    def backends(self) -> dict[str, str]:
        return {"prefill_attention": chunk_attention_backend(self.device, self.has_sliding_layers, self.head_dim),
                "decode_attention": decode_backend(self.device) + (
                    f"; log-sum-exp merge over {self.world} ranks" if self.world > 1 else "")}

    def _encode(self, cache: StarCache, ids: torch.Tensor, position: int, slot: int, progress=None,
                sync: AnchorSync | None = None, sync_last: bool = False) -> torch.Tensor:
        """ids [N] at positions position.. into slots slot.., in chunks; returns the last logits [1, V].

        `sync` rides on one chunk's forward: the first (a receiver's first block), or with sync_last the last
        (the source's chunk that completes the anchor).
        """
        if sync is None:
            return self._extend(cache, ids, position, progress, slot=slot)
        n, chunk = ids.numel(), self.run.chunk_size
        cut = (n - 1) // chunk * chunk if sync_last else min(chunk, n)
        logits = None
        for lo, hi, synced in ((0, cut, not sync_last), (cut, n, sync_last)):
            if hi > lo:
                cache.sync = sync if synced else None
                try:
                    logits = self._extend(cache, ids[lo:hi], position + lo, progress, slot=slot + lo)
                finally:
                    cache.sync = None
        return logits

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, *, reserve: int, progress=None) -> DocumentState:
        """Phase 1 on this rank: its blocks, each after the anchor; ids [N] is the whole document."""
        self.activate()
        start = time.perf_counter()
        layout = plan_blocks(ids.numel(), self.config, self.world)
        if self.world > 1:
            check_same_document(ids, self.device)
        p0, p1 = layout.span(self.rank)
        a = layout.anchor
        cache = self._rank_cache(layout, reserve)
        cache.compile_windows = self.windows_compiled(ids.numel())
        sync = AnchorSync(a) if self.world > 1 else None
        mine = layout.owners[self.rank]
        hi = layout.bounds[mine[0]][1]
        if self.rank == 0:
            # Block 0 starts with the anchor; the chunk that completes the anchor broadcasts it layer by layer.
            logits = self._encode(cache, ids[:a], 0, 0, progress, sync=sync, sync_last=True)
            if hi > a:
                logits = self._encode(cache, ids[a:hi], a, a, progress)
        else:
            # The first chunk receives the anchor into slots [0, a), layer by layer, before attending to it.
            logits = self._encode(cache, ids[p0:hi], p0, a, progress, sync=sync)
        scratch_bytes = 0
        if len(mine) > 1:
            logits, scratch_bytes = self._encode_later_blocks(cache, ids, layout, mine[1:], progress)
        synchronize(self.devices)
        phase1_s = time.perf_counter() - start
        if self.world > 1:
            # Every rank's logits become the query rank's: the document's end is there.
            dist.broadcast(logits, src=self.query_rank)
            dist.barrier()
        cache.phase = 2
        tally = RankTally(len(mine), p1 - p0, phase1_s, sync.sent_bytes if sync else 0)
        state = StarState(cache, ids.numel(), ids.numel(), logits, time.perf_counter() - start, layout=layout,
                          tally=tally)
        state.counters.update(star_blocks=len(layout.bounds), star_block_tokens=layout.bounds[0][1],
                              star_anchor_tokens=a, star_ranks=self.world, star_scratch_bytes=scratch_bytes)
        if self.config.block_size is None and len(layout.bounds) < self.config.blocks:
            # Two blocks whose anchor is the whole first block: the second block sees everything before it.
            dense = len(layout.bounds) == 1 or (len(layout.bounds) == 2 and a >= layout.bounds[0][1])
            state.counters["star_block_rule"] = (
                f"{len(layout.bounds)} of {self.config.blocks} blocks: each at least min_block_size "
                f"{self.config.min_block_size:,} tokens" + (" (dense attention: every token sees all before it)"
                                                           if dense else ""))
        return state

    def _rank_cache(self, layout: StarLayout, reserve: int) -> StarCache:
        """This rank's cache: [anchor (ranks > 0) | its blocks | (query rank) reserve more]."""
        p0, p1 = layout.span(self.rank)
        kv_start = 0 if self.rank == 0 else layout.anchor
        keeps = self.rank == self.query_rank
        return StarCache(self.model.config, kv_start + (p1 - p0) + (reserve if keeps else 0), kv_start=kv_start,
                         n_context=p1 - p0, shift=p0 - kv_start, world=self.world, keeps_queries=keeps)

    # Phase 2 only appends to the query rank's cache (context ranks store nothing new): the base checkpoint holds.
    reusable = True

    def state_inputs(self, n_tokens: int, reserve: int) -> dict:
        """Each rank saves its own shard, under a key that names it."""
        return {"rank": self.rank, "world": self.world}

    def agree(self, found: bool) -> bool:
        if self.world == 1:
            return found
        flag = torch.tensor([int(found)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    @torch.inference_mode()
    def export_state(self, state: StarState) -> tuple[dict, dict]:
        """This rank's blocks (the anchor's K/V are not needed after phase 2 began) and the last logits."""
        cache = state.cache
        lo, hi = cache.kv_start, cache.kv_start + cache.n_context
        tensors = {}
        for i, layer in enumerate(cache.layers):
            tensors[f"layers.{i}.keys"] = layer.keys[:, :, lo:hi]
            tensors[f"layers.{i}.values"] = layer.values[:, :, lo:hi]
        tally = asdict(state.tally) | {"phase2_s": 0.0, "phase2_bytes_received": 0}
        return self._with_document(state, tensors, {"tally": tally})

    @torch.inference_mode()
    def import_state(self, tensors: dict, meta: dict, reserve: int) -> StarState:
        n = meta["n_tokens"]
        layout = plan_blocks(n, self.config, self.world)
        cache = self._rank_cache(layout, reserve)
        lo, hi = cache.kv_start, cache.kv_start + cache.n_context
        for i, layer in enumerate(cache.layers):
            keys = tensors[f"layers.{i}.keys"].to(self.layer_device(i))
            values = tensors[f"layers.{i}.values"].to(keys.device)
            if keys.shape[2] != hi - lo:
                raise ValueError(f"saved layer {i} holds {keys.shape[2]} tokens, this rank's blocks {hi - lo}")
            layer.lazy_initialization(keys, values)
            layer.keys[:, :, lo:hi], layer.values[:, :, lo:hi] = keys, values
        cache.filled, cache.phase = hi, 2
        return StarState(cache, n, n, tensors["last_logits"].to(self.device), meta.get("prefill_s", 0.0),
                         counters=dict(meta.get("counters", {})), layout=layout, tally=RankTally(**meta["tally"]))

    def _encode_later_blocks(self, cache: StarCache, ids, layout: StarLayout, blocks,
                             progress) -> tuple[torch.Tensor, int]:
        """Blocks after a rank's first: each encoded in a scratch [anchor | block], its K/V then copied home.
        Returns the last logits [1, V] and the scratch's bytes."""
        a = layout.anchor
        size = max(layout.bounds[j][1] - layout.bounds[j][0] for j in blocks)
        scratch = StarCache(self.model.config, a + size, kv_start=0, n_context=0, shift=0, world=1,
                            keeps_queries=True)
        scratch.compile_windows = cache.compile_windows
        for home, layer in zip(cache.layers, scratch.layers):
            layer.lazy_initialization(home.keys, home.values)
            layer.keys[:, :, :a].copy_(home.keys[:, :, :a])
            layer.values[:, :, :a].copy_(home.values[:, :, :a])
        logits = None
        for j in blocks:
            lo, hi = layout.bounds[j]
            logits = self._encode(scratch, ids[lo:hi], lo, a, progress)
            slot = lo - cache.shift
            for home, layer in zip(cache.layers, scratch.layers):
                home.keys[:, :, slot:slot + hi - lo].copy_(layer.keys[:, :, a:a + hi - lo])
                home.values[:, :, slot:slot + hi - lo].copy_(layer.values[:, :, a:a + hi - lo])
        return logits, scratch.nbytes()

    def _encode_question(self, state: StarState, question_ids: torch.Tensor, n_new: int) -> torch.Tensor:
        """Phase 2 for the question: every rank runs it; the query rank keeps its K/V."""
        self.activate()
        cache = state.cache
        if cache.keeps_queries and state.position + question_ids.numel() + n_new - cache.shift > cache.capacity:
            raise ValueError(f"KV cache of {cache.capacity} slots has no room for {question_ids.numel()} + {n_new} "
                             "new tokens")
        logits = state.last_logits
        if question_ids.numel():
            logits = self._encode(cache, question_ids, state.position, state.position - cache.shift)
        state.position += question_ids.numel()
        state.phase2_tokens = question_ids.numel()
        return logits

    @torch.inference_mode()
    def answer(self, state: StarState, question_ids: torch.Tensor, max_new_tokens: int, sampler):
        start = time.perf_counter()
        produced = 0
        try:
            for token in super().answer(state, question_ids, max_new_tokens, sampler):
                produced += 1
                yield token
        finally:
            synchronize(self.devices)
            state.tally.phase2_s = time.perf_counter() - start
            # Forwards in phase 2: the question, then one per generated token after the first.
            tokens = state.phase2_tokens + max(0, produced - 1)
            text = self.text_config
            per_token = text.num_hidden_layers * text.num_attention_heads * (self.head_dim + 1) * 4
            state.tally.phase2_bytes_received = tokens * per_token * (self.world - 1)

    def counters(self, state: StarState) -> dict:
        counters = super().counters(state)
        rank = asdict(state.tally)
        ranks = [rank]
        if self.world > 1:
            ranks = [None] * self.world
            dist.all_gather_object(ranks, rank)
        counters["star_per_rank"] = ranks
        return counters
