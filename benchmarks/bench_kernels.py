"""Kernel benchmarks on a GPU: decode_attention (Triton vs SDPA), chunk_attention (Flex vs SDPA reference),
vote_attention, ltri-stream's span kernels (span_candidates, span_rows, farthest_point; Triton vs reference), its
block loads (gather_blocks from pinned host memory vs a copy per block), its block scores (index_scores), the
rotations of re-assigned positions (rotary) and the decode step's one-token projections (gemv).

    python benchmarks/bench_kernels.py --out results.json

Decode: one token per sequence, B=1, bf16, against a static buffer of --capacity tokens (the decode setting:
the cache is sized for the whole context). GB/s counts the K+V bytes of the valid prefix only, so a method
that reads the whole buffer shows as low bandwidth. Vote attention: one ltri-stream prefill chunk of T queries
over W rows (positions shuffled, the chunk's own rows last), out + votes + own map. Span kernels: a chunk's
maps (the query side, 4 maps of 128 rows per layer) and a chunk's evicted blocks over every layer of the 8B shape
(128 maps; farthest-point over their keys, 1,024 features, 48 slots); the references include their host work.
Block loads: one layer's 16 retrieval slots of the 8B shape (8 KV heads x 128 tokens x 128) from 1,024 pinned
blocks, bf16 or fp8 with scales; the per-block path is ContextMemory.load's (two async copies a block, or a copy and
a dequantisation for fp8). Block scores: one layer's retrieval of the 8B shape (192 query vectors over the index
vectors of a 128K or 1M-token document, 12 a 128-token block). Rotations: one layer's rows of the 8B shape (8 KV
heads, 6,784 rows, head_dim 128, bf16) from a 6,784-row table. Times are do_bench medians in ms: these kernels
replace chains of small operations, so the reference's time is mostly its launches. GEMV: each projection of the
Qwen3-1.7B and Llama-3.1-8B shapes (q/k/v and gate/up fused, as the decode step runs them), 8 distinct weights in
a row in one CUDA graph (a step's GEMVs read weights that are not in L2), Triton against F.linear (cuBLAS), us
per GEMV.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.ltri.memory import ContextMemory  # noqa: E402
from kernels.chunk_attention.flex import chunk_attention_flex  # noqa: E402
from kernels.chunk_attention.reference import chunk_attention as chunk_reference  # noqa: E402
from kernels.gemv.triton import gemv_triton  # noqa: E402
from kernels.decode_attention.triton import decode_attention_triton, num_splits_for  # noqa: E402
from kernels.farthest_point import farthest_point_reference  # noqa: E402
from kernels.farthest_point.triton import farthest_point_triton  # noqa: E402
from kernels.gather_blocks.triton import gather_blocks_triton  # noqa: E402
from kernels.index_scores import index_scores_reference  # noqa: E402
from kernels.index_scores.triton import index_scores_triton  # noqa: E402
from kernels.rotary import rotate_rows_reference  # noqa: E402
from kernels.rotary.triton import rotate_rows_triton  # noqa: E402
from kernels.span_candidates import span_candidates_reference  # noqa: E402
from kernels.span_candidates.triton import span_candidates_triton  # noqa: E402
from kernels.span_rows import span_rows_reference  # noqa: E402
from kernels.span_rows.triton import span_rows_triton  # noqa: E402
from kernels.vote_attention import vote_attention_reference  # noqa: E402
from kernels.vote_attention.triton import vote_attention_triton  # noqa: E402

# name: (Hq, Hkv, D)
SHAPES = {"llama-3.1-8b": (32, 8, 128), "gemma3-270m": (4, 1, 256)}
VOTE_SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64), "gemma3-270m": (4, 1, 256)}
VOTE_T, VOTE_W = 512, 6784
DECODE_LENGTHS = [4096, 32768, 131072, 262144]
CHUNK_OFFSETS = [0, 32768, 122880]


def bench_decode(shape: str, length: int, capacity: int) -> dict:
    Hq, Hkv, D = SHAPES[shape]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, Hq, D, **opts)
    k = torch.randn(1, Hkv, capacity, D, **opts)
    v = torch.randn(1, Hkv, capacity, D, **opts)
    length_t = torch.tensor([length], device="cuda")
    scale = D**-0.5
    full_mask = (torch.arange(capacity, device="cuda") < length)[None, None, None, :]
    q4 = q[:, :, None]  # [B, Hq, 1, D] for SDPA
    fns = {
        "triton": lambda: decode_attention_triton(q, k, v, length_t, scale=scale),
        "sdpa_valid_slice": lambda: F.scaled_dot_product_attention(
            q4, k[:, :, :length], v[:, :, :length], scale=scale, enable_gqa=True),
        "sdpa_full_buffer": lambda: F.scaled_dot_product_attention(
            q4, k, v, attn_mask=full_mask, scale=scale, enable_gqa=True),
    }
    ms = {name: do_bench(fn, warmup=25, rep=200, return_mode="median") for name, fn in fns.items()}
    # The decode loop replays a CUDA graph: this is the kernel without Python launch overhead.
    with torch.cuda.stream(torch.cuda.Stream()):
        ms["triton_graph"] = do_bench_cudagraph(fns["triton"], rep=200, return_mode="median")
    gbytes = 2 * Hkv * length * D * 2 / 1e9
    return {"op": "decode_attention", "shape": shape, "Hq": Hq, "Hkv": Hkv, "D": D, "length": length,
            "capacity": capacity, "num_splits": num_splits_for(1, Hkv, capacity, q.device),
            "ms": ms, "gb_per_s": {name: gbytes / (t / 1e3) for name, t in ms.items()}}


def bench_chunk(shape: str, offset: int, T: int, capacity: int) -> dict:
    Hq, Hkv, D = SHAPES[shape]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, Hq, T, D, **opts)
    k = torch.randn(1, Hkv, capacity, D, **opts)
    v = torch.randn(1, Hkv, capacity, D, **opts)
    scale = D**-0.5
    fns = {
        "flex": lambda: chunk_attention_flex(q, k, v, offset, scale=scale),
        "reference_sdpa": lambda: chunk_reference(q, k, v, offset, scale=scale),
    }
    ms = {name: do_bench(fn, warmup=5, rep=100, return_mode="median") for name, fn in fns.items()}
    # Causal FLOPs: 2 matmuls of 2*D per visible (query, key) pair.
    pairs = T * offset + T * (T + 1) / 2
    tflops = 4 * Hq * D * pairs / 1e12
    return {"op": "chunk_attention", "shape": shape, "Hq": Hq, "Hkv": Hkv, "D": D, "T": T, "offset": offset,
            "capacity": capacity, "ms": ms, "tflop_per_s": {n: tflops / (t / 1e3) for n, t in ms.items()}}


def bench_vote(shape: str, T: int, W: int) -> dict:
    Hq, Hkv, D = VOTE_SHAPES[shape]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    offset = 32768
    q = torch.randn(1, T, Hq, D, **opts).transpose(1, 2)  # the model's layout: a transposed view
    # Views of a row buffer larger than W, as ltri-stream passes them.
    k = torch.randn(1, Hkv, W + 512, D, **opts)[:, :, :W]
    v = torch.randn(1, Hkv, W + 512, D, **opts)[:, :, :W]
    older = torch.randperm(offset, device="cuda")[:W - T]
    key_pos = torch.cat([older, torch.arange(offset, offset + T, device="cuda")])
    scale = D**-0.5
    fns = {
        "triton": lambda: vote_attention_triton(q, k, v, key_pos, offset, scale=scale, n_own=T),
        "reference": lambda: vote_attention_reference(q, k, v, key_pos, offset, scale=scale, n_own=T),
    }
    ms = {name: do_bench(fn, warmup=5, rep=100, return_mode="median") for name, fn in fns.items()}
    # Both passes: QK^T and PV in the forward, QK^T again in the votes pass (2*D FLOPs per matmul and pair).
    tflops = 3 * 2 * Hq * D * T * W / 1e12
    return {"op": "vote_attention", "shape": shape, "Hq": Hq, "Hkv": Hkv, "D": D, "T": T, "W": W, "ms": ms,
            "tflop_per_s": {n: tflops / (t / 1e3) for n, t in ms.items()}}


def bench_spans(m: int, n: int = 128, feats: int = 1024, slots: int = 48) -> dict:
    """m causal maps of n rows (softmax attention summed over 4 heads), their candidates, rows and cover picks."""
    g = torch.Generator(device="cuda").manual_seed(42)
    causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    s = torch.randn(m, 4, n, n, device="cuda", generator=g).masked_fill(~causal, float("-inf"))
    maps = torch.softmax(s, dim=-1).sum(dim=1)
    theta = maps.flatten(1).quantile(0.9, dim=1).double()
    cands = span_candidates_reference(maps, theta, "row")
    votes = maps.sum(dim=1)
    keys = torch.randn(m, n, feats, device="cuda", dtype=torch.bfloat16, generator=g)
    ranges = torch.tensor([[0, n - 1]], device="cuda").repeat(m, slots, 1)
    fns = {
        "span_candidates": {"triton": lambda: span_candidates_triton(maps, theta, "row"),
                            "reference": lambda: span_candidates_reference(maps, theta, "row")},
        "span_rows": {"triton": lambda: span_rows_triton(cands, votes, 3.0, 12, 48, 0.1),
                      "reference": lambda: span_rows_reference(cands, votes, 3.0, 12, 48, 0.1)},
        "farthest_point": {"triton": lambda: farthest_point_triton(keys, votes, ranges),
                           "reference": lambda: farthest_point_reference(keys, votes, ranges)},
    }
    ms = {op: {name: do_bench(fn, warmup=5, rep=50, return_mode="median") for name, fn in impls.items()}
          for op, impls in fns.items()}
    return {"op": "ltri_spans", "maps": m, "n": n, "feats": feats, "slots": slots, "ms": ms}


def bench_gather(fp8: bool, slots: int = 16, heads: int = 8, block: int = 128, dim: int = 128,
                 stored: int = 1024) -> dict:
    """One layer's retrieval: `slots` blocks of a pinned context memory into the slot rows, every slot loading."""
    memory = ContextMemory(heads, block, dim, torch.bfloat16, pin=True, blocks=stored, fp8=fp8)
    for _ in range(stored // 64):
        memory.add(torch.randn(heads, 64 * block, dim, device="cuda", dtype=torch.bfloat16),
                   torch.randn(heads, 64 * block, dim, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    rows = torch.zeros(2, heads, slots * block, dim, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(stored, device="cuda")[:slots]
    host_ids = ids.tolist()
    src = (memory.keys.used, memory.values.used, memory.scales.used if fp8 else None)

    def per_block():
        for s, b in enumerate(host_ids):
            memory.load(b, rows[0, :, s * block:(s + 1) * block], rows[1, :, s * block:(s + 1) * block])

    fns = {"gather_blocks": lambda: gather_blocks_triton(rows[0], rows[1], *src[:2], ids, src[2]),
           "per_block_copies": per_block}
    ms = {name: do_bench(fn, warmup=5, rep=100, return_mode="median") for name, fn in fns.items()}
    moved = slots * memory.block_bytes
    return {"op": "gather_blocks", "fp8": fp8, "slots": slots, "heads": heads, "block": block, "dim": dim,
            "stored": stored, "bytes": moved, "ms": ms, "gb_per_s": {n: moved / (t / 1e3) / 1e9 for n, t in ms.items()}}


def bench_retrieval(tokens: int, A: int = 192, heads: int = 8, dim: int = 128, block: int = 128,
                    per_block: int = 12, rows: int = 6784) -> dict:
    """One layer and chunk: block scores over a document's index vectors, and a rotation and un-rotation of the
    rows (the 8B shape)."""
    g = torch.Generator(device="cuda").manual_seed(42)
    n_blocks = tokens // block
    N = n_blocks * per_block
    query = torch.randn(A, heads, dim, device="cuda", generator=g)
    chosen = torch.rand(A, device="cuda", generator=g) < 0.8
    vectors = torch.randn(N, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    blocks = torch.arange(n_blocks, device="cuda").repeat_interleave(per_block)
    offsets = torch.randint(0, block, (N,), device="cuda", generator=g)
    x = torch.randn(1, heads, rows, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    positions = torch.randperm(rows, device="cuda", generator=g)
    angle = torch.arange(rows, device="cuda")[:, None] * 500000.0 ** (-torch.arange(0, dim, 2, device="cuda") / dim)
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1).contiguous(), torch.cat([angle.sin()] * 2, dim=-1).contiguous()
    args = (query, vectors, blocks, offsets, n_blocks, chosen)
    fns = {
        "index_scores": {"triton": lambda: index_scores_triton(*args),
                         "reference": lambda: index_scores_reference(*args)},
        "rotate": {"triton": lambda: rotate_rows_triton(x, positions, cos, sin),
                   "reference": lambda: rotate_rows_reference(x, positions, cos, sin)},
        "unrotate": {"triton": lambda: rotate_rows_triton(x, positions, cos, sin, inverse=True),
                     "reference": lambda: rotate_rows_reference(x, positions, cos, sin, inverse=True)},
    }
    ms = {op: {name: do_bench(fn, warmup=5, rep=50, return_mode="median") for name, fn in impls.items()}
          for op, impls in fns.items()}
    return {"op": "ltri_retrieval", "tokens": tokens, "index_vectors": N, "query_vectors": A, "rows": rows, "ms": ms}


GEMV_SHAPES = {"qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048),
                               "down": (2048, 6144)},
               "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                "down": (4096, 14336)}}


def bench_gemv(shape: str, name: str, n_weights: int = 8) -> dict:
    N, K = GEMV_SHAPES[shape][name]
    x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(n_weights)]
    torch.testing.assert_close(gemv_triton(x, weights[0]), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
    fns = {"triton": lambda: [gemv_triton(x, w) for w in weights],
           "cublas": lambda: [F.linear(x, w) for w in weights]}
    if name in ("qkv", "gate_up"):
        # The decode step folds the layer's RMSNorm into these two (Llama, Mistral, Qwen layers).
        norm = (torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-6)
        fns["triton_norm"] = lambda: [gemv_triton(x, w, None, norm) for w in weights]
    if name == "gate_up":
        # And forms silu(gate) * up as it stores (half the output, the activation's kernel gone).
        fns["triton_norm_silu"] = lambda: [gemv_triton(x, w, None, norm, "silu") for w in weights]
    with torch.cuda.stream(torch.cuda.Stream()):
        us = {k: do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / n_weights for k, fn in fns.items()}
    return {"op": "gemv", "shape": shape, "projection": name, "N": N, "K": K, "us": us,
            "tb_per_s": {k: N * K * 2 / v / 1e6 for k, v in us.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--capacity", type=int, default=max(DECODE_LENGTHS), help="decode buffer size S")
    parser.add_argument("--only", choices=["spans", "gather", "retrieval", "gemv"], help="run only these benchmarks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device")

    rows = []
    if args.only is None:
        print(f"{'shape':<13} {'length':>7} " + " ".join(f"{m:>24}" for m in
              ("triton ms (GB/s)", "triton_graph ms (GB/s)", "sdpa_valid_slice", "sdpa_full_buffer")), flush=True)
        for shape in SHAPES:
            for length in DECODE_LENGTHS:
                r = bench_decode(shape, length, max(args.capacity, length))
                rows.append(r)
                cells = (f"{r['ms'][m]:8.3f} ({r['gb_per_s'][m]:6.0f})" for m in
                         ("triton", "triton_graph", "sdpa_valid_slice", "sdpa_full_buffer"))
                print(f"{shape:<13} {length:>7} " + " ".join(f"{c:>24}" for c in cells), flush=True)
                torch.cuda.empty_cache()

        T = 4096
        print(f"\n{'shape':<13} {'offset':>7} {'T':>5} {'flex ms (TFLOP/s)':>22} {'reference ms (TFLOP/s)':>24}")
        for offset in CHUNK_OFFSETS:
            r = bench_chunk("llama-3.1-8b", offset, T, capacity=131072)
            rows.append(r)
            print(f"{r['shape']:<13} {offset:>7} {T:>5} "
                  f"{r['ms']['flex']:10.3f} ({r['tflop_per_s']['flex']:6.1f}) "
                  f"{r['ms']['reference_sdpa']:12.3f} ({r['tflop_per_s']['reference_sdpa']:6.1f})", flush=True)

        print(f"\n{'shape':<13} {'T':>5} {'W':>6} {'triton ms (TFLOP/s)':>22} {'reference ms (TFLOP/s)':>24}")
        for shape in VOTE_SHAPES:
            r = bench_vote(shape, VOTE_T, VOTE_W)
            rows.append(r)
            print(f"{shape:<13} {VOTE_T:>5} {VOTE_W:>6} "
                  f"{r['ms']['triton']:10.3f} ({r['tflop_per_s']['triton']:6.1f}) "
                  f"{r['ms']['reference']:12.3f} ({r['tflop_per_s']['reference']:6.1f})", flush=True)
            torch.cuda.empty_cache()

    if args.only in (None, "spans"):
        print(f"\n{'maps':>5} " + " ".join(f"{op + ' triton / reference ms':>40}" for op in
              ("span_candidates", "span_rows", "farthest_point")))
        for m in (4, 128):
            r = bench_spans(m)
            rows.append(r)
            print(f"{m:>5} " + " ".join(f"{r['ms'][op]['triton']:18.3f} / {r['ms'][op]['reference']:8.3f}" + " " * 11
                                        for op in ("span_candidates", "span_rows", "farthest_point")), flush=True)

    if args.only in (None, "gather"):
        print(f"\n{'memory':>7} {'MB':>6} {'gather_blocks ms (GB/s)':>26} {'per-block copies ms (GB/s)':>28}")
        for fp8 in (False, True):
            r = bench_gather(fp8)
            rows.append(r)
            print(f"{'fp8' if fp8 else 'bf16':>7} {r['bytes'] / 1e6:6.1f} " + " ".join(
                f"{r['ms'][n]:14.3f} ({r['gb_per_s'][n]:6.1f})" for n in ("gather_blocks", "per_block_copies")),
                flush=True)

    if args.only in (None, "retrieval"):
        ops = ("index_scores", "rotate", "unrotate")
        print(f"\n{'tokens':>8} " + " ".join(f"{op + ' triton / reference ms':>36}" for op in ops))
        for tokens in (131072, 1048576):
            r = bench_retrieval(tokens)
            rows.append(r)
            cells = (f"{r['ms'][op]['triton']:14.3f} / {r['ms'][op]['reference']:8.3f}" + " " * 11 for op in ops)
            print(f"{tokens:>8} " + " ".join(cells), flush=True)

    if args.only in (None, "gemv"):
        print(f"\n{'shape':<13} {'projection':>10} {'N x K':>13} {'triton us (TB/s)':>18} {'cublas us (TB/s)':>18}"
              f" {'triton, norm folded':>20} {'norm and silu':>18}")
        for shape, projections in GEMV_SHAPES.items():
            for name in projections:
                r = bench_gemv(shape, name)
                rows.append(r)
                cells = (f"{r['us'][k]:9.2f} ({r['tb_per_s'][k]:4.2f})" + " " * 3
                         for k in ("triton", "cublas", "triton_norm", "triton_norm_silu") if k in r["us"])
                print(f"{shape:<13} {name:>10} {r['N']:>6}x{r['K']:<6} " + " ".join(cells), flush=True)

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
