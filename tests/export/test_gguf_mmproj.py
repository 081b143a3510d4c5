"""GGUF of a vision-language model: the language model GGUF plus the ``mmproj`` file, both loaded by
llama.cpp (llama-cpp-python 0.3.36's ``libmtmd``).

Tiny random Qwen2-VL, Qwen2.5-VL and Gemma 3 with LoRA on both towers (random B, so the merge
changes vision and language weights). For each, llama.cpp's image embeddings of a generated image
(what it puts into the image-token positions) are compared with the HF model's own image features
(``get_image_features``, the projector output), and llama.cpp's text logits with the HF model's.
Where llama.cpp's CPU graph rounds on its own (fp16 patch convolution and GELU tables in the vision
graph, RMSNorm eps 0 in the qwen2vl text graph: measured on its intermediate tensors), the F32 files
are also held to a tight bound against a copy of the HF model that rounds the same way.

Sizes llama.cpp assumes, so the tiny configs follow them: Qwen images are multiples of 28 pixels
(patch 14, 2x2 merger) with at least 8 merged tokens (llama.cpp's minimum: 56 x 224 here, no
resize on either side); Qwen2.5-VL's window attention is built for 112-pixel windows (so
``window_size=112``, and the 224-pixel-wide image spans two windows); Gemma 3's image is exactly
``image_size`` square (llama.cpp resizes to it). Run with ``-s`` for the table of errors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gguf
from fasttune import LoraSpec
from fasttune.export import gguf_mmproj
from fasttune.export.gguf import save_gguf
from fasttune.hf_integration.loader import attach_lora
from fasttune.model_patches.families import FAMILIES
from helpers.gguf_models import gguf_tokenizer
from helpers.tiny_vlms import image_processor, tiny_vlm

# Image embeddings, relative L2 against the HF features. llama.cpp's CPU graph (0.3.36) runs the
# patch convolution in fp16 even for an F32 file and its GELUs through fp16 tables (the projector's
# in the tanh form where Qwen's is exact): ~1e-4 to 6e-4 in F32, F16 weights add their rounding
# (bounds ~2.5x the largest measured). Against a copy of the model that rounds the same way
# (_as_llama_cpp_rounds) the F32 file is within ROUNDED_F32_TOL: the layout and hyper-parameters.
EMBD_TOL = {"f32": 1.5e-3, "f16": 2e-3}
ROUNDED_F32_TOL = 6e-5  # measured 1.3e-6 (gemma3) to 2.4e-5 (qwen2_vl)
# Text logits vs the live model. llama-cpp-python 0.3.36's qwen2vl graph runs its RMSNorms with eps 0
# whatever the file's qwen2vl.attention.layer_norm_rms_epsilon says (the same tensors as arch qwen2:
# 3e-7), ~6e-4 on these tiny activations; the F32 file is also checked against the live model with
# eps 0 (QWEN_EPS0_F32_TOL). Gemma's GELU goes through ggml's fp16 table (test_gguf_llama_cpp's 1e-3).
LOGIT_TOL = {"f32": 2e-3, "f16": 4e-3, "q8_0": 6e-2}
QWEN_EPS0_F32_TOL = 1e-5
IMAGE_HW = {"qwen2_vl": (56, 224), "qwen2_5_vl": (56, 224), "gemma3": (28, 28)}
VISION = {"qwen2_5_vl": {"window_size": 112}}
IDS = [5, 17, 99, 130, 250, 31, 77, 300, 12, 45]


def _model(model_type: str, **vision):
    base = tiny_vlm(model_type, seed=2, vision={**VISION.get(model_type, {}), **vision})
    model = attach_lora(base, LoraSpec(r=4, seed=0, finetune_vision_layers=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model.eval()


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class _Fp16Table(torch.nn.Module):
    """ggml's CPU GELU / quick GELU: the input rounded to fp16, the value read from an fp16 table."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x.half().float()).half().float()


def _as_llama_cpp_rounds(model, model_type: str):
    """A copy of ``model`` whose vision side rounds where llama.cpp's CPU graph does (measured on its
    intermediate tensors): the patch convolution runs in fp16 (input and kernel, even for an F32 file),
    GELUs go through fp16 tables and the projector's GELU is the tanh form. The rest is the model's own."""
    model = copy.deepcopy(model)
    inner = model.get_base_model().model
    tanh_gelu = _Fp16Table(lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
    if model_type == "gemma3":
        conv = inner.vision_tower.embeddings.patch_embedding
        for layer in inner.vision_tower.encoder.layers:
            layer.mlp.activation_fn = tanh_gelu
    else:
        conv = inner.visual.patch_embed.proj
        inner.visual.merger.mlp[1] = tanh_gelu
        if model_type == "qwen2_vl":
            for block in inner.visual.blocks:
                block.mlp.act = _Fp16Table(lambda x: x * torch.sigmoid(1.702 * x))
    with torch.no_grad():
        conv.weight.copy_(conv.weight.half().float())
    conv.register_forward_pre_hook(lambda module, args: (args[0].half().float(),) + tuple(args[1:]))
    return model


def _hf_image_features(model, model_type: str, rgb: np.ndarray) -> np.ndarray:
    from PIL import Image

    px = image_processor(model_type)(images=[Image.fromarray(rgb)], do_resize=False, return_tensors="pt")
    kwargs = {"image_grid_thw": px["image_grid_thw"]} if "image_grid_thw" in px else {}
    with torch.no_grad():
        out = model.get_base_model().model.get_image_features(pixel_values=px["pixel_values"], **kwargs)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    feats = torch.cat(list(feats)) if isinstance(feats, (tuple, list)) else feats
    return feats.reshape(-1, feats.shape[-1]).float().numpy()


def _llama_logits(path) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        llm.eval(IDS)
        return np.asarray(llm.scores[:len(IDS)])
    finally:
        llm.close()


@pytest.mark.parametrize("quants", [("f32",), ("f16", "q8_0")], ids=["f32", "f16+q8_0"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "gemma3"])
def test_language_model_and_mmproj_run_in_llama_cpp(model_type, quants, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from helpers.mtmd_run import mtmd_image_embeddings

    model = _model(model_type)
    tok = gguf_tokenizer("sp" if model_type == "gemma3" else "bpe")
    paths = save_gguf(model, tok, tmp_path, quants, name="tiny")
    mm_quant = "f32" if "f32" in quants else "f16"
    assert [p.name for p in paths] == [f"tiny-{q.upper()}.gguf" for q in quants] + [f"mmproj-tiny-{mm_quant.upper()}.gguf"]

    reader = gguf.GGUFReader(paths[-1])  # the clip header llama.cpp's loader reads
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "clip" and field("clip.has_vision_encoder") is True
    assert field("clip.projector_type") == FAMILIES[model_type].vision.mmproj_type
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {n for n, t in types.items() if t not in ("F32", "F16")} == set()
    assert all(types[n] == mm_quant.upper() for n in types if n.endswith(("attn_q.weight", "ffn_down.weight")))
    want = {"qwen2_vl": {"v.patch_embd.weight.1", "mm.2.weight", "v.post_ln.bias"},
            "qwen2_5_vl": {"v.patch_embd.weight.1", "v.blk.1.ffn_gate.weight", "mm.0.weight"},
            "gemma3": {"v.position_embd.weight", "mm.input_projection.weight", "mm.soft_emb_norm.weight"}}
    assert want[model_type] <= set(types)

    rgb = np.random.default_rng(0).integers(0, 256, (*IMAGE_HW[model_type], 3), dtype=np.uint8)
    want_embd = _hf_image_features(model, model_type, rgb)
    rounded_embd = _hf_image_features(_as_llama_cpp_rounds(model, model_type), model_type, rgb)
    with torch.no_grad():
        live = model(input_ids=torch.tensor([IDS])).logits[0].float().numpy()
        eps0 = copy.deepcopy(model)
        for module in eps0.get_base_model().model.language_model.modules():
            if hasattr(module, "variance_epsilon"):
                module.variance_epsilon = 0.0
        live_eps0 = eps0(input_ids=torch.tensor([IDS])).logits[0].float().numpy()
    for quant, path in zip(quants, paths):
        got = mtmd_image_embeddings(path, paths[-1], rgb)
        assert got.shape == want_embd.shape
        logits = _llama_logits(path)
        embd_err, logit_err, eps0_err = _rel(got, want_embd), _rel(logits, live), _rel(logits, live_eps0)
        rounded_err = _rel(got, rounded_embd)
        print(f"\n{model_type:<11} text {quant.upper():<5} mmproj {mm_quant.upper()}: image embeddings rel L2 "
              f"{embd_err:.2e} (llama.cpp's roundings: {rounded_err:.2e}), text logits rel L2 {logit_err:.2e} "
              f"(live model with RMSNorm eps 0: {eps0_err:.2e})", end="")
        assert embd_err <= EMBD_TOL[mm_quant], (quant, embd_err)
        if mm_quant == "f32":
            assert rounded_err <= ROUNDED_F32_TOL, rounded_err
        assert logit_err <= LOGIT_TOL[quant], (quant, logit_err)
        if quant == "f32" and model_type != "gemma3":
            assert eps0_err <= QWEN_EPS0_F32_TOL, eps0_err


def test_export_artifacts_of_a_vlm_from_its_merged_folder(tmp_path):
    """The run/CLI path: merged 16-bit folder first, GGUF from it; the manifest lists the mmproj file
    and a later push does not read it as an F16 language model."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from fasttune.export.artifacts import export_artifacts
    from fasttune.export.manifest import gguf_quants, read_manifest
    from helpers.mtmd_run import mtmd_image_embeddings

    model = _model("gemma3")
    out = export_artifacts(model, gguf_tokenizer("sp"), tmp_path, ["merged", "gguf"], name="vlm",
                           gguf_quantizations=["f32"], merged_dtype="float32", source="src")
    assert set(read_manifest(out["gguf"])["files"]) == {"vlm-F32.gguf", "mmproj-vlm-F32.gguf"}
    assert set(gguf_quants(out["gguf"], "src")) == {"f32"}
    rgb = np.random.default_rng(1).integers(0, 256, (*IMAGE_HW["gemma3"], 3), dtype=np.uint8)
    got = mtmd_image_embeddings(out["gguf"] / "vlm-F32.gguf", out["gguf"] / "mmproj-vlm-F32.gguf", rgb)
    assert _rel(got, _hf_image_features(model, "gemma3", rgb)) <= EMBD_TOL["f32"]


def test_qwen2_5_vl_window_attention_matters_for_the_test_image():
    """The test image spans two 112-pixel windows: full attention in every block gives other features,
    so a wrong window layout in the mmproj file could not pass the comparison above."""
    model = _model("qwen2_5_vl")
    rgb = np.random.default_rng(0).integers(0, 256, (*IMAGE_HW["qwen2_5_vl"], 3), dtype=np.uint8)
    windowed = _hf_image_features(model, "qwen2_5_vl", rgb)
    model.get_base_model().model.visual.fullatt_block_indexes = [0, 1]
    assert _rel(_hf_image_features(model, "qwen2_5_vl", rgb), windowed) > 20 * EMBD_TOL["f32"]


@pytest.mark.parametrize("model_type, vision, needs", [
    ("qwen2_5_vl", {"window_size": 56}, "window_size 112"),
    ("qwen2_5_vl", {"fullatt_block_indexes": [0]}, "fullatt_block_indexes"),
    ("qwen2_vl", {"mlp_ratio": 1}, "swapped"),
    ("qwen2_vl", {"spatial_merge_size": 1}, "spatial_merge_size 2"),
    ("qwen2_vl", {"hidden_act": "gelu"}, "hidden_act 'quick_gelu'"),
])
def test_what_llama_cpp_cannot_run_is_refused_before_writing(model_type, vision, needs, tmp_path):
    model = _model(model_type, **vision)
    with pytest.raises(ValueError, match="mmproj GGUF") as err:
        save_gguf(model, gguf_tokenizer("bpe"), tmp_path / "gguf", "f16")
    assert needs in str(err.value)
    assert not (tmp_path / "gguf").exists() or not any((tmp_path / "gguf").iterdir())


@pytest.mark.parametrize("model_type", ["qwen2_vl", "gemma3"])
def test_a_checkpoint_in_the_older_key_layout_gives_the_same_files(model_type, tmp_path):
    """save_merged writes transformers 5's keys (model.language_model.*, model.visual.*); save_pretrained
    and the Hub's originals the older ones (model.layers.* + visual.*; language_model.model.* +
    vision_tower[.vision_model].*): a folder of either exports the same tensors."""
    from safetensors.torch import load_file, save_file

    from fasttune import save_merged

    model = tiny_vlm(model_type, vision=VISION.get(model_type))
    save_merged(model, tmp_path / "new", dtype="float32")
    model.save_pretrained(tmp_path / "old")
    keys = {"new": set(load_file(tmp_path / "new" / "model.safetensors")),
            "old": set(load_file(tmp_path / "old" / "model.safetensors"))}
    assert any(k.startswith(("visual.", "language_model.")) for k in keys["old"]) and keys["old"] != keys["new"]
    folders = ["new", "old"]
    if model_type == "gemma3":  # the Hub's Gemma 3 keeps SigLIP's vision_model level too
        (tmp_path / "hub").mkdir()
        for f in (tmp_path / "old").iterdir():
            (tmp_path / "hub" / f.name).write_bytes(f.read_bytes())
        tensors = {k.replace("vision_tower.", "vision_tower.vision_model."): v
                   for k, v in load_file(tmp_path / "old" / "model.safetensors").items()}
        save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
        folders.append("hub")
    tok = gguf_tokenizer("sp" if model_type == "gemma3" else "bpe")
    files = {kind: save_gguf(tmp_path / kind, tok, tmp_path / f"gguf-{kind}", "f16", name="m") for kind in folders}
    for kind in folders[1:]:
        for new, old in zip(files["new"], files[kind]):
            a, b = gguf.GGUFReader(new).tensors, gguf.GGUFReader(old).tensors
            assert [t.name for t in a] == [t.name for t in b]
            assert all(np.array_equal(x.data, y.data) for x, y in zip(a, b)), (kind, new.name)


def test_gemma3_pool_needs_square_token_grid():
    with pytest.raises(ValueError, match="mm_tokens_per_image=3"):
        gemma3_pool = gguf_mmproj.gemma3_pool
        gemma3_pool({"image_size": 28, "patch_size": 7}, 3)
    assert gguf_mmproj.gemma3_pool({"image_size": 896, "patch_size": 14}, 256) == 4  # Gemma 3's real shape


def test_projector_types_fasttune_does_not_write_are_refused():
    split = gguf_mmproj.VisionSplit("llava", {}, [], {}, [], 96)
    with pytest.raises(ValueError, match="'llava' is not written by fasttune"):
        gguf_mmproj.check_vision(split)


def test_image_norm_comes_from_the_processor_or_the_saved_folder(tmp_path, caplog):
    proc = image_processor("gemma3")
    proc.image_mean, proc.image_std = [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]
    assert gguf_mmproj.image_norm(proc, "gemma3") == ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])
    (tmp_path / "processor_config.json").write_text('{"image_processor": {"image_mean": [1, 2, 3], '
                                                     '"image_std": [4, 5, 6]}}')
    assert gguf_mmproj.image_norm(None, "gemma3", tmp_path) == ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    with caplog.at_level("WARNING"):
        assert gguf_mmproj.image_norm(object(), "qwen2vl_merger")[0][0] == pytest.approx(0.48145466)
    assert "stock qwen2vl_merger image mean/std" in caplog.text


def test_file_names():
    assert gguf_mmproj.mmproj_filename("my-vlm", "f16") == "mmproj-my-vlm-F16.gguf"
    assert gguf_mmproj.is_mmproj("/x/mmproj-my-vlm-F16.gguf") and not gguf_mmproj.is_mmproj("my-vlm-F16.gguf")
    assert gguf_mmproj.mmproj_quant(["q4_0", "f16"]) == "f16" and gguf_mmproj.mmproj_quant(["q8_0", "f32"]) == "f32"


def test_a_family_without_mmproj_rules_keeps_the_refusal(monkeypatch):
    """A VLM row whose projector type has no rules here is refused before anything is read, naming both files."""
    from fasttune.export import gguf as gguf_export

    monkeypatch.setattr(gguf_mmproj, "SUPPORTED", ("qwen2vl_merger", "qwen2.5vl_merger"))
    with pytest.raises(ValueError, match="not supported yet") as err:
        gguf_export._arch_for({"model_type": "gemma3"})
    assert "model.language_model" in str(err.value) and "convert_hf_to_gguf.py" in str(err.value)
    assert gguf_export._arch_for({"model_type": "qwen2_vl"}) == "qwen2vl"


def test_the_processor_given_sets_the_image_normalisation(tmp_path):
    from helpers.tiny_vlms import vlm_processor

    processor = vlm_processor("gemma3")
    processor.image_processor.image_mean, processor.image_processor.image_std = [0.25, 0.5, 0.75], [0.5, 0.25, 0.125]
    paths = save_gguf(_model("gemma3"), processor, tmp_path, "q8_0", name="vlm")
    fields = gguf.GGUFReader(paths[-1]).fields
    assert fields["clip.vision.image_mean"].contents() == [0.25, 0.5, 0.75]
    assert fields["clip.vision.image_std"].contents() == [0.5, 0.25, 0.125]
    assert gguf.GGUFReader(paths[0]).fields["tokenizer.ggml.tokens"].contents()[:3] == \
        processor.tokenizer.convert_ids_to_tokens([0, 1, 2])
