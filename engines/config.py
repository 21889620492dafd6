"""Every engine's configuration, importable without torch or transformers: profiles are read and validated
before the engines load (seconds on a small machine). Each dataclass validates itself in `__post_init__` with
`require`, which names the field; an engine module takes its class from here as `Config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.validation import require, require_positions


@dataclass
class DenseConfig:
    """The dense engine has no parameters of its own."""


DESCRIPTOR_DTYPES = ("model", "int8")  # resa's block descriptors


@dataclass
class ResaConfig:
    """The paper's defaults: blocks of 16 keys, keep 10% of them (at least 16), the newest block always,
    and a dense rectification every 32 generated tokens (0 = never, the paper's plain sparse decoding). Here
    the rectification is a decode step: every 32nd feeds the 31 tokens before it again with its own, densely.

    sink_blocks (not in the paper, 0 there): always keep the first blocks too. Attention sinks (the first
    tokens) held 15-83% of the attention mass in Gemma 3 270M's global layers (measured on CPU at 3K tokens),
    and Quest's bound does not always rank them in; profiles/resa.yaml keeps 1 (see benchmarks/README.md).

    pooling: how a GQA group shares its selection. "mean" is the paper's (Quest's bound of the group's average
    query); "softmax" (NSA's group sharing) softmaxes each head's bounds over the blocks and sums them, so that
    a block one head attends to sharply is not averaged away by the group's other heads (kernels/block_select).

    centroid (ours, False in the paper): also keep each block's mean key and score a block by the average of
    Quest's bound and q . mean, a closer estimate of its logits than the bound alone (at head_dim 256 over 16
    keys the bound is loose). On CPU (4K, 4 harness samples decoded densely, every rule scored at every step)
    the blocks it kept held 89.5% of the attention mass, averaged over steps and heads (the least-served head
    of each step: 82.6%), against 87.5% (79.5%) with the bound alone and 92.2% (85.7%) for the blocks of most
    true attention. Costs a third descriptor (1/16 of K).

    descriptor_dtype: "model" keeps the descriptors in the cache's dtype (the paper's); "int8" stores each
    block's two as int8 codes of one fp32 scale per block and KV head, the max rounded up and the min down so
    that Quest's bound stays an upper bound (kernels/block_descriptors): about half the bytes the selection
    reads every step.

    select_ahead (ours, False in the paper): a decode step selects the blocks of the step after it, with its own
    query (the first decoded token's from the question's last), so that on CUDA the selection runs on a stream of
    its own beside the rest of the step instead of before this layer's sparse attention. A token's blocks then
    come from the query one position earlier; its own block (the newest) is kept as always.

    ahead_after (ours): with select_ahead, an answer's first decode steps that still select with their own query,
    before the step that selects ahead (its first steps come after the question's last tokens, where the query
    one position earlier is a formatting token's: ": " before a needle's value held 6-11 points less of dense's
    attention at the second and third steps on the embedded model, and as much as the same-step rule from the
    fourth on; benchmarks/README.md). On CUDA each form of the step is a captured graph of its own."""

    block_size: int = 16
    keep_ratio: float = 0.1
    min_blocks: int = 16
    local_blocks: int = 1
    rectify_every: int = 32
    sink_blocks: int = 0
    pooling: str = "mean"
    centroid: bool = False
    descriptor_dtype: str = "model"
    select_ahead: bool = False
    ahead_after: int = 4

    def __post_init__(self):
        require(1 <= self.block_size <= 64 and not self.block_size & (self.block_size - 1), "block_size",
                self.block_size, "a power of two in [1, 64]")
        require(0 < self.keep_ratio <= 1, "keep_ratio", self.keep_ratio, "a number in (0, 1]")
        require(self.local_blocks >= 1, "local_blocks", self.local_blocks, "an integer >= 1")
        require(self.sink_blocks >= 0, "sink_blocks", self.sink_blocks, "an integer >= 0")
        require(self.min_blocks >= self.local_blocks + self.sink_blocks, "min_blocks", self.min_blocks,
                f"an integer >= local_blocks + sink_blocks ({self.local_blocks + self.sink_blocks})")
        from kernels.block_select.reference import POOLINGS

        require(self.pooling in POOLINGS, "pooling", self.pooling, f"one of {', '.join(POOLINGS)}")
        require(self.rectify_every == 0 or self.rectify_every >= 2, "rectify_every", self.rectify_every,
                "0 (never) or an integer >= 2 (1 would re-encode every token: profile dense)")
        require(self.ahead_after >= 0, "ahead_after", self.ahead_after, "an integer >= 0")
        require(self.descriptor_dtype in DESCRIPTOR_DTYPES, "descriptor_dtype", self.descriptor_dtype,
                f"one of {', '.join(DESCRIPTOR_DTYPES)}")

    @property
    def rule(self):
        """The selection rule (kernels/block_select's KeepRule)."""
        from kernels.block_select.reference import KeepRule

        return KeepRule(self.keep_ratio, self.min_blocks, self.local_blocks, self.sink_blocks, self.pooling,
                        self.centroid)


@dataclass
class StarConfig:
    """Star Attention's parameters; the paper's default is four blocks with the anchor as large as a block."""

    block_size: int | None = None  # context tokens per block; when set it wins over `blocks`
    blocks: int = 4  # used when block_size is None: the document split into this many equal blocks
    anchor_size: int | None = None  # tokens of the anchor (the document's start); None = the block size
    # With `blocks`, fewer blocks where the document is short: each at least this long (one block = dense). The
    # paper's blocks are 16K-32K tokens; four blocks of 8K lost multi-key needles on a 0.5B model at 32K.
    min_block_size: int = 16384

    def __post_init__(self):
        require(self.min_block_size >= 1, "min_block_size", self.min_block_size, "an integer >= 1")
        require(self.block_size is None or self.block_size >= 1, "block_size", self.block_size,
                "an integer >= 1 or null")
        require(self.blocks >= 1, "blocks", self.blocks, "an integer >= 1")
        require(self.anchor_size is None or self.anchor_size >= 1, "anchor_size", self.anchor_size,
                "an integer >= 1 or null")
        require(self.anchor_size is None or self.block_size is None or self.anchor_size <= self.block_size,
                "anchor_size", self.anchor_size, f"at most block_size ({self.block_size})")


@dataclass
class SasConfig:
    """pattern: the SAS pattern text (see engines/sas/parse.py), applied on every full-attention layer."""

    pattern: str = "Rect(keys=0:32) + Diag(window=1024)"
    positions: str = "auto"  # engines/validation.py POSITIONS; re-assigned positions need a bounded cache

    def __post_init__(self):
        require_positions(self.positions)
        from engines.sas.analyzer import split
        from engines.sas.parse import parse_pattern

        try:
            split(parse_pattern(self.pattern))
        except ValueError as exc:
            raise ValueError(f"bad value for pattern: {exc}") from None


from engines.ltri.config import LtriConfig  # noqa: E402 - the registry below names every engine's configuration

CONFIGS = {"dense": DenseConfig, "resa": ResaConfig, "star": StarConfig, "sas-pattern": SasConfig,
           "ltri-stream": LtriConfig}

# Engines that re-assign RoPE positions (engines/positions.py) and so read documents past the model's context.
STREAMING = ("ltri-stream", "sas-pattern")


def reads_past_context(engine: str, config) -> bool:
    """Whether `engine` with `config` takes documents longer than the model's context (sas-pattern only with a
    bounded cache: its check refuses the others for such a document)."""
    return engine in STREAMING and getattr(config, "positions", "document") != "document"
