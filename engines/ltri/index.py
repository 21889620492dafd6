"""The index side of `ltri-stream`: span index vectors in, block retrieval out (sections 3.3-3.5).

One Indexer per engine, holding settings only: a document's state (queues, lam calibration, counters) lives on
its LtriCache.
The query side runs on the compute device without waiting for it: the chunk's own map (kernels/vote_attention),
its span candidates (kernels/span_candidates) and the rows its spans choose (kernels/span_rows, a static count
with a mask). The stored side is queued per layer and handled once per chunk for all layers (`flush`), a chunk
late so that the device never drains at a chunk boundary: candidates on the device, copied to pinned host memory
while the next chunk runs, NMS on the host at the next flush; index vectors picked by votes (the paper) or by
farthest-point sampling of the keys on the device (`pick: cover`, kernels/farthest_point), added to the index
without the host learning how many were picked.
"""

from __future__ import annotations

import numpy as np
import torch

from engines.chunk_graphs import PAYBACK_CHUNKS, ChunkGraph, graphable
from engines.ltri import spans as sp
from engines.ltri.cache import LtriCache, LtriLayer
from kernels import cdiv
from kernels.farthest_point import farthest_point
from kernels.span_rows import span_rows
from kernels.vote_attention import vote_attention

_FIRST_LAYERS = 4  # "the lam value for the first four layers is assigned as 20"
_CALIBRATION_SPANS = 4096  # most recent spans per layer kept for the lam lookup


class Indexer:
    def __init__(self, config, text_config, heads: dict[int, tuple[int, float]] | None = None, graphs: bool = False):
        """heads: {layer: (query head, retrieval score)}, from engines/ltri/heads.py (None: all heads); graphs: the
        query side of long GPU prefills replayed as CUDA graphs (run key prefill_graphs)."""
        self.cfg, self.graphs = config, graphs
        self.n_heads = text_config.num_attention_heads
        self.heads = heads or {}
        self._weights: dict[tuple, torch.Tensor] = {}  # head_weights by (retrieval layer or None, device)
        self._graphs: dict[tuple, ChunkGraph] = {}  # `_query_index` captured per (layer, device, chunk length)
        self._graph_inputs: dict = {}  # the captured query and own keys, one of each shape for every layer

    def lam(self, layer_idx: int, cache: LtriCache) -> float:
        if layer_idx < _FIRST_LAYERS:
            return self.cfg.lam_first_layers
        return cache.lams.get(layer_idx, self.cfg.lam)

    def _allocate(self, layer_idx: int, found: list[sp.Span], votes: torch.Tensor, cache: LtriCache) -> list[int]:
        return sp.allocate(found, votes, self.lam(layer_idx, cache), self.cfg.min_vectors, self.cfg.max_vectors)

    def _record(self, layer_idx: int, found: np.ndarray, cache: LtriCache) -> None:
        """Keeps spans ([k, 4] rows of `kept_spans`) for the per-layer lam lookup (section 3.3.2) when a target
        compression is set."""
        if self.cfg.compression is None or layer_idx < _FIRST_LAYERS:
            return
        seen = cache.lam_samples.setdefault(layer_idx, [])
        seen.extend(zip((found[:, 1] - found[:, 0] + 1).astype(np.int64).tolist(), found[:, 3].tolist()))
        del seen[:-_CALIBRATION_SPANS]
        lengths = torch.tensor([n for n, _ in seen], dtype=torch.float64)
        conf = torch.tensor([c for _, c in seen], dtype=torch.float64)
        cache.lams[layer_idx] = sp.calibrate_lambda(lengths, conf, self.cfg.compression)

    def head_weights(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        """[Hq] weights of the query heads in retrieval: the layer's retrieval head, else all alike."""
        key = (layer_idx if layer_idx in self.heads else None, device)
        if key not in self._weights:  # made once per layer and device: three launches fewer per retrieval
            w = self._weights[key] = torch.full((self.n_heads,), 1.0 / self.n_heads, device=device)
            if layer_idx in self.heads:
                w.zero_()[self.heads[layer_idx][0]] = 1.0
        return self._weights[key]

    def note_spans(self, layer: LtriLayer, layer_idx: int, own: torch.Tensor, start: int, cache: LtriCache) -> None:
        """Queues for span division every block completed inside the chunk. own: [n, n] the chunk's map over
        its window tokens at positions start..start+n-1. The division runs in `flush`, batched over every
        layer of the chunk: a block's spans are only needed when it leaves the window, chunks later."""
        if self.cfg.index != "dynamic":
            return
        b = layer.block
        first = cdiv(start - layer.n_init, b)  # first block starting at or after `start`
        count = (start + own.shape[0] - layer.n_init) // b - first
        if count <= 0:
            return
        lo = layer.n_init + first * b - start
        cache.span_queue.append((layer, layer_idx, first, sp.diagonal_blocks(own, lo, count, b)))

    @torch.inference_mode()
    def flush(self, cache: LtriCache, complete: bool = False) -> None:
        """At a chunk's start: divides the maps whose candidates the last flush sent to host memory, sends those
        of the maps queued since, and indexes the blocks evicted since the last flush (`pick: cover`, batched over
        layers); none of it waits for the chunk just issued. complete: divides every queued map now (a wait), as
        after the document and the question, before counters and checkpoints.

        The spans of a block are needed only when it leaves the window, chunks later; a chunk longer than the
        window (or a short window) evicts blocks whose division is still in flight, and those are divided first.
        With `compression` set, every flush divides what it sends: lam is calibrated on every span up to the
        chunk's, as the paper's lookup is."""
        self._divide_sent(cache)
        if cache.span_queue:
            self._send_candidates(cache)
        complete = complete or self.cfg.compression is not None
        if complete or any(self._dividing(cache, layer, first + keys.shape[1] // layer.block)
                           for layer, _, first, keys, _ in cache.pick_queue):
            self._divide_sent(cache)
        if cache.pick_queue:
            queue, cache.pick_queue = cache.pick_queue, []
            self._cover(queue, cache)

    @staticmethod
    def _dividing(cache: LtriCache, layer: LtriLayer, end: int) -> bool:
        """Whether a block of `layer` before block `end` still waits for its spans."""
        return any(item[0] is layer and item[2] < end for item in cache.span_queue) or any(
            item[0] is layer and item[2] < end for items, _, _ in cache.dividing for item in items)

    def _send_candidates(self, cache: LtriCache) -> None:
        """The queued maps' span candidates, computed on their device (one batch per device: a model split over
        GPUs keeps each layer's maps on its layer's device) and copied into pinned host memory without a wait."""
        queue, cache.span_queue = cache.span_queue, []
        by_device: dict[torch.device, list] = {}
        for item in queue:
            by_device.setdefault(item[-1].device, []).append(item)
        for batch in by_device.values():
            cands = sp.threshold_candidates(torch.cat([maps for *_, maps in batch]), self.cfg.threshold,
                                            self.cfg.ratio_mode)
            done = None
            if cands.is_cuda:
                host = torch.empty(cands.shape, dtype=cands.dtype, pin_memory=True)
                host.copy_(cands, non_blocking=True)
                done = torch.cuda.current_stream(cands.device).record_event()
                cands = host
            cache.dividing.append(([(layer, i, first, maps.shape[0]) for layer, i, first, maps in batch], cands,
                                   done))

    def _divide_sent(self, cache: LtriCache) -> None:
        """NMS on the host over the candidates `_send_candidates` sent: the spans of each queued block, kept until
        the block is indexed (`pending`)."""
        sent, cache.dividing = cache.dividing, []
        for items, cands, done in sent:
            if done is not None:
                done.synchronize()  # recorded a chunk ago: the device is normally past it
            spans, counts = sp.kept_spans(cands.numpy(), self.cfg.iou)
            cache.stats["spans"] += int(counts.sum())
            m = 0
            for layer, layer_idx, first, count in items:
                for k in range(count):
                    found = spans[m + k, :counts[m + k]]
                    layer.pending[first + k] = found
                    self._record(layer_idx, found, cache)
                m += count

    def _pick(self, layer: LtriLayer, layer_idx: int, block_id: int, votes: torch.Tensor,
              cache: LtriCache) -> list[int]:
        """Rows (within the block) whose keys become the block's index vectors."""
        if self.cfg.index == "static":
            return votes.topk(min(self.cfg.repr_topk, votes.numel())).indices.tolist()
        return self._allocate(layer_idx, sp.as_spans(self._spans(layer, block_id)), votes, cache)

    @staticmethod
    def _spans(layer: LtriLayer, block_id: int) -> np.ndarray:
        """The spans of a block leaving the window ([k, 4], `kept_spans`): its division, or the whole block."""
        found = layer.pending.pop(block_id, None)
        return sp.whole_block(layer.block) if found is None else found

    def evict(self, layer: LtriLayer, layer_idx: int, cache: LtriCache) -> None:
        """Whole blocks past the window go to CPU memory, indexed by their span index vectors."""
        n = (layer.local_len - layer.n_local) // layer.block
        if n <= 0:
            return
        first = layer.first_full_block()
        cover = self.cfg.index == "dynamic" and self.cfg.pick == "cover"
        if not cover and self._dividing(cache, layer, first + n):
            self.flush(cache, complete=True)  # a chunk longer than the window evicts blocks it completed itself
        start = layer.local_start
        keys, values, votes = layer.take_oldest(n * layer.block)
        cache.stats["device_to_host_bytes"] += layer.memory.add(keys, values)
        layer.summarize(first, keys, values)
        keys = layer.as_attended(keys, start)  # index vectors are matched against the chunk's queries
        if cover:
            # Picked at the next flush, with every other layer's evicted blocks: the farthest-point steps are
            # small, and one batch per chunk instead of one per layer keeps long prefills from waiting on launches.
            cache.pick_queue.append((layer, layer_idx, first, keys, votes))
            return
        votes = votes.cpu()
        rows, ids = [], []
        for i in range(n):
            picked = self._pick(layer, layer_idx, first + i, votes[i * layer.block:(i + 1) * layer.block], cache)
            rows.extend(i * layer.block + r for r in picked)
            ids.extend([first + i] * len(picked))
        index = torch.tensor(rows, dtype=torch.long, device=keys.device)
        layer.index.add(keys[:, index].transpose(0, 1), torch.tensor(ids, dtype=torch.long, device=keys.device),
                        index % layer.block)
        cache.stats["blocks_indexed"] += n

    def _cover(self, queue: list, cache: LtriCache) -> None:
        """`pick: cover` for queued evictions (layer, layer index, first block id, keys [Hkv, n * block, D], votes
        [n * block]): Eq. 7's count per block (`slot_table`), picked by farthest-point sampling of the keys (of
        the retrieval head's KV head when the layer has one, the head retrieval scores), on the device, in one
        batch per feature width."""
        groups: dict[int, list] = {}
        for layer, layer_idx, first, keys, votes in queue:
            b = layer.block
            n = keys.shape[1] // b
            feats = keys
            if layer_idx in self.heads:
                feats = keys[self.heads[layer_idx][0] // (self.n_heads // keys.shape[0])][None]
            feats = feats.view(feats.shape[0], n, b, -1).permute(1, 2, 0, 3).flatten(2)  # [n, block, F]
            # Batched per feature width and device (a model split over GPUs: each layer's keys on its own).
            groups.setdefault((feats.shape[-1], feats.device), []).append(
                (layer, first, keys, feats, votes.view(n, b), [self._spans(layer, first + i) for i in range(n)],
                 self.lam(layer_idx, cache)))
        for items in groups.values():
            self._cover_group(items, cache)

    def _cover_group(self, items: list, cache: LtriCache) -> None:
        """Picks and indexes the blocks of items (layer, first block id, keys, feats [n, block, F], votes [n, block],
        spans of each block, lam) whose feats share a width and a device."""
        b = items[0][0].block
        per_item = [len(item[5]) for item in items]  # blocks of each item
        found = [f for item in items for f in item[5]]
        spans = np.zeros((len(found), max(len(f) for f in found), 4))
        for i, f in enumerate(found):
            spans[i, :len(f)] = f
        lams = np.repeat([item[6] for item in items], per_item)
        table, slots = sp.slot_table(spans, np.array([len(f) for f in found]), lams, self.cfg.min_vectors,
                                     self.cfg.max_vectors, b)
        # Every slot of every block becomes an entry, block by block: where its pick lands in `picks` [m, width],
        # the row in its layer's keys of the block's first token, and the block's id, all known on the host. A slot
        # whose range had no row left (pick -1) stays an entry of block -1, which the scores skip, so the host never
        # waits to learn how many rows were picked.
        block, slot = np.nonzero(np.arange(table.shape[1]) < slots[:, None])
        local = np.concatenate([np.arange(k) for k in per_item])
        first = np.repeat([item[1] for item in items], per_item)
        host = torch.from_numpy(np.stack([block * table.shape[1] + slot, local[block] * b, (first + local)[block]]))
        feats = torch.cat([item[3] for item in items])
        device = feats.device
        pinned = device.type == "cuda"
        table, host = (torch.from_numpy(table), host) if not pinned else (
            torch.from_numpy(table).pin_memory(), host.pin_memory())  # copied without a wait for the device
        picks = farthest_point(feats, torch.cat([item[4] for item in items]), table.to(device, non_blocking=True))
        cells, base, ids = host.to(device, non_blocking=True)
        picked = picks.view(-1)[cells]
        rows = picked.clamp(min=0) + base
        blocks = torch.where(picked >= 0, ids, -1)
        sizes = np.add.reduceat(slots, np.cumsum([0] + per_item[:-1])).tolist()
        for item, k, r, bl, o in zip(items, per_item, rows.split(sizes), blocks.split(sizes), picked.split(sizes)):
            item[0].index.add(item[2][:, r].transpose(0, 1), bl, o)
            cache.stats["blocks_indexed"] += k

    def _query_index(self, layer_idx: int, lam: float, query, own, own_pos, offset: int,
                     scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's query index vectors, head-weighted per KV head [A, Hkv, D] fp32, and which of them count
        [A] bool: the chunk's own causal map (kernels/vote_attention of query [1, Hq, T, D] over its own keys own
        [1, Hkv, T, D] at own_pos [T]), block by block, divided into spans, the top-voted queries of each span (Eq.
        7, within the bounds of a block; kernels/span_rows). A is the most the bounds allow, so nothing here waits
        for the device to learn how many were chosen."""
        T = query.shape[2]
        _, votes, amap = vote_attention(query, own, own, own_pos, offset, scale=scaling, n_own=T)
        # Divided block by block, like the stored side (a shorter last piece on its own).
        b, cfg = self.cfg.block_size, self.cfg
        full = T // b
        pieces = [(sp.diagonal_blocks(amap, 0, full, b), votes[:full * b].view(full, b))] if full else []
        if T % b:
            pieces.append((amap[None, full * b:, full * b:], votes[None, full * b:]))
        chosen = torch.cat([span_rows(sp.threshold_candidates(maps, cfg.threshold, cfg.ratio_mode), v, lam=lam,
                                      lo=cfg.min_vectors, hi=cfg.max_vectors, iou=cfg.iou).flatten()
                            for maps, v in pieces])
        most = sum(maps.shape[0] * min(cfg.max_vectors, maps.shape[-1]) for maps, _ in pieces)
        picked = torch.sort(chosen.to(torch.uint8), descending=True, stable=True).indices[:most]
        qvec = query[0][:, picked].transpose(0, 1)  # [A, Hq, D]
        w = self.head_weights(layer_idx, query.device)
        hkv = own.shape[1]
        qw = (qvec.float() * w[None, :, None]).view(qvec.shape[0], hkv, -1, qvec.shape[-1]).sum(dim=2)
        return qw, chosen[picked]

    def _query_vectors(self, layer: LtriLayer, layer_idx: int, query, key, scaling,
                       cache: LtriCache) -> tuple[torch.Tensor, torch.Tensor]:
        """`_query_index` of the chunk in flight (its rows the window's last T), replayed as a CUDA graph per layer
        where every chunk has the same shapes (engines/chunk_graphs.py): a chunk wholly in the window, lam fixed
        (no `compression`), and enough chunks left to repay the capture."""
        T = query.shape[2]
        end = layer.width
        own = key[:, :, end - T:end]
        lam = self.lam(layer_idx, cache)
        graph = self._graphs.get((layer_idx, query.device, T))
        steady = self.graphs and self.cfg.compression is None and cache.offset >= layer.n_init and graphable(query)
        if not steady or (graph is None and cache.capacity - cache.offset < PAYBACK_CHUNKS * T):
            return self._query_index(layer_idx, lam, query, own, layer.key_pos[end - T:end], cache.offset, scaling)
        if graph is None:
            # The own rows hold positions offset .. offset + T - 1: the same causal map as at positions 0 .. T - 1.
            at = torch.arange(T, device=query.device)
            graph = self._graphs[layer_idx, query.device, T] = ChunkGraph(
                lambda q, k: self._query_index(layer_idx, lam, q, k, at, 0, scaling), f"query index L{layer_idx}",
                self._graph_inputs)
        return graph(query, own)

    def retrieve(self, layer: LtriLayer, layer_idx: int, query, key, scaling, cache: LtriCache) -> None:
        """Fills the retrieval slots with the layer's top_k blocks for this chunk (all blocks when they fit)."""
        n_blocks = layer.memory.n_blocks
        if n_blocks == 0:
            return
        k = min(self.cfg.top_k, n_blocks)
        if n_blocks <= k:
            layer.load_blocks(torch.arange(n_blocks, device=query.device), None, n_blocks, 0)
        else:
            qw, chosen = self._query_vectors(layer, layer_idx, query, key, scaling, cache)
            scores, where = layer.index.block_scores(qw, n_blocks, chosen)
            scores = self._vote(layer_idx, scores, cache)
            # The successor rule (`successor_tail`): a block whose best-matching index vector lies in its last
            # tokens brings the next block along: what the question matches there (a needle's key) may continue
            # past the block boundary (its value), which no query of the question resembles.
            layer.load_blocks(scores.topk(k).indices, where, n_blocks, self.cfg.successor_tail)
        cache.stats["blocks_retrieved"] += k
        cache.stats["retrievals"] += 1

    def _vote(self, layer_idx: int, scores: torch.Tensor, cache: LtriCache) -> torch.Tensor:
        """Collaborative voting (3.5): this layer's normalised scores plus those of earlier retrieval-head
        layers in this chunk, each weighted by its retrieval score (layers without one weigh 0.1, the
        paper's retrieval-head cut-off). While the question is read a second time (`question_votes: all`),
        those of every retrieval-head layer of the first reading's same chunk instead, this layer's own left out."""
        if not self.cfg.voting or not self.heads:
            return scores
        finite = torch.isfinite(scores)
        # Masked reductions rather than scores[finite]: a boolean index waits for the device to learn its size.
        lo, hi = scores.masked_fill(~finite, float("inf")).amin(), scores.masked_fill(~finite, float("-inf")).amax()
        own = torch.where(finite, (scores - lo) / (hi - lo).clamp(min=1e-6), 0.0)
        weight = self.heads[layer_idx][1] if layer_idx in self.heads else 0.1
        others = cache.chunk_votes
        if cache.first_reading is not None:
            others = {i: v for i, v in cache.first_reading[len(cache.question_chunks) - 1].items() if i != layer_idx}
        # Other layers' votes come from their own devices where the model is split (a vector per block).
        total = weight * own + sum(w * s.to(own.device, non_blocking=True) for w, s in others.values())
        if layer_idx in self.heads:
            cache.chunk_votes[layer_idx] = (weight, own)
        return total

    def counters(self, cache: LtriCache) -> dict:
        ids = [i for i, layer in enumerate(cache.layers) if layer.retrieve and layer.is_initialized]
        full = [cache.layers[i] for i in ids]
        cache.settle()
        stats = cache.stats
        if not full:
            return {}
        vectors = sum(layer.index.count() for layer in full)
        blocks = stats["blocks_indexed"]

        def per_layer(values) -> str:
            return ", ".join(f"L{i}:{v}" for i, v in zip(ids, values))
        out = {
            "ltri_device_rows_per_layer": max(layer.rows for layer in full),
            "ltri_peak_valid_rows": max(layer.peak_rows for layer in full),
            "ltri_peak_valid_rows_per_layer": per_layer(layer.peak_rows for layer in full),
            "ltri_peak_valid_rows_all_layers": sum(layer.peak_rows for layer in full),
            "ltri_cpu_blocks": full[0].memory.n_blocks,
            "ltri_cpu_memory_bytes": sum(layer.memory.nbytes() for layer in full),
            "ltri_index_vectors": vectors,
            "ltri_index_bytes": sum(layer.index.nbytes() for layer in full),
            "ltri_tokens_per_index_vector": round(blocks * full[0].block / vectors, 1) if vectors else None,
            "ltri_spans_per_block": round(stats["spans"] / blocks, 2) if blocks and stats["spans"] else None,
            "ltri_blocks_retrieved_per_chunk": round(stats["blocks_retrieved"] / stats["retrievals"], 1)
            if stats["retrievals"] else 0,
            "ltri_successors_loaded": stats["successors"],
            "ltri_question_readings": stats.get("question_readings") or None,
            "ltri_host_to_device_bytes": stats["host_to_device_bytes"],
            "ltri_device_to_host_bytes": stats["device_to_host_bytes"],
            "ltri_retrieval_heads": ", ".join(f"L{l}:h{h} ({s:.2f})" for l, (h, s) in sorted(self.heads.items()))
            or "none (all heads averaged)",
            "ltri_lambda": ", ".join(f"L{l}:{v:.1f}" for l, v in sorted(cache.lams.items())) or None,
            # Layers whose query side replays as a CUDA graph (the engine's, kept across documents).
            "ltri_query_graph_layers": sum(g.captured for g in self._graphs.values()) or None,
        }
        return {k: v for k, v in out.items() if v is not None}
