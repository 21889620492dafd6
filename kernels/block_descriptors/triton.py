"""Triton block-descriptor update: one program per (batch, kv head, touched block), `length` read on the device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_common import check_device, launch_context


@triton.jit
def _block_descriptors_kernel(
    K, Kmax, Kmin, Kmean, Length, n_kv_heads, n_new,
    stride_kb, stride_kh, stride_ks, stride_db, stride_dh, stride_dn,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MEAN: tl.constexpr, FOLD: tl.constexpr,
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
    keep = (blk * BLOCK < length) & (offs_d < HEAD_DIM)
    store_block_descriptors(Kmax, Kmin, Kmean, b * stride_db + h * stride_dh + blk * stride_dn + offs_d, k, valid,
                            tl.minimum(length - blk * BLOCK, BLOCK), keep, MEAN, FOLD)


@triton.jit
def store_block_descriptors(Kmax, Kmin, Kmean, dst, rows, valid, n_valid, mask, MEAN: tl.constexpr,
                            FOLD: tl.constexpr):
    """One block's descriptors from its keys rows [BLOCK, D] (valid: the n_valid rows holding keys), stored at
    dst where mask: max and min, and the mean kept apart (MEAN) or added to both in fp32 (FOLD)."""
    top = tl.max(tl.where(valid[:, None], rows, float("-inf")), 0)
    bottom = tl.min(tl.where(valid[:, None], rows, float("inf")), 0)
    if MEAN or FOLD:
        mean = tl.sum(tl.where(valid[:, None], rows.to(tl.float32), 0.0), 0) / tl.maximum(n_valid.to(tl.float32), 1.0)
        if FOLD:
            top = top.to(tl.float32) + mean
            bottom = bottom.to(tl.float32) + mean
        else:
            tl.store(Kmean + dst, mean.to(Kmean.dtype.element_ty), mask=mask)
    tl.store(Kmax + dst, top.to(Kmax.dtype.element_ty), mask=mask)
    tl.store(Kmin + dst, bottom.to(Kmin.dtype.element_ty), mask=mask)


def update_block_descriptors_triton(keys: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor,
                                    length: torch.Tensor, n_new: int, block_size: int,
                                    kmean: torch.Tensor | None = None, fold_mean: bool = False) -> None:
    """Same contract as reference.update_block_descriptors; CUDA-graph capturable."""
    if keys.dim() != 4:
        raise ValueError(f"expected keys of shape [B, Hkv, S, D], got {tuple(keys.shape)}")
    B, H, S, D = keys.shape
    nb = triton.cdiv(S, block_size)
    described = (("kmax", kmax), ("kmin", kmin)) + ((("kmean", kmean),) if kmean is not None else ())
    for name, t in described:
        if t.shape != (B, H, nb, D) or t.dtype != keys.dtype:
            raise ValueError(f"expected {name} of shape [{B}, {H}, {nb}, {D}] {keys.dtype}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if any(t.stride() != kmax.stride() for _, t in described):
        raise ValueError("expected kmax, kmin (and kmean) with the same strides")
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
            keys, kmax, kmin, kmax if kmean is None else kmean, length, H, n_new,
            keys.stride(0), keys.stride(1), keys.stride(2), kmax.stride(0), kmax.stride(1), kmax.stride(2),
            BLOCK=block_size, HEAD_DIM=D, MEAN=kmean is not None, FOLD=fold_mean,
            num_warps=4 if block_size * D >= 4096 else 2,
        )
