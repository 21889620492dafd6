"""The star engine on the real embedded model (CPU): against dense, against the paper's construction, over ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from engines.base import EngineInputError
from engines.star import StarConfig, plan_blocks
from tests.conftest import greedy_answer, make_engine, run_cli, story_ids

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).parent.parent / "samples" / "lighthouse.txt"



def test_phase1_kv_equal_the_papers_augmented_blocks(lm, story_text):
    """Every block's K/V equal those of an ordinary forward over [anchor | block] with the anchor at positions
    0..a-1 and the block at its true positions (the paper's c'_i), on full and sliding-window layers; the anchor
    is shorter than a block and the chunks cut blocks in several pieces."""
    doc, _ = story_ids(lm, story_text, 1300)
    engine = make_engine(lm, "star", chunk_size=160, block_size=450, anchor_size=300)
    state = engine.prefill(doc, reserve=4)
    layout = state.layout
    assert layout.bounds == ((0, 450), (450, 900), (900, 1300)) and layout.anchor == 300
    model = lm.model
    model.set_attn_implementation("sdpa")
    try:
        for i, (lo, hi) in enumerate(layout.bounds):
            prefix = [] if i == 0 else list(range(300))
            tokens = torch.cat([doc[prefix], doc[lo:hi]]) if prefix else doc[lo:hi]
            positions = torch.tensor(prefix + list(range(lo, hi)))
            ref = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=tokens[None], position_ids=positions[None], past_key_values=ref, use_cache=True)
            for layer in (1, 5, 11, 17):  # sliding, full, full, full (Gemma 3: every 6th layer is global)
                n = hi - lo
                mine = state.cache.layers[layer]
                torch.testing.assert_close(mine.keys[:, :, lo:hi], ref.layers[layer].keys[:, :, -n:], atol=2e-3,
                                           rtol=1e-3)
                torch.testing.assert_close(mine.values[:, :, lo:hi], ref.layers[layer].values[:, :, -n:],
                                           atol=2e-3, rtol=1e-3)
    finally:
        engine.activate()
    # Not vacuous: a dense encoding differs from the blockwise one after the first block.
    dense = make_engine(lm, "dense", chunk_size=512).prefill(doc, reserve=4)
    diff = (dense.cache.layers[11].keys[:, :, 900:1300] - state.cache.layers[11].keys[:, :, 900:1300]).abs().max()
    assert diff > 1e-2


def test_short_documents_get_fewer_blocks(capsys, monkeypatch, tmp_path):
    """Blocks of a few hundred tokens lose needles dense finds: `blocks` gives way to min_block_size (one block
    is dense attention), except that every rank gets a block; the report says which rule cut the count."""
    assert len(plan_blocks(40_000, StarConfig(blocks=4)).bounds) == 2
    assert len(plan_blocks(30_000, StarConfig(blocks=4)).bounds) == 1
    assert len(plan_blocks(3_000, StarConfig(blocks=4), world=2).bounds) == 2
    assert len(plan_blocks(70_000, StarConfig(blocks=4)).bounds) == 4
    assert len(plan_blocks(10_000, StarConfig(blocks=4, min_block_size=4096)).bounds) == 2
    answers = {}
    # Two blocks whose anchor is the whole first block are dense attention too (the story's first six
    # paragraphs are ~620 tokens).
    doc = tmp_path / "story.txt"
    doc.write_text("\n\n".join(SAMPLE.read_text(encoding="utf-8").split("\n\n")[:6]) + "\n", encoding="utf-8")
    for name, args in (("star", []), ("star-2", ["--set", "min_block_size=300"]), ("dense", [])):
        code, out, err = run_cli(["ask", str(doc), "What was the name of the schooner?", "-p", name[:5].strip("-"),
                                  "-n", "6", "--json", "--state", "off", *args], capsys, monkeypatch)
        assert code == 0, err
        answers[name] = _json_answer(out)
    for name, blocks in (("star", 1), ("star-2", 2)):
        assert answers[name]["answer_ids"] == answers["dense"]["answer_ids"]
        assert answers[name]["counters"]["star_blocks"] == blocks
        rule = answers[name]["counters"]["star_block_rule"]
        assert f"{blocks} of 4 blocks" in rule and "dense attention" in rule


def test_block_plan_and_bad_configurations():
    layout = plan_blocks(1000, StarConfig(blocks=3, min_block_size=1), world=2)
    assert layout.bounds == ((0, 334), (334, 668), (668, 1000)) and layout.anchor == 334
    assert layout.owners == ((0, 1), (2,))
    assert plan_blocks(1000, StarConfig(block_size=300, anchor_size=64)).anchor == 64
    with pytest.raises(EngineInputError, match="block_size 2,000 is larger than the document"):
        plan_blocks(1000, StarConfig(block_size=2000))
    with pytest.raises(EngineInputError, match="3 ranks but only 2 blocks"):
        plan_blocks(1000, StarConfig(blocks=2, min_block_size=1), world=3)
    with pytest.raises(EngineInputError, match="anchor_size 600 is larger than a block"):
        plan_blocks(1000, StarConfig(blocks=4, anchor_size=600, min_block_size=1))
    with pytest.raises(ValueError, match="anchor_size"):
        StarConfig(block_size=100, anchor_size=200)
    with pytest.raises(ValueError, match="blocks"):
        StarConfig(blocks=0)


def _json_answer(out: str) -> dict:
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    return lines[0]


def _ranked(args: list[str], stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in dict(os.environ, **(env or {})).items() if v}
    return subprocess.run([sys.executable, "-m", "longctx_cli", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=600)


def test_ranks_over_gloo_answer_like_one_process(capsys, monkeypatch, tmp_path):
    """`--gpus 2 --device cpu` spawns 2 gloo ranks (3 blocks: two on the first rank, one on the query rank); the
    answer equals the one-process run of the same blocks. The document (the story's first six paragraphs, ~620
    tokens) comes from stdin (read once by the launcher, handed to every rank)."""
    text = "\n\n".join(SAMPLE.read_text(encoding="utf-8").split("\n\n")[:6]) + "\n"
    doc = tmp_path / "story.txt"
    doc.write_text(text, encoding="utf-8")
    common = ["--profile", "star", "--set", "blocks=3", "--set", "min_block_size=64", "--device", "cpu", "-n", "12",
              "--json", "--state", "off"]
    code, out, err = run_cli(["ask", str(doc), "What was the name of the schooner?", *common], capsys,
                             monkeypatch)
    assert code == 0, err
    one = _json_answer(out)
    proc = _ranked(["ask", "-", "What was the name of the schooner?", *common, "--gpus", "2"], stdin=text)
    assert proc.returncode == 0, proc.stderr[-3000:]
    many = _json_answer(proc.stdout)  # printed once, by the query rank
    assert many["answer_ids"] == one["answer_ids"] and many["answer"].strip()
    per_rank = many["counters"]["star_per_rank"]
    assert [r["blocks"] for r in per_rank] == [2, 1]
    assert all(r["anchor_broadcast_bytes"] > 0 and r["phase2_bytes_received"] > 0 for r in per_rank)
    assert sum(r["context_tokens"] for r in per_rank) == one["counters"]["star_per_rank"][0]["context_tokens"]


@pytest.mark.long
def test_ranks_save_and_reuse_their_own_shards(tmp_path):
    """Two gloo ranks answer two questions from one read, each saves its own shard; a later run reuses both
    shards, and when one rank's shard is damaged, both ranks read the document again (they agree first)."""
    from longctx_cli.home import longctx_home

    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(longctx_home() / "models", target_is_directory=True)
    env = {"LONGCTX_HOME": str(home)}
    common = ["--profile", "star", "--set", "blocks=2", "--set", "min_block_size=64", "--device", "cpu", "-n", "8",
              "--json", "--gpus", "2"]
    questions = ["What was the name of the schooner?", "Who kept the lighthouse?"]

    def run(*asked: str) -> list[dict]:
        proc = _ranked(["ask", str(SAMPLE), *[a for q in asked for a in ("-q", q)], *common], env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    both = run(*questions)
    # Each rank's shard is written beside the answers; the document's last report says when it was done.
    assert both[0]["state"].startswith("computed, saving") and "beside the answers" in both[0]["state"]
    assert both[1]["state"].startswith("kept") and "the state saved" in both[1]["state"]
    shards = sorted((home / "states").glob("*.safetensors"))
    assert len(shards) == 2  # one per rank
    again = run(questions[1])
    assert again[0]["state"].startswith("reused") and again[0]["answer_ids"] == both[1]["answer_ids"]
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))
    third = run(questions[1])
    assert third[0]["state"].startswith("computed, saved") and third[0]["answer_ids"] == both[1]["answer_ids"]


@pytest.mark.long
def test_more_ranks_than_blocks_is_one_clear_error():
    proc = _ranked(["ask", str(SAMPLE), "Who?", "--profile", "star", "--set", "blocks=2", "--set", "min_block_size=64",
                    "--device", "cpu",
                    "--gpus", "3"])
    assert proc.returncode == 4, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "3 ranks but only 2 blocks" in errors[0]


def test_cli_refuses_bad_star_settings(capsys, monkeypatch):
    code, _, err = run_cli(["ask", str(SAMPLE), "Who?", "-p", "star", "--set", "block_size=100000"], capsys,
                           monkeypatch)
    assert code == 4 and "larger than the document" in err
    code, _, err = run_cli(["ask", str(SAMPLE), "Who?", "-p", "star", "--set", "block_size=100",
                            "--set", "anchor_size=200"], capsys, monkeypatch)
    assert code == 4 and "anchor_size" in err
    code, _, err = run_cli(["ask", str(SAMPLE), "Who?", "--gpus", "2"], capsys, monkeypatch)
    assert code == 4 and "need the star engine" in err


@pytest.mark.gpu
def test_gpu_one_block_equals_dense_and_graph_equals_eager():
    """On CUDA (random Gemma 3 shape, bf16): one block gives dense's tokens; with 4 blocks the captured decode
    gives the eager path's tokens."""
    from longctx_cli.models import load_model

    lm = load_model("random:gemma3-270m", device="cuda", dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(1000, lm.config.vocab_size, (5000,), generator=gen)
    question = torch.randint(1000, lm.config.vocab_size, (9,), generator=gen)
    dense, _ = greedy_answer(make_engine(lm, "dense"), doc, question, 24)
    one, _ = greedy_answer(make_engine(lm, "star", blocks=1), doc, question, 24)
    assert one == dense
    outs = {graph: greedy_answer(make_engine(lm, "star", decode_graph=graph, min_block_size=1000), doc, question,
                                 24)[0] for graph in (True, False)}
    assert outs[True] == outs[False]


def _tiny_model_folder(path: Path) -> Path:
    """A small random Llama (fp32) whose vocabulary is the byte tokenizer's, so every answer is readable text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from longctx_cli.models import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.3)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_answer_like_one_process(tmp_path):
    """NCCL ranks (a tiny fp32 random Llama, so that rounding cannot flip a token): the same answer as one
    process, through the captured decode graph with an all-gather in every layer."""
    model = _tiny_model_folder(tmp_path / "tiny")
    common = ["--model", str(model), "--dtype", "float32", "-p", "star", "--set", "blocks=4", "--set",
              "min_block_size=64", "-n", "24",
              "--layout", "plain", "--json"]
    one = _ranked(["ask", str(SAMPLE), "What was the name of the schooner?", *common])
    two = _ranked(["ask", str(SAMPLE), "What was the name of the schooner?", *common, "--gpus", "2"])
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = _json_answer(one.stdout), _json_answer(two.stdout)
    assert len(b["answer_ids"]) == 24 and len(set(b["answer_ids"])) > 1 and a["answer_ids"] == b["answer_ids"]
    assert b["counters"]["decode_cuda_graph"] is True
    assert [r["blocks"] for r in b["counters"]["star_per_rank"]] == [2, 2]


def test_the_rank_that_failed_first_gives_the_exit_code(tmp_path, capsys, monkeypatch):
    """The launcher reads the errors the ranks recorded: the earliest decides the exit code, and its line is
    printed unless the query rank printed the same failure itself."""
    import time

    from longctx_cli import distributed

    def failed(folder, rank: int, code: int, text: str) -> None:
        monkeypatch.setenv("LONGCTX_RANK_ERRORS", str(folder))
        monkeypatch.setenv("RANK", str(rank))
        distributed.record_error(text, code)
        time.sleep(0.01)

    # Rank 0 fails alone; the query rank then loses its connection (an internal error); rank 1 is stopped.
    alone = tmp_path / "alone"
    alone.mkdir()
    failed(alone, 0, 5, "rank zero cannot read the model")
    failed(alone, 2, 1, "internal error: DistBackendError")
    assert distributed._first_failure(str(alone), {0: 5, 1: -15, 2: 1}, 3) == 5
    assert capsys.readouterr().err.strip() == "error: rank 0: rank zero cannot read the model"
    # Every rank refuses the same document: the query rank printed it, the launcher adds nothing.
    same = tmp_path / "same"
    same.mkdir()
    for r in range(3):
        failed(same, r, 4, "3 ranks but only 2 blocks")
    assert distributed._first_failure(str(same), {0: 4}, 3) == 4 and capsys.readouterr().err == ""
    # Nothing recorded (ranks stopped from outside): their own codes, else a failure without one.
    assert distributed._first_failure(str(tmp_path), {0: -9, 1: -9}, 2) == 1


def test_ctrl_c_stops_every_rank(tmp_path):
    """SIGINT to the launcher (what a terminal's Ctrl-C reaches: the ranks run in their own sessions) is passed
    on; the launcher exits 130 and no rank is left running."""
    import signal
    import time

    doc = tmp_path / "ranks-interrupted.txt"
    doc.write_text(SAMPLE.read_text())
    proc = subprocess.Popen([sys.executable, "-m", "longctx_cli", "ask", str(doc), "Who?", "--profile", "star",
                             "--set", "blocks=2", "--set", "min_block_size=64", "--device", "cpu", "--gpus", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Once both ranks run (three processes read the document), give them a moment into loading or prefill.
    deadline = time.time() + 90
    while len(_readers(doc)) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert not _readers(doc)


def _readers(doc: Path) -> list[Path]:
    """The processes whose command line names `doc`."""
    return [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(doc) in _cmdline(p)]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_launcher_ignores_a_second_signal_once_interrupted(monkeypatch):
    """After the agent's SignalException (the ranks told to stop), the launcher returns 130 / 143 and ignores
    further Ctrl-C or SIGTERM: Python's finalization would reset a handled signal to its default action, and a
    second Ctrl-C while it exits would kill it (-2) instead."""
    import signal

    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from longctx_cli import distributed

    def stopped(sig):
        def run(config, entrypoint):
            def call(*args):
                raise SignalException(f"got signal: {sig}", sigval=sig)
            return call
        return run

    for name in ("LONGCTX_COMMAND", "OMP_NUM_THREADS", "LONGCTX_RANK_ERRORS"):  # launch() sets them: put back after
        monkeypatch.setenv(name, os.environ.get(name, ""))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
            for s, handler in saved.items():
                signal.signal(s, handler)
            monkeypatch.setattr(launcher, "elastic_launch", stopped(sig))
            assert distributed.launch(["ask", "doc.txt", "Who?"], 2, "cpu") == code
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
