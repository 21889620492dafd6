"""plan_slots: ltri-stream's retrieval slots after a chunk's retrieval (successors, held blocks, free slots).

The reference is held to hand-worked cases; `triton` tests hold the kernel to the reference bit for bit (on CUDA,
or on CPU through Triton's interpreter).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.slot_plan import plan_slots, plan_slots_reference
from kernels.slot_plan.reference import assign_slots, choose_blocks, slot_rows
from tests.conftest import TRITON_DEVICE


def _buffers(slots, block, front=True, device="cpu"):
    n = len(slots)
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    out = {"slots": t(slots), "load": t([7] * n), "key_pos": t([99] * (n * block)),
           "front": t([99] * (n * block)) if front else None, "tally": t([5, 6])}
    return out


def test_successors_come_right_after_their_block_until_k_are_chosen():
    # Block 4 matched in its last 2 tokens (offset 14 of 16) brings 5; 9 matched at offset 15 brings 10, which
    # would be the fourth: k = 3 stops it. Block 7 is last of the document: no successor.
    where = {4: 14, 9: 15, 2: 0, 7: 15}
    assert choose_blocks([4, 9, 2], [where[b] for b in (4, 9, 2)], 12, 16, 2) == ([4, 5, 9], 1)
    assert choose_blocks([7, 2], [15, 0], 8, 16, 2) == ([7, 2], 0)
    # A successor already chosen is not counted twice; a top block already brought as a successor is not re-added.
    assert choose_blocks([3, 4, 1], [15, 15, 0], 12, 16, 4) == ([3, 4, 5], 2)
    assert choose_blocks([3, 4, 1], [15, 15, 0], 12, 16, 0) == ([3, 4, 1], 0)


def test_held_blocks_stay_and_missing_ones_take_free_slots_in_order():
    new, load = assign_slots([8, -1, 3, 5], [9, 3, 1])
    # 3 stays in slot 2; missing 1 and 9 (ascending) take the free slots 0 and 1; slot 3 (5, unwanted) empties.
    assert new == [1, 9, 3, -1] and load == [1, 9, -1, -1]
    assert assign_slots([1, 2], [2, 1]) == ([1, 2], [-1, -1])


def test_slot_rows_positions_and_document_order():
    positions, front = slot_rows([2, -1, 0], n_init=4, block=2)
    assert positions.tolist() == [8, 9, -1, -1, 4, 5]
    # Block 0 (slot 2) is first in document order, block 2 (slot 0) second; the empty slot keeps its own rows.
    assert front.tolist() == [6, 7, 6, 7, 4, 5]


def test_reference_writes_every_output_and_adds_to_the_tally():
    bufs = _buffers([8, -1, 3, 5], block=2)
    where = torch.full((12,), 0, dtype=torch.long)
    where[9] = 1  # block 9 matched in its last token (tail 1): brings 10, the third of k = 3 (1 is left out)
    plan_slots_reference(torch.tensor([9, 3, 1]), where, **bufs, n_blocks=12, block=2, tail=1, n_init=4)
    assert bufs["slots"].tolist() == [9, 10, 3, -1]
    assert bufs["load"].tolist() == [9, 10, -1, -1]
    assert bufs["key_pos"].tolist() == [22, 23, 24, 25, 10, 11, -1, -1]
    # Document order 3, 9, 10 after the 4 init rows; the empty slot keeps its own rows' positions.
    assert bufs["front"].tolist() == [6, 7, 8, 9, 4, 5, 10, 11]
    assert bufs["tally"].tolist() == [5 + 1, 6 + 2]


def _random_case(rng: random.Random, n_slots: int, block: int, n_blocks: int, k: int, tail: int):
    top = rng.sample(range(n_blocks), k)
    where = [rng.randrange(-1, block) for _ in range(n_blocks)]
    held = rng.sample(range(n_blocks), min(n_blocks, rng.randrange(0, n_slots + 1)))
    slots = held + [-1] * (n_slots - len(held))
    rng.shuffle(slots)
    return top, where, slots


@pytest.mark.triton
@pytest.mark.parametrize("n_slots,block,n_blocks,k,tail,front", [
    pytest.param(4, 16, 6, 4, 4, True, id="S4-B16-n6-k4-tail4"),
    pytest.param(16, 128, 1000, 16, 32, True, id="S16-B128-n1000-k16-tail32-llama"),
    pytest.param(16, 128, 40, 16, 0, True, id="S16-B128-n40-k16-no-tail"),
    pytest.param(12, 64, 9, 9, 0, False, id="S12-B64-n9-k9-all-blocks-no-front"),
    pytest.param(5, 32, 63, 3, 31, False, id="S5-B32-n63-k3-tail31"),
])
def test_triton_matches_reference(n_slots, block, n_blocks, k, tail, front):
    from kernels.slot_plan.triton import plan_slots_triton

    rng = random.Random(42)
    for _ in range(6):
        top, where, slots = _random_case(rng, n_slots, block, n_blocks, k, tail)
        want = _buffers(slots, block, front)
        got = _buffers(slots, block, front, TRITON_DEVICE)
        args = dict(n_blocks=n_blocks, block=block, tail=tail, n_init=128)
        plan_slots_reference(torch.tensor(top), torch.tensor(where), **want, **args)
        plan_slots_triton(torch.tensor(top, device=TRITON_DEVICE), torch.tensor(where, device=TRITON_DEVICE),
                          **got, **args)
        for name, t in want.items():
            if t is not None:
                assert got[name].cpu().tolist() == t.tolist(), name


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.slot_plan.triton import plan_slots_triton

    bufs = _buffers([1, -1], 4, device=TRITON_DEVICE)
    top = torch.tensor([0, 1, 2], device=TRITON_DEVICE)
    where = torch.zeros(5, dtype=torch.long, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match=r"expected top of shape \[k\] with k <= 2 slots"):
        plan_slots_triton(top, where, **bufs, n_blocks=5, block=4, tail=1, n_init=0)
    bufs["key_pos"] = bufs["key_pos"][:7]
    with pytest.raises(ValueError, match=r"expected key_pos of shape \[8\] int64"):
        plan_slots_triton(top[:2], where, **bufs, n_blocks=5, block=4, tail=1, n_init=0)


def test_dispatch_on_cpu_is_the_reference():
    rng = random.Random(7)
    top, where, slots = _random_case(rng, 8, 16, 30, 8, 5)
    got, want = _buffers(slots, 16), _buffers(slots, 16)
    plan_slots(torch.tensor(top), torch.tensor(where), **got, n_blocks=30, block=16, tail=5, n_init=3)
    plan_slots_reference(torch.tensor(top), torch.tensor(where), **want, n_blocks=30, block=16, tail=5, n_init=3)
    assert all(torch.equal(got[n], want[n]) for n in want if want[n] is not None)
