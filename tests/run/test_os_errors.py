"""OS errors in one line: every known shape of a full disk, with the path, the free space and the need."""

from __future__ import annotations

import errno
import shutil

import pytest

from fasttune.run.os_errors import explain, human, is_disk_full, mount_point


def _chained(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),  # Python's buffered write: no file name
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),  # torch.save
    RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/0: "
                 "file write failed"),
    Exception("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
    OSError("52224 requested and 45216 written"),  # numpy tofile
    _chained(RuntimeError("saving failed"), OSError(errno.ENOSPC, "No space left on device")),
], ids=["enospc", "quota", "torch-pos", "torch-write", "safetensors", "numpy", "chained"])
def test_every_shape_of_a_full_disk_is_recognised(exc, tmp_path):
    assert is_disk_full(exc)
    line = explain(exc, tmp_path / "checkpoint-20", need_bytes=12_345_678, what="a checkpoint")
    free = human(shutil.disk_usage(tmp_path).free)
    assert line.startswith(f"disk full writing {tmp_path / 'checkpoint-20'}: {free} free on ")
    assert line.endswith("; free some space there or use a larger disk")
    assert "; a checkpoint needs about 12.3 MB;" in line and "\n" not in line


def test_a_failed_cpp_stream_is_a_full_disk_only_when_there_is_no_room(tmp_path, monkeypatch):
    """torch's C++ writer can fail with only "basic_ios::clear: iostream error" (seen on a real full
    tmpfs mid-checkpoint): no errno, no path. A full file system makes it the disk-full line; with
    room left it is not claimed to be one."""
    from fasttune.run import os_errors

    exc = RuntimeError("basic_ios::clear: iostream error")
    assert explain(exc, tmp_path / "checkpoint-4") is None  # this file system has room: cause unknown
    monkeypatch.setattr(os_errors, "free_bytes", lambda path: 4096)
    line = explain(_chained(RuntimeError("saving failed"), exc), tmp_path / "checkpoint-4", 10_000, "a checkpoint")
    assert line.startswith(f"disk full writing {tmp_path / 'checkpoint-4'}: 4.1 KB free on ")


def test_a_file_name_carried_by_the_error_wins(tmp_path):
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.bin"))
    assert explain(exc, tmp_path).startswith(f"disk full writing {tmp_path / 'x.bin'}:")
    assert "needs" not in explain(exc, tmp_path)  # no estimate given: none claimed


def test_other_os_errors_and_export_errors_keep_their_one_line(tmp_path):
    from fasttune.export.write_errors import ExportWriteError

    exc = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "final"))
    assert explain(exc, tmp_path) == f"permission denied writing {tmp_path / 'final'}"
    read_only = OSError(errno.EROFS, "Read-only file system")
    assert explain(read_only, tmp_path) == f"read-only file system writing {tmp_path}"
    assert explain(ValueError("not an OS error"), tmp_path) is None
    assert not is_disk_full(ValueError("bad value"))
    exported = ExportWriteError("disk full writing /r/merged/model.safetensors: needs ~412 MB more (3 MB free)",
                                tmp_path / "merged" / "model.safetensors", errno.ENOSPC)
    wrapped = _chained(RuntimeError("export failed"), exported)
    assert explain(wrapped, tmp_path) == str(exported)  # the export's line about its own file stands


def test_mount_point_and_sizes(tmp_path):
    assert mount_point(tmp_path / "not" / "yet") == mount_point(tmp_path)
    assert mount_point("/") == mount_point("/") and str(mount_point(tmp_path)).startswith("/")
    assert (human(999), human(45_216), human(3.2e9)) == ("999 bytes", "45.2 KB", "3.2 GB")
