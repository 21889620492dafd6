"""Read once, ask many: time to first token of a first question, of a second one in the same process, and of a
first question in a new process that reads the saved state, for each profile and length.

Drives `longctx ask` itself (fresh processes, `--json`), with a home of its own per profile and length:

    python benchmarks/state_reuse.py --model random:llama-3.1-8b --profiles dense,resa,sas-pattern \\
        --lengths 32k --device cuda --out state_reuse_gpu.json
    python benchmarks/state_reuse.py --lengths 8k --out state_reuse_cpu.json      # embedded model, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ("What was the name of the schooner?", "Who kept the lighthouse?")


def longctx_command() -> list[str]:
    script = Path(sys.executable).with_name("longctx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "longctx_cli"]


def _ask(args: list[str], env: dict) -> list[dict]:
    done = subprocess.run([*longctx_command(), "ask", *args, "--json", "--quiet"], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"longctx ask {' '.join(args[:6])}... failed ({done.returncode}): {done.stderr[-1500:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def document(tokens: int, model: str | None, folder: Path) -> Path:
    """A document of about `tokens` tokens: the sample story repeated (byte tokenizer of random presets: one
    token a byte; the embedded model: about four characters a token)."""
    story = (ROOT / "samples" / "lighthouse.txt").read_text(encoding="utf-8")
    chars = tokens if model and model.startswith("random:") else tokens * 4
    path = folder / f"doc_{tokens}.txt"
    path.write_text(((story + "\n\n") * (chars // len(story) + 1))[:chars], encoding="utf-8")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--profiles", default="dense,resa")
    ap.add_argument("--lengths", default="8k")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from longctx_cli.home import longctx_home
    from longctx_cli.units import parse_count
    from longctx_cli.report import run_stamp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        common = ["-n", str(args.new_tokens), "--device", args.device, "--set", "stop=[]"]
        common += ["--model", args.model] if args.model else []
        for s in args.sets:
            common += ["--set", s]
        for length in map(parse_count, args.lengths.split(",")):
            doc = document(length, args.model, Path(tmp))
            for profile in args.profiles.split(","):
                # A home of this run's own (its converted models linked in), emptied between profiles.
                home = Path(tmp) / f"home-{profile}-{length}"
                home.mkdir()
                (home / "models").symlink_to(longctx_home() / "models", target_is_directory=True)
                run_env = {**env, "LONGCTX_HOME": str(home)}
                q1, q2 = _ask([str(doc), "-q", QUESTIONS[0], "-q", QUESTIONS[1], "--profile", profile,
                               "--state", "write", *common], run_env)
                [again] = _ask([str(doc), "-q", QUESTIONS[0], "--profile", profile, "--state", "read", *common],
                               run_env)
                row = {"profile": profile, "engine": q1["engine"], "context_tokens": q1["tokens_in"],
                       "prefill_s": q1["timings"]["prefill_s"],
                       "first_token_q1_s": q1["timings"]["first_token_s"],
                       "first_token_q2_same_process_s": q2["timings"]["first_token_s"],
                       # The copy before the first question, and the wait for the file after the last.
                       "state_copy_s": q1["timings"]["wall"].get("state_write_s"),
                       "state_write_wait_s": q2["timings"]["wall"].get("state_write_s"),
                       "state_q1": q1["state"], "state_q2": q2["state"],
                       "first_token_q1_new_process_s": again["timings"]["first_token_s"],
                       "state_read_s": again["timings"]["wall"].get("state_read_s"), "state_new_process": again["state"],
                       "same_answer_new_process": again["answer_ids"] == q1["answer_ids"]}
                row["q2_over_q1"] = row["first_token_q2_same_process_s"] / row["first_token_q1_s"]
                if row["state_read_s"] is not None and row["prefill_s"]:
                    row["read_over_prefill"] = row["state_read_s"] / row["prefill_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {**run_stamp(), "model": args.model or "gemma3-270m", "device": args.device, "rows": rows,
              "note": "random weights: speed only" if args.model and args.model.startswith("random:") else None}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
