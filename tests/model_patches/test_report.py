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
