"""Reference gather of stored K/V blocks into retrieval slots (plain torch, any devices).

Defines correctness for the Triton kernel, and is the CPU path and the fallback where the stored blocks are not
reachable from the GPU (pageable host memory). It brings the slot ids to the host, a wait for the device that
the kernel avoids.
"""

from __future__ import annotations

import torch


def gather_blocks_reference(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                            ids: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Copies stored block ids[s] into slot s of dst_k/dst_v, in place, for every slot with ids[s] >= 0.

    dst_k, dst_v: [Hkv, S * block, D] (any strides with a contiguous last dimension; slot s holds rows
    s * block .. (s + 1) * block - 1). src_k, src_v: [n, Hkv, block, D], dst's dtype, or float8_e4m3fn with
    scales [n, 2, Hkv] float32 (K's at [:, 0], V's at [:, 1]), dequantised as (src.float() * scale).to(dst.dtype).
    ids: [S] int64 on dst's device, each < n; a negative id leaves its slot's rows as they are.
    """
    heads, _, dim = dst_k.shape
    n_slots, block = ids.shape[0], src_k.shape[2]
    slots = (ids >= 0).nonzero().flatten()
    if slots.numel() == 0:
        return
    blocks = ids[slots].to(src_k.device)
    for i, (dst, src) in enumerate(((dst_k, src_k), (dst_v, src_v))):
        got = src[blocks].to(dst.device, non_blocking=True)  # [m, Hkv, block, D]
        if scales is not None:
            scale = scales[blocks, i].to(dst.device, non_blocking=True)  # [m, Hkv]
            got = (got.float() * scale[:, :, None, None]).to(dst.dtype)
        # Splitting the row dimension keeps a view of dst, so the indexed assignment writes dst's own rows.
        dst.view(heads, n_slots, block, dim)[:, slots] = got.transpose(0, 1)
