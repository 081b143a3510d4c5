"""Expandable segments while a patched model lives: switched on, held by each model, restored, and
left alone where the user or the config decides. On CPU the setting is torch's real allocator
string; only ``torch.cuda.is_available`` is forced, so the decision runs as on a GPU machine."""

import pytest
import torch

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.model_patches import allocator
from helpers.tiny_models import tiny_model

ON = "expandable_segments:True"


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    for name in allocator.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator.torch.cuda, "is_available", lambda: True)
    allocator.set_expandable(False)
    yield
    allocator.set_expandable(False)
    assert allocator._holders[0] == 0, "a test left a model holding the switch"


def test_patching_switches_it_on_and_the_last_unpatch_off(as_on_a_gpu):
    first, second = tiny_model("llama", num_hidden_layers=1), tiny_model("qwen2", num_hidden_layers=1)
    report = patch_model(first, FastConfig())
    assert report.patched[allocator.OP] == 1 and ON in allocator.current_settings()
    patch_model(second, FastConfig())
    patch_model(first, FastConfig())  # a re-patch releases and takes the switch again
    unpatch_model(first)
    assert ON in allocator.current_settings(), "the second model still runs under it"
    unpatch_model(second)
    assert ON not in allocator.current_settings()


def test_the_config_turns_it_off(as_on_a_gpu):
    model = tiny_model("llama", num_hidden_layers=1)
    report = patch_model(model, FastConfig(cuda_expandable_segments=False))
    assert report.patched[allocator.OP] == 0 and ON not in allocator.current_settings()
    unpatch_model(model)


@pytest.mark.parametrize("env", allocator.ENV_VARS)
def test_the_users_environment_decides(as_on_a_gpu, monkeypatch, env):
    monkeypatch.setenv(env, "expandable_segments:False,max_split_size_mb:512")
    model = tiny_model("llama", num_hidden_layers=1)
    report = patch_model(model, FastConfig())
    assert report.patched[allocator.OP] == 0 and ON not in allocator.current_settings()
    assert not [fb for fb in report.fallbacks if fb.op == allocator.OP]
    unpatch_model(model)


def test_a_setting_the_user_made_through_torch_is_kept_after_unpatch(as_on_a_gpu):
    allocator.set_expandable(True)
    model = tiny_model("llama", num_hidden_layers=1)
    assert patch_model(model, FastConfig()).patched[allocator.OP] == 1
    unpatch_model(model)
    assert ON in allocator.current_settings()


def test_a_torch_that_refuses_is_a_logged_fallback(as_on_a_gpu, monkeypatch, caplog):
    def refuse(on):
        raise RuntimeError("expandable segments not supported on this driver")

    model = tiny_model("llama", num_hidden_layers=1)
    with monkeypatch.context() as m, caplog.at_level("WARNING", logger="fasttune"):
        m.setattr(allocator, "set_expandable", refuse)
        report = patch_model(model, FastConfig())
    assert [fb.op for fb in report.fallbacks if fb.op == allocator.OP] == [allocator.OP]
    assert "not supported on this driver" in caplog.text
    unpatch_model(model)


def test_without_cuda_nothing_changes(monkeypatch):
    monkeypatch.setattr(allocator.torch.cuda, "is_available", lambda: False)
    model = tiny_model("llama", num_hidden_layers=1)
    assert patch_model(model, FastConfig()).patched[allocator.OP] == 0
    unpatch_model(model)


def test_a_multi_process_run_is_left_as_configured(as_on_a_gpu, monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_model("llama", num_hidden_layers=1)
    with caplog.at_level("INFO", logger="fasttune"):
        report = patch_model(model, FastConfig())
    assert report.patched[allocator.OP] == 0 and ON not in allocator.current_settings()
    assert "WORLD_SIZE" in caplog.text
    unpatch_model(model)


@pytest.mark.gpu
def test_on_the_gpu_new_memory_comes_in_expandable_segments():
    """After the patch, what the step allocates maps into expandable segments (torch's own snapshot)."""
    import os

    if allocator.user_setting():
        pytest.skip(f"{allocator.user_setting()} decides the allocator in this process")
    model = tiny_model("llama", num_hidden_layers=1).cuda()
    patch_model(model, FastConfig())
    try:
        torch.cuda.empty_cache()  # earlier tests' fixed segments: a block that fits their free ranges lands there
        largest_free = max((b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                            if b["state"] == "inactive"), default=0)
        block = torch.empty(largest_free + (300 << 20), dtype=torch.uint8, device="cuda")
        segments = [s for s in torch.cuda.memory_snapshot() if s["address"] <= block.data_ptr()
                    < s["address"] + s["total_size"]]
        assert segments and segments[0].get("is_expandable"), (segments[:1], os.environ.get("PYTORCH_ALLOC_CONF"))
    finally:
        unpatch_model(model)
