"""Host link rate: pinned device-to-host and host-to-device copies, alone and both at once.

The offloaded checkpointer and the attention stash move activations over this link while the GPU
computes; their budget is what this prints. `python3 benchmarks/bench_link.py [--mib 256] [--reps 20]`
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def rate(copies, reps: int, nbytes: int) -> float:
    """GiB/s of ``copies`` (a list of (stream, dst, src)) issued ``reps`` times, all streams together."""
    for stream, dst, src in copies:  # warm-up
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        for stream, dst, src in copies:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return reps * nbytes * len(copies) / (time.perf_counter() - start) / (1 << 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="bytes per copy, MiB")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", help="write the rates as JSON here")
    args = parser.parse_args()
    nbytes = args.mib << 20
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    rates = {
        "d2h": rate([(s1, host[0], dev[0])], args.reps, nbytes),
        "h2d": rate([(s1, dev[0], host[0])], args.reps, nbytes),
        "both (sum)": rate([(s1, host[0], dev[0]), (s2, dev[1], host[1])], args.reps, nbytes),
    }
    for name, value in rates.items():
        print(f"{name:>11}: {value:6.1f} GiB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "mib": args.mib, "gib_per_s": rates}, f, indent=1)


if __name__ == "__main__":
    main()
