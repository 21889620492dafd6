"""resa's kernel-level breakdown on a GPU (the paper's Figure 6): one decode step of one layer, per context.

    python benchmarks/bench_resa_kernels.py --out resa_kernels.json

For each model shape and context length (B=1, bf16, a buffer the size of the context): dense decode attention
(the Triton split-KV kernel), resa's estimation (descriptor update + block scores + top-k) and sparse
attention (block-sparse kernel + merge), the new token's K/V write with its block's descriptor refresh (one
kv_append launch against two index_copy_ calls and the descriptor kernel), and the rectification attention (32
queries over the whole cache) amortised over 32 steps, for our few-query kernel and for SDPA with an explicit mask. Times are medians of
CUDA-graph replays (triton.testing.do_bench_cudagraph), in ms, so launch overhead is excluded as in decoding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.block_descriptors import update_block_descriptors  # noqa: E402
from kernels.block_select import KeepRule, barrier_timeouts, new_histogram, new_sync, select_blocks  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.kv_append import append_kv  # noqa: E402
from kernels.sparse_decode_attention import sparse_decode_attention  # noqa: E402

# name: (Hq, Hkv, D)
SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen3-1.7b": (16, 8, 128)}
LENGTHS = [32768, 131072, 262144]
BLOCK, RECTIFY = 16, 32


def bench(shape: str, length: int, rule: KeepRule, int8: bool = False) -> dict:
    Hq, Hkv, D = SHAPES[shape]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, Hq, D, **opts)
    k = torch.randn(1, Hkv, length, D, **opts)
    v = torch.randn(1, Hkv, length, D, **opts)
    n_blocks = triton.cdiv(length, BLOCK)
    # As the engine keeps them: with the centroid, max + mean and min + mean (two descriptors, not three); with
    # int8, codes of a scale per block and head (the shipped profile's descriptor_dtype).
    kmax = torch.empty(1, Hkv, n_blocks, D, device="cuda", dtype=torch.int8 if int8 else torch.bfloat16)
    kmin = torch.empty_like(kmax)
    kscale = torch.empty(1, Hkv, n_blocks, device="cuda") if int8 else None
    fold = rule.centroid
    n = torch.tensor([length], device="cuda")
    update_block_descriptors(k, kmax, kmin, n, length, BLOCK, fold_mean=fold, scale=kscale)
    width = rule.keep(n_blocks)
    scale = D**-0.5
    histogram, sync = new_histogram(1, Hkv, "cuda"), new_sync(1, Hkv, "cuda")  # as the engine calls it

    def select(fused: bool = True):
        return select_blocks(q, kmax, kmin, n, block_size=BLOCK, rule=rule, width=width, scale=scale, folded=fold,
                             histogram=histogram, descriptor_scale=kscale, sync=sync if fused else None)

    blocks = select()
    q_rect = torch.randn(1, Hq, RECTIFY, D, **opts)
    pos = torch.arange(length, device="cuda")
    rect_mask = pos[None, :] <= (length - RECTIFY + torch.arange(RECTIFY, device="cuda"))[:, None]

    k_new, v_new = torch.randn(1, Hkv, 1, D, **opts), torch.randn(1, Hkv, 1, D, **opts)
    last = n - 1

    def kv_write_separate():
        k.index_copy_(2, last, k_new)
        v.index_copy_(2, last, v_new)
        update_block_descriptors(k, kmax, kmin, n, 1, BLOCK, fold_mean=fold, scale=kscale)

    def estimation():
        update_block_descriptors(k, kmax, kmin, n, 1, BLOCK, fold_mean=fold, scale=kscale)
        select()

    fns = {
        "dense_attention": lambda: decode_attention(q, k, v, n, scale=scale),
        "estimation": estimation,
        "descriptor_update": lambda: update_block_descriptors(k, kmax, kmin, n, 1, BLOCK, fold_mean=fold, scale=kscale),
        "select": select,
        "select_without_sync": lambda: select(False),
        "kv_write_and_descriptors_separate": kv_write_separate,
        "kv_write_and_descriptors_fused": lambda: append_kv(k, v, k_new, v_new, last, descriptors=(kmax, kmin, None),
                                                            length=n, block_size=BLOCK, fold_mean=fold,
                                                            descriptor_scale=kscale),
        "sparse_attention": lambda: sparse_decode_attention(q, k, v, blocks, n, block_size=BLOCK, scale=scale),
        "rectify_attention_triton": lambda: decode_attention(q_rect, k, v, n, scale=scale),
        "rectify_attention_sdpa": lambda: F.scaled_dot_product_attention(
            q_rect, k, v, attn_mask=rect_mask, scale=scale, enable_gqa=True),
    }
    with torch.cuda.stream(torch.cuda.Stream()):
        ms = {name: do_bench_cudagraph(fn, rep=100, return_mode="median") for name, fn in fns.items()}
    resa = ms["estimation"] + ms["sparse_attention"]
    rectify = min(ms["rectify_attention_triton"], ms["rectify_attention_sdpa"]) / RECTIFY
    kv_bytes = 2 * Hkv * length * D * 2
    return {"shape": shape, "Hq": Hq, "Hkv": Hkv, "D": D, "length": length, "kept_blocks": width, "int8": int8,
            "n_blocks": n_blocks, "ms": ms, "estimation_plus_sparse_ms": resa,
            "rectification_amortised_ms": rectify,
            "speedup_estimation_plus_sparse_vs_dense": ms["dense_attention"] / resa,
            "speedup_with_rectification_vs_dense": ms["dense_attention"] / (resa + rectify),
            "dense_gb_per_s": kv_bytes / 1e9 / (ms["dense_attention"] / 1e3)}


def sweep_sparse(shape: str = "llama-3.1-8b", length: int = 131072) -> list[dict]:
    """Tile, pipeline depth and programs per SM of the block-sparse kernel, at one shape and length."""
    import kernels.sparse_decode_attention.triton as sparse

    Hq, Hkv, D = SHAPES[shape]
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, Hq, D, **opts)
    k = torch.randn(1, Hkv, length, D, **opts)
    v = torch.randn(1, Hkv, length, D, **opts)
    rule = KeepRule(0.1, 16, 1)
    width = rule.keep(triton.cdiv(length, BLOCK))
    blocks = torch.sort(torch.randperm(triton.cdiv(length, BLOCK), device="cuda")[:width]).values
    blocks = blocks.to(torch.int32).expand(1, Hkv, -1).contiguous()
    n = torch.tensor([length], device="cuda")
    saved = (sparse._BLOCK_N, sparse._NUM_STAGES, sparse._PROGRAMS_PER_SM, sparse._NUM_WARPS)
    rows = []
    for block_n in (64, 128):
        for stages in (2, 3, 4):
            for per_sm in (2, 4, 8):
                for warps in (4, 8):
                    sparse._BLOCK_N, sparse._NUM_STAGES, sparse._PROGRAMS_PER_SM, sparse._NUM_WARPS = \
                        block_n, stages, per_sm, warps
                    fn = lambda: sparse_decode_attention(q, k, v, blocks, n, block_size=BLOCK, scale=D**-0.5)  # noqa: E731
                    try:
                        with torch.cuda.stream(torch.cuda.Stream()):
                            ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
                    except Exception as e:  # a config that does not fit (shared memory) is skipped
                        print(f"sparse BLOCK_N {block_n} stages {stages} per_sm {per_sm} warps {warps}: {e}")
                        continue
                    rows.append({"block_n": block_n, "stages": stages, "programs_per_sm": per_sm, "warps": warps,
                                 "ms": ms})
                    print(f"sparse BLOCK_N {block_n} stages {stages} per_sm {per_sm} warps {warps}: {ms:.4f} ms",
                          flush=True)
    sparse._BLOCK_N, sparse._NUM_STAGES, sparse._PROGRAMS_PER_SM, sparse._NUM_WARPS = saved
    return rows


def _selection_inputs(shape: str, length: int, rule: KeepRule, int8: bool) -> tuple:
    """(q, kmax, kmin, length tensor, select_blocks keywords) of one layer, descriptors as the engine keeps them."""
    Hq, Hkv, D = SHAPES[shape]
    q = torch.randn(1, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, Hkv, length, D, device="cuda", dtype=torch.bfloat16)
    n_blocks = triton.cdiv(length, BLOCK)
    kmax, kmin = (torch.empty(1, Hkv, n_blocks, D, device="cuda", dtype=torch.int8 if int8 else torch.bfloat16)
                  for _ in range(2))
    kscale = torch.empty(1, Hkv, n_blocks, device="cuda") if int8 else None
    n = torch.tensor([length], device="cuda")
    update_block_descriptors(k, kmax, kmin, n, length, BLOCK, fold_mean=rule.centroid, scale=kscale)
    args = dict(block_size=BLOCK, rule=rule, width=rule.keep(n_blocks), scale=D**-0.5, folded=rule.centroid,
                histogram=new_histogram(1, Hkv, "cuda"), descriptor_scale=kscale)
    return q, kmax, kmin, n, args


def sweep_select(lengths: list[int], rule: KeepRule, shape: str = "llama-3.1-8b", int8: bool = False) -> list[dict]:
    """Block selection with the histogram, as the engine calls it (one layer, median ms): the scoring tile and
    warps, then the one-program top-k's warps (mean pooling; 0 = the launcher's rule), or softmax pooling as one
    launch (with the sync words: the tile, warps, programs an SM and the bounds loop's pipelining). int8: int8 descriptors with their scale, as resa.yaml keeps them."""
    import kernels.block_select.triton as sel

    _, Hkv, D = SHAPES[shape]
    names = ("_DOT_ELEMENTS", "_SCORE_WARPS", "_TOPK_WARPS", "_FUSED_WARPS", "_FUSED_PROGRAMS_PER_SM",
             "_FUSED_STAGES")
    saved = {name: getattr(sel, name) for name in names}
    rows = []
    for length in lengths:
        q, kmax, kmin, n, args = _selection_inputs(shape, length, rule, int8)
        expected = sel.select_blocks_triton(q, kmax, kmin, n, **args)
        configs = [{"_DOT_ELEMENTS": t * D, "_SCORE_WARPS": w} for t in (32, 64, 128) for w in (2, 4, 8)]
        if rule.pooling == "softmax":
            configs += [{"sync": True, "_DOT_ELEMENTS": t * D, "_FUSED_WARPS": w, "_FUSED_PROGRAMS_PER_SM": p,
                         "_FUSED_STAGES": st} for t in (32, 64, 128) for w in (4, 8) for p in (1, 2) for st in (1, 3)]
        else:
            configs += [{"_TOPK_WARPS": w} for w in (4, 8, 16, 32)]
        for config in configs:
            for name, value in {**saved, **config}.items():
                if name != "sync":
                    setattr(sel, name, value)
            sync = new_sync(1, Hkv, "cuda") if config.get("sync") else None
            fn = lambda: sel.select_blocks_triton(q, kmax, kmin, n, sync=sync, **args)  # noqa: E731
            try:
                same = torch.equal(fn(), expected)
                with torch.cuda.stream(torch.cuda.Stream()):
                    ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
            except Exception as e:  # a config that does not compile is reported and skipped
                print(f"select {length} {config}: {type(e).__name__}: {e}"[:300])
                continue
            if sync is not None:
                config["barriers_given_up"] = barrier_timeouts(sync)
            rows.append({"length": length, **config, "ms": ms, "same_blocks_as_default": same})
            print(f"select {length} {config}: {ms:.4f} ms same={same}", flush=True)
        for name, value in saved.items():
            setattr(sel, name, value)
    return rows


def fused_phases(lengths: list[int], rule: KeepRule, shape: str = "qwen3-1.7b", int8: bool = False) -> list[dict]:
    """The fused selection's time up to each of its four phases (the kernel stopped after phase 1..4: bounds, pooled
    scores, the k-th bin and counts, the output), over programs an SM, warps and the bounds loop's pipelining, next
    to the selection as separate launches (median us of CUDA-graph replays, one layer)."""
    import kernels.block_select.triton as sel

    _, Hkv, _ = SHAPES[shape]
    names = ("_FUSED_PROGRAMS_PER_SM", "_FUSED_WARPS", "_FUSED_STAGES", "_FUSED_LAST")
    saved = {name: getattr(sel, name) for name in names}
    rows = []
    for length in lengths:
        q, kmax, kmin, n, args = _selection_inputs(shape, length, rule, int8)
        expected = sel.select_blocks_triton(q, kmax, kmin, n, **args)
        with torch.cuda.stream(torch.cuda.Stream()):
            unfused = do_bench_cudagraph(lambda: sel.select_blocks_triton(q, kmax, kmin, n, **args), rep=100,
                                         return_mode="median") * 1e3
        for per_sm, warps, stages in ((1, 4, 1), (2, 4, 1), (3, 4, 1), (1, 4, 2), (2, 4, 2), (1, 4, 3), (2, 4, 3),
                                      (2, 8, 2)):
            sel._FUSED_PROGRAMS_PER_SM, sel._FUSED_WARPS, sel._FUSED_STAGES = per_sm, warps, stages
            sync = new_sync(1, Hkv, "cuda")
            fn = lambda: sel.select_blocks_triton(q, kmax, kmin, n, sync=sync, **args)  # noqa: E731
            us = []
            for last in (1, 2, 3, 4):
                sel._FUSED_LAST = last
                same = torch.equal(fn(), expected)
                with torch.cuda.stream(torch.cuda.Stream()):
                    us.append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3)
            row = {"length": length, "programs_per_sm": per_sm, "warps": warps, "stages": stages, "us_to_phase": us,
                   "same_blocks": same, "barriers_given_up": barrier_timeouts(sync), "unfused_us": unfused}
            rows.append(row)
            print(row, flush=True)
            for name, value in saved.items():
                setattr(sel, name, value)
    return rows


def sweep_rectify(lengths: list[int]) -> list[dict]:
    """Rows per program, warps and stages of the few-query kernel for rectification's G x 32 rows (median ms of
    one layer; rows 64 at 4 warps was the configuration before MANY_ROWS). Gemma 3's shape (4 heads on 1 KV
    head, head_dim 256) too."""
    import kernels.decode_attention.triton as dec

    saved = dict(dec.MANY_ROWS)
    rows = []
    for shape, (Hq, Hkv, D) in {**SHAPES, "gemma3-270m": (4, 1, 256)}.items():
        for length in lengths:
            opts = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(1, Hq, RECTIFY, D, **opts)
            k = torch.randn(1, Hkv, length, D, **opts)
            v = torch.randn(1, Hkv, length, D, **opts)
            n = torch.tensor([length], device="cuda")
            expected = None
            for per_program, warps, stages in ((64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2),
                                               (128, 8, 3), (64, 8, 2)):
                dec.MANY_ROWS.update(rows=per_program, warps=warps, stages=stages)
                fn = lambda: decode_attention(q, k, v, n, scale=D**-0.5)  # noqa: E731
                try:
                    out = fn()
                    expected = out if expected is None else expected
                    err = (out.float() - expected.float()).abs().max().item()
                    with torch.cuda.stream(torch.cuda.Stream()):
                        ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
                except Exception as e:  # a config that does not fit (registers, shared memory) is skipped
                    print(f"rectify {shape} {length} rows {per_program} warps {warps} stages {stages}: "
                          f"{type(e).__name__}: {e}"[:300])
                    continue
                rows.append({"shape": shape, "length": length, "rows_per_program": per_program, "warps": warps,
                             "stages": stages, "ms": ms, "max_diff_vs_first": err})
                print(f"rectify {shape} {length} rows {per_program} warps {warps} stages {stages}: {ms:.4f} ms "
                      f"diff {err:.1e}", flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    dec.MANY_ROWS.update(saved)
    return rows


def sweep_rectify_launch(lengths: list[int]) -> list[dict]:
    """The few-query kernel's whole launch for rectification's G x 32 rows at each shape: keys a tile, warps,
    stages and programs an SM (the splits), with the rows a program as launch_config picks them (median ms of one
    layer, in a CUDA graph with its merge)."""
    import kernels.decode_attention.triton as dec

    names = ("_BLOCK_N", "_PROGRAMS_PER_SM", "_NUM_WARPS", "_FEW_QUERY_STAGES")
    saved, saved_many = {n: getattr(dec, n) for n in names}, dict(dec.MANY_ROWS)
    rows = []
    for shape, (Hq, Hkv, D) in SHAPES.items():
        for length in lengths:
            opts = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(1, Hq, RECTIFY, D, **opts)
            k, v = torch.randn(1, Hkv, length, D, **opts), torch.randn(1, Hkv, length, D, **opts)
            n = torch.tensor([length], device="cuda")
            fn = lambda: decode_attention(q, k, v, n, scale=D**-0.5)  # noqa: E731
            expected = fn().float()
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        for per_sm in (1, 2, 3, 4):
                            values = dict(zip(names, (block_n, per_sm, warps, stages)))
                            for name, value in values.items():
                                setattr(dec, name, value)
                            dec.MANY_ROWS.update(warps=warps, stages=stages, block_n=block_n, programs_per_sm=per_sm)
                            try:
                                err = (fn().float() - expected).abs().max().item()
                                with torch.cuda.stream(torch.cuda.Stream()):
                                    ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
                            except Exception as e:  # registers or shared memory: skipped
                                print(f"{shape} {length} {values}: {type(e).__name__}"[:200])
                                continue
                            rows.append({"shape": shape, "length": length, "block_n": block_n, "warps": warps,
                                         "stages": stages, "programs_per_sm": per_sm, "ms": ms,
                                         "max_diff_vs_shipped": err, "gb_per_s": 4 * Hkv * length * D / ms / 1e6})
                            print(rows[-1], flush=True)
            for name, value in saved.items():
                setattr(dec, name, value)
            dec.MANY_ROWS.update(saved_many)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep-ratio", type=float, default=0.1)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated context lengths")
    parser.add_argument("--pooling", default="mean", choices=("mean", "softmax"))
    parser.add_argument("--centroid", action="store_true",
                        help="the block mean key folded into max and min, as resa.yaml's rule keeps it")
    parser.add_argument("--int8", action="store_true",
                        help="int8 descriptors with a scale per block and head (resa.yaml's descriptor_dtype)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=tuple(SHAPES), help="the sweeps' model shape")
    parser.add_argument("--sweep-sparse", action="store_true", help="only sweep the sparse kernel's tiling")
    parser.add_argument("--sweep-select", action="store_true", help="only sweep the selection's tiling and search")
    parser.add_argument("--sweep-rectify", action="store_true", help="only sweep the rectification kernel's rows")
    parser.add_argument("--sweep-rectify-launch", action="store_true",
                        help="only sweep the rectification kernel's key tile, warps, stages and splits")
    parser.add_argument("--fused-phases", action="store_true",
                        help="only time the fused selection's phases (softmax pooling) over its launch settings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/bench_resa_kernels.py needs a CUDA device")
    meta = {"device": torch.cuda.get_device_name(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python3", *sys.argv])}
    if args.sweep_sparse:
        rows = sweep_sparse(args.shape, int(args.lengths.split(",")[0]))
        if args.out:
            args.out.write_text(json.dumps({**meta, "shape": args.shape, "rows": rows}, indent=2) + "\n")
        return
    if args.sweep_rectify or args.sweep_rectify_launch:
        sweep = sweep_rectify_launch if args.sweep_rectify_launch else sweep_rectify
        rows = sweep(list(map(int, args.lengths.split(","))))
        if args.out:
            args.out.write_text(json.dumps({**meta, "rectify_tokens": RECTIFY, "rows": rows}, indent=2) + "\n")
        return
    rule = KeepRule(args.keep_ratio, 16, 1, 1, args.pooling, centroid=args.centroid)
    if args.fused_phases:
        rows = fused_phases(list(map(int, args.lengths.split(","))), rule, args.shape, args.int8)
        if args.out:
            args.out.write_text(json.dumps({**meta, "shape": args.shape, "rows": rows}, indent=2) + "\n")
        return
    if args.sweep_select:
        rows = sweep_select(list(map(int, args.lengths.split(","))), rule, args.shape, args.int8)
        if args.out:
            args.out.write_text(json.dumps({**meta, "shape": args.shape, "pooling": args.pooling,
                                            "centroid": args.centroid, "int8_descriptors": args.int8,
                                            "keep_ratio": args.keep_ratio, "rows": rows}, indent=2) + "\n")
        return
    rows = []
    cols = ("dense_attention", "descriptor_update", "select", "select_without_sync", "sparse_attention",
            "rectify_attention_triton",
            "rectify_attention_sdpa")
    print(f"{'shape':<13} {'length':>7} " + " ".join(f"{c[:16]:>16}" for c in cols) + "  speedup", flush=True)
    for shape in SHAPES:
        for length in map(int, args.lengths.split(",")):
            r = bench(shape, length, rule, args.int8)
            rows.append(r)
            print(f"{shape:<13} {length:>7} " + " ".join(f"{r['ms'][c]:16.4f}" for c in cols)
                  + f"  {r['speedup_estimation_plus_sparse_vs_dense']:.2f}x", flush=True)
            torch.cuda.empty_cache()
    result = {**meta, "keep_ratio": args.keep_ratio, "pooling": args.pooling, "centroid": args.centroid,
              "int8_descriptors": args.int8,
              "sink_blocks": 1, "block_size": BLOCK, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
