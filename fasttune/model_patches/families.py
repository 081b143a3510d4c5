"""The families table: model_type → what each module of that family is and which kernel fits it.

Data, not code. One ``FamilySpec`` row per exact ``config.model_type``; a family derived from
another is ``dataclasses.replace`` of its row. ``patch.py`` reads a row; the patchers find the
modules by their exact class (``resolve_classes`` / ``family_modules`` at the bottom of this file
look the row's class names up in ``modeling_module``), check each against what the row expects,
and swap the forwards of that instance only. Adding a family = a row here + its parity test.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from torch import nn

from .report import PatchReport

# Activation names in configs → the gated-MLP kernel that computes them exactly.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}


@dataclass(frozen=True)
class VisionLayout:
    """Where a vision-language model keeps its towers: attribute paths from its ``*ForConditionalGeneration``.

    The language tower's modules are found by their exact classes like any family's; these paths
    scope what concerns one tower only (LoRA targets, the vision tower's checkpointing, export).

    Attributes:
        language_model: the language tower (decoder layers, final norm).
        vision_tower: the image encoder.
        projector: the image-to-text projector (inside the vision tower for Qwen2-VL/2.5-VL).
        mmproj_type: llama.cpp's projector type for a GGUF ``mmproj`` file, None where it has none.
    """

    language_model: str
    vision_tower: str
    projector: str
    mmproj_type: str | None = None


@dataclass(frozen=True)
class FamilySpec:
    """What fasttune knows about one model family (one exact ``model_type``).

    Attributes:
        model_type: ``config.model_type`` this row matches, exactly.
        modeling_module: module holding the family's classes (resolved lazily on patch).
        causal_lm_class / decoder_layer_class / attention_class / mlp_class / norm_class: exact
            class names; a module of another class is left stock and reported.
        norm_eps_attr: attribute holding the RMSNorm epsilon.
        norm_offset: 1.0 where the norm scales by (1 + weight) (Gemma).
        norm_casting: "llama" (normalise in fp32, cast, multiply) or "gemma" (all fp32, cast last).
        qkv_layout: "separate" (q_proj/k_proj/v_proj) or "fused" (one qkv_proj, Phi-3).
        qk_norm: None, "head" (RMSNorm over each head, Qwen3/Gemma3), "head_after_rope" (the same, on the
            rotated q/k: Hunyuan), "head_optional" ("head" where
            the module has q_norm/k_norm, GLM-4-MoE's config.use_qk_norm) or "full" (over the whole
            projection before the head split, OLMo2).
        attention_kwargs: extra keyword arguments the stock attention passes to the attention
            function, as (name, source) with source "module:<attr>", "config:<attr>" or
            "module:<attr>?<flag>" (the module's attribute where its ``<flag>`` attribute is true, else None:
            EXAONE 4 keeps ``sliding_window`` on every layer and ``is_sliding`` says which layers use it).
        mlp_layout: "separate" (gate_proj/up_proj) or "fused" (gate_up_proj, gate first, Phi-3).
        activation_attrs: config attributes naming the MLP activation, first present wins.
        final_softcap_attr: config attribute of the final-logit soft-cap (Gemma 2/3), if any.
        logit_divisor_attr: config attribute the logits are divided by (Granite), if any.
        pre_norm_layer: True where the decoder layer is exactly x + attn(norm_1(x)), then h + mlp(norm_2(h)),
            with the norms ``input_layernorm`` / ``post_attention_layernorm`` and every layer argument passed
            on to the attention (``residual.py`` runs that layer with fused residual norms).
        mlp_output_saved: True where an op after a dense MLP saves its output for backward (a
            post-feedforward norm: Gemma 2/3, OLMo2; Qwen3.5-MoE's gated shared expert); False where it
            only enters the residual sum, so a checkpoint recompute may skip computing it.
        experts_output_saved: the same for the routed experts' output (``moe.py``).
        gguf_arch: llama.cpp architecture name for GGUF export.
        moe_block_class: the sparse mixture-of-experts block (router + experts) a decoder layer holds
            in place of a dense MLP, or None for dense families (``moe.py``).
        experts_class: the experts module of that block (stacked 3-D ``gate_up_proj``/``down_proj``).
        experts_glu: "act" (the config's activation on the first half of gate_up, times the second
            half) or "clamped_swiglu" (gpt-oss: interleaved gate/up, clamped, α-sigmoid, up + 1).
        experts_transposed: expert weights stored [E, in, out] (gpt-oss) instead of [E, out, in].
        experts_bias: the expert projections carry biases ``gate_up_proj_bias``/``down_proj_bias``.
        rope_half_cos: the rotary tables hold half the rotary width (gpt-oss); the kernel gets them
            repeated, [cos | cos], which is the same rotation.
        rope_layout: "halves" (HF's rotate_half: the RoPE kernel's layout) or "interleaved" (adjacent
            pairs, GLM-4 / ERNIE 4.5): those keep the family's own ``apply_rotary_pos_emb``, reported.
        rope_flag: attribute of the attention module saying whether this layer rotates q/k at all
            (SmolLM3's NoPE layers: ``use_rope``), or None where every layer does.
        rope_flag_when: attribute of the attention module that puts ``rope_flag`` in force: where it is None,
            every layer rotates whatever ``rope_flag`` says (EXAONE 4: with a ``sliding_window`` only the
            ``is_sliding`` layers rotate and the full-attention ones are NoPE; without one, every layer rotates).
            None: ``rope_flag`` always decides.
        qk_norm_attrs: the attention module's q and k norm attributes.
        output_gate: q_proj also yields a gate per head ([q_h | g_h], Qwen3.5's full-attention layers):
            the attention output is multiplied by sigmoid(g) before o_proj.
        output_dropout_attr: attribute of the attention and MLP modules holding a dropout probability the stock
            forwards apply to their outputs in training, ``nn.functional.dropout(out, p, training)`` after o_proj
            and after down_proj (Seed-OSS: ``residual_dropout``); the patched forwards apply it at the same points
            (the same random numbers, in the same order), a checkpoint recompute replays it. None: no such dropout.
        vision: the towers of a vision-language model (``causal_lm_class`` is then its
            ``*ForConditionalGeneration``); None for a text-only family.
    """

    model_type: str
    modeling_module: str
    causal_lm_class: str
    decoder_layer_class: str
    attention_class: str
    mlp_class: str | None  # None: no dense MLP class (every layer is a mixture of experts)
    norm_class: str
    norm_eps_attr: str = "variance_epsilon"
    norm_offset: float = 0.0
    norm_casting: str = "llama"
    qkv_layout: str = "separate"
    qk_norm: str | None = None
    attention_kwargs: tuple[tuple[str, str], ...] = ()
    mlp_layout: str = "separate"
    activation_attrs: tuple[str, ...] = ("hidden_act",)
    final_softcap_attr: str | None = None
    logit_divisor_attr: str | None = None
    pre_norm_layer: bool = False
    mlp_output_saved: bool = False
    experts_output_saved: bool = False
    gguf_arch: str = "llama"
    moe_block_class: str | None = None
    experts_class: str | None = None
    experts_glu: str = "act"
    experts_transposed: bool = False
    experts_bias: bool = False
    rope_half_cos: bool = False
    rope_layout: str = "halves"
    rope_flag: str | None = None
    rope_flag_when: str | None = None
    qk_norm_attrs: tuple[str, str] = ("q_norm", "k_norm")
    output_gate: bool = False
    output_dropout_attr: str | None = None
    vision: VisionLayout | None = None


def _row(base: FamilySpec, model_type: str, prefix: str, **changes) -> FamilySpec:
    """A row derived from ``base`` whose classes are named ``<prefix>ForCausalLM`` etc."""
    pkg = model_type
    names = dict(
        modeling_module=f"transformers.models.{pkg}.modeling_{pkg}",
        causal_lm_class=f"{prefix}ForCausalLM",
        decoder_layer_class=f"{prefix}DecoderLayer",
        attention_class=f"{prefix}Attention",
        mlp_class=f"{prefix}MLP",
        norm_class=f"{prefix}RMSNorm",
    )
    names.update(changes)
    return dataclasses.replace(base, model_type=model_type, **names)


LLAMA = FamilySpec(
    model_type="llama",
    modeling_module="transformers.models.llama.modeling_llama",
    causal_lm_class="LlamaForCausalLM",
    decoder_layer_class="LlamaDecoderLayer",
    attention_class="LlamaAttention",
    mlp_class="LlamaMLP",
    norm_class="LlamaRMSNorm",
    pre_norm_layer=True,
    gguf_arch="llama",
)

MISTRAL = _row(LLAMA, "mistral", "Mistral", attention_kwargs=(("sliding_window", "config:sliding_window"),),
               gguf_arch="llama")
QWEN2 = _row(LLAMA, "qwen2", "Qwen2", attention_kwargs=(("sliding_window", "module:sliding_window"),),
             gguf_arch="qwen2")
QWEN3 = _row(QWEN2, "qwen3", "Qwen3", qk_norm="head", gguf_arch="qwen3")
# Gemma's MLP builds its activation from config.hidden_act; Gemma 2/3 from config.hidden_activation.
GEMMA = _row(LLAMA, "gemma", "Gemma", norm_eps_attr="eps", norm_offset=1.0, norm_casting="gemma",
             activation_attrs=("hidden_act",), gguf_arch="gemma")
GEMMA2 = _row(GEMMA, "gemma2", "Gemma2", activation_attrs=("hidden_activation",),
              attention_kwargs=(("sliding_window", "module:sliding_window"),
                                ("softcap", "module:attn_logit_softcapping")),
              final_softcap_attr="final_logit_softcapping", mlp_output_saved=True, pre_norm_layer=False,
              gguf_arch="gemma2")
GEMMA3_TEXT = _row(GEMMA2, "gemma3_text", "Gemma3", qk_norm="head",
                   modeling_module="transformers.models.gemma3.modeling_gemma3",
                   causal_lm_class="Gemma3ForCausalLM", attention_kwargs=(("sliding_window", "module:sliding_window"),),
                   gguf_arch="gemma3")
# Not pre-norm layers as residual.py runs them: Phi-3 adds residual dropouts, Granite scales the
# residual branch, OLMo2 (like Gemma 2/3) norms the branch outputs.
PHI3 = _row(LLAMA, "phi3", "Phi3", qkv_layout="fused", mlp_layout="fused",
            attention_kwargs=(("sliding_window", "config:sliding_window"),), pre_norm_layer=False, gguf_arch="phi3")
GRANITE = _row(LLAMA, "granite", "Granite", logit_divisor_attr="logits_scaling", pre_norm_layer=False,
               gguf_arch="granite")
OLMO2 = _row(LLAMA, "olmo2", "Olmo2", qk_norm="full", norm_casting="gemma", mlp_output_saved=True,
             pre_norm_layer=False, gguf_arch="olmo2")
# Families whose forward is one of the above with a difference the row states. OLMo 3 is llama.cpp's
# olmo2 with sliding layers. Ministral's sliding layers have no llama.cpp arch that fasttune checked, so
# its gguf_arch (absent from export/gguf_arch.ARCHS) makes save_gguf refuse it with the reason.
OLMO3 = _row(OLMO2, "olmo3", "Olmo3", attention_kwargs=(("sliding_window", "module:sliding_window"),),
             gguf_arch="olmo2")
MINISTRAL = _row(MISTRAL, "ministral", "Ministral", attention_kwargs=(("sliding_window", "module:sliding_window"),),
                 gguf_arch="ministral")
SMOLLM3 = _row(LLAMA, "smollm3", "SmolLM3", attention_kwargs=(("sliding_window", "module:sliding_window"),),
               rope_flag="use_rope", gguf_arch="smollm3")
# GLM-4 (dense): norms after the attention and the MLP too (post_self_attn_layernorm, post_mlp_layernorm),
# Phi-3's fused gate_up_proj, partial interleaved rotary. ERNIE 4.5: Llama's layer, interleaved rotary.
GLM4 = _row(LLAMA, "glm4", "Glm4", mlp_layout="fused", rope_layout="interleaved", pre_norm_layer=False,
            mlp_output_saved=True, gguf_arch="glm4")
ERNIE4_5 = _row(LLAMA, "ernie4_5", "Ernie4_5", rope_layout="interleaved", gguf_arch="ernie4_5")
# Hunyuan dense: Llama's layer with per-head q/k norms applied after RoPE (query_layernorm / key_layernorm).
HUNYUAN_V1_DENSE = _row(LLAMA, "hunyuan_v1_dense", "HunYuanDenseV1", qk_norm="head_after_rope",
                        qk_norm_attrs=("query_layernorm", "key_layernorm"), gguf_arch="hunyuan-dense")
# EXAONE 4: OLMo2's layer (no input norms; post_attention_layernorm / post_feedforward_layernorm on the branch
# outputs) with Llama's norm casting and per-head q/k norms before RoPE. With config.sliding_window set, its
# sliding layers rotate and its full-attention layers are NoPE (every module holds the window; is_sliding says
# which layers use it); without one, every layer rotates with full attention.
EXAONE4 = _row(OLMO2, "exaone4", "Exaone4", qk_norm="head", norm_casting="llama",
               attention_kwargs=(("sliding_window", "module:sliding_window?is_sliding"),),
               rope_flag="is_sliding", rope_flag_when="sliding_window", gguf_arch="exaone4")
# Seed-OSS: Llama's layer with q/k/v biases (config.attention_bias; o_proj's attention_out_bias, mlp_bias) and a
# dropout of config.residual_dropout (0.1 in the released config) on the attention's and the MLP's outputs, before
# the residual adds; the checkpoint recompute replays its masks (preserve_rng_state). Its dropout comes after the
# MLP's down projection and saves only its mask: the recompute may still skip that projection.
SEED_OSS = _row(LLAMA, "seed_oss", "SeedOss", output_dropout_attr="residual_dropout", gguf_arch="seed_oss")
# Qwen3.5 (text): three of every four layers mix tokens with a gated delta rule (linear_attn, stock);
# the others are Qwen3 attention with a per-head output gate, partial RoPE and (1 + w) norms in fp32.
# Not pre-norm layers as residual.py runs them (a linear-attention layer calls linear_attn).
QWEN3_5_TEXT = _row(QWEN3, "qwen3_5_text", "Qwen3_5", modeling_module="transformers.models.qwen3_5.modeling_qwen3_5",
                    norm_eps_attr="eps", norm_offset=1.0, norm_casting="gemma", attention_kwargs=(),
                    output_gate=True, pre_norm_layer=False, gguf_arch="qwen35")
# Qwen3.5-MoE (text): the same layers with a routed-experts block; its shared expert (a dense MLP, the
# family's only one) is scaled by a sigmoid gate in the block's own forward, which stays stock around the
# fused experts. That product saves the MLP's output for backward: a recompute must compute it whole (the
# routed experts' output only enters the sum and may still be skipped).
QWEN3_5_MOE_TEXT = _row(QWEN3_5_TEXT, "qwen3_5_moe_text", "Qwen3_5Moe",
                        modeling_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                        moe_block_class="Qwen3_5MoeSparseMoeBlock", experts_class="Qwen3_5MoeExperts",
                        mlp_output_saved=True, gguf_arch="qwen35moe")

# Mixtures of experts: the dense row of the same attention, plus the MoE block and its experts.
# Qwen3-MoE keeps dense MLP layers where config.mlp_only_layers says so; the others are MoE only.
QWEN3_MOE = _row(QWEN3, "qwen3_moe", "Qwen3Moe", moe_block_class="Qwen3MoeSparseMoeBlock",
                 experts_class="Qwen3MoeExperts", gguf_arch="qwen3moe")
# Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's layer (q/k/v biases) with a routed-experts block whose
# shared expert (a Qwen2MoeMLP, as the dense layers of mlp_only_layers / decoder_sparse_step) is scaled by
# sigmoid(shared_expert_gate(x)) in the block's own forward, stock around the fused experts: that product saves
# the MLP's output (mlp_output_saved). Its attention passes no sliding_window kwarg (the mask carries the window).
QWEN2_MOE = _row(QWEN2, "qwen2_moe", "Qwen2Moe", attention_kwargs=(), moe_block_class="Qwen2MoeSparseMoeBlock",
                 experts_class="Qwen2MoeExperts", mlp_output_saved=True, gguf_arch="qwen2moe")
MIXTRAL = _row(MISTRAL, "mixtral", "Mixtral", mlp_class=None, moe_block_class="MixtralSparseMoeBlock",
               experts_class="MixtralExperts", gguf_arch="llama")
OLMOE = _row(LLAMA, "olmoe", "Olmoe", qk_norm="full", attention_kwargs=(("sliding_window", "config:sliding_window"),),
             mlp_class=None, moe_block_class="OlmoeSparseMoeBlock", experts_class="OlmoeExperts", gguf_arch="olmoe")
GRANITEMOE = _row(GRANITE, "granitemoe", "GraniteMoe", mlp_class=None, moe_block_class="GraniteMoeMoE",
                  experts_class="GraniteMoeExperts", gguf_arch="granitemoe")
# GLM-4-MoE: the first config.first_k_dense_replace layers dense, then MoE blocks with a shared
# expert (a dense Glm4MoeMLP, patched as one); partial rotary (config.partial_rotary_factor).
GLM4_MOE = _row(LLAMA, "glm4_moe", "Glm4Moe", qk_norm="head_optional", moe_block_class="Glm4MoeMoE",
                experts_class="Glm4MoeExperts", gguf_arch="glm4moe")
# gpt-oss: attention sinks (passed on as s_aux), half-width rotary tables, norms that multiply in
# fp32 before the cast, and a block that returns (output, router scores): not a pre-norm layer.
GPT_OSS = _row(LLAMA, "gpt_oss", "GptOss", mlp_class=None, norm_casting="gemma", rope_half_cos=True,
               attention_kwargs=(("sliding_window", "module:sliding_window"), ("s_aux", "module:sinks")),
               pre_norm_layer=False, moe_block_class="GptOssMLP", experts_class="GptOssExperts",
               experts_glu="clamped_swiglu", experts_transposed=True, experts_bias=True, gguf_arch="gpt-oss")
# Vision-language models: the language tower on its text family's path (Qwen2-VL's 3-D RoPE sections
# are folded into cos/sin by the stock rotary module, so the attention rotates as Qwen2's does); the
# stock ForConditionalGeneration applies no final soft-cap (Gemma 3's text config may carry one).
_QWEN_VL = dict(mlp_class="Qwen2MLP", gguf_arch="qwen2vl")
QWEN2_VL = _row(QWEN2, "qwen2_vl", "Qwen2VL", causal_lm_class="Qwen2VLForConditionalGeneration", **_QWEN_VL,
                vision=VisionLayout("model.language_model", "model.visual", "model.visual.merger", "qwen2vl_merger"))
QWEN2_5_VL = _row(QWEN2, "qwen2_5_vl", "Qwen2_5_VL", causal_lm_class="Qwen2_5_VLForConditionalGeneration",
                  **_QWEN_VL, vision=VisionLayout("model.language_model", "model.visual", "model.visual.merger",
                                                  "qwen2.5vl_merger"))
GEMMA3 = _row(GEMMA3_TEXT, "gemma3", "Gemma3", causal_lm_class="Gemma3ForConditionalGeneration",
              final_softcap_attr=None, vision=VisionLayout("model.language_model", "model.vision_tower",
                                                           "model.multi_modal_projector", "gemma3"))

FAMILIES: dict[str, FamilySpec] = {
    spec.model_type: spec
    for spec in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3_TEXT, PHI3, GRANITE, OLMO2,
                 OLMO3, MINISTRAL, SMOLLM3, GLM4, ERNIE4_5, HUNYUAN_V1_DENSE, EXAONE4, SEED_OSS, QWEN3_5_TEXT,
                 QWEN3_MOE, MIXTRAL, OLMOE, GRANITEMOE, GLM4_MOE, GPT_OSS, QWEN3_5_MOE_TEXT, QWEN2_MOE,
                 QWEN2_VL, QWEN2_5_VL, GEMMA3)
}


def family_for(model_type: str | None) -> FamilySpec | None:
    """The row for this exact model_type, or None."""
    return FAMILIES.get(model_type or "")


# --- the table's classes in the installed transformers --------------------------------------

_CLASS_FIELDS = ("causal_lm_class", "decoder_layer_class", "attention_class", "mlp_class", "norm_class")


def resolve_classes(spec: FamilySpec) -> dict[str, type]:
    """Field name → class of this family in the installed transformers (missing ones omitted)."""
    try:
        module = importlib.import_module(spec.modeling_module)
    except ImportError:
        return {}
    found = {}
    for field_name in _CLASS_FIELDS:
        if getattr(spec, field_name) is None:  # a family without that kind of module (mlp_class of MoE-only ones)
            continue
        cls = getattr(module, getattr(spec, field_name), None)
        if isinstance(cls, type):
            found[field_name] = cls
    return found


def family_class(spec: FamilySpec, classes: dict, field_name: str, op: str, report: PatchReport) -> type | None:
    """The family's class ``field_name`` (e.g. "norm_class") from ``resolve_classes``, or None after
    reporting that this transformers version lacks it."""
    cls = classes.get(field_name)
    if cls is None:
        report.fallback(op, spec.model_type, f"{getattr(spec, field_name)} not found in {spec.modeling_module}")
    return cls


def family_modules(base: nn.Module, spec: FamilySpec, classes: dict, field_name: str, op: str, report: PatchReport):
    """(name, module) for each module of exactly the family's class ``field_name`` (none, and the
    class reported missing, when this transformers version lacks it)."""
    cls = family_class(spec, classes, field_name, op, report)
    if cls is not None:
        yield from ((name, m) for name, m in base.named_modules() if type(m) is cls)
