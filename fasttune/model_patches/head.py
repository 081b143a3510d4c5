"""The causal-LM head with the fused linear cross-entropy: the loss without the [tokens, vocab] logits.

With labels in training mode, the patched forward runs the backbone, then computes the loss from
the last hidden states and the lm_head weight with ``fused_linear_cross_entropy`` (family extras:
final-logit soft-cap, logit scaling). Mixture-of-experts models add their routers' auxiliary loss
as stock does (``moe_aux.py``) and return ``MoeCausalLMOutputWithPast``. Without labels, in eval mode, or when the caller asks for
logits, it runs the stock forward, so generation and evaluation are unchanged.

It also answers TRL's fused-LM-head protocol (``model(..., labels=..., fused_lm_head=True)``, TRL
≥ 1.15's SFT/DPO/GRPO/KTO/RLOO trainers) with fasttune's kernels (``trl_head.py``), under the
temperature and outputs TRL configured (``TrlHeadSettings``, set by ``configure_trl_head`` or
``install_trl_head``). When TRL's own head sits below ours and nobody told us its settings, the
call goes to TRL's head: its temperature is not knowable from here, and a guess could be wrong.

Where it differs from stock on purpose: a training batch whose labels are all ignored (-100) gives
loss 0.0 and zero gradients where stock's mean gives NaN, with a warning once per head (truncation
usually cut every completion). An input id outside the embedding raises ``TokenIdError`` naming the
id, its (batch, position) and the vocabulary size, where stock raises a bare IndexError; the ids are
only inspected once the forward has failed (no host sync on the normal path; on CUDA the device-side
assert leaves nothing to inspect, so that error stays stock's).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import FastConfig
from ..kernels.cross_entropy import fused_linear_cross_entropy, master_weight
from ..kernels.label_summary import LabelSummary
from ..kernels.scratch_pool import scratch_pool
from .checkpointing import layer_checkpointing
from .families import FamilySpec, family_for
from .instance import PatchedForward, signature_has, stock_forward, swap_forward
from .moe_aux import MoeCausalLMOutputWithPast, add_router_aux, router_logits_wanted
from .report import PatchReport
from .trl_head import FusedLMHeadOutput, TrlHeadSettings, fused_lm_head_fields, provides_fused_head
from .zero3 import is_zero3_param, zero3_ready

logger = logging.getLogger("fasttune")

IGNORE_INDEX = -100
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # others (float64) take the stock path
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass(frozen=True)
class HeadExtras:
    """Logit transforms of a family, read off the config once at patch time."""

    softcap: float | None = None
    logit_scale: float | None = None
    # TRL's fused head reads the soft-cap off the text config, also where the model's own forward
    # applies none (Gemma3ForConditionalGeneration): its fused_lm_head calls get TRL's numbers.
    trl_softcap: float | None = None

    @classmethod
    def from_config(cls, spec: FamilySpec, config) -> "HeadExtras":
        softcap = getattr(config, spec.final_softcap_attr, None) if spec.final_softcap_attr else None
        divisor = getattr(config, spec.logit_divisor_attr, None) if spec.logit_divisor_attr else None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        trl_softcap = getattr(text, "final_logit_softcapping", None) if spec.vision is not None else softcap
        return cls(softcap=softcap, logit_scale=None if divisor in (None, 1, 1.0) else 1.0 / divisor,
                   trl_softcap=trl_softcap)


class FusedLossCausalLMForward(PatchedForward):
    """Replacement ``forward`` of a ``*ForCausalLM`` instance (see module docstring)."""

    op = "cross_entropy"
    answers_fused_lm_head = True

    def __init__(self, module: nn.Module, stock, extras: HeadExtras, config: FastConfig):
        super().__init__(module, stock)
        self.extras = extras
        self.workspace_mib = config.loss_workspace_mib
        self.return_logits = config.return_logits
        self.fused_logprobs = config.fused_logprobs
        # Set by FastTrainer from TrainingArguments.label_smoothing_factor (same math as HF's LabelSmoother).
        self.label_smoothing = 0.0
        # What TRL configured its fused head with; None: unknown (see _answers_fused).
        self.trl_settings: TrlHeadSettings | None = None
        self._warned_delegation = False
        self._warned_all_ignored = False
        # Set by install_trl_head: the autocast of the mixed-precision wrapper ours went over (a
        # callable returning the context), and whether a fasttune head lies below TRL's (it counts
        # the plain calls this one passes down).
        self.autocast = None
        self.over_fasttune_head = False

    # -- helpers ------------------------------------------------------------------------------
    def _head_params(self):
        """(weight, bias) of the lm_head as the fused loss needs them (whole), or None: stock path.

        DDP and an unsharded FSDP unit: the parameters as they are. FSDP2 outside lm_head's unit
        (its forward never runs): the unit is unsharded here, see ``_gathered_dtensor_params``.
        DeepSpeed ZeRO-3: used only when gathered for this module's forward and backward
        (``hf_integration.distributed.register_zero3_lm_head``), else stock: lm_head's own
        forward gathers it. FSDP1's empty views outside their unit: stock.
        """
        head = self.module.get_output_embeddings()
        if not _is_linear(head):
            return None  # a LoRA-wrapped or quantised lm_head: stock path
        own = dict(head.named_parameters(recurse=False))
        if is_zero3_param(own.get("weight")):
            # Not ``head.weight``: inside DeepSpeed's forward that getter gathers the weight and
            # registers it with this module on the fly, without keeping it gathered for this
            # forward (a tied weight is released after the embedding's forward, before the loss).
            weight, bias = own["weight"], own.get("bias")
            return (weight, bias) if zero3_ready(self.module, weight, bias) else None
        weight, bias = head.weight, head.bias
        if _is_local(weight) and _is_local(bias):
            return (weight, bias) if weight.numel() > 0 else None
        if not (self.module.training and torch.is_grad_enabled()):
            return None  # evaluation, generation: lm_head's own forward gathers what it needs
        return _gathered_dtensor_params(head)

    def _backbone(self, args, kwargs):
        backbone = getattr(self.module, self.module.base_model_prefix)
        with self._token_ids_explained(args, kwargs):
            out = backbone(*args, **kwargs)
        return out, (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0])

    def _flat_inputs(self, hidden, labels, shift_labels, weight, fp32=False):
        y, shape = self._flat_labels(labels, shift_labels, weight.device)
        h, weight = self._flat_hidden(hidden, weight, fp32)
        return h, y, weight, shape

    @staticmethod
    def _flat_labels(labels, shift_labels, device):
        """The shifted labels, flat on the head's device, and their [batch, seq] shape."""
        if shift_labels is None:
            # HF's shift: pad the labels with one ignored position instead of slicing the hidden states.
            labels = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        else:
            labels = shift_labels
        return labels.reshape(-1).to(device), labels.shape

    @staticmethod
    def _flat_hidden(hidden, weight, fp32=False):
        h = hidden.reshape(-1, hidden.shape[-1])
        if h.device != weight.device:
            h = h.to(weight.device)
        if fp32:
            h, weight = h.float(), weight.float()
        # Match the stock lm_head under autocast: its matmul runs in the autocast dtype. An fp32 (master)
        # weight goes in as it is: the kernels read its 16-bit copy for the products and return its
        # gradient in fp32 (the accumulator itself: no bf16 dW, no upcast of it by autograd).
        elif torch.is_autocast_enabled(h.device.type):
            dt = torch.get_autocast_dtype(h.device.type)
            h = h.to(dt)
            if not master_weight(h, weight):
                weight = weight.to(dt)
        elif h.dtype != weight.dtype:
            h = h.to(weight.dtype)
        return h, weight

    def _call_stock(self, args, kwargs, labels, shift_labels, num_items_in_batch):
        for name, value in (("labels", labels), ("shift_labels", shift_labels),
                            ("num_items_in_batch", num_items_in_batch)):
            if value is not None:
                kwargs[name] = value
        with self._token_ids_explained(args, kwargs):
            return self.stock(*args, **kwargs)

    @contextlib.contextmanager
    def _token_ids_explained(self, args, kwargs):
        """Re-raise the embedding's IndexError for an out-of-range input id as a ``TokenIdError``
        with the details. The ids are read only after a failure: the normal path pays nothing."""
        try:
            yield
        except (IndexError, RuntimeError) as err:
            detail = out_of_range_token(kwargs.get("input_ids", args[0] if args else None),
                                        self.module.get_input_embeddings())
            if detail is None:
                raise
            raise TokenIdError(detail) from err

    def _warn_if_all_ignored(self, stats: LabelSummary) -> None:
        # Reads the count the loss reads anyway (started at the top of the forward: no sync of its own).
        if self._warned_all_ignored or stats.valid():
            return
        self._warned_all_ignored = True
        logger.warning("fasttune: a training batch has no label to learn from (every label is %d): its loss is "
                       "0.0 with zero gradients, where a stock mean loss gives NaN. This usually means "
                       "truncation (max_length) cut every completion, or the prompt/assistant mask covers "
                       "the whole sequence. Warned once.", IGNORE_INDEX)

    def _stock_reason(self, fused_lm_head, has_labels, params, kwargs) -> str:
        """Why this call runs the forward below ours (the run-time counts; stock path only)."""
        weight = None if params is None else params[0]
        if fused_lm_head and has_labels:
            moe_aux = kwargs.get("output_router_logits") or getattr(self.module.config, "output_router_logits", False)
            if not self.fused_logprobs:
                why = "FastConfig.fused_logprobs is off"
            elif moe_aux:
                why = "MoE router logits asked (aux loss)"
            elif weight is None or weight.dtype not in _KERNEL_DTYPES:
                why = _weight_reason(weight)
            else:
                why = "TRL's temperature and outputs unknown here"
            return f"fused_lm_head call left to TRL's head: {why}"
        if not has_labels:
            return "no labels (generation, or a forward without loss)"
        if not self.module.training:
            return "eval mode (logits computed)"
        if self.return_logits:
            return "FastConfig.return_logits asks for logits"
        if weight is None or weight.dtype not in _KERNEL_DTYPES:
            return _weight_reason(weight)
        return "logits_to_keep asks for logits"

    # -- forward ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.autocast is None:
            return self._forward(*args, **kwargs)
        with self.autocast():  # the mixed precision the wrapper below ours would have run this call in
            return self._forward(*args, **kwargs)

    def _forward(self, *args, labels=None, shift_labels=None, num_items_in_batch=None,
                 fused_lm_head=False, **kwargs):
        params = self._head_params()
        has_labels = labels is not None or shift_labels is not None
        if fused_lm_head and has_labels and self._answers_fused(params, kwargs):
            self.count()
            return self._trl_fused(args, kwargs, labels, shift_labels, num_items_in_batch, params)
        if fused_lm_head:
            kwargs["fused_lm_head"] = True  # let TRL's own head (if installed) answer
        fused = (has_labels and params is not None and params[0].dtype in _KERNEL_DTYPES
                 and self.module.training and not self.return_logits
                 and not fused_lm_head and kwargs.get("logits_to_keep", 0) in (0, None))
        if not fused:
            if fused_lm_head or not self.over_fasttune_head:  # else the head below counts the call
                self.count(self._stock_reason(fused_lm_head, has_labels, params, kwargs))
            return self._call_stock(args, kwargs, labels, shift_labels, num_items_in_batch)
        self.count()
        kwargs.pop("logits_to_keep", None)
        router_aux = router_logits_wanted(self.module, kwargs)  # None: not a mixture of experts
        if router_aux is not None:
            kwargs["output_router_logits"] = router_aux
        weight, bias = params
        y, _ = self._flat_labels(labels, shift_labels, weight.device)
        # The count the head needs on the host, queued before the layers: read there without stalling.
        stats = LabelSummary(y, IGNORE_INDEX)
        outputs, hidden = self._backbone(args, kwargs)
        h, weight = self._flat_hidden(hidden, weight)
        self._warn_if_all_ignored(stats)
        with scratch_pool(*self._idle_graph_pool(h.device)):
            loss = fused_linear_cross_entropy(
                h, weight, y, bias, ignore_index=IGNORE_INDEX, num_items_in_batch=num_items_in_batch,
                label_smoothing=self.label_smoothing, softcap=self.extras.softcap,
                logit_scale=self.extras.logit_scale, workspace_mib=self.workspace_mib, label_stats=stats,
            )
        common = dict(logits=None, hidden_states=getattr(outputs, "hidden_states", None),
                      attentions=getattr(outputs, "attentions", None))
        if router_aux is None:
            result = CausalLMOutputWithPast(loss=loss, **common)
        else:
            aux = None
            if router_aux:
                mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
                loss, aux = add_router_aux(self.module, loss, outputs, mask)
            result = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, router_logits=getattr(
                outputs, "router_logits", None), **common)
        setattr(result, _CACHE_FIELD, getattr(outputs, _CACHE_FIELD, None))
        return result

    # -- TRL's fused-LM-head protocol ----------------------------------------------------------
    def _answers_fused(self, params, kwargs) -> bool:
        moe_aux = kwargs.get("output_router_logits") or getattr(self.module.config, "output_router_logits", False)
        if params is None or params[0].dtype not in _KERNEL_DTYPES or not self.fused_logprobs or moe_aux:
            return False  # MoE aux loss, wrapped head, float64 or option off: TRL's head (if any) answers
        if self.trl_settings is not None or not provides_fused_head(self.stock):
            return True  # configured, or nobody configured another temperature: TRL's defaults
        if not self._warned_delegation:
            self._warned_delegation = True
            logger.warning("fasttune: TRL's own fused LM head answers fused_lm_head=True calls: its temperature "
                           "and outputs are unknown here. Use FastSFTTrainer/FastDPOTrainer/FastGRPOTrainer or "
                           "FastPatchCallback to serve them with fasttune's kernel.")
        return False

    def _idle_graph_pool(self, device: torch.device) -> tuple:
        """(pool, stream) of the CUDA graphs the model's checkpointed layers replay (``checkpoint_forward_graphs``),
        idle while the head runs: the head's workspace (~0.3 GiB of logits per chunk) takes the pool's free
        blocks instead of adding to the main pool's peak (``kernels/scratch_pool.py``). (None, None) without, or
        where the head computes on another device than the layers' graphs (a model split over GPUs)."""
        state = layer_checkpointing(self.module)
        graphs = None if state is None else state.graphs
        pool, stream = (None, None) if graphs is None else graphs.scratch
        return (pool, stream) if stream is not None and stream.device == device else (None, None)

    def _trl_fused(self, args, kwargs, labels, shift_labels, num_items_in_batch, params):
        settings = self.trl_settings or TrlHeadSettings()
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        _, hidden = self._backbone(args, kwargs)
        weight, bias = params
        h, y, weight, shape = self._flat_inputs(hidden, labels, shift_labels, weight, fp32=settings.fp32_head)
        if bias is not None:
            bias = bias.to(weight.dtype)
        with scratch_pool(*self._idle_graph_pool(h.device)):
            fields = fused_lm_head_fields(h, y, weight, bias, settings, softcap=self.extras.trl_softcap,
                                          logit_scale=self.extras.logit_scale, workspace_mib=self.workspace_mib)
        # TRL's per-token fields cover the seq-1 predicted positions (the padded last one is dropped).
        keep = slice(None, -1) if shift_labels is None else slice(None)
        per_token = {k: None if v is None else v.view(shape)[..., keep] for k, v in fields.items()}
        mask = (y != IGNORE_INDEX).view(shape)[..., keep]
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedLMHeadOutput(loss=-per_token["log_probs"].sum() / denom, label_mask=mask, **per_token)


# -- the lm_head's parameters under DDP, FSDP2 and ZeRO-3 (for _head_params) ---------------------
def _fsdp_module_class():
    """torch's FSDP2 ``FSDPModule``, or None when torch is built without torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _is_linear(head) -> bool:
    """A plain ``nn.Linear``, also once ``fully_shard(lm_head)`` made it ``FSDPLinear(FSDPModule, nn.Linear)``."""
    if type(head) is nn.Linear:
        return True
    fsdp = _fsdp_module_class() if isinstance(head, nn.Linear) else None
    return fsdp is not None and type(head).__bases__ == (fsdp, nn.Linear)


def _weight_reason(weight) -> str:
    """Why the lm_head weight keeps a call stock (``_head_params`` gave None, or a dtype the kernels lack)."""
    if weight is None:
        return "lm_head weight not usable whole here (wrapped, quantised or sharded)"
    return f"lm_head weight is {str(weight.dtype).replace('torch.', '')}"


class TokenIdError(ValueError, IndexError):
    """An input id outside the embedding (an IndexError too, like stock's error, for old handlers)."""


def out_of_range_token(input_ids, embedding: nn.Module) -> str | None:
    """The message for the first input id outside ``embedding``'s rows, or None when all are inside
    (or they cannot be read: not a CPU integer tensor; after a CUDA device-side assert nothing can)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_cuda or input_ids.is_floating_point():
        return None
    vocab = getattr(embedding, "num_embeddings", None) or getattr(embedding, "weight", torch.empty(0)).shape[0]
    bad = (input_ids < 0) | (input_ids >= vocab)
    if not vocab or not bool(bad.any()):
        return None
    first = tuple(bad.nonzero()[0].tolist())
    where = f"(batch {first[0]}, position {first[1]})" if len(first) == 2 else f"index {first}"
    return (f"input_ids: token id {int(input_ids[first])} at {where} is outside the embedding's {vocab} rows "
            f"(valid ids 0..{vocab - 1}); {int(bad.sum())} id(s) of this batch are out of range. A tokenizer "
            "with added tokens needs model.resize_token_embeddings(len(tokenizer)).")


def _is_local(t) -> bool:
    """None, or a tensor whose data is a plain ``torch.Tensor`` (not a DTensor shard)."""
    return t is None or type(t.data) is torch.Tensor


def _gathered_dtensor_params(head: nn.Module):
    """(weight, bias) of an lm_head holding DTensor shards, whole for this forward; None if not possible.

    An FSDP2 unit is unsharded as its own forward would do it (the mixed-precision policy's
    param_dtype reaches the kernel); its post-backward, which the root's final callback runs for a
    unit whose forward did not, reduce-scatters the gradient and reshards. A DTensor that stays
    sharded (a tied weight of another unit, tensor parallelism) is gathered with ``full_tensor``;
    its gradient is averaged over the ranks and scattered back to the shards, FSDP's reduction.
    """
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return None
    if isinstance(head, fsdp):
        head.unshard()
    from torch.distributed.tensor import DTensor, Partial

    def whole(t):
        if isinstance(t, DTensor):
            return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)
        return t

    weight, bias = whole(head.weight), whole(head.bias)
    return (weight, bias) if _is_local(weight) and _is_local(bias) else None


def patch_head(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig, report: PatchReport) -> None:
    """Install the fused-loss forward on the causal-LM instance, or record why not."""
    if not config.cross_entropy:
        return
    where = type(base).__name__
    expected = classes.get("causal_lm_class")
    if expected is None or type(base) is not expected:
        report.fallback("cross_entropy", where, f"expected {spec.causal_lm_class}; the loss stays stock")
        return
    stock = stock_forward(base)
    if not signature_has(type(base).forward, "labels"):
        report.fallback("cross_entropy", where, "forward takes no `labels` in this transformers version")
        return
    if not _is_linear(base.get_output_embeddings()):
        report.fallback("cross_entropy", where,
                        f"lm_head is {type(base.get_output_embeddings()).__name__}, not a plain nn.Linear")
        return
    if getattr(base.config, "logit_scale", None) not in (None, 1, 1.0) and spec.logit_divisor_attr is None:
        report.fallback("cross_entropy", where, "config.logit_scale is not modelled for this family")
        return
    swap_forward(base, FusedLossCausalLMForward(base, stock, HeadExtras.from_config(spec, base.config), config), report)
    report.add("cross_entropy", counted=True)


def head_forward(model: nn.Module) -> FusedLossCausalLMForward | None:
    """The installed fused-loss forward of a patched model, if any."""
    fwd = model.__dict__.get("forward")
    return fwd if isinstance(fwd, FusedLossCausalLMForward) else None


def configure_trl_head(base: nn.Module, settings: TrlHeadSettings | None) -> bool:
    """Tell the fused-loss forward of ``base`` (a ``*ForCausalLM``) what TRL configured its head
    with. False when fasttune's head is not the outermost forward of ``base``."""
    head = head_forward(base)
    if head is None:
        return False
    head.trl_settings = settings
    return True


def install_trl_head(base: nn.Module, settings: TrlHeadSettings, config: FastConfig, report: PatchReport,
                     autocast=None) -> bool:
    """Put fasttune's head back on top after TRL wrapped it (TRL adds its fused head after a
    callback's ``on_init_end``): a new fused-loss forward over TRL's, configured with ``settings``,
    its undo registered on ``report``. Only where ``patch_model`` had installed the head.

    Args:
        base: the ``*ForCausalLM``.
        settings: what TRL configured its head with.
        config: fasttune's options.
        report: the model's report (its undo list, its run-time counts).
        autocast: None when ``base.forward`` is TRL's head itself. When it is a mixed-precision
            wrapper around TRL's head (accelerate's; ``hf_integration`` recognises it), a callable
            returning the wrapper's autocast context: fasttune's head goes over the wrapper and
            runs every call under that context, as the call would have run below it.

    Returns:
        True when fasttune's head answers ``fused_lm_head=True`` calls of ``base`` afterwards.
    """
    if configure_trl_head(base, settings):
        return True
    current = base.__dict__.get("forward")
    spec = family_for(getattr(base.config, "model_type", None))
    trl_below = autocast is not None or provides_fused_head(current)
    if spec is None or not report.patched["cross_entropy"] or not trl_below:
        return False
    head = FusedLossCausalLMForward(base, current, HeadExtras.from_config(spec, base.config), config)
    head.trl_settings = settings
    head.autocast = autocast
    head.over_fasttune_head = True  # TRL's head wrapped the one patch_model installed
    swap_forward(base, head, report)
    return True


__all__ = ["FusedLMHeadOutput", "FusedLossCausalLMForward", "HeadExtras", "TrlHeadSettings", "configure_trl_head",
           "head_forward", "install_trl_head", "patch_head"]
