"""longctx_cli.tasks: RULER-style task generation (token-exact lengths, needles, seeds) and scoring."""

import hashlib
import re
from collections import Counter
from dataclasses import replace

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from longctx_cli.errors import ConfigError
from longctx_cli.tasks import (TASKS, base_overhead, generate, prompt_tail, score, string_match_all,
                               string_match_part)
from longctx_cli.tasks.fitting import largest_within, token_counter
from longctx_cli.tasks.frequency import FWE_INTRO, FWE_NOISE
from longctx_cli.tasks.haystack import FILLER, _SENTENCE_END, insert, prose_corpus

NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for [\w-]+ is: [\w-]+\.")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Whitespace:
    """A stand-in tokenizer: one token per whitespace-separated word, no BOS."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": text.split()}


@pytest.fixture(scope="module")
def byte_bpe():
    """A Llama-3 style tokenizer (regex split, byte-level BPE, BOS) trained on a slice of the haystack."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>"])
    tok.train_from_iterator([prose_corpus()[:300_000], FILLER * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


@pytest.fixture(scope="module")
def gemma():
    from longctx_cli.models import load_tokenizer

    return load_tokenizer(None)


def assert_exact(samples, tokenizer, length, budget):
    count, overhead = token_counter(tokenizer), base_overhead(tokenizer)
    for s in samples:
        assert s.prompt_tokens == length - budget
        assert count(s.document) + overhead(s.question, s.answer_prefix) == length - budget
        assert s.document_tokens == count(s.document)


@pytest.mark.parametrize("length", [1000, 2048, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_exact_length_whitespace(task, length):
    assert_exact(generate(task, length, 2, Whitespace(), seed=3, budget=64), Whitespace(), length, 64)


@pytest.mark.parametrize("length", [1500, 4096])
@pytest.mark.parametrize("task", TASKS)
def test_exact_length_byte_bpe(task, length, byte_bpe):
    assert_exact(generate(task, length, 1, byte_bpe, seed=5, budget=32), byte_bpe, length, 32)


@pytest.mark.parametrize("task", TASKS)
def test_exact_length_gemma(task, gemma):
    assert_exact(generate(task, 2048, 1, gemma, seed=1, budget=128), gemma, 2048, 128)


@pytest.mark.parametrize("length", [1024, 4097])
def test_exact_length_gemma_prose(length, gemma):
    assert_exact(generate("niah_single_2", length, 2, gemma, seed=2), gemma, length, 0)


def test_custom_overhead_is_honoured():
    # A chat template's header and question block: the document shrinks by what they take.
    samples = generate("niah_single_2", 1000, 1, Whitespace(), overhead=lambda q, a: 100)
    assert samples[0].document_tokens == 900 and samples[0].prompt_tokens == 1000


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.33, 0.5, 0.9, 1.0])
def test_needle_once_at_depth(task, depth):
    for s in generate(task, 4096, 3, Whitespace(), seed=9, depths=[depth]):
        (needle,) = NEEDLE.findall(s.document)
        assert s.document.count(needle) == 1 and s.expected[0] in needle
        assert s.depths == [depth]
        # Position within the haystack (after the task's opening line), in characters.
        start = s.document.index("\n") + 1
        haystack_chars = len(s.document) - start - len(needle)
        assert abs((s.document.index(needle) - start) / haystack_chars - depth) < 0.03


def test_needles_sit_between_sentences():
    (s,) = generate("niah_single_2", 2048, 1, Whitespace(), seed=4, depths=[0.5])
    before = s.document[: s.document.index("One of the special")]
    assert re.search(r"[.!?][\"'\u2019\u201d)]* $", before)


def test_multivalue_needles_at_given_depths_in_order():
    depths = [0.2, 0.4, 0.6, 0.8]
    (s,) = generate("niah_multivalue", 4096, 1, Whitespace(), seed=0, depths=depths)
    needles = NEEDLE.findall(s.document)
    assert len(needles) == 4 and len(set(needles)) == 4
    positions = [s.document.index(n) / len(s.document) for n in needles]
    assert all(abs(p - d) < 0.04 for p, d in zip(positions, depths))
    assert sorted(s.expected) == sorted(n.split(": ")[1].rstrip(".") for n in needles)


def test_sampled_depths_come_from_rulers_grid():
    for s in generate("niah_multikey", 1000, 4, Whitespace()):
        assert len(s.depths) == 4 and s.depths == sorted(s.depths)
        assert all(round(d * 39) == pytest.approx(d * 39, abs=0.2) for d in s.depths)


def test_reproducible_by_seed(gemma):
    for task in ("niah_single_2", "cwe"):
        a = generate(task, 1024, 3, gemma, seed=7)
        assert a == generate(task, 1024, 3, gemma, seed=7)
        # Sample i does not depend on how many were asked for.
        assert a[:2] == generate(task, 1024, 2, gemma, seed=7)


@pytest.mark.parametrize("task", TASKS)
def test_distinct_across_seeds_and_indices(task):
    a = generate(task, 1024, 3, Whitespace(), seed=0)
    b = generate(task, 1024, 3, Whitespace(), seed=1)
    hashes = {s.prompt_hash for s in a + b}
    assert len(hashes) == 6
    assert all(x.expected != y.expected for x, y in zip(a, b))


def test_prompt_hash():
    (s,) = generate("vt", 1000, 1, Whitespace())
    assert s.prompt_hash == hashlib.sha256(f"{s.document}\0{s.question}\0{s.answer_prefix}".encode()).hexdigest()


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")] + ["vt"])
def test_expected_answers_in_document(task):
    for s in generate(task, 2048, 2, Whitespace(), seed=12):
        assert s.metric == "string_match_all" and s.expected
        for value in s.expected:
            assert value in s.document
        assert score(s, " ".join(s.expected)) == 1.0


def test_niah_question_shapes():
    (single,) = generate("niah_single_3", 1000, 1, Whitespace())
    assert re.fullmatch(r"What is the special magic uuid for [a-z]+-[a-z]+ mentioned in the provided text\?",
                        single.question)
    assert single.answer_prefix.endswith("mentioned in the provided text is")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", single.expected[0])
    (multi,) = generate("niah_multiquery", 1000, 1, Whitespace())
    keys = re.findall(r"[a-z]+-[a-z]+", multi.question)
    assert len(set(keys)) == 4 and ", and " in multi.question and len(multi.expected) == 4
    assert multi.document.startswith("Some special magic numbers are hidden")
    (mk,) = generate("niah_multikey", 1000, 1, Whitespace())
    assert len(NEEDLE.findall(mk.document)) == 4 and len(mk.expected) == 1


def test_vt_chain_in_order():
    for s in generate("vt", 2048, 3, Whitespace(), seed=2):
        value = re.search(r"the value (\d{5})", s.question).group(1)
        names = s.expected
        assert len(names) == 5 and len(set(names)) == 5
        main = s.document[s.document.rindex("Memorize and track"):]
        lines = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
        positions = [re.search(f"^{line}$", main, re.M).start() for line in lines]
        assert positions == sorted(positions) and all(s.document.count(line) == 1 for line in lines)
        assert f"5 variables are assigned the value {value}" in s.answer_prefix


@pytest.mark.parametrize("length,common_freq", [(2048, 6), (4096, 30)])
def test_cwe_common_words_are_most_common(length, common_freq):
    for s in generate("cwe", length, 2, Whitespace(), seed=8):
        main = s.document[s.document.rindex("Below is a numbered list"):]
        counts = Counter(re.findall(r"\d+\. (\w+)", main))
        assert len(s.expected) == 10
        assert all(counts[w] == common_freq for w in s.expected)
        assert max(n for w, n in counts.items() if w not in s.expected) < common_freq


def test_fwe_expected_are_most_frequent(gemma):
    for tokenizer in (Whitespace(), gemma):
        for s in generate("fwe", 2048, 2, tokenizer, seed=6):
            counts = Counter(s.document[len(FWE_INTRO):].split())
            ranked = [w for w, _ in counts.most_common() if w != FWE_NOISE]
            assert set(ranked[:3]) == set(s.expected)
            assert counts[ranked[2]] > counts[ranked[3]]


def test_cwe_fwe_have_no_depths():
    assert generate("cwe", 2048, 1, Whitespace(), depths=[0.5])[0].depths == []
    assert generate("fwe", 2048, 1, Whitespace())[0].depths == []


def test_bad_arguments():
    with pytest.raises(ConfigError, match="unknown task"):
        generate("niah", 1000, 1, Whitespace())
    with pytest.raises(ConfigError, match="depths"):
        generate("niah_single_1", 1000, 1, Whitespace(), depths=[1.5])
    with pytest.raises(ConfigError, match="1 or 4 depths"):
        generate("niah_multikey", 1000, 1, Whitespace(), depths=[0.1, 0.2])
    with pytest.raises(ConfigError, match="budget"):
        generate("vt", 1000, 1, Whitespace(), budget=1000)
    with pytest.raises(ConfigError, match="niah_single_2 at length 40"):
        generate("niah_single_2", 40, 1, Whitespace())


def test_insert():
    text = "One two. Three four. Five six."
    assert insert(text, ["N."], [0.0], _SENTENCE_END, " ") == "N. One two. Three four. Five six."
    assert insert(text, ["N."], [1.0], _SENTENCE_END, " ") == "One two. Three four. Five six. N."
    assert insert(text, ["N."], [0.6], _SENTENCE_END, " ") == "One two. Three four. N. Five six."
    assert insert(text, ["A.", "B."], [0.3, 0.3], _SENTENCE_END, " ") == "One two. A. B. Three four. Five six."
    assert insert("Mr. Smith came. He sat.", ["N."], [0.1], _SENTENCE_END, " ") == "N. Mr. Smith came. He sat."
    assert insert("", ["A.", "B."], [0.5, 0.5], _SENTENCE_END, "\n") == "A.\nB."


@pytest.mark.parametrize("target", [0, 1, 7, 100, 1000, 4097])
def test_largest_within(target):
    def f(s):  # steps of 1 and 2 tokens, like words of one and two tokens
        return 5 + s + s // 3

    best = largest_within(f, target + 5, 10_000)
    assert f(best) <= target + 5 < f(best + 1)


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("Only 123 here.", ["123", "456"]) == 0.5
    assert string_match_all("Only 123 here.", ["123", "456", "789", "000"]) == 0.25
    assert string_match_all("APPLE, Banana", ["apple", "banana"]) == 1.0  # case-insensitive
    assert string_match_all("nothing", ["apple"]) == 0.0
    assert string_match_all("pineapple", ["apple"]) == 1.0  # substring, as RULER scores
    assert string_match_all("a\x00b", ["a\nb"]) == 1.0  # control characters read as newlines
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_string_match_part():
    assert string_match_part("Paris, I think", ["paris", "London"]) == 1.0
    assert string_match_part("LONDON", ["paris", "london"]) == 1.0
    assert string_match_part("Rome", ["paris", "london"]) == 0.0


def test_score_uses_the_samples_metric():
    (s,) = generate("niah_multivalue", 1000, 1, Whitespace())
    assert score(s, f"{s.expected[0]}, {s.expected[2].upper()}") == 0.5
    assert score(replace(s, metric="string_match_part"), s.expected[1]) == 1.0


def test_prompt_tail():
    assert prompt_tail("Q?", "It is") == "\n\nQuestion: Q?\nAnswer: It is"
