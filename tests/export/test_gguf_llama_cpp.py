"""Every GGUF fasttune can write, loaded in llama.cpp (llama-cpp-python): the embedded demo's and the
llama family's in all 17 types (8 quantised in Python, 9 K-quants through llama.cpp's quantizer),
and every other family's, the MoE ones (qwen3_moe, mixtral, gpt_oss, olmoe, granitemoe, glm4_moe, qwen2_moe) included,
as F16, Q8_0 and Q4_0 (4/5-bit files keep an 8-bit output projection); Qwen3.5, Qwen3.5-MoE and Qwen2-MoE as F32, F16,
Q8_0.

Each file is checked three ways:
- tokenization: llama.cpp's ids equal transformers' on a few strings;
- "the file says": llama.cpp's logits equal those of the HF model carrying the file's own
  (dequantised) weights, whatever the type: a wrong layout, permutation or metadata key shows
  here at full size, while quantisation noise does not (only llama.cpp's 8-bit activations remain);
- the live model: the logit error against the model that was exported, within a per-type bound.
Run with ``-s`` to see the table of errors.
"""

import copy

import numpy as np
import pytest
import torch

import gguf
from fasttune import embedded
from fasttune.export.gguf import K_QUANTS, PY_QUANTS, save_gguf
from fasttune.export.gguf_moe_arch import gguf_tensor_name, name_map_key
from helpers.gguf_models import (ARCH, EXAONE4_LLAMA3, EXAONE4_SWA, FAMILIES, MOE, QWEN3_5, SMOLLM3_NOPE,
                                 family_tokenizer, gguf_model, gguf_moe_model, gguf_qwen2_moe_model,
                                 gguf_qwen3_5_moe_model)

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/FACTS.md, GGUF section)")

SEQ = 16
TEXTS = ("Hello world, how are you today?", "double  spaces and 12345 numbers\n\nnew  lines ",
         "fine-tuning isn't hard; it's fun!", "cab = dbc", "qwerty =")
# llama.cpp logits vs the live model, relative L2 error: the largest measured on these tiny random
# models (the table printed with -s) with ~1.5x margin. Low-bit types are that noisy here.
LIVE_TOL = {"f32": 1e-4, "f16": 4e-3, "bf16": 2.5e-2, "q8_0": 6e-2, "q5_0": 0.35, "q5_1": 0.3, "q4_0": 0.7,
            "q4_1": 0.6, "q6_k": 0.15, "q5_k_s": 0.25, "q5_k_m": 0.25, "q4_k_s": 0.4, "q4_k_m": 0.4,
            "q3_k_s": 0.9, "q3_k_m": 0.8, "q3_k_l": 0.8, "q2_k": 1.2}
# llama.cpp vs the file's own weights: what remains is llama.cpp rounding activations (f16 for F16
# weights, bf16 for BF16, 8-bit blocks for quantised types); a wrong layout gives errors near 1.
FILE_TOL = {"f32": 1e-4, "f16": 4e-3, "bf16": 1.5e-2}
FILE_TOL_QUANTISED = 5e-2
FILE_TOL_MOE_QUANTISED = 0.15  # 8-bit activations can flip a token's top-k experts (qwen3_moe Q4_0: 7.8e-2)
# 8-bit weights flip one token's experts too: gpt_oss Q8_0 is 9.9e-2 against the live model, all of it
# from one position (0.38 there, ~1e-2 elsewhere, with only the attention weights rounded to Q8_0).
LIVE_TOL_MOE = {"q8_0": 0.15}
FAMILY_QUANTS = ("f16", "q8_0", "q4_0")  # llama and the demo get every type
GELU_F32_TOL = 1e-3  # Gemma's GELU goes through ggml's fp16 lookup table even for F32 weights


def _deinterleave_rows(w, n_head):
    """GGML's interleaved q/k row pairs back to HF's rotate-half order, head by head."""
    out = np.empty_like(w)
    d = w.shape[0] // n_head
    for h in range(n_head):
        rows = w[h * d:(h + 1) * d]
        out[h * d:(h + 1) * d][: d // 2] = rows[0::2]
        out[h * d:(h + 1) * d][d // 2:] = rows[1::2]
    return out


class Reference:
    """The live model's logits on a fixed prompt, and a merged plain copy to load GGUF weights into."""

    def __init__(self, model, tok, family):
        self.tok, self.family = tok, family
        self.arch = {"embedded": "llama", **{f: a for f, (a, _) in MOE.items()}}.get(family, ARCH.get(family, family))
        ids = tok(TEXTS[0])["input_ids"][:SEQ]
        self.ids = ids + tok("The quick brown fox", add_special_tokens=False)["input_ids"][: SEQ - len(ids)]
        with torch.no_grad():
            self.live = model(torch.tensor([self.ids])).logits[0].float().numpy()
        merged = copy.deepcopy(model)
        self.plain = merged.merge_and_unload() if hasattr(merged, "merge_and_unload") else merged

    def file_logits(self, path):
        """Logits of the HF model carrying ``path``'s tensors, dequantised and mapped back to HF layout."""
        model = copy.deepcopy(self.plain)
        cfg = model.config
        tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in t.shape[::-1]])
                   for t in gguf.GGUFReader(path).tensors}
        model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch)
        names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
        with torch.no_grad():
            for hf_name, param in model.named_parameters(remove_duplicate=False):
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    if "output.weight" in tensors:  # tied in HF; llama.cpp reads its own (maybe 8-bit) copy
                        model.lm_head.weight = torch.nn.Parameter(torch.from_numpy(tensors["output.weight"].copy()))
                    continue
                value = _experts(tensors, hf_name, self.arch)
                if value is None:
                    value = tensors[gguf_tensor_name(names.get_name(name_map_key(hf_name),
                                                                    try_suffixes=(".weight", ".bias")))]
                permuted = self.arch in ("llama", "granite", "granitemoe", "smollm3")
                if permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
                    value = _deinterleave_rows(value, heads)
                if self.arch.startswith("gemma") and "norm" in hf_name:
                    value = value - 1.0
                param.copy_(torch.from_numpy(np.ascontiguousarray(value)))
            return model.eval()(torch.tensor([self.ids])).logits[0].float().numpy()

    def check(self, path, quant):
        """[] when llama.cpp tokenizes like transformers and its logits are within bounds, else the failure."""
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                              type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)  # exact KV cache
        try:
            for text in TEXTS:
                want = self.tok(text)["input_ids"]
                got = llm.tokenize(text.encode(), add_bos=want[:1] == [self.tok.bos_token_id], special=False)
                assert got == want, (self.family, quant, text)
            llm.eval(self.ids)
            got = np.asarray(llm.scores[:len(self.ids)])
        finally:
            llm.close()
        live_err, file_err = _rel(got, self.live), _rel(got, self.file_logits(path))
        print(f"\nGGUF {self.family:<12} {quant.upper():<7} logit error vs live model {live_err:.2e} "
              f"(max |diff| {np.abs(got - self.live).max():.2e}), vs the file's weights {file_err:.2e}", end="")
        live_tol, file_tol = LIVE_TOL[quant], FILE_TOL.get(quant, FILE_TOL_QUANTISED)
        if quant == "f32" and self.family.startswith("gemma"):
            live_tol = file_tol = GELU_F32_TOL
        if self.family in MOE and quant not in FILE_TOL:
            file_tol, live_tol = FILE_TOL_MOE_QUANTISED, LIVE_TOL_MOE.get(quant, live_tol)
        return [] if file_err <= file_tol and live_err <= live_tol else [(self.family, quant, live_err, file_err)]


def _experts(tensors, hf_name, arch):
    """Stacked MoE experts back from llama.cpp's per-projection tensors (None for other parameters)."""
    if ".experts." not in hf_name:
        return None
    blk = f"blk.{hf_name.split('.layers.')[1].split('.')[0]}"
    if arch == "gpt-oss":  # transposed, gate/up interleaved, with biases
        kind = "bias" if hf_name.endswith("_bias") else "weight"
        gate, up = tensors[f"{blk}.ffn_gate_exps.{kind}"], tensors[f"{blk}.ffn_up_exps.{kind}"]
        down = tensors[f"{blk}.ffn_down_exps.{kind}"]
        if "gate_up_proj" in hf_name:
            out = np.empty(gate.shape[:1] + (2 * gate.shape[1],) + gate.shape[2:], dtype=gate.dtype)
            out[:, 0::2], out[:, 1::2] = gate, up
            return out if kind == "bias" else out.transpose(0, 2, 1)
        return down if kind == "bias" else down.transpose(0, 2, 1)
    if hf_name.endswith("gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        return np.concatenate([tensors[f"{blk}.ffn_gate_exps.weight"], tensors[f"{blk}.ffn_up_exps.weight"]], axis=1)
    return tensors[f"{blk}.ffn_down_exps.weight"]


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check_all(model, tok, family, paths, quants):
    ref = Reference(model, tok, family)
    failed = [f for quant, path in zip(quants, paths) for f in ref.check(path, quant)]
    assert not failed, failed


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_in_llama_cpp(family, tmp_path):
    """16-bit, 8-bit and 4-bit (whose output projection stays 8-bit) files of each family."""
    model, tok = gguf_model(family), family_tokenizer(family)
    quants = FAMILY_QUANTS if family != "llama" else PY_QUANTS + K_QUANTS
    _check_all(model, tok, family, save_gguf(model, tok, tmp_path, quants), quants)


def test_qwen3_5_loads_in_llama_cpp(tmp_path):
    """llama.cpp's qwen35: the gated delta rule's tensors transformed (−exp(A_log), the conv squeezed, value
    heads reordered from transformers' grouped to llama.cpp's tiled sharing of the key heads), the (1 + w)
    norms shifted, the gated full attention with partial RoPE in sections. Judged against the live model
    only: mapping those transformed tensors back for the file-weights check is not implemented."""
    model, tok = gguf_model("qwen3_5_text", **QWEN3_5), family_tokenizer("qwen3_5_text")
    quants = ("f32", "f16", "q8_0")  # Q8_0: the conv stays F32 (llama.cpp's ssm_conv aborts on anything else)
    ref = Reference(model, tok, "qwen3_5_text")
    ref.file_logits = lambda path: ref.live  # so both errors are the live one...
    failed = [f for quant, path in zip(quants, save_gguf(model, tok, tmp_path, quants)) for f in ref.check(path, quant)]
    assert not [f for f in failed if f[2] > LIVE_TOL[f[1]]], failed  # ...judged by the live bound


# Qwen3.5-MoE at tiny_models' widths (hidden 96, 16-wide delta-rule heads), relative L2 error against the live
# model as measured with ~1.7x margin (LoRA-merged: F32 4.6e-6, F16 8.5e-3, Q8_0 0.118). Most of the F16 error
# is the weights' own rounding (6.9e-3 with the file's weights in F32); at Q8_0 it is llama.cpp's 8-bit
# activations (0.12 against the file's weights in F32, the weights alone 0.035); the dense Qwen3.5 at these
# widths has the same Q8_0 error (0.11). F32 is the check of the layout.
QWEN3_5_MOE_TOL = {"f32": 1e-4, "f16": 1.5e-2, "q8_0": 0.2}


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora-merged"])
def test_qwen3_5_moe_loads_in_llama_cpp(lora, tmp_path):
    """llama.cpp's qwen35moe: Qwen3.5's layers (as test_qwen3_5_loads_in_llama_cpp) with routed experts split into
    ffn_{gate,up,down}_exps and the sigmoid-gated shared expert (its gate a vector); with LoRA merged on every
    linear layer and on the experts. Judged against the live model only, as Qwen3.5 is."""
    model, tok = gguf_qwen3_5_moe_model(lora=lora), family_tokenizer("qwen3_5_moe_text")
    quants = ("f32", "f16", "q8_0")
    ref = Reference(model, tok, "qwen3_5_moe_text")
    ref.file_logits = lambda path: ref.live
    failed = [f for quant, path in zip(quants, save_gguf(model, tok, tmp_path, quants)) for f in ref.check(path, quant)]
    assert not [f for f in failed if f[2] > QWEN3_5_MOE_TOL[f[1]]], failed


# Qwen2-MoE measured (relative L2 logit error vs the live model / vs the file's weights): plain F32 8.4e-7, F16
# 9.0e-4 / 5.3e-4, Q8_0 3.9e-2 / 1.6e-2; LoRA-merged F32 1.0e-6, F16 1.0e-3 / 6.1e-4, Q8_0 2.7e-2 / 1.7e-2; without
# q/k/v biases F32 8.2e-7. Judged by the MoE bounds of Reference.check.
@pytest.mark.parametrize("lora, overrides", [(False, {}), (True, {}), (False, dict(qkv_bias=False))],
                         ids=["plain", "lora-merged", "no-qkv-bias"])
def test_qwen2_moe_loads_in_llama_cpp(lora, overrides, tmp_path):
    """llama.cpp's qwen2moe: q/k/v biases (optional), routed experts split into ffn_{gate,up,down}_exps and not
    renormalised, the sigmoid-gated shared expert (its gate a vector); with LoRA merged on every linear layer (the
    shared expert and its gate included) and on the experts. Judged against the live model and the file's weights."""
    model, tok = gguf_qwen2_moe_model(lora=lora, **overrides), family_tokenizer("qwen2_moe")
    quants = ("f32", "f16", "q8_0")
    _check_all(model, tok, "qwen2_moe", save_gguf(model, tok, tmp_path, quants), quants)


def test_smollm3_nope_layer_loads_in_llama_cpp(tmp_path):
    """Four layers, the fourth without RoPE, as llama.cpp's SmolLM3 graph runs them."""
    model, tok = gguf_model("smollm3", **SMOLLM3_NOPE), family_tokenizer("smollm3")
    _check_all(model, tok, "smollm3", save_gguf(model, tok, tmp_path, FAMILY_QUANTS), FAMILY_QUANTS)


@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_families_load_in_llama_cpp(family, tmp_path):
    """Experts split into ffn_{gate,up,down}_exps, LoRA on the experts merged, the router kept F32."""
    model, tok = gguf_moe_model(family), family_tokenizer("llama")
    _check_all(model, tok, family, save_gguf(model, tok, tmp_path, FAMILY_QUANTS), FAMILY_QUANTS)


@pytest.fixture(scope="module")
def demo():
    """The embedded demo: its tokenizer and model, lightly trained so the logits are not flat."""
    tok = embedded.build_tokenizer()
    model = embedded.build_model(tok, seed=0)
    rows = embedded.TaskDataset(tok, embedded.make_task(64, seed=1))
    batch = embedded.PadCollator(tok.pad_token_id)([rows[i] for i in range(64)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(5):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tok


def test_the_embedded_demo_loads_in_llama_cpp_in_every_type(demo, tmp_path):
    model, tok = demo
    paths = save_gguf(model, tok, tmp_path, PY_QUANTS + K_QUANTS, name="demo")
    reader = gguf.GGUFReader(paths[0])
    assert reader.fields["tokenizer.ggml.merges"].contents() == ["Ġ ="]
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is True
    _check_all(model, tok, "embedded", paths, PY_QUANTS + K_QUANTS)


# EXAONE 4 at 64 layers (the depth llama.cpp needs for its window), relative L2 error as measured with ~1.5x margin
# (live model / the file's weights): F32 2.7e-6 / 2.7e-6 (the layout and the per-layer RoPE/window check), F16
# 3.3e-3 / 1.8e-3, Q8_0 9.0e-2 / 6.4e-2. Q8_0 is llama.cpp's 8-bit activations over 32x the layers of the other
# families' models (the file's own weights account for it; the window, the RoPE type and the layer pattern do not
# move it: 7.8e-2..8.6e-2 with each changed); 64-layer llama / qwen3 / olmo2 at these widths: 3.5e-2..5.0e-2.
EXAONE4_DEEP_TOL = {"f32": (1e-4, 1e-4), "f16": (5e-3, 3e-3), "q8_0": (0.14, 0.1)}


@pytest.mark.parametrize("overrides", [dict(rope_parameters=EXAONE4_LLAMA3), EXAONE4_SWA,
                                       dict(EXAONE4_SWA, sliding_window_pattern=3)],
                         ids=["no_window_llama3_rope", "sliding_64_layers", "sliding_64_layers_period_3"])
def test_exaone4_loads_in_llama_cpp(overrides, tmp_path):
    """llama.cpp's exaone4 as F32, F16 and Q8_0: without a window (every layer rotated, full attention), and the
    32B's layout at tiny widths (64 layers, three of four sliding with a window shorter than the prompt, the
    fourth NoPE), both with Llama 3 RoPE (its rope_freqs tensor); and two of three sliding, which only the file's
    per-layer pattern tells llama.cpp (its default for 64 layers is the 32B's three of four)."""
    model, tok = gguf_model("exaone4", **overrides), family_tokenizer("exaone4")
    quants = ("f32", "f16", "q8_0")
    paths = save_gguf(model, tok, tmp_path, quants)
    if overrides.get("num_hidden_layers") != 64:
        return _check_all(model, tok, "exaone4", paths, quants)
    ref = Reference(model, tok, "exaone4")
    failed = [f for quant, path in zip(quants, paths) for f in ref.check(path, quant)]
    assert not [f for f in failed if f[2] > EXAONE4_DEEP_TOL[f[1]][0] or f[3] > EXAONE4_DEEP_TOL[f[1]][1]], failed


@pytest.mark.parametrize("overrides", [dict(), dict(attention_bias=False), dict(head_dim=96)],
                         ids=["qkv_bias", "no_bias", "wide_heads"])
def test_seed_oss_loads_in_llama_cpp(overrides, tmp_path):
    """llama.cpp's seed_oss as F32, F16 and Q8_0, plain and LoRA-merged (the model is a LoRA model; the live
    logits are the adapter's): q/k/v biases or none, and heads wider than hidden / heads (the 36B's 80 x 128 over
    5,120), whose o_proj is not square. Residual dropout is a training matter: eval logits ignore it."""
    model, tok = gguf_model("seed_oss", residual_dropout=0.1, attention_dropout=0.1, **overrides), \
        family_tokenizer("seed_oss")
    quants = ("f32", "f16", "q8_0")
    _check_all(model, tok, "seed_oss", save_gguf(model, tok, tmp_path, quants), quants)
