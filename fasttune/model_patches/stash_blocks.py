"""What a stashed core leaves in place of each tensor it saved (``attention_stash.py``).

- ``StashedBlock``: a flat run of device memory copied to pinned host memory, brought back in backward;
- ``StashedRef``: one saved tensor, a view into a block;
- ``RecomputedInput``: the core's own input, which is not copied at all: the recompute makes it again
  before it reaches the skipped core (the layer's norm output), so the core's nodes get that tensor;
- ``UnusedOutput``: a core's output that nothing reads (NaNs of its shape in the recompute).

Each has ``get()``, called once per use recorded (a saved tensor's unpack, or the recompute's output).
"""

from __future__ import annotations

import torch

__all__ = ["InputUse", "RecomputedInput", "StashedBlock", "StashedRef", "UnusedOutput", "view_of"]


class StashedBlock:
    """A flat run of device memory copied to the host; taken back once per use recorded.

    The device copy is kept between the takes of one backward (the core's output and the saved
    attention output are one block) and dropped at the last; a second backward takes it again.
    """

    __slots__ = ("chain", "kind", "flat", "packed", "nbytes", "uses", "left", "__weakref__")

    def __init__(self, chain, flat: torch.Tensor, kind: str):
        self.chain = chain
        self.kind = kind  # of the core that made it
        self.flat = flat  # uint8 device memory, until the core's copies start together (``LayerStash.run``)
        self.packed = None
        self.nbytes = flat.numel()
        self.uses = self.left = 0
        chain._count(self.nbytes)
        chain.stats.blocks += 1
        chain.stats.bytes += self.nbytes

    def __del__(self):
        chain = getattr(self, "chain", None)
        if chain is not None:
            chain._count(-self.nbytes)

    def add_use(self) -> None:
        self.uses += 1
        self.left += 1

    def prefetch(self) -> None:
        self.chain.checkpointer.fetch_ahead(self.packed)

    def take(self) -> torch.Tensor:
        self.left -= 1
        keep = self.left > 0
        if not keep:
            self.left = self.uses
        return self.chain.checkpointer.take(self.packed, keep=keep)


class UnusedOutput:
    """A stashed core's output nobody reads (it only enters the residual sum): nothing is copied; the
    recompute gets NaNs of its shape, so that a use of them could not go unnoticed."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.device = tuple(t.shape), t.dtype, t.device

    def get(self) -> torch.Tensor:
        return torch.full(self.shape, float("nan"), dtype=self.dtype, device=self.device)


class StashedRef:
    """One saved tensor: its block (bytes) and where it sits in it (in elements of its dtype)."""

    __slots__ = ("block", "dtype", "shape", "stride", "offset")

    def __init__(self, block: StashedBlock, dtype: torch.dtype, shape, stride, offset: int):
        self.block, self.dtype, self.shape, self.stride, self.offset = block, dtype, shape, stride, offset
        block.add_use()

    def get(self) -> torch.Tensor:
        raw = self.block.take()
        size = self.dtype.itemsize
        flat = raw[: raw.numel() - raw.numel() % size].view(self.dtype)  # the storage may end mid-element
        return flat.as_strided(self.shape, self.stride, self.offset)


class RecomputedInput:
    """A stashed core's input: not copied, since the layer's recompute makes it again (bitwise, as every
    recomputed tensor) just before it skips the core. ``set`` hands it the recompute's tensor; each
    saved use of it (``InputUse``) takes it once, and the last lets it go (so it lives as long as a fetched
    copy would). It saves the link and host memory one hidden-sized tensor per layer (the projections' input)."""

    __slots__ = ("tensor", "uses", "left")

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.uses = self.left = 0

    def use(self, shape) -> "InputUse":
        """One saved tensor that is the input, or the input reshaped to ``shape`` (a view of its memory)."""
        self.uses += 1
        self.left += 1
        return InputUse(self, tuple(shape))

    def set(self, t: torch.Tensor) -> None:
        self.tensor, self.left = t.detach(), self.uses

    def take(self) -> torch.Tensor:
        t = self.tensor
        if t is None:  # the recompute stopped before the core: nothing after it saved through the checkpoint
            raise RuntimeError("attention stash: a stashed core's input was needed before its recompute made it "
                               "(a core whose input the recompute does not reach must not pass core_input)")
        self.left -= 1
        if self.left <= 0:
            self.tensor = None
        return t


class InputUse:
    """One saved tensor that was the core's input (or a reshape of it): the recompute's input, reshaped."""

    __slots__ = ("held", "shape")

    def __init__(self, held: RecomputedInput, shape: tuple):
        self.held, self.shape = held, shape

    def get(self) -> torch.Tensor:
        t = self.held.take()
        return t if tuple(t.shape) == self.shape else t.reshape(self.shape)


def view_of(t: torch.Tensor, x: torch.Tensor | None) -> bool:
    """Is ``t`` ``x`` itself or ``x.view(t.shape)``: the same memory read in the same order (so the
    recompute's ``x``, reshaped, is ``t``)? A linear's saved [N, D] input is its [B, S, D] input's view."""
    if x is None or t.dtype != x.dtype or t.device != x.device or t.numel() != x.numel():
        return False
    if t.data_ptr() != x.data_ptr():
        return False
    try:
        v = x.view(t.shape)
    except RuntimeError:  # x's strides allow no such view: t reads other memory or another order
        return False
    return v.stride() == t.stride()
