"""The compacted KV cache of `sas-pattern`: per layer only the slots its pattern's analysis asks for.

Layout of a layer's buffers [B, Hkv, rows, D]:

    [0, static)                   the static part's slots; key k lives at plan.slot_of[k] from step k to its
                                  last use (ring buffers for windows, fixed slots for sinks, ...)
    [static, static + pool)       the H2O pool (Dynamic patterns only): per KV head, the keys kept by score
    [staging, staging + chunk)    a prefill chunk's own K/V; in decode, row `staging` holds a key no static
                                  query sees (it can still enter the pool)
    [rows - 1]                    trash: where padded (absent) pool candidates are written, never attended

`key_pos` [B, Hkv, rows] says which token position each row holds (-1: none), so the attention mask over the
compacted cache is the pattern itself evaluated at (query position, key_pos). A prefill chunk is attended
from the staging rows and then committed: its keys still needed later move to their slots. Scores (H2O) are
kept per row: attention probability accumulated over the queries that saw the key, reduced over the query
heads of the KV head.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engines.cache import OwnedRowsLayer, StaticKVCache, layer_types
from engines.sas.analyzer import CachePlan


class SasLayer(OwnedRowsLayer):

    def __init__(self, owner: "SasCache", plan: CachePlan, staging: int, sliding: bool):
        super().__init__()
        self.owner, self.plan, self.is_sliding = owner, plan, sliding
        self.static, self.pool = plan.static_slots, plan.dynamic_slots
        self.staging = self.static + self.pool
        self.rows = self.staging + staging + 1
        self.trash = self.rows - 1
        self.dynamic = plan.dynamic

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        # Zeros, not empty: rows masked out still enter p @ v in some kernels, and 0 * NaN = NaN.
        self.keys = torch.zeros(batch, heads, self.rows, dim, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(batch, heads, self.rows, value_states.shape[-1], dtype=self.dtype,
                                  device=self.device)
        self.key_pos = torch.full((batch, heads, self.rows), -1, dtype=torch.long, device=self.device)
        self.in_pool = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        self.in_pool[self.static:self.staging] = True
        # Rows one decode step reads: the slots plus the staging row (a device tensor for the kernel).
        self.decode_rows = torch.full((batch,), self.staging + 1, dtype=torch.long, device=self.device)
        self.slot_of = self.plan.slot_of.to(self.device)
        self.last = self.plan.last.to(self.device)
        if self.dynamic is not None:
            self.score = torch.zeros(batch, heads, self.rows, dtype=torch.float32, device=self.device)
            self.score[:, :, self.static:self.staging] = float("-inf")  # empty pool slots lose to any key
            self._candidates()
        self.is_initialized = True

    def _candidates(self) -> None:
        """Keys entering the pool at each step, as CSR (enter_start [n + 2], enter_keys) plus a fixed width."""
        enters = self.plan.enters_pool
        order = torch.argsort(torch.where(enters >= 0, enters, enters.numel() + 2), stable=True)
        counts = torch.bincount(enters[enters >= 0], minlength=enters.numel() + 2)
        self.enter_start = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(self.device)
        self.enter_keys = order[: int(counts.sum())].to(self.device)
        self.enter_width = max(1, int(counts.max()))
        if self.dynamic.refresh:
            # refresh=true keeps every candidate: pool row = rank of the key among the candidates.
            rank = torch.full_like(enters, -1)
            rank[self.plan.enters_pool >= 0] = torch.arange(int((enters >= 0).sum()))
            self.pool_rank = rank.to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states: [B, Hkv, T, D] -> the whole buffers; prefill writes the staging rows, decode the slot."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        key_states = owner.kept_keys(key_states, self.is_sliding)  # `attended` rotates them back
        if owner.decoding:
            pos = owner.position_on(self.device)  # [1]
            slot = self.slot_of[pos]
            row = torch.where(slot >= 0, slot, self.staging)
            self.keys.index_copy_(2, row, key_states)
            self.values.index_copy_(2, row, value_states)
            self.key_pos.index_copy_(2, row, pos.view(1, 1, 1).expand(*self.key_pos.shape[:2], 1))
            if self.dynamic is not None:
                self.score.index_fill_(2, row, 0.0)
        else:
            t = key_states.shape[2]
            if t > self.trash - self.staging:
                raise ValueError(f"a chunk of {t} tokens does not fit the {self.trash - self.staging} staging rows")
            rows = slice(self.staging, self.staging + t)
            self.keys[:, :, rows] = key_states
            self.values[:, :, rows] = value_states
            self.key_pos[:, :, self.staging:] = -1
            self.key_pos[:, :, rows] = torch.arange(owner.offset, owner.offset + t, device=self.device)
            if self.dynamic is not None:
                self.score[:, :, self.staging:] = 0.0
        return self.keys, self.values

    def assigned(self) -> torch.Tensor:
        """[B, Hkv, rows] the positions the rows are attended at when positions are re-assigned: a key within the
        cache's reach of the chunk keeps its true distance (document position - shift), the document's first
        `lead` tokens (sinks the pattern keeps for good) keep their positions, and any other older key (H2O
        pool, strided columns) sits at `lead`, in front of the recent ones."""
        lead = self.owner.lead
        recent = self.key_pos - self.owner.positions.shift_on(self.device)
        return torch.where(recent >= lead, recent, torch.where(self.key_pos < lead, self.key_pos, lead))

    def attended(self, keys: torch.Tensor) -> torch.Tensor:
        """The rows' keys as attention reads them: rotated at `assigned` where positions are re-assigned."""
        if self.owner.positions is None:
            return keys
        return self.owner.positions.rotate(keys, self.assigned(), self.is_sliding)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Everything a row holds: K, V, its key position and (H2O) its score."""
        return (self.keys, self.values, self.key_pos) + ((self.score,) if self.dynamic is not None else ())

    def rows_ahead(self, position: int) -> torch.Tensor:
        """[R] the rows that tokens from `position` on may overwrite: the slots they take, the H2O pool and the
        staging row (decode writes a key no static query sees there)."""
        ahead = self.slot_of[position:]
        taken = ahead[ahead >= 0].unique()
        return torch.cat([taken, torch.arange(self.static, self.staging + 1, device=self.device)])

    def commit_chunk(self, offset: int, t: int) -> None:
        """After a chunk's attention: its keys still needed by later queries move to their static slots."""
        pos = torch.arange(offset, offset + t, device=self.device)
        keep = (self.slot_of[pos] >= 0) & (self.last[pos] >= offset + t)
        src = self.staging + (pos[keep] - offset)
        dst = self.slot_of[pos[keep]]
        for buf in self.buffers():
            buf.index_copy_(2, dst, buf.index_select(2, src))
        self.key_pos[:, :, self.staging:] = -1

    def rows_of(self, keys: torch.Tensor, offset: int | None) -> torch.Tensor:
        """Where candidate keys [W] sit now: staging rows for this chunk's keys (offset None: decode)."""
        safe = keys.clamp(min=0)
        slot = self.slot_of[safe]
        if offset is None:
            return torch.where(slot >= 0, slot, self.staging)
        return torch.where(safe >= offset, self.staging + safe - offset, slot)

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        extra = self.key_pos.nbytes + (self.score.nbytes if self.dynamic is not None else 0)
        return self.keys.nbytes + self.values.nbytes + extra


class SasCache(StaticKVCache):
    """One SasLayer per decoder layer; `capacity` is the sequence length the plans were made for."""

    def __init__(self, config, plans: list[CachePlan], capacity: int, staging: int):
        sliding = [t == "sliding_attention" for t in layer_types(config)]
        layers = [SasLayer(self, plan, staging, s) for plan, s in zip(plans, sliding)]
        super().__init__(config, capacity, layers)
        self.block_masks: dict = {}  # FlexAttention block masks of the chunk in flight (engines/sas/flex.py)
        self.kernel_dir: Path | None = None  # where generated decode-mask kernels go (engines/sas/codegen.py)
        self.analysis_s = 0.0  # the analyzer's time for this cache's plans
        # Re-assigned positions (engines/positions.py): a chunk's queries sit at most `reach` (the rows before
        # staging) past the shift; the first `lead` tokens are kept by every full layer's plan to the end.
        self.reach = max(layer.staging for layer in layers)
        self.lead = min(_lead(layer.plan, capacity) for layer, s in zip(layers, sliding) if not s) \
            if not all(sliding) else 0

    def begin_chunk(self, offset: int, n: int) -> None:
        super().begin_chunk(offset, n)
        if self.positions is not None:
            self.positions.set_shift(max(0, offset - self.reach))


def _lead(plan: CachePlan, n: int) -> int:
    """How many of the document's first tokens the plan keeps until the end of a sequence of n tokens."""
    kept = plan.last >= n - 1
    return int(kept.int().cumprod(0).sum())
