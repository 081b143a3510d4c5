"""Pre-norm decoder layers with the residual adds inside the RMSNorm kernels.

A pre-norm layer (Llama, Mistral, Qwen 2/3, Gemma) computes

    h   = x + attn(norm_1(x))
    out = h + mlp(norm_2(h))

Stock, that is two add kernels in forward, and in backward two more where autograd sums the
gradients of x and of h (each feeds its norm and a residual add). ``FusedResidualLayerForward``
runs the same layer with ``norm_1.keep(x)`` (the norm, and x passed through: its backward adds the
residual's gradient in the same pass, ``kernels.rms_norm.rms_norm_keep``) and ``norm_2.add(attn,
x)`` (the add and the norm in one pass, whose backward adds the gradient of h): three of the four
adds are gone (8B shape: ~47 µs each per layer, 4 TB/s over [8,192, 4,096] bf16). The forward
values are the stock ones bit for bit on the GPU (the same sums, rounded as torch rounds them;
the Triton interpreter truncates instead); a norm's gradient and the residual's are summed in fp32
and rounded once instead of twice.

The layer's own arguments go to the attention as the stock layer passes them (all of them, by
name); the norms must be fasttune's (``norm.py``) and free of hooks (they are called directly, so
a user's hook, FSDP2's or DeepSpeed ZeRO-3's parameter gathering would be skipped), else the layer
runs stock. Decode steps (few rows, no autograd) run the stock layer, as every other patch does.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..config import FastConfig
from .families import FamilySpec, family_modules
from .instance import DECODE_STEP, PatchedForward, stock_forward, stock_is_faster, swap_forward
from .norm import FastRMSNormForward
from .report import PatchReport

OP = "residual_norms"
CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _MODULE_HOOKS
                      if hasattr(nn.modules.module, f"_global{name}"))  # register_module_forward_hook & co.


def _required_names(fn) -> tuple[str, ...]:
    """Named parameters of ``fn`` without a default, after the first (hidden_states)."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return tuple(p.name for p in params if p.default is inspect.Parameter.empty
                 and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def _defaults(fn) -> dict:
    return {p.name: p.default for p in inspect.signature(fn).parameters.values()
            if p.default is not inspect.Parameter.empty}


class FusedResidualLayerForward(PatchedForward):
    """Replacement ``forward`` of one pre-norm decoder layer (module docstring)."""

    op = OP

    def __init__(self, module: nn.Module, stock):
        super().__init__(module, stock)
        # The stock layer names every argument when it calls the attention; an argument the
        # attention cannot do without gets the layer's default when the caller left it out.
        self.layer_defaults = _defaults(stock)
        self.attn_required = _required_names(stock_forward(module.self_attn))

    def _norms(self) -> tuple[FastRMSNormForward, FastRMSNormForward] | None:
        """The two norms' forwards, called directly; None when a norm must be called as a module:
        its forward was replaced, or it has hooks (a user's, FSDP2's or DeepSpeed's parameter
        gathering), which only ``Module.__call__`` runs."""
        if _GLOBAL_HOOKS and any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS):
            return None
        norms = (self.module.input_layernorm, self.module.post_attention_layernorm)
        if any(getattr(m, name) for m in norms for name in _MODULE_HOOKS):
            return None
        fwds = tuple(m.__dict__.get("forward") for m in norms)
        return fwds if all(isinstance(f, FastRMSNormForward) for f in fwds) else None

    def __call__(self, *args, **kwargs):
        if len(args) == 1:
            hidden = args[0]
        elif not args and "hidden_states" in kwargs:
            kwargs = dict(kwargs)
            hidden = kwargs.pop("hidden_states")
        else:  # other positional arguments: only the stock forward knows their names
            self.count("other positional arguments than hidden_states")
            return self.stock(*args, **kwargs)
        norms = self._norms()  # None once a norm was unpatched or replaced by someone else
        if norms is None or not isinstance(hidden, torch.Tensor) or stock_is_faster(hidden):
            self.count("a norm replaced, unpatched or hooked" if norms is None else DECODE_STEP
                       if isinstance(hidden, torch.Tensor) else "hidden_states is not a tensor")
            return self.stock(hidden, **kwargs)
        self.count()
        for name in self.attn_required:
            if name not in kwargs and name in self.layer_defaults:
                kwargs = {**kwargs, name: self.layer_defaults[name]}
        layer = self.module
        normed, hidden = norms[0].keep(hidden)
        attn_out, _ = layer.self_attn(hidden_states=normed, **kwargs)
        normed, hidden = norms[1].add(attn_out, hidden)
        return hidden + layer.mlp(normed)


def check_layer(module: nn.Module) -> str | None:
    """Why this decoder layer cannot run with fused residual norms, or None."""
    missing = [name for name in CHILDREN if not isinstance(getattr(module, name, None), nn.Module)]
    if missing:
        return f"no {', '.join(missing)} submodule"
    try:
        first = next(iter(inspect.signature(stock_forward(module)).parameters), None)
    except (TypeError, ValueError):
        return "forward has no inspectable signature"
    if first != "hidden_states":
        return f"forward's first parameter is {first!r}, not 'hidden_states'"
    return None


def patch_residuals(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig,
                    report: PatchReport) -> None:
    """Install ``FusedResidualLayerForward`` on each pre-norm decoder layer; report the others."""
    if not (config.residual_norms and config.rms_norm and spec.pre_norm_layer):
        return
    for name, module in family_modules(base, spec, classes, "decoder_layer_class", OP, report):
        norms = [getattr(module, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if any(isinstance(m, nn.Module) and not isinstance(m.__dict__.get("forward"), FastRMSNormForward) for m in norms):
            continue  # a norm left stock: its own fallback is already in the report
        reason = check_layer(module)
        if reason is not None:
            report.fallback(OP, name, reason)
            continue
        swap_forward(module, FusedResidualLayerForward(module, stock_forward(module)), report)
        report.add(OP, counted=True)


__all__ = ["FusedResidualLayerForward", "check_layer", "patch_residuals"]
