"""The SAS paper's event-based KV cache simulator (section 5.3, Algorithm 1), kept as a test oracle.

It replays a cache plan (`slot_of`, `size` from `assign_slots` / `plan_cache`) against what the pattern asks
for, found by brute force over the n x n plane (small n) rather than from the analyzer's last uses. Events:
CacheStore (a key at its own step), CacheEvict (the step after its last use), CacheActive / CacheInactive
(a stored key starts / stops being visible to the current query). They wait in a priority queue keyed by
step and are processed in one batch per step, evictions before stores, so a new key may take the slot that
was let go in the same step. Checked, failing with a one-line AssertionError on the first violation:
(a) a store goes to a free slot in [0, size); (b) every key the query attends to is in its slot; (c) the mask
over slots (slot holding position p visible iff pattern.visible(q, p)) is exactly the attended keys' slots,
stale keys included; (d) nothing else is kept: no key that no query sees, and size = most keys alive at once.
Static patterns only (for a Dynamic pattern, simulate the static part from `analyzer.split`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from engines.sas.pattern import Pattern

# Kinds in the order they run within one step's batch: a slot is let go before it is taken again.
INACTIVE, EVICT, STORE, ACTIVE = range(4)


@dataclass
class SimulationTrace:
    size: int
    live: torch.Tensor  # [n] int64: keys held after each step's batch
    active: torch.Tensor  # [n] int64: slots the query of each step attends to
    events: int


def simulate(pattern: Pattern, n: int, slot_of: torch.Tensor, size: int) -> SimulationTrace:
    """pattern: static; slot_of: [n] int64 (-1 = not stored); size: cache slots. Raises AssertionError."""
    if pattern.dynamic():
        raise ValueError(f"simulate takes a static pattern (use analyzer.split), got {pattern}")
    if tuple(slot_of.shape) != (n,):
        raise ValueError(f"expected slot_of of shape [{n}], got {list(slot_of.shape)}")
    pos = torch.arange(n)
    seen = pattern.visible(pos[:, None], pos[None, :]).numpy()  # [q, k]
    slots = slot_of.numpy()
    queue = _events(seen, slots)
    count = len(queue)
    heapq.heapify(queue)

    held = np.full(size, -1)  # the position last written to each slot: it stays there, stale, once evicted
    live = np.zeros(size, dtype=bool)
    active = np.zeros(size, dtype=bool)
    live_per_step, active_per_step = [], []
    for step in range(n + 1):
        while queue and queue[0][0] == step:
            _, kind, key = heapq.heappop(queue)
            slot = int(slots[key])
            if kind == STORE:
                _store(step, key, slot, seen, held, live)
            elif kind == EVICT:
                live[slot] = False
            elif 0 <= slot < size and held[slot] == key:
                # Visibility of a key that is not where it should be is left to the step's checks.
                active[slot] = kind == ACTIVE
        if step < n:
            _check_step(step, seen, slots, held, live, active)
            live_per_step.append(int(live.sum()))
            active_per_step.append(int(active.sum()))
    most = max(live_per_step, default=0)
    if most != size:
        raise AssertionError(f"cache size {size} is not minimal: at most {most} keys are alive at once")
    return SimulationTrace(size, torch.tensor(live_per_step, dtype=torch.long),
                           torch.tensor(active_per_step, dtype=torch.long), count)


def _events(seen: np.ndarray, slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(step, kind, key) for every store, eviction and change of visibility, from the brute-force plane."""
    n = seen.shape[0]
    last = np.where(seen, np.arange(n)[:, None], -1).max(axis=0, initial=-1)
    stored = np.flatnonzero(slots >= 0).tolist()
    events = [(k, STORE, k) for k in stored]
    events += [(int(last[k]) + 1, EVICT, k) for k in stored if last[k] >= k]
    before = np.zeros_like(seen)
    before[1:] = seen[:-1]
    for kind, cells in ((ACTIVE, seen & ~before), (INACTIVE, before & ~seen)):
        q, k = np.nonzero(cells)
        events += [(step, kind, key) for step, key in zip(q.tolist(), k.tolist())]
    return events


def _store(step: int, key: int, slot: int, seen, held, live) -> None:
    # Raised rather than asserted, so that `python -O` cannot turn the oracle off.
    where = f"step {step}: key {key} stored to slot {slot}"
    if not 0 <= slot < held.shape[0]:
        raise AssertionError(f"{where}, outside [0, {held.shape[0]})")
    if live[slot]:
        raise AssertionError(f"{where}, which holds live key {held[slot]}")
    if not seen[:, key].any():
        raise AssertionError(f"{where} but no query attends to it")
    held[slot], live[slot] = key, True


def _check_step(q: int, seen, slots, held, live, active) -> None:
    size = held.shape[0]
    keys = np.flatnonzero(seen[q])
    where = slots[keys]
    inside = (where >= 0) & (where < size)
    at = np.where(inside, where, 0)
    missing = np.flatnonzero(~inside | ~live[at] | (held[at] != keys))
    if missing.size:
        key, slot = int(keys[missing[0]]), int(where[missing[0]])
        found = f"slot {slot} holds {held[slot]}" if 0 <= slot < size else f"slot {slot} is not in the cache"
        raise AssertionError(f"step {q}: attended key {key} is missing ({found})")
    expected = np.zeros(size, dtype=bool)
    expected[where] = True
    # What the engine's mask function reads: every slot by the position it holds, live or stale.
    mask = (held >= 0) & seen[q, np.maximum(held, 0)]
    for name, got in (("the mask", mask), ("the active events", active)):
        wrong = np.flatnonzero(got != expected)
        if wrong.size:
            slot = int(wrong[0])
            verb = "selects" if got[slot] else "misses"
            raise AssertionError(f"step {q}: {name} {verb} slot {slot} (key {held[slot]}, "
                                 f"{'live' if live[slot] else 'stale'}), attended: {bool(expected[slot])}")
