"""The saved adapter reloads in PEFT with the same logits and names the base by its Hub id."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from fasttune.export.adapter import save_adapter
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer

VOCAB = 1000


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def _ids(seed=0):
    return torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits.float()


def _lora(model, **kw):
    kw = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **kw}
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(**kw))


def test_save_adapter_reloads_and_substitutes_base_id(tok, tmp_path):
    base = tiny_model("llama", vocab_size=VOCAB)
    base.config._name_or_path = str(tmp_path / "local-base")
    peft_model = _lora(base, target_modules=["q_proj", "v_proj"])
    ids = _ids(4)
    ref = _logits(peft_model, ids)
    out = save_adapter(peft_model, tmp_path / "a", tok, base_model_id="org/Base-1B")
    assert (out / "adapter_model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/Base-1B"
    reloaded = PeftModel.from_pretrained(tiny_model("llama", vocab_size=VOCAB), out)
    torch.testing.assert_close(_logits(reloaded, ids), ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="PeftModel"):
        save_adapter(base, tmp_path / "b")
