"""PatchReport: counts, grouped fallbacks in the log table, undo order."""

from fasttune.model_patches.report import Fallback, PatchReport


def test_counts_and_table():
    r = PatchReport(model_type="llama")
    r.add("rms_norm", 5)
    r.add("cross_entropy")
    for i in range(32):
        r.fallback("lora_mlp", f"model.layers.{i}.mlp", "lora_dropout > 0")
    text = str(r)
    assert "rms_norm" in text and "5 patched" in text and "cross_entropy" in text
    assert text.count("lora_dropout > 0") == 1 and "(+29 more)" in text
    assert r.fallbacks[0] == Fallback("lora_mlp", "model.layers.0.mlp", "lora_dropout > 0")


def test_empty_report_says_so():
    assert "nothing patched" in str(PatchReport(model_type="gpt2"))


def test_undo_runs_last_first_once():
    order = []
    r = PatchReport()
    r.on_undo(lambda: order.append(1))
    r.on_undo(lambda: order.append(2))
    r.undo()
    r.undo()
    assert order == [2, 1]


def test_take_undo_removes_only_the_picked_steps():
    order = []
    r = PatchReport()
    steps = [lambda i=i: order.append(i) for i in range(4)]
    for fn in steps:
        r.on_undo(fn)
    assert r.take_undo(lambda fn: fn in (steps[0], steps[2])) == [steps[0], steps[2]]
    r.undo()
    assert order == [3, 1]


def _reports_logged(caplog) -> int:
    return sum(r.getMessage().startswith("fasttune patch report") for r in caplog.records)


def test_patch_model_logs_its_report_once_per_model_and_outcome(caplog, monkeypatch):
    import logging

    from fasttune import FastConfig, patch_model
    from helpers.tiny_models import tiny_model

    caplog.set_level(logging.INFO, logger="fasttune")
    model, other = tiny_model("llama"), tiny_model("llama")
    patch_model(model)
    patch_model(model, FastConfig())  # the Trainer re-patching what the loader patched: same outcome
    assert _reports_logged(caplog) == 1
    patch_model(model, FastConfig(rms_norm=False))  # a different outcome is news
    patch_model(other)  # another instance has its own report
    assert _reports_logged(caplog) == 3
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # rank 0 speaks for a launched job
    patch_model(tiny_model("llama"))
    assert _reports_logged(caplog) == 0
