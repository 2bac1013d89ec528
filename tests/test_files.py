"""Atomic writes (opentinker/files.py): a file is replaced whole or left as it was."""

from __future__ import annotations

import os
import stat

import pytest

from opentinker.files import replaced, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    assert write_atomic(path, "new") == path
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["state.json"]


def test_a_block_that_raises_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"line 1\n")
    with pytest.raises(ValueError, match="bad record"), replaced(path, binary=True) as f:
        f.write(b"half")
        raise ValueError("bad record")
    assert path.read_bytes() == b"line 1\n" and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_mode_is_applied_from_creation(tmp_path):
    path = write_atomic(tmp_path / "service.json", "{}", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = write_atomic(tmp_path / "plain.json", "{}")
    assert stat.S_IMODE(other.stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
