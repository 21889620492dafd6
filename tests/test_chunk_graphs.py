"""Prefill chunks' fixed-shape work replayed as CUDA graphs (engines/chunk_graphs.py): the same results as the
eager calls, for a function, the layers' norms and MLPs, and ltri-stream's query side; CPU tensors run eagerly."""

import pytest
import torch

from engines import chunk_graphs
from engines.chunk_graphs import ChunkGraph
from tests.conftest import make_engine


def _work(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.nn.functional.silu(x @ w)
    return y, torch.sort(y.sum(dim=-1), stable=True).indices


def test_cpu_tensors_run_the_function_itself():
    graph = ChunkGraph(_work)
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    got = graph(x, w)
    assert not graph.captured and graph.replays == 0
    for a, b in zip(got, _work(x, w)):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_replays_compute_new_inputs_as_the_function_does():
    """The first call captures (and returns the eager results), later calls of that shape replay into the same
    output tensors, other shapes run eagerly; every result equals the function's own."""
    torch.manual_seed(42)
    w = torch.randn(64, 48, device="cuda")
    graph = ChunkGraph(lambda x: _work(x, w))
    outputs = None
    for i in range(4):
        x = torch.randn(1000, 64, device="cuda")
        got = graph(x)
        want = _work(x, w)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        if i == 1:
            outputs = got
        elif i > 1:
            assert all(a is b for a, b in zip(got, outputs))  # the graph's own outputs, written again
    assert graph.captured and graph.replays == 3
    x = torch.randn(63, 64, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(graph(x), _work(x, w))) and graph.replays == 3


@pytest.mark.gpu
def test_graphs_sharing_their_inputs_replay_in_turn():
    """Two graphs with one captured input (a model's layers): called in turn, each computes from its own call's
    input, and the first's result stays intact until it is replayed again."""
    torch.manual_seed(42)
    shared: dict = {}
    weights = [torch.randn(64, 48, device="cuda") for _ in range(2)]
    graphs = [ChunkGraph(lambda x, w=w: _work(x, w), inputs=shared) for w in weights]
    for _ in range(3):
        xs = [torch.randn(1000, 64, device="cuda") for _ in range(2)]
        got = [g(x) for g, x in zip(graphs, xs)]
        for out, x, w in zip(got, xs, weights):
            assert all(torch.equal(a, b) for a, b in zip(out, _work(x, w)))
    assert graphs[0].inputs[0] is graphs[1].inputs[0] and len(shared) == 1


def _prefill(lm, name, ids, **settings):
    engine = make_engine(lm, name, **settings)
    state = engine.prefill(ids, reserve=16)
    return engine, state


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen3-1.7b", "gemma3-270m"])
def test_graphed_norms_and_mlps_prefill_as_the_modules_do(preset, monkeypatch):
    """dense on random Qwen3 and Gemma 3 shapes (two and four norms a layer; Gemma's sliding-window layers), 40
    chunks of 64 tokens: the last logits and every layer's K/V equal those of the model's own modules, and the
    modules are back in place afterwards; after an answer has regrouped the MLPs' weights (fused projections), the
    graphs are captured again and still agree."""
    from engines.decoding import Sampler
    from longctx_cli import models
    from longctx_cli.models import load_model

    # A model of its own: one another test has answered with (the process keeps loaded models) has its weights
    # regrouped already, and the answer below would move nothing.
    monkeypatch.setattr(models, "_LOADED", {})
    lm = load_model(f"random:{preset}", device="cuda", dtype="bfloat16")
    ids = torch.randint(1000, 20000, (40 * 64 + 17,), generator=torch.Generator().manual_seed(3))
    layers = lm.model.get_decoder().layers
    before = [type(layer.mlp) for layer in layers]
    eager = _prefill(lm, "dense", ids, chunk_size=64, prefill_graphs=False)[1]
    engine, graphed = _prefill(lm, "dense", ids, chunk_size=64, prefill_graphs=True)
    assert [type(layer.mlp) for layer in layers] == before
    assert not eager.cache.prefill_graphs and graphed.cache.prefill_graphs
    modules = chunk_graphs.for_model(lm.model)
    assert modules.replays() > 0
    torch.testing.assert_close(graphed.last_logits, eager.last_logits, rtol=0, atol=0)
    for a, b in zip(eager.cache.layers, graphed.cache.layers):
        assert torch.equal(a.keys, b.keys)
    weights = modules.weights
    list(engine.answer(graphed, ids[:8], 4, Sampler()))  # the decode step fuses gate and up
    again = engine.prefill(ids, reserve=16)
    assert modules.weights != weights
    torch.testing.assert_close(again.last_logits, eager.last_logits, rtol=0, atol=0)


@pytest.mark.gpu
def test_ltri_prefill_with_graphs_retrieves_as_without(monkeypatch):
    """ltri-stream on a random Llama shape cut to 4 layers (48 chunks, past its 2K context: positions re-assigned):
    with the norms, MLPs and query side replayed as graphs, every retrieval counter, index entry and slot, and the
    last logits, equal the eager prefill's."""
    from longctx_cli.models import load_model
    from longctx_cli.presets import RANDOM_PRESETS

    shape = dict(RANDOM_PRESETS["llama-3.1-8b"], num_hidden_layers=4, intermediate_size=1024,
                 max_position_embeddings=2048, rope_parameters=dict(rope_type="default", rope_theta=500000.0))
    monkeypatch.setitem(RANDOM_PRESETS, "llama-4-layers-test", shape)
    lm = load_model("random:llama-4-layers-test", device="cuda", dtype="bfloat16")
    ids = torch.randint(1000, 20000, (48 * 128,), generator=torch.Generator().manual_seed(4))
    small = dict(n_init=64, block_size=64, top_k=4, n_local=256, chunk_size=128)
    runs = [_prefill(lm, "ltri-stream", ids, prefill_graphs=on, **small) for on in (False, True)]
    (e0, s0), (e1, s1) = runs
    c0, c1 = e0.counters(s0), e1.counters(s1)
    assert c1["ltri_query_graph_layers"] == 4 and "ltri_query_graph_layers" not in c0
    assert s0.cache.positions is not None
    skip = {"ltri_query_graph_layers", "prefill_cuda_graphs"}
    assert {k: v for k, v in c0.items() if k not in skip} == {k: v for k, v in c1.items() if k not in skip}
    for a, b in zip(s0.cache.layers, s1.cache.layers):
        assert a.slots == b.slots
        n = a.index.n
        assert n == b.index.n
        for x, y in ((a.index.vectors.used, b.index.vectors.used), (a.index.block.used, b.index.block.used)):
            assert torch.equal(x, y)
    torch.testing.assert_close(s1.last_logits, s0.last_logits, rtol=0, atol=0)


def test_plan_counts_the_graphs_kept_buffers():
    """`longctx plan`'s activations include what the prefill graphs keep: per layer its norms' and MLP's outputs
    (Gemma 3: four norms) and one shared input, for chunks small enough to be graphed."""
    from longctx_cli.models import load_config

    llama, gemma = load_config("random:llama-3.1-8b"), load_config("random:gemma3-270m")
    assert chunk_graphs.kept_bytes(llama, 512, 2) == (32 * 3 + 1) * 512 * 4096 * 2
    assert chunk_graphs.kept_bytes(llama, 2048, 2) == 0  # 16 MiB a chunk: eager
    assert chunk_graphs.kept_bytes(gemma, 512, 2) == (18 * 5 + 1) * 512 * 640 * 2


def test_graphs_only_where_enough_small_chunks_repay_the_captures():
    from longctx_cli.models import load_config
    from longctx_cli.profiles import RunSettings

    llama = load_config("random:llama-3.1-8b")
    run = RunSettings(chunk_size=512)
    assert chunk_graphs.graphed(llama, run, 32 * 512, 2)
    assert not chunk_graphs.graphed(llama, run, 32 * 512 - 1, 2)  # 31 full chunks
    assert not chunk_graphs.graphed(llama, RunSettings(chunk_size=2048), 10**6, 2)  # 16 MiB a chunk
    assert not chunk_graphs.graphed(llama, RunSettings(chunk_size=512, prefill_graphs=False), 10**6, 2)
