"""The index side of `ltri-stream`: span index vectors in, block retrieval out (sections 3.3-3.5).

One Indexer per engine, holding settings only: a document's state (queues, lam calibration, counters) lives on
its LtriCache. The stored side (span division, index vectors of evicted blocks) is engines/ltri/stored.py; here is
the query side, which runs on the compute device without waiting for it: the chunk's own map
(kernels/vote_attention), its span candidates (kernels/span_candidates) and the rows its spans choose
(kernels/span_rows, a static count with a mask), then every stored block's score and the top_k blocks loaded, with
collaborative voting across retrieval-head layers.
"""

from __future__ import annotations

import torch

from engines.chunk_graphs import PAYBACK_CHUNKS, ChunkGraph, graphable
from engines.ltri import spans as sp
from engines.ltri.cache import LtriCache, LtriLayer
from engines.ltri.stored import StoredIndex
from kernels.span_rows import span_rows
from kernels.vote_attention import vote_attention


class Indexer(StoredIndex):
    def __init__(self, config, text_config, heads: dict[int, tuple[int, float]] | None = None, graphs: bool = False):
        """heads: {layer: (query head, retrieval score)}, from engines/ltri/heads.py (None: all heads); graphs: the
        query side of long GPU prefills replayed as CUDA graphs (run key prefill_graphs)."""
        self.cfg, self.graphs = config, graphs
        self.n_heads = text_config.num_attention_heads
        self.heads = heads or {}
        self._weights: dict[tuple, torch.Tensor] = {}  # head_weights by (retrieval layer or None, device)
        self._graphs: dict[tuple, ChunkGraph] = {}  # `_query_index` captured per (layer, device, chunk length)
        self._graph_inputs: dict = {}  # the captured query and own keys, one of each shape for every layer

    def head_weights(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        """[Hq] weights of the query heads in retrieval: the layer's retrieval head, else all alike."""
        key = (layer_idx if layer_idx in self.heads else None, device)
        if key not in self._weights:  # made once per layer and device: three launches fewer per retrieval
            w = self._weights[key] = torch.full((self.n_heads,), 1.0 / self.n_heads, device=device)
            if layer_idx in self.heads:
                w.zero_()[self.heads[layer_idx][0]] = 1.0
        return self._weights[key]

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
