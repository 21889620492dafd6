"""Where evicted tokens live: CPU context memory (K/V in blocks) and the device-side index memory.

Context memory is host RAM, pinned when the model is on a GPU so a kernel reads retrieved blocks from it
directly; one slab per layer, sized for the document (doubling if it ever runs out). The index memory holds the span index
vectors (keys of the chosen tokens, every KV head) and the block each belongs to; it stays on the compute
device, as in the paper, and is the only device-side state that grows with the document (a few percent of
its keys).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kernels import cdiv
from kernels.gather_blocks import gather_blocks
from kernels.index_scores import index_scores


_PINNING: ThreadPoolExecutor | None = None


def _pinning() -> ThreadPoolExecutor:
    """Threads that allocate pinned slabs: a slab is first written when its layer first evicts, a window's worth of
    tokens into the document, so its allocation runs beside the prefill's first chunks.

    How: cudaHostAlloc (PyTorch's default for pinned memory) pins at ~1.9 GB/s on an H200 machine (sampled: ~7 s of
    a 128K prefill of an 8B model, for its 16 GiB) and holds the driver while it does, halving another thread's
    launch rate; touching ordinary pages (16 GB/s, several threads, no driver) and then registering them
    (cudaHostRegister, 16 GB/s) is PyTorch's other pinned allocator, asked for here unless PYTORCH_CUDA_ALLOC_CONF
    says otherwise."""
    global _PINNING
    if _PINNING is None:
        if "pinned_use_cuda_host_register" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            threads = max(1, min(8, os.cpu_count() or 1))
            settings = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
            setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
            if setter is None:  # PyTorch before the accelerator-wide allocator settings
                setter = torch.cuda.memory._set_allocator_settings
            setter(settings)
        _PINNING = ThreadPoolExecutor(max_workers=4, thread_name_prefix="longctx-pin")
    return _PINNING


class _Growable:
    """A [capacity, *shape] tensor that doubles when full, never past `limit` rows (None: no limit); `n` rows
    are in use. A pinned one is allocated by a background thread and waited for at first use (`data`)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, pin: bool, capacity: int = 16,
                 limit: int | None = None):
        self.shape, self.dtype, self.device, self.pin, self.limit = shape, dtype, device, pin, limit
        rows = capacity if limit is None else min(capacity, limit)
        self._data: torch.Tensor | Future = _pinning().submit(self._alloc, rows) if pin else self._alloc(rows)
        self.n = 0

    @property
    def data(self) -> torch.Tensor:
        if isinstance(self._data, Future):
            self._data = self._data.result()  # raises the allocation's own error (out of host memory) here
        return self._data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._data = value

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, *self.shape), dtype=self.dtype, device=self.device, pin_memory=self.pin)

    def reserve(self, extra: int) -> None:
        if self.n + extra > self.data.shape[0]:
            if self.pin:
                # The host copy below is not stream-ordered: earlier async device -> host copies must land, and
                # kernels still reading the old slab (gather_blocks) must finish before it is freed.
                torch.cuda.synchronize()
            rows = max(2 * self.data.shape[0], self.n + extra)
            bigger = self._alloc(rows if self.limit is None else max(min(rows, self.limit), self.n + extra))
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


def context_blocks(n_tokens: int, n_init: int, block: int) -> int:
    """Blocks of context memory a document of n_tokens can fill (the tokens past the init ones)."""
    return max(1, cdiv(n_tokens - n_init, block))


class ContextMemory:
    """Evicted blocks of one layer: keys/values [n_blocks, Hkv, block, D] in host memory.

    fp8: stored as float8 e4m3 with one scale per (block, KV head) (amax / 448), half the host memory of
    bf16 (1M tokens of an 8B model: 64 GiB instead of 128); blocks are scaled back on the device as they load.
    """

    FP8_MAX = 448.0  # largest finite float8_e4m3fn

    def __init__(self, heads: int, block: int, dim: int, dtype: torch.dtype, pin: bool, blocks: int = 16,
                 fp8: bool = False):
        """blocks: the expected number of blocks (the slabs grow past it if needed)."""
        self.fp8 = fp8
        store = torch.float8_e4m3fn if fp8 else dtype
        cpu = torch.device("cpu")
        self.keys = _Growable((heads, block, dim), store, cpu, pin, blocks)
        self.values = _Growable((heads, block, dim), store, cpu, pin, blocks)
        if fp8:
            self.scales = _Growable((2, heads), torch.float32, cpu, pin, blocks)  # [n, K/V, Hkv]

        self.base: tuple[torch.Tensor, ...] = ()  # blocks read back from a saved state (adopt)

    @property
    def n_base(self) -> int:
        return self.base[0].shape[0] if self.base else 0

    @property
    def n_blocks(self) -> int:
        return self.n_base + self.keys.n

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Blocks 0.. from a saved state, kept as they were read (no copy into the pinned slabs, which stay for
        blocks added later): [n, Hkv, block, D] each, scales [n, 2, Hkv] when fp8."""
        self.base = (keys, values) + ((scales,) if self.fp8 else ())
        for slab in self.slabs():
            slab.n = 0

    def slabs(self) -> list["_Growable"]:
        """The append-only slabs (blocks after the adopted ones): keys, values and (fp8) scales."""
        return [self.keys, self.values] + ([self.scales] if self.fp8 else [])

    def stored(self) -> list[torch.Tensor]:
        """Every stored block as tensors (keys, values, (fp8) scales), adopted ones first."""
        if not self.base:
            return [slab.used for slab in self.slabs()]
        return [torch.cat([b, slab.used]) if slab.n else b for b, slab in zip(self.base, self.slabs())]

    def _block(self, i: int, block_id: int) -> torch.Tensor:
        """Block block_id of tensor i (0 keys, 1 values, 2 scales)."""
        if block_id < self.n_base:
            return self.base[i][block_id]
        return self.slabs()[i].data[block_id - self.n_base]

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """keys/values: [Hkv, n * block, D] on the device, n whole blocks in position order. Returns the bytes
        copied to the host."""
        heads, _, dim = keys.shape
        block = self.keys.shape[1]
        k = keys.view(heads, -1, block, dim).transpose(0, 1)
        v = values.view(heads, -1, block, dim).transpose(0, 1)
        if self.fp8:
            # Quantised on the device (where the blocks are), so only fp8 bytes cross to the host.
            scale = torch.stack([t.abs().amax(dim=(2, 3)).float() for t in (k, v)], dim=1)  # [n, 2, Hkv]
            scale = (scale / self.FP8_MAX).clamp(min=1e-12)
            k = (k.float() / scale[:, 0, :, None, None]).to(torch.float8_e4m3fn)
            v = (v.float() / scale[:, 1, :, None, None]).to(torch.float8_e4m3fn)
            self.scales.append(scale)
        self.keys.append(k)
        self.values.append(v)
        return k.shape[0] * self.block_bytes

    def load(self, block_id: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Copies block `block_id` into keys/values [Hkv, block, D] (device rows); returns the bytes moved."""
        k, v = self._block(0, block_id), self._block(1, block_id)
        if not self.fp8:
            keys.copy_(k, non_blocking=True)
            values.copy_(v, non_blocking=True)
            return self.block_bytes
        scale = self._block(2, block_id).to(keys.device, non_blocking=True)  # [2, Hkv]
        for dst, src, s in ((keys, k, scale[0]), (values, v, scale[1])):
            dst.copy_(src.to(keys.device, non_blocking=True).float() * s[:, None, None])
        return self.block_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes one block's load moves host -> device: its K and V (and fp8 scales)."""
        heads, block, dim = self.keys.shape
        return 2 * heads * block * dim * self.keys.dtype.itemsize + (2 * heads * 4 if self.fp8 else 0)

    def gather(self, keys: torch.Tensor, values: torch.Tensor, load: torch.Tensor | list[int]) -> None:
        """Block load[s] into slot s of keys/values [Hkv, S * block, D] (device rows), for every load[s] >= 0 (load:
        [S] int64 on the rows' device, or a host list). One kernel reads the pinned slabs; blocks adopted from a
        saved state (pageable host memory) load one by one, after the ids come to the host."""
        if self.base:
            block = self.keys.shape[1]
            for s, b in enumerate(load.tolist() if isinstance(load, torch.Tensor) else load):
                if b >= 0:
                    self.load(b, keys[:, s * block:(s + 1) * block], values[:, s * block:(s + 1) * block])
            return
        ids = load
        if not isinstance(load, torch.Tensor):
            ids = torch.tensor(load, dtype=torch.long).to(keys.device, non_blocking=True)
        gather_blocks(keys, values, self.keys.used, self.values.used, ids, self.scales.used if self.fp8 else None)

    def nbytes(self) -> int:
        return sum(slab.nbytes() for slab in self.slabs()) + sum(t.nbytes for t in self.base)


class IndexMemory:
    """Index vectors of one layer: vectors [N, Hkv, D] and block [N] on the compute device; at most `limit`
    of them (a document's blocks times max_vectors: what the memory plan counts). An entry of block -1 holds no
    vector (a picking slot that found no row): entries are added without the host learning how many were picked,
    and the scores skip those."""

    def __init__(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device, limit: int):
        self.vectors = _Growable((heads, dim), dtype, device, False, capacity=256, limit=limit)
        self.block = _Growable((), torch.long, device, False, capacity=256, limit=limit)
        self.offset = _Growable((), torch.long, device, False, capacity=256, limit=limit)  # token in its block

    @property
    def n(self) -> int:
        """Entries, those of block -1 included."""
        return self.vectors.n

    def count(self) -> int:
        """Index vectors held (entries of a block): one wait, where counters are read."""
        return int((self.block.used >= 0).sum()) if self.n else 0

    def add(self, vectors: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        self.vectors.append(vectors)
        self.block.append(blocks)
        self.offset.append(offsets)

    def block_scores(self, query: torch.Tensor, n_blocks: int,
                     chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """query: [A, Hkv, D] head-weighted query vectors, of which those where chosen [A] (bool) is set take
        part (None: all) -> [n_blocks] best dot product of any vector of the block with any query vector (blocks
        without vectors: -inf), and [n_blocks] the offset in its block of the vector that scored it (-1: none); one
        kernel on CUDA (kernels/index_scores)."""
        return index_scores(query, self.vectors.used, self.block.used, self.offset.used, n_blocks, chosen)

    def nbytes(self) -> int:
        return self.vectors.nbytes() + self.block.nbytes() + self.offset.nbytes()
