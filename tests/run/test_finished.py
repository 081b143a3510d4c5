"""A finished run's model loads from its folder alone: the adapter on its 16-bit base."""

import torch

from fasttune.run.finished import load_run, torch_dtype, trained_adapter, usable_artifacts
from fasttune.run.folder import RunFolder
from helpers.fake_run import make_finished_run


def test_load_a_finished_lora_run(tmp_path):
    run = make_finished_run(tmp_path / "run")
    folder = RunFolder(run)
    assert trained_adapter(folder) and usable_artifacts(("adapter", "merged"), folder) == ("adapter", "merged")
    cfg, model, tok = load_run(run)
    from peft import PeftModel

    assert isinstance(model, PeftModel) and cfg.run_name == "demo" and tok.eos_token == "</s>"
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert usable_artifacts(("adapter", "gguf"), model) == ("adapter", "gguf")
    (folder.final / "adapter_config.json").unlink()  # as a full fine-tune's final/ would be
    assert usable_artifacts(("adapter", "gguf"), folder) == ("gguf",)
    assert torch_dtype("float16") == torch.float16 and torch_dtype("auto") in (torch.float32, torch.bfloat16)
