"""Per-instance model patching: the only place that knows transformers' modeling internals."""

from .families import FAMILIES, FamilySpec, family_for
from .instance import find_causal_lm
from .patch import patch_model, patch_report, unpatch_model
from .report import Fallback, PatchReport

__all__ = ["FAMILIES", "FamilySpec", "family_for", "find_causal_lm", "patch_model", "patch_report",
           "unpatch_model", "Fallback", "PatchReport"]
