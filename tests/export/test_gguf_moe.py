"""GGUF export of mixture-of-experts models (Qwen3-MoE as llama.cpp's ``qwen3moe``, Mixtral as
``llama`` with expert tensors, OLMoE as ``olmoe``, GraniteMoE as ``granitemoe``, GLM-4.5 as ``glm4moe``, Qwen2-MoE
as ``qwen2moe``;
gpt-oss's own layout is tested in test_gguf_moe_arch.py): the stacked experts split into llama.cpp's
``ffn_{gate,up,down}_exps`` with PEFT's merge of LoRA on the experts applied, the router as ``ffn_gate_inp``,
the expert counts in the metadata, and llama.cpp's logits matching the HF model's. Configs llama.cpp cannot represent
are refused with the reason."""

import copy

import numpy as np
import pytest
import torch

import gguf
from fasttune.export.gguf import save_gguf
from helpers.gguf_models import EXPERTS_AT, MOE, gguf_moe_model
from helpers.tiny_tokenizers import bpe_tokenizer

try:
    import llama_cpp
except ImportError:  # CI installs it (NOTES §5)
    llama_cpp = None

SEQ = 12


def _model(family, **overrides):
    return gguf_moe_model(family, **overrides)


CHUNKED = sorted(f for f in MOE if f != "gpt_oss")  # experts [E, 2I, H]: gate rows, then up rows
ROUTER = {"granitemoe": "block_sparse_moe.router.weight"}


@pytest.fixture(scope="module", params=CHUNKED)
def exported(request, tmp_path_factory):
    family = request.param
    model = _model(family)
    path = save_gguf(model, bpe_tokenizer(), tmp_path_factory.mktemp(family), ["f16"], name=f"tiny-{family}")[0]
    ids = torch.randint(3, 400, (1, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(ids).logits[0].float().numpy()
    return family, model, path, ref, ids[0].tolist()


def test_expert_tensors_and_metadata(exported):
    family, model, path, _, _ = exported
    reader = gguf.GGUFReader(path)
    arch = MOE[family][0]
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["general.architecture"] == arch
    assert fields[f"{arch}.expert_count"] == 4 and fields[f"{arch}.expert_used_count"] == 2
    if arch == "qwen3moe":
        assert fields["qwen3moe.expert_feed_forward_length"] == 128
    tensors = {t.name: t for t in reader.tensors}
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    at = f"model.layers.1.{EXPERTS_AT.get(family, 'mlp.experts')}"
    gate_up = merged[f"{at}.gate_up_proj"].numpy()
    router = merged[f"model.layers.1.{ROUTER.get(family, 'mlp.gate.weight')}"].numpy()
    for name, want in (("blk.1.ffn_gate_exps.weight", gate_up[:, :128]), ("blk.1.ffn_up_exps.weight", gate_up[:, 128:]),
                       ("blk.1.ffn_down_exps.weight", merged[f"{at}.down_proj"].numpy()),
                       ("blk.1.ffn_gate_inp.weight", router)):
        t = tensors[name]
        got = np.asarray(t.data, dtype=np.float32).reshape(want.shape)
        assert np.allclose(got, want, atol=2e-3, rtol=2e-3), name
    assert tensors["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed (NOTES §5)")
def test_llama_cpp_logits_match(exported):
    family, _, path, ref, ids = exported
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    got = np.asarray(llm.scores[:SEQ])
    llm.close()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= 1e-2, (family, err)


def test_unrepresentable_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="norm_topk_prob"):
        save_gguf(_model("qwen3_moe", norm_topk_prob=False), bpe_tokenizer(), tmp_path / "a", ["f16"])
    with pytest.raises(ValueError, match="dense layers"):
        save_gguf(_model("qwen3_moe", mlp_only_layers=[1]), bpe_tokenizer(), tmp_path / "b", ["f16"])
    with pytest.raises(ValueError, match="does not renormalise"):
        save_gguf(_model("olmoe", norm_topk_prob=True), bpe_tokenizer(), tmp_path / "d", ["f16"])
