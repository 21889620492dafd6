"""The saved-state store: round trip, verification before use, bounded size, concurrent writers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from longctx_cli.checksums import tensor_checksum
from longctx_cli.states import StateError, StateStore, state_key

INPUTS = {"engine": "dense", "model": "m", "tokens": 5, "document": "abc"}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.keys": torch.randn(1, 2, 5, 4, generator=g),
            "layers.0.values": torch.randn(1, 2, 5, 4, generator=g).to(torch.bfloat16),
            "last_logits": torch.randn(1, 11, generator=g)}


def test_round_trip(tmp_path):
    store = StateStore(tmp_path)
    key = state_key(INPUTS)
    saved = store.save(key, INPUTS, _tensors(), {"n_tokens": 5})
    assert saved.bytes > 0 and saved.path.exists()
    tensors, meta, read = store.load(key, INPUTS)
    assert meta == {"n_tokens": 5} and read.bytes == saved.bytes
    for name, t in _tensors().items():
        assert torch.equal(tensors[name], t) and tensors[name].dtype == t.dtype


def _blocking_save_file(monkeypatch, release: threading.Event, seen: list):
    """safetensors' save_file held until `release` is set; `seen` gets the writing thread's name."""
    import safetensors.torch

    real = safetensors.torch.save_file

    def held(tensors, filename, metadata=None):
        seen.append(threading.current_thread().name)
        assert release.wait(60)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", held)


def test_a_state_written_beside_is_the_one_given_when_given(tmp_path, monkeypatch):
    """save_beside returns before the file is written, on a thread of its own, from a copy: tensors changed
    meanwhile (a question's answer) leave the file as it was given, and it reads back as `save` writes it."""
    store = StateStore(tmp_path)
    key = state_key(INPUTS)
    release, seen = threading.Event(), []
    _blocking_save_file(monkeypatch, release, seen)
    live = _tensors()
    pending = store.save_beside(key, INPUTS, live, {"n_tokens": 5})
    for t in live.values():
        t.fill_(7)
    assert not store.path(key).exists()
    release.set()
    saved = pending.wait()
    assert seen and seen[0].startswith("longctx-state-") and saved.path == store.path(key)
    tensors, meta, _ = store.load(key, INPUTS)
    assert meta == {"n_tokens": 5}
    for name, t in _tensors().items():
        assert torch.equal(tensors[name], t)
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.path(key).name]


def test_a_state_write_given_up_leaves_no_file(tmp_path, monkeypatch):
    """A run that ends while its state is written (Ctrl-C: the exit handlers run) leaves neither a partial file
    nor, once the write returns, a state; wait then raises OSError, which the run reports as one warning."""
    store = StateStore(tmp_path)
    key = state_key(INPUTS)
    release, seen = threading.Event(), []
    _blocking_save_file(monkeypatch, release, seen)
    pending = store.save_beside(key, INPUTS, _tensors(), {})
    while not seen:
        time.sleep(0.01)
    pending.abandon()
    assert list(tmp_path.iterdir()) == []
    release.set()
    with pytest.raises(OSError, match="ended before the state was written"):
        pending.wait()
    assert list(tmp_path.iterdir()) == []


def test_missing_is_none_and_other_inputs_are_refused(tmp_path):
    store = StateStore(tmp_path)
    assert store.load("0" * 32, INPUTS) is None
    key = state_key(INPUTS)
    store.save(key, INPUTS, _tensors(), {})
    with pytest.raises(StateError, match="other inputs"):
        store.load(key, {**INPUTS, "engine": "resa"})


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_files_are_refused(tmp_path, damage):
    store = StateStore(tmp_path)
    key = state_key(INPUTS)
    path = store.save(key, INPUTS, _tensors(), {}).path
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 20]
    elif damage == "flip":
        data[-7] ^= 0x40  # inside the last tensor's bytes
    else:
        data = bytearray(b"not a state at all")
    path.write_bytes(bytes(data))
    with pytest.raises(StateError):
        store.load(key, INPUTS)


def test_checksum_sees_any_changed_word():
    t = torch.randn(64, 33)
    base = tensor_checksum(t)
    for index in (0, 1000, t.numel() - 1):
        changed = t.clone().view(-1)
        changed[index] = changed[index] + 1.0
        assert tensor_checksum(changed.view_as(t)) != base
    assert tensor_checksum(t[:, :32]) != base  # a truncated tensor too


def test_least_recently_used_states_are_evicted(tmp_path):
    import os
    import time

    store = StateStore(tmp_path, limit_bytes=1 << 40)
    keys = [state_key({**INPUTS, "document": str(i)}) for i in range(3)]
    for i, key in enumerate(keys):
        store.save(key, {**INPUTS, "document": str(i)}, _tensors(i), {})
        os.utime(store.path(key), (time.time() - 100 + i, time.time() - 100 + i))
    store.load(keys[0], {**INPUTS, "document": "0"})  # used last: kept
    one = store.path(keys[1]).stat().st_size
    store.limit_bytes = 2 * one
    removed = store.evict()
    assert removed == [keys[1]]
    assert [e.key for e in store.entries()] == [keys[2], keys[0]]


_WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from longctx_cli.states import StateStore
    inputs = {"engine": "dense", "document": "same"}
    big = {"keys": torch.arange(2_000_000, dtype=torch.float32)}
    for _ in range(5):
        StateStore(Path(sys.argv[1])).save("k" * 32, inputs, big, {"writer": sys.argv[2]})
""")


def test_two_processes_saving_one_key(tmp_path):
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(i)], cwd=root) for i in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    tensors, meta, _ = StateStore(tmp_path).load("k" * 32, {"engine": "dense", "document": "same"})
    assert torch.equal(tensors["keys"], torch.arange(2_000_000, dtype=torch.float32))
    assert meta["writer"] in ("0", "1")
    assert [p.name for p in tmp_path.iterdir()] == ["k" * 32 + ".safetensors"]


def test_states_command_lists_and_removes(tmp_path, monkeypatch, capsys):
    from tests.conftest import run_cli

    monkeypatch.setenv("LONGCTX_HOME", str(tmp_path))
    store = StateStore()
    key = state_key(INPUTS)
    store.save(key, INPUTS, _tensors(), {"document": "book.txt"})
    code, out, err = run_cli(["states"], capsys, monkeypatch)
    assert code == 0 and key in out and "book.txt" in out and "1 states" in err
    code, out, err = run_cli(["states", "rm", key[:8]], capsys, monkeypatch)
    assert code == 0 and "removed 1 state" in err and not store.path(key).exists()
    code, out, err = run_cli(["states", "rm", "nope"], capsys, monkeypatch)
    assert code == 2 and "no saved state matches" in err


def test_checksums_of_large_host_tensors_see_every_piece():
    """Host tensors past 16 MiB are checked piece by piece on several threads; a flipped byte in any piece, or a
    different length, changes the checksum."""
    import torch

    t = torch.zeros(65 << 20, dtype=torch.uint8)
    first = tensor_checksum(t)
    for where in (0, 64 << 20, (65 << 20) - 1):
        t[where] = 1
        assert tensor_checksum(t) != first
        t[where] = 0
    assert tensor_checksum(t) == first and tensor_checksum(t[:-4]) != first
