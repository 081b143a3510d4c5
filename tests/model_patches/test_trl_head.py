"""fasttune's answer to TRL's fused-LM-head protocol: every field against float64 and against TRL's
own head (``trl.trainer.utils.add_fused_lm_head``), gradients included, at a temperature ≠ 1, with a
soft-cap and a logit scale; and who answers when (configured, unconfigured, callback order)."""

import copy

import pytest
import torch

from fasttune import FastConfig, patch_model, patch_report, unpatch_model
from fasttune.model_patches.head import TrlHeadSettings, configure_trl_head, head_forward, install_trl_head
from fasttune.model_patches.trl_head import FIELDS, fused_lm_head_fields, provides_fused_head
from helpers.compare import rel_err
from helpers.tiny_models import make_batch, tiny_model

HEAD_ONLY = FastConfig(rms_norm=False, rope=False, mlp=False, lora=False)
RTOL = 1e-5


def _trl_head():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    return add_fused_lm_head



def _ref_fields(hidden, weight, labels, T, softcap=None, scale=None, bias=None):
    """float64 oracle: every TRL field over flat rows (0 where ignored)."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if scale is not None:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = z / T
    logp = torch.log_softmax(t, -1)
    mask = labels != -100
    y = labels.clamp(min=0)
    out = {
        "log_probs": logp.gather(-1, y[:, None]).squeeze(-1),
        "entropy": -(logp.exp() * logp).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * logp, -1),
        "mean_logits": t.mean(-1),
        "is_top1": t.argmax(-1) == y,
    }
    return {k: v * mask if v.dtype != torch.bool else v & mask for k, v in out.items()}


@pytest.mark.parametrize("case", ["one_pass", "logprobs_softcap", "logprobs_temperature"])
def test_fields_match_float64(device, case):
    g = torch.Generator().manual_seed(0)
    N, D, V = 37, 24, 301
    hidden = torch.randn(N, D, generator=g).to(device).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.5).to(device).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.3] = -100
    labels = labels.to(device)
    softcap = 3.0 if case == "logprobs_softcap" else None
    T = 1.0 if case == "logprobs_softcap" else 0.7
    bias = torch.randn(V, generator=g).to(device) if case == "logprobs_temperature" else None
    # one_pass: SFT/DPO-style settings (entropy detached) → the cross-entropy kernel with stats.
    settings = TrlHeadSettings(T, FIELDS, entropy_grad=case != "one_pass")
    got = fused_lm_head_fields(hidden, labels, weight, bias, settings, softcap=softcap, logit_scale=0.9)
    ref = _ref_fields(hidden, weight, labels, T, softcap, 0.9, bias)
    for name in FIELDS:
        if name == "is_top1":
            assert torch.equal(got[name], ref[name])
        else:
            assert rel_err(got[name], ref[name]) <= 1e-5, name
    # Gradients of log_probs (and, where differentiable, entropy) against float64.
    up = torch.randn(N, generator=g, dtype=torch.float64).to(device)
    ue = torch.randn(N, generator=g, dtype=torch.float64).to(device)
    with_entropy = case != "one_pass"
    obj = (got["log_probs"].double() * up).sum() + ((got["entropy"].double() * ue).sum() if with_entropy else 0)
    dh, dw = torch.autograd.grad(obj, (hidden, weight))
    ref_obj = (ref["log_probs"] * up).sum() + ((ref["entropy"] * ue).sum() if with_entropy else 0)
    rh, rw = torch.autograd.grad(ref_obj, (hidden, weight))
    assert rel_err(dh, rh) <= 1e-5 and rel_err(dw, rw) <= 1e-5
    if not with_entropy:
        assert not got["entropy"].requires_grad


def test_no_labelled_row_gives_connected_zeros(device):
    hidden = torch.randn(5, 8, device=device, requires_grad=True)
    weight = torch.randn(11, 8, device=device)
    labels = torch.full((5,), -100, device=device)
    got = fused_lm_head_fields(hidden, labels, weight, None, TrlHeadSettings(0.5, ("entropy", "mean_logits")))
    assert not got["log_probs"].any() and not got["entropy"].any() and got["is_top1"] is None
    got["log_probs"].sum().backward()
    assert hidden.grad is not None and not hidden.grad.any()


def test_settings_validate():
    with pytest.raises(ValueError, match="temperature"):
        TrlHeadSettings(0.0)
    with pytest.raises(ValueError, match="outputs"):
        TrlHeadSettings(1.0, ("log_probs", "logits"))
    assert TrlHeadSettings(1, ("entropy",)).outputs == ("log_probs", "entropy")


DPO_WPO = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
GRPO = ("log_probs", "entropy")


@pytest.mark.parametrize("case", [
    dict(family="llama", vocab=70_001, T=1.0, outputs=DPO_WPO, entropy_grad=False),  # DPO + WPO, V > 65,536
    dict(family="gemma2", T=0.7, outputs=GRPO, entropy_grad=True),  # GRPO at T=0.7, soft-capped family
    dict(family="granite", T=0.7, outputs=DPO_WPO[:4], entropy_grad=False),  # logit scaling, T folded in
    dict(family="llama", T=0.7, outputs=GRPO, entropy_grad=True, shift=True),  # pre-shifted labels (CP)
    dict(family="qwen2", T=0.7, outputs=GRPO, entropy_grad=True, fp32_head=True),  # cast_lm_head_to_fp32
], ids=["dpo-wpo-bigvocab", "grpo-softcap", "granite-scale", "shift-labels", "fp32-head-autocast"])
def test_head_matches_trls_own_head(case, device):
    """fasttune's head over TRL's (Fast*Trainer order) vs TRL's head: fields and gradients."""
    T, outputs, grad_ent, fp32 = case["T"], case["outputs"], case["entropy_grad"], case.get("fp32_head", False)
    stock = tiny_model(case["family"], vocab_size=case.get("vocab", 1_003)).to(device)
    _trl_head()(stock, temperature=T, outputs=outputs, cast_lm_head_to_fp32=fp32)
    fast = copy.deepcopy(stock)
    patch_model(fast, HEAD_ONLY)
    assert provides_fused_head(head_forward(fast).stock)
    assert configure_trl_head(fast, TrlHeadSettings(T, outputs, entropy_grad=grad_ent, fp32_head=fp32))
    batch = make_batch(stock.config.vocab_size, seed=7, device=device)
    if case.get("shift"):
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    # GRPO's cast_lm_head_to_fp32 matters under autocast: the backbone in bf16, the head in fp32.
    ctx = torch.autocast(device, dtype=torch.bfloat16, enabled=fp32)
    with ctx:
        a, b = fast(**batch, fused_lm_head=True), stock(**batch, fused_lm_head=True)
    assert torch.equal(a.label_mask, b.label_mask)
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if name not in outputs:
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x, y) if name == "is_top1" else rel_err(x, y) <= RTOL, name
    assert rel_err(a.loss, b.loss) <= RTOL
    up = torch.randn_like(b.log_probs)
    for model, out in ((fast, a), (stock, b)):
        obj = (out.log_probs * up).sum() + out.loss + (0.3 * out.entropy.sum() if grad_ent else 0)
        obj.backward()
    for (name, p), q in zip(fast.named_parameters(), stock.parameters()):
        assert rel_err(p.grad, q.grad) <= RTOL, name


def test_bf16_fields_within_twice_torchs_error(device):
    """bf16 inputs: |fasttune − ref64| ≤ 2·|torch bf16 − ref64| + atol (norms over the rows)."""
    g = torch.Generator().manual_seed(3)
    N, D, V = 53, 64, 70_001
    hidden = torch.randn(N, D, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(V, D, generator=g) * 0.3).to(device, torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=g).to(device)
    labels[::4] = -100
    got = fused_lm_head_fields(hidden, labels, weight, None, TrlHeadSettings(0.7, FIELDS[:4]))
    ref = _ref_fields(hidden, weight, labels, 0.7)
    mask = labels != -100
    t = (hidden @ weight.t()).float() / 0.7  # what torch gives from bf16 logits
    logp = torch.log_softmax(t, -1)
    same_dtype = {"log_probs": logp.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1) * mask,
                  "entropy": -(logp.exp() * logp).sum(-1) * mask, "mean_logits": t.mean(-1) * mask,
                  "log_sum_sq_probs": torch.logsumexp(2 * logp, -1) * mask}
    for name, torch_value in same_dtype.items():
        err = (got[name].double() - ref[name]).norm()
        assert err <= 2 * (torch_value.double() - ref[name]).norm() + 1e-3 * ref[name].norm(), name


def test_unconfigured_head_leaves_trls_head_answering(caplog):
    """Patched after TRL but never told TRL's temperature: TRL's head answers (never a guess)."""
    stock = tiny_model("llama", vocab_size=501)
    _trl_head()(stock, temperature=0.5)
    fast = copy.deepcopy(stock)
    patch_model(fast, HEAD_ONLY)
    batch = make_batch(stock.config.vocab_size, seed=8)
    with caplog.at_level("WARNING", logger="fasttune"):
        a = fast(**batch, fused_lm_head=True)
    assert "TRL's own fused LM head" in caplog.text
    assert torch.equal(a.log_probs, stock(**batch, fused_lm_head=True).log_probs)


def test_install_over_trls_head_and_undo():
    """Callback order: patch, then TRL wraps our head; installing puts a configured head on top."""
    model = tiny_model("llama", vocab_size=501)
    patch_model(model, HEAD_ONLY)
    _trl_head()(model, temperature=0.5, outputs=("log_probs", "entropy"))
    trl_forward = model.__dict__["forward"]
    assert head_forward(model) is None and provides_fused_head(trl_forward)
    settings = TrlHeadSettings(0.5, ("log_probs", "entropy"))
    assert install_trl_head(model, settings, HEAD_ONLY, patch_report(model))
    head = head_forward(model)
    assert head.stock is trl_forward and head.trl_settings is settings
    assert install_trl_head(model, settings, HEAD_ONLY, patch_report(model))  # idempotent
    assert head_forward(model) is head
    batch = make_batch(model.config.vocab_size, seed=9)
    a = model(**batch, fused_lm_head=True)
    b = trl_forward(**batch, fused_lm_head=True)
    assert rel_err(a.log_probs, b.log_probs) <= RTOL and rel_err(a.entropy, b.entropy) <= RTOL
    unpatch_model(model)
    assert model.__dict__["forward"] is trl_forward


def test_install_refuses_a_model_whose_head_was_not_patched():
    model = tiny_model("llama", vocab_size=501)
    report = patch_model(model, FastConfig(cross_entropy=False, rms_norm=False, rope=False, mlp=False, lora=False))
    _trl_head()(model)
    assert not install_trl_head(model, TrlHeadSettings(), HEAD_ONLY, report)
    assert head_forward(model) is None
