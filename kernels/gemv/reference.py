"""Reference GEMV: torch's linear (CPU path, test oracle, and every call the Triton kernel does not take), with
what a decode step may fold into it: the RMSNorm before, the gated MLP's activation and the residual add after."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama family's RMSNorm as transformers computes it: statistics in fp32, the normalised row rounded to
    x's dtype, then times the weight. x: [..., K]; weight: [K]."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# A gated MLP's activations by the names kernels.gemv takes, as transformers' ACT2FN computes them.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None, act: str | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """See kernels.gemv.gemv."""
    if norm is not None:
        x = rms_norm(x, *norm)
    y = F.linear(x, weight, bias)
    if act is not None:
        gate, up = y.chunk(2, dim=-1)
        y = ACTIVATIONS[act](gate) * up
    return y if residual is None else residual + y
