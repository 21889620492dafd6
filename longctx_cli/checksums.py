"""Checksums of saved-state tensors, computed where each tensor lives (longctx_cli/states.py checks every tensor
it reads back): CRC-32 in parallel pieces on the host, a position-weighted word sum on a GPU."""

from __future__ import annotations

import hashlib
import os


def tensor_checksum(t) -> str:
    """A checksum of the tensor's bytes, computed where the tensor lives: CRC-32 on the CPU; on a GPU a
    position-weighted sum of its 32-bit words (a GPU state is checked without a copy to the host). Either way a
    truncated, shifted or overwritten word changes it. States are saved and read on the same device type (part
    of their key), so both sides use the same rule."""
    return checksums({"t": t})["t"]


_CRC_PIECE = 16 << 20


def checksums(tensors: dict) -> dict[str, str]:
    """tensor_checksum of each tensor. Host tensors are cut into 16 MiB pieces whose CRC-32s run on a thread per
    core (zlib lets go of the GIL): GiBs of host memory (ltri-stream's context memory) are checked at memory
    speed rather than one core's ~2 GB/s. A tensor of several pieces is named by a hash of their CRCs."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    import torch

    out, pieces = {}, []
    for name, t in tensors.items():
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        if flat.is_cuda:
            out[name] = _device_sum(flat)
            continue
        view = memoryview(flat.numpy())
        cut = [view[i:i + _CRC_PIECE] for i in range(0, len(view), _CRC_PIECE)] or [view]
        pieces.append((name, len(view), cut))
    flat_pieces = [p for _, _, cut in pieces for p in cut]
    with ThreadPoolExecutor(max_workers=max(1, min(len(flat_pieces), os.cpu_count() or 1))) as pool:
        crcs = iter(list(pool.map(zlib.crc32, flat_pieces)))
    for name, size, cut in pieces:
        mine = [next(crcs) for _ in cut]
        digest = f"{mine[0]:08x}" if len(mine) == 1 else \
            hashlib.sha256(b"".join(c.to_bytes(4, "little") for c in mine)).hexdigest()[:16]
        out[name] = f"crc32:{digest}:{size}"
    return out


def _device_sum(flat) -> str:
    import torch

    if flat.numel() % 4:
        flat = torch.cat([flat, flat.new_zeros(4 - flat.numel() % 4)])
    words = flat.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return f"sum:{int((words * weights).sum()) & 0xFFFFFFFFFFFFFFFF:016x}:{words.numel()}"
