"""Qwen3.5-MoE (text) as llama.cpp's qwen35moe (``export/gguf_qwen35moe.py``): the expert keys and the expert,
shared-expert and gated-delta-rule tensors in the file, and the configs its graph cannot run refused before
anything is written; tests/export/test_gguf_llama_cpp.py runs the same model in llama.cpp."""

import copy

import gguf
import numpy as np
import pytest

from fasttune.export import gguf as ft_gguf
from fasttune.export import gguf_qwen35moe
from fasttune.export.gguf import save_gguf
from helpers.gguf_models import gguf_qwen3_5_moe_model, gguf_tokenizer


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = gguf_qwen3_5_moe_model()
    paths = save_gguf(model, gguf_tokenizer("bpe"), tmp_path_factory.mktemp("q35moe"), ["f32", "q8_0"])
    return model, paths


def _tensors(path):
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in t.shape[::-1]])
            for t in gguf.GGUFReader(path).tensors}


def test_keys(exported):
    _, (path, _) = exported
    fields = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()}
    assert fields["general.architecture"] == "qwen35moe"
    assert fields["qwen35moe.expert_count"] == 4 and fields["qwen35moe.expert_used_count"] == 2
    assert fields["qwen35moe.expert_feed_forward_length"] == 32
    assert fields["qwen35moe.expert_shared_feed_forward_length"] == 48
    assert "qwen35moe.feed_forward_length" not in fields  # no dense MLP: llama.cpp reads it optionally
    assert fields["qwen35moe.ssm.group_count"] == 2 and fields["qwen35moe.ssm.time_step_rank"] == 4
    assert fields["qwen35moe.ssm.state_size"] == 16 and fields["qwen35moe.ssm.inner_size"] == 64
    assert fields["qwen35moe.full_attention_interval"] == 2
    assert list(fields["qwen35moe.rope.dimension_sections"]) == [2, 2, 2, 0]


def test_expert_shared_expert_and_delta_rule_tensors(exported):
    """The merged (LoRA on every linear layer and on the experts) weights as llama.cpp reads them."""
    model, (path, _) = exported
    tensors = _tensors(path)
    merged = copy.deepcopy(model).merge_and_unload()
    for il in (0, 1):
        mlp, blk = merged.model.layers[il].mlp, f"blk.{il}"
        gate_up = mlp.experts.gate_up_proj.detach().numpy()
        want = {"ffn_gate_exps.weight": gate_up[:, :32], "ffn_up_exps.weight": gate_up[:, 32:],
                "ffn_down_exps.weight": mlp.experts.down_proj.detach().numpy(),
                "ffn_gate_inp.weight": mlp.gate.weight.detach().numpy(),
                "ffn_gate_shexp.weight": mlp.shared_expert.gate_proj.weight.detach().numpy(),
                "ffn_up_shexp.weight": mlp.shared_expert.up_proj.weight.detach().numpy(),
                "ffn_down_shexp.weight": mlp.shared_expert.down_proj.weight.detach().numpy(),
                "ffn_gate_inp_shexp.weight": mlp.shared_expert_gate.weight.detach().numpy()[0],  # a vector
                "post_attention_norm.weight": merged.model.layers[il].post_attention_layernorm.weight.detach()
                .numpy() + 1}
        for name, value in want.items():
            assert tensors[f"{blk}.{name}"].shape == value.shape, name
            np.testing.assert_allclose(tensors[f"{blk}.{name}"], value, rtol=1e-6, atol=1e-7, err_msg=name)
    attn = merged.model.layers[0].linear_attn
    hf_head = [(j % 2) * 2 + j // 2 for j in range(4)]  # value heads tiled over 2 key heads, as in qwen35
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -np.exp(attn.A_log.detach().numpy()[hf_head]), rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.0.ssm_norm.weight"], attn.norm.weight.detach().numpy(), rtol=1e-6)
    assert not any(".ffn_gate.weight" in n or ".ffn_up.weight" in n for n in tensors)  # no dense MLP


def test_router_gates_and_conv_stay_f32_in_quantised_files(exported):
    _, (_, q8) = exported
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(q8).tensors}
    F32, Q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    for il in (0, 1):
        assert types[f"blk.{il}.ffn_gate_inp.weight"] == types[f"blk.{il}.ffn_gate_inp_shexp.weight"] == F32
        assert types[f"blk.{il}.ffn_gate_exps.weight"] == types[f"blk.{il}.ffn_up_shexp.weight"] == Q8
    assert types["blk.0.ssm_conv1d.weight"] == F32


def test_shared_gate_is_a_vector_and_nothing_else_changes():
    gate = "model.layers.3.mlp.shared_expert_gate.weight"
    assert gguf_qwen35moe.shape(gate, (1, 96)) == (96,)
    assert gguf_qwen35moe.transform(gate, np.arange(96.0).reshape(1, 96)).shape == (96,)
    other = "model.layers.3.mlp.shared_expert.up_proj.weight"
    assert gguf_qwen35moe.shape(other, (48, 96)) == (48, 96)
    assert gguf_qwen35moe.transform(other, np.zeros((48, 96))).shape == (48, 96)


def test_configs_llama_cpp_cannot_run_are_refused(tmp_path):
    assert ft_gguf.gguf_refusal(gguf_qwen3_5_moe_model(lora=False).config) is None
    gelu = gguf_qwen3_5_moe_model(lora=False, hidden_act="gelu")
    assert "runs SiLU experts" in ft_gguf.gguf_refusal(gelu.config)
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        save_gguf(gelu, gguf_tokenizer("bpe"), tmp_path / "out")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    odd = gguf_qwen3_5_moe_model(lora=False, num_hidden_layers=3,
                                 layer_types=["linear_attention", "full_attention", "full_attention"])
    assert "full-attention layer every n-th layer" in ft_gguf.gguf_refusal(odd.config)  # Qwen3.5's own rules
    wide = gguf_qwen3_5_moe_model(lora=False, linear_value_head_dim=32)  # llama.cpp: "wrong shape" for attn_qkv
    assert "linear_value_head_dim=32 differs from linear_key_head_dim=16" in ft_gguf.gguf_refusal(wide.config)
