"""The fused-loss causal-LM head: same loss and gradients as stock, stock behaviour where it must be."""

import copy

import pytest
import torch
from torch import nn

from fasttune import FastConfig, patch_model, unpatch_model
from fasttune.model_patches.head import FusedLMHeadOutput, head_forward
from helpers.compare import assert_grads_close, rel_err
from helpers.tiny_models import make_batch, tiny_model

HEAD_ONLY = FastConfig(rms_norm=False, rope=False, mlp=False, lora=False)


def _loss_and_backward(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kw)
    out.loss.backward()
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_llama_head_parity_fp32(tied):
    stock = tiny_model("llama", tie_word_embeddings=tied)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, HEAD_ONLY)
    assert report.patched["cross_entropy"] == 1
    batch = make_batch(stock.config.vocab_size, seed=1)
    a, b = _loss_and_backward(fast, batch), _loss_and_backward(stock, batch)
    assert a.logits is None  # training forward with labels: no [tokens, vocab] tensor returned
    assert rel_err(a.loss, b.loss) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)


def test_num_items_in_batch_divides_the_sum():
    stock = tiny_model("llama")
    fast = copy.deepcopy(stock)
    patch_model(fast, HEAD_ONLY)
    batch = make_batch(stock.config.vocab_size, seed=2)
    n = torch.tensor(57)
    a = _loss_and_backward(fast, batch, num_items_in_batch=n)
    b = _loss_and_backward(stock, batch, num_items_in_batch=n)
    assert rel_err(a.loss, b.loss) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)


def test_eval_mode_and_no_labels_return_stock_logits():
    stock = tiny_model("llama")
    fast = copy.deepcopy(stock)
    patch_model(fast, HEAD_ONLY)
    batch = make_batch(stock.config.vocab_size, seed=3)
    fast.eval(), stock.eval()
    with torch.no_grad():
        a, b = fast(**batch), stock(**batch)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
        nolab = {k: v for k, v in batch.items() if k != "labels"}
        assert torch.equal(fast(**nolab).logits, stock(**nolab).logits)


def test_return_logits_option_takes_the_stock_path():
    model = tiny_model("llama")
    patch_model(model, FastConfig(rms_norm=False, rope=False, mlp=False, lora=False, return_logits=True))
    out = model(**make_batch(model.config.vocab_size))
    assert out.logits is not None and out.logits.shape[-1] == model.config.vocab_size


def test_peft_wrapped_model():
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama")
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    stock = get_peft_model(copy.deepcopy(base), cfg)
    fast = get_peft_model(copy.deepcopy(base), cfg)
    fast.load_state_dict(stock.state_dict())
    report = patch_model(fast, HEAD_ONLY)
    assert report.patched["cross_entropy"] == 1
    batch = make_batch(base.config.vocab_size, seed=4)
    a, b = _loss_and_backward(fast, batch), _loss_and_backward(stock, batch)
    assert rel_err(a.loss, b.loss) <= 1e-6
    assert_grads_close(fast, stock, 1e-5)


def test_trl_fused_lm_head_protocol():
    model = tiny_model("llama")
    patch_model(model, HEAD_ONLY)
    batch = make_batch(model.config.vocab_size, seed=5)
    out = model(**batch, fused_lm_head=True)
    assert isinstance(out, FusedLMHeadOutput)
    with torch.no_grad():
        logits = unpatched_logits(model, batch)[:, :-1].double()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits, -1)
    ref_lp = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * mask
    ref_ent = -(logp.exp() * logp).sum(-1) * mask
    assert torch.equal(out.label_mask, mask)
    assert rel_err(out.log_probs, ref_lp) <= 1e-6
    assert rel_err(out.entropy, ref_ent) <= 1e-5
    assert torch.equal(out.is_top1, (logits.argmax(-1) == labels) & mask)
    assert rel_err(out.loss, -ref_lp.sum() / mask.sum()) <= 1e-6
    out.loss.backward()
    assert model.lm_head.weight.grad is not None


def unpatched_logits(model, batch):
    report_model = copy.deepcopy(model)
    unpatch_model(report_model)
    report_model.eval()
    return report_model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def test_quantised_or_wrapped_lm_head_falls_back():
    model = tiny_model("llama")

    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    model.lm_head = Scaled(model.lm_head)
    report = patch_model(model, HEAD_ONLY)
    assert report.patched["cross_entropy"] == 0
    assert any(fb.op == "cross_entropy" and "nn.Linear" in fb.reason for fb in report.fallbacks)
    assert head_forward(model) is None


def test_unpatch_restores_the_class_forward():
    model = tiny_model("llama")
    patch_model(model, HEAD_ONLY)
    assert "forward" in model.__dict__
    unpatch_model(model)
    assert "forward" not in model.__dict__


def test_autocast_bf16_matches_stock_within_bf16_noise():
    stock = tiny_model("llama")
    fast = copy.deepcopy(stock)
    patch_model(fast, HEAD_ONLY)
    batch = make_batch(stock.config.vocab_size, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = fast(**batch).loss
        b = stock(**batch).loss
    ref = stock(**batch).loss  # fp32
    assert abs(float(a) - float(ref)) <= 2 * abs(float(b) - float(ref)) + 2e-2


@pytest.mark.parametrize("tied", [False, True])
def test_autocast_over_fp32_master_weights_keeps_the_head_gradient_fp32(tied, monkeypatch):
    """Full fine-tuning with fp32 parameters under bf16 autocast (the Trainer's bf16=True over an fp32 model):
    the fused head runs (counted) on the lm_head's bf16 values, as stock's autocast cast does, and returns its
    gradient in fp32 straight from the accumulator (no bf16 dW, not cast by autograd): values a bf16 gradient
    cannot hold, as close to the fp32 run's as stock autocast's (bf16-rounded) gradient is."""
    from fasttune.kernels._lce_common import head_chunks

    stock = tiny_model("llama", tie_word_embeddings=tied)
    fast = copy.deepcopy(stock)
    report = patch_model(fast, HEAD_ONLY)
    casts = []  # the weight dtype each call of the loss kernel's chunk driver received
    monkeypatch.setattr("fasttune.kernels.cross_entropy.head_chunks", lambda h, w, *a, **k: (
        casts.append(w.dtype), head_chunks(h, w, *a, **k))[1])
    batch = make_batch(stock.config.vocab_size, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = _loss_and_backward(fast, batch).loss
        b = _loss_and_backward(stock, batch).loss
    assert report.calls[("cross_entropy", "fused")] >= 1 and casts == [torch.float32]  # the master weight went in
    ref = copy.deepcopy(stock)
    _loss_and_backward(ref, batch)  # fp32
    g_fast, g_stock, g_ref = (m.lm_head.weight.grad for m in (fast, stock, ref))
    assert g_fast.dtype == torch.float32 and not torch.equal(g_fast, g_fast.bfloat16().float())
    assert abs(float(a) - float(b)) <= 1e-2 * abs(float(b))
    err = lambda g: float((g.double() - g_ref.double()).norm() / g_ref.double().norm())  # noqa: E731
    assert err(g_fast) <= 2 * err(g_stock) + 1e-3, (err(g_fast), err(g_stock))


# -- where fasttune differs from stock on purpose ---------------------------------------------------
def test_all_ignored_batch_gives_zero_loss_and_warns_once(caplog):
    """Stock's mean over zero labels is NaN; the fused head gives 0.0 with zero gradients, and says
    once (per head) that such a batch usually means truncation cut every completion."""
    stock = tiny_model("llama", vocab_size=1000)
    fast = copy.deepcopy(stock)
    patch_model(fast, HEAD_ONLY)
    batch = make_batch(1000, seed=7)
    batch["labels"][:] = -100
    assert torch.isnan(stock(**batch).loss)
    with caplog.at_level("WARNING", logger="fasttune"):
        for _ in range(2):
            out = _loss_and_backward(fast, batch)
            assert out.loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in fast.parameters())
    warned = [r for r in caplog.records if "no label to learn from" in r.getMessage()]
    assert len(warned) == 1 and "truncation" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="fasttune"):
        _loss_and_backward(fast, make_batch(1000, seed=8))  # a normal batch: no warning
    assert not caplog.records


@pytest.mark.parametrize("training", [True, False], ids=["fused", "stock_head"])
@pytest.mark.parametrize("bad", [1003, -5])
def test_out_of_range_input_id_names_id_position_and_vocab(training, bad):
    from fasttune.model_patches.head import TokenIdError

    model = tiny_model("llama", vocab_size=1000)
    patch_model(model, HEAD_ONLY)
    model.train(training)
    batch = make_batch(1000, seed=9)
    batch["input_ids"][1, 5] = bad
    batch["input_ids"][1, 9] = 2000
    with pytest.raises(TokenIdError, match=rf"input_ids: token id {bad} at \(batch 1, position 5\) is outside the "
                                           r"embedding's 1000 rows \(valid ids 0\.\.999\); 2 id\(s\)") as info:
        model(**batch)
    assert isinstance(info.value, ValueError) and isinstance(info.value, IndexError)  # old `except IndexError` still works
    assert isinstance(info.value.__cause__, IndexError)  # the embedding's own error is kept as the cause


def test_other_index_errors_pass_through_unchanged():
    """An IndexError that is not about input ids (a label outside the vocab, in the stock head) is not rewritten."""
    model = tiny_model("llama", vocab_size=1000)
    patch_model(model, HEAD_ONLY)
    model.eval()
    batch = make_batch(1000, seed=10)
    batch["labels"][0, 3] = 5000
    with pytest.raises(IndexError) as info:
        model(**batch)
    assert "input_ids" not in str(info.value)


def test_head_workspace_takes_the_layers_graph_pool_only_on_its_device():
    """With CUDA graphs of the checkpointed layers, the head's workspace goes to their idle pool
    (``_idle_graph_pool``; the CUDA run: test_forward_graphs.py); without graphs, or where the head runs on
    another device than the graphs' stream (a model split over GPUs), nowhere but the main pool."""
    from types import SimpleNamespace

    from fasttune.model_patches.checkpointing import layer_checkpointing

    model = tiny_model("llama", dtype=torch.float32, seed=0)
    patch_model(model, FastConfig(checkpointing="offload"))
    head, state = head_forward(model), layer_checkpointing(model)
    assert state.graphs is None and head._idle_graph_pool(torch.device("cuda", 0)) == (None, None)
    pool, stream = object(), SimpleNamespace(device=torch.device("cuda", 0))
    state.graphs = SimpleNamespace(scratch=(pool, stream))
    assert head._idle_graph_pool(torch.device("cuda", 0)) == (pool, stream)
    assert head._idle_graph_pool(torch.device("cuda", 1)) == (None, None)
    assert head._idle_graph_pool(torch.device("cpu")) == (None, None)
    state.graphs = SimpleNamespace(scratch=(None, None))  # nothing captured yet
    assert head._idle_graph_pool(torch.device("cuda", 0)) == (None, None)
