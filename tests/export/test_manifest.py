"""Export manifests: an artifact is reused only when complete, unchanged and made from the same weights."""

from __future__ import annotations

import json
import os

import pytest

from fasttune.export.manifest import (MANIFEST, artifact_files, gguf_quants, read_manifest, reusable,
                                      source_fingerprint, write_manifest)


def test_fingerprint_follows_every_file_of_the_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.safetensors").write_bytes(b"weights")
    (tmp_path / "sub" / "b.json").write_text("{}")
    first = source_fingerprint(tmp_path)
    assert source_fingerprint(tmp_path) == first and len(first) == 20
    st = (tmp_path / "a.safetensors").stat()
    os.utime(tmp_path / "a.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # rewritten
    assert source_fingerprint(tmp_path) != first


def test_complete_artifacts(tmp_path):
    assert artifact_files(tmp_path, "adapter") == [] and artifact_files(tmp_path, "merged") == []
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"w")
    assert artifact_files(tmp_path, "adapter") == ["adapter_config.json", "adapter_model.safetensors"]
    (tmp_path / "config.json").write_text("{}")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"1")
    assert artifact_files(tmp_path, "merged") == []  # a shard is missing
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"2")
    assert len(artifact_files(tmp_path, "merged")) == 4
    with pytest.raises(ValueError, match="kind"):
        artifact_files(tmp_path, "onnx")


def test_reuse_needs_the_same_source_and_untouched_files(tmp_path):
    for name in ("run-Q8_0.gguf", "run-F16.gguf", ".run-Q4_0.gguf.x.tmp"):
        (tmp_path / name).write_bytes(b"gguf " + name.encode())
    write_manifest(tmp_path, "gguf", "src1", ["run-Q8_0.gguf", "run-F16.gguf"])
    assert read_manifest(tmp_path)["files"] == {"run-F16.gguf": 17, "run-Q8_0.gguf": 18}
    assert reusable(tmp_path, "gguf", "src1")
    assert sorted(gguf_quants(tmp_path, "src1")) == ["f16", "q8_0"]
    assert not reusable(tmp_path, "gguf", "src2") and gguf_quants(tmp_path, "src2") == {}
    assert not reusable(tmp_path, "gguf", None) and not reusable(tmp_path, "merged", "src1")
    (tmp_path / "run-F16.gguf").write_bytes(b"truncated")
    assert not reusable(tmp_path, "gguf", "src1")
    (tmp_path / MANIFEST).write_text("not json")
    assert read_manifest(tmp_path) is None and not reusable(tmp_path, "gguf", "src1")


def test_a_vlm_mmproj_file_is_not_a_quant_type(tmp_path):
    """``mmproj-run-F16.gguf`` rides along with the language-model files: it must not read as an F16 one."""
    for name in ("run-Q8_0.gguf", "mmproj-run-F16.gguf"):
        (tmp_path / name).write_bytes(b"gguf")
    write_manifest(tmp_path, "gguf", "src1", ["run-Q8_0.gguf", "mmproj-run-F16.gguf"])
    assert gguf_quants(tmp_path, "src1") == {"q8_0": tmp_path / "run-Q8_0.gguf"}
