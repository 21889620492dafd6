"""plan_slots in Triton: one program decides a layer's retrieval slots on the device, so the host never waits for
the chunk's top-k ids (see reference.py for the rule it follows).

The successor rule walks the top-k ids in order with the chosen blocks in a register vector; every set question
(is b chosen, is a slot's block still wanted, the rank of a missing block among the missing) is a comparison of
two such vectors, [P, P] at most for P the slots rounded up to a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch, launch_context


@triton.jit
def _plan_slots_kernel(
    Top, Where, Slots, Load, KeyPos, Front, Tally,
    k, n_slots, n_blocks, n_init, tail_from,
    P: tl.constexpr, BLOCK: tl.constexpr, SUCCESSORS: tl.constexpr, FRONT: tl.constexpr,
):
    i = tl.arange(0, P)
    valid = i < k
    if SUCCESSORS:
        wanted = tl.full([P], -1, dtype=tl.int64)
        count = 0
        successors = 0
        for j in range(0, k):
            b = tl.load(Top + j)
            w = tl.load(Where + b)
            add = (count < k) & (tl.sum((wanted == b).to(tl.int32), 0) == 0)
            wanted = tl.where((i == count) & add, b, wanted)
            count += add.to(tl.int32)
            nxt = b + 1
            more = (count < k) & (w >= tail_from) & (nxt < n_blocks)
            more = more & (tl.sum((wanted == nxt).to(tl.int32), 0) == 0)
            wanted = tl.where((i == count) & more, nxt, wanted)
            count += more.to(tl.int32)
            successors += more.to(tl.int32)
    else:
        wanted = tl.load(Top + i, mask=valid, other=-1)
        successors = 0
    s = tl.arange(0, P)
    slot_ok = s < n_slots
    old = tl.load(Slots + s, mask=slot_ok, other=-1)
    # [wanted i, slot s]: block i sits in slot s.
    same = (wanted[:, None] == old[None, :]) & valid[:, None] & slot_ok[None, :]
    missing = valid & (tl.sum(same.to(tl.int32), 1) == 0)
    free = slot_ok & (tl.sum(same.to(tl.int32), 0) == 0)
    # Rank of a missing block among the missing (ascending ids), of a free slot among the free (slot order).
    below = (wanted[None, :] < wanted[:, None]) & missing[None, :]
    miss_rank = tl.sum(below.to(tl.int32), 1)
    free_i = free.to(tl.int32)
    free_rank = tl.cumsum(free_i, 0) - free_i
    match = missing[:, None] & (miss_rank[:, None] == free_rank[None, :])  # [wanted i, slot s]
    has = free & (tl.sum(match.to(tl.int32), 0) > 0)
    got = tl.sum(tl.where(match, wanted[:, None], 0), 0)
    new = tl.where(free, tl.where(has, got, -1), old)
    tl.store(Slots + s, new, mask=slot_ok)
    tl.store(Load + s, tl.where(has, got, -1), mask=slot_ok)
    t = tl.arange(0, BLOCK)
    rows = s[:, None] * BLOCK + t[None, :]
    held = new >= 0
    tl.store(KeyPos + rows, tl.where(held[:, None], n_init + new[:, None] * BLOCK + t[None, :], -1),
             mask=slot_ok[:, None])
    if FRONT:
        # Rank of each held block in document order among the held ones.
        order = tl.sum(((new[None, :] < new[:, None]) & held[None, :] & slot_ok[None, :]).to(tl.int32), 1)
        at = tl.where(held, order, s).to(tl.int64)
        tl.store(Front + rows, n_init + at[:, None] * BLOCK + t[None, :], mask=slot_ok[:, None])
    n_loaded = tl.sum(has.to(tl.int64), 0)
    tl.store(Tally, tl.load(Tally) + successors.to(tl.int64))
    tl.store(Tally + 1, tl.load(Tally + 1) + n_loaded)


def plan_slots_triton(top: torch.Tensor, where: torch.Tensor | None, slots: torch.Tensor, load: torch.Tensor,
                      key_pos: torch.Tensor, front: torch.Tensor | None, tally: torch.Tensor, *, n_blocks: int,
                      block: int, tail: int, n_init: int) -> None:
    """Same contract as reference.plan_slots_reference; CUDA tensors (or any under the interpreter)."""
    k, n_slots = top.shape[0], slots.shape[0]
    if where is None and tail:
        raise ValueError("expected where [n_blocks] with a successor tail, got None")
    if top.dim() != 1 or k > n_slots:
        raise ValueError(f"expected top of shape [k] with k <= {n_slots} slots, got {tuple(top.shape)}")
    for name, t, n in (("top", top, k), ("where", where, n_blocks), ("slots", slots, n_slots),
                       ("load", load, n_slots), ("key_pos", key_pos, n_slots * block),
                       ("front", front, n_slots * block), ("tally", tally, 2)):
        if t is None:
            continue
        if t.shape != (n,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"expected {name} of shape [{n}] int64 contiguous, got {tuple(t.shape)} {t.dtype}")
        check_device(name, t, slots.device)
    with launch_context(slots.device):
        launch(_plan_slots_kernel, (1,),
            top, where if where is not None else top, slots, load, key_pos, front if front is not None else key_pos,
            tally,
            k, n_slots, n_blocks, n_init, block - tail,
            P=triton.next_power_of_2(n_slots), BLOCK=block, SUCCESSORS=tail > 0, FRONT=front is not None,
            num_warps=4,
        )
