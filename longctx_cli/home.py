"""`$LONGCTX_HOME` (default ~/.cache/longctx): what longctx keeps between runs, written so that nothing in it
is ever half-written.

Every file goes to a temporary name in its own folder first and is renamed into place once complete
(`os.replace` is atomic on POSIX), so a crash or Ctrl-C leaves either the old file or none, never a torn one.
Readers still check what they load (sizes, checksums) and rebuild what does not pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from longctx_cli.errors import ConfigError

VARIABLE = "LONGCTX_HOME"


def longctx_home() -> Path:
    raw = os.environ.get(VARIABLE)
    if raw is None:
        return Path.home() / ".cache" / "longctx"
    if not raw.strip():
        raise ConfigError(f"{VARIABLE} is set but empty; unset it (default ~/.cache/longctx) or name a writable "
                          "folder")
    return Path(raw).expanduser()


def check_home() -> Path:
    """The home, refused (exit 4, naming the variable) when it cannot be used; creates nothing."""
    home = longctx_home()
    origin = f"{VARIABLE}={home}" if VARIABLE in os.environ else f"the longctx home {home}"
    existing = home
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{origin}: {existing} is a file, not a folder; set {VARIABLE} to a writable folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{origin}: {existing} is not writable (read-only or no permission); set {VARIABLE} "
                          "to a writable folder")
    return home


def keep_compile_caches(home: Path) -> None:
    """Compiled kernels (torch.compile's Inductor, Triton) cached under the home, so that they survive reboots
    and /tmp cleaners and a machine compiles a shape once; variables the user set win."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home / "compile" / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(home / "compile" / "triton"))


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yields a temporary path next to `path`; once the block ends without error it replaces `path`.

    On any exception (Ctrl-C included) the temporary file is removed and `path` is left as it was.
    Two processes writing the same path each write their own temporary file; the last rename wins whole.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    tmp.chmod(0o666 & ~_umask())  # mkstemp makes 0600; the file is shared like any other cache file
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes | str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """Yields an empty temporary folder next to `path`; once the block ends without error it becomes `path`
    (an older `path` is removed first). On any exception the temporary folder is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    tmp.chmod(0o777 & ~_umask())
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_digest(path: Path, sample_bytes: int = 1 << 16) -> str:
    """A cheap fingerprint of a large file: its size, its first and last `sample_bytes` and 16 samples between
    (a truncated, torn or overwritten file differs; a full hash of a GB of weights would cost seconds a run)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for k in range(18):
            f.seek(0 if k == 0 else max(0, size - sample_bytes) if k == 17 else size * k // 17)
            h.update(f.read(sample_bytes))
    return h.hexdigest()
