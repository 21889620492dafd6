"""Span selection in one Triton launch: one program per map runs the greedy NMS and the row picking.

The reference brings the candidates to the host (a wait for the device per layer and chunk) and loops there;
here a program holds its map's candidates (up to 2n - 1, in midpoint order) and rows in registers, takes the
best one still alive (which suppresses those it overlaps) and serves it its most-voted rows, until none is left.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch, launch_context
from kernels.span_rows.reference import span_counts


@triton.jit
def _serve(rows, in_span, votes, taken, count, hi):
    """A kept span's `count` most-voted rows (ties to the lowest row), less those taken, until hi rows are taken."""
    for _ in range(count):
        best = tl.argmax(tl.where(in_span, votes, float("-inf")), 0, tie_break_left=True)
        in_span = in_span & (rows != best)
        taken = tl.where((rows == best) & (tl.sum(taken, 0) < hi), 1, taken)
    return taken


@triton.jit(do_not_specialize=["lo", "hi"])
def _span_rows_fwd_kernel(
    Cands, Count, Votes, Out,
    n_cands, n_rows, lo, hi, iou,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    c_idx = tl.arange(0, BLOCK_C)
    c_ok = c_idx < n_cands
    cands = Cands + m * n_cands * 4 + c_idx * 4
    start = tl.load(cands, mask=c_ok, other=0.0).to(tl.int32)
    end = tl.load(cands + 1, mask=c_ok, other=-1.0).to(tl.int32)
    score = tl.load(cands + 2, mask=c_ok, other=0.0)
    count = tl.load(Count + m * n_cands + c_idx, mask=c_ok, other=0)
    length = end - start + 1
    alive = c_ok & (score > 0)
    rows = tl.arange(0, BLOCK_N)
    r_ok = rows < n_rows
    votes = tl.load(Votes + m * n_rows + rows, mask=r_ok, other=float("-inf"))
    taken = tl.zeros([BLOCK_N], dtype=tl.int32)
    spans = tl.sum(alive.to(tl.int32), 0)
    # Greedy NMS, best score first (ties to the lowest midpoint: the reference's stable order). Each kept span
    # suppresses itself and what it overlaps, then serves its rows: the rows follow the spans' order, so both
    # can run in the one pass.
    for _ in range(spans):
        if tl.max(alive.to(tl.int32), 0) > 0:
            c = tl.argmax(tl.where(alive, score, float("-inf")), 0, tie_break_left=True)
            s0 = tl.sum(tl.where(c_idx == c, start, 0), 0)
            e0 = tl.sum(tl.where(c_idx == c, end, 0), 0)
            inter = tl.minimum(end, e0) - tl.maximum(start, s0) + 1
            union = length + (e0 - s0 + 1) - inter
            overlap = (inter > 0) & (inter.to(tl.float64) / union.to(tl.float64) > iou)
            alive = alive & ~overlap & (c_idx != c)
            if tl.sum(taken, 0) < hi:
                k = tl.sum(tl.where(c_idx == c, count, 0), 0)
                taken = _serve(rows, r_ok & (rows >= s0) & (rows <= e0), votes, taken, k, hi)
    # No span at all: the whole map, fully confident (all of its rows count).
    if spans == 0:
        taken = _serve(rows, r_ok, votes, taken, n_rows, hi)
    # Topped up to lo (or the whole map when it is shorter) with the most-voted rows left.
    need = tl.minimum(lo, n_rows) - tl.sum(taken, 0)
    for _ in range(need):
        best = tl.argmax(tl.where(r_ok & (taken == 0), votes, float("-inf")), 0, tie_break_left=True)
        taken = tl.where(rows == best, 1, taken)
    tl.store(Out + m * n_rows + rows, taken.to(tl.int8), mask=r_ok)


def span_rows_triton(cands: torch.Tensor, votes: torch.Tensor, lam: float, lo: int, hi: int,
                     iou: float) -> torch.Tensor:
    """Same contract as reference.span_rows_reference; CUDA tensors (or any under the interpreter)."""
    if cands.dim() != 3 or cands.shape[2] != 4 or cands.dtype != torch.float64:
        raise ValueError(f"expected cands of shape [m, C, 4] float64, got {tuple(cands.shape)} {cands.dtype}")
    m, C, _ = cands.shape
    if votes.dim() != 2 or votes.shape[0] != m or votes.shape[1] > 1024:
        raise ValueError(f"expected votes of shape [{m}, n] with n <= 1024, got {tuple(votes.shape)}")
    for name, t in (("cands", cands), ("votes", votes)):
        check_device(name, t, cands.device)
    n = votes.shape[1]
    out = torch.empty(m, n, dtype=torch.int8, device=cands.device)
    if m == 0 or n == 0:
        return out.bool()
    cands = cands.contiguous()
    with launch_context(cands.device):
        launch(_span_rows_fwd_kernel, (m,),
            cands, span_counts(cands, lam), votes.float().contiguous(), out, C, n, lo, hi, float(iou),
            BLOCK_C=triton.next_power_of_2(C), BLOCK_N=triton.next_power_of_2(n), num_warps=4,
        )
    return out.bool()
