"""``FastConfig.gc_freeze``: after the first optimizer step of ``train()`` Python's collector leaves every object
alive then alone (``gc.freeze``) until ``train()`` ends, on FastTrainer and FastPatchCallback; a collector that is
off, or objects frozen by someone else, are left as they are; a ``train()`` that raises still thaws."""

import gc

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from fasttune import FastConfig, FastPatchCallback, FastTrainer
from fasttune.embedded import PadCollator
from fasttune.hf_integration.collector import FrozenCollector
from helpers.tiny_models import tiny_model
from helpers.train_data import random_lm_rows


class FreezeProbe(TrainerCallback):
    """``gc.get_freeze_count()`` at each step's end; raises at step ``fail_at`` when given."""

    def __init__(self, fail_at: int | None = None):
        self.counts, self.fail_at = [], fail_at

    def on_step_end(self, args, state, control, **kwargs):
        self.counts.append(gc.get_freeze_count())
        if state.global_step == self.fail_at:
            raise RuntimeError("a step fails")


@pytest.fixture(autouse=True)
def thawed(monkeypatch):
    monkeypatch.setattr(FrozenCollector, "MIN_STEPS", 3)  # these runs are 3 steps long
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def _trainer(tmp_path, fast_config=None, callback=False, probe=None):
    model = tiny_model("llama")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    probe = probe or FreezeProbe()
    kw = dict(model=model, args=args, train_dataset=random_lm_rows(model.config.vocab_size, n=16),
              data_collator=PadCollator(0))
    if callback:
        return Trainer(callbacks=[FastPatchCallback(fast_config), probe], **kw), probe
    return FastTrainer(fast_config=fast_config, callbacks=[probe], **kw), probe


@pytest.mark.parametrize("callback", [False, True], ids=["FastTrainer", "FastPatchCallback"])
def test_frozen_after_the_first_step_and_thawed_when_train_ends(tmp_path, callback):
    trainer, probe = _trainer(tmp_path, callback=callback)
    trainer.train()
    # Every step after the first runs with the objects frozen (the probe may see the first step's freeze or
    # not, by the callbacks' order); none are once train() is over.
    assert len(probe.counts) == 3 and all(c > 1000 for c in probe.counts[1:]), probe.counts
    assert gc.get_freeze_count() == 0
    trainer.train()  # a second train() freezes again
    assert all(c > 1000 for c in probe.counts[4:]) and gc.get_freeze_count() == 0, probe.counts


def test_off_leaves_the_collector_alone(tmp_path):
    trainer, probe = _trainer(tmp_path, FastConfig(gc_freeze=False))
    trainer.train()
    assert probe.counts == [0, 0, 0]


def test_objects_someone_else_froze_stay_frozen_and_a_disabled_collector_stays_off(tmp_path):
    gc.freeze()
    theirs = gc.get_freeze_count()
    trainer, probe = _trainer(tmp_path)
    trainer.train()
    # Not frozen again (no more than theirs; some of theirs die by reference count meanwhile), not thawed.
    assert all(theirs // 2 < c <= theirs for c in probe.counts + [gc.get_freeze_count()]), (theirs, probe.counts)
    gc.unfreeze()
    gc.disable()
    trainer, probe = _trainer(tmp_path / "off")
    trainer.train()
    assert probe.counts == [0, 0, 0] and not gc.isenabled()


def test_a_train_that_raises_thaws(tmp_path):
    trainer, probe = _trainer(tmp_path, probe=FreezeProbe(fail_at=2))
    with pytest.raises(RuntimeError, match="a step fails"):
        trainer.train()
    assert probe.counts[-1] > 1000 and gc.get_freeze_count() == 0


def test_a_run_shorter_than_min_steps_is_not_frozen(tmp_path, monkeypatch):
    """The thaw costs a full collection: a run of fewer steps than ``MIN_STEPS`` would pay what it saves."""
    monkeypatch.setattr(FrozenCollector, "MIN_STEPS", 4)
    trainer, probe = _trainer(tmp_path)
    trainer.train()
    assert probe.counts == [0, 0, 0]
