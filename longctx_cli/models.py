"""Finding, converting and loading models: the named offline models (named_models.py), HF folders, hub ids in the
local cache, .gguf files, and random-weight presets of real shapes (speed runs only).

Nothing here touches the network: a hub id must already be in the local HF cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

from longctx_cli.errors import ConfigError, ModelError
from longctx_cli.home import longctx_home
from longctx_cli.named_models import EMBEDDED, NAMED, convert_once, converted_dir, named
from longctx_cli.presets import RANDOM_PRESETS

if TYPE_CHECKING:
    import torch


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    random_weights: bool
    load_s: float
    devices: list[torch.device] = field(default_factory=list)

    @property
    def config(self):
        return self.model.config.get_text_config(decoder=True)

    @property
    def max_context(self) -> int:
        return max_context(self.model.config)


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return longctx_home() / "models" / f"{gguf.stem}-{key}"


def _hub_id(spec: str) -> bool:
    import re

    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", spec) is not None


def _check_model_folder(path: Path, spec: str) -> None:
    """A HF folder must hold a readable config.json and tokenizer files; refused with exit 5 otherwise."""
    import json

    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"{spec} is a folder but has no config.json: not a HF model folder")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelError(f"{config}: not a readable JSON config ({str(exc).splitlines()[0][:120]})") from None
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((path / n).is_file() for n in names):
        raise ModelError(f"{spec} has no tokenizer files ({', '.join(names)}): copy the model's tokenizer into "
                         "the folder")


def resolve_model_dir(spec: str | None, progress=lambda msg: None) -> Path | None:
    """Map a --model value to a local HF folder (None for random presets). Raises ModelError with advice."""
    check_model_spec(spec)
    if (model := named(spec)) is not None:
        return converted_dir(model, progress)
    if spec.startswith("random:"):
        return None
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        from longctx_cli.gguf_convert import convert_gguf

        out = _gguf_cache_dir(path)
        return convert_once(out, lambda: convert_gguf(path, out, progress), progress)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        raise ModelError(
            f"model {spec!r} is not in the local HF cache and longctx never downloads at run time; "
            f"fetch it first: huggingface-cli download {spec}"
        ) from None
    _check_model_folder(folder, spec)
    return folder


def check_model_spec(spec: str | None) -> None:
    """Everything about --model that can be refused without loading or converting anything (exit 5)."""
    if (model := named(spec)) is not None:
        model.check_usable()
        return
    if spec.startswith("random:"):
        if spec[7:] not in RANDOM_PRESETS:
            raise ModelError(f"unknown random preset {spec[7:]!r}; choose one of: {', '.join(RANDOM_PRESETS)}")
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"no such GGUF file: {spec}")
        return
    if path.is_dir():
        _check_model_folder(path, spec)
        return
    if path.exists():
        raise ModelError(f"{spec} is a file, not a model: give a HF model folder, a .gguf file, a cached hub id "
                         "or random:PRESET")
    if _hub_id(spec):
        return  # looked up in the local HF cache when the model is needed
    raise ModelError(f"no such model folder or file: {spec} (expected {', '.join(NAMED)}, a HF folder, a .gguf "
                     "file, a cached hub id such as org/name, or random:PRESET)")


# Model families whose activations exceed float16's range: the logits overflow and the answer comes out empty.
NO_FLOAT16 = ("gemma3", "gemma3_text")


def check_dtype(config, dtype: str, device: str) -> None:
    """Refuse (exit 4) a dtype the model cannot run in, before its weights load."""
    kind = config.get_text_config(decoder=True).model_type
    if dtype == "float16" and (kind in NO_FLOAT16 or config.model_type in NO_FLOAT16):
        raise ConfigError(f"dtype float16: {kind} models overflow in float16 (the answer would come out empty); "
                          "use --dtype bfloat16 or float32")


def quiet_libraries() -> None:
    """No progress bars from transformers / huggingface_hub (loading, GGUF conversion): --quiet, logs, pipes."""
    import huggingface_hub.utils
    import transformers

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def pick_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} asked for, but no CUDA device is available (use device auto or cpu)")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def byte_tokenizer():
    """A byte-level tokenizer (259 ids) for random-weight models: any preset's vocabulary can hold it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    # Sorted: the alphabet comes from a hash set, in a different order in every process.
    vocab.update({ch: i + 3 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def load_tokenizer(spec: str | None, progress=lambda msg: None):
    """The tokenizer alone (fast): lets the CLI count tokens before loading weights. Memoised per process."""
    return _tokenizer_from(resolve_model_dir(spec, progress))


# Keyed by folder, not by the call's arguments: every caller passes a fresh `progress` lambda.
@functools.lru_cache(maxsize=4)
def _tokenizer_from(folder: Path | None):
    if folder is None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    from longctx_cli import converted_tokenizer

    try:
        # A named model's folder loads AutoTokenizer's tokenizer in a third of the time; other folders: AutoTokenizer.
        tokenizer = converted_tokenizer.load(folder)
        return tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"cannot load the tokenizer in {folder}: {str(exc).splitlines()[0][:200]}") from None


def load_config(spec: str | None, progress=lambda msg: None):
    """The model's config without its weights (for token limits and memory plans before loading)."""
    from transformers import AutoConfig

    folder = resolve_model_dir(spec, progress)
    if folder is None:
        params = dict(RANDOM_PRESETS[spec[7:]])
        return AutoConfig.for_model(params.pop("model_type"), **params)
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot read the model's config in {folder}: {str(exc).splitlines()[0][:200]}") from None


def max_context(config) -> int:
    return int(getattr(config.get_text_config(decoder=True), "max_position_embeddings", 0) or 0)


def _random_model(preset: str, device: torch.device, dtype: torch.dtype):
    import torch

    from transformers import AutoModelForCausalLM

    config = load_config(f"random:{preset}")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


_LOADED: dict[tuple, LoadedModel] = {}


def load_model(spec: str | None, *, device: str = "auto", dtype: str = "auto", gpus_model: int | None = None,
               layer_state: list[int] | None = None, tokenizer=None, progress=lambda msg: None) -> LoadedModel:
    """Load weights with accelerate's device_map over the local GPUs (one device on CPU); with gpus_model, the
    layers split in order over that many GPUs (longctx_cli/split.py), balanced by their weights plus
    `layer_state` (the engine's bytes per layer, when known).

    Memoised per process (bench and tests run several engines and documents over one model).
    """
    key = (spec or EMBEDDED, device, dtype, gpus_model)
    if key in _LOADED:
        return dataclasses.replace(_LOADED[key], load_s=0.0)
    _LOADED[key] = _load_model(spec, device, dtype, tokenizer, progress, gpus_model, layer_state)
    return _LOADED[key]


def _load_model(spec, device, dtype, tokenizer, progress, gpus_model=None, layer_state=None) -> LoadedModel:
    from longctx_cli.split import load_split, split_devices

    start = time.perf_counter()
    split = split_devices(gpus_model, device)
    target = pick_device(device)
    torch_dtype = pick_dtype(dtype, target)
    folder = resolve_model_dir(spec, progress)
    if tokenizer is None:
        tokenizer = load_tokenizer(spec) if folder is not None else byte_tokenizer()
    progress("loading weights" if split is None else f"loading weights over {len(split)} GPUs")
    name = spec if folder is None else (named(spec).name if named(spec) is not None else spec)
    if split is not None:
        try:
            model = load_split(load_config(spec), split, torch_dtype, folder, layer_state).eval()
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load model from {folder or spec}: {str(exc).splitlines()[0]}") from None
    elif folder is None:
        model = _random_model(spec[7:], target, torch_dtype)
    else:
        from transformers import AutoModelForCausalLM

        # device_map="auto" spreads layers over every local GPU when --device is plain "auto"/"cuda".
        device_map = "auto" if target.type == "cuda" and target.index is None else {"": target}
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, device_map=device_map)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load model from {folder}: {str(exc).splitlines()[0]}") from None
        model.eval()
    devices = sorted({p.device for p in model.parameters()}, key=str)
    return LoadedModel(model, tokenizer, name, folder is None, time.perf_counter() - start, devices)
