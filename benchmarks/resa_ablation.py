"""What rectification buys (the ReSA paper's Figure 1 / section 3.2): drift over a long generation.

A real book passage (samples/haystack, Austen) of --context tokens is prefilled densely; the next --generate
tokens of the same book are then fed one decode step at a time (teacher forcing) and each is scored. Dense
decoding is the reference; resa decodes sparsely with rectification every 32 tokens and without any (the plain
block-sparse baseline, rectify_every 0). Errors written into the KV cache by sparse steps accumulate without
rectification, so its loss should drift away from dense as the generation grows.

    python benchmarks/resa_ablation.py --context 8192 --generate 1024 --samples 4 --out ablation.json

Reported per configuration: mean NLL per bucket of positions, the perplexity of the final 32 tokens (the
paper's measure), and the mean |NLL - dense NLL| per bucket.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines import ENGINES  # noqa: E402
from longctx_cli.home import longctx_home  # noqa: E402
from longctx_cli.models import load_model  # noqa: E402
from longctx_cli.profiles import resolve_profile  # noqa: E402
from longctx_cli.report import environment  # noqa: E402

CONFIGS = {"dense": ("dense", {}), "resa_f32": ("resa", {"rectify_every": 32}),
           "resa_no_rectification": ("resa", {"rectify_every": 0})}


def passages(tokenizer, n: int, length: int) -> list[list[int]]:
    """n passages of `length` tokens from the books, spread evenly over them (deterministic)."""
    books = sorted((Path(__file__).resolve().parents[1] / "samples" / "haystack").glob("*.txt"))
    ids = []
    for book in books:
        ids += tokenizer(book.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise SystemExit(f"the books hold {len(ids)} tokens, fewer than {length}")
    stride = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * stride:i * stride + length] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--generate", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=128)
    parser.add_argument("--keep-ratio", type=float, default=0.1)
    parser.add_argument("--model", default=None, help="default: the embedded Gemma 3 270M")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    lm = load_model(args.model, device="auto", dtype="auto")
    bos = [lm.tokenizer.bos_token_id] if lm.tokenizer.bos_token_id is not None else []
    nll = {name: [] for name in CONFIGS}
    used = {}
    for i, passage in enumerate(passages(lm.tokenizer, args.samples, args.context + args.generate - len(bos))):
        doc = torch.tensor(bos + passage[:args.context - len(bos)])
        targets = passage[args.context - len(bos):]
        for name, (profile, overrides) in CONFIGS.items():
            if profile == "resa":
                overrides = {**overrides, "keep_ratio": args.keep_ratio}
            prof = resolve_profile(profile, overrides)
            used[name] = {"profile": profile, **dataclasses.asdict(prof.engine_config)}
            engine = ENGINES[prof.engine](lm, prof.engine_config, prof.run, home=longctx_home())
            state = engine.prefill(doc, reserve=len(targets))
            nll[name].append(engine.teacher_forced_nll(state, torch.tensor([], dtype=torch.long), targets))
            print(f"passage {i}: {name}: mean NLL {sum(nll[name][-1]) / len(targets):.4f}", flush=True)
            del state

    def bucketed(values: list[list[float]]) -> list[float]:
        cols = [sum(v[j] for v in values) / len(values) for j in range(args.generate)]
        return [sum(cols[j:j + args.bucket]) / len(cols[j:j + args.bucket]) for j in range(0, args.generate, args.bucket)]

    summary = {}
    for name, values in nll.items():
        gaps = [[abs(a - b) for a, b in zip(v, d)] for v, d in zip(values, nll["dense"])]
        tail = [x for v in values for x in v[-32:]]
        summary[name] = {"nll_per_bucket": bucketed(values), "abs_gap_to_dense_per_bucket": bucketed(gaps),
                         "final32_perplexity": math.exp(sum(tail) / len(tail)),
                         "mean_nll": sum(map(sum, values)) / (len(values) * args.generate)}
        print(f"{name:>24}: final-32 ppl {summary[name]['final32_perplexity']:.3f}  |gap| per bucket "
              + " ".join(f"{g:.4f}" for g in summary[name]["abs_gap_to_dense_per_bucket"]))
    result = {"command": " ".join(["python3", *sys.argv]), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
              "model": args.model or "gemma3-270m", "environment": environment(), "context_tokens": args.context,
              "generated_tokens": args.generate, "samples": args.samples, "bucket": args.bucket,
              "keep_ratio": args.keep_ratio, "source": "samples/haystack (Austen, public domain), teacher forcing",
              "configs": used, "summary": summary, "nll": nll}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
