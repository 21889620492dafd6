"""rotary: keys rotated and un-rotated at per-row positions from a cos/sin table; a decode step's q and k rotated
at its position, after their per-head norms.

The references are held to the model's own rotation (transformers' apply_rotary_pos_emb with the model's rotary
module) on CPU; `triton` tests hold the Triton kernels to the references (on CUDA, or on CPU through Triton's
interpreter): bit for bit where every operation rounds as the reference's, within two roundings of the model's
dtype where the norm's sum of squares is summed in another order.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.gemv import rms_norm
from kernels.rotary import rotate_half, rotate_qk, rotate_qk_reference, rotate_rows, rotate_rows_reference
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


def _qk_case(B, Hq, Hkv, D, dtype, norms, seed=42):
    g = torch.Generator().manual_seed(seed)
    # q and k as the attention hands them over: one token's projection viewed as heads, then transposed.
    q = (3 * torch.randn(B, 1, Hq, D, generator=g)).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(B, 1, Hkv, D, generator=g)).to(dtype).transpose(1, 2)
    angles = torch.rand(B, 1, D, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    weights = [((torch.rand(D, generator=g) + 0.5).to(dtype), 1e-6) for _ in range(2)] if norms else [None, None]
    return q, k, cos, sin, *weights


@pytest.mark.parametrize("norms", [False, True], ids=["rope", "norms+rope"])
def test_rotate_qk_reference_is_the_models_rotation(norms):
    """In fp32, the model's own rotation of its norms' outputs (Qwen 3's order: per-head RMSNorm, then rotation)."""
    q, k, cos, sin, q_norm, k_norm = _qk_case(2, 4, 2, 64, torch.float32, norms)
    want = apply_rotary_pos_emb(rms_norm(q, *q_norm) if norms else q, rms_norm(k, *k_norm) if norms else k, cos, sin)
    got = rotate_qk_reference(q, k, cos, sin, q_norm, k_norm)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _product_size(x, norm, cos, sin):
    """|x| |cos| + |rotate_half(x)| |sin| of the (normed) row: the scale of the rotation's products, per element."""
    x = (rms_norm(x, *norm) if norm is not None else x).float()
    c, s = cos.float().abs().unsqueeze(1), sin.float().abs().unsqueeze(1)
    return x.abs() * c + rotate_half(x).abs() * s


@pytest.mark.triton
@pytest.mark.parametrize("B,Hq,Hkv,D,dtype,norms", [
    pytest.param(1, 16, 8, 128, torch.bfloat16, True, id="B1-Hq16-Hkv8-D128-bf16-norms"),
    pytest.param(1, 32, 8, 128, torch.bfloat16, False, id="B1-Hq32-Hkv8-D128-bf16"),
    pytest.param(2, 4, 1, 256, torch.bfloat16, False, id="B2-Hq4-Hkv1-D256-bf16"),
    pytest.param(2, 6, 2, 64, torch.float32, False, id="B2-Hq6-Hkv2-D64-fp32"),
    pytest.param(1, 6, 2, 64, torch.float32, True, id="B1-Hq6-Hkv2-D64-fp32-norms"),
])
def test_rotate_qk_triton_matches_reference(B, Hq, Hkv, D, dtype, norms):
    from kernels.rotary.triton import rotate_qk_triton

    q, k, cos, sin, q_norm, k_norm = _qk_case(B, Hq, Hkv, D, dtype, norms)
    want = rotate_qk_reference(q, k, cos, sin, q_norm, k_norm)
    moved = [None if n is None else (n[0].to(TRITON_DEVICE), n[1]) for n in (q_norm, k_norm)]
    got = rotate_qk_triton(*(t.to(TRITON_DEVICE) for t in (q, k, cos, sin)), *moved)
    sizes = [_product_size(x, norm, cos, sin) for x, norm in ((q, q_norm), (k, k_norm))]
    for g, w, heads, size in zip(got, want, (Hq, Hkv), sizes):
        assert g.dtype == dtype and g.shape == (B, heads, 1, D)
        g = g.cpu()
        if dtype == torch.float32 and not norms:
            assert torch.equal(g, w)
        else:
            # A rounding of the normed row apart (its sum of squares is summed in another order), which the rotation
            # carries at the size of its products; under the interpreter, which truncates fp32 to bf16 where the GPU
            # rounds, up to three (the normed row, its product with the weight, the result).
            assert ((g.float() - w.float()).abs() <= 4 * torch.finfo(dtype).eps * size + 1e-6).all()
    # A wrong half's sign or the norm left out would show far past that bound.
    other = rotate_qk_reference(q, k, -cos, sin, q_norm, k_norm)
    assert not torch.allclose(got[0].cpu().float(), other[0].float(), rtol=0.1, atol=0.1)


@pytest.mark.triton
def test_rotate_qk_launcher_rejects_bad_inputs():
    from kernels.rotary.triton import rotate_qk_triton

    q, k, cos, sin, q_norm, k_norm = _qk_case(1, 4, 2, 64, torch.bfloat16, True)
    q, k, cos, sin = (t.to(TRITON_DEVICE) for t in (q, k, cos, sin))
    q_norm, k_norm = ((w.to(TRITON_DEVICE), eps) for w, eps in (q_norm, k_norm))
    with pytest.raises(ValueError, match=r"expected q of shape \[B, Hq, 1, D\]"):
        rotate_qk_triton(q.expand(1, 4, 2, 64), k, cos, sin)
    with pytest.raises(ValueError, match=r"expected k of shape \[1, Hkv, 1, 64\]"):
        rotate_qk_triton(q, k.float(), cos, sin)
    with pytest.raises(ValueError, match=r"expected cos of shape \[1, 1, 64\]"):
        rotate_qk_triton(q, k, cos[0], sin)
    with pytest.raises(ValueError, match="both the q and the k norm"):
        rotate_qk_triton(q, k, cos, sin, q_norm)
    with pytest.raises(ValueError, match=r"expected the k norm weight of shape \[64\]"):
        rotate_qk_triton(q, k, cos, sin, q_norm, (k_norm[0].float(), k_norm[1]))


def test_rotate_qk_dispatch_on_cpu_is_the_reference():
    q, k, cos, sin, q_norm, k_norm = _qk_case(1, 4, 2, 64, torch.float32, True)
    for g, w in zip(rotate_qk(q, k, cos, sin, q_norm, k_norm), rotate_qk_reference(q, k, cos, sin, q_norm, k_norm)):
        assert torch.equal(g, w)
