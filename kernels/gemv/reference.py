"""Reference GEMV: torch's linear (CPU path, test oracle, and every call the Triton kernel does not take)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See kernels.gemv.gemv."""
    return F.linear(x, weight, bias)
