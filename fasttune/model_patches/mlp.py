"""Gated MLPs with the SwiGLU/GeGLU activation on the Triton kernel, and the fused-LoRA hook point.

``down(act(gate(x)) * up(x))`` with the gate/up projections separate or fused (Phi-3's
``gate_up_proj``: gate is the first half), then the family's output dropout in training where its row
names one (``FamilySpec.output_dropout_attr``: Seed-OSS's ``residual_dropout``). The activation is read
off the config attributes the family's row names (``FamilySpec.activation_attrs``) through
``families.ACTIVATIONS``, and checked against the module's own activation function on a probe, so a
module computing something else than its config says stays stock instead of silently changing numbers.

Hook for fused LoRA: ``fused_mlp(module, x) -> Tensor`` on an installed forward replaces the
whole computation; None (the default) runs the path above through the module's own projection
submodules (so PEFT LoRA and bitsandbytes layers keep working).

The MLP stash (``FastConfig.mlp_stash``): in an offloaded decoder layer the MLP of the layer (not a
shared expert) is a core of ``attention_stash.py``: what it saves for backward goes to the host and its
recompute is skipped. Its output is not stashed where it only enters the residual sum
(``FamilySpec.mlp_output_saved`` False). Not stashed: an MLP with dropout inside (PEFT's
``lora_dropout``: skipping the core in the recompute would shift the random numbers of what follows).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FastConfig
from . import attention_stash
from .attention import float_dtype, output_dropout
from .families import ACTIVATIONS, FamilySpec, family_class
from .dropout_watch import DropoutWatch
from .instance import DECODE_STEP, PatchedForward, single_input, stock_forward, stock_is_faster, swap_forward
from .report import PatchReport

OP = "mlp"
OP_HOOK = "mlp_hook"  # installed for the LoRA hook only (config.mlp off)
MLP_ATTR = "mlp"  # the decoder layer's MLP child, in every family of the table
ACT_ATTRS = ("act_fn", "activation_fn")  # where the stock MLPs keep their activation module
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAYOUT_SUBMODULES = {"separate": ("gate_proj", "up_proj", "down_proj"), "fused": ("gate_up_proj", "down_proj")}
# The function each kernel activation computes, for the probe.
_KERNEL_MATH = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": lambda x: F.gelu(x, approximate="none"),
}


class FastMLPForward(PatchedForward):
    """Replacement ``forward`` of one gated-MLP instance.

    Attributes:
        fused_mlp: ``(module, x) -> Tensor`` replacing the whole MLP (fused LoRA), or None.
        activation: the kernel activation ("silu", "gelu_tanh", "gelu"), or None to apply the
            module's own activation function (installed for the hook only).
        layer_mlp: the ``mlp`` of a decoder layer (the MLP stash's core), not a shared expert.
        output_saved: an op after the MLP saves its output (``FamilySpec.mlp_output_saved``).
    """

    op = OP

    def __init__(self, module: nn.Module, stock, layout: str, activation: str | None, act_attr: str,
                 dropout_attr: str | None = None, layer_mlp: bool = False, output_saved: bool = True):
        super().__init__(module, stock)
        self.layer_mlp = layer_mlp
        self.output_saved = output_saved
        self.dropout_attr = dropout_attr  # FamilySpec.output_dropout_attr: dropout after down_proj (Seed-OSS)
        self.fused_mlp: Callable | None = None
        self.layout = layout
        self.activation = activation
        self.act_attr = act_attr
        self.dropout_inside = DropoutWatch(skip_self=True)  # PEFT's lora_dropout in the projections

    def _gate_up(self, x):
        m = self.module
        if self.layout == "fused":
            return m.gate_up_proj(x).chunk(2, dim=-1)
        return m.gate_proj(x), m.up_proj(x)

    def _act(self, gate, up):
        if (self.activation is not None and gate.dtype in KERNEL_DTYPES and up.dtype == gate.dtype
                and gate.shape == up.shape and gate.numel() > 0):
            from ..kernels.swiglu import geglu, swiglu

            gate, up = gate.contiguous(), up.contiguous()  # no-ops except for Phi-3's halves
            self.count()
            if self.activation == "silu":
                return swiglu(gate, up)
            return geglu(gate, up, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        if self.activation is not None:
            self.count("gate/up the kernel does not take (dtype, shape or empty)")
        return getattr(self.module, self.act_attr)(gate) * up

    def __call__(self, *args, **kwargs):
        x = single_input(args, kwargs)  # the stock forwards take one tensor; anything else is theirs
        if x is None or stock_is_faster(x):
            if self.activation is not None:
                self.count("other arguments than one tensor" if x is None else DECODE_STEP)
            return self.stock(*args, **kwargs)
        stash = attention_stash.current(attention_stash.MLP) if self.layer_mlp else None
        if stash is not None and torch.is_grad_enabled() and not self._dropout_inside():
            # What the core saves: its input and the gate/up products (the fused path's; about so otherwise).
            core_bytes = (x.numel() + 2 * x.numel() // x.shape[-1] * self._width()) * x.element_size()
            out = stash.run(lambda: (self._compute(x), None), core_bytes, self.module, attention_stash.MLP,
                            saved_all=True, output_unused=not self.output_saved)[0]
        else:
            out = self._compute(x)
        # After a recompute that skipped the down projection (NaN output) the dropout still draws its mask, the
        # only thing its backward needs: the same random numbers as the forward's, the same gradients.
        return output_dropout(self.module, out, self.dropout_attr)

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_mlp is not None:  # counted by the hook (lora.LoRAMLPHook), or by _act when it falls back
            return self.fused_mlp(self.module, x)
        return self.unfused(x)

    def _dropout_inside(self) -> bool:
        """Does a submodule (PEFT's ``lora_dropout``) draw random numbers in this call? (The module's own
        output dropout comes after the core.)"""
        return self.dropout_inside.draws(self.module)

    def _width(self) -> int:
        """The intermediate width I."""
        m = self.module
        if self.layout == "fused":
            return _out_features(m.gate_up_proj) // 2
        return _out_features(m.gate_proj)

    def unfused(self, x: torch.Tensor) -> torch.Tensor:
        """The module's own projections around the activation kernel (what a fused hook falls back to)."""
        gate, up = self._gate_up(x)
        return self.module.down_proj(self._act(gate, up))


def _out_features(proj: nn.Module) -> int:
    """Output width of a projection module (nn.Linear, a PEFT LoRA layer, a bitsandbytes layer)."""
    base = getattr(proj, "base_layer", proj)
    return int(getattr(base, "out_features", 0) or 0)


def config_activation(config, spec: FamilySpec) -> str | None:
    """The activation name the family's config gives (first non-None of ``spec.activation_attrs``)."""
    for attr in spec.activation_attrs:
        value = getattr(config, attr, None)
        if value is not None:
            return value
    return None


def _probe(act_fn, kind: str) -> bool:
    """True when ``act_fn`` computes the kernel activation ``kind`` (fp32, on [-8, 8])."""
    x = torch.linspace(-8.0, 8.0, 257, dtype=torch.float32)
    try:
        with torch.no_grad():
            got = act_fn(x)
    except Exception:  # noqa: BLE001 - any failure means "not the function we know"
        return False
    return isinstance(got, torch.Tensor) and got.shape == x.shape and torch.allclose(
        got.float(), _KERNEL_MATH[kind](x), rtol=1e-5, atol=1e-6)


probe_activation = _probe  # public name for the MoE experts' act_fn check (moe.py)


def check_mlp(module: nn.Module, spec: FamilySpec, activation: str | None, use_kernel: bool):
    """(reason it cannot be patched or None, the activation attribute of the module)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return "forward has no inspectable signature", None
    if len(params) != 1:
        return "forward takes other arguments than the input tensor in this transformers version", None
    for attr in _LAYOUT_SUBMODULES[spec.mlp_layout]:
        if not isinstance(getattr(module, attr, None), nn.Module):
            return f"no `{attr}` submodule in this transformers version", None
    if spec.output_dropout_attr is not None and not hasattr(module, spec.output_dropout_attr):
        return f"no `{spec.output_dropout_attr}` attribute (the dropout probability of the output)", None
    act_attr = next((a for a in ACT_ATTRS if callable(getattr(module, a, None))), None)
    if act_attr is None:
        return f"no activation attribute ({' / '.join(ACT_ATTRS)})", None
    if use_kernel:
        dtype = float_dtype(module)
        if dtype is not None and dtype not in KERNEL_DTYPES:
            name = str(dtype).replace("torch.", "")
            return f"parameters are {name}; the kernels take float32/float16/bfloat16", act_attr
        if activation is None:
            return f"no activation in config.{' / config.'.join(spec.activation_attrs)}", act_attr
        kind = ACTIVATIONS.get(activation)
        if kind is None:
            return (f"activation {activation!r} has no kernel; supported: {', '.join(sorted(ACTIVATIONS))}",
                    act_attr)
        if not _probe(getattr(module, act_attr), kind):
            return (f"the module's {type(getattr(module, act_attr)).__name__} does not compute {activation!r} "
                    "(config and module disagree)", act_attr)
    return None, act_attr


def patch_mlp(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig, report: PatchReport) -> None:
    """Install ``FastMLPForward`` on every MLP of the family's class.

    Installed when ``config.mlp`` (the activation kernel) or ``config.lora`` (the fused-LoRA hook)
    is on; reported as "mlp" per module with the kernel, "mlp_hook" without it.
    """
    if not (config.mlp or config.lora) or spec.mlp_class is None:
        return  # (a family of mixture-of-experts layers only: moe.py)
    op = OP if config.mlp else OP_HOOK
    mlp_cls = family_class(spec, classes, "mlp_class", op, report)
    if mlp_cls is None:
        return
    layer_cls = classes.get("decoder_layer_class")
    layer_mlps = set()  # ids of the decoder layers' own MLPs (not shared experts)
    for name, module in base.named_modules():
        if layer_cls is not None and type(module) is layer_cls:
            child = getattr(module, MLP_ATTR, None)
            if child is not None and type(child) is not mlp_cls and type(child).__name__ != spec.moe_block_class:
                report.fallback(op, f"{name}.{MLP_ATTR}", f"is {type(child).__name__}, not {spec.mlp_class}")
            if child is not None:
                layer_mlps.add(id(child))
        if type(module) is not mlp_cls:
            continue
        # The module's own config is what its activation was built from.
        activation = config_activation(getattr(module, "config", None) or base.config, spec)
        reason, act_attr = check_mlp(module, spec, activation, use_kernel=config.mlp)
        if reason is not None:
            report.fallback(op, name, reason)
            continue
        kind = ACTIVATIONS[activation] if config.mlp else None
        fwd = FastMLPForward(module, stock_forward(module), spec.mlp_layout, kind, act_attr, spec.output_dropout_attr,
                             layer_mlp=id(module) in layer_mlps, output_saved=spec.mlp_output_saved)
        swap_forward(module, fwd, report)
        report.add(op, counted=config.mlp)  # the LoRA hook point alone runs no kernel of its own


def mlp_forward(module: nn.Module) -> FastMLPForward | None:
    """The installed ``FastMLPForward`` of an MLP module, if any (for the LoRA patcher)."""
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, FastMLPForward) else None


__all__ = ["FastMLPForward", "check_mlp", "config_activation", "mlp_forward", "patch_mlp", "probe_activation"]
