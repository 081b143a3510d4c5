"""Mixture-of-experts layers: the routed experts on ``kernels.grouped_mlp``, PEFT LoRA on the experts fused in.

transformers 5 keeps each MoE layer's experts as stacked 3-D parameters (``gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I]; gpt-oss [E, H, 2I] / [E, I, H] with biases) in one
experts module, called by its block as ``experts(hidden_states, top_k_index, top_k_weights)``
after the block's router. Only that call is replaced: the router stays stock (its softmax/top-k,
``norm_topk_prob``, gpt-oss's own router, and the hooks that record ``router_logits`` for the
auxiliary loss run as they do), and its weights reach ``grouped_mlp`` as a differentiable input,
so the router trains as stock (``moe_aux.py`` adds the auxiliary loss under the fused head).

``FastExpertsForward`` is installed on the block's ``experts`` child as it is at patch time: the
experts module itself, or the outermost PEFT ``ParamWrapper`` when LoRA targets the experts'
parameters (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])``; each targeted parameter adds one wrapper). At each call it reads the
wrappers' current state: one active adapter → its A/B go into the grouped products (PEFT would
add ``s·B A`` to every expert's weight for the call: E·(2I·H + H·I) values per layer); disabled or
merged adapters → the base weights alone; several active adapters, a disabled *merged* adapter
(PEFT unmerges it), hooks on an inner wrapper, quantised or partitioned weights, other arguments
→ the forward it replaced (stock, or PEFT's). Decode steps take the stock path too, unless the
experts are held in NF4 (``moe_nf4.py``, QLoRA): then the grouped path serves them as well, on
the experts the step's tokens hit (dequantised alone), and a call that does go stock gets the
dequantised weights as dense parameters for that call.

With ``FastConfig.lora_widen`` the LoRA-wrapped expert weights are re-homed at the first fused
call into buffers bordered by A and s·B (``moe_widen.py``), so the rank-r terms ride in the grouped
products, forward and backward (``kernels/moe_wide.py``).

Under checkpointing the experts' output only enters the residual sum, so a recompute runs their
gate/up product alone (what their backward needs: ``grouped_mlp(..., output_unused=True)``); with
``FastConfig.experts_stash`` an offloaded layer's experts keep what they save in host memory and the
recompute never reaches them (``attention_stash.py``).

What the row and the module must agree on is checked at patch time (``check_experts``): the
parameter shapes and layout, the biases, and the activation — probed on the module itself
(``_apply_gate`` where transformers has it, else ``act_fn``), so a module that computes something
else than the row says stays stock instead of silently changing numbers.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ..config import FastConfig
from ..kernels.grouped_mlp import ExpertGLU, ExpertProjection, grouped_mlp
from ..kernels.moe_reference import moe_glu as reference_glu
from ..kernels.nf4_weight import NF4Weight
from . import attention_stash
from .layer_call import recomputing
from .families import ACTIVATIONS, FamilySpec
from .instance import DECODE_STEP, PatchedForward, stock_forward, stock_is_faster, swap_forward
from .mlp import config_activation, probe_activation
from .moe_nf4 import OP as OP_NF4
from .moe_nf4 import dense_experts, hit_experts, holds_nf4, nf4_settings, quantize_experts
from .moe_widen import UnwidenExperts, wide_experts
from .report import FUSED, PatchReport

OP = "moe"
OP_LORA = "lora_moe"  # a call that ran with LoRA adapters fused into the grouped products
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EXPERTS_ATTR = "experts"  # the block's experts child, in every MoE family of the table
_ARG_NAMES = (("hidden_states",), ("top_k_index", "router_indices"), ("top_k_weights", "routing_weights"))


def is_param_wrapper(module: nn.Module) -> bool:
    """A PEFT ``ParamWrapper`` (LoRA on a parameter), by duck typing."""
    return (hasattr(module, "parameter_name") and hasattr(module, "lora_A") and hasattr(module, "lora_B")
            and isinstance(getattr(module, "base_layer", None), nn.Module))


def unwrap(module: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """(the ParamWrappers from outermost in, the module they wrap)."""
    wrappers = []
    while is_param_wrapper(module):
        wrappers.append(module)
        module = module.base_layer
    return wrappers, module


def _resolve(spec: FamilySpec, name: str | None) -> type | None:
    if name is None:
        return None
    try:
        return getattr(importlib.import_module(spec.modeling_module), name, None)
    except ImportError:
        return None


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


# --------------------------------------------------------------------------------------------
# what the module is (patch time)
# --------------------------------------------------------------------------------------------


def _glu(experts: nn.Module, spec: FamilySpec, base_config) -> ExpertGLU | str:
    if spec.experts_glu == "clamped_swiglu":
        alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
        if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)):
            return "no numeric `alpha`/`limit` (gpt-oss swiglu) on the experts"
        return ExpertGLU("clamped_swiglu", float(alpha), float(limit))
    activation = config_activation(getattr(experts, "config", None) or base_config, spec)
    kind = ACTIVATIONS.get(activation)
    if kind is None:
        return f"activation {activation!r} has no kernel; supported: {', '.join(sorted(ACTIVATIONS))}"
    act_fn = getattr(experts, "act_fn", None)
    if not callable(act_fn) or not probe_activation(act_fn, kind):
        return f"the experts' act_fn does not compute {activation!r} (config and module disagree)"
    return ExpertGLU(kind)


def _probe_gate(experts: nn.Module, glu: ExpertGLU) -> bool:
    """The module's own ``_apply_gate`` (transformers ≥ 5.2x) computes ``glu`` on a probe; True
    where the module has none (the layout then comes from the row)."""
    apply_gate = getattr(experts, "_apply_gate", None)
    if not callable(apply_gate):
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g) * 6.0
    try:
        with torch.no_grad():
            got = apply_gate(x)
    except Exception:  # noqa: BLE001 - any failure means "not the function we know"
        return False
    want = reference_glu(x, None, glu)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got.float(), want,
                                                                                       rtol=1e-5, atol=1e-6)


def check_experts(experts: nn.Module, spec: FamilySpec, base_config) -> ExpertGLU | str:
    """The activation the fused path computes for this experts module, or why it cannot take it."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no 3-D `gate_up_proj`/`down_proj` tensors in this transformers version"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not stacked [E, ., .]"
    if gate_up.dtype not in KERNEL_DTYPES or down.dtype not in KERNEL_DTYPES:
        return f"expert weights are {gate_up.dtype} (quantised?); the fused path takes float32/float16/bfloat16"
    transposed = getattr(experts, "is_transposed", spec.experts_transposed)
    if bool(transposed) != spec.experts_transposed:
        return f"experts.is_transposed={transposed} but the family row says {spec.experts_transposed}"
    hidden = getattr(base_config, "hidden_size", None)
    gu_in, gu_out = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    d_in, d_out = (down.shape[1], down.shape[2]) if transposed else (down.shape[2], down.shape[1])
    if gu_in != hidden or d_out != hidden or gu_out != 2 * d_in:
        return f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} do not fit hidden {hidden}"
    has_bias = isinstance(getattr(experts, "gate_up_proj_bias", None), torch.Tensor)
    if has_bias != spec.experts_bias or has_bias != isinstance(getattr(experts, "down_proj_bias", None), torch.Tensor):
        return f"expert biases present={has_bias}, the family row says {spec.experts_bias}"
    if getattr(experts, "has_gate", True) is not True or getattr(experts, "has_post_expert_norm", False):
        return "experts without a gate or with a post-expert norm"
    glu = _glu(experts, spec, base_config)
    if isinstance(glu, str):
        return glu
    if not _probe_gate(experts, glu):
        return f"the experts' _apply_gate does not compute {glu.kind} with the layout the row says"
    return glu


# --------------------------------------------------------------------------------------------
# the forward (call time)
# --------------------------------------------------------------------------------------------


def _adapter(wrapper: nn.Module):
    """(lora_a [E, r, in], lora_b [E, out, r], scaling) of the one active adapter, None for no
    adapter in effect (disabled or merged into the weight), or a reason string."""
    merged = bool(getattr(wrapper, "merged_adapters", None))
    if getattr(wrapper, "disable_adapters", False):
        return "adapter disabled while merged (PEFT unmerges it on this call)" if merged else None
    if merged:
        return None
    active = getattr(wrapper, "active_adapters", None) or []
    active = [a for a in ([active] if isinstance(active, str) else active) if a in wrapper.lora_A]
    if not active:
        return None
    if len(active) > 1:
        return "several active adapters on the experts"
    name = active[0]
    a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    E = getattr(wrapper, "num_experts", None)
    if not isinstance(E, int) or a.shape[0] % E or b.shape[1] != a.shape[0]:
        return "LoRA shapes on the experts are not [r·E, in] / [out, r·E]"
    r = a.shape[0] // E
    lora_a = a.view(E, r, a.shape[1])
    lora_b = b.view(b.shape[0], r, E).permute(2, 0, 1)  # PEFT's column order: rank-major, expert-minor
    return lora_a, lora_b, float(wrapper.scaling[name])


def _largest_rank(wrapper: nn.Module) -> int:
    """The largest rank of the wrapper's adapters, active or not (0 for none)."""
    E = getattr(wrapper, "num_experts", None)
    if not isinstance(E, int) or E < 1:
        return 0
    return max((a.weight.shape[0] // E for a in wrapper.lora_A.values()), default=0)


class FastExpertsForward(PatchedForward):
    """Replacement ``forward`` of a MoE block's ``experts`` child (module docstring)."""

    op = OP

    def __init__(self, module: nn.Module, stock, experts: nn.Module, glu: ExpertGLU, spec: FamilySpec,
                 widen: bool = False):
        super().__init__(module, stock)
        self.widen = widen  # re-home LoRA-wrapped expert weights bordered by A and s·B (moe_widen.py)
        self.experts = experts
        self.glu = glu
        self.transposed = spec.experts_transposed
        self.bias = spec.experts_bias
        # The experts' output only enters a sum (every MoE row so far): a checkpoint recompute, whose
        # output is thrown away, skips the GLU, the down projection and the sum.
        self.skip_unused = not spec.experts_output_saved

    def projections(self):
        """(gate_up, down) ``ExpertProjection``s for this call, or why the call stays stock."""
        wrappers, experts = unwrap(self.module)
        if experts is not self.experts:
            return "the experts module was replaced since patching"
        if any(_hooked(m) for m in wrappers[1:] + ([experts] if wrappers else [])):
            return "forward hooks on a wrapped experts module (the fused path would skip them)"
        adapters, ranks = {}, {}
        for wrapper in wrappers:
            found = _adapter(wrapper)
            if isinstance(found, str):
                return found
            if found is not None:
                adapters[wrapper.parameter_name] = found
            ranks[wrapper.parameter_name] = _largest_rank(wrapper)
        out = []
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            if not isinstance(weight, NF4Weight) and (weight.numel() == 0 or weight.dtype not in KERNEL_DTYPES):
                return f"{name} is partitioned or quantised ({weight.dtype}, {weight.numel()} values here)"
            lora = adapters.pop(name, (None, None, 1.0))
            bias = getattr(experts, f"{name}_bias") if self.bias else None
            # Widened for the largest adapter on it, whether active now or not: a pass with the adapters
            # off (DPO's reference) runs the same widened product with a zero border, bit for bit a fresh
            # adapter's (B = 0) output.
            wide = (wide_experts(experts, name, ranks[name], self.transposed)
                    if self.widen and ranks.get(name) and not isinstance(weight, NF4Weight) else None)
            out.append(ExpertProjection(weight, bias, *lora, transposed=self.transposed, wide=wide))
        if adapters:
            return f"LoRA on other expert parameters ({', '.join(adapters)})"
        for p in out:
            if p.lora_a is not None and (p.lora_a.shape[2] != p.in_features or p.lora_b.shape[1] != p.out_features):
                return "LoRA shapes on the experts do not match the expert weights"
        return tuple(out)

    def __call__(self, *args, **kwargs):
        call = _arguments(args, kwargs)
        nf4 = holds_nf4(self.experts)
        # With NF4 experts a stock call must dequantise the whole stack anyway: the grouped path
        # (which dequantises the same) serves decode steps too.
        if call is None or (stock_is_faster(call[0]) and not nf4):
            return self._stock(nf4, "other arguments than (hidden_states, top_k_index, top_k_weights)"
                               if call is None else DECODE_STEP, args, kwargs)
        x, index, weights = call
        specs = self.projections()
        if isinstance(specs, str) or x.dtype not in KERNEL_DTYPES or x.dim() != 2 or index.dim() != 2:
            return self._stock(nf4, specs if isinstance(specs, str) else
                               "inputs outside the kernel's domain (dtype or shape)", args, kwargs)
        self.count()
        if any(p.lora_a is not None for p in specs):
            self.calls[OP_LORA, FUSED] += 1
        if nf4:
            self.calls[OP_NF4, FUSED] += 1
            hit = hit_experts(index, specs) if stock_is_faster(x) else None  # a decode step: its experts only
            if hit is not None:
                index, specs = hit

        def core():
            return grouped_mlp(x, index, weights, specs[0], specs[1], self.glu,
                               output_unused=self.skip_unused and recomputing()), None

        stash = attention_stash.current(attention_stash.EXPERTS)
        if stash is None or not torch.is_grad_enabled():
            return core()[0]
        # What the grouped Function saves: its gate/up product [T·k, 2I] and its input.
        core_bytes = (x.shape[0] * index.shape[1] * specs[0].out_features + x.numel()) * x.element_size()
        return stash.run(core, core_bytes, self.module, attention_stash.EXPERTS, saved_all=True,
                         output_unused=self.skip_unused)[0]

    def _stock(self, nf4: bool, reason: str, args, kwargs):
        """The replaced forward, counted with ``reason``; NF4 experts dense for this call only."""
        self.count(reason)
        if not nf4:
            return self.stock(*args, **kwargs)
        self.calls[OP_NF4, f"dequantised for a stock call: {reason}"] += 1
        with dense_experts(self.experts):
            return self.stock(*args, **kwargs)


def _arguments(args, kwargs):
    """(hidden_states, top_k_index, top_k_weights) from the stock call, or None."""
    values = list(args)
    for names in _ARG_NAMES[len(values):]:
        found = [kwargs[n] for n in names if n in kwargs]
        if len(found) != 1:
            return None
        values.append(found[0])
    used = sum(1 for names in _ARG_NAMES for n in names if n in kwargs)
    if len(values) != 3 or used != len(kwargs) or not all(isinstance(v, torch.Tensor) for v in values):
        return None
    return tuple(values)


# --------------------------------------------------------------------------------------------
# the patcher
# --------------------------------------------------------------------------------------------


def patch_moe(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig, report: PatchReport) -> None:
    """Install ``FastExpertsForward`` on the experts child of every MoE block of the family.

    Reported as "moe" per block (and "lora_moe" where PEFT LoRA wraps the experts, "moe_nf4" where
    the frozen experts were quantised to NF4: ``moe_nf4.py``), or a fallback naming the block and
    the reason.
    """
    if not config.moe or spec.moe_block_class is None:
        return
    block_cls, experts_cls = _resolve(spec, spec.moe_block_class), _resolve(spec, spec.experts_class)
    if block_cls is None or experts_cls is None:
        report.fallback(OP, spec.model_type, f"{spec.moe_block_class} / {spec.experts_class} not found in "
                        f"{spec.modeling_module}")
        return
    nf4 = nf4_settings(base, config)
    if config.lora_widen:
        report.on_undo(UnwidenExperts(base))  # runs after the forwards are restored (undo is last-in, first-out)
    if isinstance(nf4, str):
        report.fallback(OP_NF4, "experts", nf4)
    for name, block in base.named_modules():
        if type(block) is not block_cls:
            continue
        outer = getattr(block, EXPERTS_ATTR, None)
        if not isinstance(outer, nn.Module):
            report.fallback(OP, name, f"no `{EXPERTS_ATTR}` child")
            continue
        _, experts = unwrap(outer)
        if type(experts) is not experts_cls:
            report.fallback(OP, name, f"experts are {type(experts).__name__}, not {spec.experts_class}")
            continue
        glu = check_experts(experts, spec, base.config)
        if isinstance(glu, str):
            report.fallback(OP, f"{name}.{EXPERTS_ATTR}", glu)
            continue
        widen = config.lora_widen and outer is not experts
        swap_forward(outer, FastExpertsForward(outer, stock_forward(outer), experts, glu, spec, widen), report)
        report.add(OP, counted=True)
        if outer is not experts:  # PEFT LoRA on expert parameters: fused at each call where it qualifies
            report.add(OP_LORA, counted=True)
        if isinstance(nf4, tuple):
            undo = quantize_experts(experts, *nf4)
            if isinstance(undo, str):
                report.fallback(OP_NF4, f"{name}.{EXPERTS_ATTR}", undo)
            else:
                report.on_undo(undo)
                report.add(OP_NF4, counted=True)


def experts_forward(module: nn.Module) -> FastExpertsForward | None:
    """The installed ``FastExpertsForward`` of a block's experts child, if any."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, FastExpertsForward) else None


__all__ = ["FastExpertsForward", "check_experts", "experts_forward", "is_param_wrapper", "patch_moe", "unwrap"]
