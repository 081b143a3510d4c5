"""The attention stash: an offloaded layer's attention core kept in host memory, not recomputed.

With checkpointing "offload" (and the offloaded layers of "auto") a decoder layer is recomputed
whole in backward. Its attention core (the q/k/v projections with their LoRA terms, the q/k norms,
RoPE and the attention function) costs a third of that recompute on an 8B model and saves about
five hidden-sized tensors, which the host link can move while the GPU computes. With
``FastConfig.attention_stash``:

- forward: the core runs under saved-tensor hooks of its own, nested inside the checkpoint's. What
  its autograd nodes save (the rank-r products, q/k/v as the attention takes them, the attention
  output) is copied to pinned host memory on the offload side stream, from the checkpointer's pool,
  all of a core's copies queued together when it ends, and so is the core's output (usually the same
  memory as the saved attention output: one copy serves both). The core's input (the norm's output
  the projections save) is not copied: the recompute makes it again before it reaches the core
  (``stash_blocks.RecomputedInput``). With q/k norms, the normed, rotated q/k the attention saves are
  not copied either: backward remakes them from the norms' inputs (``stash_remake.py``). The checkpoint
  never sees those tensors.
- recompute: the core is skipped; its output comes back from the host, its input is handed to its
  nodes. The checkpoint's count of saved tensors still matches, since the core saved nothing through
  the checkpoint in either pass.
- backward: the core's own nodes from the forward run on the tensors brought back. When layer i's
  recompute takes its output back, the copies of layer i's saved tensors and of layer i-1's output
  start, so they overlap the MLP's recompute and backward.

The nodes of the forward run on bitwise copies of what they saved: gradients equal those of a run
without checkpointing. Kept on the GPU as they are (held by the graph, as without the stash):
tensors that are not activations in the graph (frozen weights, cos/sin, masks, a log-sum-exp:
anything that does not require grad or is a leaf), views of parameters (full fine-tuning), small
ones (< 1 MiB) and ones whose memory has gaps.

Host memory: about 0.16 GiB per layer at 8,192 tokens of an 8B model (q, k, v, the attention output). A core
that would take the stash past its budget (half the host memory available when a forward's stash was empty,
plus the pool's free pinned buffers) is recomputed as usual, and the forward's first such layer is logged.
The link is a budget too, in GPU time (``stash_link.py``): a core goes only while the link, at the rate
measured on the run, keeps pace with the forward; the others are recomputed as usual. The cores' copies run
on a stream of their own, and the device memory they read is let go in stream order a few layers later (no
``record_stream``). With a padding mask the stashed cores share one additive bias of it per forward
(``mask_bias.py``): torch would make one per call, which a stashed core keeps on the GPU until the backward.
Not stashed: eager attention (it saves the [S, S] probabilities), attention dropout or dropout inside the
projections (PEFT's ``lora_dropout``) in training (skipping the core would shift the RNG for what follows), a KV
cache, a core called more than once in one layer call (the first call is).

The routed experts of a mixture-of-experts layer are a core of the same kind
(``FastConfig.experts_stash``, ``moe.py``): the grouped expert Function saves its gate/up product
[tokens·k, 2I] and its input, which the stash moves to the host (``saved_all``: tensors a custom
Function saves do not require grad); the recompute skips the routed experts (their output only enters
the residual sum, so none is stashed: ``output_unused``). A layer's blocks are all fetched back when
its recompute begins, so the experts' copies overlap the attention's recompute.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .mask_bias import SharedMaskBias
from .offload import OffloadedCheckpointer
from .stash_blocks import InputUse, RecomputedInput, StashedBlock, StashedRef, UnusedOutput, view_of
from .stash_link import HeldOriginals, LinkBudget
from .stash_remake import RemadeRef, RemadeTensors

logger = logging.getLogger("fasttune")

MIN_BYTES = 1 << 20
STORAGE_SLACK = 2  # a saved view's whole storage is copied when it is at most this many times the view
HOST_SHARE = 0.5  # of the memory available to the process when a forward starts stashing

ATTENTION, EXPERTS, MLP = "attention", "experts", "mlp"  # the kinds of core (``StashChain.kinds``)
OUTPUT = "o_proj"  # not a core: the attention's output projection keeps its output only (``output_stash.py``)
FETCHED_A_LAYER_AHEAD = (EXPERTS, MLP, OUTPUT)  # their blocks come back one layer early

_CURRENT = contextvars.ContextVar("fasttune_attention_stash", default=None)


def current(kind: str | None = None) -> "LayerStash | None":
    """The stash of the checkpointed layer call running now (forward or recompute), or None; with ``kind``,
    None too unless that kind of core goes to the host (a caller then skips what only a stash needs)."""
    stash = _CURRENT.get()
    return stash if stash is None or kind is None or kind in stash.chain.kinds else None


def available_host_bytes() -> int | None:
    """Memory the system can still hand out (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class StashStats:
    """Counters, for tests and benchmarks.

    Attributes:
        cores_stashed: cores whose saved tensors went to the host (forward).
        cores_skipped: recomputes that took a core's output back instead of running it.
        cores_over_budget: cores run and recomputed as usual because the host budget was full.
        cores_link_busy: cores run and recomputed as usual because the host link was behind (or, once
            measured, its budget for this forward was spent: ``stash_link.LinkBudget``).
        blocks: host copies made; bytes: their size.
        outputs_kept, outputs_reused: o_proj outputs sent to the host, and recomputes that took one back.
        inputs_recomputed: stashed cores whose input was not copied (the recompute hands it back).
        tensors_remade: backward remakes of saved tensors that were not copied (``stash_remake.py``).
    """

    cores_stashed: int = 0
    cores_skipped: int = 0
    cores_over_budget: int = 0
    cores_link_busy: int = 0
    blocks: int = 0
    bytes: int = 0
    outputs_kept: int = 0
    outputs_reused: int = 0
    inputs_recomputed: int = 0
    tensors_remade: int = 0


class StashChain:
    """Per-model state: the checkpointer whose pool and side stream carry the copies, the budget,
    the bytes on the host now, and the last layer stash made (for the prefetch of the one below)."""

    def __init__(self, checkpointer: OffloadedCheckpointer, budget_bytes: int | None = None,
                 kinds: tuple[str, ...] = (ATTENTION,)):
        self.checkpointer = checkpointer
        self.kinds = frozenset(kinds)  # the cores that go to the host: ATTENTION, EXPERTS, MLP and/or OUTPUT
        self.quantized_outputs = False  # OUTPUT over NF4/FP8 bases too (``output_stash.py``)
        self.fixed_budget = budget_bytes  # tests pin it; None: measured when the stash is empty
        self.budget: int | None = None
        self.stats = StashStats()
        self.min_bytes = MIN_BYTES  # smaller saved tensors stay on the device (tests lower it)
        self.host_bytes = 0
        self.last: weakref.ref | None = None
        self._lock = threading.Lock()
        self._warned_budget = False
        self.mask_bias = SharedMaskBias()  # a padding mask's additive bias, one per forward for every stashed core
        self.link = LinkBudget()  # the link's budget in GPU time, once measured
        checkpointer.copy_timer = self.link.copies_timed  # every copy to the host times the link, inputs too
        self.held = HeldOriginals()  # device memory the copies in flight read
        self._input_bytes = 0  # of the offloaded layer input now running
        self._streams: dict = {}  # per device: the stream the cores' copies to the host run on

    def new_layer(self, index: int = 0, hidden: torch.Tensor | None = None) -> "LayerStash":
        """The stash of one checkpointed layer call (held by that call's recompute function), made as the
        forward of layer ``index`` with input ``hidden`` begins."""
        if hidden is not None:
            self._input_bytes = hidden.numel() * hidden.element_size()
            self.held.layer_started()
            self.link.layer_started(index, hidden.device, self._input_bytes, self.checkpointer.pinned_allocations)
        stash = LayerStash(self, self.last)
        self.last = weakref.ref(stash)
        return stash

    def link_busy(self, core_bytes: int = 0, device: torch.device | None = None) -> bool:
        """The host link cannot take this core now (``LinkBudget``: this forward's share is spent, or not
        measured yet: the first training step stashes nothing on CUDA); it is then recomputed as usual."""
        if device is None or device.type != "cuda":
            return False  # copies on the CPU are synchronous: no link to fall behind
        busy = not (self.link.measured and self.link.admits(core_bytes))
        if busy:
            self.stats.cores_link_busy += 1
        return busy

    def settle(self, charged: int, sent: int, device: torch.device | None) -> None:
        """A core admitted for ``charged`` bytes sent ``sent``: the link budget takes the difference (where
        ``link_busy`` charged it: on CUDA, once measured)."""
        if device is not None and device.type == "cuda" and self.link.measured:
            self.link.settle(charged, sent)

    def send(self, flats: list[torch.Tensor]) -> list:
        """Start the host copies of one core's blocks (``OffloadedCheckpointer.pack_many``). On CUDA they run
        on a stream of their own, so that the next layer input's copy (which the compute stream waits for a
        layer later) does not queue behind them; the device originals are held (``HeldOriginals``) and the
        copies timed for the ``LinkBudget``."""
        checkpointer = self.checkpointer
        if not flats:  # everything the core saved stays on the device (small, or parameters)
            return []
        device = flats[0].device
        if device.type != "cuda":
            return checkpointer.pack_many(flats)
        compute, side = torch.cuda.current_stream(device), checkpointer.side_stream(device)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device=device)
        stream.wait_stream(side)  # host buffers are reused in the side stream's order
        packed = checkpointer.pack_many(flats, held=True, stream=stream)
        end = packed[0].copied
        for p in packed:
            p.copied = p.home = None  # the originals are ours to hold (they are not ``on_device``)
        self.held.hold(end, compute, list(flats))
        return packed

    def admit(self, core_bytes: int) -> bool:
        """May one more core of ``core_bytes`` go to the host?"""
        with self._lock:
            if self.host_bytes == 0 or self.budget is None:
                self.budget = self._measure_budget()
            ok = self.budget is not None and self.host_bytes + core_bytes <= self.budget
        if not ok:
            self.stats.cores_over_budget += 1
            if not self._warned_budget:
                self._warned_budget = True
                logger.info("fasttune: attention stash full (%.1f of %.1f GiB host memory): further layers' attention "
                            "is recomputed", self.host_bytes / 2**30, (self.budget or 0) / 2**30)
        return ok

    def _measure_budget(self) -> int | None:
        if self.fixed_budget is not None:
            return self.fixed_budget
        avail = available_host_bytes()
        if avail is None:
            return None
        return int(avail * HOST_SHARE) + self.checkpointer.pool.bytes_free

    def count_remade(self) -> None:
        self.stats.tensors_remade += 1

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.host_bytes += nbytes


def _device(module: torch.nn.Module) -> torch.device | None:
    """Where the core runs: its module's first parameter's device (None without parameters)."""
    p = next(module.parameters(), None)
    return None if p is None else p.device


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return None


def _parameter_memory(t: torch.Tensor, params: tuple) -> bool:
    """``t`` lives in the memory of one of ``params`` as they are now, not as they were when the core
    began: a parameter re-homed during the core (``lora_widen`` moves a frozen weight into its bordered
    buffer at its first fused call) has a new address, and its old one, freed, may come back as a new
    activation's (addresses recorded at the start made such an activation stay on the device, at
    random, as the allocator reused memory). A dozen parameters per core: a cheap scan."""
    ptr = t.untyped_storage().data_ptr()
    return any(_storage_ptr(p) == ptr for p in params)


def _span(t: torch.Tensor) -> int:
    """Elements from the tensor's first to its last one in memory (its numel when it has no gaps)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))


class LayerStash:
    """The stash of one checkpointed layer call: the cores it ran (usually one) and their blocks."""

    def __init__(self, chain: StashChain, prev: weakref.ref | None):
        self.chain = chain
        self.prev = prev
        self.recompute = False
        self.calls: dict[str, int] = {}  # per kind of core: its calls in the current pass
        # per (kind, call): its output's ref (or UnusedOutput), or None (run as usual); its output required grad
        self.plan: dict[tuple[str, int], StashedRef | UnusedOutput | None] = {}
        self.grad: dict[tuple[str, int], bool] = {}
        self.inputs: dict[tuple[str, int], RecomputedInput] = {}  # per (kind, call): its input, if it saved it
        self.blocks: list[StashedBlock] = []  # of every core of the layer call
        # This core's blocks by memory address: valid while the core runs only (its tensors are held
        # alive meanwhile); a later core may get the same addresses for other tensors.
        self._by_address: dict[tuple, StashedBlock] = {}
        self._remade: dict[tuple, tuple[RemadeTensors, int]] = {}  # by output memory address, as _by_address
        self._alive: list[torch.Tensor] | None = None
        self._kind = ATTENTION  # of the core running now
        self._params: tuple = ()  # the core's module's parameters (their memory is not stashed)
        self._input_tensor: torch.Tensor | None = None  # the running core's input, when its recompute makes it
        self._input: RecomputedInput | None = None

    def begin(self, recompute: bool) -> contextvars.Token:
        """Enter a pass of the layer call (its forward or a recompute). A recompute starts fetching
        every block of the layer back (its backward needs them all), then the experts' blocks of the
        layer below: the copy waits for the work queued before it, and the experts' backward comes
        right after the attention's short recompute, so a fetch started one layer ahead is one the
        backward does not wait for."""
        self.recompute = recompute
        self.calls = {}
        if recompute:
            self.chain.held.release_all()  # the forward is over: its copies' originals go in stream order
            for block in self.blocks:
                block.prefetch()
            below = self.prev() if self.prev is not None else None
            for block in below.blocks if below is not None else ():
                if block.kind in FETCHED_A_LAYER_AHEAD:
                    block.prefetch()
        return _CURRENT.set(self)

    @staticmethod
    def end(token: contextvars.Token) -> None:
        _CURRENT.reset(token)

    def run(self, core: Callable[[], tuple], core_bytes: int, module: torch.nn.Module, kind: str = ATTENTION, *,
            saved_all: bool = False, output_unused: bool = False, core_input: torch.Tensor | None = None):
        """Run ``core`` (returns (output, extra)) stashed, as usual, or not at all (a recompute
        whose core was stashed: the output comes back from the host, extra is None).

        ``core_bytes``: what the core will stash, estimated; ``module``: the one whose parameters
        the core uses (their views stay where they are); ``kind``: ATTENTION or EXPERTS, stashed
        when the chain's kinds hold it; ``saved_all``: every large saved tensor that is not a
        parameter goes to the host, whether it requires grad or not (a custom Function's
        intermediates); ``output_unused``: the recompute's output is thrown away (NaNs then);
        ``core_input``: the core's input, passed in both passes, where the recompute makes it before it reaches
        the core (something later in the layer saves through the checkpoint, so an early-stopping recompute
        gets there): a saved tensor that is exactly this input is not copied (``RecomputedInput``) and
        ``core_bytes`` should not count it."""
        index = self.calls.get(kind, 0)
        self.calls[kind] = index + 1
        key = (kind, index)
        if self.recompute:
            ref = self.plan.get(key)
            if ref is None:
                return core()
            if key in self.inputs:
                if core_input is None:
                    raise RuntimeError(f"attention stash: the recompute of a {kind} core saved with its input "
                                       "passed none")
                self.inputs[key].set(core_input)
            out = ref.get()
            if self.grad[key]:  # as in forward, so what follows saves the same tensors (linear saves W for dX)
                out = out.detach().requires_grad_()
            self.chain.stats.cores_skipped += 1
            for block in self.blocks:  # this layer's backward needs them next
                block.prefetch()
            below = self.prev() if self.prev is not None else None
            if below is not None:
                for ref_below in below.plan.values():
                    if isinstance(ref_below, StashedRef):
                        ref_below.block.prefetch()
            return out, None
        if (kind not in self.chain.kinds or index > 0 or not self.chain.admit(core_bytes)
                or self.chain.link_busy(core_bytes, _device(module))):
            self.plan[key] = None
            return core()
        self._params = tuple(module.parameters())
        self._alive = []
        self._by_address = {}
        self._kind = kind
        self._input_tensor, self._input = (None if core_input is None else core_input.detach()), None
        try:
            with StashHooks(self, saved_all):
                out, extra = core()
            ref = UnusedOutput(out) if output_unused else self.ref(out, force=True)
            self.chain.settle(core_bytes, self._send_pending(), _device(module))
            if self._input is not None:
                self.inputs[key] = self._input
                self.chain.stats.inputs_recomputed += 1
        finally:
            for remade, _ in self._remade.values():
                remade.release()
            self._alive = None
            self._by_address, self._remade = {}, {}
            self._params = ()
            self._input_tensor, self._input = None, None
        if ref is None:  # the core's output is a plain contiguous tensor (attention.py); anything else is a bug
            raise RuntimeError(f"attention stash: the core's output {type(out).__name__} {tuple(out.stride())} "
                               "cannot be copied flat")
        self.plan[key] = ref
        self.grad[key] = out.requires_grad
        self.chain.stats.cores_stashed += 1
        return out, extra

    def remakes(self, inputs: tuple, outputs: tuple, remake: Callable) -> None:
        """The running core's ``outputs`` are ``remake(*inputs)``, bitwise: where its nodes save them, backward
        makes them again from the inputs' copies instead of copying them too (``stash_remake.py``). Nothing
        outside a stashed core's forward."""
        if self._alive is None or self.recompute:
            return
        remade = RemadeTensors(inputs, outputs, remake, self.chain.count_remade)
        for i, t in enumerate(outputs):
            ptr = _storage_ptr(t)
            if ptr is not None:
                self._remade[(t.device, ptr)] = (remade, i)
                self._alive.append(t)  # its address stays its own until the core ends

    def _send_pending(self) -> int:
        """Send the blocks gathered so far; the bytes they move."""
        pending = list(self._by_address.values())
        sent = sum(b.flat.numel() * b.flat.element_size() for b in pending)
        for block, packed in zip(pending, self.chain.send([b.flat for b in pending])):
            block.packed, block.flat = packed, None
        return sent

    def keep(self, out: torch.Tensor, kind: str) -> "StashedRef | None":
        """Send ``out`` alone to the host (what made it saves through the checkpoint as usual); its ref, or
        None when its memory cannot be copied flat."""
        self._alive, self._by_address, self._kind = [], {}, kind
        try:
            ref = self.ref(out, force=True)
            self._send_pending()
        finally:
            self._alive, self._by_address = None, {}
        return ref

    def ref(self, t: torch.Tensor, force: bool = False, saved_all: bool = False):
        """A ``StashedRef`` for ``t`` when it goes to the host (``force``: whatever its kind;
        ``saved_all``: large and not a parameter's memory, whether it requires grad or not), an ``InputUse``
        when it is the running core's input (or its view: the recompute hands it back), else None.

        A block is the tensor's whole storage, shared by every saved view of it (q, k and v are
        column slices of one fused product: one copy), unless the storage is much larger than the
        tensor (then its span, when that has no gaps)."""
        if t.device.type not in ("cuda", "cpu") or (type(t) is not torch.Tensor and not force):
            return None  # tensor subclasses (DTensor, quantised weights) stay as they are
        if any(s < 0 for s in t.stride()) or t.numel() == 0:
            return None
        if not force and view_of(t, self._input_tensor):  # the recompute makes it again: nothing to copy
            if self._input is None:
                self._input = RecomputedInput()
            return self._input.use(t.shape)
        nbytes = t.numel() * t.element_size()
        if not force:
            if nbytes < self.chain.min_bytes or (not saved_all and (not t.requires_grad or t.is_leaf)):
                return None
            if _parameter_memory(t, self._params):
                return None
        remade = None if force else self._remade.get((t.device, _storage_ptr(t)))
        if remade is not None and remade[0].bind(lambda x: self.ref(x, force=True)):
            return remade[0].use(remade[1], t)
        detached = t.detach()
        storage = detached.untyped_storage()
        key = (t.device, storage.data_ptr())
        block = self._by_address.get(key)
        if block is None and storage.nbytes() <= STORAGE_SLACK * nbytes:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            block = self._new_block(key, flat, detached)
        if block is not None:  # the whole storage: the offset is the view's own, in elements of its dtype
            return StashedRef(block, t.dtype, tuple(t.shape), tuple(t.stride()), detached.storage_offset())
        if _span(t) != t.numel():
            return None  # gaps in a large storage: the span would move bytes nobody saved
        key = (t.device, storage.data_ptr() + detached.storage_offset() * t.element_size(), t.numel(), t.dtype)
        block = self._by_address.get(key)
        if block is None:
            flat = detached.as_strided((t.numel(),), (1,), detached.storage_offset()).view(torch.uint8)
            block = self._new_block(key, flat, detached)
        return StashedRef(block, t.dtype, tuple(t.shape), tuple(t.stride()), 0)

    def _new_block(self, key, flat: torch.Tensor, owner: torch.Tensor) -> "StashedBlock":
        block = self._by_address[key] = StashedBlock(self.chain, flat, self._kind)
        self.blocks.append(block)
        # Held until the core ends, so no later tensor of the core gets this address (and this key).
        self._alive.append(owner)
        return block


class StashHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks of a stashed core: activations go to the host, everything else stays."""

    def __init__(self, stash: LayerStash, saved_all: bool = False):
        self.stash = stash
        self.saved_all = saved_all
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc):
        self.stash = None  # the hooks and their bound pack method form a cycle: it must not hold the blocks
        return super().__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        ref = self.stash.ref(tensor, saved_all=self.saved_all)
        # detach: returning a saved output itself would make a reference cycle through its grad_fn
        return ref if ref is not None else tensor.detach()

    @staticmethod
    def _unpack(saved):
        return saved.get() if isinstance(saved, (StashedRef, InputUse, RemadeRef)) else saved


__all__ = ["ATTENTION", "EXPERTS", "MLP", "OUTPUT", "LayerStash", "RecomputedInput", "StashChain", "StashHooks",
           "StashStats", "StashedBlock", "StashedRef", "UnusedOutput", "available_host_bytes", "current"]
