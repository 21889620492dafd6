"""Triton GEMV for one token: y = W x (+ b), W [N, K] row-major, as a decode step's projections run it.

One program per BLOCK_N rows of W walks K in BLOCK_K steps (fp32 products, summed once at the end). At one
token cuBLAS picks GEMM tiles that leave the small projections well short of the memory bandwidth; this
kernel reads W in long contiguous rows. The weights never depend on the kernel before it in the step, so with
programmatic dependent launch a program loads its first W tile before it waits for that kernel, and only x
waits. On an H200 (CUDA graphs of 8 GEMVs on distinct weights): Qwen3-1.7B's four projections take 27.1 us a
layer (40.4 with F.linear), Llama-3.1-8B's 104.0 (123.6); chained as a layer's four, each reading the one before's
output, they stream 3.72 and 4.22 TB/s against a 4.27 TB/s copy (benchmarks/results/
2026-11-29_h200_gemv_tiles_and_residual_in_o_gemv.json.gz; F.linear: 2026-11-28_h200_decode_gemv.json).

With `norm` the RMSNorm before a projection (the Llama family's, as a decoder layer runs it before q/k/v and
before gate/up) is folded in: each program reads the whole row once for its RMS (a few KB, from L2), so the norm
needs no kernel of its own, nor the gap before the GEMV that a kernel without programmatic launch leaves.
With `act` the weight is a gated MLP's gate and up projections stacked ([2I, K]) and the kernel returns act(gate) *
up ([I]): a program's rows are half gate rows and the matching up rows, and it forms the product as it stores, so
the activation needs no kernel either, and the down projection's input is ready when the GEMV ends. With
`residual` the kernel adds the decoder layer's residual stream to what it stores (a decode step's o and down
projections: engines/decode_folds.residuals_into_gemvs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._gdc import use_pdl
from kernels._triton_common import check_device, launch_context

BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 8, 2048, 4, 3  # BLOCK_K at most: a row shorter than it is one tile
ACTIVATIONS = {"silu": 1, "gelu_tanh": 2}  # `act` names, as the kernel's ACT codes
# (rows a program, K a step, warps) by weight shape [N, K] where an H200 sweep (4-32 rows x 512-8192 of K, 4 or 8
# warps, each projection alone and the four chained as a layer: benchmarks/gemv_tiles.py; results/2026-11-29_
# h200_gemv_tiles_and_residual_in_o_gemv.json.gz) found another at least 3% faster than the default. A program's K
# step is one load, all of it in flight at once: long steps keep enough bytes in flight where a projection has few
# programs (Qwen3-1.7B's o and down: 4.19 -> 2.99 and 9.37 -> 6.82 µs against 8 rows x 512 at 8 warps), short ones
# where it has many (the gate/up GEMVs). The program count's waves over the SMs make the best tile jump between
# neighbouring shapes, so measured shapes are listed rather than a rule guessed.
TUNED = {(4096, 2048): (16, 1024, 8), (12288, 2048): (32, 256, 8), (6144, 4096): (16, 512, 8),
         (4096, 4096): (16, 1024, 8), (28672, 4096): (16, 256, 4), (4096, 14336): (16, 1024, 8)}


@triton.jit
def _row_input(X, G, offs_k, K, r, NORM: tl.constexpr):
    """x[offs_k] in fp32; with NORM, as transformers' Llama RMSNorm gives it: x * r rounded to x's dtype, times the
    norm's weight G, rounded again."""
    x = tl.load(X + offs_k, mask=offs_k < K, other=0.0)
    if NORM:
        g = tl.load(G + offs_k, mask=offs_k < K, other=0.0)
        x = (g.to(tl.float32) * (x.to(tl.float32) * r).to(x.dtype).to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _activation(x, ACT: tl.constexpr):
    """fp32 in and out: ACT 1 is SiLU, 2 GELU's tanh form (Gemma's gelu_pytorch_tanh)."""
    if ACT == 1:
        return x / (1.0 + tl.exp(-x))
    else:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))


@triton.jit
def _gemv_fwd_kernel(X, W, B, Y, G, R, N, K, eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, NORM: tl.constexpr, K_ALL: tl.constexpr, ACT: tl.constexpr,
                     RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    local = tl.arange(0, BLOCK_N)
    if ACT:
        # Gated: the first half of the program's rows are gate rows, the second half the up rows of the same
        # outputs (N // 2 further down the stacked weight).
        HALF: tl.constexpr = BLOCK_N // 2
        outs = tl.program_id(0) * HALF + local % HALF
        rows = outs + (local // HALF) * (N // 2)
        in_rows = outs < N // 2
    else:
        rows = tl.program_id(0) * BLOCK_N + local
        in_rows = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptr = W + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    # The first tile before waiting on the previous kernel: the weights are not its output.
    w = tl.load(w_ptr, mask=in_rows[:, None] & (offs_k < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = 1.0
    if NORM:
        # Every program reads the whole row (K_ALL >= K) for its RMS: the norm needs no launch of its own.
        offs_all = tl.arange(0, K_ALL)
        x_all = tl.load(X + offs_all, mask=offs_all < K, other=0.0).to(tl.float32)
        r = tl.math.rsqrt(tl.sum(x_all * x_all, 0) / K + eps)
    acc = w.to(tl.float32) * _row_input(X, G, offs_k, K, r, NORM)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        in_k = k0 + offs_k < K
        w = tl.load(w_ptr + k0, mask=in_rows[:, None] & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * _row_input(X, G, k0 + offs_k, K, r, NORM)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=in_rows, other=0.0).to(tl.float32)
    if ACT:
        # transformers' roundings: gate and up in the model's dtype, the activation rounded, then the product.
        y = y.to(Y.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, HALF)), (1, 0)))
        y = _activation(gate, ACT).to(Y.dtype.element_ty).to(tl.float32) * up
        rows = tl.program_id(0) * HALF + tl.arange(0, HALF)
        in_rows = rows < N // 2
    if RESIDUAL:
        # The decoder layer's residual + output, rounded as transformers' add of two tensors in the model's dtype.
        y = y.to(Y.dtype.element_ty).to(tl.float32) + tl.load(R + rows, mask=in_rows, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=in_rows)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                norm: tuple[torch.Tensor, float] | None = None, act: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.gemv for one row: x [..., K] with x.numel() == K; CUDA-graph capturable."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"expected a contiguous weight [N, K], got {tuple(weight.shape)} strides {weight.stride()}")
    N, K = weight.shape
    if act is not None and (act not in ACTIVATIONS or N % 2):
        raise ValueError(f"expected act in {sorted(ACTIVATIONS)} over stacked gate and up rows [2I, K], got {act!r} "
                         f"over {N} rows")
    if x.shape[-1] != K or x.numel() != K or x.dtype != weight.dtype:
        raise ValueError(f"expected x of one row [..., {K}] in {weight.dtype}, got {tuple(x.shape)} {x.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != weight.dtype):
        raise ValueError(f"expected bias [{N}] in {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    g, eps = norm if norm is not None else (None, 0.0)
    if g is not None and (g.shape != (K,) or g.dtype != weight.dtype or not g.is_contiguous()):
        raise ValueError(f"expected a contiguous norm weight [{K}] in {weight.dtype}, got {tuple(g.shape)} {g.dtype}")
    out = N // 2 if act else N
    if residual is not None and (residual.numel() != out or residual.dtype != x.dtype or not residual.is_contiguous()):
        raise ValueError(f"expected a contiguous residual of {out} values in {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    x = x.contiguous()
    operands = (("x", x), ("weight", weight), ("bias", bias), ("norm weight", g), ("residual", residual))
    for name, t in operands:
        if t is not None:
            check_device(name, t, weight.device)
    y = torch.empty(*x.shape[:-1], out, device=x.device, dtype=x.dtype)
    rows, step, warps = TUNED.get((N, K), (BLOCK_N, min(BLOCK_K, triton.next_power_of_2(K)), NUM_WARPS))
    pdl = use_pdl(weight.device)
    with launch_context(weight.device):
        _gemv_fwd_kernel[(triton.cdiv(N, rows),)](
            x, weight, bias if bias is not None else weight, y, g if g is not None else weight,
            residual if residual is not None else weight, N, K, float(eps),
            HAS_BIAS=bias is not None, BLOCK_N=rows, BLOCK_K=step, NORM=g is not None,
            K_ALL=triton.next_power_of_2(K) if g is not None else 1, ACT=ACTIVATIONS.get(act, 0),
            RESIDUAL=residual is not None, PDL=pdl, launch_pdl=pdl, num_warps=warps, num_stages=NUM_STAGES,
        )
    return y
