"""`longctx plan`: memory per device for a profile, model and document, before loading any weights."""

from __future__ import annotations

import psutil
import torch
from rich.console import Console
from rich.table import Table

from engines import ENGINES, chunk_graphs
from engines.cache import head_dim
from engines.config import STREAMING, reads_past_context
from longctx_cli.errors import ConfigError
from longctx_cli.inputs import collect_documents, iter_text, tokenize_stream
from longctx_cli.models import load_config, load_tokenizer, max_context, pick_device, pick_dtype
from longctx_cli.report import gib
from longctx_cli.split import check_gpus_model, free_memory, layer_split, layer_state_bytes, split_devices
from longctx_cli.units import parse_count

err = Console(stderr=True)
MARGIN = 0.9  # leave 10% of free memory for the allocator's fragmentation and the CUDA context
QUESTION_TOKENS = 64  # room planned for a question not yet asked


_PARAMETERS: dict[str, int] = {}


def parameter_bytes(config, dtype_bytes: int) -> int:
    """Weight bytes, counted on a meta-device instance (no memory, no weights read); memoised per config."""
    from transformers import AutoModelForCausalLM

    key = config.to_json_string()
    if key not in _PARAMETERS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _PARAMETERS[key] = sum(p.numel() for p in model.parameters())
    return _PARAMETERS[key] * dtype_bytes


def activation_bytes(config, chunk: int, context: int, dtype_bytes: int, device: torch.device) -> int:
    """Peak transient memory of one prefill chunk: hidden states, MLP, q/k/v, attention scratch, logits."""
    text = config.get_text_config(decoder=True)
    qkv = (text.num_attention_heads + 2 * text.num_key_value_heads) * head_dim(config)
    per_token = 4 * text.hidden_size + 3 * text.intermediate_size + qkv
    scratch = 0
    if device.type == "cpu":
        # The CPU path materialises fp32 scores [Hq, chunk, context] plus the boolean mask.
        scratch = text.num_attention_heads * chunk * context * 4 + chunk * context
    return chunk * per_token * dtype_bytes + scratch + text.vocab_size * 4


def estimate(profile, config, n_tokens: int) -> dict:
    run = profile.run
    split = bool(run.gpus_model and run.gpus_model > 1)
    # A split runs on GPUs 0..N-1 (checked against the visible ones), whatever --device auto finds here.
    device = torch.device("cuda", 0) if split else pick_device(run.device)
    dtype_bytes = torch.tensor([], dtype=pick_dtype(run.dtype, device)).element_size()
    engine = ENGINES[profile.engine]
    capacity = n_tokens + run.max_new_tokens
    weights = parameter_bytes(config, dtype_bytes)
    # The question's room is not known before it is asked: the answer's, plus a question's allowance.
    kv = engine.memory_plan(config, capacity, dtype_bytes, profile.engine_config, chunk_size=run.chunk_size,
                            reserve=run.max_new_tokens + QUESTION_TOKENS)
    act = activation_bytes(config, min(run.chunk_size, capacity), capacity, dtype_bytes, device)
    if device.type == "cuda" and not split and chunk_graphs.graphed(config, run, n_tokens, dtype_bytes):
        act += chunk_graphs.kept_bytes(config, run.chunk_size, dtype_bytes)  # kept while the model is loaded
    layers = {}
    if split:
        devices = split_devices(run.gpus_model, run.device)
        free = dict(zip(devices, free_memory(devices)))
        per_layer = layer_state_bytes(engine, config, capacity, dtype_bytes, profile.engine_config,
                                      chunk_size=run.chunk_size, reserve=run.max_new_tokens + QUESTION_TOKENS)
        placed = layer_split(config, devices, pick_dtype(run.dtype, device), per_layer, list(free.values()))
        need = {d: w + st + act for d, w, st in zip(devices, placed.weights, placed.state)}
        weights_on, kv_on = dict(zip(devices, placed.weights)), dict(zip(devices, placed.state))
        layers = {d: f"{r.start}-{r.stop - 1}" for d, r in zip(devices, placed.layers)}
    elif device.type == "cuda":
        ids = [device.index] if device.index is not None else list(range(torch.cuda.device_count()))
        n = len(ids)
        free = {f"cuda:{i}": torch.cuda.mem_get_info(i)[0] for i in ids}
        need = {d: weights // n + kv // n + act for d in free}
        weights_on, kv_on = {d: weights / n for d in free}, {d: kv / n for d in free}
    else:
        free = {"cpu": psutil.virtual_memory().available}
        need = {"cpu": weights + kv + act}
        weights_on, kv_on = {"cpu": weights}, {"cpu": kv}
    return {"tokens": n_tokens, "capacity": capacity, "weights": weights, "kv": kv, "activations": act,
            "need": need, "free": free, "max_context": max_context(config), "weights_on": weights_on,
            "kv_on": kv_on, "layers": layers,
            "fits": all(need[d] <= MARGIN * free[d] for d in need)}


def max_tokens(profile, config) -> int:
    """The longest document (tokens) whose estimate fits the devices as they are now (0 if none)."""
    lo, hi = 0, 1 << 26
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if estimate(profile, config, mid)["fits"] else (lo, mid - 1)
    return lo


def run_plan(profile, *, model: str | None, paths: list[str], tokens: str | None) -> int:
    check_gpus_model(profile.run.gpus_model, profile.run.device)
    config = load_config(model, progress=lambda m: err.print(f"[dim]{m}...[/]"))
    if tokens is not None:
        n_tokens = parse_count(tokens)
    elif paths:
        tokenizer = load_tokenizer(model)
        docs = collect_documents(paths)
        n_tokens = max(tokenize_stream(iter_text(d), tokenizer).numel() for d in docs) + QUESTION_TOKENS
    else:
        raise ConfigError("plan needs documents or --tokens N")
    try:
        est = estimate(profile, config, n_tokens)
    except ValueError as exc:  # e.g. a sas pattern too irregular to analyse at this length
        raise ConfigError(f"profile {profile.name}: {exc}") from None
    table = Table(title=f"plan: {profile.name} ({profile.engine}) on {model or 'gemma3-270m'}", title_justify="left")
    split = bool(est["layers"])
    for col in ("device", *(("layers",) if split else ()), "weights", "KV cache", "activations", "needed", "free",
                "fits"):
        table.add_column(col)
    for dev, need in est["need"].items():
        ok = need <= MARGIN * est["free"][dev]
        table.add_row(dev, *((est["layers"][dev],) if split else ()), gib(est["weights_on"][dev]),
                      gib(est["kv_on"][dev]), gib(est["activations"]), gib(need), gib(est["free"][dev]),
                      "[green]yes[/]" if ok else "[red]no[/]")
    err.print(table)
    device = torch.device("cuda") if split else pick_device(profile.run.device)
    dtype = str(pick_dtype(profile.run.dtype, device)).removeprefix("torch.")
    err.print(f"weights: {gib(est['weights'])} ({est['weights'] / 1e9:.1f} GB) in {dtype}" +
              (f", split over {len(est['layers'])} GPUs in layer order; each layer's state on its layer's GPU"
               if split else ""))
    err.print(f"document: {n_tokens:,} tokens, KV capacity {est['capacity']:,} tokens, "
              f"model context {est['max_context']:,}")
    try:
        notes = ENGINES[profile.engine].plan_notes(config, est["capacity"], profile.engine_config)
    except ValueError as exc:  # e.g. a sas pattern too irregular to analyse at this length
        raise ConfigError(f"profile {profile.name}: {exc}") from None
    for line in notes:
        err.print(line)
    verdict = 0
    past = est["max_context"] and est["capacity"] > est["max_context"]
    if past and reads_past_context(profile.engine, profile.engine_config):
        top = ENGINES[profile.engine].largest_position(config, profile.engine_config, est["capacity"],
                                                        chunk_size=profile.run.chunk_size,
                                                        reserve=profile.run.max_new_tokens + QUESTION_TOKENS)
        err.print(f"positions re-assigned: {est['capacity']:,} tokens exceed the model's {est['max_context']:,}; "
                  f"{profile.engine} gives the model positions up to {top:,} (engines/positions.py)")
    elif past:
        err.print(f"[red]too long:[/] {est['capacity']:,} tokens (document, question and answer) exceed the "
                  f"model's {est['max_context']:,}; shorten or split the document, lower --max-new-tokens, or use an "
                  f"engine that reads past it: {' or '.join(STREAMING)}")
        verdict = 6
    if not est["fits"]:
        most = max_tokens(profile, config)
        room = f"at most ~{most:,} tokens fit now" if most else f"the weights alone ({gib(est['weights'])}) do not fit"
        err.print(f"[red]does not fit:[/] {room}; lower --chunk-size, use a sparser profile, or split the model over "
                  "more GPUs (--gpus-model N)")
        verdict = verdict or 7
    if verdict == 0:
        err.print("[green]fits[/]")
    print(f"{'fits' if verdict == 0 else 'does not fit'}")
    return verdict
