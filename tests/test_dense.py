"""The dense engine on the real embedded model: exactness against transformers' own generate and forward."""

from __future__ import annotations

import pytest
import torch

from engines import ENGINES
from engines.decoding import Sampler
from longctx_cli.home import longctx_home
from longctx_cli.profiles import resolve_profile

pytestmark = pytest.mark.slow


def _engine(lm, **overrides):
    profile = resolve_profile("dense", overrides)
    return ENGINES["dense"](lm, profile.engine_config, profile.run, home=longctx_home())


def _document_ids(lm, text: str, n: int) -> torch.Tensor:
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = (ids * (n // len(ids) + 1))[: n - 1]
    return torch.tensor([lm.tokenizer.bos_token_id, *ids])


def test_greedy_equals_generate(lm, story_text):
    """700-token document (past the 512-token sliding window) + question: the engine's greedy tokens equal
    model.generate's, token for token."""
    ids = _document_ids(lm, story_text, 700)
    question = torch.tensor(lm.tokenizer("\n\nQuestion: What was the name of the schooner?\nAnswer:",
                                         add_special_tokens=False)["input_ids"])
    engine = _engine(lm, chunk_size=256)
    state = engine.prefill(ids, reserve=question.numel() + 24)
    ours = list(engine.answer(state, question, 24, Sampler()))

    lm.model.set_attn_implementation("sdpa")
    full = torch.cat([ids, question]).view(1, -1)
    with torch.inference_mode():
        ref = lm.model.generate(full, attention_mask=torch.ones_like(full), max_new_tokens=24, do_sample=False,
                                min_new_tokens=24, eos_token_id=None, pad_token_id=0)
    assert ours == ref[0, full.shape[1]:].tolist()
    assert state.cache.capacity == ids.numel() + question.numel() + 24


@pytest.fixture(scope="module")
def one_shot(lm, story_text):
    """1,100 tokens of the story (two chunks of 1,000, past the sliding window) and transformers' one-shot
    last-token logits for them."""
    ids = _document_ids(lm, story_text, 1100)
    lm.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        return ids, lm.model(ids.view(1, -1), logits_to_keep=1).logits[0, -1].float()


@pytest.mark.parametrize("chunk", [97, 256, 1000, 4096], ids=lambda c: f"chunk{c}")
def test_chunked_prefill_matches_one_shot(lm, one_shot, chunk):
    """Chunk sizes that do and do not divide the length give the one-shot last-token logits (fp32, 1e-4)."""
    ids, ref = one_shot
    state = _engine(lm, chunk_size=chunk).prefill(ids, reserve=1)
    got = state.last_logits[0]
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert got.argmax() == ref.argmax()


def test_sliding_window_layers_see_only_their_window(lm):
    """Past Gemma 3's 512-token window the sliding layers must drop old keys: compare with HF beyond 512."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (700,), generator=gen)
    lm.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        ref = lm.model(ids.view(1, -1), logits_to_keep=1).logits[0, -1].float()
    got = _engine(lm, chunk_size=128).prefill(ids, reserve=1).last_logits[0]
    assert torch.allclose(got, ref, atol=1e-3 * ref.abs().max().item())


def test_sampling_is_seeded(lm, story_text):
    """The same seed samples the same tokens, also from a restored state whose decode step an earlier answer made
    (read once, ask many); another seed, or greedy decoding, other ones (so the temperature is applied at all)."""
    ids = _document_ids(lm, story_text, 300)
    engine = _engine(lm)

    state = engine.prefill(ids, reserve=8)
    checkpoint = engine.checkpoint(state)

    def run(sampler):
        engine.restore(state, checkpoint)
        return list(engine.answer(state, torch.tensor([], dtype=torch.long), 8, sampler))

    seeded = [run(Sampler(temperature=1.0, top_p=0.9, seed=seed)) for seed in (3, 3, 4)]
    assert seeded[0] == seeded[1]
    assert seeded[0] != seeded[2]
    assert seeded[0] != run(Sampler())


@pytest.mark.long
def test_converted_cache_reloads_without_converting_and_gives_identical_logits(lm, monkeypatch, tmp_path):
    """A second load reads the safetensors cache (no GGUF conversion) and gives exactly the logits of the GGUF
    as transformers itself loads it (assembled here from the packages: the product keeps only the conversion)."""
    from transformers import AutoModelForCausalLM

    import longctx_cli.gguf_convert
    from longctx_cli.models import _load_model
    from longctx_cli.named_models import NAMED

    def no_conversion(*args, **kwargs):
        raise AssertionError("the converted cache was not used")

    monkeypatch.setattr(longctx_cli.gguf_convert, "convert_gguf", no_conversion)
    gguf = tmp_path / "gemma3-270m.gguf"
    NAMED["gemma3-270m"].assemble(gguf)
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563]])  # "<bos>The capital of France is"
    again = _load_model(None, "cpu", "float32", lm.tokenizer, lambda m: None)
    original = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.inference_mode():
        again.model.set_attn_implementation("sdpa")
        a, b = again.model(ids).logits, original(ids).logits
    assert torch.equal(a, b)


def test_tokenizer_matches_gemma_segmentation(lm):
    """The rebuilt SentencePiece-BPE tokenizer segments like Gemma 3's own (not GGUF's Unigram import)."""
    assert lm.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"] == [818, 5279, 529, 7001,
                                                                                                563]
    text = "Hello  world\n\nTabs\tand ünïcödé 日本語 🙂 <b>"
    assert lm.tokenizer.decode(lm.tokenizer(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.gpu
def test_seeded_sampling_through_the_captured_step_repeats_from_a_restored_state():
    """On CUDA, the decode step captured by the first answer: the same seed samples the same tokens when the
    question is asked again from the checkpoint (the replays read the generator's seed as the answer set it)."""
    from longctx_cli.models import load_model

    lm = load_model("random:qwen3-1.7b", device="cuda", dtype="bfloat16")
    ids = torch.randint(1000, 20000, (2000,), generator=torch.Generator().manual_seed(2))
    engine = _engine(lm, chunk_size=1024)
    state = engine.prefill(ids, reserve=40)
    checkpoint = engine.checkpoint(state)
    outs = []
    for seed in (5, 5, 6):
        engine.restore(state, checkpoint)
        outs.append(list(engine.answer(state, ids[:8], 24, Sampler(temperature=1.0, seed=seed))))
        assert state.decode.captured
    assert outs[0] == outs[1] != outs[2]


@pytest.mark.gpu
def test_answer_stopped_early_leaves_the_state_whole_on_gpu():
    """Captured steps run one ahead of the tokens read: an answer closed after 5 tokens has run 5 steps (one more
    than it needed, its K/V past what the answer kept); asked again from the checkpoint, the question gives the
    same tokens in full."""
    from longctx_cli.models import load_model

    lm = load_model("random:qwen3-1.7b", device="cuda", dtype="bfloat16")
    ids = torch.randint(1000, 20000, (2000,), generator=torch.Generator().manual_seed(3))
    engine = _engine(lm, chunk_size=1024)
    state = engine.prefill(ids, reserve=40)
    checkpoint = engine.checkpoint(state)
    full = list(engine.answer(state, ids[:8], 24, Sampler()))
    engine.restore(state, checkpoint)
    start = state.position
    stream = engine.answer(state, ids[:8], 24, Sampler())
    first = [next(stream) for _ in range(5)]
    stream.close()
    assert first == full[:5] and state.position == start + 8 + 5
    engine.restore(state, checkpoint)
    assert list(engine.answer(state, ids[:8], 24, Sampler())) == full


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["gemma3-270m", "qwen3-1.7b"])
def test_graph_decode_equals_eager_decode_on_gpu(preset):
    """On CUDA: the captured decode step replays to exactly the eager loop's greedy tokens (random weights:
    the comparison needs no trained model), with sliding-window (Gemma 3) and GQA (Qwen3) shapes. The model's
    own projections on both sides: the fused ones round differently, and are held to the fp32 error rule
    instead (test_decode_blocks.py)."""
    from longctx_cli.models import load_model

    lm = load_model(f"random:{preset}", device="cuda", dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 20000, (3000,), generator=gen)
    outs = []
    for graph in (True, False):
        engine = _engine(lm, decode_graph=graph, chunk_size=1024, fuse_projections=False)
        state = engine.prefill(ids, reserve=40)
        outs.append(list(engine.answer(state, ids[:8], 32, Sampler())))
        assert state.decode.captured == graph
        assert engine.backends()["decode_attention"] == "triton split-KV"
        expected = "flex attention" if preset == "gemma3-270m" else "cudnn split"  # Gemma: D 256, windows
        assert engine.backends()["prefill_attention"].startswith(expected)
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["gemma3-270m", "qwen3-1.7b"])
def test_gpu_prefill_error_within_twice_hf_bf16_error(preset):
    """Chunked bf16 prefill on CUDA (cuDNN / Flex) against an fp32 one-shot HF forward: its error on
    the last-token logits is at most 2x that of HF's own one-shot bf16 SDPA forward (flash-attention's rule)."""
    import copy

    from longctx_cli.models import load_model

    lm = load_model(f"random:{preset}", device="cuda", dtype="bfloat16")
    ids = torch.randint(1000, 20000, (5000,), generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(lm.model).float()
    reference.set_attn_implementation("sdpa")
    lm.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        exact = reference(ids.view(1, -1).cuda(), logits_to_keep=1).logits[0, -1].float()
        hf = lm.model(ids.view(1, -1).cuda(), logits_to_keep=1).logits[0, -1].float()
    del reference
    got = _engine(lm, chunk_size=1024).prefill(ids, reserve=1).last_logits[0]
    ours, theirs = ((got - exact).norm() / exact.norm()).item(), ((hf - exact).norm() / exact.norm()).item()
    assert ours <= 2 * theirs + 1e-3, f"chunked prefill error {ours:.2e} vs HF bf16 one-shot {theirs:.2e}"


def test_teacher_forced_nll_equals_one_forward(lm, story_text):
    """Feeding known tokens one decode step at a time scores them as one full forward does."""
    ids = _document_ids(lm, story_text, 600)
    question = torch.tensor(lm.tokenizer("\n\nQuestion: Who kept the light?\nAnswer:",
                                         add_special_tokens=False)["input_ids"])
    targets = ids[100:120].tolist()
    engine = _engine(lm, chunk_size=256)
    state = engine.prefill(ids, reserve=question.numel() + len(targets))
    nll = engine.teacher_forced_nll(state, question, targets)

    lm.model.set_attn_implementation("sdpa")
    full = torch.cat([ids, question, torch.tensor(targets)]).view(1, -1)
    with torch.inference_mode():
        # The logits of the question's last token and of each target but the last: those that score a target.
        logp = torch.log_softmax(lm.model(full, logits_to_keep=len(targets) + 1).logits[0, :-1].float(), dim=-1)
    ref = [-logp[i, t].item() for i, t in enumerate(targets)]
    assert nll == pytest.approx(ref, abs=1e-3)
