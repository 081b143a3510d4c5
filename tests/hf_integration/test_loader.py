"""load_model: tiny models saved to disk and loaded by path (offline), 16-bit and NF4, LoRA attached,
patched, and every wrong name or option turned into a clear error.

Models use hidden/intermediate sizes that are multiples of 64 (bitsandbytes 0.50.2's CPU NF4 path
misbehaves otherwise, docs/FACTS.md, bitsandbytes on the CPU). Hub failures are answered by a
loopback HTTP server that replies the way the Hub does (status + ``X-Error-Code``), so huggingface_hub's
own error mapping is used.
"""

from __future__ import annotations

import http.server
import json
import threading
import traceback

import pytest
import torch

from fasttune import FastConfig, LoraSpec, load_model, patch_report, unpatch_model
from fasttune.hf_integration import loader
from fasttune.hf_integration.loader import ModelLoadError, context_limit, resolve_dtype
from helpers.compare import rel_err
from helpers.tiny_models import tiny_config, tiny_model
from helpers.tiny_tokenizers import bpe_tokenizer, sp_tokenizer

SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _save(path, model_type="llama", tokenizer=None, **overrides):
    model = tiny_model(model_type, seed=3, **{**SIZES, **overrides})
    model.save_pretrained(path)
    (tokenizer or bpe_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama (GQA, 2 layers) + byte-level BPE tokenizer written by save_pretrained."""
    return _save(tmp_path_factory.mktemp("tiny_llama"))


def _bos_batch(tokenizer, device):
    tokenizer.padding_side = "left"
    enc = tokenizer(["the quick brown fox jumps", "hello"], return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in enc.items()}


def _randomise_lora_b(model, seed=0):
    """PEFT starts B at zero; random B makes the adapters change the outputs (so the paths count)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


# --- LoraSpec ------------------------------------------------------------------------------------

def test_lora_spec_defaults_and_peft_config():
    spec = LoraSpec()
    assert (spec.r, spec.alpha, spec.dropout, spec.target_modules, spec.bias) == (16, 16, 0.0, "all-linear", "none")
    assert not spec.use_rslora and not spec.use_dora and spec.modules_to_save is None
    assert spec.unfused_reason() is None
    cfg = LoraSpec(r=8, alpha=32, dropout=0.1, target_modules=["q_proj", "v_proj"], use_rslora=True,
                   modules_to_save=["lm_head"]).to_peft_config()
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.use_rslora) == (8, 32, 0.1, True)
    assert set(cfg.target_modules) == {"q_proj", "v_proj"} and list(cfg.modules_to_save) == ["lm_head"]
    assert "dropout=0.1" in LoraSpec(dropout=0.1).unfused_reason()
    assert "use_dora" in LoraSpec(use_dora=True).unfused_reason()


@pytest.mark.parametrize("kwargs, option", [
    (dict(r=0), "r"), (dict(r=-4), "r"), (dict(r=2.5), "r"), (dict(r=True), "r"),
    (dict(alpha=0), "alpha"), (dict(dropout=-0.1), "dropout"), (dict(dropout=1.0), "dropout"),
    (dict(bias="some"), "bias"), (dict(target_modules=[]), "target_modules"),
    (dict(target_modules=[""]), "target_modules"), (dict(modules_to_save=[3]), "modules_to_save"),
    (dict(seed=1.5), "seed"),
])
def test_lora_spec_rejects_bad_values(kwargs, option):
    with pytest.raises(ValueError, match=rf"LoraSpec\.{option}\b"):
        LoraSpec(**kwargs)


# --- loading -------------------------------------------------------------------------------------

def test_load_16bit_by_path_attaches_lora_and_patches(saved):
    model, tok = load_model(saved, max_seq_length=128, dtype="float32", lora=LoraSpec(r=8, seed=0))
    from peft import PeftModel

    assert isinstance(model, PeftModel)
    assert tok.model_max_length == 128 and tok.pad_token is not None
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable[:5]
    assert len(trainable) == 2 * len(LORA_TARGETS) * 2  # A and B, 7 projections, 2 layers: no lm_head
    assert all(p.dtype == torch.float32 for p in model.parameters())

    report = patch_report(model)
    assert report is not None and report.model_type == "llama"
    for op, n in dict(cross_entropy=1, rms_norm=5, rope=2, lora_qkv=2, lora_o=2, lora_mlp=2).items():
        assert report.patched[op] == n, str(report)
    assert report.fallbacks == [], str(report)

    # A training step runs on the fused paths and only the adapters get gradients.
    model.train()
    batch = _bos_batch(tok, next(model.parameters()).device)
    out = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    assert out.logits is None and torch.isfinite(out.loss)  # fused loss: no logits materialised
    out.loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_auto_dtype_and_seeded_lora(saved):
    model, _ = load_model(saved, lora=LoraSpec(r=4, seed=7))
    expected = resolve_dtype(None, loader.default_device())
    assert model.get_base_model().model.embed_tokens.weight.dtype == expected
    again, _ = load_model(saved, lora=LoraSpec(r=4, seed=7))
    a = dict(model.named_parameters())
    for name, p in again.named_parameters():
        if "lora_A" in name:
            assert torch.equal(p, a[name]), name
    if not torch.cuda.is_available():
        assert expected == torch.float32


def test_full_finetune_without_lora(saved):
    model, _ = load_model(saved, lora=None, dtype="float32", fast_config=FastConfig(rope=False))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.requires_grad for p in model.parameters())
    report = patch_report(model)
    assert report.patched["rope"] == 0 and report.patched["cross_entropy"] == 1


def test_load_4bit_nf4_double_quant_no_upcast(saved):
    bnb = pytest.importorskip("bitsandbytes")
    model, tok = load_model(saved, load_in_4bit=True, dtype="bfloat16", max_seq_length=64)
    base = model.get_base_model()
    quantised = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * len(LORA_TARGETS)
    for m in quantised:
        assert m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested  # double quantisation
        assert m.compute_dtype == torch.bfloat16
    # No fp32 upcast of the non-quantised weights; PEFT keeps the adapters in float32.
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    assert base.lm_head.weight.dtype == torch.bfloat16
    assert {p.dtype for n, p in base.named_parameters() if "norm" in n} == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}
    report = patch_report(model)
    assert report.patched["lora_mlp"] == 2 and report.patched["cross_entropy"] == 1 and not report.fallbacks, \
        str(report)
    model.train()
    batch = _bos_batch(tok, next(model.parameters()).device)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)


@pytest.mark.parametrize("nf4", [False, True])
def test_load_in_fp8_stores_the_lora_bases_in_fp8(saved, nf4):
    """load_in_fp8=True is FastConfig(base_dtype="fp8"): every LoRA base in FP8, recorded with its
    source folder (exports read the 16-bit originals there); from NF4 too (dequantised once)."""
    if nf4:
        pytest.importorskip("bitsandbytes")
    from fasttune.model_patches.fp8_base import FP8_SOURCE_ATTR, is_fp8_layer

    model, tok = load_model(saved, dtype="float32", load_in_4bit=nf4, load_in_fp8=True, lora=LoraSpec(r=4, seed=0),
                            fast_config=FastConfig(rope=False))
    report = patch_report(model)
    assert {report.patched["fp8_" + p] for p in LORA_TARGETS} == {2}, str(report)
    assert report.patched["rope"] == 0  # the rest of the given fast_config is kept
    bases = [m.get_base_layer() for n, m in model.named_modules()
             if n.endswith(LORA_TARGETS) and hasattr(m, "base_layer")]
    assert len(bases) == 14 and all(is_fp8_layer(b) and b.__dict__[FP8_SOURCE_ATTR] == str(saved) for b in bases)
    model.train()
    batch = _bos_batch(tok, next(model.parameters()).device)
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_4bit_lora_generation_matches_unpatched(saved):
    """Greedy tokens and per-step logits of the patched NF4+LoRA model equal PEFT/bitsandbytes' own (fp32).

    bitsandbytes 0.50's CPU inference path (eval, no grad, AVX512-BF16 CPUs) repacks NF4 weights in
    place and multiplies approximately (~3e-3 relative to the exact dequantised product); the
    reference here is bitsandbytes' exact path, so that switch is turned off on each layer.
    """
    bnb = pytest.importorskip("bitsandbytes")
    model, tok = load_model(saved, load_in_4bit=True, dtype="float32")
    _randomise_lora_b(model)
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    model.eval()
    batch = _bos_batch(tok, next(model.parameters()).device)
    kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True,
              pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        fast = model.generate(**batch, **kw)
        unpatch_model(model)
        assert patch_report(model) is None
        stock = model.generate(**batch, **kw)
    assert torch.equal(fast.sequences, stock.sequences)
    for step, (a, b) in enumerate(zip(fast.logits, stock.logits)):
        assert rel_err(a, b) <= 1e-5, step


def test_plain_trainer_accepts_loaded_model(saved, tmp_path):
    from transformers import Trainer, TrainingArguments

    from fasttune.embedded import PadCollator
    from helpers.train_data import random_lm_rows

    model, tok = load_model(saved, dtype="float32", lora=LoraSpec(r=4, seed=0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, learning_rate=1e-2,
                             save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=random_lm_rows(400, n=2, max_len=9),
                      data_collator=PadCollator(tok.pad_token_id))
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n].to(p.device))}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:5]


def test_max_seq_length_is_checked_against_the_config(saved):
    with pytest.raises(ValueError, match=r"max_seq_length=4096 exceeds .*256 positions.*RoPE scaling"):
        load_model(saved, max_seq_length=4096)
    _, tok = load_model(saved, lora=None)
    assert tok.model_max_length == 256  # a tokenizer without a real limit gets the config's


def test_context_limit_counts_declared_rope_scaling():
    cfg = tiny_config("llama", max_position_embeddings=8192)
    assert context_limit(cfg) == 8192
    cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                           "rope_theta": 1e4}
    assert context_limit(cfg) == 32768


def test_missing_pad_token_is_set(tmp_path):
    tok = bpe_tokenizer()
    tok.pad_token = None
    path = _save(tmp_path / "nopad", tokenizer=tok, pad_token_id=None)
    model, loaded = load_model(path, lora=None)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"  # no pad-like or unk token in this vocab
    assert model.config.pad_token_id == model.generation_config.pad_token_id == loaded.pad_token_id

    sp = sp_tokenizer()  # has <unk>: preferred over eos
    sp.pad_token = None
    loader.set_pad_token(sp, tiny_model("llama", vocab_size=512))
    assert sp.pad_token == "<unk>"


def test_unsupported_architecture_loads_stock_with_a_warning(tmp_path, caplog):
    path = tmp_path / "neox"
    torch.manual_seed(0)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_neox", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                               num_attention_heads=4, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    with caplog.at_level("WARNING", logger="fasttune"):
        model, tok = load_model(path, dtype="float32", lora=LoraSpec(r=4))
    report = patch_report(model)
    assert dict(report.patched) == {} and report.fallbacks[0].op == "*" and "gpt_neox" in report.fallbacks[0].reason
    assert any("gpt_neox" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    model.eval()
    with torch.no_grad():
        assert model(**_bos_batch(tok, next(model.parameters()).device)).logits.shape[-1] == 512


# --- wrong names ---------------------------------------------------------------------------------

def _load_error(name, **kw) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(name, **kw)
    err = info.value
    assert err.__cause__ is None and (err.__suppress_context__ or err.__context__ is None)  # no chained traceback
    assert len("".join(traceback.format_exception(err)).splitlines()) < 20
    return err


def test_local_path_errors(tmp_path, saved):
    err = _load_error(str(tmp_path / "nope" / "model"))
    assert err.reason == "path_not_found" and "does not exist" in str(err)
    assert _load_error("./not-here").reason == "path_not_found"
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"x")
    assert _load_error(str(file)).reason == "not_a_model_dir"
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _load_error(str(empty))
    assert err.reason == "not_a_model_dir" and "no config.json" in str(err)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert "PEFT adapter" in str(_load_error(str(adapter)))
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((saved / "config.json").read_text())
    err = _load_error(str(no_weights))
    assert err.reason == "not_a_model_dir" and "no weights" in str(err)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    (unknown / "model.safetensors").write_bytes(b"")
    assert _load_error(str(unknown)).reason == "unknown_architecture"


def test_hub_id_offline_and_invalid():
    err = _load_error("fasttune-tests/definitely-not-cached")  # conftest sets HF_HUB_OFFLINE=1
    assert err.reason == "offline" and "HF_HUB_OFFLINE" in str(err)
    assert _load_error("bad id!").reason == "invalid_name"


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers ``/{org}/{name}/resolve/{rev}/config.json`` like the Hub does for each failure."""

    ANSWERS = {
        "org/missing": (404, "RepoNotFound"),
        "org/private": (401, "RepoNotFound"),
        "org/gated": (403, "GatedRepo"),
        "org/forbidden": (403, None),
        "org/gguf-only": (404, "EntryNotFound"),
        "org/has-branches": (404, "RevisionNotFound"),
    }

    def _answer(self):
        parts = self.path.split("/")
        status, code = self.ANSWERS.get("/".join(parts[1:3]), (500, None))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield endpoint
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("repo, reason, words", [
    ("org/missing", "hub_not_found", "not on the Hub"),
    ("org/private", "hub_not_found", "private"),
    ("org/gated", "gated", "accept its terms"),
    ("org/forbidden", "access_denied", "HTTP 403"),
    ("org/gguf-only", "not_a_model_repo", "no config.json"),
])
def test_hub_errors_are_told_apart(fake_hub, repo, reason, words):
    err = _load_error(repo, token=False)
    assert err.reason == reason and words in str(err) and repo in str(err), str(err)


def test_hub_revision_not_found(fake_hub):
    err = _load_error("org/has-branches", revision="v9", token=False)
    assert err.reason == "revision_not_found" and "'v9'" in str(err)


def test_hub_unreachable(monkeypatch):
    """What huggingface_hub raises once its retries on a dead endpoint run out (measured against a closed
    port: ~45 s of back-off, so simulated here)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    def unreachable(*args, **kwargs):
        try:
            raise ConnectionError("[Errno 111] Connection refused")
        except ConnectionError as cause:
            raise errors.LocalEntryNotFoundError("An error happened while trying to locate the file") from cause

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    err = _load_error("org/anything", token=False)
    assert err.reason == "network" and "Connection refused" in str(err) and "check the network" in str(err)


# --- bad options ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(max_seq_length=0), "max_seq_length"),
    (dict(max_seq_length=2.5), "max_seq_length"),
    (dict(dtype="int8"), "dtype"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(load_in_4bit="yes"), "load_in_4bit"),
    (dict(load_in_fp8="yes"), "load_in_fp8"),
    (dict(load_in_fp8=True, lora=None), "load_in_fp8"),
    (dict(torch_dtype=torch.float16), "dtype"),
    (dict(quantization_config=object()), "quantization_config"),
])
def test_bad_options_raise_before_loading(kwargs, words):
    with pytest.raises(ValueError, match=words):
        load_model("/nonexistent/is/not/read", **kwargs)


def test_bad_option_types():
    with pytest.raises(TypeError, match="lora"):
        load_model("/nonexistent", lora={"r": 8})
    with pytest.raises(TypeError, match="fast_config"):
        load_model("/nonexistent", fast_config={"rope": False})


def test_4bit_without_bitsandbytes_or_on_unsupported_device(monkeypatch):
    real_find_spec = loader.importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"load_in_4bit=True needs bitsandbytes"):
        load_model("/nonexistent", load_in_4bit=True)
    monkeypatch.undo()
    pytest.importorskip("bitsandbytes")
    with pytest.raises(ValueError, match=r"load_in_4bit=True.*not on 'mps'"):
        load_model("/nonexistent", load_in_4bit=True, device_map={"": "mps"})
    with pytest.raises(ValueError, match=r"load_in_4bit=True.*not on 'disk'"):
        load_model("/nonexistent", load_in_4bit=True, device_map={"model": "cpu", "lm_head": "disk"})
    with pytest.raises(ModelLoadError):  # accelerate's strategies pass the option check
        load_model("/nonexistent", load_in_4bit=True, device_map="auto")
    monkeypatch.setattr(loader, "_bnb_cpu_probe", lambda: "RuntimeError: no CPU kernels")
    with pytest.raises(ValueError, match=r"load_in_4bit=True on CPU.*no CPU kernels"):
        load_model("/nonexistent", load_in_4bit=True, device_map={"": "cpu"})



def test_load_4bit_under_fsdp_stores_the_codes_in_the_compute_dtype(saved, monkeypatch):
    """Under ``accelerate launch`` with FSDP (ACCELERATE_USE_FSDP) the NF4 codes are held in the compute
    dtype (``bnb_4bit_quant_storage``), a float tensor FSDP2 shards with the rest of its unit: the
    same bytes as the uint8 load, so the same loss and adapter gradients, bit for bit, on the fused path."""
    bnb = pytest.importorskip("bitsandbytes")
    runs = {}
    for fsdp in ("false", "true"):
        monkeypatch.setenv("ACCELERATE_USE_FSDP", fsdp)
        model, tok = load_model(saved, load_in_4bit=True, dtype="bfloat16", lora=LoraSpec(r=4, seed=0))
        quantised = [m for m in model.get_base_model().modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(quantised) == 2 * len(LORA_TARGETS)
        assert {m.weight.dtype for m in quantised} == {torch.bfloat16 if fsdp == "true" else torch.uint8}
        assert not patch_report(model).fallbacks, str(patch_report(model))
        model.train()
        batch = _bos_batch(tok, next(model.parameters()).device)
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        runs[fsdp] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
                      [m.weight.data.reshape(-1).view(torch.uint8) for m in quantised])
    (loss_a, grads_a, codes_a), (loss_b, grads_b, codes_b) = runs["false"], runs["true"]
    assert all(torch.equal(a, b) for a, b in zip(codes_a, codes_b))
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
