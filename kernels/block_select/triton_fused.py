"""Softmax pooling's whole selection in one launch: bounds, pooled scores, their histogram and the binned top-k.

The selection has three row-wide dependencies: the heads' softmax needs every block's bound for its max and sum,
the k-th score's bin needs every score counted, and a block's place in the ascending output needs the count of
blocks kept before it. Split into launches (triton.py) each dependency costs a kernel boundary, several µs of
a decode step's layer. Here one program per (batch, kv head, part of the row) runs four phases and the row's
programs meet between them at a barrier in global memory (`row_barrier`):

1. bounds of the part's blocks (tile_bounds), its per-head max and sum of exp2, and a slice of the row's histogram
   cleared;
2. the part's pooled scores (pool_scores, over every part's max and sum), counted into the histogram and kept in
   registers for the phases after it (the part's blocks are one vector there);
3. the k-th score's bin from the histogram (_kth_bin), and the part's blocks above it and tied with it;
4. the part's kept blocks written at their places (the counts of the parts before it), -1 past k, and its slice
   of the histogram zeroed again (a call leaves the histogram as the separate launches do: zeroed).

With STAMPS each program also writes the GPU's global timer (ns) at its start, when the kernel before it is done,
and at each phase's end and each barrier's passing (reference.PHASE_STAMPS): where the launch's time goes inside a
captured step, which a profiler sees only as one kernel.

A barrier only works if every program of the row is resident at once: the launcher starts no more programs than
the device holds at once (from the compiled kernel's registers and shared memory), and a program waits a bounded
number of polls before it gives up and records that in the row's sync words (`barrier_timeouts`; with 4
programs an SM asked for where 3 fit, every call gave up). The sync words are scratch the caller zeroes once
(`new_sync`) and keeps: a call leaves the first two barriers' words at zero and the third's at its count, which the
next call's first barrier zeroes. Triton's interpreter runs programs one after another, so there (and wherever
`FIRST`/`LAST` split the phases) the phases run as separate launches of the same kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from kernels._gdc import grid_dependency_wait
from kernels.block_select.reference import HIST_BINS, PHASE_STAMPS, SYNC_WORDS
from kernels.block_select.triton_scores import group_query, pool_scores, tile_bounds
from kernels.block_select.triton_topk import (_above_and_ties, _bin_of, _head_and_k, _int_key, _store_taken,
                                              count_score_bins)

_HIST_BINS = tl.constexpr(HIST_BINS)
if HIST_BINS != 64 * 64:
    raise ImportError(f"the fused selection reads the histogram as 64 rows of 64 bins, the selection counts "
                      f"{HIST_BINS}")
# A row's sync words (reference.SYNC_WORDS): the arrivals at barriers 1 and 2, the barriers given up, the arrivals
# at barrier 3.
_SYNC_WORDS = tl.constexpr(SYNC_WORDS)
_GIVEN_UP = tl.constexpr(2)
_MAX_POLLS = tl.constexpr(1 << 22)  # about a second of polling: far past any phase's time, short of a hang
_N_STAMPS = tl.constexpr(len(PHASE_STAMPS))


@triton.jit
def _stamp(Stamps, slot: tl.constexpr, pid_bh, part, n_programs, STAMPS: tl.constexpr):
    """Stamps [rows, n_programs, len(PHASE_STAMPS)] int64: the global timer at this program's `slot`."""
    if STAMPS:
        tl.store(Stamps + (pid_bh * n_programs + part) * _N_STAMPS + slot, globaltimer())


@triton.jit
def row_barrier(Sync, row, n_programs, WORD: tl.constexpr, BEFORE: tl.constexpr):
    """Wait until the n_programs programs of `row` have all arrived: each adds one to the barrier's own word and
    polls it until it reads n_programs, so the last arrival's add is what releases the others. That program then
    zeroes the word of the barrier before this one (BEFORE), which every program of the row has left (they have all
    arrived here); the last barrier's word is zeroed at the next call's first barrier. Every thread's writes before
    the barrier are visible to every program of the row after it (bar.sync, then release / acquire by one thread)."""
    tl.debug_barrier()
    words = Sync + row * _SYNC_WORDS
    old = tl.atomic_add(words + WORD, 1, sem="acq_rel")
    if old == n_programs - 1:
        tl.atomic_xchg(words + BEFORE, 0, sem="relaxed")
    else:
        polls = 0
        waiting = True
        while waiting:
            polls += 1
            waiting = (tl.atomic_add(words + WORD, 0, sem="acquire") < n_programs) & (polls < _MAX_POLLS)
        if polls >= _MAX_POLLS:
            tl.atomic_add(words + _GIVEN_UP, 1, sem="relaxed")
    tl.debug_barrier()


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
def clear_histogram_slice(Hist, pid_bh, part, SLICE: tl.constexpr):
    """Zero bins [part * SLICE, (part + 1) * SLICE) of row pid_bh of Hist [B * Hkv, HIST_BINS]."""
    offs_h = part * SLICE + tl.arange(0, SLICE)
    tl.store(Hist + pid_bh.to(tl.int64) * _HIST_BINS + offs_h, tl.zeros([SLICE], tl.int32), mask=offs_h < _HIST_BINS)


@triton.jit
def _fused_select_kernel(
    Q, Kmax, Kmin, Kmean, Scale, Length, Bounds, PartMax, PartSum, Scores, Hist, Counts, Sync, Out, Stamps,
    n_kv_heads, n_blocks_cap, n_programs, n_sub, width, ratio_num, ratio_den, min_blocks, local_blocks, sink_blocks,
    scale_log2, stride_qb, stride_qh, stride_db, stride_dh, stride_dn, stride_sb, stride_sh,
    GROUP: tl.constexpr, G_DOT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
    CENTROID: tl.constexpr, FOLDED: tl.constexpr, QUANT: tl.constexpr, IEEE: tl.constexpr, P_PAD: tl.constexpr,
    HIST_SLICE: tl.constexpr, W_PAD: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr, FIRST: tl.constexpr,
    LAST: tl.constexpr, STAGES: tl.constexpr, PART: tl.constexpr, PDL: tl.constexpr, STAMPS: tl.constexpr,
):
    """Out [B * Hkv, width] int32 from q [B, Hq, D] and the descriptors; program (row, part) covers the n_sub tiles
    of TILE blocks from part * n_sub. Phases FIRST..LAST run in this launch (1..4: all of them); STAMPS only with
    all of them."""
    part = tl.program_id(1)
    _stamp(Stamps, 0, tl.program_id(0), part, n_programs, STAMPS)
    grid_dependency_wait(PDL)
    pid_bh, n_blocks, k = _head_and_k(Length, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK)
    _stamp(Stamps, 1, pid_bh, part, n_programs, STAMPS)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    first_block = part.to(tl.int64) * n_sub * TILE
    offs_g = tl.arange(0, G_DOT)
    heads = offs_g < GROUP
    rows = pid_bh * GROUP + offs_g
    if FIRST <= 1:
        clear_histogram_slice(Hist, pid_bh, part, HIST_SLICE)
        m_run = tl.full([G_DOT], float("-inf"), tl.float32)
        z_run = tl.zeros([G_DOT], tl.float32)
        a_pos, a_neg, a_pos_lo, a_neg_lo, step, q = group_query(Q, Kmax, b, h, stride_qb, stride_qh, GROUP, G_DOT,
                                                                 HEAD_DIM, QUANT, IEEE)
        for t in tl.range(0, n_sub, num_stages=STAGES):
            offs = first_block + t * TILE + tl.arange(0, TILE)
            s = tile_bounds(a_pos, a_neg, a_pos_lo, a_neg_lo, step, q, Kmax, Kmin, Kmean, Scale, b, h, offs,
                            n_blocks, n_blocks_cap, local_blocks, sink_blocks, scale_log2, stride_db, stride_dh,
                            stride_dn, stride_sb, stride_sh, HEAD_DIM, CENTROID, FOLDED, QUANT, IEEE)
            tl.store(Bounds + rows[:, None] * n_blocks_cap + offs[None, :], s,
                     mask=heads[:, None] & (offs[None, :] < n_blocks_cap))
            m_new = tl.maximum(m_run, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            z_run = z_run * tl.exp2(m_run - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_run = m_new
        tl.store(PartMax + rows * n_programs + part, m_run, mask=heads)
        tl.store(PartSum + rows * n_programs + part, z_run, mask=heads)
        _stamp(Stamps, 2, pid_bh, part, n_programs, STAMPS)
        if LAST >= 2:
            row_barrier(Sync, pid_bh, n_programs, 0, 3)
            _stamp(Stamps, 3, pid_bh, part, n_programs, STAMPS)
    # Phases 2-4 take the part's blocks as one vector of PART lanes (lanes past its n_sub tiles point at
    # n_blocks_cap, outside every mask) and keep its scores in registers from phase 2 to phase 4.
    lanes = tl.arange(0, PART)
    offs = tl.where(lanes < n_sub * TILE, first_block + lanes, n_blocks_cap)
    inside = offs < n_blocks
    if FIRST <= 2 and LAST >= 2:
        acc = pool_scores(Bounds, PartMax, PartSum, pid_bh, offs, n_blocks, n_blocks_cap, n_programs, local_blocks,
                          sink_blocks, GROUP, P_PAD)
        count_score_bins(Hist, pid_bh, acc, inside, SHIFT, BASE)
        if LAST == 2:  # the phases as separate launches: the next one reads the scores back
            tl.store(Scores + pid_bh * n_blocks_cap + offs, acc, mask=offs < n_blocks_cap)
        _stamp(Stamps, 4, pid_bh, part, n_programs, STAMPS)
        if LAST >= 3:
            row_barrier(Sync, pid_bh, n_programs, 1, 0)
            _stamp(Stamps, 5, pid_bh, part, n_programs, STAMPS)
    if FIRST >= 3:
        acc = tl.load(Scores + pid_bh * n_blocks_cap + offs, mask=offs < n_blocks_cap, other=float("-inf"),
                      cache_modifier=".cg")
    if LAST >= 3:
        key = _bin_of(_int_key(acc), SHIFT, BASE)
    if FIRST <= 3 and LAST >= 3:
        thr, above = _kth_bin(Hist, pid_bh, k)
        both = _above_and_ties(key, inside, thr)
        tl.store(Counts + pid_bh * n_programs + part, tl.sum(both, 0).to(tl.int32, bitcast=True))
        _stamp(Stamps, 6, pid_bh, part, n_programs, STAMPS)
        if LAST >= 4:
            row_barrier(Sync, pid_bh, n_programs, 3, 1)
            _stamp(Stamps, 7, pid_bh, part, n_programs, STAMPS)
    if LAST >= 4:
        if FIRST == 4:
            thr, above = _kth_bin(Hist, pid_bh, k)
            both = _above_and_ties(key, inside, thr)
        else:
            # Every program of the row has read the histogram (phase 3): zeroed again for whoever calls next.
            clear_histogram_slice(Hist, pid_bh, part, HIST_SLICE)
        offs_p = tl.arange(0, P_PAD)
        counts = tl.load(Counts + pid_bh * n_programs + offs_p, mask=offs_p < part, other=0, cache_modifier=".cg")
        before = tl.sum(counts.to(tl.uint32, bitcast=True), 0)
        out_row = Out + pid_bh * width
        _store_taken(out_row, key, inside, offs, before + tl.cumsum(both, 0), thr, (k - above).to(tl.int32))
        if part == 0:
            offs_w = tl.arange(0, W_PAD)
            tl.store(out_row + offs_w, tl.full([W_PAD], -1, tl.int32), mask=(offs_w >= k) & (offs_w < width))
        _stamp(Stamps, 8, pid_bh, part, n_programs, STAMPS)
