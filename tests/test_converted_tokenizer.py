"""A named model's converted folder loads its tokenizer through converted_tokenizer, not AutoTokenizer, and gets
AutoTokenizer's tokenizer: same class, backend, special and added tokens, chat template, ids and text. Other
folders keep AutoTokenizer, and a damaged tokenizer.json is still a ModelError. CPU; a model whose folder is not
converted in this home is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import AddedToken

from longctx_cli import converted_tokenizer, models
from longctx_cli.errors import ModelError
from longctx_cli.gguf_convert import MANIFEST
from longctx_cli.named_models import EMBEDDED, NAMED, model_dir

TEXTS = [
    "The keeper of the lighthouse counted 68413 gulls.",
    "<bos>Question: who rang the bell?<eos>\nAnswer:",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "naïve café — 東京タワー, Ελληνικά, 🌊🚢\ttabs\n\n  and spaces  ",
    "<pad><unk><|endoftext|><start_of_turn>model <mask>",
    "",
]
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Wo ist der Leuchtturm? 灯台"}]


def _state(tokenizer) -> dict:
    """The tokenizer's Python-side state with AddedTokens as plain dicts (they compare by content only)."""
    def plain(x):
        if isinstance(x, AddedToken):
            return x.__getstate__()
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    state = {k: plain(v) for k, v in vars(tokenizer).items() if k != "_tokenizer"}
    # Qwen2Tokenizer keeps the vocabulary and merges it built its BPE from; nothing reads them after __init__,
    # and loading from tokenizer_file leaves the class defaults there. The backend compared below holds them.
    state.pop("_vocab", None)
    state.pop("_merges", None)
    return state


@pytest.fixture(scope="module", params=list(NAMED))
def pair(request):
    folder = model_dir(NAMED[request.param])
    if not (folder / MANIFEST).is_file():
        pytest.skip(f"{request.param} is not converted in {folder.parent}")
    return transformers.AutoTokenizer.from_pretrained(str(folder)), converted_tokenizer.load(folder)


def test_same_class_backend_and_state(pair):
    auto, fast = pair
    assert type(fast) is type(auto)
    assert fast.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert _state(fast) == _state(auto)
    assert list(fast.init_kwargs) == list(auto.init_kwargs)


def test_same_special_and_added_tokens(pair):
    auto, fast = pair
    for name in ("bos", "eos", "pad", "unk"):
        assert getattr(fast, f"{name}_token") == getattr(auto, f"{name}_token")
        assert getattr(fast, f"{name}_token_id") == getattr(auto, f"{name}_token_id")
    assert fast.all_special_tokens == auto.all_special_tokens and fast.all_special_ids == auto.all_special_ids
    assert {i: t.__getstate__() for i, t in fast.added_tokens_decoder.items()} == \
        {i: t.__getstate__() for i, t in auto.added_tokens_decoder.items()}
    assert (len(fast), fast.vocab_size, fast.model_max_length) == (len(auto), auto.vocab_size, auto.model_max_length)
    assert fast.chat_template == auto.chat_template


@pytest.mark.parametrize("special", [True, False], ids=["with-special", "without-special"])
def test_same_ids_and_text(pair, special):
    auto, fast = pair
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=special)
        assert fast.encode(text, add_special_tokens=special) == ids, text
        assert fast(text, add_special_tokens=special) == auto(text, add_special_tokens=special), text
        with_specials = [*auto.all_special_ids, *ids, *auto.all_special_ids]
        for skip in (True, False):
            assert fast.decode(with_specials, skip_special_tokens=skip) == \
                auto.decode(with_specials, skip_special_tokens=skip), text
    assert fast(TEXTS, padding=True) == auto(TEXTS, padding=True)


def test_same_chat_template(pair):
    auto, fast = pair
    if auto.chat_template is None:
        assert fast.chat_template is None
        pytest.skip("this model has no chat template")
    for tokenize in (False, True):
        out = auto.apply_chat_template(CHAT, tokenize=tokenize, add_generation_prompt=True)
        assert fast.apply_chat_template(CHAT, tokenize=tokenize, add_generation_prompt=True) == out
    assert "<|im_start|>" in auto.apply_chat_template(CHAT, tokenize=False)


def test_named_folders_do_not_use_autotokenizer(pair, monkeypatch):
    auto, _ = pair

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer used for a named model's converted folder")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tokenizer = models._tokenizer_from.__wrapped__(Path(auto.name_or_path))
    assert type(tokenizer) is type(auto) and tokenizer.encode(TEXTS[0]) == auto.encode(TEXTS[0])


def _fake_folder(folder, tokenizer_class="TokenizersBackend", extra=None):
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    if extra:
        (folder / extra).write_text("{}")
    return folder


@pytest.mark.parametrize("where, tokenizer_class, extra", [
    pytest.param("elsewhere", "TokenizersBackend", None, id="not-a-named-folder"),
    pytest.param("named", "GemmaTokenizer", None, id="other-class"),
    pytest.param("named", "TokenizersBackend", "special_tokens_map.json", id="legacy-file"),
])
def test_other_folders_keep_autotokenizer(tmp_path, monkeypatch, where, tokenizer_class, extra):
    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))
    folder = model_dir(NAMED[EMBEDDED]) if where == "named" else tmp_path / "mine"
    _fake_folder(folder, tokenizer_class, extra)
    assert converted_tokenizer.load(folder) is None
    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: calls.append(path) or "auto")
    assert models._tokenizer_from.__wrapped__(folder) == "auto" and calls == [str(folder)]


def test_a_damaged_tokenizer_file_is_a_model_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))
    folder = _fake_folder(model_dir(NAMED[EMBEDDED]))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vo')
    with pytest.raises(ModelError, match="cannot load the tokenizer"):
        models._tokenizer_from.__wrapped__(folder)


def test_added_tokens_come_from_the_head_of_the_file(tmp_path):
    tokens = [{"id": 7, "content": "<x>", "single_word": False, "lstrip": True, "rstrip": False,
               "normalized": False, "special": True}]
    path = tmp_path / "tokenizer.json"
    # A key order other than the tokenizers library's; a value that may go on past the text read so far.
    path.write_text(json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": tokens, "version": 12}))
    assert {i: t.__getstate__() for i, t in converted_tokenizer.added_tokens(path).items()} == \
        {7: {k: v for k, v in tokens[0].items() if k != "id"}}
    assert converted_tokenizer._top_level_value('{"a": 12', "a", complete=False) is None
    path.write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="added_tokens"):
        converted_tokenizer.added_tokens(path)
