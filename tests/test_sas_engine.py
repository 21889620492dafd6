"""sas-pattern on the embedded model (CPU): full causal = dense, static patterns = the pattern as a dense
mask over the whole sequence (a plain HF forward), H2O keeps heavy hitters, bad patterns are one line."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_utils import AttentionInterface

from engines.sas.parse import parse_pattern
from engines.sas.pattern import Diag
from tests.conftest import greedy_answer, make_engine, run_cli, story_ids

pytestmark = pytest.mark.slow



def _masked_forward_answer(lm, pattern_text: str, ids: torch.Tensor, n_new: int) -> list[int]:
    """Greedy tokens from plain full-sequence forwards whose attention is the pattern as a dense mask
    (sliding layers: their own window): what the compacted cache must reproduce exactly."""
    pattern = parse_pattern(pattern_text)
    window = lm.model.config.get_text_config(decoder=True).sliding_window

    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
        rule = Diag(window=sliding_window) if sliding_window else pattern
        pos = torch.arange(query.shape[2])
        mask = rule.visible(pos[:, None], pos[None, :])
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.masked_fill(~mask.any(-1, keepdim=True), 0.0).transpose(1, 2), None

    assert window
    AttentionInterface.register("sas_test_dense_mask", attention)
    previous = lm.model.config._attn_implementation
    lm.model.set_attn_implementation("sas_test_dense_mask")
    try:
        tokens = ids.tolist()
        with torch.inference_mode():
            for _ in range(n_new):
                logits = lm.model(input_ids=torch.tensor([tokens]), use_cache=False, logits_to_keep=1).logits
                tokens.append(int(logits[0, -1].argmax()))
    finally:
        lm.model.set_attn_implementation(previous)
    return tokens[ids.numel():]


@pytest.mark.parametrize("pattern", [
    pytest.param("Rect(keys=0:8) + Diag(window=150)", id="streaming"),  # sinks + window, several ring turns
    # block-local: a ring of blocks (its slot function is tested in test_sas_pattern.py)
    pytest.param("Rect(size=[64, 64]) >> Diag(window=2)", id="block-local", marks=pytest.mark.long),
    pytest.param("Diag(window=300) + Diag(stride=97)", id="strided"),  # the cache keeps keys the window left long ago
])
def test_static_pattern_equals_dense_mask(lm, story_text, pattern):
    doc, question = story_ids(lm, story_text, 600)
    engine = make_engine(lm, "sas-pattern", chunk_size=256, pattern=pattern)
    got, state = greedy_answer(engine, doc, question, 4)
    want = _masked_forward_answer(lm, pattern, torch.cat([doc, question]), 4)
    assert got == want
    full = next(layer for layer in state.cache.layers if not layer.is_sliding)
    assert full.static < state.cache.capacity  # the cache really is compacted


def test_h2o_keeps_the_attention_sink(lm, story_text):
    """H2O's premise: heavy hitters. Gemma's first token takes much of the attention on full layers, so
    with a window that has long left it behind, the pool must still hold it."""
    doc, question = story_ids(lm, story_text, 1000)
    engine = make_engine(lm, "sas-pattern", chunk_size=256, pattern="Diag(window=128) + Dynamic(budget=16)")
    _, state = greedy_answer(engine, doc, question, 4)
    for layer in state.cache.layers:
        if layer.is_sliding:
            continue
        pool = layer.key_pos[0, :, layer.static:layer.staging]
        assert layer.pool == 16
        assert (pool >= 0).all() and all(len(set(h.tolist())) == 16 for h in pool)  # full, no duplicates
        assert (pool == 0).any(dim=-1).all(), f"layer pool {pool.tolist()} lost the sink"


def test_h2o_refresh_runs_and_counts(lm, story_text):
    doc, question = story_ids(lm, story_text, 600)
    engine = make_engine(lm, "sas-pattern", chunk_size=256,
                         pattern="Diag(window=128) + Dynamic(budget=32, refresh=true, score=attn.max.pool(3))")
    tokens, state = greedy_answer(engine, doc, question, 4)
    assert len(tokens) == 4
    full = next(layer for layer in state.cache.layers if not layer.is_sliding)
    # refresh keeps every key that left the window (none is lost), reading only 32 of them per step
    assert full.pool == state.cache.capacity - 128
    assert "H2O" in engine.counters(state)["kv_cache_slots"]


@pytest.mark.parametrize("pattern,column", [
    ("Diag(window=-4)", 6), ("Diagonal()", 1), ("Rect(keys=0:32) +", 18), ("Dynamic(budget=4) + Dynamic(budget=2)", None),
], ids=["negative-window", "unknown-primitive", "truncated", "two-dynamic"])
def test_bad_pattern_is_one_line_exit_4(pattern, column, capsys, monkeypatch, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.")
    code, out, err = run_cli(["ask", "--profile", "sas-pattern", "--set", f"pattern={pattern}", str(doc), "Q?"],
                             capsys, monkeypatch)
    assert code == 4 and out == ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "pattern" in lines[0]
    if column:
        assert f"column {column}" in lines[0]


def test_plan_reports_cache_size(capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--profile", "sas-block-local", "--tokens", "16k"], capsys, monkeypatch)
    assert code == 0
    text = " ".join(err.split())
    assert "sas-pattern KV cache: 384 of" in text and "cache index of key k: k % 384" in text


@pytest.mark.gpu
def test_gpu_flex_prefill_and_graph_decode_match_cpu_reference():
    """Random Gemma-shaped model: the GPU path (Flex prefill, the pattern generated into the Triton decode
    kernel, in a CUDA graph) gives the CPU reference path's next-token distributions, with the same weights."""
    from longctx_cli.models import load_model

    cpu_lm = load_model("random:gemma3-270m", device="cpu", dtype="float32")
    # Random weights are drawn on the target device, by its own generator: copy the CPU ones over.
    gpu_lm = dataclasses.replace(cpu_lm, model=copy.deepcopy(cpu_lm.model).to("cuda"),
                                 devices=[torch.device("cuda")])
    doc = torch.randint(10, 200, (1500,), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(10, 200, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    nll = {}
    for device, lm in (("cpu", cpu_lm), ("cuda", gpu_lm)):
        engine = make_engine(lm, "sas-pattern", chunk_size=512, pattern="Rect(keys=0:16) + Diag(window=300)")
        state = engine.prefill(doc, reserve=3 + len(targets))
        # Teacher-forced: every step's whole distribution is compared, not only a (degenerate) greedy pick.
        nll[device] = torch.tensor(engine.teacher_forced_nll(state, torch.tensor([5, 6, 7]), targets))
        if device == "cuda":
            assert engine.counters(state)["decode_cuda_graph"]
    torch.testing.assert_close(nll["cuda"], nll["cpu"], rtol=1e-4, atol=1e-4)
