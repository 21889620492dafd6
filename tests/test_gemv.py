"""kernels/gemv: the decode step's one-token projection against F.linear (Triton on CUDA, or on CPU through
Triton's interpreter; the dispatch's fallbacks on CPU, CI)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels.gemv import gemv
from tests.conftest import TRITON_DEVICE


def test_gemv_is_linear_off_the_kernels_path():
    """CPU, several rows, fp32: F.linear's result exactly, with and without bias."""
    torch.manual_seed(42)
    w, b = torch.randn(24, 40), torch.randn(24)
    for x in (torch.randn(1, 1, 40), torch.randn(3, 40)):
        assert torch.equal(gemv(x, w), F.linear(x, w)) and torch.equal(gemv(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("tile", ["default", "tuned", "tuned-4-warps"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N,K", [(8, 512), (1000, 640), (2048, 2048), (12, 4097)], ids=lambda n: str(n))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.triton
def test_gemv_triton_matches_fp32(monkeypatch, dtype, N, K, bias, tile):
    """Rows and K that are not multiples of the tiles (the default's, and a shape-tuned one's): error against
    an fp32 product at most 2x torch's own at the same dtype (flash-attention's rule)."""
    import kernels.gemv.triton as gemv_module
    from kernels.gemv.triton import gemv_triton

    if tile != "default":
        monkeypatch.setitem(gemv_module.TUNED, (N, K), (16, 256, 4) if tile.endswith("warps") else (32, 256, 8))

    if TRITON_DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16")
    torch.manual_seed(42)
    w = (torch.randn(N, K) * K**-0.5).to(dtype).to(TRITON_DEVICE)
    x = torch.randn(1, 1, K).to(dtype).to(TRITON_DEVICE)
    b = torch.randn(N).to(dtype).to(TRITON_DEVICE) if bias else None
    out = gemv_triton(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == (1, 1, N) and out.dtype == dtype
    low = F.linear(x.cpu().float(), w.cpu().float(), None if b is None else b.cpu().float()).to(dtype) \
        if TRITON_DEVICE == "cpu" else F.linear(x, w, b)
    torch_err = (low.float().to(ref.device) - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.2e} vs torch {dtype} error {torch_err:.2e}"


@pytest.mark.parametrize("N,K", [(8, 512), (1000, 640), (12, 4097)], ids=lambda n: str(n))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.triton
def test_gemv_triton_with_a_folded_norm_matches_fp32(dtype, N, K):
    """The RMSNorm folded into the GEMV: error against the norm and product in fp32 at most 2x that of torch
    running both at the kernel's dtype (reference.rms_norm, then F.linear)."""
    from kernels.gemv.reference import rms_norm
    from kernels.gemv.triton import gemv_triton

    if TRITON_DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16")
    torch.manual_seed(42)
    w = (torch.randn(N, K) * K**-0.5).to(dtype).to(TRITON_DEVICE)
    x = (3 * torch.randn(1, 1, K)).to(dtype).to(TRITON_DEVICE)
    g = (1 + 0.2 * torch.randn(K)).to(dtype).to(TRITON_DEVICE)
    out = gemv_triton(x, w, None, (g, 1e-6))
    ref = F.linear(rms_norm(x.float(), g.float(), 1e-6), w.float())
    low = F.linear(rms_norm(x.cpu(), g.cpu(), 1e-6).float(), w.cpu().float()).to(dtype) \
        if TRITON_DEVICE == "cpu" else F.linear(rms_norm(x, g, 1e-6), w)
    torch_err = (low.float().to(ref.device) - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * torch_err + 1e-5, f"kernel error {err:.2e} vs torch {dtype} error {torch_err:.2e}"


def test_gemv_folds_the_norm_off_the_kernels_path():
    """CPU: the norm, then F.linear."""
    from kernels.gemv.reference import rms_norm

    x, w, g = torch.randn(1, 1, 40), torch.randn(24, 40), torch.rand(40) + 0.5
    assert torch.equal(gemv(x, w, None, (g, 1e-6)), F.linear(rms_norm(x, g, 1e-6), w))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("I,K,rows", [(4, 512, 8), (500, 640, 16), (1000, 2048, 32), (6, 4097, 8)],
                         ids=lambda n: str(n))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.triton
def test_gemv_triton_gated_matches_fp32(monkeypatch, dtype, I, K, rows, act):
    """A gated MLP's act(gate) * up formed by the gate/up GEMV ([2I, K] stacked; outputs that are not a multiple
    of the program's half, with and without the folded norm): error against fp32 at most 2x torch's at the
    kernel's dtype (F.linear, then the activation and product)."""
    import kernels.gemv.triton as gemv_module
    from kernels.gemv.reference import ACTIVATIONS, rms_norm
    from kernels.gemv.triton import gemv_triton

    if TRITON_DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16")
    monkeypatch.setitem(gemv_module.TUNED, (2 * I, K), (rows, 256, 4))
    torch.manual_seed(42)
    w = (torch.randn(2 * I, K) * 2 * K**-0.5).to(dtype).to(TRITON_DEVICE)
    x = torch.randn(1, 1, K).to(dtype).to(TRITON_DEVICE)
    b = torch.randn(2 * I).to(dtype).to(TRITON_DEVICE)
    g = (1 + 0.2 * torch.randn(K)).to(dtype).to(TRITON_DEVICE)
    fn = ACTIVATIONS[act]

    def gated(y):
        gate, up = y.chunk(2, dim=-1)
        return fn(gate) * up

    for bias, norm in ((None, None), (b, (g, 1e-6))):
        out = gemv_triton(x, w, bias, norm, act)
        h = rms_norm(x.float(), g.float(), 1e-6) if norm else x.float()
        ref = gated(F.linear(h, w.float(), None if bias is None else bias.float()))
        h_low = rms_norm(x, g, 1e-6) if norm else x
        if TRITON_DEVICE == "cpu":  # torch's half-precision linear: fp32 products rounded to the dtype
            y_low = F.linear(h_low.float(), w.float(), None if bias is None else bias.float()).to(dtype)
        else:
            y_low = F.linear(h_low, w, bias)
        low = gated(y_low)
        assert out.shape == (1, 1, I) and out.dtype == dtype
        torch_err = (low.float().to(ref.device) - ref).abs().max().item()
        err = (out.float() - ref).abs().max().item()
        assert err <= 2 * torch_err + 1e-5, f"{act} norm={norm is not None}: kernel {err:.2e} vs torch {torch_err:.2e}"


@pytest.mark.parametrize("form", ["plain", "norm", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.triton
def test_gemv_triton_adds_the_residual(dtype, form):
    """residual + y with y rounded first, as the decoder layer adds two tensors: against the reference at the
    kernel's dtype, the sum within one rounding of the kernel's y plus the residual (1000 outputs, K 640)."""
    from kernels.gemv.triton import gemv_triton

    if TRITON_DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bfloat16")
    torch.manual_seed(42)
    rows = 2000 if form == "gated" else 1000
    w = (torch.randn(rows, 640) * 640**-0.5).to(dtype).to(TRITON_DEVICE)
    x = torch.randn(1, 1, 640).to(dtype).to(TRITON_DEVICE)
    r = (8 * torch.randn(1, 1, 1000)).to(dtype).to(TRITON_DEVICE)
    g = (1 + 0.2 * torch.randn(640)).to(dtype).to(TRITON_DEVICE)
    kwargs = {"norm": (g, 1e-6)} if form == "norm" else {"act": "silu"} if form == "gated" else {}
    y = gemv_triton(x, w, **kwargs)
    out = gemv_triton(x, w, residual=r, **kwargs)
    assert out.shape == r.shape and out.dtype == dtype
    assert torch.equal(out, r + y)  # the kernel's own y, added and rounded as torch adds two tensors
    with pytest.raises(ValueError, match="residual"):
        gemv_triton(x, w, residual=r[..., :10], **kwargs)


def test_gemv_gated_off_the_kernels_path():
    """CPU: F.linear, then act(gate) * up over its two halves; the residual added last."""
    x, w = torch.randn(1, 1, 40), torch.randn(48, 40)
    y = F.linear(x, w)
    assert torch.equal(gemv(x, w, None, None, "silu"), F.silu(y[..., :24]) * y[..., 24:])
    assert torch.equal(gemv(x, w, None, None, "gelu_tanh"), F.gelu(y[..., :24], approximate="tanh") * y[..., 24:])
    r = torch.randn(1, 1, 48)
    assert torch.equal(gemv(x, w, residual=r), r + y)


def test_gemv_triton_refuses_what_it_cannot_take():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    from kernels.gemv.triton import gemv_triton

    w = torch.randn(16, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="one row"):
        gemv_triton(torch.randn(2, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="contiguous weight"):
        gemv_triton(torch.randn(1, 16, dtype=torch.float16), w.t())
    with pytest.raises(ValueError, match="bias"):
        gemv_triton(torch.randn(1, 32, dtype=torch.float16), w, torch.randn(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="norm weight"):
        gemv_triton(torch.randn(1, 32, dtype=torch.float16), w, None, (torch.ones(16, dtype=torch.float16), 1e-6))
    with pytest.raises(ValueError, match="act in"):
        gemv_triton(torch.randn(1, 32, dtype=torch.float16), w, None, None, "relu")
    with pytest.raises(ValueError, match="stacked gate and up"):
        gemv_triton(torch.randn(1, 32, dtype=torch.float16), w[:15], None, None, "silu")
