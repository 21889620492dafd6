"""rotary: keys rotated and un-rotated at per-row positions from a cos/sin table.

The reference is held to the model's own rotation (transformers' apply_rotary_pos_emb with the model's rotary
module) on CPU; `triton` tests hold the Triton kernel to the reference bit for bit (on CUDA, or on CPU through
Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.rotary import rotate_rows, rotate_rows_reference
from tests.conftest import TRITON_DEVICE


def _tables(D, n=4096):
    config = LlamaConfig(hidden_size=D * 4, num_attention_heads=4, head_dim=D, max_position_embeddings=n,
                         rope_theta=500000.0)
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.empty(0), torch.arange(n)[None])
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _case(B, H, R, D, dtype, seed=42):
    g = torch.Generator().manual_seed(seed)
    # Rows as the engines hand them over: a slice of a larger row buffer (strided heads and batch).
    x = torch.randn(B, H, R + 7, D, generator=g).to(dtype)[:, :, 3:3 + R]
    positions = torch.randint(0, 4096, (R,), generator=g)
    positions[::5] = -1  # empty rows
    return x, positions


def test_reference_is_the_models_rotation_and_inverse_undoes_it():
    cos, sin = _tables(64)
    x, positions = _case(1, 3, 50, 64, torch.float32)
    positions = positions.clamp(min=0)
    want, _ = apply_rotary_pos_emb(x, x, cos[positions][None], sin[positions][None])
    torch.testing.assert_close(rotate_rows_reference(x, positions, cos, sin), want, rtol=0, atol=0)
    back = rotate_rows_reference(want, positions, cos, sin, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize("B,H,R,D,dtype", [
    pytest.param(1, 2, 63, 64, torch.float32, id="B1-H2-R63-D64-fp32"),
    pytest.param(1, 8, 1000, 128, torch.bfloat16, id="B1-H8-R1000-D128-bf16"),
    pytest.param(2, 1, 130, 256, torch.bfloat16, id="B2-H1-R130-D256-bf16"),
])
@pytest.mark.parametrize("inverse", [False, True], ids=["rotate", "unrotate"])
def test_triton_matches_reference_bit_for_bit(B, H, R, D, dtype, inverse):
    from kernels.rotary.triton import rotate_rows_triton

    cos, sin = _tables(D)
    x, positions = _case(B, H, R, D, dtype)
    want = rotate_rows_reference(x, positions, cos, sin, inverse)
    got = rotate_rows_triton(*(t.to(TRITON_DEVICE) for t in (x, positions, cos, sin)), inverse)
    assert got.dtype == dtype and got.shape == (B, H, R, D)
    if TRITON_DEVICE == "cpu" and dtype == torch.bfloat16:
        # Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to nearest even, as torch): the
        # fp32 result, truncated, must then match bit for bit.
        exact = rotate_rows_reference(x.float(), positions, cos, sin, inverse)
        want = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    assert torch.equal(got.cpu(), want)


@pytest.mark.triton
def test_triton_launcher_rejects_bad_inputs():
    from kernels.rotary.triton import rotate_rows_triton

    cos, sin = (t.to(TRITON_DEVICE) for t in _tables(64, 128))
    x, positions = (t.to(TRITON_DEVICE) for t in _case(1, 2, 10, 64, torch.float32))
    with pytest.raises(ValueError, match=r"expected x of shape \[B, H, R, D\]"):
        rotate_rows_triton(x[0], positions, cos, sin)
    with pytest.raises(ValueError, match=r"expected positions of shape \[10\] int64"):
        rotate_rows_triton(x, positions.int(), cos, sin)
    with pytest.raises(ValueError, match=r"expected cos of shape \[n, 64\] float32"):
        rotate_rows_triton(x, positions, cos.half(), sin)
    with pytest.raises(ValueError, match=r"expected a power-of-two head dim"):
        rotate_rows_triton(x[..., :48], positions, cos[:, :48].contiguous(), sin[:, :48].contiguous())


def test_dispatch_on_cpu_is_the_reference():
    cos, sin = _tables(64, 256)
    x, positions = _case(1, 2, 20, 64, torch.float32)
    assert torch.equal(rotate_rows(x, positions, cos, sin), rotate_rows_reference(x, positions, cos, sin))
