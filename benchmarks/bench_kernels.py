"""Forward + backward GPU time of the elementwise/row kernels on Llama-3-8B shapes (bf16).

Columns: eager (the Hugging Face module code, inlined), torch.compile of that code, Liger Kernel
(when importable) and fasttune. GPU time is the median over replays of a CUDA graph holding one
fwd+bwd step (launch gaps would otherwise dominate ops this small; docs/FACTS.md, Measuring on the GPU), falling back to the
kernel time summed by torch.profiler when a step cannot be captured.

Achieved bandwidth = bytes that must move / time, as a share of the device-to-device copy rate
measured in the same run (a 4 GiB copy, bytes read + written). Bytes that must move, per op:

- rms_norm  x [N, H], weight trainable: fwd reads x, writes y; bwd reads x, dy, writes dx
            → 5·N·H elements (weight, r and dw are O(H + N): left out).
- rope      q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [B, S, D]: fwd reads and writes q, k; bwd
            reads dq, dk and writes their inputs' grads; each pass reads cos and sin
            → 4·(|q| + |k|) + 4·|cos| elements.
- swiglu / geglu  gate, up [N, I]: fwd reads gate, up, writes y; bwd reads dy, gate, up, writes
            dgate, dup → 8·N·I elements.

Usage (H200 machine):  python benchmarks/bench_kernels.py [--ops rms_norm,rope] [--no-compile]
[--out results.json] [--tune]. Prints a markdown table; --tune adds a sweep of the RMSNorm
backward's launch knobs (module constants of fasttune/kernels/rms_norm.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fasttune.kernels.rms_norm import rms_norm  # noqa: E402
from fasttune.kernels.rope import apply_rope  # noqa: E402
from fasttune.kernels.swiglu import geglu, swiglu  # noqa: E402

DT = torch.bfloat16
N, H, INTER = 16384, 4096, 14336
B, S, HQ, HK, D = 4, 4096, 32, 8, 128
EPS = 1e-5


# --- the Hugging Face module code (LlamaRMSNorm, apply_rotary_pos_emb, LlamaMLP's act·up) ----


def hf_rms_norm(x, weight, eps=EPS):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def hf_swiglu(gate, up):
    return F.silu(gate) * up


def hf_geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def _liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:  # optional peer
        print(f"liger_kernel not importable ({type(e).__name__}: {e}); its column is empty", file=sys.stderr)
        return None
    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", True),
        "rope": lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s),
        "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g, u),
        "geglu": lambda g, u: LigerGELUMulFunction.apply(g, u),
    }


# --- cases: inputs, one fwd+bwd step per implementation, bytes ------------------------------


_GEN = torch.Generator().manual_seed(0)


def _randn(*shape, scale=1.0):
    # Drawn on the host: a failed graph capture leaves the CUDA generator in capture mode
    # ("Offset increment outside graph capture"), which must not take the later cases down.
    return (torch.randn(*shape, generator=_GEN, dtype=torch.float32) * scale).to(device="cuda", dtype=DT)


def case_rms_norm():
    x = _randn(N, H).requires_grad_()
    w = (1 + _randn(H, scale=0.1)).requires_grad_()
    dy = _randn(N, H)

    def step(fn):
        return lambda: torch.autograd.grad(fn(x, w), (x, w), dy)

    fns = {"eager": hf_rms_norm, "fasttune": lambda x, w: rms_norm(x, w, EPS)}
    return step, fns, 5 * N * H * 2, hf_rms_norm


def case_rope():
    # q/k as attention gets them: transposed views of [B, S, H, D] projection outputs (non-leaf).
    q_src, k_src = _randn(B, S, HQ, D).requires_grad_(), _randn(B, S, HK, D).requires_grad_()
    q_base, k_base = q_src * 1, k_src * 1  # non-leaf: the kernel may rotate them in place
    ang = (torch.rand(B, S, D // 2, generator=_GEN) * 100).cuda()  # host RNG: see _randn
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(DT), emb.sin().to(DT)
    dq, dk = _randn(B, S, HQ, D).transpose(1, 2), _randn(B, S, HK, D).transpose(1, 2)

    def step(fn):
        def run():
            qr, kr = fn(q_base.transpose(1, 2), k_base.transpose(1, 2), cos, sin)
            return torch.autograd.grad((qr, kr), (q_base, k_base), (dq, dk))
        return run

    fns = {"eager": hf_rope, "fasttune": apply_rope}
    nbytes = (4 * (q_src.numel() + k_src.numel()) + 4 * cos.numel()) * 2
    return step, fns, nbytes, hf_rope


def _case_gated(hf_fn, ours):
    def make():
        gate = _randn(N, INTER, scale=2.0).requires_grad_()
        up = _randn(N, INTER).requires_grad_()
        dy = _randn(N, INTER)

        def step(fn):
            return lambda: torch.autograd.grad(fn(gate, up), (gate, up), dy)

        return step, {"eager": hf_fn, "fasttune": ours}, 8 * N * INTER * 2, hf_fn
    return make


CASES = {
    "rms_norm": case_rms_norm,
    "rope": case_rope,
    "swiglu": _case_gated(hf_swiglu, swiglu),
    "geglu": _case_gated(hf_geglu, lambda g, u: geglu(g, u, "tanh")),
}


# --- timing ---------------------------------------------------------------------------------


def graph_time_ms(fn, reps):
    """Median ms of ``fn`` over ``reps`` replays of a CUDA graph holding one call (after a warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compilation, autotuning, allocator pools
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def _profiler_time_ms(fn, reps):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us / reps / 1e3


_CAPTURE_BROKEN = False


def gpu_time_ms(fn, reps=20):
    """(median ms per call, method). After one failed capture the rest use the profiler: an
    invalidated capture poisons later captures in the same process (seen on the H200)."""
    global _CAPTURE_BROKEN
    if not _CAPTURE_BROKEN:
        try:
            return graph_time_ms(fn, reps), "graph"
        except Exception as e:  # e.g. a capture-unsafe step
            _CAPTURE_BROKEN = True
            print(f"  CUDA graph capture failed ({type(e).__name__}: {str(e)[:120]}); profiler from here on",
                  file=sys.stderr)
    torch.cuda.synchronize()
    return _profiler_time_ms(fn, reps), "profiler"


def copy_bandwidth():
    """Device-to-device copy of 4 GiB, bytes read + written per second (median of 10)."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (4 << 30) / (statistics.median(times) * 1e-3)


def tune_rms_norm_bwd(bw, reps):
    """Sweep the RMSNorm backward's launch knobs at [N, H] (dx and dw; reads x, dy, writes dx)."""
    import fasttune.kernels.rms_norm as mod

    x, w, dy = _randn(N, H), _randn(H), _randn(N, H)
    _, _, rstd = mod._fwd(x, None, w, EPS, 0.0, "llama")
    saved = mod._BWD_TILE, mod._BWD_PROGRAMS_PER_SM, mod._num_warps
    print("\n| _BWD_TILE | _BWD_PROGRAMS_PER_SM | num_warps | bwd ms | share of copy |\n|---|---|---|---|---|")
    try:
        for tile in (4096, 8192):
            for ppsm in (1, 2, 3, 4, 8):
                for warps in (4, 8, 16):
                    mod._BWD_TILE, mod._BWD_PROGRAMS_PER_SM = tile, ppsm
                    mod._num_warps = lambda elements, w_=warps: w_
                    ms, _ = gpu_time_ms(lambda: mod._bwd(dy, None, x, w, rstd, 0.0, "llama", True, True), reps)
                    print(f"| {tile} | {ppsm} | {warps} | {ms:.4f} | {100 * 3 * N * H * 2 / (ms * 1e-3) / bw:.1f}% |",
                          flush=True)
    finally:
        mod._BWD_TILE, mod._BWD_PROGRAMS_PER_SM, mod._num_warps = saved


def tune_rope(bw, reps):
    """Sweep RoPE's launch knobs (tokens per program via _TILE, num_warps), fwd+bwd and each pass."""
    import fasttune.kernels.rope as mod

    step, fns, nbytes, _ = case_rope()
    q = _randn(B, S, HQ, D).transpose(1, 2)
    k = _randn(B, S, HK, D).transpose(1, 2)
    ang = (torch.rand(B, S, D // 2, generator=_GEN) * 100).cuda()  # host RNG: see _randn
    cos, sin = torch.cat((ang, ang), -1).cos().to(DT), torch.cat((ang, ang), -1).sin().to(DT)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    saved = mod._TILE_FWD, mod._TILE_BWD, mod._num_warps
    half_bytes = nbytes / 2
    print("\n| tile (pairs/program) | num_warps | fwd+bwd ms | share | fwd in place ms | share | bwd (out of place) ms | share |"
          "\n|---|---|---|---|---|---|---|---|")
    try:
        for tile in (1024, 2048, 4096, 8192):
            for warps in (1, 2, 4, 8, 16):
                mod._TILE_FWD = mod._TILE_BWD = tile
                mod._num_warps = lambda pairs, w_=warps: w_
                both, _ = gpu_time_ms(step(fns["fasttune"]), reps)
                fwd, _ = gpu_time_ms(lambda: mod._launch(q, k, q, k, cos, sin, None, False), reps)
                bwd, _ = gpu_time_ms(lambda: mod._launch(q, k, qo, ko, cos, sin, None, True), reps)
                share = lambda ms, b: f"{100 * b / (ms * 1e-3) / bw:.1f}%"  # noqa: E731
                print(f"| {tile} | {warps} | {both:.4f} | {share(both, nbytes)} | {fwd:.4f} | {share(fwd, half_bytes)} "
                      f"| {bwd:.4f} | {share(bwd, half_bytes)} |", flush=True)
    finally:
        mod._TILE_FWD, mod._TILE_BWD, mod._num_warps = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--tune", action="store_true", help="also sweep the RMSNorm backward launch knobs")
    p.add_argument("--tune-rope", action="store_true", help="also sweep RoPE's launch knobs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s (read + write), torch {torch.__version__}")
    liger = _liger()
    impls = ["eager", "compile", "liger", "fasttune"]
    results = {"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "ops": {}}
    for op in args.ops.split(","):
        step, fns, nbytes, hf_fn = CASES[op]()
        if not args.no_compile:
            fns["compile"] = torch.compile(hf_fn)
        if liger is not None:
            fns["liger"] = liger[op]
        row = {}
        for impl in impls:
            if impl not in fns:
                continue
            try:
                ms, how = gpu_time_ms(step(fns[impl]), args.reps)
            except Exception as e:
                print(f"  {op}/{impl} failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            row[impl] = {"ms": ms, "share_of_copy": nbytes / (ms * 1e-3) / bw, "timing": how}
            print(f"  {op:9s} {impl:9s} {ms:8.3f} ms  {100 * row[impl]['share_of_copy']:5.1f}% ({how})", flush=True)
        results["ops"][op] = {"bytes": nbytes, **row}
        del step, fns
        torch.cuda.empty_cache()
    print("\n| op (fwd+bwd, bf16) | MB moved | " + " | ".join(impls) + " |")
    print("|---|---|" + "---|" * len(impls))
    for op, row in results["ops"].items():
        cells = [f"{row[i]['ms']:.3f} ms / {100 * row[i]['share_of_copy']:.0f}%" if i in row else "—" for i in impls]
        print(f"| {op} | {row['bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    print(f"\nshare = bytes that must move / time / measured copy rate ({bw / 1e12:.2f} TB/s)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.tune:
        tune_rms_norm_bwd(bw, args.reps)
    if args.tune_rope:
        tune_rope(bw, args.reps)


if __name__ == "__main__":
    main()
