"""FastConfig: every fasttune option, in one dataclass.

Like PEFT's configs: each field documents itself in ``metadata["help"]``, ``__post_init__``
checks each value's type (TypeError naming the field: ``rms_norm="no"`` must not leave the kernel
on) and rejects contradictions with a ValueError naming the field, and ``to_dict``/``from_dict``
round-trip (model cards and the CLI's YAML embed it). No behaviour hides in environment variables.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CHECKPOINTING_MODES = (None, "recompute", "offload", "auto")
ARTIFACTS = ("adapter", "merged", "gguf")
GGUF_QUANTIZATIONS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
                      "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
MERGED_DTYPES = ("bfloat16", "float16", "float32")
BASE_DTYPES = ("auto", "fp8")
MOE_EXPERTS_NF4 = ("auto", "on", "off")


@dataclass
class FastConfig:
    """Options for patching, checkpointing, export and Hub upload.

    Example:
        >>> FastConfig(checkpointing="offload", push_to_hub=True, hub_model_id="me/llama-sft")
    """

    # --- kernels -------------------------------------------------------------------------
    cross_entropy: bool = field(default=True, metadata={
        "help": "Compute the causal-LM loss with the fused linear cross-entropy (logits never materialised)."})
    rms_norm: bool = field(default=True, metadata={"help": "Triton RMSNorm (forward + hand-written backward)."})
    residual_norms: bool = field(default=True, metadata={
        "help": "With the Triton RMSNorm, in pre-norm decoder layers (Llama, Mistral, Qwen 2/3, Gemma): the "
                "attention's residual add runs inside the norm after it, and each norm's backward adds the "
                "residual stream's gradient (no separate add kernels; same forward values)."})
    rope: bool = field(default=True, metadata={"help": "Triton rotary embedding applied to Q and K in one launch."})
    mlp: bool = field(default=True, metadata={"help": "Triton SwiGLU/GeGLU activation in the gated MLP."})
    moe: bool = field(default=True, metadata={
        "help": "Mixture-of-experts layers: the routed experts as one sorted, grouped computation (grouped "
                "products, fused GLU, hand-written backward), with PEFT LoRA on the experts fused in."})
    moe_experts_nf4: str = field(default="auto", metadata={
        "help": "With `moe`: hold the frozen stacked expert weights (transformers 5's 3-D gate_up_proj/down_proj, "
                "which bitsandbytes' 4-bit loading leaves dense) in NF4, quantised by bitsandbytes with the base's "
                "blocksize and double-quant setting, dequantised per call inside the grouped expert path. 'auto': "
                "when the base was loaded in 4-bit NF4 (QLoRA); 'on': always (needs bitsandbytes; frozen experts "
                "only); 'off': the experts keep their load dtype. LoRA on the experts still trains; PEFT's in-place "
                "merge is refused (save_merged dequantises; unpatch_model restores dense experts)."})
    lora: bool = field(default=True, metadata={
        "help": "Fused LoRA paths (gated MLP, QKV, O; NF4 dequantised on the fly) for PEFT LoRA "
                "modules with dropout 0, no bias and no DoRA; other LoRA modules keep PEFT's path."})
    lora_widen: bool = field(default=True, metadata={
        "help": "With fused LoRA: at its first fused call, store each frozen dense q/k/v, gate/up and down weight "
                "with room for its group's LoRA B columns (the ranks padded to 64 columns: +1.6% of a 4096-wide "
                "weight) so the rank-r term rides in the base product instead of an extra pass over the output. "
                "bf16 LoRA: one rounding per projection; closer to fp32 than stock bf16 (stock PEFT rounds the "
                "base product, then the sum, so early LoRA updates below half a bf16 ulp vanish; False gives "
                "stock's numbers). Never for FSDP shards or ZeRO-3 partitions. NF4 (QLoRA) groups take the same "
                "layout per product (on CUDA where every width is a multiple of 512): each dequantisation writes "
                "W into a widened buffer of its own with B in its tail, so no memory is kept, and those groups "
                "stay fused in no-grad passes (DPO's reference equals a fresh adapter's policy bit for bit); the "
                "8B NF4 step on an H100: 653 against 662-678 ms; Qwen2.5-7B NF4: 630 against 640 ms. Also the stacked expert "
                "weights of a MoE block whose experts carry PEFT LoRA (target_parameters): each is bordered by A and "
                "s·B (ranks padded to 16 rows and columns), so the forward and the input gradient are one grouped "
                "product each."})
    base_dtype: str = field(default="auto", metadata={
        "help": "Frozen base weights of the fused LoRA projections (q/k/v, o, gate/up, down): 'auto' keeps them "
                "as loaded (exact). 'fp8' (an approximation, opt-in): stores them as float8_e4m3fn with a "
                "power-of-two scale per output row, computed from the 16-bit (or dequantised NF4) weights at "
                "patch time, the 16-bit copy freed (1 byte per weight), and multiplies X·Wᵀ and dY·W in FP8 "
                "with per-row scaled activations and gradients (torch._scaled_mm on GPUs with FP8, sm89+; a "
                "dequantise-and-matmul reference elsewhere). LoRA terms, norms, attention and the loss keep "
                "their precision; those projections are never widened (lora_widen). Named fp8_* in the "
                "PatchReport and the model card; merged/GGUF exports read the original 16-bit weights from "
                "the checkpoint the model was loaded from."})
    fused_logprobs: bool = field(default=True, metadata={
        "help": "Serve TRL's fused LM head (fused_lm_head=True: SFT metrics, DPO, GRPO, KTO, RLOO "
                "log-probabilities) with fasttune's kernel."})
    loss_workspace_mib: int | None = field(default=None, metadata={
        "help": "Upper bound, in MiB, of the logit workspace the fused loss uses per chunk of tokens. "
                "None: 1024 when the LM head trains (fewer chunks, fewer passes over its fp32 gradient), "
                "else what 1,024 tokens take, at least 256."})
    return_logits: bool = field(default=False, metadata={
        "help": "Also return logits from a training forward with labels (costs the [tokens, vocab] memory)."})

    flex_sinks: bool = field(default=True, metadata={
        "help": "Attention with sinks (gpt-oss) on CUDA: switch a model running eager attention to compiled flex "
                "attention (set_attn_implementation('flex_attention'), undone by unpatch_model) with the sinks "
                "folded in by a float32 rescale of each row; transformers has no SDPA path for sinks and its eager "
                "one materialises every [heads, seq, seq] score matrix."})

    # --- checkpointing -------------------------------------------------------------------
    checkpointing: str | None = field(default=None, metadata={
        "help": "Decoder-layer activation checkpointing: None (off), 'recompute', 'offload' (layer "
                "inputs in pinned CPU memory, prefetched during backward) or 'auto' (keep what fits "
                "memory_budget_gb resident, offload the rest)."})
    memory_budget_gb: float | None = field(default=None, metadata={
        "help": "GPU memory 'auto' checkpointing may use for activations; None: free memory minus a margin."})
    keep_recomputed_nf4: bool = field(default=True, metadata={
        "help": "With checkpointing: the NF4 weights a checkpointed layer's recompute dequantises are kept for that "
                "layer's backward (dX = dY W) instead of being dequantised again, when the compute dtype is the "
                "QuantState's (bf16 QLoRA): 6 of a Llama layer's 20 dequantisations a step, for one layer's weights "
                "held from its recompute to its backward. Exact: the same values. 8B NF4 step on an H100: -1.1% time, "
                "+0.19 GiB peak (benchmarks/RESULTS.md, session 41)."})
    reuse_forward_lora: bool = field(default=False, metadata={
        "help": "Opt-in, with checkpointing: a checkpointed layer's recompute takes the LoRA products X·Aᵀ and the "
                "adapters' bf16 casts its forward made (kernels/forward_reuse.py) instead of making them again; the "
                "recompute of an MLP whose output it discards then skips its GLU pass, and a widened group copies B "
                "into its buffer once per layer call. Exact: the same tensors. Costs the records from each layer's "
                "forward to its recompute (~3.2 MB a layer for an 8B model at 8,192 tokens, at most 256 MiB in all). "
                "Off until measured on a GPU (benchmarks/RESULTS.md, session 51)."})
    attention_stash: bool | None = field(default=None, metadata={
        "help": "With checkpointing 'offload' or 'auto': the attention core of each offloaded decoder layer "
                "(q/k/v projections through the attention output) keeps what it saves for backward in pinned "
                "host memory instead of being recomputed (about 0.16 GiB of host memory per layer per 8k tokens "
                "of an 8B model, within half the host's available memory; further layers are recomputed; its "
                "input is not copied: the recompute makes it), as far as the host link keeps pace with the "
                "forward (measured on the first two steps). Exact: gradients equal those of a run without "
                "checkpointing. 8B step on an H100: +1.1-4.1% tok/s, +0.17/+0.31 GiB allocated/reserved "
                "(benchmarks/RESULTS.md, session 46). None (default): on where the layers record their forward "
                "(dense families, bf16 and NF4 bases), off where the forward runs without autograd "
                "(checkpoint_no_grad_forward: mixture-of-experts families by default), with base_dtype='fp8' "
                "(not measured there yet) and for families with q/k norms (Qwen3, Gemma 3, OLMo 2: their normed "
                "q/k are remade in backward from the norms' inputs, so a core moves what a Llama core moves, yet "
                "Qwen3-8B on an H100 ran no faster with it: sessions 48-49). Cores with dropout inside (attention "
                "dropout, PEFT's lora_dropout) are recomputed. True: on wherever it applies."})
    experts_stash: bool = field(default=False, metadata={
        "help": "With checkpointing 'offload' or 'auto': the routed experts of each offloaded mixture-of-experts "
                "layer keep what they save for backward (their gate/up product and input) in pinned host memory "
                "instead of being recomputed (about 0.23 GiB of host memory per layer per 8k tokens of "
                "Qwen3-30B-A3B, within the same host budget as attention_stash). Exact. Measured slower on an H200 "
                "with a PCIe host link (~46k vs ~72k tok/s on 8 Qwen3-30B-A3B layers, benchmarks/RESULTS.md): "
                "for hosts whose link to the GPU is much faster than PCIe."})
    mlp_stash: bool = field(default=False, metadata={
        "help": "With checkpointing 'offload' or 'auto': the gated MLP of each offloaded dense decoder layer keeps "
                "what it saves for backward (its input and gate/up products) in pinned host memory instead of being "
                "recomputed, as far as the host link keeps pace with the forward (its rate and the layers' time "
                "measured on the first two steps) and the stashes' host budget allow; further layers are "
                "recomputed. About 0.5 GiB of host memory per stashed layer per 8k tokens of an 8B model. Exact. On "
                "an H100's PCIe link (~51 GiB/s, 6.4 ms a layer) the 8B bf16 step's 512 MiB core never fits the "
                "budget at 4x2048, so nothing is stashed (benchmarks/RESULTS.md, session 39): for hosts whose link "
                "to the GPU is much faster than PCIe."})
    o_proj_stash: bool | None = field(default=None, metadata={
        "help": "With checkpointing 'offload' or 'auto': the fused LoRA o_proj of each offloaded decoder layer "
                "copies its output to pinned host memory (64 MiB per layer per 8k tokens of an 8B model) and the "
                "recompute takes it back instead of multiplying again, as far as the host link keeps pace "
                "(measured on the first two steps, as for the other stashes). Exact. 8B bf16 step on an H100: "
                "+0.9-1.3% tok/s, +0.06 GiB peak. None (default): on over dense bases where the layers record "
                "their forward (dense families); off over NF4/FP8 bases (the 8B NF4 step ran 2% slower with it) "
                "and where the forward runs without autograd (checkpoint_no_grad_forward: mixture-of-experts "
                "families by default). True: every fused o_proj of an offloaded layer."})
    checkpoint_no_grad_forward: bool | None = field(default=None, metadata={
        "help": "With checkpointing: a checkpointed decoder layer's forward runs without autograd (nothing "
                "recorded, nothing saved but its input) and is recorded once, by its recompute in backward, "
                "instead of twice (torch's non-reentrant checkpoint). Same gradients, less host time. None "
                "(default): on for mixture-of-experts families, whose many small launches leave the step "
                "host-bound (8 Qwen3-30B-A3B layers on an H200, one process: 111.0-114.3 vs 122.7-133.9 ms/step), off for dense ones, "
                "GPU-bound already (Llama-3.1-8B: the same speed, 0.35 GiB more reserved). Router logits for the "
                "auxiliary loss keep their gradient. A layer keeps the recorded forward under forward hooks on "
                "its modules, with the stashes and in multi-process runs "
                "(counted as 'no_grad_forward' in the report, logged once per reason). torch.autograd.grad "
                "cannot follow such a layer (it raises; with allow_unused=True the layers' parameters get "
                "None): set False for it."})
    checkpoint_forward_graphs: bool = field(default=False, metadata={
        "help": "Opt-in, CUDA: a checkpointed layer's forward that runs without autograd "
                "(checkpoint_no_grad_forward) is captured once as a CUDA graph and replayed: one launch "
                "instead of the layer's many, so the host reaches the backward ahead of the GPU. 8 Qwen3-30B-A3B "
                "layers on an H200: 119.9 -> 97.5 ms/step where the host could not keep up, 102.0 -> 97.3 where it "
                "could. Costs one layer's forward working set, kept reserved in the graphs' memory pool (0.67 GiB "
                "there), which the experts' backward reuses for its temporaries (+0.34-0.47 GiB reserved in all: "
                "14.06-14.19 GiB against 13.72 eager and Unsloth's 13.99-14.15, measured before the offloaded layer "
                "inputs left in stream order). "
                "Layers with dropout in training, or that record router logits for transformers, stay "
                "eager (logged); a new input layout or adapter switch is captured anew."})
    checkpoint_backward_graphs: bool = field(default=False, metadata={
        "help": "Opt-in, CUDA, with checkpoint_forward_graphs: a checkpointed layer's backward (its recompute "
                "and back-propagation) is captured once as a CUDA graph too, in the same memory pool, and "
                "replayed; the layer's parameter gradients are added to .grad after each replay (as autograd "
                "would: same numbers). The backward's working set then lives in that pool, which the forward's "
                "replays reuse. Mixture-of-experts layers are captured too. Layers whose parameters carry "
                "gradient hooks, that record router logits (output_router_logits=True) or run dropout in "
                "training stay eager (logged). An 8B dense step on an H200 whose host kept up ran no faster "
                "(benchmarks/RESULTS.md): for hosts that cannot launch a step as fast as the GPU runs it. 8 "
                "Qwen3-30B-A3B layers at 4x2048 on an H100: 13.86 GiB reserved in each of three rounds, Unsloth "
                "14.03-14.07 and 1.22x slower in the same invocation (no graphs: 13.54 GiB, 1.19x)."})
    cuda_expandable_segments: bool = field(default=True, metadata={
        "help": "Switch torch's CUDA caching allocator to expandable segments when a model is patched on a "
                "machine with CUDA (process-wide, for allocations from then on; undone by unpatch_model): "
                "checkpointing's working sets change size from layer to layer, and fixed segments let the "
                "reserve grow to twice what is allocated on long sequences. A PYTORCH_ALLOC_CONF / "
                "PYTORCH_CUDA_ALLOC_CONF that names expandable_segments is left as the user set it."})

    # --- multi-GPU -----------------------------------------------------------------------
    fsdp_reshard_after_forward: bool | None = field(default=None, metadata={
        "help": "FSDP2 units whose parameters are adapters over a frozen base (LoRA/QLoRA decoder layers): "
                "True leaves FSDP's reshard-after-forward; False keeps their weights gathered from forward "
                "to backward (one all-gather per step instead of two or three; each GPU holds those layers "
                "unsharded at the end of forward, as DDP does); None: False when those layers take at most "
                "half of the free GPU memory."})
    zero3_keep_frozen_gathered: bool | None = field(default=None, metadata={
        "help": "DeepSpeed ZeRO-3: keep the frozen parameters (a LoRA/QLoRA base) gathered from their first "
                "use in a step until the optimizer step, as DeepSpeed's persistent parameters: each is "
                "all-gathered once per step instead of around every module's forward, checkpoint recompute "
                "and backward (each GPU holds them whole at the end of forward, as DDP does; adapters, "
                "gradients and optimizer states stay partitioned). True always; False leaves DeepSpeed's "
                "setting; None: True when they take at most half of the smallest free GPU memory among the "
                "ranks and are not offloaded to the CPU."})

    # --- logging and the host side of the loop -----------------------------------------------
    log_throughput: bool = field(default=True, metadata={
        "help": "FastTrainer logs tokens/s and peak GPU memory with each log line."})
    gc_freeze: bool = field(default=True, metadata={
        "help": "FastTrainer, FastPatchCallback: after the first optimizer step of a train() of 100 steps or more, "
                "Python's cyclic garbage "
                "collector is told to leave every object alive then alone (gc.collect(), then gc.freeze(): the "
                "model, optimizer states, caches), until train() ends (gc.unfreeze()). Process-wide. A full "
                "collection otherwise walks them all, ~0.5 million objects for an 8B-shaped LoRA setup: on the "
                "2-core CPU machine one every 25 steps, 0.11 s each, 3% of its 152 ms steps (benchmarks/bench_gc.py); "
                "an NF4 8B step on an H100 that ran one took 956 ms against 671-687 (benchmarks/RESULTS.md, session "
                "39). Left alone when the collector is "
                "disabled or something already froze objects. Cycles among the frozen objects that become garbage "
                "during training are freed after train() ends."})

    # --- export and hub ------------------------------------------------------------------
    export_artifacts: tuple[str, ...] = field(default=(), metadata={
        "help": "Artifacts to save under output_dir at the end of train(): 'adapter', 'merged', 'gguf'. "
                "With push_to_hub, push_artifacts are saved too."})
    merged_dtype: str = field(default="bfloat16", metadata={
        "help": "dtype of the merged 16-bit export: " + ", ".join(MERGED_DTYPES)})
    push_to_hub: bool = field(default=False, metadata={
        "help": "Push the artifacts to the Hub at the end of train() (main process only)."})
    hub_model_id: str | None = field(default=None, metadata={
        "help": "Repo id of the merged model; the adapter goes to '<id>-lora', GGUF files to '<id>-GGUF'."})
    push_artifacts: tuple[str, ...] = field(default=ARTIFACTS, metadata={
        "help": "Which artifacts push_to_hub uploads: " + ", ".join(ARTIFACTS)})
    gguf_quantizations: tuple[str, ...] = field(default=("q8_0",), metadata={
        "help": "GGUF files to write: " + ", ".join(GGUF_QUANTIZATIONS) + " (K-quants need llama-cpp-python)."})
    hub_private: bool = field(default=True, metadata={"help": "Create the Hub repos as private."})
    base_model_id: str | None = field(default=None, metadata={
        "help": "Hub id of the base model, written into cards when the base was loaded from a local path."})

    def __post_init__(self) -> None:
        _check_types(self)
        if self.checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING_MODES}, got {self.checkpointing!r}")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ValueError(f"memory_budget_gb must be > 0, got {self.memory_budget_gb}")
        if self.memory_budget_gb is not None and self.checkpointing != "auto":
            raise ValueError("memory_budget_gb only applies to checkpointing='auto'")
        for stash in ("attention_stash", "experts_stash", "mlp_stash", "o_proj_stash"):
            if getattr(self, stash) and self.checkpointing == "recompute":
                raise ValueError(f"{stash} applies to checkpointing='offload' or 'auto', not 'recompute'")
        if self.checkpoint_backward_graphs and not self.checkpoint_forward_graphs:
            raise ValueError("checkpoint_backward_graphs needs checkpoint_forward_graphs=True (their graphs share "
                             "one memory pool)")
        if self.checkpoint_forward_graphs and self.checkpoint_no_grad_forward is False:
            raise ValueError("checkpoint_forward_graphs replays the forward that checkpoint_no_grad_forward runs "
                             "without autograd; it cannot be combined with checkpoint_no_grad_forward=False")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"base_dtype must be one of {BASE_DTYPES}, got {self.base_dtype!r}")
        if self.moe_experts_nf4 not in MOE_EXPERTS_NF4:
            raise ValueError(f"moe_experts_nf4 must be one of {MOE_EXPERTS_NF4}, got {self.moe_experts_nf4!r}")
        if self.loss_workspace_mib is not None and self.loss_workspace_mib < 1:
            raise ValueError(f"loss_workspace_mib must be >= 1, got {self.loss_workspace_mib}")
        self.export_artifacts = _choices("export_artifacts", self.export_artifacts, ARTIFACTS)
        self.push_artifacts = _choices("push_artifacts", self.push_artifacts, ARTIFACTS)
        self.gguf_quantizations = _choices("gguf_quantizations", self.gguf_quantizations, GGUF_QUANTIZATIONS,
                                           lower=True)
        if self.merged_dtype not in MERGED_DTYPES:
            raise ValueError(f"merged_dtype must be one of {MERGED_DTYPES}, got {self.merged_dtype!r}")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("push_to_hub=True needs hub_model_id")
        if self.push_to_hub and not self.push_artifacts:
            raise ValueError("push_to_hub=True needs at least one of push_artifacts")
        if self.hub_model_id is not None and self.hub_model_id.count("/") > 1:
            raise ValueError(f"hub_model_id must be 'name' or 'namespace/name', got {self.hub_model_id!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-ready dict (tuples become lists)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FastConfig":
        """Inverse of ``to_dict``; an unknown key is a ValueError listing the known ones."""
        if not isinstance(data, Mapping):
            raise TypeError(f"FastConfig.from_dict expects a dict of FastConfig fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(repr(k) if not isinstance(k, str) else k for k in data if k not in known)
        if unknown:
            raise ValueError(f"unknown FastConfig field(s) {unknown}; known: {sorted(known)}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**kwargs)

    @classmethod
    def coerce(cls, value: "FastConfig | Mapping[str, Any] | None", name: str = "fast_config") -> "FastConfig":
        """The FastConfig a caller meant: itself, ``FastConfig()`` for None, ``from_dict`` of a dict.

        Args:
            value: a FastConfig, a dict of its fields, or None.
            name: the caller's argument name, used in error messages.

        Raises:
            TypeError: ``value`` is none of those, or a field has the wrong type.
            ValueError: an unknown key or a bad value (the message names ``name`` and the field).
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            try:
                return cls.from_dict(value)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{name}: {err}") from None
        raise TypeError(f"{name} must be a FastConfig, a dict of FastConfig fields or None, "
                        f"got {type(value).__name__}")

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Field name → help text (the CLI and the Space show these)."""
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def _choices(name: str, values, allowed, lower: bool = False) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)
    out = []
    for v in values:
        v = v.lower() if lower else v
        if v not in allowed:
            raise ValueError(f"{name}: {v!r} is not one of {', '.join(allowed)}")
        if v not in out:
            out.append(v)
    return tuple(out)


# -- field types ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _field_kinds() -> dict[str, tuple[type, bool]]:
    """Field name → (base type, None allowed), read off FastConfig's annotations."""
    out = {}
    for name, hint in typing.get_type_hints(FastConfig).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        (base,) = [a for a in args if a is not type(None)]
        out[name] = (tuple if typing.get_origin(base) is tuple else base, type(None) in args)
    return out


_EXPECTED = {bool: "True or False", int: "an integer", float: "a number", str: "a string",
             tuple: "a string or a list of strings"}


def _check_types(cfg: FastConfig) -> None:
    """TypeError naming the field for a value of the wrong type; ints and floats normalised.

    Strict on purpose: ``bool("no")`` is True, so a string would silently leave a kernel on.
    """
    for name, (kind, nullable) in _field_kinds().items():
        value = getattr(cfg, name)
        if value is None and nullable:
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        elif kind is tuple:
            ok = isinstance(value, str) or (isinstance(value, (list, tuple))
                                            and all(isinstance(v, str) for v in value))
        else:
            ok = isinstance(value, kind)
        if not ok:
            expected = "True, False or None" if kind is bool and nullable else (
                _EXPECTED[kind] + (" or None" if nullable else ""))
            raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
        if kind is int:
            setattr(cfg, name, int(value))
        elif kind is float:
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            setattr(cfg, name, float(value))


def resolve_checkpointing(args, config: FastConfig) -> FastConfig:
    """Map the Trainer's activation/gradient checkpointing flag onto ``config.checkpointing``.

    The user asked for checkpointing and chose no fasttune mode → "offload". Whenever fasttune
    checkpoints, the Trainer's own flag is cleared so layers are never wrapped twice.
    """
    if args is None:
        return config
    asked = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    if asked and config.checkpointing is None:
        config = dataclasses.replace(config, checkpointing="offload")
    if config.checkpointing is not None:
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            if hasattr(args, name):
                setattr(args, name, False)
    return config
