"""Where resa's block selection spends its time in one decode step, per layer: the bound kernel, the softmax pool
and the top-k, and the top-k's stages (load, key range, search, output), each timed by switching the others off
in a copy of the shipped top-k program, plus warps per program and the search's step count per head, with the
search bracketed by the scores' range and by the bin of their histogram (as the engine runs it: the shipped
rule's top-k compares the scores' bins, so with the histogram it has no search step left). Two sources
of descriptors and queries: random keys with a shared direction per 512-token span (so block scores spread), the
Llama-3.1-8B and Qwen3-1.7B attention shapes, 128K and 256K tokens; and with --engine, a random-weight model's own
(every layer's query and descriptors in one decode step after a prefill of random tokens). The shipped rule
(softmax pooling + centroid folded into int8 descriptors, 10%, floor 1,024 blocks). Checks that the copy selects what the shipped kernel
selects, and the shipped kernel what the reference selects. Speed only.

    python benchmarks/resa_topk_breakdown.py          # writes $OUT/topk_diag.json (or ./topk_diag.json)
    python benchmarks/resa_topk_breakdown.py --engine random:qwen3-1.7b --length 128k   # $OUT/topk_engine.json
"""
import argparse, json, os, sys
from pathlib import Path
import torch, triton, triton.language as tl
from triton.testing import do_bench_cudagraph
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.block_select.triton as sel
from kernels.block_select.triton_topk import _bin_of, _bracket, _resident_row, _resident_search, _resident_store
from kernels.block_descriptors import update_block_descriptors
from kernels.block_select import KeepRule, new_histogram, score_bins
from kernels.block_select.reference import select_blocks as ref_select


@triton.jit
def _topk_variant(Scores, Length, Out, Steps, Hist, n_blocks_cap, width, ratio_num, ratio_den, min_blocks,
                  n_kv_heads, BLOCK: tl.constexpr, NB_MAIN: tl.constexpr, NB_REST: tl.constexpr,
                  W_PAD: tl.constexpr, SEARCH: tl.constexpr, OUTPUT: tl.constexpr, RANGE: tl.constexpr,
                  HIST: tl.constexpr, SHIFT: tl.constexpr, BASE: tl.constexpr):
    """The shipped resident top-k (kernels/block_select/triton_topk.py) from its own parts, each switchable."""
    pid_bh, n_blocks, k, offs_a, in_a, key_a, offs_b, in_b, key_b = _resident_row(
        Scores, Length, n_blocks_cap, ratio_num, ratio_den, min_blocks, n_kv_heads, BLOCK, NB_MAIN, NB_REST)
    key_a = _bin_of(key_a, SHIFT, BASE)
    key_b = _bin_of(key_b, SHIFT, BASE)
    if RANGE:
        lo, hi, count = _bracket(Hist, pid_bh, n_blocks, k, key_a, in_a, key_b, in_b, HIST, SHIFT, BASE, True)
    else:
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483648, tl.int64)
        count = tl.full([], -1, tl.int32)
    if SEARCH:
        thr, exact, steps = _resident_search(key_a, in_a, key_b, in_b, k, lo, hi, count, True)
    else:
        thr, exact, steps = lo.to(tl.int32), count == k, tl.zeros([], dtype=tl.int32)
    tl.store(Steps + pid_bh, steps)
    if OUTPUT:
        _resident_store(Out + pid_bh * width, key_a, in_a, offs_a, key_b, in_b, offs_b, thr, exact, k, width,
                        W_PAD)
    else:
        tl.store(Out + pid_bh * width, thr)


RULE = KeepRule(keep_ratio=0.1, min_blocks=1024, local_blocks=1, sink_blocks=1, pooling="softmax", centroid=True)
DESCRIPTORS = "int8"


def _bench(fn) -> float:
    return round(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000, 2)


def measure(q, kmax, kmin, dscale, n, scale, stages=True) -> dict:
    """One layer's selection: q [1, Hq, D], int8 descriptors [1, Hkv, NB, D] (the mean folded in) and their scale
    dscale [1, Hkv, NB], n [1]. Times (µs), search steps per head (bracketed by the scores' range, and by the
    histogram's bin: steps_hist)."""
    Hq, D = q.shape[1:]
    Hkv, NB = kmax.shape[1:3]
    width = RULE.keep(NB)
    args = dict(block_size=16, rule=RULE, width=width, scale=scale, folded=True, descriptor_scale=dscale)
    full = lambda: sel.select_blocks_triton(q, kmax, kmin, n, **args)
    got = full()
    ref = ref_select(q.float(), kmax, kmin, n, **args)
    group = Hq // Hkv
    tile = min(128, sel._DOT_ELEMENTS // D)
    n_tiles = triton.cdiv(NB, tile)
    scores = torch.empty(1, Hkv, NB, device="cuda", dtype=torch.float32)
    bounds = torch.empty(1, Hkv, group, NB, device="cuda", dtype=torch.float32)
    tmax = torch.empty(1, Hkv, group, n_tiles, device="cuda", dtype=torch.float32)
    tsum = torch.empty_like(tmax)
    num, den = RULE.ratio

    def b_():
        sel._head_bounds_kernel[(Hkv, n_tiles)](q, kmax, kmin, kmax, dscale, n, bounds, tmax, tsum, Hkv, NB,
            n_tiles, 1, 1, scale * sel._LOG2E, q.stride(0), q.stride(1), kmax.stride(0), kmax.stride(1),
            kmax.stride(2), dscale.stride(0), dscale.stride(1), GROUP=group, G_DOT=16, HEAD_DIM=D, BLOCK=16,
            TILE=tile, CENTROID=True, FOLDED=True, QUANT=True, IEEE=False, PDL=False, num_warps=4)

    hist = new_histogram(1, Hkv, "cuda")
    shift, base = score_bins(RULE.pooling, group)

    def p_(with_hist=False):
        sel._softmax_pool_kernel[(Hkv, n_tiles)](bounds, tmax, tsum, n, scores, hist, Hkv, NB, n_tiles, 1, 1,
            GROUP=group, BLOCK=16, TILE=tile, NT_PAD=max(16, triton.next_power_of_2(n_tiles)), HIST=with_hist,
            SHIFT=shift, BASE=base, PDL=False, num_warps=4)
    b_(); p_()
    out = torch.empty(1, Hkv, width, device="cuda", dtype=torch.int32)
    steps = torch.zeros(Hkv, device="cuda", dtype=torch.int32)
    main, rest, shipped_warps = sel.resident_layout(NB)

    def t_(search=True, output=True, rng=True, warps=None, with_hist=False):
        _topk_variant[(Hkv,)](scores, n, out, steps, hist, NB, width, num, den, RULE.min_blocks, Hkv, BLOCK=16,
            NB_MAIN=main, NB_REST=rest, W_PAD=max(16, triton.next_power_of_2(width)),
            SEARCH=search, OUTPUT=output, RANGE=rng, HIST=with_hist, SHIFT=shift, BASE=base,
            num_warps=warps or shipped_warps)
    row = dict(n_blocks=NB, width=width, agree_with_reference=(got == ref).float().mean().item())
    t_()
    row.update(variant_equals_shipped=torch.equal(out, got), steps=steps.tolist())
    p_(True); t_(with_hist=True)
    row.update(hist_variant_equals_shipped=torch.equal(out, got), steps_hist=steps.tolist(),
               hist_left_zero=not hist.any().item())
    hist_args = dict(args, histogram=hist)
    row["shipped_with_hist_equals_without"] = torch.equal(sel.select_blocks_triton(q, kmax, kmin, n, **hist_args), got)
    ms = {}
    with torch.cuda.stream(torch.cuda.Stream()):
        ms["select_full_hist"] = _bench(lambda: sel.select_blocks_triton(q, kmax, kmin, n, **hist_args))
        hist.zero_()  # the variant's stages start from zeros
        ms["select_full"] = _bench(full)
        ms["bounds"] = _bench(b_)
        ms["pool"] = _bench(p_)
        ms["topk"] = _bench(t_)
        ms["pool_topk"] = _bench(lambda: (p_(), t_()))
        ms["pool_topk_hist"] = _bench(lambda: (p_(True), t_(with_hist=True)))
        if stages:
            ms["pool_hist_no_topk"] = _bench(lambda: p_(True))
            ms["topk_nosearch"] = _bench(lambda: t_(search=False))
            ms["topk_nooutput"] = _bench(lambda: t_(output=False))
            ms["topk_norange"] = _bench(lambda: t_(rng=False))
            ms["topk_load_only"] = _bench(lambda: t_(search=False, output=False, rng=False))
            for w in (4, 8, 16, 32):
                ms[f"topk_w{w}"] = _bench(lambda: t_(warps=w))
            ms["empty_graph_kernel"] = _bench(lambda: steps.add_(0))
        hist.zero_()
    row["us"] = ms
    return row


def random_rows() -> list:
    rows = []
    for shape, (Hq, Hkv, D) in {"llama-3.1-8b": (32, 8, 128), "qwen3-1.7b": (16, 8, 128)}.items():
        for length in (131072, 262144):
            torch.manual_seed(0)
            opts = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(1, Hq, D, **opts)
            k = torch.randn(1, Hkv, length, D, **opts)
            # Real keys are not iid: give each 512-token span a shared direction so block scores spread.
            k += 2 * torch.randn(1, Hkv, length // 512, 1, D, **opts).expand(-1, -1, -1, 512, -1).reshape(
                1, Hkv, length, D)
            NB = length // 16
            kmax, kmin = (torch.empty(1, Hkv, NB, D, device="cuda", dtype=torch.int8) for _ in range(2))
            dscale = torch.empty(1, Hkv, NB, device="cuda")
            n = torch.tensor([length], device="cuda")
            update_block_descriptors(k, kmax, kmin, n, length, 16, fold_mean=True, scale=dscale)
            row = dict(shape=shape, length=length, **measure(q, kmax, kmin, dscale, n, D ** -0.5))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def engine_rows(model: str, length: str) -> list:
    """Every layer's selection inputs in one eager decode step of the shipped resa profile, after a prefill."""
    from engines import ENGINES
    from engines.decoding import Sampler, swapped
    from longctx_cli.home import longctx_home
    from longctx_cli.models import load_model
    from longctx_cli.profiles import resolve_profile
    from longctx_cli.units import parse_count
    import kernels.block_select as block_select

    lm = load_model(model, device="cuda", dtype="bfloat16")
    prof = resolve_profile("resa", {})
    engine = ENGINES[prof.engine](lm, prof.engine_config, prof.run, home=longctx_home())
    if engine.config.rule != RULE or engine.config.descriptor_dtype != DESCRIPTORS:
        raise SystemExit(f"the shipped profile's rule {engine.config.rule} ({engine.config.descriptor_dtype}) is not "
                         f"the breakdown's {RULE} ({DESCRIPTORS})")
    torch.manual_seed(0)
    state = engine.prefill(torch.randint(1000, 20000, (parse_count(length),)), reserve=64)
    seen = []
    shipped = sel.select_blocks_triton

    def keep(q, kmax, kmin, n, **kw):
        seen.append((q.clone(), kmax.clone(), kmin.clone(), kw["descriptor_scale"].clone(), n.clone(), kw["scale"]))
        return shipped(q, kmax, kmin, n, **kw)
    rows = []
    with torch.inference_mode():
        step = engine._decode_step(state, Sampler())
        step.start(1234, state.position)
        block_select._triton_impl.cache_clear()
        sel.select_blocks_triton = keep
        try:
            with swapped(step.blocks):
                step._step()
        finally:
            sel.select_blocks_triton = shipped
            block_select._triton_impl.cache_clear()
        torch.cuda.synchronize()
        for layer, (q, kmax, kmin, dscale, n, scale) in enumerate(seen):
            NB = triton.cdiv(int(n.item()), 16)  # the blocks in use (the cache's capacity holds the answer room)
            d = [t[:, :, :NB].contiguous() for t in (kmax, kmin, dscale)]
            row = dict(model=model, length=length, layer=layer, **measure(q.contiguous(), *d, n, scale, stages=False))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", help="a random-weight model (random:PRESET): its own queries and descriptors")
    ap.add_argument("--length", default="128k")
    a = ap.parse_args()
    rows = engine_rows(a.engine, a.length) if a.engine else random_rows()
    name = "topk_engine.json" if a.engine else "topk_diag.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps({
        "command": "python benchmarks/resa_topk_breakdown.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "rows": rows}, indent=1))
