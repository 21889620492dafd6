"""What crosses between star's ranks: the anchor's K/V in phase 1, every shard's partial attention in phase 2,
and the check that every rank read the same document."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engines.base import EngineInputError
from kernels.decode_attention import merge_partials


@dataclass
class AnchorSync:
    """For one forward: after layer l has written the anchor's K/V on the source rank, broadcast them.

    tokens: the anchor length. The source is rank 0 (it encodes block 0): there the K/V are read from slots
    [0, tokens), on the receivers written to slots [0, tokens) (sliding-window layers: the last `window` anchor
    tokens, all that a block can see). sent_bytes counts what crossed (sent on rank 0, received elsewhere).
    """

    tokens: int
    sent_bytes: int = 0

    def __call__(self, key: torch.Tensor, value: torch.Tensor, window: int | None, is_source: bool) -> None:
        lo = 0 if window is None else max(0, self.tokens - window)
        buf = (torch.stack([key[:, :, lo:self.tokens], value[:, :, lo:self.tokens]]) if is_source else
               torch.empty((2, *key[:, :, lo:self.tokens].shape), dtype=key.dtype, device=key.device))
        dist.broadcast(buf, src=0)
        self.sent_bytes += buf.nbytes
        if not is_source:
            key[:, :, lo:self.tokens].copy_(buf[0])
            value[:, :, lo:self.tokens].copy_(buf[1])


def gather_merge(out: torch.Tensor, lse: torch.Tensor, world: int) -> torch.Tensor:
    """out [B, Hq, T, D], lse [B, Hq, T] of this rank's shard -> the merge over every rank's shard [B, Hq, T, D]."""
    packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)
    gathered = torch.empty((world, *packed.shape), dtype=packed.dtype, device=packed.device)
    if dist.get_backend() == "gloo":
        dist.all_gather(list(gathered.unbind(0)), packed)
    else:
        dist.all_gather_into_tensor(gathered, packed)
    merged, _ = merge_partials(gathered[..., :-1].unbind(0), gathered[..., -1].unbind(0))
    return merged.to(out.dtype)


def check_same_document(ids: torch.Tensor, device: torch.device) -> None:
    """Every rank tokenised its own copy of the input (SPMD): refuse to run if the copies differ."""
    ids = ids.to(torch.long)
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.long) % 65521
    mine = torch.tensor([ids.numel(), int(ids.sum()), int((ids * weights).sum())], device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if any(not torch.equal(mine, other) for other in every):
        raise EngineInputError("star: the ranks read different documents (token counts or checksums differ); "
                               "every host must see the same input")
