"""What each matrix product of the 8B LoRA step costs, and what regrouping them would buy (H200).

The no-recompute LoRA step on a Llama-3.1-8B shape (4×2048 = 8,192 rows) is GEMM-bound. This
times, in isolation, the products one decoder layer runs (M = 8,192 rows, bf16, dense frozen base
W, LoRA r = 16), each as fasttune runs it today next to an alternative grouping:

- qkv forward: three products X W_pᵀ vs one product with the stacked [W_q; W_k; W_v] (N = 6,144).
- qkv dX: dY_q W_q, then two accumulating products (cuBLAS epilogue, beta = 1) vs one product
  [dY_q | dY_k | dY_v] [W_q; W_k; W_v] (K = 6,144).
- gate/up forward and dX: the same question for the two 14,336-wide projections.
- the rank-r term in forward: base product then ``addmm_`` of (XA) Bᵀ (an extra pass over Y,
  fasttune's order: B = 0 is bitwise the base layer) vs (XA) Bᵀ written first and the base product
  accumulating onto it in the epilogue.
- LoRA's memory-bound products in backward: dY B, dYᵀ (XA), dYBᵀ X, per width.
- the rank-r term folded into the base product (``kernels/lora_wide.py``): q/k/v, gate/up and down
  with their ``addmm_`` passes vs one product per projection over [X | s·XA] (X copied into the
  widened input, B written into the weight's tail; the down projection's H already in place), and
  backward's dX through the widened weights' strided [out, in] views.

Each row: median GPU time over ``--reps`` replays of a CUDA graph holding one call, TFLOP/s (the
dense products) or GB/s (bytes the product must read and write, for the rank-16 ones). Prints a
markdown table; ``--out`` writes JSON.

Usage (H200 machine, repo root):  python3 benchmarks/bench_gemm.py [--rows 8192] [--out gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import graph_time_ms  # noqa: E402

DT = torch.bfloat16
D, I, KV, R = 4096, 14336, 1024, 16


def cases(m: int, tail: int = 0) -> list[tuple[str, str, object, float, float]]:
    """(group, variant, fn, flops, bytes) for one decoder layer's products at ``m`` rows; widened
    weights with ``tail`` extra columns (0: just the ranks)."""
    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=DT) * 0.02

    x, x_mlp, h = rnd(m, D), rnd(m, D), rnd(m, I)
    wq, wk, wv, wo = rnd(D, D), rnd(KV, D), rnd(KV, D), rnd(D, D)
    wqkv = torch.cat([wq, wk, wv])
    wg, wu, wd = rnd(I, D), rnd(I, D), rnd(D, I)
    wgu = torch.cat([wg, wu])
    dq, dk, dv = rnd(m, D), rnd(m, KV), rnd(m, KV)
    dqkv = torch.cat([dq, dk, dv], dim=1)
    dg, du = rnd(m, I), rnd(m, I)
    dgu = torch.cat([dg, du], dim=1)
    xa, b_i, b_d, a_qkv = rnd(m, R), rnd(I, R), rnd(D, R), rnd(3 * R, D)
    y_i, y_d = torch.empty(m, I, device="cuda", dtype=DT), torch.empty(m, D, device="cuda", dtype=DT)
    f = 2.0 * m

    def seq_qkv():
        for w in (wq, wk, wv):
            torch.nn.functional.linear(x, w)

    def seq_qkv_dx():
        dx = torch.mm(dq, wq)
        dx.addmm_(dk, wk)
        dx.addmm_(dv, wv)

    def seq_gu():
        torch.nn.functional.linear(x_mlp, wg)
        torch.nn.functional.linear(x_mlp, wu)

    def seq_gu_dx():
        torch.mm(dg, wg).addmm_(du, wu)

    def base_then_rank():
        torch.nn.functional.linear(x_mlp, wg).addmm_(xa, b_i.t())

    def rank_then_base():
        torch.mm(xa, b_i.t(), out=y_i).addmm_(x_mlp, wg.t())

    # Widened products (fasttune/kernels/lora_wide.py): W the first columns of [W | B-tail], one
    # product over [X | s·XA]. Buffers as the model holds them after lora_widen re-homes W.
    def wide(w, extra):
        buf = torch.zeros(w.shape[0], w.shape[1] + extra, device="cuda", dtype=DT)
        buf[:, : w.shape[1]].copy_(w)
        return buf

    t = tail  # widened weights carry `tail` extra columns (≥ the ranks; padded for row alignment)
    wq_w, wk_w, wv_w = wide(wq, max(t, 3 * R)), wide(wk, max(t, 3 * R)), wide(wv, max(t, 3 * R))
    wg_w, wu_w, wd_w = wide(wg, max(t, 2 * R)), wide(wu, max(t, 2 * R)), wide(wd, max(t, R))
    xa_qkv, xa_gu = rnd(m, 3 * R), rnd(m, 2 * R)
    b_q, b_kv = rnd(D, R), rnd(KV, R)
    hcat = torch.empty(m, I + max(t, R), device="cuda", dtype=DT)
    hcat[:, :I].copy_(h)

    def qkv_now():
        for w, b in ((wq, b_q), (wk, b_kv), (wv, b_kv)):
            torch.nn.functional.linear(x, w).addmm_(xa_qkv[:, :R], b.t())

    def qkv_wide():
        xcat = torch.empty(m, wq_w.shape[1], device="cuda", dtype=DT)
        xcat[:, :D].copy_(x)
        torch.mul(xa_qkv, 0.5, out=xcat[:, D:D + 3 * R])
        xcat[:, D + 3 * R:].zero_()
        for w, b, col in ((wq_w, b_q, 0), (wk_w, b_kv, R), (wv_w, b_kv, 2 * R)):
            w[:, D + col:D + col + R].copy_(b)
            torch.nn.functional.linear(xcat, w)

    def gu_now():
        for w in (wg, wu):
            torch.nn.functional.linear(x_mlp, w).addmm_(xa, b_i.t())

    def gu_wide():
        xcat = torch.empty(m, wg_w.shape[1], device="cuda", dtype=DT)
        xcat[:, :D].copy_(x_mlp)
        torch.mul(xa_gu, 0.5, out=xcat[:, D:D + 2 * R])
        xcat[:, D + 2 * R:].zero_()
        for w, col in ((wg_w, 0), (wu_w, R)):
            w[:, D + col:D + col + R].copy_(b_i)
            torch.nn.functional.linear(xcat, w)

    def down_now():
        torch.nn.functional.linear(h, wd).addmm_(xa, b_d.t())

    def down_wide():
        torch.mul(xa, 0.5, out=hcat[:, I:I + R])
        hcat[:, I + R:].zero_()
        wd_w[:, I:I + R].copy_(b_d)
        torch.nn.functional.linear(hcat, wd_w)

    return [
        ("qkv fwd", "3 products (now)", seq_qkv, f * D * (D + 2 * KV), 0),
        ("qkv fwd", "1 stacked product", lambda: torch.nn.functional.linear(x, wqkv), f * D * (D + 2 * KV), 0),
        ("qkv dX", "3 accumulating (now)", seq_qkv_dx, f * D * (D + 2 * KV), 0),
        ("qkv dX", "1 product, K = 6144", lambda: torch.mm(dqkv, wqkv), f * D * (D + 2 * KV), 0),
        ("o fwd", "X Wᵀ", lambda: torch.nn.functional.linear(x, wo), f * D * D, 0),
        ("o dX", "dY W", lambda: torch.mm(dq, wo), f * D * D, 0),
        ("gate/up fwd", "2 products (now)", seq_gu, f * D * 2 * I, 0),
        ("gate/up fwd", "1 stacked product", lambda: torch.nn.functional.linear(x_mlp, wgu), f * D * 2 * I, 0),
        ("gate/up dX", "2 accumulating (now)", seq_gu_dx, f * D * 2 * I, 0),
        ("gate/up dX", "1 product, K = 28672", lambda: torch.mm(dgu, wgu), f * D * 2 * I, 0),
        ("down fwd", "H Wᵀ", lambda: torch.nn.functional.linear(h, wd), f * D * I, 0),
        ("down dX", "dY W", lambda: torch.mm(dq, wd), f * D * I, 0),
        ("gate + rank-r", "base, then addmm_ (now)", base_then_rank, f * D * I, 0),
        ("gate + rank-r", "rank first, base in epilogue", rank_then_base, f * D * I, 0),
        ("rank-r pass", "Y += XA Bᵀ, N = 14336", lambda: y_i.addmm_(xa, b_i.t()), 0, 2 * 2 * m * I),
        ("rank-r pass", "Y += XA Bᵀ, N = 4096", lambda: y_d.addmm_(xa, b_d.t()), 0, 2 * 2 * m * D),
        ("LoRA bwd", "dY B, N = 14336", lambda: torch.mm(dg, b_i), 0, 2 * m * I),
        ("LoRA bwd", "dYᵀ XA, N = 14336", lambda: torch.mm(dg.t(), xa), 0, 2 * m * I),
        ("LoRA bwd", "dY B, N = 4096", lambda: torch.mm(dq, b_d), 0, 2 * m * D),
        ("LoRA bwd", "dYᵀ XA, N = 4096", lambda: torch.mm(dq.t(), xa), 0, 2 * m * D),
        ("LoRA bwd", "dYBᵀ X, K = 4096", lambda: torch.mm(xa.t(), x), 0, 2 * m * D),
        ("LoRA bwd", "dYBᵀ H, K = 14336", lambda: torch.mm(xa.t(), h), 0, 2 * m * I),
        ("LoRA fwd", "X A_qkvᵀ (r = 48)", lambda: torch.mm(x, a_qkv.t()), 0, 2 * m * D),
        ("qkv + rank-r", "3 products + 3 addmm_ (two-product path)", qkv_now, f * D * (D + 2 * KV), 0),
        ("qkv + rank-r", f"widened: copy X, 3 products K = {wq_w.shape[1]}", qkv_wide, f * D * (D + 2 * KV), 0),
        ("gate/up + rank-r", "2 products + 2 addmm_ (two-product path)", gu_now, f * D * 2 * I, 0),
        ("gate/up + rank-r", f"widened: copy X, 2 products K = {wg_w.shape[1]}", gu_wide, f * D * 2 * I, 0),
        ("down + rank-r", "product + addmm_ (two-product path)", down_now, f * D * I, 0),
        ("down + rank-r", f"widened: 1 product K = {wd_w.shape[1]} (H in place)", down_wide, f * D * I, 0),
        ("gate/up dX", f"through widened W views (ld = {wg_w.shape[1]})",
         lambda: torch.mm(dg, wg_w[:, :D]).addmm_(du, wu_w[:, :D]), f * D * 2 * I, 0),
        ("qkv dX", f"through widened W views (ld = {wq_w.shape[1]})",
         lambda: torch.mm(dq, wq_w[:, :D]).addmm_(dk, wk_w[:, :D]).addmm_(dv, wv_w[:, :D]), f * D * (D + 2 * KV), 0),
        ("down dX", f"through a widened W view (ld = {wd_w.shape[1]})", lambda: torch.mm(dq, wd_w[:, :I]),
         f * D * I, 0),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tails", default="0,64,128",
                   help="widened-weight tail widths to time (0: exactly the ranks), comma-separated")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemm.py needs a CUDA GPU")
    rows = []
    print("| product | variant | ms | TFLOP/s | GB/s |\n|---|---|---|---|---|")
    tails = [int(t) for t in args.tails.split(",") if t]
    todo = cases(args.rows, tails[0]) + [c for t in tails[1:] for c in cases(args.rows, t) if "widened" in c[1]]
    for group, variant, fn, flops, nbytes in todo:
        ms = graph_time_ms(fn, args.reps)
        row = dict(group=group, variant=variant, ms=round(ms, 4),
                   tflops=round(flops / ms / 1e9, 1) if flops else None,
                   gbps=round(nbytes / ms / 1e6, 1) if nbytes else None)
        rows.append(row)
        print(f"| {group} | {variant} | {ms:.4f} | {row['tflops'] or ''} | {row['gbps'] or ''} |", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(rows=rows, m=args.rows, gpu=torch.cuda.get_device_name(), torch=torch.__version__), fh,
                      indent=1)


if __name__ == "__main__":
    main()
