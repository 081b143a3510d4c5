"""Inference on a patched model: eval-mode logits and ``generate`` equal the stock model's, on every family.

Stock vs patched copies of one tiny random model (tests/_lib/helpers/tiny_models.py: GQA, two
layers, each family's options on; vocab 1,000, since in eval the head is stock and a 70k vocab only
slows the stock sampler down), fp32, every kernel on. A batch of two prompts of
different lengths, left padded (the layout batched generation uses):

- eval forward without labels, and with labels (the Trainer's evaluation call): logits come back
  and match stock, and so does the loss;
- greedy ``generate`` with the KV cache and without it: identical tokens, per-step logits within
  1e-5 relative;
- sampling with a fixed seed (two families: the sampler is family-independent, the logits it
  reads are checked on all ten above): identical tokens (the logits agree to ~1e-6, far from the
  gaps a different draw needs).

Tolerance. fp32 kernels and stock PyTorch compute the same functions with different summation
orders: ≤ 1e-5 relative (Frobenius) on the logits of the real (non-pad) positions; a wrong rotary
position under left padding, a missed cache update or a swapped softcap gives ≥ 1e-2. Padded
query positions attend to nothing real; their logits are not compared.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fasttune import FastConfig, patch_model
from helpers.compare import rel_err
from helpers.tiny_models import FAMILY_CASES, OWN_ROPE_TYPES, family_type, stock_fallback_ops, tiny_model

PAD = 0
NEW_TOKENS = 3
VOCAB = 1000


def _left_padded_prompts(vocab_size: int, lengths=(6, 3), seed: int = 40, device="cpu"):
    """Two prompts of different lengths, left padded with PAD (ids avoid PAD so padding is unambiguous)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab_size, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


@pytest.fixture(scope="module", params=FAMILY_CASES)
def pair(request):
    """(stock, patched) eval-mode copies of one tiny model of the family."""
    model_type = request.param
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stock = tiny_model(model_type, seed=8, vocab_size=VOCAB).to(device).eval()
    fast = copy.deepcopy(stock)
    report = patch_model(fast, FastConfig())
    assert [f.op for f in report.fallbacks] == stock_fallback_ops(request.param), str(report)
    own_rope = family_type(request.param) in OWN_ROPE_TYPES  # their own rotation: the attention carries the hooks only
    assert {"rms_norm", "attention_hook" if own_rope else "rope", "mlp", "cross_entropy"} <= set(report.patched), \
        str(report)
    return stock, fast


def test_eval_forward_returns_logits_matching_stock(pair):
    stock, fast = pair
    device = next(stock.parameters()).device
    ids, mask = _left_padded_prompts(stock.config.vocab_size, device=device)
    labels = ids.masked_fill(mask == 0, -100)
    real = mask.bool()
    with torch.no_grad():
        for kwargs in ({}, {"labels": labels}):
            a = fast(input_ids=ids, attention_mask=mask, **kwargs)
            b = stock(input_ids=ids, attention_mask=mask, **kwargs)
            assert a.logits is not None and a.logits.shape == b.logits.shape
            assert rel_err(a.logits[real], b.logits[real]) <= 1e-5
            if kwargs:
                assert rel_err(a.loss, b.loss) <= 1e-6


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_greedy_generation_matches_stock(pair, use_cache):
    stock, fast = pair
    device = next(stock.parameters()).device
    ids, mask = _left_padded_prompts(stock.config.vocab_size, device=device)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              use_cache=use_cache, pad_token_id=PAD, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        a = fast.generate(ids, **kw)
        b = stock.generate(ids, **kw)
    assert a.sequences.shape == (2, ids.shape[1] + NEW_TOKENS)
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == len(b.logits) == NEW_TOKENS
    for step, (la, lb) in enumerate(zip(a.logits, b.logits)):
        assert rel_err(la, lb) <= 1e-5, f"step {step}"


@pytest.mark.parametrize("pair", ["llama", "gemma2"], indirect=True)  # gemma2: softcapped logits
def test_sampling_with_a_fixed_seed_matches_stock(pair):
    stock, fast = pair
    device = next(stock.parameters()).device
    ids, mask = _left_padded_prompts(stock.config.vocab_size, seed=41, device=device)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=True,
              top_k=0, top_p=1.0, temperature=1.0, pad_token_id=PAD)
    outs = []
    for model in (fast, stock):
        torch.manual_seed(123)
        with torch.no_grad():
            outs.append(model.generate(ids, **kw))
    assert torch.equal(outs[0], outs[1])
