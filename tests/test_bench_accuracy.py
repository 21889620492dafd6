"""`longctx bench --tasks`: the accuracy harness end to end on the embedded model (dense, short length)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def cli(capsys, monkeypatch):
    return lambda *args: run_cli([str(a) for a in args], capsys, monkeypatch)


def test_bench_tasks_dense_end_to_end(cli, tmp_path):
    out = tmp_path / "acc.json"
    code, stdout, err = cli("bench", "--tasks", "niah_single_1,vt", "--lengths", "1k", "--samples", "2",
                            "-n", "12", "--json", out)
    assert code == 0, err
    assert stdout == ""
    assert "accuracy: gemma3-270m" in err
    result = json.loads(out.read_text())
    assert result["mode"] == "accuracy" and result["model"] == "gemma3-270m"
    assert [(r["task"], r["length"], r["samples"]) for r in result["rows"]] == [("niah_single_1", 1024, 2),
                                                                              ("vt", 1024, 2)]
    assert len(result["samples"]) == 4
    hashes = {s["prompt_hash"] for s in result["samples"]}
    assert len(hashes) == 4
    for sample in result["samples"]:
        run = sample["results"]["dense"]
        assert sample["expected"] and isinstance(run["answer"], str)
        assert 0 <= run["score"] <= 100
        # The prompt fills the length minus the answer budget exactly (budget = min(RULER's, -n 12)).
        assert run["prompt_tokens"] == 1024 - 12
        found = sum(e.lower() in run["answer"].lower() for e in sample["expected"])
        assert run["score"] == pytest.approx(100 * found / len(sample["expected"]))
    niah = result["rows"][0]
    # Dense compared with itself; the small base model finds a number needle in 1K tokens of filler.
    assert niah["score"] == niah["dense_score"] and niah["score"] >= 50


def test_bench_tasks_bad_arguments(cli):
    code, _, err = cli("bench", "--tasks", "niah_nope", "--lengths", "1k")
    assert code == 4 and "unknown task 'niah_nope'" in err
    code, _, err = cli("bench", "--tasks", "vt", "--lengths", "1k", "--depths", "deep")
    assert code == 4 and "--depths" in err


def test_bench_plot_without_matplotlib_is_a_clear_error(cli, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _, err = cli("bench", "--tasks", "niah_single_1", "--lengths", "1k", "--samples", "1", "-n", "8",
                       "--plot", tmp_path / "p.png")
    assert code == 4 and "matplotlib" in err
