"""`sas-pattern`: SAS, the sparse attention synthesizer (a pattern language compiled into cache plans and kernels).

A profile's `pattern` (engines/sas/pattern.py) says which keys each query sees. Before prefill the analyzer
(engines/sas/analyzer.py) sizes a compacted KV cache for the whole sequence (document + question + answer)
and hands out its slots; every layer then keeps only the keys its pattern can still reach (engines/sas/cache.py).
Gemma-style sliding-window layers keep their own window exactly, as a Diag(window=w) pattern of their own.

- Prefill, per chunk: the chunk's K/V go to staging rows, its queries attend to [compacted cache | chunk] under
  the pattern (FlexAttention with a block mask built from the pattern on GPU, SDPA with the explicit mask on
  CPU and for chunks of fewer than 128 tokens), then the keys still needed move to their slots.
- Decode: the new key goes to its slot, and the split-KV decode kernel reads the compacted cache, masking each
  row by the pattern at the row's key position. On GPU the pattern is generated into the kernel as a Triton
  function (engines/sas/codegen.py, the paper's code generation): no mask kernel, no host sync, inside the
  CUDA graph. H2O layers compute the mask once (their scores need it too) and pass it as flags.
- Dynamic (H2O): attention probabilities (from the kernel's log-sum-exp) accumulate per key; keys the static
  part lets go of compete for the pool by accumulated score (top-k, on the device). In prefill the pool is
  updated once per chunk (not per token); `pool(w)` smooths a chunk's scores over neighbouring keys.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engines.base import DocumentState, Engine, EngineInputError
from engines.config import SasConfig
from engines.cache import kv_token_bytes, layer_types
from engines.explicit import score_slices
from engines.sas.analyzer import CachePlan, adopt_plan, describe_index, plan_cache
from engines.sas.cache import SasCache, SasLayer
from engines.sas.codegen import triton_visible
from engines.sas.flex import flex_prefill
from engines.sas.parse import parse_pattern
from engines.sas.pattern import Diag, Pattern
from kernels.decode_attention import PositionMask, PositionRule, decode_attention, decode_backend

# Below this many queries a chunk runs the SDPA path (FlexAttention's query tile is 128).
_FLEX_MIN_QUERIES = 128
_EXACT_UP_TO = 65536  # plans (memory, roofline) analyse exactly up to this many tokens
ROOM_GRAIN = 256  # question + answer room, in tokens, is planned in multiples of this


def _rows_visible(static: Pattern, area: Pattern | None, q_pos: torch.Tensor, key_pos: torch.Tensor,
                  in_pool: torch.Tensor) -> torch.Tensor:
    """The pattern over a layer's rows: static rows by the static part, pool rows by the dynamic area."""
    mask = static.visible(q_pos, key_pos)
    if area is not None:
        mask = torch.where(in_pool, area.visible(q_pos, key_pos), mask)
    return mask


def _parts(plan: CachePlan) -> tuple[Pattern, Pattern | None]:
    return plan.static, (plan.area if plan.dynamic is not None else None)


def visible(layer: SasLayer, q_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    return _rows_visible(*_parts(layer.plan), q_pos, key_pos, layer.in_pool[: key_pos.shape[-1]])


@functools.cache
def _position_rule(static: Pattern, triton: bool, kernel_dir: Path | None) -> PositionRule:
    """A static layer's decode mask, evaluated inside the decode kernel (generated Triton on GPU, its module
    kept in kernel_dir)."""
    return PositionRule(static.visible, triton_visible(static, kernel_dir) if triton else None)


@functools.cache
def _slot_mask(static: Pattern, area: Pattern | None, cuda: bool):
    """An H2O layer's decode mask over the rows. On GPU the pattern's dozen elementwise ops are compiled into
    one kernel: eager they cost 15-50 us per layer and step (measured on an H100), more than the attention.
    Keyed by the patterns (equal across documents), so a new document reuses the compiled kernel."""
    fn = functools.partial(_rows_visible, static, area)
    return torch.compile(fn, fullgraph=True, dynamic=False) if cuda else fn


def _refresh_selection(layer: SasLayer, width: int) -> torch.Tensor:
    """refresh=true: [B, Hkv, width] True except for pool rows outside the top `budget` by score."""
    keep = torch.ones(*layer.score.shape[:2], width, dtype=torch.bool, device=layer.device)
    pool = layer.score[:, :, layer.static:layer.staging]
    if layer.pool > layer.dynamic.budget:
        top = pool.topk(layer.dynamic.budget, dim=-1).indices
        chosen = torch.zeros_like(pool, dtype=torch.bool).scatter_(-1, top, True)
        keep[:, :, layer.static:layer.staging] = chosen
    return keep


def _reduce_heads(p: torch.Tensor, how: str) -> torch.Tensor:
    """p: [B, Hkv, G, ...] -> [B, Hkv, ...] over the query heads that share a KV head."""
    return p.amax(dim=2) if how == "max" else (p.mean(dim=2) if how == "mean" else p.sum(dim=2))


def _prefill_reference(layer, query, key, value, scaling, offset):
    """SDPA with the explicit mask (H2O layers: softmax formed here, probabilities accumulated into scores)."""
    B, Hq, T, D = query.shape
    group = Hq // key.shape[1]
    width = layer.staging + T
    q_pos = torch.arange(offset, offset + T, device=query.device)[:, None]
    heads = layer.key_pos if layer.dynamic is not None else layer.key_pos[:, :1]
    mask = visible(layer, q_pos, heads[:, :, None, :width])  # [B, Hkv or 1, T, width]
    if layer.dynamic is not None and layer.dynamic.refresh:
        mask = mask & _refresh_selection(layer, width)[:, :, None]
    k, v = key[:, :, :width], value[:, :, :width]
    if layer.dynamic is None:
        with _without_cudnn(query):
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, enable_gqa=group > 1)
        return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    out = torch.empty_like(query)
    gained = torch.zeros(B, k.shape[1], width, dtype=torch.float32, device=query.device)
    for lo, t, _, s in score_slices(query, k, scaling, lambda lo, t: mask[:, :, None, lo:lo + t]):
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[:, :, lo:lo + t] = torch.matmul(p, v.float()[:, :, None]).view(B, Hq, t, D).to(query.dtype)
        gained += _reduce_heads(p, layer.dynamic.reduce).sum(dim=-2)
    _gain(layer, gained, T)
    return out


def _without_cudnn(query):
    """SDPA without its cuDNN backend: cuDNN builds an execution plan per new shape (over a second on an H100),
    and every question has a length of its own; the memory-efficient kernel takes any mask without a plan."""
    if not query.is_cuda:
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _gain(layer: SasLayer, gained: torch.Tensor, n_staged: int) -> None:
    """Add a chunk's (or step's) attention to the rows' scores; pool(w) smooths the chunk's own keys."""
    w = layer.dynamic.pool
    if w > 1 and n_staged > 1:
        staged = gained[:, :, layer.staging:layer.staging + n_staged]
        gained[:, :, layer.staging:layer.staging + n_staged] = F.max_pool1d(staged, w, stride=1, padding=w // 2)
    layer.score[:, :, : gained.shape[-1]] += gained


def admit(layer: SasLayer, candidates: torch.Tensor, offset: int | None) -> None:
    """Candidates [W] (key positions, -1 = none) compete with the pool; the pool keeps the best `budget`."""
    valid = candidates >= 0
    src = torch.where(valid, layer.rows_of(candidates, offset), layer.trash)
    if layer.dynamic.refresh:
        dst = torch.where(valid, layer.static + layer.pool_rank[candidates.clamp(min=0)], layer.trash)
        for buf in layer.buffers():
            buf.index_copy_(2, dst, buf.index_select(2, src))
    else:
        pool_rows = torch.arange(layer.static, layer.staging, device=layer.device)
        union_rows = torch.cat([pool_rows, src])  # [P + W]
        score = layer.score.index_select(2, union_rows)
        score[:, :, pool_rows.numel():] = score[:, :, pool_rows.numel():].masked_fill(~valid, float("-inf"))
        top_score, top = score.topk(layer.pool, dim=-1)  # [B, Hkv, P]
        rows = union_rows[top]
        for buf in (layer.keys, layer.values):
            picked = torch.gather(buf, 2, rows[..., None].expand(-1, -1, -1, buf.shape[-1]))
            buf[:, :, layer.static:layer.staging] = picked
        positions = torch.gather(layer.key_pos, 2, rows)
        layer.key_pos[:, :, layer.static:layer.staging] = torch.where(top_score > float("-inf"), positions, -1)
        layer.score[:, :, layer.static:layer.staging] = top_score
    layer.key_pos[:, :, layer.trash] = -1


def _decode(layer: SasLayer, query, key, value, scaling, cache: SasCache):
    """One token over the compacted cache: rows [0, staging] (the staging row may hold this very key)."""
    pos = cache.position_on(query.device)
    width = layer.staging + 1
    if layer.dynamic is None:
        triton = decode_backend(query.device).startswith("triton")
        rule = _position_rule(layer.plan.static, triton, cache.kernel_dir)
        mask = PositionMask(rule, layer.key_pos[:, :1, :width], pos.expand(query.shape[0]).contiguous())
        out = decode_attention(query[:, :, 0], key[:, :, :width], value[:, :, :width], layer.decode_rows,
                               scale=scaling, mask=mask)
        return out.unsqueeze(1)
    # H2O: the mask is needed twice (attention, then the scores), so it is formed once as flags.
    mask = _slot_mask(*_parts(layer.plan), query.is_cuda)(pos.view(1, 1, 1), layer.key_pos[:, :, :width],
                                                          layer.in_pool[:width])
    if layer.dynamic.refresh:
        mask = mask & _refresh_selection(layer, width)
    mask = mask.expand(key.shape[0], key.shape[1], width).contiguous()
    out, lse = decode_attention(query[:, :, 0], key[:, :, :width], value[:, :, :width], layer.decode_rows,
                                scale=scaling, mask=mask, return_lse=True)
    B, Hq, D = out.shape
    q = query[:, :, 0].float().view(B, key.shape[1], Hq // key.shape[1], 1, D)
    s = torch.matmul(q, key[:, :, :width].float()[:, :, None].transpose(-1, -2))[..., 0, :] * scaling
    p = torch.exp(s - lse.view(B, key.shape[1], -1, 1)).masked_fill(~mask[:, :, None], 0.0)
    _gain(layer, _reduce_heads(p, layer.dynamic.reduce), 1)
    if layer.enter_keys.numel():
        idx = layer.enter_start[pos + 1] + torch.arange(layer.enter_width, device=pos.device)
        ok = idx < layer.enter_start[pos + 2]
        admit(layer, torch.where(ok, layer.enter_keys[idx.clamp(max=layer.enter_keys.numel() - 1)], -1), None)
    return out.unsqueeze(1)


def _layer_patterns(model_config, config: SasConfig) -> list:
    """Per decoder layer, the pattern it runs: the profile's, or the model's own window on sliding layers."""
    window = getattr(model_config.get_text_config(decoder=True), "sliding_window", None)
    pattern = parse_pattern(config.pattern)
    return [Diag(window=window) if t == "sliding_attention" else pattern for t in layer_types(model_config)]


def plan_capacity(n_document: int, reserve: int) -> int:
    """The sequence length a document's plans are made for: room for the question and the answer, rounded up
    so that later questions of other lengths find the same plans (and the same saved state)."""
    return n_document + -(-max(reserve, 1) // ROOM_GRAIN) * ROOM_GRAIN


def _staging_rows(chunk_size: int, capacity: int) -> int:
    """Rows a prefill chunk's own K/V take before they move to their slots."""
    return min(chunk_size, capacity)


def cache_slots(pattern, n: int) -> int:
    """Cache rows for n tokens; past 64K tokens extrapolated linearly from 32K and 64K (exact for bounded
    patterns, whose size stops growing, and for those that grow linearly), so that plans stay cheap."""
    if n <= _EXACT_UP_TO:
        return plan_cache(pattern, n).slots
    a, b = plan_cache(pattern, _EXACT_UP_TO // 2).slots, plan_cache(pattern, _EXACT_UP_TO).slots
    return min(n, b + (b - a) * (n - _EXACT_UP_TO) // (_EXACT_UP_TO // 2))


class SasEngine(Engine):
    name = "sas-pattern"
    Config = SasConfig

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        layer = longctx.layers[module.layer_idx]
        if longctx.decoding:
            return _decode(layer, query, key, value, scaling, longctx), None
        offset, t = longctx.offset, query.shape[2]
        if query.is_cuda and t >= _FLEX_MIN_QUERIES and layer.dynamic is None:
            out = flex_prefill(layer, query, key, value, scaling, offset)
        else:
            out = _prefill_reference(layer, query, key, value, scaling, offset)
        if layer.dynamic is not None:
            admit(layer, layer.enter_keys[layer.enter_start[offset + 1]:layer.enter_start[offset + t + 1]], offset)
        layer.commit_chunk(offset, t)
        return out.transpose(1, 2), None

    def layer_patterns(self) -> list:
        return _layer_patterns(self.model.config, self.config)

    @classmethod
    def check(cls, model_config, engine_config, run, n_tokens: int | None = None, reserve: int = 0) -> None:
        """A pattern that gives no query any key would answer from zero attention outputs: refused."""
        if n_tokens is None:
            return
        try:
            plan = plan_cache(engine_config.pattern, plan_capacity(n_tokens, reserve))
        except ValueError as exc:  # a pattern too irregular to analyse at this length
            raise EngineInputError(str(exc)) from None
        if plan.slots == 0:
            raise EngineInputError(f"pattern {engine_config.pattern!r} gives no query any key in a document of "
                                   f"{n_tokens:,} tokens (every attention output would be zero); widen it")

    def make_cache(self, capacity: int, reserve: int) -> SasCache:
        start = time.perf_counter()
        self.check(self.model.config, self.config, self.run, capacity - reserve, reserve)
        capacity = plan_capacity(capacity - reserve, reserve)
        plans = [plan_cache(p, capacity) for p in self.layer_patterns()]
        cache = SasCache(self.model.config, plans, capacity, _staging_rows(self.run.chunk_size, capacity))
        cache.analysis_s = time.perf_counter() - start
        cache.kernel_dir = None if self.home is None else self.home / "sas_kernels"
        return cache

    def prefill(self, ids, *, reserve, progress=None) -> DocumentState:
        state = super().prefill(ids, reserve=reserve, progress=progress)
        state.counters["analysis_s"] = round(state.cache.analysis_s, 3)
        return state

    reusable = True

    @torch.inference_mode()
    def checkpoint(self, state: DocumentState) -> tuple:
        """The rows the question and the answer may overwrite (their slots, the pool, the staging row)."""
        kept = []
        for layer in state.cache.layers:
            rows = layer.rows_ahead(state.position)
            kept.append((rows, [buf.index_select(2, rows) for buf in layer.buffers()]))
        return state.position, kept

    @torch.inference_mode()
    def restore(self, state: DocumentState, checkpoint) -> None:
        state.position, kept = checkpoint
        for layer, (rows, saved) in zip(state.cache.layers, kept):
            for buf, rows_saved in zip(layer.buffers(), saved):
                buf.index_copy_(2, rows, rows_saved)
            layer.key_pos[:, :, layer.staging + 1:] = -1

    def state_inputs(self, n_tokens: int, reserve: int) -> dict:
        """The plans (so the slots of every key) depend on the length they were made for."""
        return {"plan_capacity": plan_capacity(n_tokens, reserve)}

    @torch.inference_mode()
    def export_state(self, state: DocumentState) -> tuple[dict, dict]:
        """Every layer's rows (bounded by its pattern, not by the document) and the last logits; copies, as
        answers overwrite rows in place."""
        tensors, plans = {"last_logits": state.last_logits}, {}
        for i, layer in enumerate(state.cache.layers):
            for name, buf in zip(("keys", "values", "key_pos", "score"), layer.buffers()):
                tensors[f"layers.{i}.{name}"] = buf.clone()
            # The plans too (a few tables of the planned length): reading back needs no analysis.
            plan = layer.plan
            if str(plan.pattern) not in plans:
                j = len(plans)
                plans[str(plan.pattern)] = {"index": j, "static_slots": plan.static_slots,
                                            "dynamic_slots": plan.dynamic_slots, "n": plan.n}
                for name in ("slot_of", "last", "enters_pool"):
                    tensors[f"host.plans.{j}.{name}"] = getattr(plan, name)
        return tensors, {"n_tokens": state.n_tokens, "prefill_s": state.prefill_s, "counters": state.counters,
                         "plans": plans}

    @torch.inference_mode()
    def import_state(self, tensors: dict, meta: dict, reserve: int) -> DocumentState:
        n = meta["n_tokens"]
        for pattern in {p for p in self.layer_patterns()}:
            saved = meta["plans"].get(str(pattern))
            if saved is not None:
                j = saved["index"]
                adopt_plan(pattern, saved["n"], saved["static_slots"], saved["dynamic_slots"],
                           *(tensors[f"host.plans.{j}.{name}"] for name in ("slot_of", "last", "enters_pool")))
        cache = self.make_cache(n + reserve, reserve)
        for i, layer in enumerate(cache.layers):
            keys = tensors[f"layers.{i}.keys"].to(self.layer_device(i))
            layer.lazy_initialization(keys, tensors[f"layers.{i}.values"])
            for name, buf in zip(("keys", "values", "key_pos", "score"), layer.buffers()):
                if tensors[f"layers.{i}.{name}"].shape != buf.shape:
                    raise ValueError(f"saved layer {i} {name} has shape {tuple(tensors[f'layers.{i}.{name}'].shape)}"
                                     f", the plan {tuple(buf.shape)}")
                buf.copy_(tensors[f"layers.{i}.{name}"])
        cache.filled = n
        return self.State(cache, n, n, tensors["last_logits"].to(self.device), meta.get("prefill_s", 0.0),
                          counters=dict(meta.get("counters", {})))

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None, *, chunk_size: int,
                    reserve: int) -> int:
        """Compacted K/V per layer (slots, a staging chunk and a trash row) plus each row's key position, and on
        H2O layers each row's score."""
        per_layer = kv_token_bytes(model_config, dtype_bytes)
        heads = model_config.get_text_config(decoder=True).num_key_value_heads
        n_tokens = plan_capacity(n_tokens - reserve, reserve)
        staging = _staging_rows(chunk_size, n_tokens) + 1
        return sum((cache_slots(p, n_tokens) + staging) * (per_layer + heads * (12 if p.dynamic() else 8))
                   for p in _layer_patterns(model_config, engine_config or SasConfig()))

    @classmethod
    def plan_notes(cls, model_config, n_tokens: int, engine_config=None) -> list[str]:
        patterns = _layer_patterns(model_config, engine_config or SasConfig())
        kinds = {}
        for p, t in zip(patterns, layer_types(model_config)):
            kinds.setdefault((t, p), 0)
            kinds[(t, p)] += 1
        lines = []
        for (t, p), count in kinds.items():
            lines.append(f"sas-pattern KV cache: {cache_slots(p, n_tokens):,} of {n_tokens:,} tokens per layer on "
                         f"{count} {t.replace('_attention', '')} layers ({p})")
            if n_tokens <= _EXACT_UP_TO:
                lines.append(f"  cache index of key k: {describe_index(plan_cache(p, n_tokens).slot_of)}")
        return lines

    def kv_read_bytes(self, model_config, n_tokens: int, dtype_bytes: int) -> int:
        """Per decode step every layer reads its compacted cache (slots + one staging row)."""
        per_layer = kv_token_bytes(model_config, dtype_bytes)
        return sum((cache_slots(p, n_tokens) + 1) * per_layer for p in self.layer_patterns())

    def backends(self) -> dict[str, str]:
        flex = "flex attention (pattern block mask)" if self.device.type == "cuda" else "sdpa reference (explicit mask)"
        return {"prefill_attention": f"{flex}; short chunks and H2O layers: sdpa/explicit softmax",
                "decode_attention": f"{decode_backend(self.device)} over the compacted cache, the pattern "
                                    + ("generated into the kernel" if self.device.type == "cuda"
                                       else "evaluated per row") + " (H2O layers: a per-row mask)"}

    def counters(self, state: DocumentState) -> dict:
        out = super().counters(state)
        types = layer_types(self.model.config)
        plans = {}
        for layer, kind in zip(state.cache.layers, types):
            plans.setdefault(kind, layer.plan)
        out["pattern"] = self.config.pattern
        out["kv_cache_slots"] = "; ".join(
            f"{plan.describe()} ({sum(t == kind for t in types)} {kind.replace('_attention', '')} layers"
            + (", the model's own window, exact)" if kind == "sliding_attention" else ")")
            for kind, plan in plans.items())
        return out
