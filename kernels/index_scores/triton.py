"""index_scores in Triton: a program per tile of index vectors matches them against every query vector and
folds each vector's best score into its block's with one 64-bit atomic max; a second launch unpacks the blocks.

The packed word is the score's float bits made order-preserving as a signed int32 (negative floats get their
magnitude bits flipped) in the high half and the vector's offset in its block in the low half, so the max picks
the best score and, among equal scores, the largest offset: the reference's tie rule.

Dot products are fp32 sums of exact products, as the reference's einsum, but not in fp32 FMA tiles: for bf16 index
vectors (the models' dtype on a GPU) each fp32 query is split into three bf16 parts whose sum is exactly the query
(8 + 8 + 8 significant bits), and each part's products with a bf16 vector are exact, so three TF32 tensor-core
products accumulated in fp32 give the dot product to fp32 rounding; other dtypes take fp32 ("ieee") dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import cdiv
from kernels._triton_common import check_device, launch, launch_context

_EMPTY = -(2 ** 63)  # a block no vector reached: its high half, -2**31, is no float's key


@triton.jit
def _index_scores_fwd_kernel(
    Q, Chosen, V, Block, Offset, Packed,
    n_vec, n_q, n_feat, stride_qa, stride_vn,
    HAS_CHOSEN: tl.constexpr, SPLIT_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_vec
    feats = tl.arange(0, BLOCK_K)
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for a0 in range(0, n_q, BLOCK_A):
        qa = a0 + tl.arange(0, BLOCK_A)
        q_ok = qa < n_q
        acc = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
        for f0 in range(0, n_feat, BLOCK_K):
            f = f0 + feats
            f_ok = f < n_feat
            v = tl.load(V + rows[:, None] * stride_vn + f[None, :], mask=row_ok[:, None] & f_ok[None, :],
                        other=0.0).to(tl.float32)
            q = tl.load(Q + qa[None, :] * stride_qa + f[:, None], mask=f_ok[:, None] & q_ok[None, :],
                        other=0.0).to(tl.float32)
            if SPLIT_Q:
                # Every operand here is a bf16 value, exact in TF32 too: TF32 products are exact (and Triton's
                # interpreter, which multiplies bf16 operands wrongly, computes the same).
                q_hi = q.to(tl.bfloat16).to(tl.float32)
                rest = q - q_hi
                q_mid = rest.to(tl.bfloat16).to(tl.float32)
                q_lo = (rest - q_mid).to(tl.bfloat16).to(tl.float32)
                acc = tl.dot(v, q_hi, acc, input_precision="tf32")
                acc = tl.dot(v, q_mid, acc, input_precision="tf32")
                acc = tl.dot(v, q_lo, acc, input_precision="tf32")
            else:
                acc += tl.dot(v, q, input_precision="ieee")
        if HAS_CHOSEN:
            q_ok = q_ok & (tl.load(Chosen + qa, mask=q_ok, other=0) != 0)
        acc = tl.where(q_ok[None, :], acc, float("-inf"))
        best = tl.maximum(best, tl.max(acc, 1))
    bits = best.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    off = tl.load(Offset + rows, mask=row_ok, other=0).to(tl.int64)
    blk = tl.load(Block + rows, mask=row_ok, other=-1)
    tl.atomic_max(Packed + blk, (key.to(tl.int64) << 32) + off, mask=row_ok & (blk >= 0))


@triton.jit
def _index_scores_unpack_kernel(Packed, Scores, Where, n_blocks, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_blocks
    packed = tl.load(Packed + i, mask=ok, other=0)
    key = (packed >> 32).to(tl.int32)
    empty = key == -2147483648
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    score = bits.to(tl.float32, bitcast=True)
    off = packed - (key.to(tl.int64) << 32)
    tl.store(Scores + i, tl.where(empty, float("-inf"), score), mask=ok)
    tl.store(Where + i, tl.where(empty, -1, off), mask=ok)


def index_scores_triton(query: torch.Tensor, vectors: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
                        n_blocks: int, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.index_scores_reference; CUDA tensors (or any under the interpreter)."""
    if query.dim() != 3 or vectors.dim() != 3 or query.shape[1:] != vectors.shape[1:]:
        raise ValueError(f"expected query [A, Hkv, D] and vectors [N, Hkv, D], got {tuple(query.shape)} and "
                         f"{tuple(vectors.shape)}")
    A, heads, dim = query.shape
    N = vectors.shape[0]
    for name, t in (("block", block), ("offset", offset)):
        if t.shape != (N,) or t.dtype != torch.int64:
            raise ValueError(f"expected {name} of shape [{N}] int64, got {tuple(t.shape)} {t.dtype}")
    if chosen is not None and (chosen.shape != (A,) or chosen.dtype != torch.bool):
        raise ValueError(f"expected chosen of shape [{A}] bool, got {tuple(chosen.shape)} {chosen.dtype}")
    for name, t in (("query", query), ("vectors", vectors)):
        if (heads > 1 and t.stride(1) != dim) or (dim > 1 and t.stride(2) != 1):
            raise ValueError(f"expected {name} with dense [Hkv, D] rows, got strides {t.stride()}")
    for name, t in (("query", query), ("vectors", vectors), ("block", block), ("offset", offset),
                    ("chosen", chosen)):
        if t is not None:
            check_device(name, t, vectors.device)
    packed = torch.full((n_blocks,), _EMPTY, dtype=torch.int64, device=vectors.device)
    scores = torch.empty(n_blocks, dtype=torch.float32, device=vectors.device)
    where = torch.empty(n_blocks, dtype=torch.int64, device=vectors.device)
    if n_blocks == 0:
        return scores, where
    block_a = max(16, min(64, triton.next_power_of_2(max(A, 1))))
    with launch_context(vectors.device):
        if N:
            launch(_index_scores_fwd_kernel, (cdiv(N, 64),),
                query, chosen.view(torch.uint8) if chosen is not None else query, vectors, block, offset, packed,
                N, A, heads * dim, query.stride(0), vectors.stride(0),
                HAS_CHOSEN=chosen is not None, SPLIT_Q=vectors.dtype == torch.bfloat16, BLOCK_N=64, BLOCK_A=block_a,
                BLOCK_K=64, num_warps=4,
            )
        launch(_index_scores_unpack_kernel, (cdiv(n_blocks, 1024),), packed, scores, where, n_blocks, BLOCK=1024,
               num_warps=4)
    return scores, where
