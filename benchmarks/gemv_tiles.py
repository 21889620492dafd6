"""Sweep the one-token GEMV's tiles (kernels/gemv TUNED) on a GPU: each projection alone, then a layer's four chained.

    python benchmarks/gemv_tiles.py --out results/X.json

For each projection of the Qwen3-1.7B and Llama-3.1-8B shapes (q/k/v and gate/up fused, as the decode step runs
them; gate/up forms silu(gate) * up), every tile of 4-32 rows x 512-8192 of K x 4 or 8 warps that keeps at most
128 weight values a thread: the median µs of 8 GEMVs on distinct weights replayed from one CUDA graph (a step's
weights are not in L2). Then a model's layers of the four projections chained, each reading the one before's
output as a decode step does (the o projection the first half of q/k/v's), with the tiles in use and with each
projection's fastest: µs a layer and the weights' TB/s, against a device-to-device copy's. A tile the sweep finds
at least 3% faster than the default belongs in TUNED.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
try:
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    import kernels.gemv.triton as gemv_module
except ImportError:  # a machine without Triton: main() says what the script needs
    triton = gemv_module = None

SHAPES = {"qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)},
          "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                           "down": (4096, 14336)}}
LAYERS = {"qwen3-1.7b": 28, "llama-3.1-8b": 16}  # the 8B's 32 layers would not change the rate, only the memory
IN_USE = dict(gemv_module.TUNED) if gemv_module else {}


def in_use(shape: tuple[int, int]) -> tuple[int, int, int]:
    """The tile kernels/gemv launches for a weight [N, K] as shipped."""
    default = (gemv_module.BLOCK_N, min(gemv_module.BLOCK_K, triton.next_power_of_2(shape[1])), gemv_module.NUM_WARPS)
    return IN_USE.get(shape, default)


def gemv(x, w, tile, act=None):
    gemv_module.TUNED[tuple(w.shape)] = tile
    return gemv_module.gemv_triton(x, w, None, None, act)


def candidates(N: int, K: int, gated: bool) -> list[tuple[int, int, int]]:
    widest = triton.next_power_of_2(K)
    tiles = {in_use((N, K))}
    for rows, step, warps in itertools.product((4, 8, 16, 32), (512, 1024, 2048, 4096, 8192), (4, 8)):
        step = min(step, widest)
        if rows * step // (warps * 32) <= 128 and not (gated and rows < 4):
            tiles.add((rows, step, warps))
    return sorted(tiles)


def sweep(model: str) -> tuple[list[dict], dict]:
    rows, best = [], {}
    for name, (N, K) in SHAPES[model].items():
        act = "silu" if name == "gate_up" else None
        x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        timed = []
        for tile in candidates(N, K, act is not None):
            if act is None:
                torch.testing.assert_close(gemv(x, weights[0], tile), torch.nn.functional.linear(x, weights[0]),
                                           rtol=2e-2, atol=2e-2)
            with torch.cuda.stream(torch.cuda.Stream()):
                us = do_bench_cudagraph(lambda: [gemv(x, w, tile, act) for w in weights], rep=40,
                                        return_mode="median") * 1e3 / len(weights)
            timed.append((us, tile))
            rows.append({"model": model, "projection": name, "N": N, "K": K, "tile": tile,
                         "in_use": tile == in_use((N, K)), "us": us, "tb_per_s": N * K * 2 / us / 1e6})
        gemv_module.TUNED.clear()
        gemv_module.TUNED.update(IN_USE)
        best[name] = min(timed)[1]
        print(f"{model} {name}: in use {in_use((N, K))} {dict((t, u) for u, t in timed)[in_use((N, K))]:.2f} µs, "
              f"fastest {best[name]} {min(timed)[0]:.2f} µs", flush=True)
    return rows, best


def chain(model: str, best: dict) -> list[dict]:
    shapes, layers = SHAPES[model], LAYERS[model]
    weights = [{n: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02 for n, s in shapes.items()}
               for _ in range(layers)]
    hidden = shapes["o"][1]
    x0 = torch.randn(1, 1, hidden, device="cuda", dtype=torch.bfloat16)

    def step(tiles):
        h = x0
        for w in weights:
            o = gemv(gemv(h, w["qkv"], tiles["qkv"])[..., :hidden], w["o"], tiles["o"])
            h = gemv(gemv(o, w["gate_up"], tiles["gate_up"], "silu"), w["down"], tiles["down"])
        return h

    total = sum(N * K * 2 for N, K in shapes.values()) * layers
    rows = []
    for label, tiles in (("in use", {n: in_use(s) for n, s in shapes.items()}), ("fastest", best)):
        with torch.cuda.stream(torch.cuda.Stream()):
            us = do_bench_cudagraph(lambda: step(tiles), rep=200, return_mode="median") * 1e3
        gemv_module.TUNED.clear()
        gemv_module.TUNED.update(IN_USE)
        rows.append({"model": model, "layers": layers, "tiles": label, "by_projection": tiles,
                     "us_a_layer": us / layers, "tb_per_s": total / us / 1e6})
        print(f"{model} chained, tiles {label}: {us / layers:.2f} µs a layer, {total / us / 1e6:.2f} TB/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if triton is None or not torch.cuda.is_available():
        sys.exit("benchmarks/gemv_tiles.py needs a CUDA device and Triton")
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / do_bench(lambda: dst.copy_(src), rep=200, return_mode="median") / 1e9
    del src, dst
    print(f"copy: {copy:.2f} TB/s", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "copy_tb_per_s": copy,
              "sweep": [], "chained": []}
    for model in SHAPES:
        rows, best = sweep(model)
        result["sweep"] += rows
        result["chained"] += chain(model, best)
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
