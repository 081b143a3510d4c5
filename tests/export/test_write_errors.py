"""A full disk or another OS error while exporting: one line naming the final file and the space needed.

Real failures where CI allows them: a per-process file-size limit (RLIMIT_FSIZE) makes the kernel
refuse the writes of safetensors (Rust), numpy (GGUF) and Python alike; a 1 MB tmpfs gives a real
ENOSPC when the test runs as root with mount rights (skipped otherwise). The exact words of each
writer on a full disk (measured on a 1 MB tmpfs) are replayed through monkeypatched writers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune.export import write_errors
from fasttune.export.artifacts import export_artifacts
from fasttune.export.write_errors import ExportWriteError, describe, naming_write_errors
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer

SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
NUMPY_FULL = "1000000 requested and 262144 written"


@pytest.mark.parametrize("exc, start", [
    (OSError(errno.ENOSPC, "No space left on device"), "disk full writing /x/m.bin: needs ~3 MB more"),
    (RuntimeError(SAFETENSORS_FULL), "disk full writing /x/m.bin: needs ~3 MB more"),
    (OSError(NUMPY_FULL), "disk full writing /x/m.bin: needs ~3 MB more"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded writing /x/m.bin: needs ~3 MB more"),
    (OSError(errno.EACCES, "Permission denied"), "permission denied writing /x/m.bin"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system writing /x/m.bin"),
    (OSError(errno.EFBIG, "File too large"), "file size limit reached writing /x/m.bin"),
])
def test_each_writer_failure_becomes_one_line(exc, start, monkeypatch):
    monkeypatch.setattr(write_errors, "free_bytes", lambda path: 500_000)
    err = describe(exc, "/x/m.bin", expected_bytes=4_000_000, written_bytes=1_000_000)
    assert isinstance(err, ExportWriteError) and str(err).startswith(start) and "\n" not in str(err)
    assert err.path == Path("/x/m.bin")
    if "needs" in start:
        assert err.needed_bytes == 2_500_000 and str(err).endswith("(<1 MB free)")


def test_other_errors_pass_through_untouched():
    assert describe(FileNotFoundError("no base"), "/x") is None
    assert describe(ValueError("bad shape"), "/x") is None
    with pytest.raises(KeyError):
        with naming_write_errors("/x"):
            raise KeyError("k")
    with pytest.raises(ExportWriteError) as info:
        with naming_write_errors("/x/a", 10, lambda: 4):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert isinstance(info.value.__cause__, OSError) and info.value.errno == errno.ENOSPC


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """The kernel refuses to grow any file of this process past ``nbytes`` (EFBIG, SIGXFSZ ignored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def _peft(tok):
    torch.manual_seed(0)
    return get_peft_model(tiny_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                     head_dim=16), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob(".*") if not p.name.startswith(".fasttune-"))


@pytest.mark.parametrize("kind, file", [("merged", "merged/model.safetensors"), ("gguf", "gguf/run-F32.gguf")])
def test_a_real_write_limit_names_the_file(kind, file, tmp_path):
    tok = bpe_tokenizer()
    model = _peft(tok)
    with _file_size_limit(256 * 1024), pytest.raises(ExportWriteError) as info:
        export_artifacts(model, tok, tmp_path, (kind,), name="run", gguf_quantizations=("f32",),
                         merged_dtype="float32")
    # safetensors passes the errno on; numpy's short write has none (and the disk has room)
    reason = "file size limit reached" if kind == "merged" else r"write cut short \(\d+ of \d+ bytes\)"
    assert re.fullmatch(f"{reason} writing {tmp_path / file}", str(info.value)), str(info.value)
    assert _hidden(tmp_path / kind) == []  # the temporary file and the staging folder are gone
    assert not (tmp_path / file).exists()


def test_full_disk_while_writing_safetensors_and_gguf(tmp_path, monkeypatch):
    """The words safetensors and numpy use on a full disk, from inside the real export path."""
    import gguf
    import safetensors.torch

    tok = bpe_tokenizer()
    model = _peft(tok)
    monkeypatch.setattr(write_errors, "free_bytes", lambda path: 1000)
    real_save = safetensors.torch.save_file

    def save_half(tensors, path, metadata=None):
        real_save(tensors, path, metadata=metadata)
        os.truncate(path, os.path.getsize(path) // 2)
        raise safetensors.SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr(safetensors.torch, "save_file", save_half)
    with pytest.raises(ExportWriteError) as info:
        export_artifacts(model, tok, tmp_path, ("merged",), name="run", merged_dtype="float32")
    msg = str(info.value)
    assert msg.startswith(f"disk full writing {tmp_path / 'merged' / 'model.safetensors'}: needs ~")
    assert msg.endswith("MB more (<1 MB free)") and info.value.needed_bytes > 0
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)

    calls = []

    def short_write(self, tensor):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(NUMPY_FULL)
        return real_write(self, tensor)

    real_write = gguf.GGUFWriter.write_tensor_data
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", short_write)
    with pytest.raises(ExportWriteError, match=rf"^disk full writing {tmp_path / 'gguf' / 'run-F16.gguf'}: needs ~"):
        export_artifacts(model, tok, tmp_path, ("gguf",), name="run", gguf_quantizations=("f16",))
    assert _hidden(tmp_path) == []


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0:
        return False
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_real_full_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "96k"):
        pytest.skip("needs root and mount rights for a small tmpfs")
    try:
        tok = bpe_tokenizer()
        with pytest.raises(ExportWriteError) as info:
            export_artifacts(_peft(tok), None, disk, ("merged",), name="run", merged_dtype="float32")
        msg = str(info.value)
        assert msg.startswith(f"disk full writing {disk / 'merged' / 'model.safetensors'}: needs ~"), msg
        assert _hidden(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False)
