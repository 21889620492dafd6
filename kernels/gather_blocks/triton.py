"""Gather of stored K/V blocks into retrieval slots in one Triton launch, reading host memory directly.

The stored blocks live in pinned host memory, which a kernel can address through unified virtual addressing
(Triton takes a pinned CPU tensor as a pointer). Each program reads its slot's block id on the GPU, so the ids
never travel to the host: no wait for the device, and one launch instead of a copy (or a dequantisation) per
block. One program copies one row tile of one KV head of one slot, K and V together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import INTERPRET, check_device, launch, launch_context

_DST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gather_blocks_fwd_kernel(
    DstK, DstV, SrcK, SrcV, Ids, Scales,
    n_rows, n_feats,
    stride_dkh, stride_dkr, stride_dvh, stride_dvr,
    stride_skn, stride_skh, stride_skr, stride_svn, stride_svh, stride_svr,
    stride_cn, stride_ck, stride_ch,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    blk = tl.load(Ids + slot)
    if blk < 0:
        return
    rows = tl.program_id(2).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    feats = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (feats < n_feats)[None, :]
    # Slot s owns dst rows s * block .. (s + 1) * block - 1 of every head.
    dst_rows = slot * n_rows + rows
    k = tl.load(SrcK + blk * stride_skn + head * stride_skh + rows[:, None] * stride_skr + feats[None, :], mask=mask)
    v = tl.load(SrcV + blk * stride_svn + head * stride_svh + rows[:, None] * stride_svr + feats[None, :], mask=mask)
    if FP8:
        # fp32 product, then one rounding to dst's dtype: the reference's (src.float() * scale).to(dtype).
        scale_k = tl.load(Scales + blk * stride_cn + head * stride_ch)
        scale_v = tl.load(Scales + blk * stride_cn + stride_ck + head * stride_ch)
        k = (k.to(tl.float32) * scale_k).to(DstK.dtype.element_ty)
        v = (v.to(tl.float32) * scale_v).to(DstV.dtype.element_ty)
    tl.store(DstK + head * stride_dkh + dst_rows[:, None] * stride_dkr + feats[None, :], k, mask=mask)
    tl.store(DstV + head * stride_dvh + dst_rows[:, None] * stride_dvr + feats[None, :], v, mask=mask)


def _check_src(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Stored blocks on dst's GPU, or in pinned host memory (any CPU tensor under the interpreter)."""
    reachable = t.device == device or (t.device.type == "cpu" and (INTERPRET or t.is_pinned()))
    if not reachable:
        raise ValueError(f"expected {name} in pinned host memory or on {device}, got {t.device}"
                         f"{' (not pinned)' if t.device.type == 'cpu' else ''}")
    if t.stride(-1) != 1:
        raise ValueError(f"expected {name} with a contiguous last dimension, got strides {t.stride()}")


def _check(dst_k, dst_v, src_k, src_v, ids, scales) -> None:
    if dst_k.dim() != 3 or dst_k.dtype not in _DST_DTYPES:
        raise ValueError(f"expected dst_k of shape [Hkv, S * block, D] float16/bfloat16/float32, got "
                         f"{tuple(dst_k.shape)} {dst_k.dtype}")
    heads, rows, dim = dst_k.shape
    if dst_v.shape != dst_k.shape or dst_v.dtype != dst_k.dtype:
        raise ValueError(f"expected dst_v of shape {list(dst_k.shape)} {dst_k.dtype}, got "
                         f"{tuple(dst_v.shape)} {dst_v.dtype}")
    if src_k.dim() != 4 or src_k.shape[1] != heads or src_k.shape[3] != dim:
        raise ValueError(f"expected src_k of shape [n, {heads}, block, {dim}], got {tuple(src_k.shape)}")
    if src_v.shape != src_k.shape or src_v.dtype != src_k.dtype:
        raise ValueError(f"expected src_v of shape {list(src_k.shape)} {src_k.dtype}, got "
                         f"{tuple(src_v.shape)} {src_v.dtype}")
    n, block = src_k.shape[0], src_k.shape[2]
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.shape[0] * block != rows:
        raise ValueError(f"expected ids of shape [S] int64 with S * {block} = {rows} (dst_k's rows), got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    if src_k.dtype == torch.float8_e4m3fn:
        if scales is None or scales.shape != (n, 2, heads) or scales.dtype != torch.float32:
            got = None if scales is None else f"{tuple(scales.shape)} {scales.dtype}"
            raise ValueError(f"expected scales of shape [{n}, 2, {heads}] float32 for float8 blocks, got {got}")
    elif src_k.dtype != dst_k.dtype or scales is not None:
        raise ValueError(f"expected src_k of dtype {dst_k.dtype} without scales, or float8_e4m3fn with scales, "
                         f"got {src_k.dtype} {'with' if scales is not None else 'without'} scales")
    for name, t in (("dst_k", dst_k), ("dst_v", dst_v), ("ids", ids)):
        check_device(name, t, dst_k.device)
    for name, t in (("src_k", src_k), ("src_v", src_v), ("scales", scales)):
        if t is not None:
            _check_src(name, t, dst_k.device)


def gather_blocks_triton(dst_k: torch.Tensor, dst_v: torch.Tensor, src_k: torch.Tensor, src_v: torch.Tensor,
                         ids: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """Same contract as reference.gather_blocks_reference; dst and ids on CUDA, src (and scales) pinned or on
    dst's GPU (any CPU tensors under the interpreter). Ids must be < n: they are never read on the host, so an
    id past the stored blocks reads past them."""
    _check(dst_k, dst_v, src_k, src_v, ids, scales)
    heads, _, dim = dst_k.shape
    n_slots, block = ids.shape[0], src_k.shape[2]
    if n_slots == 0 or heads == 0 or dim == 0 or block == 0:
        return
    block_d = triton.next_power_of_2(dim)
    # Tiles of about 4K elements: 32 a thread over 4 warps, enough loads in flight to hide the bus latency.
    block_r = max(1, min(triton.next_power_of_2(block), 4096 // block_d))
    fp8 = scales is not None
    cn, ck, ch = scales.stride() if fp8 else (0, 0, 0)
    with launch_context(dst_k.device):
        launch(_gather_blocks_fwd_kernel, (n_slots, heads, triton.cdiv(block, block_r)),
            dst_k, dst_v, src_k, src_v, ids, scales, block, dim,
            dst_k.stride(0), dst_k.stride(1), dst_v.stride(0), dst_v.stride(1),
            src_k.stride(0), src_k.stride(1), src_k.stride(2), src_v.stride(0), src_v.stride(1), src_v.stride(2),
            cn, ck, ch,
            BLOCK_R=block_r, BLOCK_D=block_d, FP8=fp8, num_warps=4,
        )
