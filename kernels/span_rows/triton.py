"""Span selection in one Triton launch: one program per map runs the greedy NMS and the row picking.

The reference brings the candidates to the host (a wait for the device per layer and chunk) and loops there;
here a program holds its map's ranked candidates (up to 2n - 1) and rows in registers, visits the candidates
best first (each kept one suppresses those it overlaps), then serves each kept span its most-voted rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch_context


@triton.jit
def _pick(c_idx, values, c):
    """values[c] of a register vector, as a scalar."""
    return tl.sum(tl.where(c_idx == c, values, 0), 0)


@triton.jit(do_not_specialize=["lo", "hi"])
def _span_rows_fwd_kernel(
    Start, End, Count, Alive, Votes, Out,
    n_cands, n_rows, lo, hi, iou,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    c_idx = tl.arange(0, BLOCK_C)
    c_ok = c_idx < n_cands
    base = m * n_cands
    start = tl.load(Start + base + c_idx, mask=c_ok, other=0)
    end = tl.load(End + base + c_idx, mask=c_ok, other=-1)
    alive = (tl.load(Alive + base + c_idx, mask=c_ok, other=0) != 0).to(tl.int32)
    length = end - start + 1
    kept = tl.zeros([BLOCK_C], dtype=tl.int32)
    # Greedy NMS, best first: a candidate still alive is kept and suppresses itself and what it overlaps.
    for c in range(n_cands):
        if _pick(c_idx, alive, c) > 0:
            s0 = tl.load(Start + base + c)
            e0 = tl.load(End + base + c)
            inter = tl.minimum(end, e0) - tl.maximum(start, s0) + 1
            union = length + (e0 - s0 + 1) - inter
            overlap = (inter > 0) & (inter.to(tl.float64) / union.to(tl.float64) > iou)
            alive = tl.where(overlap, 0, alive)
            kept = tl.where(c_idx == c, 1, kept)

    rows = tl.arange(0, BLOCK_N)
    r_ok = rows < n_rows
    votes = tl.load(Votes + m * n_rows + rows, mask=r_ok, other=float("-inf"))
    taken = tl.zeros([BLOCK_N], dtype=tl.int32)
    # Each kept span, best first, serves its count of most-voted rows (ties to the lowest row) until hi rows.
    for c in range(n_cands):
        if (_pick(c_idx, kept, c) > 0) & (tl.sum(taken, 0) < hi):
            s0 = tl.load(Start + base + c)
            e0 = tl.load(End + base + c)
            count = tl.load(Count + base + c)
            in_span = r_ok & (rows >= s0) & (rows <= e0)
            for _ in range(count):
                best = tl.argmax(tl.where(in_span, votes, float("-inf")), 0, tie_break_left=True)
                in_span = in_span & (rows != best)
                add = tl.sum(taken, 0) < hi
                taken = tl.where((rows == best) & add, 1, taken)
    # Topped up to lo (or the whole map when it is shorter) with the most-voted rows left.
    need = tl.minimum(lo, n_rows) - tl.sum(taken, 0)
    for _ in range(need):
        best = tl.argmax(tl.where(r_ok & (taken == 0), votes, float("-inf")), 0, tie_break_left=True)
        taken = tl.where(rows == best, 1, taken)
    tl.store(Out + m * n_rows + rows, taken.to(tl.int8), mask=r_ok)


def span_rows_triton(start, end, count, alive, votes: torch.Tensor, lo: int, hi: int, iou: float) -> torch.Tensor:
    """Same contract as reference.span_rows_reference; CUDA tensors (or any under the interpreter)."""
    if start.dim() != 2:
        raise ValueError(f"expected start of shape [m, C], got {tuple(start.shape)}")
    m, C = start.shape
    for name, t in (("start", start), ("end", end), ("count", count)):
        if t.shape != (m, C) or t.dtype != torch.int64:
            raise ValueError(f"expected {name} of shape [{m}, {C}] int64, got {tuple(t.shape)} {t.dtype}")
    if alive.shape != (m, C) or alive.dtype != torch.bool:
        raise ValueError(f"expected alive of shape [{m}, {C}] bool, got {tuple(alive.shape)} {alive.dtype}")
    if votes.dim() != 2 or votes.shape[0] != m or votes.shape[1] > 1024:
        raise ValueError(f"expected votes of shape [{m}, n] with n <= 1024, got {tuple(votes.shape)}")
    for name, t in (("start", start), ("end", end), ("count", count), ("alive", alive), ("votes", votes)):
        check_device(name, t, start.device)
    n = votes.shape[1]
    out = torch.empty(m, n, dtype=torch.int8, device=start.device)
    if m == 0 or n == 0:
        return out.bool()
    votes = votes.float().contiguous()
    with launch_context(start.device):
        _span_rows_fwd_kernel[(m,)](
            start.contiguous(), end.contiguous(), count.contiguous(), alive.contiguous().view(torch.int8), votes,
            out, C, n, lo, hi, float(iou),
            BLOCK_C=triton.next_power_of_2(C), BLOCK_N=triton.next_power_of_2(n), num_warps=4,
        )
    return out.bool()
