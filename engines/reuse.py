"""Read once, ask many: the defaults of the engine contract's checkpoint, restore and saved-state methods
(engines/base.py Engine), which fit a cache the answer only appends to. Engines whose answers overwrite state
(their own cache layers, windows, pools) override them; see engines/ltri/state.py and engines/sas/state.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from engines.base import DocumentState


def _first_kept(layer, n_tokens: int) -> int:
    """The first of a document's positions a later token can attend in this cache layer: 0, or for a
    sliding-window layer the start of the last window (the question's first token reads back window - 1 keys).
    Saved states keep only those rows: Gemma 3's 15 sliding layers of 18 then take 512 tokens each whatever
    the document's length."""
    window = getattr(layer, "sliding_window", None)
    return max(0, n_tokens - window) if window else 0


class Reuse:
    reusable: ClassVar[bool] = False

    @torch.inference_mode()
    def checkpoint(self, state: DocumentState) -> object:
        """What a question and its answer may overwrite, kept for `restore` (here: a cache they only append
        to, so the position alone)."""
        return state.position

    @torch.inference_mode()
    def restore(self, state: DocumentState, checkpoint) -> None:
        """Back to the state `checkpoint` was taken from: the next question sees the document alone."""
        state.position = checkpoint

    def agree(self, found: bool) -> bool:
        """Whether to use a saved state this process found (`found`): engines of several ranks ask them all."""
        return found

    def state_inputs(self, n_tokens: int, reserve: int) -> dict:
        """What shapes the state beyond the model, the settings and the document (part of its saved key)."""
        return {}

    @torch.inference_mode()
    def export_state(self, state: DocumentState) -> tuple[dict, dict]:
        """(tensors, JSON-able scalars) that `import_state` rebuilds the state from: the document's K/V. Tensors
        are read back onto the engine's device, except those named `host.*`, which stay in host memory; the
        tensors must not change when later questions are answered (copy what answers overwrite)."""
        n = state.n_tokens
        tensors = {}
        for i, layer in enumerate(state.cache.layers):
            first = _first_kept(layer, n)
            tensors[f"layers.{i}.keys"] = layer.keys[:, :, first:n]
            tensors[f"layers.{i}.values"] = layer.values[:, :, first:n]
        return self._with_document(state, tensors, {})

    @torch.inference_mode()
    def import_state(self, tensors: dict, meta: dict, reserve: int) -> DocumentState:
        """A state from `export_state`'s output, with room for `reserve` more tokens; tensors on any device."""
        n = meta["n_tokens"]
        cache = self.make_cache(n + reserve, reserve)
        for i, layer in enumerate(cache.layers):
            keys = tensors[f"layers.{i}.keys"].to(self.layer_device(i))
            values = tensors[f"layers.{i}.values"].to(keys.device)
            first = n - keys.shape[2]
            if first < 0 or first > _first_kept(layer, n):
                raise ValueError(f"saved layer {i} holds {keys.shape[2]} tokens of a {n}-token document, "
                                 f"it needs at least {n - _first_kept(layer, n)}")
            layer.lazy_initialization(keys, values)
            # Rows before `first` stay zero: a sliding-window layer never attends them again.
            layer.keys[:, :, first:n], layer.values[:, :, first:n] = keys, values
        return self._state_from(cache, tensors, meta)

    @staticmethod
    def _with_document(state: DocumentState, tensors: dict, meta: dict) -> tuple[dict, dict]:
        """What every saved state holds besides the engine's own: the last logits and the document's scalars."""
        return ({**tensors, "last_logits": state.last_logits},
                {**meta, "n_tokens": state.n_tokens, "prefill_s": state.prefill_s, "counters": state.counters})

    def _state_from(self, cache, tensors: dict, meta: dict) -> DocumentState:
        """The state around a cache filled from a saved state (`_with_document`'s part)."""
        n = meta["n_tokens"]
        cache.filled, cache.compile_windows = n, self.windows_compiled(n)
        return self.State(cache, n, n, tensors["last_logits"].to(self.device), meta.get("prefill_s", 0.0),
                          counters=dict(meta.get("counters", {})))
