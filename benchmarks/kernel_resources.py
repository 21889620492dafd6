"""Registers and shared memory of resa's decode kernels, compiled for Hopper (sm_90) on a machine without a GPU.

A kernel's programs an SM follow from its registers a thread and its shared memory, and a change that pushes the
sparse kernel past four programs an SM, or the one-launch selection past what lets a row's programs meet, costs
far more than its instructions. Triton compiles for a named target without a device (its frontend, passes and
ptxas ship with it), so this runs the launchers at a decode step's shapes with every launch replaced by a compile
(`JITFunction.warmup`) against a stand-in for Triton's active driver, then reads each cubin's resource usage with
the cuobjdump Triton bundles. Nothing runs: the numbers are the compiler's, the same a GPU machine would load.
Needs Triton (pip install triton==3.6.0); tensors stay on the CPU.

    python benchmarks/kernel_resources.py                        # Qwen3-1.7B's shape at 128K
    python benchmarks/kernel_resources.py --heads 32 8 --length 256k
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from longctx_cli.units import parse_count  # noqa: E402

# The launchers' modules whose device checks, launch path and SM count are stood in for.
_LAUNCHERS = ("kernels.block_select.triton", "kernels.sparse_decode_attention.triton", "kernels.lse_combine.triton")
_SMS = 132  # an H100 / H200
# An sm_90 SM's registers, shared memory a block may use (227 KB) and threads.
_SM_REGISTERS, _SM_SHARED, _SM_THREADS = 65536, 232448, 2048
_RESIDENT_ASSUMED = 2  # programs an SM the one-launch selection's launcher is told fit (it cannot load a kernel)


class _Target:
    """Triton's active driver as far as compiling needs it: a Hopper target, device 0, no stream."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _registers(kernel) -> int | None:
    """Registers a thread, from the kernel's cubin."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def compile_only(found: list[dict]):
    """Launches inside become compiles for sm_90, each appended to `found` as {kernel, registers, shared, warps}."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import kernels._gdc as gdc
    import kernels._triton_common as common

    def compile_launch(self, grid):
        def run(*args, **options):
            kernel = self.warmup(*args, grid=grid, **options)
            found.append({"kernel": self.fn.__name__, "registers": _registers(kernel),
                          "shared": kernel.metadata.shared, "warps": kernel.metadata.num_warps})
            return kernel
        return run

    saved = [(JITFunction, "__getitem__", JITFunction.__getitem__)]
    stand_ins = {"check_device": lambda name, t, device: None, "use_pdl": lambda device: True,
                 "sm_count": lambda device: _SMS, "_holds": lambda *args, **kw: _RESIDENT_ASSUMED,
                 "launch": lambda kernel, grid, *args, **options: kernel[grid](*args, **options)}
    for module in (common, gdc, *(importlib.import_module(name) for name in _LAUNCHERS)):
        for name, stand_in in stand_ins.items():
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, stand_in)
    previous = driver._active  # None until a driver was asked for; reset_active would look for a GPU
    driver.set_active(_Target())
    JITFunction.__getitem__ = compile_launch
    try:
        yield found
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        driver._active = previous


def programs_per_sm(row: dict) -> int:
    """Programs of a compiled kernel (a `compile_only` row) an SM holds at once: by registers (allocated to a warp
    in units of 256, 8 a thread), shared memory and threads, the least of them."""
    threads = row["warps"] * 32
    by_registers = _SM_REGISTERS // (-(-row["registers"] // 8) * 8 * threads)
    return min(by_registers, _SM_SHARED // max(1, row["shared"]), _SM_THREADS // threads)


def decode_kernels(q_heads: int, kv_heads: int, head_dim: int, length: int) -> list[dict]:
    """resa's decode step kernels at this shape (one-launch selection over int8 descriptors, sparse attention and
    its merge), as compiled for sm_90."""
    from kernels.block_select import KeepRule, new_histogram, new_sync
    from kernels.block_select.triton import select_blocks_triton
    from kernels.sparse_decode_attention.triton import sparse_decode_attention_triton

    n_blocks = length // 16
    q = torch.zeros(1, q_heads, head_dim, dtype=torch.bfloat16)
    codes = torch.zeros(1, kv_heads, n_blocks, head_dim, dtype=torch.int8)
    rule = KeepRule(0.1, 1024, 1, 1, "softmax", centroid=True)
    keys = torch.zeros(1, kv_heads, 4096, head_dim, dtype=torch.bfloat16)
    found: list[dict] = []
    with compile_only(found):
        select_blocks_triton(q, codes, codes.clone(), torch.tensor([length]), block_size=16, rule=rule,
                             width=rule.keep(n_blocks), scale=head_dim ** -0.5, folded=True,
                             histogram=new_histogram(1, kv_heads, "cpu"),
                             descriptor_scale=torch.zeros(1, kv_heads, n_blocks), sync=new_sync(1, kv_heads, "cpu"))
        # Nothing ran: the merge reads partials no one wrote, which is of no matter to its compile.
        sparse_decode_attention_triton(q, keys, keys.clone(), torch.zeros(1, kv_heads, 64, dtype=torch.int32),
                                       torch.tensor([4000]), block_size=16, scale=head_dim ** -0.5)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs=2, default=(16, 8), metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--length", default="128k")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    for row in decode_kernels(*args.heads, args.head_dim, parse_count(args.length)):
        print(f"{row['kernel']}: {row['registers']} registers a thread, {row['shared']} B shared, {row['warps']} "
              f"warps: {programs_per_sm(row)} programs an SM")


if __name__ == "__main__":
    main()
