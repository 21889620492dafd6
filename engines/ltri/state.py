"""Read once, ask many for `ltri-stream`: what a question may change, kept and put back, and the whole state
as tensors and scalars for the saved-state store.

A question is the last prefill chunk: it retrieves blocks into the slots, adds votes, may push blocks out of
the window into context memory (and index them); its answer appends to the window. A checkpoint therefore
keeps, per layer, the retrieval slots and the window rows in use (bounded by the profile, not the document),
the rows' positions and votes, the window's bookkeeping and how many blocks and index vectors were stored (the
stores only append, so they are cut back). The saved state holds the same plus the context memory and the
index vectors; the context memory stays in host memory when read back (`host.` tensors).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from engines.ltri.cache import LtriCache, LtriLayer
from engines.positions import scalars as position_scalars
from engines.positions import set_scalars as set_position_scalars

_MEMORY = ("keys", "values", "scales")
_INDEX = ("vectors", "block", "offset")


def _stores(layer: LtriLayer) -> list:
    """A retrieving layer's append-only stores: context memory slabs (host) and index vectors (device)."""
    if not layer.retrieve:
        return []
    return layer.memory.slabs() + [getattr(layer.index, name) for name in _INDEX]


def _scalars(layer: LtriLayer) -> dict:
    return {"local_len": layer.local_len, "local_start": layer.local_start, "slots": list(layer.slots),
            "peak_rows": layer.peak_rows, "shift": int(layer.shift.item())}


def _set_scalars(layer: LtriLayer, values: dict) -> None:
    layer.local_len, layer.local_start = values["local_len"], values["local_start"]
    layer.slots, layer.peak_rows = list(values["slots"]), values["peak_rows"]
    layer.shift.fill_(values["shift"])
    if layer.retrieve:
        layer.order_slots()
        layer.tally.zero_()  # the stats put back (`_set_cache_scalars`) were settled when kept


def _cache_scalars(cache: LtriCache) -> dict:
    cache.settle()
    return {"filled": cache.filled, "lams": dict(cache.lams), "lam_samples": copy.deepcopy(cache.lam_samples),
            "stats": dict(cache.stats),
            "positions": position_scalars(cache)}


def _set_cache_scalars(cache: LtriCache, values: dict) -> None:
    cache.filled, cache.stats = values["filled"], dict(values["stats"])
    set_position_scalars(cache, values["positions"])
    cache.lams = {int(k): v for k, v in values["lams"].items()}
    cache.lam_samples = {int(k): [tuple(x) for x in v] for k, v in values["lam_samples"].items()}


@torch.inference_mode()
def checkpoint(cache: LtriCache) -> list:
    """What the next question and answer may change; O(retrieval slots + window) per layer."""
    kept = []
    for layer in cache.layers:
        if not layer.is_initialized:
            kept.append(None)
            continue
        hi = layer.local0 + layer.local_len
        rows = (layer.keys[:, :, layer.n_init:hi].clone(), layer.values[:, :, layer.n_init:hi].clone(),
                layer.key_pos.clone(), layer.votes.clone())
        kept.append((rows, _scalars(layer), dict(layer.pending), [store.n for store in _stores(layer)]))
    return [kept, _cache_scalars(cache)]


@torch.inference_mode()
def restore(cache: LtriCache, kept: list) -> None:
    layers, scalars = kept
    for layer, saved in zip(cache.layers, layers):
        if saved is None:
            continue
        (keys, values, key_pos, votes), values_, pending, counts = saved
        lo = layer.n_init
        layer.keys[:, :, lo:lo + keys.shape[2]] = keys
        layer.values[:, :, lo:lo + values.shape[2]] = values
        layer.key_pos.copy_(key_pos)
        layer.votes.copy_(votes)
        _set_scalars(layer, values_)
        layer.pending = dict(pending)
        for store, n in zip(_stores(layer), counts):
            store.n = n
    _set_cache_scalars(cache, scalars)


@torch.inference_mode()
def export(cache: LtriCache) -> tuple[dict, dict]:
    """Every layer's rows, context memory (host) and index vectors; the scalars as JSON values."""
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            layers.append(None)
            continue
        if layer.device.type == "cuda":
            torch.cuda.synchronize(layer.device)  # evicted blocks reach host memory by asynchronous copies
        for name in ("keys", "values", "key_pos", "votes"):
            tensors[f"layers.{i}.{name}"] = getattr(layer, name).clone()
        if layer.retrieve:
            # The stores only append: their blocks and vectors stay as they are (no copy of the context memory).
            for name, tensor in zip(_MEMORY, layer.memory.stored()):
                tensors[f"host.layers.{i}.memory.{name}"] = tensor
            for name in _INDEX:
                tensors[f"layers.{i}.index.{name}"] = getattr(layer.index, name).used
            if layer.summary_keys is not None:
                n = layer.memory.n_blocks
                tensors[f"layers.{i}.summary_keys"] = layer.summary_keys[:, :, :n].clone()
                tensors[f"layers.{i}.summary_values"] = layer.summary_values[:, :, :n].clone()
        pending = {str(b): spans.tolist() for b, spans in layer.pending.items()}  # [start, end, score, confidence]
        layers.append({**_scalars(layer), "pending": pending})
    return tensors, {"layers": layers, "cache": _cache_scalars(cache)}


@torch.inference_mode()
def load(cache: LtriCache, tensors: dict, meta: dict, device_of) -> None:
    """Fills a fresh cache (made for the same document and settings) from `export`'s output. device_of(i): the
    device of layer i."""
    cache.memory_blocks = 16
    for i, (layer, values) in enumerate(zip(cache.layers, meta["layers"])):
        if values is None:
            continue
        keys = tensors[f"layers.{i}.keys"].to(device_of(i))
        layer.lazy_initialization(keys, tensors[f"layers.{i}.values"])
        for name in ("keys", "values", "key_pos", "votes"):
            saved, buf = tensors[f"layers.{i}.{name}"], getattr(layer, name)
            if saved.shape != buf.shape:
                raise ValueError(f"saved layer {i} {name} has shape {tuple(saved.shape)}, the cache "
                                 f"{tuple(buf.shape)}")
            buf.copy_(saved)
        if layer.retrieve:
            # The context memory is used where it was read into (host memory), not copied into pinned slabs.
            layer.memory.adopt(*(tensors[f"host.layers.{i}.memory.{name}"] for name in _MEMORY
                                 if f"host.layers.{i}.memory.{name}" in tensors))
            for name in _INDEX:
                store = getattr(layer.index, name)
                store.n = 0
                store.append(tensors[f"layers.{i}.index.{name}"].to(store.device))
            if layer.summary_keys is not None:
                for name in ("summary_keys", "summary_values"):
                    saved = tensors[f"layers.{i}.{name}"]
                    getattr(layer, name)[:, :, :saved.shape[2]] = saved
        _set_scalars(layer, values)
        layer.pending = {int(b): np.array(spans, dtype=np.float64).reshape(-1, 4)
                         for b, spans in values["pending"].items()}
    _set_cache_scalars(cache, meta["cache"])
