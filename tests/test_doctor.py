"""`fasttune doctor`'s pieces: versions, kernel placement, the dry patch, the report."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from fasttune import doctor
from fasttune.model_patches import FAMILIES


def test_versions_come_from_the_installed_distributions():
    rows = {r["name"]: r for r in doctor.versions()}
    assert rows["torch"]["version"] == importlib.metadata.version("torch") and rows["torch"]["ok"] is True
    assert rows["python"]["ok"] is True
    assert {"triton", "transformers", "peft", "trl", "bitsandbytes", "gguf", "llama-cpp-python"} <= set(rows)
    assert all(r["ok"] is None for r in rows.values() if r["version"] is None)  # missing is not "too old"


@pytest.mark.parametrize("version, minimum, ok", [("2.13.0+cpu", "2.6", True), ("0.3.9", "0.3.30", False),
                                                  ("5.0.0rc1", "5.0", True), ("1.0", "1.10", False)])
def test_version_comparison_is_numeric(version, minimum, ok):
    assert (doctor._version_tuple(version) >= doctor._version_tuple(minimum)) is ok


def test_kernel_placement_follows_the_backend_rules(monkeypatch):
    if torch.cuda.is_available():
        assert set(doctor.kernel_backends().values()) == {"triton"}
        assert doctor.gpu()["memory_gib"] > 0
        return
    assert doctor.gpu() == {"name": "none", "count": 0}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert set(doctor.kernel_backends().values()) == {"triton-interpreter"}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert set(doctor.kernel_backends().values()) == {"reference (no CUDA device)"}
    assert set(doctor.kernel_backends()) == set(doctor.KERNELS)


def test_dry_patch_covers_every_family_and_reports_fallbacks():
    rows = {r["family"]: r for r in doctor.dry_patch()}
    assert set(rows) == set(FAMILIES) | {"llama + LoRA"}
    for family, row in rows.items():
        assert not any(r.startswith("could not build") for r in row["fallbacks"]), (family, row)
        assert row["patched"].get("cross_entropy") == 1 and row["patched"].get("rms_norm", 0) >= 3, (family, row)


def test_report_text_names_gpu_kernels_families_and_fallbacks():
    info = {"versions": [{"name": "torch", "version": "2.0", "minimum": "2.6", "ok": False},
                         {"name": "gguf", "version": None, "minimum": "0.17", "ok": None}],
            "gpu": {"name": "none", "count": 0}, "kernels": {"rms_norm": "reference (no CUDA device)"},
            "families": ["llama", "qwen2"],
            "dry_patch": [{"family": "llama", "patched": {"rms_norm": 3}, "fallbacks": ["rope: reason here"]}]}
    text = doctor.format_report(info)
    assert "torch              2.0  (fasttune needs >= 2.6)" in text and "gguf               not installed" in text
    assert "GPU: none" in text and "rms_norm       reference (no CUDA device)" in text
    assert "supported families: llama, qwen2" in text and "falls back: rope: reason here" in text
    assert "llama          rms_norm x3" in text
