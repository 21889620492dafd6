"""Triton block-descriptor update: one program per (batch, kv head, touched block), `length` read on the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch_context
from kernels.block_descriptors.reference import CODE_MAX

_CODE_MAX = tl.constexpr(CODE_MAX)


@triton.jit
def _block_descriptors_kernel(
    K, Kmax, Kmin, Kmean, Scale, Length, n_kv_heads, n_new,
    stride_kb, stride_kh, stride_ks, stride_db, stride_dh, stride_dn, stride_sb, stride_sh,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MEAN: tl.constexpr, FOLD: tl.constexpr, QUANT: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    length = tl.load(Length + b).to(tl.int64)
    blk = (length - n_new) // BLOCK + tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    # Keys past `length` (the rest of a partly filled block) are masked out of both reductions.
    valid = offs < length
    ptrs = K + b * stride_kb + h * stride_kh + offs[:, None] * stride_ks + offs_d[None, :]
    k = tl.load(ptrs, mask=valid[:, None], other=0.0)
    # A program past the last touched block (n_new not block aligned) writes nothing.
    live = blk * BLOCK < length
    store_block_descriptors(Kmax, Kmin, Kmean, b * stride_db + h * stride_dh + blk * stride_dn + offs_d, k, valid,
                            tl.minimum(length - blk * BLOCK, BLOCK), live & (offs_d < HEAD_DIM), MEAN, FOLD,
                            Scale + b * stride_sb + h * stride_sh + blk, live, QUANT)


@triton.jit
def store_block_descriptors(Kmax, Kmin, Kmean, dst, rows, valid, n_valid, mask, MEAN: tl.constexpr,
                            FOLD: tl.constexpr, scale_at, live, QUANT: tl.constexpr):
    """One block's descriptors from its keys rows [BLOCK, D] (valid: the n_valid rows holding keys), stored at
    dst where mask: max and min, and the mean kept apart (MEAN) or added to both in fp32 (FOLD). QUANT: int8
    codes of one scale stored at scale_at where live (reference.quantize_outwards: max up, min down)."""
    top = tl.max(tl.where(valid[:, None], rows, float("-inf")), 0)
    bottom = tl.min(tl.where(valid[:, None], rows, float("inf")), 0)
    if MEAN or FOLD:
        mean = tl.sum(tl.where(valid[:, None], rows.to(tl.float32), 0.0), 0) / tl.maximum(n_valid.to(tl.float32), 1.0)
        if FOLD:
            top = top.to(tl.float32) + mean
            bottom = bottom.to(tl.float32) + mean
        else:
            tl.store(Kmean + dst, mean.to(Kmean.dtype.element_ty), mask=mask)
    if QUANT:
        top = top.to(tl.float32)
        bottom = bottom.to(tl.float32)
        amax = tl.maximum(tl.max(tl.where(mask, tl.maximum(tl.abs(top), tl.abs(bottom)), 0.0), 0), 1e-30)
        inv = _CODE_MAX / amax
        top = tl.minimum(tl.ceil(top * inv), 127.0)
        bottom = tl.maximum(tl.floor(bottom * inv), -127.0)
        tl.store(scale_at, amax / _CODE_MAX, mask=live)
    tl.store(Kmax + dst, top.to(Kmax.dtype.element_ty), mask=mask)
    tl.store(Kmin + dst, bottom.to(Kmin.dtype.element_ty), mask=mask)


def check_descriptors(described: tuple, scale: torch.Tensor | None, keys: torch.Tensor, block_size: int) -> None:
    """Shapes, dtypes and strides of (name, tensor) descriptors and their int8 scale for keys [B, Hkv, S, D]."""
    B, H, S, D = keys.shape
    nb = triton.cdiv(S, block_size)
    dtype = keys.dtype if scale is None else torch.int8
    for name, t in described:
        if t.shape != (B, H, nb, D) or t.dtype != dtype or t.stride() != described[0][1].stride():
            raise ValueError(f"expected {name} of shape [{B}, {H}, {nb}, {D}] {dtype}, strided like kmax, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if scale is not None and (scale.shape != (B, H, nb) or scale.dtype != torch.float32 or scale.stride(2) != 1):
        raise ValueError(f"expected scale of shape [{B}, {H}, {nb}] float32 with unit stride over blocks, got "
                         f"{tuple(scale.shape)} {scale.dtype}")


def update_block_descriptors_triton(keys: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor,
                                    length: torch.Tensor, n_new: int, block_size: int,
                                    kmean: torch.Tensor | None = None, fold_mean: bool = False,
                                    scale: torch.Tensor | None = None) -> None:
    """Same contract as reference.update_block_descriptors; CUDA-graph capturable."""
    if keys.dim() != 4:
        raise ValueError(f"expected keys of shape [B, Hkv, S, D], got {tuple(keys.shape)}")
    B, H, S, D = keys.shape
    described = (("kmax", kmax), ("kmin", kmin)) + ((("kmean", kmean),) if kmean is not None else ())
    check_descriptors(described, scale, keys, block_size)
    described += (("scale", scale),) if scale is not None else ()
    if length.shape != (B,):
        raise ValueError(f"expected length of shape [{B}], got {tuple(length.shape)}")
    if block_size & (block_size - 1) or D & (D - 1):
        raise ValueError(f"expected block_size and head_dim powers of two, got {block_size} and {D}")
    if n_new < 1:
        raise ValueError(f"expected n_new >= 1, got {n_new}")
    for name, t in (("keys", keys), ("length", length), *described):
        check_device(name, t, keys.device)
    touched = (n_new + block_size - 2) // block_size + 1
    with launch_context(keys.device):
        _block_descriptors_kernel[(B * H, touched)](
            keys, kmax, kmin, kmax if kmean is None else kmean, length if scale is None else scale, length, H, n_new,
            keys.stride(0), keys.stride(1), keys.stride(2), kmax.stride(0), kmax.stride(1), kmax.stride(2),
            0 if scale is None else scale.stride(0), 0 if scale is None else scale.stride(1),
            BLOCK=block_size, HEAD_DIM=D, MEAN=kmean is not None, FOLD=fold_mean, QUANT=scale is not None,
            num_warps=4 if block_size * D >= 4096 else 2,
        )
