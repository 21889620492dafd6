"""Saved document states under `$LONGCTX_HOME/states/`: a document read once is answered again without prefill.

A state file is safetensors (the engine's tensors) whose metadata holds a JSON header: the key's inputs, the
engine's own scalars and a checksum per tensor (longctx_cli/checksums.py). The key covers everything that shapes the state: the model's
weight and tokenizer files (names, sizes, a hash of each file's header), the engine and its settings, the
prefill settings (chunk size, dtype, device type) and the document's token ids. Files are written atomically
(two processes saving one key each write their own temporary file; the last rename wins whole) and verified
before use: a truncated, corrupted or foreign file is reported in one warning line and recomputed. The folder
is bounded (`state_cache_gib`): the least recently used states go first.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from longctx_cli.checksums import checksums
from longctx_cli.home import atomic_file, file_digest, longctx_home

FORMAT = 2
SUFFIX = ".safetensors"
_SMALL = 16 << 20  # files hashed whole below this size; larger ones by their header or samples


@functools.lru_cache(maxsize=8)
def model_fingerprint(folder: Path | None, random_preset: str | None = None) -> str:
    """A cheap identity of a model: every file's name, size and a hash of its header (safetensors), or of the
    whole file (config, tokenizer), or of samples (other large files). Random presets: their shape and the
    library versions that draw the weights."""
    h = hashlib.sha256()
    if folder is None:
        import torch
        import transformers

        from longctx_cli.models import RANDOM_PRESETS

        h.update(json.dumps([random_preset, RANDOM_PRESETS.get(random_preset or ""), torch.__version__,
                             transformers.__version__], sort_keys=True, default=str).encode())
        return h.hexdigest()[:24]
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith(".")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        if path.suffix == SUFFIX:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                h.update(f.read(min(n, 1 << 26)))
        elif size <= _SMALL:
            h.update(path.read_bytes())
        else:
            h.update(file_digest(path).encode())
    return h.hexdigest()[:24]


def document_digest(ids) -> str:
    import torch

    return hashlib.sha256(ids.to(torch.int32).contiguous().numpy().tobytes()).hexdigest()


def state_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass
class Saved:
    key: str
    path: Path
    bytes: int
    seconds: float


@dataclass
class Entry:
    key: str
    path: Path
    bytes: int
    used: float  # last use, seconds since the epoch
    header: dict


class StateStore:
    """The states folder: save, load (verified), list, remove, and keep under `limit_bytes`."""

    def __init__(self, root: Path | None = None, limit_bytes: int = 20 << 30):
        self.root = root or longctx_home() / "states"
        self.limit_bytes = limit_bytes

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def save(self, key: str, inputs: dict, tensors: dict, meta: dict) -> Saved:
        """tensors: name -> tensor (any device); meta: the engine's JSON-able scalars."""
        start = time.perf_counter()
        header = self._header(key, inputs, tensors, meta)
        return self._write(key, {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, header,
                           start)

    def save_beside(self, key: str, inputs: dict, tensors: dict, meta: dict) -> "PendingSave":
        """As `save`, the file written on a thread of its own: what it writes is copied to host memory first
        (`host.` tensors, which later answers leave as they are, excepted), so the caller may go on changing the
        tensors; `PendingSave.wait` joins it."""
        start = time.perf_counter()
        header = self._header(key, inputs, tensors, meta)
        snapshot = {name: t.detach().contiguous() if name.startswith("host.") else _host_copy(t)
                    for name, t in tensors.items()}
        return PendingSave(self, key, snapshot, header, start)

    def _header(self, key: str, inputs: dict, tensors: dict, meta: dict) -> dict:
        return {"format": FORMAT, "key": key, "inputs": inputs, "meta": meta, "checksums": checksums(tensors)}

    def _write(self, key: str, cpu: dict, header: dict, start: float, pending: "PendingSave | None" = None) -> Saved:
        from safetensors.torch import save_file

        def given_up(tmp: Path) -> None:
            if pending is not None and not pending.track(tmp):
                raise OSError("the run ended before the state was written")

        path = self.path(key)
        with atomic_file(path) as tmp:
            given_up(tmp)
            save_file(cpu, str(tmp), metadata={"longctx": json.dumps(header, default=str)})
            given_up(tmp)  # not renamed into place once the run has ended
        size = path.stat().st_size
        self.evict(keep=key)
        return Saved(key, path, size, time.perf_counter() - start)

    def load(self, key: str, inputs: dict, device=None) -> tuple[dict, dict, Saved] | None:
        """(tensors on `device`, meta, what was read), None when there is no such state; raises StateError when
        the file is there but cannot be used (the caller warns and recomputes)."""
        from safetensors import SafetensorError, safe_open

        path = self.path(key)
        if not path.is_file():
            return None
        start = time.perf_counter()
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                header = json.loads((f.metadata() or {}).get("longctx", "null"))
                if not isinstance(header, dict) or header.get("format") != FORMAT:
                    raise StateError("not a longctx state of this version")
                if header.get("key") != key or header.get("inputs") != json.loads(json.dumps(inputs, default=str)):
                    raise StateError("made for other inputs (model, engine, settings or document)")
                names = set(f.keys())
                if names != set(header["checksums"]):
                    raise StateError("tensors missing or extra")
                tensors = {name: f.get_tensor(name) for name in names}
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
            raise StateError(f"unreadable ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})") \
                from None
        if device is not None:
            # `host.` tensors (e.g. ltri-stream's context memory) stay in host memory.
            tensors = {name: t if name.startswith("host.") else t.to(device) for name, t in tensors.items()}
        for name, found in checksums(tensors).items():
            if found != header["checksums"][name]:
                raise StateError(f"tensor {name} is corrupted (checksum mismatch)")
        os.utime(path)  # most recently used: evicted last
        return tensors, header["meta"], Saved(key, path, path.stat().st_size, time.perf_counter() - start)

    def remove(self, key: str) -> bool:
        path = self.path(key)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        return existed

    def entries(self) -> list[Entry]:
        """Every state file, least recently used first (headers only: nothing large is read)."""
        from safetensors import SafetensorError, safe_open

        out = []
        for path in self.root.glob(f"*{SUFFIX}") if self.root.is_dir() else []:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    header = json.loads((f.metadata() or {}).get("longctx", "null")) or {}
            except (SafetensorError, OSError, ValueError):
                header = {}
            stat = path.stat()
            out.append(Entry(path.name[: -len(SUFFIX)], path, stat.st_size, stat.st_mtime, header))
        return sorted(out, key=lambda e: e.used)

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove the least recently used states until the folder fits `limit_bytes` (never `keep`)."""
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        removed = []
        for entry in entries:
            if total <= self.limit_bytes:
                break
            if entry.key == keep:
                continue
            entry.path.unlink(missing_ok=True)
            total -= entry.bytes
            removed.append(entry.key)
        return removed


class StateError(Exception):
    """A state file that exists but cannot be used; the message says why, in a few words."""


def _host_copy(t):
    """A contiguous copy of t in host memory (one copy, from any device)."""
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())


class PendingSave:
    """A state file being written on a thread of its own (StateStore.save_beside). A run that ends before it is
    written (Ctrl-C, an error) leaves no partial file: the exit handler removes it."""

    def __init__(self, store: StateStore, key: str, cpu: dict, header: dict, start: float):
        self.key, self.bytes = key, sum(t.nbytes for t in cpu.values())
        self.document = ""  # the document it is the state of, for the report that joins it
        self.saved: Saved | None = None
        self.error: BaseException | None = None
        self._tmp: Path | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        atexit.register(self.abandon)
        self._thread = threading.Thread(target=self._run, args=(store, cpu, header, start), daemon=True,
                                        name=f"longctx-state-{key[:12]}")
        self._thread.start()

    def _run(self, store: StateStore, cpu: dict, header: dict, start: float) -> None:
        try:
            self.saved = store._write(self.key, cpu, header, start, pending=self)
        except BaseException as exc:  # noqa: BLE001 - raised again by wait, in the caller's thread
            self.error = exc

    def track(self, tmp: Path) -> bool:
        """The temporary file being written; False once the run has given the write up."""
        with self._lock:
            self._tmp = tmp
            return not self._abandoned

    def wait(self) -> Saved:
        """The saved file once written; raises what writing it raised (OSError for a full or read-only disk)."""
        self._thread.join()
        atexit.unregister(self.abandon)
        if self.error is not None:
            raise self.error
        return self.saved

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            if self._tmp is not None and self._thread.is_alive():
                self._tmp.unlink(missing_ok=True)


def settings_of(config) -> dict:
    """A dataclass's fields as plain JSON values (tuples as lists), for a state key."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


class DocumentStates:
    """A run's use of the store: `--state` (auto: read if saved, else compute and save; off; read: never save;
    write: always compute and save), the report's `state` line, and a warning line for a state found damaged."""

    def __init__(self, mode: str, model_spec: str | None, profile, limit_gib: float):
        self.mode, self.model_spec, self.profile = mode, model_spec, profile
        self.store = StateStore(limit_bytes=int(limit_gib * 2**30))
        self.pending: PendingSave | None = None  # the state being written beside the answers (keep, wait)

    def inputs(self, engine, ids, reserve: int) -> dict:
        from longctx_cli.models import EMBEDDED, resolve_model_dir

        spec = self.model_spec
        random = spec[7:] if spec and spec.startswith("random:") else None
        folder = None if random else resolve_model_dir(spec)
        run = self.profile.run
        return {"format": FORMAT, "model": spec or EMBEDDED, "model_files": model_fingerprint(folder, random),
                "engine": engine.name, "engine_settings": settings_of(engine.config), "chunk_size": run.chunk_size,
                "dtype": str(engine.model.dtype), "device": engine.device.type, "tokens": int(ids.numel()),
                "document": document_digest(ids), **engine.state_inputs(int(ids.numel()), reserve)}

    def find(self, engine, ids, reserve: int, report):
        """The saved state for these inputs, imported with room for `reserve` tokens; None to compute it.
        Engines of several ranks use a saved state only when every rank found its own part (`engine.agree`)."""
        from longctx_cli.clock import CLOCK
        from longctx_cli.report import gib

        if self.mode in ("off", "write") or not engine.reusable:
            return None
        inputs = self.inputs(engine, ids, reserve)
        key = state_key(inputs)
        if self.pending is not None and self.pending.key == key:
            self.wait()  # this document's state, still being written
        with CLOCK.part("state read"):
            state, read = self._read(engine, key, inputs, reserve)
            if not engine.agree(state is not None):
                return None
        report.state = f"reused {key[:12]}, read {gib(read.bytes)} in {read.seconds:.2f} s"
        return state

    def _read(self, engine, key: str, inputs: dict, reserve: int):
        """(state, how it was read), or (None, None) when there is none or it is damaged (one warning line)."""
        from longctx_cli.named_models import warn

        try:
            found = self.store.load(key, inputs, device=engine.device)
            if found is None:
                return None, None
            tensors, meta, read = found
            return engine.import_state(tensors, meta, reserve), read
        # StateError: damaged or foreign; KeyError, ValueError: a file of the right key this engine cannot take.
        except (StateError, KeyError, ValueError) as exc:
            warn(f"saved state {key[:12]} ({self.store.path(key)}): {exc}; reading the document again")
            self.store.remove(key)
            return None, None

    def keep(self, engine, state, ids, reserve: int, report) -> None:
        """Save a state just computed, where the engine and `--state` allow: copied to host memory here, written
        to disk on a thread of its own while the questions are answered (`wait` joins it); the report says what
        happened."""
        from longctx_cli.clock import CLOCK
        from longctx_cli.report import gib

        if not engine.reusable:
            report.state = f"computed ({engine.name} keeps no saved state)"
            return
        if self.mode in ("off", "read"):
            report.state = f"computed, not saved (--state {self.mode})"
            return
        self.wait()  # one state written at a time: the one before, written beside this document's prefill
        inputs = self.inputs(engine, ids, reserve)
        key = state_key(inputs)
        with CLOCK.part("state write"):
            tensors, meta = engine.export_state(state)
            # Read back, every tensor but `host.` ones goes to the engine's device and is checked there: check
            # it there now too (the rule differs between host and device).
            tensors = {name: t if name.startswith("host.") else t.to(engine.device) for name, t in tensors.items()}
            self.pending = self.store.save_beside(key, inputs, tensors, {**meta, "document": report.path})
            self.pending.document = report.path
        report.state = f"computed, saving {gib(self.pending.bytes)} as {key[:12]} beside the answers"

    def carry_on(self, report) -> None:
        """The state being written goes on beside the next document (joined by its keep or the run's last wait):
        `report`, this document's last, says so."""
        if self.pending is not None:
            report.state += "; written on beside the next document"

    def wait(self, report=None) -> None:
        """Join the state being written, if any: its time waited counts as `state write`, and `report` (the
        document's last) says how it went; a failed write is one warning line, the run goes on."""
        from longctx_cli.clock import CLOCK
        from longctx_cli.named_models import warn
        from longctx_cli.report import gib

        pending, self.pending = self.pending, None
        if pending is None:
            return
        began = time.perf_counter()
        try:
            with CLOCK.part("state write"):
                saved = pending.wait()
        except OSError as exc:
            warn(f"cannot save the document's state in {self.store.root}: {exc.strerror or exc}")
            line = "not saved (see the warning)"
        else:
            line = (f"saved {gib(saved.bytes)} in {saved.seconds:.2f} s as {saved.key[:12]} "
                    f"(waited {time.perf_counter() - began:.2f} s after the answers)")
        if report is None:
            return
        if report.path != pending.document:  # an earlier document's, joined in a later one's report
            report.state += f"; {pending.document}'s state {line}"
        elif report.state.startswith("computed"):
            report.state = f"computed, {line}"
        else:
            report.state += f"; the state {line}"
