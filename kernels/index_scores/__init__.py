"""index_scores: ltri-stream's block scores from its span index vectors (the best match of any index vector of a
block with any query vector of the chunk, and which token of the block it was).

`index_scores(...)` runs the Triton kernel on CUDA (three launches whatever the index's size, where the reference
takes about a dozen small operations) or the reference elsewhere.
"""

from __future__ import annotations

import functools

import torch

from kernels.index_scores.reference import index_scores_reference

__all__ = ["index_scores", "index_scores_reference"]


@functools.cache
def _triton_impl():
    # Imported lazily: CPU machines may have no Triton at all.
    try:
        from kernels.index_scores.triton import index_scores_triton
    except ImportError:
        return None
    return index_scores_triton


def index_scores(query: torch.Tensor, vectors: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
                 n_blocks: int, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [A, Hkv, D], vectors [N, Hkv, D], block and offset [N], chosen [A] bool or None -> scores
    [n_blocks] fp32 and where [n_blocks] int64; see reference.index_scores_reference."""
    impl = _triton_impl() if vectors.is_cuda else None
    return (impl or index_scores_reference)(query, vectors, block, offset, n_blocks, chosen)
