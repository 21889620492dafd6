"""A preallocated (static) KV cache that plugs into transformers through its public Cache API.

Every layer owns `[B, Hkv, capacity, D]` key and value buffers (views of seq-major storage), allocated on the
layer's own device the first time it writes (so accelerate's device_map across GPUs needs nothing special).
Where a token goes is decided by the cache, not by transformers:
- prefill: the engine calls `begin_chunk(offset)`; the chunk's K/V land at `[offset, offset + T)` (host ints);
- decode: the engine calls `begin_decode(pos, length)` with device tensors; K/V land at `pos` via
  one launch (kernels/kv_append, two `index_copy_` calls on CPU), so a decode step has static shapes and never reads a position on the host (CUDA-graph safe).
The attention function receives the cache as the `longctx` keyword and reads `offset` / `length` from it.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kernels.kv_append import append_kv


def layer_types(config) -> list[str]:
    """Per decoder layer, "full_attention" or "sliding_attention" (models without the field: all full)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers


def full_layers(config) -> list[int]:
    """Indices of the layers that attend to the whole sequence (those engines approximate)."""
    return [i for i, t in enumerate(layer_types(config)) if t != "sliding_attention"]


def head_dim(config) -> int:
    text = config.get_text_config(decoder=True)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def kv_token_bytes(config, dtype_bytes: int) -> int:
    """K and V bytes of one token in one layer."""
    return 2 * config.get_text_config(decoder=True).num_key_value_heads * head_dim(config) * dtype_bytes


def seq_major_buffer(batch: int, capacity: int, heads: int, dim: int, dtype, device) -> torch.Tensor:
    """Zeros stored [B, capacity, H, D], returned as the [B, H, capacity, D] view every kernel takes."""
    return torch.zeros(batch, capacity, heads, dim, dtype=dtype, device=device).transpose(1, 2)


class OwnedLayer(CacheLayerMixin):
    """A cache layer that reads its cache's shared state through `owner`. The cache holds its layers, so the
    layer holds the cache weakly: a strong reference back would make each document's cache a cycle, its K/V freed
    only when Python's cyclic collector next runs, after the next document may already have needed the memory."""

    @property
    def owner(self):
        return self._owner()

    @owner.setter
    def owner(self, cache) -> None:
        self._owner = weakref.ref(cache)


class StaticKVLayer(OwnedLayer):
    is_compileable = True

    def __init__(self, owner: "StaticKVCache", capacity: int, sliding_window: int | None):
        super().__init__()
        self.owner = owner
        self.capacity = capacity
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        # Zeros, not empty: positions past the valid length are masked, but 0 * NaN would still poison
        # kernels that multiply masked probabilities with whole V tiles. Stored seq-major [B, capacity, Hkv, D]
        # and handed out as [B, Hkv, capacity, D] views: no stride but the batch's depends on the capacity, so
        # cuDNN's prefill plans (keyed by strides) serve every document length, not just one capacity
        # (benchmarks/cudnn_plan_reuse.py on an H100: 3-4 s of plan builds per new capacity at 128K in the
        # head-major layout).
        self.keys = seq_major_buffer(batch, self.capacity, heads, k_dim, self.dtype, self.device)
        self.values = seq_major_buffer(batch, self.capacity, heads, value_states.shape[-1], self.dtype,
                                       self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states: [B, Hkv, T, D]; returns the whole buffers [B, Hkv, capacity, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        if owner.decoding:
            append_kv(self.keys, self.values, key_states, value_states, owner.position_on(self.device))
        else:
            end = owner.offset + key_states.shape[2]
            if end > self.capacity:
                raise ValueError(f"KV cache of {self.capacity} tokens cannot take position {end - 1}")
            self.keys[:, :, owner.offset:end] = key_states
            self.values[:, :, owner.offset:end] = value_states
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_seq_length(self) -> int:
        return self.owner.filled

    def get_max_length(self) -> int:
        return self.capacity

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes


class OwnedRowsLayer(OwnedLayer):
    """Base of an engine's own cache layer with `rows` buffer rows, owned by a StaticKVCache (the sizes
    transformers asks for; the engine's attention builds its own masks)."""

    is_compileable = False
    rows: int

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows, 0

    def get_seq_length(self) -> int:
        return self.owner.filled

    def get_max_length(self) -> int:
        return self.owner.capacity


class StaticKVCache(Cache):
    """One StaticKVLayer per decoder layer; sliding-window layers keep their window for the attention."""

    layer_class = StaticKVLayer

    def __init__(self, config, capacity: int, layers: list | None = None):
        """layers: an engine's own cache layers (default: one `layer_class` per decoder layer)."""
        if layers is None:
            window = getattr(config.get_text_config(decoder=True), "sliding_window", None)
            layers = [self.layer_class(self, capacity, window if t == "sliding_attention" else None)
                      for t in layer_types(config)]
        super().__init__(layers=layers)
        self.capacity = capacity
        self.offset = 0  # prefill: first position of the chunk in flight
        self.filled = 0  # host view of how many positions hold real K/V (prefill only)
        self.decoding = False
        self.compile_windows = True  # FlexAttention for windowed layers (Engine.prefill decides per document)
        self.prefill_graphs = False  # the prefill replayed the layers' norms and MLPs as CUDA graphs
        self.positions = None  # engines/positions.py Positions where RoPE positions are re-assigned
        self._position: dict[torch.device, torch.Tensor] = {}
        self._length: dict[torch.device, torch.Tensor] = {}
        self.decode_variant = None  # of decode_variants(), set by the decode step
        # Devices whose layers replay captured graphs of their own (a model split over GPUs, engines/segments.py):
        # their copies of the step's position and length persist and are refreshed in place by begin_decode.
        self.mirrored: list[torch.device] = []
        self._mirrors: dict[tuple, torch.Tensor] = {}

    def begin_chunk(self, offset: int, n: int) -> None:
        if offset + n > self.capacity:
            raise ValueError(f"chunk [{offset}, {offset + n}) does not fit a KV cache of {self.capacity} tokens")
        self.decoding, self.offset, self.filled = False, offset, offset + n

    def begin_decode(self, position: torch.Tensor, length: torch.Tensor) -> None:
        """position: [1] int64, where the new token's K/V go; length: [1] int64 = position + 1 (device)."""
        self.decoding = True
        self._position = self._mirrored("position", position)
        self._length = self._mirrored("length", length)

    def end_decode(self) -> None:
        """The end of a decode step (inside a captured one): an engine joins here what it left on side streams."""

    def step_outputs(self, start: int, n: int) -> list[torch.Tensor]:
        """Tensors (or views) a decode step writing K/V at slots start .. start + n - 1 changes besides the K/V, for
        the next one or for what it reads (a capture's warm-up puts them back)."""
        return []

    def decode_variants(self) -> tuple:
        """The forms a decode step takes in an answer (one captured graph each), the one in force read from
        `decode_variant` while the step runs or is captured; `variant_for` says which the answer's step-th step
        (0-based) takes."""
        return (None,)

    def variant_for(self, step: int):
        return None

    def decode_width(self, variant) -> int:
        """Tokens a step of this form feeds: 1, or w > 1 for a form that feeds the w - 1 before its own again."""
        return 1

    def _mirrored(self, name: str, source: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        table = {source.device: source}
        for device in self.mirrored:
            key = (name, device, tuple(source.shape))
            if key not in self._mirrors:
                self._mirrors[key] = torch.empty_like(source, device=device)
            table[device] = self._mirrors[key].copy_(source, non_blocking=True)
        return table

    def _on(self, table: dict, device: torch.device) -> torch.Tensor:
        # Layers spread over several GPUs read their own copy (made once per step, no host sync).
        if device not in table:
            table[device] = next(iter(table.values())).to(device, non_blocking=True)
        return table[device]

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [1, T] in the document -> the positions the model rotates queries and keys at."""
        if self.positions is None:
            return positions
        return self.positions.model_positions(positions, None if self.decoding else self.filled - 1)

    def kept_keys(self, key_states: torch.Tensor, sliding: bool) -> torch.Tensor:
        """key_states [B, Hkv, T, D] being written now, as a layer keeps them: un-rotated where positions are
        re-assigned (the rotation the model gave them undone), else as given."""
        positions = self.positions
        if positions is None:
            return key_states
        device = key_states.device
        if self.decoding:
            return positions.unrotate(key_states, self.position_on(device) - positions.shift_on(device), sliding)
        end = self.offset + key_states.shape[2] - positions.shift
        return positions.unrotate(key_states, torch.arange(end - key_states.shape[2], end, device=device), sliding,
                                  below=end)

    def position_on(self, device: torch.device) -> torch.Tensor:
        return self._on(self._position, device)

    def length_on(self, device: torch.device) -> torch.Tensor:
        return self._on(self._length, device)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
