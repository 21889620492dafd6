"""Triton block scoring and top-k selection: two launches (three with softmax pooling), no host synchronisation;
softmax pooling with the histogram and the sync words is one launch (triton_fused.py), what the engine runs.

1. One program per (batch, kv head, tile of blocks); blocks past the end are not read (triton_scores.py). Mean
   pooling: `_block_scores_kernel`, the group-averaged query against the tile's max/min descriptors. Softmax
   pooling: `_head_bounds_kernel` writes each head's scaled bounds (Quest's bound as two tensor-core products) and
   the tile's per-head max and sum of exponentials, and `_softmax_pool_kernel` (same grid) reduces those over
   the tiles and sums the heads' probabilities.
2. The top-k: exact for mean pooling, by the scores' bins for softmax pooling (reference.KeepRule). One program
   per (batch, kv head) in triton_topk.py, in registers up to _RESIDENT_MAX blocks, in passes over L2 past it.
"""

from __future__ import annotations

import torch
import triton

from kernels._gdc import use_pdl
from kernels._triton_common import INTERPRET, check_device, launch_context, sm_count
from kernels.block_select.reference import PHASE_STAMPS, SYNC_WORDS, KeepRule, check_out, score_bins
from kernels.block_select.triton_fused import _fused_select_kernel
from kernels.block_select.triton_scores import _block_scores_kernel, _head_bounds_kernel, _softmax_pool_kernel
from kernels.block_select.triton_topk import HIST_BINS, _block_topk_kernel, _block_topk_resident_kernel

_SCORE_TILE = 64  # blocks per scoring program (mean pooling)
# Softmax pooling's scoring program: TILE * head_dim descriptor elements each (an H100 sweep at head_dim 128,
# 32K-256K, benchmarks/bench_resa_kernels.py --sweep-select: 128 blocks and 4 warps were fastest).
_DOT_ELEMENTS = 16384
_SCORE_WARPS = 4
_TOPK_WARPS = 0  # 0: by the block count
_SELECT_TILE = 2048  # scores per pass step of the selection program (long contexts)
# Up to this many blocks (512K tokens of 16) one program holds a head's scores in registers for the search.
# 16,384 was too tight: a 256K-token document plus its answer room (16,389 blocks) fell to the multipass kernel.
_RESIDENT_MAX = 32768
# The fused selection (softmax pooling with the histogram and the sync words): a row in parts, one program each,
# at most as many programs as the device holds at once, so that a row's programs can meet at its barriers. An H200
# sweep (Qwen3-1.7B shape, int8, 128K / 256K): 2 programs an SM, 4 warps, the bounds' loop pipelined 3 deep
# (20.6 / 33.8 us against 25.4 / 46.3 at 1 an SM without pipelining; 4 an SM did not fit). _FUSED_PARTS fixes the
# parts a row (tests); _FUSED_SPLIT runs the phases as separate launches, as the interpreter does.
_FUSED_PROGRAMS_PER_SM = 2
_FUSED_PARTS = 0
_FUSED_SPLIT = False
_FUSED_WARPS = 4
_FUSED_STAGES = 3  # software pipelining of the bounds' loop over a part's tiles
# Blocks a part of a row holds in registers (phases 2-4); a row that the device's programs cannot cover in parts of
# at most this many blocks runs as separate launches.
_FUSED_PART_MAX = 2048
_FUSED_LAST = 4  # the last phase run (benchmarks time the phases by stopping early; the output is then unset)
# Diagnostics (kernels.block_select.record_phases): when a dict, each one-launch selection stamps its programs'
# phases into an int64 tensor [rows, parts, len(PHASE_STAMPS)] kept there by its sync words' address (one a layer).
_STAMPS: dict | None = None
_LOG2E = 1.4426950408889634


# Programs a device holds at once, by (device, the fused kernel's constexprs): _launch_fused.
_RESIDENT: dict = {}


def _launch_fused(fused_args, histogram: torch.Tensor, sync: torch.Tensor, options: dict, rows: int,
                  n_tiles: int) -> None:
    """Launch _fused_select_kernel over `rows` rows in parts; fused_args(parts, n_sub, stamps) gives its arguments
    for that split (n_sub tiles a part). The parts come from _FUSED_PROGRAMS_PER_SM, lowered until the compiled
    kernel fits that many programs on an SM at once, so that a row's programs can meet."""
    device = histogram.device
    per_sm = _FUSED_PROGRAMS_PER_SM
    split = _FUSED_SPLIT or INTERPRET
    if _STAMPS is not None and (split or _FUSED_LAST != 4):
        raise RuntimeError("phase stamps need the selection's one launch with every phase, on a GPU")
    while True:
        parts, n_sub = _fused_split(device, rows, n_tiles, per_sm)
        stamps = _stamps(sync, rows, parts)
        args = fused_args(parts, n_sub, stamps if stamps is not None else sync)
        kw = dict(options, P_PAD=max(16, triton.next_power_of_2(parts)), STAGES=_FUSED_STAGES,
                  PART=triton.next_power_of_2(n_sub * options["TILE"]),
                  HIST_SLICE=max(16, triton.next_power_of_2(triton.cdiv(HIST_BINS, parts))), num_warps=_FUSED_WARPS,
                  STAMPS=stamps is not None)
        if parts == 1 or split or per_sm == 1 or _holds(device, args, kw, rows) >= per_sm:
            break
        per_sm -= 1
    # One launch; phase by phase where a row's programs cannot meet (the interpreter runs them in turn).
    split = _FUSED_SPLIT or (INTERPRET and parts > 1)
    for first, last in ((1, 1), (2, 2), (3, 3), (4, 4))[:_FUSED_LAST] if split else ((1, _FUSED_LAST),):
        _fused_select_kernel[(rows, parts)](*args, **kw, FIRST=first, LAST=last)
    if split:
        histogram.zero_()  # as the one launch leaves it
    elif _FUSED_LAST in (2, 3):
        sync.zero_()  # stopped before the third barrier, whose last arrival zeroes the words before it


def _fused_split(device: torch.device, rows: int, n_tiles: int, per_sm: int) -> tuple[int, int]:
    """(parts a row, tiles a part) of the fused launch at per_sm programs an SM."""
    parts = _FUSED_PARTS or max(1, sm_count(device) * per_sm // rows)
    n_sub = triton.cdiv(n_tiles, min(parts, n_tiles))
    return triton.cdiv(n_tiles, n_sub), n_sub


def _fused_parts_fit(device: torch.device, rows: int, n_tiles: int, tile: int) -> bool:
    """Whether the fused launch's parts hold at most _FUSED_PART_MAX blocks, even at one program an SM (the fewest
    it may fall back to)."""
    return _fused_split(device, rows, n_tiles, 1)[1] * tile <= _FUSED_PART_MAX


def _stamps(sync: torch.Tensor, rows: int, parts: int) -> torch.Tensor | None:
    if _STAMPS is None:
        return None
    buffer = _STAMPS.get(sync.data_ptr())
    if buffer is None or buffer.shape[:2] != (rows, parts):
        buffer = _STAMPS[sync.data_ptr()] = torch.zeros(rows, parts, len(PHASE_STAMPS), dtype=torch.int64,
                                                        device=sync.device)
    return buffer


def _holds(device: torch.device, args: tuple, kw: dict, rows: int) -> int:
    """Programs of the one-launch fused kernel an SM holds at once (registers, shared memory, threads)."""
    key = (device, tuple(sorted(kw.items())), tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args))
    if key not in _RESIDENT:
        kernel = _fused_select_kernel.warmup(*args, grid=(rows, 1), **kw, FIRST=1, LAST=4)
        kernel._init_handles()
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        threads = kw["num_warps"] * 32
        # Registers go to a warp in units of 256 (8 a thread).
        by_regs = props["max_num_regs"] // max(1, triton.cdiv(kernel.n_regs, 8) * 8 * threads)
        by_smem = props["max_shared_mem"] // kernel.metadata.shared if kernel.metadata.shared else 32
        _RESIDENT[key] = min(by_regs, by_smem, 2048 // threads)
    return _RESIDENT[key]


def resident_layout(n_blocks: int) -> tuple[int, int, int]:
    """(main part, rest part, warps) of the register-resident top-k for a row of n_blocks scores."""
    main = max(16, 1 << (n_blocks.bit_length() - 1))
    rest = max(16, triton.next_power_of_2(max(1, n_blocks - main)))
    # A power of two (Triton's rule): 4,096 + 1,024 blocks gave 5 warps and failed to compile. About 1,024 blocks
    # a warp: with 8 warps at 256K tokens the step took 5.82 ms against 5.50 with 16 (H100, whole decode step).
    return main, rest, min(16, max(4, triton.next_power_of_2((main + rest) // 1024)))


def select_blocks_triton(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, length: torch.Tensor, *,
                         block_size: int, rule: KeepRule, width: int, scale: float = 1.0,
                         kmean: torch.Tensor | None = None, folded: bool = False,
                         histogram: torch.Tensor | None = None, descriptor_scale: torch.Tensor | None = None,
                         sync: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.select_blocks, written into `out` where given; CUDA-graph capturable.
    histogram: int32 [B, Hkv, HIST_BINS] scratch kept by the caller across calls. The scoring kernels count the
    scores' bins into it and the top-k takes the k-th score's bin from it: one program a row zeroes it again and
    does not use one that does not count the row's blocks; the fused launch clears it first and zeroes it again.
    Without it the top-k searches from the scores' range. sync: int32 [B, Hkv, SYNC_WORDS], zeroed once and kept
    by the caller: with it and the histogram, softmax pooling's selection runs as one launch (triton_fused.py)."""
    if q.dim() != 3:
        raise ValueError(f"expected q of shape [B, Hq, D], got {tuple(q.shape)}")
    B, Hq, D = q.shape
    if kmax.dim() != 4 or kmax.shape[0] != B or kmax.shape[3] != D or Hq % kmax.shape[1]:
        raise ValueError(f"expected kmax of shape [{B}, Hkv, NB, {D}] with Hq % Hkv == 0, got {tuple(kmax.shape)}")
    if kmin.shape != kmax.shape or kmin.stride() != kmax.stride() or kmin.dtype != kmax.dtype:
        raise ValueError(f"expected kmin shaped, strided and typed like kmax {tuple(kmax.shape)}, got "
                         f"{tuple(kmin.shape)} {kmin.dtype}")
    quant = descriptor_scale is not None
    if quant and (kmax.dtype != torch.int8 or descriptor_scale.shape != kmax.shape[:3]
                  or descriptor_scale.dtype != torch.float32 or descriptor_scale.stride(2) != 1):
        raise ValueError(f"expected int8 descriptors and a float32 descriptor_scale of shape {tuple(kmax.shape[:3])} "
                         f"with unit stride over blocks, got {kmax.dtype} and {tuple(descriptor_scale.shape)} "
                         f"{descriptor_scale.dtype}")
    if not quant and kmax.dtype == torch.int8:
        raise ValueError("expected a descriptor_scale with int8 descriptors")
    fold = rule.centroid and folded
    separate_mean = rule.centroid and not folded
    if separate_mean and quant:
        raise ValueError("int8 descriptors (descriptor_scale) need the mean folded in: expected folded=True")
    if separate_mean and (kmean is None or kmean.shape != kmax.shape or kmean.stride() != kmax.stride()):
        raise ValueError(f"expected kmean shaped and strided like kmax {tuple(kmax.shape)} (rule.centroid), got "
                         f"{None if kmean is None else tuple(kmean.shape)}")
    Hkv, NB = kmax.shape[1], kmax.shape[2]
    if length.shape != (B,):
        raise ValueError(f"expected length of shape [{B}], got {tuple(length.shape)}")
    if width < rule.keep(NB):
        raise ValueError(f"expected width >= {rule.keep(NB)} (the blocks kept at capacity), got {width}")
    if D & (D - 1) or block_size & (block_size - 1):
        raise ValueError(f"expected head_dim and block_size powers of two, got {D} and {block_size}")
    if quant and rule.pooling == "softmax" and D > 1024:
        # |sum of query code x descriptor code| <= 16,383 * 127 * D must stay an int32.
        raise ValueError(f"expected head_dim <= 1024 with int8 descriptors (integer products), got {D}")
    if histogram is not None and (histogram.shape != (B, kmax.shape[1], HIST_BINS) or histogram.dtype != torch.int32
                                  or not histogram.is_contiguous()):
        raise ValueError(f"expected histogram of shape [{B}, {kmax.shape[1]}, {HIST_BINS}] int32 contiguous, got "
                         f"{tuple(histogram.shape)} {histogram.dtype}")
    if sync is not None and (sync.shape != (B, kmax.shape[1], SYNC_WORDS) or sync.dtype != torch.int32
                             or not sync.is_contiguous()):
        raise ValueError(f"expected sync of shape [{B}, {kmax.shape[1]}, {SYNC_WORDS}] int32 contiguous, got "
                         f"{tuple(sync.shape)} {sync.dtype}")
    described = (("kmean", kmean),) if separate_mean else ()
    described += (("histogram", histogram),) if histogram is not None else ()
    described += (("descriptor_scale", descriptor_scale),) if quant else ()
    described += (("sync", sync),) if sync is not None else ()
    for name, t in (("q", q), ("kmax", kmax), ("kmin", kmin), ("length", length), *described):
        check_device(name, t, q.device)
    group = Hq // Hkv
    softmax = rule.pooling == "softmax"
    tile = min(128, _DOT_ELEMENTS // D) if softmax else _SCORE_TILE
    n_tiles = triton.cdiv(NB, tile)
    scores = torch.empty(B, Hkv, NB, device=q.device, dtype=torch.float32)
    if out is None:
        out = torch.empty(B, Hkv, width, device=q.device, dtype=torch.int32)
    else:
        check_out(out, (B, Hkv, width), q.device)
    num, den = rule.ratio
    hist = histogram is not None
    pdl = use_pdl(q.device)
    hist_arg = histogram if hist else out  # never read without HIST
    shift, base = score_bins(rule.pooling, group)
    scale_arg = descriptor_scale if quant else length  # never read without QUANT
    scale_strides = (descriptor_scale.stride(0), descriptor_scale.stride(1)) if quant else (0, 0)
    # Tensor-core products in the descriptors' half precision when q shares it, fp32 otherwise; int8 codes: integer
    # products against the query's fixed-point codes.
    ieee = not quant and (kmax.dtype == torch.float32 or q.dtype != kmax.dtype)
    bounds_args = (q, kmax, kmin, kmean if separate_mean else kmax, scale_arg, length)
    bounds_tail = (q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1), kmax.stride(2), *scale_strides)
    bounds_options = dict(GROUP=group, G_DOT=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK=block_size,
                          TILE=tile, CENTROID=rule.centroid, FOLDED=fold, QUANT=quant, IEEE=ieee)
    w_pad = max(16, triton.next_power_of_2(width))
    if softmax and hist and sync is not None and NB < 65536 and _fused_parts_fit(q.device, B * Hkv, n_tiles, tile):
        bounds = torch.empty(B, Hkv, group, NB, device=q.device, dtype=torch.float32)

        def fused_args(parts: int, n_sub: int, stamps: torch.Tensor) -> tuple:
            # Scratch: each head's scaled bounds; per part each head's max and sum of exp2, and its packed counts.
            part_max = torch.empty(B * Hkv * group, parts, device=q.device, dtype=torch.float32)
            counts = torch.empty(B * Hkv, parts, device=q.device, dtype=torch.int32)
            return (*bounds_args, bounds, part_max, torch.empty_like(part_max), scores, histogram, counts, sync, out,
                    stamps, Hkv, NB, parts, n_sub, width, num, den, rule.min_blocks, rule.local_blocks,
                    rule.sink_blocks, scale * _LOG2E, *bounds_tail)

        with launch_context(q.device):
            options = dict(bounds_options, W_PAD=w_pad, SHIFT=shift, BASE=base, PDL=pdl, launch_pdl=pdl)
            _launch_fused(fused_args, histogram, sync, options, B * Hkv, n_tiles)
        return out
    with launch_context(q.device):
        if softmax:
            # Scratch: each head's scaled bounds, and per tile each head's max and sum of exp2.
            bounds = torch.empty(B, Hkv, group, NB, device=q.device, dtype=torch.float32)
            tile_max = torch.empty(B, Hkv, group, n_tiles, device=q.device, dtype=torch.float32)
            tile_sum = torch.empty_like(tile_max)
            _head_bounds_kernel[(B * Hkv, n_tiles)](
                *bounds_args, bounds, tile_max, tile_sum, Hkv, NB, n_tiles, rule.local_blocks,
                rule.sink_blocks, scale * _LOG2E, *bounds_tail, **bounds_options,
                PDL=pdl, launch_pdl=pdl, num_warps=_SCORE_WARPS,
            )
            _softmax_pool_kernel[(B * Hkv, n_tiles)](
                bounds, tile_max, tile_sum, length, scores, hist_arg, Hkv, NB, n_tiles, rule.local_blocks,
                rule.sink_blocks, GROUP=group, BLOCK=block_size, TILE=tile,
                NT_PAD=max(16, triton.next_power_of_2(n_tiles)), HIST=hist, SHIFT=shift, BASE=base, PDL=pdl,
                launch_pdl=pdl, num_warps=4,
            )
        else:
            _block_scores_kernel[(B * Hkv, n_tiles)](
                q, kmax, kmin, kmean if separate_mean else kmax, scale_arg, length, scores, hist_arg, Hkv, NB,
                rule.local_blocks, rule.sink_blocks, q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1),
                kmax.stride(2), *scale_strides, GROUP=group, G_PAD=max(2, triton.next_power_of_2(group)), HEAD_DIM=D,
                BLOCK=block_size, TILE=_SCORE_TILE, CENTROID=rule.centroid, FOLDED=fold, QUANT=quant,
                HIST=hist, SHIFT=shift, BASE=base, PDL=pdl, launch_pdl=pdl, num_warps=4,
            )
        if NB <= _RESIDENT_MAX:
            main, rest, warps = resident_layout(NB)
            _block_topk_resident_kernel[(B * Hkv,)](
                scores, length, out, hist_arg, NB, width, num, den, rule.min_blocks, Hkv,
                BLOCK=block_size, NB_MAIN=main, NB_REST=rest, W_PAD=w_pad, HIST=hist,
                SHIFT=shift, BASE=base, BINNED=softmax, PDL=pdl, launch_pdl=pdl, num_warps=_TOPK_WARPS or warps,
            )
        else:
            _block_topk_kernel[(B * Hkv,)](
                scores, length, out, hist_arg, NB, width, num, den, rule.min_blocks, Hkv,
                BLOCK=block_size, TILE=_SELECT_TILE, HIST=hist, SHIFT=shift, BASE=base, BINNED=softmax, PDL=pdl,
                launch_pdl=pdl, num_warps=8,
            )
    return out
