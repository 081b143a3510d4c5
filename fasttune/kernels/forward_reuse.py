"""The LoRA products and casts a checkpointed layer's forward made, handed to its recompute.

A checkpointed layer's recompute runs each fused LoRA Function's forward again, on bitwise the same
input, to rebuild what its backward needs. Part of that work depends only on the input and the
adapters, which cannot change between a layer's forward and its recompute (the optimizer steps after
the backward): X·[A_p; …]ᵀ per group of projections (a full read of X for r columns: ~75 µs for an 8B
MLP's [8,192, 12,288] down-projection input), the stacked A and the B matrices cast to the compute
dtype (PEFT keeps them in fp32: a launch each). The forward keeps them here and the recompute takes
them back, so a layer's recompute reads X·Aᵀ from memory and, for a discarded MLP output, skips the
GLU kernel too (H is only needed for X·A_downᵀ, ``lora_glu.py``).

The caller (``model_patches.layer_call``, with ``FastConfig.reuse_forward_lora``) gives each
checkpointed layer call a ``ForwardReuse`` and enters it with ``entering(reuse, replay)``: recording
in the forward, replaying in the recompute.
``reused(kind, tensors, shape, compute)`` runs ``compute()`` and records its result in the forward;
in the recompute it hands back the forward's result for the same call (same kind, same adapter
tensors, same input shape, in call order) when the adapters' version counters have not moved, else
computes again. Nothing is reused while a CUDA graph is being captured (a graph must compute its
values, not bake in an eager tensor's address).

Memory: what is recorded stays on the GPU from a layer's forward to the end of its recompute
(~3.2 MB a layer for an 8B model at 8,192 tokens). All live records together stay under
``BUDGET_BYTES``; past it a forward records nothing and its recompute computes as before (long
contexts, where X·Aᵀ grows with the tokens).
"""

from __future__ import annotations

import contextvars

import torch

__all__ = ["BUDGET_BYTES", "ForwardReuse", "active", "entering", "held_bytes", "leaving", "replayed", "reused"]

BUDGET_BYTES = 256 << 20  # all live records of a process together; 0 turns reuse off

_CURRENT = contextvars.ContextVar("fasttune_forward_reuse", default=None)
_HELD = [0]  # bytes recorded by the live ForwardReuse objects


def held_bytes() -> int:
    """Bytes the live ``ForwardReuse`` records hold now (all layer calls)."""
    return _HELD[0]


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class ForwardReuse:
    """One checkpointed layer call's records, from its forward to its recompute (module docstring)."""

    __slots__ = ("_records", "_cursor", "_bytes", "replaying", "hits", "misses", "__weakref__")

    def __init__(self):
        self._records: dict[tuple, list] = {}  # key -> [(versions, value), ...] in call order
        self._cursor: dict[tuple, int] = {}
        self._bytes = 0
        self.replaying = False
        self.hits = self.misses = 0

    def record(self, key: tuple, versions: tuple, value) -> None:
        nbytes = _nbytes(value)
        if _HELD[0] + nbytes > BUDGET_BYTES:
            return
        self._records.setdefault(key, []).append((versions, value))
        self._bytes += nbytes
        _HELD[0] += nbytes

    def take(self, key: tuple, versions: tuple, peek: bool = False):
        """The forward's value for the next call with ``key``, or None (a miss). The call is consumed
        (the cursor moves on), except by a ``peek`` that misses: the caller then computes through
        ``reused``, which consumes it."""
        i = self._cursor.get(key, 0)
        records = self._records.get(key)
        if records is not None and i < len(records) and records[i][0] == versions:
            self._cursor[key] = i + 1
            self.hits += 1
            return records[i][1]
        if not peek:
            self._cursor[key] = i + 1
            self.misses += 1
        return None

    def clear(self) -> None:
        self._records.clear()
        self._cursor.clear()
        if self._bytes:
            _HELD[0] -= self._bytes
            self._bytes = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._records.values())

    def __del__(self):  # a call whose recompute never ran (a forward without backward) gives its bytes back
        self.clear()


def entering(reuse: ForwardReuse | None, replay: bool) -> contextvars.Token:
    """Enter a pass of a layer call: the forward records, a recompute replays from the first call on."""
    if reuse is not None:
        reuse.replaying = replay
        reuse._cursor.clear()
    return _CURRENT.set(reuse)


def leaving(token: contextvars.Token) -> None:
    """Leave the pass; after a recompute the records are dropped (its Functions saved what they need)."""
    reuse = _CURRENT.get()
    if reuse is not None and reuse.replaying:
        reuse.clear()
    _CURRENT.reset(token)


def active() -> ForwardReuse | None:
    """The ``ForwardReuse`` of the checkpointed layer call running now, or None: outside one, with reuse off
    (``BUDGET_BYTES`` 0) or while a CUDA graph is being captured (nothing is reused then)."""
    reuse = _CURRENT.get()
    if reuse is None or BUDGET_BYTES <= 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    return reuse


def reused(kind: str, tensors, shape, compute):
    """``compute()``, or in a recompute the forward's result of the same call (module docstring).

    ``tensors``: the adapter tensors the result depends on (None entries allowed); ``shape``: what
    else names the call (the input's shape and dtype)."""
    reuse = active()
    if reuse is None:
        return compute()
    key = (kind, tuple(id(t) for t in tensors), shape)
    versions = tuple(-1 if t is None else t._version for t in tensors)
    if reuse.replaying:
        value = reuse.take(key, versions)
        return compute() if value is None else value
    value = compute()
    reuse.record(key, versions, value)
    return value


def replayed(kind: str, tensors, shape):
    """In a recompute, the forward's result of the next ``reused(kind, tensors, shape, ...)`` call
    (consumed as that call would), or None: lets a caller skip the work that would feed ``compute``."""
    reuse = active()
    if reuse is None or not reuse.replaying:
        return None
    key = (kind, tuple(id(t) for t in tensors), shape)
    return reuse.take(key, tuple(-1 if t is None else t._version for t in tensors), peek=True)
