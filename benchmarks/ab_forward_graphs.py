"""A/B in one process: checkpointed MoE layers' no-grad forward replayed from CUDA graphs vs launched eagerly.

A question for issue 22, not a feature: on hosts slower than the GPU the MoE step is host-bound, and its
per-phase clocks (docs/FACTS.md) say the host launches the forward in about the GPU's time, then falls
behind in backward. A forward replayed from graphs (one replay per layer instead of ~70 launches and
their Python) would let the host start the backward's launches ~40 ms ahead of the GPU. Does the step
become GPU-bound then? This measures it, on the host as it is and on one made slower on purpose
(``--slow-host``: run the script under ``taskset`` on one core shared with a busy process).

Each checkpointed layer's forward (``no_grad_forward.LayerCall``'s first call, grad off) is captured
once per layer and input layout after two eager calls, with inputs copied into static buffers, every
layer in one shared memory pool, autocast's cast cache off during capture; its output is cloned out of
the graph's buffer. Replays run no Python: fasttune's call counts of the graphed layers stop at the
capture (the script says so), and a layer whose transformers recorder caught tensors (router logits
with ``output_router_logits``) is left eager. Arms alternate step by step (A B B A ...) after a warm-up
that captures. Per arm: median step ms (synchronised), host ms to launch forward and backward, and the
loss of every step (the graphed step must give the eager step's loss: same inputs, same kernels).

Usage (H200, repo root):
    python3 benchmarks/ab_forward_graphs.py --layers 8 --pairs 8 [--out ab.json]
    taskset -c 3 python3 -c "while True: pass" & taskset -c 3 python3 benchmarks/ab_forward_graphs.py ...
    python3 benchmarks/ab_forward_graphs.py --smoke     # tiny model on CPU: the eager arm only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe_step as moe  # noqa: E402
import bench_step as common  # noqa: E402

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402


class ForwardGraphs:
    """Replaces ``LayerCall.__call__`` while installed: the forward call (grad off, the layer's first
    call) of each layer replays its graph when ``on``; everything else runs as before."""

    def __init__(self, layer_call_cls):
        self.cls, self.original = layer_call_cls, layer_call_cls.__call__
        self.on, self.entries, self.seen = False, {}, {}
        self.buffers = {}  # static inputs and outputs, shared by every layer's graph (replays run one at a time)
        self.pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None
        self.captured = self.replays = self.left_eager = 0
        graphs = self

        def call(lc, hidden):
            return graphs(lc, hidden)

        layer_call_cls.__call__ = call

    def __call__(self, lc, hidden):
        if not (self.on and hidden.is_cuda and not torch.is_grad_enabled() and lc.fn.calls == 0):
            return self.original(lc, hidden)
        leaves, spec = pytree.tree_flatten((lc.args, lc.kwargs))
        tensors = [hidden] + [t for t in leaves if isinstance(t, torch.Tensor)]
        others = tuple(repr(v) for v in leaves if not isinstance(v, torch.Tensor))
        key = (id(lc.fn.stock), tuple((tuple(t.shape), t.dtype, t.device) for t in tensors), others,
               torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        entry = self.entries.get(key)
        if entry is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] <= 2:  # eager first: Triton compiles and autotunes, lazy buffers appear
                return self.original(lc, hidden)
            entry = self._capture(key, lc, spec, leaves, tensors)
            if entry is None:
                self.left_eager += 1
                return self.original(lc, hidden)
        elif entry == "eager":
            return self.original(lc, hidden)
        static_in, graph, out, memo = entry
        for s, t in zip(static_in, tensors):
            s.copy_(t)
        graph.replay()
        lc.fn.memo.update(memo)  # the captured forward's decisions, which its recompute reuses
        lc.fn.calls += 1  # the forward ran: the next call of this ForwardThenRecompute is the recompute
        self.replays += 1
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

    def _buffer(self, name, like: torch.Tensor) -> torch.Tensor:
        key = (name, tuple(like.shape), like.dtype, like.device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return self.buffers[key]

    def _capture(self, key, lc, spec, leaves, tensors):
        from fasttune.model_patches.layer_records import LayerRecords
        from fasttune.model_patches.no_grad_forward import LayerCall

        records = LayerRecords()  # what transformers' collector holds before the captured call
        static_in = [self._buffer(("in", i), t) for i, t in enumerate(tensors)]
        for b, t in zip(static_in, tensors):
            b.copy_(t)
        it = iter(static_in[1:])
        static_leaves = [next(it) if isinstance(v, torch.Tensor) else v for v in leaves]
        args, kwargs = pytree.tree_unflatten(static_leaves, spec)
        static_call = LayerCall(lc.fn, args, kwargs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        dtype = torch.get_autocast_dtype("cuda")
        calls = lc.fn.calls
        try:
            with torch.cuda.graph(graph, pool=self.pool), torch.autocast("cuda", dtype=dtype, cache_enabled=False):
                out = self.original(static_call, static_in[0])
                # Copied into shared buffers inside the graph: the graph's own output blocks go back to the
                # pool, which the next layer's capture reuses (one layer's working set for all of them).
                flat, out_spec = pytree.tree_flatten(out)
                flat = [self._buffer(("out", i), t).copy_(t) if isinstance(t, torch.Tensor) else t
                        for i, t in enumerate(flat)]
                out = pytree.tree_unflatten(flat, out_spec)
        except Exception as err:  # noqa: BLE001 - a layer that cannot be captured stays eager, said once
            print(f"capture failed, layer left eager: {type(err).__name__}: {err}"[:300], flush=True)
            lc.fn.calls = calls
            self.entries[key] = "eager"
            return None
        lc.fn.calls = calls  # capture ran no kernel: the replay below is this call's forward
        if records.new_slots():
            self.entries[key] = "eager"  # transformers recorded tensors a replay would not record
            return None
        self.entries[key] = (static_in, graph, out, dict(lc.fn.memo))
        self.captured += 1
        return self.entries[key]


def _one(step: common.Step) -> dict:
    common.sync()
    step.phases, step.clocks = [], []
    t0 = time.perf_counter()
    loss = step()
    common.sync()
    ms = (time.perf_counter() - t0) * 1e3
    phases = step.phase_ms()
    step.phases = None
    host = phases[0]["host"] if phases else [float("nan")] * 3
    return dict(ms=ms, host_forward=host[0], host_backward=host[1] - host[0], loss=float(loss))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(moe.MODELS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shape", default="4x2048", help="batch x sequence")
    p.add_argument("--pairs", type=int, default=8, help="steps per arm (alternating)")
    p.add_argument("--warmup", type=int, default=3, help="graphed warm-up steps (the 3rd captures)")
    p.add_argument("--label", default="", help="a name for this run in the RESULT lines (e.g. slow-host)")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model: checks the script, measures nothing")
    args = p.parse_args(argv)
    margv = ["--model", args.model, "--stacks", "fasttune", "--ckpt-dir", "", "--shapes", args.shape]
    margv += ["--smoke"] if args.smoke else ["--layers", str(args.layers)]
    margs = moe.parse_args(margv)
    b, s = margs.shapes[0]
    if args.smoke:
        args.pairs, args.warmup = 1, 1
    model = moe.prepare("fasttune", margs, print)
    from fasttune.model_patches.no_grad_forward import LayerCall

    graphs = ForwardGraphs(LayerCall)
    arms_on = (True, False) if torch.cuda.is_available() else (False,)
    vocab = moe.shape_of(margs)["vocab_size"]
    ids = torch.randint(4, vocab, (b, s), generator=torch.Generator().manual_seed(1)).to(common.device())
    step = common.Step(model, dict(input_ids=ids, labels=ids))
    for _ in range(args.warmup):
        graphs.on = torch.cuda.is_available()
        step()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    arms = {flag: [] for flag in arms_on}
    for i in range(args.pairs):
        for flag in (arms_on if i % 2 == 0 else arms_on[::-1]):
            graphs.on = flag
            arms[flag].append(_one(step))
    result = dict(model=args.model, layers=args.layers, shape=f"{b}x{s}", label=args.label, torch=torch.__version__,
                  captured=graphs.captured, replays=graphs.replays, left_eager=graphs.left_eager)
    for flag in arms_on:
        name, rows = ("graphs" if flag else "eager"), arms[flag]
        result[name] = {k: round(statistics.median(r[k] for r in rows), 1) for k in ("ms", "host_forward",
                                                                                     "host_backward")}
        result[name]["ms_all"] = [round(r["ms"], 1) for r in rows]
        result[name]["losses"] = [r["loss"] for r in rows]
        print(f"RESULT {args.label or 'run'} {name}: median {result[name]['ms']} ms/step, host forward "
              f"{result[name]['host_forward']} ms, host backward {result[name]['host_backward']} ms; steps "
              f"{result[name]['ms_all']}", flush=True)
    if torch.cuda.is_available():
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
        result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / (1 << 30), 2)
    print(f"graphs: {graphs.captured} captured, {graphs.replays} replays (their layers' fasttune call counts "
          f"stop at the capture), {graphs.left_eager} left eager; peak GiB {result.get('peak_gib')} / "
          f"{result.get('peak_reserved_gib')}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
