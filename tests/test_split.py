"""A model split over several devices (`--gpus-model`), checked on CPU.

- the split itself (longctx_cli/split.py): layers in order, the 70B shape halved over two GPUs, memory and
  per-layer state moving the cut, tied embeddings, the per-layer state summing to the engine's plan;
- placement: each layer's state allocated where the map puts its layer. On a CPU-only machine every real device
  is the CPU, so the maps here put some layers on the meta device: a tensor allocated anywhere but its layer's
  device shows up;
- the split path end to end: the embedded model dispatched by accelerate with its hooks (every device the CPU)
  answers token for token as the unsplit one, for every engine.
GPU runs over two devices: tests/test_split_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from engines import ENGINES
from longctx_cli.errors import ConfigError
from longctx_cli.models import LoadedModel, load_config, resolve_model_dir
from longctx_cli.split import dispatch, layer_split, layer_state_bytes, materialise, model_parts
from tests.conftest import greedy_answer, make_engine, run_cli, story_ids
from tests.test_engine_contract import PLANNED


def _runs(split) -> list[tuple[int, int]]:
    return [(r.start, r.stop) for r in split.layers]


def test_the_70b_shape_halves_over_two_gpus():
    config = load_config("random:llama-3.1-70b")
    split = layer_split(config, ["cuda:0", "cuda:1"], torch.bfloat16)
    assert _runs(split) == [(0, 40), (40, 80)]
    layers = {int(name.rsplit(".", 1)[1]): dev for name, dev in split.device_map.items() if ".layers." in name}
    assert layers == {i: "cuda:0" if i < 40 else "cuda:1" for i in range(80)}
    assert split.device_map["model.embed_tokens"] == split.device_map["model.rotary_emb"] == "cuda:0"
    assert split.device_map["model.norm"] == split.device_map["lm_head"] == "cuda:1"
    assert 141.0e9 < sum(split.weights) < 141.2e9  # bf16
    assert abs(split.weights[0] - split.weights[1]) < 0.01 * split.weights[0]
    assert [split.device_of_layer(i) for i in (0, 39, 40, 79)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_memory_and_state_move_the_cut():
    config = load_config("random:llama-3.1-70b")
    devices = ["cuda:0", "cuda:1"]
    # Twice the memory on the first GPU: about two thirds of the layers there.
    assert 50 <= len(layer_split(config, devices, torch.bfloat16, memory=[2, 1]).layers[0]) <= 56
    # The first ten layers hold a layer's weights' worth of state each: the first GPU takes fewer layers.
    per_layer = layer_split(config, devices, torch.bfloat16).weights[0] // 40
    heavy = layer_split(config, devices, torch.bfloat16, layer_state=[per_layer] * 10 + [0] * 70)
    assert len(heavy.layers[0]) < 40
    assert heavy.state == [10 * per_layer, 0]


def test_tied_embeddings_keep_the_head_with_them():
    split = layer_split(load_config(None), ["cuda:0", "cuda:1", "cuda:2"], torch.float32)
    assert split.device_map["lm_head"] == split.device_map["model.embed_tokens"] == "cuda:0"
    assert split.device_map["model.norm"] == "cuda:2"
    assert all(len(r) >= 1 for r in split.layers) and split.layers[-1].stop == 18
    # The two devices after the embedding's share the other layers evenly.
    assert abs(len(split.layers[1]) - len(split.layers[2])) <= 1


def test_more_devices_than_layers_is_refused():
    with pytest.raises(ConfigError, match="18 decoder layers"):
        layer_split(load_config(None), [f"cuda:{i}" for i in range(19)], torch.float32)


@pytest.mark.parametrize("profile, settings", PLANNED, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()) or "defaults")
def test_layer_state_sums_to_the_engine_plan(profile, settings):
    from longctx_cli.profiles import resolve_profile

    prof = resolve_profile(profile, {"chunk_size": 256, **settings})
    config, cls = load_config(None), ENGINES[prof.engine]
    args = dict(chunk_size=256, reserve=40)
    per_layer = layer_state_bytes(cls, config, 3000, 4, prof.engine_config, **args)
    assert len(per_layer) == 18 and min(per_layer) > 0
    assert sum(per_layer) == cls.memory_plan(config, 3000, 4, prof.engine_config, **args)


def _tensors(obj, seen=None, depth=0):
    """Every tensor an object holds in its attributes (and in the objects those hold), by attribute path."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)) and name not in _SHARED:
            yield from ((f"{name}.{n}", t) for n, t in _tensors(value, seen, depth + 1))


# What a layer refers to but does not own: its cache, the analyzer's plan (host tables), the host context memory.
_SHARED = {"owner", "plan", "memory"}


def _misplaced(cache, device_of) -> dict[int, list[str]]:
    """{layer: the state tensors not on device_of(layer)}."""
    out = {}
    for i, layer in enumerate(cache.layers):
        wrong = [f"{name} on {t.device}" for name, t in _tensors(layer) if t.device != torch.device(device_of(i))]
        if wrong:
            out[i] = wrong
    return out


def _cache_for(engine, name: str, capacity: int, reserve: int):
    if name != "star":
        return engine.make_cache(capacity, reserve)
    from engines.star.cache import StarCache

    return StarCache(engine.model.config, capacity, kv_start=0, n_context=capacity - reserve, shift=0, world=1,
                     keeps_queries=True)


PLACED = [("dense", {}), ("resa", {"centroid": True}), ("sas-streaming-llm-h2o", {}), ("sas-pattern", {}),
          ("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 4, "n_local": 256}), ("star", {})]


@pytest.mark.slow
@pytest.mark.parametrize("profile, settings", PLACED, ids=[p for p, _ in PLACED])
def test_each_layer_state_is_allocated_on_its_layer_device(lm, profile, settings):
    """Layers 1, 4, 7, ... on the meta device, the others on the CPU: every tensor of a layer's state (KV, resa's
    descriptors, sas's rows, positions and scores, ltri's rows, votes and index) follows its layer's keys."""
    engine = make_engine(lm, profile, chunk_size=256, **settings)
    cache = _cache_for(engine, engine.name, 1200, 40)
    text = lm.config
    device_of = lambda i: "meta" if i % 3 == 1 else "cpu"  # noqa: E731
    for i, layer in enumerate(cache.layers):
        shape = (1, text.num_key_value_heads, 1, engine.head_dim)
        layer.lazy_initialization(torch.zeros(shape, device=device_of(i)), torch.zeros(shape, device=device_of(i)))
    assert _misplaced(cache, device_of) == {}
    assert any(t.device.type == "meta" for _, t in _tensors(cache.layers[1]))


def test_the_placement_check_finds_a_misplaced_tensor(lm):
    engine = make_engine(lm, "resa")
    engine.single_device = False  # as over several devices: each layer's buffers on its own device, not stacked
    cache = engine.make_cache(300, 20)
    assert not cache.stacked
    for i, layer in enumerate(cache.layers):
        key = torch.zeros(1, 1, 1, engine.head_dim, device="meta" if i == 5 else "cpu")
        layer.lazy_initialization(key, key)
    cache.layers[5].kmax = torch.zeros(1)  # a descriptor allocated on the wrong device
    assert _misplaced(cache, lambda i: "meta" if i == 5 else "cpu") == {5: ["kmax on cpu"]}


def test_positions_rotate_on_the_layer_device(lm):
    """Re-assigned positions rotate keys with the rotary module on the keys' device, not the embedding's."""
    from engines.positions import Positions, rotary_module

    positions = Positions(rotary_module(lm.model), 32768)
    cos, sin = positions.cos_sin(torch.arange(8, device="meta"), sliding=False)
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (8, 256)
    assert positions.cos_sin(torch.arange(8), sliding=False)[0].device.type == "cpu"


def test_a_random_preset_is_drawn_where_the_map_puts_it():
    from transformers import AutoModelForCausalLM

    config = load_config("random:gemma3-270m")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    split = layer_split(config, ["cpu", "meta"], torch.float32, model=model)
    materialise(model, split.device_map)
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        want = next(dev for prefix, dev in split.device_map.items() if module == prefix or
                    module.startswith(prefix + "."))
        assert param.device.type == want, name
    layer = model.model.layers[split.layers[0].start]
    weight = layer.self_attn.q_proj.weight
    assert weight.device.type == "cpu" and torch.isfinite(weight).all()
    assert 0.015 < weight.std().item() < 0.025  # transformers' initializer_range, 0.02
    assert torch.equal(layer.input_layernorm.weight, torch.zeros_like(layer.input_layernorm.weight))  # Gemma: 1 + w


@pytest.fixture(scope="module")
def split_lm(lm):
    """A second copy of the embedded model, layers 0-8 and 9-17 as two devices' runs, dispatched with
    accelerate's hooks (both devices are the CPU here)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(None)), dtype=torch.float32,
                                                 device_map={"": "cpu"}).eval()
    parts = model_parts(model)
    device_map = {name: "cpu" for name in parts["first"] + parts["layers"] + parts["last"]}
    dispatch(model, device_map)
    assert hasattr(model.model.layers[9], "_hf_hook")
    return LoadedModel(model, lm.tokenizer, lm.name, False, 0.0, [torch.device("cpu")])


# Each engine with its approximation at work (a window shorter than the document, blocks that leave), the
# streaming engines with re-assigned positions (and, in the long tier, with the document's own).
SPLIT_RUNS = [("dense", {}), ("resa", {"keep_ratio": 0.2, "min_blocks": 4, "rectify_every": 4}),
              pytest.param("sas-pattern", {"pattern": "Rect(keys=0:16) + Diag(window=256)"}, marks=pytest.mark.long),
              ("sas-pattern", {"pattern": "Rect(keys=0:16) + Diag(window=256)", "positions": "cache"}),
              pytest.param("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 2, "n_local": 256},
                           marks=pytest.mark.long),
              ("ltri-stream", {"n_init": 64, "block_size": 64, "top_k": 2, "n_local": 256, "positions": "cache"}),
              ("star", {"min_block_size": 128})]


@pytest.fixture(scope="module")
def unsplit_answer(lm, story_text):
    """(document, question, the unsplit model's greedy answer) per engine and settings, computed once for the
    tests below."""
    doc, question = story_ids(lm, story_text, 700)
    answers = {}

    def answer(profile, settings):
        key = (profile, tuple(sorted(settings.items())))
        if key not in answers:
            answers[key] = greedy_answer(make_engine(lm, profile, chunk_size=256, **settings), doc, question, 8)[0]
        return doc, question, answers[key]

    return answer


@pytest.mark.slow
@pytest.mark.parametrize("profile, settings", SPLIT_RUNS, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()) or "defaults")
def test_split_model_answers_as_the_unsplit_one(lm, split_lm, unsplit_answer, profile, settings):
    doc, question, want = unsplit_answer(profile, settings)
    engine = make_engine(split_lm, profile, chunk_size=256, **settings)
    got, state = greedy_answer(engine, doc, question, 8)
    assert got == want
    assert _misplaced(state.cache, engine.layer_device) == {}


def test_every_engine_runs_split():
    assert {getattr(run, "values", run)[0] for run in SPLIT_RUNS} == set(ENGINES)


def test_plan_shows_each_gpu_layers_weights_and_state(capsys, monkeypatch):
    """Two GPUs (their count and free memory stood in for; plan allocates nothing): the 70B shape's layers
    halve, each GPU showing its weights and its layers' KV cache; with less free memory, how much fits."""
    monkeypatch.setattr("longctx_cli.split.visible_gpus", lambda: 2)
    monkeypatch.setenv("COLUMNS", "200")  # the whole table on one line per device
    args = ["plan", "--model", "random:llama-3.1-70b", "--tokens", "32k", "--gpus-model", "2", "--dtype", "bfloat16"]
    monkeypatch.setattr("longctx_cli.plan.free_memory", lambda devices: [80 * 2**30] * len(devices))
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0 and out.strip() == "fits", err
    rows = [line for line in err.splitlines() if "cuda:" in line]
    assert len(rows) == 2
    assert "0-39" in rows[0] and "40-79" in rows[1]
    assert all("65.71 GiB" in row and "5.01 GiB" in row for row in rows)  # weights, then the KV of 40 layers
    assert "141.1 GB" in err and "split over 2 GPUs" in err
    # 65.71 + 5.01 + 0.49 GiB needed per GPU, more than 90% of 75 GiB: a shorter document fits.
    monkeypatch.setattr("longctx_cli.plan.free_memory", lambda devices: [75 * 2**30] * len(devices))
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 7 and out.strip() == "does not fit"
    assert "tokens fit now" in err and "--gpus-model N" in err


@pytest.mark.parametrize("args, message", [
    (["plan", "--tokens", "4k", "--gpus-model", "2"], "--gpus-model 2: only 0 GPUs visible"),
    (["plan", "--tokens", "4k", "--set", "gpus_model=0"], "bad value for gpus_model: 0"),
    (["plan", "--tokens", "4k", "--gpus-model", "2", "--device", "cpu"], "not cpu"),
    (["ask", "--profile", "star", "--gpus", "2", "--gpus-model", "2", "-q", "Who?", "README.md"], "star's --gpus 2"),
], ids=["past-visible", "zero", "cpu", "with-star-ranks"])
def test_gpus_model_refusals(capsys, monkeypatch, args, message):
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 4 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


class _Replayed:
    """Stands in for a CUDA graph on CPU: replaying runs the captured function again over the same static
    buffers, so inputs not copied into them at each step, or a segment's layers run out of order, show up."""

    replays = 0

    def __init__(self, run, device):
        self.run = run

    def replay(self):
        _Replayed.replays += 1
        self.run()


@pytest.mark.slow
@pytest.mark.parametrize("profile, settings", SPLIT_RUNS, ids=lambda x: x if isinstance(x, str) else
                         ",".join(f"{k}={v}" for k, v in x.items()) or "defaults")
def test_per_device_graphs_answer_as_the_eager_step(split_lm, unsplit_answer, profile, settings, monkeypatch):
    """The decode step as it runs on a model split over GPUs (engines/segments.py): layers 0-8 and 9-17 as two
    segments, each replayed from its own captured function, with fused projections swapped in for the capture."""
    from engines.segments import SegmentedRun

    doc, question, want = unsplit_answer(profile, settings)
    engine = make_engine(split_lm, profile, chunk_size=256, **settings)
    cpu = [torch.device("cpu")] * 18
    monkeypatch.setattr(engine, "_segmented_run", lambda: SegmentedRun(engine.model, cpu, _Replayed,
                                                                       runs=[range(0, 9), range(9, 18)]))
    monkeypatch.setattr(engine, "_decode_blocks", lambda captured, compile: _blocks(split_lm) if captured else None)
    before = _Replayed.replays
    got, state = greedy_answer(engine, doc, question, 8)
    assert got == want
    assert state.decode.segments.captured
    assert _Replayed.replays - before >= 2 * 7  # two segments, every step after the first token
    assert engine.counters(state)["decode_cuda_graph"] == "one per device (2)"
    assert engine.counters(state)["decode_fused_projections"] == "activation+gate_up+qkv+rotation"


def _blocks(split_lm):
    from engines.decode_blocks import DecodeBlocks

    return DecodeBlocks(split_lm.model, fuse=True, compile=False)
