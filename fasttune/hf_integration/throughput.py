"""Tokens/s and peak GPU memory between two Trainer log lines."""

from __future__ import annotations

import time

import torch


class ThroughputMeter:
    """Counts the tokens of each training step and turns them into a rate at log time.

    Token counts stay on the device between logs (no host sync per step); ``read`` syncs once.
    """

    def __init__(self) -> None:
        self._tokens = None
        self._since = time.perf_counter()

    def count(self, inputs: dict) -> None:
        mask = inputs.get("attention_mask")
        ids = inputs.get("input_ids")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            n = mask.sum()
        elif isinstance(ids, torch.Tensor):
            n = torch.tensor(ids.numel(), device=ids.device)
        else:
            return
        self._tokens = n if self._tokens is None else self._tokens + n

    def read(self) -> dict[str, float]:
        """{"tokens_per_second", "peak_memory_gib"} since the last read (memory: since start)."""
        now = time.perf_counter()
        out = {}
        if self._tokens is not None:
            out["tokens_per_second"] = round(float(self._tokens) / max(now - self._since, 1e-9), 1)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        self._tokens, self._since = None, now
        return out
