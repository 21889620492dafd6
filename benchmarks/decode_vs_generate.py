"""Decode speed of `longctx` (the Python API, dense) against transformers' `generate` on the same model, prompt and
machine, in one process, alternating, several rounds.

`generate`'s ms/token is (time of N+1 new tokens - time of 1 new token) / N, so its prefill cancels out; longctx's
is the mean of the report's decode steps (after the first token). Both decode greedily with the same weights
(the API's model, handed to `generate`). Without a GPU this is the CPU path the embedded model takes on a fresh
machine.

    python benchmarks/decode_vs_generate.py --new-tokens 32 --rounds 3 --out decode_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from longctx_cli.api import Longctx
from longctx_cli.prompt import build_layout
from longctx_cli.report import run_stamp

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "lighthouse.txt"


def _generate_ms(model, ids: torch.Tensor, new: int) -> float:
    times = []
    for n in (1, new + 1):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        times.append(time.perf_counter() - start)
    return 1000 * (times[1] - times[0]) / new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    # No stop string can end the answer early: both sides decode the same number of steps.
    lc = Longctx("dense", args.model, state="off", layout="plain",
                 settings={"max_new_tokens": args.new_tokens + 1, "stop": ["\u0000never\u0000"]})
    book = lc.read(str(SAMPLE))
    question = "Tell the whole story again, in detail."
    ours, theirs, steps = [], [], []
    ids = None
    for _ in range(args.rounds):
        answer = book.ask(question)
        model = lc.session.lm.model  # loaded by the first question
        ours.append(answer.report.timings.decode_ms_per_token)
        steps.append(len(answer.report.timings.decode_step_s))
        if ids is None:
            # The same prompt: the document's ids as read (prefix included) and the question's.
            layout = build_layout(lc.session.tokenizer, question, lc.session.run.stop, layout="plain")
            ids = torch.cat([book.ids, layout.question_ids])[None].to(model.device)
        # generate runs transformers' own attention; the engine's registered one comes back after it.
        engine_attention = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        theirs.append(_generate_ms(model, ids, args.new_tokens))
        model.set_attn_implementation(engine_attention)
    result = {**run_stamp(), "model": args.model or "gemma3-270m", "prompt_tokens": int(ids.shape[1]),
              "new_tokens": args.new_tokens, "longctx_decode_ms": ours, "generate_decode_ms": theirs,
              "longctx_steps": steps, "longctx_median_ms": statistics.median(ours),
              "generate_median_ms": statistics.median(theirs),
              "ratio": statistics.median(ours) / statistics.median(theirs)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("environment",)}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
