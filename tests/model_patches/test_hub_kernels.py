"""hub_kernels.py: a model transformers kernelized (``use_kernels=True``, transformers >= 5.25's default) keeps
fasttune's patches through ``model.train()``, and gets its kernelization back at ``unpatch_model``.

Real parts: the ``kernels`` package (pinned in constraints.txt) lives in .venv/kernels-site
(scripts/setup_test_tools.sh), outside the test venv, where bitsandbytes and transformers would reach
for the Hub at import; each case runs in a subprocess with it on the path, offline, on the CPU, where
kernelize finds no kernel for the device and puts back the class's forward (the way a CUDA model gets
Liger's RMSNorm from the Hub: the instance's patched forward is replaced either way).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.fresh_process import run_script

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / ".venv" / "kernels-site"

SCRIPT = r"""
import sys, tempfile
from helpers.fresh_process import result_line
from helpers.tiny_models import make_batch, tiny_model
from transformers import AutoModelForCausalLM
from fasttune import FastConfig, patch_model, unpatch_model

path = tempfile.mkdtemp()
tiny_model("llama", seed=1).save_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True)
out = dict(kernelized=model.use_kernels)
report = patch_model(model, FastConfig(checkpointing=None))
out["after_patch"] = model.use_kernels
out["off"] = report.patched["hub_kernels_off"]
if sys.argv[1] == "kernelize-again":  # the control: the user turns the Hub kernels on over the patch
    model.set_use_kernels(True)
switches = []
if sys.argv[1] == "repatch":  # patch_model again: no kernelization in between, one undo that restores it
    setter = model.set_use_kernels
    model.set_use_kernels = lambda on, **kw: (switches.append(on), setter(on, **kw))[1]
    report = patch_model(model, FastConfig(checkpointing=None))
    out["off"] = report.patched["hub_kernels_off"]
model.train()  # what Trainer.train() does first: a mode change, which kernelizes a kernelized model again
model(**make_batch(model.config.vocab_size, seed=1)).loss.backward()
out["norm_calls"] = {why: n for (op, why), n in report.calls.items() if op == "rms_norm"}
out["warnings"] = report.call_summary()[1]
unpatch_model(model)
out["after_unpatch"] = model.use_kernels
out["switches"] = switches
print(result_line(out))
"""


def _run(mode: str) -> dict:
    if not (SITE / "kernels").is_dir():
        pytest.skip(f"the kernels package is not installed in {SITE} (bash scripts/setup_test_tools.sh)")
    return run_script(SCRIPT, mode, paths=[SITE], HF_HUB_OFFLINE="1")


def test_patched_norms_survive_train_on_a_kernelized_model():
    out = _run("patch")
    assert out["kernelized"] is True  # transformers kernelized it at load
    assert out["after_patch"] is False and out["off"] == 1
    assert out["norm_calls"].get("fused", 0) > 0 and set(out["norm_calls"]) == {"fused"}, out["norm_calls"]
    assert not out["warnings"], out["warnings"]
    assert out["after_unpatch"] is True  # unpatch_model gives the kernelization back


def test_control_kernelizing_over_the_patch_replaces_the_norms():
    """The same recipe with the kernelization turned on again after patching: kernelize replaces the patched
    norms' forwards, no norm call reaches fasttune, and the report says so. What the first test shows is the
    patch's switch at work, not a kernelize that leaves the norms alone."""
    out = _run("kernelize-again")
    assert out["after_patch"] is False
    assert out["norm_calls"].get("fused", 0) == 0
    assert any(w.startswith("rms_norm is patched but ran no call fused") for w in out["warnings"]), out["warnings"]


def test_a_repatch_does_not_kernelize_in_between():
    """``patch_model`` on a patched kernelized model: the kernelization stays off through the re-patch (no
    ``set_use_kernels(True)`` then ``False``: on CUDA a Hub fetch each time), the new report holds its undo,
    the norms run fused, and ``unpatch_model`` turns it back on once."""
    out = _run("repatch")
    assert out["after_patch"] is False and out["off"] == 1
    assert out["norm_calls"].get("fused", 0) > 0 and set(out["norm_calls"]) == {"fused"}, out["norm_calls"]
    assert out["switches"] == [True], out["switches"]  # only unpatch_model's
    assert out["after_unpatch"] is True
