"""benchmarks/step_floor.py: a step's bytes op by op are the bytes bench's roofline counts, and its read kernel
reads every word once."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from engines.base import Engine
from engines.resa.engine import ResaEngine
from longctx_cli.profiles import resolve_profile
from tests.conftest import TRITON_DEVICE

_SPEC = importlib.util.spec_from_file_location("step_floor", Path(__file__).resolve().parents[1] / "benchmarks"
                                               / "step_floor.py")
step_floor = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(step_floor)

N_TOKENS = 1 << 15


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=500, tie_word_embeddings=False)
    return config, LlamaForCausalLM(config).to(torch.bfloat16)


def _bytes(layers, names) -> int:
    return sum(b for layer in layers for name, b in layer if name in names)


def test_weights_and_dense_kv_are_benchs():
    config, model = _tiny_llama()
    profile = resolve_profile("dense", {})
    layers = step_floor.step_ops(config, N_TOKENS, profile.engine, profile.engine_config)
    linear = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert _bytes(layers, {"qkv", "o", "gate_up", "down", "lm_head"}) == linear
    assert _bytes(layers, {"attention"}) == Engine.kv_read_bytes(config, N_TOKENS, 2)
    assert len(layers) == config.num_hidden_layers + 1


@pytest.mark.parametrize("descriptor_dtype", ["int8", "model"])
def test_resa_reads_are_benchs_less_the_rectification(descriptor_dtype):
    """The bench's bytes a token average f - 1 sparse steps (the floor's step) and one rectifying step, which
    reads the whole cache (f = rectify_every)."""
    config, _ = _tiny_llama()
    profile = resolve_profile("resa", {"descriptor_dtype": descriptor_dtype, "min_blocks": 64})
    layers = step_floor.step_ops(config, N_TOKENS, profile.engine, profile.engine_config)
    engine = types.SimpleNamespace(config=profile.engine_config)  # kv_read_bytes reads only the engine's config
    bench = ResaEngine.kv_read_bytes(engine, config, N_TOKENS, 2)
    every, dense = profile.engine_config.rectify_every, Engine.kv_read_bytes(config, N_TOKENS, 2)
    step = _bytes(layers, {"select", "sparse_attention"})
    assert abs(bench - ((every - 1) * step + dense) / every) <= config.num_hidden_layers  # rounding, per layer
    assert _bytes(layers, {"sparse_attention"}) < Engine.kv_read_bytes(config, N_TOKENS, 2) // 4


@pytest.mark.triton
@pytest.mark.parametrize("n, programs", [(50_000, 4), (4096, 3), (10, 1)], ids=["n50000-P4", "n4096-P3", "n10-P1"])
def test_read_kernel_reads_each_word_once(n, programs):
    gen = torch.Generator().manual_seed(42)
    x = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=gen)
    out = torch.full((programs,), -1, dtype=torch.int32)
    block, stride = step_floor._BLOCK, programs * step_floor._BLOCK
    step_floor._read_kernel[(programs,)](x.to(TRITON_DEVICE), out := out.to(TRITON_DEVICE), n, stride,
                                         -(-n // stride), BLOCK=block, PDL=False)
    padded = torch.zeros(-(-n // stride) * stride, dtype=torch.int32)
    padded[:n] = x
    tiles = padded.view(-1, programs, block)  # [step, program, word]
    acc = tiles[0].clone()
    for t in tiles[1:]:
        acc ^= t
    want = acc[:, 0].clone()
    for word in acc.unbind(1)[1:]:
        want ^= word
    assert out.cpu().tolist() == want.tolist()
