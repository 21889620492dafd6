"""Farthest-point sampling in one Triton launch: one program per block runs every slot's step.

The batched reference takes more than a dozen launches per slot (up to 48 slots a chunk); here a program keeps its
block's picked flags and running distances in registers and streams the keys from L2 once per slot, in tiles
of features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch, launch_context


@triton.jit(do_not_specialize=["n_slots"])
def _farthest_point_fwd_kernel(
    Keys, Votes, Ranges, Picks,
    n_rows, n_feats, n_slots,
    stride_km, stride_kn, stride_vm, stride_rm, stride_rs,
    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)
    in_block = rows < n_rows
    feats = tl.arange(0, BLOCK_F)
    k_base = Keys + blk * stride_km
    votes = tl.load(Votes + blk * stride_vm + rows, mask=in_block, other=0.0).to(tl.float32)
    chosen = rows < 0
    dist = tl.full([BLOCK_N], float("inf"), dtype=tl.float32)
    picked_any = 0
    for s in range(n_slots):
        lo = tl.load(Ranges + blk * stride_rm + s * stride_rs)
        hi = tl.load(Ranges + blk * stride_rm + s * stride_rs + 1)
        ok = in_block & (rows >= lo) & (rows <= hi) & ~chosen
        crit = tl.where(ok, tl.where(picked_any > 0, dist, votes), float("-inf"))
        found = tl.max(ok.to(tl.int32), 0) > 0
        best = tl.argmax(crit, 0, tie_break_left=True)
        tl.store(Picks + blk * n_slots + s, tl.where(found, best, -1).to(tl.int64))
        if found:
            chosen = chosen | (rows == best)
            picked_any = 1
            step = tl.zeros([BLOCK_N], dtype=tl.float32)
            for f0 in range(0, n_feats, BLOCK_F):
                f = f0 + feats
                f_ok = f < n_feats
                k = tl.load(k_base + rows[:, None] * stride_kn + f[None, :], mask=in_block[:, None] & f_ok[None, :],
                            other=0.0).to(tl.float32)
                c = tl.load(k_base + best * stride_kn + f, mask=f_ok, other=0.0).to(tl.float32)
                d = k - c[None, :]
                step += tl.sum(d * d, 1)
            dist = tl.minimum(dist, step)


def farthest_point_triton(keys: torch.Tensor, votes: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.farthest_point_reference; CUDA tensors (or any under the interpreter)."""
    if keys.dim() != 3:
        raise ValueError(f"expected keys of shape [m, n, F], got {tuple(keys.shape)}")
    m, n, F = keys.shape
    if votes.shape != (m, n):
        raise ValueError(f"expected votes of shape [{m}, {n}], got {tuple(votes.shape)}")
    if ranges.dim() != 3 or ranges.shape[0] != m or ranges.shape[2] != 2 or ranges.dtype != torch.int64:
        raise ValueError(f"expected ranges of shape [{m}, S, 2] int64, got {tuple(ranges.shape)} {ranges.dtype}")
    if n > 1024:
        raise ValueError(f"expected at most 1024 rows a block, got {n}")
    for name, t in (("keys", keys), ("votes", votes), ("ranges", ranges)):
        check_device(name, t, keys.device)
    S = ranges.shape[1]
    picks = torch.empty(m, S, dtype=torch.int64, device=keys.device)
    if m == 0 or S == 0:
        return picks
    block_n = triton.next_power_of_2(n)
    # A [BLOCK_N, BLOCK_F] fp32 tile of 8K elements: 64 registers a thread over 4 warps.
    block_f = max(16, min(triton.next_power_of_2(F), 8192 // block_n))
    with launch_context(keys.device):
        launch(_farthest_point_fwd_kernel, (m,),
            keys, votes, ranges, picks, n, F, S,
            keys.stride(0), keys.stride(1), votes.stride(0), ranges.stride(0), ranges.stride(1),
            BLOCK_N=block_n, BLOCK_F=block_f, num_warps=4,
        )
    return picks
