"""`longctx bench --tasks`: the accuracy harness end to end on the embedded model (dense, short length)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture
def cli(capsys, monkeypatch):
    return lambda *args: run_cli([str(a) for a in args], capsys, monkeypatch)


def test_bench_tasks_end_to_end_next_to_dense(cli, tmp_path):
    """Two profiles' engines (star, resa) and the dense baseline, run once, on the same samples: each row's score
    and dense_score are the means of their own engine's sample scores."""
    out = tmp_path / "acc.json"
    code, stdout, err = cli("bench", "--profile", "star,resa", "--tasks", "niah_single_1,vt", "--lengths", "640",
                            "--samples", "1", "-n", "6", "--set", "min_block_size=256", "--json", out)
    assert code == 0, err
    assert stdout == ""
    assert "accuracy: gemma3-270m" in err
    result = json.loads(out.read_text())
    assert result["mode"] == "accuracy" and result["model"] == "gemma3-270m"
    assert [(r["task"], r["length"], r["samples"], r["engine"]) for r in result["rows"]] == [
        ("niah_single_1", 640, 1, "star"), ("niah_single_1", 640, 1, "resa"),
        ("vt", 640, 1, "star"), ("vt", 640, 1, "resa")]
    # --set went to the profile that has the key.
    assert result["engine_settings"]["star"]["min_block_size"] == 256
    assert "min_block_size" not in result["engine_settings"]["resa"]
    assert len({s["prompt_hash"] for s in result["samples"]}) == 2
    for sample in result["samples"]:
        assert set(sample["results"]) == {"star", "resa", "dense"}
        for run in sample["results"].values():
            assert sample["expected"] and isinstance(run["answer"], str)
            # The prompt fills the length minus the answer budget exactly (budget = min(RULER's, -n 6)).
            assert run["prompt_tokens"] == 640 - 6
            found = sum(e.lower() in run["answer"].lower() for e in sample["expected"])
            assert run["score"] == pytest.approx(100 * found / len(sample["expected"]))
    for row in result["rows"]:
        mine = [s["results"] for s in result["samples"] if s["task"] == row["task"]]
        assert row["score"] == pytest.approx(sum(r[row["profile"]]["score"] for r in mine) / len(mine))
        assert row["dense_score"] == pytest.approx(sum(r["dense"]["score"] for r in mine) / len(mine))


def test_bench_tasks_bad_arguments(cli):
    code, _, err = cli("bench", "--tasks", "niah_nope", "--lengths", "1k")
    assert code == 4 and "unknown task 'niah_nope'" in err
    code, _, err = cli("bench", "--tasks", "vt", "--lengths", "1k", "--depths", "deep")
    assert code == 4 and "--depths" in err
    code, _, err = cli("bench", "--profile", "star,resa", "--tasks", "vt", "--set", "top_k=3")
    assert code == 4 and "--set top_k: no profile among star, resa has this key" in err
    code, _, err = cli("bench", "--profile", "resa,resa", "--tasks", "vt")
    assert code == 4 and "names a profile twice" in err
    code, _, err = cli("bench", "--profile", "star,resa", "--gpus", "2", "--tasks", "vt")
    assert code == 4 and "--gpus runs one star profile" in err


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
