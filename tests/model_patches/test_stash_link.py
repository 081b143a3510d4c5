"""The stashes' link budget and held originals (``stash_link.py``), on stand-in events: the arithmetic of what
goes to the host, and the order in which device memory is let go."""

from __future__ import annotations

import pytest

from fasttune.model_patches.stash_link import HeldOriginals, LinkBudget

MIB = 1 << 20


class Clock:
    """Events on a made-up GPU timeline: ``at(t)`` is done once the clock has passed ``t`` seconds."""

    def __init__(self):
        self.now = 0.0

    def at(self, t: float) -> "FakeEvent":
        return FakeEvent(self, t)


class FakeEvent:
    def __init__(self, clock: Clock, t: float):
        self.clock, self.t = clock, t

    def query(self) -> bool:
        return self.clock.now >= self.t

    def elapsed_time(self, later: "FakeEvent") -> float:
        return (later.t - self.t) * 1e3


def _forward(budget: LinkBudget, clock: Clock, layers: int, layer_s: float, input_bytes: int, core_bytes: int,
             t0: float = 0.0) -> list[bool]:
    """One forward's decisions: each layer starts ``layer_s`` after the last and offers one core."""
    went = []
    for i in range(layers):
        budget.layer_event(i, clock.at(t0 + i * layer_s), input_bytes)
        ok = budget.admits(core_bytes) if budget.measured else False
        went.append(ok)
    return went


def test_unmeasured_until_a_forward_and_copies_are_done_then_rate_and_layer_time_are_read():
    clock, budget = Clock(), LinkBudget(safety=1.0)
    assert _forward(budget, clock, 4, 0.007, 64 * MIB, 512 * MIB) == [False] * 4
    assert not budget.measured
    budget.copies_timed(500 * MIB, clock.at(0.010), clock.at(0.020))  # 50 GiB/s-ish: 500 MiB in 10 ms
    clock.now = 1.0
    budget.layer_event(0, clock.at(1.0), 64 * MIB)  # a new forward reads the last one's events
    assert budget.measured
    assert budget.layer_s == pytest.approx(0.007)
    assert budget.rate == pytest.approx(500 * MIB / 0.010)


def test_copies_on_two_streams_at_once_share_the_link():
    """The rate is bytes over the union of the copies' spans: overlapping copies are not counted twice."""
    clock, budget = Clock(), LinkBudget()
    budget.layer_event(0, clock.at(0.0), MIB)
    budget.layer_event(1, clock.at(0.007), MIB)
    budget.copies_timed(100 * MIB, clock.at(0.000), clock.at(0.004))  # an input, then a core alongside it
    budget.copies_timed(300 * MIB, clock.at(0.002), clock.at(0.008))
    budget.copies_timed(100 * MIB, clock.at(0.010), clock.at(0.012))
    clock.now = 1.0
    budget.layer_event(0, clock.at(1.0), MIB)
    assert budget.rate == pytest.approx(500 * MIB / 0.010)


def test_a_forward_in_flight_is_not_read():
    """Events the GPU has not reached yet (the host ahead) are left for later, not read as zeros."""
    clock, budget = Clock(), LinkBudget()
    _forward(budget, clock, 4, 0.007, MIB, MIB)
    budget.copies_timed(MIB, clock.at(0.001), clock.at(0.002))
    budget.layer_event(0, clock.at(0.5), MIB)  # the clock is still at 0: nothing done
    assert not budget.measured and budget.rate is None and budget.layer_s is None


def test_the_share_of_cores_sent_follows_the_link_and_the_backlog_stays_within_the_hold_window():
    """Link 50 MiB/ms, layers 7 ms, inputs 64 MiB: 286 MiB a layer for the stash, a backlog of at most two
    layers' worth (572 MiB). 512 MiB cores: every other layer; 100 MiB cores: every layer; cores larger than
    the backlog allowed: none."""
    clock, budget = Clock(), LinkBudget(safety=1.0)
    budget.rate, budget.layer_s = 50 * MIB / 1e-3, 0.007
    went = _forward(budget, clock, 32, 0.007, 64 * MIB, 512 * MIB, t0=10.0)
    assert went == [True, False] * 16
    assert all(_forward(budget, clock, 32, 0.007, 64 * MIB, 100 * MIB, t0=20.0))
    assert not any(_forward(budget, clock, 32, 0.007, 64 * MIB, 600 * MIB, t0=30.0))


def test_a_link_slower_than_the_inputs_takes_nothing():
    clock, budget = Clock(), LinkBudget(safety=1.0)
    budget.rate, budget.layer_s = 5 * MIB / 1e-3, 0.007  # 35 MiB a layer, below the 64 MiB input
    assert not any(_forward(budget, clock, 8, 0.007, 64 * MIB, 1 * MIB))


def test_layers_that_send_nothing_do_not_save_up_for_a_burst():
    clock, budget = Clock(), LinkBudget(safety=1.0)
    budget.rate, budget.layer_s = 50 * MIB / 1e-3, 0.007
    for i in range(20):  # layers whose cores are not stashable: credit accrues, capped
        budget.layer_event(i, clock.at(i * 0.007), 64 * MIB)
        if i == 0:
            assert budget.admits(500 * MIB)  # a forward starts with the link idle
    assert budget.admits(512 * MIB)
    assert not budget.admits(512 * MIB)


def test_a_new_forward_starts_with_the_link_idle():
    clock, budget = Clock(), LinkBudget(safety=1.0)
    budget.rate, budget.layer_s = 50 * MIB / 1e-3, 0.007
    _forward(budget, clock, 8, 0.007, 64 * MIB, 8 * MIB)
    budget.layer_event(0, clock.at(1.0), 64 * MIB)  # index back to 0: a new forward
    assert budget.credit == pytest.approx(2 * 286 * MIB)


def test_a_forward_that_pinned_new_host_buffers_does_not_time_the_layers():
    """Pinning holds the host while the GPU waits: such a forward's layers look longer than they are. The first
    forward pins the layer inputs' buffers, so the layer time comes from the second; a later forward whose
    stash pinned more keeps the last clean figure."""
    clock, budget = Clock(), LinkBudget(safety=1.0)
    budget.copies_timed(500 * MIB, clock.at(0.0), clock.at(0.010))
    for i in range(4):  # host-bound while the pool grows: 30 ms between layers
        budget.layer_event(i, clock.at(i * 0.030), 64 * MIB, host_allocations=i + 1)
    clock.now = 1.0
    budget.layer_event(0, clock.at(1.0), 64 * MIB, host_allocations=4)  # the first forward grew the pool
    assert budget.rate == pytest.approx(500 * MIB / 0.010) and budget.layer_s is None and not budget.measured
    for i in range(1, 4):
        budget.layer_event(i, clock.at(1.0 + i * 0.007), 64 * MIB, host_allocations=4)
    clock.now = 2.0
    budget.layer_event(0, clock.at(2.0), 64 * MIB, host_allocations=4)  # no growth: timed
    assert budget.measured and budget.layer_s == pytest.approx(0.007)
    for i in range(1, 4):
        budget.layer_event(i, clock.at(2.0 + i * 0.020), 64 * MIB, host_allocations=4 + i)
    clock.now = 3.0
    budget.layer_event(0, clock.at(3.0), 64 * MIB, host_allocations=7)  # the stash pinned 3 more: not timed
    assert budget.layer_s == pytest.approx(0.007)


class FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_held_originals_go_after_the_compute_stream_waits_for_their_copies():
    held, stream = HeldOriginals(hold_layers=2), FakeStream()
    tensors = {}
    for layer in range(4):
        held.layer_started()
        tensors[layer] = ["block"]
        held.hold(f"copies of {layer}", stream, tensors[layer])
    # Layer 3 started: layers 0 and 1 (two layers back and more) were let go, each after its wait.
    assert stream.waited == ["copies of 0", "copies of 1"]
    assert tensors[0] == [] and tensors[1] == [] and tensors[2] == ["block"] and len(held) == 2
    held.release_all()
    assert stream.waited == [f"copies of {i}" for i in range(4)] and len(held) == 0 and tensors[3] == []


def test_a_core_that_sent_more_than_its_charge_holds_back_the_next():
    """Credit settles to the bytes really queued, and may go below zero: the layers earn it back first."""
    clock, budget = Clock(), LinkBudget(safety=1.0)
    budget.rate, budget.layer_s = 50 * MIB / 1e-3, 0.007  # 286 MiB a layer, at most 572 MiB of credit
    budget.layer_event(0, clock.at(0.0), 64 * MIB)
    assert budget.admits(300 * MIB)
    budget.settle(300 * MIB, 800 * MIB)
    assert budget.credit == pytest.approx(-228 * MIB)
    assert not budget.admits(1)
    budget.layer_event(1, clock.at(0.007), 64 * MIB)
    assert budget.credit == pytest.approx(58 * MIB) and budget.admits(50 * MIB)
    budget.settle(50 * MIB, 10 * MIB)  # sent less: the rest comes back
    assert budget.credit == pytest.approx(48 * MIB)
