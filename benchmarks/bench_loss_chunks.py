#!/usr/bin/env python3
"""Where the fused loss head's time goes, by chunk size (GPU only).

    python3 benchmarks/bench_loss_chunks.py [--shapes llama3-8b qwen2.5-7b gemma2-2b] [--rows 1024 2048 ...]

For each head shape of ``bench_loss.py`` and each chunk of R rows, times the four pieces of one chunk
(CUDA events, median): the logits product x = h·Wᵀ, the Triton pass (online softmax + dX in place),
dH = dX·W, and dW += dXᵀ·h accumulated in fp32 (``addmm_fp32_``, as ``head_chunks`` runs it). Every
piece is reported per 1,000 rows, so chunk sizes compare directly, and as a share of the bf16 GEMM
floor of the same rows (one product of the forward's shape). This picks the chunk plan of
``_lce_common.plan_chunk_rows``; it measures no peer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loss import SHAPES, time_ms_plain as timed  # noqa: E402

from fasttune.kernels._lce_common import GradScaling, addmm_fp32_  # noqa: E402
from fasttune.kernels.cross_entropy import _launch, _Options  # noqa: E402

DEFAULT_ROWS = (512, 1024, 1536, 2048, 2560, 3072, 4096, 6144, 8192)


def pieces(R: int, D: int, V: int, softcap, reps: int) -> dict:
    dev, bf = "cuda", torch.bfloat16
    h = torch.randn(R, D, device=dev, dtype=bf)
    W = (torch.randn(V, D, device=dev) * D ** -0.5).to(bf)
    y = torch.randint(0, V, (R,), device=dev)
    x = torch.empty(R, V, device=dev, dtype=bf)
    dh = torch.empty(R, D, device=dev, dtype=bf)
    dw32 = torch.zeros(V, D, device=dev, dtype=torch.float32)
    f32 = dict(device=dev, dtype=torch.float32)
    lse, loss = torch.empty(R, **f32), torch.empty(R, **f32)
    opts = _Options(softcap=softcap)
    scale = GradScaling(bf, torch.full((1,), 1.0 / R, device=dev)).c
    out = dict(rows=R)
    out["logits"] = timed(lambda: torch.mm(h, W.t(), out=x), reps)
    # The pass overwrites x with dX; refreshing x first keeps every repeat on real logits.
    refill = timed(lambda: torch.mm(h, W.t(), out=x), reps)
    out["pass"] = timed(lambda: (torch.mm(h, W.t(), out=x), _launch(opts, x, y, lse, loss=loss, dx=x, scale=scale)),
                        reps) - refill
    out["dh"] = timed(lambda: torch.mm(x, W, out=dh), reps)
    out["dw_fp32"] = timed(lambda: addmm_fp32_(dw32, x.t(), h, beta=1.0), reps)
    # The same products in the other output layout (dHᵀ = Wᵀ·dXᵀ, dWᵀ = hᵀ·dX): cuBLAS picks other kernels.
    dht = torch.empty(D, R, device=dev, dtype=bf)
    out["dh_t"] = timed(lambda: torch.mm(W.t(), x.t(), out=dht), reps)
    dw32t = torch.zeros(D, V, device=dev, dtype=torch.float32)
    out["dw_fp32_t"] = timed(lambda: addmm_fp32_(dw32t, h.t(), x, beta=1.0), reps)
    return out  # the buffers go with this frame; main() empties the cache


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=list(DEFAULT_ROWS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    rows = []
    print("| shape | rows | logits | pass | dH (dHᵀ) | dW fp32 (dWᵀ) | frozen (x+p+dH) | trainable (+dW) | ms per 1k rows: "
          "frozen / trainable | floor % frozen / trainable |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        N, D, V, softcap = SHAPES[name]
        full = pieces(N, D, V, softcap, args.reps)["logits"]  # the floor product at full N
        per_k_floor = full / N * 1000
        for R in args.rows:
            r = pieces(R, D, V, softcap, args.reps)
            torch.cuda.empty_cache()
            frozen = r["logits"] + r["pass"] + r["dh"]
            trainable = frozen + r["dw_fp32"]
            fk, tk = frozen / R * 1000, trainable / R * 1000
            r.update(shape=name, frozen=frozen, trainable=trainable, frozen_per_k=fk, trainable_per_k=tk,
                     floor_pct_frozen=100 * 2 * per_k_floor / fk, floor_pct_trainable=100 * 3 * per_k_floor / tk)
            rows.append(r)
            print(f"| {name} | {R} | {r['logits']:.3f} | {r['pass']:.3f} | {r['dh']:.3f} ({r['dh_t']:.3f}) | "
                  f"{r['dw_fp32']:.3f} ({r['dw_fp32_t']:.3f}) | "
                  f"{frozen:.3f} | {trainable:.3f} | {fk:.3f} / {tk:.3f} | "
                  f"{r['floor_pct_frozen']:.0f} / {r['floor_pct_trainable']:.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
