"""RMSNorm modules on the Triton kernel.

Every module of exactly the family's norm class (decoder-layer norms, the final norm, and the
q/k norms of Qwen3, Gemma 3 and OLMo2) gets a ``FastRMSNormForward`` computing
``rms_norm(x, weight, eps, offset=spec.norm_offset, casting=spec.norm_casting)``: the same
function as the stock forward (``kernels/reference.py`` documents both castings). Modules that do
not look like the row expects (no 1-D weight, no epsilon attribute, a forward taking other
arguments) stay stock and are reported, as are norm-named children of another class.

Each patched norm owns a ``SpareColumns`` (``kernels/spare_columns.py``): a widened LoRA group
reading its output asks for tail columns, and the norm's later outputs carry them, so the group
finds X already in place in its widened input instead of copying it.
"""

from __future__ import annotations

import inspect
import numbers

import torch
from torch import nn

from ..config import FastConfig
from ..kernels.spare_columns import SpareColumns
from .families import FamilySpec, family_class
from .instance import DECODE_STEP, PatchedForward, single_input, stock_forward, stock_is_faster, swap_forward
from .report import PatchReport

OP = "rms_norm"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OTHER_INPUT = "an input the kernel does not take (dtype, width or empty)"


class FastRMSNormForward(PatchedForward):
    """Replacement ``forward`` of one RMSNorm instance.

    Attributes:
        eps_attr: the module attribute holding epsilon (read at each call, like the stock forward).
        offset: 1.0 where the norm scales by (1 + weight) (Gemma), else 0.0.
        casting: "llama" or "gemma" (see ``kernels.reference.rms_norm``).
        spare: the spare columns the norm's consumers asked for (module docstring).
    """

    op = OP

    def __init__(self, module: nn.Module, stock, eps_attr: str, offset: float, casting: str):
        super().__init__(module, stock)
        self.eps_attr = eps_attr
        self.offset = offset
        self.casting = casting
        self.spare = SpareColumns()

    def __call__(self, *args, **kwargs):
        x = single_input(args, kwargs)  # the stock forwards take one tensor; anything else is theirs
        if x is None or stock_is_faster(x):
            self.count("other arguments than one tensor" if x is None else DECODE_STEP)
            return self.stock(*args, **kwargs)
        if not isinstance(x, torch.Tensor) or not self._takes(x):
            self.count(_OTHER_INPUT)
            return self.stock(*args, **kwargs)  # float64, odd shapes: the stock math, unchanged
        from ..kernels.rms_norm import rms_norm  # the submodule: `kernels.rms_norm` is also a module name

        self.count()
        eps = getattr(self.module, self.eps_attr)
        return rms_norm(x, self.module.weight, eps, offset=self.offset, casting=self.casting, spare=self.spare)

    def _takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel computes this call (dtypes it handles, a matching non-empty input)."""
        weight = self.module.weight
        return (x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES and x.shape[-1] == weight.shape[0]
                and x.numel() > 0)

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x), x) for a pre-norm layer (``residual.py``): use the second for the residual add, so
        its gradient is added in this norm's backward pass."""
        if not self._takes(x):
            return self(x), x
        from ..kernels.rms_norm import rms_norm_keep

        self.count()
        eps = getattr(self.module, self.eps_attr)
        return rms_norm_keep(x, self.module.weight, eps, offset=self.offset, casting=self.casting, spare=self.spare)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x) in one pass when both have one dtype and shape (the sum
        rounds as torch's add would); otherwise torch's add (type promotion included), then the norm."""
        if residual.dtype != x.dtype or residual.shape != x.shape or not self._takes(x):
            s = residual + x
            return self(s), s
        from ..kernels.rms_norm import rms_norm_add

        self.count()
        eps = getattr(self.module, self.eps_attr)
        return rms_norm_add(x, residual, self.module.weight, eps, offset=self.offset, casting=self.casting,
                            spare=self.spare)


def check_norm(module: nn.Module, spec: FamilySpec) -> str | None:
    """Why ``module`` cannot take the kernel, or None when it can."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return "no 1-D `weight` (the kernel scales by a per-feature weight)"
    if weight.dtype not in KERNEL_DTYPES:
        return f"weight is {str(weight.dtype).replace('torch.', '')}; the kernel takes float32/float16/bfloat16"
    eps = getattr(module, spec.norm_eps_attr, None)
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or eps < 0:
        return f"no numeric epsilon attribute `{spec.norm_eps_attr}`"
    try:
        params = [p for p in inspect.signature(type(module).forward).parameters.values()][1:]
    except (TypeError, ValueError):
        return "forward has no inspectable signature"
    if len(params) != 1 or params[0].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.POSITIONAL_ONLY):
        return "forward takes other arguments than the input tensor in this transformers version"
    return None


def patch_norms(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig, report: PatchReport) -> None:
    """Install ``FastRMSNormForward`` on every norm of the family's class; report the others."""
    if not config.rms_norm:
        return
    norm_cls = family_class(spec, classes, "norm_class", OP, report)
    if norm_cls is None:
        return
    for name, module in base.named_modules():
        if type(module) is not norm_cls:
            # A norm-named leaf of another class: a user's or another library's replacement (a VLM's
            # vision tower has LayerNorms of its own: the "vision_tower" entry covers it, vision.py).
            in_tower = spec.vision is not None and name.startswith(spec.vision.vision_tower + ".")
            if name.rsplit(".", 1)[-1].endswith("norm") and next(module.children(), None) is None and not in_tower:
                report.fallback(OP, name, f"is {type(module).__name__}, not {spec.norm_class}")
            continue
        reason = check_norm(module, spec)
        if reason is not None:
            report.fallback(OP, name, reason)
            continue
        fwd = FastRMSNormForward(module, stock_forward(module), spec.norm_eps_attr, float(spec.norm_offset),
                                 spec.norm_casting)
        swap_forward(module, fwd, report)
        report.add(OP, counted=True)


__all__ = ["FastRMSNormForward", "check_norm", "patch_norms"]
