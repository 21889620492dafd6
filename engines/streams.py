"""The engines' side streams: one a device and purpose, kept for the life of the process.

Work moved off the current stream (a capture's warm-up run, a capture, the K/V write beside resa's selection)
needs a stream of its own, and libraries keep state for every stream they have run on until the process ends:
cuBLAS allocates a workspace (32 MiB by default on Hopper) for each stream it runs a product on. A new stream
for every capture would keep that much GPU memory for every document read (a decode graph per document; resa adds
its rectification's): a folder or a benchmark of many documents would grow by 32-64 MiB a document. One stream a
purpose bounds that to one workspace each.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The process's stream for `purpose` ("capture", "chunk-capture", "kv-write", ...) on CUDA `device`."""
    return torch.cuda.Stream(device)
