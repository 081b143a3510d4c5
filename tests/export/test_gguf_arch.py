"""gguf_arch: llama.cpp's per-architecture conventions (the q/k row permutation, RoPE settings)."""

import numpy as np
import pytest

from fasttune.export.gguf_arch import head_dim, permute_rows, rope_settings


def _rope_rotate_half(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[d // 2:], x[:d // 2]])
    return x * cos + rot * sin


def _rope_interleaved(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos * inv
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


@pytest.mark.parametrize("n_head, d", [(4, 8), (2, 16)])
def test_permutation_turns_rotate_half_rope_into_ggml_interleaved_rope(n_head, d):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * d, 12))
    x = rng.standard_normal(12)
    pw = permute_rows(w, n_head)
    for pos in (0, 3, 17):
        for h in range(n_head):
            hf = _rope_rotate_half(w[h * d:(h + 1) * d] @ x, pos)
            gg = _rope_interleaved(pw[h * d:(h + 1) * d] @ x, pos)
            # Same attention scores: q·k is invariant to a common permutation of both.
            hf_perm = permute_rows(hf[:, None], 1)[:, 0]
            assert np.allclose(gg, hf_perm, atol=1e-10)


def test_permutation_is_a_row_permutation_and_handles_biases():
    w = np.arange(32, dtype=np.float32).reshape(16, 2)
    pw = permute_rows(w, 2)
    assert sorted(pw[:, 0].tolist()) == sorted(w[:, 0].tolist())
    b = np.arange(16, dtype=np.float32)
    assert np.array_equal(permute_rows(b, 2), pw[:, 0] / 2)


def test_rope_settings_read_v5_and_v4_configs():
    v5 = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert rope_settings(v5)["rope_theta"] == 5e5 and rope_settings(v5)["rope_type"] == "llama3"
    v4 = {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_settings(v4) == {"type": "linear", "factor": 2.0, "rope_theta": 1e4, "rope_type": "linear"}
    per_layer = {"rope_parameters": {"sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
                                     "full_attention": {"rope_theta": 1e6, "rope_type": "default"}}}
    assert rope_settings(per_layer)["rope_theta"] == 1e6
    assert rope_settings(per_layer, "sliding_attention")["rope_theta"] == 1e4


def test_head_dim_prefers_the_explicit_value():
    assert head_dim({"head_dim": 24, "hidden_size": 96, "num_attention_heads": 2}) == 24
    assert head_dim({"hidden_size": 96, "num_attention_heads": 4}) == 24


def test_qwen2vl_writes_its_rope_sections_and_refuses_others():
    import gguf

    from fasttune.export.gguf_arch import write_arch_metadata

    cfg = dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=200,
               vocab_size=512, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                   "mrope_section": [4, 4, 4]})
    w = gguf.GGUFWriter(path=None, arch="qwen2vl")
    write_arch_metadata(w, cfg, "qwen2vl")
    assert w.kv_data[0]["qwen2vl.rope.dimension_sections"].value == [4, 4, 4, 0]
    cfg["rope_parameters"] = {"rope_type": "mrope", "rope_theta": 1e4, "mrope_section": [4, 4, 2]}  # sums to 10, not 12
    with pytest.raises(ValueError, match="mrope_section"):
        write_arch_metadata(gguf.GGUFWriter(path=None, arch="qwen2vl"), cfg, "qwen2vl")
