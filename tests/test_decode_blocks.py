"""The decode step's replacement modules (engines/decode_blocks.py): fused projections and compiled blocks."""

from __future__ import annotations

import pytest
import torch

from engines.decode_blocks import DecodeBlocks, GatedMLP, _SharedGEMV
from tests.conftest import make_engine

pytestmark = pytest.mark.slow


def test_compiled_blocks_swap_in_the_mlps_and_norms_and_put_them_back(lm):
    """compile_decode's modules: every layer's MLP and norms (Gemma 3: four, and the attention's q_norm and
    k_norm) and the final norm, the attention itself left alone; they are in place only inside swapped() (prefill
    keeps the eager modules)."""
    decoder = lm.model.get_decoder()
    layers = decoder.layers
    blocks = DecodeBlocks(lm.model, fuse=False, compile=True)
    names = {name for _, name, _, _ in blocks.slots}
    assert names == {"mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "q_norm", "k_norm", "norm"}
    assert len(blocks.slots) == 7 * len(layers) + 1 and blocks.fused == set()
    eager = [layer.mlp for layer in layers]
    eager_norms = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers] + [decoder.norm]
    with blocks.swapped():
        assert all(isinstance(layer.mlp, torch._dynamo.eval_frame.OptimizedModule) for layer in layers)
        assert [layer.mlp._orig_mod for layer in layers] == eager
        assert all(layer.self_attn is not None and not hasattr(layer.self_attn, "_orig_mod") for layer in layers)
        assert all(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for layer in layers
                   for m in (layer.self_attn.q_norm, layer.self_attn.k_norm, decoder.norm))
    assert [layer.mlp for layer in layers] == eager
    assert [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers] + [decoder.norm] == eager_norms
    # The rotary embedding, swapped in the modeling module's globals and put back.
    import transformers.models.gemma3.modeling_gemma3 as modeling

    original = modeling.apply_rotary_pos_emb
    assert [(m, n) for m, n, _, _ in blocks.functions] == [(modeling, "apply_rotary_pos_emb")]
    with blocks.swapped():
        assert modeling.apply_rotary_pos_emb is blocks.functions[0][3] is not original
    assert modeling.apply_rotary_pos_emb is original


def test_fused_projections_share_one_buffer_and_give_the_models_logits(lm):
    """fuse_projections: q/k/v and gate/up become views of one weight buffer each (prefill's modules read the
    same values, no memory added); the swapped-in parts compute the same forward as the model's own modules."""
    ids = torch.randint(1000, 20000, (1, 40), generator=torch.Generator().manual_seed(0))
    lm.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        before = lm.model(ids).logits
    params = sum(p.numel() for p in lm.model.parameters())
    blocks = DecodeBlocks(lm.model, fuse=True, compile=False)
    assert blocks.fused == {"qkv", "gate_up", "activation", "rotation"}
    assert sum(p.numel() for p in lm.model.parameters()) == params
    layers = lm.model.get_decoder().layers
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert (k.storage_offset(), v.storage_offset()) == (q.numel(), q.numel() + k.numel())
        assert mlp.up_proj.weight.storage_offset() == mlp.gate_proj.weight.numel()
    # A second set (another engine on the same model) reuses the buffers.
    again = DecodeBlocks(lm.model, fuse=True, compile=False)
    assert again.shared[0].weight.data_ptr() == blocks.shared[0].weight.data_ptr()
    with torch.inference_mode():
        unchanged = lm.model(ids).logits
        with blocks.swapped():
            assert all(isinstance(layer.mlp, GatedMLP) for layer in layers)
            fused = lm.model(ids).logits
    assert torch.equal(unchanged, before)
    torch.testing.assert_close(fused, before, rtol=1e-4, atol=1e-4)
    assert all(s.x is None for s in blocks.shared)  # nothing held past the swap


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_norms_fold_into_the_projections_they_feed(family):
    """Llama-family layers: the RMSNorm before q/k/v and the one before gate/up pass their input through inside
    swapped() and the fused GEMVs normalise it (one row); several rows are normalised by the norm module as
    before. Either way the logits are the model's own (tiny random model, fp32, CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.decode_folds import Passed

    config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Norm weights away from their initial ones, so that a norm applied twice or not at all shows.
    for layer in model.model.layers:
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(layer.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)]
        for norm in norms:
            norm.weight.data.uniform_(0.5, 1.5)
    one, several = torch.tensor([[7]]), torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = [model(ids).logits for ids in (one, several)]
    blocks = DecodeBlocks(model, fuse=True, compile=False)
    assert blocks.fused == {"qkv", "gate_up", "norms", "activation", "residuals", "rotation"} | \
        ({"qk_norms"} if family == "qwen3" else set())
    with torch.inference_mode(), blocks.swapped():
        layers = model.model.layers
        assert all(isinstance(layer.input_layernorm, Passed) and isinstance(layer.post_attention_layernorm, Passed)
                   for layer in layers)
        assert all(layer.mlp.norm[0] is layer.post_attention_layernorm.norm.weight for layer in layers)
        assert all("forward" in vars(layer) for layer in layers)  # the residual adds go to the o and down GEMVs
        if family == "qwen3":  # the per-head q and k norms go to the rotation after them
            from engines.decode_folds import Noted

            assert all(isinstance(layer.self_attn.q_norm, Noted) and isinstance(layer.self_attn.k_norm, Noted)
                       for layer in layers)
        got = [model(ids).logits for ids in (one, several)]
    assert all(type(layer.input_layernorm).__name__.endswith("RMSNorm") and "forward" not in vars(layer)
               for layer in model.model.layers)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_only_a_rotation_of_halves_goes_to_the_kernel():
    """rotate_qk computes transformers' rotation of each head's halves; the modeling modules' functions of the
    families the project names pass the check, one that rotates interleaved pairs (GPT-J's form) or fails on the
    probe does not, and is left to run itself."""
    import transformers.models.gemma3.modeling_gemma3 as gemma3
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    from engines.decode_folds import rotates_halves

    assert all(rotates_halves(m.apply_rotary_pos_emb) for m in (llama, qwen3, gemma3))

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rotate(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    def partial(q, k, cos, sin, unsqueeze_dim=1):
        raise RuntimeError("expects a rotary dim of its own")

    assert not rotates_halves(interleaved) and not rotates_halves(partial)


def test_a_norm_of_another_form_is_not_folded():
    """Only a norm that computes the Llama family's RMSNorm bit for bit is folded into a GEMV."""
    from engines.decode_folds import llama_norm

    class Offset(torch.nn.Module):  # Gemma's form: (1 + weight), the rounding at the end
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(8)), 1e-6

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)).to(x.dtype)

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert llama_norm(Offset()) is None
    norm = LlamaRMSNorm(8, eps=1e-5)
    assert llama_norm(norm) == (norm.weight, 1e-5)


def test_shared_gemv_recomputes_for_another_input():
    """A part called with an input other than the one the group computed for gets that input's columns."""
    weight = torch.randn(7, 5)
    shared = _SharedGEMV(weight, None, [(0, 4), (4, 7)])
    x, y = torch.randn(2, 5), torch.randn(2, 5)
    torch.testing.assert_close(shared.columns(x, 0), x @ weight[:4].T)
    torch.testing.assert_close(shared.columns(y, 1), y @ weight[4:].T)
    torch.testing.assert_close(shared.columns(x, 1), x @ weight[4:].T)


def test_an_mlp_of_another_form_is_left_unfused():
    """gate/up fusion assumes down(act(gate(x)) * up(x)); a module with those children that computes something
    else is caught by the check on a random input and keeps its own forward."""

    class Swapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(8, 16, bias=False)
            self.down_proj, self.act_fn = torch.nn.Linear(16, 8, bias=False), torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    from engines.decode_blocks import _gated_mlp

    assert _gated_mlp(Swapped()) is None


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["gemma3-270m", "qwen3-1.7b"])
def test_fused_and_compiled_decode_error_within_twice_the_eager_steps_error_on_gpu(preset):
    """The captured step with fused projections, and with fused + compiled blocks, scores 24 teacher-forced
    tokens with an error against an fp32 forward of at most 2x that of the plain captured step (the fused GEMV
    and Inductor's fp32 intermediates change rounding, so they do not agree bit for bit; flash-attention's
    rule)."""
    import copy

    from longctx_cli.models import load_model

    lm = load_model(f"random:{preset}", device="cuda", dtype="bfloat16")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1000, 20000, (3000,), generator=gen)
    question, targets = ids[:8], torch.randint(1000, 20000, (24,), generator=gen).tolist()
    nll = {}
    for fuse, compiled in ((False, False), (True, False), (True, True)):
        engine = make_engine(lm, "dense", compile_decode=compiled, fuse_projections=fuse, chunk_size=1024)
        state = engine.prefill(ids, reserve=40)
        nll[fuse, compiled] = torch.tensor(engine.teacher_forced_nll(state, question, targets))
        counters = engine.counters(state)
        assert counters["decode_compiled_blocks"] is compiled
        # Qwen 3's norms fold into the GEMVs and the rotation; Gemma 3's (another form) keep their modules.
        folded = "activation+gate_up+norms+qk_norms+qkv+residuals+rotation" if preset == "qwen3-1.7b" \
            else "activation+gate_up+qkv+rotation"
        assert counters["decode_fused_projections"] == (folded if fuse else "none")
        assert counters["decode_projections"] == ("triton gemv" if fuse else "torch linear")
    reference = copy.deepcopy(lm.model).float()
    reference.set_attn_implementation("sdpa")
    full = torch.cat([ids, question, torch.tensor(targets)]).view(1, -1).cuda()
    with torch.inference_mode():
        logp = torch.log_softmax(reference(full).logits[0].float(), dim=-1).cpu()
    start = ids.numel() + question.numel() - 1
    exact = torch.tensor([-logp[start + i, t].item() for i, t in enumerate(targets)])
    errors = {key: (value - exact).abs().mean().item() for key, value in nll.items()}
    for key in ((True, False), (True, True)):
        assert errors[key] <= 2 * errors[False, False] + 1e-3, f"fuse, compile {key}: {errors}"
