"""Triton merge of split-KV partials: one program per (row, D tile), the splits in one tile of BLOCK_S.

The merge is a decode step's shortest kernel and sits between the attention and the o projection, so its latency
is what counts: each program issues its splits' log-sum-exps and partial outputs as one load (one L2 round trip
where a row has at most BLOCK_S splits, as every resa step does) and narrow D tiles give enough programs to
spread the reads over the SMs. More splits run as an online merge over BLOCK_S at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait, use_pdl
from kernels._triton_common import check_device, launch, launch_context

# The split-KV kernels plan about 4 programs an SM over batch x KV heads: 66 splits a row on an H200 with 8 KV
# heads, one BLOCK_S. A D tile of 16 gives Qwen3-1.7B's 16 query heads 128 programs.
_BLOCK_S, _BLOCK_D = 128, 16


@triton.jit(do_not_specialize=["num_splits"])
def _lse_combine_kernel(
    Out_part, Lse_part, Out, Lse, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        mask = offs < num_splits
        # Both loads issued before either is used: neither depends on the other.
        lse = tl.load(Lse_part + row * num_splits + offs, mask=mask, other=float("-inf"))
        o = tl.load(Out_part + (row * num_splits + offs)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # exp(-inf - m) = 0: empty splits (out 0, lse -inf) weigh nothing, nor does the first tile's empty past.
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        total = total * alpha + tl.sum(w, 0)
        # where(), not a product: an empty split's row may hold anything and 0 * NaN is NaN.
        acc = acc * alpha + tl.sum(tl.where(w[:, None] > 0, w[:, None] * o, 0.0), 0)
        m = m_new
    has = total > 0
    out = tl.where(has, acc / tl.where(has, total, 1.0), 0.0)
    tl.store(Out + row * HEAD_DIM + offs_d, out.to(Out.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(Lse + row, tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf")))


def combine_splits_triton(out_part: torch.Tensor, lse_part: torch.Tensor, out_dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """out_part: [R, S, D] fp32 contiguous; lse_part: [R, S] fp32 -> (out [R, D] out_dtype, lse [R] fp32)."""
    if out_part.dim() != 3 or out_part.dtype != torch.float32 or not out_part.is_contiguous():
        raise ValueError(f"expected out_part of shape [R, S, D] contiguous fp32, got {tuple(out_part.shape)} "
                         f"{out_part.dtype}")
    R, S, D = out_part.shape
    if lse_part.shape != (R, S) or lse_part.dtype != torch.float32 or not lse_part.is_contiguous():
        raise ValueError(f"expected lse_part of shape [{R}, {S}] contiguous fp32, got {tuple(lse_part.shape)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"expected head_dim a power of two >= 16, got {D}")
    check_device("lse_part", lse_part, out_part.device)
    check_device("out_part", out_part, out_part.device)
    out = torch.empty(R, D, device=out_part.device, dtype=out_dtype)
    lse = torch.empty(R, device=out_part.device, dtype=torch.float32)
    block_d = min(D, _BLOCK_D)
    pdl = use_pdl(out_part.device)
    with launch_context(out_part.device):
        # One BLOCK_S for every split count (masked lanes cost no memory traffic): one compilation serves
        # documents of every length.
        launch(_lse_combine_kernel, (R, D // block_d),
            out_part, lse_part, out, lse, S,
            HEAD_DIM=D, BLOCK_S=_BLOCK_S, BLOCK_D=block_d, PDL=pdl, launch_pdl=pdl, num_warps=4,
        )
    return out, lse
