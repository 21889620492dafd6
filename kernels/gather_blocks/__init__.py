"""gather_blocks: copy stored K/V blocks (host memory, optionally fp8) into a layer's retrieval slots.

ltri's context memory keeps evicted blocks in host RAM, pinned when the model is on a GPU. With the device rows
on CUDA and the blocks pinned (or already on that GPU), one Triton launch reads them straight from host memory
and the slot ids stay on the device. Anything else (CPU rows, blocks in pageable memory such as a state read
back from disk, a machine without Triton) goes to the pure-torch reference, which brings the ids to the host.
"""

from __future__ import annotations

import functools

import torch

from kernels.gather_blocks.reference import gather_blocks_reference

__all__ = ["gather_blocks", "gather_blocks_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.gather_blocks.triton import gather_blocks_triton
    except ImportError:
        return None
    return gather_blocks_triton


def _reachable(t: torch.Tensor | None, device: torch.device) -> bool:
    """Whether a kernel on `device` can read t: on that GPU, or pinned host memory (mapped into every GPU's
    address space)."""
    return t is None or t.device == device or (t.device.type == "cpu" and t.is_pinned())


def gather_blocks(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                  ids: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """dst_k, dst_v [Hkv, S * block, D] (written in place), src_k, src_v [n, Hkv, block, D] (dst's dtype, or
    float8_e4m3fn with scales [n, 2, Hkv] float32), ids [S] int64 on dst's device (-1: slot untouched); see
    reference.gather_blocks_reference."""
    device = dst_k.device
    fast = dst_k.is_cuda and all(_reachable(t, device) for t in (src_k, src_v, scales))
    impl = _triton_impl() if fast else None
    (impl or gather_blocks_reference)(dst_k, dst_v, src_k, src_v, ids, scales)
