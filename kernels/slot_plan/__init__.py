"""plan_slots: which blocks ltri-stream's retrieval slots hold after a chunk's retrieval, decided on the device.

`plan_slots(...)` runs the Triton kernel on CUDA (one launch, nothing comes back to the host) or the reference
elsewhere (which reads the ids on the host).
"""

from __future__ import annotations

import functools

import torch

from kernels.slot_plan.reference import plan_slots_reference, slot_rows

__all__ = ["plan_slots", "plan_slots_reference", "slot_rows"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.slot_plan.triton import plan_slots_triton
    except ImportError:
        return None
    return plan_slots_triton


def plan_slots(top: torch.Tensor, where: torch.Tensor | None, slots: torch.Tensor, load: torch.Tensor,
               key_pos: torch.Tensor, front: torch.Tensor | None, tally: torch.Tensor, *, n_blocks: int, block: int,
               tail: int, n_init: int) -> None:
    """top [k], where [n_blocks], slots and load [S], key_pos and front [S * block], tally [2], all int64 on one
    device (where may be None with tail 0); see reference.plan_slots_reference."""
    impl = _triton_impl() if slots.is_cuda else None
    (impl or plan_slots_reference)(top, where, slots, load, key_pos, front, tally, n_blocks=n_blocks, block=block,
                                   tail=tail, n_init=n_init)
