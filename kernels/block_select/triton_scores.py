"""Triton block scoring for the selection (kernels/block_select/triton.py launches them), one program per
(batch, kv head, tile of blocks); blocks past the end are not read.

Mean pooling: `_block_scores_kernel`, the group-averaged query against the tile's max/min descriptors. Softmax
pooling: `_head_bounds_kernel` writes each head's scaled bounds (`tile_bounds`: Quest's bound as tensor-core
products, of the group's queries as `group_query` prepares them once) and the tile's per-head max and sum of
exponentials, and `_softmax_pool_kernel` (same grid) reduces those over the tiles and sums the heads' probabilities
(`pool_scores`). The fused selection (triton_fused.py) calls the same helpers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait
from kernels.block_select.reference import QUERY_CODE_MAX
from kernels.block_select.triton_topk import HIST_BINS, count_score_bins

_HIST_BINS = tl.constexpr(HIST_BINS)
QUERY_CODE_MAX = tl.constexpr(QUERY_CODE_MAX)


@triton.jit
def _block_scores_kernel(
    Q, Kmax, Kmin, Kmean, Scale, Length, Scores, Hist, n_kv_heads, n_blocks_cap, local_blocks, sink_blocks,
    stride_qb, stride_qh, stride_db, stride_dh, stride_dn, stride_sb, stride_sh, GROUP: tl.constexpr,
    G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, CENTROID: tl.constexpr,
    FOLDED: tl.constexpr, QUANT: tl.constexpr, HIST: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Mean pooling (the paper's rule), one (batch, kv head, tile of blocks) per program."""
    grid_dependency_wait(PDL)
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    length = tl.load(Length + b).to(tl.int64)
    n_blocks = tl.cdiv(length, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
    scored = (offs < n_blocks - local_blocks) & (offs >= sink_blocks)
    base = b * stride_db + h * stride_dh + offs[:, None] * stride_dn + offs_d[None, :]
    top = tl.load(Kmax + base, mask=scored[:, None], other=0.0).to(tl.float32)
    bottom = tl.load(Kmin + base, mask=scored[:, None], other=0.0).to(tl.float32)
    if CENTROID and not FOLDED:
        mean = tl.load(Kmean + base, mask=scored[:, None], other=0.0).to(tl.float32)
    q_row = Q + b * stride_qb + h * GROUP * stride_qh + offs_d
    offs_g = tl.arange(0, G_PAD)
    q = tl.load(q_row[None, :] + offs_g[:, None] * stride_qh, mask=offs_g[:, None] < GROUP, other=0.0)
    qbar = tl.sum(q.to(tl.float32), 0) / GROUP  # [HEAD_DIM]
    s = tl.sum(tl.maximum(qbar[None, :] * top, qbar[None, :] * bottom), 1)
    if QUANT:
        s = s * tl.load(Scale + b * stride_sb + h * stride_sh + offs, mask=scored, other=0.0)
    if FOLDED:
        s = s * 0.5  # the descriptors' bound is Quest's plus q . mean
    elif CENTROID:
        s = (s + tl.sum(qbar[None, :] * mean, 1)) * 0.5
    s = tl.where(scored, s, tl.where(offs < n_blocks, float("inf"), float("-inf")))
    tl.store(Scores + pid_bh.to(tl.int64) * n_blocks_cap + offs, s, mask=offs < n_blocks_cap)
    if HIST:
        count_score_bins(Hist, pid_bh, s, offs < n_blocks, SHIFT, BASE)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a: [M, K], b: [N, K] -> a @ b.T [M, N] fp32."""
    if IEEE:
        out = tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(b))
    return out


@triton.jit
def _split_codes(c):
    """Non-negative int32 codes below 2**14 -> (c // 128, c % 128) as int8."""
    return (c // 128).to(tl.int8), (c % 128).to(tl.int8)


@triton.jit
def query_codes(q):
    """q [G, D] -> the fixed-point codes reference.query_codes defines, as int8 halves of their positive and
    negative parts ((pos_hi, pos_lo, neg_hi, neg_lo): c = 128 * hi + lo) and each row's step [G] fp32."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, QUERY_CODE_MAX, tl.float32), amax), 0.0)
    c = (qf * inv[:, None]).to(tl.int32)  # truncated, |c| <= QUERY_CODE_MAX
    pos_hi, pos_lo = _split_codes(tl.maximum(c, 0))
    neg_hi, neg_lo = _split_codes(tl.maximum(-c, 0))
    step = tl.math.div_rn(amax, tl.full(amax.shape, QUERY_CODE_MAX, tl.float32))
    return pos_hi, pos_lo, -neg_hi, -neg_lo, step


@triton.jit
def group_query(Q, Kmax, b, h, stride_qb, stride_qh, GROUP: tl.constexpr, G_DOT: tl.constexpr,
                HEAD_DIM: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr):
    """Row (b, h)'s group of queries as tile_bounds multiplies them, made once a program: (a_pos, a_neg, a_pos_lo,
    a_neg_lo, step, q), [G_DOT, HEAD_DIM] each but step [G_DOT] (rows past the group are zeros). QUANT: the
    fixed-point codes' int8 halves (query_codes); otherwise max(q, 0) and min(q, 0) in the descriptors' precision
    (fp32 with IEEE), the lo halves and step unused."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_g = tl.arange(0, G_DOT)  # the group's heads, padded to a tensor-core tile with zero rows
    q = tl.load(Q + b * stride_qb + (h * GROUP + offs_g[:, None]) * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0)
    if QUANT:
        pos_hi, pos_lo, neg_hi, neg_lo, step = query_codes(q)
        return pos_hi, neg_hi, pos_lo, neg_lo, step, q
    else:
        if IEEE:
            q = q.to(tl.float32)
        else:
            q = q.to(Kmax.dtype.element_ty)
        zero = tl.zeros_like(q)
        q_pos = tl.maximum(q, zero).to(q.dtype)  # Triton computes half-precision max / min in fp32
        q_neg = tl.minimum(q, zero).to(q.dtype)
        return q_pos, q_neg, q_pos, q_neg, tl.zeros([G_DOT], tl.float32), q


@triton.jit
def tile_bounds(a_pos, a_neg, a_pos_lo, a_neg_lo, step, q, Kmax, Kmin, Kmean, Scale, b, h, offs, n_blocks,
                n_blocks_cap, local_blocks, sink_blocks, scale_log2, stride_db, stride_dh, stride_dn, stride_sb,
                stride_sh, HEAD_DIM: tl.constexpr, CENTROID: tl.constexpr, FOLDED: tl.constexpr, QUANT: tl.constexpr,
                IEEE: tl.constexpr):
    """Every head's scaled bounds over the blocks `offs` of row (b, h), from its group_query: [G_DOT, TILE] fp32
    (rows past the group are zeros), -inf where a block is not scored. Quest's bound is two products on the
    tensor cores: sum_d max(q_d * kmax_d, q_d * kmin_d) = max(q, 0) . kmax + min(q, 0) . kmin, as kmax >= kmin.
    QUANT: int8 descriptors against the queries' fixed-point codes on the integer tensor cores, exact, the integer
    bounds then scaled per head and per block (the codes feed the products as loaded). The loads are bounded by the
    descriptors' capacity (n_blocks_cap) rather than by n_blocks, so that they need not wait for the length: what
    the blocks past it hold is masked out of the result."""
    offs_d = tl.arange(0, HEAD_DIM)
    scored = (offs < n_blocks - local_blocks) & (offs >= sink_blocks)
    held = offs < n_blocks_cap
    base = b * stride_db + h * stride_dh + offs[:, None] * stride_dn + offs_d[None, :]
    top = tl.load(Kmax + base, mask=held[:, None], other=0.0)  # [TILE, HEAD_DIM]
    bottom = tl.load(Kmin + base, mask=held[:, None], other=0.0)
    if QUANT:
        s = (tl.dot(a_pos, tl.trans(top)) + tl.dot(a_neg, tl.trans(bottom))) * 128
        s += tl.dot(a_pos_lo, tl.trans(top)) + tl.dot(a_neg_lo, tl.trans(bottom))  # int32 [G_DOT, TILE]
        s = s.to(tl.float32) * step[:, None]
        s = s * tl.load(Scale + b * stride_sb + h * stride_sh + offs, mask=held, other=0.0)[None, :]
    else:
        if IEEE:
            top, bottom = top.to(tl.float32), bottom.to(tl.float32)
        s = _dot(a_pos, top, IEEE) + _dot(a_neg, bottom, IEEE)  # [G_DOT, TILE]
    if FOLDED:
        s = s * 0.5  # the descriptors' bound is Quest's plus q . mean
    elif CENTROID:
        mean = tl.load(Kmean + base, mask=held[:, None], other=0.0)
        s = (s + _dot(q, mean.to(q.dtype), IEEE)) * 0.5
    return tl.where(scored[None, :], s * scale_log2, float("-inf"))


@triton.jit
def _head_bounds_kernel(
    Q, Kmax, Kmin, Kmean, Scale, Length, Bounds, TileMax, TileSum, n_kv_heads, n_blocks_cap, n_tiles, local_blocks,
    sink_blocks, scale_log2, stride_qb, stride_qh, stride_db, stride_dh, stride_dn, stride_sb, stride_sh,
    GROUP: tl.constexpr, G_DOT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
    CENTROID: tl.constexpr, FOLDED: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """Softmax pooling's first half, one (batch, kv head, tile of blocks) per program: every head's scaled
    bounds (tile_bounds), and the tile's per-head max and sum of exp2."""
    grid_dependency_wait(PDL)
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    n_blocks = tl.cdiv(tl.load(Length + b).to(tl.int64), BLOCK)
    offs = tile.to(tl.int64) * TILE + tl.arange(0, TILE)
    a_pos, a_neg, a_pos_lo, a_neg_lo, step, q = group_query(Q, Kmax, b, h, stride_qb, stride_qh, GROUP, G_DOT,
                                                             HEAD_DIM, QUANT, IEEE)
    s = tile_bounds(a_pos, a_neg, a_pos_lo, a_neg_lo, step, q, Kmax, Kmin, Kmean, Scale, b, h, offs, n_blocks,
                    n_blocks_cap, local_blocks, sink_blocks, scale_log2, stride_db, stride_dh, stride_dn, stride_sb,
                    stride_sh, HEAD_DIM, CENTROID, FOLDED, QUANT, IEEE)
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    offs_g = tl.arange(0, G_DOT)
    rows = pid_bh.to(tl.int64) * GROUP + offs_g
    heads = offs_g < GROUP
    tl.store(Bounds + rows[:, None] * n_blocks_cap + offs[None, :], s,
             mask=heads[:, None] & (offs[None, :] < n_blocks_cap))
    tl.store(TileMax + rows * n_tiles + tile, m, mask=heads)
    tl.store(TileSum + rows * n_tiles + tile, tl.sum(tl.exp2(s - m_safe[:, None]), 1), mask=heads)


@triton.jit
def pool_scores(Bounds, TileMax, TileSum, pid_bh, offs, n_blocks, n_blocks_cap, n_parts, local_blocks, sink_blocks,
                GROUP: tl.constexpr, NT_PAD: tl.constexpr):
    """Softmax pooling's scores of the blocks `offs` of row pid_bh: the sum over the group's heads of
    exp2(bound - max) / sum, max and sum over the row's n_parts per-part maxima and sums (each part's sum taken
    at its own max); +inf for the blocks always kept, -inf past the end. The parts' figures may come from other
    programs of the same launch: they are read from L2."""
    offs_t = tl.arange(0, NT_PAD)
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for g in tl.static_range(GROUP):
        row = pid_bh * GROUP + g
        m_t = tl.load(TileMax + row * n_parts + offs_t, mask=offs_t < n_parts, other=float("-inf"),
                      cache_modifier=".cg")
        m = tl.max(m_t, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        z_t = tl.load(TileSum + row * n_parts + offs_t, mask=offs_t < n_parts, other=0.0, cache_modifier=".cg")
        z = tl.sum(z_t * tl.exp2(m_t - m), 0)
        s = tl.load(Bounds + row * n_blocks_cap + offs, mask=offs < n_blocks_cap, other=float("-inf"))
        acc += tl.exp2(s - m) / tl.maximum(z, 1e-30)
    scored = (offs < n_blocks - local_blocks) & (offs >= sink_blocks)
    return tl.where(scored, acc, tl.where(offs < n_blocks, float("inf"), float("-inf")))


@triton.jit
def _softmax_pool_kernel(
    Bounds, TileMax, TileSum, Length, Scores, Hist, n_kv_heads, n_blocks_cap, n_tiles, local_blocks, sink_blocks,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, NT_PAD: tl.constexpr, HIST: tl.constexpr,
    SHIFT: tl.constexpr, BASE: tl.constexpr, PDL: tl.constexpr,
):
    """Scores of one tile (pool_scores), max and sum over all tiles."""
    grid_dependency_wait(PDL)
    pid_bh = tl.program_id(0).to(tl.int64)
    b = pid_bh // n_kv_heads
    n_blocks = tl.cdiv(tl.load(Length + b).to(tl.int64), BLOCK)
    offs = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    acc = pool_scores(Bounds, TileMax, TileSum, pid_bh, offs, n_blocks, n_blocks_cap, n_tiles, local_blocks,
                      sink_blocks, GROUP, NT_PAD)
    tl.store(Scores + pid_bh * n_blocks_cap + offs, acc, mask=offs < n_blocks_cap)
    if HIST:
        count_score_bins(Hist, pid_bh, acc, offs < n_blocks, SHIFT, BASE)
