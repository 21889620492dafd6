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


# Compiled kernels by (kernel, device, argument specialisation, options): `launch`.
_LAUNCHERS: dict = {}
_CACHED_LAUNCH = not INTERPRET


# The current stream's handle, as Triton itself reads it (torch.cuda.current_stream() builds a Python object: ~8 us).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                      lambda device: torch.cuda.current_stream(device).cuda_stream)


def _specialisation(arg) -> tuple:
    """What Triton compiles a kernel argument into: a tensor's dtype and 16-byte alignment; an int's width, its
    divisibility by 16 and whether it is 1; a float; anything else (None, a bool) by value."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return int, arg == 1, arg % 16 == 0, -2 ** 31 <= arg < 2 ** 31
    if isinstance(arg, float):
        return (float,)
    return type(arg), arg


def launch(kernel, grid: tuple, *args, **options) -> None:
    """`kernel[grid](*args, **options)` for a @triton.jit kernel whose parameters after `args` are constexprs given in
    `options` (with num_warps, num_stages and other compile options). Triton's launch path binds and specialises
    every argument again at each call (about 22 us of host time on an H200 machine, the largest part of a small
    kernel's cost in a host-bound prefill); here that happens once per specialisation, and later calls go
    straight to the compiled kernel's launcher. The first launch of a specialisation, and every launch under the
    interpreter, take Triton's own path."""
    global _CACHED_LAUNCH
    if not _CACHED_LAUNCH:
        kernel[grid](*args, **options)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, tuple(map(_specialisation, args)), tuple(options.items()))
    entry = _LAUNCHERS.get(key)
    if entry is not None:
        compiled, tail = entry
        full = (*grid, 1, 1)
        try:
            compiled.run(full[0], full[1], full[2], _raw_stream(device), compiled.function, compiled.packed_metadata,
                         None, None, None, *args, *tail)
            return
        except TypeError:  # another Triton's launcher signature: refused before launching
            _CACHED_LAUNCH = False
            kernel[grid](*args, **options)
            return
    compiled = kernel[grid](*args, **options)
    try:
        tail = tuple(options[name] for name in kernel.arg_names[len(args):])
        compiled.function, compiled.packed_metadata, compiled.run  # noqa: B018 (this Triton's launcher interface)
    except (AttributeError, KeyError):
        _CACHED_LAUNCH = False  # another Triton, or a kernel whose trailing parameters are not all constexprs
        return
    _LAUNCHERS[key] = (compiled, tail)
