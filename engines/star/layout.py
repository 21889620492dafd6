"""Where star's blocks go: the document cut into blocks, the anchor's length, and each rank's share."""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import EngineInputError
from engines.config import StarConfig
from kernels import cdiv


@dataclass(frozen=True)
class StarLayout:
    """Where the document's blocks go: bounds [lo, hi) per block, the anchor length, blocks per rank."""

    bounds: tuple[tuple[int, int], ...]
    anchor: int
    owners: tuple[tuple[int, ...], ...]  # per rank, its block indices (contiguous, ascending)

    def span(self, rank: int) -> tuple[int, int]:
        """Positions [p0, p1) of the rank's blocks."""
        mine = self.owners[rank]
        return self.bounds[mine[0]][0], self.bounds[mine[-1]][1]


def plan_blocks(n_tokens: int, config: StarConfig, world: int = 1) -> StarLayout:
    """Split n_tokens into blocks and assign them to `world` ranks in order; EngineInputError when it cannot."""
    if n_tokens < 1:
        raise EngineInputError("star: the document is empty")
    if config.block_size is not None:
        if config.block_size > n_tokens:
            raise EngineInputError(
                f"star: block_size {config.block_size:,} is larger than the document ({n_tokens:,} tokens); one "
                "block is plain dense attention: lower block_size, or use blocks: N")
        size = config.block_size
    else:
        # Blocks of at least min_block_size, but one per rank where the ranks ask for more.
        size = cdiv(n_tokens, min(config.blocks, max(world, n_tokens // config.min_block_size, 1)))
    bounds = tuple((lo, min(lo + size, n_tokens)) for lo in range(0, n_tokens, size))
    anchor = size if config.anchor_size is None else config.anchor_size
    if anchor > size:
        raise EngineInputError(f"star: anchor_size {anchor:,} is larger than a block ({size:,} tokens)")
    if world > len(bounds):
        raise EngineInputError(f"star: {world} ranks but only {len(bounds)} blocks of {size:,} tokens in a "
                               f"{n_tokens:,}-token document; use fewer ranks (--gpus) or smaller blocks")
    # Contiguous shares, as even as possible; the extra blocks go to the first ranks.
    per, extra = divmod(len(bounds), world)
    owners, start = [], 0
    for r in range(world):
        count = per + (r < extra)
        owners.append(tuple(range(start, start + count)))
        start += count
    return StarLayout(bounds, min(anchor, bounds[0][1]), tuple(owners))
