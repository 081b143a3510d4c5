"""The CUDA caching allocator's segments after a step: where a reserve larger than the allocation sits, per stream and pool."""

from __future__ import annotations

import bisect

import torch

GIB = 2 ** 30


def segment_summary() -> dict:
    """The allocator's mapped memory after a step, per stream: reserved, in use, free, the largest free range,
    and free bytes by range size (where a reserve larger than the allocation sits). A CUDA graphs' private pool
    is a row of its own (its blocks freed inside a capture stay reserved for the replays)."""
    out: dict = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        key = f"stream {seg['stream']:#x}" + (f" graph pool {pool}" if pool != (0, 0) else "")
        row = out.setdefault(key + (" (expandable)" if seg.get("is_expandable") else ""),
                             dict(segments=0, reserved_gib=0.0, active_gib=0.0, free_gib=0.0, largest_free_mib=0.0,
                                  free_by_size_gib={}))
        row["segments"] += 1
        row["reserved_gib"] += seg["total_size"] / GIB
        row["active_gib"] += seg["active_size"] / GIB
        for block in seg["blocks"]:
            if block["state"] != "inactive":
                continue
            row["free_gib"] += block["size"] / GIB
            row["largest_free_mib"] = max(row["largest_free_mib"], block["size"] / 2 ** 20)
            bucket = next(f"<{b} MiB" for b in (2, 32, 256, 1024, 4096, 1 << 40) if block["size"] < b << 20)
            row["free_by_size_gib"][bucket] = row["free_by_size_gib"].get(bucket, 0.0) + block["size"] / GIB
    for row in out.values():
        for k in ("reserved_gib", "active_gib", "free_gib", "largest_free_mib"):
            row[k] = round(row[k], 2)
        row["free_by_size_gib"] = {k: round(v, 2) for k, v in row["free_by_size_gib"].items()}
    return out


def _pool_ranges(snapshot: dict) -> list[tuple[int, int, tuple]]:
    """(start, end, pool id) of every segment in ``snapshot`` (a graph pool's segments outlive the trace)."""
    return sorted((s["address"], s["address"] + s["total_size"], tuple(s.get("segment_pool_id") or (0, 0)))
                  for s in snapshot.get("segments", []))


def _where(frames: list) -> str:
    """The innermost frame of fasttune's own code (else transformers', peft's, else the innermost one)."""
    for mark in ("/fasttune/", "/transformers/", "/peft/"):
        for f in frames or []:
            if mark in f.get("filename", ""):
                return f"{f['filename'].rsplit(mark, 1)[1]}:{f.get('line', '?')} {f.get('name', '')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line', '?')} {frames[0].get('name', '')}" if frames \
        else "?"


def pool_peak(snapshot: dict, pool: tuple = (0, 0), since: int = 0, top: int = 12) -> dict:
    """When the allocations of one pool (``(0, 0)``: the main pool; ``(0, n)``: a CUDA graphs' pool) peaked in a
    ``torch.cuda.memory._snapshot()`` recorded with ``_record_memory_history``: the peak of their traced bytes
    at or after trace entry ``since`` and the largest allocations alive then, summed by where they were made.

    Allocations made before the recording are not in the trace (a model's weights): the peak is of what the
    trace saw, which places the moment, not the pool's whole size. Blocks count until their free completes."""
    ranges = _pool_ranges(snapshot)
    starts = [r[0] for r in ranges]

    def pool_at(addr: int):
        i = bisect.bisect_right(starts, addr) - 1
        return ranges[i][2] if i >= 0 and addr < ranges[i][1] else None

    trace = (snapshot.get("device_traces") or [[]])[0]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    peak_at, peak_live = None, {}
    for i, ev in enumerate(trace):
        action, addr = ev.get("action"), ev.get("addr")
        own = ev.get("pool_id")  # recorded with each entry by newer torch; else the segment holding the address
        if action == "alloc" and (tuple(own) if own is not None else pool_at(addr)) == pool:
            total -= live.pop(addr, (0, ""))[0]
            live[addr] = (ev["size"], _where(ev.get("frames")))
            total += ev["size"]
            if i >= since and total > peak:
                peak, peak_at, peak_live = total, i, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    by_where: dict[str, list] = {}
    for size, where in peak_live.values():
        row = by_where.setdefault(where, [0, 0])
        row[0] += size
        row[1] += 1
    largest = sorted(by_where.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
    return dict(pool=list(pool), peak_mib=round(peak / 2 ** 20, 1), at_entry=peak_at, entries=len(trace),
                live=[dict(where=w, mib=round(b / 2 ** 20, 1), blocks=n) for w, (b, n) in largest])
