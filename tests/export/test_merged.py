"""save_adapter / save_merged: exact merged logits (fp32), NF4 bases, shard-by-shard merge onto a
16-bit base, the live model untouched, atomic files, and the local end-of-training export."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fasttune.export import merged as export
from fasttune.export.merged import save_merged
from helpers.tiny_models import tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer

VOCAB = 1000
NF4_DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=32)


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def _ids(seed=0):
    return torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, train=False):
    # train=True keeps bitsandbytes off its CPU eval path (which repacks NF4 weights and computes in bf16);
    # dropout is 0 everywhere, so train mode computes the same function in fp32
    model.train(train)
    with torch.no_grad():
        return model(ids).logits.float()


def _lora(model, **kw):
    kw = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **kw}
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(**kw))


def _reload(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kw)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _shard_keys(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out[f.name] = sorted(sf.keys())
    return out


@pytest.mark.parametrize("family", ["llama", "gemma", "phi3"])
def test_merged_logits_equal_peft_and_model_untouched(family, tok, tmp_path):
    peft_model = _lora(tiny_model(family, vocab_size=VOCAB))
    ids = _ids()
    ref = _logits(peft_model, ids)
    before = _snapshot(peft_model)

    out = save_merged(peft_model, tmp_path / "m", tok, dtype=torch.float32, max_shard_size="200KB")

    merged = _reload(out)
    torch.testing.assert_close(_logits(merged, ids), ref, rtol=1e-5, atol=1e-5)
    # the live model: same tensors, no adapter merged, same forward
    after = peft_model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged_adapters", []) for m in peft_model.modules())
    assert torch.equal(_logits(peft_model, ids), ref)
    # files: sharded with an index, config without quantisation, generation config, tokenizer
    shards = _shard_keys(out)
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()
    keys = {k for ks in shards.values() for k in ks}
    assert not any("lora_" in k or "base_layer" in k for k in keys)
    assert ("lm_head.weight" in keys) == (not cfg["tie_word_embeddings"])


def test_dora_rslora_and_trained_lm_head_on_tied_model(tok, tmp_path):
    # gemma ties lm_head to the embeddings; a trained lm_head copy must untie them in the export
    peft_model = _lora(tiny_model("gemma", vocab_size=VOCAB), use_dora=True, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"])
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name or "lora_magnitude" in name:
                p.add_(torch.randn_like(p) * 0.05)
    ids = _ids(1)
    ref = _logits(peft_model, ids)
    out = save_merged(peft_model, tmp_path / "m", tok, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    torch.testing.assert_close(_logits(_reload(out), ids), ref, rtol=1e-5, atol=1e-5)


def test_bf16_export_is_fp32_merge_then_cast(tok, tmp_path):
    peft_model = _lora(tiny_model("qwen2", vocab_size=VOCAB))
    f32 = save_merged(peft_model, tmp_path / "f32", dtype=torch.float32)
    bf16 = save_merged(peft_model, tmp_path / "bf16", tok)  # default bfloat16
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(f32 / "model.safetensors"), framework="pt") as a, \
            safe_open(str(bf16 / "model.safetensors"), framework="pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert b.get_tensor(k).dtype == torch.bfloat16
            assert torch.equal(b.get_tensor(k), a.get_tensor(k).to(torch.bfloat16)), k


@pytest.fixture(scope="module")
def nf4_setup(tmp_path_factory):
    """A fp32 base saved in several shards, its NF4 load with a random LoRA, and the same LoRA on fp32."""
    from transformers import BitsAndBytesConfig

    base_dir = tmp_path_factory.mktemp("base")
    # bitsandbytes' CPU 4-bit kernels want widths that are multiples of its 64-value blocks
    base = tiny_model("llama", vocab_size=VOCAB, **NF4_DIMS)
    base.save_pretrained(base_dir, max_shard_size="300KB")
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)
    nf4 = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=qcfg, dtype=torch.float32,
                                               attn_implementation="eager")
    peft_nf4 = _lora(nf4)
    peft_fp32 = _lora(_reload(base_dir))
    set_peft_model_state_dict(peft_fp32, get_peft_model_state_dict(peft_nf4))
    return base_dir, peft_nf4, peft_fp32


def test_merged_from_nf4_base_dequantises(nf4_setup, tmp_path):
    base_dir, peft_nf4, _ = nf4_setup
    assert any(type(m.weight).__name__ == "Params4bit" for m in peft_nf4.modules() if hasattr(m, "weight"))
    ids = _ids(2)
    ref = _logits(peft_nf4, ids, train=True)
    out = save_merged(peft_nf4, tmp_path / "m", dtype=torch.float32)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    torch.testing.assert_close(_logits(_reload(out), ids), ref, rtol=1e-5, atol=1e-5)


def test_merged_from_nf4_weights_in_cpu_packing_format(tmp_path):
    """bitsandbytes repacks NF4 weights in place (bf16 scales) at an eval-mode CPU forward on AVX512-BF16
    machines; the export must still dequantise them (to the bf16-rounded scales) without changing them."""
    from transformers import BitsAndBytesConfig

    base = tmp_path / "base"
    tiny_model("llama", vocab_size=VOCAB, **NF4_DIMS).save_pretrained(base)
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = _lora(AutoModelForCausalLM.from_pretrained(base, quantization_config=qcfg, dtype=torch.float32))
    ids = _ids(5)
    ref = _logits(model, ids, train=True)
    unpacked = _logits(_reload(save_merged(model, tmp_path / "a", dtype=torch.float32)), ids)
    _logits(model, ids)  # eval forward: packs where the CPU supports it
    packed = [m.weight for m in model.modules() if type(getattr(m, "weight", None)).__name__ == "Params4bit"
              and getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
    if not packed:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes does not repack")
    before = [w.data.clone() for w in packed]
    again = _logits(_reload(save_merged(model, tmp_path / "b", dtype=torch.float32)), ids)
    assert all(torch.equal(w.data, b) for w, b in zip(packed, before))
    assert all(w.quant_state.packing_format_for_cpu for w in packed)
    torch.testing.assert_close(unpacked, ref, rtol=1e-5, atol=1e-5)
    assert (again - ref).norm() / ref.norm() < 1e-2  # scales rounded to bf16 by the repacking


def test_merged_onto_16bit_base_shard_by_shard(nf4_setup, tmp_path, monkeypatch):
    base_dir, peft_nf4, peft_fp32 = nf4_setup
    opened = []
    import safetensors

    original = safetensors.safe_open

    def counting_open(path, *a, **kw):
        opened.append(Path(path).name)
        return original(path, *a, **kw)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    out = save_merged(peft_nf4, tmp_path / "m", base=str(base_dir), dtype=torch.float32)
    monkeypatch.undo()
    base_shards, out_shards = _shard_keys(base_dir), _shard_keys(out)
    assert len(base_shards) > 2 and out_shards == base_shards  # same split, one output shard per base shard
    assert [n for n in opened if n.startswith("model")] == sorted(base_shards)  # each base shard read once
    ids = _ids(3)
    torch.testing.assert_close(_logits(_reload(out), ids), _logits(peft_fp32, ids), rtol=1e-5, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_merge_onto_wrong_base_is_rejected(nf4_setup, tok, tmp_path):
    _, peft_nf4, _ = nf4_setup
    narrower = tmp_path / "narrower"
    tiny_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=256, head_dim=16).save_pretrained(narrower)
    with pytest.raises(ValueError, match="base has shape"):
        save_merged(peft_nf4, tmp_path / "m", base=str(narrower), dtype=torch.float32)
    shallower = tmp_path / "shallower"
    tiny_model("llama", vocab_size=VOCAB, num_hidden_layers=1, **NF4_DIMS).save_pretrained(shallower)
    with pytest.raises(ValueError, match="no tensor for the LoRA-merged"):
        save_merged(peft_nf4, tmp_path / "m", base=str(shallower), dtype=torch.float32)
    with pytest.raises(FileNotFoundError):
        save_merged(peft_nf4, tmp_path / "m", base=str(tmp_path / "missing" / "dir"))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        save_merged(torch.nn.Linear(2, 2), "/nonexistent", dtype="int8")
    with pytest.raises(ValueError, match="dtype"):
        save_merged(torch.nn.Linear(2, 2), "/nonexistent", dtype=torch.float64)


def test_failed_export_leaves_previous_files_intact(tok, tmp_path, monkeypatch):
    peft_model = _lora(tiny_model("llama", vocab_size=VOCAB))
    out = save_merged(peft_model, tmp_path / "m", tok, dtype=torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with torch.no_grad():
        next(p for n, p in peft_model.named_parameters() if "lora_B" in n).add_(1.0)

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_save_config", full_disk)
    with pytest.raises(OSError, match="^disk full writing .*m/model.safetensors: free some space"):
        save_merged(peft_model, out, tok, dtype=torch.float32)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no staging leftovers, same bytes


@pytest.mark.gpu
def test_export_from_cuda_models(tok, tmp_path):
    """Merged weights computed on the GPU (fp16-free fp32 LoRA, and an NF4 base) reach CPU files intact."""
    from transformers import BitsAndBytesConfig

    from fasttune.export.gguf import save_gguf

    peft_model = _lora(tiny_model("llama", vocab_size=VOCAB)).cuda()
    ids = _ids(6)
    ref = _logits(peft_model, ids.cuda()).cpu()
    out = save_merged(peft_model, tmp_path / "m", tok, dtype=torch.float32)
    torch.testing.assert_close(_logits(_reload(out), ids), ref, rtol=1e-4, atol=1e-4)
    assert save_gguf(peft_model, tok, tmp_path / "g", ["f16"], name="cuda")[0].is_file()

    base = tmp_path / "base"
    tiny_model("llama", vocab_size=VOCAB, **NF4_DIMS).save_pretrained(base, max_shard_size="300KB")
    qcfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    nf4 = _lora(AutoModelForCausalLM.from_pretrained(base, quantization_config=qcfg, dtype=torch.float32,
                                                     device_map={"": 0}))
    ref = _logits(nf4, ids.cuda()).cpu()
    merged = save_merged(nf4, tmp_path / "nf4", dtype=torch.float32)
    torch.testing.assert_close(_logits(_reload(merged), ids), ref, rtol=1e-4, atol=1e-4)
    onto_base = save_merged(nf4, tmp_path / "onto", base=str(base), dtype=torch.float32)
    assert _shard_keys(onto_base) == _shard_keys(base)
