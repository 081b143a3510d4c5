"""A backward's temporaries in an idle CUDA graph pool (``kernels/scratch_pool.py``).

CPU: ``scratch`` is a no-op without a pool and on CPU tensors, and ``scratch_pool`` is undone on
exit, errors included. CUDA (``gpu``): after a capture whose temporaries went back to the pool, a
tensor made inside ``scratch`` (on the capture stream) reuses the pool's blocks (the pool does not
grow), one made outside it does not, the block's results are seen on the current stream, and nothing
is routed while a graph is being captured.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fasttune.kernels import scratch_pool
from fasttune.kernels.scratch_pool import scratch


def test_no_pool_and_cpu_tensors_leave_allocation_alone():
    assert isinstance(scratch(torch.device("cpu")), contextlib.nullcontext)
    assert isinstance(scratch(torch.device("cuda", 0)), contextlib.nullcontext)  # no pool set
    with scratch_pool.scratch_pool(object(), None):
        assert isinstance(scratch(torch.device("cpu")), contextlib.nullcontext)


def test_the_pool_is_unset_on_exit_even_after_an_error():
    sentinel = object()
    with pytest.raises(RuntimeError, match="boom"):
        with scratch_pool.scratch_pool(sentinel):
            assert scratch_pool._POOL.get() == (sentinel, None)
            raise RuntimeError("boom")
    assert scratch_pool._POOL.get() is None
    with scratch_pool.scratch_pool(sentinel), scratch_pool.scratch_pool(None):
        assert scratch_pool._POOL.get() is None  # an inner None turns it off
    assert scratch_pool._POOL.get() is None


def _pool_of(t: torch.Tensor):
    """The pool id of the segment holding ``t``'s storage."""
    ptr = t.data_ptr()
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
    raise AssertionError("no segment holds the tensor")


def _pool_bytes(pool_id) -> int:
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool_id)


@pytest.mark.gpu
def test_cuda_scratch_reuses_the_idle_graph_pool():
    pool, stream = torch.cuda.MemPool(), torch.cuda.Stream()
    static = torch.randn(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.id, stream=stream):
        tmp = static * 2  # a graph temporary: its block returns to the pool (on ``stream``) after the capture
        out = tmp.sum()
        with scratch_pool.scratch_pool(pool, stream):
            assert isinstance(scratch(static.device), contextlib.nullcontext)  # capturing: left alone
        del tmp
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, static.sum() * 2)
    held = _pool_bytes(tuple(pool.id))
    assert held > 0
    current = torch.cuda.current_stream()
    with scratch_pool.scratch_pool(pool, stream):
        with scratch(static.device):
            assert torch.cuda.current_stream() == stream
            inside = static * 3  # a kernel on the pool's stream, after the current stream's queued work
        assert torch.cuda.current_stream() == current
        outside = torch.empty(1 << 20, device="cuda")
        seen = inside.clone()  # on the current stream, after the block's work
    assert _pool_of(inside) == tuple(pool.id)
    assert _pool_of(outside) != tuple(pool.id)
    assert _pool_bytes(tuple(pool.id)) == held  # the capture's freed block served it
    torch.testing.assert_close(seen, static * 3)
    del inside
    graph.replay()  # the scratch died before the replay: the graph's numbers stand
    torch.cuda.synchronize()
    torch.testing.assert_close(out, static.sum() * 2)
