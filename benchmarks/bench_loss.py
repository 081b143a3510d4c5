#!/usr/bin/env python3
"""Loss-head benchmark (GPU only): fused linear cross-entropy, fwd+bwd, side by side.

    python3 benchmarks/bench_loss.py --out $OUT/bench_loss.json      # full run, < 4 min on an H200
    python3 benchmarks/bench_loss.py --quick                           # smoke run, ~30 s

Implementations: torch eager (F.linear in bf16, F.cross_entropy on .float() logits, as Hugging Face
does), torch.compile of that, Liger's LigerFusedLinearCrossEntropyLoss, Cut Cross-Entropy's
linear_cross_entropy, fasttune (default workspace: 1024 MiB with W trainable, else what 1,024 rows take, at
least 256 MiB; 256 MiB, 1 GiB and 4 GiB show the memory/speed trade: with W trainable, fewer chunks mean
fewer read-modify-writes of the fp32 dW accumulator). A peer that does not import
gets an "n/a" row. Shapes: Llama-3-8B, Qwen2.5-7B, Gemma-2-2B (soft-cap 30) heads, bf16, ~5% of labels
ignored, W trainable and frozen; ``--fp32-master`` adds W trainable in fp32 under bf16 hidden states
(autocast over fp32 master weights; beyond_grads then counts against an fp32 dW).

Measured per row:
- ms: median fwd+bwd wall time over CUDA events after warm-up (these ops are far above launch cost);
- floor%: the GEMM floor (3 products with a trainable W, 2 frozen, each timed as one bf16 torch.mm
  [N, D]×[D, V]) as a share of ms (fasttune's compaction can beat the full-N floor slightly);
- peak_gib: torch.cuda.max_memory_allocated during one fwd+bwd minus what was allocated before it
  (inputs, labels and the fp32 reference are excluded); beyond_grads_gib: peak_gib minus the bytes of
  the gradients the call returns (dH, and dW when W trains), i.e. the implementation's own overhead;
- err_loss, err_dh, err_dw: relative Frobenius error against an fp32 chunked reference
  (fasttune.kernels.reference with fp32 inputs, TF32 off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fasttune.kernels import reference  # noqa: E402
from fasttune.kernels.cross_entropy import fused_linear_cross_entropy  # noqa: E402

GIB = 2 ** 30
DEVICE = "cuda"
SHAPES = {  # name: (N, D, V, softcap)
    "llama3-8b": (16384, 4096, 128256, None),
    "qwen2.5-7b": (8192, 3584, 152064, None),
    "gemma2-2b": (8192, 2304, 256000, 30.0),
}
QUICK_SHAPES = {"llama3-8b/4": (4096, 4096, 128256, None)}


# ------------------------------------------------------------------------------------------------
# implementations: name → factory(softcap) → (fn(h, W, y) -> loss) or a reason it is unavailable
# ------------------------------------------------------------------------------------------------


def _eager_loss(h, W, y, softcap):
    logits = F.linear(h, W)
    if softcap is not None:  # Gemma-2's HF forward soft-caps in the model dtype
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), y, ignore_index=-100)


def make_eager(softcap):
    return lambda h, W, y: _eager_loss(h, W, y, softcap)


_COMPILED = {}  # softcap → compiled fn; cleared per shape so every shape compiles static


def make_compile(softcap):
    if softcap not in _COMPILED:
        _COMPILED[softcap] = torch.compile(lambda h, W, y: _eager_loss(h, W, y, softcap), dynamic=False)
    return _COMPILED[softcap]


def make_liger(softcap):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        return f"n/a ({type(e).__name__})"
    try:
        mod = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, softcap=softcap)
    except TypeError:
        if softcap is not None:
            return "n/a (no softcap support)"
        mod = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)

    def fn(h, W, y):
        out = mod(W, h, y)
        out = out[0] if isinstance(out, tuple) else out
        return getattr(out, "loss", out)

    return fn


def make_cce(softcap):
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as e:  # noqa: BLE001
        return f"n/a ({type(e).__name__})"
    return lambda h, W, y: linear_cross_entropy(h, W, y, ignore_index=-100, softcap=softcap)


def make_fasttune(workspace_mib):
    def factory(softcap):
        return lambda h, W, y: fused_linear_cross_entropy(h, W, y, softcap=softcap, workspace_mib=workspace_mib)
    return factory


IMPLS = {
    "torch eager": make_eager,
    "torch.compile": make_compile,
    "liger": make_liger,
    "cce": make_cce,
    "fasttune": make_fasttune(None),
    "fasttune ws=256MiB": make_fasttune(256),
    "fasttune ws=1GiB": make_fasttune(1024),
    "fasttune ws=4GiB": make_fasttune(4096),
}


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------


def rel(a, b):
    if a is None or b is None:
        return None
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def fwd_bwd(fn, h, W, y):
    h.grad = None
    W.grad = None
    loss = fn(h, W, y)
    loss.backward()
    return loss


def measure_once(fn, h, W, y):
    """One fwd+bwd with memory accounting; returns (loss, dH, dW, peak_bytes, grad_bytes, seconds)."""
    h.grad = W.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = fwd_bwd(fn, h, W, y)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    grads = h.grad.nbytes + (W.grad.nbytes if W.grad is not None else 0)
    return loss.detach().float(), h.grad, W.grad, peak, grads, secs


def time_ms(fn, h, W, y, reps, warmup=1):
    for _ in range(warmup):
        fwd_bwd(fn, h, W, y)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fwd_bwd(fn, h, W, y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    h.grad = W.grad = None
    return statistics.median(times)


def gemm_ms(N, D, V, reps=5):
    a = torch.randn(N, D, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(V, D, device=DEVICE, dtype=torch.bfloat16)
    return time_ms_plain(lambda: torch.mm(a, b.t()), reps)


def time_ms_plain(f, reps):
    f()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        f()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fp32_reference(h, W, y, softcap):
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        hf = h.detach().float().requires_grad_()
        wf = W.detach().float().requires_grad_()
        loss = reference.fused_linear_cross_entropy(hf, wf, y, softcap=softcap, chunk_rows=2048)
        loss.backward()
        return loss.detach(), hf.grad, wf.grad
    finally:
        torch.set_float32_matmul_precision(prec)


def run(args):
    shapes = QUICK_SHAPES if args.quick else {k: SHAPES[k] for k in args.shapes}
    modes = ["trainable"] if args.quick else ["trainable", "frozen"]
    modes += ["fp32-master"] if args.fp32_master else []
    impls = [i for i in IMPLS if i in args.impls and not (args.quick and i == "torch.compile")]
    t_start = time.perf_counter()
    compile_spent = 0.0
    rows = []
    for shape, (N, D, V, softcap) in shapes.items():
        _COMPILED.clear()
        g = torch.Generator(device=DEVICE).manual_seed(0)
        h0 = torch.randn(N, D, device=DEVICE, generator=g).to(torch.bfloat16)
        W0 = (torch.randn(V, D, device=DEVICE, generator=g) * D ** -0.5).to(torch.bfloat16)
        y = torch.randint(0, V, (N,), device=DEVICE, generator=g)
        y[torch.rand(N, device=DEVICE, generator=g) < 0.05] = -100
        ref_loss, ref_dh, ref_dw = fp32_reference(h0, W0, y, softcap)
        t_gemm = gemm_ms(N, D, V)
        print(f"# {shape}: N={N} D={D} V={V} softcap={softcap}; one bf16 GEMM {t_gemm:.2f} ms; "
              f"reference done at {time.perf_counter() - t_start:.0f} s", flush=True)
        for mode in modes:
            h = h0.clone().requires_grad_()
            trains = mode != "frozen"
            W = (W0.float() if mode == "fp32-master" else W0.clone()).requires_grad_(trains)
            floor = t_gemm * (3 if trains else 2)
            for name in impls:
                row = dict(shape=shape, N=N, D=D, V=V, softcap=softcap, W=mode, impl=name)
                rows.append(row)
                elapsed = time.perf_counter() - t_start
                if elapsed > args.time_budget and not name.startswith("fasttune"):
                    row["status"] = f"skipped (time budget {args.time_budget:.0f} s spent)"
                    continue
                if name == "torch.compile" and compile_spent > args.compile_budget:
                    row["status"] = f"skipped (compile budget {args.compile_budget:.0f} s spent)"
                    continue
                fn = IMPLS[name](softcap)
                if isinstance(fn, str):
                    row["status"] = fn
                    continue
                if mode == "fp32-master" and not name.startswith("fasttune"):  # autocast's cast, in autograd
                    fn = (lambda f: lambda h_, w_, y_: f(h_, w_.to(h_.dtype), y_))(fn)
                try:
                    loss, dh, dw, peak, gbytes, secs = measure_once(fn, h, W, y)
                    if name == "torch.compile":
                        compile_spent += secs
                    row.update(
                        err_loss=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                        err_dh=rel(dh, ref_dh), err_dw=rel(dw, ref_dw) if trains else None,
                        peak_gib=peak / GIB, beyond_grads_gib=(peak - gbytes) / GIB,
                    )
                    del loss, dh, dw
                    h.grad = W.grad = None
                    once = time_ms(fn, h, W, y, reps=1, warmup=0)
                    reps = max(3, min(args.max_reps, int(args.cell_seconds * 1000 / max(once, 1e-3))))
                    row["ms"] = time_ms(fn, h, W, y, reps=reps, warmup=0)
                    row["reps"] = reps
                    row["floor_pct"] = 100.0 * floor / row["ms"]
                    row["status"] = "ok"
                except Exception as e:  # noqa: BLE001 - one peer failing must not stop the table
                    row["status"] = f"error: {type(e).__name__}: {str(e)[:160]}"
                    h.grad = W.grad = None
                torch.cuda.empty_cache()
                print(fmt_row(row), flush=True)
            del h, W
        del h0, W0, ref_dh, ref_dw
        torch.cuda.empty_cache()
    return rows, time.perf_counter() - t_start


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


HEADER = ("| shape | W | impl | ms | floor % | peak GiB | beyond grads GiB | err loss | err dH | err dW |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def fmt_row(r):
    if r.get("status") != "ok":
        return f"| {r['shape']} | {r['W']} | {r['impl']} | {r.get('status', '?')} | | | | | | |"
    return (f"| {r['shape']} | {r['W']} | {r['impl']} | {fmt(r['ms'], '.1f')} | {fmt(r['floor_pct'], '.0f')} | "
            f"{fmt(r['peak_gib'], '.2f')} | {fmt(r['beyond_grads_gib'], '.2f')} | {fmt(r['err_loss'], '.1e')} | "
            f"{fmt(r['err_dh'], '.1e')} | {fmt(r['err_dw'], '.1e')} |")


def versions():
    out = {"torch": torch.__version__}
    for mod in ("triton", "liger_kernel", "cut_cross_entropy"):
        try:
            from importlib.metadata import version
            out[mod] = version(mod.replace("_", "-")) if mod != "triton" else __import__("triton").__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="smoke run: one 4k-token Llama shape, W trainable")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    p.add_argument("--fp32-master", action="store_true",
                   help="also W in fp32 with bf16 hidden (autocast over fp32 master weights): the peers get "
                        "W.to(bf16) inside autograd, fasttune the fp32 W (its dW returned in fp32)")
    p.add_argument("--cell-seconds", type=float, default=1.0, help="timing budget per row (sets the repeats)")
    p.add_argument("--max-reps", type=int, default=10)
    p.add_argument("--compile-budget", type=float, default=75.0,
                   help="stop compiling new torch.compile variants after this many seconds of compiling")
    p.add_argument("--time-budget", type=float, default=190.0,
                   help="after this many seconds only fasttune rows still run")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_loss.py needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()} | {versions()}", flush=True)
    print(HEADER, flush=True)
    rows, total = run(args)
    print("\n" + HEADER)
    for r in rows:
        print(fmt_row(r))
    print(f"\n# total {total:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), versions=versions(), seconds=total,
                           definitions=__doc__.split("Measured per row:")[1].strip(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
