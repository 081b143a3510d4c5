"""Fused LoRA on the installed attention and MLP forwards: QKV, O and the gated MLP.

For every decoder layer whose attention / MLP carries an installed ``FastAttentionForward`` /
``FastMLPForward`` (attention.py, mlp.py), the hooks of that forward are set to objects that run
fasttune's fused Functions (kernels/lora.py, kernels/lora_glu.py) on the projections' PEFT
LoRA parameters and frozen dense or bitsandbytes-NF4 base weights:

    project_qkv  ``lora_qkv(x, q, k, v)``; Phi-3's fused ``qkv_proj``: ``lora_linear`` then the
                 stock [q | k | v] split
    project_o    ``lora_linear(attn_output, o)``
    fused_mlp    ``lora_mlp(x, gate, up, down, activation)``; Phi-3's ``gate_up_proj``:
                 ``lora_linear`` → SwiGLU/GeGLU kernel → ``lora_linear(down)``

Reported per module as "lora_qkv", "lora_o", "lora_mlp"; a fused call over FP8 bases
(``base_dtype="fp8"``, ``lora_fp8.py``) also counts one "fp8_<projection>" call per such
projection. A module whose projections the fused path would not compute exactly (``lora_spec`` says
why: dropout, DoRA, several active adapters, a LoRA or trainable bias, 8-bit/FP4 bases, ...; or no
adapter on any of its projections; or forward hooks on a projection, which the fused path would
skip: accelerate offloading, PEFT's mixed-adapter batches) keeps PEFT's path and is listed in
``report.fallbacks``. DeepSpeed ZeRO-3's own hooks are the exception: a call is fused when the
projections' partitioned parameters are gathered for the attention / MLP module itself (registered
as its external parameters, ``hf_integration.distributed.register_zero3_fused_lora``), else it
takes PEFT's path. A model without any PEFT LoRA layer (full fine-tuning) is left alone and reports
nothing.

Eligibility is decided at patch time for the report and checked again at every call, because
the adapter state changes under a patched model (``set_adapter``, ``merge_adapter``,
``disable_adapter()`` for DPO's reference pass): a call that does not qualify runs the default
path of that forward (the module's own projections), which is exactly PEFT's. The one exception is
a checkpoint recompute, which takes the decision of the forward it recomputes
(``layer_call.layer_memo``; not with ZeRO-3 parameters). A call also
falls back when the stock layers would not compute in the activations' dtype: outside
``torch.autocast``, each dense weight, or the compute dtype bitsandbytes' ``Linear4bit`` would
use, must be x's dtype, and adapters must be x's dtype or float32. float32 adapters under bf16
activations are then used in bf16, as under autocast (PEFT upcasts x to float32 for the rank-r
term in that case: the two differ by bf16 rounding of the rank-r term only). NF4 calls without
autograd (generation, evaluation) also take the default path: bitsandbytes' inference kernels
read the packed weights directly, which beats dequantising them for the few rows of a decode step.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..config import FastConfig
from ..kernels.fp8 import product_path
from ..kernels.lora import lora_linear, lora_qkv
from ..kernels.lora_glu import lora_mlp
from .attention import attention_forward
from .layer_call import layer_memo, recomputing
from .families import ACTIVATIONS, FamilySpec
from .fp8_base import fp8_op
from .instance import autograd_on, stock_is_faster
from .lora_specs import lora_spec
from .lora_widen import Unwiden, widen_group
from .mlp import check_mlp, config_activation, mlp_forward
from .output_stash import projection_output
from .module_attr import base_layer_of, module_attr
from .report import FUSED, PatchReport
from .zero3 import is_zero3_param, only_zero3_hooks

OP_QKV, OP_O, OP_MLP = "lora_qkv", "lora_o", "lora_mlp"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QKV_NAMES = {"separate": ("q_proj", "k_proj", "v_proj"), "fused": ("qkv_proj",)}
MLP_NAMES = {"separate": ("gate_proj", "up_proj", "down_proj"), "fused": ("gate_up_proj", "down_proj")}


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (``lora_A``, ``lora_B`` and a ``base_layer``), by duck typing."""
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "base_layer")


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def stock_compute_dtype(proj: nn.Module, spec, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype the projection's own forward multiplies x (of ``x_dtype``) in, outside autocast.

    Dense: the weight's. bitsandbytes ``Linear4bit`` casts x to ``compute_dtype``, which its
    first forward resets to the input's dtype when that is float32 or bfloat16.
    """
    if spec[0].is_fp8:  # the FP8 layer's own forward computes in x's dtype (fp8_base.py)
        return x_dtype
    if not spec[0].is_nf4:
        return spec[0].weight.dtype
    layer = base_layer_of(proj)
    declared = getattr(layer, "compute_dtype", None)
    if not getattr(layer, "compute_type_is_set", True) and x_dtype in (torch.float32, torch.bfloat16):
        return x_dtype
    return declared or x_dtype


def projection_specs(module: nn.Module, names: tuple[str, ...], at_call: bool = False, ignore_disabled: bool = False):
    """The ``(base, A, B, scaling)`` spec of each named projection of ``module``, or why not.

    Checks what does not depend on the input: ``lora_spec``, forward hooks, CPU-repacked NF4
    weights, and that at least one projection has an active adapter. ``at_call``: inside
    ``module``'s forward, where DeepSpeed ZeRO-3 parameters must be gathered for ``module``
    (``zero3.py``); DeepSpeed's own hooks on the projections are then skipped with their forward.
    ``ignore_disabled``: as if the adapters were not disabled (``lora_spec``).
    """
    specs, disabled_wide = [], False
    for name in names:
        proj = module_attr(module, name)
        if not isinstance(proj, nn.Module):
            return f"no `{name}` submodule"
        spec = lora_spec(proj, zero3_owner=module if at_call else None, ignore_disabled=ignore_disabled)
        if isinstance(spec, str):
            return f"{name}: {spec}"
        base = base_layer_of(proj)
        zero3 = is_zero3_param(module_attr(base, "weight"))
        if any(_hooked(m) and not (zero3 and only_zero3_hooks(m)) for m in (proj, base)):
            return f"{name}: forward hooks on the projection (the fused path would skip them)"
        if spec[0].is_nf4 and getattr(spec[0].quant_state, "packing_format_for_cpu", False):
            return f"{name}: NF4 weight repacked by bitsandbytes' CPU inference path"
        specs.append(spec)
        # A LoRA layer over a widened base runs its disabled-adapter calls widened too (lora_spec).
        disabled_wide |= spec[0].wide is not None and is_lora_layer(proj)
    if all(spec[1] is None for spec in specs) and not disabled_wide:
        return f"no active LoRA adapter on {', '.join(names)}"
    return specs


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a projection of x multiplies in: the autocast dtype of x's device, else x's."""
    dev = x.device.type
    autocast = dev in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(dev)
    return torch.get_autocast_dtype(dev) if autocast else x.dtype


def call_specs(module: nn.Module, names: tuple[str, ...], x: torch.Tensor):
    """``projection_specs`` plus the checks against this call's input x (dtype, device)."""
    if stock_is_faster(x):  # first: a decode step should not pay for the checks below (~90 µs)
        return "a decode step (few rows, no autograd): the stock layers launch fewer kernels"
    specs = projection_specs(module, names, at_call=True)
    if isinstance(specs, str):
        return specs
    if x.dtype not in KERNEL_DTYPES:
        return f"input is {x.dtype}"
    # A bordered NF4 group (lora_widen.py) stays fused without autograd: DPO's reference pass and the
    # policy's then compute the same products, so a fresh adapter's log-ratios start at exactly 0.
    if not autograd_on() and any(spec[0].is_nf4 and spec[0].wide is None for spec in specs):
        return "NF4 inference (no autograd): bitsandbytes' own 4-bit kernels"
    autocast = x.device.type in ("cuda", "cpu", "xpu") and torch.is_autocast_enabled(x.device.type)
    x_dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    for name, spec in zip(names, specs):
        base, a, _, _ = spec
        tensors = (base.weight, base.bias, a)
        if any(t is not None and t.device != x.device for t in tensors):
            return f"{name}: weights on another device than the input"
        if a is not None and a.dtype not in (x_dtype, torch.float32):
            return f"{name}: adapter is {a.dtype}, activations {x_dtype}"
        if not autocast and stock_compute_dtype(getattr(module, name), spec, x.dtype) != x.dtype:
            return f"{name}: activations not in the layer's compute dtype (outside autocast)"
    return specs


class _Hook:
    """Base of the hook objects: the projections they read and the hook they replaced.

    Objects, not closures, so ``copy.deepcopy`` of a patched model (TRL's reference models)
    copies them with the model. Each call is counted in ``calls`` (the report's, once installed):
    ``(op, FUSED)``, or ``(op, why)`` with the reason ``call_specs`` gave.
    """

    op = "lora"

    def __init__(self, names: tuple[str, ...], previous, widen: bool = False):
        self.names = names
        self.previous = previous
        self.widen = widen
        self._probed_disabled = False  # specs(): widening tried at a disabled-adapter call
        self.calls: Counter = Counter()

    def __repr__(self) -> str:
        return f"<fasttune {type(self).__name__} over {', '.join(self.names)}>"

    def count_fp8(self, specs, x: torch.Tensor) -> None:
        """One call of each FP8 base projection in ``specs``: ``(fp8_<name>, FUSED)`` when its
        products run on FP8 tensor cores, else why the dequantise-and-matmul reference runs."""
        for name, spec in zip(self.names, specs):
            if spec[0].is_fp8:
                self.calls[fp8_op(name), product_path(x, spec[0].fp8, compute_dtype(x)) or FUSED] += 1

    def groups(self, n: int) -> tuple[tuple[int, int, bool], ...]:
        """The projection groups that share one input, as (start, stop, input copied) over the specs."""
        return ()

    def widened(self, module: nn.Module, specs: list, dtype: torch.dtype) -> list:
        """``specs`` with each group of projections widened where ``lora_widen.widen_group`` finds
        it pays (``widen`` on)."""
        if not self.widen:
            return specs
        out = list(specs)
        for start, stop, copied in self.groups(len(specs)):
            projections = [getattr(module, n) for n in self.names[start:stop]]
            out[start:stop] = widen_group(projections, out[start:stop], dtype, input_copied=copied)
        return out

    def decide(self, module: nn.Module, x: torch.Tensor, how):
        """``how(module, x)``: this call's specs or why not; in a checkpoint recompute, the decision its
        forward took (``layer_call.layer_memo``), so the recompute runs the same path without paying
        for the checks again. Not reused for DeepSpeed ZeRO-3 parameters, whose gathering the checks
        must see at each call."""
        memo = layer_memo()
        if memo is None:
            return how(module, x)
        key = (x.dtype, x.device, compute_dtype(x), autograd_on())
        if recomputing():
            hit = memo.get((self, module))
            if hit is not None and hit[0] == key:
                return hit[1]
        specs = how(module, x)
        if isinstance(specs, str) or not any(is_zero3_param(t) for spec in specs for t in (spec[0].weight, spec[1])):
            memo[self, module] = (key, specs)
        return specs

    def specs(self, module: nn.Module, x: torch.Tensor):
        """``call_specs``, widened; a call with the adapters disabled (DPO's reference pass, maybe
        before any training call) widens the groups first, with the disabled adapters' ranks, so a
        fresh adapter (B = 0) and the reference compute the same products bit for bit."""
        specs = call_specs(module, self.names, x)
        if not isinstance(specs, str):
            return self.widened(module, specs, compute_dtype(x))
        # Tried once per hook: a group that cannot widen (FP8, ...) must not pay for the probe on
        # every reference call; one that did is found widened by call_specs from then on.
        if self.widen and not self._probed_disabled and any(
                getattr(getattr(module, n, None), "disable_adapters", False) for n in self.names):
            self._probed_disabled = True
            enabled = projection_specs(module, self.names, at_call=True, ignore_disabled=True)
            if not isinstance(enabled, str):
                self.widened(module, enabled, compute_dtype(x))
                return call_specs(module, self.names, x)
        return specs


class LoRAQKVHook(_Hook):
    """``project_qkv`` through ``lora_qkv`` (separate q/k/v) or ``lora_linear`` (Phi-3's qkv_proj)."""

    op = OP_QKV

    def groups(self, n: int):
        return ((0, n, True),)

    def __call__(self, module: nn.Module, hidden_states: torch.Tensor):
        specs = self.decide(module, hidden_states, self.specs)
        self.calls[self.op, specs if isinstance(specs, str) else FUSED] += 1
        if isinstance(specs, str):
            return self.previous(module, hidden_states)
        self.count_fp8(specs, hidden_states)
        if len(specs) == 3:
            return lora_qkv(hidden_states, *specs)
        qkv = lora_linear(hidden_states, *specs[0])
        # That is a view made inside an autograd Function: once RoPE rotates the q/k slices in
        # place, autograd refuses the sibling v slice. Re-view it as a plain tensor (no copy).
        qkv = torch.ops.aten._unsafe_view(qkv, qkv.shape)
        q_size = module.config.num_attention_heads * module.head_dim  # the stock split (attention.py)
        kv_size = module.num_key_value_heads * module.head_dim
        return qkv[..., :q_size], qkv[..., q_size:q_size + kv_size], qkv[..., q_size + kv_size:]


class LoRAOHook(_Hook):
    """``project_o`` through ``lora_linear``; in an offloaded layer with the o_proj stash on, its recompute
    takes the forward's output back from the host instead of multiplying again (``output_stash.py``)."""

    op = OP_O

    def specs(self, module: nn.Module, x: torch.Tensor):
        return call_specs(module, self.names, x)  # one projection, nothing to widen

    def __call__(self, module: nn.Module, attn_output: torch.Tensor) -> torch.Tensor:
        specs = self.decide(module, attn_output, self.specs)
        self.calls[self.op, specs if isinstance(specs, str) else FUSED] += 1
        if isinstance(specs, str):
            return self.previous(module, attn_output)
        self.count_fp8(specs, attn_output)
        spec = specs[0]
        nbytes = attn_output.numel() // attn_output.shape[-1] * spec[0].shape[0] * compute_dtype(attn_output).itemsize
        return projection_output(lambda: lora_linear(attn_output, *spec),
                                 lambda y: lora_linear(attn_output, *spec, known_output=y), nbytes, attn_output.device,
                                 quantized=spec[0].is_nf4 or spec[0].is_fp8)


class LoRAMLPHook(_Hook):
    """``fused_mlp`` through ``lora_mlp`` (separate gate/up) or lora_linear → GLU kernel →
    lora_linear (Phi-3's gate_up_proj). A call that does not qualify runs the module's stock forward.

    ``skip_unused``: the family's MLP output only enters the residual sum, so inside a checkpoint
    recompute (whose output is discarded) ``lora_mlp`` may skip the down projection.
    ``act_op``: the MLP forward's op when it counts its activation kernel (``mlp.py``), which a
    fused call also runs.
    """

    op = OP_MLP

    def __init__(self, names: tuple[str, ...], previous, activation: str, stock, skip_unused: bool = False,
                 widen: bool = False, act_op: str | None = None):
        super().__init__(names, previous, widen)
        self.activation = activation
        self.stock = stock
        self.skip_unused = skip_unused
        self.act_op = act_op

    def groups(self, n: int):
        # gate/up share a copied input; lora_mlp's down reads H where the GLU kernel writes it.
        return ((0, 2, True), (2, 3, False)) if n == 3 else ((0, 1, True), (1, 2, True))

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        specs = self.decide(module, x, self.specs)
        self.calls[self.op, specs if isinstance(specs, str) else FUSED] += 1
        if isinstance(specs, str):
            if self.previous is not None:
                return self.previous(module, x)
            # The same activation kernel as a fused call: a disabled adapter (DPO's reference pass)
            # then computes bitwise what a fresh adapter (B = 0) computes.
            fwd = mlp_forward(module)
            return fwd.unfused(x) if fwd is not None else self.stock(x)
        self.count_fp8(specs, x)
        if self.act_op is not None:
            self.calls[self.act_op, FUSED] += 1
        if len(specs) == 3:
            unused = self.skip_unused and recomputing()
            return lora_mlp(x, *specs, activation=self.activation, output_unused=unused)
        from ..kernels.swiglu import geglu, swiglu

        gate, up = (t.contiguous() for t in lora_linear(x, *specs[0]).chunk(2, dim=-1))
        if self.activation == "silu":
            h = swiglu(gate, up)
        else:
            h = geglu(gate, up, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return lora_linear(h, *specs[1])


class _UndoHook:
    """Puts a forward's previous hook back (an object, for deepcopy; no-op if replaced since)."""

    def __init__(self, fwd, attr: str, hook, previous):
        self.fwd, self.attr, self.hook, self.previous = fwd, attr, hook, previous

    def __call__(self) -> None:
        if getattr(self.fwd, self.attr, None) is self.hook:
            setattr(self.fwd, self.attr, self.previous)


def _install(fwd, attr: str, hook: _Hook, report: PatchReport, op: str) -> None:
    hook.calls = report.calls
    setattr(fwd, attr, hook)
    report.on_undo(_UndoHook(fwd, attr, hook, hook.previous))
    report.add(op, counted=True)


def _mlp_activation(module: nn.Module, fwd, spec: FamilySpec, base: nn.Module):
    """(kernel activation name, None) or (None, reason): the installed forward's verified one,
    else resolved and probed here (``config.mlp`` off installs the forward without it)."""
    if fwd.activation is not None:
        return fwd.activation, None
    activation = config_activation(getattr(module, "config", None) or base.config, spec)
    reason, _ = check_mlp(module, spec, activation, use_kernel=True)
    return (None, reason) if reason is not None else (ACTIVATIONS[activation], None)


def _patch_attention(name: str, module: nn.Module, spec: FamilySpec, config: FastConfig,
                     report: PatchReport) -> None:
    fwd = attention_forward(module)
    qkv_names, o_names = QKV_NAMES[spec.qkv_layout], ("o_proj",)
    for op, names, attr, cls in ((OP_QKV, qkv_names, "project_qkv", LoRAQKVHook),
                                 (OP_O, o_names, "project_o", LoRAOHook)):
        if fwd is None:
            report.fallback(op, name, "attention forward not installed (see the rope/attention_hook fallback)")
            continue
        specs = projection_specs(module, names)
        if isinstance(specs, str):
            report.fallback(op, name, specs)
            continue
        _install(fwd, attr, cls(names, getattr(fwd, attr), widen=config.lora_widen), report, op)


def _patch_mlp(name: str, module: nn.Module, spec: FamilySpec, base: nn.Module, config: FastConfig,
               report: PatchReport) -> None:
    fwd = mlp_forward(module)
    if fwd is None:
        report.fallback(OP_MLP, name, "MLP forward not installed (see the mlp/mlp_hook fallback)")
        return
    names = MLP_NAMES[spec.mlp_layout]
    specs = projection_specs(module, names)
    if isinstance(specs, str):
        report.fallback(OP_MLP, name, specs)
        return
    activation, reason = _mlp_activation(module, fwd, spec, base)
    if reason is not None:
        report.fallback(OP_MLP, name, reason)
        return
    hook = LoRAMLPHook(names, fwd.fused_mlp, activation, fwd.stock, skip_unused=not spec.mlp_output_saved,
                       widen=config.lora_widen, act_op=fwd.op if fwd.activation is not None else None)
    _install(fwd, "fused_mlp", hook, report, OP_MLP)


def fused_projection_names(module: nn.Module) -> list[str]:
    """The names of the projections of ``module`` (an attention or MLP) its fused-LoRA hooks read."""
    fwd = attention_forward(module) or mlp_forward(module)
    if fwd is None:
        return []
    hooks = [getattr(fwd, attr, None) for attr in ("project_qkv", "project_o", "fused_mlp")]
    names = [n for h in hooks if isinstance(h, _Hook) for n in h.names]
    return [n for n in names if isinstance(getattr(module, n, None), nn.Module)]


def fused_lora_projections(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """(attention or MLP module, the projection modules its fused-LoRA hooks read), per patched module."""
    out = []
    for module in model.modules():
        names = fused_projection_names(module)
        if names:
            out.append((module, [getattr(module, n) for n in names]))
    return out


def patch_lora(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig, report: PatchReport) -> None:
    """Set the fused-LoRA hooks of every installed attention and MLP forward of a PEFT LoRA model.

    Runs after the attention and MLP patchers. Nothing happens with ``config.lora`` off or when
    the model has no PEFT LoRA layer. Each attention gets "lora_qkv" and "lora_o", each MLP
    "lora_mlp", or a fallback naming the module and the reason.
    """
    if not config.lora or not any(is_lora_layer(m) for m in base.modules()):
        return
    attn_cls, mlp_cls = classes.get("attention_class"), classes.get("mlp_class")
    report.on_undo(Unwiden(base))  # runs after the hooks are gone (undo is last-in, first-out)
    for name, module in base.named_modules():
        if attn_cls is not None and type(module) is attn_cls:
            _patch_attention(name, module, spec, config, report)
        elif mlp_cls is not None and type(module) is mlp_cls:
            _patch_mlp(name, module, spec, base, config, report)


__all__ = ["LoRAMLPHook", "LoRAOHook", "LoRAQKVHook", "call_specs", "fused_lora_projections", "fused_projection_names",
           "is_lora_layer", "patch_lora", "projection_specs", "stock_compute_dtype"]
