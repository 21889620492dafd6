"""Documents in, token ids out, streamed: a multi-GB file never becomes one Python string.

`collect_documents` expands files, folders and "-" (stdin) into Documents; `iter_text` reads one as decoded text
pieces of about `piece_bytes`, each ending at a boundary where tokenizing the pieces separately gives the same ids
as tokenizing the whole text; `tokenize_stream` turns those pieces into one int32 id tensor.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from longctx_cli.errors import InputError

if TYPE_CHECKING:
    import torch

ENCODING_ERRORS = ("strict", "replace", "ignore")
# git and grep call a file binary when a NUL byte shows up this early.
SNIFF_BYTES = 8 * 1024
# A piece with no safe boundary grows to this many times piece_bytes before it is cut anyway.
MAX_GROWTH = 8

# "word| next": a single space between two non-whitespace characters. Every common pre-tokenizer attaches a
# lone space to the word after it (Llama-3/GPT-2 " ?\p{L}+", SentencePiece "▁next", Gemma's whole-text BPE has
# no merge across "X▁"), and none joins a non-space character to the space after it, so the cut is exact.
# Whitespace runs are never split: Llama-3 glues ".\n\n" and Gemma has tokens for runs of spaces and newlines.
# The greedy `.*` backtracks from the end, so in prose the last boundary is found after a few characters.
_SAFE_CUT = re.compile(r".*\S( )\S", re.S)
# Fallback once a piece has grown too large: before the last whitespace run, else anywhere.
_WHITESPACE_CUT = re.compile(r".*\S(?=\s)", re.S)


@dataclass
class Document:
    name: str  # path as given / relative path inside a folder / "<stdin>"
    path: Path | None  # None for stdin
    error: InputError | None = None  # found before reading (missing path, empty folder, binary start, ...)


def collect_documents(paths: list[str], glob: str = "*.txt,*.md", strict: bool = True) -> list[Document]:
    """Expand files, folders (recursively, following links to folders once each; files matching any
    comma-separated pattern, sorted) and "-". A missing path or an empty folder raises InputError, or with
    strict=False becomes a Document carrying its error, so a run over several inputs reports it and goes on."""
    patterns = [p.strip() for p in glob.split(",") if p.strip()]
    docs: list[Document] = []
    for entry in paths:
        if entry == "-":
            if any(d.path is None for d in docs):
                raise InputError("stdin ('-') can be given only once")
            docs.append(Document("<stdin>", None))
            continue
        path = Path(entry)
        if path.is_dir():
            rel = _folder_files(path, patterns)
            if not rel:
                error = InputError(f"no file matching {','.join(patterns) or '(no pattern)'} in folder: {entry}")
                docs.append(Document(entry, path, error))
            docs.extend(Document(r.as_posix(), path / r) for r in rel)
        elif path.exists():  # a file, or a named pipe such as bash's <(cmd)
            docs.append(Document(entry, path))
        else:
            docs.append(Document(entry, path, InputError(f"no such file or folder: {entry}")))
    if strict and (bad := next((d for d in docs if d.error is not None), None)):
        raise bad.error
    return docs


def _folder_files(root: Path, patterns: list[str]) -> list[Path]:
    """Files under root matching a pattern, relative to root, sorted. Links to folders are followed (each real
    folder once, so a link cycle ends); hidden files and folders (.git, .venv, ...) are never documents."""
    import fnmatch

    seen: set[str] = set()
    found: list[Path] = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        rel = Path(folder).relative_to(root)
        found += [rel / f for f in files if not f.startswith(".") and (Path(folder) / f).is_file()
                  and any(fnmatch.fnmatch(f, p) for p in patterns)]
    return sorted(found)


def sniff(doc: Document, encoding_errors: str = "strict") -> InputError | None:
    """The error reading would meet at the start of a regular file (empty, binary, not UTF-8), found by reading
    its first few KiB only, so a bad document is refused before any model loads. Pipes and stdin are not
    sniffed (reading would consume them)."""
    if doc.error is not None or doc.path is None or not doc.path.is_file():
        return doc.error
    try:
        for _ in iter_text(doc, encoding_errors=encoding_errors, piece_bytes=SNIFF_BYTES):
            break
    except InputError as exc:
        return exc
    return None


def iter_text(
    doc: Document, *, encoding_errors: str = "strict", piece_bytes: int = 1 << 20, stdin=None
) -> Iterator[str]:
    """Yield the document's text in pieces of about `piece_bytes`; "".join(pieces) is the whole text (BOM dropped).

    Every piece but the last ends right before a "word| next" space, so pieces tokenize independently
    (see `_SAFE_CUT`). `stdin` (binary or text file object) replaces sys.stdin for the "-" document.
    Raises InputError for an empty or whitespace-only document, a NUL byte in the first 8 KiB, or (with
    encoding_errors="strict") invalid UTF-8, naming the byte offset.
    """
    if encoding_errors not in ENCODING_ERRORS:
        raise ValueError(f"encoding_errors must be one of {ENCODING_ERRORS}, got {encoding_errors!r}")
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
    if doc.path is None and stdin is None and os.environ.get("LONGCTX_STDIN_FILE"):
        # A rank of a multi-process run: the launcher read stdin once into this file (longctx_cli/distributed.py).
        stdin = open(os.environ["LONGCTX_STDIN_FILE"], "rb")
    if doc.path is None:
        stream = stdin if stdin is not None else sys.stdin
        yield from _pieces(getattr(stream, "buffer", stream), doc.name, encoding_errors, piece_bytes)
        return
    label = str(doc.path)
    try:
        f = open(doc.path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {label}: {e.strerror}") from None
    with f:
        yield from _pieces(f, label, encoding_errors, piece_bytes)


def _pieces(stream: BinaryIO, label: str, errors: str, piece_bytes: int) -> Iterator[str]:
    buf, seen_text = "", False
    for text in _decode(stream, label, errors, piece_bytes):
        seen_text = seen_text or (bool(text) and not text.isspace())
        # buf had no boundary before this block, so only one reaching into the new text can be found.
        start = max(0, len(buf) - 2)
        buf += text
        if m := _SAFE_CUT.match(buf, start):
            cut = m.start(1)
        elif len(buf) >= MAX_GROWTH * piece_bytes:
            m = _WHITESPACE_CUT.match(buf)
            cut = m.end() if m else len(buf)
        else:
            continue
        yield buf[:cut]
        buf = buf[cut:]
    # Whitespace-only text may already have gone out in forced cuts; the error still stops the run.
    if not seen_text:
        raise InputError(f"empty document: {label}")
    if buf:
        yield buf


def _decode(stream: BinaryIO, label: str, errors: str, block_bytes: int) -> Iterator[str]:
    """Yield decoded text per block read (possibly ""); the UTF-8 BOM is dropped."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors)
    offset = 0  # bytes read before the current block
    first = True
    while True:
        data = stream.read(block_bytes)
        if isinstance(data, str):  # a text-mode file object without .buffer (io.StringIO in tests)
            data = data.encode("utf-8", "surrogateescape")
        if offset < SNIFF_BYTES and (nul := data.find(b"\0", 0, SNIFF_BYTES - offset)) >= 0:
            raise InputError(f"binary file (NUL byte at byte offset {offset + nul}): {label}")
        # Bytes held back by the decoder (an unfinished multi-byte character) precede `data` in the error.
        pending = len(decoder.getstate()[0])
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:
            at = offset - pending + e.start
            raise InputError(
                f"not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} at byte offset {at}): {label}; "
                "pass --encoding-errors replace to go on anyway"
            ) from None
        offset += len(data)
        if first and text:
            first = False
            text = text.removeprefix("\ufeff")
        yield text
        if not data:
            return


def tokenize_stream(pieces: Iterable[str], tokenizer, *, add_bos: bool = True) -> torch.Tensor:
    """Tokenize text pieces one by one into ids: [n_tokens] int32 on CPU, BOS first if asked and defined.

    Ids accumulate in a compact array('i') (4 bytes a token) instead of Python int lists.
    """
    import torch

    ids = array("i")
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None:
        ids.append(bos)
    strip_space = None
    for k, piece in enumerate(pieces):
        if k > 0 and piece.startswith(" "):
            if strip_space is None:
                strip_space = _adds_dummy_prefix(tokenizer)
            if strip_space:
                piece = piece[1:]
        ids.extend(_encode(tokenizer, piece))
    if not ids:
        return torch.empty(0, dtype=torch.int32)
    # frombuffer shares the array's memory (and keeps it alive) instead of copying a possibly huge id list.
    return torch.frombuffer(ids, dtype=torch.int32)


def _encode(tokenizer, text: str) -> list[int]:
    # verbose=False: a 1 MiB piece is longer than model_max_length, which is expected here, not worth a warning.
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


def _adds_dummy_prefix(tokenizer) -> bool:
    """True for SentencePiece tokenizers that prepend "▁" to every call (Llama-2 / Mistral legacy mode).

    For them " next" at a piece start would become "▁▁next"; dropping the space gives "▁next", as in the
    whole text. Other tokenizers already give identical ids with the space kept.
    """
    whole = _encode(tokenizer, "Hello world")
    if _encode(tokenizer, "Hello") + _encode(tokenizer, " world") == whole:
        return False
    return _encode(tokenizer, "Hello") + _encode(tokenizer, "world") == whole
