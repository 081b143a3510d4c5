"""The host link as a budget for the stashes, in GPU time; and the device originals their copies read.

A stashed core (``attention_stash.py``) copies what it saves to the host on the offload side stream,
behind the layer inputs. Whether the link keeps up is a question of GPU time: the host usually runs
a good part of a step ahead of the GPU, so asking on the host whether an earlier core's copies are
done says more about that lead than about the link (on a fast host nearly every core was turned
away, ``cores_link_busy``). ``LinkBudget`` decides in GPU time instead, from two figures measured on
the run itself:

- the link's device-to-host rate: the bytes of every copy to the host in a forward (layer inputs and
  stashed cores, ``OffloadedCheckpointer.copy_timer``) over the time the link was busy with them (the
  union of their spans: events right around each batch of copies, on the streams that run them);
- a layer's forward time: events recorded on the compute stream as each offloaded layer starts,
  read at the next forward (by then they are done). Not from a forward in which the host pool grew:
  pinning new host buffers (``cudaHostAlloc``, ~20 ms for a 64 MiB layer input) holds the host while
  the GPU waits, so such a forward's layers look several times longer than they are (session 39, an
  H100: the first step's layer inputs made the second step send all 32 MLP cores, the pool grew to
  18 GiB for a steady state of ~6.5, and the first timed step ran 872 ms against 640).

Each offloaded layer's forward lets the link carry ``SAFETY * rate * layer time`` minus the layer input's
bytes of the stash's copies. The credit is what the link could still take on without its backlog of
stashed copies growing past ``HOLD_LAYERS - 1`` layers' worth (a core ends within its layer, and its
originals are let go when layer ``HOLD_LAYERS`` after it begins): each layer adds its share, up to that
cap (idle link time cannot be saved up); a core goes to the host when the credit covers its estimated bytes
(the credit drops by them, then by the difference to what it really queued), else it is recomputed as usual. A forward starts with the link idle (full credit).
Until both figures exist no core goes: the first training step (its forward pins the layer inputs' buffers)
and the second stash nothing.

``HeldOriginals``: the device tensors a core's copies read are kept referenced, not
``record_stream``'d, and let go ``HOLD_LAYERS`` layers later after the compute stream waits for
their copies' event: their blocks serve the compute stream again in stream order at once. With
``record_stream`` a block waits until the host notices the copy done; the host being ahead, a whole
forward's stashed blocks stayed reserved (the layer inputs had the same problem, ``offload.py``).
The budget keeps the copies within that lag, so the wait costs nothing.
"""

from __future__ import annotations

import collections
import statistics

import torch

SAFETY = 0.9  # of the measured link rate the stash may plan on
HOLD_LAYERS = 3  # a core's device originals are let go this many offloaded layers after the one it ran in


class LinkBudget:
    """Per-forward credit of link bytes (see the module docstring).

    Attributes:
        rate: device-to-host bytes per second, measured on the stash's own copies (None until then).
        layer_s: median GPU seconds between offloaded layers' starts in the last measured forward.
        credit: bytes the link can still take in this forward without falling behind the compute.
    """

    def __init__(self, safety: float = SAFETY):
        self.safety = safety
        self.rate: float | None = None
        self.layer_s: float | None = None
        self.credit = 0.0
        self._layer_events: list[tuple[int, torch.cuda.Event]] = []  # this forward's (layer index, start)
        self._last_index: int | None = None
        self._copies: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # (bytes, start, end), unread
        self._host_allocations: int | None = None  # the host pool's count as the forward now running began

    @property
    def measured(self) -> bool:
        return self.rate is not None and self.layer_s is not None

    def per_layer(self, input_bytes: int) -> float:
        """Link bytes one offloaded layer's forward leaves for the stash (may be negative)."""
        return self.safety * self.rate * self.layer_s - input_bytes

    def cap(self, input_bytes: int) -> float:
        """The most credit there can be: the backlog the hold window lets the copies have."""
        return max(self.per_layer(input_bytes), 0.0) * (HOLD_LAYERS - 1)

    def layer_started(self, index: int, device: torch.device, input_bytes: int,
                      host_allocations: int | None = None) -> None:
        """An offloaded layer's forward begins (CUDA): record its start, and add its share to the credit.
        ``host_allocations``: the host pool's count of buffers ever pinned (``HostBufferPool.allocations``)."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        self.layer_event(index, event, input_bytes, host_allocations)

    def layer_event(self, index: int, event, input_bytes: int, host_allocations: int | None = None) -> None:
        """``layer_started`` with its event recorded (``query()``, ``elapsed_time(later)`` in ms)."""
        new_forward = self._last_index is None or index <= self._last_index
        if new_forward:
            grew = host_allocations is not None and host_allocations != self._host_allocations
            self._host_allocations = host_allocations
            self._new_forward(layers_timed=not grew)
        self._last_index = index
        self._layer_events.append((index, event))
        if self.measured:
            cap = self.cap(input_bytes)
            self.credit = cap if new_forward else min(self.credit + self.per_layer(input_bytes), cap)

    def admits(self, nbytes: int) -> bool:
        """May a core of ``nbytes`` go now (measured figures only; the credit drops by it if so)?"""
        if self.credit < nbytes:
            return False
        self.credit -= nbytes
        return True

    def settle(self, charged: int, sent: int) -> None:
        """A core admitted for ``charged`` bytes queued ``sent``: the credit takes the difference, and may go
        below zero (the next cores wait for the layers to earn it back). The estimate can be short: with a
        padding mask transformers' sdpa repeats k and v to every head before the kernel saves them."""
        self.credit -= sent - charged

    def copies_timed(self, nbytes: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """A stashed core's copies, between ``start`` and ``end`` on the side stream."""
        self._copies.append((nbytes, start, end))

    def _new_forward(self, layers_timed: bool = True) -> None:
        """Read what the last forward measured (its events are done by now, or it is skipped); its layer
        times only when ``layers_timed`` (the host pool did not grow during it)."""
        self.credit = 0.0
        events, self._layer_events = self._layer_events, []
        gaps = [a.elapsed_time(b) / 1e3 for (i, a), (j, b) in zip(events, events[1:])
                if layers_timed and j == i + 1 and b.query()]
        if gaps:
            self.layer_s = statistics.median(gaps)
        done, self._copies = _split_done(self._copies)
        if done:
            origin = done[0][1]  # spans as offsets from the first copy's start, in seconds
            spans = sorted((origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3) for _, a, b in done)
            busy, end = 0.0, float("-inf")
            for a, b in spans:  # the union of the spans: two streams' copies share the link
                if b > end:
                    busy += b - max(a, end)
                    end = b
            if busy > 0:
                self.rate = sum(n for n, _, _ in done) / busy


def _split_done(copies: list) -> tuple[list, list]:
    """(copies whose end event is done, the rest): each event asked once."""
    done, pending = [], []
    for c in copies:
        (done if c[2].query() else pending).append(c)
    return done, pending


class HeldOriginals:
    """Device tensors read by copies still in flight, each with the event that ends those copies."""

    def __init__(self, hold_layers: int = HOLD_LAYERS):
        self.hold_layers = hold_layers
        self._held: collections.deque = collections.deque()  # (layer serial, event, home stream, tensors)
        self._serial = 0

    def __len__(self) -> int:
        return len(self._held)

    def layer_started(self) -> None:
        """An offloaded layer's forward begins: let go of what was held ``hold_layers`` layers ago."""
        self._serial += 1
        while self._held and self._held[0][0] <= self._serial - self.hold_layers:
            self._release(self._held.popleft())

    def hold(self, event: torch.cuda.Event, home: torch.cuda.Stream, tensors: list[torch.Tensor]) -> None:
        self._held.append((self._serial, event, home, tensors))

    def release_all(self) -> None:
        """Let go of everything (the backward begins, or a new forward)."""
        while self._held:
            self._release(self._held.popleft())

    @staticmethod
    def _release(entry) -> None:
        _, event, home, tensors = entry
        home.wait_event(event)  # the block serves ``home`` again in its order: after the copies read it
        tensors.clear()


__all__ = ["HOLD_LAYERS", "HeldOriginals", "LinkBudget", "SAFETY"]
