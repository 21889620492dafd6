"""What a captured one-token step folds into the kernels around it (engines/decode_blocks.py swaps these in).

- The Llama family's RMSNorms into the GEMVs after them (`Passed`, `llama_norm`): the norm before q/k/v and the one
  before gate/up feed nothing but those projections, so one row passes through and the GEMV normalises it
  (kernels/gemv's `norm`). A norm folds only where it equals transformers' Llama RMSNorm bit for bit on a random row
  and its layer class is listed (`NORM_INTO_PROJECTIONS`): that its output feeds nothing else is a fact about the
  layer's forward, which no check of the norm alone can see.
- The rotary embedding of one token's q and k in one kernel (`Rotation`: kernels/rotary's rotate_qk, where the
  compiled function ran two), where the module's function is found to rotate halves as it does (`rotates_halves`),
  with Qwen 3's per-head q and k norms folded in (`Noted`): the norms note their weights and pass their input
  through, and the rotation applies both first.
- A gated MLP's activation into the gate/up GEMV (`activation_name`: the kernels/gemv name of the module's own
  activation, found bit for bit).
- The two residual adds into the GEMVs before them, the o and down projections' (`residuals_into_gemvs`): the
  adds are in the decoder layer's forward, not in a module, so a listed layer (`NORM_INTO_PROJECTIONS`, whose
  forward is transformers' Llama layer's) gets that forward for one row with the adds moved into the GEMVs'
  epilogues, bit for bit the same sums.
"""

from __future__ import annotations

import torch

from kernels.gemv import ACTIVATIONS, rms_norm
from kernels.rotary import rotate_qk, rotate_qk_reference

# Decoder layers whose input_layernorm feeds only the attention's q/k/v and post_attention_layernorm only the MLP.
NORM_INTO_PROJECTIONS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
# Attentions whose per-head q_norm and k_norm outputs go straight into apply_rotary_pos_emb, called next.
NORMS_INTO_ROTARY = ("Qwen3Attention",)


def activation_name(act_fn, like: torch.Tensor) -> str | None:
    """The kernels/gemv name of `act_fn` (checked bit for bit on a random tensor of `like`'s dtype and device),
    or None."""
    gen = torch.Generator(device=like.device).manual_seed(0)
    t = torch.randn(256, generator=gen, device=like.device).mul(4).to(like.dtype)
    with torch.no_grad():
        got = act_fn(t)
        return next((name for name, fn in ACTIVATIONS.items() if torch.equal(got, fn(t))), None)


def one_row(x: torch.Tensor) -> bool:
    """Whether x is one row (a decode step's token); several rows are a rectification's or a prefill's."""
    return x.numel() == x.shape[-1]


class Passed(torch.nn.Module):
    """An RMSNorm folded into the projection after it: one row (a decode step) passes through and the projection
    normalises it; several rows (a rectification's tokens) are normalised here, by `norm` (the model's module or
    its compiled form), as the projection then expects."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if one_row(x) else self.norm(x)


def llama_norm(norm: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) if `norm` computes reference.rms_norm (checked bit for bit on a random row), else None."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(1, 1, weight.numel(), generator=gen, device=weight.device).mul(3).to(weight.dtype)
    with torch.no_grad():
        return (weight, eps) if torch.equal(norm(x), rms_norm(x, weight, eps)) else None


class Rotation:
    """The modeling module's apply_rotary_pos_emb as a captured step runs it, applying first the q and k norms noted
    just before it (`Noted`), if any. With `kernel`, a decode step's one token on CUDA is rotated by one launch
    (kernels/rotary's rotate_qk: q's and k's norms and rotations together); otherwise norms and rotation run as one
    function (compiled with `compile`: one Inductor graph instead of three)."""

    def __init__(self, rope, compile: bool, kernel: bool):
        def norm_rope(q, k, cos, sin, wq, eps_q, wk, eps_k, unsqueeze_dim=1):
            return rope(rms_norm(q, wq, eps_q), rms_norm(k, wk, eps_k), cos, sin, unsqueeze_dim)

        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self.rope, self.norm_rope = wrap(rope), wrap(norm_rope)
        self.kernel = kernel
        self.pending: list[tuple[torch.Tensor, float]] = []

    def __call__(self, q, k, cos, sin, unsqueeze_dim=1):
        norms, self.pending = self.pending, []
        if norms and len(norms) != 2:
            raise RuntimeError(f"expected the q and k norms before the rotation, got {len(norms)} noted")
        if self.kernel and unsqueeze_dim == 1 and _one_token(q, k, cos, sin, norms):
            return rotate_qk(q, k, cos, sin, *norms)
        if not norms:
            return self.rope(q, k, cos, sin, unsqueeze_dim)
        (wq, eps_q), (wk, eps_k) = norms
        return self.norm_rope(q, k, cos, sin, wq, eps_q, wk, eps_k, unsqueeze_dim)


def rotates_halves(rope) -> bool:
    """Whether `rope` (a modeling module's apply_rotary_pos_emb) computes what rotate_qk computes, transformers'
    rotation of each head's two halves (q * cos + rotate_half(q) * sin over the whole head): checked bit for bit in
    fp32 on a random token, as a family that rotates interleaved pairs or part of the head must not be taken for it."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)
    angles = torch.rand(1, 1, 16, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    try:
        with torch.no_grad():
            got = rope(q, k, cos, sin)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    want = rotate_qk_reference(q, k, cos, sin)
    return isinstance(got, tuple) and len(got) == 2 and all(
        isinstance(g, torch.Tensor) and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


def _one_token(q, k, cos, sin, norms) -> bool:
    """Whether rotate_qk's kernel takes these: one token's q [B, Hq, 1, D] and k on CUDA, cos / sin [B, 1, D] (the
    whole head rotated), norm weights in q's dtype, all on q's device."""
    B, D = q.shape[0], q.shape[-1]
    tensors = (k, cos, sin, *(w for w, _ in norms))
    return (q.is_cuda and q.dim() == 4 and q.shape[2] == 1 and k.dim() == 4 and k.shape[2:] == (1, D)
            and cos.shape == sin.shape == (B, 1, D) and all(w.dtype == q.dtype for w, _ in norms)
            and all(t.device == q.device for t in tensors))


class Noted(torch.nn.Module):
    """A q or k norm deferred to the rotation after it: notes its weight and passes its input through."""

    def __init__(self, rotary: Rotation, params: tuple[torch.Tensor, float]):
        super().__init__()
        self.rotary, self.params = rotary, params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rotary.pending.append(self.params)
        return x


def residuals_into_gemvs(layer: torch.nn.Module, o_proj: torch.nn.Module, down_proj: torch.nn.Module):
    """`layer`'s forward (transformers' Llama decoder layer's, arguments included) with, for one row, its two
    residual adds made by the GEMVs before them, the o and down projections' (their `residual`, set for the one call
    that takes it). Several rows run the layer's own forward."""
    own = type(layer).forward

    def forward(hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
        if not one_row(hidden_states):
            return own(layer, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                       position_embeddings, **kwargs)
        o_proj.residual = hidden_states
        try:
            hidden_states, _ = layer.self_attn(
                hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                position_embeddings=position_embeddings, **kwargs)
        finally:
            o_proj.residual = None  # taken by its call; a path that never called o_proj leaves none behind
        down_proj.residual = hidden_states
        try:
            return layer.mlp(layer.post_attention_layernorm(hidden_states))
        finally:
            down_proj.residual = None

    return forward
