"""A SIGKILLed export strands hidden temporaries; the next export into the folder removes them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from fasttune.export.artifacts import export_artifacts
from fasttune.export.leftovers import ExportBusyError, export_lock, remove_stranded, stranded
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_stranded_files_are_found_and_removed_but_finals_stay(tmp_path):
    (tmp_path / "merged" / ".staging-abc" / "sub").mkdir(parents=True)
    (tmp_path / "merged" / ".staging-abc" / ".part-00000.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "merged" / "model.safetensors").write_bytes(b"final")
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / ".run-Q8_0.gguf.k2j3.tmp").write_bytes(b"y" * 500)
    (tmp_path / "gguf" / ".run-intermediate-BF16.gguf").write_bytes(b"z" * 200)
    (tmp_path / "gguf" / "run-Q8_0.gguf").write_bytes(b"final")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / ".fasttune-write-check-1").write_bytes(b"")
    (tmp_path / ".state.json.1.2.tmp").write_bytes(b"not an export's")  # outside the artifact folders
    found = {p.relative_to(tmp_path).as_posix() for p in stranded(tmp_path)}
    assert found == {"merged/.staging-abc", "gguf/.run-Q8_0.gguf.k2j3.tmp", "gguf/.run-intermediate-BF16.gguf",
                     "adapter/.fasttune-write-check-1"}
    assert remove_stranded(tmp_path) == 1700
    assert stranded(tmp_path) == [] and (tmp_path / ".state.json.1.2.tmp").exists()
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == b"final"
    assert (tmp_path / "gguf" / "run-Q8_0.gguf").read_bytes() == b"final"


def test_one_export_at_a_time(tmp_path):
    with export_lock(tmp_path):
        with pytest.raises(ExportBusyError, match=f"another export is writing into {tmp_path}"):
            with export_lock(tmp_path):
                pass
    with export_lock(tmp_path):  # released
        pass


_KILLED_EXPORT = textwrap.dedent("""
    import os, signal, sys
    import torch
    from peft import LoraConfig, get_peft_model
    from fasttune.export.artifacts import export_artifacts
    from helpers.tiny_models import tiny_model
    from helpers.tiny_tokenizers import bpe_tokenizer

    where, root = sys.argv[1], sys.argv[2]
    if where == "merged":
        import safetensors.torch
        real = safetensors.torch.save_file
        def save_then_die(tensors, path, metadata=None):
            real(tensors, path, metadata=metadata)
            os.kill(os.getpid(), signal.SIGKILL)
        safetensors.torch.save_file = save_then_die
    else:
        import gguf
        real, calls = gguf.GGUFWriter.write_tensor_data, []
        def write_then_die(self, tensor):
            calls.append(1)
            real(self, tensor)
            if len(calls) == 4:
                self.fout[0].flush()
                os.kill(os.getpid(), signal.SIGKILL)
        gguf.GGUFWriter.write_tensor_data = write_then_die
    tok = bpe_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      head_dim=16), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    export_artifacts(model, tok, root, (where,), name="run", gguf_quantizations=("f32", "q8_0"),
                     merged_dtype="float32")
""")


@pytest.mark.parametrize("where, left", [("merged", ".staging-"), ("gguf", ".run-F32.gguf.")])
def test_a_killed_export_is_swept_by_the_next_one(where, left, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests" / "_lib")])}
    proc = subprocess.run([sys.executable, "-c", _KILLED_EXPORT, where, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    leftovers = stranded(tmp_path)
    assert any(p.name.startswith(left) for p in leftovers), leftovers
    assert sum(p.stat().st_size for p in (tmp_path / where).rglob("*") if p.is_file()) > 10_000

    tok = bpe_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      head_dim=16), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    export_artifacts(model, tok, tmp_path, (where,), name="run", gguf_quantizations=("f32", "q8_0"),
                     merged_dtype="float32")
    assert stranded(tmp_path) == []
    hidden = sorted(p.name for p in (tmp_path / where).iterdir() if p.name.startswith("."))
    assert hidden == [".fasttune-export.json"]
    final = ["model.safetensors"] if where == "merged" else ["run-F32.gguf", "run-Q8_0.gguf"]
    assert all((tmp_path / where / f).is_file() for f in final)
