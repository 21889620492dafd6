"""benchmarks/accuracy_grid.py's merge and benchmarks/accuracy_table.py's table, on hand-made bench results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


grid, table = _script("accuracy_grid"), _script("accuracy_table")


def _part(profile: str, engine: str, scores: list[float], dense: list[float], dense_answer="7") -> dict:
    """One bench --tasks result: a profile and dense on len(scores) samples of niah_single_1 at 4K."""
    samples = [{"task": "niah_single_1", "length": 4096, "index": i, "seed": 0, "prompt_hash": f"h{i}",
                "results": {profile: {"answer": "x", "score": s}, "dense": {"answer": dense_answer, "score": d}}}
               for i, (s, d) in enumerate(zip(scores, dense))]
    row = {"task": "niah_single_1", "length": 4096, "engine": engine, "profile": profile, "samples": len(scores),
           "score": sum(scores) / len(scores), "dense_score": sum(dense) / len(dense)}
    return {"command": f"longctx bench --profile {profile}", "model": "m", "mode": "accuracy",
            "engine_settings": {profile: {"engine": engine}, "dense": {"engine": "dense"}},
            "rows": [row], "samples": samples}


def _write(tmp_path, name, result) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return path


def test_merge_joins_each_samples_results_and_counts_differing_dense(tmp_path):
    a = _write(tmp_path, "a", _part("resa", "resa", [100, 0], [100, 100]))
    b = _write(tmp_path, "b", _part("star", "star", [100, 100], [100, 100], dense_answer="8"))
    merged = grid.merge([a, b], order=["star", "resa"])
    assert [r["profile"] for r in merged["rows"]] == ["star", "resa"]
    assert list(merged["engine_settings"]) == ["star", "resa", "dense"]
    assert [sorted(s["results"]) for s in merged["samples"]] == [["dense", "resa", "star"]] * 2
    assert merged["dense_answers_differing"] == 2
    assert merged["cells"] == 2 and sorted(merged["commands"]) == ["longctx bench --profile resa",
                                                                    "longctx bench --profile star"]
    again = grid.merge([_write(tmp_path, "m", merged)])
    assert again["cells"] == 2 and again["rows"] == merged["rows"]


def test_merge_joins_a_cell_split_by_seed_without_dense(tmp_path):
    """`--compare none` parts of one cell on two seeds: one row over every sample, no dense column."""
    parts = []
    for seed, scores in ((0, [100, 0]), (1, [100, 100, 100])):
        part = _part("ltri-stream", "ltri-stream", scores, scores)
        part["engine_settings"].pop("dense")
        for record in part["samples"]:
            record["seed"], record["prompt_hash"] = seed, f"{seed}-{record['index']}"
            record["results"].pop("dense")
        part["rows"][0]["dense_score"] = None
        parts.append(_write(tmp_path, f"s{seed}", part))
    merged = grid.merge(parts)
    assert list(merged["engine_settings"]) == ["ltri-stream"]
    (row,) = merged["rows"]
    assert row["samples"] == 5 and row["score"] == 80.0 and row["dense_score"] is None
    assert len(merged["samples"]) == 5


def test_merge_refuses_results_that_disagree(tmp_path):
    a = _part("resa", "resa", [100], [100])
    b = _part("resa", "resa", [100], [100])
    b["engine_settings"]["resa"]["keep_ratio"] = 0.2
    with pytest.raises(SystemExit, match="settings of resa differ"):
        grid.merge([_write(tmp_path, "a", a), _write(tmp_path, "b", b)])
    c = _part("star", "star", [100], [100])
    c["samples"][0]["prompt_hash"] = "other"
    with pytest.raises(SystemExit, match="two prompts"):
        grid.merge([_write(tmp_path, "a", a), _write(tmp_path, "c", c)])


def test_table_marks_the_cells_below_target_where_dense_decides():
    result = _part("resa", "resa", [100, 0], [100, 100])
    text, missed = table.table(result, {"resa": 0.97}, decides=50)
    assert "| dense | niah_single_1 | 100.0 (n=2) |" in text
    assert "| resa | niah_single_1 | **50.0 (50%)** |" in text
    assert missed == ["resa niah_single_1 4K: 50.0 / 100.0"]
    # Where dense cannot do the task, no target applies.
    low = _part("resa", "resa", [0, 0], [0, 100])
    assert table.table(low, {"resa": 0.97}, decides=60)[1] == []
    with pytest.raises(SystemExit, match="no finished cell"):
        grid.merge([])
    # A run stopped inside a cell kept its samples so far: the table says so.
    stopped = _part("resa", "resa", [100], [100])
    stopped["rows"][0]["partial"] = True
    assert "| resa | niah_single_1 | 100.0 (100%) (partial, n=1) |" in table.table(stopped, {}, decides=50)[0]


def test_grouped_profiles_run_in_one_process_and_resume_by_member(tmp_path):
    args = grid.argparse.Namespace(profiles="resa+star,ltri-stream", tasks="niah_single_1", lengths="4k,8k",
                                   split="task", samples=2, seed=0, model=None, set=None)
    cells = grid._cells(args)
    assert cells[0][0] == "ltri-stream"  # streaming engines start first
    cmd = grid._command(args, *cells[1], tmp_path / "x.json")
    assert cmd[cmd.index("--profile") + 1] == "resa,star"
    done = _part("resa", "resa", [1.0], [1.0])
    done["rows"][0]["length"] = 8192
    star = _part("star", "star", [1.0], [1.0])
    star["rows"][0]["length"] = 8192
    resumed = _write(tmp_path, "resumed", grid.merge([_write(tmp_path, "a", done), _write(tmp_path, "b", star)]))
    # Both members finished 8K; 4K is still to run for the group.
    skip = grid._done_cells(str(resumed))
    assert ("resa", "niah_single_1", "8192") in skip and ("star", "niah_single_1", "8192") in skip
    assert grid._left("resa+star", "niah_single_1", "4096,8192", skip) == ["4096"]
    assert grid._left("resa+sas-pattern", "niah_single_1", "8192", skip) == ["8192"]


def test_readme_holds_the_current_tables_and_no_cell_misses_its_target():
    """benchmarks/README.md's per-model accuracy tables are accuracy_current.py's output from the committed
    result files (a new run changes both together), and no deciding cell there is below its engine's target."""
    current = _script("accuracy_current")
    readme = (BENCH / "README.md").read_text()
    for model in current.SOURCES:
        text, misses = current.table(model)
        assert text in readme, f"benchmarks/README.md's {model} table differs from accuracy_current.py's"
        assert misses == []
        assert text.count("\n") > 20


def test_a_cell_below_its_target_is_bold_and_counted(tmp_path, monkeypatch):
    current = _script("accuracy_current")
    rows = [{"profile": "resa", "task": "niah_single_1", "length": 2048, "score": 90.0, "dense_score": 100.0,
             "samples": 20}]
    samples = [{"task": "niah_single_1", "length": 2048, "results": {"dense": {"score": 100.0}}}] * 20
    (tmp_path / "r.json").write_text(json.dumps({"rows": rows, "samples": samples}))
    monkeypatch.setattr(current, "RESULTS", tmp_path)
    monkeypatch.setattr(current, "SOURCES", {"m": ("r.json", [("resa", [("r.json", "resa", None)], set())])})
    monkeypatch.setattr(current, "DENSE_MORE", {})
    text, misses = current.table("m")
    assert "| dense | niah_single_1 | 100.0 |" in text
    assert "| resa | niah_single_1 | **90.0 (90%)** |" in text and len(misses) == 1
