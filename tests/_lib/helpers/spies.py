"""Call counters for the fused Functions, so a silent fallback to the stock path fails a test."""

from __future__ import annotations

from collections import Counter

from fasttune.model_patches import lora as lora_mod


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
