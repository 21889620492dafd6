"""Reference block scoring and top-k selection in plain PyTorch (reads the block count on the host)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from fractions import Fraction

import torch

from kernels import cdiv

POOLINGS = ("mean", "softmax")
# Scores fall in HIST_BINS bins of their int32 order keys (score_bins); the Triton top-k counts them to start its
# search in the k-th score's bin, and softmax pooling selects by bins (select_blocks).
HIST_BINS = 4096
# Words per (batch, kv head) of the scratch where the Triton selection's programs of one row meet (triton_fused.py).
SYNC_WORDS = 4
# Softmax pooling over int8 descriptors scores each query head as fixed-point codes of at most this magnitude (14
# bits and a sign: two int8 halves on the integer tensor cores), one step per head (query_codes).
QUERY_CODE_MAX = 2**14 - 1
# What each program of the one-launch selection stamps with the GPU's global timer when asked to (triton_fused.py;
# diagnostics: kernels.block_select.record_phases), in this order.
PHASE_STAMPS = ("start", "dependency met", "bounds done", "barrier 1 passed", "scores counted", "barrier 2 passed",
                "counts done", "barrier 3 passed", "end")


@dataclass(frozen=True)
class KeepRule:
    """How many blocks a query keeps: k = max(ceil(n * keep_ratio), min(n, min_blocks)), forced ones included.

    The last `local_blocks` and the first `sink_blocks` blocks are always kept (forced). keep_ratio is held as
    an exact fraction so that the host, the reference and the kernel agree on k. `pooling` is how the query
    heads of a GQA group share one selection: "mean" (the paper: Quest's bound of the group's mean query) or
    "softmax" (NSA's sharing: each head's bounds, times the attention scale, softmaxed over the scored blocks,
    summed over the group, so that a head whose attention is peaked on a few blocks gets them kept).
    `centroid` (ours): a head's block score is the average of Quest's bound and q . (the block's mean key), an
    estimate of the block's typical logit rather than its loosest upper bound (needs the kmean descriptor).

    Softmax pooling's scores (probabilities summed over the group, in [0, group]) are compared by their bins of
    1/128 octave (score_bins): the blocks of the bins above the k-th score's are kept, then that bin's blocks,
    lowest index first. Scores in one bin differ by under 0.8%, about the bf16 rounding of the descriptors and
    queries they come from, and the Triton top-k then takes one pass with no search. Mean pooling's top-k is
    exact (ties: lowest index).
    """

    keep_ratio: float
    min_blocks: int
    local_blocks: int
    sink_blocks: int = 0
    pooling: str = "mean"
    centroid: bool = False

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"bad value for pooling: {self.pooling!r}; expected one of {', '.join(POOLINGS)}")

    @property
    def ratio(self) -> tuple[int, int]:
        f = Fraction(self.keep_ratio).limit_denominator(1_000_000)
        return f.numerator, f.denominator

    def keep(self, n_blocks: int) -> int:
        num, den = self.ratio
        return max(cdiv(n_blocks * num, den), min(n_blocks, self.min_blocks))


def score_bins(pooling: str, group: int) -> tuple[int, int]:
    """(shift, base): a score's bin is clamp((order key >> shift) - base, 0, HIST_BINS - 1). Mean pooling's scores
    take any sign and size: the key's top 12 bits (sign, exponent, 3 mantissa bits), no clamping. Softmax
    pooling's lie in [0, group]: 128 bins an octave (7 mantissa bits) over the 32 octaves below `group`, whose
    bin is the last but one; smaller scores share bin 0, the forced blocks' +inf the last bin."""
    if pooling == "mean":
        return 20, -(HIST_BINS // 2)
    top = struct.unpack("<i", struct.pack("<f", float(group)))[0] >> 16
    return 16, top - (HIST_BINS - 2)


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 -> int32 keys with the same order (the magnitude bits of negatives flipped)."""
    u = scores.float().contiguous().view(torch.int32)
    return u ^ ((u >> 31) & 0x7FFFFFFF)


def bin_keys(scores: torch.Tensor, shift: int, base: int) -> torch.Tensor:
    """The scores' bins (see score_bins), int32."""
    return ((order_keys(scores) >> shift) - base).clamp(0, HIST_BINS - 1)


def query_codes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., D] -> (codes int32 [..., D], step fp32 [...]): each row in steps of max|q| / QUERY_CODE_MAX,
    truncated towards zero, so that q ~ codes * step to 1 / QUERY_CODE_MAX of the row's largest coordinate
    (finer than bf16 for every coordinate above 1/64 of it). fp32 arithmetic the kernels repeat exactly."""
    qf = q.float()
    amax = qf.abs().amax(dim=-1)
    top = torch.full_like(amax, QUERY_CODE_MAX)
    # Divisions of two tensors: correctly rounded (a scalar divided by a tensor is a reciprocal, then a product).
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return (qf * inv[..., None]).trunc().int(), amax / top


def block_scores(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, length: torch.Tensor, *,
                 block_size: int, local_blocks: int, sink_blocks: int = 0, pooling: str = "mean",
                 scale: float = 1.0, kmean: torch.Tensor | None = None, folded: bool = False,
                 descriptor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [B, Hkv, NB] fp32: the group's pooled Quest bounds (see KeepRule), +inf for the forced (local and
    sink) blocks, -inf past the end. scale (the attention's) only matters to softmax pooling. kmean given: each
    bound is averaged with q . kmean (KeepRule.centroid). folded (kmean None): kmax and kmin hold max + mean and
    min + mean (kernels/block_descriptors' fold_mean), whose bound is the bound plus q . mean: it is halved.
    descriptor_scale [B, Hkv, NB]: kmax and kmin are int8 codes of it; softmax pooling then takes each head's
    bound from the codes and the query's fixed-point codes (query_codes), exactly, scaled afterwards."""
    B, Hq, D = q.shape
    integer = descriptor_scale is not None and pooling == "softmax"
    if descriptor_scale is not None and not integer:
        kmax = kmax.float() * descriptor_scale[..., None]
        kmin = kmin.float() * descriptor_scale[..., None]
    Hkv, NB = kmax.shape[1], kmax.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    n_blocks = (length + block_size - 1) // block_size  # [B]
    idx = torch.arange(NB, device=q.device)
    inside = (idx < n_blocks[:, None])[:, None]  # [B, 1, NB]
    forced = ((idx >= (n_blocks - local_blocks)[:, None]) | (idx < sink_blocks))[:, None] & inside
    if pooling == "mean":
        qbar = qg.mean(dim=2)[:, :, None, :]  # [B, Hkv, 1, D]
        s = torch.maximum(qbar * kmax.float(), qbar * kmin.float()).sum(dim=-1)  # [B, Hkv, NB]
        if kmean is not None:
            s = (s + (qbar * kmean.float()).sum(dim=-1)) * 0.5
        elif folded:
            s = s * 0.5
    else:
        if integer:
            c, step = query_codes(qg)
            exact = torch.maximum(c[:, :, :, None] * kmax.int()[:, :, None],
                                  c[:, :, :, None] * kmin.int()[:, :, None]).sum(dim=-1)  # [B, Hkv, G, NB]
            bound = exact.float() * step[..., None] * descriptor_scale[:, :, None]
        else:
            bound = torch.maximum(qg[:, :, :, None] * kmax.float()[:, :, None],
                                  qg[:, :, :, None] * kmin.float()[:, :, None]).sum(dim=-1)  # [B, Hkv, G, NB]
        if kmean is not None:
            bound = (bound + torch.einsum("bhgd,bhnd->bhgn", qg, kmean.float())) * 0.5
        elif folded:
            bound = bound * 0.5
        scored = (inside & ~forced)[:, :, None]  # [B, 1, 1, NB]
        s = torch.softmax((bound * scale).masked_fill(~scored, float("-inf")), dim=-1).nan_to_num(0.0).sum(dim=2)
    s = torch.where(forced, float("inf"), s)
    return s.masked_fill(~inside, float("-inf"))


def check_out(out: torch.Tensor, shape: tuple, device: torch.device) -> torch.Tensor:
    """A selection's output buffer, checked: int32 of `shape`, contiguous, on `device`."""
    if tuple(out.shape) != tuple(shape) or out.dtype != torch.int32 or not out.is_contiguous() \
            or out.device != device:
        raise ValueError(f"expected out of shape {list(shape)} int32 contiguous on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def select_blocks(q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, length: torch.Tensor, *,
                  block_size: int, rule: KeepRule, width: int, scale: float = 1.0,
                  kmean: torch.Tensor | None = None, folded: bool = False,
                  descriptor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """See kernels.block_select.select_blocks. Mean pooling: ties are broken by torch.topk (the kernel: lowest
    index). Softmax pooling: by bins (KeepRule), lowest index first within the k-th score's bin."""
    B, Hkv = kmax.shape[:2]
    scores = block_scores(q, kmax, kmin, length, block_size=block_size, local_blocks=rule.local_blocks,
                          sink_blocks=rule.sink_blocks, pooling=rule.pooling, scale=scale,
                          kmean=kmean if rule.centroid and not folded else None, folded=rule.centroid and folded,
                          descriptor_scale=descriptor_scale)
    out = torch.full((B, Hkv, width), -1, dtype=torch.int32, device=q.device)
    if rule.pooling == "softmax":
        # A stable descending sort of the bins keeps the lowest index first among equal ones; past the end: -1.
        keys = bin_keys(scores, *score_bins("softmax", q.shape[1] // Hkv)).masked_fill(scores == float("-inf"), -1)
    for b, n in enumerate(length.tolist()):
        k = rule.keep(cdiv(n, block_size))
        if k > width:
            raise ValueError(f"{k} blocks to keep do not fit the selection width {width}")
        if rule.pooling == "softmax":
            top = torch.sort(keys[b], dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values
        else:
            top = torch.topk(scores[b], k, dim=-1).indices.sort(dim=-1).values  # [Hkv, k]
        out[b, :, :k] = top.to(torch.int32)
    return out
