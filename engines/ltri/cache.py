"""The bounded device-side KV cache of `ltri-stream`, one layer per decoder layer.

Rows of a layer's buffers [B, Hkv, rows, D] on the compute device:

    [0, n_init)                     the first n_init tokens (attention sinks), kept for good
    [n_init, n_init + R)            retrieved blocks, R = top_k * block (slot s holds block `slots[s]`)
    [local0, local0 + local_cap)    the local window, oldest first: the last >= n_local tokens, then the chunk
                                    in flight, then (decode) the generated tokens

`key_pos` [rows] (device) holds each row's token position (-1: empty), so every mask is "valid and causal"
(and inside the window, for the model's own sliding-window layers). After a chunk's attention, whole blocks
older than the window leave: their K/V go to CPU context memory and their span index vectors to the index
memory; the window shifts down. Sliding-window layers keep only their window and drop what leaves it.
Nothing here grows with the document except the CPU context memory and the index vectors.
"""

from __future__ import annotations

import torch

from engines.cache import OwnedRowsLayer, StaticKVCache, layer_types
from engines.ltri.memory import ContextMemory, IndexMemory, context_blocks
from kernels.slot_plan import plan_slots, slot_rows


class LtriLayer(OwnedRowsLayer):

    def __init__(self, owner: "LtriCache", *, n_init: int, n_retrieved: int, n_local: int, block: int,
                 room: int, window: int | None, retrieve: bool, fp8_memory: bool = False, max_vectors: int = 0,
                 summaries: bool = False):
        super().__init__()
        self.owner, self.block, self.window, self.retrieve = owner, block, window, retrieve
        self.summaries = summaries and retrieve
        self.summary_keys = self.summary_values = self.summary_mask = self.summary_length = None
        self.fp8_memory, self.max_vectors = fp8_memory, max_vectors
        self.is_sliding = window is not None
        self.n_init, self.n_retrieved, self.n_local = n_init, n_retrieved, n_local
        self.local0 = n_init + n_retrieved
        self.local_cap = n_local + block + room
        self.rows = self.rows_for(n_init, n_retrieved, n_local, block, room)
        self.local_len = 0  # rows of the local window in use
        self.local_start = n_init  # position of local row 0
        self._slots = [-1] * (n_retrieved // block)  # block id per retrieval slot (`slot_ids` once initialized)
        self.n_held = 0  # slots holding a block, known on the host without reading `slot_ids`
        self.pending: dict = {}  # block id -> its spans [k, 4] (spans.kept_spans), for blocks still in the window
        self.peak_rows = 0  # most valid rows ever held (measured at every chunk)

    @staticmethod
    def rows_for(n_init: int, n_retrieved: int, n_local: int, block: int, room: int, **_) -> int:
        """Buffer rows: init, retrieval slots, then the window's >= n_local tokens, a partial block and room
        (the chunk in flight, or the question and the answer)."""
        return n_init + n_retrieved + n_local + block + room

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        if batch != 1:
            raise ValueError(f"ltri-stream runs one sequence at a time, got a batch of {batch}")
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = torch.zeros(batch, heads, self.rows, dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(batch, heads, self.rows, value_states.shape[-1], dtype=self.dtype,
                                  device=self.device)
        self.key_pos = torch.full((self.rows,), -1, dtype=torch.long, device=self.device)
        self.votes = torch.zeros(self.rows, dtype=torch.float32, device=self.device)
        self.shift = torch.zeros(1, dtype=torch.long, device=self.device)  # decode: row = position - shift
        self.rows_t = torch.full((batch,), self.rows, dtype=torch.long, device=self.device)  # decode reads all
        # Re-assigned positions of the rows in front of the window (init, then the retrieved blocks in document
        # order, whatever slots they sit in): see `assigned`.
        self.front_at = torch.arange(self.local0, device=self.device)
        # Re-assigned positions: the rows' keys rotated for decode steps (`begin_decode`, `attended`).
        self.rotated = torch.empty_like(self.keys) if self.owner.positions is not None else None
        if self.retrieve:
            # Which block each slot holds, decided on the device (kernels/slot_plan) with the blocks each slot
            # loads, and its tallies of successors and blocks loaded (read into the counters by `settle`).
            self.slot_ids = torch.tensor(self._slots, dtype=torch.long, device=self.device)
            self.slot_load = torch.full_like(self.slot_ids, -1)
            self.tally = torch.zeros(2, dtype=torch.long, device=self.device)
            pin = self.device.type == "cuda"
            # Sized for the whole document up front (the cache knows its length): a growing pinned slab would
            # wait for the device and copy itself at every doubling.
            blocks = context_blocks(self.owner.capacity, self.n_init, self.block)
            # A state read back brings its blocks along: its slabs only take the blocks a question adds.
            slab = blocks if self.owner.memory_blocks is None else self.owner.memory_blocks
            self.memory = ContextMemory(heads, self.block, dim, self.dtype, pin, slab, self.fp8_memory)
            self.index = IndexMemory(heads, dim, self.dtype, self.device, blocks * self.max_vectors)
            if self.summaries:
                # LtriConfig.decode_summaries: per stored block its mean key and value, a row each, [1, Hkv, n, D]
                # for the whole document, and which of them a decode step attends and how many rows it reads (set
                # by begin_decode).
                self.summary_keys = torch.zeros(batch, heads, blocks, dim, dtype=self.dtype, device=self.device)
                self.summary_values = torch.zeros(batch, heads, blocks, value_states.shape[-1], dtype=self.dtype,
                                                  device=self.device)
                self.summary_mask = torch.zeros(batch, heads, blocks, dtype=torch.bool, device=self.device)
                self.summary_length = torch.full((batch,), blocks, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states: [1, Hkv, T, D] -> the whole buffers; prefill appends to the window, decode writes at
        row position - shift (a device tensor: no host sync, CUDA-graph safe)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        key_states = owner.kept_keys(key_states, self.is_sliding)  # `attended` rotates them back
        if owner.decoding:
            pos = owner.position_on(self.device)
            row = pos - self.shift
            self.keys.index_copy_(2, row, key_states)
            self.values.index_copy_(2, row, value_states)
            self.key_pos.index_copy_(0, row, pos)
            return self.keys, self.values
        offset, t = owner.offset, key_states.shape[2]
        n_head = max(0, min(t, self.n_init - offset))  # tokens that belong to the init rows
        if n_head:
            self._write(offset, key_states[:, :, :n_head], value_states[:, :, :n_head], offset)
        if n_head < t:
            if offset + n_head != self.local_start + self.local_len:
                raise ValueError(f"ltri-stream: chunk at {offset + n_head} does not follow the window's end "
                                 f"{self.local_start + self.local_len}")
            if self.local_len + t - n_head > self.local_cap:
                raise ValueError(f"ltri-stream: a chunk of {t} tokens does not fit the window's "
                                 f"{self.local_cap - self.local_len} free rows")
            row = self.local0 + self.local_len
            self._write(row, key_states[:, :, n_head:], value_states[:, :, n_head:], offset + n_head)
            self.votes[row:row + t - n_head] = 0.0
            self.local_len += t - n_head
        self.peak_rows = max(self.peak_rows, self.valid_rows())
        return self.keys, self.values

    def assigned(self) -> torch.Tensor:
        """[rows] the positions the rows are attended at when positions are re-assigned: the window keeps its
        true distances (document position - shift); the init tokens keep theirs (their rows); retrieved blocks
        keep theirs while the document still fits in front of the window (shift 0), and afterwards sit between
        the init tokens and the window in document order (`order_slots`). Every position is below `rows`.
        Read on the host's shift (prefill and `begin_decode`; decode steps rotate only their own row)."""
        window = self.key_pos - self.owner.positions.shift
        if not self.retrieve:
            return window
        return torch.cat([self._front(), window[self.local0:]])

    def _front(self) -> torch.Tensor:
        """`assigned` of the rows in front of the window (init and retrieval slots): a view, no launch."""
        return self.key_pos[:self.local0] if self.owner.positions.shift == 0 else self.front_at

    def attended(self, keys: torch.Tensor) -> torch.Tensor:
        """The rows' keys as attention reads them: rotated at `assigned` where positions are re-assigned (a new
        tensor in prefill, `rotated` in decode steps; else the buffers themselves)."""
        positions = self.owner.positions
        if positions is None:
            return keys
        if self.owner.decoding:
            # Only the row this step wrote is new: no other row's key or assigned position changes while decoding.
            pos = self.owner.position_on(self.device)
            row = pos - self.shift
            new = positions.rotate(keys.index_select(2, row), pos - positions.shift_on(self.device), self.is_sliding,
                                   below=self.rows)
            return self.rotated.index_copy_(2, row, new)
        return positions.rotate(keys, self.assigned(), self.is_sliding, below=self.rows)

    def begin_decode(self) -> None:
        """Before the first decode step: `rotated` holds every row's key at its assigned position, which stays
        fixed while decoding (the answer only appends rows; each step rotates its own in `attended`), so a step
        reads the rows once instead of rotating them all again."""
        if self.rotated is not None:
            self.rotated.copy_(self.owner.positions.rotate(self.keys, self.assigned(), self.is_sliding,
                                                           below=self.rows))
        if self.summary_mask is not None:
            # Every stored block but those the retrieval slots hold: the decoded tokens keep this retrieval.
            # A step reads the stored blocks' rows only, not the whole document's capacity.
            n = self.memory.n_blocks
            attend = torch.zeros(self.summary_mask.shape[-1], dtype=torch.bool)
            attend[:n] = True
            attend[[b for b in self.slots if 0 <= b < n]] = False
            self.summary_mask.copy_(attend.expand_as(self.summary_mask))
            self.summary_length.fill_(n)

    def summarize(self, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stored blocks first, first + 1, ... (keys, values [Hkv, n * block, D] as written to context memory):
        their mean key and value rows (LtriConfig.decode_summaries)."""
        if self.summary_keys is None:
            return
        n = keys.shape[1] // self.block
        for rows, x in ((self.summary_keys, keys), (self.summary_values, values)):
            rows[0, :, first:first + n] = x.unflatten(1, (n, self.block)).float().mean(dim=2).to(rows.dtype)

    def summary_rows(self) -> int:
        """How many summary rows a decode step attends (0 without LtriConfig.decode_summaries)."""
        return 0 if self.summary_mask is None else int(self.summary_mask[0, 0].sum())

    def reattend_slots(self, attended: torch.Tensor) -> None:
        """After the retrieval slots were filled: their rows of `attended` (from `attended`) rotated afresh."""
        if self.owner.positions is None:
            return  # `attended` is the buffers themselves: the slots are already there
        lo, hi = self.n_init, self.local0
        attended[:, :, lo:hi] = self.owner.positions.rotate(self.keys[:, :, lo:hi], self._front()[lo:hi],
                                                            self.is_sliding, below=self.rows)

    def as_attended(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """keys [Hkv, n, D] of window tokens from document position `start` on, as `attended` rotated them."""
        positions = self.owner.positions
        if positions is None:
            return keys
        end = start + keys.shape[1] - positions.shift
        return positions.rotate(keys[None], torch.arange(end - keys.shape[1], end, device=keys.device),
                                self.is_sliding, below=end)[0]

    def _write(self, row: int, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        n = k.shape[2]
        self.keys[:, :, row:row + n] = k
        self.values[:, :, row:row + n] = v
        self.key_pos[row:row + n] = torch.arange(position, position + n, device=self.device)

    @property
    def width(self) -> int:
        """Rows a prefill attention reads: init, retrieval slots and the window so far."""
        return self.local0 + self.local_len

    @property
    def slots(self) -> list[int]:
        """Block id per retrieval slot (-1: empty); read from the device once initialized (a wait: checkpoints,
        saved states and decode set-up read it, never a prefill chunk)."""
        if self.retrieve and self.is_initialized:
            return self.slot_ids.tolist()
        return list(self._slots)

    @slots.setter
    def slots(self, values: list[int]) -> None:
        self._slots = list(values)
        self.n_held = sum(b >= 0 for b in values)
        if self.retrieve and self.is_initialized:
            self.slot_ids.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

    def valid_rows(self) -> int:
        init = min(self.n_init, self.owner.filled)
        return init + self.block * self.n_held + self.local_len

    def first_full_block(self) -> int:
        """Id of the oldest block of the window (block b holds positions n_init + b * block ...)."""
        return (self.local_start - self.n_init) // self.block

    def take_oldest(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Removes the window's oldest n rows; returns their keys, values [Hkv, n, D] and votes [n]."""
        lo = self.local0
        out = (self.keys[0, :, lo:lo + n].clone(), self.values[0, :, lo:lo + n].clone(), self.votes[lo:lo + n].clone())
        keep = self.local_len - n
        for buf in (self.keys, self.values):
            buf[:, :, lo:lo + keep] = buf[:, :, lo + n:lo + n + keep].clone()
        for buf in (self.key_pos, self.votes):
            buf[lo:lo + keep] = buf[lo + n:lo + n + keep].clone()
        self.key_pos[lo + keep:lo + self.local_len] = -1
        self.local_len, self.local_start = keep, self.local_start + n
        return out

    def load_blocks(self, top: torch.Tensor, where: torch.Tensor | None, n_blocks: int, tail: int) -> None:
        """Makes the retrieval slots hold the chunk's top blocks top [k] (best first; with `tail`, a block matched
        in its last `tail` tokens (where [n_blocks]) brings its successor); blocks already there stay, the j-th
        missing block takes the j-th free slot. Decided on the device (kernels/slot_plan: slots, their rows'
        positions and `front_at`), the blocks loaded from context memory in one launch (kernels/gather_blocks
        reads the pinned memory itself): nothing waits for the top-k ids."""
        lo, hi = self.n_init, self.local0
        front = self.front_at[lo:] if self.owner.positions is not None else None
        plan_slots(top, where, self.slot_ids, self.slot_load, self.key_pos[lo:hi], front, self.tally,
                   n_blocks=n_blocks, block=self.block, tail=tail, n_init=self.n_init)
        self.n_held = top.shape[0]  # k distinct blocks (successors take the place of lower-ranked ones)
        self.memory.gather(self.keys[0, :, lo:hi], self.values[0, :, lo:hi], self.slot_load)

    def order_slots(self) -> None:
        """`front_at` for the slots as they are (after a restore): the k-th retrieved block in document order takes
        the k-th block of positions after the init tokens (a needle cut by a block boundary reads on in order)."""
        if self.owner.positions is None:
            return
        _, front = slot_rows(self.slots, self.n_init, self.block)
        self.front_at[self.n_init:].copy_(front, non_blocking=True)

    def nbytes(self) -> int:
        """Device-side state: the bounded rows (K, V, positions, votes) and the index memory."""
        if not self.is_initialized:
            return 0
        index = self.index.nbytes() if self.retrieve else 0
        rotated = self.rotated.nbytes if self.rotated is not None else 0
        summaries = sum(t.nbytes for t in (self.summary_keys, self.summary_values, self.summary_mask)
                        if t is not None)
        return (self.keys.nbytes + self.values.nbytes + self.key_pos.nbytes + self.votes.nbytes + index + rotated
                + summaries)


def layer_specs(model_config, cfg, room: int) -> list[dict]:
    """Per decoder layer, LtriLayer's settings (cfg: the engine's config): full-attention layers stream (init,
    retrieval slots, a window of cfg.n_local); the model's sliding-window layers keep only their window."""
    window = getattr(model_config.get_text_config(decoder=True), "sliding_window", None)
    full = dict(n_init=cfg.n_init, n_local=cfg.n_local, window=None, retrieve=True,
                fp8_memory=cfg.context_memory == "fp8", max_vectors=cfg.vectors_per_block(),
                summaries=cfg.decode_summaries)
    sliding = dict(n_init=0, n_retrieved=0, n_local=window, window=window, retrieve=False)
    return [dict(sliding, block=cfg.block_size, room=room) if t == "sliding_attention" else
            dict(full, n_retrieved=cfg.top_k * cfg.block_size, block=cfg.block_size, room=room)
            for t in layer_types(model_config)]


class LtriCache(StaticKVCache):
    """One LtriLayer per decoder layer (specs from `layer_specs`); `chunk_votes` collects retrieval-head
    layers' block scores within a chunk, `question_chunks` those of each chunk of the question, and
    `first_reading`, while the question is read a second time (LtriConfig.question_votes), the first's."""

    def __init__(self, config, capacity: int, specs: list[dict], indexer):
        super().__init__(config, capacity, [LtriLayer(self, **spec) for spec in specs])
        self.indexer = indexer
        self.chunk_votes: dict[int, tuple[float, torch.Tensor]] = {}  # layer -> (weight, normalised scores)
        self.question_chunks: list[dict] = []
        self.first_reading: list[dict] | None = None
        self.span_queue: list = []  # (layer, layer index, first block id, maps [k, block, block]) to divide
        self.pick_queue: list = []  # (layer, layer index, first block id, keys, votes) evicted, to index
        # ([(layer, layer index, first block id, maps)], candidates in host memory, the copy's event) to divide
        self.dividing: list = []
        self.question = False  # the chunk in flight is the question (see LtriConfig.compensate_question)
        self.memory_blocks: int | None = None  # initial context-memory slab size (None: the whole document's)
        self.lams: dict[int, float] = {}  # per layer, lam calibrated to LtriConfig.compression
        self.lam_samples: dict[int, list[tuple[int, float]]] = {}  # (length, confidence) of recent spans
        self.stats = {"host_to_device_bytes": 0, "device_to_host_bytes": 0, "blocks_retrieved": 0,
                      "retrievals": 0, "spans": 0, "blocks_indexed": 0, "successors": 0, "question_readings": 0}

    def begin_chunk(self, offset: int, n: int) -> None:
        super().begin_chunk(offset, n)
        if self.positions is not None:
            # The window's first row sits at position local0 once the document has passed it: the chunk lands
            # right after the window, and no position reaches `rows`.
            full = next(layer for layer in self.layers if layer.retrieve)
            self.positions.set_shift(max(0, full.local_start - full.local0))
        self.chunk_votes = {}
        if self.question:
            self.question_chunks.append(self.chunk_votes)
        self.indexer.flush(self)

    @torch.inference_mode()
    def settle(self) -> None:
        """Moves the tallies retrieval keeps on the device (successors, blocks loaded) into `stats`: one wait per
        layer, where the counters are read or kept."""
        for layer in self.layers:
            if layer.retrieve and layer.is_initialized:
                successors, loaded = layer.tally.tolist()
                layer.tally.zero_()
                self.stats["successors"] += successors
                self.stats["host_to_device_bytes"] += loaded * layer.memory.block_bytes
