"""The current accuracy table of each named model, composed from the result files of the shipped profiles.

A model's table takes each engine's cells from the runs listed in SOURCES (later sources override earlier ones
for the same cell, so a 60-sample cell replaces its 20-sample run). Each cell is the engine's score and its % of
dense on the engine's own samples; bold marks a cell below its engine's target where dense >= 50. benchmarks/
README.md holds these tables as printed (tests/test_accuracy_grid.py keeps the two in step).

    python benchmarks/accuracy_current.py            # both tables, then the cells that miss a target
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.accuracy_table import _dense, read_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LENGTHS = (2048, 4096, 8192, 16384, 32768)
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey", "niah_multiquery", "niah_multivalue",
         "vt", "cwe", "fwe")
TARGETS = {"resa": 97.0, "star": 95.0, "ltri-stream-4k": 90.0}  # % of dense; sas-pattern: as measured
DECIDES = 50.0  # dense's score from which a cell decides a target
EVERY_BLOCK = "every block kept"  # resa's floor of 1,024 blocks covers the document: dense decoding

_Q, _G = "qwen2.5-coder-0.5b", "gemma3-270m"
_SHORT = (2048, 4096, 8192)
# model -> (dense's run, [(engine, [(file, profile in the file, lengths or None)], cells written as EVERY_BLOCK)])
SOURCES = {
    _Q: ("2026-11-24_h100_accuracy_grid_qwen2.5-coder-0.5b_resa_min512_star_min16k.json.gz", [
        ("resa", [("2026-11-24_h100_accuracy_grid_qwen2.5-coder-0.5b_resa_min512_star_min16k.json.gz", "resa", _SHORT),
                  ("2026-11-29_h200_accuracy_qwen2.5-coder-0.5b_resa_32k.json.gz", "resa", None),
                  ("2026-11-29_h200_accuracy_qwen2.5-coder-0.5b_resa_32k_multiquery_seeds0-6_a0f8982.json.gz", "resa",
                   None)],
         {(t, 16384) for t in TASKS}),
        ("star", [("2026-11-24_h100_accuracy_grid_qwen2.5-coder-0.5b_resa_min512_star_min16k.json.gz", "star", None)],
         set()),
        ("sas-pattern", [("2026-11-24_h100_accuracy_grid_qwen2.5-coder-0.5b_2k-32k.json.gz", "sas-pattern", None),
                         ("2026-11-27_h200_accuracy_qwen2.5-coder-0.5b_sas-pattern_32k.json", "sas-pattern", None)],
         set()),
        ("ltri-stream-4k", [
            ("2026-11-27_h200_accuracy_qwen2.5-coder-0.5b_ltri-stream-4k_2k.json.gz", "ltri-stream-4k", None),
            ("2026-11-25_h100_accuracy_qwen2.5-coder-0.5b_ltri-stream-4k_every_layer_question_votes_4k-32k.json.gz",
             "ltri-stream-4k", None),
            ("2026-11-27_h200_accuracy_qwen2.5-coder-0.5b_ltri-stream-4k_32k_seeds0-2_budget_splits.json.gz",
             "ltri-stream-4k", None)], set()),
    ]),
    _G: ("2026-11-24_h100_accuracy_grid_gemma3-270m_resa_min512_star_min16k_sas.json.gz", [
        ("resa", [("2026-11-24_h100_accuracy_grid_gemma3-270m_resa_min512_star_min16k_sas.json.gz", "resa", _SHORT),
                  ("2026-11-25_h100_accuracy_gemma3-270m_resa_star_singles_16k_32k.json.gz", "resa", None),
                  ("2026-11-29_h200_accuracy_gemma3-270m_resa_32k_single_needles_seeds0-2.json.gz", "resa",
                   None),
                  ("2026-11-29_h200_accuracy_gemma3-270m_resa_32k_single_needles_seeds0-5_a0f8982.json.gz", "resa",
                   None)],
         {(t, 16384) for t in TASKS[3:]}),
        ("star", [("2026-11-24_h100_accuracy_grid_gemma3-270m_resa_min512_star_min16k_sas.json.gz", "star", None),
                  ("2026-11-25_h100_accuracy_gemma3-270m_resa_star_singles_16k_32k.json.gz", "star", None)], set()),
        ("sas-pattern", [("2026-11-24_h100_accuracy_grid_gemma3-270m_resa_min512_star_min16k_sas.json.gz",
                          "sas-pattern", None)], set()),
        ("ltri-stream-4k", [
            ("2026-11-25_h100_accuracy_gemma3-270m_ltri-stream-4k_every_layer_question_votes_2k-32k.json.gz",
             "ltri-stream-4k", None),
            ("2026-11-27_h200_accuracy_gemma3-270m_ltri-stream-4k_16k_niah_single_3_seeds0-2_budget_splits.json.gz",
             "ltri-stream-4k", None)], set()),
    ]),
}
# Dense cells the main grid lacks, from another run of the same prompts.
DENSE_MORE = {_G: "2026-11-25_h100_accuracy_gemma3-270m_resa_star_singles_16k_32k.json.gz"}


@functools.cache
def _result(path: Path) -> dict:
    return read_result(path)


def _rows(file: str, profile: str, lengths) -> dict:
    return {(r["task"], r["length"]): r for r in _result(RESULTS / file)["rows"]
            if r["profile"] == profile and (lengths is None or r["length"] in lengths)}


def _cell(row: dict) -> tuple[str, float | None]:
    score, dense, n = row["score"], row["dense_score"], row["samples"]
    pct = 100 * score / dense if dense else None
    text = f"{score:.1f} ({'-' if pct is None else f'{pct:.0f}%'}{'' if n == 20 else f', n={n}'})"
    return text, pct


def table(model: str) -> tuple[str, list[str]]:
    """The markdown table of a model and the cells that miss their target."""
    dense_file, engines = SOURCES[model]
    dense = {}
    for file in filter(None, (dense_file, DENSE_MORE.get(model))):
        for key, mean_and_count in _dense(_result(RESULTS / file)).items():
            dense.setdefault(key, mean_and_count)
    lines = ["| engine | task | " + " | ".join(f"{n // 1024}K" for n in LENGTHS) + " |",
             "|---|---|" + "---|" * len(LENGTHS)]
    for task in TASKS:
        cells = [f"{dense[task, n][0]:.1f}" + ("" if dense[task, n][1] == 20 else f" (n={dense[task, n][1]})")
                 if (task, n) in dense else "" for n in LENGTHS]
        lines.append(f"| dense | {task} | " + " | ".join(cells) + " |")
    misses = []
    for engine, sources, every_block in engines:
        got = {}
        for file, profile, lengths in sources:
            got.update(_rows(file, profile, lengths))
        for task in TASKS:
            cells = []
            for n in LENGTHS:
                if (task, n) in every_block:
                    cells.append(EVERY_BLOCK)
                    continue
                if (task, n) not in got:
                    cells.append("")
                    continue
                text, pct = _cell(got[task, n])
                target = TARGETS.get(engine)
                if target and pct is not None and got[task, n]["dense_score"] >= DECIDES and pct < target:
                    text = f"**{text}**"
                    misses.append(f"{engine} {task} {n // 1024}K: {text}")
                cells.append(text)
            if any(cells):
                lines.append(f"| {engine} | {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines), misses


def main() -> None:
    for model in SOURCES:
        text, misses = table(model)
        print(f"{model}\n\n{text}\n\nbelow target: {', '.join(misses) or 'none'}\n")


if __name__ == "__main__":
    main()
