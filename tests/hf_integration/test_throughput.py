"""ThroughputMeter: tokens counted per step without host syncs, turned into a rate at log time."""

import time

import torch

from fasttune.hf_integration.throughput import ThroughputMeter


def test_counts_attention_mask_tokens_and_resets():
    meter = ThroughputMeter()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    meter.count({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask})
    meter.count({"input_ids": torch.zeros(3, 5, dtype=torch.long)})  # no mask: every token
    time.sleep(0.01)
    out = meter.read()
    assert 0 < out["tokens_per_second"] <= 20 / 0.01
    assert "tokens_per_second" not in meter.read()  # nothing counted since the last read


def test_inputs_without_tokens_are_ignored():
    meter = ThroughputMeter()
    meter.count({"pixel_values": torch.zeros(1, 3)})
    assert "tokens_per_second" not in meter.read()
