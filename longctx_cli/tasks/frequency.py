"""Aggregation tasks: RULER's common words extraction (cwe) and frequent words extraction (fwe), as `Draft`s.

Wording and parameters are RULER's (common_words_extraction.py, freq_words_extraction.py, synthetic.yaml):
cwe repeats 10 common words 30 times and the others 3 times (6 and 1 below 4K tokens), with one solved
example first; fwe draws 6-letter coded words from a Zipf distribution (alpha 2) whose top word is the
noise "...", and asks for the next three.
"""

from __future__ import annotations

import random
import string
from collections import Counter

from longctx_cli.tasks import haystack
from longctx_cli.tasks.fitting import Draft

CWE_COMMON = 10
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n")
CWE_QUESTION = "What are the 10 most common words in the above list?"
CWE_PREFIX = "The top 10 words that appear most often in the list are:"

FWE_ALPHA = 2.0
FWE_WORD_LEN = 6
FWE_NOISE = "..."
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. "
             "Find the three most frequently appeared coded words. ")
FWE_QUESTION = ("Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "According to the coded text above, the three most frequently appeared words are:"


def cwe_draft(rng: random.Random, length: int) -> Draft:
    """size = number of uncommon words (each repeated freq_ucw times) after the 10 common ones."""
    freq_cw, freq_ucw, example_shape = (6, 1, (20, 3, 1)) if length < 4096 else (30, 3, (40, 10, 3))
    vocab = list(haystack.prose_vocabulary(haystack.prose_corpus()))
    rng.shuffle(vocab)
    # An entry takes at least 2 tokens; past the corpus's words, RULER too draws from a second list.
    need = length // (2 * freq_ucw) + CWE_COMMON + 64 + example_shape[0]
    vocab += _coded_words(rng, need - len(vocab), 7, exclude=set(vocab))
    n_example, ex_cw, ex_ucw = example_shape
    example_words, words = vocab[:n_example], vocab[n_example:]
    example_list = _repeat(example_words, ex_cw, ex_ucw, random.Random(rng.getrandbits(64)))
    example = (f"{CWE_INTRO}{_numbered(example_list)}\n\nQuestion: {CWE_QUESTION}\n"
               f"Answer: {CWE_PREFIX} {_numbered(example_words[:CWE_COMMON])}\n\n")
    shuffle_seed = rng.getrandbits(64)

    def entries(size: int) -> list[str]:
        chosen = words[: CWE_COMMON + size]
        # The same size always gives the same list; another size gives another order.
        return _repeat(chosen, freq_cw, freq_ucw, random.Random(f"{shuffle_seed}:{size}"))

    def tail(size: int) -> str:
        # More entries of words used once: fewer than any common word, so the answer stays the same.
        start = len(entries(size)) + 1
        fresh = words[CWE_COMMON + size : CWE_COMMON + size + 64]
        return "".join(f" {start + i}. {w}" for i, w in enumerate(fresh))

    return Draft(
        render=lambda size: f"{example}{CWE_INTRO}{_numbered(entries(size))}",
        tail=tail, max_size=len(words) - CWE_COMMON - 64, question=CWE_QUESTION, answer_prefix=CWE_PREFIX,
        expected=words[:CWE_COMMON],
    )


def fwe_draft(rng: random.Random, length: int, budget: int) -> Draft:
    """size = RULER's num_words: rank k gets int(size * k^-alpha / zeta(alpha)) copies."""
    vocab_size = max((length - budget) // 50, 16)
    vocab = _coded_words(rng, vocab_size, FWE_WORD_LEN)
    vocab[0] = FWE_NOISE  # the most frequent "word" is noise
    zeta = _zeta(FWE_ALPHA)
    shuffle_seed = rng.getrandbits(64)

    def render(size: int) -> str:
        words = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k**-FWE_ALPHA / zeta))]
        random.Random(f"{shuffle_seed}:{size}").shuffle(words)
        return FWE_INTRO + " ".join(words)

    def check(document: str) -> None:
        counts = Counter(document[len(FWE_INTRO):].split())
        ranked = [n for w, n in counts.most_common() if w != FWE_NOISE]
        if len(ranked) < 4 or ranked[2] <= ranked[3]:
            raise ValueError("too short for fwe: the three most frequent coded words are not distinct")

    return Draft(
        render=render, tail=lambda size: f" {FWE_NOISE}" * 64, max_size=1 << 40, question=FWE_QUESTION,
        answer_prefix=FWE_PREFIX, expected=vocab[1:4], check=check,
    )


def _coded_words(rng: random.Random, n: int, length: int, exclude: set[str] = frozenset()) -> list[str]:
    """n distinct random lower-case words of `length` letters, none in `exclude`, in random order."""
    words: set[str] = set()
    while len(words) < n:
        if (w := "".join(rng.choices(string.ascii_lowercase, k=length))) not in exclude:
            words.add(w)
    ordered = sorted(words)
    rng.shuffle(ordered)
    return ordered


def _repeat(words: list[str], freq_common: int, freq_other: int, rng: random.Random) -> list[str]:
    listed = words[:CWE_COMMON] * freq_common + words[CWE_COMMON:] * freq_other
    rng.shuffle(listed)
    return listed


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def _zeta(s: float, terms: int = 1000) -> float:
    """Riemann zeta for s > 1: partial sum plus the Euler-Maclaurin tail (error ~ terms^-(s+1))."""
    return sum(k**-s for k in range(1, terms)) + terms ** (1 - s) / (s - 1) + terms**-s / 2
