"""Convert a GGUF checkpoint once into a plain HF folder (safetensors + tokenizer files).

transformers can load a GGUF directly, but it dequantises on every load (~50 s for Gemma 3 270M on 2 cores)
and refuses `save_pretrained` on the result. We detach the GGUF quantizer and save an fp32 copy that reloads
in about a second.

The tokenizer needs its own path: transformers turns a SentencePiece-BPE GGUF vocabulary ("llama" tokenizer
model without merges, as Gemma 3 ships it) into a Unigram model, which segments text differently from the
original tokenizer ("capital" -> 4 pieces instead of one token). We rebuild the BPE instead: SentencePiece
BPE merges the adjacent pair whose concatenation has the highest score, so every way of splitting a vocabulary
entry into two entries is a merge ranked by that entry's score (transformers' `generate_merges`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

# GGUF token types (llama.cpp): 1 normal, 3 control, 4 user-defined, 6 byte.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _string_array(reader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _number_array(reader, key: str) -> np.ndarray:
    field = reader.fields[key]
    return np.concatenate([field.parts[i] for i in field.data])


def _scalar(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def spm_bpe_tokenizer(gguf_path: Path):
    """A PreTrainedTokenizerFast rebuilt from a GGUF's SentencePiece-BPE vocabulary and scores.

    Returns None when the GGUF's tokenizer is not of that kind (transformers' own conversion is right then).
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    reader = gguf.GGUFReader(str(gguf_path))
    if _scalar(reader, "tokenizer.ggml.model") != "llama" or "tokenizer.ggml.merges" in reader.fields:
        return None
    tokens = _string_array(reader, "tokenizer.ggml.tokens")
    scores = _number_array(reader, "tokenizer.ggml.scores")
    types = _number_array(reader, "tokenizer.ggml.token_type")
    vocab = {tok: i for i, tok in enumerate(tokens)}

    regular = {tok for i, tok in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    merges = generate_merges(vocab, {tok: float(scores[i]) for i, tok in enumerate(tokens)},
                             skip_tokens=set(tokens) - regular)

    unk = tokens[_scalar(reader, "tokenizer.ggml.unknown_token_id", 0)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token=unk))
    prefix = [normalizers.Prepend("▁")] if _scalar(reader, "tokenizer.ggml.add_space_prefix", False) else []
    backend.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for i, tok in enumerate(tokens) if types[i] == _CONTROL]
    )
    special = {}
    for role in ("bos", "eos", "unknown", "padding"):
        idx = _scalar(reader, f"tokenizer.ggml.{role}_token_id")
        if idx is not None:
            special[{"unknown": "unk", "padding": "pad"}.get(role, role) + "_token"] = tokens[idx]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


MANIFEST = "longctx.json"


@contextlib.contextmanager
def _one_parse():
    """Within a conversion, every `gguf.GGUFReader(path)` of one file returns the same reader, and transformers'
    metadata-only `load_gguf_checkpoint` of one file is parsed once.

    Parsing a GGUF's metadata is the slow part of a conversion (millions of small numpy reads for a 262K-token
    vocabulary: ~30 s on 2 cores), and transformers parses the file anew for the config, for the weights and for
    the tokenizer; the reader is a read-only memory map, so one parse serves them all. Its metadata-only load then
    turns every field into Python values (~6 s for Qwen's 151K tokens and merges) three times (two configs, the
    tokenizer): each caller gets a copy of the first.
    """
    import copy

    import gguf
    from transformers import configuration_utils, modeling_gguf_pytorch_utils, tokenization_utils_tokenizers
    from transformers.models.auto import tokenization_auto

    original = gguf.GGUFReader
    readers, loads = {}, {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    load = modeling_gguf_pytorch_utils.load_gguf_checkpoint

    def metadata_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load(path, return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in loads:
            loads[key] = load(path, False)
        return copy.deepcopy(loads[key])

    # The modules that import the function by name (the weights' loader imports it at call time, with tensors).
    users = (configuration_utils, tokenization_utils_tokenizers, tokenization_auto)
    own = [module.load_gguf_checkpoint for module in users]
    gguf.GGUFReader = shared
    for module in users:
        module.load_gguf_checkpoint = metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader = original
        for module, function in zip(users, own):
            module.load_gguf_checkpoint = function


def convert_gguf(gguf_path: Path, out_dir: Path, progress=lambda msg: None) -> Path:
    """Write `out_dir` (config, fp32 safetensors, tokenizer) from `gguf_path`; atomic: a crash leaves nothing.

    The folder's manifest (written last) records a fingerprint of every file, which `check_converted` verifies
    before each use.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longctx_cli.home import atomic_folder, file_digest

    with atomic_folder(out_dir) as tmp, _one_parse():
        progress("converting the tokenizer")
        tokenizer = spm_bpe_tokenizer(gguf_path)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(tmp)
        progress("dequantising the weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # transformers refuses to serialise a model that still carries its GGUF quantizer; the weights are
        # already dequantised, so detaching it is lossless.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        progress("writing safetensors")
        model.save_pretrained(tmp)
        files = {f.name: file_digest(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"source": str(gguf_path), "converted_by": "longctx",
                                                "files": files}))
    return out_dir


def check_converted(out_dir: Path) -> str | None:
    """None when `out_dir` is a complete, intact conversion; otherwise what is wrong with it (one phrase)."""
    from longctx_cli.home import file_digest

    try:
        manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
    except FileNotFoundError:
        return "not converted yet" if not out_dir.exists() else "conversion incomplete (no manifest)"
    except KeyError:
        return "converted by an older longctx (no file fingerprints)"
    except (OSError, ValueError, TypeError):
        return "damaged manifest"
    for name, digest in files.items():
        path = out_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if file_digest(path) != digest:
            return f"{name} is damaged (truncated or overwritten)"
    return None
