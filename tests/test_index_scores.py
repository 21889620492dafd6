"""index_scores: ltri-stream's block scores from its index vectors.

The reference is held to a per-block Python definition on CPU; `triton` tests hold the Triton kernel to the
reference (on CUDA, or on CPU through Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch

from kernels.index_scores import index_scores, index_scores_reference
from tests.conftest import TRITON_DEVICE


def brute(query, vectors, block, offset, n_blocks, chosen):
    """Block by block in plain Python: the best q . v over chosen queries and the block's vectors (summed over
    heads), the largest offset among equal bests."""
    scores, where = [], []
    for b in range(n_blocks):
        best, at = float("-inf"), -1
        for n in (block == b).nonzero().flatten().tolist():
            s = max(((query[a].double() * vectors[n].double()).sum().item() for a in range(query.shape[0])
                     if chosen is None or chosen[a]), default=float("-inf"))
            if s > best or (s == best and offset[n].item() > at):
                best, at = s, offset[n].item()
        scores.append(best)
        where.append(at)
    return torch.tensor(scores, dtype=torch.float64), torch.tensor(where)


def _case(A, N, heads, dim, n_blocks, dtype=torch.float32, seed=42, unchosen=0.3, skipped=0.1):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(A, heads, dim, generator=g)
    vectors = torch.randn(N, heads, dim, generator=g).to(dtype)
    # Every other block id at most, so that some blocks have no vector; offsets as in a 128-token block.
    block = torch.randint(0, max(1, n_blocks // 2), (N,), generator=g) * 2
    offset = torch.randint(0, 128, (N,), generator=g)
    # Entries that hold no vector (block -1: a slot whose range had no row left), scaled up so that one counted by
    # mistake would win its block; their offsets as the picks leave them (-1).
    gone = torch.rand(N, generator=g) < skipped
    block[gone], offset[gone] = -1, -1
    vectors[gone] *= 100
    chosen = torch.rand(A, generator=g) >= unchosen
    return query, vectors, block, offset, chosen


def test_reference_equals_brute_force_with_ties_and_empty_blocks():
    query, vectors, block, offset, chosen = _case(6, 30, 2, 4, 10)
    # A tie inside block 0: the same vector twice at offsets 3 and 9; the larger offset reports it.
    vectors[1], block[:2], offset[:2] = vectors[0], 0, torch.tensor([9, 3])
    scores, where = index_scores_reference(query, vectors, block, offset, 10, chosen)
    want_scores, want_where = brute(query, vectors, block, offset, 10, chosen)
    torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-5)
    assert where.tolist() == want_where.tolist()
    assert where[1].item() == -1 and scores[1].item() == float("-inf")  # odd blocks hold no vector
    none = index_scores_reference(query, vectors, block, offset, 10, torch.zeros(6, dtype=torch.bool))
    assert (none[0] == float("-inf")).all()
    assert none[1].tolist() == brute(query, vectors, block, offset, 10, torch.zeros(6, dtype=torch.bool))[1].tolist()


@pytest.mark.triton
@pytest.mark.parametrize("A,N,heads,dim,n_blocks,dtype,with_chosen", [
    pytest.param(5, 40, 1, 16, 8, torch.float32, True, id="A5-N40-H1-D16"),
    pytest.param(33, 63, 2, 64, 20, torch.float32, False, id="A33-N63-H2-D64-qwen-all"),
    pytest.param(70, 1000, 1, 256, 97, torch.bfloat16, True, id="A70-N1000-H1-D256-gemma"),
    pytest.param(192, 4097, 8, 128, 1000, torch.bfloat16, True, id="A192-N4097-H8-D128-llama"),
])
def test_triton_matches_reference(A, N, heads, dim, n_blocks, dtype, with_chosen):
    from kernels.index_scores.triton import index_scores_triton

    if TRITON_DEVICE == "cpu" and A * N * heads * dim > 2e7:
        pytest.skip("model-sized case: CUDA only (the interpreter takes minutes)")
    query, vectors, block, offset, chosen = _case(A, N, heads, dim, n_blocks, dtype)
    chosen = chosen if with_chosen else None
    want_scores, want_where = index_scores_reference(query, vectors, block, offset, n_blocks, chosen)
    dev = [t.to(TRITON_DEVICE) if t is not None else None for t in (query, vectors, block, offset, chosen)]
    scores, where = index_scores_triton(*dev[:4], n_blocks, dev[4])
    torch.testing.assert_close(scores.cpu(), want_scores, rtol=1e-5, atol=1e-4)
    assert torch.equal(where.cpu(), want_where)


@pytest.mark.triton
def test_triton_ties_unchosen_queries_and_an_empty_index():
    from kernels.index_scores.triton import index_scores_triton

    query, vectors, block, offset, chosen = (t.to(TRITON_DEVICE) for t in _case(6, 30, 2, 4, 10))
    vectors[1], block[:2] = vectors[0], 0
    offset[:2] = torch.tensor([9, 3], device=TRITON_DEVICE)
    for picked in (chosen, torch.zeros_like(chosen)):
        got = index_scores_triton(query, vectors, block, offset, 10, picked)
        want = index_scores_reference(query.cpu(), vectors.cpu(), block.cpu(), offset.cpu(), 10, picked.cpu())
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-5, atol=1e-5)
        assert got[1].cpu().tolist() == want[1].tolist()
    scores, where = index_scores_triton(query, vectors[:0], block[:0], offset[:0], 4, chosen)
    assert (scores.cpu() == float("-inf")).all() and (where.cpu() == -1).all()


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.index_scores.triton import index_scores_triton

    query, vectors, block, offset, chosen = (t.to(TRITON_DEVICE) for t in _case(4, 10, 2, 8, 6))
    with pytest.raises(ValueError, match=r"expected query \[A, Hkv, D\] and vectors \[N, Hkv, D\]"):
        index_scores_triton(query[:, :1], vectors, block, offset, 6, chosen)
    with pytest.raises(ValueError, match=r"expected block of shape \[10\] int64"):
        index_scores_triton(query, vectors, block.int(), offset, 6, chosen)
    with pytest.raises(ValueError, match=r"expected chosen of shape \[4\] bool"):
        index_scores_triton(query, vectors, block, offset, 6, chosen[:3])
    with pytest.raises(ValueError, match=r"expected vectors with dense \[Hkv, D\] rows"):
        index_scores_triton(query, vectors.transpose(1, 2).contiguous().transpose(1, 2), block, offset, 6, chosen)


def test_dispatch_on_cpu_is_the_reference():
    query, vectors, block, offset, chosen = _case(7, 50, 2, 8, 12)
    got = index_scores(query, vectors, block, offset, 12, chosen)
    want = index_scores_reference(query, vectors, block, offset, 12, chosen)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.triton
def test_triton_keeps_every_bit_of_an_fp32_query_against_bf16_vectors():
    """Queries that differ only in their lowest bits (1 + 2**-9 + k * 2**-20: a bf16 part, a second one and a third)
    against bf16 vectors of ones: each block's score is exactly 16 times its best query, as in fp32, so the kernel's
    split of the query into three bf16 parts loses nothing (two parts would round the k away)."""
    from kernels.index_scores.triton import index_scores_triton

    dim, n_blocks = 16, 4
    k = torch.arange(1, 16, dtype=torch.float64)
    query = (1 + 2.0**-9 + k * 2.0**-20).float()[:, None, None].expand(-1, 1, dim).contiguous()  # [15, 1, 16]
    vectors = torch.ones(n_blocks, 1, dim, dtype=torch.bfloat16)
    block, offset = torch.arange(n_blocks), torch.zeros(n_blocks, dtype=torch.long)
    want = 16 * (1 + 2.0**-9 + 15 * 2.0**-20)
    ref, _ = index_scores_reference(query, vectors, block, offset, n_blocks)
    dev = [t.to(TRITON_DEVICE) for t in (query, vectors, block, offset)]
    got, where = index_scores_triton(*dev, n_blocks)
    assert ref.tolist() == [want] * n_blocks
    assert got.cpu().tolist() == [want] * n_blocks and where.cpu().tolist() == [0] * n_blocks
    for top in (9, 4, 1):  # only the queries up to k = top counted: the scores follow the low bits
        got, _ = index_scores_triton(*dev, n_blocks, (k <= top).to(TRITON_DEVICE))
        assert got.cpu().tolist() == [16 * (1 + 2.0**-9 + top * 2.0**-20)] * n_blocks
