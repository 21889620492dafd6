"""Split-KV ("flash-decoding") Triton kernel for the newest token(s) of a sequence over a static KV cache.

Launch shapes depend on tensor shapes only and nothing is read back to the host, so a call can be captured
in a CUDA graph and replayed while `length` changes on the device. Each program owns one (batch, kv head,
split): it loads every query row of its GQA group (G heads x T tokens) and walks its share of the valid key
range in BLOCK_N tiles, each row masked causally at its own position. The shares are computed on the device
from `length`: it is the valid prefix, not the buffer, that is spread over the splits. kernels/lse_combine
merges the splits by log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait, use_pdl
from kernels._triton_common import check_device, launch_context, sm_count
from kernels.decode_attention.reference import PositionMask
from kernels.lse_combine.triton import combine_splits_triton

_LOG2E = 1.4426950408889634
# Two waves of programs: measured on an H100, more splits only add merge work (and 1 wave leaves SMs idle).
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 256
# Tile of keys, warps and pipeline stages: the best of a sweep on an H100 for head_dim 128 and 256.
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 2
# Query rows (GQA group x tokens) per program: more are split over programs, each re-reading the keys.
_MAX_ROWS = 64
# Many rows (rectification: G x 32 tokens) per program at head_dim <= 128 (half at 256): rows, warps, stages and
# keys a tile (64 at head_dim 256: 128 do not fit shared memory). H100, 32 tokens over 128K keys
# (benchmarks/bench_resa_kernels.py --sweep-rectify): Llama-8B's 128 rows 0.232 ms a layer, against 0.379 as two
# programs of 64 rows each re-reading the keys; Gemma 3's 0.134 vs 0.209. With whole tiles unmasked, H200: 0.188
# at 64 keys a tile, 0.178 at 128 (benchmarks/results/2026-11-29_h200_decode_attention_unmasked_tiles.json).
# At head_dim >= 128 such a program fills an SM's shared memory (three stages of K and V tiles), so the programs
# come in one wave, one an SM: a second wave only doubles the splits the merge reads and writes. H200, Llama-8B's
# 128 rows over 128K keys: 0.172 ms a layer against 0.180 in two waves
# (benchmarks/results/2026-11-29_h200_decode_attention_rectify_one_wave.json).
MANY_ROWS = {"rows": 128, "warps": 8, "stages": 3, "block_n": 128, "programs_per_sm": 1}
# Several query tokens in at most _MAX_ROWS rows (Qwen3-1.7B's rectification: 2 heads x 32 tokens) take one
# more stage: H200, 32 tokens over 128K keys (bench_resa_kernels.py --sweep-rectify-launch), 0.151 -> 0.137 ms
# a layer; no key tile, warp count or split count of the sweep did better. One token keeps _NUM_STAGES.
_FEW_QUERY_STAGES = 3


def launch_config(rows: int, head_dim: int, queries: int = 1) -> tuple[int, int, int, int, int]:
    """(rows per program, warps, stages, keys a tile, programs an SM) for `rows` query rows (`queries` tokens) of
    one KV head."""
    wide = head_dim > 128
    if rows <= (_MAX_ROWS // 2 if wide else _MAX_ROWS):
        stages = _FEW_QUERY_STAGES if queries > 1 else _NUM_STAGES
        return max(16, triton.next_power_of_2(rows)), _NUM_WARPS, stages, _BLOCK_N, _PROGRAMS_PER_SM
    per_program = MANY_ROWS["rows"] // 2 if wide else MANY_ROWS["rows"]
    block_n = _BLOCK_N if wide else MANY_ROWS["block_n"]
    per_sm = MANY_ROWS["programs_per_sm"] if head_dim >= 128 else _PROGRAMS_PER_SM
    return min(per_program, triton.next_power_of_2(rows)), MANY_ROWS["warps"], MANY_ROWS["stages"], block_n, per_sm


@triton.jit
def _accumulate(acc, l_i, m_i, m_ref, p, v, DOT_PRECISION: tl.constexpr):
    """One key tile into each row's running output and sum: p = exp2(score - m_ref) [ROWS, BLOCK_N], v [BLOCK_N, D];
    the terms so far, relative to m_i, are rescaled to m_ref. Returns (acc, l_i)."""
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i


# Integers that follow the document's length are not specialised on (Triton keys a compiled kernel on whether
# each integer is 1 or a multiple of 16): a folder of documents of many lengths compiles the kernel once.
@triton.jit(do_not_specialize=["num_splits", "stride_ks_mask", "stride_kpb", "stride_kph"])
def _decode_attention_fwd_kernel(
    Q, K, V, Length, QFirst, KeyMask, KeyPos, QPos, Out_part, Lse_part,
    qk_scale, window, n_kv_heads, n_q_heads, num_splits, stride_ks_mask, stride_kpb, stride_kph,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    N_QUERIES, GROUP: tl.constexpr, ROWS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_QFIRST: tl.constexpr, HAS_KEYMASK: tl.constexpr,
    HAS_POSITION_MASK: tl.constexpr, POSITION_MASK: tl.constexpr, UNMASKED_PREFIX: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    length = tl.load(Length + b).to(tl.int64)
    # Row r is query token t = r % T of head h * GROUP + r // T; token t sits at position first + t. Many rows
    # (rectification: G x T) are spread over several programs (axis 2) to keep each tile in registers.
    offs_r = tl.program_id(2) * ROWS_PAD + tl.arange(0, ROWS_PAD)
    row_ok = offs_r < GROUP * N_QUERIES
    q_heads = h * GROUP + offs_r // N_QUERIES
    q_tok = offs_r % N_QUERIES
    if HAS_QFIRST:
        first = tl.load(QFirst + b).to(tl.int64)
    else:
        first = length - N_QUERIES
    row_pos = first + q_tok
    kv_lo = tl.zeros_like(length)
    if HAS_WINDOW:
        # HF sliding window: key j is visible from the query at position p iff j > p - window.
        kv_lo = tl.maximum(first + 1 - window, 0)
    # Partition [kv_lo rounded down to a tile, length) evenly over the splits, in whole tiles.
    part_lo = (kv_lo // BLOCK_N) * BLOCK_N
    # Empty when the window starts past the shard's keys (q_first far beyond length): every split writes -inf.
    split = tl.cdiv(tl.cdiv(tl.maximum(length - part_lo, 0), num_splits), BLOCK_N) * BLOCK_N
    start = part_lo + pid_s * split
    end = tl.minimum(start + split, length)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * stride_qb + q_heads[:, None] * stride_qh + q_tok[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    if HAS_POSITION_MASK:
        # Each row's query token position, for the inlined mask function (sas-pattern's pattern).
        q_at = tl.load(QPos + b).to(tl.int64) + q_tok
    v_base = V + b * stride_vb + h * stride_vh

    m_i = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
    acc = tl.zeros([ROWS_PAD, HEAD_DIM], dtype=tl.float32)
    masked_from = start
    if UNMASKED_PREFIX:
        # Whole tiles below the first query's position are seen by every row: no bounds or causal masks there,
        # as flash attention skips them off the diagonal (a compare, an and and a select a score fewer).
        masked_from = start + tl.maximum(tl.minimum(end, first + 1) - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, masked_from, BLOCK_N):
            offs = n0 + offs_n
            k = tl.load(k_base + offs[:, None] * stride_ks + offs_d[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            v = tl.load(v_base + offs[:, None] * stride_vs + offs_d[None, :])
            # Every score is finite here: the scale folds into the exponent's subtraction.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            acc, l_i = _accumulate(acc, l_i, m_i, m_new, p, v, DOT_PRECISION)
            m_i = m_new
    for n0 in range(masked_from, end, BLOCK_N):
        offs = n0 + offs_n
        # Masked loads never touch keys outside [kv_lo, end): garbage (even NaN) cannot reach the result.
        valid = (offs >= kv_lo) & (offs < end)
        k = tl.load(k_base + offs[:, None] * stride_ks + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [ROWS_PAD, BLOCK_N], log2 units
        seen = valid[None, :] & (offs[None, :] <= row_pos[:, None])
        if HAS_WINDOW:
            seen &= offs[None, :] > row_pos[:, None] - window
        if HAS_KEYMASK:
            # [B, Hkv, S] flags: keys this head may see (sas-pattern's compacted cache).
            key_ok = tl.load(KeyMask + (b * n_kv_heads + h) * stride_ks_mask + offs, mask=valid, other=0)
            seen &= key_ok[None, :] != 0
        if HAS_POSITION_MASK:
            kp = tl.load(KeyPos + b * stride_kpb + h * stride_kph + offs, mask=valid, other=-1)
            seen &= POSITION_MASK(q_at[:, None], kp[None, :])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key of a tile (causal or window edge): keep exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(v_base + offs[:, None] * stride_vs + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc, l_i = _accumulate(acc, l_i, m_i, m_safe, p, v, DOT_PRECISION)
        m_i = m_new

    # An empty split (no visible key in its range) writes out 0, lse -inf: it then weighs nothing in the merge.
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    # m_i and l_i are in log2 units; divide by log2(e) for the natural log.
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    rows = ((b * n_q_heads + q_heads) * N_QUERIES + q_tok) * num_splits + pid_s  # row of [B, Hq, T, splits]
    tl.store(Out_part + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(Lse_part + rows, lse, mask=row_ok)


def num_splits_for(batch: int, n_kv_heads: int, capacity: int, device: torch.device,
                   programs_per_sm: int = _PROGRAMS_PER_SM, row_programs: int = 1) -> int:
    """Splits per (batch, kv head, block of rows): `programs_per_sm` programs per SM, no more splits than tiles in
    the buffer, rounded down to a power of two (a few values over all lengths: the merge kernel's shapes stay few).

    Depends on shapes and the device only (never on `length`), so a captured graph stays valid.
    """
    target = triton.cdiv(programs_per_sm * sm_count(device), batch * n_kv_heads * row_programs)
    most = max(1, min(target, triton.cdiv(capacity, _BLOCK_N), _MAX_SPLITS))
    return 1 << (most.bit_length() - 1)


def _validate_positions(k_cache, mask) -> None:
    B, Hkv, S = k_cache.shape[:3]
    if mask.rule.triton is None:
        raise ValueError("expected a position mask with a Triton function for the Triton kernel, got none")
    key_pos, q_pos = mask.key_pos, mask.q_pos
    if key_pos.dim() != 3 or key_pos.shape[0] != B or key_pos.shape[1] not in (1, Hkv) \
            or key_pos.shape[2] < S or key_pos.dtype != torch.int64:
        raise ValueError(f"expected key_pos of shape [{B}, {Hkv} or 1, >= {S}] int64, got "
                         f"{(tuple(key_pos.shape), key_pos.dtype)}")
    if q_pos.shape != (B,) or q_pos.dtype != torch.int64:
        raise ValueError(f"expected q_pos of shape [{B}] int64, got {(tuple(q_pos.shape), q_pos.dtype)}")


def _validate(q, k_cache, v_cache, length, window, q_first, key_mask) -> None:
    if q.dim() != 4:
        raise ValueError(f"expected q of shape [B, Hq, D] or [B, Hq, T, D], got {tuple(q.shape)}")
    B, Hq, T, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"expected k_cache of shape [{B}, Hkv, S, {D}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"expected v_cache of shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if Hq % k_cache.shape[1]:
        raise ValueError(f"expected Hq ({Hq}) to be a multiple of Hkv ({k_cache.shape[1]})")
    if length.shape != (B,) or length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expected length of shape [{B}] int64, got {tuple(length.shape)} {length.dtype}")
    if q_first is not None and (q_first.shape != (B,) or q_first.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"expected q_first of shape [{B}] int64, got {tuple(q_first.shape)} {q_first.dtype}")
    if key_mask is not None and (key_mask.shape != k_cache.shape[:3] or key_mask.dtype != torch.bool
                                 or not key_mask.is_contiguous()):
        raise ValueError(f"expected a contiguous bool mask of shape {tuple(k_cache.shape[:3])}, got "
                         f"{tuple(key_mask.shape)} {key_mask.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"expected q in float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"expected k_cache and v_cache in {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"expected head_dim a power of two in [16, 256], got {D}")
    if window is not None and window < 1:
        raise ValueError(f"expected window >= 1 or None, got {window}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("length", length), ("q_first", q_first),
                    ("key_mask", key_mask)):
        if t is not None:
            check_device(name, t, q.device)


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    q_first: torch.Tensor | None = None,
    mask: torch.Tensor | PositionMask | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.decode_attention; CUDA tensors only, CUDA-graph capturable.

    q: [B, Hq, D] or [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, S, D]; length: [B] int64 on q's device,
    T <= length <= S. Returns out shaped like q in q's dtype (and lse [B, Hq(, T)] fp32 with return_lse).
    """
    single = q.dim() == 3
    q4 = q.unsqueeze(2) if single else q
    positions = mask if isinstance(mask, PositionMask) else None
    key_mask = None if positions is not None else mask
    _validate(q4, k_cache, v_cache, length, window, q_first, key_mask)
    key_pos = q_pos = None
    if positions is not None:
        _validate_positions(k_cache, positions)
        key_pos, q_pos = positions.key_pos, positions.q_pos
        check_device("key_pos", key_pos, q.device)
        check_device("q_pos", q_pos, q.device)
    B, Hq, T, D = q4.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    rows_pad, num_warps, num_stages, block_n, per_sm = launch_config(group * T, D, T)
    row_programs = triton.cdiv(group * T, rows_pad)
    num_splits = num_splits_for(B, Hkv, S, q.device, per_sm, row_programs)
    # Scratch from the caching allocator: inside a graph capture it comes from the graph's private pool.
    out_part = torch.empty(B * Hq * T, num_splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B * Hq * T, num_splits, device=q.device, dtype=torch.float32)
    pdl = use_pdl(q.device)
    with launch_context(q.device):
        _decode_attention_fwd_kernel[(B * Hkv, num_splits, row_programs)](
            q4, k_cache, v_cache, length, length if q_first is None else q_first,
            length if key_mask is None else key_mask.view(torch.uint8),
            length if key_pos is None else key_pos, length if q_pos is None else q_pos, out_part, lse_part,
            scale * _LOG2E, window or 0, Hkv, Hq, num_splits, S,
            0 if key_pos is None else key_pos.stride(0),
            0 if key_pos is None or key_pos.shape[1] == 1 else key_pos.stride(1),
            q4.stride(0), q4.stride(1), q4.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            T, GROUP=group, ROWS_PAD=rows_pad, HEAD_DIM=D,
            BLOCK_N=block_n, HAS_WINDOW=window is not None, HAS_QFIRST=q_first is not None,
            HAS_KEYMASK=key_mask is not None, HAS_POSITION_MASK=positions is not None,
            POSITION_MASK=None if positions is None else positions.rule.triton,
            UNMASKED_PREFIX=T > 1 and window is None and mask is None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            PDL=pdl, launch_pdl=pdl, num_warps=num_warps, num_stages=num_stages,
        )
    out, lse = combine_splits_triton(out_part, lse_part, q.dtype)
    shape = (B, Hq) if single else (B, Hq, T)
    out, lse = out.view(*shape, D), lse.view(shape)
    return (out, lse) if return_lse else out
