"""Read once, ask many for `sas-pattern`: the rows a question may overwrite, kept and put back, and the whole
compacted cache (with its plans) as tensors for the saved-state store.

The cache is bounded by the pattern, not the document; a question's tokens land in the slots the plan gives
them (ring slots a document key may still occupy), enter the H2O pool, and pass through the staging row. A
checkpoint keeps exactly those rows (`SasLayer.rows_ahead`). A saved state holds every layer's rows and the
plans' tables, so reading it back analyses nothing (an analysis takes seconds at 128K tokens).
"""

from __future__ import annotations

import torch

from engines.positions import scalars, set_scalars
from engines.sas.analyzer import adopt_plan
from engines.sas.cache import SasCache

_BUFFERS = ("keys", "values", "key_pos", "score")
_PLAN_TABLES = ("slot_of", "last", "enters_pool")


@torch.inference_mode()
def checkpoint(cache: SasCache, position: int) -> list:
    kept = []
    for layer in cache.layers:
        rows = layer.rows_ahead(position)
        kept.append((rows, [buf.index_select(2, rows) for buf in layer.buffers()]))
    return kept


@torch.inference_mode()
def restore(cache: SasCache, kept: list) -> None:
    for layer, (rows, saved) in zip(cache.layers, kept):
        for buf, rows_saved in zip(layer.buffers(), saved):
            buf.index_copy_(2, rows, rows_saved)
        layer.key_pos[:, :, layer.staging + 1:] = -1


@torch.inference_mode()
def export(cache: SasCache) -> tuple[dict, dict]:
    """Every layer's rows (copies: answers overwrite rows in place) and each distinct plan's tables (host)."""
    tensors, plans = {}, {}
    for i, layer in enumerate(cache.layers):
        for name, buf in zip(_BUFFERS, layer.buffers()):
            tensors[f"layers.{i}.{name}"] = buf.clone()
        plan = layer.plan
        if str(plan.pattern) not in plans:
            j = len(plans)
            plans[str(plan.pattern)] = {"index": j, "static_slots": plan.static_slots,
                                        "dynamic_slots": plan.dynamic_slots, "n": plan.n}
            for name in _PLAN_TABLES:
                tensors[f"host.plans.{j}.{name}"] = getattr(plan, name)
    return tensors, {"plans": plans, "positions": scalars(cache)}


def adopt_plans(patterns: set, tensors: dict, meta: dict) -> None:
    """Hand the saved plans of these patterns to the analyzer, so that the cache made next uses them."""
    for pattern in patterns:
        saved = meta["plans"].get(str(pattern))
        if saved is not None:
            j = saved["index"]
            adopt_plan(pattern, saved["n"], saved["static_slots"], saved["dynamic_slots"],
                       *(tensors[f"host.plans.{j}.{name}"] for name in _PLAN_TABLES))


@torch.inference_mode()
def load(cache: SasCache, tensors: dict, meta: dict, device_of) -> None:
    """Fills a fresh cache (made with the same plans) from `export`'s output."""
    set_scalars(cache, meta.get("positions"))
    for i, layer in enumerate(cache.layers):
        keys = tensors[f"layers.{i}.keys"].to(device_of(i))
        layer.lazy_initialization(keys, tensors[f"layers.{i}.values"])
        for name, buf in zip(_BUFFERS, layer.buffers()):
            saved = tensors[f"layers.{i}.{name}"]
            if saved.shape != buf.shape:
                raise ValueError(f"saved layer {i} {name} has shape {tuple(saved.shape)}, the plan {tuple(buf.shape)}")
            buf.copy_(saved)
