"""resa's kernels: block descriptors, block selection, block-sparse decode, few-query decode, LSE combine.

CPU tests pin the references down against brute force; `triton` tests hold the Triton kernels to the references
(run on the device; `TRITON_INTERPRET=1 pytest -m triton tests/test_resa_kernels.py` runs them on CPU through
Triton's interpreter where Triton is installed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels import cdiv
from kernels.block_descriptors import update_block_descriptors
from kernels.block_descriptors import update_block_descriptors_reference as update_ref
from kernels.block_select import (HIST_BINS, SYNC_WORDS, KeepRule, barrier_timeouts, block_scores, new_histogram,
                                   new_sync, score_bins, select_blocks)
from kernels.block_select.reference import QUERY_CODE_MAX, bin_keys, query_codes
from kernels.block_select import select_blocks_reference as select_ref
from kernels.decode_attention import decode_attention_reference as dense_ref
from kernels.lse_combine import combine_splits_reference, merge_partials
from kernels.sparse_decode_attention import sparse_decode_attention_reference as sparse_ref
from tests.conftest import TRITON_DEVICE

BS = 16


DEVICE = TRITON_DEVICE


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from kernels.block_select.triton_scores import query_codes as _query_codes

    @triton.jit
    def _query_codes_kernel(Q, Out, Step, D: tl.constexpr):
        """The codes of q [16, D] (query_codes' four halves joined again) and the rows' steps."""
        offs_g = tl.arange(0, 16)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + offs_g[:, None] * D + offs_d[None, :])
        pos_hi, pos_lo, neg_hi, neg_lo, step = _query_codes(q)
        c = 128 * (pos_hi.to(tl.int32) + neg_hi.to(tl.int32)) + pos_lo.to(tl.int32) + neg_lo.to(tl.int32)
        tl.store(Out + offs_g[:, None] * D + offs_d[None, :], c)
        tl.store(Step + offs_g, step)


def _keys(B, H, S, D, lengths, dtype=torch.float32, device="cpu"):
    """Random keys with NaN past each length: a kernel that reads beyond the valid prefix shows it."""
    torch.manual_seed(42)
    k = torch.randn(B, H, S, D, dtype=dtype, device=device)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
    return k


def _descriptors(keys, lengths, fold_mean=False):
    B, H, S, D = keys.shape
    nb = cdiv(S, BS)
    kmax = torch.full((B, H, nb, D), float("nan"), dtype=keys.dtype, device=keys.device)
    kmin = kmax.clone()
    for b, n in enumerate(lengths):
        update_ref(keys[b:b + 1], kmax[b:b + 1], kmin[b:b + 1], torch.tensor([n]), n, BS, fold_mean=fold_mean)
    return kmax, kmin


# ---- references against brute force (CPU, CI) ----

def test_descriptors_incremental_equal_full_rebuild():
    """Chunks of odd sizes, then single tokens: only touched blocks change, and they equal a rebuild."""
    S, D = 300, 8
    keys = torch.randn(1, 2, S, D)
    kmax = torch.full((1, 2, cdiv(S, BS), D), float("nan"))
    kmin = kmax.clone()
    end = 0
    for n in (37, 5, 100, 1, 1, 16, 1):
        end += n
        before = kmax.clone()
        update_ref(keys, kmax, kmin, torch.tensor([end]), n, BS)
        untouched = slice(0, (end - n) // BS)
        assert torch.equal(kmax[:, :, untouched], before[:, :, untouched])
    for blk in range(cdiv(end, BS)):
        seg = keys[0, :, blk * BS:min(end, blk * BS + BS)]
        assert torch.equal(kmax[0, :, blk], seg.amax(dim=1)) and torch.equal(kmin[0, :, blk], seg.amin(dim=1))


def _means(keys, lengths):
    """kmean [B, H, NB, D] by the reference, one full update per sequence (NaN where no key)."""
    B, H, S, D = keys.shape
    kmean = torch.full((B, H, cdiv(S, BS), D), float("nan"), dtype=keys.dtype, device=keys.device)
    scratch = kmean.clone()
    for b, n in enumerate(lengths):
        update_ref(keys[b:b + 1], scratch[b:b + 1], scratch[b:b + 1].clone(), torch.tensor([n]), n, BS, kmean[b:b + 1])
    return kmean


def test_descriptor_means_incremental_equal_block_means():
    S, D = 300, 8
    keys = torch.randn(1, 2, S, D)
    kmax = torch.full((1, 2, cdiv(S, BS), D), float("nan"))
    kmin, kmean = kmax.clone(), kmax.clone()
    end = 0
    for n in (37, 5, 100, 1, 1, 16, 1):  # the last block stays partly filled
        end += n
        update_ref(keys, kmax, kmin, torch.tensor([end]), n, BS, kmean)
    for blk in range(cdiv(end, BS)):
        seg = keys[0, :, blk * BS:min(end, blk * BS + BS)]
        torch.testing.assert_close(kmean[0, :, blk], seg.mean(dim=1))


@pytest.mark.parametrize("pooling", ["mean", "softmax"])
def test_centroid_scores_average_the_bound_and_the_mean_key(pooling):
    torch.manual_seed(0)
    L, D, G, scale = 150, 16, 4, 0.25
    keys = _keys(1, 2, 160, D, [L])
    q = torch.randn(1, 2 * G, D)
    kmax, kmin = _descriptors(keys, [L])
    kmean = _means(keys, [L])
    got = block_scores(q, kmax, kmin, torch.tensor([L]), block_size=BS, local_blocks=2, sink_blocks=1,
                       pooling=pooling, scale=scale, kmean=kmean)
    n_blocks = cdiv(L, BS)
    scored = range(1, n_blocks - 2)
    for h in range(2):
        qs = q[0, h * G:(h + 1) * G]
        heads = [qs.mean(dim=0)] if pooling == "mean" else list(qs)
        expected = torch.zeros(n_blocks - 3)
        for qh in heads:
            est = torch.stack([(torch.maximum(qh * kmax[0, h, i], qh * kmin[0, h, i]).sum()
                                + qh @ keys[0, h, i * BS:min(L, i * BS + BS)].mean(dim=0)) / 2 for i in scored])
            expected += est if pooling == "mean" else torch.softmax(est * scale, 0)
        torch.testing.assert_close(got[0, h, 1:n_blocks - 2], expected)
        assert got[0, h, 0] == float("inf") and (got[0, h, n_blocks:] == float("-inf")).all()


@pytest.mark.parametrize("pooling", ["mean", "softmax"])
def test_folded_descriptors_give_the_centroid_scores(pooling):
    """max + mean and min + mean as the two descriptors (fold_mean, written incrementally): Quest's bound over them
    is the bound plus q . mean, so `folded` scores equal the centroid rule's from three descriptors."""
    torch.manual_seed(0)
    L, D, scale = 300, 16, 0.25
    keys = _keys(1, 2, 310, D, [L])
    q = torch.randn(1, 8, D)
    kmax, kmin = _descriptors(keys, [L])
    kmean = _means(keys, [L])
    upper = torch.full_like(kmax, float("nan"))
    lower = upper.clone()
    end = 0
    for n in (37, 5, 100, 1, 1, 16, 140):
        end += n
        update_ref(keys, upper, lower, torch.tensor([end]), n, BS, fold_mean=True)
    n_blocks = cdiv(L, BS)
    torch.testing.assert_close(upper[:, :, :n_blocks], kmax[:, :, :n_blocks] + kmean[:, :, :n_blocks])
    torch.testing.assert_close(lower[:, :, :n_blocks], kmin[:, :, :n_blocks] + kmean[:, :, :n_blocks])
    args = dict(block_size=BS, local_blocks=1, sink_blocks=1, pooling=pooling, scale=scale)
    want = block_scores(q, kmax, kmin, torch.tensor([L]), kmean=kmean, **args)
    got = block_scores(q, upper, lower, torch.tensor([L]), folded=True, **args)
    torch.testing.assert_close(got, want)
    rule = KeepRule(0.2, 4, 1, 1, pooling=pooling, centroid=True)
    width = rule.keep(kmax.shape[2])
    assert torch.equal(select_blocks(q, upper, lower, torch.tensor([L]), block_size=BS, rule=rule, width=width,
                                     scale=scale, folded=True),
                       select_ref(q, kmax, kmin, torch.tensor([L]), block_size=BS, rule=rule, width=width,
                                  scale=scale, kmean=kmean))
    with pytest.raises(ValueError, match="no kmean"):
        update_block_descriptors(keys, upper, lower, torch.tensor([L]), 1, BS, kmean, fold_mean=True)


def test_centroid_rule_needs_the_mean_descriptor():
    from kernels.block_select import select_blocks

    rule = KeepRule(0.1, 16, 1, centroid=True)
    kmax = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="kmean"):
        select_blocks(torch.zeros(1, 1, 8), kmax, kmax, torch.tensor([64]), block_size=BS, rule=rule, width=16)


@pytest.mark.parametrize("n_blocks,ratio,min_blocks,expected", [
    (1, 0.1, 16, 1), (16, 0.1, 16, 16), (17, 0.1, 16, 16), (200, 0.1, 16, 20), (201, 0.1, 16, 21),
    (8192, 0.1, 16, 820), (10, 1.0, 16, 10), (3, 0.3, 1, 1), (30, 0.3, 1, 9),
])
def test_keep_rule(n_blocks, ratio, min_blocks, expected):
    assert KeepRule(ratio, min_blocks, 1).keep(n_blocks) == expected


def test_block_scores_are_quest_bounds_and_upper_bound_q_dot_k():
    torch.manual_seed(0)
    L, D, G = 150, 16, 4
    keys = _keys(1, 2, 160, D, [L])
    q = torch.randn(1, 2 * G, D)
    kmax, kmin = _descriptors(keys, [L])
    s = block_scores(q, kmax, kmin, torch.tensor([L]), block_size=BS, local_blocks=2)
    qbar = q.view(1, 2, G, D).mean(2)
    n_blocks = cdiv(L, BS)
    for h in range(2):
        for blk in range(n_blocks - 2):
            bound = sum(max(qbar[0, h, d] * kmax[0, h, blk, d], qbar[0, h, d] * kmin[0, h, blk, d]) for d in range(D))
            assert torch.isclose(s[0, h, blk], bound, atol=1e-5)
            # An upper bound on the group-mean query's score for every key of the block.
            assert (keys[0, h, blk * BS:(blk + 1) * BS] @ qbar[0, h] <= s[0, h, blk] + 1e-5).all()
        assert torch.isinf(s[0, h, n_blocks - 2:n_blocks]).all() and (s[0, h, n_blocks - 2:n_blocks] > 0).all()
        assert (s[0, h, n_blocks:] == float("-inf")).all()


def test_softmax_pooling_is_the_groups_summed_block_softmax():
    torch.manual_seed(0)
    L, D, G, scale = 150, 16, 4, 0.25
    keys = _keys(1, 2, 160, D, [L])
    q = torch.randn(1, 2 * G, D)
    kmax, kmin = _descriptors(keys, [L])
    s = block_scores(q, kmax, kmin, torch.tensor([L]), block_size=BS, local_blocks=2, sink_blocks=1,
                     pooling="softmax", scale=scale)
    n_blocks = cdiv(L, BS)
    scored = range(1, n_blocks - 2)
    for h in range(2):
        expected = torch.zeros(n_blocks)
        for g in range(G):
            qh = q[0, h * G + g]
            bounds = torch.stack([torch.maximum(qh * kmax[0, h, i], qh * kmin[0, h, i]).sum() for i in scored])
            expected[1:n_blocks - 2] += torch.softmax(bounds * scale, 0)
        torch.testing.assert_close(s[0, h, 1:n_blocks - 2], expected[1:n_blocks - 2])
        assert s[0, h, 0] == float("inf") and (s[0, h, n_blocks - 2:n_blocks] == float("inf")).all()
        assert (s[0, h, n_blocks:] == float("-inf")).all()
    assert torch.isclose(s[0, 0, 1:n_blocks - 2].sum(), torch.tensor(float(G)))


def test_softmax_pooling_keeps_the_block_one_head_attends_to():
    """One head of the group attends sharply to block 5; the others point away from it. Averaging the queries
    cancels that head's signal (the paper's pooling drops the block); per-head softmax pooling keeps it."""
    D, G, n_blocks = 16, 4, 40
    e0, e1 = torch.eye(D)[0], torch.eye(D)[1]
    torch.manual_seed(1)
    keys = 0.3 * torch.randn(1, 1, n_blocks * BS, D)
    keys[0, 0, :, 1] += torch.rand(n_blocks * BS)  # everywhere some of e1, which the other heads like
    keys[0, 0, 5 * BS + 3] = 6 * e0
    q = torch.stack([8 * e0] + [-4 * e0 + 2 * e1] * (G - 1))[None]  # [1, G, D]; mean: -e0 + 1.5 e1
    kmax, kmin = _descriptors(keys, [n_blocks * BS])
    length = torch.tensor([n_blocks * BS])
    kept = {}
    for pooling in ("mean", "softmax"):
        rule = KeepRule(0.1, 4, 1, pooling=pooling)
        idx = select_ref(q, kmax, kmin, length, block_size=BS, rule=rule, width=rule.keep(n_blocks), scale=D**-0.5)
        kept[pooling] = set(idx[0, 0].tolist())
    assert 5 not in kept["mean"] and 5 in kept["softmax"]


def test_keep_rule_rejects_unknown_pooling():
    with pytest.raises(ValueError, match="pooling"):
        KeepRule(0.1, 16, 1, pooling="max")


@pytest.mark.parametrize("L", [1, 16, 17, 255, 256, 257, 999], ids=lambda n: f"L{n}")
def test_select_keeps_top_k_local_and_pads(L):
    rule, S = KeepRule(0.1, 4, 2), 1024
    keys = _keys(2, 3, S, 8, [L, max(1, L // 2)])
    q = torch.randn(2, 6, 8)
    kmax, kmin = _descriptors(keys, [L, max(1, L // 2)])
    width = rule.keep(S // BS)
    lengths = torch.tensor([L, max(1, L // 2)])
    idx = select_ref(q, kmax, kmin, lengths, block_size=BS, rule=rule, width=width)
    scores = block_scores(q, kmax, kmin, lengths, block_size=BS, local_blocks=2)
    assert idx.shape == (2, 3, width) and idx.dtype == torch.int32
    for b, n in enumerate(lengths.tolist()):
        n_blocks = cdiv(n, BS)
        k = rule.keep(n_blocks)
        for h in range(3):
            kept = idx[b, h, :k]
            assert (idx[b, h, k:] == -1).all() and (kept >= 0).all() and (kept < n_blocks).all()
            assert torch.equal(kept, kept.sort().values) and kept.unique().numel() == k
            assert set(range(max(0, n_blocks - 2), n_blocks)) <= set(kept.tolist())
            dropped = torch.ones(n_blocks, dtype=torch.bool)
            dropped[kept.long()] = False
            if dropped.any():
                assert scores[b, h, kept.long()].min() >= scores[b, h, :n_blocks][dropped].max()


def test_sparse_reference_equals_dense_over_the_same_keys():
    B, Hkv, G, S, D = 2, 2, 4, 400, 32
    lengths = [397, 150]
    keys, values = _keys(B, Hkv, S, D, lengths), _keys(B, Hkv, S, D, lengths)
    q = torch.randn(B, Hkv * G, D)
    length = torch.tensor(lengths)
    all_blocks = torch.arange(S // BS, dtype=torch.int32).expand(B, Hkv, -1).contiguous()
    torch.testing.assert_close(sparse_ref(q, keys, values, all_blocks, length, block_size=BS, scale=0.2),
                               dense_ref(q, keys, values, length, scale=0.2), atol=1e-5, rtol=1e-5)
    # A subset (with -1 holes) equals dense attention with the other keys masked out.
    subset = torch.tensor([[3, -1, 9, 24], [0, 5, -1, 9]], dtype=torch.int32).view(1, 2, 4).expand(B, -1, -1)
    out = sparse_ref(q, keys, values, subset.contiguous(), length, block_size=BS, scale=0.2)
    for b in range(B):
        for h in range(Hkv):
            toks = [t for blk in subset[b, h].tolist() if blk >= 0 for t in range(blk * BS, blk * BS + BS)
                    if t < lengths[b]]
            p = (q[b, h * G:(h + 1) * G] @ keys[b, h, toks].T * 0.2).softmax(-1)
            torch.testing.assert_close(out[b, h * G:(h + 1) * G], p @ values[b, h, toks], atol=1e-5, rtol=1e-5)


def test_few_query_decode_equals_one_query_at_a_time():
    """T queries at positions length-T..length-1 == T single-query calls with growing lengths."""
    B, Hkv, G, S, D, T = 1, 2, 3, 300, 16, 7
    keys, values = _keys(B, Hkv, S, D, [280]), _keys(B, Hkv, S, D, [280])
    q = torch.randn(B, Hkv * G, T, D)
    for window in (None, 20):
        out, lse = dense_ref(q, keys, values, torch.tensor([280]), scale=0.3, window=window, return_lse=True)
        for t in range(T):
            o1, l1 = dense_ref(q[:, :, t], keys, values, torch.tensor([280 - T + 1 + t]), scale=0.3, window=window,
                               return_lse=True)
            torch.testing.assert_close(out[:, :, t], o1, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(lse[:, :, t], l1, atol=1e-6, rtol=1e-6)


def test_combine_splits_equals_one_shot():
    keys, values = _keys(1, 1, 256, 16, [256]), _keys(1, 1, 256, 16, [256])
    q = torch.randn(1, 4, 16)
    cuts = [0, 40, 40, 200, 256]  # an empty split included
    parts = [dense_ref(q, keys[:, :, a:b], values[:, :, a:b], torch.tensor([b - a]), scale=0.25, return_lse=True)
             if b > a else (torch.zeros(1, 4, 16), torch.full((1, 4), float("-inf")))
             for a, b in zip(cuts, cuts[1:])]
    out_part = torch.stack([o for o, _ in parts], dim=2).view(4, len(parts), 16)
    lse_part = torch.stack([lse for _, lse in parts], dim=2).view(4, len(parts))
    out, lse = combine_splits_reference(out_part.float(), lse_part, torch.float32)
    ref, ref_lse = dense_ref(q, keys, values, torch.tensor([256]), scale=0.25, return_lse=True)
    torch.testing.assert_close(out.view(1, 4, 16), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.view(1, 4), ref_lse, atol=1e-5, rtol=1e-5)
    assert merge_partials([o for o, _ in parts], [x for _, x in parts])[0].shape == (1, 4, 16)


# ---- Triton kernels against the references (device; or the interpreter) ----

def _supported(dtype) -> None:
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16")


def _lowp_error(q, keys, values, toks_per_row, scale):
    """Error of the same attention done by torch at the inputs' dtype: the yardstick (flash-attention's rule)."""
    worst = 0.0
    for (b, h, hk), toks in toks_per_row.items():
        p = (q[b, h].float() @ keys[b, hk, toks].float().T * scale).softmax(-1)
        ref = p @ values[b, hk, toks].float()
        low = ((q[b, h] @ keys[b, hk, toks].T) * scale).softmax(-1) @ values[b, hk, toks]
        worst = max(worst, (low.float() - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("n_new", [1, 5, 32, 33], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("L", [33, 1000, 4097], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.triton
def test_descriptors_triton(dtype, D, L, n_new):
    """max / min exactly, the mean (kept apart) to rounding; see test_descriptors_triton_folded."""
    from kernels.block_descriptors.triton import update_block_descriptors_triton

    _supported(dtype)
    keys = _keys(1, 4, L + 40, D, [L], dtype=dtype, device=DEVICE)
    kmax, kmin = _descriptors(keys.cpu(), [L - n_new])
    kmean = _means(keys.cpu(), [L - n_new])
    for t in (kmax, kmin, kmean):
        t[:, :, (L - n_new) // BS:] = 7.0
    got_max, got_min, got_mean = kmax.to(DEVICE), kmin.to(DEVICE), kmean.to(DEVICE)
    update_block_descriptors_triton(keys, got_max, got_min, torch.tensor([L], device=DEVICE), n_new, BS, got_mean)
    update_ref(keys.cpu(), kmax, kmin, torch.tensor([L]), n_new, BS, kmean)
    assert torch.equal(got_max.cpu(), kmax) and torch.equal(got_min.cpu(), kmin)
    # Means: fp32 sums in another order, then rounded to the dtype.
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got_mean.cpu(), kmean, equal_nan=True, **tol)


def test_int8_descriptors_round_outwards_and_keep_the_bound():
    """Codes of one scale per block and head: max rounded up and min down by at most one step, so the int8 bound
    is an upper bound of the bf16-free one and of every q . k in the block, and within a step's worth of it."""
    torch.manual_seed(42)
    keys = torch.randn(2, 3, 333, 64) * torch.tensor([0.1, 1.0, 30.0])[None, :, None, None]
    lengths = [333, 200]
    upper, lower = _descriptors(keys, lengths, fold_mean=True)
    nb = upper.shape[2]
    codes_hi = torch.zeros(upper.shape, dtype=torch.int8)
    codes_lo = codes_hi.clone()
    scale = torch.zeros(2, 3, nb)
    for b, n in enumerate(lengths):
        update_ref(keys[b:b + 1], codes_hi[b:b + 1], codes_lo[b:b + 1], torch.tensor([n]), n, BS, fold_mean=True,
                   scale=scale[b:b + 1])
    hi, lo = codes_hi.float() * scale[..., None], codes_lo.float() * scale[..., None]
    for b, n in enumerate(lengths):
        used = cdiv(n, BS)
        step = scale[b, :, :used, None]
        assert (hi[b, :, :used] >= upper[b, :, :used] - 1e-4 * step).all()  # up to fp32 rounding
        assert (lo[b, :, :used] <= lower[b, :, :used] + 1e-4 * step).all()
        assert (hi[b, :, :used] - upper[b, :, :used] <= step * 1.0001).all()
        assert (lower[b, :, :used] - lo[b, :, :used] <= step * 1.0001).all()
    assert codes_hi.abs().max() <= 127 and codes_lo.abs().max() <= 127
    q = torch.randn(2, 6, 64)
    length = torch.tensor(lengths)
    args = dict(block_size=BS, local_blocks=0, folded=True)
    exact = block_scores(q, upper, lower, length, **args)
    coded = block_scores(q, codes_hi, codes_lo, length, descriptor_scale=scale, **args)
    inside = exact.isfinite()
    assert (coded[inside] >= exact[inside] - 1e-4 * exact[inside].abs().clamp_min(1)).all()
    slack = (q.view(2, 3, 2, 64).mean(2).abs().sum(-1, keepdim=True) * scale)[inside]  # one step a coordinate
    assert ((coded - exact)[inside] <= slack * 1.001 + 1e-5).all()


def test_query_codes_are_fixed_point_within_a_step():
    """Each row in steps of max|q| / QUERY_CODE_MAX, truncated: within one step of q, the largest coordinate
    coded at full scale, zero rows zero."""
    torch.manual_seed(42)
    q = torch.randn(3, 5, 128) * torch.tensor([1e-3, 1.0, 80.0])[:, None, None]
    q[1, 2] = 0.0
    q[2, 0, 7] = 500.0  # an outlier coordinate sets its row's step
    codes, step = query_codes(q.bfloat16())
    qf = q.bfloat16().float()
    assert codes.dtype == torch.int32 and codes.abs().max() <= QUERY_CODE_MAX
    assert ((qf - codes * step[..., None]).abs() <= step[..., None] * 1.0001).all()
    assert (codes.abs().amax(-1)[step > 0] >= QUERY_CODE_MAX - 1).all()
    assert (codes[1, 2] == 0).all() and step[1, 2] == 0
    assert (codes.sign() * qf.sign() >= 0).all()


def test_int8_softmax_bounds_are_the_query_codes_exact_products():
    """Softmax pooling over int8 descriptors: each head's bound is the exact integer product of its query codes
    and the block's codes, scaled, so it stays within a query step a coordinate of the bound of q itself."""
    torch.manual_seed(42)
    keys = torch.randn(1, 2, 40 * BS, 64) * 3
    hi, lo, scale = _int8(keys, [40 * BS])
    q = torch.randn(1, 8, 64)
    length = torch.tensor([40 * BS])
    args = dict(block_size=BS, local_blocks=1, pooling="softmax", folded=True, scale=0.125)
    coded = block_scores(q, hi, lo, length, descriptor_scale=scale, **args)
    top, bottom = hi.float() * scale[..., None], lo.float() * scale[..., None]
    codes, step = query_codes(q.view(1, 2, 4, 64))
    qq = (codes.double() * step[..., None].double()).float().view(1, 8, 64)
    torch.testing.assert_close(coded, block_scores(qq, top, bottom, length, **args), rtol=1e-5, atol=1e-6)
    # against q itself: one query step a coordinate of slack in every head's bound, within softmax's rounding
    plain = block_scores(q, top, bottom, length, **args)
    inside = plain.isfinite()
    assert (coded - plain)[inside].abs().max() < 1e-3


@pytest.mark.parametrize("rows", [1, 4, 16], ids=lambda g: f"G{g}")
@pytest.mark.triton
def test_query_codes_triton_equal_reference(rows):
    """The kernels' query codes and steps are the reference's bit for bit (the int8 bounds are then exact)."""
    torch.manual_seed(42)
    q = torch.zeros(16, 128, dtype=torch.bfloat16)
    q[:rows] = (torch.randn(rows, 128) * torch.logspace(-2, 2, rows)[:, None]).bfloat16()
    q[0, 3] = -300.0  # an outlier, negative
    out = torch.empty(16, 128, dtype=torch.int32, device=DEVICE)
    step = torch.empty(16, device=DEVICE)
    _query_codes_kernel[(1,)](q.to(DEVICE), out, step, D=128)
    want, want_step = query_codes(q)
    assert torch.equal(out.cpu(), want) and torch.equal(step.cpu(), want_step)


def test_int8_descriptors_refuse_a_separate_mean():
    keys = torch.randn(1, 1, 32, 8)
    d = torch.zeros(1, 1, 2, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 descriptors"):
        update_block_descriptors(keys, d, d.clone(), torch.tensor([32]), 32, BS, kmean=torch.zeros(1, 1, 2, 8),
                                 scale=torch.zeros(1, 1, 2))


def _problem(B, group, L, D, dtype, S=None):
    """q [B, 2*group, D], keys/values [B, 2, S, D] (NaN past each length), descriptors, lengths tensor."""
    _supported(dtype)
    Hkv = 2
    lengths = [L, max(1, L // 3)][:B]
    S = S or L + 37
    keys = _keys(B, Hkv, S, D, lengths, dtype=dtype)
    values = _keys(B, Hkv, S, D, lengths, dtype=dtype).flip(-1)
    q = torch.randn(B, Hkv * group, D, dtype=dtype)
    kmax, kmin = _descriptors(keys, lengths)
    return [t.to(DEVICE) for t in (q, keys, values, kmax, kmin)] + [torch.tensor(lengths, device=DEVICE)]


@pytest.mark.parametrize("pooling", ["mean", "softmax", "mean+centroid", "softmax+centroid", "mean+folded",
                                     "softmax+folded"])
@pytest.mark.parametrize("L", [1, 17, 1000, 4097, 32768], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.triton
def test_select_triton_matches_reference(D, group, L, pooling):
    from kernels.block_select.triton import select_blocks_triton

    q, keys, _, kmax, kmin, length = _problem(2, group, L, D, torch.float16 if DEVICE == "cpu" else torch.bfloat16)
    pooling, variant = pooling.split("+")[0], pooling.partition("+")[2]
    centroid, folded = variant in ("centroid", "folded"), variant == "folded"
    kmean = _means(keys.cpu(), length.tolist()).to(DEVICE) if variant == "centroid" else None
    if folded:
        kmax, kmin = (t.to(DEVICE) for t in _descriptors(keys.cpu(), length.tolist(), fold_mean=True))
    rule = KeepRule(0.1, 16, 1, 1 if pooling == "softmax" else 0, pooling=pooling, centroid=centroid)
    width = rule.keep(kmax.shape[2]) + 5
    got = select_blocks_triton(q, kmax, kmin, length, block_size=BS, rule=rule, width=width, scale=D**-0.5,
                               kmean=kmean, folded=folded)
    cpu_mean = kmean.cpu() if kmean is not None else None
    ref = select_ref(q.cpu(), kmax.cpu(), kmin.cpu(), length.cpu(), block_size=BS, rule=rule, width=width,
                     scale=D**-0.5, kmean=cpu_mean, folded=folded)
    if not torch.equal(got.cpu(), ref):
        # Summation order may flip near-ties: the kernel's choice must still be a top-k under reference scores.
        scores = block_scores(q.cpu(), kmax.cpu(), kmin.cpu(), length.cpu(), block_size=BS, local_blocks=1,
                              sink_blocks=rule.sink_blocks, pooling=pooling, scale=D**-0.5, kmean=cpu_mean,
                              folded=folded)
        if pooling == "softmax":
            # Selected by bins: a score rounded across a bin's edge moves one bin, and that bin's lowest blocks.
            scores = bin_keys(scores, *score_bins("softmax", group)).float()
        for b in range(2):
            for h in range(2):
                a, r = got[b, h].cpu(), ref[b, h]
                assert torch.equal(a < 0, r < 0)
                ka, kr = scores[b, h, a[a >= 0].long()].sort().values, scores[b, h, r[r >= 0].long()].sort().values
                if pooling == "softmax":
                    assert (ka - kr).abs().max() <= 1
                else:
                    torch.testing.assert_close(ka, kr, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 2, 7])
def test_softmax_score_bins(group):
    """Softmax pooling's bins: in score order, 1/128 octave wide, the group's score in the last bin but one,
    +inf (forced blocks) in the last, zero and what lies 32 octaves below the group's in bin 0."""
    shift, base = score_bins("softmax", group)
    scores = torch.sort(torch.rand(20000) * group * 2.0 ** -torch.randint(0, 40, (20000,)).float()).values
    bins = bin_keys(scores, shift, base)
    assert (bins[1:] >= bins[:-1]).all()
    inside = (bins > 0) & (bins < HIST_BINS - 2)
    for i in torch.nonzero(inside[1:] & (bins[1:] == bins[:-1])).flatten()[:2000].tolist():
        assert scores[i + 1] / scores[i] < 1 + 2.0 ** -7
    assert bin_keys(torch.tensor([float(group), float("inf"), 0.0]), shift, base).tolist() == [HIST_BINS - 2,
                                                                                              HIST_BINS - 1, 0]
    assert bin_keys(torch.tensor([group * 2.0 ** -33]), shift, base).item() == 0
    assert bin_keys(torch.tensor([group * 2.0 ** -31]), shift, base).item() > 0


def test_softmax_selection_takes_higher_bins_then_lowest_index():
    """Two heads' scores built to fall in few bins: the reference keeps every block of a bin above the k-th
    score's and fills the rest from that bin in index order, not by the scores inside it."""
    torch.manual_seed(42)
    n_blocks, D = 200, 16
    # A group of one: each block's bound is its first coordinate times q's; bounds spaced well apart pick bins.
    bound = torch.zeros(1, 1, n_blocks)
    bound[0, 0, :] = torch.linspace(-20.0, 0.0, n_blocks).flip(0).round()
    kmax = torch.zeros(1, 1, n_blocks, D)
    kmax[..., 0] = bound
    q = torch.zeros(1, 1, D)
    q[..., 0] = 1.0
    length = torch.tensor([n_blocks * BS])
    rule = KeepRule(0.1, 16, 1, 0, pooling="softmax")
    got = select_ref(q, kmax, kmax.clone(), length, block_size=BS, rule=rule, width=rule.keep(n_blocks))[0, 0]
    scores = block_scores(q, kmax, kmax.clone(), length, block_size=BS, local_blocks=1, pooling="softmax")[0, 0]
    bins = bin_keys(scores, *score_bins("softmax", 1))
    k = rule.keep(n_blocks)
    kth = torch.sort(bins, descending=True).values[k - 1]
    above = torch.nonzero(bins > kth).flatten()
    fill = torch.nonzero(bins == kth).flatten()[:k - len(above)]
    assert got.tolist() == torch.cat([above, fill]).sort().values.tolist()
    assert len(torch.nonzero(bins == kth)) > k - len(above)  # the case built: the k-th bin is split


def _int8(keys, lengths):
    """Folded descriptors as int8 codes and their scale, by the reference."""
    B, H, S, D = keys.shape
    nb = cdiv(S, BS)
    hi = torch.zeros(B, H, nb, D, dtype=torch.int8)
    lo, scale = hi.clone(), torch.zeros(B, H, nb)
    for b, n in enumerate(lengths):
        update_ref(keys[b:b + 1].cpu(), hi[b:b + 1], lo[b:b + 1], torch.tensor([n]), n, BS, fold_mean=True,
                   scale=scale[b:b + 1])
    return hi, lo, scale


@pytest.mark.parametrize("form", ["folded", "int8"])
@pytest.mark.parametrize("n_new", [1, 33], ids=lambda n: f"new{n}")
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.triton
def test_descriptors_triton_folded(dtype, D, n_new, form):
    """fold_mean: max + mean and min + mean, summed in fp32 and rounded once, as the reference does; in int8,
    codes a step apart at most where the fp32 sums round differently, and their scales."""
    from kernels.block_descriptors.triton import update_block_descriptors_triton

    _supported(dtype)
    L = 1000
    keys = _keys(1, 4, L + 40, D, [L], dtype=dtype, device=DEVICE)
    if form == "int8":
        want = _int8(keys, [L - n_new])
    else:
        want = (*_descriptors(keys.cpu(), [L - n_new]), None)
    got = [None if t is None else t.to(DEVICE) for t in want]
    update_block_descriptors_triton(keys, got[0], got[1], torch.tensor([L], device=DEVICE), n_new, BS,
                                    fold_mean=True, scale=got[2])
    update_ref(keys.cpu(), *want[:2], torch.tensor([L]), n_new, BS, fold_mean=True, scale=want[2])
    if form == "int8":
        for a, b in zip(got[:2], want[:2]):
            diff = a.cpu().int() - b.int()
            assert diff.abs().max() <= 1 and (diff != 0).float().mean() < 0.05
        torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)
        return
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a.cpu(), b, equal_nan=True, **tol)


@pytest.mark.parametrize("pooling", ["mean", "softmax"])
@pytest.mark.parametrize("L", [1000, 32768], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("group", [1, 4], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.triton
def test_select_triton_int8_matches_reference(D, group, L, pooling):
    """Selection over int8 descriptors and their scale: the reference's blocks, up to near-ties."""
    from kernels.block_select.triton import select_blocks_triton

    q, keys, _, _, _, length = _problem(2, group, L, D, torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    hi, lo, scale = _int8(keys.cpu(), length.tolist())
    rule = KeepRule(0.1, 16, 1, 1, pooling=pooling, centroid=True)
    args = dict(block_size=BS, rule=rule, width=rule.keep(hi.shape[2]) + 3, scale=D**-0.5, folded=True)
    sync = new_sync(2, 2, DEVICE) if pooling == "softmax" else None  # as the engine calls it: one fused launch
    got = select_blocks_triton(q, hi.to(DEVICE), lo.to(DEVICE), length, descriptor_scale=scale.to(DEVICE),
                               histogram=new_histogram(2, 2, DEVICE), sync=sync, **args).cpu()
    ref = select_ref(q.cpu(), hi, lo, length.cpu(), descriptor_scale=scale, **args)
    if torch.equal(got, ref):
        return
    scores = block_scores(q.cpu(), hi, lo, length.cpu(), block_size=BS, local_blocks=1, sink_blocks=1,
                          pooling=pooling, scale=D**-0.5, folded=True, descriptor_scale=scale)
    if pooling == "softmax":
        scores = bin_keys(scores, *score_bins("softmax", group)).float()
    for b in range(2):
        for h in range(2):
            a, r = got[b, h], ref[b, h]
            assert torch.equal(a < 0, r < 0)
            ka, kr = scores[b, h, a[a >= 0].long()].sort().values, scores[b, h, r[r >= 0].long()].sort().values
            if pooling == "softmax":
                assert (ka - kr).abs().max() <= 1
            else:
                torch.testing.assert_close(ka, kr, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hist", [False, True], ids=["range", "hist"])
@pytest.mark.parametrize("n_blocks", [40, 1000, 5000], ids=lambda n: f"NB{n}")
@pytest.mark.triton
def test_select_triton_breaks_ties_by_lowest_index(n_blocks, hist):
    """Scores with heavy ties (4 distinct values, negatives and zero included): the kernel keeps every block
    above the k-th largest score and the lowest-indexed blocks among those equal to it, however the blocks
    split into the two resident parts (5,000 = 4,096 + 1,024 also once picked a warp count Triton rejects)."""
    from kernels.block_select.triton import select_blocks_triton

    D = 64
    torch.manual_seed(42)
    level = torch.randint(-1, 3, (1, 2, n_blocks), dtype=torch.float32)
    kmax = torch.zeros(1, 2, n_blocks, D)
    kmax[..., 0] = level
    q = torch.ones(1, 2, D)
    length = torch.tensor([n_blocks * BS - 3])
    rule = KeepRule(0.1, 16, 1)
    width = rule.keep(n_blocks) + 3
    args = [t.to(DEVICE) for t in (q, kmax, kmax.clone(), length)]
    histogram = new_histogram(1, 2, DEVICE) if hist else None
    got = select_blocks_triton(*args, block_size=BS, rule=rule, width=width, histogram=histogram).cpu()
    k = rule.keep(n_blocks)
    for h in range(2):
        score = level[0, h].clone()
        score[-1] = float("inf")  # the local block
        order = sorted(range(n_blocks), key=lambda i: (-score[i].item(), i))
        assert got[0, h, :k].tolist() == sorted(order[:k]), f"head {h}"
        assert (got[0, h, k:] == -1).all()


@pytest.mark.parametrize("forced", [(1, 0), (3, 2), (24, 0), (20, 30)], ids=lambda f: f"local{f[0]}-sink{f[1]}")
@pytest.mark.parametrize("n_blocks", [1, 2, 17, 40, 300], ids=lambda n: f"NB{n}")
@pytest.mark.parametrize("hist", [False, True], ids=["range", "hist"])
@pytest.mark.triton
def test_select_triton_forced_blocks_around_k(n_blocks, forced, hist):
    """The search is bracketed by the finite scores and stops early: it must stay exact when the forced
    (+inf) blocks are fewer than, as many as or more than k, and when every block is forced."""
    from kernels.block_select.triton import select_blocks_triton

    D = 64
    torch.manual_seed(42)
    kmax = torch.randn(1, 2, n_blocks, D)
    kmin = kmax - torch.rand(1, 2, n_blocks, D)
    q = torch.randn(1, 2, D)
    length = torch.tensor([n_blocks * BS - 5])
    rule = KeepRule(0.1, 16, *forced)
    width = rule.keep(n_blocks) + 2
    args = [t.to(DEVICE) for t in (q, kmax, kmin, length)]
    histogram = new_histogram(1, 2, DEVICE) if hist else None
    got = select_blocks_triton(*args, block_size=BS, rule=rule, width=width, histogram=histogram).cpu()
    scores = block_scores(q, kmax, kmin, length, block_size=BS, local_blocks=forced[0], sink_blocks=forced[1])
    k = rule.keep(n_blocks)
    for h in range(2):
        order = sorted(range(n_blocks), key=lambda i: (-scores[0, h, i].item(), i))  # ties: lowest index first
        assert got[0, h, :k].tolist() == sorted(order[:k]), f"head {h}"
        assert (got[0, h, k:] == -1).all()


def _histogram_left(histogram: torch.Tensor) -> None:
    """What a call leaves in the histogram: zeros, for the next call (the one-program top-k and the fused launch
    zero it after reading it)."""
    assert not histogram.any()


@pytest.mark.parametrize("pooling", ["mean", "softmax+centroid"])
@pytest.mark.parametrize("L", [17, 4097, 32768], ids=lambda n: f"L{n}")
@pytest.mark.triton
def test_select_triton_histogram_changes_nothing(L, pooling):
    """With the histogram the top-k starts from the k-th score's bin (softmax pooling: takes it): the same
    selection as without it, call after call, and a histogram left holding other counts (a call stopped between
    its launches) is not trusted: the one-program top-k ignores it, and leaves it zeroed."""
    from kernels.block_select.triton import select_blocks_triton

    q, keys, _, kmax, kmin, length = _problem(2, 4, L, 64, torch.float16 if DEVICE == "cpu" else torch.bfloat16)
    pooling, centroid = pooling.split("+")[0], pooling.endswith("+centroid")
    kmean = _means(keys.cpu(), length.tolist()).to(DEVICE) if centroid else None
    rule = KeepRule(0.1, 16, 1, 1, pooling=pooling, centroid=centroid)
    args = dict(block_size=BS, rule=rule, width=rule.keep(kmax.shape[2]) + 2, scale=64**-0.5, kmean=kmean)
    plain = select_blocks_triton(q, kmax, kmin, length, **args)
    histogram = new_histogram(2, 2, DEVICE)
    for _ in range(2):  # the second call finds the histogram the first left
        assert torch.equal(select_blocks_triton(q, kmax, kmin, length, histogram=histogram, **args), plain)
        _histogram_left(histogram)
    histogram[0, 1, 3000] = 5
    histogram[1, 0] = 1
    assert torch.equal(select_blocks_triton(q, kmax, kmin, length, histogram=histogram, **args), plain)
    _histogram_left(histogram)


@pytest.mark.parametrize("parts", [1, 3, 16], ids=lambda p: f"parts{p}")
@pytest.mark.parametrize("n_blocks", [1, 40, 1000, 5000], ids=lambda n: f"NB{n}")
@pytest.mark.triton
def test_select_triton_fused_equals_one_program_a_row(monkeypatch, n_blocks, parts):
    """Softmax pooling with the histogram and the sync words: one launch whose `parts` programs a row meet at
    barriers (phase by phase under the interpreter, where parts > 1). Scores built to fall in a few bins, so that
    the k-th score's bin is split and its ties straddle the parts: the blocks one program a row takes, bit for bit,
    call after call; the histogram left zeroed and the first two barriers' arrival counts at 0."""
    import kernels.block_select.triton as triton_select

    torch.manual_seed(42)
    D, group = 64, 2
    level = torch.randint(0, 4, (2, 2, n_blocks)).float() * 3.0
    kmax = torch.zeros(2, 2, n_blocks, D)
    kmax[..., 0] = level
    q = torch.zeros(2, 2 * group, D)
    q[..., 0] = 1.0
    length = torch.tensor([n_blocks * BS - 3, max(1, n_blocks * BS // 2)])
    rule = KeepRule(0.1, 16, 1, 1, pooling="softmax")
    width = rule.keep(n_blocks) + 3
    args = [t.to(DEVICE) for t in (q, kmax, kmax.clone(), length)]
    kw = dict(block_size=BS, rule=rule, width=width, scale=1.0)
    one_program = triton_select.select_blocks_triton(*args, **kw)
    monkeypatch.setattr(triton_select, "_FUSED_PARTS", parts)
    histogram, sync = new_histogram(2, 2, DEVICE), new_sync(2, 2, DEVICE)
    histogram[0, 1, 3000] = 5  # left by a call stopped between its launches: cleared before counting
    for _ in range(2):
        got = triton_select.select_blocks_triton(*args, histogram=histogram, sync=sync, **kw)
        assert torch.equal(got, one_program)
        _histogram_left(histogram)
        assert not sync[..., :2].any() and barrier_timeouts(sync) == 0  # the third barrier's is zeroed by the next
    assert torch.equal(got.cpu(), select_ref(*(t.cpu() for t in args), **kw))
    if DEVICE == "cuda":  # the phases as separate launches, as the interpreter runs them
        monkeypatch.setattr(triton_select, "_FUSED_SPLIT", True)
        assert torch.equal(triton_select.select_blocks_triton(*args, histogram=histogram, sync=sync, **kw), got)


@pytest.mark.triton
def test_select_triton_parts_past_the_register_limit_run_as_launches(monkeypatch):
    """The one launch holds a part's blocks in registers from its second phase on: where the row's parts would hold
    more than _FUSED_PART_MAX blocks the selection runs as the separate launches instead, with the same blocks."""
    import kernels.block_select.triton as triton_select

    q, _, _, kmax, kmin, length = _problem(2, 2, 1000 * BS, 64, torch.float32)
    rule = KeepRule(0.1, 16, 1, 1, pooling="softmax")
    kw = dict(block_size=BS, rule=rule, width=rule.keep(kmax.shape[2]), scale=64**-0.5)
    want = select_ref(*(t.cpu() for t in (q, kmax, kmin, length)), **kw)
    fused = []
    launch_fused = triton_select._launch_fused
    monkeypatch.setattr(triton_select, "_launch_fused", lambda *a, **k: fused.append(1) or launch_fused(*a, **k))
    monkeypatch.setattr(triton_select, "_FUSED_PARTS", 2)
    for part_max, one_launch in ((2048, True), (256, False)):  # 8 tiles of 128 blocks: parts of 512
        monkeypatch.setattr(triton_select, "_FUSED_PART_MAX", part_max)
        fused.clear()
        got = triton_select.select_blocks_triton(q, kmax, kmin, length, histogram=new_histogram(2, 2, DEVICE),
                                                 sync=new_sync(2, 2, DEVICE), **kw)
        assert bool(fused) is one_launch and torch.equal(got.cpu(), want)


@pytest.mark.triton
def test_phase_stamps_refuse_the_phases_as_separate_launches(monkeypatch):
    """Phase stamps time the one launch; asked for where the phases run as separate launches (the interpreter,
    _FUSED_SPLIT) the selection says so instead of stamping part of them."""
    import kernels.block_select.triton as triton_select
    from kernels.block_select import record_phases

    monkeypatch.setattr(triton_select, "_FUSED_SPLIT", True)
    monkeypatch.setattr(triton_select, "_STAMPS", None)  # restored after the test
    q, _, _, kmax, kmin, length = _problem(1, 2, 300, 64, torch.float32)
    rule = KeepRule(0.1, 16, 1, 1, pooling="softmax")
    record_phases({})
    with pytest.raises(RuntimeError, match="one launch with every phase"):
        triton_select.select_blocks_triton(q, kmax, kmin, length, block_size=BS, rule=rule,
                                           width=rule.keep(kmax.shape[2]), histogram=new_histogram(1, 2, DEVICE),
                                           sync=new_sync(1, 2, DEVICE))


@pytest.mark.gpu
def test_phase_stamps_show_the_barriers_holding_and_change_no_result():
    """With phase stamps (record_phases) the one launch keeps the same blocks; each program's stamps rise through
    PHASE_STAMPS, and no program of a row passes a barrier before the row's last program has reached it."""
    from kernels.block_select import PHASE_STAMPS, record_phases

    q, _, _, kmax, kmin, length = _problem(2, 2, 32768, 128, torch.bfloat16)
    rule = KeepRule(0.1, 16, 1, 1, pooling="softmax")
    kw = dict(block_size=BS, rule=rule, width=rule.keep(kmax.shape[2]), scale=128**-0.5,
              histogram=new_histogram(2, 2, "cuda"), sync=new_sync(2, 2, "cuda"))
    plain = select_blocks(q, kmax, kmin, length, **kw)
    stamps = {}
    record_phases(stamps)
    try:
        got = select_blocks(q, kmax, kmin, length, **kw)
    finally:
        record_phases(None)
    assert torch.equal(got, plain) and barrier_timeouts(kw["sync"]) == 0
    (s,) = stamps.values()
    s = s.cpu()
    assert s.shape[0] == 4 and s.shape[1] > 1 and s.shape[2] == len(PHASE_STAMPS)
    assert (s > 0).all() and (s.diff(dim=2) >= 0).all()
    for reached, passed in ((2, 3), (4, 5), (6, 7)):
        assert (s[:, :, passed].amin(1) >= s[:, :, reached].amax(1)).all()


def test_phase_stamps_need_triton():
    if importlib.util.find_spec("triton") is not None:
        pytest.skip("Triton is installed: the stamps' own tests run")
    from kernels.block_select import record_phases

    with pytest.raises(RuntimeError, match="need Triton"):
        record_phases({})


def test_select_dispatch_takes_the_histogram_and_validates_it():
    """The reference ignores the histogram; the Triton launcher refuses one of the wrong shape or dtype."""
    q, _, _, kmax, kmin, length = _problem(1, 2, 300, 64, torch.float32)
    rule = KeepRule(0.1, 16, 1)
    width = rule.keep(kmax.shape[2])
    args = dict(block_size=BS, rule=rule, width=width)
    histogram = new_histogram(1, 2, "cpu")
    assert histogram.shape == (1, 2, HIST_BINS) and histogram.dtype == torch.int32
    cpu = [t.cpu() for t in (q, kmax, kmin, length)]
    assert torch.equal(select_blocks(*cpu, histogram=histogram, **args), select_ref(*cpu, **args))
    with pytest.raises(ValueError, match="expected a rule with centroid"):
        select_blocks(*cpu, folded=True, **args)
    if importlib.util.find_spec("triton") is None:
        return
    from kernels.block_select.triton import select_blocks_triton

    with pytest.raises(ValueError, match="histogram of shape"):
        select_blocks_triton(*cpu, histogram=histogram[:, :1], **args)
    with pytest.raises(ValueError, match="histogram of shape"):
        select_blocks_triton(*cpu, histogram=histogram.long(), **args)
    sync = new_sync(1, 2, "cpu")
    assert sync.shape == (1, 2, SYNC_WORDS) and not sync.any()
    with pytest.raises(ValueError, match="sync of shape"):
        select_blocks_triton(*cpu, histogram=histogram, sync=sync[:, :, :2], **args)
    wide = torch.zeros(1, 2, 3, 2048, dtype=torch.int8)
    with pytest.raises(ValueError, match="head_dim <= 1024 with int8"):
        select_blocks_triton(torch.zeros(1, 4, 2048), wide, wide.clone(), torch.tensor([40]), block_size=BS,
                             rule=KeepRule(0.1, 16, 1, pooling="softmax", centroid=True), width=3, folded=True,
                             descriptor_scale=torch.zeros(1, 2, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("L", [1, 17, 1000, 4097, 32768], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.triton
def test_sparse_triton_matches_reference(D, group, L, dtype):
    from kernels.sparse_decode_attention.triton import sparse_decode_attention_triton

    q, keys, values, kmax, kmin, length = _problem(2, group, L, D, dtype)
    blocks = select_ref(q.cpu(), kmax.cpu(), kmin.cpu(), length.cpu(), block_size=BS, rule=KeepRule(0.1, 16, 1),
                        width=KeepRule(0.1, 16, 1).keep(kmax.shape[2]) + 3).to(DEVICE)
    out, lse = sparse_decode_attention_triton(q, keys, values, blocks, length, block_size=BS, scale=D**-0.5,
                                              return_lse=True)
    ref, ref_lse = sparse_ref(q.float(), keys.float(), values.float(), blocks, length, block_size=BS,
                              scale=D**-0.5, return_lse=True)
    assert out.dtype == dtype and not out.isnan().any()
    toks = {}
    for b, n in enumerate(length.tolist()):
        for h in range(q.shape[1]):
            hk = h // group
            toks[(b, h, hk)] = [t for blk in blocks[b, hk].tolist() if blk >= 0
                                for t in range(blk * BS, min(n, blk * BS + BS))]
    err = (out.float() - ref).abs().max().item()
    torch_err = _lowp_error(q, keys, values, toks, D**-0.5)
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.2e} vs torch {dtype} error {torch_err:.2e}"
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [2, 32], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.triton
def test_few_query_decode_triton_matches_reference(D, group, T, window):
    from kernels.decode_attention.triton import decode_attention_triton

    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    _, keys, values, _, _, length = _problem(2, group, 4097, D, dtype)
    q = torch.randn(2, 2 * group, T, D, dtype=dtype, device=DEVICE)
    out, lse = decode_attention_triton(q, keys, values, length, scale=D**-0.5, window=window, return_lse=True)
    ref, ref_lse = dense_ref(q.float(), keys.float(), values.float(), length, scale=D**-0.5, window=window,
                             return_lse=True)
    assert out.shape == q.shape and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("splits", [7, 300], ids=["S7", "S300-online"])
@pytest.mark.triton
def test_combine_triton_matches_reference(splits):
    """Splits within one tile of the kernel, and more (merged online, tile by tile)."""
    from kernels.lse_combine.triton import combine_splits_triton

    torch.manual_seed(42)
    out_part = torch.randn(50, splits, 128, device=DEVICE)
    lse_part = 3 * torch.randn(50, splits, device=DEVICE)
    lse_part[:, 3] = float("-inf")  # empty splits weigh nothing, even if their rows hold NaN
    out_part[:, 3] = float("nan")
    lse_part[7] = float("-inf")  # a row with no key at all: out 0, lse -inf
    lse_part[9, :128] = float("-inf")  # S300: a first tile with nothing in it, then keys
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    got, got_lse = combine_splits_triton(out_part, lse_part, dtype)
    ref, ref_lse = combine_splits_reference(out_part.cpu(), lse_part.cpu(), dtype)
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse.cpu(), ref_lse, atol=1e-5, rtol=1e-5)
    assert (got[7] == 0).all() and got_lse[7] == float("-inf")


def _captured(step):
    """step() warmed up and captured by the engines' own capture: (graph, the outputs of the captured call)."""
    from engines.decoding import capture_graph

    outputs = []
    graph = capture_graph(lambda: outputs.append(step()), torch.device("cuda"))
    return graph, outputs[-1]


@pytest.mark.gpu
def test_sparse_step_in_a_cuda_graph_follows_length():
    """descriptor update + select + sparse attention captured once, replayed while the length grows."""
    from kernels.block_descriptors import update_block_descriptors
    from kernels.block_select import select_blocks
    from kernels.sparse_decode_attention import sparse_decode_attention

    B, Hkv, G, S, D = 1, 8, 4, 8192, 128
    rule = KeepRule(0.1, 16, 1)
    keys = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    kmax = torch.zeros(B, Hkv, S // BS, D, device="cuda", dtype=torch.bfloat16)
    kmin = torch.zeros_like(kmax)
    update_block_descriptors(keys, kmax, kmin, torch.tensor([5000], device="cuda"), 5000, BS)
    q = torch.randn(B, Hkv * G, D, device="cuda", dtype=torch.bfloat16)
    length = torch.tensor([5001], device="cuda")
    width = rule.keep(S // BS)

    def step():
        update_block_descriptors(keys, kmax, kmin, length, 1, BS)
        blocks = select_blocks(q, kmax, kmin, length, block_size=BS, rule=rule, width=width)
        return blocks, sparse_decode_attention(q, keys, values, blocks, length, block_size=BS, scale=D**-0.5)

    graph, (blocks, out) = _captured(step)
    for n in (5001, 5002, 6000, 8192):
        # Decoding grows the length one token at a time; for the jumps, bring the earlier blocks up to date.
        update_block_descriptors(keys, kmax, kmin, torch.tensor([n - 1], device="cuda"), n - 1, BS)
        length.fill_(n)
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref_kmax, ref_kmin = kmax.clone(), kmin.clone()
        update_ref(keys.cpu(), ref_kmax := ref_kmax.cpu(), ref_kmin := ref_kmin.cpu(), torch.tensor([n]), n, BS)
        assert torch.equal(kmax.cpu()[:, :, :cdiv(n, BS)], ref_kmax[:, :, :cdiv(n, BS)])
        ref_blocks = select_ref(q.cpu(), ref_kmax, ref_kmin, torch.tensor([n]), block_size=BS, rule=rule, width=width)
        assert ((blocks >= 0).sum(-1).cpu() == (ref_blocks >= 0).sum(-1)).all()
        ref = sparse_ref(q.float(), keys.float(), values.float(), blocks, length, block_size=BS, scale=D**-0.5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["launches", "fused"])
def test_programmatic_dependent_launch_changes_no_result(monkeypatch, fused):
    """A decode step's kernels (K/V write with descriptors, selection with its histogram, sparse attention and its
    combine) captured in a CUDA graph with programmatic dependent launch, each kernel waiting for the one before:
    bit for bit what plain launches give, replay after replay; with the sync words the selection is one launch
    whose programs meet at barriers."""
    import kernels._gdc as gdc
    from kernels.block_descriptors import update_block_descriptors
    from kernels.kv_append import append_kv
    from kernels.sparse_decode_attention import sparse_decode_attention

    if not gdc.use_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs Hopper or later")
    B, Hkv, G, S, D = 1, 8, 2, 65536, 128
    rule = KeepRule(0.1, 1024, 1, 1, pooling="softmax", centroid=True)

    def run(pdl: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(gdc, "_hopper_or_later", lambda index: pdl)
        torch.manual_seed(0)
        opts = dict(device="cuda", dtype=torch.bfloat16)
        keys, values = torch.randn(B, Hkv, S, D, **opts), torch.randn(B, Hkv, S, D, **opts)
        kmax, kmin = (torch.zeros(B, Hkv, S // BS, D, **opts) for _ in range(2))
        n0 = 50000
        update_block_descriptors(keys, kmax, kmin, torch.tensor([n0], device="cuda"), n0, BS, fold_mean=True)
        q, k_new, v_new = torch.randn(B, Hkv * G, D, **opts), torch.randn(B, Hkv, 1, D, **opts), \
            torch.randn(B, Hkv, 1, D, **opts)
        pos, length = torch.tensor([n0], device="cuda"), torch.tensor([n0 + 1], device="cuda")
        histogram = new_histogram(B, Hkv, "cuda")
        sync = new_sync(B, Hkv, "cuda") if fused else None
        width = rule.keep(S // BS)

        def step():
            append_kv(keys, values, k_new, v_new, pos, descriptors=(kmax, kmin, None), length=length,
                      block_size=BS, fold_mean=True)
            blocks = select_blocks(q, kmax, kmin, length, block_size=BS, rule=rule, width=width, scale=D**-0.5,
                                   folded=True, histogram=histogram, sync=sync)
            return blocks, sparse_decode_attention(q, keys, values, blocks, length, block_size=BS, scale=D**-0.5)

        graph, (blocks, out) = _captured(step)
        got = []
        for i in range(3):
            q.copy_(torch.randn_like(q))
            k_new.copy_(torch.randn_like(k_new))
            graph.replay()
            got += [blocks.clone(), out.clone(), kmax.clone(), kmin.clone()]
            pos += 1
            length += 1
        torch.cuda.synchronize()
        assert not histogram.any()
        if fused:  # every barrier met
            assert barrier_timeouts(sync) == 0
        return got

    with_pdl, plain = run(True), run(False)
    for a, b in zip(with_pdl, plain):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["mean", "softmax"])
def test_select_triton_resident_past_256k_tokens(pooling):
    """A 256K-token document plus answer room (16,389 blocks) stays on the register-resident search, with and
    without the histogram; with the sync words softmax pooling's row goes to the fused launch: the same blocks."""
    from kernels.block_select.triton import _RESIDENT_MAX, select_blocks_triton

    L = 262144 + 77
    assert cdiv(L, BS) <= _RESIDENT_MAX
    q, _, _, kmax, kmin, length = _problem(1, 4, L, 128, torch.bfloat16)
    rule = KeepRule(0.1, 16, 1, 1, pooling=pooling)
    width = rule.keep(kmax.shape[2])
    got = select_blocks_triton(q, kmax, kmin, length, block_size=BS, rule=rule, width=width, scale=128**-0.5)
    histogram = new_histogram(1, 2, "cuda")
    assert torch.equal(select_blocks_triton(q, kmax, kmin, length, block_size=BS, rule=rule, width=width,
                                            scale=128**-0.5, histogram=histogram), got)
    _histogram_left(histogram)
    if pooling == "softmax":  # and as one launch, its programs meeting at barriers
        sync = new_sync(1, 2, "cuda")
        assert torch.equal(select_blocks_triton(q, kmax, kmin, length, block_size=BS, rule=rule, width=width,
                                                scale=128**-0.5, histogram=histogram, sync=sync), got)
        assert barrier_timeouts(sync) == 0
    got = got.cpu()
    scores = block_scores(q.cpu(), kmax.cpu(), kmin.cpu(), length.cpu(), block_size=BS, local_blocks=1,
                          sink_blocks=1, pooling=pooling, scale=128**-0.5)
    n = cdiv(L, BS)
    for h in range(2):
        kept = got[0, h][got[0, h] >= 0].long()
        assert kept.numel() == rule.keep(n) and {0, n - 1} <= set(kept.tolist())
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[kept] = False
        if pooling == "softmax":  # selected by bins: one bin apart at most where the kernel's rounding differs
            bins = bin_keys(scores[0, h, :n], *score_bins("softmax", 4))
            assert bins[kept].min() >= bins[dropped].max() - 1
            continue
        assert scores[0, h, kept].min() >= scores[0, h, :n][dropped].max() - 1e-3 * scores[0, h, kept].abs().min()


@pytest.mark.parametrize("pooling", ["mean", "softmax"])
@pytest.mark.triton
def test_select_triton_multipass_equals_resident(monkeypatch, pooling):
    """The multipass top-k (rows past the resident limit) selects what the register-resident one does, with and
    without the histogram, exact (mean pooling) and by bins (softmax): here with the limit lowered."""
    import kernels.block_select.triton as triton_select

    q, _, _, kmax, kmin, length = _problem(2, 4, 3000, 64, torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    rule = KeepRule(0.1, 16, 1, 1, pooling=pooling)
    args = dict(block_size=BS, rule=rule, width=rule.keep(kmax.shape[2]) + 2, scale=64**-0.5)
    resident = triton_select.select_blocks_triton(q, kmax, kmin, length, **args)
    monkeypatch.setattr(triton_select, "_RESIDENT_MAX", 64)
    monkeypatch.setattr(triton_select, "_SELECT_TILE", 64)
    for histogram in (None, new_histogram(2, 2, DEVICE)):
        assert torch.equal(triton_select.select_blocks_triton(q, kmax, kmin, length, histogram=histogram, **args),
                           resident)


@pytest.mark.gpu
def test_select_triton_long_context_multipass():
    """Past _RESIDENT_MAX blocks the selection searches in passes over L2 instead of registers: same contract."""
    from kernels.block_select.triton import _RESIDENT_MAX, select_blocks_triton

    L = (_RESIDENT_MAX + 3000) * BS + 5
    q, _, _, kmax, kmin, length = _problem(1, 4, L, 64, torch.bfloat16)
    rule = KeepRule(0.1, 16, 1, 1)
    width = rule.keep(kmax.shape[2])
    got = select_blocks_triton(q, kmax, kmin, length, block_size=BS, rule=rule, width=width).cpu()
    scores = block_scores(q.cpu(), kmax.cpu(), kmin.cpu(), length.cpu(), block_size=BS, local_blocks=1, sink_blocks=1)
    for h in range(2):
        kept = got[0, h][got[0, h] >= 0].long()
        assert kept.numel() == rule.keep(cdiv(L, BS)) and 0 in kept.tolist()
        dropped = torch.ones(cdiv(L, BS), dtype=torch.bool)
        dropped[kept] = False
        assert scores[0, h, kept].min() >= scores[0, h, :cdiv(L, BS)][dropped].max() - 1e-3


@pytest.mark.parametrize("pooling", ["mean", "softmax"])
def test_select_writes_into_a_given_buffer(pooling):
    """With `out` the selection lands in the caller's buffer (a later step reads it) and equals the plain call's;
    a buffer of the wrong shape or dtype is refused."""
    q, _, _, kmax, kmin, length = _problem(2, 2, 300, 64, torch.float32)
    rule = KeepRule(0.1, 4, 1, 1, pooling=pooling)
    width = rule.keep(kmax.shape[2])
    kw = dict(block_size=BS, rule=rule, width=width, scale=64**-0.5, histogram=new_histogram(2, 2, q.device),
              sync=new_sync(2, 2, q.device))
    plain = select_blocks(q, kmax, kmin, length, **kw)
    out = torch.full((2, 2, width), 7, dtype=torch.int32, device=q.device)
    assert select_blocks(q, kmax, kmin, length, out=out, **kw) is out and torch.equal(out, plain)
    for bad in (out[:, :, :-1], out.to(torch.int64)):
        with pytest.raises(ValueError, match="expected out of shape"):
            select_blocks(q, kmax, kmin, length, out=bad, **kw)
