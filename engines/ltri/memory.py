"""Where evicted tokens live: CPU context memory (K/V in blocks) and the device-side index memory.

Context memory is host RAM, pinned when the model is on a GPU so block loads are plain async copies; one
slab per layer, sized for the document (doubling if it ever runs out). The index memory holds the span index vectors (keys of the chosen
tokens, every KV head) and the block each belongs to; it stays on the compute device, as in the paper, and is
the only device-side state that grows with the document (a few percent of its keys).
"""

from __future__ import annotations

import torch


class _Growable:
    """A [capacity, *shape] tensor that doubles when full; `n` rows are in use."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, pin: bool, capacity: int = 16):
        self.shape, self.dtype, self.device, self.pin = shape, dtype, device, pin
        self.data = self._alloc(capacity)
        self.n = 0

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, *self.shape), dtype=self.dtype, device=self.device, pin_memory=self.pin)

    def reserve(self, extra: int) -> None:
        if self.n + extra > self.data.shape[0]:
            if self.pin:
                # The host copy below is not stream-ordered: earlier async device -> host copies must land.
                torch.cuda.synchronize()
            bigger = self._alloc(max(2 * self.data.shape[0], self.n + extra))
            bigger[: self.n].copy_(self.data[: self.n])
            self.data = bigger

    def append(self, rows: torch.Tensor) -> None:
        self.reserve(rows.shape[0])
        self.data[self.n:self.n + rows.shape[0]].copy_(rows, non_blocking=True)
        self.n += rows.shape[0]

    @property
    def used(self) -> torch.Tensor:
        return self.data[: self.n]

    def nbytes(self) -> int:
        return self.data.nbytes


class ContextMemory:
    """Evicted blocks of one layer: keys/values [n_blocks, Hkv, block, D] in host memory."""

    def __init__(self, heads: int, block: int, dim: int, dtype: torch.dtype, pin: bool, blocks: int = 16):
        """blocks: the expected number of blocks (the slabs grow past it if needed)."""
        self.keys = _Growable((heads, block, dim), dtype, torch.device("cpu"), pin, blocks)
        self.values = _Growable((heads, block, dim), dtype, torch.device("cpu"), pin, blocks)

    @property
    def n_blocks(self) -> int:
        return self.keys.n

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values: [Hkv, n * block, D] on the device, n whole blocks in position order."""
        heads, _, dim = keys.shape
        block = self.keys.shape[1]
        self.keys.append(keys.view(heads, -1, block, dim).transpose(0, 1))
        self.values.append(values.view(heads, -1, block, dim).transpose(0, 1))

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes()


class IndexMemory:
    """Index vectors of one layer: vectors [N, Hkv, D] and block [N] on the compute device."""

    def __init__(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.vectors = _Growable((heads, dim), dtype, device, False, capacity=256)
        self.block = _Growable((), torch.long, device, False, capacity=256)

    @property
    def n(self) -> int:
        return self.vectors.n

    def add(self, vectors: torch.Tensor, blocks: torch.Tensor) -> None:
        self.vectors.append(vectors)
        self.block.append(blocks)

    def block_scores(self, query: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """query: [A, Hkv, D] head-weighted query vectors -> [n_blocks] best dot product of any vector of the
        block with any query vector (blocks without vectors: -inf)."""
        sims = torch.einsum("akd,nkd->an", query.float(), self.vectors.used.float()).amax(dim=0)
        out = torch.full((n_blocks,), float("-inf"), dtype=torch.float32, device=sims.device)
        return out.scatter_reduce(0, self.block.used, sims, reduce="amax")

    def nbytes(self) -> int:
        return self.vectors.nbytes() + self.block.nbytes()
