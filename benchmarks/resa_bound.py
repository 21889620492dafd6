"""How fast resa could decode at best, from measured runs: the upper bound on its speedup over dense.

    python benchmarks/resa_bound.py --speed results/X_resa_speed_....json --kernels results/Y_resa_kernels_....json \
        [--kernels results/Z_...json] --out results/resa_bound.json

No GPU: this reads committed measurements of one device. A decode step is the part both engines share (weights,
norms, projections, the graph; measured as dense's step minus dense's attention kernel times the layers) plus
the attention. resa's best case keeps the shared part as dense measured it and puts its own per-layer work
(descriptors, 10% of the KV) and the rectification's extra KV read (once per `rectify_every` tokens; its weight
read left out, as if folded into a decode step) at the run's measured copy bandwidth. A second bound also puts
the shared part at its floor (the weights at the copy bandwidth) in both engines. Kernel level: the bytes
selection plus sparse attention must read against dense attention's measured time.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

# The speed runs' random models (bench_resa_kernels.py's shapes): layers, KV heads, head_dim; bf16
SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen3-1.7b": (28, 8, 128)}
ELEM, BLOCK = 2, 16


def kernel_rows(paths: list[Path], shape: str) -> dict:
    """(pooling, centroid, context) -> the kernel bench's row of this shape (ms per layer)."""
    rows = {}
    for path in paths:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if row["shape"] == shape:
                rows[(data["pooling"], data["centroid"], row["length"])] = row
    return rows


def bound(dense: dict, resa: dict, kernels: dict, centroid: bool, bandwidth: float, keep: float,
          rectify_every: int, shape: str = "llama-3.1-8b", min_blocks: int = 16) -> dict:
    layers, hkv, head_dim = SHAPES[shape]
    ctx = dense["context_tokens"]
    # The kept share: keep_ratio, but at least min_blocks blocks (the shipped profile keeps 1,024).
    keep = max(keep, min(1.0, min_blocks * BLOCK / ctx))
    k_bytes = hkv * head_dim * ctx * ELEM  # one layer's keys
    dense_attention = layers * kernels["ms"]["dense_attention"]
    shared = dense["decode_ms_per_token"] - dense_attention
    weights = dense["roofline_ms"] - 1000 * layers * 2 * k_bytes / bandwidth  # the weights' share of the roofline
    counters = resa["counters"]
    descriptors = 3 if centroid else 2  # max, min (and mean): 1/16 of K each
    layer_bytes = descriptors * k_bytes / 16 + keep * 2 * k_bytes
    attention_floor = 1000 * layers * layer_bytes / bandwidth
    rectify_floor = 1000 * layers * 2 * k_bytes / bandwidth / rectify_every
    rect_measured = 1000 * counters["rectification_s"] / counters["rectifications"] / rectify_every
    best = shared + attention_floor + rectify_floor
    best_floor = weights + attention_floor + rectify_floor
    return {
        "context_tokens": ctx,
        "kept_share": keep,
        "dense_ms": dense["decode_ms_per_token"],
        "dense_attention_ms": dense_attention,
        "shared_ms_dense": shared,
        "resa_ms": resa["decode_ms_per_token"],
        "resa_median_ms": resa["decode_ms_median"],
        "resa_attention_ms": layers * kernels["ms"]["estimation"] + layers * kernels["ms"]["sparse_attention"],
        "shared_ms_resa": resa["decode_ms_median"] - layers * (kernels["ms"]["estimation"]
                                                                + kernels["ms"]["sparse_attention"]),
        "rectification_ms_per_token": rect_measured,
        "weights_floor_ms": weights,
        "resa_attention_floor_ms": attention_floor,
        "rectification_floor_ms_per_token": rectify_floor,
        "measured_speedup": dense["decode_ms_per_token"] / resa["decode_ms_per_token"],  # the run's profile
        "max_speedup_shared_as_measured": dense["decode_ms_per_token"] / best,
        "max_speedup_shared_at_floor": (weights + dense_attention) / best_floor,
        "kernel_dense_attention_us": 1000 * kernels["ms"]["dense_attention"],
        "kernel_resa_us": 1000 * kernels["estimation_plus_sparse_ms"],
        "kernel_floor_us": 1e6 * layer_bytes / bandwidth,
        "kernel_max_speedup": kernels["ms"]["dense_attention"] * bandwidth / (1000 * layer_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", type=Path, required=True, help="longctx bench --json of resa vs dense")
    parser.add_argument("--kernels", type=Path, action="append", required=True, help="bench_resa_kernels.py --out")
    parser.add_argument("--keep", type=float, default=0.1)
    parser.add_argument("--min-blocks", type=int, default=16,
                        help="blocks kept at least (the paper's 16; the shipped profile's 1024)")
    parser.add_argument("--rectify-every", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    speed = json.loads(args.speed.read_text())
    bandwidth = speed["hbm_bytes_per_s"]
    shape = speed["model"].removeprefix("random:")
    if shape not in SHAPES:
        raise SystemExit(f"no shape for {speed['model']}; known: {', '.join(SHAPES)}")
    kernels = kernel_rows(args.kernels, shape)
    rows = []
    for ctx in sorted({r["context_tokens"] for r in speed["rows"]}):
        dense = next(r for r in speed["rows"] if r["engine"] == "dense" and r["context_tokens"] == ctx)
        resa = next(r for r in speed["rows"] if r["engine"] == "resa" and r["context_tokens"] == ctx)
        for (pooling, centroid, length), krow in sorted(kernels.items()):
            if length == ctx:
                row = bound(dense, resa, krow, centroid, bandwidth, args.keep, args.rectify_every, shape,
                            args.min_blocks)
                rows.append({"pooling": pooling, "centroid": centroid, **row})
    result = {
        "command": "python3 benchmarks/resa_bound.py " + " ".join(
            [f"--speed {args.speed}"] + [f"--kernels {k}" for k in args.kernels]
            + [f"--keep {args.keep}", f"--min-blocks {args.min_blocks}"]
            + ([f"--out {args.out}"] if args.out else [])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "inputs": {"speed": {k: speed[k] for k in ("command", "date", "environment")},
                   "kernels": [{k: json.loads(p.read_text())[k] for k in ("command", "date", "device")}
                               for p in args.kernels]},
        "hbm_bytes_per_s": bandwidth,
        "rows": rows,
        "note": "computed from the measured runs named in inputs (random-weight model: speed only); resa's "
                "shared part is taken as dense's (resa's own measured one is larger), so the bounds are "
                "optimistic for resa",
    }
    for row in rows:
        print(f"{row['context_tokens'] // 1024}K {row['pooling']}{'+centroid' if row['centroid'] else ''}: "
              f"the run's profile measured {row['measured_speedup']:.2f}x; at most {row['max_speedup_shared_as_measured']:.2f}x "
              f"(shared part as measured), {row['max_speedup_shared_at_floor']:.2f}x (shared part at its floor); "
              f"kernel {row['kernel_resa_us']:.1f} us vs floor {row['kernel_floor_us']:.1f} us, at most "
              f"{row['kernel_max_speedup']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
