"""Positions re-assigned within what attention sees, so that streaming engines read past the model's context.

A model is trained on positions below its context length (`max_position_embeddings`). Streaming engines keep a
bounded set of keys, so, as InfLLM and StreamingLLM do, they need not use the document's offsets: a token's
query and key are rotated at a position inside a bounded range, chosen so that the distances attention relies on
stay as they were (the recent window keeps its true distances) and nothing older sits farther than the range.

The model itself rotates queries and keys (RoPE) at the `position_ids` it is given; the engine gives it the
document position minus `shift` (the cache's, one value per forward). Keys are kept un-rotated (the rotation is
undone as they are written, `unrotate`), and the engine rotates the rows it attends at the positions it assigns
them (`rotate`), so a key's position may change as the window moves without rounding errors piling up.

Only rotary models whose rotation is the `rotate_half` form (Llama, Qwen2/3, Mistral, Gemma 3) qualify: the
rotation is taken from the model's own rotary module, so RoPE scaling (linear, llama3, YaRN) is honoured.
"""

from __future__ import annotations

import copy
import inspect

import torch

from kernels.rotary import rotate_half, rotate_rows


def rotary_module(model):
    """The model's rotary embedding module, or None where positions cannot be re-assigned."""
    try:
        decoder = model.get_decoder()
    except AttributeError:
        return None
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or getattr(model.config.get_text_config(decoder=True), "partial_rotary_factor", 1.0) != 1.0:
        return None
    return rotary


def context_limit(model_config) -> int:
    """The model's trained context (`max_position_embeddings`); 0 where the config does not say."""
    return int(getattr(model_config.get_text_config(decoder=True), "max_position_embeddings", 0) or 0)


def reassigns(mode: str, n_tokens: int, limit: int) -> bool:
    """Whether a document of n_tokens (question and answer included) runs on re-assigned positions: `auto` when
    it is longer than the model's context (limit; 0 = unknown), `cache` always, `document` never."""
    return mode == "cache" or (mode == "auto" and bool(limit) and n_tokens > limit)


class Positions:
    """A cache's position map: model position = document position - shift; the rotation of its keys.

    shift is a host integer for prefill and a device tensor per device for decode steps (read inside the
    captured graph, so a restored state's shift needs no new capture).
    """

    def __init__(self, rotary, limit: int):
        self.rotary, self.limit = rotary, limit
        # accelerate's hook (a model split over devices) wraps forward as (*args, **kwargs): read the module's own.
        forward = getattr(rotary, "_old_forward", rotary.forward)
        self._typed = "layer_type" in inspect.signature(forward).parameters
        self._rotaries: dict[torch.device, torch.nn.Module] = {}
        self.shift = 0
        self._shift: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (device, sliding) -> cos, sin [n, D]
        self.largest = -1  # the largest position given to the model, for the report

    def set_shift(self, shift: int) -> None:
        self.shift = int(shift)
        for t in self._shift.values():
            t.fill_(self.shift)

    def shift_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._shift:
            self._shift[device] = torch.full((1,), self.shift, dtype=torch.long, device=device)
        return self._shift[device]

    def model_positions(self, positions: torch.Tensor, last: int | None) -> torch.Tensor:
        """positions [1, T] (document) -> [1, T] the positions the model rotates at. A prefill chunk gives its
        last document position `last` (a host integer, so the check needs no device sync); decode steps (None)
        read the shift on the device and are bounded by the room the engine reserved."""
        if last is None:
            return positions - self.shift_on(positions.device)
        top = last - self.shift
        if self.limit and top >= self.limit:
            raise ValueError(f"re-assigned position {top} is past the model's context of {self.limit}")
        self.largest = max(self.largest, top)
        return positions - self.shift

    def note(self, position: int) -> None:
        """A decode step fed the token at document `position` (for the report's largest position)."""
        self.largest = max(self.largest, position - self.shift)

    def cos_sin(self, positions: torch.Tensor, sliding: bool,
                below: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] (any device) -> cos, sin [..., D] in fp32, the model's own rotation at them. below: a
        bound the caller knows on the host (every position < below), so the rotation can be looked up in a
        table made once (the rotary module costs about ten launches a call, and prefill rotates every layer's
        rows at every chunk)."""
        if below is not None:
            cos, sin = self._table(positions.device, sliding, below)
            # Empty rows carry negative positions; whatever they are rotated at, attention never reads them.
            at = positions.clamp(0, cos.shape[0] - 1)
            return cos[at], sin[at]
        return self._computed(positions, sliding)

    def _table(self, device: torch.device, sliding: bool, below: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] of positions 0..n-1 (n >= below, grown by doubling up to the model's context): the same
        fp32 values as the rotary module gives position by position (its products are elementwise)."""
        table = self._tables.get((device, sliding))
        if table is None or table[0].shape[0] < below:
            grown = 2 * table[0].shape[0] if table is not None else 1024
            n = max(below, min(grown, self.limit) if self.limit else grown)  # never past the model's context
            table = self._tables[device, sliding] = self._computed(torch.arange(n, device=device), sliding)
        return table

    def _computed(self, positions: torch.Tensor, sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.empty(0, dtype=torch.float32, device=positions.device)
        flat = positions.reshape(1, -1)
        args = (x, flat, "sliding_attention" if sliding else "full_attention") if self._typed else (x, flat)
        cos, sin = self._rotary_on(positions.device)(*args)
        shape = (*positions.shape, cos.shape[-1])
        return cos.reshape(shape), sin.reshape(shape)

    def _rotary_on(self, device: torch.device) -> torch.nn.Module:
        """The rotary module on `device`: layers split over several devices each rotate with a copy of their own
        (a few KB of frequencies), so no rotation crosses devices at every step."""
        if device not in self._rotaries:
            rotary = self.rotary
            home = next(rotary.buffers(), torch.empty(0)).device
            if home != device:
                from accelerate.hooks import remove_hook_from_module

                rotary = remove_hook_from_module(copy.deepcopy(rotary)).to(device)
            self._rotaries[device] = rotary
        return self._rotaries[device]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, sliding: bool,
               below: int | None = None) -> torch.Tensor:
        """x: [B, H, R, D] un-rotated keys -> rotated at positions ([R] or [B, H, R]; all < below where given),
        in x's dtype."""
        if below is not None and positions.dim() == 1:
            return rotate_rows(x, positions, *self._table(positions.device, sliding, below))
        cos, sin = self.cos_sin(positions, sliding, below)
        if cos.dim() == 2:
            cos, sin = cos[None, None], sin[None, None]
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor, sliding: bool,
                 below: int | None = None) -> torch.Tensor:
        """The inverse of `rotate` (the rotary's attention scaling divided out): x [B, H, T, D] rotated at
        positions [T] (all < below where given) -> un-rotated, in x's dtype."""
        if below is not None:
            return rotate_rows(x, positions, *self._table(positions.device, sliding, below), inverse=True)
        cos, sin = self.cos_sin(positions, sliding, below)
        cos, sin = cos[None, None], sin[None, None]
        xf = x.float()
        return ((xf * cos - rotate_half(xf) * sin) / (cos * cos + sin * sin)).to(x.dtype)

    def counters(self) -> dict:
        return {"positions": "re-assigned", "largest_position": self.largest}


def scalars(cache) -> list[int] | None:
    """A cache's position map as JSON values, for checkpoints and saved states (None: document positions)."""
    positions = cache.positions
    return None if positions is None else [positions.shift, positions.largest]


def set_scalars(cache, values: list[int] | None) -> None:
    if cache.positions is not None and values is not None:
        cache.positions.set_shift(values[0])
        cache.positions.largest = max(cache.positions.largest, values[1])
