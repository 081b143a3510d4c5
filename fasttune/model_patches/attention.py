"""Self-attention modules with Q/K rotated by the Triton RoPE kernel, and the fused-LoRA hook points.

One forward for every family of the table, driven by the family's row: the projections (separate
q/k/v or Phi-3's fused ``qkv_proj``), the optional q/k norm ("head": over each head, Qwen3 /
Gemma 3; "full": over the whole projection, OLMo2; after RoPE: Hunyuan), Qwen3.5's per-head output
gate, RoPE (skipped in a layer whose ``rope_flag`` attribute is false, SmolLM3's NoPE layers, and EXAONE 4's
full-attention layers where its ``rope_flag_when`` attribute, the window, is set; the family's own rotation
where its pairs are interleaved, GLM-4 / ERNIE 4.5), the KV-cache update, the attention function
transformers selects for ``config._attn_implementation`` (eager: the family's own
``eager_attention_forward``, so Gemma 2's soft-cap stays), and the output projection, followed in
training by the family's output dropout where its row names one (``FamilySpec.output_dropout_attr``:
Seed-OSS's ``residual_dropout``; ``output_dropout``, the stock call at the stock point). The extra
keyword arguments a family passes to the attention function (sliding window, soft-cap) come from
``FamilySpec.attention_kwargs``.

Hooks for fused LoRA (replace the attributes of an installed forward):
    ``project_qkv(module, hidden_states) -> (q, k, v)``, each [..., heads*head_dim];
    ``project_o(module, attn_output) -> Tensor``. The defaults call the module's own projection
    submodules, so PEFT LoRA and bitsandbytes layers keep working. The RoPE kernel rotates q and
    k in place (bumping their version counters): a hook's autograd Function must not save the q/k
    it returns for its backward (it would fail loudly), and should not return views of its inputs.

Works with transformers 5.17 (``past_key_values``, ``cache.update(k, v, layer_idx)``) and 5.24
(``cache``, ``cache.update(k, v, layer_idx, kwargs=kwargs)``): the variant is read off the stock
forward's signature at patch time, and both keyword names are accepted at call time.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
from typing import Callable

import torch
from torch import nn

from ..config import FastConfig
from . import attention_stash
from .attention_qk import attention_qk
from .dropout_watch import DropoutWatch
from .mask_bias import sdpa_dtype, shareable
from .families import FamilySpec, family_class
from .instance import DECODE_STEP, PatchedForward, few_rows_without_grad, stock_forward, swap_forward
from .report import FUSED, PatchReport
from .sink_attention import FLEX, flex_sinks_unavailable, sink_flex_attention

OP_ROPE = "rope"
OP_HOOK = "attention_hook"  # installed for the LoRA hooks only (config.rope off)
OP_SINKS = "flex_sinks"  # attention with sinks through flex attention (sink_attention.py)
ATTENTION_ATTR = "self_attn"  # the decoder layer's attention child, in every family of the table
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_COMMON_ATTRS = ("config", "head_dim", "scaling", "num_key_value_groups", "is_causal", "layer_idx",
                 "attention_dropout")
_LAYOUT_SUBMODULES = {"separate": ("q_proj", "k_proj", "v_proj", "o_proj"), "fused": ("qkv_proj", "o_proj")}


def project_qkv_separate(module: nn.Module, hidden_states: torch.Tensor):
    """Default ``project_qkv`` for q_proj/k_proj/v_proj layouts (called in the stock order)."""
    return module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)


def project_qkv_fused(module: nn.Module, hidden_states: torch.Tensor):
    """Default ``project_qkv`` for Phi-3's qkv_proj: [q | k | v] along the last dimension."""
    qkv = module.qkv_proj(hidden_states)
    q_size = module.config.num_attention_heads * module.head_dim
    kv_size = module.num_key_value_heads * module.head_dim
    return qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]


def project_o(module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor:
    """Default ``project_o``: the module's own o_proj."""
    return module.o_proj(attn_output)


def attention_interface(functions, implementation: str | None, eager: Callable) -> Callable:
    """The attention function for ``implementation``, as the stock forward picks it.

    transformers ≥ 5 has ``ALL_ATTENTION_FUNCTIONS.get_interface(name, default)``; older ones
    index the registry, with the module's eager function for "eager".
    """
    get_interface = getattr(functions, "get_interface", None)
    if get_interface is not None:
        return get_interface(implementation, eager)
    if implementation in (None, "eager"):
        return eager
    return functions[implementation]


class FastAttentionForward(PatchedForward):
    """Replacement ``forward`` of one attention instance (see the module docstring).

    Attributes:
        project_qkv: ``(module, hidden_states) -> (q, k, v)``; fused LoRA replaces it.
        project_o: ``(module, attn_output) -> output``; fused LoRA replaces it.
        use_rope_kernel: rotate with ``fasttune.kernels.apply_rope`` (else the family's own
            ``apply_rotary_pos_emb``).
    """

    op = OP_ROPE

    def __init__(self, module: nn.Module, stock, spec: FamilySpec, *, eager: Callable, stock_rope: Callable | None,
                 functions, cache_kwargs: bool, use_rope_kernel: bool, flex_sinks: bool = False):
        super().__init__(module, stock)
        self.flex_sinks = flex_sinks  # the sinks through sink_flex_attention when the model runs flex
        self.project_qkv: Callable = project_qkv_fused if spec.qkv_layout == "fused" else project_qkv_separate
        self.project_o: Callable = project_o
        self.use_rope_kernel = use_rope_kernel
        self.qk_norm = spec.qk_norm
        self.q_norm, self.k_norm = spec.qk_norm_attrs
        if self.qk_norm == "head_optional":  # GLM-4-MoE: config.use_qk_norm decides whether the module has them
            self.qk_norm = "head" if hasattr(module, self.q_norm) else None
        self.attention_kwargs = tuple(spec.attention_kwargs)
        self.eager = eager
        self.stock_rope = stock_rope
        self.functions = functions
        self.cache_kwargs = cache_kwargs  # 5.24 passes the call's kwargs to cache.update
        self.half_cos = spec.rope_half_cos
        self.rope_flag = spec.rope_flag  # SmolLM3: a NoPE layer's module says use_rope = 0
        self.rope_flag_when = spec.rope_flag_when  # EXAONE 4: is_sliding decides only where a window is set
        self.output_gate = spec.output_gate  # Qwen3.5: q_proj yields [q_h | g_h] per head
        self.output_dropout_attr = spec.output_dropout_attr  # Seed-OSS: residual_dropout after o_proj
        self.dropout_inside = DropoutWatch(skip_self=True)  # PEFT's lora_dropout in the projections

    def _rope(self, q, k, cos, sin):
        if self.use_rope_kernel and self.half_cos:  # gpt-oss: [cos | cos] is the same rotation, in our layout
            stock_cos_sin = (cos, sin)
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if self.use_rope_kernel:
            decode = self.stock_rope is not None and few_rows_without_grad(q.shape[0] * q.shape[2])  # B·S tokens
            if _rope_fits(q, k, cos, sin) and not decode:
                from ..kernels.rope import apply_rope

                self.count()
                return apply_rope(q, k, cos, sin)
            self.count(DECODE_STEP if decode
                       else "q/k/cos/sin outside the kernel's domain (dtype, shape, rotary width)")
        if self.stock_rope is None:  # patched with the kernel but this call does not fit it
            from ..kernels.reference import apply_rope as reference_rope

            return reference_rope(q, k, cos, sin)
        if self.use_rope_kernel and self.half_cos:
            cos, sin = stock_cos_sin
        return self.stock_rope(q, k, cos, sin)

    def _extra_kwargs(self, module):
        return {name: attention_kwarg(module, source) for name, source in self.attention_kwargs}

    def _rotates(self, m) -> bool:
        """Does this layer apply RoPE (the row's ``rope_flag`` / ``rope_flag_when``)?"""
        if self.rope_flag is None:
            return True
        if self.rope_flag_when is not None and getattr(m, self.rope_flag_when) is None:
            return True
        return bool(getattr(m, self.rope_flag))

    def __call__(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, *,
                 past_key_values=None, **kwargs):
        m = self.module
        if cache is None:
            cache = past_key_values
        if few_rows_without_grad(hidden_states.numel() // max(1, hidden_states.shape[-1])):
            # A decode step: the stock forward (no kernel here pays off; fewer Python frames).
            if self.use_rope_kernel:
                self.count(DECODE_STEP)
            if cache is not None:
                kwargs = {**kwargs, ("cache" if self.cache_kwargs else "past_key_values"): cache}
            # By name: Qwen2-VL's attention takes (hidden_states, attention_mask, position_ids, ...).
            return self.stock(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                              **kwargs)
        stash = attention_stash.current(attention_stash.ATTENTION)
        if stash is not None and self._stashable(m, cache):
            attn_output, attn_weights = stash.run(
                lambda: self._core(m, hidden_states, position_embeddings, attention_mask, cache, kwargs, stash),
                self._stash_bytes(m, hidden_states), m, core_input=hidden_states)
        else:
            attn_output, attn_weights = self._core(m, hidden_states, position_embeddings, attention_mask, cache, kwargs)
        return output_dropout(m, self.project_o(m, attn_output), self.output_dropout_attr), attn_weights

    def _stash_bytes(self, m: nn.Module, hidden_states: torch.Tensor) -> int:
        """What a stashed core copies (the link budget charges it): q (with its gate) and the attention output,
        heads·head_dim wide each, k and v, kv heads·head_dim each (with q/k norms: the norms' inputs; backward
        remakes the normed q/k from them); not the projections' input (the recompute makes it). Three hidden widths
        where the module does not say its heads."""
        config, tokens = m.config, hidden_states.numel() // hidden_states.shape[-1]
        heads, head_dim = getattr(config, "num_attention_heads", None), getattr(m, "head_dim", None)
        if isinstance(heads, int) and isinstance(head_dim, int):
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            width = (3 if self.output_gate else 2) * heads * head_dim + 2 * kv_heads * head_dim
        else:
            width = 3 * hidden_states.shape[-1]
        return tokens * width * hidden_states.element_size()

    def _stashable(self, m: nn.Module, cache) -> bool:
        """May this call's core go to the attention stash (attention_stash.py says why not otherwise)?"""
        return (cache is None and m.config._attn_implementation not in (None, "eager")
                and not (m.training and m.attention_dropout) and not self.dropout_inside.draws(m))

    def _core(self, m, hidden_states, position_embeddings, attention_mask, cache, kwargs, stash=None):
        """Projections, q/k norms, RoPE, cache update and attention: (output [..., heads*head_dim], weights).
        ``stash``: the ``LayerStash`` of a core that may be stashed (its chain's ``SharedMaskBias``: one
        additive bias per forward, not per layer; it remakes the normed q/k in backward: ``attention_qk.py``)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, m.head_dim)

        q, k, v = self.project_qkv(m, hidden_states)
        gate = None
        if self.output_gate:  # as stock: per head, the first head_dim columns are q, the next its gate
            q, gate = q.view(*input_shape, -1, 2 * m.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
        norms = (getattr(m, self.q_norm, None), getattr(m, self.k_norm, None))
        rope = (lambda q, k: self._rope(q, k, *position_embeddings)) if self._rotates(m) else None
        q, k = attention_qk(q, k, hidden_shape, self.qk_norm, norms, rope, stash)
        v = v.reshape(hidden_shape).transpose(1, 2)  # a view, as stock's

        if cache is not None:
            if self.cache_kwargs:
                k, v = cache.update(k, v, m.layer_idx, kwargs=kwargs)
            else:
                k, v = cache.update(k, v, m.layer_idx)

        interface = self._interface(m, q, attention_mask)
        if stash is not None and "position_bias" not in kwargs and shareable(
                attention_mask, m.config._attn_implementation, q):
            attention_mask = stash.chain.mask_bias.get(attention_mask, sdpa_dtype(q))
        attn_output, attn_weights = interface(
            m, q, k, v, attention_mask,
            dropout=m.attention_dropout if m.training else 0.0,
            scaling=m.scaling,
            **self._extra_kwargs(m),
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        if gate is not None:
            attn_output = attn_output * torch.sigmoid(gate)
        return attn_output, attn_weights

    def _interface(self, m, q, attention_mask) -> Callable:
        """The attention function of this call: ``sink_flex_attention`` for a family with sinks on the
        flex path (counted as ``flex_sinks``), else the one transformers selects."""
        implementation = m.config._attn_implementation
        if self.flex_sinks:
            why = _why_not_sink_flex(implementation, q, attention_mask)
            self.calls[OP_SINKS, why or FUSED] += 1
            if why is None:
                return sink_flex_attention
        return attention_interface(self.functions, implementation, self.eager)


def output_dropout(module: nn.Module, out: torch.Tensor, attr: str | None) -> torch.Tensor:
    """The stock ``nn.functional.dropout(out, p=module.<attr>, training=module.training)`` on an attention or MLP
    output (``FamilySpec.output_dropout_attr``, Seed-OSS's ``residual_dropout``): the same call, so the same
    random numbers in the same order. ``out`` itself where ``attr`` is None, in eval mode or with p == 0 (as
    torch's dropout, which then draws nothing)."""
    if attr is None or not module.training:
        return out
    p = getattr(module, attr)
    if not p:
        return out
    return nn.functional.dropout(out, p=p, training=True)


def _kwarg_source(source: str) -> tuple[str, str, str | None]:
    """("module" or "config", attribute, flag or None) of a ``FamilySpec.attention_kwargs`` source."""
    where, attr = source.split(":", 1)
    attr, _, flag = attr.partition("?")
    return where, attr, flag or None


def attention_kwarg(module: nn.Module, source: str):
    """The value a ``FamilySpec.attention_kwargs`` source names for this attention module: "module:<attr>",
    "config:<attr>", or "module:<attr>?<flag>" (the attribute where ``module.<flag>`` is true, else None)."""
    where, attr, flag = _kwarg_source(source)
    if flag is not None and not getattr(module, flag):
        return None
    return getattr(module if where == "module" else module.config, attr, None)


def _why_not_sink_flex(implementation, q, attention_mask) -> str | None:
    if implementation != FLEX:
        return f"attn_implementation is {implementation!r}"
    if not q.is_cuda:
        return "not on CUDA"
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        return f"the mask is a {type(attention_mask).__name__}, not a flex BlockMask"
    return None


def _device_type(base: nn.Module) -> str | None:
    param = next(iter(base.parameters()), None)
    return None if param is None else param.device.type


def use_flex_for_sinks(base: nn.Module, spec: FamilySpec, config: FastConfig, report: PatchReport) -> bool:
    """For a family with attention sinks: switch a model that runs eager attention to flex attention
    (``sink_attention.py`` says why), undone by ``report.undo()``. Returns whether the model now runs
    flex attention, whose sink layers then go through ``sink_flex_attention``.

    A model on the CPU of a machine without CUDA stays eager without a fallback line (flex attention
    cannot train there, and nothing is left to act on); on a CUDA machine the line says to move it."""
    if not config.flex_sinks or not any(name == "s_aux" for name, _ in spec.attention_kwargs):
        return False
    current = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if current == FLEX:
        return True
    device = _device_type(base)
    if current not in (None, "eager"):
        why = f"attn_implementation is {current!r} (kept)"
    elif device != "cuda":
        if not torch.cuda.is_available():
            return False
        why = f"the model is on {device}: move it to CUDA before patching for flex attention"
    elif getattr(base.config, "attention_dropout", 0.0):  # a model loaded in eval mode trains later
        why = f"attention_dropout={base.config.attention_dropout} (flex attention has none)"
    elif not callable(getattr(base, "set_attn_implementation", None)):
        why = "this transformers version has no set_attn_implementation"
    else:
        why = flex_sinks_unavailable()
    if why is None:
        try:
            base.set_attn_implementation(FLEX)
        except (ValueError, ImportError) as err:
            why = f"set_attn_implementation('flex_attention') refused: {err}"
    if why is not None:
        report.fallback(OP_SINKS, spec.model_type, why)
        return False
    report.on_undo(_RestoreAttention(base, current or "eager"))
    return True


class _RestoreAttention:
    """Sets the attention implementation back. An object, not a closure, so that ``copy.deepcopy``
    of a patched model (TRL's reference model) restores the copy, not the original."""

    def __init__(self, base: nn.Module, implementation: str):
        self.base, self.implementation = base, implementation

    def __call__(self) -> None:
        self.base.set_attn_implementation(self.implementation)


def _rope_fits(q, k, cos, sin) -> bool:
    """The kernel's domain: float16/bfloat16/float32 heads, rotary width even and ≤ head_dim, and one
    cos/sin row per token ([B or 1, S, Dr]; a 3-D RoPE table not yet folded into one, [3, B, S, Dr], is not)."""
    dr = cos.shape[-1]
    per_token = cos.dim() == 3 and cos.shape[0] in (1, q.shape[0]) and cos.shape[1] == q.shape[2]
    return (q.dtype in KERNEL_DTYPES and k.dtype == q.dtype and cos.dtype in KERNEL_DTYPES and per_token
            and sin.dtype == cos.dtype and sin.shape == cos.shape and dr % 2 == 0 and 0 < dr <= q.shape[-1]
            and q.numel() > 0)


def float_dtype(module: nn.Module) -> torch.dtype | None:
    """dtype of the module's first floating-point parameter (packed 4-bit weights are skipped)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def check_attention(module: nn.Module, spec: FamilySpec, use_rope_kernel: bool = True) -> str | None:
    """Why ``module`` cannot take the replacement forward, or None when it can."""
    try:
        params = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return "forward has no inspectable signature"
    missing = [p for p in ("hidden_states", "position_embeddings", "attention_mask") if p not in params]
    if missing:
        return f"forward takes no {', '.join(missing)} in this transformers version"
    if "cache" not in params and "past_key_values" not in params:
        return "forward takes neither `cache` nor `past_key_values` in this transformers version"
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "forward takes no **kwargs in this transformers version"
    if "cache_position" in params:
        return "forward takes an explicit `cache_position` (a cache API this forward does not reproduce)"
    for attr in _COMMON_ATTRS + _LAYOUT_SUBMODULES[spec.qkv_layout]:
        if not hasattr(module, attr):
            return f"no `{attr}` attribute in this transformers version"
    if not isinstance(module.head_dim, int) or not isinstance(module.scaling, numbers.Real):
        return "head_dim/scaling are not numbers"
    if not hasattr(module.config, "_attn_implementation"):
        return "config has no `_attn_implementation`"
    if spec.qkv_layout == "fused" and not (hasattr(module, "num_key_value_heads")
                                           and hasattr(module.config, "num_attention_heads")):
        return "fused qkv_proj without num_key_value_heads / config.num_attention_heads"
    if getattr(getattr(module, "config", None), "clip_qkv", None) is not None:
        return "config.clip_qkv clamps q/k/v (OLMoE), which this forward does not model"
    q_norm, k_norm = spec.qk_norm_attrs
    if spec.qk_norm == "head_optional" and hasattr(module, q_norm) != hasattr(module, k_norm):
        return f"{q_norm} without {k_norm} (or the reverse)"
    if spec.qk_norm in ("head", "head_after_rope", "full") and not (hasattr(module, q_norm)
                                                                    and hasattr(module, k_norm)):
        return f"the family row expects {q_norm}/{k_norm} ({spec.qk_norm}) and the module has none"
    if spec.rope_flag is not None and not hasattr(module, spec.rope_flag):
        return f"no `{spec.rope_flag}` attribute (whether this layer applies RoPE)"
    if spec.rope_flag_when is not None and not hasattr(module, spec.rope_flag_when):
        return f"no `{spec.rope_flag_when}` attribute (whether `{spec.rope_flag}` decides RoPE)"
    if spec.output_dropout_attr is not None and not hasattr(module, spec.output_dropout_attr):
        return f"no `{spec.output_dropout_attr}` attribute (the dropout probability of the output)"
    for name, source in spec.attention_kwargs:
        where, attr, flag = _kwarg_source(source)
        for needed in (attr, flag) if where == "module" else (flag,):
            if needed is not None and not hasattr(module, needed):
                return f"no `{needed}` attribute (passed to the attention function as `{name}`)"
    dtype = float_dtype(module)
    if use_rope_kernel and dtype is not None and dtype not in KERNEL_DTYPES:
        return f"parameters are {str(dtype).replace('torch.', '')}; the kernels take float32/float16/bfloat16"
    return None


def _family_functions(spec: FamilySpec):
    """(eager_attention_forward, apply_rotary_pos_emb, ALL_ATTENTION_FUNCTIONS) of the family."""
    try:
        mod = importlib.import_module(spec.modeling_module)
    except ImportError:
        return None, None, None
    functions = getattr(mod, "ALL_ATTENTION_FUNCTIONS", None)
    if functions is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as functions
    return getattr(mod, "eager_attention_forward", None), getattr(mod, "apply_rotary_pos_emb", None), functions


def patch_attention(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig,
                    report: PatchReport) -> None:
    """Install ``FastAttentionForward`` on every attention module of the family's class.

    Installed when ``config.rope`` (the RoPE kernel) or ``config.lora`` (the fused-LoRA hooks)
    is on; reported as "rope" per module with the kernel, "attention_hook" without it.
    """
    if not (config.rope or config.lora):
        return
    # Interleaved rotary pairs (GLM-4, ERNIE 4.5) are not the kernel's layout: the family's own rotation
    # runs inside the installed forward, which still carries the fused-LoRA hooks.
    rope_kernel = config.rope and spec.rope_layout == "halves"
    if config.rope and not rope_kernel:
        report.fallback(OP_ROPE, spec.model_type, f"{spec.rope_layout} rotary layout: the family's own "
                        "apply_rotary_pos_emb rotates q/k")
        if not config.lora:
            return
    op = OP_ROPE if rope_kernel else OP_HOOK
    attn_cls = family_class(spec, classes, "attention_class", op, report)
    if attn_cls is None:
        return
    eager, stock_rope, functions = _family_functions(spec)
    if eager is None or (stock_rope is None and not rope_kernel):
        report.fallback(op, spec.model_type, f"{spec.modeling_module} has no eager_attention_forward / "
                        "apply_rotary_pos_emb in this transformers version")
        return
    flex_sinks = use_flex_for_sinks(base, spec, config, report)
    layer_cls = classes.get("decoder_layer_class")
    for name, module in base.named_modules():
        if layer_cls is not None and type(module) is layer_cls:
            child = getattr(module, ATTENTION_ATTR, None)
            if child is not None and type(child) is not attn_cls:
                report.fallback(op, f"{name}.{ATTENTION_ATTR}",
                                f"is {type(child).__name__}, not {spec.attention_class}")
            elif child is None:  # Qwen3.5's linear-attention layers: another token mixer, stock
                mixers = [type(c).__name__ for n, c in module.named_children() if "attn" in n]
                report.fallback(op, name, f"no {ATTENTION_ATTR}; its token mixer {', '.join(mixers) or '(none)'} "
                                "runs stock")
        if type(module) is not attn_cls:
            continue
        reason = check_attention(module, spec, use_rope_kernel=rope_kernel)
        if reason is not None:
            report.fallback(op, name, reason)
            continue
        stock = stock_forward(module)
        cache_kwargs = "cache" in inspect.signature(type(module).forward).parameters
        fwd = FastAttentionForward(module, stock, spec, eager=eager, stock_rope=stock_rope, functions=functions,
                                   cache_kwargs=cache_kwargs, use_rope_kernel=rope_kernel, flex_sinks=flex_sinks)
        swap_forward(module, fwd, report)
        report.add(op, counted=rope_kernel)  # the LoRA hook points alone run no kernel of their own
        if flex_sinks:
            report.add(OP_SINKS, counted=True)


def attention_forward(module: nn.Module) -> FastAttentionForward | None:
    """The installed ``FastAttentionForward`` of an attention module, if any (for the LoRA patcher)."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, FastAttentionForward) else None


__all__ = ["FastAttentionForward", "attention_forward", "attention_interface", "attention_kwarg", "check_attention",
           "float_dtype", "output_dropout", "patch_attention", "use_flex_for_sinks", "project_o", "project_qkv_fused",
           "project_qkv_separate"]
