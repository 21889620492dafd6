"""The command line end to end on the real embedded model: exit codes, stdout / stderr split, messages.

Every run goes through `longctx_cli.entry.main` in-process (`run_cli`), so the tokenizer and the model load once.
Documents are paragraphs of samples/lighthouse.txt (~100-150 tokens) unless a test needs the whole story.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import yaml

from engines.base import Engine
from engines.dense import DenseEngine
from longctx_cli import __version__
from longctx_cli.models import load_tokenizer
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).parent.parent / "samples" / "lighthouse.txt"
QUESTION = "What was the name of the schooner?"
MAX_CONTEXT = 32768  # Gemma 3 270M's max_position_embeddings
JSON_KEYS = {"path", "question", "answer", "engine", "model", "tokens_in", "tokens_out", "timings", "memory"}


def _paragraph(index: int) -> str:
    return SAMPLE.read_text(encoding="utf-8").split("\n\n")[index].strip() + "\n"


# Paragraph 5 tells of the storm and the schooner Margaret Ellen; 2 introduces Ada; 4 the village post office.
SCHOONER, ADA, VILLAGE = _paragraph(5), _paragraph(2), _paragraph(4)


def _n_tokens(text: str) -> int:
    return len(load_tokenizer(None).encode(text, add_special_tokens=False))


def _prompt_tokens(document: str, question: str = QUESTION) -> int:
    """BOS + document + the base-model question tail, as README describes the layout."""
    return 1 + _n_tokens(document) + _n_tokens(f"\n\nQuestion: {question}\nAnswer:")


def _json_lines(stdout: str) -> list[dict]:
    lines = stdout.splitlines()
    assert lines, "no JSON on stdout"
    return [json.loads(line) for line in lines]


def _error_line(stderr: str) -> str:
    """The one 'error: ...' line; the whole message must be on it (no wrapping at the terminal width)."""
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, f"expected one error line, got {lines!r} in:\n{stderr}"
    return lines[0]


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@pytest.fixture
def cli(capsys, monkeypatch):
    def run(*args: str, stdin_text: str | None = None):
        return run_cli([str(a) for a in args], capsys, monkeypatch, stdin_text=stdin_text)

    return run


@pytest.fixture
def schooner_file(tmp_path) -> Path:
    return _write(tmp_path / "schooner.txt", SCHOONER)


@pytest.fixture
def folder(tmp_path) -> Path:
    root = tmp_path / "docs"
    _write(root / "a.txt", SCHOONER)
    _write(root / "b.txt", ADA)
    _write(root / "notes" / "c.md", VILLAGE)
    _write(root / "d.csv", "name,role\nElias Marrow,keeper\nAda Fenwick,assistant\n")
    return root


# --- ask: the whole sample ---------------------------------------------------------------------------------------


def test_ask_sample_answer_on_stdout_report_on_stderr(cli):
    code, out, err = cli("ask", SAMPLE, QUESTION, "-n", "12")
    assert code == 0, err
    assert out.strip()
    # The base model answers this one right ("The Margaret Ellen.").
    assert "Margaret" in out
    assert "longctx report" in err and "prefill" in err
    # stdout carries the answer only.
    assert "prefill" not in out and "report" not in out


def test_ask_sample_json_is_one_object(cli):
    code, out, err = cli("ask", SAMPLE, QUESTION, "-n", "12", "--json")
    assert code == 0, err
    [obj] = _json_lines(out)
    assert JSON_KEYS <= obj.keys()
    assert {"prefill_s", "decode_ms_per_token"} <= obj["timings"].keys()
    assert obj["path"] == str(SAMPLE)
    assert obj["question"] == QUESTION
    assert obj["engine"] == "dense" and obj["model"] == "gemma3-270m"
    assert obj["tokens_in"] == _prompt_tokens(SAMPLE.read_text(encoding="utf-8"))
    assert 1 <= obj["tokens_out"] <= 12
    assert obj["timings"]["prefill_s"] > 0
    assert "Margaret" in obj["answer"]
    assert obj["stopped"] in ("stop", "length") and obj["error"] is None
    # With --json no report table on stderr: the object carries it.
    assert "longctx report" not in err


# --- ask: folders, stdin, --concat -------------------------------------------------------------------------------


def test_ask_folder_one_answer_per_document(cli, folder):
    code, out, err = cli("ask", folder, QUESTION, "-n", "6", "--json")
    assert code == 0, err
    objs = _json_lines(out)
    # Sorted, recursive, *.txt and *.md by default; the .csv is not a document.
    assert [o["path"] for o in objs] == ["a.txt", "b.txt", "notes/c.md"]
    assert all(o["answer"] and o["tokens_out"] >= 1 for o in objs)
    assert objs[0]["tokens_in"] == _prompt_tokens(SCHOONER)
    assert objs[1]["tokens_in"] == _prompt_tokens(ADA)


def test_ask_folder_plain_prefixes_each_answer_with_its_path(cli, folder):
    code, out, err = cli("ask", folder, QUESTION, "-n", "4", "--glob", "*.txt", "--quiet")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("a.txt: ") and lines[1].startswith("b.txt: ")


def test_ask_folder_glob_picks_csv(cli, folder):
    code, out, err = cli("ask", folder, "Who was the keeper?", "-n", "4", "--glob", "*.csv", "--json")
    assert code == 0, err
    [obj] = _json_lines(out)
    assert obj["path"] == "d.csv"


def test_ask_stdin(cli):
    code, out, err = cli("ask", "-", QUESTION, "-n", "8", "--json", stdin_text=SCHOONER)
    assert code == 0, err
    [obj] = _json_lines(out)
    assert obj["path"] == "<stdin>"
    # All of stdin went in.
    assert obj["tokens_in"] == _prompt_tokens(SCHOONER)
    assert "Margaret" in obj["answer"]


def test_ask_concat_gives_one_object(cli, tmp_path):
    a = _write(tmp_path / "a.txt", ADA)
    b = _write(tmp_path / "b.txt", SCHOONER)
    code, out, err = cli("ask", a, b, QUESTION, "-n", "8", "--concat", "--json")
    assert code == 0, err
    [obj] = _json_lines(out)
    assert obj["path"] == f"{a} + {b}"
    # Both documents (and the separator) are in the prompt.
    assert obj["tokens_in"] > _prompt_tokens(ADA) + _n_tokens(SCHOONER)
    assert "Margaret" in obj["answer"]


# --- profiles, plan, bench ---------------------------------------------------------------------------------------


def test_profiles_list_and_show(cli):
    code, out, err = cli("profiles")
    assert code == 0, err
    assert "dense" in [line.split()[0] for line in out.splitlines() if line.strip()]

    code, out, err = cli("profiles", "show", "dense")
    assert code == 0, err
    shown = yaml.safe_load(out)
    assert shown["engine"] == "dense" and shown["chunk_size"] == 2048

    code, out, err = cli("profiles", "show", "dense", "--set", "chunk_size=512")
    assert code == 0, err
    assert yaml.safe_load(out)["chunk_size"] == 512


def test_plan_tokens_fits(cli):
    code, out, err = cli("plan", "--tokens", "4k")
    assert code == 0, err
    assert out.strip() == "fits"
    assert "4,096 tokens" in err


def test_plan_tokens_longer_than_model_context(cli):
    code, out, err = cli("plan", "--tokens", "1m")
    assert code == 6, err
    assert out.strip() == "does not fit"
    assert "too long" in err and f"{MAX_CONTEXT:,}" in err and "1,048,6" in err


def test_plan_document(cli):
    code, out, err = cli("plan", SAMPLE)
    assert code == 0, err
    assert out.strip() == "fits"
    # The plan counts the document's tokens, BOS included, plus a margin of 64 for the question.
    n = 1 + _n_tokens(SAMPLE.read_text(encoding="utf-8")) + 64
    assert f"document: {n:,} tokens" in err


def test_bench_json(cli, tmp_path):
    result = tmp_path / "bench.json"
    code, out, err = cli("bench", "--lengths", "256", "--steps", "2", "--compare", "none", "--set",
                         "compile_decode=true", "--json", result)
    assert code == 0, err
    assert out == ""
    data = json.loads(result.read_text())
    assert data["model"] == "gemma3-270m" and data["random_weights"] is False
    # The run keys that shape the measurement are recorded next to the engine's (compilation needs the GPU's
    # captured step: on CPU the counter says it did not happen).
    assert data["engine_settings"]["dense"] == {"engine": "dense", "chunk_size": 2048, "dtype": "auto",
                                                "decode_graph": True, "compile_decode": True,
                                                "fuse_projections": True, "prefill_graphs": True}
    [row] = data["rows"]
    assert {"engine", "context_tokens", "prefill_s", "decode_ms_per_token", "peak_gib"} <= row.keys()
    assert row["engine"] == "dense" and row["context_tokens"] == 256
    assert row["prefill_s"] > 0 and row["decode_ms_per_token"] > 0 and row["peak_gib"] > 0
    # The host's resident memory before the prefill (the model's weights at least) and what the run added to it.
    assert row["host_rss_before_gib"] > 0.5 and 0 <= row["host_peak_added_gib"] < row["host_rss_before_gib"]
    assert row["counters"]["decode_compiled_blocks"] is False
    assert row["counters"]["decode_fused_projections"] == "none"
    assert row["counters"]["decode_projections"] == "torch linear"
    assert row["counters"]["prefill_cuda_graphs"] is False  # CPU: the model's own modules


def test_bench_records_where_an_engine_runs_out_of_memory(cli, tmp_path, monkeypatch):
    """A length that does not fit is a row saying so (with the planned state), and the other lengths still run."""
    from engines.dense import DenseEngine

    prefill = DenseEngine.prefill

    def prefill_or_oom(self, ids, **kwargs):
        if ids.numel() > 300:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB")
        return prefill(self, ids, **kwargs)

    monkeypatch.setattr(DenseEngine, "prefill", prefill_or_oom)
    result = tmp_path / "bench.json"
    code, out, err = cli("bench", "--lengths", "256,512", "--steps", "2", "--compare", "none", "--json", result)
    assert code == 0, err
    small, big = json.loads(result.read_text())["rows"]
    assert small["context_tokens"] == 256 and small["decode_ms_per_token"] > 0
    assert big["context_tokens"] == 512 and "prefill_s" not in big
    assert big["out_of_memory"].startswith("CUDA out of memory") and big["planned_state_gib"] > 0
    assert "out of memory" in err


def test_bench_short_warmup(cli, tmp_path):
    """--warmup N warms up on the context's first N tokens (streaming engines at 1M); the file says so."""
    result = tmp_path / "bench.json"
    code, out, err = cli("bench", "--lengths", "256", "--steps", "2", "--compare", "none", "--warmup", "64",
                         "--json", result)
    assert code == 0, err
    data = json.loads(result.read_text())
    assert data["warmup_tokens"] == 64 and data["rows"][0]["context_tokens"] == 256
    code, out, err = cli("bench", "--lengths", "256", "--warmup", "-5")
    assert code == 4 and "--warmup takes" in _error_line(err)


def test_bench_profiles_and_their_baseline():
    """The profiles that run and the baseline run once beside them, whichever of them names dense."""
    from longctx_cli.cli import _bench_profiles

    def names(profile, compare):
        profs, base = _bench_profiles(profile, compare, None, {})
        return [p.name for p in profs], base and base.name

    assert names("resa", "dense") == (["resa"], "dense")
    assert names("dense", "dense") == (["dense"], None)  # dense is its own baseline
    assert names("resa", "none") == (["resa"], None)
    assert names("resa,dense", "dense") == (["resa"], "dense")
    assert names("resa, star", "dense") == (["resa", "star"], "dense")
    assert names("resa,dense", "none") == (["resa", "dense"], None)


# --- bad input: exit 3 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, content, expected", [
    ("empty.txt", b"", "empty document"),
    ("blank.txt", b"  \n\t\n   \n", "empty document"),
    ("binary.txt", b"GIF89a\x01\x00\x00\x00 some text", "binary file (NUL byte at byte offset 7)"),
    ("latin1.txt", "Hello world, caf\u00e9 noir".encode("latin-1"), "invalid byte 0xe9 at byte offset 16"),
], ids=["empty", "whitespace-only", "binary", "invalid-utf8"])
def test_ask_bad_document(cli, tmp_path, name, content, expected):
    path = _write(tmp_path / name, content)
    code, out, err = cli("ask", path, QUESTION, "-n", "4")
    assert code == 3, err
    line = _error_line(err)
    assert expected in line and str(path) in line
    assert out == ""


@pytest.mark.parametrize("name", ["missing.txt", "notes[v2].txt"])
def test_ask_missing_file(cli, tmp_path, name):
    path = tmp_path / name
    code, out, err = cli("ask", path, QUESTION)
    assert code == 3, err
    # The path is named as given (brackets too: the message is not rich markup).
    assert f"no such file or folder: {path}" in _error_line(err)


def test_ask_invalid_utf8_replace_goes_on(cli, tmp_path):
    path = _write(tmp_path / "latin1.txt", SCHOONER.replace("south-west", "s\u00fcd-west").encode("latin-1"))
    code, out, err = cli("ask", path, QUESTION, "-n", "4")
    assert code == 3 and "--encoding-errors replace" in _error_line(err)
    code, out, err = cli("ask", path, QUESTION, "-n", "4", "--encoding-errors", "replace")
    assert code == 0, err
    assert out.strip()


def test_ask_document_longer_than_context_refused_before_weights_load(cli, tmp_path, monkeypatch):
    sentence = "The keeper wrote the wind, the ships and the gulls in his green logbook every single evening. "
    text = sentence * 1900
    n_prompt = _prompt_tokens(text)
    assert n_prompt > MAX_CONTEXT + 4096  # the file really is too long for Gemma 3 270M
    path = _write(tmp_path / "long.txt", text)

    def no_weights(*args, **kwargs):
        loads.append(args)
        raise AssertionError("model weights loaded for a document that cannot fit")

    loads = []
    monkeypatch.setattr("longctx_cli.models.load_model", no_weights)
    monkeypatch.setattr("longctx_cli.models._load_model", no_weights)
    code, out, err = cli("ask", path, QUESTION, "-n", "8")
    assert loads == []
    assert code == 6, err
    line = _error_line(err)
    assert f"prompt of {n_prompt:,} tokens" in line and f"{MAX_CONTEXT:,} tokens" in line
    assert str(path) in line
    assert out == ""


# --- configuration errors: exit 4; model errors: exit 5 ----------------------------------------------------------


@pytest.mark.parametrize("profile_yaml, options, code, expected", [
    (None, ["--profile", "nope"], 4, "unknown profile 'nope'"),
    ("engine: dense\nchunk_sise: 512\n", [], 4, "unknown key 'chunk_sise'"),
    ("engine: dense\nchunk_size: [512\n", [], 4, "malformed YAML"),
    ("engine: warp\n", [], 4, "unknown engine 'warp'"),
    (None, ["--set", "chunk_size=-3"], 4, "bad value for chunk_size: -3"),
    (None, ["--model", "/nonexistent/dir"], 5, "no such model folder or file: /nonexistent/dir"),
    (None, ["--model", "random:nope"], 5, "unknown random preset 'nope'"),
    (None, ["--model", "someorg/somemodel"], 5, "huggingface-cli download someorg/somemodel"),
], ids=["unknown-profile", "unknown-key", "malformed-yaml", "unknown-engine", "bad-value", "model-path",
        "random-preset", "hub-id-not-cached"])
def test_ask_config_and_model_errors(cli, tmp_path, schooner_file, profile_yaml, options, code, expected):
    if profile_yaml is not None:
        profile = _write(tmp_path / "custom.yaml", profile_yaml)
        options = ["--profile", str(profile), *options]
    got, out, err = cli("ask", schooner_file, QUESTION, *options)
    assert got == code, err
    line = _error_line(err)
    assert expected in line
    if profile_yaml is not None:
        assert str(tmp_path / "custom.yaml") in line
    assert out == ""


# --- out of memory and Ctrl-C ------------------------------------------------------------------------------------


def test_ask_out_of_memory(cli, schooner_file, monkeypatch):
    def oom(self, ids, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(DenseEngine, "prefill", oom)
    code, out, err = cli("ask", schooner_file, QUESTION, "-n", "4")
    assert code == 7, err
    line = _error_line(err)
    assert "out of memory" in line and "2.00 GiB" in line and "chunk_size" in line and "--chunk-size" in line
    assert "cpu needs ~" in line and "GiB free now" in line  # needed vs free per device, from the plan


@pytest.fixture
def interrupt_after_3_tokens(monkeypatch):
    """Engine.answer yields its first 3 real tokens, then the user presses Ctrl-C; returns those tokens."""
    real = Engine.answer
    produced: list[int] = []

    def answer(self, state, question_ids, max_new_tokens, sampler):
        stream = real(self, state, question_ids, max_new_tokens, sampler)
        for token in itertools.islice(stream, 3):
            produced.append(token)
            yield token
        stream.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(DenseEngine, "answer", answer)
    return produced


def test_ctrl_c_during_decode_flushes_partial_answer(cli, schooner_file, interrupt_after_3_tokens):
    code, out, err = cli("ask", schooner_file, QUESTION, "-n", "12")
    assert code == 130, err
    partial = load_tokenizer(None).decode(interrupt_after_3_tokens, skip_special_tokens=True).strip()
    assert len(interrupt_after_3_tokens) == 3 and partial
    assert out.strip() == partial
    assert "longctx report" in err and "stopped: interrupted" in err


def test_ctrl_c_during_decode_json(cli, schooner_file, interrupt_after_3_tokens):
    code, out, err = cli("ask", schooner_file, QUESTION, "-n", "12", "--json")
    assert code == 130, err
    [obj] = _json_lines(out)
    assert obj["stopped"] == "interrupted" and obj["tokens_out"] == 3
    assert obj["answer"] == load_tokenizer(None).decode(interrupt_after_3_tokens, skip_special_tokens=True).strip()


def test_ctrl_c_during_prefill(cli, schooner_file, monkeypatch):
    def interrupted(self, ids, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(DenseEngine, "prefill", interrupted)
    code, out, err = cli("ask", schooner_file, QUESTION, "-n", "4", "--json")
    assert code == 130, err
    [obj] = _json_lines(out)
    assert obj["stopped"] == "interrupted" and obj["answer"] == "" and obj["tokens_out"] == 0


# --- partial failure: exit 8 -------------------------------------------------------------------------------------


def test_folder_with_one_bad_document(cli, tmp_path):
    root = tmp_path / "docs"
    _write(root / "a.txt", SCHOONER)
    bad = _write(root / "b.txt", b"\x7fELF\x02\x01\x01\x00\x00\x00 not text")
    _write(root / "c.txt", ADA)
    code, out, err = cli("ask", root, QUESTION, "-n", "4", "--json")
    assert code == 8, err
    objs = _json_lines(out)
    assert [o["path"] for o in objs] == ["a.txt", "b.txt", "c.txt"]
    good = [objs[0], objs[2]]
    assert all(o["answer"] and o["stopped"] in ("stop", "length") and o["error"] is None for o in good)
    assert objs[1]["stopped"] == "error" and "binary file" in objs[1]["error"]
    line = _error_line(err)
    assert "binary file" in line and str(bad) in line
    assert "1 of 3 documents failed" in err


# --- version, help, usage ----------------------------------------------------------------------------------------


def test_version(cli):
    code, out, err = cli("--version")
    assert code == 0, err
    assert out.strip() == f"longctx {__version__}"


def test_help(cli):
    code, out, err = cli("-h")
    assert code == 0, err
    assert all(command in out for command in ("ask", "bench", "plan", "profiles"))
    code, out, err = cli("ask", "-h")
    assert code == 0, err
    assert "--concat" in out and "--encoding-errors" in out


def test_usage_error_exit_2(cli):
    code, out, err = cli("ask", "--no-such-option", "x", "y")
    assert code == 2
    assert "--no-such-option" in err and "internal error" not in err


def test_compiled_kernels_are_cached_under_the_home(tmp_path, capsys, monkeypatch):
    """Inductor's and Triton's caches go under $LONGCTX_HOME (a shape compiles once per machine, across
    reboots); a cache folder the user chose is kept."""
    import os

    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so that it is restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    code, _, err = run_cli(["plan", "--model", "random:gemma3-270m", "--tokens", "1k"], capsys, monkeypatch)
    assert code == 0, err
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"
