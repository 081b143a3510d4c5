"""A/B in one process: checkpointed layers whose forward runs without autograd vs recorded twice.

``FastConfig.checkpoint_no_grad_forward`` (``fasttune/model_patches/no_grad_forward.py``) is
switched on the patched model between steps, alternating A B B A ..., so both arms see the same
machine, the same allocator state and the same drift: the H200 machines this runs on differ by up to
40% from one another on host-bound steps, and even one machine moves by 10% between processes.

Per arm: median step ms (synchronised), the host ms to launch forward and backward (how far the host
is from the GPU: a step whose host time is below the GPU's is GPU-bound), peak memory is the run's.
The model is ``bench_moe_step.py``'s (Qwen3-30B-A3B or gpt-oss-20b widths, LoRA on attention and
experts, bf16 autocast, AdamW, checkpointing "offload").

Usage (H200, repo root):
    python3 benchmarks/ab_no_grad_forward.py --layers 8 --pairs 8 [--model gpt-oss-20b] [--out ab.json]
    python3 benchmarks/ab_no_grad_forward.py --smoke     # tiny model on CPU: checks the script
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


def one_step(step: common.Step) -> dict:
    """One synchronised step: its ms, the host ms to launch forward and backward, its loss."""
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


def ab_arguments(description: str, warmup: int) -> argparse.ArgumentParser:
    """The options of an in-process A/B on bench_moe_step.py's model."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(moe.MODELS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shape", default="4x2048", help="batch x sequence")
    p.add_argument("--pairs", type=int, default=8, help="steps per arm (alternating)")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model: checks the script, measures nothing")
    return p


def main(argv=None) -> None:
    args = ab_arguments(__doc__.split("\n")[0], warmup=2).parse_args(argv)
    b, s = (int(v) for v in args.shape.lower().split("x"))
    margv = ["--model", args.model, "--stacks", "fasttune", "--ckpt-dir", "", "--shapes", args.shape]
    margv += ["--smoke"] if args.smoke else ["--layers", str(args.layers)]
    margs = moe.parse_args(margv)
    if args.smoke:
        b, s = margs.shapes[0]
        args.pairs, args.warmup = 1, 1
    model = moe.prepare("fasttune", margs, print)
    from fasttune.model_patches.checkpointing import layer_checkpointing

    state = layer_checkpointing(model)
    vocab = moe.shape_of(margs)["vocab_size"]
    ids = torch.randint(4, vocab, (b, s), generator=torch.Generator().manual_seed(1)).to(common.device())
    step = common.Step(model, dict(input_ids=ids, labels=ids))
    for flag in (True, False) * args.warmup:
        state.no_grad_forward = flag
        step()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    arms = {True: [], False: []}
    for i in range(args.pairs):
        for flag in ((True, False) if i % 2 == 0 else (False, True)):
            state.no_grad_forward = flag
            arms[flag].append(one_step(step))
    result = dict(model=args.model, layers=args.layers, shape=f"{b}x{s}", torch=torch.__version__)
    for flag, name in ((True, "no_grad_forward"), (False, "recorded")):
        rows = arms[flag]
        result[name] = {k: round(statistics.median(r[k] for r in rows), 1) for k in ("ms", "host_forward",
                                                                                     "host_backward")}
        result[name]["ms_all"] = [round(r["ms"], 1) for r in rows]
        print(f"RESULT {name}: median {result[name]['ms']} ms/step, host forward {result[name]['host_forward']} ms, "
              f"host backward {result[name]['host_backward']} ms; steps {result[name]['ms_all']}", flush=True)
    if torch.cuda.is_available():
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
    calls = {f"{op}/{why}"[:100]: n for (op, why), n in model._bench_report.calls.items() if op == "no_grad_forward"}
    result["calls"] = calls
    print("calls", calls, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
