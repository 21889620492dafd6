"""HF's own eager path on the same random-weight model, to compare the dense engine against.

One-shot prefill (SDPA, DynamicCache, logits of the last token only) and an eager decode loop (one forward per
token, DynamicCache). Random weights: speed only. Usage on a GPU:
    python benchmarks/hf_baseline.py --model random:llama-3.1-8b --lengths 32k,128k --out hf.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys

import torch
from transformers import DynamicCache

from longctx_cli.models import load_model
from longctx_cli.units import parse_count
from longctx_cli.report import environment


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--lengths", default="32k,128k")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    lm = load_model(args.model, device="cuda", dtype="bfloat16")
    model = lm.model
    model.set_attn_implementation("sdpa")
    rows = []
    for length in map(parse_count, args.lengths.split(",")):
        ids = torch.randint(1000, lm.config.vocab_size, (1, length), device="cuda")
        for attempt in ("warmup", "timed"):
            torch.cuda.reset_peak_memory_stats()
            cache = DynamicCache(config=model.config)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.inference_mode():
                start.record()
                out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                end.record()
                end.synchronize()
                prefill_s = start.elapsed_time(end) / 1000
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                times = []
                for _ in range(args.steps + 4):
                    start.record()
                    out = model(token, past_key_values=cache, use_cache=True)
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            del cache, out
            torch.cuda.empty_cache()
        rows.append({"engine": "hf-eager-sdpa", "context_tokens": length, "prefill_s": prefill_s,
                     "decode_ms_per_token": statistics.median(times[4:]),
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(rows[-1], flush=True)
    result = {"command": " ".join(["python", *sys.argv]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "model": args.model, "random_weights": True, "note": "random weights: speed only",
              "environment": environment(), "rows": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
