"""What every Triton launcher needs: the launch context, SM counts, and the interpreter switch.

TRITON_INTERPRET=1 runs the kernels on CPU tensors through Triton's interpreter; the launchers then accept CPU
tensors, which lets a machine without a GPU step through a kernel (slow; for debugging and the optional
interpreter tests, never a production path).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def launch_context(device: torch.device):
    """Launch on the tensor's own GPU (never whatever cuda:0 happens to be current)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Every operand on the launch device, CUDA (or anything under the interpreter), last dim contiguous."""
    if t.device != device or not (t.device.type == "cuda" or INTERPRET):
        raise ValueError(f"expected {name} on the CUDA device {device}, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"expected {name} with a contiguous last dimension, got strides {t.stride()}")
