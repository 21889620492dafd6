"""Triton KV append: one program per (batch, kv head, new token) writes its key and value rows; with DESCRIBE
(one new token), the same program recomputes the touched block's max / min (/ mean) from the block's other
cached keys and the new key it holds in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._gdc import grid_dependency_wait, use_pdl
from kernels.block_descriptors.triton import check_descriptors, store_block_descriptors
from kernels._triton_common import check_device, launch_context


@triton.jit
def _append_kv_kernel(
    K, V, KNew, VNew, Pos, Kmax, Kmin, Kmean, Scale, Length, n_kv_heads,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_nb, stride_nh, stride_nt, stride_wb, stride_wh, stride_wt, stride_db, stride_dh, stride_dn,
    stride_sb, stride_sh,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK: tl.constexpr,
    DESCRIBE: tl.constexpr, MEAN: tl.constexpr, FOLD: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency_wait(PDL)
    pid_bh = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    in_d = offs_d < D
    k = tl.load(KNew + b * stride_nb + h * stride_nh + t * stride_nt + offs_d, mask=in_d)
    v = tl.load(VNew + b * stride_wb + h * stride_wh + t * stride_wt + offs_v, mask=offs_v < DV)
    k_row = K + b * stride_kb + h * stride_kh
    tl.store(k_row + pos * stride_ks + offs_d, k.to(K.dtype.element_ty), mask=in_d)
    tl.store(V + b * stride_vb + h * stride_vh + pos * stride_vs + offs_v, v.to(V.dtype.element_ty),
             mask=offs_v < DV)
    if DESCRIBE:
        length = tl.load(Length + b).to(tl.int64)
        blk = (length - 1) // BLOCK
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        valid = offs < length
        new = offs == pos
        # The block's other keys from the cache; the new one from registers (this program's own store is not
        # ordered before its loads).
        rows = tl.load(k_row + offs[:, None] * stride_ks + offs_d[None, :],
                       mask=(valid & ~new)[:, None] & in_d[None, :], other=0.0)
        rows = tl.where(new[:, None], k.to(rows.dtype)[None, :], rows)
        store_block_descriptors(Kmax, Kmin, Kmean, b * stride_db + h * stride_dh + blk * stride_dn + offs_d, rows,
                                valid, tl.minimum(length - blk * BLOCK, BLOCK), in_d, MEAN, FOLD,
                                Scale + b * stride_sb + h * stride_sh + blk, blk >= 0, QUANT)


def append_kv_triton(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                     position: torch.Tensor, *, descriptors: tuple | None = None, length: torch.Tensor | None = None,
                     block_size: int = 16, fold_mean: bool = False,
                     descriptor_scale: torch.Tensor | None = None) -> None:
    """Same contract as reference.append_kv; CUDA-graph capturable."""
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"expected keys [B, Hkv, S, D] and values [B, Hkv, S, Dv], got {tuple(keys.shape)} and "
                         f"{tuple(values.shape)}")
    B, H, S, D = keys.shape
    DV = values.shape[3]
    T = key_states.shape[2] if key_states.dim() == 4 else -1
    if key_states.shape != (B, H, T, D) or value_states.shape != (B, H, T, DV):
        raise ValueError(f"expected key_states [{B}, {H}, T, {D}] and value_states [{B}, {H}, T, {DV}], got "
                         f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
    if position.shape != (T,) or position.dtype != torch.int64:
        raise ValueError(f"expected position of shape [{T}] int64, got {tuple(position.shape)} {position.dtype}")
    described = ()
    if descriptors is not None:
        kmax, kmin, kmean = descriptors
        described = (("kmax", kmax), ("kmin", kmin)) + ((("kmean", kmean),) if kmean is not None else ())
        check_descriptors(described, descriptor_scale, keys, block_size)
        described += (("descriptor_scale", descriptor_scale),) if descriptor_scale is not None else ()
        if length is None or length.shape != (B,):
            raise ValueError(f"expected length of shape [{B}], got {None if length is None else tuple(length.shape)}")
        if block_size & (block_size - 1):
            raise ValueError(f"expected block_size a power of two, got {block_size}")
        described += (("length", length),)
    for name, t in (("keys", keys), ("values", values), ("key_states", key_states), ("value_states", value_states),
                    ("position", position), *described):
        check_device(name, t, keys.device)
    dummy = keys
    kmax, kmin, kmean = descriptors if descriptors is not None else (dummy, dummy, None)
    pdl = use_pdl(keys.device)
    with launch_context(keys.device):
        _append_kv_kernel[(B * H, T)](
            keys, values, key_states, value_states, position, kmax, kmin, kmax if kmean is None else kmean,
            position if descriptor_scale is None else descriptor_scale, length if length is not None else position, H,
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            key_states.stride(0), key_states.stride(1), key_states.stride(2),
            value_states.stride(0), value_states.stride(1), value_states.stride(2),
            kmax.stride(0), kmax.stride(1), kmax.stride(2),
            0 if descriptor_scale is None else descriptor_scale.stride(0),
            0 if descriptor_scale is None else descriptor_scale.stride(1),
            D=D, DV=DV, D_PAD=triton.next_power_of_2(D), DV_PAD=triton.next_power_of_2(DV), BLOCK=block_size,
            DESCRIBE=descriptors is not None, MEAN=kmean is not None, FOLD=fold_mean,
            QUANT=descriptor_scale is not None, PDL=pdl, launch_pdl=pdl,
            num_warps=4 if descriptors is not None and block_size * D >= 4096 else (2 if descriptors else 1),
        )
