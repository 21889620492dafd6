"""Split-KV ("flash-decoding") Triton kernel for one query token per sequence over a static KV cache.

Launch shapes depend on tensor shapes only and nothing is read back to the host, so a call can be captured
in a CUDA graph and replayed while `length` changes on the device. Each program owns one (batch, kv head,
split): it loads the whole GQA group of query heads and walks its share of the valid key range
[lo, length) in BLOCK_N tiles. The shares are computed on the device from `length`: it is the valid prefix,
not the buffer, that is spread over the splits. A second small kernel merges the splits by log-sum-exp.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Two waves of programs: measured on an H100, more splits only add merge work (and 1 wave leaves SMs idle).
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 256
# Tile of keys, warps and pipeline stages: the best of a sweep on an H100 for head_dim 128 and 256.
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 2


@triton.jit
def _decode_attention_fwd_kernel(
    Q, K, V, Length, Out_part, Lse_part,
    qk_scale, window, n_kv_heads, n_q_heads, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    length = tl.load(Length + b).to(tl.int64)
    kv_lo = tl.zeros_like(length)
    if HAS_WINDOW:
        # HF sliding window: key j is visible from query q = length-1 iff j > q - window.
        kv_lo = tl.maximum(length - window, 0)
    # Partition [kv_lo rounded down to a tile, length) evenly over the splits, in whole tiles.
    part_lo = (kv_lo // BLOCK_N) * BLOCK_N
    split = tl.cdiv(tl.cdiv(length - part_lo, num_splits), BLOCK_N) * BLOCK_N
    start = part_lo + pid_s * split
    end = tl.minimum(start + split, length)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = h * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        # Masked loads never touch keys outside [kv_lo, end): garbage (even NaN) cannot reach the result.
        valid = (offs >= kv_lo) & (offs < end)
        k = tl.load(k_base + offs[:, None] * stride_ks + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Every tile holds a valid key, so m_new is finite; the guard keeps exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs[:, None] * stride_vs + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (no valid key in its range) writes out 0, lse -inf: it then weighs nothing in the merge.
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    # m_i and l_i are in log2 units; divide by log2(e) for the natural log.
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    rows = (b * n_q_heads + q_rows) * num_splits + pid_s  # row of [B, Hq, num_splits]
    row_mask = offs_g < GROUP
    tl.store(Out_part + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_mask[:, None])
    tl.store(Lse_part + rows, lse, mask=row_mask)


@triton.jit
def _decode_attention_combine_kernel(
    Out_part, Lse_part, Out, Lse, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # flat (batch, q head)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SPLITS_PAD)
    lse = tl.load(Lse_part + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        mask = offs < num_splits
        # exp(-inf - m) = 0: empty splits (out 0, lse -inf) weigh nothing.
        w = tl.exp(tl.load(Lse_part + row * num_splits + offs, mask=mask, other=float("-inf")) - m)
        o = tl.load(Out_part + (row * num_splits + offs)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    has = total > 0
    out = tl.where(has, acc / tl.where(has, total, 1.0), 0.0)
    tl.store(Out + row * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(Lse + row, tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf")))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits_for(batch: int, n_kv_heads: int, capacity: int, device: torch.device) -> int:
    """Splits per (batch, kv head): _PROGRAMS_PER_SM programs per SM, no more splits than tiles in the buffer.

    Depends on shapes and the device only (never on `length`), so a captured graph stays valid.
    """
    target = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device.index), batch * n_kv_heads)
    return max(1, min(target, triton.cdiv(capacity, _BLOCK_N), _MAX_SPLITS))


def _validate(q, k_cache, v_cache, length, window) -> None:
    if q.dim() != 3:
        raise ValueError(f"expected q of shape [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"expected k_cache of shape [{B}, Hkv, S, {D}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"expected v_cache of shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if Hq % k_cache.shape[1]:
        raise ValueError(f"expected Hq ({Hq}) to be a multiple of Hkv ({k_cache.shape[1]})")
    if length.shape != (B,) or length.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expected length of shape [{B}] int64, got {tuple(length.shape)} {length.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"expected q in float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"expected k_cache and v_cache in {q.dtype}, got {k_cache.dtype} and {v_cache.dtype}")
    if D < 16 or D > 256 or D & (D - 1):
        raise ValueError(f"expected head_dim a power of two in [16, 256], got {D}")
    if window is not None and window < 1:
        raise ValueError(f"expected window >= 1 or None, got {window}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("length", length)):
        if t.device != q.device or t.device.type != "cuda":
            raise ValueError(f"expected {name} on the CUDA device of q ({q.device}), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"expected {name} with a contiguous last dimension, got strides {t.stride()}")


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.decode_attention; CUDA tensors only, CUDA-graph capturable.

    q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, S, D]; length: [B] int64 on q's device, 1 <= length <= S.
    Returns out [B, Hq, D] in q's dtype (and lse [B, Hq] fp32 with return_lse).
    """
    _validate(q, k_cache, v_cache, length, window)
    B, Hq, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    num_splits = num_splits_for(B, Hkv, S, q.device)
    # Scratch from the caching allocator: inside a graph capture it comes from the graph's private pool.
    out_part = torch.empty(B, Hq, num_splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, Hq, num_splits, device=q.device, dtype=torch.float32)
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, device=q.device, dtype=torch.float32)
    with torch.cuda.device(q.device):
        _decode_attention_fwd_kernel[(B * Hkv, num_splits)](
            q, k_cache, v_cache, length, out_part, lse_part,
            scale * _LOG2E, window or 0, Hkv, Hq, num_splits,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_N=_BLOCK_N,
            HAS_WINDOW=window is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        )
        # Split over D too: a (batch, head) row alone would walk all splits serially.
        block_d = min(D, 64)
        _decode_attention_combine_kernel[(B * Hq, D // block_d)](
            out_part, lse_part, out, lse, num_splits,
            HEAD_DIM=D, SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_S=64, BLOCK_D=block_d,
            num_warps=4,
        )
    return (out, lse) if return_lse else out
