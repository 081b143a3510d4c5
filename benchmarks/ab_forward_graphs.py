"""A/B in one process: checkpointed layers' no-grad forward replayed from CUDA graphs vs launched eagerly.

``FastConfig.checkpoint_forward_graphs`` (``fasttune/model_patches/forward_graphs.py``) is switched on
the patched model between steps, alternating A B B A ..., so both arms see the same machine and drift.
On hosts slower than the GPU the MoE step is host-bound; with the forward replayed (one launch a layer
instead of ~70 and their Python) the host starts the backward's launches ahead of the GPU. This
measures it on the host as it is, and on one made slower on purpose (run under ``taskset`` on one core
shared with a busy process, ``--label slow-host``). Per arm: median step ms (synchronised), host ms to
launch forward and backward, and the loss of every step (the steps alternate while AdamW trains).
The warm-up runs with graphs on: the first two calls of each layer are eager, the third captures.

Usage (H200, repo root):
    python3 benchmarks/ab_forward_graphs.py --layers 8 --pairs 8 [--out ab.json]
    taskset -c 3 python3 -c "while True: pass" & taskset -c 3 python3 benchmarks/ab_forward_graphs.py --label slow-host
    python3 benchmarks/ab_forward_graphs.py --smoke     # tiny model on CPU: nothing is captured there
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe_step as moe  # noqa: E402
import bench_step as common  # noqa: E402
from ab_no_grad_forward import ab_arguments, one_step  # noqa: E402

import torch  # noqa: E402


def main(argv=None) -> None:
    p = ab_arguments(__doc__.split("\n")[0], warmup=3)  # graphed warm-up steps: the 3rd captures
    p.add_argument("--label", default="", help="a name for this run in the RESULT lines (e.g. slow-host)")
    args = p.parse_args(argv)
    margv = ["--model", args.model, "--stacks", "fasttune", "--ckpt-dir", "", "--shapes", args.shape]
    margv += ["--smoke"] if args.smoke else ["--layers", str(args.layers)]
    margs = moe.parse_args(margv)
    b, s = margs.shapes[0]
    if args.smoke:
        args.pairs, args.warmup = 1, 1
    margs.forward_graphs = True
    model = moe.prepare("fasttune", margs, print)
    from fasttune.model_patches.checkpointing import layer_checkpointing

    state = layer_checkpointing(model)
    graphs = state.graphs
    arms_on = (True, False) if torch.cuda.is_available() else (False,)
    vocab = moe.shape_of(margs)["vocab_size"]
    ids = torch.randint(4, vocab, (b, s), generator=torch.Generator().manual_seed(1)).to(common.device())
    step = common.Step(model, dict(input_ids=ids, labels=ids))
    for _ in range(args.warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    arms = {flag: [] for flag in arms_on}
    for i in range(args.pairs):
        for flag in (arms_on if i % 2 == 0 else arms_on[::-1]):
            state.graphs = graphs if flag else None
            arms[flag].append(one_step(step))
    result = dict(model=args.model, layers=args.layers, shape=f"{b}x{s}", label=args.label, torch=torch.__version__,
                  captured=graphs.captures, replays=graphs.replays)
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
    print(f"graphs: {graphs.captures} captured, {graphs.replays} replays; peak GiB {result.get('peak_gib')} / "
          f"{result.get('peak_reserved_gib')}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
