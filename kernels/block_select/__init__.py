"""block_select: which key blocks one decode query reads (Quest scores, GQA-shared, dynamic top-k).

Per KV head, the query heads of its GQA group are averaged into one query q, and every block i gets Quest's
upper bound on q.k over the block, sum_d max(q_d * kmax_id, q_d * kmin_id) (the paper's pooling; with
softmax pooling each head's bounds are softmaxed over the blocks and summed over the group instead). The last
`local_blocks` blocks are always kept (and the first `sink_blocks`, an option beyond the paper: attention-sink
tokens), and
k = max(ceil(n_blocks * keep_ratio), min(n_blocks, min_blocks)) blocks are kept in all.
The result has a fixed width (static shapes: the k of the cache's capacity), holds the kept block indices in
ascending order and is padded with -1. Triton on CUDA (no host sync, CUDA-graph safe), the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.block_select.reference import (HIST_BINS, PHASE_STAMPS, POOLINGS, QUERY_CODE_MAX, SYNC_WORDS, KeepRule,
                                            block_scores, check_out, query_codes, score_bins)
from kernels.block_select.reference import select_blocks as select_blocks_reference

__all__ = ["HIST_BINS", "PHASE_STAMPS", "POOLINGS", "QUERY_CODE_MAX", "SYNC_WORDS", "KeepRule", "barrier_timeouts",
           "block_scores", "new_histogram", "new_sync", "query_codes", "record_phases", "score_bins", "select_blocks",
           "select_blocks_reference"]


@functools.cache
def _triton_impl():
    try:
        from kernels.block_select.triton import select_blocks_triton
    except ImportError:
        return None
    return select_blocks_triton


def select_blocks(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, length: torch.Tensor, *,
                  block_size: int, rule: KeepRule, width: int, scale: float = 1.0,
                  kmean: torch.Tensor | None = None, folded: bool = False,
                  histogram: torch.Tensor | None = None, descriptor_scale: torch.Tensor | None = None,
                  sync: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; kmax, kmin (and kmean, required by rule.centroid): [B, Hkv, NB, D]; length: [B] int64
    (valid keys, the new one included); scale: the attention's softmax scale (used by rule.pooling "softmax").
    folded: kmax and kmin hold max + mean and min + mean (kernels/block_descriptors' fold_mean): rule.centroid's
    score is then half their bound, from two descriptors instead of three (kmean not read).
    histogram: scratch the Triton kernels keep between calls, int32 [B, Hkv, HIST_BINS] (`new_histogram`): the
    scores' bins counted, which spares the top-k its search; it changes no result. The reference ignores it.
    descriptor_scale: [B, Hkv, NB] fp32 with int8 kmax and kmin (kernels/block_descriptors' scale): each block's
    codes times its scale; Quest's bound from the codes, scaled.
    sync: scratch the Triton kernels keep between calls, int32 [B, Hkv, SYNC_WORDS] (`new_sync`): with it and the
    histogram, softmax pooling's selection is one launch whose programs meet there. It changes no result.

    out: where to write the result (int32 [B, Hkv, width], contiguous), as a buffer a later step reads.

    Returns block indices [B, Hkv, width] int32: the kept blocks ascending, then -1. width >= rule.keep(NB).
    """
    if rule.centroid and kmean is None and not folded:
        raise ValueError("rule.centroid needs the kmean descriptor, or descriptors with the mean folded in")
    if folded and not rule.centroid:
        raise ValueError("folded descriptors hold the block means: expected a rule with centroid")
    args = dict(block_size=block_size, rule=rule, width=width, scale=scale, kmean=None if folded else kmean,
                folded=folded, descriptor_scale=descriptor_scale)
    impl = _triton_impl() if q.is_cuda else None
    if impl is None:
        result = select_blocks_reference(q, kmax, kmin, length, **args)
        return result if out is None else check_out(out, result.shape, q.device).copy_(result)
    return impl(q, kmax, kmin, length, histogram=histogram, sync=sync, out=out, **args)


def new_histogram(batch: int, kv_heads: int, device) -> torch.Tensor:
    """The scratch `select_blocks` keeps between calls, zeroed."""
    return torch.zeros(batch, kv_heads, HIST_BINS, dtype=torch.int32, device=device)


def new_sync(batch: int, kv_heads: int, device) -> torch.Tensor:
    """The sync words `select_blocks` keeps between calls, zeroed. A call leaves its first two barriers' arrival
    counts at zero and its third's at the row's program count (the next call's first barrier zeroes it), and adds
    the barriers it gave up to their count (`barrier_timeouts`)."""
    return torch.zeros(batch, kv_heads, SYNC_WORDS, dtype=torch.int32, device=device)


def barrier_timeouts(sync: torch.Tensor) -> int:
    """How many times a program of the fused selection stopped waiting for the rest of its row (0 unless the
    device could not run a row's programs at once; the selection of such a call is not to be trusted)."""
    return int(sync[..., 2].sum())


def record_phases(stamps: dict | None) -> None:
    """Diagnostics on a GPU: with a dict, every later one-launch selection (softmax pooling with the histogram and
    the sync words) stamps each program's phases with the GPU's global timer, in ns (PHASE_STAMPS, in order), into
    stamps[sync.data_ptr()], an int64 tensor [B * Hkv, parts, len(PHASE_STAMPS)]: one per sync-words tensor, i.e.
    per layer, written again at each call (a captured graph keeps writing the tensor it was captured with).
    Set it before capturing. None stops the stamping for later calls and captures."""
    impl = _triton_impl()
    if impl is None:
        raise RuntimeError("phase stamps need Triton")
    import kernels.block_select.triton as triton_select

    triton_select._STAMPS = stamps
