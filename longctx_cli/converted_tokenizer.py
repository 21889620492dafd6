"""The tokenizer of a named model's converted folder, built as AutoTokenizer builds it, in a third of the time.

For these folders AutoTokenizer.from_pretrained spends most of its time outside the tokenizers library: it parses
tokenizer.json with Python's json module to read the added tokens (Gemma's 33 MB file: ~1 s), then deep-copies
the backend it loaded (TokenizersBackend: ~1 s) or parses the file once more to rebuild the BPE from Python lists
(Qwen2Tokenizer). Here the class is given `tokenizer_file`, so the backend is read once, in Rust, and the added
tokens come from the head of tokenizer.json, where the tokenizers library writes them ahead of the vocabulary.
The other keyword arguments are those transformers' `_from_pretrained` derives from such a folder; a folder with
anything this module does not repeat (legacy files, other config keys, another tokenizer class) is left to
AutoTokenizer. tests/test_converted_tokenizer.py checks the result against AutoTokenizer for both named models.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Classes for which loading from `tokenizer_file` gives AutoTokenizer's backend for the converted folders.
# Qwen2Tokenizer rebuilds its pipeline in __init__ from code; the converted tokenizer.json holds that same
# pipeline, which the test checks.
CLASSES = ("TokenizersBackend", "Qwen2Tokenizer")
# tokenizer_config.json keys that make `_from_pretrained` do more than `_init_kwargs` repeats.
OTHER_KEYS = ("added_tokens_decoder", "additional_special_tokens", "extra_special_tokens", "auto_map",
              "init_inputs", "fast_tokenizer_files")
# Files that transformers would read besides tokenizer_config.json, tokenizer.json and chat_template.jinja.
OTHER_FILES = ("special_tokens_map.json", "added_tokens.json", "additional_chat_templates", "tokenizer.model",
               "vocab.json", "merges.txt")


def load(folder: Path):
    """The tokenizer of a named model's converted folder, or None for any other folder (AutoTokenizer's)."""
    from longctx_cli.gguf_convert import MANIFEST
    from longctx_cli.named_models import NAMED, model_dir

    if folder not in {model_dir(m) for m in NAMED.values()} or not (folder / MANIFEST).is_file():
        return None
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    cls = _tokenizer_class(config)
    if cls is None or any(k in config for k in OTHER_KEYS) or any((folder / f).exists() for f in OTHER_FILES):
        return None
    if any(k.endswith("_token") and k not in cls.SPECIAL_TOKENS_ATTRIBUTES and isinstance(v, str)
           for k, v in config.items()):
        return None  # model-specific special tokens: not repeated here
    try:
        return cls(**_init_kwargs(folder, config, cls))
    except Exception as exc:
        # The tokenizers library reports a tokenizer.json it cannot parse as a bare Exception; as a ValueError
        # it becomes the same ModelError as AutoTokenizer's json error on that file.
        if type(exc) is Exception:
            raise ValueError(str(exc)) from None
        raise


def _tokenizer_class(config: dict):
    """The class AutoTokenizer picks for these folders: the one tokenizer_config.json names. For qwen2 that is
    the class registered for the model type; for gemma3_text (registered: GemmaTokenizer) AutoTokenizer keeps
    the named TokenizersBackend, as the type is not on its list of checkpoints whose named class it overrides."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = config.get("tokenizer_class")
    return tokenizer_class_from_name(name) if name in CLASSES else None


def _init_kwargs(folder: Path, config: dict, cls) -> dict:
    """The keyword arguments `_from_pretrained` passes to the class for this folder, in its order, with
    `tokenizer_file` in place of the backend it would load or rebuild itself."""
    from huggingface_hub import is_offline_mode

    kwargs = {k: v for k, v in config.items() if k not in ("tokenizer_class", "add_bos_token", "add_eos_token")}
    template = folder / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text(encoding="utf-8")
    for name in cls.vocab_files_names:
        kwargs[name] = None
    kwargs["tokenizer_file"] = str(folder / "tokenizer.json")
    kwargs.update(name_or_path=str(folder), is_local=True, local_files_only=is_offline_mode())
    added = added_tokens(folder / "tokenizer.json")
    kwargs["added_tokens_decoder"] = added
    kwargs = cls.convert_added_tokens(kwargs, save=False)
    # Named special tokens become the added tokens they name (with their lstrip/rstrip/normalized flags).
    by_content = {str(token): token for token in added.values()}
    for key in cls.SPECIAL_TOKENS_ATTRIBUTES:
        if kwargs.get(key) is not None and by_content:
            kwargs[key] = by_content.get(str(kwargs[key]), kwargs[key])
    return kwargs


_SPACE = re.compile(r"[ \t\n\r]*")


def added_tokens(path: Path) -> dict:
    """tokenizer.json's "added_tokens" as {id: AddedToken}, parsed from the head of the file only: the
    tokenizers library serialises them before the normalizer, pre-tokenizer and model (a key order it keeps;
    were it to change, more of the file is read, with the same result)."""
    from tokenizers import AddedToken

    with open(path, encoding="utf-8") as f:
        text, chunk = "", 1 << 20
        while True:
            more = f.read(chunk)
            text += more
            tokens = _top_level_value(text, "added_tokens", complete=not more)
            if tokens is not None:
                return {t.pop("id"): AddedToken(**t) for t in tokens}
            chunk *= 2


def _top_level_value(text: str, key: str, complete: bool):
    """The value of top-level `key` in the JSON object that `text` begins, or None while `text` is too short
    to hold it. Raises ValueError when the (complete) text is no such object or lacks the key."""
    decoder = json.JSONDecoder()
    pos = _SPACE.match(text, 0).end()
    if text[pos:pos + 1] != "{":
        raise ValueError("tokenizer.json does not hold a JSON object")
    pos += 1
    try:
        while True:
            name, pos = decoder.raw_decode(text, _SPACE.match(text, pos).end())
            pos = _SPACE.match(text, pos).end()
            if text[pos:pos + 1] != ":":
                raise json.JSONDecodeError("expected ':'", text, pos)
            value, pos = decoder.raw_decode(text, _SPACE.match(text, pos + 1).end())
            pos = _SPACE.match(text, pos).end()
            # A value that runs to the end of the text may be cut short (a number): wait for what follows it.
            if pos == len(text) and not complete:
                return None
            if name == key:
                return value
            if text[pos:pos + 1] != ",":
                raise ValueError(f"tokenizer.json has no {key!r}")
            pos += 1
    except json.JSONDecodeError:
        if complete:
            raise
        return None
