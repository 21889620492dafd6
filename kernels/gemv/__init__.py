"""gemv: one token's projection y = x W^T (+ b), as nn.Linear computes it.

The decode step's projections (engines/decode_blocks.py) call this: a Triton kernel for one row on
CUDA in half precision (triton.py), torch's linear for everything else (CPU, several rows, fp32).
"""

from __future__ import annotations

import functools

import torch

from kernels.gemv.reference import gemv as gemv_reference
from kernels.gemv.reference import ACTIVATIONS, rms_norm

__all__ = ["ACTIVATIONS", "gemv", "gemv_backend", "gemv_reference", "rms_norm"]


@functools.cache
def _triton_impl():
    try:
        from kernels.gemv.triton import gemv_triton
    except ImportError:
        return None
    return gemv_triton


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, act: str | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K]; bias: [N] or None; norm: an RMSNorm's (weight [K], eps) applied to x first
    (reference.rms_norm) -> [..., N] in x's dtype, F.linear's result. With act ("silu" or "gelu_tanh"), weight is
    a gated MLP's gate and up rows stacked ([2I, K]) and the result act(gate) * up ([..., I]). residual (the
    result's shape) is added last, as `residual + y`.

    On Hopper the kernel reads its first weight tile before the kernel launched before it on the stream has
    finished (programmatic dependent launch): the weight must not be that kernel's output (a model's weights
    never are)."""
    impl = _triton_impl() if x.is_cuda else None
    if impl is None or x.numel() != x.shape[-1] or x.dtype not in (torch.bfloat16, torch.float16) \
            or weight.dtype != x.dtype or not weight.is_contiguous() \
            or (norm is not None and (norm[0].dtype != x.dtype or not norm[0].is_contiguous())) \
            or (residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous())):
        return gemv_reference(x, weight, bias, norm, act, residual)
    return impl(x, weight, bias, norm, act, residual)


def gemv_backend(device: torch.device) -> str:
    """What a one-token half-precision projection runs on `device`, for the report."""
    return "triton gemv" if device.type == "cuda" and _triton_impl() else "torch linear"
