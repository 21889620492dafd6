"""Triton GEMV for one token: y = W x (+ b), W [N, K] row-major, as a decode step's projections run it.

One program per BLOCK_N rows of W walks K in BLOCK_K steps (fp32 products, summed once at the end). At one
token cuBLAS picks GEMM tiles that leave the small projections well short of the memory bandwidth; this
kernel reads W in long contiguous rows. The weights never depend on the kernel before it in the step, so with
programmatic dependent launch a program loads its first W tile before it waits for that kernel, and only x
waits. On an H200 (CUDA graphs of 8 GEMVs on distinct weights; benchmarks/bench_kernels.py --only gemv):
Qwen3-1.7B's four projections take 31.5 us a layer against 40.4 with F.linear, Llama-3.1-8B's 111.9 against 123.6
(benchmarks/results/2026-11-28_h200_decode_gemv.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._gdc import use_pdl
from kernels._triton_common import check_device, launch_context

BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 8, 512, 8, 3
# (rows a program, K a step, warps) by weight shape [N, K] where an H200 sweep (8, 16, 32 rows x 256, 512 of K, 4
# or 8 warps; benchmarks/results/2026-11-28_h200_decode_gemv.json) found another at least 3% faster than the
# default: the program count's waves over the SMs make the best tile jump between neighbouring shapes, so measured
# shapes are listed rather than a rule guessed. Qwen3-1.7B's gate/up: 14.65 -> 12.63 µs; Llama-3.1-8B's q/k/v
# 16.02 -> 12.73, gate/up 57.07 -> 53.93, down 31.66 -> 30.35.
TUNED = {(12288, 2048): (32, 256, 8), (6144, 4096): (16, 512, 8), (28672, 4096): (16, 256, 4),
         (4096, 14336): (32, 512, 8)}


@triton.jit
def _gemv_fwd_kernel(X, W, B, Y, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_rows = rows < N
    w_ptr = W + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    # The first tile before waiting on the previous kernel: the weights are not its output.
    w = tl.load(w_ptr, mask=in_rows[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = w.to(tl.float32) * tl.load(X + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        in_k = k0 + offs_k < K
        w = tl.load(w_ptr + k0, mask=in_rows[:, None] & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * tl.load(X + k0 + offs_k, mask=in_k, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=in_rows)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.gemv for one row: x [..., K] with x.numel() == K; CUDA-graph capturable."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"expected a contiguous weight [N, K], got {tuple(weight.shape)} strides {weight.stride()}")
    N, K = weight.shape
    if x.shape[-1] != K or x.numel() != K or x.dtype != weight.dtype:
        raise ValueError(f"expected x of one row [..., {K}] in {weight.dtype}, got {tuple(x.shape)} {x.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != weight.dtype):
        raise ValueError(f"expected bias [{N}] in {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    x = x.contiguous()
    for name, t in (("x", x), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        check_device(name, t, weight.device)
    y = torch.empty(*x.shape[:-1], N, device=x.device, dtype=x.dtype)
    rows, step, warps = TUNED.get((N, K), (BLOCK_N, BLOCK_K, NUM_WARPS))
    pdl = use_pdl(weight.device)
    with launch_context(weight.device):
        _gemv_fwd_kernel[(triton.cdiv(N, rows),)](
            x, weight, bias if bias is not None else weight, y, N, K, HAS_BIAS=bias is not None, BLOCK_N=rows,
            BLOCK_K=step, PDL=pdl, launch_pdl=pdl, num_warps=warps, num_stages=NUM_STAGES,
        )
    return y
