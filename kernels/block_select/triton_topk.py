"""The top-k half of block selection: which blocks score at least the k-th largest score, exactly.

`_block_topk_resident_kernel`, one program per (batch, kv head): finds the k-th largest score over the scores'
order-preserving integer keys, held in registers as two power-of-two parts (k is computed on the device from
`length`) by a binary search between the smallest and largest finite key that stops once exactly k blocks are
at or above the midpoint (at most 32 steps), then writes the blocks scoring above it, plus as many ties as needed
(lowest index first), in ascending order, and pads with -1. Past the launcher's resident limit,
`_block_topk_kernel` does the same in passes over the scores (which stay in L2). Measured on an H100 and not kept: a
radix select (four tl.histogram passes, 1.8x slower), a search of 2 bits a step (three counts a step, slower), the
same three counts packed into one int64 reduction (select 31.1 -> 31.5 us at 8,192 blocks, 65.2 -> 69.4 at 16,384),
the softmax pooling fused into this kernel (slower).

Given a histogram of the scores (HIST_BINS bins of their order keys, counted by the scoring kernel), both kernels
start their search inside the bin that holds the k-th largest score instead of across every finite score, and
zero the histogram for the next call. A histogram that does not count exactly the row's blocks (left over from a
call stopped between its two launches) is ignored: the search then brackets by the keys present.

BINNED (softmax pooling's rule, reference.select_blocks): the keys compared are the scores' bins, so the k-th
score's bin is the threshold and, with the histogram, there is nothing to search: one pass takes the blocks of
higher bins and the lowest-indexed blocks of that bin.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait
from kernels.block_select import HIST_BINS

_HIST_BINS = tl.constexpr(HIST_BINS)


@triton.jit
def _int_key(s):
    """fp32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    u = s.to(tl.int32, bitcast=True)
    return u ^ ((u >> 31) & 0x7FFFFFFF)


@triton.jit
def _bin_of(key, SHIFT: tl.constexpr, BASE: tl.constexpr):
    """int32 order keys -> their bins (reference.score_bins): key >> SHIFT less BASE, clamped to the bins."""
    return tl.minimum(tl.maximum((key >> SHIFT) - BASE, 0), _HIST_BINS - 1)


@triton.jit
def count_score_bins(Hist, pid_bh, s, inside, SHIFT: tl.constexpr, BASE: tl.constexpr):
    """Add the scores s (fp32) where `inside` to their bins in row pid_bh of Hist [B * Hkv, HIST_BINS] int32."""
    bins = _bin_of(_int_key(s), SHIFT, BASE)
    tl.atomic_add(Hist + pid_bh.to(tl.int64) * _HIST_BINS + bins, inside.to(tl.int32), mask=inside, sem="relaxed")


@triton.jit
def _sum_max_min(a_n, a_bin, a_count, b_n, b_bin, b_count):
    return a_n + b_n, tl.maximum(a_bin, b_bin), tl.minimum(a_count, b_count)


@triton.jit
def _hist_bracket(Hist, pid_bh, n_blocks, k, SHIFT: tl.constexpr, BASE: tl.constexpr, BINNED: tl.constexpr):
    """(usable, lo, hi, exact) from row pid_bh of the histogram, which is zeroed: [lo, hi) is the bin of the k-th
    largest int32 order key (BINNED: that bin's index, lo, and lo + 1), exact when exactly k keys are >= lo.
    usable: the row counts n_blocks scores."""
    offs = tl.arange(0, _HIST_BINS)
    row = Hist + pid_bh * _HIST_BINS + offs
    h = tl.load(row)
    tl.store(row, tl.zeros_like(h))
    above = tl.cumsum(h, 0, reverse=True)  # keys in this bin or higher
    reach = above >= k
    total, top_bin, at_top = tl.reduce((h, tl.where(reach, offs, -1), tl.where(reach, above, 2147483647)), 0,
                                       _sum_max_min)
    if BINNED:
        lo = top_bin.to(tl.int64)
        hi = lo + 1
    else:
        # The end bins also hold the keys clamped into them.
        lo = tl.where(top_bin == 0, -2147483648, (top_bin + BASE).to(tl.int64) << SHIFT)
        hi = tl.where(top_bin == _HIST_BINS - 1, 2147483648, (top_bin + BASE + 1).to(tl.int64) << SHIFT)
    return (total == n_blocks) & (top_bin >= 0), lo, hi, at_top == k


@triton.jit
def _order_key(s):
    """fp32 -> int64 in [0, 2^32) with the same order."""
    return _int_key(s).to(tl.int64) + 2147483648


@triton.jit
def _select_key(s, SHIFT: tl.constexpr, BASE: tl.constexpr, BINNED: tl.constexpr):
    """The multipass kernel's key of a score: its bin (BINNED), else its order key, as int64."""
    if BINNED:
        key = _bin_of(_int_key(s), SHIFT, BASE).to(tl.int64)
    else:
        key = _order_key(s)
    return key


@triton.jit
def _head_and_k(Length, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK: tl.constexpr):
    """This program's (batch, kv head) row, its sequence's block count and k = max(ceil(n * ratio), min(n, min))."""
    pid_bh = tl.program_id(0).to(tl.int64)
    length = tl.load(Length + pid_bh // n_kv_heads).to(tl.int64)
    n_blocks = tl.cdiv(length, BLOCK)
    return pid_bh, n_blocks, tl.maximum(tl.cdiv(n_blocks * ratio_num, ratio_den), tl.minimum(n_blocks, min_blocks))


@triton.jit
def _count_at_least(Row, n, thr, TILE: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr, BINNED: tl.constexpr):
    count = tl.zeros([], dtype=tl.int64)
    for t in range(0, n, TILE):
        offs = t + tl.arange(0, TILE)
        key = _select_key(tl.load(Row + offs, mask=offs < n, other=float("-inf")), SHIFT, BASE, BINNED)
        count += tl.sum(((key >= thr) & (offs < n)).to(tl.int64), 0)
    return count


@triton.jit
def _block_topk_kernel(
    Scores, Length, Out, Hist, n_blocks_cap, width, ratio_num, ratio_den, min_blocks, n_kv_heads,
    BLOCK: tl.constexpr, TILE: tl.constexpr, HIST: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr,
    BINNED: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    pid_bh, n_blocks, k = _head_and_k(Length, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK)
    row = Scores + pid_bh * n_blocks_cap
    # Invariant: count(key >= lo) >= k > count(key >= hi); after at most 32 halvings lo is the k-th largest
    # key, or a key with exactly k blocks at or above it (as good a threshold: the output takes its ties).
    lo = tl.zeros([], dtype=tl.int64)
    hi = lo + (_HIST_BINS if BINNED else 4294967296)
    count = lo - 1
    if HIST:
        usable, bin_lo, bin_hi, exact = _hist_bracket(Hist, pid_bh, n_blocks, k, SHIFT, BASE, BINNED)
        if usable:
            # The histogram's int32 keys, shifted to this kernel's unsigned ones (bins stay as they are).
            lo = bin_lo + (0 if BINNED else 2147483648)
            hi = bin_hi + (0 if BINNED else 2147483648)
            count = tl.where(exact, k, count)
    while (hi - lo > 1) & (count != k):
        mid = (lo + hi) // 2
        count = _count_at_least(row, n_blocks, mid, TILE, SHIFT, BASE, BINNED)
        enough = count >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    ties_wanted = k - _count_at_least(row, n_blocks, lo + 1, TILE, SHIFT, BASE, BINNED)
    out_row = Out + pid_bh * width
    n_sel = tl.zeros([], dtype=tl.int64)
    n_eq = tl.zeros([], dtype=tl.int64)
    for t in range(0, n_blocks, TILE):
        offs = t + tl.arange(0, TILE)
        inside = offs < n_blocks
        key = _select_key(tl.load(row + offs, mask=inside, other=float("-inf")), SHIFT, BASE, BINNED)
        eq = (key == lo) & inside
        take = ((key > lo) & inside) | (eq & (n_eq + tl.cumsum(eq.to(tl.int64), 0) <= ties_wanted))
        slot = n_sel + tl.cumsum(take.to(tl.int64), 0) - 1
        tl.store(out_row + slot, offs.to(tl.int32), mask=take)
        n_sel += tl.sum(take.to(tl.int64), 0)
        n_eq += tl.sum(eq.to(tl.int64), 0)
    for t in range(0, width, TILE):
        offs = t + tl.arange(0, TILE)
        tl.store(out_row + offs, tl.full([TILE], -1, tl.int32), mask=(offs >= k) & (offs < width))


@triton.jit
def _resident_keys(Row, offs, inside):
    return _int_key(tl.load(Row + offs, mask=inside, other=float("-inf")))


@triton.jit
def _min_max_count(a_low, a_high, a_n, b_low, b_high, b_n):
    return tl.minimum(a_low, b_low), tl.maximum(a_high, b_high), a_n + b_n


@triton.jit
def _key_range(key, inside):
    """One reduction: the smallest key, the largest finite key and the count of +inf (or NaN) keys."""
    inf_key = 2139095040
    finite = key < inf_key
    return tl.reduce((tl.where(inside, key, inf_key), tl.where(inside & finite, key, -2147483648),
                      (inside & ~finite).to(tl.int32)), 0, _min_max_count)


@triton.jit
def _resident_row(Scores, Length, n_blocks_cap, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK: tl.constexpr,
                  NB_MAIN: tl.constexpr, NB_REST: tl.constexpr):
    """This program's row, its block count, k, and its scores' keys in registers as two power-of-two parts
    (offsets, in-range mask, keys of each)."""
    pid_bh, n_blocks, k = _head_and_k(Length, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK)
    row = Scores + pid_bh * n_blocks_cap
    offs_a = tl.arange(0, NB_MAIN)
    offs_b = NB_MAIN + tl.arange(0, NB_REST)
    in_a = offs_a < n_blocks
    in_b = offs_b < n_blocks
    return (pid_bh, n_blocks, k, offs_a, in_a, _resident_keys(row, offs_a, in_a), offs_b, in_b,
            _resident_keys(row, offs_b, in_b))


@triton.jit
def _resident_bracket(key_a, in_a, key_b, in_b, k):
    """Bracket the search by the keys present (+inf marks the blocks always kept): lo = the smallest key, hi = one
    past the largest finite key unless k blocks reach it."""
    low_a, high_a, n_inf_a = _key_range(key_a, in_a)
    low_b, high_b, n_inf_b = _key_range(key_b, in_b)
    lo = tl.minimum(low_a, low_b).to(tl.int64)
    top = tl.maximum(tl.maximum(high_a, high_b).to(tl.int64), lo) + 1
    return lo, tl.where(n_inf_a + n_inf_b < k, top, 2147483648)


@triton.jit
def _resident_search(key_a, in_a, key_b, in_b, k, lo, hi, count, COUNT: tl.constexpr):
    """(threshold, exact, steps): halves [lo, hi) and stops as soon as exactly k blocks score >= mid (mid is then
    as good a threshold as the k-th key: the output takes every tie of it; exact says so). count: the blocks
    known to score >= lo (k: no search), else -1. Steps are counted only with COUNT (the selection breakdown's);
    the shipped kernel's loop carries nothing more."""
    steps = tl.zeros([], dtype=tl.int32)
    while (hi - lo > 1) & (count != k):
        mid = (lo + hi) >> 1
        m32 = mid.to(tl.int32)
        count = tl.sum(((key_a >= m32) & in_a).to(tl.int32), 0) + tl.sum(((key_b >= m32) & in_b).to(tl.int32), 0)
        enough = count >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
        if COUNT:
            steps += 1
    return lo.to(tl.int32), count == k, steps


@triton.jit
def _resident_store(out_row, key_a, in_a, offs_a, key_b, in_b, offs_b, thr, exact, k, width, W_PAD: tl.constexpr):
    """The blocks scoring above thr, then as many of its ties as k needs (lowest index first), in ascending
    order; -1 up to width. exact: exactly k blocks score >= thr (a search that stopped early), so all are taken
    and no tie needs its rank."""
    if exact:
        take_a = (key_a >= thr) & in_a
        take_b = (key_b >= thr) & in_b
        tl.store(out_row + tl.cumsum(take_a.to(tl.int32), 0) - 1, offs_a.to(tl.int32), mask=take_a)
        first_b = tl.sum(take_a.to(tl.int32), 0)
        tl.store(out_row + first_b + tl.cumsum(take_b.to(tl.int32), 0) - 1, offs_b.to(tl.int32), mask=take_b)
    else:
        # One scan a part counts both the blocks above thr (low 16 bits) and its ties (high 16 bits); block i is
        # taken if above, or a tie within the first `ties`, and lands after the blocks taken before it.
        both_a = _above_and_ties(key_a, in_a, thr)
        both_b = _above_and_ties(key_b, in_b, thr)
        total_a = tl.sum(both_a, 0)
        ties = k - ((total_a & 0xFFFF) + (tl.sum(both_b, 0) & 0xFFFF)).to(tl.int32)
        _store_taken(out_row, key_a, in_a, offs_a, tl.cumsum(both_a, 0), thr, ties)
        _store_taken(out_row, key_b, in_b, offs_b, total_a + tl.cumsum(both_b, 0), thr, ties)
    offs_w = tl.arange(0, W_PAD)
    tl.store(out_row + offs_w, tl.full([W_PAD], -1, tl.int32), mask=(offs_w >= k) & (offs_w < width))


@triton.jit
def _above_and_ties(key, inside, thr):
    """Per block: 1 if above thr, 1 << 16 if equal to it (uint32: a row's counts fit 16 bits each)."""
    return ((key > thr) & inside).to(tl.uint32) + (((key == thr) & inside).to(tl.uint32) << 16)


@triton.jit
def _store_taken(out_row, key, inside, offs, counts, thr, ties):
    """Store the taken blocks of one part; counts: the inclusive scan of _above_and_ties over the row so far."""
    above = (counts & 0xFFFF).to(tl.int32)
    tied = (counts >> 16).to(tl.int32)
    take = ((key > thr) | ((key == thr) & (tied <= ties))) & inside
    tl.store(out_row + above + tl.minimum(tied, ties) - 1, offs.to(tl.int32), mask=take)


@triton.jit
def _block_topk_resident_kernel(
    Scores, Length, Out, Hist, n_blocks_cap, width, ratio_num, ratio_den, min_blocks, n_kv_heads,
    BLOCK: tl.constexpr, NB_MAIN: tl.constexpr, NB_REST: tl.constexpr, W_PAD: tl.constexpr, HIST: tl.constexpr,
    SHIFT: tl.constexpr, BASE: tl.constexpr, BINNED: tl.constexpr, PDL: tl.constexpr,
):
    """_block_topk_kernel for up to NB_MAIN + NB_REST blocks: the scores are loaded once and searched in
    registers, as two power-of-two parts (16,389 blocks are 16,384 + 16 rather than 32,768)."""
    grid_dependency_wait(PDL)
    pid_bh, n_blocks, k, offs_a, in_a, key_a, offs_b, in_b, key_b = _resident_row(
        Scores, Length, n_blocks_cap, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK, NB_MAIN, NB_REST)
    if BINNED:
        key_a = _bin_of(key_a, SHIFT, BASE)
        key_b = _bin_of(key_b, SHIFT, BASE)
    lo, hi, count = _bracket(Hist, pid_bh, n_blocks, k, key_a, in_a, key_b, in_b, HIST, SHIFT, BASE, BINNED)
    thr, exact, _ = _resident_search(key_a, in_a, key_b, in_b, k, lo, hi, count, False)
    _resident_store(Out + pid_bh * width, key_a, in_a, offs_a, key_b, in_b, offs_b, thr, exact, k, width, W_PAD)


@triton.jit
def _bracket(Hist, pid_bh, n_blocks, k, key_a, in_a, key_b, in_b, HIST: tl.constexpr, SHIFT: tl.constexpr,
             BASE: tl.constexpr, BINNED: tl.constexpr):
    """The search's start (lo, hi, count): the histogram's bin where it is usable, else the keys' range."""
    count = tl.full([], -1, tl.int32)
    if HIST:
        usable, lo, hi, exact = _hist_bracket(Hist, pid_bh, n_blocks, k, SHIFT, BASE, BINNED)
        if usable:
            count = tl.where(exact, k.to(tl.int32), count)
        else:
            lo, hi = _resident_bracket(key_a, in_a, key_b, in_b, k)
    else:
        lo, hi = _resident_bracket(key_a, in_a, key_b, in_b, k)
    return lo, hi, count
