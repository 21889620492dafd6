"""Span candidates in one Triton launch: one program per map, from the map to its best span per midpoint.

The reference is dozens of small torch operations per batch of maps (prefix sums, a gather per anti-diagonal,
four gathers per rectangle sum); prefill issues a batch for every layer and chunk. Here a program loads its map,
forms both float64 prefix sums in registers (the thresholded map's for the triangle scores, the raw map's for
the confidence), writes them to a scratch buffer, and reads them back along the anti-diagonals. The prefix sums
are parallel scans, so their rounding differs from a sequential sum by float64 ulps (exact for maps of integers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch, launch_context

MAX_N = 128  # the map and both its prefix sums stay in registers up to this size (ltri-stream's blocks)


@triton.jit
def _at(P, r, c, n):
    """The zero-bordered prefix sum P[r, c] = sum of rows < r and columns < c, from the scratch [n, n]; lanes
    outside 0..n read 0 (padding lanes never touch memory outside the map's scratch)."""
    ok = (r >= 1) & (c >= 1) & (r <= n) & (c <= n)
    return tl.load(P + (r - 1) * n + (c - 1), mask=ok, other=0.0)


@triton.jit
def _rect(P, r0, r1, c0, c1, n):
    """Sums over rows r0..r1 and columns c0..c1 (inclusive; empty ranges give 0), as the reference orders them."""
    return _at(P, r1 + 1, c1 + 1, n) - _at(P, r0, c1 + 1, n) - _at(P, r1 + 1, c0, n) + _at(P, r0, c0, n)


@triton.jit
def _span_candidates_fwd_kernel(
    Maps, Theta, Scratch, Out,
    n, stride_mm, stride_mr,
    ROW: tl.constexpr, COL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    inside = (r < n) & (c < n)
    a = tl.load(Maps + m * stride_mm + r * stride_mr + c, mask=inside, other=0.0).to(tl.float64)
    theta = tl.load(Theta + m)
    thresholded = Scratch + m * 2 * n * n
    raw = thresholded + n * n
    # Rows first, then columns, as the reference's cumsum(-2).cumsum(-1).
    pt = tl.cumsum(tl.cumsum(tl.where(inside & (c <= r), a - theta, 0.0), axis=0), axis=1)
    tl.store(thresholded + r * n + c, pt, mask=inside)
    pr = tl.cumsum(tl.cumsum(a, axis=0), axis=1)
    tl.store(raw + r * n + c, pr, mask=inside)
    tl.debug_barrier()  # the scratch is read back below by other threads of the program

    i = tl.arange(0, BLOCK)[None, :]
    n_mid = 2 * n - 1
    for s0 in range(0, n_mid, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        j = s[:, None] - i
        valid = (j >= i) & (j < n) & (s[:, None] < n_mid)
        jj = tl.where(valid, j, 0)
        # TA(i, j) = P[j + 1, j + 1] - P[j + 1, i] on the zero-bordered prefix sums.
        ta = _at(thresholded, jj + 1, jj + 1, n) - _at(thresholded, jj + 1, tl.where(valid, i, 0), n)
        ta = tl.where(valid, ta, float("-inf"))
        best = tl.max(ta, 1)
        ok = s < n_mid
        bi = tl.where(ok, tl.argmax(ta, 1, tie_break_left=True), 0)
        bj = tl.where(ok, s - bi, 0)
        tri = _rect(raw, bi, bj, bi, bj, n)
        total = tri
        if ROW:
            total = total + _rect(raw, bi, bj, bi * 0, bi - 1, n)
        if COL:
            total = total + _rect(raw, bj + 1, bi * 0 + n - 1, bi, bj, n)
        conf = tl.where(total > 0, tri / tl.maximum(total, 1e-300), 1.0)
        out = Out + (m * n_mid + s) * 4
        tl.store(out, bi.to(tl.float64), mask=ok)
        tl.store(out + 1, bj.to(tl.float64), mask=ok)
        tl.store(out + 2, best, mask=ok)
        tl.store(out + 3, conf, mask=ok)


def span_candidates_triton(maps: torch.Tensor, theta: torch.Tensor, ratio_mode: str) -> torch.Tensor:
    """Same contract as reference.span_candidates_reference; CUDA tensors (or any under the interpreter), maps
    of at most MAX_N rows."""
    if maps.dim() != 3 or maps.shape[1] != maps.shape[2]:
        raise ValueError(f"expected maps of shape [m, n, n], got {tuple(maps.shape)}")
    m, n, _ = maps.shape
    if not 1 <= n <= MAX_N:
        raise ValueError(f"expected maps of 1 to {MAX_N} rows, got {n}")
    if maps.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"expected maps in float32 or float64, got {maps.dtype}")
    if theta.shape != (m,) or theta.dtype != torch.float64:
        raise ValueError(f"expected theta of shape [{m}] float64, got {tuple(theta.shape)} {theta.dtype}")
    if ratio_mode not in ("row", "col", "rowcol"):
        raise ValueError(f"expected ratio_mode row, col or rowcol, got {ratio_mode!r}")
    for name, t in (("maps", maps), ("theta", theta)):
        check_device(name, t, maps.device)
    out = torch.empty(m, 2 * n - 1, 4, dtype=torch.float64, device=maps.device)
    if m == 0:
        return out
    scratch = torch.empty(m, 2, n, n, dtype=torch.float64, device=maps.device)
    block = max(16, triton.next_power_of_2(n))
    with launch_context(maps.device):
        launch(_span_candidates_fwd_kernel, (m,),
            maps, theta, scratch, out, n, maps.stride(0), maps.stride(1),
            ROW=ratio_mode in ("row", "rowcol"), COL=ratio_mode in ("col", "rowcol"), BLOCK=block,
            BLOCK_S=max(1, 4096 // block), num_warps=16 if block >= 128 else 4,
        )
    return out
