"""`ltri-stream`'s configuration: the paper's values (section 4, appendix B) where it gives them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from engines.validation import require, require_positions


@dataclass
class LtriConfig:
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
    # Ours, "none" by default: "exact" makes the document's prefill attention in retrieving layers also attend
    # the stored blocks the rows leave out, loaded from context memory a slot-sized batch at a time and merged
    # by log-sum-exp, instead of renormalising over the rows it holds (the K/V drift that costs multi-key
    # needles at 16K). The device rows stay bounded (one batch more, transiently); the layer's whole context
    # memory is read once per chunk (O(n^2 / chunk) copies), so it suits a few layers and documents up to ~32K.
    compensate: str = "none"
    # Layers `compensate` applies to (null: every retrieving layer). The drift enters through the first
    # retrieving layer, whose inputs are still exact. "first": the model's first retrieving layer (5 in the
    # embedded model, 0 in Llama's).
    compensate_layers: list[int] | str | None = None
    # Compensate the question's chunk too (its retrieval is the one decoding keeps).
    compensate_question: bool = False
    # Which retrieval-head layers a layer's question retrieval counts (section 3.5's voting): "earlier" (the
    # paper: those before it in the same chunk) or "all" (ours: the question is read twice, and the second time
    # every layer counts the first reading's votes of every retrieval-head layer, later ones included). Lower
    # layers run before the layers that find the needles: on Qwen2.5-Coder-0.5B at 32K, layers 0-10 retrieved
    # none of a sample's four needle blocks while layers 11-23 held all four, and decoding answered one or
    # three values of four where every layer holding them answered all four.
    question_votes: str = "earlier"
    # Ours, off by default: each decode step also attends one summary row per stored block the rows leave out,
    # the block's mean key and mean value with a logit bias of log(block_size) (exp of the mean logit times the
    # count: Jensen's lower bound of the block's attention mass), merged with the rows' attention by
    # log-sum-exp. With an exact prefill, decoding over the rows alone still changes digits of copied needles
    # (Qwen2.5-Coder-0.5B at 32K, benchmarks/ltri_decode_study.py): the rows hold every needle but not the
    # attention mass the rest of the document takes. Costs one device row per stored block and layer
    # (documents up to ~32K tokens); refused past the model's context (the summaries have no positions there).
    decode_summaries: bool = False
    # RoPE positions (engines/validation.py POSITIONS): "auto" re-assigns them within the device rows for
    # documents longer than the model's context (InfLLM), "cache" always, "document" never.
    positions: str = "auto"

    def __post_init__(self):
        for name in ("n_local", "block_size", "top_k", "repr_topk", "min_vectors", "max_vectors"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        require(self.n_init >= 0, "n_init", self.n_init, "an integer >= 0")
        for name, allowed in (("index", ("dynamic", "static")), ("pick", ("votes", "cover")),
                              ("ratio_mode", ("row", "col", "rowcol")), ("retrieval_heads", ("auto", "none")),
                              ("context_memory", ("model", "fp8")), ("compensate", ("none", "exact")),
                              ("question_votes", ("earlier", "all"))):
            require(getattr(self, name) in allowed, name, getattr(self, name), " or ".join(allowed))
        require(0.0 < self.threshold < 1.0, "threshold", self.threshold, "a quantile in (0, 1)")
        require(0.0 < self.iou < 1.0, "iou", self.iou, "a number in (0, 1)")
        require(self.lam > 0, "lam", self.lam, "a number > 0")
        require(self.lam_first_layers > 0, "lam_first_layers", self.lam_first_layers, "a number > 0")
        require(self.max_vectors >= self.min_vectors, "max_vectors", self.max_vectors,
                f"an integer >= min_vectors ({self.min_vectors})")
        for name in ("n_init", "n_local"):
            require(getattr(self, name) % self.block_size == 0, name, getattr(self, name),
                    f"a multiple of block_size ({self.block_size})")
        require(0 <= self.successor_tail <= self.block_size, "successor_tail", self.successor_tail,
                f"0 to block_size ({self.block_size})")
        require(self.compression is None or self.compression >= 1, "compression", self.compression,
                "null or a number >= 1")
        layers = self.compensate_layers
        require(layers is None or layers == "first" or isinstance(layers, (list, tuple))
                and all(type(i) is int and i >= 0 for i in layers), "compensate_layers", layers,
                "null, first or a list of layer indices (integers >= 0)")
        require_positions(self.positions)
        for name in ("compensate_question", "decode_summaries"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")

    def vectors_per_block(self) -> int:
        """The most index vectors a stored block gets."""
        return self.max_vectors if self.index == "dynamic" else self.repr_topk

    def for_layers(self, full: list[int]) -> LtriConfig:
        """This config with compensate_layers "first" resolved against the model's retrieving layers `full`."""
        if self.compensate_layers == "first":
            return replace(self, compensate_layers=full[:1])
        return self

    def compensates(self, layer_idx: int) -> bool:
        """Whether `compensate` applies to this layer (see for_layers)."""
        if isinstance(self.compensate_layers, str):
            raise ValueError(f"compensate_layers {self.compensate_layers!r} is resolved by for_layers first")
        return self.compensate != "none" and (self.compensate_layers is None or layer_idx in self.compensate_layers)
