"""What each FP8 base product of the 8B LoRA step costs against bf16, and what its pieces cost (H200).

``FastConfig(base_dtype="fp8")`` runs a decoder layer's frozen base products through
``kernels/fp8.py``. This times one layer's products at M = 8,192 rows (4×2048 tokens) in isolation:

- forward X Wᵀ per projection group: bf16 ``F.linear``; ``torch._scaled_mm`` with row-wise scales,
  fast and exact accumulation; a stacked product per group ([W_q; W_k; W_v], [W_gate; W_up]);
- the row quantiser of X (``fp8.quantize_rows``) per input width;
- dX = dY W: bf16 ``mm``; FP8 as fasttune runs it (G = dY diag(s_W) quantised, a transposed copy of
  the codes, exact accumulation), the transposed copy alone (``byte_transpose.py`` and torch's
  strided copy), fast accumulation, and one stacked product per group (K = Σ out);
- the rank-r term added onto an FP8 product's output (``addmm_``), the pass the widened bf16
  products fold in.

Each row: median GPU time over ``--reps`` replays of a CUDA graph holding one call, and TFLOP/s
for the products. Prints a markdown table; ``--out`` writes JSON.

Usage (H200 machine, repo root):  python3 benchmarks/bench_fp8_gemm.py [--rows 8192] [--out fp8_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import graph_time_ms  # noqa: E402

from fasttune.kernels import fp8  # noqa: E402
from fasttune.kernels.byte_transpose import transpose_bytes  # noqa: E402

DT = torch.bfloat16
D, I, KV, R = 4096, 14336, 1024, 16
GROUPS = (("qkv", D, (D, KV, KV)), ("o", D, (D,)), ("gate/up", D, (I, I)), ("down", I, (D,)))


def _scaled(q, s, w_t, s_w, fast):
    out = torch._scaled_mm(q, w_t, s.view(-1, 1), s_w.view(1, -1), out_dtype=DT, use_fast_accum=fast)
    return out[0] if isinstance(out, tuple) else out


def cases(m: int) -> list[tuple[str, str, object, float]]:
    """(group, variant, fn, flops) for one decoder layer's base products at ``m`` rows."""
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=DT) * 0.02

    out = []
    for name, k, outs in GROUPS:
        x = rnd(m, k)
        ws = [rnd(n, k) for n in outs]
        fw = [fp8.Fp8Weight.quantize(w) for w in ws]
        dys = [rnd(m, n) for n in outs]
        xq = fp8.quantize_rows(x)
        flops = 2.0 * m * k * sum(outs)
        xa, bs = rnd(m, R), [rnd(n, R) for n in outs]
        ys = [torch.empty(m, n, device="cuda", dtype=DT) for n in outs]

        def fwd_bf16(x=x, ws=ws):
            for w in ws:
                F.linear(x, w)

        def fwd_fp8(x=x, fw=fw, xq=xq, fast=True, quant=True):
            q, s = fp8.quantize_rows(x) if quant else xq
            for w in fw:
                _scaled(q, s, w.fp8.t(), w.scale, fast)

        def rank_terms(ys=ys, bs=bs, xa=xa):
            for y, b in zip(ys, bs):
                y.addmm_(xa, b.t())

        def dx_bf16(dys=dys, ws=ws):
            dx = torch.mm(dys[0], ws[0])
            for dy, w in zip(dys[1:], ws[1:]):
                dx.addmm_(dy, w)

        def dx_fp8_now(dys=dys, fw=fw):
            dx = None
            for dy, w in zip(dys, fw):
                part = fp8.grad_input_product(dy, w)
                dx = part if dx is None else dx.add_(part)

        gq = [fp8.quantize_rows(dy, col_scale=w.scale) for dy, w in zip(dys, fw)]
        wt = [w.fp8.t().contiguous().t() for w in fw]  # column-major [out, in] codes, made once
        ones = torch.ones(k, device="cuda", dtype=torch.float32)

        def dx_fp8_pre_t(fast, gq=gq, wt=wt, ones=ones):
            for (q, s), w in zip(gq, wt):
                _scaled(q, s, w, ones, fast)

        def transposes(fw=fw, torch_copy=False):
            for w in fw:
                w.fp8.t().contiguous() if torch_copy else transpose_bytes(w.fp8)

        def quant_g(dys=dys, fw=fw):
            for dy, w in zip(dys, fw):
                fp8.quantize_rows(dy, col_scale=w.scale)

        out += [
            (f"{name} fwd", "bf16 F.linear", fwd_bf16, flops),
            (f"{name} fwd", "fp8 as now: quantise X + fast-accum products", fwd_fp8, flops),
            (f"{name} fwd", "fp8 products only, fast accum", lambda f=fwd_fp8: f(quant=False), flops),
            (f"{name} fwd", "fp8 products only, exact accum", lambda f=fwd_fp8: f(fast=False, quant=False), flops),
            (f"{name} fwd", "quantise X alone", lambda x=x: fp8.quantize_rows(x), 0),
            (f"{name} fwd", "rank-r addmm_ passes", rank_terms, 0),
            (f"{name} dX", "bf16 mm (+ accumulating)", dx_bf16, flops),
            (f"{name} dX", "fp8 as now: quantise G, transpose W, exact accum, add", dx_fp8_now, flops),
            (f"{name} dX", "fp8 products only, exact accum", lambda f=dx_fp8_pre_t: f(False), flops),
            (f"{name} dX", "fp8 products only, fast accum", lambda f=dx_fp8_pre_t: f(True), flops),
            (f"{name} dX", "transposed copies of the codes alone (byte_transpose)", transposes, 0),
            (f"{name} dX", "transposed copies, torch's t().contiguous()", lambda f=transposes: f(torch_copy=True), 0),
            (f"{name} dX", "quantise G alone", quant_g, 0),
        ]
        if len(outs) > 1:
            wcat = fp8.Fp8Weight.quantize(torch.cat(ws))
            wcat_t = wcat.fp8.t().contiguous().t()
            gcat = fp8.quantize_rows(torch.cat(dys, dim=1), col_scale=wcat.scale)
            out += [
                (f"{name} fwd", f"fp8 one stacked product N = {sum(outs)}, fast accum",
                 lambda wcat=wcat, xq=xq: _scaled(xq[0], xq[1], wcat.fp8.t(), wcat.scale, True), flops),
                (f"{name} dX", f"fp8 one stacked product K = {sum(outs)}, exact accum",
                 lambda g=gcat, w=wcat_t, o=ones: _scaled(g[0], g[1], w, o, False), flops),
                (f"{name} dX", f"fp8 one stacked product K = {sum(outs)}, fast accum",
                 lambda g=gcat, w=wcat_t, o=ones: _scaled(g[0], g[1], w, o, True), flops),
            ]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm.py needs a CUDA GPU")
    why = fp8.product_path(torch.empty(1, 16, device="cuda", dtype=DT),
                           fp8.Fp8Weight.quantize(torch.ones(16, 16, device="cuda")))
    if why:
        raise SystemExit(f"no FP8 products here: {why}")
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M = {args.rows}")
    print("| product | variant | ms | TFLOP/s |\n|---|---|---|---|")
    for group, variant, fn, flops in cases(args.rows):
        ms = graph_time_ms(fn, args.reps)
        row = dict(group=group, variant=variant, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1) if flops else None)
        rows.append(row)
        print(f"| {group} | {variant} | {ms:.4f} | {row['tflops'] or ''} |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(rows=rows, m=args.rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__), fh,
                      indent=1)


if __name__ == "__main__":
    main()
