"""ltri-stream's retrieval slots for one layer and chunk, in plain PyTorch (the definition the kernel matches).

From the chunk's top-k blocks (best first) to what the slots hold: a block whose best-matching index vector lies
in its last `tail` tokens brings its successor along, right after it, while fewer than k are chosen; blocks
already in a slot stay there; the j-th missing block (ascending ids) takes the j-th free slot. Writes the slots,
the blocks to load per slot, the slot rows' document positions and, where positions are re-assigned, the rows'
attended positions (the k-th held block in document order at the k-th block of positions after the init tokens).
"""

from __future__ import annotations

import torch


def choose_blocks(top: list[int], where: list[int], n_blocks: int, block: int, tail: int) -> tuple[list[int], int]:
    """The blocks to hold (best first, successors right after their block) and how many came as successors."""
    k = len(top)
    if not tail:
        return list(top), 0
    wanted: list[int] = []
    successors = 0
    for b, w in zip(top, where):
        if len(wanted) >= k:
            break
        if b not in wanted:
            wanted.append(b)
        if w >= block - tail and b + 1 < n_blocks and b + 1 not in wanted and len(wanted) < k:
            wanted.append(b + 1)
            successors += 1
    return wanted, successors


def assign_slots(old: list[int], wanted: list[int]) -> tuple[list[int], list[int]]:
    """New slot contents and the block each slot loads (-1: none): held blocks stay, the j-th missing one
    (ascending) goes to the j-th free slot, free slots left over empty."""
    keep, held = set(wanted), set(old)
    free = [s for s, b in enumerate(old) if b not in keep]
    missing = [b for b in sorted(wanted) if b not in held]
    new, load = list(old), [-1] * len(old)
    for s, b in zip(free, missing):
        new[s] = load[s] = b
    for s in free[len(missing):]:
        new[s] = -1
    return new, load


def slot_rows(slots: list[int], n_init: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S * block] each slot row's document position (-1: empty slot) and its attended position when positions
    are re-assigned (held blocks in document order after the init tokens; an empty slot's rows keep their own)."""
    ids = torch.tensor(slots, dtype=torch.long)[:, None]
    t = torch.arange(block)
    positions = (n_init + ids * block + t).masked_fill(ids < 0, -1).flatten()
    # Rank of each slot's block in document order: empty slots (-1) sort first, so they are counted out.
    rank = ids[:, 0].argsort(stable=True).argsort() - (ids < 0).sum()
    own = n_init + torch.arange(len(slots))[:, None] * block + t
    front = torch.where(ids >= 0, n_init + rank[:, None] * block + t, own).flatten()
    return positions, front


def plan_slots_reference(top: torch.Tensor, where: torch.Tensor | None, slots: torch.Tensor, load: torch.Tensor,
                         key_pos: torch.Tensor, front: torch.Tensor | None, tally: torch.Tensor, *, n_blocks: int,
                         block: int, tail: int, n_init: int) -> None:
    """top [k] int64 block ids best first (distinct, k <= S), where [n_blocks] int64 offset of each block's best
    index vector (read only with tail > 0; None without); written in place: slots [S] (block per slot, -1 empty),
    load [S] (block each slot loads, -1 none), key_pos [S * block], front [S * block] (None: positions not
    re-assigned), tally [2] += (successors, blocks loaded)."""
    top_l = top.tolist()
    where_l = where[top].tolist() if tail else [0] * len(top_l)
    wanted, successors = choose_blocks(top_l, where_l, n_blocks, block, tail)
    new, to_load = assign_slots(slots.tolist(), wanted)
    positions, attended = slot_rows(new, n_init, block)
    slots.copy_(torch.tensor(new))
    load.copy_(torch.tensor(to_load))
    key_pos.copy_(positions)
    if front is not None:
        front.copy_(attended)
    tally += torch.tensor([successors, sum(b >= 0 for b in to_load)], device=tally.device)
