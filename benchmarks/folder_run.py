"""One question over a folder of documents of different lengths, as a pipeline asks it: where the wall clock goes.

One `longctx ask FOLDER -q QUESTION --json` process over N documents whose lengths spread geometrically between
two bounds (text from samples/haystack, cut to about the wanted token count). Reported: the process wall clock
measured from outside, the start-up (everything the first document's report holds besides its own work), and per
document the report's parts: its compute (prefill, question, decode) against everything else (tokenizing,
state, compilation or graph capture inside those parts shows up as a slower document).

    python benchmarks/folder_run.py --docs 20 --lengths 2k:32k --device cuda --out result.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Who is the first person named in the text?"
COMPUTE = ("prefill_s", "question_s", "decode_s")


def _documents(n: int, lo: int, hi: int, folder: Path) -> list[int]:
    """n files doc_00.txt.. of about lo..hi tokens (about four characters a token), each a different slice."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "samples" / "haystack").glob("*.txt")))
    sizes = [round(lo * (hi / lo) ** (i / max(1, n - 1))) for i in range(n)]
    for i, tokens in enumerate(sizes):
        start = (i * 7919) % max(1, len(text) - 4 * tokens)
        (folder / f"doc_{i:02d}.txt").write_text(text[start:start + 4 * tokens], encoding="utf-8")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--lengths", default="2k:32k", help="LO:HI tokens")
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", default="dense")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from longctx_cli.report import run_stamp
    from longctx_cli.units import parse_count

    lo, hi = (parse_count(x) for x in args.lengths.split(":"))
    script = Path(sys.executable).with_name("longctx")
    longctx = [str(script)] if script.exists() else [sys.executable, "-m", "longctx_cli"]
    with tempfile.TemporaryDirectory() as tmp:
        sizes = _documents(args.docs, lo, hi, Path(tmp))
        cmd = [*longctx, "ask", tmp, "-q", QUESTION, "--profile", args.profile, "--device", args.device, "-n",
               str(args.new_tokens), "--state", "off", "--json", "--set", "stop=[]"]
        if args.model:
            cmd += ["--model", args.model]
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"longctx failed ({done.returncode}): {done.stderr[-2000:]}")
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    rows = []
    for report in reports:
        parts = report["timings"]["wall"]
        compute = sum(parts.get(k, 0.0) for k in COMPUTE)
        rows.append({"path": Path(report["path"]).name, "tokens_in": report["tokens_in"], "compute_s": compute,
                     "report_total_s": parts["total_s"], "parts": parts,
                     "counters": {k: v for k, v in report["counters"].items() if not isinstance(v, (dict, list))}})
    first = rows[0]
    startup = first["report_total_s"] - first["compute_s"] - sum(
        first["parts"].get(k, 0.0) for k in ("tokenize_s", "prompt_layout_s"))
    compute = sum(r["compute_s"] for r in rows)
    documents = sum(r["report_total_s"] for r in rows) - startup
    result = {**run_stamp(), "command": " ".join(["python", "benchmarks/folder_run.py", *sys.argv[1:]]),
              "device": args.device, "profile": args.profile, "model": args.model or "gemma3-270m",
              "planned_tokens": sizes, "process_wall_s": wall, "startup_s": startup, "documents_wall_s": documents,
              "compute_s": compute, "documents_over_compute": documents / compute,
              "process_over_compute": wall / compute, "rows": rows}
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
