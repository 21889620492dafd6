"""longctx_cli.inputs: collecting documents, streaming text in safe pieces, tokenizing the pieces."""

import io
import os

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from longctx_cli.errors import InputError
from longctx_cli.inputs import Document, collect_documents, iter_text, tokenize_stream

# Prose with the awkward parts: runs of spaces and newlines, tabs, digits, contractions, punctuation,
# accents, CJK and emoji (4-byte UTF-8).
TEXT = (
    "Hello world, this is a test. It's 2024; the price was $1234.56!\n\n"
    "Second paragraph:   three spaces,\ttab, and a line\nbreak. Café crème brûlée, naïve façade.\n"
    "中文 文本 和 日本語のテキスト 😀 emoji 🎉 here... (parens) [brackets] {braces} \"quotes\"\n"
    "'single'.\n\n\n"
    "  Leading spaces, trailing spaces   \n"
) * 6

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> Tokenizer:
    """Llama-3 / Qwen style: regex split, byte-level BPE."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, special_tokens=["<s>"])
    tok.train_from_iterator([TEXT], trainer)
    return tok


def _sentencepiece(legacy: bool) -> Tokenizer:
    """Gemma style (spaces -> "▁", BPE over the whole text) or Llama-2 legacy style ("▁" prepended per call).

    Merges are learned word by word, as SentencePiece does, then applied without a pre-tokenizer.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"]))
    replace = normalizers.Replace(" ", "▁")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if legacy else replace
    tok.pre_tokenizer = None
    return tok


@pytest.fixture(scope="module", params=["byte-level", "gemma", "legacy-spm"])
def tokenizer(request):
    tok = _byte_level() if request.param == "byte-level" else _sentencepiece(legacy=request.param == "legacy-spm")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _read(path, **kw):
    return list(iter_text(Document(str(path), path), **kw))


def test_file_is_one_document(tmp_path):
    path = _write(tmp_path, "book.txt", TEXT)
    assert collect_documents([str(path)]) == [Document(str(path), path)]
    assert "".join(_read(path)) == TEXT


def test_folder_recursion_with_glob(tmp_path):
    for name in ["b.md", "a.txt", "sub/deep/c.txt", "skip.py", ".git/d.txt", "sub/.cache/e.md"]:
        _write(tmp_path, name, "text")
    docs = collect_documents([str(tmp_path)])
    assert [d.name for d in docs] == ["a.txt", "b.md", "sub/deep/c.txt"]
    assert docs[2].path == tmp_path / "sub" / "deep" / "c.txt"
    assert [d.name for d in collect_documents([str(tmp_path)], glob="*.py, *.md")] == ["b.md", "skip.py"]


def test_stdin_from_passed_file_object():
    (doc,) = collect_documents(["-"])
    assert doc == Document("<stdin>", None)
    assert "".join(iter_text(doc, stdin=io.BytesIO(TEXT.encode()), piece_bytes=50)) == TEXT
    wrapped = io.TextIOWrapper(io.BytesIO(TEXT.encode()), encoding="utf-8")  # like sys.stdin: has .buffer
    assert "".join(iter_text(doc, stdin=wrapped)) == TEXT
    with pytest.raises(InputError, match="only once"):
        collect_documents(["-", "-"])


@pytest.mark.parametrize("piece_bytes", [1, 3, 16, 64], ids=lambda n: f"piece{n}")
def test_pieces_rejoin_exactly(tmp_path, piece_bytes):
    pieces = _read(_write(tmp_path, "t.txt", TEXT), piece_bytes=piece_bytes)
    assert "".join(pieces) == TEXT
    assert len(pieces) > len(TEXT.encode()) // piece_bytes // 8


@pytest.mark.parametrize("piece_bytes", [16, 64], ids=lambda n: f"piece{n}")
def test_pieces_end_at_word_space_boundaries(tmp_path, piece_bytes):
    # TEXT has a "word| next" boundary at least every 8 * 16 bytes, so no cut is forced.
    pieces = _read(_write(tmp_path, "t.txt", TEXT), piece_bytes=piece_bytes)
    for left, right in zip(pieces, pieces[1:]):
        assert not left[-1].isspace() and right[0] == " " and not right[1].isspace(), (left, right)
    assert max(len(p.encode()) for p in pieces) < 8 * piece_bytes


def test_multibyte_characters_across_piece_borders(tmp_path):
    text = "é中😀 " * 50 + "😀" * 40  # the last word is longer than the growth cap, so it is cut mid-word
    path = _write(tmp_path, "u.txt", text)
    for piece_bytes in range(1, 8):
        assert "".join(_read(path, piece_bytes=piece_bytes)) == text


@pytest.mark.parametrize("piece_bytes", [16, 64, 1 << 20], ids=lambda n: f"piece{n}")
def test_piecewise_tokenization_equals_whole(tmp_path, tokenizer, piece_bytes):
    path = _write(tmp_path, "t.txt", TEXT)
    whole = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = tokenize_stream(_read(path, piece_bytes=piece_bytes), tokenizer, add_bos=False)
    assert ids.dtype == torch.int32 and ids.dim() == 1
    assert ids.tolist() == whole


def test_bos_prepended_once(tokenizer):
    ids = tokenize_stream(["Hello", " world", " again"], tokenizer)
    assert ids[0].item() == tokenizer.bos_token_id
    assert ids.tolist().count(tokenizer.bos_token_id) == 1
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    assert tokenize_stream(["Hello"], tokenizer, add_bos=False).tolist() == hello
    assert tokenize_stream([], tokenizer, add_bos=False).shape == (0,)


@pytest.mark.parametrize(
    "data", [b"", b" \n\t\r\n  \n", b"\xef\xbb\xbf", b"\xef\xbb\xbf  \n"], ids=["empty", "whitespace", "bom", "bom-ws"]
)
def test_empty_document(tmp_path, data):
    path = _write(tmp_path, "e.txt", data)
    with pytest.raises(InputError, match=f"empty document: {path}"):
        _read(path, piece_bytes=2)


def test_binary_file_with_nul(tmp_path):
    path = _write(tmp_path, "b.bin", b"PK\x03\x04 some header" + b"\0" + b"x" * 100)
    with pytest.raises(InputError, match=rf"binary file \(NUL byte at byte offset 16\): {path}"):
        _read(path, piece_bytes=4)
    # Past the first 8 KiB a NUL is text like any other character.
    late = "a " * 5000 + "\0"
    assert "".join(_read(_write(tmp_path, "late.txt", late))) == late


@pytest.mark.parametrize("piece_bytes", [1, 2, 5, 1 << 20])
@pytest.mark.parametrize(
    "data, offset",
    [(b"hello w\xffrld", 7), (b"ab \xe2\x82X more", 3), (b"caf\xc3\xa9 ok \xe2\x82", 9), (b"\xef\xbb\xbfok \x80", 6)],
    ids=["bad-byte", "bad-continuation", "truncated-at-end", "after-bom"],
)
def test_invalid_utf8_names_path_and_byte_offset(tmp_path, data, offset, piece_bytes):
    path = _write(tmp_path, "bad.txt", data)
    with pytest.raises(InputError) as err:
        _read(path, piece_bytes=piece_bytes)
    message = str(err.value)
    assert str(path) in message and f"byte offset {offset}" in message and "--encoding-errors replace" in message
    assert "\n" not in message


def test_replace_and_ignore_go_on(tmp_path):
    path = _write(tmp_path, "bad.txt", b"hello w\xffrld and more")
    assert "".join(_read(path, encoding_errors="replace")) == "hello w\ufffdrld and more"
    assert "".join(_read(path, encoding_errors="ignore", piece_bytes=3)) == "hello wrld and more"
    with pytest.raises(ValueError, match="encoding_errors"):
        _read(path, encoding_errors="latin-1")


def test_missing_path_and_folder_without_matches(tmp_path):
    with pytest.raises(InputError, match="no such file or folder: nowhere/book.txt"):
        collect_documents(["nowhere/book.txt"])
    _write(tmp_path, "docs/code.py", "x = 1")
    with pytest.raises(InputError, match=r"no file matching \*\.txt,\*\.md in folder: .*docs"):
        collect_documents([str(tmp_path / "docs")])


@pytest.mark.parametrize("piece_bytes", [1, 2, 1 << 20])
def test_bom_dropped(tmp_path, piece_bytes):
    path = _write(tmp_path, "bom.txt", b"\xef\xbb\xbf" + TEXT.encode())
    assert "".join(_read(path, piece_bytes=piece_bytes)) == TEXT


@pytest.mark.slow
def test_real_tokenizer_piecewise_equals_whole(tmp_path):
    """LONGCTX_TEST_TOKENIZER: a saved HF tokenizer folder (e.g. the embedded Gemma 3 one)."""
    folder = os.environ.get("LONGCTX_TEST_TOKENIZER")
    if not folder:
        pytest.skip("set LONGCTX_TEST_TOKENIZER to a saved tokenizer folder")
    tok = AutoTokenizer.from_pretrained(folder)
    text = TEXT * 20
    path = _write(tmp_path, "t.txt", text)
    whole = tok.encode(text, add_special_tokens=False)
    for piece_bytes in (16, 100, 4096):
        assert tokenize_stream(_read(path, piece_bytes=piece_bytes), tok, add_bos=False).tolist() == whole
