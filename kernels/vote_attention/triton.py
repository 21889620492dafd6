"""Vote attention in two Triton passes: a flash-attention forward, then the probabilities' sums per key.

The forward pass is flash attention over rows whose positions are in any order (each key tile is masked by
its rows' positions), and it keeps each query's log-sum-exp. The second pass gives each program one tile of
keys of one KV head: it loads the tile once, recomputes the probabilities p = exp(s - lse) of every query of
the head's GQA group against it, and sums them per key (votes) and, where the tile meets the chunk's own rows,
per (query, key) over the heads (own map). Programs write disjoint partial buffers that torch sums: no atomics,
so the result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch, launch_context

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# head_dim: (BLOCK_M queries, BLOCK_N keys, warps, stages) of the forward pass. Its grid is query tiles x B*Hq,
# one wave on an H100 for a 512-query chunk of Llama-8B at 128 queries a tile; models with fewer heads (Qwen2.5:
# 14) take 64. At 256 a 64 x 256 fp32 accumulator is 128 registers a thread over 4 warps: 8 warps, 32-key tiles.
_FWD_CONFIG = {64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}
# head_dim: (BLOCK_M, BLOCK_N, warps, stages) of the votes pass. Its grid is key tiles x B*Hkv, so small key
# tiles keep the SMs busy for models with one or two KV heads.
_VOTES_CONFIG = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (64, 32, 4, 2)}


def _config(table: dict, head_dim: int) -> tuple[int, int, int, int]:
    return table[max(64, head_dim)]


# Integers that change from chunk to chunk are not specialised on: one compiled kernel serves a whole document.
@triton.jit(do_not_specialize=["offset", "n_keys"])
def _vote_attention_fwd_kernel(
    Q, K, V, KeyPos, Out, Lse,
    qk_scale, offset, n_keys, n_queries, n_q_heads, group,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_q_heads).to(tl.int64)
    h = (pid_bh % n_q_heads).to(tl.int64)
    hk = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < n_queries
    q_pos = offset + offs_m
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Positions are in any order (retrieved rows hold older tokens): every tile is read and masked by position.
    for n0 in range(0, n_keys, BLOCK_N):
        offs = n0 + offs_n
        kp = tl.load(KeyPos + offs, mask=offs < n_keys, other=-1)
        # Empty rows are never loaded: whatever they hold (even NaN) cannot reach the result.
        filled = kp >= 0
        k = tl.load(k_base + offs[:, None] * stride_ks + offs_d[None, :], mask=filled[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        seen = filled[None, :] & (kp[None, :] <= q_pos[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A query may see no key of a tile: keep exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs[:, None] * stride_vs + offs_d[None, :], mask=filled[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A query that sees no row: out 0, lse -inf, so the votes pass gives it probability 0 everywhere.
    has = l_i > 0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))  # log2 units
    rows = pid_bh.to(tl.int64) * n_queries + offs_m
    tl.store(Out + rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=["offset", "n_keys", "n_own"])
def _vote_attention_votes_kernel(
    Q, K, KeyPos, Lse, VotesPart, OwnPart,
    qk_scale, offset, n_keys, n_queries, n_own, n_kv_heads, group,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = (pid_bkv // n_kv_heads).to(tl.int64)
    hk = (pid_bkv % n_kv_heads).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, BLOCK_M)
    kp = tl.load(KeyPos + offs_n, mask=offs_n < n_keys, other=-1)
    filled = kp >= 0
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=filled[:, None], other=0.0)
    own_q0 = n_queries - n_own
    own_k0 = n_keys - n_own
    # Only the last key tiles hold the chunk's own rows.
    keys_in_own = pid_n * BLOCK_N + BLOCK_N > own_k0
    votes = tl.zeros([BLOCK_N], dtype=tl.float32)
    for m0 in range(0, n_queries, BLOCK_M):
        offs_m = m0 + offs_r
        row_ok = offs_m < n_queries
        # Probabilities of this query tile summed over the GQA group's heads: the own map's tile, and votes.
        heads = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(group):
            h = hk * group + g
            # A block pointer, not a [BLOCK_M, HEAD_DIM] tensor of 64-bit addresses: those spill at head_dim 128+.
            q_blk = tl.make_block_ptr(Q + b * stride_qb + h * stride_qh, shape=(n_queries, HEAD_DIM),
                                      strides=(stride_qt, 1), offsets=(m0, 0), block_shape=(BLOCK_M, HEAD_DIM),
                                      order=(1, 0))
            q = tl.load(q_blk, boundary_check=(0,), padding_option="zero")
            lse = tl.load(Lse + (b * n_kv_heads * group + h) * n_queries + offs_m, mask=row_ok,
                          other=float("-inf"))
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            # lse is -inf for a query that sees nothing (and past the last query), and then every pair is masked
            # out here. Rebuilt for each head rather than held: a [BLOCK_M, BLOCK_N] mask costs registers.
            ok = filled[None, :] & (kp[None, :] <= offset + offs_m[:, None]) & (lse[:, None] > float("-inf"))
            heads += tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        votes += tl.sum(heads, 0)
        if keys_in_own & (m0 + BLOCK_M > own_q0):
            a = offs_m - own_q0
            c = offs_n - own_k0
            mask = (a[:, None] >= 0) & row_ok[:, None] & (c[None, :] >= 0) & (offs_n[None, :] < n_keys)
            own_ptr = OwnPart + pid_bkv.to(tl.int64) * n_own * n_own + a[:, None] * n_own + c[None, :]
            tl.store(own_ptr, heads, mask=mask)
    tl.store(VotesPart + pid_bkv.to(tl.int64) * n_keys + offs_n, votes, mask=offs_n < n_keys)


def _validate(q, k, v, key_pos, n_own) -> None:
    if q.dim() != 4:
        raise ValueError(f"expected q of shape [B, Hq, T, D], got {tuple(q.shape)}")
    B, Hq, T, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"expected k of shape [{B}, Hkv, W, {D}], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"expected v of shape {tuple(k.shape)}, got {tuple(v.shape)}")
    Hkv, W = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"expected Hq ({Hq}) to be a multiple of Hkv ({Hkv})")
    if key_pos.shape != (W,) or key_pos.dtype != torch.int64:
        raise ValueError(f"expected key_pos of shape [{W}] int64, got {tuple(key_pos.shape)} {key_pos.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"expected q in float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected k and v in {q.dtype}, got {k.dtype} and {v.dtype}")
    if D not in (16, 32, 64, 128, 256):
        raise ValueError(f"expected head_dim a power of two in [16, 256], got {D}")
    if not 1 <= n_own <= min(T, W):
        raise ValueError(f"expected 1 <= n_own <= min(T, W) = {min(T, W)}, got {n_own}")
    for name, t in (("q", q), ("k", k), ("v", v), ("key_pos", key_pos)):
        check_device(name, t, q.device)


def vote_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_pos: torch.Tensor,
    offset: int,
    *,
    scale: float,
    n_own: int,
    return_lse: bool = False,
    votes: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Same contract as reference.vote_attention_reference; CUDA tensors (or any under the interpreter).

    q: [B, Hq, T, D]; k, v: [B, Hkv, W, D], any strides with a contiguous last dimension (views of a larger
    row buffer); key_pos: [W] int64. Returns out [B, Hq, T, D] in q's dtype, votes [W] fp32, own
    [n_own, n_own] fp32 (votes=False: None for both, and the second pass is not launched).
    """
    _validate(q, k, v, key_pos, n_own)
    B, Hq, T, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    group = Hq // Hkv
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = scale * _LOG2E
    out = torch.empty(B, Hq, T, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B * Hq, T, device=q.device, dtype=torch.float32)
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    k_strides = (k.stride(0), k.stride(1), k.stride(2))
    with launch_context(q.device):
        block_m, block_n, warps, stages = _config(_FWD_CONFIG, D)
        launch(_vote_attention_fwd_kernel, (triton.cdiv(T, block_m), B * Hq),
            q, k, v, key_pos, out, lse, qk_scale, offset, W, T, Hq, group,
            *q_strides, *k_strides, v.stride(0), v.stride(1), v.stride(2),
            HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision,
            num_warps=warps, num_stages=stages,
        )
        if not votes:
            return (out, None, None, lse.view(B, Hq, T) * _LN2) if return_lse else (out, None, None)
        # Every element of both partials is written by exactly one program.
        votes_part = torch.empty(B * Hkv, W, device=q.device, dtype=torch.float32)
        own_part = torch.empty(B * Hkv, n_own, n_own, device=q.device, dtype=torch.float32)
        block_m, block_n, warps, stages = _config(_VOTES_CONFIG, D)
        launch(_vote_attention_votes_kernel, (triton.cdiv(W, block_n), B * Hkv),
            q, k, key_pos, lse, votes_part, own_part, qk_scale, offset, W, T, n_own, Hkv, group,
            *q_strides, *k_strides,
            HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision,
            num_warps=warps, num_stages=stages,
        )
    if not return_lse:
        return out, votes_part.sum(0), own_part.sum(0)
    # The kernel keeps lse in log2 units of the log2(e)-scaled scores; the contract's is the natural log.
    return out, votes_part.sum(0), own_part.sum(0), lse.view(B, Hq, T) * _LN2
