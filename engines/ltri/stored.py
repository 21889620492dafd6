"""The stored side of `ltri-stream`'s index (sections 3.3-3.4): the spans of every block a chunk completes, and the
index vectors of the blocks that leave the window.

The chunk's own map is queued per layer and handled once per chunk for all layers (`flush`), a chunk late so that
the device never drains at a chunk boundary: span candidates on the device, copied to pinned host memory while the
next chunk runs, NMS on the host at the next flush. An evicted block's index vectors are picked by votes (the
paper) or by farthest-point sampling of its keys on the device (`pick: cover`, kernels/farthest_point), added to
the index without the host learning how many were picked. `StoredIndex` is the Indexer's half that does this
(engines/ltri/index.py holds the query side); it reads the Indexer's settings (`cfg`, `heads`, `n_heads`).
"""

from __future__ import annotations

import numpy as np
import torch

from engines.ltri import spans as sp
from engines.ltri.cache import LtriCache, LtriLayer
from kernels import cdiv
from kernels.farthest_point import farthest_point

_FIRST_LAYERS = 4  # "the lam value for the first four layers is assigned as 20"
_CALIBRATION_SPANS = 4096  # most recent spans per layer kept for the lam lookup


class StoredIndex:
    """Span division, lam and index vectors for evicted blocks; mixed into `Indexer`."""

    cfg: object
    heads: dict
    n_heads: int

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
