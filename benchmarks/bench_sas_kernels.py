"""sas-pattern at kernel level on a GPU (SAS paper section 8, Tables 2-4): prefill and decode per static pattern.

    PYTHONPATH=. python3 benchmarks/bench_sas_kernels.py --out sas_kernels.json

B=1, MHA (64 heads, head_dim 128), bf16, random q/k/v (speed only). Per pattern and length N:
- prefill (the whole sequence under the pattern, causal): compiled FlexAttention with the default 128 x 128
  sparse block ("flex"); SAS's lowering, the same mask_mod with the sparse block (Q x KV in {128, 64}^2) that
  runs fastest ("sas": the 128 x 128 candidate is the flex measurement itself, so sas <= flex by construction;
  the row lists every candidate); dense causal SDPA, flash backend ("dense"), up to --dense-max-len.
- decode (one query at position N-1, the cache holding N tokens): FlexAttention decoding over the full cache
  ("flex"); SAS: the compacted cache of plan_cache(pattern, N).slots rows read by the split-KV Triton decode
  kernel with the pattern generated into it (engines/sas/codegen.py: each row masked by the pattern at its key
  position, inside the key loop; "sas", what the engine runs); for comparison the same kernel given the mask
  as per-row flags, computed by a dozen eager torch ops ("sas_eager_mask") or by one compiled kernel
  ("sas_compiled_mask"), or precomputed outside the timing ("sas_kernel"); the same kernel over the full
  cache without a mask ("dense").
Prefill: triton.testing.do_bench (L2 flushed; with --prefill-timer cuda_graph, graph replays without launch
overhead, rows "prefill-graph"). Decode: CUDA-graph replays over enough copies of the caches (one per emulated
layer) that the bytes each method reads do not stay in L2, per copy; "ms_eager" is do_bench of one
eager call (Python launch overhead included). Medians, with 20%/80% quantiles.
FlexAttention is compiled once per pattern and block configuration with dynamic sequence lengths (batch, heads
and head_dim static, so decode still takes FlexAttention's decoding kernel). Block masks are built from the
pattern in row chunks, because create_block_mask materialises the N x N mask (which does not fit at 128K);
they are compared with create_block_mask's at the smallest length.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.sas.analyzer import plan_cache  # noqa: E402
from engines.sas.parse import parse_pattern  # noqa: E402
from engines.sas.codegen import triton_visible  # noqa: E402
from kernels.decode_attention import PositionMask, PositionRule, decode_attention, decode_attention_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = ["sas-pattern", "sas-block-local", "sas-sliding-window", "sas-openai-strided", "sas-openai-fixed",
            "sas-strided-block-local"]
LENGTHS = [2048, 4096, 8192, 16384, 32768, 131072]
FLEX_BLOCK = (128, 128)  # FlexAttention's default sparse block
CELL = 64  # block masks are counted at this granularity and summed up to coarser blocks
TOLERANCE = 2e-2  # max abs difference accepted between bf16 outputs and the reference
QUANTILES = [0.5, 0.2, 0.8]
DEVICE = torch.device("cuda")
FULL_CACHE_BYTES = 24 << 30  # what the full-cache copies of decode (flex, dense) may take


def pattern_text(name: str) -> str:
    return yaml.safe_load((ROOT / "profiles" / f"{name}.yaml").read_text())["pattern"]


@functools.cache
def pattern_of(name: str):
    # One object per profile: compiled graphs guard on the pattern the mask_mod closes over.
    return parse_pattern(pattern_text(name))


@functools.cache
def compiled_slot_mask(name: str, heads: int):
    """The per-slot decode mask as one compiled kernel instead of a dozen small ones (for comparison)."""
    pattern = pattern_of(name)

    def slot_mask(pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        return pattern.visible(pos, key_pos).expand(1, heads, key_pos.shape[-1]).contiguous()

    return torch.compile(slot_mask, dynamic=True, fullgraph=True)


def plan_job(text: str, n: int, threads: int) -> tuple[int, torch.Tensor, float]:
    """Runs in a worker process: (cache slots, slot_of [n], seconds)."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    plan = plan_cache(text, n)
    return plan.slots, plan.slot_of.clone(), time.perf_counter() - start


def slot_positions(slot_of: torch.Tensor, slots: int, pos: int) -> torch.Tensor:
    """slot_of: [n] (-1: never stored) -> [slots] int64, the key each slot holds at step pos: the last k <= pos
    with slot_of[k] == s (-1: none yet). A key that has expired still sits there; the pattern masks it out."""
    keys = torch.arange(pos + 1)
    slot = slot_of[: pos + 1]
    stored = slot >= 0
    key_pos = torch.full((slots,), -1, dtype=torch.long)
    return key_pos.scatter_reduce_(0, slot[stored], keys[stored], reduce="amax")


def cell_counts(pattern, q_len: int, kv_len: int, q_first: int, device) -> torch.Tensor:
    """[cdiv(q_len, CELL), cdiv(kv_len, CELL)] int32: visible (query, key) pairs per CELL x CELL cell, for the
    queries at positions q_first.. (padding rows and columns count as not visible, as in create_block_mask)."""
    nq, nk = math.ceil(q_len / CELL), math.ceil(kv_len / CELL)
    k = torch.arange(nk * CELL, device=device)
    rows = max(CELL, (1 << 26) // (nk * CELL) // CELL * CELL)  # bounds the int64 temporaries to ~0.5 GB
    out = []
    for lo in range(0, nq * CELL, rows):
        q = torch.arange(lo, min(lo + rows, nq * CELL), device=device)
        seen = pattern.visible(q[:, None] + q_first, k[None, :]) & (q[:, None] < q_len) & (k[None, :] < kv_len)
        out.append(seen.view(-1, CELL, nk, CELL).sum((1, 3), dtype=torch.int32))
    return torch.cat(out)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dense: [nq, nk] bool -> (counts [1, 1, nq], column indices [1, 1, nq, nk], listed ones first) int32."""
    counts = dense.sum(-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), indices[None, None].contiguous()


def block_mask(counts: torch.Tensor, block: tuple[int, int], seq: tuple[int, int], mask_mod):
    """A BlockMask of block (q, kv) from CELL counts: full blocks (every pair visible) and partial ones."""
    from torch.nn.attention.flex_attention import BlockMask

    fq, fk = block[0] // CELL, block[1] // CELL
    nq, nk = counts.shape
    pad = (0, -nk % fk, 0, -nq % fq)
    c = F.pad(counts, pad).view((nq + pad[3]) // fq, fq, (nk + pad[1]) // fk, fk).sum((1, 3))
    full = c == block[0] * block[1]
    kv_num, kv_idx = _ordered((c > 0) & ~full)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=seq)


def _dense_blocks(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    out = torch.zeros(*idx.shape[:-1], idx.shape[-1] + 1, dtype=torch.bool, device=idx.device)
    return out.scatter_(-1, torch.where(listed, idx.long(), idx.shape[-1]), True)[..., :-1]


def same_blocks(a, b) -> bool:
    """Two BlockMasks list the same partial and the same full blocks."""
    return all(torch.equal(_dense_blocks(x.kv_num_blocks, x.kv_indices), _dense_blocks(y.kv_num_blocks, y.kv_indices))
               and torch.equal(_dense_blocks(x.full_kv_num_blocks, x.full_kv_indices),
                               _dense_blocks(y.full_kv_num_blocks, y.full_kv_indices)) for x, y in [(a, b)])


def work_fraction(bm) -> float:
    """Listed (partial + full) blocks over all blocks of the causal lower triangle."""
    nq, nk = bm.kv_indices.shape[-2], bm.kv_indices.shape[-1]
    tri = sum(min(nk, math.ceil((i + 1) * bm.BLOCK_SIZE[0] / bm.BLOCK_SIZE[1])) for i in range(nq))
    return round(int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) / tri, 4)


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


def static_dims(*tensors: torch.Tensor) -> None:
    """Only the sequence dim varies: batch and heads stay static (FlexAttention's decoding kernel needs them)."""
    for t in tensors:
        for d in (0, 1, 3):
            torch._dynamo.mark_static(t, d)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]


def bench(fn) -> dict:
    from triton.testing import do_bench

    med, lo, hi = do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES)
    return {"ms": med, "q20": lo, "q80": hi}


def bench_graph(fn, copies: int) -> dict:
    """fn runs `copies` steps (one per emulated layer); per-step times of CUDA-graph replays."""
    from triton.testing import do_bench_cudagraph

    with torch.cuda.stream(torch.cuda.Stream()):
        med, lo, hi = do_bench_cudagraph(fn, rep=50, quantiles=QUANTILES)
    return {"ms": med / copies, "q20": lo / copies, "q80": hi / copies, "copies": copies}


def copies_for(bytes_read: int, cap: int = 64) -> int:
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(cap, math.ceil(4 * l2 / max(1, bytes_read))))


def speedups(ms: dict) -> dict:
    """base time / sas time (and / sas_kernel time where there is one)."""
    return {f"{m}_vs_{base}": round(ms[base] / ms[m], 3) for m in ("sas", "sas_eager_mask", "sas_compiled_mask", "sas_kernel")
            for base in ("flex", "dense") if ms.get(m) and ms.get(base)}


def _attempts(block: tuple[int, int], plain_failed: set) -> list[dict | None]:
    """Kernel options to try for a sparse block: none (FlexAttention's defaults: on an H100, 128 x 64 tiles,
    which a 64-row block does not hold), then tiles that fit. A block whose plain attempt failed once (with the
    error recorded) goes straight to the fitted tiles for later patterns."""
    fitted = {"BLOCK_M": min(block[0], 128), "BLOCK_N": 64, **({"num_warps": 4} if block[0] < 128 else {})}
    return [fitted] if block in plain_failed else [None, fitted]


def prefill_row(name: str, n: int, args, plain_failed: set, emit) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask

    text = pattern_text(name)
    pattern, dev, H, D = pattern_of(name), DEVICE, args.heads, args.head_dim
    scale, flex = D**-0.5, compiled_flex()
    blocks = [(qb, kb) for qb in args.q_blocks for kb in args.kv_blocks]
    blocks.sort(key=lambda b: b != FLEX_BLOCK)

    def mask_mod(b, h, q_idx, kv_idx):
        return pattern.visible(q_idx, kv_idx)

    check = n == min(args.lengths)
    # do_bench (the default) sees launch overhead where the kernel is shorter than the host's launch path.
    graph = args.prefill_timer == "cuda_graph"
    timer = (lambda fn: bench_graph(fn, 1)) if graph else bench
    q, k, v = (torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    static_dims(q, k, v)
    counts = cell_counts(pattern, n, n, 0, dev)
    candidates, outs = [], {}
    for block in blocks:
        bm = block_mask(counts, block, (n, n), mask_mod)
        cand = {"block": list(block), "work_fraction": work_fraction(bm)}
        if check:
            cand["same_blocks_as_create_block_mask"] = same_blocks(
                bm, create_block_mask(mask_mod, None, None, n, n, device=dev, BLOCK_SIZE=block))
        for opts in _attempts(block, plain_failed):
            fn = functools.partial(flex, q, k, v, block_mask=bm, scale=scale, kernel_options=opts)
            start = time.perf_counter()
            try:
                out = fn()
                sync()
            except Exception as exc:  # a block FlexAttention refuses: recorded, then the next attempt
                cand.setdefault("errors", []).append({"kernel_options": opts, "error": error_text(exc)})
                if opts is None:
                    plain_failed.add(block)
                continue
            cand.update(kernel_options=opts, first_call_s=round(time.perf_counter() - start, 2), **timer(fn))
            if check:
                outs[block] = out
            break
        candidates.append(cand)
        print(f"  prefill {name} N={n} block={block}: {cand.get('ms', 'failed')}", file=sys.stderr, flush=True)
    timed = [c for c in candidates if "ms" in c]
    best = min(timed, key=lambda c: c["ms"]) if timed else None
    flex_c = next((c for c in timed if tuple(c["block"]) == FLEX_BLOCK and c["kernel_options"] is None), None)
    ms = {"flex": flex_c and flex_c["ms"], "sas": best and best["ms"]}
    quant = {"flex": flex_c and [flex_c["q20"], flex_c["q80"]], "sas": best and [best["q20"], best["q80"]]}
    row = {"pattern": name, "pattern_text": text, "N": n, "phase": "prefill-graph" if graph else "prefill",
           "timer": args.prefill_timer}
    if n <= args.dense_max_len:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            d = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
        ms["dense"], quant["dense"] = d["ms"], [d["q20"], d["q80"]]
    else:
        row["dense_skipped"] = f"N > --dense-max-len {args.dense_max_len}"
    row.update(ms=ms, q20_q80=quant, speedup=speedups(ms), sas_block=best and best["block"],
               sas_kernel_options=best and best["kernel_options"], candidates=candidates)
    if check and outs:
        row["check"] = prefill_check(pattern, q, k, v, scale, outs, best)
    emit(row)


def prefill_check(pattern, q, k, v, scale, outs: dict, best: dict) -> dict:
    """Max abs difference of each block configuration and of sas vs flex, against SDPA with the explicit mask."""
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    mask = pattern.visible(pos[:, None], pos[None, :])
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
    ref = ref.masked_fill(~mask.any(-1)[:, None], 0.0)  # a query that sees nothing: 0, as FlexAttention gives
    diffs = {f"{b[0]}x{b[1]}": (o.float() - ref).abs().max().item() for b, o in outs.items()}
    sas_vs_flex = (outs[tuple(best["block"])].float() - outs[FLEX_BLOCK].float()).abs().max().item() \
        if FLEX_BLOCK in outs else None
    worst = max(list(diffs.values()) + [sas_vs_flex or 0.0])
    return {"N": n, "max_abs_vs_masked_sdpa": diffs, "sas_vs_flex_max_abs": sas_vs_flex, "tolerance": TOLERANCE,
            "ok": worst <= TOLERANCE}


def last_attending(pattern, n: int) -> int | None:
    """The last position <= n-1 whose query sees some key (None within 4096 steps)."""
    for p in range(n - 1, max(-1, n - 4097), -1):
        if bool(pattern.visible(torch.tensor(p), torch.arange(p + 1)).any()):
            return p
    return None


def decode_row(name: str, n: int, args, plan_futures: dict, emit) -> None:
    text = pattern_text(name)
    pattern, dev, H, D = pattern_of(name), DEVICE, args.heads, args.head_dim
    try:
        slots, slot_of, plan_s = plan_futures[(name, n)].result()
    except Exception as exc:
        emit({"pattern": name, "pattern_text": text, "N": n, "phase": "decode", "error": error_text(exc)})
        return
    base = {"pattern": name, "pattern_text": text, "N": n, "cache_slots": slots, "plan_s": round(plan_s, 2)}
    pos = n - 1
    seen = int(pattern.visible(torch.tensor(pos), torch.arange(n)).sum())
    row = decode_one(name, n, pos, slots, slot_of, H, D, dev, check=n == min(args.lengths))
    emit({**base, "phase": "decode", **row})
    if seen == 0 and (p := last_attending(pattern, n)) is not None:
        # The query at N-1 sees nothing (FlexAttention then skips every block): time the last one that sees.
        emit({**base, "phase": "decode-last-attending", **decode_one(name, n, p, slots, slot_of, H, D, dev)})
    torch.cuda.empty_cache()


def decode_one(name: str, n: int, pos: int, slots: int, slot_of, H: int, D: int, dev, check: bool = False) -> dict:
    """One decode step at position pos with the cache planned for n tokens: flex / sas (generated mask) /
    sas_eager_mask / sas_compiled_mask / sas_kernel (mask precomputed) / dense."""
    from torch.nn.attention.flex_attention import create_block_mask

    pattern, compiled = pattern_of(name), compiled_slot_mask(name, H)
    generated = PositionRule(pattern.visible, triton_visible(pattern))
    opts = dict(device=dev, dtype=torch.bfloat16)
    scale, flex = D**-0.5, compiled_flex()
    key_pos = slot_positions(slot_of, slots, pos)
    # The compaction loses nothing: the slots' visible keys are exactly the visible keys of the whole sequence.
    pos_cpu = torch.tensor(pos)
    want = torch.arange(n)[pattern.visible(pos_cpu, torch.arange(n))]
    got = key_pos[pattern.visible(pos_cpu, key_pos)].sort().values
    row = {"position": pos, "visible_keys": int(want.numel()), "compaction_ok": torch.equal(want, got)}

    first = torch.tensor(pos, device=dev)

    def mask_mod(b, h, q_idx, kv_idx):
        return pattern.visible(q_idx + first, kv_idx)

    bm = block_mask(cell_counts(pattern, 1, n, pos, dev), FLEX_BLOCK, (1, n), mask_mod)
    if check:
        row["same_blocks_as_create_block_mask"] = same_blocks(
            bm, create_block_mask(mask_mod, None, None, 1, n, device=dev, BLOCK_SIZE=FLEX_BLOCK))
    flex_blocks = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
    per_key = H * D * 2 * 2  # K and V, bf16
    full_bytes = n * per_key
    budget = max(1, FULL_CACHE_BYTES // full_bytes)
    copies = {"flex": min(budget, copies_for(flex_blocks * FLEX_BLOCK[1] * per_key)),
              "dense": min(budget, copies_for((pos + 1) * per_key)), "sas": copies_for(slots * per_key)}
    q4 = torch.randn(1, H, 1, D, **opts)
    q = q4[:, :, 0]
    static_dims(q4)
    kf = [torch.randn(1, H, n, D, **opts) for _ in range(max(copies["flex"], copies["dense"]))]
    vf = [torch.randn(1, H, n, D, **opts) for _ in range(len(kf))]
    for t in kf + vf:
        static_dims(t)
    stored = (key_pos >= 0).to(dev)
    idx = key_pos.clamp(min=0).to(dev)
    ks = [torch.where(stored[:, None], kf[0][:, :, idx], 0.0)] + \
        [torch.randn(1, H, slots, D, **opts) for _ in range(copies["sas"] - 1)]
    vs = [torch.where(stored[:, None], vf[0][:, :, idx], 0.0)] + \
        [torch.randn(1, H, slots, D, **opts) for _ in range(copies["sas"] - 1)]
    key_pos_dev = key_pos.to(dev).view(1, 1, slots)
    pos_dev = first.view(1, 1, 1)
    len_slots = torch.full((1,), slots, dtype=torch.long, device=dev)
    len_dense = torch.full((1,), pos + 1, dtype=torch.long, device=dev)

    def slot_mask():
        # What the engine does each step: the pattern at each slot's key position, one row per KV head.
        return pattern.visible(pos_dev, key_pos_dev).expand(1, H, slots).contiguous()

    fixed_mask = slot_mask()
    steps = {
        "flex": lambda c: flex(q4, kf[c], vf[c], block_mask=bm, scale=scale),
        "sas": lambda c: decode_attention(q, ks[c], vs[c], len_slots, scale=scale,
                                          mask=PositionMask(generated, key_pos_dev, first.view(1))),
        "sas_eager_mask": lambda c: decode_attention(q, ks[c], vs[c], len_slots, scale=scale, mask=slot_mask()),
        "sas_kernel": lambda c: decode_attention(q, ks[c], vs[c], len_slots, scale=scale, mask=fixed_mask),
        "sas_compiled_mask": lambda c: decode_attention(q, ks[c], vs[c], len_slots, scale=scale,
                                                        mask=compiled(pos_dev, key_pos_dev)),
        "dense": lambda c: decode_attention(q, kf[c], vf[c], len_dense, scale=scale),
    }
    copies["sas_kernel"] = copies["sas_compiled_mask"] = copies["sas_eager_mask"] = copies["sas"]
    outs = {m: step(0) for m, step in steps.items()}  # warm-up (FlexAttention compiles here)
    sync()
    ms, quant, eager, errors = {}, {}, {}, {}
    for m, step in steps.items():
        try:
            r = bench_graph(lambda step=step, c=copies[m]: [step(i) for i in range(c)], copies[m])
            ms[m], quant[m] = r["ms"], [r["q20"], r["q80"]]
        except Exception as exc:  # a method that cannot be captured: its eager time stands alone
            errors[m] = error_text(exc)
        if m in ("flex", "sas", "dense"):
            eager[m] = bench(lambda step=step: step(0))["ms"]
    ref = decode_attention_reference(q, kf[0], vf[0], torch.full((1,), n, dtype=torch.long, device=dev),
                                     scale=scale, q_first=torch.full((1,), pos, dtype=torch.long, device=dev),
                                     mask=pattern.visible(first, torch.arange(n, device=dev)).expand(1, H, n)
                                     .contiguous())
    diffs = {m: (outs[m].reshape(ref.shape).float() - ref.float()).abs().max().item()
             for m in ("flex", "sas", "sas_eager_mask", "sas_compiled_mask")}
    row.update(ms=ms, q20_q80=quant, ms_eager=eager, copies=copies, speedup=speedups(ms),
               speedup_eager=speedups(eager), flex_listed_blocks=flex_blocks,
               check={"max_abs_vs_reference": diffs, "tolerance": TOLERANCE,
                      "ok": max(diffs.values()) <= TOLERANCE})
    if errors:
        row["graph_errors"] = errors
    return row


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    names = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=ints, default=LENGTHS, help="comma-separated sequence lengths")
    parser.add_argument("--patterns", type=names, default=PATTERNS, help="comma-separated profile names")
    parser.add_argument("--phases", type=names, default=["prefill", "decode"], help="prefill,decode")
    parser.add_argument("--out", type=Path, help="JSON result (rewritten after every row)")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--q-blocks", type=ints, default=[128, 64], help="SAS's candidate query block sizes")
    parser.add_argument("--kv-blocks", type=ints, default=[128, 64], help="SAS's candidate key block sizes")
    parser.add_argument("--dense-max-len", type=int, default=32768, help="longest N for prefill's dense SDPA")
    parser.add_argument("--time-limit", type=float, help="seconds after which the remaining rows are skipped")
    parser.add_argument("--prefill-timer", choices=["do_bench", "cuda_graph"], default="do_bench",
                        help="cuda_graph: replays without launch overhead (rows then have phase prefill-graph)")
    args = parser.parse_args(argv)
    for name in args.patterns:
        if not (ROOT / "profiles" / f"{name}.yaml").exists():
            parser.error(f"no profile profiles/{name}.yaml")
    if bad := [n for n in args.lengths if n % 128 or n < 128]:
        parser.error(f"lengths must be multiples of 128, got {bad}")
    if bad := [b for b in args.q_blocks + args.kv_blocks if b % CELL or b > 128]:
        parser.error(f"block sizes must be multiples of {CELL} up to 128, got {bad}")
    if FLEX_BLOCK[0] not in args.q_blocks or FLEX_BLOCK[1] not in args.kv_blocks:
        parser.error(f"the candidates must include FlexAttention's default block {FLEX_BLOCK}")
    if bad := [p for p in args.phases if p not in ("prefill", "decode")]:
        parser.error(f"unknown phases {bad}; expected prefill, decode")
    return args


def start_plans(args) -> dict:
    """plan_cache for every (pattern, N) in worker processes, longest first, while the GPU runs prefill."""
    workers = max(1, min(8, (os.cpu_count() or 2) - 2))
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    threads = max(1, (os.cpu_count() or 2) // workers)
    return {(name, n): pool.submit(plan_job, pattern_text(name), n, threads)
            for n in sorted(args.lengths, reverse=True) for name in args.patterns}


def summary(rows: list[dict]) -> str:
    lines = [f"{'pattern':<24} {'N':>6} {'phase':<9} {'flex':>9} {'sas':>9} {'dense':>9} {'x flex':>7} "
             f"{'x dense':>7}  detail"]
    for r in rows:
        ms, sp = r.get("ms", {}), r.get("speedup", {})
        fmt = lambda x: f"{x:9.4f}" if x else f"{'-':>9}"  # noqa: E731
        detail = f"block {r.get('sas_block')}" if r["phase"].startswith("prefill") else \
            f"slots {r.get('cache_slots')}, vs flex: compiled mask x{sp.get('sas_compiled_mask_vs_flex', '-')}, " \
            f"kernel only x{sp.get('sas_kernel_vs_flex', '-')}"
        lines.append(f"{r['pattern']:<24} {r['N']:>6} {r['phase'][:9]:<9} {fmt(ms.get('flex'))} {fmt(ms.get('sas'))} "
                     f"{fmt(ms.get('dense'))} {sp.get('sas_vs_flex', '-'):>7} {sp.get('sas_vs_dense', '-'):>7}  "
                     f"{detail}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/bench_sas_kernels.py needs a CUDA device")
    import triton

    plans = start_plans(args) if "decode" in args.phases else {}
    result = {"command": " ".join(["python3", *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__},
              "note": "random inputs (speed only)",
              "settings": {"batch": 1, "heads": args.heads, "head_dim": args.head_dim, "dtype": "bfloat16",
                           "flex": "torch.compile(flex_attention, dynamic=True, fullgraph=True), batch/heads/"
                                   "head_dim marked static; block masks from the pattern (checked against "
                                   "create_block_mask at the smallest N)",
                           "dense_prefill": "SDPA is_causal=True, flash backend",
                           "decode_kernel": "kernels.decode_attention (Triton split-KV); sas: pattern generated "
                                            "into the kernel (engines/sas/codegen.py)",
                           "decode_timing": "CUDA-graph replay over `copies` cache copies, per copy",
                           "prefill_timing": "triton.testing.do_bench, L2 flushed (phase prefill); CUDA-graph "
                                             "replay, L2 not flushed (phase prefill-graph)",
                           "quantiles": "median, [20%, 80%]"},
              "rows": []}

    def emit(row: dict) -> None:
        result["rows"].append(row)
        if "cache_slots" in row:
            result.setdefault("cache_slots", {}).setdefault(row["pattern"], {})[str(row["N"])] = row["cache_slots"]
        ms = {k: round(v, 4) for k, v in row.get("ms", {}).items() if v}
        print(f"{row['pattern']} N={row['N']} {row['phase']}: {ms} {row.get('speedup', row.get('error'))}",
              flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    start = time.perf_counter()
    plain_failed: set = set()
    torch.manual_seed(0)
    # Lengths outermost, decode first: if the time limit cuts the run, what is lost is the longest prefill.
    jobs = [(decode_row, "decode", n, name, plans) for n in args.lengths for name in args.patterns] + \
        [(prefill_row, "prefill", n, name, plain_failed) for n in args.lengths for name in args.patterns]
    for fn, phase, n, name, extra in jobs:
        if phase not in args.phases:
            continue
        if args.time_limit and time.perf_counter() - start > args.time_limit:
            emit({"pattern": name, "N": n, "phase": phase, "skipped": f"--time-limit {args.time_limit} s reached"})
            continue
        fn(name, n, args, extra, emit)
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    # One FlexAttention compile per (pattern, block, kernel options, phase), not per length.
    result["dynamo_unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result["rows"]), flush=True)


if __name__ == "__main__":
    main()
