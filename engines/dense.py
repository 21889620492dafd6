"""`dense`: exact attention. Chunked prefill into the static cache, graph-captured decode.

Prefill attention on GPU: cuDNN attention (prefix + diagonal merged by log-sum-exp) for full layers, FlexAttention
with a causal+window block mask for sliding-window layers; on CPU SDPA with an explicit mask. Decode attention: a split-KV Triton kernel that takes the valid
length as a device tensor on GPU (static shapes, reads only the valid prefix); on CPU SDPA over the keys each new
token sees (fp32; the PyTorch reference otherwise).
"""

from __future__ import annotations

import torch

from engines.base import Engine, exact_attention
from engines.config import DenseConfig
from kernels.chunk_attention import chunk_attention_backend
from kernels.decode_attention import decode_backend


class DenseEngine(Engine):
    name = "dense"
    Config = DenseConfig
    reusable = True

    @staticmethod
    def attention(module, query, key, value, attention_mask, scaling=None, sliding_window=None, longctx=None,
                  **kwargs):
        return exact_attention(query, key, value, scaling, sliding_window, longctx), None

    def backends(self) -> dict[str, str]:
        one_token = self.model.dtype == torch.float32  # the CPU's SDPA path takes fp32 queries only
        return {"prefill_attention": chunk_attention_backend(self.device, self.has_sliding_layers, self.head_dim),
                "decode_attention": decode_backend(self.device, one_token=one_token)}
