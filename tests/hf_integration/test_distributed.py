"""hf_integration/distributed.py in one process: DDP defaults, FSDP checkpointing hand-over, ZeRO-3
registration (DeepSpeed's registration table stood in for) and the export gather's no-op case.
The multi-process behaviour (DDP, FSDP2, real DeepSpeed ZeRO-3, export on rank 0) is in
tests/test_distributed.py."""

import copy
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainingArguments

import fasttune.model_patches.head as head_module
from fasttune import FastConfig, FastTrainer, patch_model
from fasttune.embedded import PadCollator
import fasttune.hf_integration.distributed as distributed
from fasttune.hf_integration.distributed import (DistributedHeadCallback, fsdp_checkpointing_requested,
                                                 gathered_weights, keep_frozen_gathered_zero3, register_zero3_lm_head,
                                                 release_fsdp_checkpointing, set_ddp_defaults, sharding_kind)
from fasttune.model_patches.checkpointing import layer_checkpointing
from helpers.compare import rel_err
from helpers.tiny_models import make_batch, tiny_model
from helpers.train_data import random_lm_rows

VOCAB = 1001


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, **kw)


@pytest.mark.parametrize("user, checkpointing, expected", [
    (None, "offload", False), (None, "recompute", False), (True, "offload", True), (None, None, None)])
def test_ddp_find_unused_parameters(tmp_path, user, checkpointing, expected):
    args = _args(tmp_path, ddp_find_unused_parameters=user)
    changed = set_ddp_defaults(args, FastConfig(checkpointing=checkpointing))
    assert args.ddp_find_unused_parameters is expected
    assert changed is (False if user is None and checkpointing else None)


def test_fast_trainer_sets_find_unused_before_building_ddp_kwargs(tmp_path):
    model = tiny_model("llama", vocab_size=VOCAB)
    trainer = FastTrainer(model=model, args=_args(tmp_path, gradient_checkpointing=True),
                          train_dataset=random_lm_rows(VOCAB, n=4), data_collator=PadCollator(0))
    assert trainer.fast_config.checkpointing == "offload"
    assert trainer.args.ddp_find_unused_parameters is False
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False


def test_fsdp_checkpointing_is_left_to_fasttune(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_checkpointing_requested(SimpleNamespace(fsdp_plugin_args={"activation_checkpointing": True}))
    assert fsdp_checkpointing_requested(SimpleNamespace(fsdp=True, fsdp_config={"activation_checkpointing": True}))
    assert not fsdp_checkpointing_requested(SimpleNamespace(fsdp_plugin_args={"reshard_after_forward": True}))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")  # accelerate launch --config_file fsdp2.yaml
    assert fsdp_checkpointing_requested(SimpleNamespace())

    plugin = SimpleNamespace(activation_checkpointing=True)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    assert not release_fsdp_checkpointing(accelerator, FastConfig())  # fasttune does not checkpoint: FSDP's stays
    assert plugin.activation_checkpointing is True
    assert release_fsdp_checkpointing(accelerator, FastConfig(checkpointing="offload"))
    assert plugin.activation_checkpointing is False
    assert not release_fsdp_checkpointing(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=None)),
                                          FastConfig(checkpointing="offload"))


def _fake_deepspeed(monkeypatch, registered: list):
    """``deepspeed.zero.register_external_parameter`` as DeepSpeed implements it: a per-module table
    exposed through ``module.ds_external_parameters()``."""

    def register_external_parameter(module, parameter):
        if not hasattr(module, "_external_params"):
            module._external_params = {}
            module.ds_external_parameters = types.MethodType(lambda self: self._external_params.items(), module)
        module._external_params[id(parameter)] = parameter
        registered.append((module, parameter))

    zero = SimpleNamespace(register_external_parameter=register_external_parameter)
    monkeypatch.setitem(sys.modules, "deepspeed", SimpleNamespace(zero=zero))


def test_register_zero3_lm_head_makes_the_head_fused(monkeypatch):
    from peft import LoraConfig, get_peft_model

    stock = tiny_model("llama", vocab_size=VOCAB)
    fast = get_peft_model(copy.deepcopy(stock), LoraConfig(r=4, target_modules=["q_proj"]))  # B = 0: same function
    patch_model(fast, FastConfig(rms_norm=False, rope=False, mlp=False, lora=False))
    causal_lm = fast.get_base_model()
    causal_lm.lm_head.weight.requires_grad_(True)
    registered = []
    _fake_deepspeed(monkeypatch, registered)
    assert not register_zero3_lm_head(fast) and registered == []  # not a ZeRO-3 parameter: nothing to do
    weight = causal_lm.lm_head.weight
    weight.ds_id, weight.ds_status = 5, SimpleNamespace(name="AVAILABLE")
    assert sharding_kind(fast) == "zero3"
    DistributedHeadCallback().on_train_begin(None, None, None, model=fast)
    assert registered == [(causal_lm, weight)]
    assert register_zero3_lm_head(fast) and len(registered) == 1  # idempotent

    calls = []
    original = head_module.fused_linear_cross_entropy
    monkeypatch.setattr(head_module, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or original(*a, **k))
    batch = make_batch(VOCAB, seed=4)
    a, b = fast(**batch).loss, stock(**batch).loss
    a.backward()
    b.backward()
    assert calls == [1] and rel_err(a, b) <= 1e-6
    assert rel_err(weight.grad, stock.lm_head.weight.grad) <= 1e-5


def test_gathered_weights_is_a_no_op_without_sharding():
    model = tiny_model("llama", vocab_size=VOCAB)
    before = {n: p for n, p in model.named_parameters()}
    assert sharding_kind(model) == "none"
    with gathered_weights(model, is_main=True) as m:
        assert m is model and all(p is before[n] for n, p in m.named_parameters())
    assert all(p is before[n] for n, p in model.named_parameters())


def _as_zero3_partitions(model, device: str = "cuda"):
    """Every parameter as DeepSpeed ZeRO-3 leaves it on 2 ranks (attributes stood in for: an id, a
    status, half of its elements as the local partition on ``device``); LoRA's adapters stay trainable."""
    for i, p in enumerate(model.parameters()):
        part = (p.numel() + 1) // 2
        p.ds_id, p.ds_status, p.ds_persist, p.ds_numel = i, SimpleNamespace(name="NOT_AVAILABLE"), False, p.numel()
        p.ds_tensor = SimpleNamespace(device=torch.device(device), numel=lambda n=part: n, element_size=lambda: 4)
    return model


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", vocab_size=VOCAB), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    patch_model(model, FastConfig(checkpointing="auto"))
    return model


@pytest.mark.parametrize("setting, cuda, device, free_gib, marked", [
    (False, True, "cuda", 100, False),   # off
    (None, False, "cuda", 100, False),   # "auto" without CUDA
    (None, True, "cpu", 100, False),     # "auto" with the partitions offloaded to the CPU
    (None, True, "cuda", 0, False),      # "auto": more than half of the smallest free memory
    (None, True, "cuda", 100, True),     # "auto" within it
    (True, False, "cpu", 0, True),       # asked for
])
def test_zero3_frozen_parameters_are_kept_gathered_when_asked_or_when_they_fit(monkeypatch, caplog, setting, cuda,
                                                                              device, free_gib, marked):
    """``keep_frozen_gathered_zero3`` marks the frozen ZeRO-3 parameters persistent (never a trainable
    one), and takes their gathered size less the local partitions from "auto" checkpointing's budget;
    the multi-rank run (DeepSpeed's coordinator keeping them whole) is in tests/test_distributed.py."""
    model = _as_zero3_partitions(_lora_model(), device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(distributed, "smallest_free_gpu_memory", lambda device: free_gib << 30)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert frozen and trainable
    with caplog.at_level("INFO", logger="fasttune"):
        n = keep_frozen_gathered_zero3(model, FastConfig(checkpointing="auto", zero3_keep_frozen_gathered=setting))
    assert n == (len(frozen) if marked else 0)
    assert all(p.ds_persist is marked for p in frozen) and not any(p.ds_persist for p in trainable)
    whole = sum(p.numel() * 4 for p in frozen)
    expected = whole - sum((p.numel() + 1) // 2 * 4 for p in frozen) if marked else 0
    assert layer_checkpointing(model).policy.reserved_bytes == expected
    if cuda and setting is None and not marked:  # why not, in the log
        assert "gathers them per module" in caplog.text or "gathers frozen parameters per module" in caplog.text
    assert keep_frozen_gathered_zero3(model, FastConfig(zero3_keep_frozen_gathered=True)) == (
        0 if marked else len(frozen))  # marked ones are not counted twice
