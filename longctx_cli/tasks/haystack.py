"""Haystacks: RULER's repeated filler, and real prose (samples/haystack/*.txt), with needles put in at depths.

A haystack is a window of a source read cyclically (the prose from a random paragraph on, wrapping round to
the start of the corpus if a context needs more), cut into words so that a task can take exactly the first
`size` of them. Needles go between sentences (prose) or lines (filler), at the boundary nearest to
depth x the haystack's length in characters, as RULER inserts them between sentences.
"""

from __future__ import annotations

import bisect
import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path

from longctx_cli.errors import InputError

HAYSTACK_DIR = Path(__file__).resolve().parents[2] / "samples" / "haystack"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# After a sentence's closing punctuation (and quotes), before the space; not after "Mr." or an initial.
_SENTENCE_END = re.compile(
    r"(?<!\bMr)(?<!\bMrs)(?<!\bSt)(?<!\bDr)(?<!\bRev)(?<!\b[A-Z])[.!?][\"'\u2019\u201d)]*(?=\s)"
)
_LINE_END = re.compile(r"(?<=\S)(?=\n)")
_WORD = re.compile(r"\S+")


@functools.cache
def prose_corpus(directory: Path = HAYSTACK_DIR) -> str:
    """The haystack texts (*.txt in `directory`, by name), paragraphs apart, as one string."""
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise InputError(f"no haystack text (*.txt) in {directory}; the prose tasks need samples/haystack/")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files) + "\n\n"


@functools.cache
def _paragraph_starts(corpus: str) -> list[int]:
    return [0] + [m.end() for m in re.finditer(r"\n\n+", corpus) if m.end() < len(corpus)]


@functools.cache
def prose_vocabulary(corpus: str) -> tuple[str, ...]:
    """Distinct lower-case words of 3-12 letters found in the corpus (names, which are capitalised, are not)."""
    return tuple(sorted(set(re.findall(r"(?<![\w'\u2019-])[a-z]{3,12}(?![\w'\u2019-])", corpus))))


@dataclass
class Haystack:
    text: str  # the window: enough text for the context asked for, starting at a paragraph or line
    ends: list[int]  # character offset where each word of `text` ends
    boundary: re.Pattern  # positions where a needle may go
    sep: str  # between a needle and the text beside it

    @property
    def max_size(self) -> int:
        return len(self.ends)

    def words(self, size: int) -> str:
        """The first `size` words, with the whitespace between them as in the source."""
        return self.text[: self.ends[size - 1]] if size > 0 else ""

    def continuation(self, size: int, n_words: int = 64) -> str:
        """The text that follows words(size): the next `n_words` words with their leading whitespace."""
        start = self.ends[size - 1] if size > 0 else 0
        stop = self.ends[min(size + n_words, len(self.ends)) - 1]
        return self.text[start:stop]

    def with_needles(self, size: int, needles: list[str], depths: list[float]) -> str:
        return insert(self.words(size), needles, depths, self.boundary, self.sep)


def window(source: str, start: int, n_chars: int, boundary: re.Pattern, sep: str) -> Haystack:
    """A haystack of about `n_chars` characters of `source` read cyclically from `start`."""
    reps = (start + n_chars) // len(source) + 1
    text = (source * reps)[start : start + n_chars]
    ends = [m.end() for m in _WORD.finditer(text)]
    # The window may cut its last word in two; drop that word.
    if ends and ends[-1] == len(text) and not source[(start + n_chars) % len(source)].isspace():
        ends.pop()
    return Haystack(text, ends, boundary, sep)


def prose(rng: random.Random, n_chars: int, corpus: str | None = None) -> Haystack:
    """Prose from a random paragraph of the corpus on; needles go between sentences."""
    corpus = corpus if corpus is not None else prose_corpus()
    start = rng.choice(_paragraph_starts(corpus))
    return window(corpus, start, n_chars, _SENTENCE_END, " ")


def filler(n_chars: int) -> Haystack:
    """RULER's noise: the filler paragraph repeated on lines of its own; needles go on lines between them."""
    return window(FILLER + "\n", 0, n_chars, _LINE_END, "\n")


def insert(text: str, needles: list[str], depths: list[float], boundary: re.Pattern, sep: str) -> str:
    """`text` with needle i at the boundary nearest to depths[i] * len(text); needles at one boundary keep
    their order. Boundaries are the ends of `boundary` matches, and the start and end of the text."""
    if len(needles) != len(depths):
        raise ValueError(f"expected one depth per needle, got {len(depths)} depths for {len(needles)} needles")
    if not text:
        return sep.join(needles)
    cuts = sorted({0, len(text), *(m.end() for m in boundary.finditer(text))})
    placed = sorted((_nearest(cuts, d * len(text)), i) for i, d in enumerate(depths))
    pieces, prev = [], 0
    for cut, i in placed:
        pieces.append(text[prev:cut])
        pieces.append(needles[i] + sep if cut == 0 else sep + needles[i])
        prev = cut
    pieces.append(text[prev:])
    return "".join(pieces)


def _nearest(cuts: list[int], pos: float) -> int:
    j = bisect.bisect_left(cuts, pos)
    candidates = cuts[max(0, j - 1) : j + 1]
    return min(candidates, key=lambda c: abs(c - pos))
