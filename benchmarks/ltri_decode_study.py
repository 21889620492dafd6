"""What decoding over ltri-stream-4k's bounded rows needs once the prefill is exact.

ltri-stream-4k's prefill is exact (every retrieving layer compensated) and its decoding reads, per layer, the
first n_init tokens, the top_k blocks the question retrieved and the last n_local tokens. This study isolates
that decoding from the engine: the document is prefilled densely once (transformers' own cache; its K/V can be
kept on disk with --kv-dir for reruns), the question is read densely once to measure how much of its attention
each stored block takes in each layer, and the question and answer are then read again: the question over every
key (`--question exact`, as ltri-stream-4k's compensated question chunk; `rows`: over the rows) and each decoded
token over the rows that each variant keeps:

- dense: every key (must give the dense answer);
- oracle: each layer's top_k blocks by the question's attention mass (a retrieval better than any index);
- needles: the blocks holding the needles, then oracle's order up to top_k;
- window: no stored block at all;
- `+summary` on any of them: one extra row per left-out block, its mean key and mean value, with a logit bias of
  log(block_size) (exp of the mean logit times the count: Jensen's lower bound of the block's attention mass),
  so the softmax keeps a first-order estimate of the mass the rows leave out.

    python benchmarks/ltri_decode_study.py --model qwen2.5-coder-0.5b --task niah_multivalue --length 32768 \\
        --samples 20 --only 1 --kv-dir /tmp/kv --out study.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.modeling_utils import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.ltri_retrieval_study import chosen_samples, needle_blocks, sample_arguments  # noqa: E402
from longctx_cli.accuracy import PromptBuilder, _ids  # noqa: E402
from longctx_cli.models import load_model  # noqa: E402
from longctx_cli.profiles import parse_override, resolve_profile  # noqa: E402
from longctx_cli.prompt import AnswerText  # noqa: E402
from longctx_cli.report import run_stamp  # noqa: E402
from longctx_cli.tasks import ANSWER_BUDGET, score  # noqa: E402

VARIANTS = ("dense", "oracle", "oracle+summary", "needles", "needles+summary", "window", "window+summary")


class Rows:
    """What the attention below reads: `mode` dense (causal over the cache), measure (dense, and each layer's
    attention mass of the question on every document position kept in `mass`) or rows (the document positions
    in `kept[layer]`, the summary rows `summary[layer]`, and every position past the document)."""

    mode = "dense"
    n_doc = 0
    kept: dict[int, torch.Tensor] = {}
    summary: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    mass: dict[int, torch.Tensor] = {}


def study_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, Hq, T, D]; key, value: [1, Hkv, S, D], the whole cache with the T new tokens last."""
    t, s = query.shape[2], key.shape[2]
    layer = module.layer_idx
    q_pos = torch.arange(s - t, s)
    k_pos, extra = torch.arange(s), None
    if Rows.mode == "rows":
        k_pos = torch.cat([Rows.kept[layer], torch.arange(Rows.n_doc, s)])
        key, value = key[:, :, k_pos], value[:, :, k_pos]
        if layer in Rows.summary:
            s_key, s_value, s_bias = Rows.summary[layer]
            key, value = torch.cat([s_key, key], dim=2), torch.cat([s_value, value], dim=2)
            extra = torch.cat([s_bias, torch.zeros(k_pos.numel())])
            k_pos = torch.cat([torch.full((s_bias.numel(),), -1), k_pos])
    bias = torch.zeros(t, k_pos.numel()).masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    if extra is not None:
        bias += extra[None, :]
    group = query.shape[1] // key.shape[1]
    if Rows.mode == "measure":
        k, v = key.repeat_interleave(group, dim=1).float(), value.repeat_interleave(group, dim=1).float()
        p = torch.softmax(query.float() @ k.transpose(-1, -2) * scaling + bias, dim=-1)
        Rows.mass[layer] = p[0, :, :, :Rows.n_doc].sum(dim=(0, 1))
        out = (p @ v).to(query.dtype)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias.to(query.dtype), scale=scaling,
                                             enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def prefill(model, doc: torch.Tensor, chunk: int) -> DynamicCache:
    cache = DynamicCache()
    for start in range(0, doc.numel(), chunk):
        model(input_ids=doc[None, start:start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def greedy(model, cache, tail: torch.Tensor, budget: int, text: AnswerText, question: str) -> str:
    """The answer: the question read over all keys (question "exact", as ltri-stream-4k's compensated question
    chunk) or over the rows (question "rows"), then every decoded token over the rows."""
    ids = tail[None]
    Rows.mode = "dense" if question == "exact" else "rows"
    for _ in range(budget):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        Rows.mode = "rows"
        token = int(logits[0, -1].argmax())
        text.feed(token)
        if text.done:
            break
        ids = torch.tensor([[token]])
    return text.text


def choose(variant: str, mass: torch.Tensor, needles: list[int], n_stored: int, cfg) -> list[int]:
    """The stored blocks a layer keeps: mass is the question's attention per document position."""
    if variant.startswith("window"):
        return []
    per_block = mass[cfg.n_init:cfg.n_init + n_stored * cfg.block_size].view(n_stored, cfg.block_size).sum(dim=1)
    order = per_block.argsort(descending=True).tolist()
    first = [b for b in needles if b < n_stored] if variant.startswith("needles") else []
    return sorted((first + [b for b in order if b not in first])[:cfg.top_k])


def set_rows(variant: str, cache, needles: list[int], n_doc: int, cfg) -> dict:
    """Fills Rows for a variant; returns the stored blocks each layer keeps (none for dense)."""
    n_stored = max(0, (n_doc - cfg.n_local - cfg.n_init) // cfg.block_size)
    window = cfg.n_init + n_stored * cfg.block_size
    Rows.kept, Rows.summary, chosen = {}, {}, {}
    for i, layer in enumerate(cache.layers):
        if variant == "dense":
            Rows.kept[i] = torch.arange(n_doc)
            continue
        blocks = choose(variant, Rows.mass[i], needles, n_stored, cfg)
        chosen[i] = blocks
        spans = [torch.arange(cfg.n_init)] + [torch.arange(cfg.n_init + b * cfg.block_size,
                                                           cfg.n_init + (b + 1) * cfg.block_size) for b in blocks]
        Rows.kept[i] = torch.cat(spans + [torch.arange(window, n_doc)])
        if variant.endswith("+summary"):
            left = torch.tensor([b for b in range(n_stored) if b not in blocks], dtype=torch.long)
            stored = slice(cfg.n_init, window)
            keys = layer.keys[:, :, stored].unflatten(2, (n_stored, cfg.block_size))[:, :, left].mean(dim=3)
            values = layer.values[:, :, stored].unflatten(2, (n_stored, cfg.block_size))[:, :, left].mean(dim=3)
            Rows.summary[i] = (keys, values, torch.full((left.numel(),), math.log(cfg.block_size)))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # --profile gives n_init, n_local, block_size and top_k (--set top_k=24 changes one); --chunk-size the prefill's
    sample_arguments(parser, profile="ltri-stream-4k", task="niah_multivalue", length=32768, samples=20,
                     chunk_size=1024)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--question", choices=("exact", "rows"), default="exact",
                        help="the question's own attention: over all keys (ltri-stream-4k compensates the question's "
                             "chunk) or over the rows")
    parser.add_argument("--kv-dir", type=Path, help="keep each sample's dense prefill here and reuse it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {bad}; expected some of {', '.join(VARIANTS)}")

    prof = resolve_profile(args.profile, dict(parse_override(item) for item in args.set))
    cfg = prof.engine_config
    lm = load_model(args.model, device="cpu", dtype="float32")
    if "sliding_attention" in (getattr(lm.model.config.get_text_config(decoder=True), "layer_types", None) or []):
        parser.error("the study's attention has no sliding window: use a model whose layers are all global")
    AttentionInterface.register("ltri_decode_study", study_attention)
    lm.model.set_attn_implementation("ltri_decode_study")
    builder = PromptBuilder(lm.tokenizer, "auto", [])
    budget = min(ANSWER_BUDGET[args.task], prof.run.max_new_tokens)
    rows = []
    for sample in chosen_samples(args, lm.tokenizer, budget, builder.overhead()):
        doc = torch.cat([builder.prefix, _ids(lm.tokenizer, sample.document)])
        tail = builder.tail(sample.question, sample.answer_prefix)
        needles = sorted({b for n in sample.expected for b in needle_blocks(
            lm.tokenizer, builder.prefix.numel(), sample.document, n, cfg.n_init, cfg.block_size)})
        saved = args.kv_dir / f"{args.task}_{args.length}_{args.seed}_{sample.index}.pt" if args.kv_dir else None
        start = time.perf_counter()
        Rows.mode, Rows.n_doc = "dense", doc.numel()
        with torch.inference_mode():
            if saved is not None and saved.exists():
                cache = DynamicCache()
                for i, (k, v) in enumerate(torch.load(saved)):
                    cache.update(k, v, i)
                dense_kv = f"read from --kv-dir in {time.perf_counter() - start:.1f} s"
            else:
                cache = prefill(lm.model, doc, args.chunk_size)
                dense_kv = f"prefilled in {time.perf_counter() - start:.1f} s"
                if saved is not None:
                    saved.parent.mkdir(parents=True, exist_ok=True)
                    torch.save([(layer.keys, layer.values) for layer in cache.layers], saved)
            Rows.mode = "measure"
            lm.model(input_ids=tail[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.crop(doc.numel() - cache.get_seq_length())
            n_stored = max(0, (doc.numel() - cfg.n_local - cfg.n_init) // cfg.block_size)
            row = {"index": sample.index, "prompt_hash": sample.prompt_hash, "depths": sample.depths,
                   "expected": sample.expected, "needle_blocks": needles, "stored_blocks": n_stored,
                   "dense_kv": dense_kv, "variants": {}}
            for variant in variants:
                chosen = set_rows(variant, cache, needles, doc.numel(), cfg)
                answer = greedy(lm.model, cache, tail, budget,
                                AnswerText(lm.tokenizer, builder.stop_strings, builder.stop_ids), args.question)
                cache.crop(doc.numel() - cache.get_seq_length())
                stored = [b for b in needles if b < n_stored]  # the others sit in the window
                covering = sum(all(b in got for b in stored) for got in chosen.values())
                row["variants"][variant] = {"score": 100 * score(sample, answer), "answer": answer.strip()[:100],
                                            "layers_holding_every_needle": f"{covering}/{len(chosen)}" if chosen else ""}
                print(sample.index, variant, row["variants"][variant], flush=True)
        rows.append(row)
        if args.out:
            args.out.write_text(json.dumps({**run_stamp(), "args": {k: str(v) for k, v in vars(args).items()},
                                            "engine_settings": {k: getattr(cfg, k) for k in
                                                                ("n_init", "n_local", "block_size", "top_k")},
                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
