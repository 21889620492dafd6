"""sas-pattern's attention over its compacted cache: the pattern as a mask over the rows, prefill chunks (SDPA
with the explicit mask; H2O layers an explicit softmax whose probabilities feed the scores), decode steps
(the split-KV kernel with the pattern generated into it, or a per-row mask on H2O layers), and the H2O pool's
admission. FlexAttention's prefill path is engines/sas/flex.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from engines.explicit import score_slices
from engines.sas.analyzer import CachePlan
from engines.sas.cache import SasCache, SasLayer
from engines.sas.codegen import triton_visible
from engines.sas.pattern import Pattern
from kernels.chunk_attention import sdpa_without_plans
from kernels.decode_attention import PositionMask, PositionRule, decode_attention, decode_backend


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


def prefill_reference(layer, query, key, value, scaling, offset):
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
        with sdpa_without_plans(query.device):
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


def decode(layer: SasLayer, query, key, value, scaling, cache: SasCache):
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
