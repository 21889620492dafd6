"""The decoder layers' modules as a captured decode step runs them: fused projections, compiled blocks.

A captured decode step of an 8B model is ~1,500 kernels: GEMVs that stream the weights, and small element-wise
kernels around them. These rewrites make it cheaper, swapped in only while a step is captured (prefill keeps
the model's own modules and its chunk shapes):

- Fused projections (run key `fuse_projections`, on): q, k and v read the same hidden state, as do an MLP's
  gate and up projections. At one token each is a GEMV, and the small ones (k and v: 8 MB each on
  Llama-3.1-8B) run far below the memory bandwidth. Each group's weights are moved once into one buffer (the
  modules keep views of their rows: no memory is added, prefill computes what it computed before) and the step
  runs one GEMV per group. The step's projections (the fused groups, the attention's output and the MLP's down
  projection) run through kernels/gemv: on CUDA a Triton GEMV that streams the weight rows at more of the memory
  bandwidth than cuBLAS's one-row GEMMs (H200: Qwen3-1.7B's four 40.4 -> 27.1 us a layer, benchmarks/README.md).
- Folds (with fused projections; engines/decode_folds.py): the Llama, Mistral and Qwen layers' two RMSNorms
  computed inside the GEMVs they feed, one token's q and k rotated by one kernel with Qwen 3's q/k norms inside
  it, a gated MLP's activation formed by the gate/up GEMV as it stores, and the layer's two residual adds made by
  the o and down GEMVs: kernels, and the launch gaps before the GEMVs, a layer fewer.
- Compiled blocks (run key `compile_decode`, off): the MLPs (with fused projections, their activation * up
  alone, for several rows) and norms under torch.compile with static shapes.
  Inductor fuses each RMSNorm (6-8 kernels) and the MLP's activation * up into one (H100, random 8B at 4K:
  8.60 -> 7.73 ms/token, 1,497 -> 1,017 kernels; benchmarks/profile_decode.py). The norms include those inside
  the attention (Qwen 3's and Gemma 3's per-head q_norm and k_norm: eagerly 16 kernels a layer) and the final
  one. Their shapes never change with the document, so one compilation serves every layer and document; the
  attention (Triton launchers, the engine's cache state) stays eager. The rotary embedding,
  `apply_rotary_pos_emb` in the model's modeling module, is compiled too where its kernel does not take it
  (several rows, or no fused projections): eagerly it is ~10 kernels per layer (~0.6 ms of an 8B step). The
  attention forward looks that function up in its module's globals, so it is swapped there, as Liger Kernel
  patches it; the model's classes are untouched.
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch

from engines.decode_folds import (NORM_INTO_PROJECTIONS, NORMS_INTO_ROTARY, Noted, Passed, Rotation, activation_name,
                                  llama_norm, one_row, residuals_into_gemvs, rotates_halves)
from kernels.gemv import gemv, gemv_backend

_COMPILED_SUFFIXES = ("MLP", "RMSNorm")
# Fused weight buffers, per projecting module (attention or MLP), shared by every engine on the model.
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fuse(owner: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None, list] | None:
    """Move `owner`'s Linear children `names` into one [sum(out), in] weight (and bias); each keeps a view of its
    rows. None if they are not plain Linears over the same input. Done once per module."""
    if owner in _FUSED:
        return _FUSED[owner]
    linears = [getattr(owner, name, None) for name in names]
    first = linears[0]
    if not all(type(m) is torch.nn.Linear for m in linears) or any(
            m.in_features != first.in_features or m.weight.dtype != first.weight.dtype
            or m.weight.device != first.weight.device or (m.bias is None) != (first.bias is None) for m in linears):
        return None
    # Plain tensors even when called under inference_mode: prefill uses the views too.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None if first.bias is None else torch.cat([m.bias for m in linears])
        bounds, start = [], 0
        for m in linears:
            stop = start + m.out_features
            m.weight = torch.nn.Parameter(weight[start:stop], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[start:stop], requires_grad=False)
            bounds.append((start, stop))
            start = stop
    _FUSED[owner] = (weight, bias, bounds)
    return _FUSED[owner]


class _SharedGEMV:
    """Projections that read the same input, as one GEMV: the first part called with an input computes every
    part's columns; the others take theirs from it. A part called with another input gets its own columns of a
    fresh product, so an unexpected call order costs time, never correctness."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bounds: list):
        self.weight, self.bias, self.bounds = weight, bias, bounds
        self.norm: tuple[torch.Tensor, float] | None = None  # the RMSNorm folded in (weight, eps), see Passed
        self.x = self.y = None

    def columns(self, x: torch.Tensor, part: int) -> torch.Tensor:
        if x is not self.x:
            self.x, self.y = x, gemv(x, self.weight, self.bias, self.norm if one_row(x) else None)
        start, stop = self.bounds[part]
        return self.y[..., start:stop]

    def clear(self) -> None:
        self.x = self.y = None


class _Part(torch.nn.Module):
    def __init__(self, shared: _SharedGEMV, part: int):
        super().__init__()
        self.shared, self.part = shared, part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.columns(x, self.part)


class Projection(torch.nn.Module):
    """An nn.Linear's forward through kernels/gemv (one token on CUDA: the project's GEMV; else F.linear).
    `residual`, set for one one-row call (decode_folds.residuals_into_gemvs), is added by that call's GEMV."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.residual: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual, self.residual = self.residual, None
        return gemv(x, self.weight, self.bias, residual=residual)


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)), the MLP of the Llama, Qwen, Mistral and Gemma families, with gate and up as
    one GEMV. For one row whose activation kernels/gemv knows (`act`: SiLU, GELU's tanh form), that GEMV forms
    act(gate) * up as it stores: no kernel between the two GEMVs. Several rows (a rectification's tokens) run the
    activation and product apart, through torch.compile when compiled (`compile_gate`); the GEMVs stay
    kernels/gemv launches."""

    def __init__(self, mlp: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.act_fn, self.down = mlp.act_fn, Projection(mlp.down_proj)
        self.weight, self.bias = weight, bias
        self.norm: tuple[torch.Tensor, float] | None = None  # the RMSNorm folded in (weight, eps), see Passed
        self.act = activation_name(mlp.act_fn, weight)
        self.gate = self._gate

    def _gate(self, both: torch.Tensor) -> torch.Tensor:
        gate, up = both.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def compile_gate(self) -> None:
        self.gate = torch.compile(self._gate, dynamic=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one = one_row(x)
        if one and self.act is not None:
            hidden = gemv(x, self.weight, self.bias, self.norm, self.act)
        else:
            hidden = self.gate(gemv(x, self.weight, self.bias, self.norm if one else None))
        return self.down(hidden)


def _gated_mlp(mlp: torch.nn.Module) -> GatedMLP | None:
    """The fused form of `mlp` if it is a gated MLP (checked on a random input against its own forward)."""
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
            or getattr(mlp.gate_proj, "out_features", None) != getattr(mlp.up_proj, "out_features", -1):
        return None
    fused = _fuse(mlp, ("gate_proj", "up_proj"))
    if fused is None:
        return None
    candidate = GatedMLP(mlp, fused[0], fused[1])
    weight = mlp.gate_proj.weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(1, 1, mlp.gate_proj.in_features, generator=gen, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        want, got = mlp(x).float(), candidate(x).float()
    return candidate if torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()) else None


class DecodeBlocks:
    """Replacement modules for the decoder layers (fused projections, compiled MLPs and norms), in place only
    inside `swapped()`. `fused` names what was fused ("qkv", "gate_up", "norms", "activation", ...), for the report."""

    def __init__(self, model: torch.nn.Module, *, fuse: bool, compile: bool):
        self.slots: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]] = []
        self.shared: list[_SharedGEMV] = []
        self.fused: set[str] = set()
        self.compiled = compile
        self.functions: list[tuple[object, str, object, object]] = []
        self.forwards: list[tuple[torch.nn.Module, object]] = []  # layers' one-row forwards (_fold_residuals)
        for layer in getattr(model.get_decoder(), "layers", None) or []:
            for name, child in layer.named_children():
                replacement = child
                if fuse and name == "mlp":
                    replacement = _gated_mlp(child) or child
                    if replacement is not child:
                        self.fused |= {"gate_up", "activation"} if replacement.act else {"gate_up"}
                if fuse and hasattr(child, "q_proj"):
                    self._fuse_attention(child)
                if compile and isinstance(replacement, GatedMLP):
                    replacement.compile_gate()
                elif compile and type(child).__name__.endswith(_COMPILED_SUFFIXES):
                    replacement = torch.compile(replacement, dynamic=False)
                rotation = self._rotation(child, fuse, compile) if hasattr(child, "q_proj") else None
                if rotation is not None and fuse and type(child).__name__ in NORMS_INTO_ROTARY:
                    self._defer_qk_norms(child, rotation)
                if compile and hasattr(child, "q_proj"):
                    self._compile_norms(child)  # Qwen 3's and Gemma 3's per-head q_norm and k_norm
                if replacement is not child:
                    self.slots.append((layer, name, child, replacement))
            if fuse:
                self._fold_norms(layer)
                self._fold_residuals(layer)
        if compile:
            self._compile_norms(model.get_decoder())  # the final norm, once per step
        # For the report: what the swapped-in projections run (none swapped: the model's own Linear modules).
        device = next(model.parameters()).device
        self.projections = gemv_backend(device) if self.fused else "torch linear"

    def _fold_norms(self, layer: torch.nn.Module) -> None:
        """Fold the layer's two norms into the fused GEMVs they feed (NORM_INTO_PROJECTIONS' layers only)."""
        if type(layer).__name__ not in NORM_INTO_PROJECTIONS:
            return
        swapped = {(parent, name): replacement for parent, name, _, replacement in self.slots}
        attention = getattr(layer, "self_attn", None)
        q_part = swapped.get((attention, "q_proj"))
        targets = {"input_layernorm": q_part.shared if isinstance(q_part, _Part) else None,
                   "post_attention_layernorm": swapped.get((layer, "mlp"))}
        for name, target in targets.items():
            norm = getattr(layer, name, None)
            params = llama_norm(norm) if isinstance(target, (_SharedGEMV, GatedMLP)) else None
            if params is None:
                continue
            target.norm = params
            # The compiled form of the norm, if one was swapped in, serves several rows behind the pass-through.
            several = swapped.get((layer, name), norm)
            self.slots = [slot for slot in self.slots if slot[:2] != (layer, name)]
            self.slots.append((layer, name, norm, Passed(several)))
            self.fused.add("norms")

    def _fold_residuals(self, layer: torch.nn.Module) -> None:
        """The layer's two residual adds made by its o and down GEMVs (NORM_INTO_PROJECTIONS' layers whose forward
        is the class's: one wrapped by hooks, such as accelerate's device moves, keeps its own)."""
        swapped = {(parent, name): replacement for parent, name, _, replacement in self.slots}
        o_proj, mlp = swapped.get((getattr(layer, "self_attn", None), "o_proj")), swapped.get((layer, "mlp"))
        if type(layer).__name__ in NORM_INTO_PROJECTIONS and "forward" not in vars(layer) \
                and isinstance(o_proj, Projection) and isinstance(mlp, GatedMLP):
            self.forwards.append((layer, residuals_into_gemvs(layer, o_proj, mlp.down)))
            self.fused.add("residuals")

    def _rotation(self, attn: torch.nn.Module, fuse: bool, compile: bool) -> Rotation | None:
        """The Rotation swapped in for apply_rotary_pos_emb in attn's modeling module (one per module; the attention
        forward looks the function up in its module's globals at call time): its kernel for one token with fused
        projections where the function rotates halves as the kernel does, compiled with `compile`."""
        module = sys.modules[type(attn).__module__]
        rope = getattr(module, "apply_rotary_pos_emb", None)
        if not callable(rope) or not (fuse or compile):
            return None
        rotation = next((r for m, n, _, r in self.functions if m is module and n == "apply_rotary_pos_emb"), None)
        if rotation is None:
            rotation = Rotation(rope, compile, kernel=fuse and rotates_halves(rope))
            self.functions.append((module, "apply_rotary_pos_emb", rope, rotation))
            if rotation.kernel:
                self.fused.add("rotation")
        return rotation

    def _defer_qk_norms(self, attn: torch.nn.Module, rotation: Rotation) -> None:
        """attn's q_norm and k_norm applied by the rotation that follows them (NORMS_INTO_ROTARY's attentions)."""
        params = [llama_norm(getattr(attn, name, None)) for name in ("q_norm", "k_norm")]
        if None in params:
            return
        for name, p in zip(("q_norm", "k_norm"), params):
            self.slots.append((attn, name, getattr(attn, name), Noted(rotation, p)))
        self.fused.add("qk_norms")

    def _compile_norms(self, parent: torch.nn.Module) -> None:
        """parent's own RMSNorm children (not its layers' nor those deferred), compiled like the layers' norms."""
        taken = {(p, n) for p, n, _, _ in self.slots}
        for name, child in parent.named_children():
            if type(child).__name__.endswith("RMSNorm") and (parent, name) not in taken:
                self.slots.append((parent, name, child, torch.compile(child, dynamic=False)))

    def _fuse_attention(self, attn: torch.nn.Module) -> None:
        names = ("q_proj", "k_proj", "v_proj")
        fused = _fuse(attn, names) if all(hasattr(attn, n) for n in names) else None
        if fused is None:
            return
        shared = _SharedGEMV(*fused)
        self.shared.append(shared)
        self.slots += [(attn, n, getattr(attn, n), _Part(shared, i)) for i, n in enumerate(names)]
        self.fused.add("qkv")
        if isinstance(getattr(attn, "o_proj", None), torch.nn.Linear):
            self.slots.append((attn, "o_proj", attn.o_proj, Projection(attn.o_proj)))

    @contextlib.contextmanager
    def swapped(self):
        for parent, name, _, replacement in self.slots + self.functions:
            setattr(parent, name, replacement)
        for layer, forward in self.forwards:
            layer.forward = forward  # an instance attribute over the class's forward, deleted after
        try:
            yield
        finally:
            for parent, name, original, _ in self.slots + self.functions:
                setattr(parent, name, original)
            for layer, _ in self.forwards:
                del layer.forward
            for shared in self.shared:
                shared.clear()
