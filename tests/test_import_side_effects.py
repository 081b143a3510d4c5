"""`import fasttune` (and each subpackage) changes nothing in torch, transformers, peft, trl or os.environ."""

import json
import subprocess
import sys

import pytest

# Runs in a fresh interpreter: fingerprint the libraries, import fasttune's packages, fingerprint again.
_PROBE = r"""
import importlib, json, os, sys, types
import torch, transformers, peft, trl
import transformers.models.llama.modeling_llama as ml
import transformers.trainer as tt

def fingerprint():
    fp = {}
    mods = [torch, torch.nn.functional, transformers, peft, trl, ml, tt, torch.utils.checkpoint]
    for m in mods:
        for k, v in list(vars(m).items()):
            if callable(v) or isinstance(v, type):
                fp[f"{m.__name__}.{k}"] = id(v)
    for cls in (ml.LlamaForCausalLM, ml.LlamaAttention, ml.LlamaMLP, ml.LlamaRMSNorm, ml.LlamaDecoderLayer,
                tt.Trainer, torch.nn.Module, torch.nn.Linear, torch.autograd.Function):
        for k, v in list(vars(cls).items()):
            fp[f"{cls.__qualname__}.{k}"] = id(v)
    return fp

before, env_before = fingerprint(), dict(os.environ)
loaded_before = set(sys.modules)
for name in sys.argv[1:]:
    mod = importlib.import_module(name)
    for attr in getattr(mod, "__all__", []):
        getattr(mod, attr, None)  # resolve lazy names too
after, env_after = fingerprint(), dict(os.environ)
changed = sorted(k for k in before if after.get(k) != before[k])
print(json.dumps({"changed": changed, "env": sorted(set(env_before.items()) ^ set(env_after.items())),
                  "cuda_init": torch.cuda.is_initialized()}))
"""

PACKAGES = ["fasttune", "fasttune.config", "fasttune.kernels", "fasttune.model_patches",
            "fasttune.hf_integration", "fasttune.hf_integration.trainer", "fasttune.hf_integration.callback",
            "fasttune.hub_cards"]


@pytest.mark.parametrize("packages", [PACKAGES])
def test_import_changes_nothing(packages):
    out = subprocess.run([sys.executable, "-c", _PROBE, *packages], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["changed"] == [], f"import changed library attributes: {result['changed'][:20]}"
    assert result["env"] == [], f"import changed os.environ: {result['env']}"
    assert result["cuda_init"] is False
