"""Saved tensors a stashed core makes again in backward instead of copying them (``attention_stash.py``).

Qwen3, Gemma 3, Exaone 4, OLMo 2 and Hunyuan normalise q and k (per head or over the whole projection)
around RoPE. A stashed attention core then saves two versions of q and k: the norms save their inputs,
the attention saves the normed, rotated q/k. The second is a cheap elementwise function of the first,
and the first comes back from the host anyway, so ``RemadeTensors`` makes the attention's q/k again,
on the GPU, the first time its backward unpacks them: the link then moves what a Llama core moves
(Qwen3-8B at 8,192 tokens: ~160 instead of ~240 MiB a layer).

Exact: the same kernels run on bitwise copies of the same inputs, so the remade q/k equal the saved
ones (the CPU tests compare gradients with ``torch.equal`` against a run without checkpointing). The
caller's ``remake`` must take the path its forward took; ``attention.py`` runs it under ``no_grad``
and ``instance.graphless_training`` (so no decode-step shortcut is taken with autograd off).
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["RemadeRef", "RemadeTensors"]


class RemadeTensors:
    """Outputs of ``remake(*inputs)`` that autograd nodes of the core saved: made again once per backward,
    at the first unpack of one of them, and let go when every saved use has taken its own.

    ``inputs`` are the tensors while the core runs (``release`` drops them when it ends); ``bind`` makes the
    stash's refs to their copies (taken once each per remake) the first time an output is saved. Of the
    outputs only the layout is kept: holding them would keep their device memory until the backward."""

    __slots__ = ("inputs", "refs", "layouts", "remake", "uses", "left", "made", "on_remake")

    def __init__(self, inputs: tuple, outputs: tuple, remake: Callable, on_remake: Callable[[], None] | None = None):
        self.inputs: tuple | None = tuple(t.detach() for t in inputs)
        self.layouts = tuple(_layout(t) for t in outputs)
        self.remake = remake
        self.refs: list | None = None
        self.uses = self.left = 0
        self.made: tuple | None = None
        self.on_remake = on_remake  # counts remakes (``StashStats.tensors_remade``)

    def bind(self, ref_of: Callable[[torch.Tensor], object]) -> bool:
        """Refs to the inputs' host copies (``ref_of`` makes one, or None where it cannot); False when one
        input cannot be copied flat: the outputs are then stashed as usual."""
        if self.refs is None:
            if self.inputs is None:
                return False
            refs = [ref_of(t) for t in self.inputs]
            if any(r is None for r in refs):
                return False
            self.refs = refs
        return True

    def release(self) -> None:
        """The core has ended: its inputs are the stash's (or the graph's) to keep, not ours."""
        self.inputs = None

    def use(self, index: int, t: torch.Tensor) -> "RemadeRef":
        """One saved tensor ``t``: a view of output ``index``'s memory."""
        self.uses += 1
        self.left += 1
        return RemadeRef(self, index, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def take(self, index: int) -> torch.Tensor:
        if self.made is None:
            inputs = [r.get() for r in self.refs]
            made = self.remake(*inputs)
            for got, want in zip(made, self.layouts):
                if _layout(got) != want:  # the saved views' strides and offsets would read other memory
                    raise RuntimeError(f"attention stash: a remade tensor is laid out as {_layout(got)}, the "
                                       f"forward's was {want}")
            self.made = tuple(made)
            if self.on_remake is not None:
                self.on_remake()
        out = self.made[index]
        self.left -= 1
        if self.left <= 0:  # the last saved use: let the memory go (a second backward remakes it)
            self.made, self.left = None, self.uses
        return out


def _layout(t: torch.Tensor) -> tuple:
    """What must match for a saved view's strides and offset to read the same elements of a remade tensor."""
    return tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()


class RemadeRef:
    """One saved tensor that ``RemadeTensors`` makes again: where it sits in its output's memory."""

    __slots__ = ("remade", "index", "shape", "stride", "offset")

    def __init__(self, remade: RemadeTensors, index: int, shape, stride, offset: int):
        self.remade, self.index, self.shape, self.stride, self.offset = remade, index, shape, stride, offset

    def get(self) -> torch.Tensor:
        return self.remade.take(self.index).as_strided(self.shape, self.stride, self.offset)
