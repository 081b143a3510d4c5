"""Merged weights, one tensor at a time, without touching the live model.

A LoRA model's merged checkpoint is, for every LoRA-wrapped linear ``W`` (dequantised first when
it is NF4/int8 through bitsandbytes)::

    W' = W + s · B A                       (plain LoRA, s = lora_alpha / r or the rsLoRA scale)
    W' = m / ‖W + s · B A‖_row · (W + s · B A)   (DoRA, m the learned magnitude per output row)

computed in float32 and cast only when written. Embedding LoRA adds ``s · (B A)ᵀ``. A
``modules_to_save`` copy replaces the original module. LoRA on a parameter (PEFT's ``ParamWrapper``,
``target_parameters``: stacked MoE experts) adds PEFT's own ``get_delta_weight``. Nothing is merged in place: each entry
holds a ``load()`` that computes its tensor on demand, so a writer can stream a checkpoint
while at most one merged tensor (plus one shard) is alive.

Two sources share these rules: ``ModelWeights`` (the live model's own base weights) and
``MergeRules`` applied to another checkpoint's tensors (``save_merged(base=...)``). A base layer
stored in FP8 (``FastConfig(base_dtype="fp8")``, ``model_patches/fp8_base.py``) holds only an
approximation of its weight: its entry reads the original 16-bit tensor from the checkpoint the
model was loaded from (``OriginalWeights``, one tensor per ``load()``), never the FP8 codes.
Stacked MoE experts held in NF4 (``FastConfig.moe_experts_nf4``, ``kernels.nf4_weight.NF4Weight``
in the parameter's place) are written under the parameter's own key, dequantised (plus the LoRA
delta of their ``ParamWrapper``); with ``save_merged(base=...)`` the delta goes onto the 16-bit
original instead.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..kernels.nf4_weight import NF4Weight
from ..model_patches.fp8_base import FP8_SOURCE_ATTR, is_fp8_layer


@dataclass
class WeightEntry:
    """One tensor of the merged checkpoint: its key, shape and a function computing it (fp32 for floats)."""

    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


@dataclass
class MergeRules:
    """What turns base tensors into merged ones.

    Attributes:
        merge: checkpoint key → function(base fp32 tensor) → merged fp32 tensor (LoRA layers).
        replace: checkpoint key → function() → tensor that replaces the base (modules_to_save copies).
        shapes: checkpoint key → shape the merge expects.
        untie: True when tied input/output embeddings end up different (config must untie them).
    """

    merge: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    replace: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    untie: bool = False


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a core dependency
        return model
    if isinstance(model, PeftModel):
        return model.base_model.model
    return model


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The module's weight as a float tensor, dequantising bitsandbytes NF4/FP4 and int8 weights.

    Reads only; the module is not changed (PEFT's own helper moves int8 weights in place). An FP8
    layer is refused: its codes are an approximation; ``OriginalWeights`` reads its 16-bit original.
    """
    if is_fp8_layer(module):
        raise ValueError("this base weight is stored in FP8 (an approximation); read its 16-bit original from the "
                         "checkpoint the model was loaded from (merged_weights.OriginalWeights)")
    weight = module.weight
    kind = type(weight).__name__
    if kind == "Params4bit":
        import bitsandbytes as bnb

        data, state = weight.data, weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes repacks NF4 weights in place for its AVX512-BF16 CPU kernel at the first
            # eval-mode forward; undo that on copies (its inverse mutates the state it is given).
            inverse = getattr(bnb.functional, "_convert_weight_packed_for_cpu_inverse", None)
            if inverse is None:
                raise RuntimeError("NF4 weight is in bitsandbytes' CPU packing format and this bitsandbytes "
                                   "version has no inverse: move the model to another device first")
            # packed scales are [in/blocksize, out] in bf16; the inverse restores the codes only reliably
            absmax = state.absmax.T.reshape(-1).float()
            data, state = inverse(data.clone(), copy.deepcopy(state))
            state.absmax, state.nested, state.offset, state.state2 = absmax, False, None, None
        return bnb.functional.dequantize_4bit(data, state).float()
    if kind == "Int8Params":
        scb = getattr(weight, "SCB", None)
        if scb is None and getattr(module, "state", None) is not None:
            scb = module.state.SCB
        if scb is None:
            raise ValueError("int8 weight without SCB scales: cannot dequantise it")
        return weight.data.float() * (scb.float().view(-1, 1) / 127.0)
    return weight.detach().float()


def _weight_shape(module: nn.Module) -> tuple[int, ...]:
    weight = module.weight
    if type(weight).__name__ == "Params4bit":
        return tuple(weight.quant_state.shape)
    return tuple(weight.shape)


def _is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, LoraLayer)


def _is_modules_to_save(module: nn.Module) -> bool:
    try:
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, ModulesToSaveWrapper)


def _active_adapters(module: nn.Module) -> list[str]:
    if getattr(module, "disable_adapters", False):
        return []
    active = module.active_adapters
    return [active] if isinstance(active, str) else list(active)


def _lora_weight_merger(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """fp32 base weight → merged weight for one LoRA layer; None when nothing is to be added."""
    adapters = [a for a in _active_adapters(module)
                if (a in module.lora_A or a in module.lora_embedding_A) and a not in module.merged_adapters]
    if not adapters:
        return None
    for a in adapters:
        variant = getattr(module, "lora_variant", {}).get(a)
        if variant is not None and not type(variant).__name__.startswith("Dora"):
            raise NotImplementedError(
                f"merging LoRA variant {type(variant).__name__} (adapter {a!r}) is not supported; "
                "merge a copy with PEFT's merge_and_unload instead")
    fan_in_fan_out = getattr(module, "fan_in_fan_out", False)
    first = adapters[0]
    device = (module.lora_embedding_A[first] if first in module.lora_embedding_A else module.lora_A[first].weight).device

    def merge(weight: torch.Tensor) -> torch.Tensor:
        base = weight.to(device, torch.float32)  # a base checkpoint tensor may come from the CPU
        out = base
        for a in adapters:
            scale = float(module.scaling[a])
            if a in module.lora_embedding_A:
                delta = (module.lora_embedding_B[a].float() @ module.lora_embedding_A[a].float()).T * scale
            else:
                delta = module.lora_B[a].weight.float() @ module.lora_A[a].weight.float() * scale
                if fan_in_fan_out:
                    delta = delta.T
            if a in getattr(module, "lora_magnitude_vector", {}):
                # DoRA: the norm is taken on the unmerged base plus this adapter, as PEFT's forward does.
                oriented = (base.T if fan_in_fan_out else base) + (delta.T if fan_in_fan_out else delta)
                norm = torch.linalg.norm(oriented, dim=1)
                factor = module.lora_magnitude_vector[a].weight.float() / norm
                factor = factor.view(1, -1) if fan_in_fan_out else factor.view(-1, 1)
                out = factor * (out + delta)
            else:
                out = out + delta
        return out.detach()

    return merge


def _is_param_wrapper(module: nn.Module) -> bool:
    """PEFT's LoRA on a parameter (``LoraConfig(target_parameters=...)``)."""
    return _is_lora_layer(module) and hasattr(module, "parameter_name") and hasattr(module, "get_delta_weight")


def _param_merger(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """fp32 base parameter → merged, with PEFT's own delta (it knows the stacked-experts layouts)."""
    adapters = [a for a in _active_adapters(module) if a in module.lora_A and a not in module.merged_adapters]
    if not adapters:
        return None

    def merge(param: torch.Tensor) -> torch.Tensor:
        out = param.detach().to(torch.float32)
        with torch.no_grad():
            for a in adapters:
                out = out + module.get_delta_weight(a).to(out.device, torch.float32)
        return out

    return merge


def _lora_bias_merger(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    adapters = [a for a in _active_adapters(module)
                if getattr(module, "lora_bias", {}).get(a) and a not in module.merged_adapters]
    if not adapters:
        return None

    def merge(bias: torch.Tensor) -> torch.Tensor:
        out = bias.to(module.lora_B[adapters[0]].bias.device, torch.float32)
        for a in adapters:
            out = out + module.lora_B[a].bias.float() * float(module.scaling[a])
        return out.detach()

    return merge


class OriginalWeights:
    """The tensors of the checkpoint a model was loaded from (a folder or a Hub id, whose snapshot
    is downloaded or found in the cache), read one at a time: the 16-bit originals of FP8 bases."""

    def __init__(self, source: str):
        self.source = source
        self._where: dict[str, Path] | None = None

    def _shard_of(self, key: str) -> Path | None:
        if self._where is None:
            path = Path(self.source)
            if not path.is_dir():
                from huggingface_hub import snapshot_download

                path = Path(snapshot_download(self.source, allow_patterns=["*.safetensors", "*.json"]))
            self._where = {k: shard for shard, keys in checkpoint_shards(path) for k in keys}
        return self._where.get(key)

    def load(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 tensor ``key``; a ValueError when the checkpoint has no float tensor of ``shape`` there."""
        shard = self._shard_of(key)
        tensor = None if shard is None else _read_tensor(shard, key)
        if tensor is None or not tensor.is_floating_point() or tuple(tensor.shape) != tuple(shape):
            found = "no such tensor" if tensor is None else f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)}"
            raise ValueError(f"{key}: the base weight is stored in FP8 and its 16-bit original was to be read from "
                             f"{self.source}, which holds {found} (expected float {tuple(shape)}); pass base=<the "
                             "16-bit checkpoint> to save_merged (then save_gguf on the merged folder)")
        return tensor


def _no_original(key: str) -> torch.Tensor:
    raise ValueError(f"{key}: the base weight is stored in FP8 (FastConfig(base_dtype='fp8')) and the model was not "
                     "loaded from a checkpoint, so its 16-bit original is unknown: pass base=<folder or Hub id of the "
                     "16-bit checkpoint> to save_merged (then save_gguf on the merged folder)")


class _Walker:
    """Walks a transformers model once and records entries (live weights) and merge rules."""

    def __init__(self) -> None:
        self.entries: list[WeightEntry] = []
        self.rules = MergeRules()
        self._uses: dict[int, list[tuple[int, bool]]] = {}  # id(param) -> [(entry index, merged?)]
        self._originals: dict[str, OriginalWeights] = {}

    def base_weight(self, layer: nn.Module, key: str) -> Callable[[], torch.Tensor]:
        """A loader of ``layer``'s weight as a float tensor: dequantised, or for an FP8 layer its
        16-bit original read from the recorded source checkpoint."""
        if not is_fp8_layer(layer):
            return lambda: dequantized_weight(layer)
        source = layer.__dict__.get(FP8_SOURCE_ATTR)
        if source is None:
            return lambda: _no_original(key)
        original = self._originals.setdefault(source, OriginalWeights(source))
        shape = _weight_shape(layer)
        return lambda: original.load(key, shape)

    def add(self, name: str, shape, load, source: torch.Tensor | None, merged: bool) -> None:
        if source is not None:
            self._uses.setdefault(id(source), []).append((len(self.entries), merged))
        self.entries.append(WeightEntry(name, tuple(shape), load))

    def _nf4(self, held: NF4Weight, key: str, merge=None) -> None:
        """An NF4-held stacked weight: one entry under its parameter's key, dequantised (and merged)."""
        if merge is not None:
            self.rules.merge[key] = merge
            self.rules.shapes[key] = tuple(held.shape)
        self.add(key, held.shape, lambda h=held, f=merge: f(h.dequantize()) if f else h.dequantize().float(),
                 held.packed, merge is not None)

    def walk(self, module: nn.Module, prefix: str) -> None:
        if isinstance(module, NF4Weight):
            self._nf4(module, prefix[:-1])
            return
        if _is_param_wrapper(module):
            self._param_lora(module, prefix)
            return
        if _is_lora_layer(module):
            self._lora(module, prefix)
            return
        if _is_modules_to_save(module):
            self._modules_to_save(module, prefix)
            return
        quantized = (type(getattr(module, "weight", None)).__name__ in ("Params4bit", "Int8Params")
                     or is_fp8_layer(module))
        for pname, param in module._parameters.items():
            if param is None:
                continue
            if pname == "weight" and quantized:
                self.add(prefix + pname, _weight_shape(module), self.base_weight(module, prefix + pname), param, False)
            else:
                self.add(prefix + pname, param.shape, lambda p=param: _as_float(p), param, False)
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                self.add(prefix + bname, buf.shape, lambda b=buf: _as_float(b), buf, False)
        for cname, child in module._modules.items():
            if child is not None:
                self.walk(child, f"{prefix}{cname}.")

    def _param_lora(self, module: nn.Module, prefix: str) -> None:
        """PEFT ``ParamWrapper``s (LoRA on a parameter, e.g. stacked MoE experts; nested, one per
        targeted parameter) around one module: its tensors with each wrapper's delta added."""
        merges = {}
        while _is_param_wrapper(module):
            merge = _param_merger(module)
            if merge is not None:
                merges[module.parameter_name] = merge
            module = module.base_layer
        for pname, param in module._parameters.items():
            if param is None:
                continue
            merge = merges.get(pname)
            if merge is not None:
                self.rules.merge[prefix + pname] = merge
                self.rules.shapes[prefix + pname] = tuple(param.shape)
            self.add(prefix + pname, param.shape, lambda p=param, f=merge: f(p) if f else _as_float(p), param,
                     merge is not None)
        for cname, child in module._modules.items():
            if isinstance(child, NF4Weight):
                self._nf4(child, prefix + cname, merges.get(cname))
            elif child is not None:
                self.walk(child, f"{prefix}{cname}.")

    def _lora(self, module: nn.Module, prefix: str) -> None:
        base = module.get_base_layer()
        merge_w = _lora_weight_merger(module)
        merge_b = _lora_bias_merger(module)
        key = prefix + "weight"
        if merge_w is not None:
            self.rules.merge[key] = merge_w
            self.rules.shapes[key] = _weight_shape(base)
        read = self.base_weight(base, key)
        self.add(key, _weight_shape(base), lambda r=read, f=merge_w: f(r()) if f else r(), base.weight,
                 merge_w is not None)
        bias = getattr(base, "bias", None)
        if bias is not None:
            if merge_b is not None:
                self.rules.merge[prefix + "bias"] = merge_b
                self.rules.shapes[prefix + "bias"] = tuple(bias.shape)
            self.add(prefix + "bias", bias.shape, lambda b=bias, f=merge_b: f(b) if f else _as_float(b),
                     bias, merge_b is not None)

    def _modules_to_save(self, module: nn.Module, prefix: str) -> None:
        active = getattr(module, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) else active
        if getattr(module, "disable_adapters", False) or active not in module.modules_to_save:
            self.walk(module.original_module, prefix)
            return
        start = len(self.entries)
        self.walk(module.modules_to_save[active], prefix)
        for entry in self.entries[start:]:
            self.rules.replace[entry.name] = entry.load

    def finish(self) -> tuple[list[WeightEntry], MergeRules]:
        """Drops duplicate (tied) entries unless one of their uses was merged differently."""
        drop: set[int] = set()
        for uses in self._uses.values():
            if len(uses) < 2:
                continue
            if any(merged for _, merged in uses):
                self.rules.untie = True
            else:
                drop.update(i for i, _ in uses[1:])
        entries = [e for i, e in enumerate(self.entries) if i not in drop]
        return entries, self.rules


def _as_float(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.float() if t.is_floating_point() else t


def model_weights(model: nn.Module) -> tuple[list[WeightEntry], MergeRules]:
    """Entries of the merged checkpoint of ``model`` (PEFT or plain), in module order, plus its rules."""
    walker = _Walker()
    walker.walk(unwrap_model(model), "")
    return walker.finish()


def checkpoint_shards(directory: str | Path) -> list[tuple[Path, list[str]]]:
    """(shard file, keys) of a local safetensors checkpoint, in shard order."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            shards.setdefault(fname, []).append(key)
        return [(directory / f, keys) for f, keys in sorted(shards.items())]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")
    with safe_open(str(single), framework="pt") as f:
        return [(single, list(f.keys()))]


def checkpoint_weights(directory: str | Path) -> list[WeightEntry]:
    """Entries reading a local safetensors checkpoint lazily (one tensor per ``load()``)."""
    from safetensors import safe_open

    entries = []
    for path, keys in checkpoint_shards(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                shape = tuple(f.get_slice(key).get_shape())
                entries.append(WeightEntry(key, shape, lambda p=path, k=key: _read_tensor(p, k)))
    return entries


def _read_tensor(path: Path, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return _as_float(f.get_tensor(key))
