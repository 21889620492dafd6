"""What a decode step's launch structure alone costs against its memory roofline (GPU).

    python benchmarks/step_floor.py --model random:qwen3-1.7b --length 128k --profile resa --out results/X.json

A captured decode step is a chain of dependent kernels, about ten a layer. This reads exactly the bytes a step of
the given engine must read (each op's weights, K/V, descriptors; one row of activations for the small ops), op by
op in the step's order, with a kernel that does nothing but stream its bytes (every program reads its first tile
before waiting for the kernel before it, then the rest; programmatic dependent launch, as the project's kernels),
captured as a CUDA graph. The same bytes are also read with one launch a layer and one launch a step. Against the
roofline `longctx bench` uses (bytes / the measured copy bandwidth), the first layout is a floor for any step
built from that many launches, before any kernel computes anything; the other two show what fewer launches
would buy. Ops: q/k/v, norm + rotation, (dense: the K/V write,) the attention (resa: selection over the
descriptors, then the kept blocks; its K/V write runs beside the selection and is left out), the split merge, o,
the residual add, gate/up, down, the residual add; then the final norm and the LM head. The rectification's
amortised reads are outside a step and left out (bench's roofline adds them for resa).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from engines.decoding import capture_graph
from longctx_cli.models import load_config
from longctx_cli.profiles import resolve_profile
from longctx_cli.units import parse_count

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a CPU machine: step_ops alone
    triton = None

_BLOCK = 4096  # int32 words a program reads per step of its loop (16 KB)

if triton is not None:
    @triton.jit
    def _read_kernel(X, Out, n, stride, steps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Out[program] = the xor of X's tiles pid, pid + P, ... (stride = P * BLOCK words, steps =
        cdiv(n, stride))."""
        pid = tl.program_id(0)
        stride = stride.to(tl.int64)  # a whole step's words pass 2**31
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.load(X + offs, mask=offs < n, other=0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        for t in range(1, steps):
            at = offs + t * stride
            acc ^= tl.load(X + at, mask=at < n, other=0)
        tl.store(Out + pid, tl.xor_sum(acc, 0))


def step_ops(config, n_tokens: int, engine: str, engine_config, dtype_bytes: int = 2) -> list[list[tuple[str, int]]]:
    """[layer][op] = (name, bytes read) for one decode step of a Llama-family model (the final norm and LM head
    as a last 'layer'). dense reads every K/V; resa its kept blocks plus every block's descriptors."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    row = hidden * dtype_bytes
    kv = n_tokens * kv_heads * head_dim * 2 * dtype_bytes
    if engine == "resa":
        block = engine_config.block_size
        n_blocks = -(-n_tokens // block)
        kept = min(n_tokens, engine_config.rule.keep(n_blocks) * block)
        descriptor = 2 * head_dim + 4 if engine_config.descriptor_dtype == "int8" else 2 * head_dim * dtype_bytes
        attend = [("select", n_blocks * kv_heads * descriptor), ("sparse_attention", kv * kept // n_tokens)]
    elif engine == "dense":
        attend = [("kv_write", 2 * kv_heads * head_dim * dtype_bytes), ("attention", kv)]
    else:
        raise ValueError(f"expected engine dense or resa, got {engine!r}")
    layer = [("qkv", hidden * (heads + 2 * kv_heads) * head_dim * dtype_bytes), ("norm_rope", row), *attend,
             ("merge", heads * head_dim * 4), ("o", heads * head_dim * hidden * dtype_bytes), ("add", row),
             ("gate_up", hidden * 2 * config.intermediate_size * dtype_bytes),
             ("down", config.intermediate_size * hidden * dtype_bytes), ("add", row)]
    return [layer] * config.num_hidden_layers + [[("norm", row), ("lm_head", config.vocab_size * row)]]


def _graph(launches: list[tuple[torch.Tensor, int]], out: torch.Tensor, programs: int) -> torch.cuda.CUDAGraph:
    def run():
        for view, n in launches:
            grid = min(programs, triton.cdiv(n, _BLOCK))
            stride = grid * _BLOCK
            _read_kernel[(grid,)](view, out, n, stride, triton.cdiv(n, stride), BLOCK=_BLOCK, PDL=True,
                                  num_stages=3, launch_pdl=True)

    return capture_graph(run, out.device)


def _replay_ms(graph: torch.cuda.CUDAGraph, n: int = 50) -> float:
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    from longctx_cli.bench import copy_bandwidth

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-1.7b", help="random:PRESET (the shape only)")
    parser.add_argument("--length", default="128k")
    parser.add_argument("--profile", default="resa")
    parser.add_argument("--programs-per-sm", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    profile = resolve_profile(args.profile, {})
    n_tokens = parse_count(args.length)
    layers = step_ops(load_config(args.model), n_tokens, profile.engine, profile.engine_config)
    words = [[max(1, b // 4) for _, b in layer] for layer in layers]
    total = sum(map(sum, words))
    buffer = torch.randint(-2**31, 2**31 - 1, (total,), dtype=torch.int32, device=device)
    programs = args.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(programs, dtype=torch.int32, device=device)
    per_op, per_layer, offset = [], [], 0
    for layer in words:
        per_layer.append((buffer[offset:], sum(layer)))
        for n in layer:
            per_op.append((buffer[offset:], n))
            offset += n
    bandwidth = copy_bandwidth(device)
    roofline_ms = 1000 * 4 * total / bandwidth
    rows = []
    for name, launches in (("one launch an op", per_op), ("one launch a layer", per_layer),
                           ("one launch a step", [(buffer, total)])):
        ms = _replay_ms(_graph(launches, out, programs))
        rows.append({"layout": name, "launches": len(launches), "ms_per_step": ms, "x_roofline": ms / roofline_ms})
        print(f"{name:>20}: {len(launches):4d} launches  {ms:.3f} ms  {ms / roofline_ms:.2f}x the roofline")
    result = {"command": "python benchmarks/step_floor.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "platform": platform.platform(), "model": args.model, "length": n_tokens, "profile": args.profile,
              "ops_per_layer": [name for name, _ in layers[0]], "step_bytes": 4 * total,
              "hbm_bytes_per_s": bandwidth, "roofline_ms": roofline_ms, "rows": rows}
    print(f"step bytes {4 * total / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"roofline {roofline_ms:.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
