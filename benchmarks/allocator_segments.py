"""The CUDA caching allocator's segments after a step: where a reserve larger than the allocation sits, per stream and pool."""

from __future__ import annotations

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
