"""Poisoned memory: every buffer a kernel reads must have been written.

Any 16-bit garbage holds NaN/inf patterns and 0 × NaN = NaN, so a product or kernel that reads
columns nobody wrote (a spare tail, a widened input, a scratch buffer) can turn a run NaN at
random: on CUDA the caching allocator hands freed blocks straight back, on the CPU glibc does.
Two poisons make such a read show every time instead of sometimes:

- ``PoisonAllocations``: a dispatch mode that fills every fresh uninitialised allocation
  (``empty``, ``empty_like``, ``new_empty``, ``empty_strided``...) with 0xFF bytes, NaN in every
  float dtype (-1 in the integer ones). Deterministic, on any device: what the allocator would
  hand back after a NaN-poisoned free.
- ``poison_free_memory(device)``: the real allocators. CUDA: every free block of the caching
  allocator is filled with NaN bytes (allocate the cached-but-free memory, fill, free: the blocks
  stay cached and are handed out next). CPU: a churn of NaN-filled blocks of assorted sizes that
  glibc keeps on its free lists.
"""

from __future__ import annotations

import contextlib

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
UNINITIALISED = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                 _aten.new_empty.default, _aten.new_empty_strided.default, _aten.empty_permuted.default}


def _fill_bytes(t: torch.Tensor) -> None:
    # Through the raw bytes of the whole storage (a fresh allocation's storage is the tensor's).
    storage = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    raw.fill_(0xFF)


class PoisonAllocations(TorchDispatchMode):
    """Fill each fresh uninitialised allocation made while active with 0xFF bytes (NaN).

    ``count`` says how many allocations were poisoned, so a test can check the mode saw the path.
    Higher-order operators (flex attention, which gpt-oss runs on CUDA) pass through, their insides
    unpoisoned; torch.compile compiles as if the mode were off (``ignore_compile_internals``), so
    its kernels run instead of an eager fallback that torch refuses under a dispatch mode.
    """

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.count = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func in UNINITIALISED and isinstance(out, torch.Tensor) and out.numel() \
                and out.dtype != torch.bool and out.device.type != "meta":
            _fill_bytes(out)
            self.count += 1
        return out


def _free_cuda_blocks(device) -> list[int]:
    """Sizes of the caching allocator's free (cached, unallocated) blocks on ``device``."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    small = 1 << 20  # requests up to 1 MiB are served from the small pool only, larger from the large
    return [block["size"] for seg in torch.cuda.memory_snapshot() if seg["device"] == index
            for block in seg["blocks"] if block["state"] == "inactive"
            and (block["size"] <= small) == (seg.get("segment_type", "large") == "small")]


def poison_free_memory(device) -> None:
    """Fill the allocator's free memory on ``device`` with NaN bytes (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        reserved = torch.cuda.memory_reserved(device)
        # One allocation of exactly each free block's size: best fit hands back that block, so
        # the cache is filled without growing (allocating "all free bytes" in fixed chunks would
        # make new segments wherever the cache is fragmented, doubling it test after test).
        blocks = [torch.empty(size, dtype=torch.uint8, device=device)
                  for size in sorted(_free_cuda_blocks(device), reverse=True)]
        for block in blocks:
            block.fill_(0xFF)
        del blocks
        torch.cuda.synchronize(device)
        if torch.cuda.memory_reserved(device) > reserved:  # a block was served elsewhere: give it back
            torch.cuda.empty_cache()
        return
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8) for n in (1 << k for k in range(9, 24)) for _ in range(2)]
    del blocks


@contextlib.contextmanager
def poisoned(device):
    """Both poisons: the allocator's free memory now, and every allocation made inside."""
    poison_free_memory(device)
    mode = PoisonAllocations()
    with mode:
        yield mode
