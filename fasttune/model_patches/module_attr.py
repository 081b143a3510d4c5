"""Attribute reads of ``nn.Module`` instances on the per-call hot path, without the cost of a miss.

``getattr(module, "quant_state", None)`` on a module that lacks it goes through
``nn.Module.__getattr__``, which raises (and formats) an ``AttributeError`` that ``getattr`` then
swallows: ~2-3 µs per miss. The fused-LoRA hooks read each projection's state at every call
(``lora_specs.py``), ~40 such reads per projection, which made the checks ~100 µs per projection
and the patched forward host-bound on fast GPUs. ``module_attr`` looks in the same places in the
same order and never raises.
"""

from __future__ import annotations

from torch import nn

_MODULE_GETATTR = nn.Module.__getattr__
# (class, name) -> read with getattr (the class has the name, its own __getattr__, or is no nn.Module);
# bounded by the classes and names the hooks read.
_BY_GETATTR: dict[tuple[type, str], bool] = {}


def _route(cls: type, name: str) -> bool:
    route = _BY_GETATTR[cls, name] = (not issubclass(cls, nn.Module) or cls.__getattr__ is not _MODULE_GETATTR
                                      or hasattr(cls, name))
    return route


def module_attr(module, name: str, default=None):
    """``getattr(module, name, default)``, read without raising on a miss for plain ``nn.Module``s.

    Python's lookup order: the class (properties, methods) and the instance ``__dict__`` by normal
    attribute access, then nn.Module's parameters, buffers and submodules (its ``__getattr__``).
    A class with its own ``__getattr__`` (or a non-module) is read with ``getattr``.
    """
    cls = type(module)
    route = _BY_GETATTR.get((cls, name))
    if route if route is not None else _route(cls, name):
        return getattr(module, name, default)
    d = module.__dict__
    if name in d:
        return d[name]
    values = d["_parameters"]
    if name in values:
        return values[name]
    values = d["_buffers"]
    if name in values:
        return values[name]
    return d["_modules"].get(name, default)


def base_layer_of(module: nn.Module) -> nn.Module:
    """PEFT's ``get_base_layer()``: follow ``base_layer`` down to the innermost layer."""
    while True:
        inner = module_attr(module, "base_layer")
        if inner is None:
            return module
        module = inner


__all__ = ["base_layer_of", "module_attr"]
