"""LayerRecords: what transformers' output collector gathered during one layer call, on the real
``transformers.utils.output_capturing`` collector variable."""

from __future__ import annotations

import torch
from transformers.utils import output_capturing

from fasttune.model_patches.layer_records import LayerRecords


def test_new_slots_get_replace_and_a_fresh_collector_for_the_recompute():
    var = output_capturing._active_collector
    collected = {"router_logits": [torch.zeros(1)], "hidden_states": [], "_hidden_states_layers": [0, 2]}
    token = var.set(collected)
    try:
        records = LayerRecords()
        a, b = torch.ones(2), torch.full((3,), 2.0)
        collected["router_logits"] += [a, None]  # a None entry is no record
        collected["hidden_states"].append(b)
        slots = records.new_slots()
        assert sorted(slots) == [("hidden_states", 0), ("router_logits", 0)]
        got = records.get(slots)
        assert all(x is y for x, y in zip(got, [{"router_logits": a, "hidden_states": b}[k] for k, _ in slots]))
        c, d = a + 1, b + 1
        records.replace(slots, [{"router_logits": c, "hidden_states": d}[k] for k, _ in slots])
        assert collected["router_logits"][1] is c and collected["hidden_states"][0] is d
        assert collected["router_logits"][0].shape == (1,)  # what was there before the call is untouched
        with records.recording({"router_logits"}) as fresh:
            assert var.get() is fresh and fresh == {"router_logits": []}
        assert var.get() is collected
        with records.recording(set()) as empty:
            assert empty == {} and var.get() is collected
    finally:
        var.reset(token)


def test_no_active_collector_records_nothing():
    records = LayerRecords()
    assert records.new_slots() == [] and records.get([]) == []
