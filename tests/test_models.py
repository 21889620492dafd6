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


def test_a_conversion_turns_the_metadata_into_values_once(tmp_path, monkeypatch):
    """transformers' metadata-only loads of one GGUF (two configs and the tokenizer) share one parse, each caller
    getting its own copy; loads with tensors, and everything outside a conversion, are the library's own."""
    from transformers import configuration_utils, modeling_gguf_pytorch_utils, tokenization_utils_tokenizers
    from transformers.models.auto import tokenization_auto

    from longctx_cli.gguf_convert import _one_parse

    calls = []

    def load(path, return_tensors=False, **kwargs):
        calls.append(return_tensors)
        return {"config": {"model_type": "llama"}, "tokenizer": {"tokens": ["a", "b"]}}

    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", load)
    path = tmp_path / "m.gguf"
    before = configuration_utils.load_gguf_checkpoint
    with _one_parse():
        got = [m.load_gguf_checkpoint(path, return_tensors=False) for m in
               (configuration_utils, tokenization_auto, tokenization_utils_tokenizers)]
        got[0]["config"]["model_type"] = "changed by its caller"
        again = configuration_utils.load_gguf_checkpoint(str(path))
        with_tensors = modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=True)
    assert calls == [False, True]
    assert got[1] == got[2] == again == with_tensors and got[1] is not got[2]
    assert configuration_utils.load_gguf_checkpoint is before
    assert tokenization_auto.load_gguf_checkpoint is tokenization_utils_tokenizers.load_gguf_checkpoint is before
