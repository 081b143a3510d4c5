"""Every tensor a graphed layer call reads, found through its arguments, and the call rebuilt on static copies.

A CUDA graph replays the addresses its capture saw. ``forward_graphs`` and ``backward_graphs`` copy each
call's input tensors into static buffers and replay on those, so every tensor the layer reads must be
among the inputs they copy. Plain tensors in (nested) tuples, lists and dicts are; but an attention mask
under ``flex_attention`` is a ``BlockMask``: an object holding eight index tensors, with a ``mask_mod``
function whose closure may hold more (the padding mask). transformers builds a new one every forward,
so a capture that kept the capture step's ``BlockMask`` replays reads of freed memory (on gpt-oss-20b:
an illegal memory access, and where the freed blocks still held indices, silently wrong attention).

``call_inputs`` splits the arguments into their tensors (a ``BlockMask``'s attributes and the tensors in
its ``mask_mod``'s closure included) and a hashable key of everything else: scalars by ``repr``,
functions by code object and closure, so two masks built alike share a graph. ``rebuild`` returns
the arguments with other tensors in those places: a copy of the ``BlockMask``, a copy of a closure
(same code, new cells). An argument whose state a replay could not follow (any other object that is
not a plain value, such as a KV cache) is a reason to stay eager, returned as a string.
"""

from __future__ import annotations

import enum
import functools
import types

import torch
from torch.utils import _pytree as pytree

__all__ = ["CallInputs", "call_inputs"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
          enum.Enum, type, types.BuiltinFunctionType, slice, range, type(Ellipsis))
_DEPTH = 12  # nested closures deeper than this are not followed (a reason to stay eager)


class Unfollowable(Exception):
    """An argument holds state a replay would not follow; the message says which."""


def _block_mask_class():
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # torch without flex attention
        return None
    return BlockMask


def _spec_key(spec):
    """A pytree structure as a dict key (its repr where this torch's TreeSpec does not hash)."""
    try:
        hash(spec)
    except TypeError:
        return repr(spec)
    return spec


def _tensor_key(t: torch.Tensor) -> tuple:
    return ("tensor", tuple(t.shape), t.stride(), t.dtype, t.device)


class CallInputs:
    """A layer call's arguments split into ``tensors`` (in a fixed order) and ``key`` (everything else,
    hashable; the tensors' shapes, strides, dtypes and devices included)."""

    def __init__(self, args: tuple, kwargs: dict):
        self.tensors: list[torch.Tensor] = []
        self._keys: list = []
        self._block_mask = _block_mask_class()
        leaves, self._spec = pytree.tree_flatten((args, kwargs))
        self._builders = [self._split(leaf, 0) for leaf in leaves]
        self.key = (_spec_key(self._spec), tuple(self._keys))  # the structure too: which keyword holds what

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        """(args, kwargs) with ``tensors`` (as many as ``self.tensors``, in their order) in their places."""
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten([build(it) for build in self._builders], self._spec)
        if next(it, None) is not None:
            raise ValueError("rebuild: more tensors than the call holds")
        return args, kwargs

    def _split(self, value, depth: int):
        """Record ``value``'s tensors and key; return a builder: iterator of tensors -> value rebuilt."""
        if depth > _DEPTH:
            raise Unfollowable("an argument nests functions deeper than the graphs follow")
        if isinstance(value, torch.Tensor):
            self.tensors.append(value)
            self._keys.append(_tensor_key(value))
            return _next
        if isinstance(value, _PLAIN):
            self._keys.append(repr(value))
            return functools.partial(_same, value)
        if isinstance(value, (tuple, list)):
            self._keys.append((type(value).__name__, len(value)))
            parts = [self._split(v, depth + 1) for v in value]
            return functools.partial(_sequence, type(value), parts)
        if self._block_mask is not None and isinstance(value, self._block_mask):
            return self._split_object(value, depth)
        if isinstance(value, types.FunctionType):
            return self._split_function(value, depth)
        if isinstance(value, functools.partial):
            self._keys.append("partial")
            func = self._split(value.func, depth + 1)
            args = [self._split(v, depth + 1) for v in value.args]
            names = sorted(value.keywords)
            self._keys.append(tuple(names))
            kw = [self._split(value.keywords[k], depth + 1) for k in names]
            return functools.partial(_partial, func, args, names, kw)
        raise Unfollowable(f"an argument of type {type(value).__name__} (a replay would not follow its state)")

    def _split_object(self, value, depth: int):
        """A ``BlockMask``: its attributes, each split; rebuilt as a shallow copy holding the new values."""
        names = sorted(vars(value))
        self._keys.append((type(value).__name__, tuple(names)))
        parts = [self._split(getattr(value, n), depth + 1) for n in names]
        return functools.partial(_object, value, names, parts)

    def _split_function(self, fn: types.FunctionType, depth: int):
        """A function, keyed by its code object and its closure's contents; rebuilt with new cells where its
        closure holds tensors (transformers' mask functions close over the padding mask)."""
        if any(isinstance(v, torch.Tensor) for v in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())):
            raise Unfollowable(f"function {fn.__qualname__} has tensor defaults")
        n_before = len(self.tensors)
        self._keys.append(("function", fn.__code__, repr(fn.__defaults__), repr(fn.__kwdefaults__)))
        cells = []
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                self._keys.append("empty cell")
                cells.append(None)
                continue
            cells.append(self._split(contents, depth + 1))
        if len(self.tensors) == n_before:  # no tensor inside: the function itself serves every replay
            return functools.partial(_same, fn)
        return functools.partial(_function, fn, cells)


def _next(it):
    return next(it)


def _same(value, it):
    return value


def _sequence(kind, parts, it):
    return kind(build(it) for build in parts)


def _partial(func, args, names, kw, it):
    return functools.partial(func(it), *(b(it) for b in args), **{n: b(it) for n, b in zip(names, kw)})


def _object(value, names, parts, it):
    new = object.__new__(type(value))
    new.__dict__.update(vars(value))
    for n, build in zip(names, parts):
        setattr(new, n, build(it))
    return new


def _function(fn, cells, it):
    closure = tuple(types.CellType() if build is None else types.CellType(build(it)) for build in cells)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    return new


def call_inputs(args: tuple, kwargs: dict) -> CallInputs | str:
    """The call's ``CallInputs``, or why a graph cannot replay it (a string)."""
    try:
        return CallInputs(args, kwargs)
    except Unfollowable as err:
        return str(err)
