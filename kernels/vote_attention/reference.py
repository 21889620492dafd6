"""Reference vote attention: softmax attention of a prefill chunk over unordered rows, plus what each key received.

Defines correctness for the Triton kernels and is the CPU production path. The probabilities are formed
explicitly in fp32, a slice of queries at a time (the [.., t, W] scores are the largest temporaries).
"""

from __future__ import annotations

import torch

QUERY_SLICE = 256  # queries per slice: bounds the [B, Hkv, G, t, W] score tensor


def vote_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_pos: torch.Tensor,
    offset: int,
    *,
    scale: float,
    n_own: int,
    return_lse: bool = False,
    votes: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Attention of T queries over W rows whose positions are in any order, with the probabilities' sums.

    q: [B, Hq, T, D]; k, v: [B, Hkv, W, D] (Hq % Hkv == 0; query head h reads KV head h // (Hq // Hkv));
    key_pos: [W] int64, each row's token position, -1 for an empty row (its K and V may hold anything);
    query i sits at position offset + i and sees row j iff 0 <= key_pos[j] <= offset + i.
    Returns out [B, Hq, T, D] in q's dtype; votes [W] fp32, the probabilities summed over batch, heads and
    queries; own [n_own, n_own] fp32, own[a, c] = the probabilities of query T - n_own + a on row
    W - n_own + c summed over batch and heads (1 <= n_own <= min(T, W)). A query that sees no row gets out 0
    and adds nothing. return_lse: also lse [B, Hq, T] fp32, each query's log-sum-exp of its scaled scores
    (natural log; -inf for a query that sees no row), for merging with attention over other keys. votes=False:
    votes and own are not summed and come back as None.
    """
    B, Hq, T, D = q.shape
    Hkv, W = k.shape[1], k.shape[2]
    own0 = W - n_own
    filled = key_pos >= 0
    k_t = k.float()[:, :, None].transpose(-1, -2)  # [B, Hkv, 1, D, W]
    # An empty row's V is never weighted, but 0 * NaN would still be NaN.
    v = v.float().masked_fill(~filled[:, None], 0.0)[:, :, None]  # [B, Hkv, 1, W, D]
    out = torch.empty_like(q)
    want_votes = votes
    votes = torch.zeros(W, dtype=torch.float32, device=q.device) if want_votes else None
    own = torch.zeros(n_own, n_own, dtype=torch.float32, device=q.device) if want_votes else None
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    # Built once for the chunk's queries [T, W] and sliced, rather than once per query slice.
    seen = filled & (key_pos <= torch.arange(offset, offset + T, device=q.device)[:, None])
    for lo in range(0, T, QUERY_SLICE):
        t = min(QUERY_SLICE, T - lo)
        qs = q[:, :, lo:lo + t].float().view(B, Hkv, Hq // Hkv, t, D)
        # In place: one [.., t, W] temporary per slice.
        s = torch.matmul(qs, k_t).mul_(scale).masked_fill_(~seen[lo:lo + t], float("-inf"))
        lse[:, :, lo:lo + t] = torch.logsumexp(s, dim=-1).view(B, Hq, t)
        p = torch.softmax(s, dim=-1)
        blind = ~seen[lo:lo + t].any(-1)  # [t]: queries with no visible row, whose softmax is NaN
        if blind.any():
            p.masked_fill_(blind[:, None], 0.0)
        out[:, :, lo:lo + t] = torch.matmul(p, v).view(B, Hq, t, D).to(q.dtype)
        if not want_votes:
            continue
        heads = p.sum(dim=(0, 1, 2))  # [t, W]
        votes += heads.sum(dim=0)
        first = max(lo, T - n_own)
        if first < lo + t:
            own[first - (T - n_own):lo + t - (T - n_own)] = heads[first - lo:, own0:]
    return (out, votes, own, lse) if return_lse else (out, votes, own)
