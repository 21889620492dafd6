"""kernels/kv_append: the decode step's K/V write (and resa's fused descriptor refresh) against its reference
(on CUDA, or on CPU through Triton's interpreter), and the reference against what it replaces (CPU, CI)."""

from __future__ import annotations

import pytest
import torch

from kernels import cdiv
from kernels.block_descriptors import update_block_descriptors_reference
from kernels.kv_append import append_kv, append_kv_reference
from tests.conftest import TRITON_DEVICE

BS = 16


def _cache(B, H, S, D, DV, dtype, device, seq_major=True):
    """Cached keys / values with NaN in the rows not yet written (fresh-buffer poison), as [B, H, S, D] views."""
    torch.manual_seed(42)
    shape_k, shape_v = ((B, S, H, D), (B, S, H, DV)) if seq_major else ((B, H, S, D), (B, H, S, DV))
    keys = torch.randn(shape_k, dtype=dtype, device=device)
    values = torch.randn(shape_v, dtype=dtype, device=device)
    if seq_major:
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    return keys, values


def _described(keys, length):
    B, H, S, D = keys.shape
    kmax = torch.full((B, H, cdiv(S, BS), D), float("nan"), dtype=keys.dtype, device=keys.device)
    kmin, kmean = kmax.clone(), kmax.clone()
    for b, n in enumerate(length.tolist()):
        update_block_descriptors_reference(keys[b:b + 1], kmax[b:b + 1], kmin[b:b + 1], torch.tensor([n]), n, BS,
                                           kmean[b:b + 1])
    return kmax, kmin, kmean


def test_reference_writes_rows_and_refreshes_the_touched_block():
    keys, values = _cache(1, 2, 70, 8, 8, torch.float32, "cpu")
    length = torch.tensor([37])
    kmax, kmin, kmean = _described(keys, length - 1)
    k_new, v_new = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    before = kmax.clone()
    append_kv_reference(keys, values, k_new, v_new, torch.tensor([36]), descriptors=(kmax, kmin, kmean),
                        length=length)
    assert torch.equal(keys[:, :, 36:37], k_new) and torch.equal(values[:, :, 36:37], v_new)
    block = keys[:, :, 32:37]
    assert torch.equal(kmax[:, :, 2], block.amax(2)) and torch.equal(kmin[:, :, 2], block.amin(2))
    torch.testing.assert_close(kmean[:, :, 2], block.mean(2))
    assert torch.equal(kmax[:, :, :2], before[:, :, :2])  # other blocks untouched


def test_descriptors_need_one_token_and_a_length():
    keys, values = _cache(1, 2, 64, 8, 8, torch.float32, "cpu")
    kv = torch.randn(1, 2, 2, 8)
    with pytest.raises(ValueError, match="one new token and a length"):
        append_kv(keys, values, kv, kv, torch.tensor([3, 4]), descriptors=(keys, keys, None),
                  length=torch.tensor([5]))


@pytest.mark.parametrize("describe", [False, True, "fold", "int8"],
                         ids=["kv", "kv+descriptors", "kv+folded", "kv+folded-int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize(("B", "H", "T", "D", "DV", "pos"), [
    pytest.param(1, 8, 1, 128, 128, 4096, id="B1-H8-T1-D128-pos4096"),
    pytest.param(2, 2, 1, 80, 64, 63, id="B2-H2-T1-D80-Dv64-pos63"),
    pytest.param(1, 1, 1, 256, 256, 0, id="B1-H1-T1-D256-pos0"),
    pytest.param(1, 4, 32, 64, 64, 1000, id="B1-H4-T32-D64-pos1000"),
])
@pytest.mark.parametrize("seq_major", [True, False], ids=["seq-major", "head-major"])
@pytest.mark.triton
def test_append_kv_triton(B, H, T, D, DV, pos, dtype, describe, seq_major):
    from kernels.kv_append.triton import append_kv_triton

    if describe and T != 1:
        pytest.skip("descriptors are refreshed for one new token")
    if TRITON_DEVICE == "cpu" and dtype == torch.bfloat16 and describe:
        pytest.skip("Triton's interpreter has no bfloat16 constants")
    S = 4200
    keys, values = _cache(B, H, S, D, DV, dtype, TRITON_DEVICE, seq_major)
    position = torch.arange(pos, pos + T, device=TRITON_DEVICE)
    length = torch.full((B,), pos + T, device=TRITON_DEVICE)
    k_new = torch.randn(B, H, T, D, dtype=dtype, device=TRITON_DEVICE)
    v_new = torch.randn(B, T, H, DV, dtype=dtype, device=TRITON_DEVICE).transpose(1, 2)  # a strided view
    want_k, want_v = keys.clone().cpu(), values.clone().cpu()
    kw = {}
    want_kw = {}
    quant = describe == "int8"
    fold = describe == "fold" or quant
    if describe:
        d = _described(keys.cpu(), length.cpu() - 1)
        d = (d[0], d[1], None) if fold else d
        if quant:
            d = (torch.zeros(d[0].shape, dtype=torch.int8), torch.zeros(d[0].shape, dtype=torch.int8), None)
            want_kw["descriptor_scale"] = torch.zeros(d[0].shape[:3])
            kw["descriptor_scale"] = want_kw["descriptor_scale"].to(TRITON_DEVICE)
        kw.update(descriptors=tuple(None if t is None else t.to(TRITON_DEVICE) for t in d), length=length,
                  fold_mean=fold)
        want_kw.update(descriptors=d, length=length.cpu(), fold_mean=fold)
    append_kv_triton(keys, values, k_new, v_new, position, **kw)
    append_kv_reference(want_k, want_v, k_new.cpu(), v_new.cpu(), position.cpu(), **want_kw)
    assert torch.equal(keys.cpu(), want_k) and torch.equal(values.cpu(), want_v)
    if quant:
        # Codes of the fp32 sums: one step apart at most where the sums round differently; the scales to rounding.
        for i in (0, 1):
            diff = kw["descriptors"][i].cpu().int() - want_kw["descriptors"][i].int()
            assert diff.abs().max() <= 1 and (diff != 0).float().mean() < 0.05
        torch.testing.assert_close(kw["descriptor_scale"].cpu(), want_kw["descriptor_scale"], rtol=1e-2, atol=0)
        assert want_kw["descriptor_scale"].count_nonzero() == B * H  # the touched block's, every head
    elif fold:
        # max + mean and min + mean: fp32 sums, perhaps in another order, rounded to the dtype.
        tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
        for i in (0, 1):
            torch.testing.assert_close(kw["descriptors"][i].cpu(), want_kw["descriptors"][i], equal_nan=True, **tol)
    elif describe:
        got, want = kw["descriptors"], want_kw["descriptors"]
        for i in (0, 1):  # max and min exactly (NaN: blocks not yet described, on both sides)
            torch.testing.assert_close(got[i].cpu(), want[i], rtol=0, atol=0, equal_nan=True)
        # Means: fp32 sums, perhaps in another order, rounded to the dtype.
        tol = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
        torch.testing.assert_close(got[2].cpu(), want[2], equal_nan=True, **tol)
