"""Kernels against their references: CPU always (reference vs naive fp64), GPU paths on the device."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import cdiv
from kernels.chunk_attention import chunk_attention
from kernels.chunk_attention.reference import chunk_attention as chunk_reference
from kernels.decode_attention import decode_attention, merge_partials
from kernels.decode_attention.reference import decode_attention as decode_reference
from tests.conftest import TRITON_DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(42)


def make_cache(B, Hkv, S, D, lengths, dtype=torch.float32, device="cpu"):
    """Random K/V [B, Hkv, S, D] with everything at index >= lengths[b] poisoned with NaN."""
    k = torch.randn(B, Hkv, S, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, S, D, dtype=dtype, device=device)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return k, v


def assert_triton_decode_matches_reference(q, k, v, length, **options) -> None:
    """The Triton kernel's output and log-sum-exp against the fp32 reference's, with the same options (window,
    q_first, mask); no NaN (the caches hold NaN past each length)."""
    from kernels.decode_attention.triton import decode_attention_triton

    scale = q.shape[-1] ** -0.5
    out, lse = decode_attention_triton(q, k, v, length, scale=scale, return_lse=True, **options)
    ref, ref_lse = decode_reference(q.float(), k.float(), v.float(), length, scale=scale, return_lse=True, **options)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def naive_decode(q, k, v, lengths, scale, window=None):
    """Per-sequence fp64 attention of the last valid position: (out [B, Hq, D], lse [B, Hq])."""
    B, Hq, D = q.shape
    outs, lses = [], []
    for b, n in enumerate(lengths):
        lo = 0 if window is None else max(0, n - window)
        kb = k[b, :, lo:n].double().repeat_interleave(Hq // k.shape[1], dim=0)  # [Hq, n - lo, D]
        vb = v[b, :, lo:n].double().repeat_interleave(Hq // k.shape[1], dim=0)
        s = torch.einsum("hd,hnd->hn", q[b].double(), kb) * scale
        outs.append(torch.einsum("hn,hnd->hd", s.softmax(-1), vb))
        lses.append(s.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


def naive_chunk(q, k, v, offset, scale, window=None):
    """fp64 causal attention of q [B, Hq, T, D] at positions offset.. over k, v [B, Hkv, offset+T, D]."""
    L = offset + q.shape[2]
    group = q.shape[1] // k.shape[1]
    k = k[:, :, :L].double().repeat_interleave(group, dim=1)
    v = v[:, :, :L].double().repeat_interleave(group, dim=1)
    pos = torch.arange(offset, L)[:, None]
    kv = torch.arange(L)[None, :]
    mask = kv <= pos if window is None else (kv <= pos) & (kv > pos - window)
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


DECODE_CASES = [
    # B, Hq, Hkv, D, S, lengths
    (2, 8, 2, 64, 1000, [1000, 63]),
    (1, 4, 4, 32, 70, [1]),
    (3, 8, 1, 64, 4200, [4097, 1000, 17]),
    (2, 16, 2, 128, 300, [257, 300]),
]


def _case_id(c):
    B, Hq, Hkv, D, S, lengths = c
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-D{D}-S{S}-L{'_'.join(map(str, lengths))}"


@pytest.mark.parametrize("window", [None, 100], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_reference_matches_naive(case, window):
    B, Hq, Hkv, D, S, lengths = case
    q = torch.randn(B, Hq, D)
    k, v = make_cache(B, Hkv, S, D, lengths)
    scale = D**-0.5
    out, lse = decode_attention(q, k, v, torch.tensor(lengths), scale=scale, window=window, return_lse=True)
    ref_out, ref_lse = naive_decode(q, k, v, lengths, scale, window)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 100, 5000], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
def test_decode_cpu_one_query_matches_reference(case, window):
    """The CPU path for one new token (SDPA over the keys it sees) against the reference that defines it."""
    B, Hq, Hkv, D, S, lengths = case
    q = torch.randn(B, Hq, D)
    k, v = make_cache(B, Hkv, S, D, lengths)
    out = decode_attention(q, k, v, torch.tensor(lengths), scale=D**-0.5, window=window)
    ref = decode_reference(q, k, v, torch.tensor(lengths), scale=D**-0.5, window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_decode_reference_bf16_accumulates_in_fp32():
    lengths = [1000, 500]
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    k, v = make_cache(2, 2, 1024, 64, lengths, dtype=torch.bfloat16)
    out = decode_reference(q, k, v, torch.tensor(lengths), scale=0.125)
    ref, _ = naive_decode(q, k, v, lengths, 0.125)
    assert out.dtype == torch.bfloat16
    # Only the final rounding to bf16 separates the two.
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("bounds", [[0], [0, 300], [0, 100, 700]], ids=lambda b: f"shards{len(b)}")
def test_merge_partials_equals_full_attention(bounds):
    lengths = [1000, 250]  # the second sequence leaves the last shards empty
    S, Hq, Hkv, D = 1000, 8, 2, 64
    q = torch.randn(2, Hq, D)
    k, v = make_cache(2, Hkv, S, D, lengths)
    outs, lses = [], []
    for lo, hi in zip(bounds, bounds[1:] + [S]):
        shard_len = torch.tensor(lengths).sub(lo).clamp(0, hi - lo)
        o, s = decode_reference(q, k[:, :, lo:hi], v[:, :, lo:hi], shard_len, scale=0.125, return_lse=True)
        outs.append(o)
        lses.append(s)
    out, lse = merge_partials(outs, lses)
    ref_out, ref_lse = naive_decode(q, k, v, lengths, 0.125)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_merge_partials_all_empty_gives_zero():
    out, lse = merge_partials([torch.full((2, 4), float("nan"))] * 2, [torch.full((2,), -math.inf)] * 2)
    assert torch.equal(out, torch.zeros(2, 4)) and torch.all(lse == -math.inf)


CHUNK_CASES = [
    # B, Hq, Hkv, D, S, offset, T
    (2, 8, 2, 64, 1200, 0, 1000),
    (1, 4, 1, 64, 1200, 1000, 63),
    (2, 4, 4, 32, 700, 300, 257),
]


@pytest.mark.parametrize("window", [None, 100], ids=lambda w: f"W{w}")
@pytest.mark.parametrize(
    "case", CHUNK_CASES, ids=lambda c: "B{}-Hq{}-Hkv{}-D{}-S{}-off{}-T{}".format(*c)
)
def test_chunk_reference_matches_naive(case, window):
    B, Hq, Hkv, D, S, offset, T = case
    q = torch.randn(B, Hq, T, D)
    k, v = make_cache(B, Hkv, S, D, [offset + T] * B)
    out = chunk_attention(q, k, v, offset, scale=D**-0.5, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), naive_chunk(q, k, v, offset, D**-0.5, window), atol=2e-5, rtol=1e-4)


def test_chunk_then_decode_agree():
    """The last query of a chunk and a decode step at the same position are the same attention."""
    q = torch.randn(1, 8, 40, 64)
    k, v = make_cache(1, 2, 200, 64, [140])
    chunk = chunk_reference(q, k, v, 100, scale=0.125, window=50)
    step = decode_reference(q[:, :, -1], k, v, torch.tensor([140]), scale=0.125, window=50)
    torch.testing.assert_close(chunk[:, :, -1], step, atol=1e-5, rtol=1e-5)


def lowp_decode(q, k, v, lengths, scale, window=None):
    """The same attention computed by torch at the inputs' dtype, no upcast: the yardstick for kernel error."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for b, n in enumerate(lengths):
        lo = 0 if window is None else max(0, n - window)
        kb = k[b, :, lo:n].repeat_interleave(group, dim=0)
        vb = v[b, :, lo:n].repeat_interleave(group, dim=0)
        p = (torch.einsum("hd,hnd->hn", q[b], kb) * scale).softmax(-1)
        outs.append(torch.einsum("hn,hnd->hd", p, vb))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("length", [1, 17, 1000, 4097, 32768], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("group", [1, 4, 8], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.gpu
def test_decode_triton_matches_reference(D, group, length, window, dtype):
    from kernels.decode_attention.triton import decode_attention_triton

    Hkv, lengths = 2, [length, max(1, length // 3)]
    S = length + 37  # a buffer that is not a whole number of tiles, with NaN past each length
    q = torch.randn(2, Hkv * group, D, device="cuda", dtype=dtype)
    k, v = make_cache(2, Hkv, S, D, lengths, dtype=dtype, device="cuda")
    length_t = torch.tensor(lengths, device="cuda")
    scale = D**-0.5
    out, lse = decode_attention_triton(q, k, v, length_t, scale=scale, window=window, return_lse=True)
    ref, ref_lse = decode_reference(q.float(), k.float(), v.float(), length_t, scale=scale, window=window,
                                    return_lse=True)
    assert out.dtype == dtype and not out.isnan().any()
    err = (out.float() - ref).abs().max().item()
    torch_err = (lowp_decode(q, k, v, lengths, scale, window).float() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.2e} vs torch {dtype} error {torch_err:.2e}"
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
@pytest.mark.gpu
def test_decode_triton_cuda_graph_follows_length(window):
    B, Hq, Hkv, D, S = 2, 32, 8, 128, 8192
    schedule = [[100, 5000], [7000, 1], [8192, 4097]]
    k, v = make_cache(B, Hkv, S, D, [S, 5000], dtype=torch.bfloat16, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    length = torch.tensor(schedule[0], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        decode_attention(q, k, v, length, scale=D**-0.5, window=window)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, length, scale=D**-0.5, window=window)
    for lengths in schedule:
        length.copy_(torch.tensor(lengths))
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = decode_reference(q.float(), k.float(), v.float(), length, scale=D**-0.5, window=window)
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=1e-2)


@pytest.mark.gpu
def test_decode_triton_int64_offsets():
    """B*Hkv*S*D > 2**31: element offsets of the last sequences overflow int32."""
    from kernels.decode_attention.triton import decode_attention_triton

    B, Hkv, S, D = 17, 8, 131072, 128
    assert B * Hkv * S * D > 2**31
    lengths = [S - 5] * (B - 1) + [S]
    q = torch.randn(B, Hkv, D, device="cuda", dtype=torch.bfloat16)
    k, v = make_cache(B, Hkv, S, D, lengths, dtype=torch.bfloat16, device="cuda")
    v += torch.arange(B, device="cuda").view(B, 1, 1, 1)  # reading another sequence's rows shows up as >= 1
    length = torch.tensor(lengths, device="cuda")
    out = decode_attention_triton(q, k, v, length, scale=D**-0.5)
    ref = decode_reference(q[-2:].float(), k[-2:].float(), v[-2:].float(), length[-2:], scale=D**-0.5)
    torch.testing.assert_close(out[-2:].float(), ref, atol=1e-3, rtol=1e-2)


def lowp_chunk(q, k, v, offset, scale, window=None):
    L = offset + q.shape[2]
    group = q.shape[1] // k.shape[1]
    k = k[:, :, :L].repeat_interleave(group, dim=1)
    v = v[:, :, :L].repeat_interleave(group, dim=1)
    pos = torch.arange(offset, L, device=q.device)[:, None]
    kv = torch.arange(L, device=q.device)[None, :]
    mask = kv <= pos if window is None else (kv <= pos) & (kv > pos - window)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [1000, 4096], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("offset", [0, 4096], ids=lambda o: f"off{o}")
@pytest.mark.parametrize("D", [128, 256], ids=lambda d: f"D{d}")
@pytest.mark.gpu
def test_chunk_flex_matches_reference(D, offset, T, window):
    from kernels.chunk_attention.flex import BLOCK, chunk_attention_flex

    B, Hq, Hkv, S = 1, 8, 2, 8292
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    # Flex's contract: NaN is allowed only in key blocks wholly past the chunk (never read); the rest of the
    # garbage, which shares a block with valid keys, must be finite. Make it large to show it is masked.
    end = offset + T
    k, v = make_cache(B, Hkv, S, D, [end] * B, dtype=torch.bfloat16, device="cuda")
    k[:, :, end : cdiv(end, BLOCK) * BLOCK] = 1e4
    v[:, :, end : cdiv(end, BLOCK) * BLOCK] = 1e4
    out = chunk_attention_flex(q, k, v, offset, scale=D**-0.5, window=window)
    ref = chunk_reference(q.float(), k.float(), v.float(), offset, scale=D**-0.5, window=window)
    assert not out.isnan().any()
    err = (out.float() - ref).abs().max().item()
    torch_err = (lowp_chunk(q, k, v, offset, D**-0.5, window).float() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"flex error {err:.2e} vs torch bf16 error {torch_err:.2e}"


@pytest.mark.parametrize("layout", ["head-major", "seq-major"])
@pytest.mark.parametrize("grain", [16384, 2048, 0], ids=lambda g: f"grain{g}")
@pytest.mark.parametrize("T", [1000, 4096], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("offset", [0, 4096, 5000], ids=lambda o: f"off{o}")
@pytest.mark.parametrize("heads", [(8, 2), (8, 8), (32, 8)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.gpu
def test_chunk_cudnn_split_matches_reference(D, heads, offset, T, grain, layout, monkeypatch):
    """The prefix in one piece (grain 0) or two (grain 2048 at offset 5000: [0, 4096) and [4096, 5000)), over
    head-major buffers and over seq-major ones (the static cache's layout)."""
    import kernels.chunk_attention.cudnn as cudnn
    from kernels.chunk_attention.cudnn import chunk_attention_cudnn

    monkeypatch.setattr(cudnn, "PAST_GRAIN", grain)
    (Hq, Hkv), B, S = heads, 1, 9200
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    end = offset + T
    k, v = make_cache(B, Hkv, S, D, [end] * B, dtype=torch.bfloat16, device="cuda")  # NaN past `end`
    if layout == "seq-major":
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    out = chunk_attention_cudnn(q, k, v, offset, scale=D**-0.5)
    ref = chunk_reference(q.float(), k.float(), v.float(), offset, scale=D**-0.5, window=None)
    assert not out.isnan().any()
    err = (out.float() - ref).abs().max().item()
    torch_err = (lowp_chunk(q, k, v, offset, D**-0.5, None).float() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"cudnn error {err:.2e} vs torch bf16 error {torch_err:.2e}"


@pytest.mark.parametrize("T", [1, 13, 38, 64, 65, 100, 127, 128, 129, 200, 300], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
@pytest.mark.gpu
def test_chunk_dispatch_gemma_shape_any_chunk_length(window, T):
    """The dispatcher on Gemma 3's shape (head_dim 256) for the chunk lengths a question tail produces."""
    offset, S = 1000, 1500
    q = torch.randn(1, 4, T, 256, device="cuda", dtype=torch.bfloat16)
    k, v = make_cache(1, 1, S, 256, [offset + T], dtype=torch.bfloat16, device="cuda")
    # FlexAttention needs finite values past the valid prefix (see flex.py); zeros, as the engine's cache.
    k[:, :, offset + T:] = 0
    v[:, :, offset + T:] = 0
    out = chunk_attention(q, k, v, offset, scale=256**-0.5, window=window)
    ref = chunk_reference(q.float(), k.float(), v.float(), offset, scale=256**-0.5, window=window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def naive_queries(q, k, v, first, scale, window=None):
    """fp64 attention of q [B, Hq, T, D] at positions first.. over keys [0, first + T) (causal, window)."""
    T = q.shape[2]
    group = q.shape[1] // k.shape[1]
    kk = k[:, :, :first + T].double().repeat_interleave(group, dim=1)
    vv = v[:, :, :first + T].double().repeat_interleave(group, dim=1)
    pos = torch.arange(first, first + T)[:, None]
    kv = torch.arange(first + T)[None, :]
    mask = (kv <= pos) if window is None else (kv <= pos) & (kv > pos - window)
    s = (q.double() @ kk.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ vv, s.logsumexp(-1)


SHARDS = [[0, 1000], [0, 300, 1000], [0, 17, 600, 611, 1000], [0, 999, 1000]]


@pytest.mark.parametrize("window", [None, 100], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("T", [1, 5], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("bounds", SHARDS, ids=lambda b: f"shards{len(b) - 1}-" + "_".join(map(str, b[1:-1])))
def test_shard_attention_merged_equals_full(bounds, T, window):
    """Star's phase 2: each shard of positions [lo, hi) attends on its own (q_first = the queries' index in the
    shard, so a shard before the queries is seen whole), the last shard holds the queries' own K/V; the
    log-sum-exp merge equals attention over the concatenated KV."""
    B, Hq, Hkv, D = 1, 8, 2, 64
    first = bounds[-1] - T  # the queries are the last T positions; the last shard ends with them
    q = torch.randn(B, Hq, T, D)
    k, v = make_cache(B, Hkv, bounds[-1] + 8, D, [bounds[-1]])
    outs, lses = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        ks, vs = k[:, :, lo:hi].clone(), v[:, :, lo:hi].clone()
        # Each rank's buffer has room past its shard: poison it.
        ks = torch.cat([ks, torch.full_like(ks[:, :, :4], float("nan"))], dim=2)
        vs = torch.cat([vs, torch.full_like(vs[:, :, :4], float("nan"))], dim=2)
        o, s = decode_attention(q, ks, vs, torch.tensor([hi - lo]), scale=0.125, window=window, return_lse=True,
                                q_first=torch.tensor([first - lo]))
        outs.append(o)
        lses.append(s)
    out, lse = merge_partials(outs, lses)
    ref_out, ref_lse = naive_queries(q, k, v, first, 0.125, window)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)


def test_q_first_past_a_window_gives_an_empty_shard():
    q = torch.randn(1, 4, 3, 32)
    k, v = make_cache(1, 1, 64, 32, [64])
    out, lse = decode_attention(q, k, v, torch.tensor([64]), scale=0.2, window=10, return_lse=True,
                                q_first=torch.tensor([200]))
    assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == -math.inf)


@pytest.mark.parametrize("window", [None, 512], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("first", [5000, 5300, 9000], ids=lambda f: f"first{f}")
@pytest.mark.parametrize("T", [1, 12], ids=lambda t: f"T{t}")
@pytest.mark.gpu
def test_decode_triton_q_first_matches_reference(T, first, window):
    """A context shard (keys [0, 5000)) seen by queries at later indices, as star's context ranks do."""
    B, Hq, Hkv, D, n = 1, 32, 8, 128, 5000
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = make_cache(B, Hkv, n + 100, D, [n], dtype=torch.bfloat16, device="cuda")
    length, q_first = torch.tensor([n], device="cuda"), torch.tensor([first], device="cuda")
    assert_triton_decode_matches_reference(q, k, v, length, window=window, q_first=q_first)


@pytest.mark.parametrize("T", [17, 32, 33], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("shape", [(32, 8, 128), (4, 1, 256), (8, 8, 64)], ids=lambda s: "Hq{}-Hkv{}-D{}".format(*s))
@pytest.mark.gpu
def test_decode_triton_many_rows_matches_reference(shape, T):
    """Rectification's shape: G x T query rows per KV head over the many-rows launch config (128 rows a program
    at head_dim <= 128, 64 at 256; a partial last program at T 33), causal among the new tokens."""
    Hq, Hkv, D = shape
    n = 3001
    q = torch.randn(1, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = make_cache(1, Hkv, n + 50, D, [n], dtype=torch.bfloat16, device="cuda")
    length = torch.tensor([n], device="cuda")
    assert_triton_decode_matches_reference(q, k, v, length)


# The first query's position one before, at and one past a 64- and a 128-key tile's edge; and queries at 5000 over
# a context shard of 1000 keys (star's context ranks: q_first past the length).
@pytest.mark.parametrize("first,shard", [(4094, None), (4095, None), (4096, None), (5000, 1000)],
                         ids=["first4094", "first4095", "first4096", "first5000-shard1000"])
@pytest.mark.parametrize("group", [2, 4], ids=lambda g: f"G{g}")
@pytest.mark.triton
def test_decode_triton_unmasked_whole_tiles_stop_at_the_first_query(first, shard, group):
    """Several query tokens: whole tiles of keys below the first query's position run without masks. Each row
    stays causal at its own position, and no key at or past a length (NaN there) reaches the result."""
    device = TRITON_DEVICE
    T, Hkv, D = 32, 2, 64
    n = first + T if shard is None else shard
    q = torch.randn(1, Hkv * group, T, D, device=device, dtype=torch.float16)
    k, v = make_cache(1, Hkv, n + 77, D, [n], dtype=torch.float16, device=device)
    # Keys past the first query carry large values: one seen a row too early moves that row's output by ~0.2.
    v[:, :, first + 1:n] = 1000.0
    length = torch.tensor([n], device=device)
    q_first = None if shard is None else torch.tensor([first], device=device)
    assert_triton_decode_matches_reference(q, k, v, length, q_first=q_first)


def test_key_mask_equals_attention_over_the_kept_keys():
    """sas-pattern's compacted cache: a per-head key mask equals attention over only the kept keys."""
    B, Hq, Hkv, D, S = 1, 8, 2, 64, 300
    q = torch.randn(B, Hq, D)
    k, v = make_cache(B, Hkv, S, D, [S])
    keep = torch.rand(B, Hkv, S) < 0.3
    out = decode_reference(q, k, v, torch.tensor([S]), scale=D**-0.5, mask=keep)
    for h in range(Hkv):
        idx = keep[0, h].nonzero()[:, 0]
        sub_k, sub_v = k[:, h:h + 1, idx], v[:, h:h + 1, idx]
        heads = slice(h * Hq // Hkv, (h + 1) * Hq // Hkv)
        want = decode_reference(q[:, heads], sub_k, sub_v, torch.tensor([idx.numel()]), scale=D**-0.5)
        torch.testing.assert_close(out[:, heads], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("S", [63, 1056, 4097], ids=lambda s: f"S{s}")
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (4, 1)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("D", [128, 256], ids=lambda d: f"D{d}")
@pytest.mark.gpu
def test_decode_triton_key_mask_matches_reference(D, heads, S):
    Hq, Hkv = heads
    q = torch.randn(1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = make_cache(1, Hkv, S, D, [S], dtype=torch.bfloat16, device="cuda")
    keep = torch.rand(1, Hkv, S, device="cuda") < 0.5
    keep[:, 0, :] = False  # a head that sees nothing: out 0, lse -inf
    length = torch.tensor([S], device="cuda")
    assert_triton_decode_matches_reference(q, k, v, length, mask=keep)


def test_flex_compiles_only_where_it_pays():
    """Windowed layers compile FlexAttention only for documents with enough windowed attention: the embedded
    model's 15 windowed layers at 8K tokens do not; at 1M tokens, or 32 heads with a 4,096 window at 32K, do."""
    from kernels.chunk_attention import windowed_compile_pays

    assert not windowed_compile_pays(15, 4, 256, 512, 8192, 2048)
    assert windowed_compile_pays(15, 4, 256, 512, 1 << 20, 2048)
    assert windowed_compile_pays(32, 32, 128, 4096, 32768, 2048)


@pytest.mark.parametrize("T, offset", [(2048, 8192), (1000, 9000), (300, 0)], ids=["T2048", "T1000", "T300-start"])
@pytest.mark.gpu
def test_windowed_chunk_without_compilation_matches_flex(T, offset):
    """The uncompiled windowed path (SDPA with the band mask) against FlexAttention and the fp32 reference."""
    torch.manual_seed(42)
    q = torch.randn(1, 4, T, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, offset + T + 64, 256, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = chunk_reference(q.float(), k.float(), v.float(), offset, scale=256**-0.5, window=512)
    plain = chunk_attention(q, k, v, offset, scale=256**-0.5, window=512, compiled=False)
    flex = chunk_attention(q, k, v, offset, scale=256**-0.5, window=512)
    assert (plain.float() - ref).abs().max() <= 2 * (flex.float() - ref).abs().max() + 1e-3
