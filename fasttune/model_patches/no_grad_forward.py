"""A checkpointed decoder layer whose forward runs without autograd: recorded once, in backward.

``torch.utils.checkpoint(use_reentrant=False)`` runs the layer's forward with autograd on: every
op records a node, every tensor an op saves goes through the checkpoint's pack hook (to be dropped),
and backward's recompute answers each of those hooks again. On a layer of many small launches (a
mixture-of-experts layer: router, sort, gathers, two grouped products, ~70 launches) the host is
then slower than the GPU: 8 Qwen3-30B-A3B layers took 46–69 ms of host time to launch a forward the
GPU ran in ~47 ms, and 79 ms to launch its backward (H200, benchmarks/RESULTS.md).

``RecomputedLayer`` runs the forward under ``no_grad`` (nothing recorded, nothing saved but the
layer input, which the offload hooks around it move to the host) and, in backward, runs the layer
again with autograd on, from the saved input, under the forward's autocast state and RNG state
(dropout masks are the same), then back-propagates the output gradient through that recompute
(``torch.autograd.backward``: parameter gradients accumulate as in any backward; the input's
gradient is returned). The recompute is the same call the non-reentrant checkpoint makes
(``ForwardThenRecompute``'s second call, ``recomputing()`` True), with the same outputs skipped,
so the gradients are those of the graph-recording checkpoint, bit for bit.

On by default for mixture-of-experts families only (``FastConfig.checkpoint_no_grad_forward``): a
dense 8B layer is GPU-bound already, and there it measured the same speed with 0.35 GiB more
reserved (the recompute runs to the layer's output, which the non-reentrant one stops short of).

What transformers records inside the layer (the router logits of the auxiliary loss, attention
weights) leaves the Function as further outputs, so it carries its gradient (``layer_records.py``).
Where the layer keeps the graph-recording checkpoint instead (``why_not``): forward hooks on the
layer's modules (what they capture would carry no gradient), other inputs that need a gradient, the
stashes (they rely on the recorded forward), and multi-process runs (DDP, FSDP and ZeRO-3 hook into
the recorded backward). ``torch.autograd.grad`` cannot follow such a layer: a
gradient through it raises (it would land in ``.grad`` instead of being returned), and the layer's
parameters are not in the recorded graph (torch says so; with ``allow_unused=True`` their gradients
are None). ``FastConfig(checkpoint_no_grad_forward=False)`` records every forward for those uses.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels.backward_follows import backward_follows
from ..kernels.scratch_pool import scratch_pool
from .backward_graphs import BackwardGraphs
from .forward_graphs import ForwardGraphs
from .instance import graphless_training
from .layer_records import LayerRecords
from .report import FUSED

logger = logging.getLogger("fasttune")

OP = "no_grad_forward"
_TRANSFORMERS_HOOK = "output_capturing_hook"  # transformers' recorder: what it records leaves as outputs (layer_records)


def _foreign_hooks(layer: nn.Module) -> bool:
    """Forward hooks on the layer's modules other than transformers' recorder (the layer's own hooks
    run outside the checkpointed call and see its output, which carries the gradient).

    Walks ``_modules`` directly, every call: ``layer.modules()`` builds a generator frame, a name and a
    memo entry per module, 0.6 ms of host time per MoE layer call (~380 modules with PEFT's wrappers)."""
    stack = list(layer._modules.values())
    while stack:
        m = stack.pop()
        if m is None:
            continue
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            if hooks and any(getattr(h, "__name__", "") != _TRANSFORMERS_HOOK for h in hooks.values()):
                return True
        stack.extend(m._modules.values())
    return False


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def why_not(layer: nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why this layer call must record its forward (the graph-recording checkpoint), or None."""
    if _distributed():
        return "a multi-process run (DDP/FSDP/ZeRO-3 hook into the recorded backward)"
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return "another layer input than hidden_states requires grad"
    if _foreign_hooks(layer):
        return "forward hooks on the layer's modules (what they capture would carry no gradient)"
    return None


def _autocast_state(device_type: str) -> list[tuple]:
    kinds = {device_type, "cpu"}
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in sorted(kinds)]


class _Autocast:
    """Re-enters the autocast state captured by ``_autocast_state``."""

    def __init__(self, state, cache_enabled: bool):
        self.contexts = [torch.autocast(device_type=k, dtype=dtype, enabled=on, cache_enabled=cache_enabled)
                         for k, on, dtype in state]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


class RecomputedLayer(torch.autograd.Function):
    """forward(run, hidden, anchor): ``run(hidden)`` without autograd; backward recomputes it with
    autograd and back-propagates. ``anchor``: a tensor that requires grad, so the output does even
    when ``hidden`` does not (layer 0 under frozen embeddings: its LoRA still trains)."""

    @staticmethod
    def forward(ctx, run, hidden, anchor):
        ctx.run = run
        ctx.hidden_grad = hidden.requires_grad
        ctx.device = hidden.device
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        records = LayerRecords()
        with graphless_training():
            out = run(hidden) if run.graphs is None else run.graphs.run(run, hidden, run.layer, run.counts)
        ctx.save_for_backward(hidden)
        # What transformers recorded inside the layer (router logits) leaves as outputs too, so it
        # carries a gradient; the recompute records it again (layer_records.py).
        ctx.slots = records.new_slots()
        run.single, run.records, run.slots = isinstance(out, torch.Tensor), records, ctx.slots
        flat = (out,) if run.single else tuple(out)
        run.n_out = len(flat)
        return (*flat, *records.get(ctx.slots))

    @staticmethod
    def backward(ctx, *grads):
        check = getattr(torch.autograd, "_is_checkpoint_valid", None)
        if check is not None and not check():
            raise RuntimeError("fasttune's checkpointed layers recompute in backward and back-propagate there, "
                               "which torch.autograd.grad (or backward(inputs=...)) cannot follow; use "
                               "loss.backward(), or FastConfig(checkpoint_no_grad_forward=False)")
        (hidden,) = ctx.saved_tensors
        graphs = ctx.run.graphs.backward if ctx.run.graphs is not None else None
        if graphs is not None:
            d_hidden = graphs.run(ctx, hidden, grads, lambda h, g: _recompute(ctx, h, g, replayable=True))
            if d_hidden is not NotImplemented:
                return None, d_hidden, None
        h = hidden.detach().requires_grad_(ctx.hidden_grad)
        pairs = _recompute(ctx, h, grads)
        if pairs:
            pool = ctx.run.graphs.scratch if ctx.run.graphs is not None else (None,)
            with scratch_pool(*pool):  # with CUDA graphs: the backward's temporaries may use their idle pool
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return None, (h.grad if ctx.hidden_grad else None), None


def _recompute(ctx, h: torch.Tensor, grads: tuple, replayable: bool = False) -> list[tuple]:
    """Run ``ctx``'s layer again from ``h`` with autograd on, under its forward's autocast state (and RNG
    states, unless ``replayable``: a CUDA graph's capture, which no layer drawing random numbers reaches);
    the (output, gradient) pairs to back-propagate."""
    devices = [ctx.device] if ctx.cuda_rng is not None and not replayable else []
    records = LayerRecords()
    with torch.random.fork_rng(devices=devices, enabled=not replayable), \
            records.recording({k for k, _ in ctx.slots}) as fresh:
        if not replayable:
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
        # Both callers back-propagate through what this records at once (kernels/backward_follows.py).
        with torch.enable_grad(), _Autocast(ctx.autocast, ctx.autocast_cache and not replayable), backward_follows():
            out = ctx.run(h)
    recorded = [fresh[k][i] if i < len(fresh.get(k, ())) else None for k, i in ctx.slots]
    if any(t is None for t in recorded):
        raise RuntimeError("a checkpointed layer's recompute recorded fewer outputs than its forward "
                           f"({ctx.slots}); FastConfig(checkpoint_no_grad_forward=False) records the forward")
    outs = ((out,) if isinstance(out, torch.Tensor) else tuple(out)) + tuple(recorded)
    return [(t, g) for t, g in zip(outs, grads) if isinstance(t, torch.Tensor) and g is not None and t.requires_grad]


def forward_graphs(config) -> ForwardGraphs | None:
    """A model's CUDA graphs of these forwards (``FastConfig.checkpoint_forward_graphs``), with those of their
    backward (``checkpoint_backward_graphs``) as its ``backward``; or None."""
    if not config.checkpoint_forward_graphs:
        return None
    graphs = ForwardGraphs()
    if config.checkpoint_backward_graphs:
        graphs.backward = BackwardGraphs(graphs)
    return graphs


class LayerCall:
    """The layer call ``RecomputedLayer`` runs: ``fn(hidden, *args, **kwargs)``, with ``fn`` a
    ``ForwardThenRecompute`` (its first call is the forward, the next the recompute)."""

    def __init__(self, fn, args: tuple, kwargs: dict, graphs=None, layer=None, counts=None):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.graphs, self.layer, self.counts = graphs, layer, counts  # forward_graphs.py, when on
        self.single, self.n_out, self.records, self.slots = True, 1, None, []  # set by the forward

    def __call__(self, hidden):
        return self.fn(hidden, *self.args, **self.kwargs)


_ANCHORS: dict[torch.device, torch.Tensor] = {}


def anchor(device: torch.device) -> torch.Tensor:
    """An empty tensor that requires grad (one per device)."""
    t = _ANCHORS.get(device)
    if t is None:
        t = _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return t


def chosen(fwd, stashed: bool, args: tuple, kwargs: dict) -> bool:
    """Run this call of ``fwd`` (a ``checkpointing.CheckpointedLayerForward``) without autograd? Where
    its model has the option on, counted in ``fwd.calls`` under ``OP``: fused, or why the layer records
    its forward (logged once per reason and model)."""
    state = fwd.state
    if not state.no_grad_forward:
        return False
    why = "the attention/experts stash rely on the recorded forward" if stashed else why_not(fwd.module, args, kwargs)
    fwd.calls[OP, why or FUSED] += 1
    if why is not None and why not in state.logged:
        state.logged.add(why)
        logger.info("fasttune: checkpointed layers record their forward: %s", why)
    return why is None


def run_without_graph(fn, hidden: torch.Tensor, args: tuple, kwargs: dict, layer: nn.Module | None = None,
                      graphs=None, counts=None):
    """``fn(hidden, *args, **kwargs)`` through ``RecomputedLayer``. Its output requires grad even where
    ``hidden`` does not when ``layer`` has parameters that do (layer 0 under frozen embeddings).
    ``graphs``: the model's ``forward_graphs.ForwardGraphs`` (the forward replayed from a CUDA graph),
    with ``counts``, the report's call counter; None: eager."""
    call = LayerCall(fn, args, kwargs, graphs if layer is not None else None, layer, counts)
    if not hidden.requires_grad and not (layer is not None and any(p.requires_grad for p in layer.parameters())):
        with torch.no_grad():
            return call(hidden)
    outputs = RecomputedLayer.apply(call, hidden, anchor(hidden.device))
    call.records.replace(call.slots, outputs[call.n_out:])  # the collector gets the tensors that carry grad
    call.records = None
    return outputs[0] if call.single else tuple(outputs[:call.n_out])


__all__ = ["OP", "RecomputedLayer", "chosen", "forward_graphs", "run_without_graph", "why_not"]
