"""Atomic files and folders: an error leaves the previous file, and no temporary file behind."""

import os

import pytest

from fasttune.export.atomic import atomic_path, atomic_write, staged_dir


def test_atomic_path_keeps_old_file_on_error(tmp_path):
    final = atomic_write(tmp_path / "f.json", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"half-writ")
            raise RuntimeError("disk full")
    assert final.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["f.json"]


def test_staged_dir_moves_every_file_in_or_none(tmp_path):
    out = tmp_path / "out"
    with staged_dir(out) as stage:
        (stage / "sub").mkdir()
        (stage / "a.bin").write_bytes(b"a")
        (stage / "sub" / "b.bin").write_bytes(b"b")
    assert (out / "a.bin").read_bytes() == b"a" and (out / "sub" / "b.bin").read_bytes() == b"b"
    with pytest.raises(RuntimeError):
        with staged_dir(out) as stage:
            (stage / "a.bin").write_bytes(b"new")
            raise RuntimeError("killed")
    assert (out / "a.bin").read_bytes() == b"a"
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "sub"]  # no staging folder left
