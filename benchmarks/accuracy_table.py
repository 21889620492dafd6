"""One markdown table per model from accuracy results: engine x task x length, each engine's score against
dense on the same samples, and which cells meet a target.

A target applies to a cell where dense scores at least `--decides` (the tasks the model can do at all); the
table marks a cell below its engine's target in bold and counts them.

    python benchmarks/accuracy_table.py qwen.json --targets resa=0.97,star=0.95,ltri-stream=0.9
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def _label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _dense(result: dict) -> dict:
    """(task, length) -> (dense's mean score, samples) over every sample that dense answered (a merged file may
    hold more samples for some profiles than for others; each profile's ratio uses its own samples' dense)."""
    scores = {}
    for record in result["samples"]:
        run = record["results"].get("dense")
        if run and run.get("score") is not None:
            scores.setdefault((record["task"], record["length"]), []).append(run["score"])
    return {key: (sum(v) / len(v), len(v)) for key, v in scores.items()}


def table(result: dict, targets: dict[str, float], decides: float) -> tuple[str, list[str]]:
    """The markdown table and the cells that miss their target ("resa niah_single_1 32K: 50.0 / 60.0")."""
    rows = result["rows"]
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    cell = {(r["profile"], r["task"], r["length"]): r for r in rows}
    dense = _dense(result)
    lines = ["| engine | task | " + " | ".join(_label(n) for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for task in tasks:
        values = [dense.get((task, n)) for n in lengths]
        lines.append(f"| dense | {task} | " + " | ".join(
            "" if v is None or v[0] is None else f"{v[0]:.1f} (n={v[1]})" for v in values) + " |")
    missed = []
    for prof in profiles:
        for task in tasks:
            out = []
            for n in lengths:
                r = cell.get((prof, task, n))
                if r is None or r["score"] is None:
                    out.append("" if r is None else "not run")
                    continue
                text = f"{r['score']:.1f}"
                if r["dense_score"]:
                    text += f" ({100 * r['score'] / r['dense_score']:.0f}%)"
                if r.get("partial"):  # a run stopped inside this cell: its samples so far
                    text += f" (partial, n={r['samples']})"
                goal = targets.get(r["engine"], targets.get(prof))
                if goal and r["dense_score"] is not None and r["dense_score"] >= decides:
                    if r["score"] < goal * r["dense_score"] - 1e-9:
                        text = f"**{text}**"
                        missed.append(f"{prof} {task} {_label(n)}: {r['score']:.1f} / {r['dense_score']:.1f}")
                out.append(text)
            lines.append(f"| {prof} | {task} | " + " | ".join(out) + " |")
    return "\n".join(lines), missed


def read_result(path: str | Path) -> dict:
    """A result file: JSON, or gzipped JSON (`.json.gz`: results/ keeps files of every sample that way)."""
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--targets", default="", help="engine=fraction of dense, comma-separated")
    parser.add_argument("--decides", type=float, default=50.0, help="dense score from which a target applies")
    args = parser.parse_args()
    targets = {k: float(v) for k, v in (t.split("=") for t in args.targets.split(",") if t)}
    for path in args.results:
        result = read_result(path)
        text, missed = table(result, targets, args.decides)
        print(f"### {result['model']} ({path})\n\n{text}\n")
        goals = ", ".join(f"{k} >= {v:.0%} of dense" for k, v in targets.items())
        if targets:
            print(f"Targets ({goals}, where dense >= {args.decides:g}): "
                  + (f"{len(missed)} cells miss: " + "; ".join(missed) if missed else "every cell meets its target")
                  + "\n")


if __name__ == "__main__":
    main()
