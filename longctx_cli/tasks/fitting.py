"""Token-exact documents: grow a task's document until it holds exactly the number of tokens asked for.

A task builder describes its document as a function of one integer `size` (haystack words, list entries,
...) and hands it over as a `Draft`; `fit` finds the largest size that stays within the target, then adds
characters of the draft's `tail` (the text that would come next) until the count is reached. Counting means
tokenizing the whole document, so the searches interpolate rather than bisect: a 32K-token document takes
about ten counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from longctx_cli.errors import ConfigError


@dataclass
class Draft:
    """A task's document as a function of `size`, and the prompt parts that go with it.

    render(size) must grow (in tokens) with size, up to a few tokens of tokenizer noise; render(0) is the
    document with no haystack at all. tail(size) is text that may follow render(size) to fill the last
    tokens; it must hold more tokens than one step of size adds.
    """

    render: Callable[[int], str]
    tail: Callable[[int], str]
    max_size: int
    question: str
    answer_prefix: str
    expected: list[str]
    needles: list[str] = field(default_factory=list)  # each must occur exactly once in the document
    depths: list[float] = field(default_factory=list)
    check: Callable[[str], None] | None = None  # raises if the final document does not pose the task


def token_counter(tokenizer) -> Callable[[str], int]:
    """Number of tokens of a text, without special tokens: what the prompt layout feeds for the document.

    `tokenizer` is an HF tokenizer or anything whose __call__(text, add_special_tokens=False) returns a
    mapping with "input_ids".
    """
    # HF warns once when a text is longer than model_max_length; here that is the point, not a mistake.
    extra = {"verbose": False} if hasattr(tokenizer, "model_max_length") else {}

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False, **extra)["input_ids"])

    return count


def fit(draft: Draft, target: int, count: Callable[[str], int]) -> tuple[str, int]:
    """The draft's document with `target` tokens; returns (document, its token count).

    Never more than the target; less only if no prefix of the tail lands on it (a character that adds two
    tokens at once), which none of the tests' tokenizers has shown.
    """
    at = _memo(lambda size: count(draft.render(size)))
    if at(0) > target:
        raise ConfigError(f"its smallest document takes {at(0)} tokens, more than the {target} left for it")
    size = largest_within(at, target, draft.max_size)
    text, n = draft.render(size), at(size)
    if size == draft.max_size and n < target:
        raise RuntimeError(f"haystack exhausted at {n} of {target} tokens")
    if n < target:
        tail = draft.tail(size)
        with_tail = _memo(lambda k: count(text + tail[:k]))
        k = largest_within(with_tail, target, len(tail))
        text, n = text + tail[:k], with_tail(k)
    return text, n


def _memo(f: Callable[[int], int]) -> Callable[[int], int]:
    cache: dict[int, int] = {}

    def g(x: int) -> int:
        if x not in cache:
            cache[x] = f(x)
        return cache[x]

    return g


def largest_within(f: Callable[[int], int], target: int, limit: int) -> int:
    """The largest s in [0, limit] with f(s) <= target, for a non-decreasing f with f(0) <= target.

    Secant steps from the bracket end nearer the target (f is close to linear: tokens per word, per list
    entry), falling back to bisection when two steps in a row fail to halve the bracket.
    """
    lo, f_lo = 0, f(0)
    f0, hi, f_hi = f_lo, None, None
    step = 16
    # Grow until the target is bracketed, extrapolating from the tokens per unit seen so far.
    while hi is None:
        s = min(limit, lo + step)
        fs = f(s)
        if fs > target:
            hi, f_hi = s, fs
        else:
            if s == limit:
                return s
            rate = (fs - f0) / s if fs > f0 else None
            lo, f_lo = s, fs
            # Aim just past the target so the next probe usually brackets it.
            step = max(1, int((target - f_lo) / rate * 1.05) + 2) if rate else step * 2
    slow = 0
    while hi - lo > 1:
        if slow >= 2:
            s = (lo + hi) // 2
        else:
            slope = max(f_hi - f_lo, 1) / (hi - lo)
            aim = target + 0.5
            base, f_base = (lo, f_lo) if aim - f_lo <= f_hi - aim else (hi, f_hi)
            s = min(max(base + round((aim - f_base) / slope), lo + 1), hi - 1)
        width = hi - lo
        fs = f(s)
        if fs > target:
            hi, f_hi = s, fs
        else:
            lo, f_lo = s, fs
        slow = slow + 1 if (hi - lo) * 2 > width else 0
    return lo
