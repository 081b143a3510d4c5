"""Where a profiled step leaves the GPU idle: gaps between kernels in a torch.profiler Chrome trace.

A gap before kernel K is CPU-bound when K's launch (the ``cuda_runtime`` or ``cuda_driver``
event with K's correlation id) started after the previous kernel had ended: the GPU waited for the host. Each gap
is attributed to the outermost ``user_annotation`` range around the launch (``bench_step.py`` marks
forward / backward / optimizer) and to the innermost CPU op that launched K.

``stream_report`` looks at the compute stream alone: its gaps while copies on a side stream keep the GPU
busy are waits (an event the stream waits on), not idle GPU time.

Usage:  python3 benchmarks/trace_gaps.py TRACE.json[.gz] [--top 15] [--min-us 20] [--shrink OUT.json.gz]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict


def _load(trace) -> list[dict]:
    if isinstance(trace, str):
        with (gzip.open(trace, "rt") if trace.endswith(".gz") else open(trace)) as fh:
            trace = json.load(fh)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gap_report(trace, top: int = 15, min_us: float = 20.0) -> str:
    """A text summary: idle time in total, by annotated phase, and the ``top`` longest gaps."""
    events = [e for e in _load(trace) if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        return "no GPU kernels in the trace"
    # Triton launches through the driver API (cuLaunchKernelEx), cuBLAS and torch through the runtime.
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    phases = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    op_starts = [e["ts"] for e in ops]

    def enclosing(items, starts, ts, innermost: bool):
        best = None
        for e in items[max(0, bisect.bisect_right(starts, ts) - 2000):bisect.bisect_right(starts, ts)]:
            if e["ts"] <= ts <= e["ts"] + e["dur"]:
                if best is None or (e["dur"] < best["dur"]) == innermost:
                    best = e
        return best["name"] if best else "-"

    phase_starts = [e["ts"] for e in phases]
    gaps, by_phase = [], defaultdict(float)
    busy_end = kernels[0]["ts"] + kernels[0]["dur"]
    prev_name = kernels[0]["name"]
    for k in kernels[1:]:
        gap = k["ts"] - busy_end
        if gap >= min_us:
            launch = launches.get(k["args"].get("correlation"))
            ts = launch["ts"] if launch else k["ts"]
            cpu_bound = launch is not None and launch["ts"] >= busy_end
            phase = enclosing(phases, phase_starts, ts, innermost=False)
            by_phase[phase] += gap
            gaps.append((gap, phase, cpu_bound, enclosing(ops, op_starts, ts, innermost=True), prev_name, k["name"]))
        if k["ts"] + k["dur"] > busy_end:
            busy_end, prev_name = k["ts"] + k["dur"], k["name"]
    span = busy_end - kernels[0]["ts"]
    idle = sum(g[0] for g in gaps)
    lines = [f"GPU span {span / 1e3:.1f} ms, idle in gaps >= {min_us:.0f} us: {idle / 1e3:.1f} ms "
             f"({len(gaps)} gaps; CPU-bound {sum(g[0] for g in gaps if g[2]) / 1e3:.1f} ms)",
             "by phase: " + ", ".join(f"{p} {t / 1e3:.1f} ms"
                                      for p, t in sorted(by_phase.items(), key=lambda kv: -kv[1])),
             "| gap us | phase | host-bound | launched by | after kernel | next kernel |", "|---|---|---|---|---|---|"]
    by_op = defaultdict(float)
    for g in gaps:
        by_op[g[3]] += g[0]
    lines.insert(2, "by launching op: " + ", ".join(
        f"{o} {t / 1e3:.1f} ms" for o, t in sorted(by_op.items(), key=lambda kv: -kv[1])[:8]))
    for gap, phase, cpu_bound, op, prev, nxt in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"| {gap:.0f} | {phase} | {'yes' if cpu_bound else 'no'} | {op[:50]} | {prev[:50]} | {nxt[:50]} |")
    return "\n".join(lines)


def stream_report(trace, min_us: float = 20.0, top_ops: int = 8, top_waits: int = 12) -> str:
    """Busy time per CUDA stream, then the compute stream's own idle gaps (the stream with the most
    kernel time, copies not counted): host-bound when the next kernel was launched after the stream went idle, else
    waiting (the kernel sat queued behind an event wait, e.g. on a copy of another stream),
    each by the op that launched the next kernel. GPU-wide gaps (``gap_report``) miss the waits:
    a copy running on a side stream keeps the GPU busy while compute stands still."""
    events = [e for e in _load(trace) if e.get("ph") == "X"]
    by_stream = defaultdict(list)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    if not by_stream:
        return "no GPU kernels in the trace"
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    op_starts = [e["ts"] for e in ops]
    phases = [e for e in events if e.get("cat") == "user_annotation"]

    def phase_of(ts):
        outer = [p for p in phases if p["ts"] <= ts <= p["ts"] + p["dur"]]
        return max(outer, key=lambda p: p["dur"])["name"] if outer else "-"

    def busy(ks):
        total, end = 0.0, None
        for k in ks:
            start, stop = k["ts"], k["ts"] + k["dur"]
            if end is None or start > end:
                total, end = total + k["dur"], stop
            elif stop > end:
                total, end = total + stop - end, stop
        return total

    for ks in by_stream.values():
        ks.sort(key=lambda e: e["ts"])
    times = {s: busy(ks) for s, ks in by_stream.items()}
    kernel_time = {s: sum(k["dur"] for k in ks if k.get("cat") == "kernel") for s, ks in by_stream.items()}
    compute = max(kernel_time, key=kernel_time.get)  # copies may keep a side stream busier
    lines = ["busy by stream: " + ", ".join(f"{s} {t / 1e3:.1f} ms" + (" (compute)" if s == compute else "")
                                            for s, t in sorted(times.items(), key=lambda kv: -kv[1]))]
    ks = by_stream[compute]
    idle = {"host-bound": 0.0, "waiting": 0.0}
    waits, host_by_phase, wait_by_phase, longest = defaultdict(float), defaultdict(float), defaultdict(float), []
    end = ks[0]["ts"] + ks[0]["dur"]
    for k in ks[1:]:
        gap = k["ts"] - end
        if gap >= min_us:
            launch = launches.get(k["args"].get("correlation"))
            if launch is None or launch["ts"] >= end:
                idle["host-bound"] += gap
                host_by_phase[phase_of(launch["ts"] if launch else k["ts"])] += gap
            else:
                idle["waiting"] += gap
                i = bisect.bisect_right(op_starts, launch["ts"])
                inner = [e for e in ops[max(0, i - 2000):i] if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
                op = min(inner, key=lambda e: e["dur"])["name"] if inner else "-"
                phase = phase_of(launch["ts"])
                waits[op] += gap
                wait_by_phase[phase] += gap
                longest.append((gap, phase, op, k["name"], _overlapping(by_stream, compute, end, k["ts"])))
        end = max(end, k["ts"] + k["dur"])
    span = end - ks[0]["ts"]
    lines.append(f"compute stream: span {span / 1e3:.1f} ms, idle in gaps >= {min_us:.0f} us: "
                 f"host-bound {idle['host-bound'] / 1e3:.1f} ms, waiting {idle['waiting'] / 1e3:.1f} ms")
    if phases and host_by_phase:
        lines.append("host-bound by phase: " + ", ".join(
            f"{p} {t / 1e3:.1f} ms" for p, t in sorted(host_by_phase.items(), key=lambda kv: -kv[1])))
    if waits:
        lines.append("waiting, by the op launching the next kernel: " + ", ".join(
            f"{o} {t / 1e3:.1f} ms" for o, t in sorted(waits.items(), key=lambda kv: -kv[1])[:top_ops]))
    if phases and wait_by_phase:
        lines.append("waiting by phase: " + ", ".join(
            f"{p} {t / 1e3:.1f} ms" for p, t in sorted(wait_by_phase.items(), key=lambda kv: -kv[1])))
    if longest:  # what the compute stream waited on: the other streams' work during the gap
        lines += ["| wait us | phase | launched by | next kernel | other streams during the wait |",
                  "|---|---|---|---|---|"]
        for gap, phase, op, nxt, other in sorted(longest, key=lambda w: -w[0])[:top_waits]:
            lines.append(f"| {gap:.0f} | {phase} | {op[:40]} | {nxt[:40]} | {other} |")
    return "\n".join(lines)


def _overlapping(by_stream, compute, start: float, stop: float) -> str:
    """The work of the streams other than ``compute`` inside [start, stop]: per stream, busy us and the
    names of its longest items (a copy's direction and size tell which transfer the compute stream waited on)."""
    parts = []
    for s, ks in by_stream.items():
        if s == compute:
            continue
        inside = [(min(stop, k["ts"] + k["dur"]) - max(start, k["ts"]), k) for k in ks
                  if k["ts"] < stop and k["ts"] + k["dur"] > start]
        if not inside:
            continue
        busy = sum(t for t, _ in inside)
        names = sorted(inside, key=lambda tk: -tk[0])[:2]
        parts.append(f"{s}: {busy:.0f} us in {len(inside)} ("
                     + ", ".join(f"{k['name'][:24]}{_bytes(k)}" for _, k in names) + ")")
    return "; ".join(parts) or "none (an event of the host?)"


def _bytes(k) -> str:
    n = k.get("args", {}).get("bytes")
    return f" {n / 2**20:.0f} MiB" if n else ""


_SHRINK_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "user_annotation", "cuda_runtime", "cuda_driver")


def shrink(trace, dst: str, min_op_us: float = 10.0) -> tuple[int, int]:
    """Write to ``dst`` (gzipped JSON) what the reports read: kernels, copies, memsets, launches, phase
    annotations and CPU ops of at least ``min_op_us``, with only the arguments they use: three profiled
    Qwen3-8B steps (203,376 events) became 83,357 events, 1.2 MB gzipped, small enough to come back from a
    device run. Returns (events in, out)."""
    events = _load(trace)
    keep = []
    for e in events:
        cat = e.get("cat")
        if e.get("ph") != "X" or not (cat in _SHRINK_CATS or (cat == "cpu_op" and e.get("dur", 0) >= min_op_us)):
            continue
        args = e.get("args", {})
        kept_args = {k: args[k] for k in ("correlation", "stream", "bytes") if k in args}
        keep.append({"ph": "X", "cat": cat, "name": e["name"], "ts": e["ts"], "dur": e.get("dur", 0),
                     "tid": e.get("tid"), "args": kept_args})
    with gzip.open(dst, "wt") as fh:
        json.dump({"traceEvents": keep}, fh)
    return len(events), len(keep)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--shrink", metavar="OUT.json.gz", help="also write a smaller gzipped copy of the trace there")
    args = p.parse_args(argv)
    if args.shrink:
        print("events in, kept:", shrink(args.trace, args.shrink))
    print(gap_report(args.trace, args.top, args.min_us))
    print(stream_report(args.trace, args.min_us))


if __name__ == "__main__":
    main()
