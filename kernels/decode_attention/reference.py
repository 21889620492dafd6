"""Reference decode attention: the last T (usually 1) tokens of a sequence against a static KV cache.

Defines correctness for the Triton kernel and is the CPU production path. It reads the valid prefix only,
so it asks the host for `length.max()` and is not CUDA-graph safe; the Triton kernel is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class PositionRule:
    """Which keys a query sees, as a function of token positions. torch: (q_pos, key_pos) int64 tensors,
    broadcasting -> bool, the definition (it runs in the reference); triton: a @triton.jit function of the same
    two arguments that the Triton kernel inlines into its key loop (a constexpr argument; None where Triton is
    absent). Both must say False for key_pos -1 (an empty row)."""

    torch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    triton: Any = None


@dataclass(frozen=True)
class PositionMask:
    """A mask computed from token positions inside the kernel, for caches whose rows are not in position order
    (sas-pattern's compacted cache): query t sees row j only where rule(q_pos + t, key_pos[j]) holds.

    key_pos: [B, Hkv or 1, >= S] int64, each row's token position (-1: none); q_pos: [B] int64, the first
    query's token position."""

    rule: PositionRule
    key_pos: torch.Tensor
    q_pos: torch.Tensor


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    q_first: torch.Tensor | None = None,
    mask: torch.Tensor | PositionMask | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the queries at positions length-T .. length-1 over keys [0, length).

    q: [B, Hq, D] (T = 1) or [B, Hq, T, D]; k_cache, v_cache: [B, Hkv, S, D] with Hq % Hkv == 0; length: [B]
    int, 0 <= length <= S (0 gives an empty shard for T = 1: out 0, lse -inf). Query t sits at index
    first + t, first = length - T by default or q_first ([B] int64) when given: it sees keys j < length with
    j <= first + t, and with a window only those with j > first + t - window. A q_first >= length attends to a
    shard of keys that all precede the queries (star's phase 2 on a context rank). Keys at index >= length
    may hold anything, NaN included. mask, on top of these rules: a [B, Hkv, S] bool tensor (contiguous), the
    keys each KV head may see at all, or a PositionMask. Returns out shaped like q in q's dtype, and with
    return_lse also lse [B, Hq] or [B, Hq, T] fp32 (natural log of the sum of exp(scaled scores)), computed in
    fp32; a query that sees no key gets out 0 and lse -inf.
    """
    single = q.dim() == 3
    if single:
        q = q.unsqueeze(2)
    B, Hq, T, D = q.shape
    Hkv = k_cache.shape[1]
    # One host sync: read only up to the longest valid prefix instead of the whole buffer.
    hi = int(length.max()) if B else 0
    k = k_cache[:, :, :hi].float()
    v = v_cache[:, :, :hi].float()
    pos = torch.arange(hi, device=q.device)
    first = length - T if q_first is None else q_first
    last = (first[:, None] + torch.arange(T, device=q.device))[:, :, None]  # [B, T, 1]: each query's index
    valid = (pos <= last) & (pos < length[:, None, None])  # [B, T, hi]
    if window is not None:
        valid &= pos > last - window
    seen = valid[:, None, None]  # [B, 1, 1, T, hi]: broadcasts over kv heads and the GQA group
    if isinstance(mask, PositionMask):
        q_at = (mask.q_pos[:, None] + torch.arange(T, device=q.device))[:, None, :, None]  # [B, 1, T, 1]
        seen = seen & mask.rule.torch(q_at, mask.key_pos[:, :, None, :hi])[:, :, None]
    elif mask is not None:
        seen = seen & mask[:, :, :hi][:, :, None, None, :]

    qg = q.float().view(B, Hkv, Hq // Hkv, T, D)
    s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, T, hi]
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for an empty shard
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    # Zero the garbage rows of V: p is 0 there, but 0 * NaN would still be NaN.
    v = v.masked_fill(~(pos < length[:, None])[:, None, :, None], 0.0)
    out = torch.matmul(p, v[:, :, None]).reshape(B, Hq, T, D).to(q.dtype)
    lse = lse.reshape(B, Hq, T)
    if single:
        out, lse = out[:, :, 0], lse[:, :, 0]
    return (out, lse) if return_lse else out
