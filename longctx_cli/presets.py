"""Random-weight presets: the real shapes of the models the papers and benchmarks use, for speed runs only (every
output made with one says so). `random:NAME` on the command line; the weights are drawn at load time."""

from __future__ import annotations

RANDOM_PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "gemma3-270m": dict(
        model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
    ),
}

# The 8B shape with RoPE scaled to 1M positions (llama3 rule, factor 128): streaming engines at 1M tokens.
RANDOM_PRESETS["llama-3.1-8b-1m"] = dict(
    RANDOM_PRESETS["llama-3.1-8b"], max_position_embeddings=1048576,
    rope_parameters=dict(RANDOM_PRESETS["llama-3.1-8b"]["rope_parameters"], factor=128.0))

# The 70B shape (80 layers, 64 heads, 8 KV heads, 8192 hidden; ~141 GB of bf16 weights): more than one GPU holds,
# for runs with the model split over several (--gpus-model). RoPE as the 8B's: both come from Llama 3.1's rule.
RANDOM_PRESETS["llama-3.1-70b"] = dict(
    RANDOM_PRESETS["llama-3.1-8b"], hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8)
