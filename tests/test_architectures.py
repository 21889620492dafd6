"""The dense engine plugs into every supported family through transformers' extension points alone: tiny
random-weight Llama, Mistral (sliding window), Qwen2, Qwen3 and Gemma 3 models, greedy tokens compared with
transformers' own generate (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engines import ENGINES
from engines.decoding import Sampler
from longctx_cli.models import LoadedModel
from longctx_cli.profiles import resolve_profile

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
FAMILIES = {
    "llama": dict(model_type="llama", head_dim=16),
    "mistral": dict(model_type="mistral", head_dim=16, sliding_window=48),
    "qwen2": dict(model_type="qwen2", head_dim=16),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma3": dict(model_type="gemma3_text", head_dim=32, sliding_window=40, query_pre_attn_scalar=32,
                   layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_greedy_equals_generate(family):
    params = {**TINY, **FAMILIES[family]}
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    lm = LoadedModel(model, None, f"tiny-{family}", True, 0.0, [torch.device("cpu")])
    profile = resolve_profile("dense", {"chunk_size": 37})
    engine = ENGINES["dense"](lm, profile.engine_config, profile.run, home=None)
    ids = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(1))
    question = ids[:5]
    state = engine.prefill(ids, reserve=5 + 20)
    ours = list(engine.answer(state, question, 20, Sampler()))
    assert state.cache.nbytes() == engine.memory_plan(config, ids.numel() + 25, 4, chunk_size=37, reserve=25)

    model.set_attn_implementation("sdpa")
    full = torch.cat([ids, question]).view(1, -1)
    with torch.inference_mode():
        ref = model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=20, min_new_tokens=20,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, full.shape[1]:].tolist()
