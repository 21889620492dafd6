"""`star`: Star Attention. Blockwise-local context encoding with an anchor block, then global query attention.

Phase 1 (prefill): the document is cut into blocks; every block but the first is encoded after the anchor (the
document's first `anchor_size` tokens) with causal attention over [anchor | block] only, at the tokens' true
positions; the anchor's K/V are then ignored and the block's kept. The anchor's K/V are the same for every
block (it attends only to itself), so they are computed once, by the rank holding block 0, and sent to the
other ranks layer by layer while that rank is still encoding (one NCCL/gloo broadcast per layer): a rank starts
on its own block without first re-encoding the anchor.
Phase 2 (question and answer): every rank runs the model on the new tokens; in every layer each rank attends
over its own KV shard and returns (out, log-sum-exp), an all-gather brings every shard's partial result to
every rank, and each merges them by log-sum-exp (the paper's distributed softmax). Only the query rank (the
last, holding the document's end) stores the new tokens' K/V.

One process (no torch.distributed world) runs the same algorithm with the blocks one after another; its phase 2
is then exactly dense attention over the concatenated cache. A world of several ranks comes from `longctx ask
--gpus N` (local ranks) or torchrun; each rank holds a model replica.

Cache layout on a rank: slots [0, kv_start) hold the anchor (ranks > 0 only), then the rank's blocks (contiguous
positions p0 .. p1, slot = position - shift), then on the query rank the question and the answer.
"""

from engines.config import StarConfig
from engines.star.layout import StarLayout, plan_blocks

__all__ = ["StarConfig", "StarLayout", "plan_blocks"]
