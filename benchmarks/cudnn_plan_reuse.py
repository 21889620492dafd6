"""Does prefill pay cuDNN plan builds per cache capacity, or per chunk offset? Chunked cuDNN attention (one
layer's calls, Llama-3.1-8B attention shape, bf16, GPU) over four documents in one process: 128K, 128K again, a
shorter one (120,000 tokens) and 128K in a larger cache. Run one layout and grain per process: plans are
cached process-wide."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch

import kernels.chunk_attention.cudnn as cudnn


def run(layout: str, capacity: int, length: int, chunk: int, Hq=32, Hkv=8, D=128) -> float:
    opts = dict(device="cuda", dtype=torch.bfloat16)
    if layout == "head_major":
        k, v = (torch.randn(1, Hkv, capacity, D, **opts) for _ in range(2))
    else:
        k, v = (torch.randn(1, capacity, Hkv, D, **opts).transpose(1, 2) for _ in range(2))
    q = torch.randn(1, chunk, Hq, D, **opts).transpose(1, 2)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for offset in range(0, length, chunk):
        cudnn.chunk_attention_cudnn(q[:, :, :min(chunk, length - offset)], k, v, offset, scale=D**-0.5)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=("head_major", "seq_major"), default="seq_major")
    ap.add_argument("--grain", type=int, default=cudnn.PAST_GRAIN, help="PAST_GRAIN (0: the prefix in one piece)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args()
    cudnn.PAST_GRAIN = args.grain
    run(args.layout, 4112, 4096, args.chunk)  # cuDNN's own start-up, outside the rows
    rows = []
    for length, capacity in ((131072, 131088), (131072, 131088), (120000, 120016), (131072, 135168)):
        s = run(args.layout, capacity, length, args.chunk)
        rows.append({"layout": args.layout, "grain": args.grain, "length": length, "capacity": capacity,
                     "attention_s": s})
        print(f"{args.layout:<10} grain {args.grain:>5} length {length:>7} capacity {capacity:>7}: {s:.3f} s",
              flush=True)
    meta = {"device": torch.cuda.get_device_name(), "python": platform.python_version(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "PYTHONPATH=$PWD python3 " + " ".join(sys.argv), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
