"""kernels._triton_common.launch: Triton's launch path once per specialisation, the compiled launcher after.

A cached launch must compute what Triton's own path computes, and a call whose arguments Triton would compile
differently (another dtype, a pointer off 16-byte alignment, an int that is 1 or divisible by 16, another
constexpr) must not reuse a kernel compiled for another specialisation.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cdiv


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_kernel(X, Out, n, scale, step, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + i * step, mask=i < n, other=0.0).to(tl.float32) * scale
        if NEGATE:
            x = -x
        tl.store(Out + i, x.to(Out.dtype.element_ty), mask=i < n)

    return _scale_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cached_launches_match_triton_launches_across_specialisations(dtype):
    from kernels._triton_common import _LAUNCHERS, launch

    kernel = _kernel()
    x = torch.randn(4099, device="cuda").to(dtype)
    cases = [  # (offset into x, n, step, negate): alignment, n % 16, step == 1 and 2, the constexpr
        (0, 4096, 1, False), (0, 4096, 1, False), (1, 1000, 1, False), (0, 1000, 2, True), (3, 1, 1, True),
        (0, 4096, 1, False), (1, 1000, 1, False),
    ]
    for offset, n, step, negate in cases:
        src = x[offset:]
        want = torch.empty(n, device="cuda", dtype=dtype)
        got = torch.full_like(want, float("nan"))
        grid = (cdiv(n, 256),)
        kernel[grid](src, want, n, 0.5, step, BLOCK=256, NEGATE=negate)
        launch(kernel, grid, src, got, n, 0.5, step, BLOCK=256, NEGATE=negate)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (offset, n, step, negate)
    # Four specialisations were compiled and cached (the repeats went through the cache).
    assert sum(key[0] is kernel for key in _LAUNCHERS) == 4


def test_specialisation_keys_separate_what_triton_compiles_apart():
    from kernels._triton_common import _specialisation as spec

    x = torch.zeros(64)
    assert spec(x) == spec(torch.zeros(3)) and spec(x[4:]) == spec(x)  # 16-byte aligned fp32 either way
    assert spec(x[1:]) != spec(x) and spec(x.half()) != spec(x)  # off alignment; another dtype
    assert spec(3) == spec(5) and spec(32) == spec(48)
    assert len({spec(1), spec(3), spec(16), spec(2 ** 31), spec(-16)}) == 4  # -16 and 16: both divisible, 32-bit
    assert spec(True) != spec(1) and spec(None) != spec(0) and spec(0.5) == spec(2.0)
