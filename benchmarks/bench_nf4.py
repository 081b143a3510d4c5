"""The NF4 dequantiser's store into a widened buffer, by width (issue 21).

``lora_wide.BorderedNf4`` dequantises each NF4 weight [out, in] into the first ``in`` columns of an
[out, in + 64] buffer (rows ``in + 64`` apart). This times that store against a contiguous out of the
same weight, per projection shape of Llama-3.1-8B, Qwen2.5-7B and Gemma 3 12B. ``--min-row-tile``
sets the narrowest row tile (``nf4._MIN_ROW_TILE``; 2,048 by default: only widths that are multiples of
2,048 take one, others store in runs; 256 gives Qwen2.5's and Gemma 3's widths tiles of 512 and 256).
Random codes, nested bf16 state (blocksize 64, as bitsandbytes' QLoRA default). Each row: median GPU
µs over ``--reps`` replays of a CUDA graph holding one call.

Usage (GPU machine, repo root):  python3 benchmarks/bench_nf4.py [--reps 200] [--min-row-tile 256]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import graph_time_ms  # noqa: E402
from fasttune.kernels import nf4  # noqa: E402

SHAPES = {
    "llama-8b q": (4096, 4096), "llama-8b gate": (14336, 4096), "llama-8b down": (4096, 14336),
    "qwen2.5-7b q": (3584, 3584), "qwen2.5-7b gate": (18944, 3584), "qwen2.5-7b down": (3584, 18944),
    "gemma3-12b gate": (15360, 3840), "gemma3-12b down": (3840, 15360),
}


def random_state(shape, device):
    """Random NF4 codes and a nested bf16 QuantState of ``shape`` (timing only: values do not matter)."""
    n = math.prod(shape)
    blocks = -(-n // 64)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, device=device)
    state2 = SimpleNamespace(absmax=torch.rand(-(-blocks // 256), device=device) + 0.5,
                             code=torch.sort(torch.rand(256, device=device) * 2 - 1).values, blocksize=256)
    qs = SimpleNamespace(absmax=torch.randint(0, 256, (blocks,), dtype=torch.uint8, device=device),
                         shape=torch.Size(shape), dtype=torch.bfloat16, blocksize=64, quant_type="nf4",
                         nested=True, offset=torch.tensor(0.01, device=device), state2=state2)
    return packed, qs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--extra", type=int, default=64, help="tail columns of the widened buffer")
    ap.add_argument("--min-row-tile", type=int, default=None, help="override nf4._MIN_ROW_TILE (A/B)")
    args = ap.parse_args()
    if args.min_row_tile is not None:
        nf4._MIN_ROW_TILE = args.min_row_tile
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, min row tile {nf4._MIN_ROW_TILE}")
    print("| weight | [out, in] | contiguous µs | rows apart µs | rows apart / contiguous | row tile |")
    print("|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        packed, qs = random_state(shape, dev)
        flat = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        wide = torch.empty(shape[0], shape[1] + args.extra, dtype=torch.bfloat16, device=dev)
        view = wide[:, : shape[1]]
        want = nf4.dequantize_nf4(packed, qs, out=flat)
        assert torch.equal(nf4.dequantize_nf4(packed, qs, out=view), want), name
        t_flat = graph_time_ms(lambda: nf4.dequantize_nf4(packed, qs, out=flat), args.reps) * 1e3
        t_wide = graph_time_ms(lambda: nf4.dequantize_nf4(packed, qs, out=view), args.reps) * 1e3
        tile = nf4.fast_rows_apart(shape[1], shape[1] + args.extra, dev)
        print(f"| {name} | {list(shape)} | {t_flat:.1f} | {t_wide:.1f} | {t_wide / t_flat:.2f} | {tile} |")


if __name__ == "__main__":
    main()
