"""The SAS analyzer (paper section 5): token lifetimes -> minimal KV cache, cache index and mask functions.

For a sequence of N tokens (document + question + answer: the engine knows N before it starts), key k is
needed from its own step (its K/V exist only then) to its last use, the last query that can attend to it.
The cache holds exactly the keys alive at each step, so its size is the most keys alive at once; a key that
no query will ever attend to is not stored at all. Slots are handed out greedily at arrival from those freed
by expired keys (interval colouring: optimal, and a window becomes a ring buffer), giving the cache index
function `slot_of[k]` as a table. The attention mask over the compacted cache needs no table: a slot holding
key position p is visible from query q iff the pattern says so for (q, p); an expired key fails that test.

Last uses come from the pattern's geometry, not from the N x N plane: past `settled(k)` a key's column
repeats with `period()` between the rows where rectangles start or stop, so only the band before
`settled(k)` and the last period of each later segment are evaluated.

Dynamic (H2O) parts: `split` separates `static + area * Dynamic(...)`; the static part sizes the cache, the
dynamic pool adds `budget` slots (refresh=false) or keeps every key the area can reach (refresh=true).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch

from engines.sas.pattern import And, Diag, Dynamic, Not, Or, Pattern
from engines.sas.parse import parse_pattern

NOTHING = Not(Diag())  # no causal cell at all
_KEYS_PER_PASS = 4096
_BRUTE_FORCE_CELLS = 1 << 31


@dataclass(frozen=True)
class Split:
    """pattern = static + area * dynamic (dynamic None for a static pattern)."""

    static: Pattern
    dynamic: Dynamic | None = None
    area: Pattern = NOTHING


def split(pattern: Pattern) -> Split:
    """Separate the static part from at most one `area * Dynamic(...)` term OR-ed at the top level."""
    terms = _or_terms(pattern)
    dynamic_terms = [t for t in terms if t.dynamic()]
    if not dynamic_terms:
        return Split(pattern)
    if len(dynamic_terms) > 1 or len(pattern.dynamic()) > 1:
        raise ValueError("bad pattern: at most one Dynamic(...) is supported")
    term = dynamic_terms[0]
    static_terms = [t for t in terms if t is not term]
    static = functools.reduce(Or, static_terms) if static_terms else NOTHING
    if isinstance(term, Dynamic):
        return Split(static, term, Not(static))
    factors = [term.left, term.right] if isinstance(term, And) else []
    dyn = [f for f in factors if isinstance(f, Dynamic)]
    if len(dyn) != 1 or any(f.dynamic() for f in factors if f is not dyn[0]):
        raise ValueError(f"bad pattern: Dynamic must stand alone or be AND-ed with a static area "
                         f"(area * Dynamic(...)) in a top-level '+' term, got {term}")
    area = factors[0] if factors[1] is dyn[0] else factors[1]
    return Split(static, dyn[0], area)


def _or_terms(p: Pattern) -> list[Pattern]:
    return _or_terms(p.left) + _or_terms(p.right) if isinstance(p, Or) else [p]


def last_use(pattern: Pattern, n: int) -> torch.Tensor:
    """[n] int64: the last query (< n) that sees each key, -1 for a key no query sees. Static patterns."""
    out = torch.full((n,), -1, dtype=torch.long)
    period = pattern.period()
    if period * (len(pattern.rows()) + 1) > n:
        return _last_use_brute(pattern, n)
    rows = sorted(r for r in pattern.rows() if 0 < r < n)
    for lo in range(0, n, _KEYS_PER_PASS):
        k = torch.arange(lo, min(n, lo + _KEYS_PER_PASS))
        out[lo:lo + k.numel()] = _last_use_keys(pattern, k, n, rows, period)
    return out


def _last_use_keys(pattern: Pattern, k: torch.Tensor, n: int, rows: list[int], period: int) -> torch.Tensor:
    settled = pattern.settled(k).clamp(max=n).maximum(k)
    best = torch.full_like(k, -1)
    # The periodic part: segments between critical rows, each decided by its last period.
    bounds = [settled] + [torch.full_like(k, r).maximum(settled) for r in rows] + [torch.full_like(k, n)]
    steps = torch.arange(period)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        q = (stop - period)[:, None] + steps  # [K, period]
        seen = _seen(pattern, q, k, (q >= start[:, None]) & (q < stop[:, None]))
        best = torch.maximum(best, torch.where(seen, q, -1).amax(dim=1))
    # The band before settled(k), evaluated whole.
    width = int((settled - k).max()) if k.numel() else 0
    if width:
        q = k[:, None] + torch.arange(width)
        seen = _seen(pattern, q, k, q < settled[:, None])
        best = torch.maximum(best, torch.where(seen, q, -1).amax(dim=1))
    return best


def _seen(pattern: Pattern, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return valid & pattern.visible(q, k[:, None])


def _last_use_brute(pattern: Pattern, n: int) -> torch.Tensor:
    """Irregular patterns (period too long to exploit): every query row."""
    if n * n > _BRUTE_FORCE_CELLS:
        raise ValueError(f"pattern {pattern} is too irregular to analyse at {n} tokens (period "
                         f"{pattern.period()}); use shorter periods")
    out = torch.full((n,), -1, dtype=torch.long)
    q = torch.arange(n)[:, None]
    for lo in range(0, n, _KEYS_PER_PASS // 4):
        k = torch.arange(lo, min(n, lo + _KEYS_PER_PASS // 4))
        seen = pattern.visible(q, k[None, :])
        out[lo:lo + k.numel()] = torch.where(seen, q, -1).amax(dim=0)
    return out


def assign_slots(last: torch.Tensor) -> tuple[torch.Tensor, int]:
    """last: [n] last uses -> (slot_of [n] int64, -1 = never stored; cache size = most keys alive at once).

    At step t the keys whose last use was before t leave first, then key t takes the lowest free slot."""
    slot_of = torch.full_like(last, -1)
    free: list[int] = []
    expiring: list[tuple[int, int]] = []  # (first step it is no longer needed, slot)
    size = 0
    for k, end in enumerate(last.tolist()):
        while expiring and expiring[0][0] <= k:
            heapq.heappush(free, heapq.heappop(expiring)[1])
        if end < k:
            continue
        slot = heapq.heappop(free) if free else size
        size = max(size, slot + 1)
        slot_of[k] = slot
        heapq.heappush(expiring, (end + 1, slot))
    return slot_of, size


@dataclass
class CachePlan:
    """A pattern's KV cache for a sequence of n tokens (per layer; the same for every head)."""

    pattern: Pattern
    n: int
    static_slots: int  # the compacted cache of the static part
    dynamic_slots: int  # the H2O pool (refresh=false) or the keys kept for it (refresh=true)
    slot_of: torch.Tensor  # [n] int64, static part; -1 = not stored there
    last: torch.Tensor  # [n] int64, last query of the static part that sees each key; -1 = none
    enters_pool: torch.Tensor  # [n] int64: step at which a key becomes an H2O candidate (-1: never)
    dynamic: Dynamic | None
    area: Pattern
    static: Pattern

    @property
    def slots(self) -> int:
        return self.static_slots + self.dynamic_slots

    def describe(self) -> str:
        text = f"{self.slots} of {self.n} tokens"
        if self.dynamic is not None:
            text += f" ({self.static_slots} static + {self.dynamic_slots} H2O)"
        return text


def plan_cache(pattern: Pattern | str, n: int) -> CachePlan:
    """Analyse `pattern` for n tokens (or take the plan `adopt_plan` was given)."""
    pattern = parse_pattern(pattern) if isinstance(pattern, str) else pattern
    return _ADOPTED.get((pattern, n)) or _plan_cache(pattern, n)


_ADOPTED: dict[tuple[Pattern, int], CachePlan] = {}


def adopt_plan(pattern: Pattern, n: int, static_slots: int, dynamic_slots: int, slot_of: torch.Tensor,
               last: torch.Tensor, enters_pool: torch.Tensor) -> CachePlan:
    """A plan made before (e.g. stored with a saved state), used instead of analysing again (seconds at 128K
    tokens). The most recent few are kept."""
    parts = split(pattern)
    plan = CachePlan(pattern, n, static_slots, dynamic_slots, slot_of, last, enters_pool, parts.dynamic, parts.area,
                     parts.static)
    if slot_of.shape != (n,) or last.shape != (n,) or enters_pool.shape != (n,):
        raise ValueError(f"a plan for {n} tokens needs tables of {n} entries, got {tuple(slot_of.shape)}")
    _ADOPTED[(pattern, n)] = plan
    while len(_ADOPTED) > 8:
        _ADOPTED.pop(next(iter(_ADOPTED)))
    return plan


@functools.lru_cache(maxsize=16)
def _plan_cache(pattern: Pattern, n: int) -> CachePlan:
    parts = split(pattern)
    last = last_use(parts.static, n)
    slot_of, size = assign_slots(last)
    enters = torch.full((n,), -1, dtype=torch.long)
    extra = 0
    if parts.dynamic is not None:
        # A key becomes a candidate when the static part lets go of it (right after its own step if no
        # static query sees it), as long as the area can still reach it then or later.
        area_last = last_use(parts.area, n)
        candidate = torch.where(last >= 0, last + 1, torch.arange(1, n + 1))
        enters = torch.where(area_last >= candidate, candidate, -1)
        reachable = int((enters >= 0).sum())
        extra = min(parts.dynamic.budget, reachable) if not parts.dynamic.refresh else reachable
    return CachePlan(pattern, n, size, extra, slot_of, last, enters, parts.dynamic, parts.area, parts.static)


def max_alive(pattern: Pattern, n: int) -> int:
    """Brute force over the n x n plane (tests, small n): the most keys alive at once."""
    q = torch.arange(n)
    seen = pattern.visible(q[:, None], q[None, :])  # [q, k]
    used = seen.any(dim=0)
    last = torch.where(seen, q[:, None], -1).amax(dim=0)
    alive = (q[None, :] <= q[:, None]) & (last[None, :] >= q[:, None]) & used[None, :]
    return int(alive.sum(dim=1).max()) if n else 0


def describe_index(slot_of: torch.Tensor) -> str:
    """The cache index function as a formula where it has a closed form (the paper's Figure 12), else a
    table: e.g. StreamingLLM "k < 32: k; k >= 32: 32 + (k - 32) % 1024", strided block-local
    "k % 4 == 0: (k // 4) % 64; else not stored"."""
    n = slot_of.numel()
    k = torch.arange(n)
    stored = slot_of >= 0
    if n and not stored.all():
        ok = stored.nonzero()[:, 0]
        step = int(torch.diff(ok).min()) if ok.numel() > 1 else 1
        first = int(ok[0]) if ok.numel() else 0
        if ok.numel() and bool((stored == ((k - first) % step == 0) & (k >= first)).all()):
            inner = _ring_pieces(slot_of[ok], f"(k // {step})" if first % step == 0 else f"((k - {first}) // {step})")
            if inner is not None:
                return f"k % {step} == {first % step}: {inner}; else not stored"
        return f"a table of {n} slots ({int(stored.sum())} keys stored)"
    return _ring_pieces(slot_of, "k") or f"a table of {n} slots"


def _ring_pieces(t: torch.Tensor, var: str) -> str | None:
    """t[i] = i below `base`, then base + (i - base) % m (a ring after fixed slots); None if not that shape."""
    i = torch.arange(t.numel())
    prefix = int((t == i).int().cumprod(0).sum())  # length of the identity prefix
    if prefix == t.numel():
        return var
    base = int(t[prefix:].min())
    m = int(t[prefix:].max()) - base + 1
    if prefix < base or not bool((t[base:] == base + (i[base:] - base) % m).all()):
        return None
    return f"{var} % {m}" if base == 0 else f"{var} < {base}: {var}; {var} >= {base}: {base} + ({var} - {base}) % {m}"
