"""The saved-state store: round trip, verification before use, bounded size, concurrent writers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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
