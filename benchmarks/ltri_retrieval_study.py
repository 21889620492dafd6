"""Which blocks ltri-stream's question chunk retrieves, against the blocks that hold the needles (issue 8).

Decoding keeps the retrieval of the last prefill chunk (the question's), so a needle answer needs the needle's
block(s) among them. Per sample: the needles' block ids (block b holds positions n_init + b * block_size ...),
per full-attention layer the retrieved blocks of the question chunk, whether they cover every needle block,
and the answer and its score.

    python benchmarks/ltri_retrieval_study.py --task niah_single_3 --length 4096 --samples 5 \\
        --set n_local=512 --set top_k=4 --chunk-size 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines import ENGINES  # noqa: E402
from engines.decoding import Sampler  # noqa: E402
from longctx_cli.accuracy import PromptBuilder, _ids  # noqa: E402
from longctx_cli.models import load_model  # noqa: E402
from longctx_cli.profiles import resolve_profile  # noqa: E402
from longctx_cli.report import run_stamp  # noqa: E402
from longctx_cli.prompt import AnswerText  # noqa: E402
from longctx_cli.tasks import generate, score  # noqa: E402


def needle_blocks(tokenizer, prefix_len: int, document: str, needle: str, n_init: int, block: int) -> list[int]:
    start = document.index(needle)
    first = prefix_len + len(_ids(tokenizer, document[:start]))
    last = prefix_len + len(_ids(tokenizer, document[:start + len(needle)])) - 1
    return sorted({max(0, (p - n_init) // block) for p in (first, last)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="niah_single_3")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE profile overrides")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    overrides = {"chunk_size": args.chunk_size}
    for item in args.set:
        key, value = item.split("=", 1)
        overrides[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    lm = load_model(None, device="auto", dtype="auto")
    prof = resolve_profile("ltri-stream", overrides)
    cfg = prof.engine_config
    engine = ENGINES["ltri-stream"](lm, cfg, prof.run)
    builder = PromptBuilder(lm.tokenizer, "auto", [])
    rows = []
    for sample in generate(args.task, args.length, args.samples, lm.tokenizer, seed=0, budget=128,
                           overhead=builder.overhead()):
        doc = torch.cat([builder.prefix, _ids(lm.tokenizer, sample.document)])
        tail = builder.tail(sample.question, sample.answer_prefix)
        state = engine.prefill(doc, reserve=tail.numel() + 128)
        text = AnswerText(lm.tokenizer, builder.stop_strings, builder.stop_ids)
        stream = engine.answer(state, tail, 128, Sampler())
        for token in stream:
            text.feed(token)
            if text.done:
                break
        stream.close()
        # The blocks decoding read: each retrieving layer's slots after the question.
        retrieved = {i: [b for b in layer.slots if b >= 0] for i, layer in enumerate(state.cache.layers)
                     if layer.retrieve}
        needles = [needle_blocks(lm.tokenizer, builder.prefix.numel(), sample.document, n, cfg.n_init,
                                 cfg.block_size) for n in sample.expected]
        wanted = sorted({b for blocks in needles for b in blocks})
        covered = {layer: all(b in got for b in wanted) for layer, got in retrieved.items()}
        row = {"index": sample.index, "depths": sample.depths, "score": 100 * score(sample, text.text),
               "answer": text.text.strip()[:80], "expected": sample.expected, "needle_blocks": needles,
               "layers_covering_needles": f"{sum(covered.values())}/{len(covered)}", "retrieved": retrieved}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "retrieved"}), flush=True)
        print("   retrieved per layer:", retrieved, flush=True)
    if args.out:
        args.out.write_text(json.dumps({**run_stamp(), "args": vars(args) | {"out": str(args.out)}, "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
