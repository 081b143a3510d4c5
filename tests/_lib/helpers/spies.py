"""Call counters for the fused Functions, so a silent fallback to the stock path fails a test."""

from __future__ import annotations

from collections import Counter

from fasttune.kernels import grouped_mlp as grouped_mlp_mod
from fasttune.model_patches import lora as lora_mod
from fasttune.model_patches.allocator import OP as ALLOCATOR_OP
from fasttune.model_patches.attention import OP_SINKS


def count_fused_lora(monkeypatch) -> Counter:
    """Count (by name) the calls the LoRA hooks make of lora_qkv, lora_linear and lora_mlp."""
    calls = Counter()
    for name in ("lora_qkv", "lora_linear", "lora_mlp"):
        fn = getattr(lora_mod, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(lora_mod, name, counted)
    return calls


def model_patch_counts(report) -> dict[str, int]:
    """``report.patched`` without the switches only a CUDA machine makes (the allocator's, tested by
    test_allocator.py; gpt-oss's flex attention, by test_sink_attention.py): the model's own patches,
    the same on CPU and GPU."""
    return {op: n for op, n in report.patched.items() if op not in (ALLOCATOR_OP, OP_SINKS)}


def grouped_mlp_output_unused(monkeypatch) -> list[bool]:
    """The ``output_unused`` flag of every fused forward of the grouped expert MLP (with autograd or
    without), in call order (False: a full call; True: a checkpoint recompute's gate/up product alone)."""
    flags = []
    real = grouped_mlp_mod._forward

    def spy(x, index, weights, glu, meta, output_unused, tensors, save):
        flags.append(output_unused)
        return real(x, index, weights, glu, meta, output_unused, tensors, save)

    monkeypatch.setattr(grouped_mlp_mod, "_forward", spy)
    return flags
