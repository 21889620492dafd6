"""A rank's part of a star document: its KV cache, its tally for the report, and the document state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.base import DocumentState
from engines.cache import StaticKVCache, StaticKVLayer
from engines.star.layout import StarLayout
from engines.star.ranks import AnchorSync


class StarLayer(StaticKVLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        # Phase 2 on a context rank: the new tokens' K/V are not kept (only the query rank keeps them).
        if self.owner.phase == 2 and not self.owner.keeps_queries:
            return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)


class StarCache(StaticKVCache):
    """A rank's KV: [anchor (ranks > 0) | its blocks | (query rank) question + answer]; slot = position - shift.

    Phase 1 (`phase = 1`) writes chunks at host slots as the dense cache does. Phase 2 takes absolute positions
    (device tensors in decode) and derives slots on the device; `sync` (set for one forward) moves the anchor's
    K/V layer by layer from the rank that encodes it to the others.
    """

    layer_class = StarLayer

    def __init__(self, config, capacity: int, *, kv_start: int, n_context: int, shift: int, world: int,
                 keeps_queries: bool):
        super().__init__(config, capacity)
        self.kv_start, self.n_context, self.shift = kv_start, n_context, shift
        self.world, self.keeps_queries = world, keeps_queries
        self.phase = 1
        self.sync: AnchorSync | None = None
        self._context_end: dict[torch.device, torch.Tensor] = {}

    def begin_chunk(self, offset: int, n: int) -> None:
        if self.phase == 2 and not self.keeps_queries:
            # The new tokens are not stored here; offset is their (virtual) slot, past the context.
            self.decoding, self.offset = False, offset
            return
        super().begin_chunk(offset, n)

    def begin_decode(self, position: torch.Tensor, length: torch.Tensor) -> None:
        """position, length: absolute ([1] int64 on the device); stored as slots."""
        super().begin_decode(position - self.shift, length - self.shift)

    def context_end_on(self, device: torch.device) -> torch.Tensor:
        """[1] int64: the number of context slots past kv_start (a context rank's shard length)."""
        if device not in self._context_end:
            self._context_end[device] = torch.full((1,), self.n_context, dtype=torch.long, device=device)
        return self._context_end[device]


@dataclass
class RankTally:
    """What one rank did for a document, for the report (gathered over ranks into star_per_rank)."""

    blocks: int
    context_tokens: int
    phase1_s: float
    anchor_broadcast_bytes: int
    phase2_s: float = 0.0
    phase2_bytes_received: int = 0


@dataclass
class StarState(DocumentState):
    """A document's state on one rank: its shard of the cache, the block layout, the question's length (phase 2
    forwards before decoding) and this rank's tally."""

    layout: StarLayout | None = None
    phase2_tokens: int = 0
    tally: RankTally | None = None
