"""A model split over two GPUs (`--gpus-model 2`), run on two GPUs; skipped with fewer.

Random weights are drawn on one GPU and the same weights spread over two (accelerate's hooks), so the split model
and the single-GPU one compute the same function: teacher-forced NLLs are compared (greedy tokens of a random
model are degenerate), per engine, with the split decode step replayed from one CUDA graph per GPU. Each layer's
state must sit on its layer's GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engines.decoding import Sampler
from engines.resa.cache import ResaKVCache
from longctx_cli.models import LoadedModel, load_model
from longctx_cli.split import dispatch, layer_split
from tests.conftest import make_engine
from tests.test_split import _misplaced

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs")]

RUNS = [("dense", {}), ("resa", {"rectify_every": 8}),
        ("sas-pattern", {"pattern": "Rect(keys=0:64) + Diag(window=1024)"}),
        ("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 4, "n_local": 1024}),
        ("star", {"min_block_size": 1024})]


@pytest.fixture(autouse=True)
def _resa_selects(monkeypatch):
    """resa's selection, sparse kernels and rectification graphs on the split model: under the shipped floor these
    documents keep every block, where resa would otherwise decode with dense's kernel."""
    monkeypatch.setattr(ResaKVCache, "dense_when_every_block_kept", False)


@pytest.fixture(scope="module")
def pair():
    """random:qwen3-1.7b in bf16 on cuda:0, and a copy of the same weights split over cuda:0 and cuda:1."""
    one = load_model("random:qwen3-1.7b", device="cuda:0", dtype="bfloat16")
    model = copy.deepcopy(one.model)
    split = layer_split(model.config, ["cuda:0", "cuda:1"], torch.bfloat16, model=model)
    for name, device in split.device_map.items():
        model.get_submodule(name).to(device)
    dispatch(model, split.device_map)
    two = LoadedModel(model, one.tokenizer, one.name, True, 0.0, [torch.device("cuda:0"), torch.device("cuda:1")])
    return one, two, split


def _nll(engine, ids, question, targets):
    state = engine.prefill(ids, reserve=question.numel() + len(targets))
    return torch.tensor(engine.teacher_forced_nll(state, question, targets)), state


@pytest.mark.parametrize("profile, settings", RUNS, ids=[p for p, _ in RUNS])
def test_split_over_two_gpus_scores_as_one_gpu(pair, profile, settings):
    one, two, split = pair
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1000, 20000, (6000,), generator=gen)
    question, targets = ids[:16], ids[100:132].tolist()
    want, _ = _nll(make_engine(one, profile, chunk_size=1024, **settings), ids, question, targets)
    engine = make_engine(two, profile, chunk_size=1024, **settings)
    assert not engine.single_device
    got, state = _nll(engine, ids, question, targets)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=1e-2)
    assert engine.counters(state)["decode_cuda_graph"] == "one per device (2)"
    assert _misplaced(state.cache, split.device_of_layer) == {}
    assert {layer.keys.device.index for layer in state.cache.layers if layer.is_initialized} == {0, 1}


@pytest.mark.parametrize("profile, settings", RUNS[:2], ids=[p for p, _ in RUNS[:2]])
def test_per_gpu_graphs_score_as_the_eager_split_step(pair, profile, settings):
    """The split step replayed from a graph per GPU against the same step run eagerly: the same NLLs up to the
    captured step's own kernels (its one-row projections are the project's GEMVs, eager steps cuBLAS's), so
    teacher-forced, not greedy tokens, which a random model's near-ties send apart after a few steps."""
    _, two, _ = pair
    ids = torch.randint(1000, 20000, (3000,), generator=torch.Generator().manual_seed(4))
    question, targets = ids[:8], ids[100:140].tolist()
    nlls = []
    for graph in (True, False):
        got, state = _nll(make_engine(two, profile, chunk_size=1024, decode_graph=graph, **settings), ids, question,
                          targets)
        assert (state.decode.segments is not None) == graph
        nlls.append(got)
    torch.testing.assert_close(nlls[0], nlls[1], atol=3e-2, rtol=1e-2)


@pytest.mark.slow
def test_the_70b_shape_runs_over_two_gpus():
    free = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    if min(free) < 80 * 2**30:
        pytest.skip("needs ~75 GiB free on each of two GPUs")
    lm = load_model("random:llama-3.1-70b", device="auto", dtype="bfloat16", gpus_model=2)
    layers = lm.model.get_decoder().layers
    # The cut follows each GPU's free memory (this module's other models sit on the first): one run of layers
    # per GPU, about half each.
    on = [next(layer.parameters()).device.index for layer in layers]
    cut = on.index(1)
    assert on == [0] * cut + [1] * (80 - cut) and 30 <= cut <= 50, on
    engine = make_engine(lm, "dense", chunk_size=2048)
    ids = torch.randint(1000, 20000, (4096,), generator=torch.Generator().manual_seed(5))
    state = engine.prefill(ids, reserve=40)
    tokens = list(engine.answer(state, ids[:8], 16, Sampler()))
    assert len(tokens) == 16
    assert engine.counters(state)["decode_cuda_graph"] == "one per device (2)"
    assert _misplaced(state.cache, lambda i: f"cuda:{on[i]}") == {}
