"""What one question costs from the shell: `longctx ask` beside a minimal transformers script, same machine.

Each side runs as a fresh process, `--runs` times in a row (the first run of each pays its cold caches), on the
same model folder, document, question and number of new tokens (greedy). Reported per run: the process wall
clock measured from outside, and for longctx the report's own parts (which must add up to it); for the HF
script its first and second `generate` call inside the process.

    python benchmarks/cold_start.py --out benchmarks/results/cold_start_cpu.json             # embedded, CPU
    python benchmarks/cold_start.py --model random:llama-3.1-8b --tokens 8k --device cuda --out gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What was the name of the schooner?"

# The minimal script a user would write: import, load, build the same prompt, generate.
HF_SCRIPT = r"""
import json, sys, time, psutil
born = psutil.Process().create_time()
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
model_spec, doc_path, question, new, device, dtype = sys.argv[1:7]
new = int(new)
dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
if model_spec.startswith("random:"):
    sys.path.insert(0, sys.argv[7])
    from longctx_cli.models import RANDOM_PRESETS, byte_tokenizer
    params = dict(RANDOM_PRESETS[model_spec[7:]])
    config = AutoConfig.for_model(params.pop("model_type"), **params)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tok = byte_tokenizer()
else:
    tok = AutoTokenizer.from_pretrained(model_spec)
    model = AutoModelForCausalLM.from_pretrained(model_spec, dtype=dtype, device_map={"": device})
model.eval()
text = open(doc_path, encoding="utf-8").read()
prompt = f"{text}\n\nQuestion: {question}\nAnswer:"
ids = tok(prompt, return_tensors="pt").input_ids.to(device)
calls = []
for _ in range(2):
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    calls.append(time.perf_counter() - t)
answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
print(json.dumps({"tokens_in": ids.shape[1], "generate_s": calls, "answer": answer,
                  "in_process_s": time.time() - born}))
"""


def _document(tokens: int | None, model: str, tmp: Path) -> Path:
    """The sample story, or the story repeated to about `tokens` tokens (random presets' byte tokenizer: one
    token a byte; real tokenizers: about four characters a token)."""
    if not tokens:
        return ROOT / "samples" / "lighthouse.txt"
    story = (ROOT / "samples" / "lighthouse.txt").read_text(encoding="utf-8")
    chars = tokens if model.startswith("random:") else tokens * 4
    path = tmp / f"doc_{tokens}.txt"
    path.write_text(((story + "\n\n") * (chars // len(story) + 1))[:chars], encoding="utf-8")
    return path


def _timed(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return wall, done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded model's converted folder")
    ap.add_argument("--tokens", default=None, help="a synthetic document of about this many tokens (e.g. 8k); "
                                                     "default: samples/lighthouse.txt")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--state", default="off", help="longctx's --state: off (compute every run, as the script "
                                                     "does) or auto (the second run reads the first one's state)")
    ap.add_argument("--fresh-home", action="store_true",
                    help="run 1 starts from an empty $LONGCTX_HOME (its compile caches included); later runs reuse it")
    ap.add_argument("--out")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from longctx_cli.models import resolve_model_dir
    from longctx_cli.units import parse_count
    from longctx_cli.report import run_stamp

    model = args.model or str(resolve_model_dir(None))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    script = Path(sys.executable).with_name("longctx")
    longctx = [str(script)] if script.exists() else [sys.executable, "-m", "longctx_cli"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        doc = _document(parse_count(args.tokens) if args.tokens else None, model, Path(tmp))
        env = dict(os.environ)
        if args.fresh_home:
            # Compile caches follow the home unless these are set (longctx_cli/home.py keep_compile_caches).
            env["LONGCTX_HOME"] = str(Path(tmp) / "home")
            for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
                env.pop(name, None)
        for run in range(1, args.runs + 1):
            wall, out = _timed([sys.executable, "-c", HF_SCRIPT, model, str(doc), QUESTION, str(args.new_tokens),
                                args.device, dtype, str(ROOT)], env)
            hf = json.loads(out.strip().splitlines()[-1])
            rows.append({"side": "hf-script", "run": run, "process_wall_s": wall, **hf})
            print(rows[-1], flush=True)
            wall, out = _timed([*longctx, "ask", str(doc), "-q", QUESTION, "--model", model, "-n",
                                str(args.new_tokens), "--device", args.device, "--dtype", dtype, "--set",
                                "stop=[]", "--state", args.state, "--json"], env)
            report = json.loads(out.strip().splitlines()[-1])
            parts = report["timings"]["wall"]
            rows.append({"side": "longctx", "run": run, "process_wall_s": wall, "report_total_s": parts["total_s"],
                         "parts": parts, "tokens_in": report["tokens_in"], "tokens_out": report["tokens_out"],
                         "answer": report["answer"], "decode_ms_per_token": report["timings"]["decode_ms_per_token"],
                         "prefill_s": report["timings"]["prefill_s"]})
            print(rows[-1], flush=True)
    result = {**run_stamp(), "model": model, "device": args.device, "dtype": dtype, "new_tokens": args.new_tokens,
              "state": args.state, "fresh_home": args.fresh_home,
              "document_tokens": rows[0]["tokens_in"], "rows": rows,
              "note": "random weights: speed only" if model.startswith("random:") else None}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
