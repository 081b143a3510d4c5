"""LabelSummary: the loss head's label count and range check, started ahead of need.

The fused loss head needs on the host how many rows are not ignored (it sizes the compacted
products) and checks that every label lies in [0, V). Read where the head runs, that is a host
sync at the end of the forward: the host stops launching until the GPU has run every layer, and
then the GPU waits for the backward's first launches. Started where the labels are first known (the
top of the model's forward), the three numbers travel to pinned host memory behind an event while
the host launches the layers; reading them at the head waits only for that event, long passed.
"""

from __future__ import annotations

import torch


class LabelSummary:
    """(count of non-ignored labels, smallest, largest) of ``labels``, copied to the host without a sync.

    Args:
        labels: integer tensor, already shifted; read once, now (the reductions are queued now).
        ignore_index: the label value to skip; None: labels < 0 read as 0 (log-probs), nothing skipped.
    """

    def __init__(self, labels: torch.Tensor, ignore_index: int | None):
        self.labels = labels
        self.version = _version(labels)  # an in-place change after the start makes the summary stale
        self.ignore_index = ignore_index
        self.event = None
        if labels.numel() == 0:
            self._host = torch.zeros(3, dtype=torch.int64)
            return
        lab = labels.long()
        if ignore_index is None:
            lab = lab.clamp(min=0)
            valid = torch.ones_like(lab, dtype=torch.bool)
        else:
            valid = lab != ignore_index
        big = torch.iinfo(torch.int64).max
        packed = torch.stack([valid.sum(), torch.where(valid, lab, big).min(), torch.where(valid, lab, -1).max()])
        if packed.device.type != "cuda":
            self._host = packed
            return
        with torch.cuda.device(packed.device):
            self._host = torch.empty(3, dtype=torch.int64, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def matches(self, labels: torch.Tensor, ignore_index: int | None) -> bool:
        """Started for this very tensor, unchanged since, with the same ``ignore_index``."""
        return labels is self.labels and _version(labels) == self.version and ignore_index == self.ignore_index

    def valid(self) -> int:
        """The number of non-ignored labels (no range check); waits only for the copy started in ``__init__``."""
        return self._numbers()[0]

    def count(self, V: int) -> int:
        """The number of non-ignored labels, after checking their range.

        Raises:
            ValueError: a non-ignored label lies outside [0, V).
        """
        count, lo, hi = self._numbers()
        if count and (lo < 0 or hi >= V):
            bad = lo if lo < 0 else hi
            hint = "" if self.ignore_index is None else f" or ignore_index={self.ignore_index}"
            raise ValueError(f"labels must lie in [0, {V}){hint}; found {bad}")
        return count

    def _numbers(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self._host.tolist()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter; None for an inference tensor, which has none (labels made under
    ``torch.inference_mode``, e.g. by a data pipeline; outside that mode they cannot change in place)."""
    return None if t.is_inference() else t._version


__all__ = ["LabelSummary"]
