"""Reference block-descriptor update in plain PyTorch (reads `length` on the host; CPU path and test oracle)."""

from __future__ import annotations

import torch

from kernels import cdiv


# int8 descriptors: a block's codes span +-CODE_MAX steps of its scale; rounding outwards may add one step.
CODE_MAX = 126


def quantize_outwards(top: torch.Tensor, bottom: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top, bottom: [..., D] -> int8 codes (top rounded up, bottom down) and the scale [...] fp32 that both
    share: code * scale >= top and <= bottom up to fp32 rounding, so Quest's bound stays an upper bound."""
    top, bottom = top.float(), bottom.float()
    amax = torch.maximum(top.abs().amax(dim=-1), bottom.abs().amax(dim=-1)).clamp_min(1e-30)
    inv = (CODE_MAX / amax)[..., None]
    high = torch.ceil(top * inv).clamp(max=127).to(torch.int8)
    low = torch.floor(bottom * inv).clamp(min=-127).to(torch.int8)
    return high, low, amax / CODE_MAX


def update_block_descriptors(keys: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, length: torch.Tensor,
                             n_new: int, block_size: int, kmean: torch.Tensor | None = None,
                             fold_mean: bool = False, scale: torch.Tensor | None = None) -> None:
    """keys: [B, Hkv, S, D]; kmax, kmin: [B, Hkv, NB, D] (int8 with scale [B, Hkv, NB]); length: [B]. See
    kernels.block_descriptors."""
    B, H, _, D = keys.shape
    for b, end in enumerate(length.tolist()):
        lo = (end - n_new) // block_size
        hi = cdiv(end, block_size)
        seg = keys[b, :, lo * block_size:end]  # [H, n, D]
        pad = (hi - lo) * block_size - seg.shape[1]
        # The last block may be partly filled: pad it so that the padding never wins the max or the min.
        top = torch.cat([seg, seg.new_full((H, pad, D), float("-inf"))], dim=1).view(H, hi - lo, block_size, D)
        bottom = torch.cat([seg, seg.new_full((H, pad, D), float("inf"))], dim=1).view(H, hi - lo, block_size, D)
        top, bottom = top.amax(dim=2), bottom.amin(dim=2)
        if kmean is not None or fold_mean:
            total = torch.cat([seg.float(), seg.new_zeros((H, pad, D), dtype=torch.float32)], dim=1)
            count = (end - torch.arange(lo, hi) * block_size).clamp(max=block_size).to(torch.float32)
            mean = total.view(H, hi - lo, block_size, D).sum(dim=2) / count[None, :, None].to(keys.device)
            if fold_mean:
                top, bottom = top.float() + mean, bottom.float() + mean
            else:
                kmean[b, :, lo:hi] = mean.to(kmean.dtype)
        if scale is not None:
            top, bottom, scale[b, :, lo:hi] = quantize_outwards(top, bottom)
        kmax[b, :, lo:hi] = top.to(kmax.dtype)
        kmin[b, :, lo:hi] = bottom.to(kmin.dtype)
