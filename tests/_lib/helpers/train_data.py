"""Small in-process datasets for Trainer tests."""

from __future__ import annotations

import torch


def random_lm_rows(vocab_size: int, n: int = 32, min_len: int = 5, max_len: int = 19, seed: int = 0,
                   prompt_frac: float = 0.3) -> list[dict[str, list[int]]]:
    """Rows of different lengths with the first ~30% of each row's labels masked (a "prompt")."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(3, vocab_size, (length,), generator=g).tolist()
        cut = max(1, int(length * prompt_frac))
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [-100] * cut + ids[cut:]})
    return rows
