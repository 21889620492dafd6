"""gather_blocks: stored K/V blocks (host memory, optionally fp8) copied into a layer's retrieval slots.

The reference is held to a one-slot-at-a-time Python definition on CPU; `triton` tests hold the Triton kernel to
the reference (on CUDA, or on CPU through Triton's interpreter); the `gpu` test reads pinned host blocks.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gather_blocks import gather_blocks, gather_blocks_reference
from tests.conftest import TRITON_DEVICE

# Under Triton's interpreter a lane that reads outside its tensor reads whatever lies there, and arithmetic on it
# warns (inf - inf, NaN); on a GPU the same read can fault. The warnings are errors here, so such a read fails.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

FP8 = torch.float8_e4m3fn
LO = 5  # the slots' first row in the layer's buffer: rows before and after them must stay as they were


def gather_loop(dst_k, dst_v, src_k, src_v, ids, scales=None) -> None:
    """One slot at a time in plain Python: the definition the reference batches."""
    block = src_k.shape[2]
    for s, b in enumerate(ids.tolist()):
        if b < 0:
            continue
        for i, (dst, src) in enumerate(((dst_k, src_k), (dst_v, src_v))):
            got = src[b] if scales is None else src[b].float() * scales[b, i][:, None, None]
            dst[:, s * block:(s + 1) * block] = got.to(dst.dtype)


def _case(n, heads, block, dim, ids, dtype, store, seed=42):
    """Layer buffers [1, Hkv, rows, D] of random old rows, and n stored blocks [n, Hkv, block, D] as ltri's
    context memory stores them (fp8: quantised with one scale per block and KV head)."""
    g = torch.Generator().manual_seed(seed)
    rows = LO + len(ids) * block + 7
    bufs = [torch.randn(1, heads, rows, dim, generator=g).to(dtype) for _ in range(2)]
    src = [torch.randn(n, heads, block, dim, generator=g).to(dtype) for _ in range(2)]
    scales = None
    if store == FP8:
        scales = torch.stack([t.float().abs().amax(dim=(2, 3)) / 448.0 for t in src], dim=1)  # [n, 2, Hkv]
        src = [(t.float() / scales[:, i, :, None, None]).to(FP8) for i, t in enumerate(src)]
    return bufs, src, torch.tensor(ids), scales


def _slots(bufs, n_slots, block):
    """The slot rows of the layer buffers: views `keys[0, :, lo:hi]`, strided (not contiguous)."""
    return [buf[0, :, LO:LO + n_slots * block] for buf in bufs]


@pytest.mark.parametrize("n,heads,block,dim,ids,dtype,store", [
    pytest.param(6, 2, 16, 8, [3, 0, 5, 3], torch.float32, torch.float32, id="n6-H2-block16-D8-fp32"),
    pytest.param(5, 3, 63, 100, [-1, 4, 0, -1, 2], torch.bfloat16, torch.bfloat16, id="n5-H3-block63-D100-bf16"),
    pytest.param(5, 3, 63, 100, [1, -1, -1, 4], torch.bfloat16, FP8, id="n5-H3-block63-D100-fp8-bf16"),
    pytest.param(4, 2, 16, 64, [2, -1, 0], torch.float32, FP8, id="n4-H2-block16-D64-fp8-fp32"),
    pytest.param(3, 2, 16, 8, [-1, -1], torch.float32, torch.float32, id="all-slots-kept"),
])
def test_reference_equals_loop(n, heads, block, dim, ids, dtype, store):
    bufs, src, ids, scales = _case(n, heads, block, dim, ids, dtype, store)
    old = [buf.clone() for buf in bufs]
    want = [buf.clone() for buf in bufs]
    gather_loop(*_slots(want, len(ids), block), *src, ids, scales)
    gather_blocks_reference(*_slots(bufs, len(ids), block), *src, ids, scales)
    for got, exp, before in zip(bufs, want, old):
        assert torch.equal(got, exp)
        # Slots with -1 and the rows around the slots keep their old contents.
        for s, b in enumerate(ids.tolist()):
            rows = slice(LO + s * block, LO + (s + 1) * block)
            assert torch.equal(got[..., rows, :], before[..., rows, :]) == (b < 0)
        assert torch.equal(got[..., :LO, :], before[..., :LO, :])
        assert torch.equal(got[..., LO + len(ids) * block:, :], before[..., LO + len(ids) * block:, :])


def _assert_matches(got, want, store, dtype):
    """Bit-equal, except where Triton's interpreter rounds fp32 to bf16 toward zero (the GPU rounds to nearest
    even): there, within one bf16 unit of the last place."""
    if TRITON_DEVICE == "cpu" and store == FP8 and dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=0.0)
    else:
        assert torch.equal(got, want)


@pytest.mark.triton
@pytest.mark.parametrize("n,heads,block,dim,ids,dtype,store", [
    pytest.param(6, 2, 16, 8, [3, 0, 5, 3], torch.float32, torch.float32, id="n6-H2-block16-D8-fp32"),
    pytest.param(5, 3, 63, 100, [-1, 4, 0, -1, 2], torch.bfloat16, torch.bfloat16, id="n5-H3-block63-D100-bf16"),
    pytest.param(9, 8, 128, 128, [7, -1, 2, 8, 0, -1], torch.bfloat16, torch.bfloat16, id="n9-H8-block128-D128-llama"),
    pytest.param(5, 3, 63, 100, [1, -1, -1, 4], torch.bfloat16, FP8, id="n5-H3-block63-D100-fp8-bf16"),
    pytest.param(4, 2, 16, 64, [2, -1, 0], torch.float32, FP8, id="n4-H2-block16-D64-fp8-fp32"),
])
def test_triton_matches_reference(n, heads, block, dim, ids, dtype, store):
    """Blocks on the kernel's device (CPU tensors under the interpreter), slots a strided view."""
    from kernels.gather_blocks.triton import gather_blocks_triton

    bufs, src, ids, scales = _case(n, heads, block, dim, ids, dtype, store)
    want = [buf.clone() for buf in bufs]
    gather_blocks_reference(*_slots(want, len(ids), block), *src, ids, scales)
    dev = [buf.to(TRITON_DEVICE) for buf in bufs]
    gather_blocks_triton(*_slots(dev, len(ids), block), *[t.to(TRITON_DEVICE) for t in src],
                         ids.to(TRITON_DEVICE), None if scales is None else scales.to(TRITON_DEVICE))
    for got, exp in zip(dev, want):
        _assert_matches(got.cpu(), exp, store, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("store", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(FP8, id="fp8")])
def test_dispatch_reads_pinned_blocks_without_a_sync(store):
    """Pinned host blocks, ids on the GPU: the Triton path, which never waits for the device (the reference's
    nonzero() would, and raises in sync-debug mode)."""
    bufs, src, ids, scales = _case(9, 8, 128, 128, [7, -1, 2, 8, 0, -1], torch.bfloat16, store)
    want = [buf.clone() for buf in bufs]
    gather_blocks_reference(*_slots(want, len(ids), block=128), *src, ids, scales)
    dev = [buf.cuda() for buf in bufs]
    src = [t.pin_memory() for t in src]
    scales = None if scales is None else scales.pin_memory()
    ids = ids.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_blocks(*_slots(dev, len(ids), block=128), *src, ids, scales)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, exp in zip(dev, want):
        assert torch.equal(got.cpu(), exp)


@pytest.mark.gpu
def test_triton_launcher_rejects_pageable_blocks():
    from kernels.gather_blocks.triton import gather_blocks_triton

    bufs, src, ids, _ = _case(3, 2, 16, 8, [0, 2], torch.float32, torch.float32)
    dst = _slots([buf.cuda() for buf in bufs], 2, 16)
    with pytest.raises(ValueError, match=r"expected src_k in pinned host memory or on cuda:\d, got cpu \(not pinned\)"):
        gather_blocks_triton(*dst, *src, ids.cuda())


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.gather_blocks.triton import gather_blocks_triton

    bufs, src, ids, _ = _case(3, 2, 16, 8, [0, -1, 2], torch.float32, torch.float32)
    dst = _slots([buf.to(TRITON_DEVICE) for buf in bufs], 3, 16)
    src = [t.to(TRITON_DEVICE) for t in src]
    ids = ids.to(TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"expected ids of shape \[S\] int64 with S \* 16 = 48"):
        gather_blocks_triton(*dst, *src, ids[:2])
    with pytest.raises(ValueError, match=r"expected ids of shape \[S\] int64"):
        gather_blocks_triton(*dst, *src, ids.int())
    with pytest.raises(ValueError, match=r"expected src_k of shape \[n, 2, block, 8\]"):
        gather_blocks_triton(*dst, src[0][:, :1], src[1], ids)
    with pytest.raises(ValueError, match=r"expected src_k of dtype torch.float32 without scales"):
        gather_blocks_triton(*dst, src[0].bfloat16(), src[1].bfloat16(), ids)
    with pytest.raises(ValueError, match=r"expected scales of shape \[3, 2, 2\] float32 for float8 blocks, got None"):
        gather_blocks_triton(*dst, src[0].to(FP8), src[1].to(FP8), ids)
    with pytest.raises(ValueError, match=r"expected dst_v of shape \[2, 48, 8\] torch.float32"):
        gather_blocks_triton(dst[0], dst[1][:, :32], *src, ids)


def test_dispatch_on_cpu_is_the_reference():
    bufs, src, ids, scales = _case(5, 3, 63, 100, [1, -1, -1, 4], torch.bfloat16, FP8)
    want = [buf.clone() for buf in bufs]
    gather_blocks_reference(*_slots(want, len(ids), 63), *src, ids, scales)
    gather_blocks(*_slots(bufs, len(ids), 63), *src, ids, scales)
    assert all(torch.equal(got, exp) for got, exp in zip(bufs, want))
