"""OffloadedCheckpointer: decoder-layer inputs kept in (pinned) host memory between forward and backward.

Used by ``checkpointing.py`` for ``FastConfig.checkpointing="offload"`` (and the offloaded part of
"auto"). Activation checkpointing of a decoder layer keeps only the layer's input, the
``hidden_states`` tensor [batch, seq, hidden], and recomputes the rest in backward. This module
moves that one tensor off the GPU:

- ``pack(t)`` (forward): copy ``t`` into a pooled host buffer on a side CUDA stream
  (``non_blocking``, the side stream first waits for the compute stream; an event marks the end of
  the copy). ``t``'s memory must not be handed to someone else before the copy has read it:
  - a layer input (the chain, ``keep_last``) is held as ``on_device`` until the next ``pack`` or
    its ``unpack``; only there is it let go, and the compute stream first waits for the copy's
    event. Its block is then free in the compute stream's order at once. (``record_stream`` would
    keep it until the host sees the copy done: with the host a step ahead of the GPU, every layer's
    input of that step piled up in the reserve.)
  - other tensors: ``t.record_stream(side)``.
  The wait costs nothing in practice: the copy ends long before the layer it overlaps.
- ``unpack(p)`` (backward, when the checkpointed layer i starts recomputing): hand back the GPU
  copy (the compute stream waits on the copy's event), then start bringing back the input of the
  layer packed before it (layer i-1) on the side stream, so that copy overlaps layer i's recompute
  and backward. Its destination is allocated from the compute stream's pool (the side stream first
  waits for the compute work queued so far), so the freed copy serves the compute stream at once.
- The most recently packed tensor also keeps its GPU original until the next ``pack``: the first
  layer the backward reaches (the last one packed) then needs no copy at all.
- Host buffers come from a pool keyed by (device, byte size): reused across steps, pinned once; a request
  may take the front of a free buffer up to ``FIT`` times its size (the mix of sizes shifts between steps).
  A buffer goes back to the pool when its ``OffloadedTensor`` is freed (autograd frees saved
  tensors after backward). Every copy touching a pooled buffer runs on the same side stream of its
  device, so stream order alone makes reuse safe. The pool never holds more than the largest
  working set seen (free buffers of other sizes are dropped first), so changing shapes do not grow
  pinned memory without bound. (Dropped pinned blocks go back to torch's host caching allocator.)

Without CUDA the same code runs without streams: ``pack`` copies into a pooled (unpinned) CPU
buffer, ``unpack`` returns a clone of it (the stand-in for the host-to-device copy), so CPU CI
exercises pool, prefetch chain and bookkeeping. Copies are exact, so gradients are bitwise those
of plain recompute.

Which tensors go through ``pack``: ``offloading(hidden_states)`` is a ``saved_tensors_hooks``
context put around ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Inside the
checkpointed function the checkpoint's own hooks take over, so the only tensors our hooks see are
the checkpoint's saved inputs; of those only ``hidden_states`` is offloaded, small inputs
(cos/sin, masks, position ids) are kept as they are.

State lives in the checkpointer object (one per patched model); nothing is global.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class OffloadStats:
    """Counters, for tests and benchmarks.

    Attributes:
        packed: tensors offloaded.
        fetched: host-to-device copies issued (prefetches included).
        prefetched: copies issued ahead of need (for the layer below the one recomputing).
        prefetch_hits: unpacks that found their tensor already fetched ahead.
        kept_on_device: unpacks served by the GPU original (the last tensor packed).
        misses: unpacks that had to start their copy on the spot.
    """

    packed: int = 0
    fetched: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    kept_on_device: int = 0
    misses: int = 0


FIT = 4  # a free host buffer may serve a request down to a quarter of its size


class HostBufferPool:
    """Flat uint8 host buffers, reused by byte size, or the front of a larger free one (pinned when ``pin``).

    Thread-safe: buffers come back from autograd's worker threads.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self.allocations = 0  # buffers ever created (a reuse test watches this)
        self.bytes_in_use = 0
        self.bytes_free = 0
        self.peak_bytes_in_use = 0

    def acquire(self, nbytes: int, device_key) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` bytes: a free one of that size, else the first ``nbytes`` of the
        smallest free one up to ``FIT`` times larger, else a new one."""
        with self._lock:
            key = self._fit(device_key, nbytes)
            buf = None
            if key is not None:
                bufs = self._free[key]
                buf = bufs.pop()
                if not bufs:
                    del self._free[key]
                self.bytes_free -= key[1]
            self.bytes_in_use += nbytes if buf is None else key[1]
            self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
        if buf is None:
            with self._lock:
                self.allocations += 1
                self._evict(self.peak_bytes_in_use)  # free buffers of other sizes make room first
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)  # the caller copies nbytes in
        return buf if buf.numel() == nbytes else buf[:nbytes]

    def _fit(self, device_key, nbytes: int):
        """The free list to take from (lock held): this size, else the smallest within ``FIT`` times it. The mix
        of sizes a step needs can shift from step to step (the stashes send a different set of cores as the link
        allows): exact sizes alone then pinned new buffers for one size while dropping another's, over and over
        (a CPU replay of four alternating mixes: 29 buffers pinned in 12 steps, 8 with the fit). Session 48's
        Qwen3-8B steps of 1.8-2.7 s (an H100) had another cause: its stashed bytes kept growing."""
        if (device_key, nbytes) in self._free:
            return (device_key, nbytes)
        sizes = [k[1] for k in self._free if k[0] == device_key and nbytes < k[1] <= FIT * nbytes]
        return (device_key, min(sizes)) if sizes else None

    def release(self, buf: torch.Tensor, device_key) -> None:
        """Give ``buf`` (as ``acquire`` returned it) back to the pool."""
        if buf._base is not None:  # the front of a larger buffer: the whole of it goes back
            buf = buf._base
        nbytes = buf.numel()
        key = (device_key, nbytes)
        with self._lock:
            self.bytes_in_use -= nbytes
            self._free.setdefault(key, []).append(buf)
            self._free.move_to_end(key)
            self.bytes_free += nbytes
            self._evict(self.peak_bytes_in_use)

    def _evict(self, limit: int) -> None:
        """Drop least recently used free buffers until in-use + free bytes fit ``limit`` (lock held)."""
        while self._free and self.bytes_in_use + self.bytes_free > limit:
            old_key, old = next(iter(self._free.items()))
            old.pop()
            self.bytes_free -= old_key[1]
            if not old:
                del self._free[old_key]

    def clear(self) -> None:
        """Drop every free buffer (buffers in use come back and are kept as usual)."""
        with self._lock:
            self._free.clear()
            self.bytes_free = 0

    @property
    def bytes_total(self) -> int:
        return self.bytes_in_use + self.bytes_free


class OffloadedTensor:
    """One tensor living in a pooled host buffer (what ``pack`` returns and ``unpack`` takes).

    Attributes:
        shape, dtype, device: of the original tensor.
        host: the host copy (a view of the pooled buffer).
        on_device: a device tensor ready to hand out (the original, or a fetched copy), else None.
        fetched: ``on_device`` is a fetched copy (not the original).
        ready: CUDA event recorded after the copy that filled ``on_device`` (None: nothing to wait for).
        copied: CUDA event recorded after the copy out of the original, when ``on_device`` holds the
            original without ``record_stream``: ``home`` (the stream its block serves) waits for it
            before the original is let go (``release_original``).
        prev: weak reference to the tensor packed just before this one (the layer below).
    """

    __slots__ = ("shape", "dtype", "device", "host", "on_device", "fetched", "ready", "compute", "copied", "home",
                 "prev", "_flat", "_pool", "_device_key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, flat: torch.Tensor, pool: HostBufferPool, device_key):
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device
        self._flat = flat
        self._pool = pool
        self._device_key = device_key
        self.host = flat.view(tensor.dtype).view(tensor.shape)
        self.on_device = None
        self.fetched = False
        self.ready = None
        self.compute = None  # the stream a fetched copy was allocated for (it must see the copy finish)
        self.copied = self.home = None
        self.prev = None

    def release_original(self) -> torch.Tensor | None:
        """Let go of the device original held as ``on_device`` (None when it holds a fetched copy or
        nothing) and return it. Its block serves ``home`` again in stream order, so ``home`` first waits for
        the copy out of it: from here on the caller may drop the last reference."""
        original = None if self.fetched else self.on_device
        if original is not None:
            self.on_device = None
            if self.copied is not None:
                self.home.wait_event(self.copied)
        self.copied = self.home = None
        return original

    def __del__(self):
        try:
            self.release_original()  # an original still held (a backward that never came)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        ready, on_device = getattr(self, "ready", None), getattr(self, "on_device", None)
        if ready is not None and on_device is not None and self.compute is not None:
            # A fetched copy dropped unused (an abandoned backward): its block goes back to the compute
            # stream's pool, so that stream must not run past the copy still writing into it.
            try:
                self.compute.wait_event(ready)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
        flat, self._flat = getattr(self, "_flat", None), None
        if flat is not None:
            try:
                self._pool.release(flat, self._device_key)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass

    def __repr__(self) -> str:
        return f"OffloadedTensor({tuple(self.shape)}, {self.dtype}, {self.device})"


class OffloadedCheckpointer:
    """Moves tensors to host memory in forward and brings them back, ahead of need, in backward.

    Args:
        prefetch: on ``unpack`` of a tensor, start fetching the one packed before it.
        keep_last: the last tensor packed keeps its device original until the next ``pack``.

    Attributes:
        pool: the host buffers (pinned once CUDA tensors are packed).
        stats: ``OffloadStats`` counters.
    """

    def __init__(self, prefetch: bool = True, keep_last: bool = True):
        self.prefetch = prefetch
        self.keep_last = keep_last
        self.stats = OffloadStats()
        self._pools: dict[bool, HostBufferPool] = {}
        self._side_streams: dict[int, torch.cuda.Stream] = {}
        self._last: weakref.ref | None = None
        self.copy_timer = None  # (bytes, start event, end event) of each batch of copies to the host, or None

    # -- pool ---------------------------------------------------------------------------------
    def _pool(self, pinned: bool) -> HostBufferPool:
        pool = self._pools.get(pinned)
        if pool is None:
            pool = self._pools[pinned] = HostBufferPool(pin=pinned)
        return pool

    @property
    def pool(self) -> HostBufferPool:
        """The pinned pool when CUDA tensors were packed, else the CPU one."""
        return self._pools.get(True) or self._pool(False)

    @property
    def pinned_allocations(self) -> int:
        """Pinned host buffers ever created (0 before the first): the stashes' link budget skips the layer
        times of a forward in which this grew (``stash_link.py``)."""
        pool = self._pools.get(True)
        return 0 if pool is None else pool.allocations

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` (created on first use)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(index)
        if stream is None:
            stream = self._side_streams[index] = torch.cuda.Stream(device=index)
        return stream

    # -- pack / unpack ---------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor, chain: bool = True) -> OffloadedTensor:
        """Start copying ``tensor`` to a host buffer; return the handle ``unpack`` takes.

        ``chain=False``: outside the layer-input chain (no prefetch link, no device original kept);
        the caller fetches it with ``fetch_ahead`` and takes it with ``take`` (the attention stash).

        Raises:
            TypeError: ``tensor`` is not a tensor.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach()
        held = chain and self.keep_last
        (packed,) = self._copy_out([tensor], held=held)
        if not chain:
            return packed
        last = self._last() if self._last is not None else None
        if last is not None:
            last.release_original()  # only the newest original stays on the device (a prefetched copy stays)
            packed.prev = self._last
        if self.keep_last:
            packed.on_device = tensor
        self._last = weakref.ref(packed)
        return packed

    def pack_many(self, tensors: list[torch.Tensor], held: bool = False,
                  stream: torch.cuda.Stream | None = None) -> list[OffloadedTensor]:
        """``pack(t, chain=False)`` for each of ``tensors`` (one device), with one wait for the compute
        stream and one switch to the side stream for all their copies (the attention stash's blocks of one
        core: a switch per copy costs host time in a forward that is close to host-bound).

        ``held`` (CUDA): the originals are not ``record_stream``'d; the caller keeps them until the compute
        stream has waited for the copies' event, ``copied`` of each result (timed: ``stash_link.py``).
        ``stream``: the copies' stream instead of the side stream; it must first wait for the side stream
        (pooled host buffers are reused in the side stream's order)."""
        return self._copy_out([t.detach() for t in tensors], held=held, stream=stream)

    def _copy_out(self, tensors: list[torch.Tensor], held: bool = False,
                  stream: torch.cuda.Stream | None = None) -> list[OffloadedTensor]:
        """Start the device-to-host copies of ``tensors`` (detached, one device) into pooled buffers.

        ``held``: the caller keeps each original as ``on_device`` and lets it go only through
        ``release_original`` (stream-ordered reuse); else the originals are ``record_stream``'d.
        With ``copy_timer`` set (CUDA) it is called with (bytes, start, end): events on the copies' stream
        right around them (the stashes' link budget, ``stash_link.py``)."""
        if not tensors:
            return []
        device = tensors[0].device
        cuda = device.type == "cuda"
        device_key = (device.type, device.index)
        pool = self._pool(cuda)
        packed = [OffloadedTensor(t, pool.acquire(t.numel() * t.element_size(), device_key), pool, device_key)
                  for t in tensors]
        if cuda:
            side = stream or self.side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the copies must see the finished tensors
            timer = self.copy_timer
            with torch.cuda.stream(side):
                if timer is not None:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record(side)
                for p, t in zip(packed, tensors):
                    p.host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event(enable_timing=timer is not None) if held or timer is not None else None
                if copied is not None:
                    copied.record(side)
            if timer is not None:
                timer(sum(t.numel() * t.element_size() for t in tensors), start, copied)
            for p, t in zip(packed, tensors):
                if held:  # home: the stream the forward runs on, whose pool the input's block is in
                    p.copied, p.home = copied, torch.cuda.current_stream(device)
                else:
                    t.record_stream(side)  # its memory is not reused before the copy has read it
        else:
            for p, t in zip(packed, tensors):
                p.host.copy_(t)
        self.stats.packed += len(tensors)
        return packed

    def unpack(self, packed: OffloadedTensor) -> torch.Tensor:
        """The tensor ``packed`` holds, on its original device; starts fetching the one below.

        Raises:
            TypeError: ``packed`` is not an ``OffloadedTensor``.
        """
        if not isinstance(packed, OffloadedTensor):
            raise TypeError(f"packed must be an OffloadedTensor, got {type(packed).__name__}")
        if packed.on_device is None:
            self.stats.misses += 1
            self._fetch(packed)
        elif packed.fetched:
            self.stats.prefetch_hits += 1
        else:
            self.stats.kept_on_device += 1
            packed.on_device = packed.release_original()  # handed out: the caller may drop the last reference
        tensor, ready, compute = packed.on_device, packed.ready, packed.compute
        packed.on_device = packed.ready = packed.compute = None  # the caller owns it now; no device memory here
        packed.fetched = False
        if ready is not None:
            compute.wait_event(ready)
        below = packed.prev() if (self.prefetch and packed.prev is not None) else None
        if below is not None and below.on_device is None:
            self.stats.prefetched += 1
            self._fetch(below)
        return tensor

    def fetch_ahead(self, packed: OffloadedTensor) -> None:
        """Start bringing ``packed`` back to its device unless a copy is there already."""
        if packed.on_device is None:
            self.stats.prefetched += 1
            self._fetch(packed)

    def take(self, packed: OffloadedTensor, keep: bool = False) -> torch.Tensor:
        """The device copy of ``packed`` (fetched on the spot when no prefetch made one), ready to use on
        the current stream. ``keep``: ``packed`` holds on to the copy for a later ``take``."""
        if packed.on_device is None:
            self.stats.misses += 1
            self._fetch(packed)
        else:
            self.stats.prefetch_hits += 1
        tensor, ready, compute = packed.on_device, packed.ready, packed.compute
        if ready is not None:
            compute.wait_event(ready)
        if not keep:
            packed.on_device = packed.ready = packed.compute = None
            packed.fetched = False
        return tensor

    def _fetch(self, packed: OffloadedTensor) -> None:
        """Issue the host-to-device copy of ``packed`` (on the side stream with CUDA)."""
        self.stats.fetched += 1
        if packed.device.type == "cuda":
            side = self.side_stream(packed.device)
            compute = torch.cuda.current_stream(packed.device)
            # The copy lands in a block of the compute stream's pool, which that stream reuses as soon as the
            # tensor is freed. A block of the side stream's pool could serve only the side stream again, after
            # the compute stream passed its last use; with the host layers ahead of the GPU those blocks
            # piled up (14 GiB of 48 reserved on the side stream at 262,144 tokens, docs/FACTS.md).
            tensor = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)  # copied over whole
            side.wait_stream(compute)  # the block may still serve compute work queued before this point
            with torch.cuda.stream(side):
                tensor.copy_(packed.host, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(side)
            packed.on_device, packed.ready, packed.compute = tensor, ready, compute
        else:
            packed.on_device = packed.host.clone()  # stands in for the host-to-device copy
        packed.fetched = True

    # -- hooks ---------------------------------------------------------------------------------
    def offloading(self, tensor: torch.Tensor) -> "OffloadInputHooks":
        """A ``saved_tensors_hooks`` context that offloads ``tensor`` (and only it) when autograd saves it."""
        return OffloadInputHooks(self, tensor)

    def close(self) -> None:
        """Forget the last tensor and drop free host buffers (tensors still packed stay valid)."""
        self._last = None
        for pool in self._pools.values():
            pool.clear()


class OffloadInputHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that offload one given tensor and keep every other saved tensor as is.

    Put around ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: they then see only the
    checkpoint's saved inputs (the checkpoint's own hooks handle everything inside).
    """

    def __init__(self, checkpointer: OffloadedCheckpointer, target: torch.Tensor):
        self.checkpointer = checkpointer
        self.target = target
        self.offloaded = 0
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc):
        self.target = None  # do not keep the layer input alive through this object
        return super().__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        if self.target is not None and _same_tensor(tensor, self.target):
            self.offloaded += 1
            return self.checkpointer.pack(tensor)
        # detach: returning a saved output itself would make a reference cycle through its grad_fn
        return tensor.detach()

    def _unpack(self, saved):
        if isinstance(saved, OffloadedTensor):
            return self.checkpointer.unpack(saved)
        return saved


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a tensor object over the very same memory, shape and strides."""
    if a is b:
        return True
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.numel() > 0 and a.data_ptr() == b.data_ptr())


__all__ = ["HostBufferPool", "OffloadInputHooks", "OffloadStats", "OffloadedCheckpointer", "OffloadedTensor"]
