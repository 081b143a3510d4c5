"""Qwen3.5 (text) as llama.cpp's qwen35 (``export/gguf_qwen35.py``): the keys and the gated delta rule's tensors
in the file; tests/export/test_gguf_llama_cpp.py runs the same model in llama.cpp."""

import copy

import gguf
import numpy as np
import pytest

from fasttune.export import gguf as ft_gguf
from fasttune.export import gguf_qwen35
from fasttune.export.gguf import save_gguf
from helpers.gguf_models import QWEN3_5, gguf_model, gguf_tokenizer


def _field(reader, key):
    return reader.fields[key].contents()


def test_qwen3_5_keys_and_gated_delta_rule_tensors(tmp_path):
    """The qwen35 file's SSM keys and the delta rule's tensors as llama.cpp reads them (test_gguf_llama_cpp.py
    runs it): ssm_a = −exp(A_log) and each GGUF value head j holding transformers' head (j % nk)·r + j // nk."""
    model = gguf_model("qwen3_5_text", **QWEN3_5)
    cfg = model.base_model.model.config
    (path,) = save_gguf(model, gguf_tokenizer("bpe"), tmp_path, ["f32"])
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "qwen35"
    assert _field(reader, "qwen35.ssm.conv_kernel") == 4 and _field(reader, "qwen35.ssm.state_size") == 64
    assert _field(reader, "qwen35.ssm.group_count") == 2 and _field(reader, "qwen35.ssm.time_step_rank") == 4
    assert _field(reader, "qwen35.ssm.inner_size") == 256 and _field(reader, "qwen35.full_attention_interval") == 2
    assert list(_field(reader, "qwen35.rope.dimension_sections")) == [3, 3, 2, 0]
    assert _field(reader, "qwen35.rope.dimension_count") == 16
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in t.shape[::-1]])
               for t in reader.tensors}
    merged = copy.deepcopy(model).merge_and_unload()
    attn = merged.model.layers[0].linear_attn
    nk, nv, r = 2, 4, 2
    hf_head = [(j % nk) * r + j // nk for j in range(nv)]  # llama.cpp's value head j reads key head j % nk
    assert all(h // r == j % nk for j, h in enumerate(hf_head))  # ...which is the key head h shares in transformers
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -np.exp(attn.A_log.detach().numpy()[hf_head]), rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.0.ssm_dt.bias"], attn.dt_bias.detach().numpy()[hf_head], rtol=1e-6)
    out = attn.out_proj.weight.detach().numpy().reshape(-1, nv, 64)[:, hf_head].reshape(-1, nv * 64)
    np.testing.assert_allclose(tensors["blk.0.ssm_out.weight"], out, rtol=1e-6)
    assert tensors["blk.0.ssm_conv1d.weight"].shape == (2 * 2 * 64 + nv * 64, 4)
    np.testing.assert_allclose(tensors["blk.0.ssm_norm.weight"], attn.norm.weight.detach().numpy(), rtol=1e-6)  # no +1
    np.testing.assert_allclose(tensors["blk.0.attn_norm.weight"],
                               merged.model.layers[0].input_layernorm.weight.detach().numpy() + 1, rtol=1e-6)
    assert ft_gguf.gguf_refusal(cfg) is None


def test_qwen3_5_layer_patterns_llama_cpp_cannot_run_are_refused():
    odd = gguf_model("qwen3_5_text", **{**QWEN3_5, "num_hidden_layers": 3,
                                        "layer_types": ["linear_attention", "full_attention", "full_attention"]})
    assert "full-attention layer every n-th layer" in ft_gguf.gguf_refusal(odd.base_model.model.config)



@pytest.mark.parametrize("nk, nv", [(2, 2), (2, 4), (2, 6), (16, 32)])
def test_value_head_order_gives_every_gguf_head_the_key_head_transformers_gave_it(nk, nv):
    cfg = dict(linear_num_key_heads=nk, linear_num_value_heads=nv)
    order = gguf_qwen35._value_head_order(cfg)
    if nv == nk:
        assert order is None
        return
    r = nv // nk
    assert sorted(order) == list(range(nv))  # a permutation
    assert all(int(h) // r == j % nk for j, h in enumerate(order))  # llama.cpp's key head j % nk = transformers' h // r
    rows = np.arange(nv * 3).reshape(nv * 3, 1)  # three rows per head
    moved = gguf_qwen35._heads(rows, order, 3)
    assert all((moved[3 * j:3 * j + 3, 0] == np.arange(3 * h, 3 * h + 3)).all() for j, h in enumerate(order))
    with pytest.raises(ValueError, match="do not share"):
        gguf_qwen35._value_head_order(dict(linear_num_key_heads=2, linear_num_value_heads=3))
