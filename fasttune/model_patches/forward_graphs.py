"""A checkpointed layer's forward without autograd, replayed from a CUDA graph (opt-in).

``FastConfig.checkpoint_forward_graphs``. A layer run by ``no_grad_forward.RecomputedLayer`` does
nothing in its forward but compute its output: no graph is recorded, nothing is saved but its input.
That forward can then be captured once as a CUDA graph and replayed: one launch instead of a mixture-
of-experts layer's ~70 and the Python around them. The host then reaches the backward ~40 ms ahead of
the GPU on 8 Qwen3-30B-A3B layers and keeps it busy to the end (H200: 119.9 → 97.5 ms/step on a host
that could not keep up, 102.0 → 97.3 on one that could; benchmarks/RESULTS.md). The price: the graphs'
memory pool keeps one layer's forward working set reserved for the whole step (0.67 GiB there); the
experts' backward takes its temporaries from that pool, idle by then (``kernels/scratch_pool.py``).

What a replay must reproduce, and how:
- the same computation: a graph per layer and per *layout*: the input tensors' shapes, dtypes and
  devices, the other arguments (by ``repr``), autocast's state, and the Python state that steers the
  layer's code: every module's ``training`` flag and PEFT's adapter switches (disabled, active
  adapter, merged). Another layout is captured anew; a layer whose parameters or buffers moved
  (re-homed, ``.to()``) is captured again, the old graph dropped.
- the same inputs: copied into static buffers before each replay; the output is copied out. Every
  tensor the call reads counts, a flex ``BlockMask``'s and its mask function's closure's included
  (``graph_inputs.py``: transformers builds a new mask every forward).
- what the Python of the call leaves behind: fasttune's call counts of the layer's ops (the capture's
  counts are added again at each replay), the forward's fused-LoRA decisions that its recompute reuses
  (``layer_call.layer_memo``), and the forward's place in its ``ForwardThenRecompute``.
- Left eager: dropout with p > 0 in training (its random numbers are the recompute's to repeat; an
  ``nn.Dropout`` or a ``*dropout`` probability attribute, ``draws_dropout``), a layer whose call
  records tensors for transformers (router logits under ``output_router_logits``: a replay would not
  record them), an argument whose state a replay would not follow (an object other than tensors,
  plain values, functions and a ``BlockMask``), a layout seen fewer than ``WARM_CALLS`` times (Triton
  compiles and autotunes on the first calls), hidden-state shapes beyond the first ``MAX_SHAPES`` (each
  shape keeps its static buffers and captures), and a capture that fails (logged once, with the
  reason). CPU tensors never take graphs.
"""

from __future__ import annotations

import logging
import numbers
from collections import Counter

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .graph_inputs import CallInputs, call_inputs
from .layer_records import LayerRecords

logger = logging.getLogger("fasttune")

WARM_CALLS = 2  # eager calls of a layout before its capture
MAX_SHAPES = 8  # hidden-state shapes (batch x length) a model's graphs are captured for; further shapes stay eager
_EAGER = "eager"  # an entry for a layout that stays eager


class ShapeBudget:
    """The hidden-state layouts a model's graphs were captured for, at most ``limit``. Each new one costs its own
    static buffers and a capture per layer, so batches padded to ever new lengths would grow memory without end;
    past the limit a new layout stays eager (logged once: pad to a few lengths, ``pad_to_multiple_of``)."""

    def __init__(self, limit: int = MAX_SHAPES):
        self.limit, self.layouts = limit, set()

    def admit(self, hidden: torch.Tensor) -> bool:
        """May a graph be captured for ``hidden``'s layout (already admitted, or room for one more)?"""
        layout = (tuple(hidden.shape), hidden.stride(), hidden.dtype, hidden.device)
        if layout in self.layouts:
            return True
        if len(self.layouts) >= self.limit:
            return False
        self.layouts.add(layout)
        return True

    def refusal(self) -> str:
        return (f"more than {self.limit} hidden-state shapes (batch x sequence length): new ones run eagerly (each "
                "keeps its own buffers and captures); pad batches to a few lengths (pad_to_multiple_of)")


def draws_dropout(m: nn.Module) -> bool:
    """Does ``m`` apply dropout with p > 0 when training: an ``nn.Dropout``, or a probability the module's own
    forward passes to ``nn.functional.dropout`` from a number attribute named ``*dropout*`` (``attention_dropout``;
    Seed-OSS's ``residual_dropout``, ``FamilySpec.output_dropout_attr``)?"""
    if isinstance(m, nn.Dropout):
        return m.p > 0
    return any("dropout" in name and isinstance(p, numbers.Real) and not isinstance(p, bool) and p > 0
               for name, p in m.__dict__.items())


def layer_state(layer: nn.Module) -> tuple | str:
    """The Python state that steers ``layer``'s forward, as a hashable tuple; or why it must stay eager."""
    state, stack = [], [layer]
    while stack:
        m = stack.pop()
        if m is None:
            continue
        if m.training and draws_dropout(m):
            return "dropout in training (its random numbers are the recompute's to repeat)"
        if "lora_A" in m._modules:  # a PEFT LoRA layer: its switches choose the code path
            state.append((m.training, bool(getattr(m, "disable_adapters", False)),
                          tuple(getattr(m, "active_adapters", ()) or ()),
                          tuple(getattr(m, "merged_adapters", ()) or ())))
        else:
            state.append(m.training)
        stack.extend(m._modules.values())
    return tuple(state)


def layer_storages(layer: nn.Module) -> tuple:
    """The data pointers of ``layer``'s parameters and buffers (a capture is stale once they move)."""
    return tuple(t.data_ptr() for t in (*layer.parameters(), *layer.buffers()))


class _Entry:
    __slots__ = ("graph", "inputs", "output", "counts", "memo", "storages")

    def __init__(self, graph, inputs, output, counts, memo, storages):
        self.graph, self.inputs, self.output = graph, inputs, output
        self.counts, self.memo, self.storages = counts, memo, storages


class ForwardGraphs:
    """The graphs of one model's checkpointed layers, in one memory pool (replays run one at a time)."""

    def __init__(self):
        self.entries: dict = {}
        self.seen: Counter = Counter()
        self.buffers: dict = {}
        self.pool = self.stream = None
        self.logged: set[str] = set()
        self.captures = self.replays = 0
        self.shapes = ShapeBudget()  # shared with the backward's graphs
        self.backward = None  # backward_graphs.BackwardGraphs of the same layers, when on

    def run(self, call, hidden: torch.Tensor, layer: nn.Module, counts: Counter):
        """``call(hidden)`` (a ``no_grad_forward.LayerCall`` whose function has not run yet), replayed
        from ``layer``'s graph where one fits, else eager. ``counts``: the report's call counter, which
        the layer's ops count into."""
        if not hidden.is_cuda or torch.cuda.is_current_stream_capturing():
            return call(hidden)
        state = layer_state(layer)
        if isinstance(state, str):
            return self._eager(call, hidden, state)
        if LayerRecords().start:  # transformers collects outputs (router logits) in this forward
            return self._eager(call, hidden, "the layer records tensors for transformers (router logits): "
                                             "a replay would not")
        inputs = call_inputs(call.args, call.kwargs)
        if isinstance(inputs, str):
            return self._eager(call, hidden, inputs)
        tensors = [hidden, *inputs.tensors]
        key = (id(layer), state, (tuple(hidden.shape), hidden.stride(), hidden.dtype, hidden.device), inputs.key,
               torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        entry = self.entries.get(key)
        if isinstance(entry, _Entry) and entry.storages != layer_storages(layer):
            del self.entries[key]  # parameters moved since the capture: capture again
            self.seen[key], entry = WARM_CALLS, None
        if entry is None:
            self.seen[key] += 1
            if self.seen[key] <= WARM_CALLS:
                return call(hidden)
            if not self.shapes.admit(hidden):
                self.entries[key] = _EAGER
                return self._eager(call, hidden, self.shapes.refusal())
            entry = self._capture(key, call, layer, inputs, tensors, counts)
        if entry == _EAGER:
            return call(hidden)
        for buf, t in zip(entry.inputs, tensors):
            buf.copy_(t)
        entry.graph.replay()
        call.fn.calls += 1  # the forward has run: the function's next call is the recompute
        call.fn.memo.update(entry.memo)
        counts.update(entry.counts)
        self.replays += 1
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.output)

    @property
    def scratch(self):
        """(pool, stream) a layer's backward may take its temporaries from (``kernels.scratch_pool``): the
        graphs' MemPool and capture stream once something was captured; else (None, None)."""
        return (self.pool, self.stream) if self.captures and hasattr(self.pool, "id") else (None, None)

    def _eager(self, call, hidden, why: str):
        self._log(why)
        return call(hidden)

    def _log(self, why: str) -> None:
        if why not in self.logged:
            self.logged.add(why)
            logger.info("fasttune: checkpointed layers' forward runs eagerly, not from CUDA graphs: %s", why)

    def buffer(self, name, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A static tensor with the shape and strides of ``like`` (its dtype, or ``dtype``) under ``name``,
        shared by every graph that asks for it."""
        key = (name, tuple(like.shape), like.stride(), dtype or like.dtype, like.device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty_strided(like.shape, like.stride(), dtype=key[3], device=like.device)
        return self.buffers[key]

    def capture_pool(self):
        """The pool id every capture of this model uses (the forwards' and ``backward_graphs``'), made on first
        use with ``self.stream``, the one stream they are all captured on (its freed blocks are that stream's)."""
        if self.pool is None:
            # A MemPool, so that a layer's backward can take its temporaries from the same blocks
            # (kernels/scratch_pool.py); torch without MemPool: a plain graph pool.
            mempool = getattr(torch.cuda, "MemPool", None)
            self.pool = mempool() if mempool is not None else torch.cuda.graph_pool_handle()
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.pool.id if hasattr(self.pool, "id") else self.pool

    def _capture(self, key, call, layer, call_in: CallInputs, tensors, counts: Counter):
        """Capture ``call`` on static copies of its inputs (nothing runs); an entry, or ``_EAGER``."""
        inputs = [self.buffer(("in", i), t) for i, t in enumerate(tensors)]  # shared by every layer's graph
        for buf, t in zip(inputs, tensors):
            buf.copy_(t)
        static_args, static_kwargs = call_in.rebuild(inputs[1:])
        fn, calls, counts0, memo0 = call.fn, call.fn.calls, Counter(counts), dict(call.fn.memo)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        failed = None
        try:
            autocast = dict(enabled=torch.is_autocast_enabled("cuda"), dtype=torch.get_autocast_dtype("cuda"))
            pool_id = self.capture_pool()
            with torch.cuda.graph(graph, pool=pool_id, stream=self.stream), \
                    torch.autocast("cuda", cache_enabled=False, **autocast):
                out = fn(inputs[0], *static_args, **static_kwargs)
                # Copied into buffers shared by every layer, inside the graph: the graph's own blocks go back
                # to the pool, where the next layer's capture reuses them.
                flat, out_spec = pytree.tree_flatten(out)
                output = pytree.tree_unflatten([self.buffer(("out", i), t).copy_(t) if isinstance(t, torch.Tensor)
                                                else t for i, t in enumerate(flat)], out_spec)
        except Exception as err:  # noqa: BLE001 - the layout stays eager, the reason logged once
            failed = f"capture failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
        # The capture ran the call's Python but no kernel: its counts come back with each replay, and the
        # replay that follows is this call's forward.
        captured = counts - counts0
        counts.clear()
        counts.update(counts0)
        fn.calls = calls
        if failed is not None:
            fn.memo = memo0
            self._log(failed)
            self.entries[key] = _EAGER
            return _EAGER
        self.entries[key] = entry = _Entry(graph, inputs, output, captured, dict(fn.memo), layer_storages(layer))
        self.captures += 1
        if self.captures == 1:
            logger.info("fasttune: checkpointed layers' forward replayed from CUDA graphs (one layer's forward "
                        "working set stays reserved in their pool)")
        return entry


__all__ = ["ForwardGraphs", "MAX_SHAPES", "ShapeBudget", "WARM_CALLS", "draws_dropout", "layer_state", "layer_storages"]
