"""gguf_moe_arch: gpt-oss's transposed, interleaved experts with biases split into llama.cpp's
``ffn_{gate,up,down}_exps``, the attention sinks and router bias in the file, glm4moe's and qwen2moe's metadata, and
the configs each MoE graph cannot express refused before any file is written (gpt-oss's YaRN with
truncate=False among them, unless approximate_yarn accepts it). The logits of every MoE arch against
llama.cpp are in test_gguf_llama_cpp.py."""

import numpy as np
import pytest
import torch

import gguf
from fasttune.export.gguf import gguf_refusal, save_gguf
from fasttune.export.gguf_moe_arch import expert_parts, gguf_tensor_name, name_map_key
from helpers.gguf_models import GPT_OSS_YARN, gguf_moe_model, gguf_qwen2_moe_model
from helpers.tiny_tokenizers import bpe_tokenizer

try:
    import llama_cpp
except ImportError:  # CI installs it (NOTES §5)
    llama_cpp = None


def test_gpt_oss_experts_split_computes_what_the_hf_experts_compute():
    E, H, N = 3, 8, 5
    gen = torch.Generator().manual_seed(0)
    gate_up, gate_up_b = torch.randn(E, H, 2 * N, generator=gen), torch.randn(E, 2 * N, generator=gen)
    down, down_b = torch.randn(E, N, H, generator=gen), torch.randn(E, H, generator=gen)
    x = torch.randn(4, H, generator=gen)
    parts = {key: (shape, take) for name, t in (("gate_up_proj", gate_up), ("gate_up_proj_bias", gate_up_b),
                                                ("down_proj", down), ("down_proj_bias", down_b))
             for key, shape, take in expert_parts("gpt-oss", f"model.layers.2.mlp.experts.{name}", tuple(t.shape))}
    assert set(parts) == {f"model.layers.2.mlp.experts.{p}" for p in
                          ("gate_proj", "up_proj", "gate_proj.bias", "up_proj.bias", "down_proj", "down_proj.bias")}
    pre = "model.layers.2.mlp.experts."
    g, u = parts[pre + "gate_proj"][1](gate_up), parts[pre + "up_proj"][1](gate_up)
    gb, ub = parts[pre + "gate_proj.bias"][1](gate_up_b), parts[pre + "up_proj.bias"][1](gate_up_b)
    d, db = parts[pre + "down_proj"][1](down), parts[pre + "down_proj.bias"][1](down_b)
    assert parts[pre + "gate_proj"][0] == tuple(g.shape) == (E, N, H)
    assert parts[pre + "down_proj"][0] == tuple(d.shape) == (E, H, N)
    for e in range(E):  # HF: gate = even columns of x @ gate_up + b, up = odd ones; llama.cpp: W x + b per piece
        hf = x @ gate_up[e] + gate_up_b[e]
        torch.testing.assert_close(x @ g[e].T + gb[e], hf[:, 0::2])
        torch.testing.assert_close(x @ u[e].T + ub[e], hf[:, 1::2])
        h = torch.randn(4, N, generator=gen)
        torch.testing.assert_close(h @ d[e].T + db[e], h @ down[e] + down_b[e])


def test_chunked_experts_and_names():
    parts = expert_parts("granitemoe", "model.layers.0.block_sparse_moe.experts.gate_up_proj", (4, 256, 64))
    assert [(k, s) for k, s, _ in parts] == [("model.layers.0.mlp.experts.gate_proj", (4, 128, 64)),
                                             ("model.layers.0.mlp.experts.up_proj", (4, 128, 64))]
    assert expert_parts("olmoe", "model.layers.0.mlp.gate.weight", (4, 64)) is None
    assert name_map_key("model.layers.3.block_sparse_moe.router.weight") == "model.layers.3.mlp.gate.weight"
    assert gguf_tensor_name("blk.0.attn_sinks") == "blk.0.attn_sinks.weight"
    assert gguf_tensor_name("blk.0.attn_q.bias") == "blk.0.attn_q.bias"


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory):
    model = gguf_moe_model("gpt_oss")
    return model, save_gguf(model, bpe_tokenizer(), tmp_path_factory.mktemp("gpt_oss"), ["q8_0"], name="oss")[0]


def test_gpt_oss_metadata_sinks_and_biases(gpt_oss_file):
    model, path = gpt_oss_file
    reader = gguf.GGUFReader(path)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["general.architecture"] == "gpt-oss"
    assert fields["gpt-oss.expert_count"] == 4 and fields["gpt-oss.expert_used_count"] == 2
    assert fields["gpt-oss.expert_feed_forward_length"] == 128
    assert fields["gpt-oss.attention.sliding_window"] == 5
    assert fields["gpt-oss.rope.scaling.factor"] == 32.0
    assert fields["gpt-oss.rope.scaling.original_context_length"] == 4096
    tensors = {t.name: t for t in reader.tensors}
    merged = model.merge_and_unload().state_dict() if hasattr(model, "merge_and_unload") else model.state_dict()
    F32 = gguf.GGMLQuantizationType.F32
    for name, hf in (("blk.1.attn_sinks.weight", "self_attn.sinks"), ("blk.1.ffn_gate_inp.bias", "mlp.router.bias"),
                     ("blk.1.attn_q.bias", "self_attn.q_proj.bias"),
                     ("blk.1.ffn_gate_inp.weight", "mlp.router.weight")):
        want = merged[f"model.layers.1.{hf}"].numpy()
        assert tensors[name].tensor_type == F32, name
        np.testing.assert_array_equal(np.asarray(tensors[name].data).reshape(want.shape), want)
    gate_up_b = merged["model.layers.1.mlp.experts.gate_up_proj_bias"].numpy()
    for name, want in (("blk.1.ffn_gate_exps.bias", gate_up_b[:, 0::2]), ("blk.1.ffn_up_exps.bias", gate_up_b[:, 1::2]),
                       ("blk.1.ffn_down_exps.bias", merged["model.layers.1.mlp.experts.down_proj_bias"].numpy())):
        assert tensors[name].tensor_type == F32, name
        np.testing.assert_array_equal(np.asarray(tensors[name].data).reshape(want.shape), want)
    assert tensors["blk.1.ffn_gate_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_glm4moe_metadata_dense_lead_shared_expert_and_selection_bias(tmp_path):
    model = gguf_moe_model("glm4_moe")
    path = save_gguf(model, bpe_tokenizer(), tmp_path, ["f16"], name="glm")[0]
    reader = gguf.GGUFReader(path)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["glm4moe.expert_count"] == 4 and fields["glm4moe.expert_used_count"] == 2
    assert fields["glm4moe.expert_feed_forward_length"] == 128 and fields["glm4moe.feed_forward_length"] == 256
    assert fields["glm4moe.expert_shared_count"] == 1 and fields["glm4moe.leading_dense_block_count"] == 1
    assert fields["glm4moe.expert_weights_scale"] == 2.5 and fields["glm4moe.expert_weights_norm"] is True
    assert fields["glm4moe.expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
    assert fields["glm4moe.rope.dimension_count"] == 32  # partial_rotary_factor 0.5 of head_dim 64
    tensors = {t.name: t for t in reader.tensors}
    assert {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight"} <= set(tensors)
    assert not any(n.startswith("blk.0.ffn_") and "exps" in n for n in tensors)
    assert {"blk.1.ffn_gate_shexp.weight", "blk.1.attn_q.bias", "blk.1.attn_q_norm.weight"} <= set(tensors)
    bias = model.base_model.model.model.layers[1].mlp.gate.e_score_correction_bias.numpy()
    t = tensors["blk.1.exp_probs_b.bias"]
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(np.asarray(t.data), bias)


def test_qwen2moe_metadata_shared_expert_and_its_gate(tmp_path):
    """Qwen2-MoE as llama.cpp's qwen2moe: expert and shared-expert widths, q/k/v biases, the shared expert's sigmoid
    gate (HF [1, H]) as a vector of n_embd, LoRA on it merged; a required ``output``."""
    model = gguf_qwen2_moe_model()
    path = save_gguf(model, bpe_tokenizer(), tmp_path, ["f32"], name="q2")[0]
    reader = gguf.GGUFReader(path)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["general.architecture"] == "qwen2moe"
    assert fields["qwen2moe.expert_count"] == 4 and fields["qwen2moe.expert_used_count"] == 2
    assert fields["qwen2moe.expert_feed_forward_length"] == 128
    assert fields["qwen2moe.expert_shared_feed_forward_length"] == 256
    tensors = {t.name: t for t in reader.tensors}
    merged = model.merge_and_unload().state_dict()
    gate = tensors["blk.1.ffn_gate_inp_shexp.weight"]
    assert [int(n) for n in gate.shape] == [256]
    np.testing.assert_array_equal(np.asarray(gate.data), merged["model.layers.1.mlp.shared_expert_gate.weight"][0])
    want = merged["model.layers.1.mlp.shared_expert.down_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_down_shexp.weight"].data).reshape(want.shape), want)
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias", "output.weight"} <= set(tensors)
    assert not any(n.startswith("blk.") and n.split(".")[2] in ("ffn_gate", "ffn_up", "ffn_down") for n in tensors)
    assert gguf_refusal(model.config) is None


@pytest.mark.parametrize("family, overrides, match", [
    ("gpt_oss", dict(swiglu_limit=5.0), "limit=7.0"),
    ("gpt_oss", dict(swiglu_alpha=1.5), "alpha=1.702"),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"]), "even layers"),
    ("gpt_oss", dict(attention_bias=False), "attention_bias"),
    ("gpt_oss", dict(rope_parameters=GPT_OSS_YARN), "truncate=False"),
    ("olmoe", dict(num_key_value_heads=2), "grouped-query"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("olmoe", dict(norm_topk_prob=True), "does not renormalise"),
    ("glm4_moe", dict(n_routed_experts=8, n_group=4, topk_group=2), "group-limited"),
    ("glm4_moe", dict(n_shared_experts=0), "shared expert"),
    # qwen2moe: measured in llama.cpp (F32, tiny model): renormalised top-k 0.16 relative logit error, a window of 4
    # tokens 0.72; heads narrower than hidden do not load
    ("qwen2_moe", dict(norm_topk_prob=True), "does not renormalise"),
    ("qwen2_moe", dict(mlp_only_layers=[1]), "dense layers"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "dense layers"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), "no sliding window"),
    ("qwen2_moe", dict(head_dim=32), "num_attention_heads \\* head_dim"),
    ("qwen2_moe", dict(hidden_act="gelu"), "SiLU"),
])
def test_configs_llama_cpp_cannot_express_are_refused_before_writing(family, overrides, match, tmp_path):
    model = gguf_moe_model(family, **overrides)
    with pytest.raises(ValueError, match=match):
        save_gguf(model, bpe_tokenizer(), tmp_path, ["f16"], name="x")
    assert list(tmp_path.iterdir()) == []
    assert gguf_refusal(model.config) is not None  # FastTrainer's check at construction says so too


def test_untruncated_yarn_is_written_when_accepted(tmp_path, caplog):
    model = gguf_moe_model("gpt_oss", rope_parameters=GPT_OSS_YARN)
    with caplog.at_level("WARNING", logger="fasttune.export.gguf_arch"):
        path = save_gguf(model, bpe_tokenizer(), tmp_path, ["f16"], name="x", approximate_yarn=True)[0]
    assert "truncate=False" in caplog.text
    fields = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()}
    assert fields["gpt-oss.rope.scaling.factor"] == 32.0


@pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed (NOTES §5)")
def test_llama_cpp_runs_yarn_truncated_at_long_positions(tmp_path):
    """ggml floors/ceils the YaRN correction range: over 384 positions llama.cpp follows the
    truncate=True model to fp32 rounding and is far from the truncate=False one (the same weights)."""
    n = 384
    ids = torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for truncate in (True, False):
        model = gguf_moe_model("gpt_oss", max_position_embeddings=512,
                               rope_parameters=dict(GPT_OSS_YARN, truncate=truncate))
        with torch.no_grad():
            logits[truncate] = model(torch.tensor([ids])).logits[0].numpy()
    path = save_gguf(model, bpe_tokenizer(), tmp_path, ["f32"], name="x", approximate_yarn=True)[0]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True, verbose=False,
                          n_threads=2, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(ids)
    got = np.asarray(llm.scores[:n])
    llm.close()
    err = {t: float(np.linalg.norm(got - want) / np.linalg.norm(want)) for t, want in logits.items()}
    assert err[True] <= 1e-4 and err[False] >= 1e-2, err
