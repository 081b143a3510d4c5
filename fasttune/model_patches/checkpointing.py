"""Decoder-layer activation checkpointing: ``FastConfig.checkpointing`` = "recompute", "offload" or "auto".

Each decoder layer instance gets a ``CheckpointedLayerForward`` (its instance ``forward``, inside
the module's hooks, so FSDP/PEFT hooks stay outside the recompute). In training mode with
gradients enabled it runs the stock forward in one of three ways:

- resident: as is; every activation stays on the GPU until backward (no checkpointing).
- recompute: ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``:
  only the layer inputs are saved, the layer is recomputed in backward with the CPU and CUDA RNG
  states of the forward restored (dropout masks are the same), under the forward's autocast state.
- offload: the same, with the saved ``hidden_states`` moved to pinned host memory on a side
  stream and prefetched back one layer ahead in backward (``offload.py``). Small inputs (masks,
  cos/sin, position ids) stay as they are.

Recompute and offload run the very same kernels on the very same inputs as the stock forward, so
gradients are bitwise those of an unchecked run wherever the kernels are deterministic. While a
layer is recomputed, ``layer_call.recomputing()`` is True: the recompute's output is thrown away, so the
fused LoRA MLP skips its down projection there (the layer's last GEMM, ~27% of a Llama layer's
recompute FLOPs) in families whose MLP output goes straight into the residual sum (lora.py).
Non-reentrant checkpointing needs no ``enable_input_require_grads`` (LoRA with frozen embeddings
works as is), supports ``torch.autograd.grad`` and DDP without ``static_graph``. MoE families' layers
run their forward without autograd instead, recorded once by the recompute (``no_grad_forward.py``).

"auto" keeps the first ``k`` layers resident and offloads the rest, with ``k`` as large as the
activation budget allows. Decided per forward, at the first decoder layer: the activation memory
of one layer is measured once per input shape/dtype (layer 0 of that forward runs resident under a
saved-tensor meter: bytes of the distinct storages autograd saves, parameters and shared inputs
excluded; on CUDA at least the allocator's growth over the layer, minus its output), then
``k = resident_layers(n, layer_bytes, budget)`` (one layer's worth is reserved for the backward
recompute of the offloaded ones). The budget is ``memory_budget_gb`` (GiB) when set; else the GPU
memory free right now (reusable cached blocks and a per-process memory fraction honoured) minus a
margin, the gradients backward will still allocate, and the loss head's working memory; with no
CUDA and no budget nothing is kept resident. Because the decision is taken again at every forward,
memory that appears later (optimizer states after the first step) shrinks ``k`` automatically.
Each new decision is logged, e.g. "auto: 20/32 layers resident, 12 offloaded (...)".

Hugging Face's own checkpointing is never stacked on top: every module whose
``gradient_checkpointing`` flag is on has it turned off at install (``LayerCheckpointing.reclaim``),
a decoder layer found with it on again at a later forward is turned off with a warning; undo
restores the flags. Like HF, a checkpointed layer gets ``cache=None``/``use_cache=False``
unless its class declares ``_can_checkpoint_with_cache``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import FastConfig
from ..kernels._lce_common import DEFAULT_WORKSPACE_MIB
from ..kernels.forward_reuse import ForwardReuse
from ..kernels.kept_weights import KeptWeights
from .families import FamilySpec
from .instance import PatchedForward, find_causal_lm, stock_forward, swap_forward
from .attention_stash import ATTENTION, EXPERTS, MLP, OUTPUT, StashChain
from .layer_call import ForwardThenRecompute
from . import no_grad_forward
from .offload import OffloadedCheckpointer
from .report import PatchReport

logger = logging.getLogger("fasttune")

OP = "checkpointing"
STATE_ATTR = "_fasttune_checkpointing"
RESIDENT, RECOMPUTE, OFFLOAD = "resident", "recompute", "offload"
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
GIB = 1 << 30
MARGIN_BYTES = 2 * GIB          # allocator fragmentation, cuBLAS workspaces, transient buffers
MARGIN_FRACTION = 0.05          # of the device's total memory, when larger
STOCK_LOSS_BYTES_PER_LOGIT = 12  # bf16 logits + fp32 upcast + fp32 and bf16 gradients (stock HF loss)


def resident_layers(n_layers: int, layer_bytes: int, budget_bytes: int | None, working_bytes: int = 0) -> int:
    """How many layers may keep all their activations within ``budget_bytes``.

    All ``n_layers`` when they fit; otherwise the layers left out are recomputed in backward, which
    needs one more layer's activations at a time, so that much (plus ``working_bytes``) is reserved.

    Raises:
        ValueError: a negative size, or ``n_layers`` < 0.
    """
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    if layer_bytes < 0 or working_bytes < 0:
        raise ValueError(f"layer_bytes and working_bytes must be >= 0, got {layer_bytes}, {working_bytes}")
    if budget_bytes is None or budget_bytes <= 0:
        return 0
    if n_layers * layer_bytes <= budget_bytes:
        return n_layers
    k = (budget_bytes - layer_bytes - working_bytes) // layer_bytes
    return int(max(0, min(n_layers - 1, k)))


@dataclass(frozen=True)
class AutoDecision:
    """What "auto" decided for one forward."""

    resident: int
    n_layers: int
    layer_bytes: int
    budget_bytes: int | None
    shape: tuple
    dtype: torch.dtype

    def __str__(self) -> str:
        budget = "no budget known" if self.budget_bytes is None else f"budget {_size(self.budget_bytes)}"
        return (f"auto: {self.resident}/{self.n_layers} layers resident, {self.n_layers - self.resident} offloaded "
                f"({_size(self.layer_bytes)} per layer at {list(self.shape)} "
                f"{str(self.dtype).replace('torch.', '')}, {budget})")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


class SavedBytesMeter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the distinct storages autograd saves on ``device`` (``exclude``: storage pointers)."""

    def __init__(self, device: torch.device, exclude: set[int]):
        self.device = device
        self.exclude = exclude
        self.seen: set[int] = set()
        self.nbytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if tensor.device == self.device:
            try:
                storage = tensor.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without a plain storage
                ptr, size = id(tensor), tensor.numel() * tensor.element_size()
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.nbytes += size
        return tensor.detach()  # not the tensor itself: a saved output would form a reference cycle

    @staticmethod
    def _unpack(tensor):
        return tensor


class AutoPolicy:
    """The activation budget of "auto" and the per-shape measurements of one layer's activations."""

    def __init__(self, base: nn.Module, n_layers: int, config: FastConfig, head_fused: bool):
        self.base = base
        self.n_layers = n_layers
        self.budget_gb = config.memory_budget_gb
        # The head's largest default workspace when none is set (a trainable head's).
        self.head_workspace = 2 * (config.loss_workspace_mib or DEFAULT_WORKSPACE_MIB) * (1 << 20)
        self.head_fused = head_fused
        self.layer_bytes: dict[tuple, int] = {}
        self.decision: AutoDecision | None = None
        self._param_slots: list[tuple[nn.Module, str]] | None = None
        self.reserved_bytes = 0  # memory promised elsewhere (FSDP2 layers kept gathered until backward)

    def budget_bytes(self, hidden: torch.Tensor) -> int | None:
        """Bytes activations may take now (before layer 0 runs); None when unknown."""
        if self.budget_gb is not None:
            return int(self.budget_gb * GIB)
        if hidden.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(hidden.device)
        allocated, reserved = _allocator_bytes(hidden.device)
        fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction_of is not None:
            free = min(free, max(0, int(fraction_of(hidden.device) * total) - reserved))
        available = free + reserved - allocated
        margin = max(MARGIN_BYTES, int(MARGIN_FRACTION * total))
        return max(0, available - margin - self.reserved_bytes - self._pending_grad_bytes() - self._head_bytes(hidden))

    def _pending_grad_bytes(self) -> int:
        """Gradients backward will allocate (trainable parameters without a .grad yet)."""
        # Walking the module tree (``parameters()``) took ~8 ms of host time per forward on an
        # 8B model, with the GPU idle behind it; the (module, name) slots are listed once and read
        # again each time, so a parameter swapped in later (FSDP2's DTensors) is still seen.
        if self._param_slots is None:
            self._param_slots = [(m, name) for m in self.base.modules() for name in m._parameters]
        total = 0
        for module, name in self._param_slots:
            p = module._parameters.get(name)
            if p is not None and p.requires_grad and p.grad is None:
                total += _local(p).numel() * p.element_size()  # FSDP2: a gradient is the local shard
        return total

    def _head_bytes(self, hidden: torch.Tensor) -> int:
        if self.head_fused:
            return self.head_workspace
        config = getattr(self.base, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", 0) or 0
        return hidden.numel() // hidden.shape[-1] * vocab * STOCK_LOSS_BYTES_PER_LOGIT

    def decide(self, hidden: torch.Tensor, layer_bytes: int, budget: int | None) -> AutoDecision:
        working = 3 * hidden.numel() * hidden.element_size()  # kept-last input, a prefetch, its gradient
        k = resident_layers(self.n_layers, layer_bytes, budget, working)
        decision = AutoDecision(k, self.n_layers, layer_bytes, budget, tuple(hidden.shape), hidden.dtype)
        old = self.decision
        if old is None or (old.resident, old.shape, old.dtype) != (k, decision.shape, decision.dtype):
            logger.info("fasttune: %s", decision)
        self.decision = decision
        return decision


class LayerCheckpointing:
    """Per-model checkpointing state (one per patched model; nothing is shared between models).

    Attributes:
        mode: "recompute", "offload" or "auto".
        n_layers: decoder layers wrapped.
        checkpointer: the ``OffloadedCheckpointer`` (offload and auto).
        stash: the ``StashChain`` of the config's attention/experts/mlp/o_proj stashes (offload and auto), else None.
        policy: the ``AutoPolicy`` (auto only).
        resident: layers [0, resident) run resident in the current forward (auto).
    """

    def __init__(self, mode: str, base: nn.Module, n_layers: int, config: FastConfig, head_fused: bool,
                 moe: bool = False, qk_norm: bool = False):
        self.mode = mode
        self.base = base
        self.n_layers = n_layers
        self.checkpointer = OffloadedCheckpointer() if mode in ("offload", "auto") else None
        ngf = config.checkpoint_no_grad_forward  # None: on for MoE (host-bound), under forward graphs (replayed)
        self.no_grad_forward = (moe or config.checkpoint_forward_graphs) if ngf is None else ngf
        o_proj = not self.no_grad_forward if config.o_proj_stash is None else config.o_proj_stash
        # None: where the layers record their forward, not over FP8 bases (unmeasured), not with q/k norms: their
        # inputs make a core 1.5x Llama's bytes, more than the link carries beside the layer inputs (session 48,
        # Qwen3-8B on an H100: 11,465 tok/s on against 12,198 off, steps of up to 2.7 s pinning host buffers).
        attention = config.attention_stash
        if attention is None:
            attention = not self.no_grad_forward and config.base_dtype != "fp8" and not qk_norm
        kinds = tuple(k for k, on in ((ATTENTION, attention), (EXPERTS, config.experts_stash),
                                      (MLP, config.mlp_stash), (OUTPUT, o_proj)) if on)
        self.stash = StashChain(self.checkpointer, kinds=kinds) if self.checkpointer is not None and kinds else None
        if self.stash is not None:
            self.stash.quantized_outputs = config.o_proj_stash is True  # default: dense bases only (output_stash.py)
        self.policy = AutoPolicy(base, n_layers, config, head_fused) if mode == "auto" else None
        self.resident = 0
        self.keep_nf4 = config.keep_recomputed_nf4
        self.reuse_lora = config.reuse_forward_lora
        self.logged: set[str] = set()  # reasons a layer recorded its forward, logged once each
        self.graphs = no_grad_forward.forward_graphs(config)  # those forwards from CUDA graphs, or None
        self._hf_flags, self._warned = [], False

    @property
    def decision(self) -> AutoDecision | None:
        """The last "auto" decision (None before the first training forward, or in other modes)."""
        return self.policy.decision if self.policy is not None else None

    def how(self, index: int) -> str:
        """How layer ``index`` runs in the current forward: "resident", "recompute" or "offload"."""
        if self.mode == "recompute":
            return RECOMPUTE
        if self.mode == "offload":
            return OFFLOAD
        return RESIDENT if index < self.resident else OFFLOAD

    def reclaim(self) -> int:
        """Turn off HF's ``gradient_checkpointing`` flag on every module of the model; returns how many.

        Done at install; call it again after something ran ``gradient_checkpointing_enable`` (e.g.
        ``Trainer.train`` with ``gradient_checkpointing=True``) to skip the warning of the first forward.
        With no flag left on, ``model.is_gradient_checkpointing`` is False, so TRL's
        generation helpers do not toggle HF's checkpointing back on either.
        """
        n = 0
        for module in self.base.modules():
            if module.__dict__.get("gradient_checkpointing", False):
                self.silence_hf(module, at_install=True)
                n += 1
        return n

    def silence_hf(self, module: nn.Module, at_install: bool) -> None:
        """Turn off HF's checkpointing flag on ``module`` (restored by ``close``); warn if not at install."""
        if not module.__dict__.get("gradient_checkpointing", False):
            return
        module.gradient_checkpointing = False
        if module not in self._hf_flags:
            self._hf_flags.append(module)
        if not at_install and not self._warned:
            self._warned = True
            logger.warning("fasttune: Hugging Face gradient checkpointing was turned on after fasttune's %r "
                           "checkpointing; turning it off on the decoder layers (do not call "
                           "gradient_checkpointing_enable on a patched model).", self.mode)

    def close(self) -> None:
        """Undo: restore HF's flags, release host buffers."""
        for module in self._hf_flags:
            module.gradient_checkpointing = True
        self._hf_flags.clear()
        if self.checkpointer is not None:
            self.checkpointer.close()


class CheckpointedLayerForward(PatchedForward):
    """Replacement ``forward`` of one decoder layer: runs the stock forward resident, recomputed or offloaded."""

    op = OP

    def __init__(self, module: nn.Module, stock, index: int, state: LayerCheckpointing):
        super().__init__(module, stock)
        self.index = index
        self.state = state

    def __call__(self, *args, **kwargs):
        layer, state = self.module, self.state
        if layer.__dict__.get("gradient_checkpointing", False):
            state.silence_hf(layer, at_install=False)
        if not (layer.training and torch.is_grad_enabled()):
            return self.stock(*args, **kwargs)
        if args:
            hidden, args = args[0], args[1:]
        elif "hidden_states" in kwargs:
            kwargs = dict(kwargs)
            hidden = kwargs.pop("hidden_states")
        else:
            return self.stock(*args, **kwargs)
        if not isinstance(hidden, torch.Tensor):
            return self.stock(hidden, *args, **kwargs)
        if state.policy is not None and self.index == 0:
            return self._plan_and_run(hidden, args, kwargs)
        return self.run(state.how(self.index), hidden, args, kwargs)

    def run(self, how: str, hidden: torch.Tensor, args: tuple, kwargs: dict):
        """Run the stock forward ``how`` = "resident", "recompute" or "offload"."""
        if how == RESIDENT:
            return self.stock(hidden, *args, **kwargs)
        kwargs = self._without_cache(kwargs)
        stash = self.state.stash if how == OFFLOAD else None
        fn = ForwardThenRecompute(self.stock, stash.new_layer(self.index, hidden) if stash is not None else None,
                                  KeptWeights() if self.state.keep_nf4 else None,
                                  ForwardReuse() if self.state.reuse_lora else None)
        without_graph, graphs = no_grad_forward.chosen(self, stash is not None, args, kwargs), self.state.graphs
        with self.state.checkpointer.offloading(hidden) if how == OFFLOAD else contextlib.nullcontext():
            if without_graph:
                return no_grad_forward.run_without_graph(fn, hidden, args, kwargs, self.module, graphs, self.calls)
            return checkpoint(fn, hidden, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    def _plan_and_run(self, hidden: torch.Tensor, args: tuple, kwargs: dict):
        """Layer 0 under "auto": decide how many layers stay resident in this forward (measuring if needed)."""
        state, policy = self.state, self.state.policy
        key = (tuple(hidden.shape), hidden.dtype, hidden.device)
        budget = policy.budget_bytes(hidden)
        layer_bytes = policy.layer_bytes.get(key)
        if layer_bytes is not None:
            state.resident = policy.decide(hidden, layer_bytes, budget).resident
            return self.run(state.how(0), hidden, args, kwargs)
        out, layer_bytes = self._measure(hidden, args, kwargs)
        policy.layer_bytes[key] = layer_bytes
        state.resident = policy.decide(hidden, layer_bytes, budget).resident
        return out

    def _measure(self, hidden: torch.Tensor, args: tuple, kwargs: dict):
        """Run resident under a ``SavedBytesMeter``; return (output, activation bytes of this layer)."""
        exclude = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs)) if t is not hidden}
        exclude |= {t.untyped_storage().data_ptr() for t in self.module.parameters()}
        exclude |= {t.untyped_storage().data_ptr() for t in self.module.buffers()}
        cuda = hidden.device.type == "cuda"
        before = _allocator_bytes(hidden.device)[0] if cuda else 0
        meter = SavedBytesMeter(hidden.device, exclude)
        with meter:
            out = self.stock(hidden, *args, **kwargs)
        nbytes = meter.nbytes
        if cuda:
            grown = _allocator_bytes(hidden.device)[0] - before
            grown -= sum(t.numel() * t.element_size() for t in _tensors(out))
            nbytes = max(nbytes, grown)
        return out, nbytes

    def _without_cache(self, kwargs: dict) -> dict:
        """Like HF under checkpointing: a recompute must not write the KV cache a second time."""
        if getattr(self.module, "_can_checkpoint_with_cache", False):
            return kwargs
        drop = [k for k in CACHE_KWARGS if kwargs.get(k) is not None]
        if not drop and not kwargs.get("use_cache"):
            return kwargs
        kwargs = dict(kwargs)
        for k in drop:
            kwargs[k] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        return kwargs


def _allocator_bytes(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes of the caching allocator on ``device``.

    One nested-dict read: ``torch.cuda.memory_allocated`` and ``memory_reserved`` each flatten and
    sort every allocator statistic, ~1 ms of host time apiece, paid at the first decoder layer of
    every "auto" forward while the GPU waits for its first kernels.
    """
    stats = torch.cuda.memory.memory_stats_as_nested_dict(device)
    return tuple(stats.get(key, {}).get("all", {}).get("current", 0) for key in ("allocated_bytes", "reserved_bytes"))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _tensors(obj):
    """The tensors inside nested tuples/lists/dicts (and ModelOutput-like mappings)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def install_checkpointing(base: nn.Module, spec: FamilySpec, classes: dict, config: FastConfig,
                          report: PatchReport) -> None:
    """Wrap every decoder layer of ``base`` for ``config.checkpointing`` (no-op when it is None).

    Runs last among the patchers: it wraps the decoder layer's own forward, whatever the other
    patchers did to its submodules. Records the undo and ``report.add("checkpointing", n_layers)``.
    """
    mode = config.checkpointing
    if mode is None:
        return
    layer_cls = classes.get("decoder_layer_class")
    if layer_cls is None:
        report.fallback(OP, spec.model_type, f"{spec.decoder_layer_class} not found in {spec.modeling_module}; "
                        "no activation checkpointing")
        return
    layers = []
    for name, module in base.named_modules():
        if not isinstance(module, layer_cls):
            continue
        stock = stock_forward(module)
        try:
            first = next(iter(inspect.signature(stock).parameters), None)
        except (TypeError, ValueError):
            first = None
        if first != "hidden_states":
            report.fallback(OP, name, f"forward's first parameter is {first!r}, not 'hidden_states'")
            continue
        layers.append((module, stock))
    if not layers:
        report.fallback(OP, spec.model_type, f"no {spec.decoder_layer_class} module to checkpoint")
        return
    head_fused = report.patched.get("cross_entropy", 0) > 0
    state = LayerCheckpointing(mode, base, len(layers), config, head_fused, moe=spec.moe_block_class is not None,
                               qk_norm=spec.qk_norm is not None)
    report.on_undo(state.close)
    state.reclaim()
    for index, (module, stock) in enumerate(layers):
        swap_forward(module, CheckpointedLayerForward(module, stock, index, state), report)
    base.__dict__[STATE_ATTR] = state
    report.on_undo(lambda: base.__dict__.pop(STATE_ATTR, None))
    report.add(OP, len(layers))
    logger.info("fasttune: checkpointing=%r on %d decoder layers", mode, len(layers))


def layer_checkpointing(model: nn.Module) -> LayerCheckpointing | None:
    """The checkpointing state of a patched model (PEFT/DDP wrappers allowed), or None."""
    return find_causal_lm(model).__dict__.get(STATE_ATTR)


__all__ = ["AutoDecision", "AutoPolicy", "CheckpointedLayerForward", "LayerCheckpointing",
           "SavedBytesMeter", "install_checkpointing", "layer_checkpointing", "resident_layers"]
