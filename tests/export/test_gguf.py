"""GGUF export: every family read back with GGUFReader (names, shapes, metadata, dequantised values
against PEFT's own merge); RoPE variants and tokenizers (chat prompts with special tokens)
through llama.cpp; K-quants through llama.cpp's quantizer. Every family and type loaded in
llama.cpp with logits compared: test_gguf_llama_cpp.py.

Tiny models here use widths that are multiples of 256 (K-quant rows) and in-process tokenizers
llama.cpp recognises (byte-level BPE "gpt2" and SentencePiece-style "llama").
"""

import copy
import sys

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import gguf
from fasttune.export import gguf as ft_gguf
from fasttune.export.gguf import save_gguf
from fasttune.export.merged import save_merged
from helpers.gguf_models import ARCH, DIMS, FAMILIES, ROTARY, SP_FAMILIES, TIED, gguf_model, gguf_tokenizer
from helpers.tiny_tokenizers import sp_model_bytes, sp_tokenizer

try:
    import llama_cpp
except ImportError:  # CI installs it (see docs/FACTS.md, GGUF and llama.cpp for the build flags)
    llama_cpp = None
needs_llama_cpp = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed (docs/FACTS.md, GGUF and llama.cpp)")

SEQ = 12


def _tokenizer(kind):
    return gguf_tokenizer(kind)


def _model(family, **overrides):
    return gguf_model(family, **overrides)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family → (peft model, tokenizer, {"f16": path, "q8_0": path}, reference logits, ids)."""
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(family):
        if family not in cache:
            model = _model(family)
            tok = _tokenizer("sp" if family in SP_FAMILIES else "bpe")
            paths = save_gguf(model, tok, root / family, ["f16", "q8_0"], name=f"tiny-{family}")
            ids = torch.randint(3, 400, (1, SEQ), generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                ref = model(ids).logits[0].float().numpy()
            cache[family] = (model, tok, dict(zip(["f16", "q8_0"], paths)), ref, ids[0].tolist())
        return cache[family]

    return get


def _field(reader, key):
    return reader.fields[key].contents()


def _interleave_rows(w, n_head):
    """Independent oracle of the rotate-half → interleaved-pairs row order, head by head."""
    out = np.empty_like(w)
    d = w.shape[0] // n_head
    for h in range(n_head):
        rows = w[h * d:(h + 1) * d]
        out[h * d:(h + 1) * d][0::2] = rows[: d // 2]
        out[h * d:(h + 1) * d][1::2] = rows[d // 2:]
    return out


def _expected_tensors(family, model):
    """GGUF name → expected values, from PEFT's own merge (on a copy) and llama.cpp's conventions."""
    arch = ARCH.get(family, family)
    merged = copy.deepcopy(model).merge_and_unload()
    sd = {k: v.float().numpy() for k, v in merged.state_dict().items()}
    shift = 1.0 if arch.startswith("gemma") else 0.0
    per_layer = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "post_attention_layernorm": "ffn_norm" if arch not in ("gemma2", "gemma3", "olmo2", "exaone4", "seed_oss")
        else "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",  # GLM-4
        "self_attn.query_layernorm": "attn_q_norm", "self_attn.key_layernorm": "attn_k_norm",  # Hunyuan
    }
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + shift}
    if family not in TIED:
        out["output.weight"] = sd["lm_head.weight"]
    elif arch == "olmo2":
        out["output.weight"] = sd["model.embed_tokens.weight"]
    for key, value in sd.items():
        if not key.startswith("model.layers."):
            continue
        _, _, layer, rest = key.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        value = value + shift if "norm" in module else value
        if arch in ("llama", "granite", "smollm3") and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = DIMS["num_attention_heads"] if "q_proj" in module else DIMS["num_key_value_heads"]
            value = _interleave_rows(value, heads)
        out[f"blk.{layer}.{per_layer[module]}.{kind}"] = value
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_reader_names_shapes_metadata_values(family, exported):
    model, tok, paths, _, _ = exported(family)
    arch = ARCH.get(family, family)
    expected = _expected_tensors(family, model)
    for quant, tol in (("f16", 1e-3), ("q8_0", 1e-2)):
        reader = gguf.GGUFReader(paths[quant])
        assert _field(reader, "general.architecture") == arch
        assert _field(reader, f"{arch}.block_count") == DIMS["num_hidden_layers"]
        assert _field(reader, f"{arch}.embedding_length") == DIMS["hidden_size"]
        assert _field(reader, f"{arch}.feed_forward_length") == DIMS["intermediate_size"]
        assert _field(reader, f"{arch}.attention.head_count") == DIMS["num_attention_heads"]
        assert _field(reader, f"{arch}.attention.head_count_kv") == DIMS["num_key_value_heads"]
        assert _field(reader, f"{arch}.context_length") == DIMS["max_position_embeddings"]
        assert _field(reader, f"{arch}.rope.dimension_count") == int(DIMS["head_dim"] * ROTARY.get(family, 1.0))
        assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
        assert _field(reader, "general.file_type") == gguf.LlamaFileType[f"MOSTLY_{quant.upper()}"]
        assert _field(reader, "tokenizer.ggml.model") == ("llama" if family in SP_FAMILIES else "gpt2")
        assert len(_field(reader, "tokenizer.ggml.tokens")) == DIMS["vocab_size"]
        assert _field(reader, "tokenizer.chat_template") == tok.chat_template
        assert _field(reader, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
        tensors = {t.name: t for t in reader.tensors}
        assert set(tensors) == set(expected)
        for name, want in expected.items():
            t = tensors[name]
            assert list(t.shape[::-1]) == list(want.shape), name
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
            is_matrix = want.ndim == 2 and not name.endswith("_norm.weight")
            assert t.tensor_type == (gguf.GGMLQuantizationType[quant.upper()] if is_matrix
                                     else gguf.GGMLQuantizationType.F32), name
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err < (tol if is_matrix else 1e-7), (name, err)


def test_arch_specific_metadata(exported):
    r = gguf.GGUFReader(exported("gemma2")[2]["f16"])
    assert _field(r, "gemma2.attn_logit_softcapping") == pytest.approx(50.0)
    assert _field(r, "gemma2.final_logit_softcapping") == pytest.approx(30.0)
    assert _field(r, "gemma2.attention.sliding_window") == 64
    assert _field(r, "gemma2.attention.sliding_window_pattern") == [True, False]
    r = gguf.GGUFReader(exported("gemma3_text")[2]["f16"])
    assert _field(r, "gemma3.rope.freq_base") == pytest.approx(1e6)
    assert _field(r, "gemma3.rope.freq_base_swa") == pytest.approx(1e4)
    assert _field(r, "gemma3.final_logit_softcapping") == pytest.approx(20.0)
    r = gguf.GGUFReader(exported("granite")[2]["f16"])
    assert _field(r, "granite.attention.scale") == pytest.approx(0.2)
    assert _field(r, "granite.embedding_scale") == pytest.approx(2.0)
    assert _field(r, "granite.residual_scale") == pytest.approx(0.5)
    assert _field(r, "granite.logit_scale") == pytest.approx(4.0)
    assert "granite.attention.key_length" not in r.fields
    r = gguf.GGUFReader(exported("phi3")[2]["f16"])
    assert _field(r, "phi3.rope.scaling.original_context_length") == 4096
    assert _field(r, "general.name") == "tiny-phi_3"  # llama.cpp's Phi-3 vocab quirk needs Phi-3 tokens
    r = gguf.GGUFReader(exported("llama")[2]["f16"])
    assert _field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert _field(r, "tokenizer.ggml.eot_token_id") == _tokenizer("bpe").convert_tokens_to_ids("<|im_end|>")


ROPE_CASES = {
    "llama-llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-linear": ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "qwen2-yarn": ("qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}),
    "gemma3-linear-global": ("gemma3_text", {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3-partial": ("phi3", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


@needs_llama_cpp
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_llama_cpp_rope_scaling(case, tmp_path):
    """RoPE variants (llama3 frequency factors, linear, YaRN, Gemma 3 global-only scaling, partial rotary)
    over 40 positions, so the scaled frequencies matter."""
    family, rope = ROPE_CASES[case]
    extra = {"sliding_window": 8} if family == "gemma3_text" else {}
    model = _model(family, rope_parameters=rope, **extra)
    path = save_gguf(model, _tokenizer("bpe"), tmp_path, ["f16"])[0]
    if rope.get("rope_type") == "llama3":
        assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    ids = torch.randint(3, 400, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits[0].float().numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids[0].tolist())
    got = np.asarray(llm.scores[:40])
    llm.close()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-2


@needs_llama_cpp
@pytest.mark.parametrize("kind", ["bpe", "sp", "sp-prefix"])
def test_llama_cpp_tokenizer_parity(kind, exported, tmp_path):
    """Same ids from llama.cpp as from transformers: plain text, and a chat prompt with special tokens."""
    if kind == "sp-prefix":  # Llama-2-style dummy prefix: llama.cpp's add_space_prefix
        tok = sp_tokenizer(add_prefix_space=True)
        path = save_gguf(exported("gemma")[0], tok, tmp_path, "f16")[0]
    else:
        tok = _tokenizer(kind)
        path = exported("llama" if kind == "bpe" else "gemma")[2]["f16"]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, vocab_only=True, verbose=False)
    # (no leading blank: transformers' Metaspace skips the prefix ▁ before one, llama.cpp's SPM does not)
    texts = ["Hello world, how are you today?", "double  spaces and 12345 numbers\n\nnew  lines ",
             "Ünïcödé naïve café 🦙", "fine-tuning isn't hard; it's fun!"]
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok(text, add_special_tokens=False)["input_ids"]
    assert llm.token_eos() == tok.eos_token_id and llm.token_bos() == tok.bos_token_id
    if kind == "sp-prefix":
        llm.close()
        return  # after special tokens llama.cpp prefixes a space again (transformers' legacy=True behaviour)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True)
    assert llm.tokenize(chat.encode(), add_bos=False, special=True) == tok(chat, add_special_tokens=False)["input_ids"]
    llm.close()


def test_sentencepiece_scores_from_model_file(exported, tmp_path):
    """A tokenizer that still has its SentencePiece model file gets the model's own scores."""
    import sentencepiece as spm

    tok = sp_tokenizer()
    (tmp_path / "tokenizer.model").write_bytes(sp_model_bytes())
    tok.vocab_file = str(tmp_path / "tokenizer.model")
    path = save_gguf(exported("gemma")[0], tok, tmp_path / "out", "f16")[0]
    scores = _field(gguf.GGUFReader(path), "tokenizer.ggml.scores")
    sp = spm.SentencePieceProcessor(model_proto=sp_model_bytes())
    normal = [i for i in range(sp.get_piece_size()) if not (sp.is_control(i) or sp.is_byte(i) or sp.is_unknown(i))
              and not sp.id_to_piece(i).startswith("<")]
    assert [scores[i] for i in normal] == pytest.approx([sp.get_score(i) for i in normal])
    without = gguf.GGUFReader(exported("gemma")[2]["f16"])  # merge-rank scores: same order of merges
    merged_pieces = [i for i in normal if len(sp.id_to_piece(i)) > 1]
    rank = _field(without, "tokenizer.ggml.scores")
    assert np.argsort([-scores[i] for i in merged_pieces], kind="stable").tolist() == \
        np.argsort([-rank[i] for i in merged_pieces], kind="stable").tolist()


@needs_llama_cpp
def test_kquants_through_llama_cpp(exported, tmp_path):
    model, tok, _, ref, ids = exported("llama")
    paths = save_gguf(model, tok, tmp_path, ["q4_k_m", "q6_k", "q4_0"], name="run")
    assert [p.name for p in paths] == ["run-Q4_K_M.gguf", "run-Q6_K.gguf", "run-Q4_0.gguf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no intermediate left
    expected = _expected_tensors("llama", model)
    for path, weight_tol, logit_tol in zip(paths, (0.12, 0.04, 0.15), (0.5, 0.15, 0.5)):
        reader = gguf.GGUFReader(path)
        types = {t.tensor_type.name for t in reader.tensors}
        assert {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q6_K": {"Q6_K"}, "Q4_0": {"Q4_0", "Q8_0"}}[path.stem.split("-")[-1]] <= types
        q = reader.tensors[[t.name for t in reader.tensors].index("blk.0.attn_q.weight")]
        got = gguf.quants.dequantize(q.data, q.tensor_type)
        want = expected["blk.0.attn_q.weight"]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < weight_tol
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        llm.eval(ids)
        got = np.asarray(llm.scores[:SEQ])
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < logit_tol, path.name
        llm.close()


def test_from_saved_folder_equals_from_model(exported, tmp_path):
    model, tok, _, _, _ = exported("qwen2")
    folder = save_merged(model, tmp_path / "merged", tok, dtype=torch.float32)
    a = save_gguf(model, tok, tmp_path / "a", "f16", name="same")[0]
    b = save_gguf(folder, tok, tmp_path / "b", ["f16"], name="same")[0]
    assert a.read_bytes() == b.read_bytes()
    c = save_gguf(folder, None, tmp_path / "c", ["f16"])[0]  # tokenizer and name from the folder
    assert c.name == "merged-F16.gguf" and gguf.GGUFReader(c).fields["tokenizer.ggml.tokens"].contents()[:5] == \
        gguf.GGUFReader(a).fields["tokenizer.ggml.tokens"].contents()[:5]


def test_kquants_without_llama_cpp_name_the_extra(monkeypatch, exported, tmp_path):
    model, tok, _, _, _ = exported("llama")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match=r"pip install 'fasttune\[gguf-kquants\]'") as info:
        save_gguf(model, tok, tmp_path, ["q8_0", "q4_k_m"])
    assert "-DGGML_NATIVE=OFF" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # checked before any work


def test_failed_write_leaves_no_file(exported, tmp_path, monkeypatch):
    model, tok, _, _, _ = exported("llama")
    calls = []
    real = ft_gguf._encode

    def flaky(data, qtype):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(data, qtype)

    monkeypatch.setattr(ft_gguf, "_encode", flaky)
    with pytest.raises(OSError):
        save_gguf(model, tok, tmp_path, ["f16", "q8_0"], name="x")
    assert list(tmp_path.iterdir()) == []


def test_bad_inputs(exported, tmp_path):
    model, tok, _, _, _ = exported("llama")
    with pytest.raises(ValueError, match="q3_z"):
        save_gguf(model, tok, tmp_path, ["q3_z"])
    with pytest.raises(ValueError, match="tokenizer is required"):
        save_gguf(model, None, tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        save_gguf(AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=64, n_head=2,
                                                                          vocab_size=512)), tok, tmp_path)
    small = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**DIMS, "vocab_size": 256}))
    with pytest.raises(ValueError, match="embedding has only 256 rows"):
        save_gguf(small, tok, tmp_path)
    untied = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma", **DIMS, tie_word_embeddings=False))
    with torch.no_grad():
        untied.lm_head.weight.normal_()
    with pytest.raises(ValueError, match="separate lm_head"):
        save_gguf(untied, _tokenizer("sp"), tmp_path)


@pytest.mark.parametrize("model_type", ["ministral"])
def test_families_without_converter_rules_are_refused_before_anything_is_written(model_type, tmp_path):
    """Trained on the fast path, but their GGUF layout was never checked in llama.cpp: refused with
    the way out, and nothing is written."""
    from helpers.tiny_models import tiny_model

    model = tiny_model(model_type)
    assert ft_gguf.gguf_refusal(model.config) is not None
    with pytest.raises(ValueError, match=rf"GGUF export of '{model_type}'.*not implemented.*save_merged"):
        save_gguf(model, _tokenizer("bpe"), tmp_path / "out")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    assert ft_gguf.gguf_refusal(tiny_model("llama").config) is None


def test_smollm3_nope_layers_llama_cpp_cannot_run_are_refused(tmp_path):
    """llama.cpp skips RoPE in every fourth layer whatever the config says: another pattern is refused."""
    odd = gguf_model("smollm3", no_rope_layers=[1, 0])  # the second layer NoPE: llama.cpp would rotate it
    assert "no_rope_layers is [1, 0]" in ft_gguf.gguf_refusal(odd.base_model.model.config)
    with pytest.raises(ValueError, match=r"smollm3 GGUF: llama.cpp applies RoPE to layers \[1, 1\]"):
        save_gguf(odd, gguf_tokenizer("bpe"), tmp_path / "out")
    assert ft_gguf.gguf_refusal(gguf_model("smollm3").base_model.model.config) is None


@pytest.mark.parametrize("overrides, why", [
    (dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
     r"sliding_window=5.*only for 64-layer models and runs these 2 layers all rotated"),
    (dict(num_hidden_layers=64, layer_types=["full_attention"] * 64, hidden_size=128, intermediate_size=256,
          num_attention_heads=2, num_key_value_heads=1), r"every 64-layer EXAONE 4 the 32B's sliding window"),
    (dict(head_dim=32), r"num_attention_heads \* head_dim == hidden_size.*4 \* 32 != 256"),
    (dict(hidden_act="gelu"), r"SiLU-gated MLP, this config's hidden_act is 'gelu'"),
], ids=["window_at_2_layers", "no_window_at_64_layers", "head_dim", "activation"])
def test_exaone4_configs_llama_cpp_runs_otherwise_are_refused(overrides, why, tmp_path):
    """llama.cpp runs EXAONE 4's window (NoPE full-attention layers) at 64 layers only, and every other depth
    rotated with full attention; its output projection is square and its MLP SiLU. Each of these would load
    and give other logits, or fail to load (head_dim): refused up front (gguf_refusal) and by save_gguf."""
    model = gguf_model("exaone4", **overrides)
    refusal = ft_gguf.gguf_refusal(model.base_model.model.config)
    assert refusal is not None and refusal.startswith("exaone4 GGUF: ")
    with pytest.raises(ValueError, match=why):
        save_gguf(model, gguf_tokenizer("bpe"), tmp_path / "out")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    assert ft_gguf.gguf_refusal(gguf_model("exaone4").base_model.model.config) is None


@pytest.mark.parametrize("overrides, why", [
    (dict(attention_out_bias=True), r"seed_oss GGUF: llama.cpp's Seed-OSS graph has no o_proj bias"),
    (dict(mlp_bias=True), r"seed_oss GGUF: llama.cpp's Seed-OSS graph has no MLP projection biases"),
], ids=["o_proj_bias", "mlp_bias"])
def test_seed_oss_biases_llama_cpp_cannot_load_are_refused(overrides, why, tmp_path):
    """llama.cpp's Seed-OSS loader reads q/k/v biases only: a file with an o_proj or MLP bias fails to load there
    (checked by hand with llama-cpp-python 0.3.36), so fasttune refuses it up front and when writing."""
    model = gguf_model("seed_oss", **overrides)
    assert ft_gguf.gguf_refusal(model.base_model.model.config).startswith("seed_oss GGUF: ")
    with pytest.raises(ValueError, match=why):
        save_gguf(model, gguf_tokenizer("bpe"), tmp_path / "out")
    assert ft_gguf.gguf_refusal(gguf_model("seed_oss").base_model.model.config) is None


def test_ernie4_5_projection_biases_llama_cpp_cannot_run_are_refused(tmp_path):
    biased = gguf_model("ernie4_5", use_bias=True)  # fasttune trains it (tiny_models); llama.cpp has no biases
    with pytest.raises(ValueError, match="ernie4_5 GGUF: llama.cpp's ERNIE 4.5 graph has no projection biases"):
        save_gguf(biased, gguf_tokenizer("bpe"), tmp_path / "out")


def test_a_rope_scaling_llama_cpp_cannot_be_told_is_refused_up_front():
    """Hunyuan's dynamic (NTK-alpha) RoPE has no GGUF key here: refused by gguf_refusal, which FastTrainer asks
    at construction, not only when the file is written after training."""
    model = gguf_model("hunyuan_v1_dense", rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    assert "RoPE type 'dynamic' is not supported for GGUF arch 'hunyuan-dense'" in ft_gguf.gguf_refusal(
        model.base_model.model.config)
