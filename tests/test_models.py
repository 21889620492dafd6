"""The model cache: conversions run once however many longctx processes start together."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

_CONVERTER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from longctx_cli.named_models import convert_once

    out = Path(sys.argv[1])

    def convert():
        with open(out.parent / "conversions.log", "a") as log:
            log.write("converting\\n")
        time.sleep(1.0)  # long enough for the other process to arrive while this one converts
        out.mkdir()
        (out / "longctx.json").write_text('{"files": {}}')

    convert_once(out, convert, lambda msg: print(msg, flush=True))
""")


def test_two_processes_starting_together_convert_once(tmp_path: Path):
    out = tmp_path / "models" / "m"
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERTER, str(out)], cwd=root, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    said = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert (tmp_path / "models" / "conversions.log").read_text() == "converting\n"
    assert (out / "longctx.json").exists()
    # The later process either waited on the lock (and said so) or started after the conversion was done.
    assert sum("waiting for another longctx process" in s for s in said) <= 1


def test_a_conversion_parses_the_gguf_once(tmp_path):
    """Inside a conversion every reader of one GGUF file is the same parse (transformers opens it for the config,
    the weights and the tokenizer); outside, readers are the library's own again."""
    import gguf

    from longctx_cli.gguf_convert import _one_parse

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("t", np.arange(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    original = gguf.GGUFReader
    with _one_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        assert first.fields["llama.block_count"].contents() == 1
    assert gguf.GGUFReader is original and gguf.GGUFReader(path) is not first
