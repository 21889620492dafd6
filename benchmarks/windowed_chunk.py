"""Windowed (sliding-window) chunk attention on a GPU: FlexAttention (compiled per shape) against SDPA with the
band mask on the memory-efficient kernel (no compilation, no cuDNN plan) and SDPA's default choice. Reports the
first call (compilation or plan included) and the median after it (triton.testing.do_bench), per shape.

    python benchmarks/windowed_chunk.py --out windowed.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (query heads, KV heads, head_dim, window, chunk, offset, buffer): Gemma 3 270M at two chunk lengths, then two
# larger windowed shapes.
SHAPES = [(4, 1, 256, 512, 2048, 8192, 12288), (4, 1, 256, 512, 1000, 9000, 12288),
          (32, 8, 128, 4096, 2048, 30000, 36000), (16, 8, 128, 1024, 2048, 30000, 36000)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from kernels.chunk_attention.flex import chunk_attention_flex as flex
    from kernels.chunk_attention.reference import chunk_attention as sdpa
    from longctx_cli.report import run_stamp

    def efficient(*a, **k):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return sdpa(*a, **k)

    rows = []
    for hq, hkv, d, w, t, off, s in SHAPES:
        q = torch.randn(1, hq, t, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        row = {"shape": f"Hq{hq}-Hkv{hkv}-D{d}-w{w}-T{t}", "first_call_s": {}, "ms": {}}
        outs = {}
        for name, fn in (("flex", flex), ("sdpa_efficient", efficient), ("sdpa_default", sdpa)):
            start = time.perf_counter()
            outs[name] = fn(q, k, v, off, scale=d**-0.5, window=w)
            torch.cuda.synchronize()
            row["first_call_s"][name] = time.perf_counter() - start
            row["ms"][name] = do_bench(lambda: fn(q, k, v, off, scale=d**-0.5, window=w))
        row["max_diff_efficient_vs_flex"] = (outs["flex"].float() - outs["sdpa_efficient"].float()).abs().max().item()
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {**run_stamp(), "rows": rows, "note": "random inputs: speed only"}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
