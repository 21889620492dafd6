"""`ltri-stream`: Ltri-LLM (../shared/papers/ltri-llm.txt), streaming with bounded device memory.

The document streams through in chunks. Every full-attention layer keeps on the device only the first
`n_init` tokens, the local window (>= `n_local` tokens), `top_k` retrieved blocks and the chunk in flight
(engines/ltri/cache.py); older tokens leave in blocks of `block_size` for CPU context memory, each block
indexed by the span index vectors of its semantic spans (engines/ltri/spans.py). Per chunk and layer:

1. Retrieval (section 3.4): the chunk's own causal attention map is divided into spans, whose top-voted
   queries are the query index vectors; every stored block scores the best dot product between them and its
   index vectors (on the layer's retrieval head, or all heads averaged); with collaborative voting the
   retrieval-head layers before this one add their normalised block scores, weighted by their head scores
   (section 3.5). The top_k blocks are loaded into the retrieval slots (blocks already there stay).
2. Attention over [init | retrieved | window | chunk], an explicit softmax: its probabilities give each
   window key its votes (attention received, InfLLM's Eq. 6) and the chunk's own map, from which the spans
   of every block completed in this chunk are found while it is still on the device.
3. Eviction: whole blocks past the window go to CPU memory; per span the top-n voted tokens become index
   vectors, n from the span's confidence (Eq. 7), lam per layer fixed or calibrated to a target compression.

The question is the last prefill chunk (its retrieval is the persistent one); decode keeps that retrieval
(the persistent mechanism, 3.5) and appends generated tokens to the window, one static-shape step over the
layer's rows with a validity mask (CUDA-graph safe). Layers the model itself runs with a sliding window stay
exact, holding only their window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import psutil
import torch
import torch.nn.functional as F

from engines.base import DocumentState, Engine, EngineInputError, outside_engine_error
from engines.cache import layer_types
from engines.ltri.cache import LtriCache, LtriLayer, layer_specs
from engines.ltri.heads import cached_heads
from engines.ltri.index import Indexer
from engines.ltri.memory import context_blocks
from kernels.decode_attention import decode_attention, decode_backend
from longctx_cli.models import longctx_home

_QUERY_SLICE = 256  # queries per slice of the explicit softmax


@dataclass
class LtriConfig:
    """The paper's values (section 4, appendix B) where it gives them."""

    n_init: int = 128  # attention-sink tokens kept on the device
    n_local: int = 4096  # local window
    block_size: int = 128  # memory unit: tokens per block moved to / from CPU memory
    top_k: int = 16  # blocks retrieved per chunk (InfLLM's reserved blocks)
    index: str = "dynamic"  # dynamic span index vectors (3.3.2) or static: InfLLM's top repr_topk per block
    repr_topk: int = 4
    threshold: float = 0.9  # attention-map threshold as a quantile of the block's map (Eq. 5)
    iou: float = 0.1  # NMS IoU threshold
    ratio_mode: str = "row"  # neighbours for the confidence: row, col or rowcol
    lam: float = 3.0  # Eq. 7
    lam_first_layers: float = 20.0  # lam of the model's first four layers
    # Index vectors per block, at least and at most. Appendix B's 4 and 12 (our reading) lost needles on the
    # embedded model (niah_single_2 at 4K, 1408-row budget, 5 samples: 1 of 5 vs 4 of 5 with 12 and 48).
    min_vectors: int = 12
    max_vectors: int = 48
    # Which tokens become index vectors: "votes" (the paper: each span's most-attended ones) or "cover" (ours:
    # farthest-point samples of the block's keys, one inside each span, the same count per block). On the
    # embedded model the votes of the first global layer went to a UUID's characters and lost the words the
    # question matches: at the question the needle's block ranked 12th-25th there against 1st with all of the
    # block's keys (4K, 1,408-row budget).
    pick: str = "cover"
    # A retrieved block whose best match lies in its last successor_tail tokens brings the next block along
    # (ours; 0: off): 4 of 10 UUID needles at 4K straddled two 128-token blocks, and the question only matched
    # the first (its key), never the value's remainder in the second.
    successor_tail: int = 32
    compression: float | None = None  # target tokens per index vector: calibrate lam per layer (3.3.2)
    retrieval_heads: str = "auto"  # auto: identified once per model (Wu et al.) and cached; none: all heads
    voting: bool = True  # collaborative voting across retrieval-head layers
    # CPU context memory format: "model" (the model's dtype) or "fp8" (e4m3 with a scale per block and KV head:
    # half the host memory, for documents whose K/V outgrow the host, e.g. 1M tokens of an 8B model).
    context_memory: str = "model"
    # Ours, off by default (an experiment): the document's prefill attention in retrieving layers also counts
    # every stored block it does not hold, carrying its mean value, instead of renormalising over the rows it
    # holds (the K/V drift that costs multi-key needles at 16K, see NOTES). The question's chunk is left alone
    # (unless compensate_question): counted there too, the blurred mass broke single needles' answers ("1111...")
    # on the embedded model.
    # A block's mass sum_j exp(q.k_j): "mean" takes block_size x exp(q.mean key) (Jensen: an underestimate), "moment" adds the keys' per-dimension variance,
    # block_size x exp(q.mean + q^2.var / 2) (exact for Gaussian keys), capped at the block's upper bound from its
    # keys' max and min (left_out_log_mass). "exact" attends the left-out blocks' own keys and values, loaded
    # from context memory a slot-sized batch at a time and merged by log-sum-exp: exact prefill attention with
    # the device rows still bounded (one batch more, transiently), at the cost of reading the layer's whole
    # context memory once per chunk (O(n^2 / chunk) copies: for compensate_layers such as first).
    compensate: str = "none"
    # Tokens per summary of `compensate` (a divisor of block_size; null: one summary a block). Finer runs may
    # estimate a block's mass better, at more summary memory.
    summary_tokens: int | None = None
    # Layers `compensate` applies to (null: every retrieving layer). The drift enters through the first
    # retrieving layer, whose inputs are still exact (so its summaries are too); layers not listed attend to
    # their rows only and store no summaries. "first": the model's first retrieving layer (5 in the embedded
    # model, 0 in Llama's).
    compensate_layers: list[int] | str | None = None
    # Compensate the question's chunk too (its retrieval is the one decoding keeps).
    compensate_question: bool = False
    # Ours: blocks retrieved per layer where it differs from top_k, {layer index: blocks} (null: top_k in every
    # retrieving layer). Each layer's device rows follow its own count. The drift that costs multi-key needles
    # enters through the first retrieving layer's thinned attention while streaming (see NOTES), so that layer
    # may take more of a fixed total, e.g. {5: 24, 11: 6, 17: 6} holds as many rows as top_k 12 in all three.
    layer_top_k: dict[int, int] | None = None

    def __post_init__(self):
        for name in ("n_init", "n_local", "block_size", "top_k", "repr_topk", "min_vectors", "max_vectors"):
            if getattr(self, name) < (0 if name == "n_init" else 1):
                raise ValueError(f"bad value for {name}: {getattr(self, name)}; expected an integer >= "
                                 f"{0 if name == 'n_init' else 1}")
        checks = [
            ("index", self.index in ("dynamic", "static"), "dynamic or static"),
            ("pick", self.pick in ("votes", "cover"), "votes or cover"),
            ("ratio_mode", self.ratio_mode in ("row", "col", "rowcol"), "row, col or rowcol"),
            ("retrieval_heads", self.retrieval_heads in ("auto", "none"), "auto or none"),
            ("context_memory", self.context_memory in ("model", "fp8"), "model or fp8"),
            ("threshold", 0.0 < self.threshold < 1.0, "a quantile in (0, 1)"),
            ("iou", 0.0 < self.iou < 1.0, "a number in (0, 1)"),
            ("lam", self.lam > 0, "a number > 0"),
            ("lam_first_layers", self.lam_first_layers > 0, "a number > 0"),
            ("max_vectors", self.max_vectors >= self.min_vectors, f"an integer >= min_vectors ({self.min_vectors})"),
            ("n_init", self.n_init % self.block_size == 0, f"a multiple of block_size ({self.block_size})"),
            ("n_local", self.n_local % self.block_size == 0, f"a multiple of block_size ({self.block_size})"),
            ("successor_tail", 0 <= self.successor_tail <= self.block_size, f"0 to block_size ({self.block_size})"),
            ("compression", self.compression is None or self.compression >= 1, "null or a number >= 1"),
            ("compensate", self.compensate in ("none", "mean", "moment", "exact"), "none, mean, moment or exact"),
            ("summary_tokens", self.summary_tokens is None or 1 <= self.summary_tokens <= self.block_size
             and self.block_size % self.summary_tokens == 0, f"null or a divisor of block_size ({self.block_size})"),
            ("compensate_layers", self.compensate_layers is None or self.compensate_layers == "first"
             or isinstance(self.compensate_layers, (list, tuple))
             and all(type(i) is int and i >= 0 for i in self.compensate_layers),
             "null, first or a list of layer indices (integers >= 0)"),
            ("compensate_question", isinstance(self.compensate_question, bool), "true or false"),
            ("layer_top_k", self.layer_top_k is None or isinstance(self.layer_top_k, dict)
             and all(type(i) is int and i >= 0 and type(k) is int and k >= 1 for i, k in self.layer_top_k.items()),
             "null or a mapping of layer index (integer >= 0) to blocks (integer >= 1), e.g. {5: 24}"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"bad value for {name}: {getattr(self, name)!r}; expected {expected}")

    def for_layers(self, full: list[int]) -> LtriConfig:
        """This config with compensate_layers "first" resolved against the model's retrieving layers `full`."""
        if self.compensate_layers == "first":
            return replace(self, compensate_layers=full[:1])
        return self

    def compensates(self, layer_idx: int) -> bool:
        """Whether `compensate` applies to (and keeps summaries for) this layer (see for_layers)."""
        if isinstance(self.compensate_layers, str):
            raise ValueError(f"compensate_layers {self.compensate_layers!r} is resolved by for_layers first")
        return self.compensate != "none" and (self.compensate_layers is None or layer_idx in self.compensate_layers)

    def summarises(self, layer_idx: int) -> bool:
        """Whether this layer keeps block summaries (mean and moment estimate from them; exact needs none)."""
        return self.compensate in ("mean", "moment") and self.compensates(layer_idx)

    def top_k_for(self, layer_idx: int) -> int:
        """Blocks this layer retrieves (and has retrieval slots for): layer_top_k's entry, else top_k."""
        return (self.layer_top_k or {}).get(layer_idx, self.top_k)

    def fewest_top_k(self) -> int:
        """The smallest retrieval of any layer: below it every layer holds every stored block."""
        return min([self.top_k, *(self.layer_top_k or {}).values()])


def compensated(s, v, s_out, v_out):
    """Attention over rows (scores s [..., t, W], values v [..., W, D]) plus keys left out, each summarised by
    a log-weighted score s_out [..., t, N] and a value v_out [..., N, D]: one softmax over both -> [..., t, D]."""
    top = torch.maximum(s.amax(-1, keepdim=True), s_out.amax(-1, keepdim=True))
    e, e_out = torch.exp(s - top), torch.exp(s_out - top)
    return (torch.matmul(e, v) + torch.matmul(e_out, v_out)) / (e.sum(-1, keepdim=True) + e_out.sum(-1, keepdim=True))


def _softmax_state(s, v):
    """Online softmax over scores s [..., t, W] and values v [..., W, D]: (running max, mass, weighted values)."""
    top = s.amax(-1, keepdim=True)
    e = torch.exp(s - top)
    return top, e.sum(-1, keepdim=True), torch.matmul(e, v)


def _softmax_add(state, s, v):
    """The state of _softmax_state with further keys (scores s [..., t, Wi], values v [..., Wi, D]) merged in."""
    top, mass, acc = state
    new = torch.maximum(top, s.amax(-1, keepdim=True))
    old, e = torch.exp(top - new), torch.exp(s - new)
    return new, mass * old + e.sum(-1, keepdim=True), acc * old + torch.matmul(e, v)


def _stored_batches(layer: LtriLayer, device):
    """compensate: exact: K and V [1, Hkv, 1, n * block, D] (fp32) of the stored blocks the rows do not hold, n
    at most the layer's slot count per batch. The bytes loaded count in the cache's host_to_device_bytes."""
    held = {b for b in layer.slots if b >= 0}
    ids = [b for b in range(layer.memory.n_blocks) if b not in held]
    per, block = max(1, layer.n_retrieved // layer.block), layer.block
    hkv, dim = layer.keys.shape[1], layer.keys.shape[3]
    for lo in range(0, len(ids), per):
        batch = ids[lo:lo + per]
        k = torch.empty(hkv, len(batch) * block, dim, dtype=layer.dtype, device=device)
        v = torch.empty_like(k)
        for j, b in enumerate(batch):
            layer.owner.stats["host_to_device_bytes"] += layer.memory.load(b, k[:, j * block:(j + 1) * block],
                                                                           v[:, j * block:(j + 1) * block])
        yield k.float()[None, :, None], v.float()[None, :, None]


def _left_out(layer: LtriLayer) -> tuple[torch.Tensor, ...] | None:
    """The summaries (LtriLayer.summaries) [1, Hkv, 1, N, D] of the runs of the stored blocks the rows do not
    hold, or None."""
    if layer.summaries is None:
        return None
    runs = layer.block // layer.summary_tokens
    keep = torch.ones(layer.summaries[0].shape[0] // runs, dtype=torch.bool, device=layer.summaries[0].device)
    keep[[b for b in layer.slots if b >= 0]] = False
    keep = keep.repeat_interleave(runs)
    if not keep.any():
        return None
    return tuple(x[keep].transpose(0, 1)[None, :, None] for x in layer.summaries)


def left_out_log_mass(q, summaries, n: int, scaling: float, compensate: str):
    """Estimated log sum_j exp(scaling q.k_j) over each summarised run of n keys: q [..., t, D], summaries
    [..., N, D] -> [..., t, N]. mean: n exp(q.mean) (Jensen: a lower bound); moment: n exp(q.mean + q^2.var / 2),
    capped at the run's upper bound n exp(max(q, 0).kmax + min(q, 0).kmin): a few keys far from the rest
    (a needle, an outlier dimension) make the Gaussian's variance term overshoot."""
    k_mean, _, k_var, k_max, k_min = summaries
    s = torch.matmul(q, k_mean.transpose(-1, -2)) * scaling + math.log(n)
    if compensate == "moment":
        bound = (torch.matmul(q.clamp(min=0), k_max.transpose(-1, -2))
                 + torch.matmul(q.clamp(max=0), k_min.transpose(-1, -2))) * scaling + math.log(n)
        s = torch.minimum(s + torch.matmul(q * q, k_var.transpose(-1, -2)) * (scaling * scaling / 2), bound)
    return s


def _softmax_attention(layer: LtriLayer, query, key, value, scaling, offset, n_own: int, compensate: str = "none"):
    """Explicit softmax over the layer's rows; adds each row's votes; returns out [B, Hq, T, D] and the
    chunk's own map [n_own, n_own] (its last n_own queries on its own window rows, summed over heads).
    compensate: the output also counts the stored blocks the rows leave out (LtriConfig.compensate); the votes
    and maps stay those of the rows."""
    B, Hq, T, D = query.shape
    hkv = key.shape[1]
    width = layer.width
    kp = layer.key_pos[:width]
    k, v = key[:, :, :width].float(), value[:, :, :width].float()
    own0 = width - n_own
    out = torch.empty_like(query)
    own = torch.zeros(n_own, n_own, dtype=torch.float32, device=query.device)
    left_out = _left_out(layer) if compensate in ("mean", "moment") else None
    exact = []  # compensate: exact: per query slice (lo, t, q, online-softmax state over the rows)
    for lo in range(0, T, _QUERY_SLICE):
        t = min(_QUERY_SLICE, T - lo)
        q = query[:, :, lo:lo + t].float().view(B, hkv, Hq // hkv, t, D)
        s = torch.matmul(q, k[:, :, None].transpose(-1, -2)) * scaling  # [B, Hkv, G, t, width]
        q_pos = torch.arange(offset + lo, offset + lo + t, device=query.device)[:, None]
        s = s.masked_fill(~((kp >= 0) & (kp <= q_pos)), float("-inf"))
        p = torch.softmax(s, dim=-1)
        if compensate == "exact":  # finished below, once every stored block has been merged in
            exact.append((lo, t, q, _softmax_state(s, v[:, :, None])))
        elif left_out is None:
            out[:, :, lo:lo + t] = torch.matmul(p, v[:, :, None]).view(B, Hq, t, D).to(query.dtype)
        else:  # each left-out run: its estimated log-mass, its mean value
            s_out = left_out_log_mass(q, left_out, layer.summary_tokens, scaling, compensate)
            out[:, :, lo:lo + t] = compensated(s, v[:, :, None], s_out, left_out[1]).view(B, Hq, t, D).to(query.dtype)
        heads = p.sum(dim=(0, 1, 2))  # [t, width]
        layer.votes[:width] += heads.sum(dim=0)
        first = max(lo, T - n_own)
        if first < lo + t:
            own[first - (T - n_own):lo + t - (T - n_own)] = heads[first - lo:, own0:]
    if exact:  # each stored block is loaded once for all the query slices
        states = [state for *_, state in exact]
        for k_b, v_b in _stored_batches(layer, query.device):
            states = [_softmax_add(state, torch.matmul(q, k_b.transpose(-1, -2)) * scaling, v_b)
                      for state, (_, _, q, _) in zip(states, exact)]
        for (lo, t, _, _), (_, mass, acc) in zip(exact, states):
            out[:, :, lo:lo + t] = (acc / mass).view(B, Hq, t, D).to(query.dtype)
    return out, own


def _window_attention(layer: LtriLayer, query, key, value, scaling, offset):
    """A sliding-window layer of the model: SDPA over its window rows, exact."""
    width = layer.width
    kp = layer.key_pos[:width]
    q_pos = torch.arange(offset, offset + query.shape[2], device=query.device)[:, None]
    mask = (kp >= 0) & (kp <= q_pos) & (q_pos - kp < layer.window)
    return F.scaled_dot_product_attention(query, key[:, :, :width], value[:, :, :width], attn_mask=mask,
                                          scale=scaling, enable_gqa=query.shape[1] != key.shape[1])


def _decode(layer: LtriLayer, query, key, value, scaling, cache: LtriCache):
    """One token over the layer's rows: valid ones (and, on sliding layers, inside the window)."""
    mask = layer.key_pos >= 0
    if layer.window is not None:
        mask = mask & (cache.position_on(query.device) - layer.key_pos < layer.window)
    mask = mask.view(1, 1, -1).expand(key.shape[0], key.shape[1], -1).contiguous()
    out = decode_attention(query[:, :, 0], key, value, layer.rows_t, scale=scaling, key_mask=mask)
    return out.unsqueeze(1)


def context_memory_bytes(model_config, cfg: LtriConfig, n_tokens: int, dtype_bytes: int) -> int:
    """Host bytes of the context memory for a document of n_tokens: K and V of every block past the init
    tokens, on every full-attention layer (fp8: one byte per element plus a K and a V scale per block and head)."""
    per_token_layer = Engine.memory_plan(model_config, 1, dtype_bytes) // len(layer_types(model_config))
    full = sum(t != "sliding_attention" for t in layer_types(model_config))
    blocks = context_blocks(n_tokens, cfg.n_init, cfg.block_size)
    if cfg.context_memory != "fp8":
        return full * blocks * cfg.block_size * per_token_layer
    heads = model_config.get_text_config(decoder=True).num_key_value_heads
    return full * blocks * (cfg.block_size * per_token_layer // dtype_bytes + 2 * heads * 4)


class LtriEngine(Engine):
    name = "ltri-stream"
    Config = LtriConfig

    def __init__(self, lm, config, run):
        full = [i for i, t in enumerate(layer_types(lm.model.config)) if t != "sliding_attention"]
        config = config.for_layers(full)
        super().__init__(lm, config, run)
        if config.compensate_layers is not None and not set(config.compensate_layers) <= set(full):
            raise EngineInputError(f"bad value for compensate_layers: {list(config.compensate_layers)}; expected "
                                   f"retrieving (full-attention) layers of the model: {full}")
        if config.layer_top_k is not None and not set(config.layer_top_k) <= set(full):
            raise EngineInputError(f"bad value for layer_top_k: {dict(config.layer_top_k)}; expected keys that are "
                                   f"retrieving (full-attention) layers of the model: {full}")
        heads = {}
        if config.retrieval_heads == "auto" and not lm.random_weights:
            heads = cached_heads(self.model, lm.tokenizer, lm.name, full, longctx_home())
            self.activate()
        self.indexer = Indexer(config, self.text_config, heads)

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        if longctx is None:
            raise outside_engine_error()
        layer = longctx.layers[module.layer_idx]
        if longctx.decoding:
            return _decode(layer, query, key, value, scaling, longctx), None
        offset, t = longctx.offset, query.shape[2]
        if not layer.retrieve:
            out = _window_attention(layer, query, key, value, scaling, offset)
            excess = layer.local_len - layer.window
            if excess > 0:
                layer.take_oldest(excess)
            return out.transpose(1, 2), None
        indexer = longctx.indexer
        indexer.retrieve(layer, module.layer_idx, query, key, scaling, longctx)
        n_own = min(t, layer.local_len)
        cfg = indexer.cfg
        on = cfg.compensates(module.layer_idx) and (cfg.compensate_question or not longctx.question)
        compensate = cfg.compensate if on else "none"
        out, own = _softmax_attention(layer, query, key, value, scaling, offset, n_own, compensate)
        indexer.note_spans(layer, module.layer_idx, own, offset + t - n_own, longctx)
        indexer.evict(layer, module.layer_idx, longctx)
        return out.transpose(1, 2), None

    def make_cache(self, capacity: int) -> LtriCache:
        room = self.run.chunk_size + self._reserve
        return LtriCache(self.model.config, capacity, layer_specs(self.model.config, self.config, room), self.indexer)

    def prefill(self, ids, *, reserve, progress=None) -> DocumentState:
        if self.run.chunk_size % self.config.block_size:
            raise EngineInputError(f"chunk_size {self.run.chunk_size} is not a multiple of block_size "
                                   f"{self.config.block_size}")
        self._reserve = reserve
        self._check_host_memory(ids.numel() + reserve)
        self.indexer.reset()
        state = super().prefill(ids, reserve=reserve, progress=progress)
        self.indexer.flush(state.cache)  # the last chunk's blocks, so that the counters are complete
        return state

    def _check_host_memory(self, n_tokens: int) -> None:
        """Context memory is allocated for the whole document up front (pinned on GPU machines, so it cannot be
        swapped): refuse early, with numbers and the remedy, rather than fail inside the allocator."""
        need = context_memory_bytes(self.model.config, self.config, n_tokens,
                                    next(self.model.parameters()).element_size())
        free = psutil.virtual_memory().available
        if need > 0.9 * free:
            hint = "" if self.config.context_memory == "fp8" else "--set context_memory=fp8 (half), "
            raise EngineInputError(f"ltri-stream needs {need / 2**30:.1f} GiB of CPU context memory for "
                                   f"{n_tokens:,} tokens, and the host has {free / 2**30:.1f} GiB available; use "
                                   f"{hint}a shorter document or a host with more memory")

    def _encode_question(self, state, question_ids, n_new):
        state.cache.question = True
        try:
            logits = super()._encode_question(state, question_ids, n_new)
        finally:
            state.cache.question = False
        self.indexer.flush(state.cache)  # index what the question's chunk evicted (the counters count it)
        for layer in state.cache.layers:
            if layer.local_len + n_new > layer.local_cap:
                raise ValueError(f"ltri-stream window has no room for {n_new} new tokens")
            # Decode: the token at position p goes to row p - shift, right after the window.
            layer.shift.fill_(state.position - (layer.local0 + layer.local_len))
        return logits

    @classmethod
    def memory_plan(cls, model_config, n_tokens: int, dtype_bytes: int, engine_config=None) -> int:
        """Device bytes: every layer's bounded rows (K and V; room for a 2048-token chunk and 2048 question and
        answer tokens), independent of the document's length, plus index vectors at max_vectors per block (and
        the block summaries of `compensate`)."""
        kinds = layer_types(model_config)
        full = [i for i, t in enumerate(kinds) if t != "sliding_attention"]
        cfg = (engine_config or LtriConfig()).for_layers(full)
        per_token_layer = Engine.memory_plan(model_config, 1, dtype_bytes) // len(kinds)
        rows = sum(LtriLayer.rows_for(**spec) for spec in layer_specs(model_config, cfg, 4096))
        index = len(full) * (n_tokens // cfg.block_size * cfg.max_vectors) * (per_token_layer // 2 + 8)
        # compensate: five vectors per run of summary_tokens and KV head in fp32 (LtriLayer.summaries), twice
        # over (the buffer doubles), in the layers it applies to
        per_run = 5 * per_token_layer * 4 // dtype_bytes
        runs = n_tokens // (cfg.summary_tokens or cfg.block_size)
        summarised = sum(cfg.summarises(i) for i in full)
        summaries = summarised * runs * per_run
        return rows * per_token_layer + index + summaries

    @classmethod
    def plan_notes(cls, model_config, n_tokens: int, engine_config=None) -> list[str]:
        cfg = engine_config or LtriConfig()
        full = sum(t != "sliding_attention" for t in layer_types(model_config))
        per_layer = f" ({', '.join(f'L{i}: {k}' for i, k in sorted(cfg.layer_top_k.items()))} blocks)" \
            if cfg.layer_top_k else ""
        return [f"ltri-stream device window per full layer: {cfg.n_init} init + {cfg.top_k} x {cfg.block_size} "
                f"retrieved{per_layer} + {cfg.n_local} local tokens + the chunk ({full} full layers)",
                f"ltri-stream CPU context memory: {context_memory_bytes(model_config, cfg, n_tokens, 2) / 2**30:.2f} "
                f"GiB ({'fp8' if cfg.context_memory == 'fp8' else 'bf16'}) for {n_tokens:,} tokens"]

    def kv_read_bytes(self, model_config, n_tokens: int, dtype_bytes: int) -> int:
        """A decode step reads every layer's rows (masked ones included): room for a chunk and the answer."""
        per_token_layer = Engine.memory_plan(model_config, 1, dtype_bytes) // len(layer_types(model_config))
        specs = layer_specs(model_config, self.config, self.run.chunk_size + self.run.max_new_tokens)
        return per_token_layer * sum(LtriLayer.rows_for(**spec) for spec in specs)

    def backends(self) -> dict[str, str]:
        return {"prefill_attention": "explicit softmax over init + retrieved + window (votes, span maps); "
                                     "sliding layers: sdpa over their window",
                "decode_attention": f"{decode_backend(self.device)} over the bounded rows (validity mask)"}

    def counters(self, state: DocumentState) -> dict:
        out = super().counters(state)
        out.update(self.indexer.counters(state.cache))
        return out
