"""OffloadedCheckpointer on its own: pack/unpack, prefetch chain, buffer pool, hooks; real streams on CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from fasttune.model_patches.offload import HostBufferPool, OffloadedCheckpointer, OffloadedTensor


def _rand(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_is_a_copy_and_unpack_returns_it_exactly(device, dtype):
    ck = OffloadedCheckpointer(keep_last=False)
    x = _rand((3, 37, 29), dtype, device, 0)
    expect = x.clone()
    packed = ck.pack(x)
    x.add_(1)  # the host copy must not see later writes to the original
    assert packed.host.device.type == "cpu"
    out = ck.unpack(packed)
    assert out.device == x.device and out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, expect)
    assert ck.stats.misses == 1 and ck.stats.packed == 1


def test_pack_many_copies_each_tensor_once_and_take_returns_it(device):
    """The attention stash queues one core's copies together: each handle holds an exact copy taken
    at pack time, outside the prefetch chain (no device original kept), fetched on its own by take."""
    ck = OffloadedCheckpointer()
    xs = [_rand((5, 33), torch.bfloat16, device, 7), _rand((64,), torch.float32, device, 8),
          _rand((9, 4, 3), torch.float32, device, 9).transpose(0, 2)]
    expect = [x.clone() for x in xs]
    packed = ck.pack_many(xs)
    for x in xs:
        x.zero_()  # later writes to the originals must not reach the copies
    assert ck.stats.packed == 3 and all(p.on_device is None and p.prev is None for p in packed)
    assert ck.pack_many([]) == [] and ck.stats.packed == 3
    for p, e in zip(packed, expect):
        out = ck.take(p)
        assert out.device == e.device and out.dtype == e.dtype and out.shape == e.shape
        assert torch.equal(out, e)
    assert ck.stats.misses == 3


def test_non_contiguous_input(device):
    ck = OffloadedCheckpointer(keep_last=False)
    x = _rand((40, 30), torch.float32, device, 1).t()[::2]
    out = ck.unpack(ck.pack(x))
    assert torch.equal(out, x)


def test_keep_last_keeps_only_the_newest_original(device):
    ck = OffloadedCheckpointer()
    a, b = _rand((5, 7), torch.float32, device, 2), _rand((5, 7), torch.float32, device, 3)
    pa, pb = ck.pack(a), ck.pack(b)
    assert pa.on_device is None
    assert pb.on_device is not None and pb.on_device.data_ptr() == b.data_ptr()
    assert pb.prev() is pa and pa.prev is None


def test_release_original_lets_go_of_an_original_only(device):
    """The one place a held layer input is let go (with CUDA, after the compute stream waits for its copy):
    it hands back the original once; a fetched copy is not an original and stays."""
    ck = OffloadedCheckpointer()
    a, b = _rand((3, 5), torch.float32, device, 5), _rand((3, 5), torch.float32, device, 6)
    pa = ck.pack(a)
    original = pa.release_original()
    assert original is not None and original.data_ptr() == a.data_ptr() and pa.on_device is None
    assert pa.release_original() is None and pa.copied is None and pa.home is None
    pb = ck.pack(b)
    ck.unpack(pb)  # kept original handed out; fetches pa ahead
    assert pa.fetched and pa.release_original() is None and pa.on_device is not None
    assert torch.equal(ck.unpack(pa), a)


def test_prefetch_chain_brings_back_the_layer_below(device):
    ck = OffloadedCheckpointer()
    xs = [_rand((4, 9, 16), torch.float32, device, s) for s in range(4)]
    packed = [ck.pack(x) for x in xs]
    for i in reversed(range(4)):  # backward order
        assert torch.equal(ck.unpack(packed[i]), xs[i])
        if i > 0:
            assert packed[i - 1].on_device is not None  # fetched ahead of its unpack
    s = ck.stats
    assert (s.kept_on_device, s.prefetch_hits, s.prefetched, s.misses) == (1, 3, 3, 0)


def test_without_prefetch_every_unpack_misses(device):
    ck = OffloadedCheckpointer(prefetch=False, keep_last=False)
    xs = [_rand((6, 8), torch.float32, device, s) for s in range(3)]
    packed = [ck.pack(x) for x in xs]
    for i in reversed(range(3)):
        assert torch.equal(ck.unpack(packed[i]), xs[i])
    assert ck.stats.misses == 3 and ck.stats.prefetched == 0


def test_unpack_twice_refetches(device):
    ck = OffloadedCheckpointer()
    x = _rand((8, 8), torch.float32, device, 4)
    p = ck.pack(x)
    assert torch.equal(ck.unpack(p), x)
    assert torch.equal(ck.unpack(p), x)  # retain_graph: a second backward unpacks again
    assert ck.stats.misses == 1


def test_pool_reuses_buffers_across_steps(device):
    ck = OffloadedCheckpointer()
    for step in range(4):
        xs = [_rand((2, 33, 24), torch.bfloat16, device, 10 * step + i) for i in range(5)]
        packed = [ck.pack(x) for x in xs]
        for i in reversed(range(5)):
            assert torch.equal(ck.unpack(packed[i]), xs[i])
        del packed
        gc.collect()
        assert ck.pool.bytes_in_use == 0
        assert ck.pool.allocations == 5, f"step {step}: buffers were re-allocated"


def test_pool_stays_bounded_when_shapes_change():
    pool = HostBufferPool(pin=False)
    for size in (1000, 3000, 1000, 5000, 2000):
        bufs = [pool.acquire(size, "cpu") for _ in range(4)]
        for b in bufs:
            pool.release(b, "cpu")
        assert pool.bytes_in_use == 0
        assert pool.bytes_total <= pool.peak_bytes_in_use
    assert pool.peak_bytes_in_use == 4 * 5000
    pool.clear()
    assert pool.bytes_free == 0


def test_pool_serves_a_shifting_mix_of_sizes_without_pinning_again():
    """Steps that need the same bytes in a different mix (more small blocks, fewer large ones, and back) are
    served by the buffers there are: a small request takes the front of a larger free buffer, which goes back
    whole. Exact sizes alone dropped one size's buffers to pin the other's, every time the mix shifted."""
    pool = HostBufferPool(pin=False)
    mixes = [[64] * 4 + [16] * 2, [64] * 2 + [16] * 6, [64] * 4 + [16] * 2, [64] * 3 + [16] * 4]
    for step, mix in enumerate(mixes * 3):
        bufs = [pool.acquire(n, "cpu") for n in mix]
        assert [b.numel() for b in bufs] == mix
        for b in bufs:
            pool.release(b, "cpu")
        assert pool.bytes_in_use == 0 and pool.bytes_total <= pool.peak_bytes_in_use
        if step == len(mixes) - 1:
            first_round = pool.allocations  # 8: the second mix has the most blocks
    assert pool.allocations == first_round == 8, pool.allocations
    tiny = pool.acquire(3, "cpu")  # more than FIT times smaller than every free buffer: a new one
    assert pool.allocations == 9 and tiny.numel() == 3


def test_bad_arguments_raise():
    ck = OffloadedCheckpointer()
    with pytest.raises(TypeError, match="tensor"):
        ck.pack([1.0])
    with pytest.raises(TypeError, match="packed"):
        ck.unpack(torch.zeros(2))


def test_hooks_offload_only_the_target_and_gradients_match(device):
    ck = OffloadedCheckpointer(keep_last=False)
    x = _rand((7, 5), torch.float32, device, 5).requires_grad_()
    w = _rand((5, 3), torch.float32, device, 6).requires_grad_()
    ref_x, ref_w = torch.autograd.grad((x @ w).sin().sum(), (x, w))
    hooks = ck.offloading(x)
    with hooks:
        y = (x @ w).sin().sum()  # mm saves x and w; sin saves its input
    assert hooks.offloaded == 1 and hooks.target is None
    gx, gw = torch.autograd.grad(y, (x, w))
    assert torch.equal(gx, ref_x) and torch.equal(gw, ref_w)
    assert ck.stats.packed == 1 and ck.stats.misses == 1


def test_two_checkpointers_share_nothing(device):
    a, b = OffloadedCheckpointer(), OffloadedCheckpointer()
    pa1 = a.pack(_rand((3, 3), torch.float32, device, 7))
    pb1 = b.pack(_rand((3, 3), torch.float32, device, 8))
    pa2 = a.pack(_rand((3, 3), torch.float32, device, 9))
    assert pa2.prev() is pa1 and pb1.prev is None
    assert a.pool is not b.pool and b.stats.packed == 1
    assert isinstance(pa1, OffloadedTensor)


# --- real CUDA streams ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_pack_uses_pinned_memory_and_a_side_stream():
    ck = OffloadedCheckpointer(keep_last=False)
    x = torch.randn(64, 1024, device="cuda")
    expect = x.clone()
    ck.unpack(ck.pack(x))  # pins the pool's buffer first: pinning host memory can wait for the device
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # keep the compute stream busy (~0.5 s)
    packed = ck.pack(x)
    side = ck.side_stream(x.device)
    assert side != compute
    assert packed.host.is_pinned()
    # The host returned at once and the copy waits behind the busy compute stream on the side stream.
    assert not side.query()
    torch.cuda.synchronize()
    assert torch.equal(packed.host, expect.cpu())
    assert torch.equal(ck.unpack(packed), expect)


@pytest.mark.gpu
def test_cuda_prefetch_waits_for_queued_work_then_overlaps_the_recompute():
    ck = OffloadedCheckpointer()
    xs = [torch.randn(256, 1024, device="cuda") for _ in range(3)]
    warm = [ck.pack(x) for x in xs]  # one round first: pinned buffers and device blocks exist before the timing
    [ck.unpack(p) for p in reversed(warm)]
    del warm
    hits = ck.stats.prefetch_hits
    packed = [ck.pack(x) for x in xs]
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of compute work queued before the unpack (the layer above's backward)
    top = ck.unpack(packed[2])  # kept on device; starts fetching packed[1] on the side stream
    below = packed[1]
    assert below.fetched and below.ready is not None
    # Its block comes from the compute stream's pool, so the copy waits for the work queued before it.
    assert not below.ready.query()
    torch.cuda._sleep(2_000_000_000)  # ~1 s: the top layer's recompute, queued after the prefetch
    below.ready.synchronize()  # the prefetch finished...
    assert not torch.cuda.current_stream().query()  # ...while that recompute was still running
    assert torch.equal(ck.unpack(below), xs[1])
    assert torch.equal(top, xs[2])
    assert torch.equal(ck.unpack(packed[0]), xs[0])
    torch.cuda.synchronize()
    assert ck.stats.prefetch_hits - hits == 2 and ck.stats.misses == 0


@pytest.mark.gpu
def test_cuda_a_prefetched_copy_dropped_unused_is_waited_for():
    ck = OffloadedCheckpointer()
    xs = [torch.randn(512, 1024, device="cuda") for _ in range(2)]
    packed = [ck.pack(x) for x in xs]
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the copy and the reuse below both queue behind this: a real race without the wait
    ck.unpack(packed[1])  # prefetches packed[0]
    ready = packed[0].ready
    del packed  # an abandoned backward: the fetched copy is freed without being handed out
    gc.collect()
    reuse = torch.full((512, 1024), 7.0, device="cuda")  # may land in the freed block: ordered after the copy
    torch.cuda.synchronize()
    assert ready.query() and bool((reuse == 7.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("let_go_by", ["next pack", "unpack"])
def test_cuda_a_held_original_serves_the_compute_stream_at_once_and_after_its_copy(let_go_by):
    """A layer input held as the newest original goes back to the compute stream's pool as soon as it is let
    go (no ``record_stream``, which would keep its block until the host sees the copy done), and compute work
    that takes its block is ordered after the copy out of it, however late the side stream runs."""
    ck = OffloadedCheckpointer()
    shape = (1000, 1037)  # an odd size: no other free block of it
    ck.unpack(ck.pack(torch.zeros(shape, device="cuda")))  # pins the pool's buffer first (pinning can wait)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    other = torch.randn(shape, device="cuda")
    x = torch.randn(shape, device="cuda")
    expect, ptr = x.cpu(), x.data_ptr()
    with torch.cuda.stream(ck.side_stream(x.device)):
        torch.cuda._sleep(200_000_000)  # the copy out of x runs late: a reuse not ordered after it would win
    packed = ck.pack(x)
    assert packed.on_device is not None and not packed.fetched
    if let_go_by == "next pack":
        nxt = ck.pack(other)  # lets x's original go
        assert packed.on_device is None
    else:
        assert ck.unpack(packed).data_ptr() == ptr  # the original handed out (and dropped at once)
    del x
    gc.collect()
    reuse = torch.empty(shape, device="cuda")
    assert reuse.data_ptr() == ptr, "the let-go original's block was not free for the compute stream"
    reuse.fill_(float("nan"))
    torch.cuda.synchronize()
    assert torch.equal(packed.host, expect), "the block was reused before the copy out of it"
    if let_go_by == "next pack":
        assert torch.equal(ck.unpack(nxt), other)
        assert torch.equal(ck.unpack(packed).cpu(), expect)


@pytest.mark.gpu
def test_cuda_pool_no_growth_and_no_leak_over_steps():
    ck = OffloadedCheckpointer()
    gc.collect()  # earlier tests' garbage would otherwise be freed inside the loop, below the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for step in range(5):
        xs = [torch.randn(4, 512, 768, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
        packed = [ck.pack(x) for x in xs]
        del xs
        outs = [ck.unpack(p) for p in reversed(packed)]
        del outs, packed
        gc.collect()
        torch.cuda.synchronize()
        del_pending = torch.empty(1, device="cuda")  # lets the allocator retire record_stream'd blocks
        del del_pending
        assert ck.pool.allocations == 6 and ck.pool.bytes_in_use == 0
        assert torch.cuda.memory_allocated() == base, f"step {step}: device memory leaked"
        if step == 0:
            reserved = torch.cuda.memory_reserved()
        assert torch.cuda.memory_reserved() == reserved, f"step {step}: the reserve grew"
    side = ck.side_stream(torch.device("cuda")).cuda_stream
    assert not [s for s in torch.cuda.memory_snapshot() if s["stream"] == side], "blocks in the side stream's pool"
