"""patch_model / unpatch_model / patch_report as an API: wrappers, re-patching, unsupported models."""

import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from fasttune import FastConfig, patch_model, patch_report, unpatch_model
from fasttune.model_patches import find_causal_lm
from helpers.tiny_models import make_batch, tiny_model


def test_find_causal_lm_through_peft_and_ddp_style_wrappers():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", num_hidden_layers=1)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    assert find_causal_lm(peft_model) is base

    class DistributedDataParallel(torch.nn.Module):  # the wrapper's name is what find_causal_lm reads
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert find_causal_lm(DistributedDataParallel(peft_model)) is base


def test_report_is_stored_and_repatching_replaces_it():
    model = tiny_model("llama", num_hidden_layers=1)
    first = patch_model(model, FastConfig(rms_norm=False))
    assert patch_report(model) is first and first.patched["rms_norm"] == 0
    second = patch_model(model, FastConfig())
    assert patch_report(model) is second and second.patched["rms_norm"] > 0
    unpatch_model(model)
    assert patch_report(model) is None
    unpatch_model(model)  # no-op


def test_unsupported_model_stays_stock_with_a_warning(caplog):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).eval()
    batch = make_batch(100, seed=1)
    expected = model(**batch).loss
    with caplog.at_level(logging.WARNING, logger="fasttune"):
        report = patch_model(model)
    assert not report.patched and report.fallbacks[0].op == "*"
    assert "llama" in report.fallbacks[0].reason and "gpt2" in caplog.text
    assert torch.equal(model(**batch).loss, expected)
