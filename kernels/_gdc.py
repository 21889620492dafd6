"""Programmatic dependent launch (Hopper and later), for the kernels of one decode step.

A kernel launched with `launch_pdl=True` may be scheduled while the kernel before it in the stream is still
finishing; it starts with `grid_dependency_wait(PDL)`, which waits for that kernel (and so for everything before
it) to complete before this one touches memory, and lets the next kernel be scheduled in turn. What it saves is
the launch gap between dependent kernels, which a decode step of many small kernels pays per launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._triton_common import INTERPRET


@triton.jit
def grid_dependency_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether launches on this device use programmatic dependent launch (never under the interpreter)."""
    return device.type == "cuda" and not INTERPRET and _hopper_or_later(
        device.index if device.index is not None else torch.cuda.current_device())
