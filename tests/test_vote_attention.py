"""vote_attention: attention over unordered rows with per-key votes and the chunk's own map.

CPU tests pin the reference down against a plain dense softmax; `triton` tests hold the Triton kernels to the
reference (on the device; `TRITON_INTERPRET=1 pytest -m triton tests/test_vote_attention.py` runs the small
cases on CPU through Triton's interpreter, the model-sized ones only on CUDA).
"""

from __future__ import annotations

import re

import pytest
import torch

from kernels.vote_attention import vote_attention, vote_attention_reference
from tests.conftest import CUDA, TRITON_DEVICE

DEVICE = TRITON_DEVICE
OFFSET = 9000  # positions of older rows lie below it: room for W - T older rows at the largest shapes


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(42)


def make_rows(B, Hkv, T, W, D, empty=0.2, dtype=torch.float32, device="cpu", layout="ltri"):
    """K, V [B, Hkv, W, D] (views of a row buffer with NaN past W and in empty rows) and key_pos [W].

    layout "ltri": W - T older rows in shuffled order (a share `empty` of them -1), then the chunk's own T rows
    at OFFSET..; "shuffled": every row an older position or the chunk's, in any order; "old": every row older
    than the chunk (each query sees all of them)."""
    older = torch.randperm(OFFSET)
    if layout == "old":
        key_pos = older[:W]
    else:
        key_pos = torch.cat([older[:W - T], torch.arange(OFFSET, OFFSET + T)])
        if layout == "shuffled":
            key_pos = key_pos[torch.randperm(W)]
    n_empty = int(empty * (W - T if layout == "ltri" else W))
    gaps = torch.randperm(W - T if layout == "ltri" else W)[:n_empty]
    key_pos[gaps] = -1
    buf_k = torch.full((B, Hkv, W + 29, D), float("nan"), dtype=dtype)
    buf_v = torch.full_like(buf_k, float("nan"))
    filled = key_pos >= 0
    buf_k[:, :, :W][:, :, filled] = torch.randn(B, Hkv, int(filled.sum()), D, dtype=dtype)
    buf_v[:, :, :W][:, :, filled] = torch.randn(B, Hkv, int(filled.sum()), D, dtype=dtype)
    buf_k, buf_v = buf_k.to(device), buf_v.to(device)
    return buf_k[:, :, :W], buf_v[:, :, :W], key_pos.to(device)


def make_queries(B, Hq, T, D, dtype=torch.float32, device="cpu"):
    """q [B, Hq, T, D] as the model hands it over: a transposed view of [B, T, Hq, D]."""
    return torch.randn(B, T, Hq, D, dtype=dtype, device=device).transpose(1, 2)


def dense(q, k, v, key_pos, offset, scale, n_own, dtype=torch.float64):
    """The whole [B, Hq, T, W] softmax at once, at `dtype`: (out, votes, own)."""
    B, Hq, T, D = q.shape
    group = Hq // k.shape[1]
    seen = (key_pos >= 0) & (key_pos <= offset + torch.arange(T, device=q.device)[:, None])  # [T, W]
    k = k.to(dtype).nan_to_num(0.0).repeat_interleave(group, dim=1)
    v = v.to(dtype).nan_to_num(0.0).repeat_interleave(group, dim=1)
    s = (q.to(dtype) @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    p = s.softmax(-1).nan_to_num(0.0)  # a query that sees nothing: all NaN -> 0
    W = k.shape[2]
    return p @ v, p.sum(dim=(0, 1, 2)), p.sum(dim=(0, 1))[T - n_own:, W - n_own:]


CPU_CASES = [
    # B, Hq, Hkv, T, W, D, n_own, layout
    pytest.param(1, 2, 2, 40, 100, 16, 40, "ltri", id="B1-Hq2-Hkv2-T40-W100-D16-own40"),
    pytest.param(2, 4, 2, 33, 80, 32, 10, "shuffled", id="B2-Hq4-Hkv2-T33-W80-D32-own10-shuffled"),
    pytest.param(1, 7, 1, 50, 120, 64, 25, "ltri", id="B1-Hq7-Hkv1-T50-W120-D64-own25"),
    pytest.param(1, 4, 2, 300, 400, 16, 128, "ltri", id="B1-Hq4-Hkv2-T300-W400-D16-own128"),
]


@pytest.mark.parametrize("B,Hq,Hkv,T,W,D,n_own,layout", CPU_CASES)
def test_reference_matches_dense(B, Hq, Hkv, T, W, D, n_own, layout):
    q = make_queries(B, Hq, T, D)
    k, v, key_pos = make_rows(B, Hkv, T, W, D, layout=layout)
    out, votes, own = vote_attention_reference(q, k, v, key_pos, OFFSET, scale=D**-0.5, n_own=n_own)
    ref_out, ref_votes, ref_own = dense(q, k, v, key_pos, OFFSET, D**-0.5, n_own)
    assert out.dtype == q.dtype and votes.dtype == own.dtype == torch.float32
    assert votes.shape == (W,) and own.shape == (n_own, n_own)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(votes.double(), ref_votes, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(own.double(), ref_own, atol=1e-5, rtol=1e-5)
    # Each query's probabilities sum to one; empty rows receive nothing.
    assert abs(votes.sum().item() - B * Hq * T) < 1e-3 * B * Hq * T
    assert (votes[key_pos < 0] == 0).all()


def dense_lse(q, k, key_pos, offset, scale):
    """Each query's log-sum-exp [B, Hq, T] (fp64) of its visible scaled scores; -inf where it sees nothing."""
    T = q.shape[2]
    seen = (key_pos >= 0) & (key_pos <= offset + torch.arange(T, device=q.device)[:, None])
    k = k.double().nan_to_num(0.0).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def test_reference_lse_matches_dense():
    q = make_queries(1, 4, 20, 16)
    k, v, key_pos = blind_rows(1, 2, 20, 30, 16, blind=5)
    out, votes, own, lse = vote_attention_reference(q, k, v, key_pos, OFFSET, scale=0.25, n_own=20, return_lse=True)
    want = dense_lse(q, k, key_pos, OFFSET, 0.25)
    assert lse.shape == (1, 4, 20) and lse.dtype == torch.float32 and (lse[:, :, :5] == float("-inf")).all()
    torch.testing.assert_close(lse[:, :, 5:].double(), want[:, :, 5:], atol=1e-5, rtol=1e-5)
    assert torch.equal(out, vote_attention_reference(q, k, v, key_pos, OFFSET, scale=0.25, n_own=20)[0])


def test_reference_without_votes_is_the_same_attention():
    """votes=False: the same output and lse, no votes or own map."""
    q = make_queries(1, 4, 20, 16)
    k, v, key_pos = blind_rows(1, 2, 20, 30, 16, blind=5)
    full = vote_attention_reference(q, k, v, key_pos, OFFSET, scale=0.25, n_own=20, return_lse=True)
    out, votes, own, lse = vote_attention(q, k, v, key_pos, OFFSET, scale=0.25, n_own=20, return_lse=True,
                                          votes=False)
    assert votes is None and own is None
    assert torch.equal(out, full[0]) and torch.equal(lse, full[3])


def blind_rows(B, Hkv, T, W, D, blind, dtype=torch.float32, device="cpu"):
    """Rows whose positions all follow the chunk's first `blind` queries: those queries see nothing."""
    k, v, _ = make_rows(B, Hkv, T, W, D, empty=0.0, dtype=dtype, device=device)
    key_pos = torch.arange(OFFSET + blind, OFFSET + blind + W, device=device)
    return k, v, key_pos


def test_reference_query_that_sees_nothing_gives_zero():
    q = make_queries(1, 4, 20, 16)
    k, v, key_pos = blind_rows(1, 2, 20, 30, 16, blind=5)
    out, votes, own = vote_attention(q, k, v, key_pos, OFFSET, scale=0.25, n_own=20)
    ref_out, ref_votes, ref_own = dense(q, k, v, key_pos, OFFSET, 0.25, 20)
    assert not out.isnan().any() and (out[:, :, :5] == 0).all() and (own[:5] == 0).all()
    assert abs(votes.sum().item() - 4 * 15) < 1e-3
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(votes.double(), ref_votes, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own.double(), ref_own, atol=1e-5, rtol=1e-5)


# ---- Triton kernels against the reference (device; or the interpreter) ----

CUDA_ONLY = pytest.mark.skipif(not CUDA, reason="model-sized: CUDA only (too slow for the interpreter)")

TRITON_CASES = [
    # B, Hq, Hkv, T, W, D, n_own, empty share, layout
    pytest.param(1, 32, 8, 512, 6784, 128, 512, 0.1, "ltri", id="B1-Hq32-Hkv8-T512-W6784-D128", marks=CUDA_ONLY),
    pytest.param(1, 32, 8, 512, 4097, 128, 300, 0.1, "ltri", id="B1-Hq32-Hkv8-T512-W4097-D128-own300",
                 marks=CUDA_ONLY),
    pytest.param(1, 32, 8, 512, 1000, 128, 512, 0.0, "ltri", id="B1-Hq32-Hkv8-T512-W1000-D128", marks=CUDA_ONLY),
    pytest.param(1, 14, 2, 512, 6784, 64, 512, 0.1, "ltri", id="B1-Hq14-Hkv2-T512-W6784-D64", marks=CUDA_ONLY),
    pytest.param(1, 14, 2, 512, 1000, 64, 77, 0.3, "shuffled", id="B1-Hq14-Hkv2-T512-W1000-D64-own77-shuffled",
                 marks=CUDA_ONLY),
    pytest.param(1, 4, 1, 512, 6784, 256, 512, 0.1, "ltri", id="B1-Hq4-Hkv1-T512-W6784-D256", marks=CUDA_ONLY),
    pytest.param(1, 4, 1, 512, 4097, 256, 511, 0.1, "ltri", id="B1-Hq4-Hkv1-T512-W4097-D256-own511",
                 marks=CUDA_ONLY),
    pytest.param(2, 32, 8, 512, 4097, 128, 512, 0.1, "ltri", id="B2-Hq32-Hkv8-T512-W4097-D128", marks=CUDA_ONLY),
    pytest.param(1, 4, 2, 63, 200, 64, 63, 0.1, "ltri", id="B1-Hq4-Hkv2-T63-W200-D64"),
    pytest.param(1, 7, 1, 40, 150, 64, 17, 0.1, "shuffled", id="B1-Hq7-Hkv1-T40-W150-D64-own17-shuffled"),
    pytest.param(2, 8, 2, 33, 130, 128, 9, 0.1, "ltri", id="B2-Hq8-Hkv2-T33-W130-D128-own9"),
    pytest.param(1, 4, 1, 40, 90, 256, 40, 0.1, "ltri", id="B1-Hq4-Hkv1-T40-W90-D256"),
    pytest.param(1, 4, 2, 50, 300, 64, 20, 0.9, "ltri", id="B1-Hq4-Hkv2-T50-W300-D64-own20-empty90"),
    pytest.param(1, 4, 1, 48, 100, 128, 48, 0.0, "old", id="B1-Hq4-Hkv1-T48-W100-D128-all-visible"),
]


def _lowp_dtype():
    # Triton's interpreter has no bfloat16.
    return torch.bfloat16 if CUDA else torch.float16


def _check(q, k, v, key_pos, n_own, got):
    """flash-attention's rule for out (error against fp32 at most twice torch's at the input dtype); votes
    and own against the fp32 reference."""
    D = q.shape[-1]
    out, votes, own = got
    ref_out, ref_votes, ref_own = vote_attention_reference(q.float(), k.float(), v.float(), key_pos, OFFSET,
                                                           scale=D**-0.5, n_own=n_own)
    assert out.dtype == q.dtype and out.shape == q.shape and not out.isnan().any()
    err = (out.float() - ref_out).abs().max().item()
    if q.dtype == torch.float32:
        torch_err = 0.0
    else:
        torch_err = (dense(q, k, v, key_pos, OFFSET, D**-0.5, n_own, dtype=q.dtype)[0].float() - ref_out)
        torch_err = torch_err.abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.2e} vs torch {q.dtype} error {torch_err:.2e}"
    # Same inputs, same fp32 scores up to summation order: the probabilities agree closely.
    torch.testing.assert_close(votes, ref_votes, atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(own, ref_own, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("B,Hq,Hkv,T,W,D,n_own,empty,layout", TRITON_CASES)
@pytest.mark.triton
def test_triton_matches_reference(B, Hq, Hkv, T, W, D, n_own, empty, layout):
    from kernels.vote_attention.triton import vote_attention_triton

    dtype = _lowp_dtype()
    q = make_queries(B, Hq, T, D, dtype=dtype, device=DEVICE)
    k, v, key_pos = make_rows(B, Hkv, T, W, D, empty=empty, dtype=dtype, device=DEVICE, layout=layout)
    got = vote_attention_triton(q, k, v, key_pos, OFFSET, scale=D**-0.5, n_own=n_own)
    _check(q, k, v, key_pos, n_own, got)


@pytest.mark.triton
def test_triton_fp32_matches_reference():
    from kernels.vote_attention.triton import vote_attention_triton

    q = make_queries(1, 6, 37, 64, device=DEVICE)
    k, v, key_pos = make_rows(1, 2, 37, 110, 64, device=DEVICE)
    _check(q, k, v, key_pos, 30, vote_attention_triton(q, k, v, key_pos, OFFSET, scale=0.125, n_own=30))


@pytest.mark.triton
def test_triton_query_that_sees_nothing_gives_zero():
    from kernels.vote_attention.triton import vote_attention_triton

    dtype = _lowp_dtype()
    q = make_queries(1, 4, 20, 64, dtype=dtype, device=DEVICE)
    k, v, key_pos = blind_rows(1, 2, 20, 70, 64, blind=5, dtype=dtype, device=DEVICE)
    out, votes, own = got = vote_attention_triton(q, k, v, key_pos, OFFSET, scale=0.125, n_own=20)
    assert (out[:, :, :5] == 0).all() and (own[:5] == 0).all()
    _check(q, k, v, key_pos, 20, got)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", ["low", "fp32"])
def test_triton_lse_matches_reference(dtype):
    """lse (natural log) for merging with attention over other keys; -inf for a query that sees nothing."""
    from kernels.vote_attention.triton import vote_attention_triton

    dtype = _lowp_dtype() if dtype == "low" else torch.float32
    q = make_queries(1, 14, 40, 64, dtype=dtype, device=DEVICE)
    k, v, key_pos = blind_rows(1, 2, 40, 150, 64, blind=5, dtype=dtype, device=DEVICE)
    *got, lse = vote_attention_triton(q, k, v, key_pos, OFFSET, scale=0.125, n_own=30, return_lse=True)
    _check(q, k, v, key_pos, 30, tuple(got))
    want = dense_lse(q, k, key_pos, OFFSET, 0.125)
    assert lse.shape == (1, 14, 40) and (lse[:, :, :5] == float("-inf")).all()
    torch.testing.assert_close(lse[:, :, 5:].double(), want[:, :, 5:], atol=2e-3 if dtype != torch.float32 else 1e-4,
                               rtol=1e-3)


@pytest.mark.triton
def test_triton_without_votes_launches_the_attention_alone():
    """votes=False: the first pass's output and lse, bit for bit, and no votes or own map."""
    from kernels.vote_attention.triton import vote_attention_triton

    dtype = _lowp_dtype()
    q = make_queries(1, 14, 40, 64, dtype=dtype, device=DEVICE)
    k, v, key_pos = make_rows(1, 2, 40, 150, 64, dtype=dtype, device=DEVICE)
    full = vote_attention_triton(q, k, v, key_pos, OFFSET, scale=0.125, n_own=30, return_lse=True)
    out, votes, own, lse = vote_attention_triton(q, k, v, key_pos, OFFSET, scale=0.125, n_own=30, return_lse=True,
                                                 votes=False)
    assert votes is None and own is None
    assert torch.equal(out, full[0]) and torch.equal(lse, full[3])
    plain = vote_attention_triton(q, k, v, key_pos, OFFSET, scale=0.125, n_own=30, votes=False)
    assert len(plain) == 3 and torch.equal(plain[0], out)


@pytest.mark.parametrize("change,message", [
    (lambda a: {**a, "q": a["q"][0]}, "expected q of shape [B, Hq, T, D]"),
    (lambda a: {**a, "k": a["k"][:, :1].expand(1, 3, -1, -1), "v": a["v"][:, :1].expand(1, 3, -1, -1)},
     "expected Hq (4) to be a multiple of Hkv (3)"),
    (lambda a: {**a, "v": a["v"][:, :, :-1]}, "expected v of shape"),
    (lambda a: {**a, "key_pos": a["key_pos"].int()}, "expected key_pos of shape [40] int64"),
    (lambda a: {**a, "k": a["k"].half()}, "expected k and v in torch.float32"),
    (lambda a: {**a, "n_own": 21}, "expected 1 <= n_own <= min(T, W) = 20"),
    (lambda a: {**a, "q": a["q"][..., :24], "k": a["k"][..., :24], "v": a["v"][..., :24]},
     "expected head_dim a power of two"),
], ids=["q-3d", "heads", "v-shape", "key_pos-int32", "dtype", "n_own", "head_dim"])
@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs(change, message):
    from kernels.vote_attention.triton import vote_attention_triton

    q = make_queries(1, 4, 20, 32, device=DEVICE)
    k, v, key_pos = make_rows(1, 2, 20, 40, 32, device=DEVICE)
    args = change({"q": q, "k": k, "v": v, "key_pos": key_pos, "n_own": 20})
    with pytest.raises(ValueError, match=re.escape(message)):
        vote_attention_triton(args["q"], args["k"], args["v"], args["key_pos"], OFFSET, scale=0.1,
                              n_own=args["n_own"])
