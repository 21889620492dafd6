"""Retrieval heads (Wu et al. 2024, as Ltri-LLM section 3.5 uses them), identified once per model and cached.

A head's retrieval score is how often, while the model copies a needle from a long context, the key it
attends to most is the very needle token being copied. Here the copy is teacher-forced: a haystack of seeded
random sentences with a needle ("The secret code is <word>-<digits>."), the question, then the needle's value
as the answer; at each answer token, a head scores when its top key (eager attention) holds that same token
inside the needle. Per layer the best head counts if its score is above 0.1 (the paper's cut-off).

Scores are keyed by the model's name and configuration (dtype and transformers version included). The package
ships the named models' scores in float32 (retrieval_heads/, as `cached_heads` writes them; the long tests
compute them again and compare), so a first run on the CPU does not pay ~10-40 s for them; other models and
dtypes are scored on first use and kept under $LONGCTX_HOME.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

_WORDS = ("river stone market window garden letter morning silver harbor winter paper orange basket candle "
          "forest bridge engine signal copper valley meadow lantern ribbon pepper marble castle anchor velvet "
          "thunder pillow summit violet saddle cotton falcon meadow planet rocket canyon whistle feather").split()
CUTOFF = 0.1


def _sample(rng: random.Random, n_sentences: int) -> tuple[str, str, str]:
    """(context, question, value): a haystack with one needle at a random depth."""
    value = f"{rng.choice(_WORDS)}-{rng.randint(1000, 9999)}"
    sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."
                 for _ in range(n_sentences)]
    sentences.insert(rng.randint(1, n_sentences - 1), f"The secret code is {value}.")
    return " ".join(sentences), "\n\nQuestion: What is the secret code?\nAnswer: The secret code is", value


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def score_heads(model, tokenizer, layers: list[int], samples: int = 4, n_sentences: int = 80,
                seed: int = 0) -> dict[int, list[float]]:
    """{layer: [score per query head]} for the given decoder layers (eager attention, one sample at a time)."""
    rng = random.Random(seed)
    device = model.get_input_embeddings().weight.device
    previous = model.config._attn_implementation
    hits: dict[int, torch.Tensor] = {}
    total = 0
    model.set_attn_implementation("eager")
    try:
        for _ in range(samples):
            context, question, value = _sample(rng, n_sentences)
            bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
            head = bos + _tokens(tokenizer, context.split("The secret code is")[0])
            needle = _tokens(tokenizer, f"The secret code is {value}.")
            rest = _tokens(tokenizer, " " + context.split(f"{value}.", 1)[1] + question)
            answer = _tokens(tokenizer, " " + value)
            ids = torch.tensor([head + needle + rest + answer], device=device)
            out = model(input_ids=ids, output_attentions=True, use_cache=False, logits_to_keep=1)
            lo, hi = len(head), len(head) + len(needle)
            first = ids.shape[1] - len(answer)
            for layer in layers:
                att = out.attentions[layer][0].to(device)  # [H, T, T]; the layer's device where split
                top = att[:, first - 1:ids.shape[1] - 1].argmax(dim=-1)  # [H, answer]: key each head reads most
                target = ids[0, first:]
                copied = (top >= lo) & (top < hi) & (ids[0][top] == target[None])
                hits[layer] = hits.get(layer, 0) + copied.float().sum(dim=1).cpu()
            total += len(answer)
    finally:
        model.set_attn_implementation(previous)
    return {layer: (h / total).tolist() for layer, h in hits.items()}


def best_heads(scores: dict[int, list[float]]) -> dict[int, tuple[int, float]]:
    """{layer: (head, score)} for layers whose best head passes the cut-off."""
    out = {}
    for layer, per_head in scores.items():
        head = max(range(len(per_head)), key=per_head.__getitem__)
        if per_head[head] > CUTOFF:
            out[layer] = (head, per_head[head])
    return out


_COMPUTED: dict[str, dict[int, list[float]]] = {}  # scores computed in this process, by model key
SHIPPED = Path(__file__).with_name("retrieval_heads")


def heads_key(model, model_name: str) -> str:
    """The scores' file name: the model's name and its whole configuration (dtype, transformers version)."""
    return hashlib.sha256(f"{model_name}|{model.config.to_json_string()}".encode()).hexdigest()[:16]


def cached_heads(model, tokenizer, model_name: str, layers: list[int],
                 home: Path | None) -> dict[int, tuple[int, float]]:
    """best_heads from the package's scores for this model, else from home/retrieval_heads/, else computed now
    and kept there (home None: kept for this process only)."""
    key = heads_key(model, model_name)
    path = None if home is None else home / "retrieval_heads" / f"{key}.json"
    scores = _COMPUTED.get(key)
    for known in (SHIPPED / f"{key}.json", path):
        if scores is None and known is not None and known.exists():
            scores = _read_scores(known, layers)
    if scores is None:
        scores = score_heads(model, tokenizer, layers)
        if path is not None:
            _write_atomic(path, json.dumps({"model": model_name, "method": "Wu et al. 2024, teacher-forced copy",
                                            "scores": scores}, indent=1))
    _COMPUTED[key] = scores
    return best_heads({layer: s for layer, s in scores.items() if layer in layers})


def _read_scores(path: Path, layers: list[int]) -> dict[int, list[float]] | None:
    """The cached scores, or None (after one warning line) when the file is damaged: they are computed again."""
    try:
        scores = {int(k): [float(x) for x in v] for k, v in json.loads(path.read_text())["scores"].items()}
        if set(layers) <= set(scores):
            return scores
        problem = "layers missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        problem = type(exc).__name__
    print(f"warning: {path}: damaged retrieval-head cache ({problem}); identifying the heads again", file=sys.stderr)
    return None


def _write_atomic(path: Path, text: str) -> None:
    """Written to a temporary name and renamed: a crash leaves the old file or none, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".partial",
                                     delete=False) as tmp:
        try:
            tmp.write(text)
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, path)
