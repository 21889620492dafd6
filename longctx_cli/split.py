"""A model split over several local GPUs (`--gpus-model N`): decoder layers in order, one contiguous run per device.

The split is an explicit `{module name: device}` map that accelerate dispatches (its hooks move the hidden state
from one device to the next): the embeddings and the rotary embedding on the first device, the final norm and the
LM head on the last (with tied embeddings the LM head stays with them: one copy of the weights). Layer sizes come
from accelerate's `compute_module_sizes` on a meta-device model (nothing allocated); the runs are chosen to
minimise the largest device's share of its memory, counting each layer's weights plus the engine's state for that
layer (`layer_state_bytes`), so that KV caches, descriptors and rings sit with their layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from longctx_cli.errors import ConfigError


@dataclass
class Split:
    """devices[d] holds decoder layers layers[d] (a range) and `weights[d]` + `state[d]` bytes."""

    devices: list[str]
    layers: list[range]
    weights: list[int]
    state: list[int]
    device_map: dict[str, str]

    def device_of_layer(self, index: int) -> str:
        return next(d for d, run in zip(self.devices, self.layers) if index in run)


def meta_model(config):
    """The model with every tensor on the meta device: names and sizes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def model_parts(model) -> dict:
    """Qualified names: `layers` (the decoder layers, in order), `first` (what runs before them), `last` (after)."""
    names = {id(m): n for n, m in model.named_modules()}
    decoder = model.get_decoder()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    first, last = [names[id(embed)]], []
    for child in decoder.children():
        if child is decoder.layers or child is embed:
            continue
        # The rotary embedding feeds every layer from the start; the final norm comes after them.
        (first if "rotary" in type(child).__name__.lower() else last).append(names[id(child)])
    decoder_name = names[id(decoder)]
    for name, child in model.named_children():
        if name != decoder_name and child is not head:
            first.append(name)  # e.g. a vision tower, which runs before the language model
    if head is not None:
        (first if tied else last).append(names[id(head)])
    prefix = names[id(decoder.layers)]
    return {"layers": [f"{prefix}.{i}" for i in range(len(decoder.layers))], "first": first, "last": last}


def _parts_and_sizes(model, dtype: torch.dtype) -> tuple[dict, dict]:
    from accelerate.utils import compute_module_sizes

    return model_parts(model), compute_module_sizes(model, dtype=dtype)


_SIZES: dict[tuple, tuple[dict, dict]] = {}


def _named_sizes(config, dtype: torch.dtype) -> tuple[dict, dict]:
    """model_parts and module sizes of `config`'s model, memoised (`plan` asks for many lengths)."""
    key = (config.to_json_string(), str(dtype))
    if key not in _SIZES:
        _SIZES[key] = _parts_and_sizes(meta_model(config), dtype)
    return _SIZES[key]


def _runs(load: list[int], first: int, last: int, capacity: list[float]) -> list[range]:
    """Contiguous runs of layers, one per device (each at least one layer), minimising the sum over devices of
    bytes**2 / capacity: every device at the same fraction of its capacity where the layers allow, and the others
    even where one device's share is fixed by what it must hold (a large embedding). `first` and `last` are the
    fixed bytes of the first and last devices."""
    n, k = len(load), len(capacity)
    prefix = [0]
    for x in load:
        prefix.append(prefix[-1] + x)

    def cost(d: int, lo: int, hi: int) -> float:
        fixed = (first if d == 0 else 0) + (last if d == k - 1 else 0)
        return (fixed + prefix[hi] - prefix[lo]) ** 2 / capacity[d]

    inf = float("inf")
    # best[d][i]: the least sum for layers [0, i) on devices [0, d]; cut[d][i]: where d starts.
    best = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, 0, i)
    for d in range(1, k):
        for i in range(d + 1, n + 1):
            for j in range(d, i):
                value = best[d - 1][j] + cost(d, j, i)
                if value < best[d][i]:
                    best[d][i], cut[d][i] = value, j
    bounds, i = [n], n
    for d in range(k - 1, 0, -1):
        i = cut[d][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[d], bounds[d + 1]) for d in range(k)]


def layer_split(config, devices: list[str], dtype: torch.dtype, layer_state: list[int] | None = None,
                memory: list[int] | None = None, model=None) -> Split:
    """The decoder layers of `config` over `devices`, in order. layer_state: the engine's bytes per layer (default
    none); memory: each device's usable bytes (default equal). model: an instance to name (default a meta one)."""
    parts, sizes = _named_sizes(config, dtype) if model is None else _parts_and_sizes(model, dtype)
    n = len(parts["layers"])
    if len(devices) > n:
        raise ConfigError(f"--gpus-model {len(devices)}: the model has {n} decoder layers, fewer than the devices")
    state = layer_state or [0] * n
    load = [sizes[name] + s for name, s in zip(parts["layers"], state)]
    first, last = (sum(sizes[name] for name in parts[key]) for key in ("first", "last"))
    runs = _runs(load, first, last, [float(m) for m in memory] if memory else [1.0] * len(devices))
    device_map = {name: devices[0] for name in parts["first"]}
    weights, states = [], []
    for device, run in zip(devices, runs):
        device_map.update({parts["layers"][i]: device for i in run})
        weights.append(sum(sizes[parts["layers"][i]] for i in run))
        states.append(sum(state[i] for i in run))
    device_map.update({name: devices[-1] for name in parts["last"]})
    weights[0] += first
    weights[-1] += last
    return Split(list(devices), runs, weights, states, device_map)


def one_layer_config(config, layer_type: str):
    """`config` with a single decoder layer of `layer_type`: an engine's memory plan of it is that layer's state
    (every engine's plan is a sum over layers)."""
    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = [layer_type]
    return config


def layer_state_bytes(engine_cls, config, n_tokens: int, dtype_bytes: int, engine_config, *, chunk_size: int,
                      reserve: int) -> list[int]:
    """The engine's state bytes per decoder layer for a document of n_tokens (question and answer included)."""
    from engines.cache import layer_types

    per_type = {t: engine_cls.memory_plan(one_layer_config(config, t), n_tokens, dtype_bytes, engine_config,
                                          chunk_size=chunk_size, reserve=reserve)
                for t in set(layer_types(config))}
    return [per_type[t] for t in layer_types(config)]


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus_model(gpus_model: int | None, device: str, ranks: int = 1) -> None:
    """Refuse (exit 4) a split the machine or the run cannot take, before anything loads."""
    if gpus_model is None or gpus_model == 1:
        return
    if ranks > 1:
        raise ConfigError(f"--gpus-model {gpus_model} splits one model copy over GPUs; star's --gpus {ranks} runs one "
                          "copy per GPU: use one of them")
    if device == "cpu" or device.startswith("cuda:"):
        raise ConfigError(f"--gpus-model {gpus_model} spreads the model over GPUs 0..{gpus_model - 1}; it takes "
                          f"--device auto or cuda, not {device}")
    if gpus_model > (seen := visible_gpus()):
        raise ConfigError(f"--gpus-model {gpus_model}: only {seen} GPU{'s' * (seen != 1)} visible")


def split_devices(gpus_model: int | None, device: str) -> list[str] | None:
    """The GPUs a run splits the model over (None: one device, as --device says)."""
    if gpus_model is None or gpus_model == 1:
        return None
    check_gpus_model(gpus_model, device)
    return [f"cuda:{i}" for i in range(gpus_model)]


def materialise(model, device_map: dict[str, str]) -> None:
    """Give a meta-device model (random presets) storage where `device_map` puts each module, drawn as
    transformers initialises a fresh model: a 70B model never exists whole on one device."""
    for name, device in device_map.items():
        model.get_submodule(name).to_empty(device=device)
    # The meta instance was marked initialised; its tensors are fresh storage now.
    for item in [*model.modules(), *model.parameters(), *model.buffers()]:
        if getattr(item, "_is_hf_initialized", False):
            item._is_hf_initialized = False
    model.initialize_weights()


def dispatch(model, device_map: dict[str, str]):
    """accelerate's hooks on `model` (already where `device_map` says): each module's inputs move to its device.
    Hooks are forced when every entry names one device, so that a CPU run takes the same path."""
    from accelerate import dispatch_model

    return dispatch_model(model, device_map, force_hooks=True,
                          skip_keys=getattr(model, "_skip_keys_device_placement", None))


def free_memory(devices: list[str]) -> list[int]:
    """Each CUDA device's free bytes now (what a split is balanced against)."""
    return [torch.cuda.mem_get_info(torch.device(d))[0] for d in devices]


def load_split(config, devices: list[str], dtype: torch.dtype, folder=None, layer_state: list[int] | None = None):
    """The model split over `devices` (longctx_cli/models.py's loader for --gpus-model): a HF folder's weights
    read straight onto their devices, or a random preset's drawn there."""
    from transformers import AutoModelForCausalLM

    split = layer_split(config, devices, dtype, layer_state, free_memory(devices))
    if folder is not None:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, device_map=split.device_map)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    materialise(model, split.device_map)
    return dispatch(model, split.device_map)
