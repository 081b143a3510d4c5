"""TRL's fused-LM-head protocol answered by fasttune's kernels: per-token fields without logits.

TRL (≥ 1.15) calls ``model(..., labels=..., fused_lm_head=True)`` from its SFT, DPO, GRPO, KTO and
RLOO trainers and reads a ``FusedLMHeadOutput``. What a call must compute was fixed when TRL installed
its head (``trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)``);
``TrlHeadSettings`` carries the same three choices to fasttune's head. With labels y (shifted,
-100 ignored), z the family's transformed logits (soft-cap, logit scale) and T the temperature, per
position with a label:

    log_probs        = log softmax(z/T)[y]                   (differentiable)
    entropy          = −Σ_j p_j log p_j,  p = softmax(z/T)   (differentiable)
    is_top1          = y is the first argmax of z            (no gradient)
    mean_logits      = mean_j z_j / T                        (no gradient)
    log_sum_sq_probs = log Σ_j p_j²                          (no gradient)

and 0 (False) where the label is ignored; ``loss = −Σ log_probs / (num_items_in_batch or count)``.

Which kernel: when ``is_top1`` is asked and the entropy needs no gradient (SFT and DPO detach it),
``fused_linear_cross_entropy(reduction="none", return_stats=True)`` gives −log_probs, entropy and
top-1 in one pass, the temperature folded into its logit scale (exact without a soft-cap, or at
T = 1). Otherwise (GRPO/RLOO's temperature, entropy bonus) ``fused_linear_logprobs`` on the
labelled rows only, entropy differentiable. Fields neither kernel gives are computed under no_grad:
``mean_logits`` without a soft-cap is exactly (s/T)·(h·mean_j W_j + mean_j b_j), one [N, D]×[D]
product; the rest in row chunks of plain-torch logits bounded by the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..kernels.cross_entropy import fused_linear_cross_entropy
from ..kernels.logprobs import fused_linear_logprobs

IGNORE_INDEX = -100
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class FusedLMHeadOutput(ModelOutput):
    """The fields TRL's trainers read from ``model(..., fused_lm_head=True)``; per-token fields
    are [batch, seq-1] (or [batch, seq] with ``shift_labels``) and zero where the label is ignored."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


@dataclass(frozen=True)
class TrlHeadSettings:
    """What a fused-LM-head call computes (TRL's ``add_fused_lm_head`` arguments).

    Attributes:
        temperature: T > 0 dividing the logits (GRPO/RLOO pass their sampling temperature).
        outputs: per-token fields to compute besides ``log_probs`` (always computed); the
            default asks for every field, as a caller without TRL's configuration may read any.
        entropy_grad: whether the entropy may be back-propagated (GRPO's entropy bonus); False
            lets the one-pass cross-entropy kernel serve SFT/DPO, which detach it.
        fp32_head: run the projection in float32 outside autocast (GRPO's ``cast_lm_head_to_fp32``).
    """

    temperature: float = 1.0
    outputs: tuple[str, ...] = FIELDS
    entropy_grad: bool = True
    fp32_head: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}")
        unknown = sorted(set(self.outputs) - set(FIELDS))
        if unknown:
            raise ValueError(f"outputs has unknown field(s) {unknown}; known: {list(FIELDS)}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "outputs", tuple(dict.fromkeys(("log_probs", *self.outputs))))


def provides_fused_head(forward) -> bool:
    """True when ``forward`` answers ``fused_lm_head=True`` itself (TRL's head, or fasttune's).

    TRL's ``_fused_forward`` is wrapped with ``functools.wraps`` (its signature reads as the
    model's), so look at the function's own keyword-only parameters instead.
    """
    if forward is None:
        return False
    if getattr(forward, "answers_fused_lm_head", False):
        return True
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    if code is None:
        return False
    named = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return "fused_lm_head" in named


def fused_lm_head_fields(hidden, labels, weight, bias, settings: TrlHeadSettings, *, softcap=None,
                         logit_scale=None, workspace_mib=None) -> dict[str, torch.Tensor | None]:
    """The per-token fields of ``settings.outputs`` over flat rows (module docstring).

    Args:
        hidden: [N, D] last hidden states (flattened, already in the head's dtype).
        labels: [N] next-token labels, ``-100`` where ignored.
        weight: [V, D] lm_head weight, hidden's dtype.
        bias: optional [V] lm_head bias, weight's dtype.
        settings: temperature, fields to compute, entropy gradient, fp32 projection.
        softcap: the family's final-logit soft-cap, or None.
        logit_scale: the family's logit multiplier, or None.
        workspace_mib: bound of the logit workspace per chunk.

    Returns:
        field name → [N] tensor (float32, ``is_top1`` bool), zero where ignored; None if not asked.
    """
    want = set(settings.outputs)
    T = settings.temperature
    out: dict[str, torch.Tensor | None] = dict.fromkeys(FIELDS)
    mask = labels != IGNORE_INDEX
    one_pass = ("is_top1" in want and not (settings.entropy_grad and "entropy" in want)
                and (softcap is None or T == 1.0))
    if one_pass:
        scale = (1.0 if logit_scale is None else logit_scale) / T
        per_token, stats = fused_linear_cross_entropy(
            hidden, weight, labels, bias, ignore_index=IGNORE_INDEX, reduction="none", return_stats=True,
            softcap=softcap, logit_scale=None if scale == 1.0 else scale, workspace_mib=workspace_mib)
        out["log_probs"] = -per_token
        out["entropy"] = stats["entropy"] if "entropy" in want else None
        out["is_top1"] = stats["correct"]
        want.discard("is_top1")
    extra = want & {"is_top1", "mean_logits", "log_sum_sq_probs"}
    if one_pass and not extra:
        return out
    # Only the labelled rows are projected (prompt and padding tokens need no logits).
    rows_h, rows_y = hidden[mask], labels[mask]
    if not one_pass:
        got = fused_linear_logprobs(rows_h, weight, rows_y, bias, temperature=T, softcap=softcap,
                                    logit_scale=logit_scale, return_entropy="entropy" in want,
                                    workspace_mib=workspace_mib)
        logp, ent = got if isinstance(got, tuple) else (got, None)
        out["log_probs"] = _scatter(mask, logp)
        out["entropy"] = None if ent is None else _scatter(mask, ent)
    if extra:
        stats = _no_grad_stats(rows_h, rows_y, weight, bias, extra, T, softcap, logit_scale, workspace_mib)
        for name, value in stats.items():
            out[name] = _scatter(mask, value)
    return out


def _scatter(mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # `masked_scatter` keeps the result connected to the graph even when no label is valid.
    dtype = torch.bool if rows.dtype == torch.bool else torch.float32
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_scatter(mask, rows.to(dtype))


@torch.no_grad()
def _no_grad_stats(h, y, weight, bias, names, T, softcap, logit_scale, workspace_mib) -> dict[str, torch.Tensor]:
    """is_top1 / mean_logits / log_sum_sq_probs of the labelled rows, never more than a workspace
    of logits at a time (≤ 16 bytes per logit alive: the product, fp32 logits, 2·logits, exp)."""
    scale = 1.0 if logit_scale is None else logit_scale
    out: dict[str, torch.Tensor] = {}
    names = set(names)
    if "mean_logits" in names and softcap is None:
        # mean_j (s/T)(h·W_j + b_j) = (s/T)(h · mean_j W_j + mean_j b_j): no [N, V] product needed.
        w_mean = weight.mean(0, dtype=torch.float32)  # accumulates in fp32 without an fp32 copy of W
        b_mean = bias.mean(dtype=torch.float32) if bias is not None else 0.0
        out["mean_logits"] = (h.float() @ w_mean + b_mean) * (scale / T)
        names.discard("mean_logits")
    if not names:
        return out
    N, V = h.shape[0], weight.shape[0]
    budget = (1024 if workspace_mib is None else workspace_mib) * 2 ** 20
    step = max(1, int(budget // (16 * V)))
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for start in range(0, N, step):
        z = h[start:start + step] @ weight.t()
        if bias is not None:
            z = z + bias
        z = z.float() * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / T
        if "is_top1" in names:
            parts["is_top1"].append(z.argmax(-1) == y[start:start + step])  # first maximum, as TRL counts
        if "mean_logits" in names:
            parts["mean_logits"].append(z.mean(-1))
        if "log_sum_sq_probs" in names:
            parts["log_sum_sq_probs"].append(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
    for name, chunks in parts.items():
        out[name] = torch.cat(chunks) if chunks else h.new_zeros(0, dtype=torch.bool if name == "is_top1"
                                                                 else torch.float32)
    return out


__all__ = ["FIELDS", "FusedLMHeadOutput", "TrlHeadSettings", "fused_lm_head_fields", "provides_fused_head"]
