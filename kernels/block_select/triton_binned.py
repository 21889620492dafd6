"""Softmax pooling's top-k (reference.KeepRule: by the scores' bins) spread over the row's chunks of blocks.

With the histogram the pool kernel counts, the k-th score's bin is known without a search: it is the highest bin
with at least k scores in it or above. `_binned_topk_kernel` runs one program per (batch, kv head, chunk of
CHUNK blocks). Each reads that bin from the histogram (in two levels of 64 bins), counts the row's blocks above
it and tied with it before its chunk (one packed sum over the earlier scores, which are in L2), and writes its
chunk's chosen blocks at their places in the ascending list: every block of a higher bin, and of the k-th
score's bin the lowest-indexed ones k still needs. The first program pads the list with -1 past k.

One program per row (triton_topk.py) scans the whole row on one SM, a scan whose time grows with the row; here
each program scans one chunk, and the chunks run side by side. The histogram must count exactly this call's
scores: the bounds kernel clears it before the pool kernel counts (triton.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait
from kernels.block_select import HIST_BINS
from kernels.block_select.triton_topk import _above_and_ties, _bin_of, _head_and_k, _int_key, _store_taken

_SIDE = 64  # the histogram read as _SIDE rows of _SIDE bins
if _SIDE * _SIDE != HIST_BINS:
    raise ImportError(f"the binned top-k reads {_SIDE * _SIDE} histogram bins, the selection counts {HIST_BINS}")


@triton.jit
def _kth_bin(Hist, pid_bh, k):
    """(bin, above) of row pid_bh of Hist [B * Hkv, 64 * 64]: the bin of the k-th largest score, and the count of
    scores in higher bins. Rows of 64 bins first, then the bins of the row that holds the k-th score."""
    offs = tl.arange(0, 64)
    # From L2: other programs of the same launch may have counted into it.
    h = tl.load(Hist + pid_bh * 4096 + offs[:, None] * 64 + offs[None, :], cache_modifier=".cg")  # [row, bin]
    per_row = tl.sum(h, 1)
    row = tl.max(tl.where(tl.cumsum(per_row, 0, reverse=True) >= k, offs, 0), 0)
    above_rows = tl.sum(tl.where(offs > row, per_row, 0), 0)
    bins = tl.sum(tl.where(offs[:, None] == row, h, 0), 0)
    col = tl.max(tl.where(tl.cumsum(bins, 0, reverse=True) + above_rows >= k, offs, 0), 0)
    return row * 64 + col, above_rows + tl.sum(tl.where(offs > col, bins, 0), 0)


@triton.jit
def _counts_before(Row, first, SIZE: tl.constexpr, end, thr, SHIFT: tl.constexpr, BASE: tl.constexpr):
    """Blocks in [first, first + SIZE) before `end`: above thr in the low 16 bits, equal to it in the high 16."""
    offs = first + tl.arange(0, SIZE)
    before = offs < end
    key = _bin_of(_int_key(tl.load(Row + offs, mask=before, other=float("-inf"))), SHIFT, BASE)
    return tl.sum(_above_and_ties(key, before, thr), 0)


@triton.jit
def _binned_topk_kernel(
    Scores, Length, Out, Hist, n_blocks_cap, width, ratio_num, ratio_den, min_blocks, n_kv_heads,
    BLOCK: tl.constexpr, NB_MAIN: tl.constexpr, NB_REST: tl.constexpr, CHUNK: tl.constexpr, W_PAD: tl.constexpr,
    SHIFT: tl.constexpr, BASE: tl.constexpr, PDL: tl.constexpr,
):
    """Scores [B * Hkv, n_blocks_cap] fp32 -> Out [B * Hkv, width] int32, one chunk of a row per program; the row
    fits NB_MAIN + NB_REST blocks (both powers of two), at most 65,535."""
    grid_dependency_wait(PDL)
    pid_bh, n_blocks, k = _head_and_k(Length, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK)
    thr, above = _kth_bin(Hist, pid_bh, k)
    ties = (k - above).to(tl.int32)
    row = Scores + pid_bh * n_blocks_cap
    start = tl.program_id(1) * CHUNK
    end = tl.minimum(start, n_blocks)
    before = _counts_before(row, 0, NB_MAIN, end, thr, SHIFT, BASE)
    before += _counts_before(row, NB_MAIN, NB_REST, end, thr, SHIFT, BASE)
    offs = start + tl.arange(0, CHUNK)
    inside = offs < n_blocks
    key = _bin_of(_int_key(tl.load(row + offs, mask=inside, other=float("-inf"))), SHIFT, BASE)
    out_row = Out + pid_bh * width
    _store_taken(out_row, key, inside, offs, before + tl.cumsum(_above_and_ties(key, inside, thr), 0), thr, ties)
    if tl.program_id(1) == 0:
        offs_w = tl.arange(0, W_PAD)
        tl.store(out_row + offs_w, tl.full([W_PAD], -1, tl.int32), mask=(offs_w >= k) & (offs_w < width))
