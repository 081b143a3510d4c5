"""A checkpointed layer's backward replayed from a CUDA graph (opt-in, with the forward's graphs).

``FastConfig.checkpoint_backward_graphs``. With ``checkpoint_forward_graphs`` the forward of each
checkpointed layer is one launch, but its backward (``no_grad_forward.RecomputedLayer.backward``: the
recompute with autograd, then the back-propagation through it) still launches every kernel from
Python, hundreds per layer, and the host's lead from the forward runs out in it (an FP8 8B step
left the compute stream idle ~270 ms of its backward for launches; benchmarks/RESULTS.md). Here that
backward is captured once per layer and layout and replayed:

- captured: the recompute from static copies of the layer input, the output gradients and the other
  arguments, then ``torch.autograd.grad`` of its outputs with respect to the layer input and the
  layer's trainable parameters, copied into static buffers shared by every layer;
- after a replay the parameter gradients are added to ``.grad`` (set where it is None), which is
  what autograd's accumulation does with them: the same numbers, in the same order;
- memory: every capture is in the forward graphs' pool, and every capture's own blocks go back to
  it, so the pool holds the largest of one layer's forward or backward working set, and the main
  pool no longer holds the backward's.

Mixture-of-experts layers are captured too (the routing lives on the device; a Qwen3-MoE matched
eager bit for bit over twelve batches on an H100, ``test_cuda_moe_backward_replays_bitwise``).
Left eager (logged once each): a layout seen fewer than ``WARM_CALLS`` times, dropout in training,
a layer that records tensors for transformers (router logits: ``output_router_logits=True``),
hidden-state shapes beyond the forward graphs' ``MAX_SHAPES`` (a budget the two share), parameters
with gradient hooks (a replay does not run them), an argument whose state a replay would not follow
(``graph_inputs.py``), a backward that builds a graph of its own (``create_graph``), and a capture
that fails.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from .forward_graphs import WARM_CALLS, ForwardGraphs, layer_state, layer_storages
from .graph_inputs import CallInputs, call_inputs

logger = logging.getLogger("fasttune")

_EAGER = "eager"


class _Entry:
    __slots__ = ("graph", "inputs", "d_hidden", "grads", "counts", "storages")

    def __init__(self, graph, inputs, d_hidden, grads, counts, storages):
        self.graph, self.inputs, self.d_hidden, self.grads = graph, inputs, d_hidden, grads
        self.counts, self.storages = counts, storages


def _hooked(p: torch.Tensor) -> bool:
    return bool(getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))


def accumulate(params, grads) -> None:
    """Add ``grads`` to the ``.grad`` of ``params`` as autograd's accumulation would (a copy where it is None)."""
    have = [(p.grad, g) for p, g in zip(params, grads) if g is not None and p.grad is not None]
    if have:
        torch._foreach_add_([a for a, _ in have], [g for _, g in have])
    for p, g in zip(params, grads):
        if g is not None and p.grad is None:
            p.grad = g.clone()


class BackwardGraphs:
    """The backward graphs of one model's checkpointed layers, in the pool of its ``ForwardGraphs``."""

    def __init__(self, forward: ForwardGraphs):
        self.forward = forward
        self.entries: dict = {}
        self.seen: Counter = Counter()
        self.logged: set[str] = set()
        self.captures = self.replays = 0

    def why_eager(self, state: tuple | str, params: list, ctx) -> str | None:
        """Why this call's backward runs eagerly, or None; ``state``: the layer's ``layer_state``."""
        if not ctx.device.type == "cuda" or torch.cuda.is_current_stream_capturing():
            return "not on CUDA"
        if torch.is_grad_enabled():
            return "a backward that records a graph (create_graph=True)"
        if ctx.slots:
            return "the layer records tensors for transformers (router logits)"
        if any(_hooked(p) for p in params):
            return "parameters with gradient hooks (a replay would not run them)"
        return state if isinstance(state, str) else None

    def run(self, ctx, hidden: torch.Tensor, grads: tuple, recompute):
        """The layer's input gradient from a replay of its backward graph, with its parameter gradients added
        to ``.grad``; or ``NotImplemented`` when this call runs eagerly (the caller's path).

        ``recompute(h, grads)`` runs the layer again with autograd on from ``h`` (the caller's recompute, without
        restoring RNG states: no layer that draws random numbers gets here) and returns the (output,
        gradient) pairs to back-propagate."""
        run = ctx.run
        layer, counts = run.layer, run.counts
        params = [p for p in layer.parameters() if p.requires_grad]
        state = layer_state(layer)
        why = self.why_eager(state, params, ctx)
        if why is not None:
            return self._eager(why)
        call_in = call_inputs(run.args, run.kwargs)
        if isinstance(call_in, str):
            return self._eager(call_in)
        grad_list = list(grads)
        own = [hidden, *(g for g in grad_list if g is not None)]
        tensors = own + call_in.tensors
        key = (id(layer), state, ctx.hidden_grad, tuple(g is None for g in grad_list),
               tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in own), call_in.key,
               tuple(map(id, params)), tuple(ctx.autocast), ctx.autocast_cache)
        entry = self.entries.get(key)
        storages = layer_storages(layer)
        if isinstance(entry, _Entry) and entry.storages != storages:
            del self.entries[key]  # parameters moved since the capture: capture again
            self.seen[key], entry = WARM_CALLS, None
        if entry is None:
            self.seen[key] += 1
            if self.seen[key] <= WARM_CALLS:
                return NotImplemented
            if not self.forward.shapes.admit(hidden):
                self.entries[key] = _EAGER
                return self._eager(self.forward.shapes.refusal())
            entry = self._capture(key, run, grad_list, call_in, tensors, params, storages, recompute, ctx)
        if entry == _EAGER:
            return NotImplemented
        for buf, t in zip(entry.inputs, tensors):
            buf.copy_(t)
        entry.graph.replay()
        run.fn.calls += 1  # the recompute has run
        counts.update(entry.counts)
        accumulate(params, entry.grads)
        self.replays += 1
        return None if entry.d_hidden is None else entry.d_hidden.clone()

    def _eager(self, why: str):
        if why not in self.logged:
            self.logged.add(why)
            logger.info("fasttune: checkpointed layers' backward runs eagerly, not from CUDA graphs: %s", why)
        return NotImplemented

    def _capture(self, key, run, grad_list, call_in: CallInputs, tensors, params, storages, recompute, ctx):
        """Capture the recompute and its back-propagation on static copies of the inputs; an entry or ``_EAGER``."""
        fg = self.forward
        inputs = [fg.buffer(("bwd in", i), t) for i, t in enumerate(tensors)]
        for buf, t in zip(inputs, tensors):
            buf.copy_(t)
        rest = iter(inputs[1:])
        static_grads = [None if g is None else next(rest) for g in grad_list]
        static_args, static_kwargs = call_in.rebuild(list(rest))
        fn, calls, args, kwargs = run.fn, run.fn.calls, run.args, run.kwargs
        counts0 = Counter(run.counts)
        graph = torch.cuda.CUDAGraph()
        failed = d_hidden = None
        out_grads: list = []
        try:
            pool_id = fg.capture_pool()
            torch.cuda.synchronize()
            run.args, run.kwargs = static_args, static_kwargs
            with torch.cuda.graph(graph, pool=pool_id, stream=fg.stream, capture_error_mode="thread_local"):
                h = inputs[0].detach().requires_grad_(ctx.hidden_grad)
                pairs = recompute(h, static_grads)
                wrt = ([h] if ctx.hidden_grad else []) + params
                got = torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
                    if pairs else [None] * len(wrt)
                # Into buffers shared by every layer (their layers' gradients are added to .grad before the
                # next replay): the graph's own blocks go back to the pool.
                # A parameter's buffer has its strides, as autograd's accumulation gives .grad.
                got = [None if g is None else fg.buffer(("bwd out", i), t, g.dtype).copy_(g)
                       for i, (g, t) in enumerate(zip(got, wrt))]
                d_hidden = got[0] if ctx.hidden_grad else None
                out_grads = got[1:] if ctx.hidden_grad else got
        except Exception as err:  # noqa: BLE001 - the layout stays eager, the reason logged once
            failed = f"capture failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
        finally:
            run.args, run.kwargs = args, kwargs
        captured = run.counts - counts0  # the capture ran the Python, no kernel: its counts come with each replay
        run.counts.clear()
        run.counts.update(counts0)
        fn.calls = calls
        if failed is not None:
            self._eager(failed)
            self.entries[key] = _EAGER
            return _EAGER
        self.entries[key] = entry = _Entry(graph, inputs, d_hidden, out_grads, captured, storages)
        self.captures += 1
        if self.captures == 1:
            logger.info("fasttune: checkpointed layers' backward replayed from CUDA graphs (their working set in "
                        "the forward graphs' pool)")
        return entry


__all__ = ["BackwardGraphs", "accumulate"]
