"""Block-sparse split-KV decode kernel: each program walks its share of the selected-block list.

One program per (batch, kv head, split) loads all query heads of its GQA group (the paper's shared KV fetch)
and processes BLOCK_N keys per step: BLOCK_N / block_size listed blocks, their keys gathered row by row.
Slots holding -1 and keys past `length` (a partly filled last block) are masked out of the loads. The list
width is static, so launch shapes never depend on the data (CUDA-graph safe); splits merge in lse_combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait, use_pdl
from kernels._triton_common import check_device, launch_context, sm_count
from kernels.lse_combine.triton import combine_splits_triton

_LOG2E = 1.4426950408889634
# H200 sweeps (benchmarks/bench_resa_kernels.py --sweep-sparse, 1,024 kept blocks a head at 128K): 4 programs an
# SM took 18.0 / 18.3 us against 19.8 / 20.2 with 2 (Qwen3-1.7B / Llama-3.1-8B shapes), 32.5 against 34.2 at 256K.
_PROGRAMS_PER_SM = 4
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 2


@triton.jit
def _sparse_decode_fwd_kernel(
    Q, K, V, Blocks, Length, Out_part, Lse_part,
    qk_scale, n_kv_heads, n_q_heads, num_splits, width, slots_per_split,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    length = tl.load(Length + b).to(tl.int64)
    slot_lo = pid_s * slots_per_split
    slot_hi = tl.minimum(slot_lo + slots_per_split, width)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = h * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + q_rows[:, None] * stride_qh + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    list_row = Blocks + pid_bh.to(tl.int64) * width

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
    # Key n0 + i is row i % BLOCK of the block listed in slot (n0 + i) // BLOCK. The next step's list entries
    # are loaded a step ahead, and V with K, so that no load waits on another inside the step.
    slot = (slot_lo * BLOCK + offs_n) // BLOCK
    blk_next = tl.load(list_row + slot, mask=slot < slot_hi, other=-1)
    for n0 in range(slot_lo * BLOCK, slot_hi * BLOCK, BLOCK_N):
        blk = blk_next.to(tl.int64)
        tok = blk * BLOCK + (offs_n % BLOCK)
        valid = (blk >= 0) & (tok < length)
        k = tl.load(k_base + tok[:, None] * stride_ks + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_base + tok[:, None] * stride_vs + offs_d[None, :], mask=valid[:, None], other=0.0)
        slot = (n0 + BLOCK_N + offs_n) // BLOCK
        blk_next = tl.load(list_row + slot, mask=slot < slot_hi, other=-1)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A step may hold only padding (-1 slots): keep exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    rows = (b * n_q_heads + q_rows) * num_splits + pid_s
    row_mask = offs_g < GROUP
    tl.store(Out_part + rows[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_mask[:, None])
    tl.store(Lse_part + rows, lse, mask=row_mask)


def split_plan(batch: int, n_kv_heads: int, width: int, block_size: int, device: torch.device) -> tuple[int, int]:
    """(splits, list slots per split): about _PROGRAMS_PER_SM programs per SM, whole BLOCK_N steps per split."""
    per_step = max(1, _BLOCK_N // block_size)
    steps = triton.cdiv(width, per_step)
    splits = max(1, min(triton.cdiv(_PROGRAMS_PER_SM * sm_count(device), batch * n_kv_heads), steps))
    slots = triton.cdiv(steps, splits) * per_step
    return triton.cdiv(width, slots), slots


def sparse_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   blocks: torch.Tensor, length: torch.Tensor, *, block_size: int, scale: float,
                                   return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.sparse_decode_attention; CUDA-graph capturable."""
    if q.dim() != 3:
        raise ValueError(f"expected q of shape [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D or Hq % k_cache.shape[1]:
        raise ValueError(f"expected k_cache of shape [{B}, Hkv, S, {D}] with Hq % Hkv == 0, got "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"expected k_cache and v_cache of shape {tuple(k_cache.shape)} in {q.dtype}")
    Hkv = k_cache.shape[1]
    if blocks.dim() != 3 or blocks.shape[:2] != (B, Hkv) or blocks.dtype != torch.int32 \
            or not blocks.is_contiguous():
        raise ValueError(f"expected blocks of shape [{B}, {Hkv}, W] contiguous int32, got {tuple(blocks.shape)} "
                         f"{blocks.dtype}")
    if length.shape != (B,):
        raise ValueError(f"expected length of shape [{B}], got {tuple(length.shape)}")
    if D < 16 or D > 256 or D & (D - 1) or block_size & (block_size - 1) or block_size > _BLOCK_N:
        raise ValueError(f"expected head_dim a power of two in [16, 256] and block_size a power of two <= "
                         f"{_BLOCK_N}, got {D} and {block_size}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("blocks", blocks), ("length", length)):
        check_device(name, t, q.device)
    width = blocks.shape[2]
    num_splits, slots = split_plan(B, Hkv, width, block_size, q.device)
    group = Hq // Hkv
    out_part = torch.empty(B * Hq, num_splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B * Hq, num_splits, device=q.device, dtype=torch.float32)
    pdl = use_pdl(q.device)
    with launch_context(q.device):
        _sparse_decode_fwd_kernel[(B * Hkv, num_splits)](
            q, k_cache, v_cache, blocks, length, out_part, lse_part,
            scale * _LOG2E, Hkv, Hq, num_splits, width, slots,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK=block_size,
            BLOCK_N=_BLOCK_N, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            PDL=pdl, launch_pdl=pdl, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
        )
    out, lse = combine_splits_triton(out_part, lse_part, q.dtype)
    out, lse = out.view(B, Hq, D), lse.view(B, Hq)
    return (out, lse) if return_lse else out
