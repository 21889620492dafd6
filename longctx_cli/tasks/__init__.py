"""RULER-style accuracy tasks (NVIDIA RULER's definitions) with token-exact lengths, and their scoring.

    samples = generate("niah_single_2", 4096, 10, tokenizer, seed=0, budget=128)
    for s in samples:
        answer = ask(s.document, s.question, answer_prefix=s.answer_prefix)   # the caller's model run
        print(s.task, s.length, score(s, answer))

A sample's prompt is `document`, then the question and the answer prefix as the prompt layout frames them
(base models: "\\n\\nQuestion: {question}\\nAnswer: {answer_prefix}", see `prompt_tail`). `length` counts
the whole sequence in the model's own tokens: document tokens + `overhead(question, answer_prefix)` (the
layout's tokens: BOS, chat header, question block) = length - budget, where budget is the room left for
the answer. Sample i depends only on (task, length, i, seed, depths, budget, tokenizer, overhead).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from longctx_cli.errors import ConfigError
from longctx_cli.tasks import haystack
from longctx_cli.tasks.fitting import Draft, fit, token_counter
from longctx_cli.tasks.frequency import cwe_draft, fwe_draft
from longctx_cli.tasks.niah import NIAH, niah_draft, vt_draft
from longctx_cli.tasks.scoring import METRICS, score, string_match_all, string_match_part

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey", "niah_multivalue",
         "niah_multiquery", "vt", "cwe", "fwe")
# RULER's tokens_to_generate per task: a sensible answer budget.
ANSWER_BUDGET = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}

__all__ = ["ANSWER_BUDGET", "METRICS", "TASKS", "Sample", "base_overhead", "generate", "prompt_tail", "score",
           "string_match_all", "string_match_part"]


@dataclass
class Sample:
    task: str
    length: int  # the context length asked for, in tokens, answer budget included
    index: int
    seed: int  # the seed passed to generate(); with task, length and index it fixes the sample
    document: str  # task text, haystack and needles: what `longctx ask` reads as the document
    question: str
    answer_prefix: str  # goes after the layout's "Answer:" so that a base model answers in RULER's frame
    expected: list[str]  # strings the answer should contain
    metric: str  # a key of METRICS
    depths: list[float]  # needle depths, ascending: fractions of the haystack (nearest sentence or line
    #                      boundary to that point); [] for cwe and fwe, which have no needles
    budget: int  # tokens left for the answer
    document_tokens: int
    prompt_tokens: int  # document_tokens + overhead(question, answer_prefix); length - budget when exact
    prompt_hash: str  # sha256 of document, question and answer_prefix (NUL-separated), for audit


def prompt_tail(question: str, answer_prefix: str) -> str:
    """What the base-model layout puts after the document."""
    return f"\n\nQuestion: {question}\nAnswer: {answer_prefix}"


def base_overhead(tokenizer) -> Callable[[str, str], int]:
    """Tokens the base-model layout adds to the document: BOS (if the tokenizer has one) and prompt_tail.

    For a chat model pass instead the template's own count (header, question block, generation prompt).
    """
    count = token_counter(tokenizer)
    bos = int(getattr(tokenizer, "bos_token_id", None) is not None)
    return lambda question, answer_prefix: bos + count(prompt_tail(question, answer_prefix))


def generate(task: str, length: int, n: int, tokenizer, *, seed: int = 0, depths: list[float] | None = None,
             budget: int = 0, overhead: Callable[[str, str], int] | None = None) -> list[Sample]:
    """n samples of `task` whose prompts hold exactly length - budget tokens of `tokenizer`.

    depths (0..1, needle tasks only; cwe and fwe have no needles and ignore them): None samples them from
    RULER's 40-point grid; one value puts every needle there; otherwise one value per needle.
    Raises ConfigError for an unknown task, bad depths or budget, or a length too small for the task.
    """
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if depths is not None and not all(0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"depths must lie in [0, 1], got {depths}")
    if not 0 <= budget < length:
        raise ConfigError(f"budget must be in [0, length), got budget {budget} for length {length}")
    count = token_counter(tokenizer)
    overhead = overhead or base_overhead(tokenizer)
    chars_per_token = _chars_per_token(task, count)
    return [_sample(task, length, i, seed, depths, budget, count, overhead, chars_per_token) for i in range(n)]


def _sample(task, length, index, seed, depths, budget, count, overhead, chars_per_token) -> Sample:
    key = f"longctx-ruler:{seed}:{task}:{length}:{index}".encode()
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    # The haystack window: comfortably more text than the context can hold.
    n_chars = int(length * chars_per_token * 1.5) + 4000
    try:
        draft = _draft(task, rng, length, budget, n_chars, depths)
    except ValueError as e:
        raise ConfigError(f"{task}: {e}") from None
    target = length - budget - overhead(draft.question, draft.answer_prefix)
    try:
        document, n_tokens = fit(draft, target, count)
        if draft.check:
            draft.check(document)
    except (ConfigError, ValueError) as e:
        raise ConfigError(f"{task} at length {length} (budget {budget}): {e}") from None
    for needle in draft.needles:
        if document.count(needle) != 1:
            raise RuntimeError(f"{task}: needle {needle!r} occurs {document.count(needle)} times")
    digest = hashlib.sha256("\0".join((document, draft.question, draft.answer_prefix)).encode()).hexdigest()
    return Sample(task=task, length=length, index=index, seed=seed, document=document, question=draft.question,
                  answer_prefix=draft.answer_prefix, expected=draft.expected, metric="string_match_all",
                  depths=draft.depths, budget=budget, document_tokens=n_tokens,
                  prompt_tokens=length - budget - target + n_tokens, prompt_hash=digest)


def _draft(task: str, rng: random.Random, length: int, budget: int, n_chars: int, depths) -> Draft:
    if task in NIAH:
        return niah_draft(task, rng, n_chars, depths)
    if task == "vt":
        return vt_draft(rng, n_chars, depths)
    if task == "cwe":
        return cwe_draft(rng, length)
    return fwe_draft(rng, length, budget)


def _chars_per_token(task: str, count: Callable[[str], int]) -> float:
    """Characters per token of the task's haystack, to size its window (the most of filler and prose)."""
    probe = haystack.FILLER * 100
    ratio = len(probe) / max(count(probe), 1)
    if task in NIAH and NIAH[task][0] == "prose":
        probe = haystack.prose_corpus()[:20000]
        ratio = max(ratio, len(probe) / max(count(probe), 1))
    return ratio
