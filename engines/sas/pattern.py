"""The SAS pattern language: primitives over the (query, key) plane and the operators that compose them.

A pattern says which keys a query may attend to, by absolute token position; causality (key <= query) is
always applied on top (`visible`). Primitives, as in the SAS paper (section 4):

    Rect(queries=a:b, keys=c:d, stride=s, offset=o)   a rectangle anywhere; with a stride, only the rows and
                                                       columns at (index - start) % s == o (dilation)
    Diag(window=w, offset=o, stride=s)                 o <= q - k < o + w (no window: unbounded), and
                                                       (q - k - o) % s == 0: causal, sliding window, offset
                                                       and strided diagonals
    Dynamic(budget=B, refresh=false, score=attn.sum)   keys chosen at run time by an importance score (H2O)

Operators, tightest first: `unit >> p` spread (`p` evaluated on tiles whose size is the unit rectangle's
extent, the unit's own cells inside each tile: block-sparse variants), `~a` (or `!a`) not, `a * b` and,
`a + b` or. Parentheses group.

Every node also answers three questions the analyzer needs to find each key's last use without evaluating
the whole N x N plane: for a fixed key k, the column {q : p(q, k)} is periodic in q with period `period()`
from row `settled(k)` on, except where it crosses one of `rows()` (the finite row bounds of rectangles).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

INF = None  # an open end of a span


@dataclass(frozen=True)
class Span:
    """Positions start <= i < stop (stop None: unbounded)."""

    start: int = 0
    stop: int | None = None

    def contains(self, i: torch.Tensor) -> torch.Tensor:
        inside = i >= self.start
        return inside if self.stop is None else inside & (i < self.stop)

    def __str__(self) -> str:
        return f"{self.start or ''}:{'' if self.stop is None else self.stop}"


class Pattern:
    """A boolean function of (query position, key position); subclasses implement `mask`."""

    def mask(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q, k: int64 position tensors (broadcastable) -> bool, without the causal cut."""
        raise NotImplementedError

    def visible(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """What the engine applies: the pattern and causality (k <= q); dynamic parts count as visible."""
        return self.mask(q, k) & (k <= q) & (k >= 0)

    # Leaves (Rect, Diag, Dynamic) and Spread say these themselves; a boolean combination of columns repeats
    # once every child's does, with every child's period, and changes where any child's rows do.
    def settled(self, k: torch.Tensor) -> torch.Tensor:
        """k: key positions -> the row from which each key's column repeats with `period()`."""
        return functools.reduce(torch.maximum, (c.settled(k) for c in self.children()))

    def period(self) -> int:
        return math.lcm(*(c.period() for c in self.children()))

    def rows(self) -> frozenset[int]:
        return frozenset().union(*(c.rows() for c in self.children()))

    def dynamic(self) -> list["Dynamic"]:
        """The Dynamic nodes inside this pattern."""
        return [d for child in self.children() for d in child.dynamic()]

    def children(self) -> tuple["Pattern", ...]:
        return ()

    def __add__(self, other: "Pattern") -> "Pattern":
        return Or(self, other)

    def __mul__(self, other: "Pattern") -> "Pattern":
        return And(self, other)

    def __invert__(self) -> "Pattern":
        return Not(self)

    def __rshift__(self, other: "Pattern") -> "Pattern":
        if not isinstance(self, Rect):
            raise ValueError(f"the left side of >> must be a Rect (the tile), got {self}")
        return Spread(self, other)


def _strided(i: torch.Tensor, start: int, stride: int, offset: int) -> torch.Tensor:
    return (i - start) % stride == offset


@dataclass(frozen=True)
class Rect(Pattern):
    queries: Span = field(default_factory=Span)
    keys: Span = field(default_factory=Span)
    stride: int = 1
    offset: int = 0

    def __post_init__(self):
        for name, span in (("queries", self.queries), ("keys", self.keys)):
            if span.start < 0 or (span.stop is not None and span.stop <= span.start):
                raise ValueError(f"Rect {name} must be a non-empty range start:stop with 0 <= start < stop, "
                                 f"got {span}")
        if self.stride < 1:
            raise ValueError(f"Rect stride must be >= 1, got {self.stride}")
        if not 0 <= self.offset < self.stride:
            raise ValueError(f"Rect offset must be in [0, stride), got {self.offset} with stride {self.stride}")

    def mask(self, q, k):
        inside = self.queries.contains(q) & self.keys.contains(k)
        if self.stride > 1:
            inside = inside & _strided(q, self.queries.start, self.stride, self.offset) \
                & _strided(k, self.keys.start, self.stride, self.offset)
        return inside

    def settled(self, k):
        return k

    def period(self) -> int:
        return self.stride

    def rows(self) -> frozenset[int]:
        return frozenset(r for r in (self.queries.start, self.queries.stop) if r)

    def __str__(self) -> str:
        args = [f"{name}={span}" for name, span in (("queries", self.queries), ("keys", self.keys))
                if span != Span()]
        if self.stride > 1:
            args += [f"stride={self.stride}"] + ([f"offset={self.offset}"] if self.offset else [])
        return f"Rect({', '.join(args)})"


@dataclass(frozen=True)
class Diag(Pattern):
    window: int | None = None
    offset: int = 0
    stride: int = 1

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"Diag window must be >= 1 (or absent for unbounded), got {self.window}")
        if self.offset < 0:
            raise ValueError(f"Diag offset must be >= 0 (keys above the diagonal are never visible), "
                             f"got {self.offset}")
        if self.stride < 1:
            raise ValueError(f"Diag stride must be >= 1, got {self.stride}")

    def mask(self, q, k):
        d = q - k
        inside = d >= self.offset
        if self.window is not None:
            inside = inside & (d < self.offset + self.window)
        if self.stride > 1:
            inside = inside & ((d - self.offset) % self.stride == 0)
        return inside

    def settled(self, k):
        return k + self.offset + (self.window or 0)

    def period(self) -> int:
        return 1 if self.window is not None else self.stride

    def __str__(self) -> str:
        args = [f"window={self.window}"] if self.window is not None else []
        args += [f"offset={self.offset}"] if self.offset else []
        args += [f"stride={self.stride}"] if self.stride > 1 else []
        return f"Diag({', '.join(args)})"


REDUCTIONS = ("sum", "mean", "max")


@dataclass(frozen=True)
class Dynamic(Pattern):
    """H2O: within the area it is AND-ed with (by default everything the static part leaves out), keep the
    `budget` keys with the highest accumulated importance. score: `attn` (softmax probabilities), then a
    reduction over the query heads that share a KV head (`sum`, `mean`, `max`), then optionally
    `pool(w)`, a max over w neighbouring keys (odd w). refresh=false: evicted keys are gone (cache = budget);
    refresh=true: every key is kept and the top `budget` are read each step (less compute, no memory saved)."""

    budget: int = 512
    refresh: bool = False
    reduce: str = "sum"
    pool: int = 1

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"Dynamic budget must be >= 1, got {self.budget}")
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Dynamic score reduction must be one of {', '.join(REDUCTIONS)}, got {self.reduce!r}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"Dynamic pool width must be an odd integer >= 1, got {self.pool}")

    def mask(self, q, k):
        # As a static mask: every key it could pick (the run time picks `budget` of them).
        return torch.ones_like(q - k, dtype=torch.bool)

    def settled(self, k):
        return k

    def period(self) -> int:
        return 1

    def dynamic(self) -> list["Dynamic"]:
        return [self]

    @property
    def score(self) -> str:
        return "attn." + self.reduce + (f".pool({self.pool})" if self.pool > 1 else "")

    def __str__(self) -> str:
        return f"Dynamic(budget={self.budget}, refresh={str(self.refresh).lower()}, score={self.score})"


@dataclass(frozen=True)
class _Binary(Pattern):
    left: Pattern
    right: Pattern

    def children(self):
        return (self.left, self.right)


@dataclass(frozen=True)
class Or(_Binary):
    def mask(self, q, k):
        return self.left.mask(q, k) | self.right.mask(q, k)

    def __str__(self) -> str:
        return f"{self.left} + {_operand(self.right, Or)}"


@dataclass(frozen=True)
class And(_Binary):
    def mask(self, q, k):
        return self.left.mask(q, k) & self.right.mask(q, k)

    def __str__(self) -> str:
        return f"{_operand(self.left, Or)} * {_operand(self.right, (Or, And))}"


@dataclass(frozen=True)
class Not(Pattern):
    inner: Pattern

    def mask(self, q, k):
        return ~self.inner.mask(q, k)

    def children(self):
        return (self.inner,)

    def __str__(self) -> str:
        return f"~{_operand(self.inner, (Or, And))}"


@dataclass(frozen=True)
class Spread(Pattern):
    """unit >> inner: inner decides which (query tile, key tile) pairs are on; unit, which cells of a tile."""

    unit: Rect
    inner: Pattern

    def __post_init__(self):
        if self.unit.queries.stop is None or self.unit.keys.stop is None:
            raise ValueError(f"the tile of >> needs finite queries and keys ranges (its size), got {self.unit}")
        if self.inner.dynamic():
            raise ValueError("Dynamic cannot be spread over tiles")

    @property
    def tile(self) -> tuple[int, int]:
        return self.unit.queries.stop, self.unit.keys.stop

    def mask(self, q, k):
        bq, bk = self.tile
        return self.inner.mask(q // bq, k // bk) & self.unit.mask(q % bq, k % bk)

    def children(self):
        return (self.unit, self.inner)

    def settled(self, k):
        # The inner column of key tile k // bk repeats from its own settled tile row on.
        return self.inner.settled(k // self.tile[1]) * self.tile[0]

    def period(self) -> int:
        return self.inner.period() * self.tile[0]

    def rows(self) -> frozenset[int]:
        return frozenset(r * self.tile[0] for r in self.inner.rows())

    def __str__(self) -> str:
        return f"{self.unit} >> {_operand(self.inner, (Or, And, Not))}"


def _operand(p: Pattern, looser) -> str:
    """p as an operand of a tighter operator: parenthesised when its own operator binds looser."""
    return f"({p})" if isinstance(p, looser) else str(p)
