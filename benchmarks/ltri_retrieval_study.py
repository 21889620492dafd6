"""Which blocks ltri-stream's question chunk retrieves, against the blocks that hold the needles.

Decoding keeps the retrieval of the last prefill chunk (the question's), so a needle answer needs the needle's
block(s) among them. Per sample: the needles' block ids (block b holds positions n_init + b * block_size ...),
per full-attention layer the retrieved blocks of the question chunk, whether they cover every needle block,
how many blocks of the other needles (multi-key distractors) came along, and the answer and its score.

    python benchmarks/ltri_retrieval_study.py --task niah_single_3 --length 4096 --samples 5 \\
        --set n_local=512 --set top_k=4 --chunk-size 256
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines import ENGINES  # noqa: E402
from engines.decoding import Sampler  # noqa: E402
from longctx_cli.accuracy import PromptBuilder, _ids  # noqa: E402
from longctx_cli.home import longctx_home  # noqa: E402
from longctx_cli.models import load_model  # noqa: E402
from longctx_cli.profiles import parse_override, resolve_profile  # noqa: E402
from longctx_cli.report import run_stamp  # noqa: E402
from longctx_cli.prompt import AnswerText  # noqa: E402
from longctx_cli.tasks import ANSWER_BUDGET, generate, score  # noqa: E402


def needle_blocks(tokenizer, prefix_len: int, document: str, needle: str, n_init: int, block: int) -> list[int]:
    start = document.index(needle)
    first = prefix_len + len(_ids(tokenizer, document[:start]))
    last = prefix_len + len(_ids(tokenizer, document[:start + len(needle)])) - 1
    return sorted({max(0, (p - n_init) // block) for p in (first, last)})


def distractor_blocks(tokenizer, prefix_len: int, document: str, expected: list[str], n_init: int,
                      block: int) -> list[int]:
    """Blocks of the needles whose values are not asked for (niah_multikey's other keys)."""
    needles = re.findall(r"One of the special magic \w+ for .+? is: [\w-]+\.", document)
    return sorted({b for n in needles if not any(v in n for v in expected)
                   for b in needle_blocks(tokenizer, prefix_len, document, n, n_init, block)})


@torch.inference_mode()
def exact_kv(state, dense_cache, n_init: int, block: int, which: str = "all",
             layers: str | tuple[int, ...] = "all") -> None:
    """Replaces the ltri cache's K/V (device rows by their positions, CPU context memory by block) with dense's;
    which: all, stored (init rows and context memory) or window (the window's rows); layers: all, global (the
    retrieving, full-attention layers), sliding (the model's sliding-window layers) or layer indices."""
    if isinstance(layers, str):
        layers = tuple(i for i, layer in enumerate(state.cache.layers)
                       if layers == "all" or layer.retrieve == (layers == "global"))
    for i, (layer, ref) in enumerate(zip(state.cache.layers, dense_cache.layers)):
        if i not in layers:
            continue
        held = layer.key_pos >= 0
        window = torch.zeros_like(held)
        window[layer.local0:] = True
        if which != "all":
            held &= window if which == "window" else ~window
        rows = held.nonzero().flatten()
        pos = layer.key_pos[rows]
        layer.keys[:, :, rows] = ref.keys[:, :, pos].to(layer.keys.device)
        layer.values[:, :, rows] = ref.values[:, :, pos].to(layer.values.device)
        if layer.retrieve and which != "window":
            n = layer.memory.n_blocks
            span = slice(n_init, n_init + n * block)
            for mine, theirs in ((layer.memory.keys, ref.keys), (layer.memory.values, ref.values)):
                exact = theirs[0, :, span].reshape(theirs.shape[1], n, block, -1).transpose(0, 1)
                mine.used.copy_(exact.to(mine.used.dtype).cpu())


def layer_choice(value: str) -> str | tuple[int, ...]:
    """--exact-layers: all, global, sliding or comma-separated layer indices (11 or 11,17)."""
    if value in ("all", "global", "sliding"):
        return value
    try:
        layers = tuple(sorted({int(x) for x in value.split(",")}))
    except ValueError:
        layers = ()
    if not layers or layers[0] < 0:
        raise argparse.ArgumentTypeError(f"expected all, global, sliding or comma-separated layer indices "
                                         f"(11 or 11,17), got {value!r}")
    return layers


def _rank(scores: torch.Tensor, wanted: list[int]) -> int:
    """Worst 1-based rank among the wanted blocks (1 = best block)."""
    stored = [b for b in wanted if b < scores.numel()]
    return max(int((scores > scores[b]).sum()) + 1 for b in stored) if stored else 0


def _needle_ranks(indexer, layer, layer_idx, query, key, scaling, cache, wanted) -> dict:
    """Rank of the needle block(s) at the question chunk under block-scoring variants:
    engine (the engine's query vectors, index vectors, voting), no_vote (without voting), sum (no_vote's vectors,
    each query vector's best match in the block summed, ColBERT's late interaction), all_q (every question
    query instead of the span-picked ones), last_q (the last question token only), all_keys (query vectors
    against every key of the block: no index loss), oracle (attention mass of the question's last query on the
    block, softmax over all stored keys; retrieval head, else all heads)."""
    n_blocks = layer.memory.n_blocks
    hkv = key.shape[1]
    w = indexer.head_weights(layer_idx, query.device)

    def weighted(q):  # [A, Hq, D] -> [A, Hkv, D]
        return (q.float() * w[None, :, None]).view(q.shape[0], hkv, -1, q.shape[-1]).sum(dim=2)

    qw, chosen = indexer._query_vectors(layer, layer_idx, query, key, scaling, cache)  # weighted per KV head
    qw = qw[chosen]
    allq = query[0].transpose(0, 1)
    keys = layer.memory.keys.used.float()  # [n, Hkv, block, D]
    own = layer.index.block_scores(qw, n_blocks)[0]
    # The engine's own voting, on a copy of this chunk's votes so far (retrieve adds this layer's after us).
    votes = SimpleNamespace(chunk_votes=dict(cache.chunk_votes), first_reading=cache.first_reading,
                            question_chunks=cache.question_chunks)
    scores = {"engine": indexer._vote(layer_idx, own, votes)}
    scores["no_vote"] = own
    scores["all_q"] = layer.index.block_scores(weighted(allq), n_blocks)[0]
    scores["last_q"] = layer.index.block_scores(weighted(allq[-1:]), n_blocks)[0]
    held = layer.index.block.used >= 0  # entries of block -1 hold no vector
    sims = torch.einsum("akd,nkd->an", qw, layer.index.vectors.used[held].float())  # [A, N]
    per_block = torch.full((sims.shape[0], n_blocks), float("-inf"))
    per_block = per_block.scatter_reduce(1, layer.index.block.used[held].expand_as(sims), sims, reduce="amax")
    scores["sum"] = per_block.clamp(min=0).sum(dim=0)  # ColBERT-style: each query vector's best match, summed
    scores["all_keys"] = torch.einsum("akd,nkbd->anb", qw, keys).amax(dim=(0, 2))
    last = query[0, :, -1].float()  # [Hq, D]
    logits = torch.einsum("hd,nhbd->hnb", last, keys.repeat_interleave(query.shape[1] // hkv, dim=1)) * scaling
    mass = torch.softmax(logits.flatten(1), dim=-1).view(logits.shape).sum(dim=-1)  # [Hq, n]
    scores["oracle"] = (w[:, None] * mass).sum(dim=0)
    return {name: _rank(s, wanted) for name, s in scores.items()}


def sample_arguments(parser: argparse.ArgumentParser, *, profile: str, task: str, length: int, samples: int,
                     chunk_size: int) -> None:
    """The options that pick a study's model, profile and samples (those of `longctx bench`)."""
    parser.add_argument("--model", default=None, help="a named model (longctx models) or a model folder; default: the embedded one")
    parser.add_argument("--profile", default=profile, help="the ltri-stream profile the --set overrides start from")
    parser.add_argument("--task", default=task)
    parser.add_argument("--length", type=int, default=length)
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--seed", type=int, default=0, help="the harness's sample seed (bench --seed)")
    parser.add_argument("--only", default="", help="comma-separated sample indices to run (of the first --samples)")
    parser.add_argument("--chunk-size", type=int, default=chunk_size)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE profile overrides")


def chosen_samples(args, tokenizer, budget: int, overhead: int):
    """The task's samples as `longctx bench` makes them, those --only names (all without it)."""
    only = {int(i) for i in args.only.split(",") if i}
    for sample in generate(args.task, args.length, args.samples, tokenizer, seed=args.seed, budget=budget,
                           overhead=overhead):
        if not only or sample.index in only:
            yield sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sample_arguments(parser, profile="ltri-stream", task="niah_single_3", length=4096, samples=5, chunk_size=256)
    parser.add_argument("--inject", default="",
                        help="comma-separated layer ids: force the needle blocks into these layers' question "
                             "retrieval (the paper's mandatory evidence injection, appendix A); 'all' for every layer")
    parser.add_argument("--exclude-distractors", action="store_true",
                        help="keep the other needles' blocks (multi-key distractors) out of the question's retrieval "
                             "in every layer: what a perfectly precise retrieval would give")
    parser.add_argument("--exact-kv", choices=("all", "stored", "window"),
                        help="before the question, overwrite K/V the engine holds with dense prefill's: all (device "
                             "rows and CPU context memory: what is left is the thinned context at decode, without the "
                             "drift of K/V computed over a thinned context), stored (init tokens and context memory "
                             "only) or window (the local window only)")
    parser.add_argument("--exact-layers", type=layer_choice, default="all",
                        help="with --exact-kv: all, global (the full-attention, retrieving layers), sliding (the "
                             "sliding-window ones) or comma-separated layer indices (11 or 11,17)")
    parser.add_argument("--diagnose", action="store_true",
                        help="at the question chunk, rank the needle block under several block-scoring variants")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    overrides = {"chunk_size": args.chunk_size}
    overrides.update(parse_override(item) for item in args.set)  # YAML values, as `longctx --set`: [5, 11]
    lm = load_model(args.model, device="auto", dtype="auto")
    n_layers = lm.config.num_hidden_layers
    if isinstance(args.exact_layers, tuple) and args.exact_layers[-1] >= n_layers:
        parser.error(f"argument --exact-layers: layer {args.exact_layers[-1]} out of range; the model has "
                     f"{n_layers} layers (0 to {n_layers - 1})")
    prof = resolve_profile(args.profile, overrides)
    cfg = prof.engine_config
    engine = ENGINES["ltri-stream"](lm, cfg, prof.run, home=longctx_home())
    dense = None
    if args.exact_kv:
        dprof = resolve_profile("dense", {"chunk_size": args.chunk_size})
        dense = ENGINES["dense"](lm, dprof.engine_config, dprof.run, home=longctx_home())
    builder = PromptBuilder(lm.tokenizer, "auto", [])
    forced: list[int] = []
    barred: list[int] = []
    if args.inject or args.exclude_distractors:
        vote = engine.indexer._vote
        layers = None if args.inject in ("all", "") else {int(x) for x in args.inject.split(",")}

        def injected(layer_idx, scores, cache):
            scores = vote(layer_idx, scores, cache)
            if args.inject and forced and (layers is None or layer_idx in layers):
                scores = scores.clone()
                stored = [b for b in forced if b < scores.numel()]  # blocks still in the window need no help
                scores[stored] = scores.max() + 1.0
            if barred:
                scores = scores.clone()
                scores[[b for b in barred if b < scores.numel()]] = float("-inf")
            return scores
        engine.indexer._vote = injected
    diagnosis: dict = {}
    if args.diagnose:
        retrieve = engine.indexer.retrieve

        def diagnosed(layer, layer_idx, query, key, scaling, cache):
            if forced_question and layer.memory.n_blocks > cfg.top_k:
                diagnosis[layer_idx] = _needle_ranks(engine.indexer, layer, layer_idx, query, key, scaling, cache,
                                                     forced_question)
            return retrieve(layer, layer_idx, query, key, scaling, cache)
        engine.indexer.retrieve = diagnosed
    forced_question: list[int] = []
    rows = []
    budget = min(ANSWER_BUDGET[args.task], prof.run.max_new_tokens)  # as `longctx bench`: the same samples
    for sample in chosen_samples(args, lm.tokenizer, budget, builder.overhead()):
        doc = torch.cat([builder.prefix, _ids(lm.tokenizer, sample.document)])
        tail = builder.tail(sample.question, sample.answer_prefix)
        needles = [needle_blocks(lm.tokenizer, builder.prefix.numel(), sample.document, n, cfg.n_init,
                                 cfg.block_size) for n in sample.expected]
        wanted = sorted({b for blocks in needles for b in blocks})
        others = [b for b in distractor_blocks(lm.tokenizer, builder.prefix.numel(), sample.document,
                                               sample.expected, cfg.n_init, cfg.block_size) if b not in wanted]
        forced.clear()
        barred.clear()
        if dense is not None:
            ref = dense.prefill(doc, reserve=tail.numel() + budget)
        state = engine.prefill(doc, reserve=tail.numel() + budget)
        if dense is not None:
            exact_kv(state, ref.cache, cfg.n_init, cfg.block_size, args.exact_kv, args.exact_layers)
            del ref
            engine.activate()
        forced.extend(wanted)  # the question chunk only: decoding keeps its retrieval
        forced_question[:] = wanted
        if args.exclude_distractors:
            barred.extend(others)
        diagnosis.clear()
        text = AnswerText(lm.tokenizer, builder.stop_strings, builder.stop_ids)
        stream = engine.answer(state, tail, budget, Sampler())
        for token in stream:
            text.feed(token)
            if text.done:
                break
        stream.close()
        # The blocks decoding read: each retrieving layer's slots after the question.
        retrieved = {i: [b for b in layer.slots if b >= 0] for i, layer in enumerate(state.cache.layers)
                     if layer.retrieve}
        # Blocks not yet evicted sit in the window, which decoding reads whole.
        stored = next(layer.memory.n_blocks for layer in state.cache.layers if layer.retrieve)
        covered = {layer: all(b in got or b >= stored for b in wanted) for layer, got in retrieved.items()}
        row = {"index": sample.index, "prompt_hash": sample.prompt_hash, "depths": sample.depths,
               "score": 100 * score(sample, text.text), "answer": text.text.strip()[:80], "expected": sample.expected, "needle_blocks": needles,
               "layers_covering_needles": f"{sum(covered.values())}/{len(covered)}", "retrieved": retrieved}
        if others:
            row["distractor_blocks"] = others
            row["distractors_per_layer"] = {layer: sum(b in got or b >= stored for b in others)
                                            for layer, got in retrieved.items()}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "retrieved"}), flush=True)
        print("   retrieved per layer:", retrieved, flush=True)
        if diagnosis:
            row["needle_rank"] = dict(diagnosis)
            for layer_idx, ranks in diagnosis.items():
                print(f"   layer {layer_idx} needle rank:", ranks, flush=True)
    if args.out:
        args.out.write_text(json.dumps({**run_stamp(), "args": vars(args) | {"out": str(args.out)}, "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()
