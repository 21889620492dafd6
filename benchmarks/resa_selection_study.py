"""How well each block-scoring rule picks what dense decoding attends to (resa's accuracy against dense).

Harness samples are decoded densely (the recorder stands in for resa's sparse attention and returns dense
attention); at every decode step of every sparse layer the query and keys are handed to each scoring rule, and the
blocks a rule keeps (same k, same forced local and sink blocks) are compared with dense attention:
captured attention mass per query head and the relative error of the attention output.

    python benchmarks/resa_selection_study.py --tasks niah_single_3,niah_multivalue --length 4096 --samples 2

Rules: `mean` the paper's (Quest's bound of the GQA group's mean query), `max` the largest per-head bound,
`softmax` per-head softmax over the blocks' bounds summed over the group (NSA-style shared importance),
`maxnorm` the same without the softmax's denominator (exp of each bound less its head's best), `centroid`
the softmax pooling over q . (the block's mean key) instead of the bound, `hybrid` over the average of the
bound and q . mean (the shipped rule), `hybrid-local` / `hybrid-recent` / `hybrid-sink` the same pooling with each
head's scores taken less its score of the last (local) block, of the last block before it, or of the first (sink)
block instead of softmaxed over the row (no row-wide normaliser: every part of a row can score those blocks itself),
`hybrid-window` less the log-sum-exp of the 16 blocks that end at the last block before the local one,
`hybrid-stale` the softmax pooling with each head's normaliser from the step before (the same layer's; the
current one at a document's first step), `int8` the hybrid over the descriptors as the shipped profile stores them
(max + mean and min + mean as int8 codes of a scale per block, rounded outwards) with the query as it is, `int8-codes`
the same against the query's fixed-point codes (kernels.block_select.block_scores: the shipped scoring), and `oracle` the true attention mass per block summed over the group
(needs every key: an upper bound, not a rule). The floor is the paper's 16 blocks unless --min-blocks says
otherwise (the shipped 1,024 keeps every block of a CPU-sized document).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engines.resa.engine as resa_module  # noqa: E402
from engines import ENGINES  # noqa: E402
from engines.decoding import Sampler  # noqa: E402
from kernels import cdiv  # noqa: E402
from kernels.block_descriptors import update_block_descriptors  # noqa: E402
from kernels.block_select import KeepRule, block_scores  # noqa: E402
from longctx_cli.accuracy import PromptBuilder, _ids  # noqa: E402
from longctx_cli.home import longctx_home  # noqa: E402
from longctx_cli.models import load_model  # noqa: E402
from longctx_cli.profiles import resolve_profile  # noqa: E402
from longctx_cli.report import run_stamp  # noqa: E402
from longctx_cli.prompt import AnswerText  # noqa: E402
from longctx_cli.tasks import generate, score  # noqa: E402

RULES = ("mean", "max", "softmax", "maxnorm", "centroid", "hybrid", "hybrid-local", "hybrid-recent", "hybrid-sink",
         "hybrid-window", "hybrid-stale", "hybrid-ahead", "int8", "int8-codes", "oracle")


def block_extrema(k: torch.Tensor, n: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k: [Hkv, S, D] -> kmax, kmin [Hkv, NB, D] over the first n keys."""
    nb = cdiv(n, bs)
    pad = nb * bs - n
    kk = k[:, :n].float()
    hi = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=float("-inf")).view(k.shape[0], nb, bs, -1).amax(2)
    lo = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=float("inf")).view(k.shape[0], nb, bs, -1).amin(2)
    return hi, lo


def hybrid_logits(qg: torch.Tensor, bound: torch.Tensor, mu: torch.Tensor, scale: float) -> torch.Tensor:
    """The shipped rule's per-head block scores: Quest's bound [Hkv, G, NB] and q . mean averaged, scaled."""
    return (bound + torch.einsum("hgd,hnd->hgn", qg, mu)) * scale / 2


def quest_bound(qg: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Each head's Quest bound over each block: [Hkv, G, NB]."""
    return torch.maximum(qg[:, :, None] * hi[:, None], qg[:, :, None] * lo[:, None]).sum(-1)


def int8_descriptors(key: torch.Tensor, n: int, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key: [1, Hkv, S, D] -> the int8 codes of max + mean and min + mean [Hkv, NB, D] and their scale [Hkv, NB],
    as the engine stores them (descriptor_dtype int8)."""
    _, Hkv, _, D = key.shape
    nb = cdiv(n, bs)
    top = torch.zeros(1, Hkv, nb, D, dtype=torch.int8)
    bottom, step = top.clone(), torch.zeros(1, Hkv, nb)
    update_block_descriptors(key[:, :, :n], top, bottom, torch.tensor([n]), n, bs, fold_mean=True, scale=step)
    return top[0], bottom[0], step[0]


def int8_scores(qg: torch.Tensor, codes: tuple, scale: float, query_as_codes: bool) -> torch.Tensor:
    """The shipped rule over int8 descriptors (int8_descriptors): [Hkv, NB] by the selection's own block_scores,
    every block scored; with query_as_codes the bound of the query's fixed-point codes (the shipped scoring),
    otherwise of the query as it is against the dequantized codes."""
    top, bottom, step = codes
    Hkv, G, D = qg.shape
    n_blocks = top.shape[1]
    args = dict(block_size=1, local_blocks=0, pooling="softmax", scale=scale, folded=True)
    if query_as_codes:
        s = block_scores(qg.reshape(1, Hkv * G, D), top[None], bottom[None], torch.tensor([n_blocks]),
                         descriptor_scale=step[None], **args)
    else:
        s = block_scores(qg.reshape(1, Hkv * G, D), top[None].float() * step[None, ..., None],
                         bottom[None].float() * step[None, ..., None], torch.tensor([n_blocks]), **args)
    return s[0]


def rule_scores(rule: str, qg: torch.Tensor, hi, lo, probs_blocks, scale: float, mu=None, stale=None,
                codes=None, q_before=None) -> torch.Tensor:
    """qg: [Hkv, G, D]; hi, lo, mu (block mean keys): [Hkv, NB, D]; probs_blocks: [Hkv, G, NB] -> [Hkv, NB].
    stale: [Hkv, G, 1], each head's log-normaliser of the step before (hybrid-stale); codes: int8_descriptors;
    q_before: [Hkv, G, D], the layer's query of the step before (hybrid-ahead)."""
    if rule == "hybrid-ahead":
        return rule_scores("hybrid", qg if q_before is None else q_before, hi, lo, probs_blocks, scale, mu)
    if rule == "oracle":
        return probs_blocks.sum(1)
    if rule in ("int8", "int8-codes"):
        return int8_scores(qg, codes, scale, rule == "int8-codes")
    if rule == "centroid":
        return torch.softmax(torch.einsum("hgd,hnd->hgn", qg, mu) * scale, dim=-1).sum(1)
    if rule == "mean":
        q = qg.mean(1, keepdim=True)
        return torch.maximum(q[:, :, None] * hi[:, None], q[:, :, None] * lo[:, None]).sum(-1)[:, 0]
    bound = quest_bound(qg, hi, lo)
    if rule == "max":
        return bound.amax(1)
    if rule == "maxnorm":
        return torch.exp((bound - bound.amax(-1, keepdim=True)) * scale).sum(1)
    if rule.startswith("hybrid"):
        h = hybrid_logits(qg, bound, mu, scale)
        if rule == "hybrid":
            return torch.softmax(h, dim=-1).sum(1)
        if rule == "hybrid-stale":
            return torch.exp(h - (h.logsumexp(-1, keepdim=True) if stale is None else stale)).sum(1)
        nb = h.shape[-1]
        recent = h[..., -2:-1] if nb > 1 else h[..., -1:]
        window = h[..., max(0, nb - 17):max(1, nb - 1)].logsumexp(-1, keepdim=True)
        ref = {"hybrid-local": h[..., -1:], "hybrid-recent": recent, "hybrid-sink": h[..., :1],
               "hybrid-window": window}[rule]
        return torch.exp(h - ref).sum(1)
    return torch.softmax(bound * scale, dim=-1).sum(1)


class Recorder:
    def __init__(self, rule: KeepRule, block_size: int, rules: tuple[str, ...] = RULES):
        self.rule, self.bs, self.rules = rule, block_size, rules
        self.rows: list[dict] = []
        self.tag: dict = {}
        self.decode_with = "dense"  # the rule whose sparse output is returned (generation follows it)
        self.lse: dict[int, tuple[int, torch.Tensor]] = {}  # layer (call order within a step) -> (n, log-normaliser)
        self.queries: dict[int, tuple[int, torch.Tensor]] = {}  # layer -> (n, its query at that step)
        self.layer, self.last_n = 0, -1

    def __call__(self, q, key, value, blocks, length, *, block_size, scale):
        n = int(length[0])
        B, Hq, D = q.shape
        Hkv = key.shape[1]
        qg = q[0].float().view(Hkv, Hq // Hkv, D)
        k, v = key[0, :, :n].float(), value[0, :, :n].float()
        logits = torch.einsum("hgd,hsd->hgs", qg, k) * scale
        probs = torch.softmax(logits, -1)
        dense_out = torch.einsum("hgs,hsd->hgd", probs, v)
        nb = cdiv(n, self.bs)
        pad = nb * self.bs - n
        pb = torch.nn.functional.pad(probs, (0, pad)).view(Hkv, -1, nb, self.bs).sum(-1)  # [Hkv, G, NB]
        hi, lo = block_extrema(key[0], n, self.bs)
        mu = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(Hkv, nb, self.bs, D).sum(2)
        mu = mu / torch.full((nb,), float(self.bs)).index_fill_(0, torch.tensor([nb - 1]), float(n - (nb - 1) * self.bs))[None, :, None]
        self.layer = self.layer + 1 if n == self.last_n else 0
        self.last_n = n
        h = hybrid_logits(qg, quest_bound(qg, hi, lo), mu, scale)
        codes = int8_descriptors(key[:, :, :n].float(), n, self.bs) if {"int8", "int8-codes"} & set(self.rules) \
            else None
        prev = self.lse.get(self.layer)
        stale = prev[1] if prev is not None and prev[0] == n - 1 else None
        self.lse[self.layer] = (n, h.logsumexp(-1, keepdim=True))
        prev_q = self.queries.get(self.layer)
        q_before = prev_q[1] if prev_q is not None and prev_q[0] == n - 1 else None
        self.queries[self.layer] = (n, qg)
        keep = self.rule.keep(nb)
        forced = torch.zeros(nb, dtype=torch.bool)
        forced[max(0, nb - self.rule.local_blocks):] = True
        forced[:self.rule.sink_blocks] = True
        row = {**self.tag, "n": n, "blocks": nb, "keep": keep}
        returned = dense_out
        kept = {}
        for name in self.rules:
            s = rule_scores(name, qg, hi, lo, pb, scale, mu, stale, codes, q_before).masked_fill(forced[None], float("inf"))
            top = torch.topk(s, keep, dim=-1).indices  # [Hkv, keep]
            mask = kept[name] = torch.zeros(Hkv, nb, dtype=torch.bool).scatter_(1, top, True)
            tokmask = mask.repeat_interleave(self.bs, dim=1)[:, :n]  # [Hkv, n]
            sl = logits.masked_fill(~tokmask[:, None], float("-inf"))
            out = torch.einsum("hgs,hsd->hgd", torch.softmax(sl, -1), v)
            mass = (probs * tokmask[:, None]).sum(-1).flatten()
            err = ((out - dense_out).norm(dim=-1) / dense_out.norm(dim=-1)).flatten()
            if name == self.decode_with:
                returned = out
            row[name] = {"mass_min": round(float(mass.min()), 4), "mass_mean": round(float(mass.mean()), 4),
                         "err_max": round(float(err.max()), 4), "err_mean": round(float(err.mean()), 4)}
        if {"int8", "int8-codes"} <= kept.keys():
            # What the query's fixed-point codes change: the share of blocks kept by both int8 rules.
            row["int8-codes"]["same_as_int8"] = round(float((kept["int8"] & kept["int8-codes"]).sum() / (Hkv * keep)),
                                                      4)
        self.rows.append(row)
        return returned.view(1, Hq, D).to(q.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="niah_single_3,niah_multivalue")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--keep-ratio", type=float, default=0.1)
    parser.add_argument("--min-blocks", type=int, default=16, help="the rule's floor (the paper's 16)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--decode-with", default="dense",
                        help="comma-separated: dense and/or rules; each generates its own answers (scored)")
    parser.add_argument("--model", default=None, help="as `longctx ask --model` (default: the embedded model)")
    parser.add_argument("--rules", default="all", help="comma-separated rules to score (default: all; each "
                                                        "--decode-with rule is scored too)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    lm = load_model(args.model, device="auto", dtype="auto")
    # The engine must take its sparse path for the recorder to see each step (keeping every block, it decodes
    # densely); the recorder returns dense attention (or the chosen rule's), whatever blocks the engine picked.
    prof = resolve_profile("resa", {"keep_ratio": 0.5, "min_blocks": 16, "rectify_every": 0})
    engine = ENGINES["resa"](lm, prof.engine_config, prof.run, home=longctx_home())
    cfg = prof.engine_config
    asked = RULES if args.rules == "all" else tuple(args.rules.split(","))
    decoders = [m for m in args.decode_with.split(",") if m != "dense"]
    unknown = sorted(set(asked + tuple(decoders)) - set(RULES))
    if unknown:
        parser.error(f"unknown rules {unknown}; known: {', '.join(RULES)}")
    rules = tuple(r for r in RULES if r in asked or r in decoders)
    rec = Recorder(KeepRule(args.keep_ratio, args.min_blocks, cfg.local_blocks, cfg.sink_blocks), cfg.block_size,
                   rules)
    resa_module.sparse_decode_attention = rec
    builder = PromptBuilder(lm.tokenizer, "auto", [])
    scores: dict[str, list[float]] = {}
    for task in args.tasks.split(","):
        for sample in generate(task, args.length, args.samples, lm.tokenizer, seed=0, budget=args.max_new_tokens,
                               overhead=builder.overhead()):
            doc = torch.cat([builder.prefix, _ids(lm.tokenizer, sample.document)])
            tail = builder.tail(sample.question, sample.answer_prefix)
            for mode in args.decode_with.split(","):
                rec.decode_with = mode
                state = engine.prefill(doc, reserve=tail.numel() + args.max_new_tokens)
                text = AnswerText(lm.tokenizer, builder.stop_strings, builder.stop_ids)
                stream = engine.answer(state, tail, args.max_new_tokens, Sampler())
                for step, token in enumerate(stream):
                    rec.tag = {"task": task, "sample": sample.index, "mode": mode, "step": step + 1}
                    text.feed(token)
                    if text.done:
                        break
                stream.close()
                got = 100 * score(sample, text.text)
                scores.setdefault(f"{task}/{mode}", []).append(got)
                print(task, sample.index, mode, got, repr(text.text.strip()[:60]), sample.expected, flush=True)
    print({k: round(statistics.fmean(v), 1) for k, v in scores.items()})

    summary = {}
    for name in rules:
        vals = [r[name] for r in rec.rows]
        summary[name] = {key: round(statistics.fmean(v[key] for v in vals), 4) for key in vals[0]}
        if name == "int8-codes" and "same_as_int8" in vals[0]:
            summary[name]["same_as_int8_min"] = min(v["same_as_int8"] for v in vals)
        summary[name]["err_max_p90"] = round(sorted(v["err_max"] for v in vals)[int(0.9 * len(vals))], 4)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**run_stamp(), "args": vars(args) | {"out": str(args.out)},
                                        "summary": summary, "scores": scores, "rows": rec.rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
