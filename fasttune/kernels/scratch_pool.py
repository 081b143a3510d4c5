"""A backward's scratch tensors allocated in a CUDA graph pool that is idle at that time.

With ``FastConfig.checkpoint_forward_graphs`` the checkpointed layers' forwards are replayed from CUDA
graphs whose memory pool keeps one layer's forward working set reserved for the whole step (0.67 GiB
on a Qwen3-MoE layer at 8k tokens), while the eager allocator's peak comes later, in backward, where
the routed experts' backward holds its own [rows, ·] scratch (the gathered output gradient, the gate/up
gradient, the input's gradient: ~0.45 GiB there at once). Both are working sets of one layer, never needed at once, so
the backward's scratch can live in the graphs' pool: the pool's free blocks hold nothing between two
replays (a graph writes them before it reads them), and the scratch dies before the backward
returns, long before the next forward replays a graph.

Only tensors that die inside the scope may be allocated in it: an output, a saved tensor or a
gradient allocated there would be overwritten by the next replay. ``scratch()`` is therefore opened
by the kernel around its own temporaries, and only inside ``scratch_pool(pool)``, which the
checkpointing sets around a layer's backward. Elsewhere (no graphs, CPU, a capture) it does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_POOL = contextvars.ContextVar("fasttune_scratch_pool", default=None)


@contextlib.contextmanager
def scratch_pool(pool, stream=None):
    """Within this block, ``scratch()`` allocates CUDA tensors in ``pool`` (a ``torch.cuda.MemPool``;
    None: no change) on ``stream``, the stream the pool's graphs were captured on: the allocator hands a
    freed block only to the stream that allocated it."""
    token = _POOL.set(None if pool is None else (pool, stream))
    try:
        yield
    finally:
        _POOL.reset(token)


@contextlib.contextmanager
def _on_pool(pool, stream, device):
    """Work and allocations of the block on ``stream`` (after the current stream's queued work, and
    before its next): its tensors come from ``pool``'s free blocks of that stream."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool, device):
            yield
    finally:
        current.wait_stream(stream)


def scratch(device: torch.device):
    """A context in which new CUDA tensors on ``device`` come from the scratch pool, when one is set
    (``scratch_pool``) and no graph is being captured; else a no-op context. The block's kernels run
    on the pool's stream, ordered after what the current stream queued before and before what it
    queues after; a tensor made there and used later on the current stream is freed (on the host)
    before the next such block, which waits for the current stream's work, and before the next
    replay, which runs on the current stream: its block is reused only after its last use."""
    entry = _POOL.get()
    if entry is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return contextlib.nullcontext()
    pool, stream = entry
    return _on_pool(pool, stream or torch.cuda.current_stream(device), device)


__all__ = ["scratch", "scratch_pool"]
