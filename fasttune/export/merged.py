"""Merged 16-bit weights that load with ``AutoModelForCausalLM.from_pretrained``.

Every final file is written atomically (``atomic.py``). The live training model is never modified:
merged tensors are computed one at a time from its weights (see ``merged_weights.py``).

``save_merged(model, out, base="org/Base-16bit")`` merges onto the original 16-bit checkpoint,
shard by shard, so a QLoRA run yields a clean 16-bit model instead of dequantised NF4 weights.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from .atomic import staged_dir
from .merged_weights import MergeRules, checkpoint_shards, model_weights, unwrap_model
from .write_errors import naming_write_errors

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = size.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()


class _ShardWriter:
    """Accumulates tensors and writes ``model-XXXXX-of-YYYYY.safetensors`` shards into a stage."""

    def __init__(self, stage: Path, max_bytes: int) -> None:
        self.stage, self.max_bytes = stage, max_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.parts: list[tuple[Path, list[str]]] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.max_bytes:
            self.flush()
        self.current[key] = tensor
        self.size += nbytes

    def flush(self) -> None:
        if not self.current:
            return
        from safetensors.torch import save_file

        i = len(self.parts)
        path = self.stage / f".part-{i:05d}.safetensors"
        final = self.stage.parent / ("model.safetensors" if i == 0 else f"model-{i + 1:05d}.safetensors")
        with naming_write_errors(final, self.size, lambda: _size(path)):
            save_file(self.current, str(path), metadata={"format": "pt"})
        self.parts.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def finish(self) -> list[str]:
        """Renames parts to their final names, writes the index when sharded; returns file names."""
        self.flush()
        n = len(self.parts)
        if n == 0:
            raise ValueError("the merged model has no tensors")
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map, total = {}, 0
        for (path, keys), name in zip(self.parts, names):
            os.replace(path, self.stage / name)
            total += (self.stage / name).stat().st_size
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def _resolve_base(base: str | Path) -> Path:
    """A local checkpoint folder for ``base``: the path itself, or a Hub snapshot (downloads)."""
    path = Path(base).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(base).startswith((".", "/", "~")) or str(base).count("/") != 1:
        raise FileNotFoundError(f"base {str(base)!r} is neither a local checkpoint folder nor a Hub id")
    from huggingface_hub import snapshot_download

    from .hub_http import hub_timeouts

    with hub_timeouts():  # a stalled download fails (and is retried by huggingface_hub) instead of hanging
        return Path(snapshot_download(str(base), allow_patterns=["*.safetensors", "*.json"]))


def _embedding_keys(inner: nn.Module) -> tuple[str | None, str | None]:
    names = {id(m): n for n, m in inner.named_modules()}
    keys = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            mod = getattr(inner, getter)()
        except (AttributeError, NotImplementedError):
            mod = None
        keys.append(f"{names[id(mod)]}.weight" if mod is not None and id(mod) in names else None)
    return keys[0], keys[1]


def _merge_from_base(stage: Path, base_dir: Path, rules: MergeRules, dtype: torch.dtype) -> list[str]:
    """Streams ``base_dir``'s shards: each output shard = base shard with LoRA merged / modules replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = checkpoint_shards(base_dir)
    pending = set(rules.merge) | set(rules.replace)
    n = len(shards)
    weight_map, names, total = {}, [], 0
    for i, (path, keys) in enumerate(shards):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for key in keys:
                if key in rules.replace:
                    tensor = rules.replace[key]()
                else:
                    tensor = f.get_tensor(key)
                    if key in rules.merge:
                        if tuple(tensor.shape) != rules.shapes[key]:
                            raise ValueError(f"LoRA merge of {key!r}: base has shape {tuple(tensor.shape)}, "
                                             f"the adapter was trained on {rules.shapes[key]}")
                        tensor = rules.merge[key](tensor.float())
                pending.discard(key)
                out[key] = _cast(tensor, dtype)
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        expected = sum(t.numel() * t.element_size() for t in out.values())
        with naming_write_errors(stage.parent / name, expected, lambda: _size(stage / name)):
            save_file(out, str(stage / name), metadata={"format": "pt"})
        total += (stage / name).stat().st_size
        weight_map.update({k: name for k in out})
        names.append(name)
        del out
    missing = sorted(k for k in pending if k in rules.merge)
    if missing:
        raise ValueError(f"base checkpoint {base_dir} has no tensor for the LoRA-merged key(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}: is it the model the adapter was trained on?")
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _save_config(inner: nn.Module, stage: Path, dtype: torch.dtype, untie: bool) -> None:
    config = copy.deepcopy(inner.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = dtype
    if untie and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False
    config.save_pretrained(str(stage))
    generation_config = getattr(inner, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(stage))


def _remove_stale_shards(out_dir: Path, keep: list[str]) -> None:
    for p in out_dir.glob("model*.safetensors"):
        if p.name not in keep:
            p.unlink()
    if len(keep) == 1 and (out_dir / "model.safetensors.index.json").exists():
        (out_dir / "model.safetensors.index.json").unlink()


def _writable_dir(out_dir: str | Path, name: str = "out_dir") -> Path:
    """``out_dir`` as a Path, created and checked writable before any work: a merge can take minutes,
    so a path that cannot receive it fails first, with the path and the reason, not at the end.

    Raises:
        TypeError: ``out_dir`` is not a str or path.
        ValueError: it is an existing file, or the folder cannot be created or written.
    """
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"{name} must be a folder path (str or os.PathLike), got {type(out_dir).__name__}")
    path = Path(out_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: {path} is an existing file, not a folder; pass a folder path "
                         "(created when missing); the file was left untouched")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A real write, not os.access: root passes os.access on read-only mounts.
        fd, probe = tempfile.mkstemp(prefix=".fasttune-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{name}: cannot write to the folder {path}: {err.strerror or err} "
                         f"({type(err).__name__}); nothing was written") from err
    return path


def save_merged(model: nn.Module, out_dir: str | Path, tokenizer=None, *, base: str | Path | None = None,
                dtype: torch.dtype | str = torch.bfloat16, max_shard_size: int | str = "5GB") -> Path:
    """Saves LoRA-merged weights that load with ``AutoModelForCausalLM.from_pretrained``.

    The merge runs in float32 and casts to ``dtype`` at the write. The live model is untouched.

    Args:
        model: a ``peft.PeftModel`` (LoRA, possibly on an NF4/int8 bitsandbytes base) or a plain
            transformers model (then this is a dequantising ``save_pretrained``).
        out_dir: destination folder (created). Checked before merging: an existing file or a
            folder that cannot be created or written is a ValueError naming it, and nothing is written.
        tokenizer: saved beside the weights when given.
        base: None merges onto the model's own base weights (dequantised when quantised). A local
            checkpoint folder or Hub id of the 16-bit original merges onto those instead, streaming
            one shard at a time (no network when local).
        dtype: torch dtype or one of "bfloat16", "float16", "float32".
        max_shard_size: shard size for ``base=None`` ("5GB", "200MB" or bytes); with ``base`` the
            base's sharding is kept.

    Returns:
        ``out_dir`` as a Path. Writes ``config.json`` (without ``quantization_config``),
        ``generation_config.json``, safetensors shards (+ index) and the tokenizer files.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be a torch dtype or one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    out_dir = _writable_dir(out_dir)
    inner = unwrap_model(model)
    entries, rules = model_weights(model)
    in_key, out_key = _embedding_keys(inner)
    names_present = {e.name for e in entries}
    untie = rules.untie or (in_key != out_key and in_key in names_present and out_key in names_present
                            and getattr(inner.config, "tie_word_embeddings", False))
    with torch.no_grad(), staged_dir(out_dir) as stage:
        if base is None:
            writer = _ShardWriter(stage, _parse_size(max_shard_size))
            for entry in entries:
                writer.add(entry.name, _cast(entry.load(), dtype))
            shard_names = writer.finish()
        else:
            shard_names = _merge_from_base(stage, _resolve_base(base), rules, dtype)
        _save_config(inner, stage, dtype, untie)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(stage))
    _remove_stale_shards(out_dir, shard_names)
    logger.info("saved merged %s model to %s (%d shard(s))", str(dtype).replace("torch.", ""), out_dir,
                len(shard_names))
    return out_dir
