"""Fused linear cross-entropy and plain cross-entropy vs float64 math and the same-dtype reference:
the loss, the stats and every gradient (hidden, weight, bias), each feature alone and combined.

Errors are relative Frobenius norms (float64): a GEMM's rounding spreads over every element, so an
elementwise "2x torch" bound would fail wherever torch happens to be exact by chance.
fp32: ≤ 1e-5 against the float64 reference and against the fp32 reference.
bf16/fp16: ‖kernel − ref64‖ ≤ 2·‖torch_same_dtype − ref64‖ + 1 ulp·‖ref64‖, where torch_same_dtype
is the Hugging Face recipe (F.linear in the low dtype, loss in fp32) and the ulp covers the
interpreter's truncating fp32→bf16 stores of dX.
"""

import importlib

import pytest
import torch

from fasttune.kernels import _lce_common as common
from fasttune.kernels import reference
from fasttune.kernels.cross_entropy import cross_entropy, fused_linear_cross_entropy

from helpers.kernel_checks import check_in_norm
from helpers.compare import make_head_inputs as make_inputs

# The module, by path: the package attribute `fasttune.kernels.cross_entropy` names the function too.
ce_mod = importlib.import_module("fasttune.kernels.cross_entropy")
IGN = -100


def run(fn, h, W, b, y, upstream, frozen_w=False, **kw):
    """(loss, stats or None, [grad_h, grad_W, grad_b]) of fn on fresh leaves, backward of Σ loss·upstream."""
    hl = h.detach().clone().requires_grad_()
    wl = W.detach().clone().requires_grad_(not frozen_w)
    bl = None if b is None else b.detach().clone().requires_grad_()
    out = fn(hl, wl, y, bl, **kw)
    loss, stats = out if kw.get("return_stats") else (out, None)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return loss.detach(), stats, [hl.grad, wl.grad, None if bl is None else bl.grad]


def ref_fn(h, W, y, b, workspace_mib=None, **kw):
    return reference.fused_linear_cross_entropy(h, W, y, b, **kw)


def loss_from_logits(x, y, reduction="mean", num_items_in_batch=None, label_smoothing=0.0, softcap=None,
                     logit_scale=None, z_loss=0.0, return_stats=False):
    """The loss of given logits in fp32 by autograd, written from the spec (an oracle independent of
    the kernel's formulas)."""
    z = x.float()
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = y != IGN
    lse = z.logsumexp(-1)
    z_y = z.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    eps = label_smoothing
    loss = torch.where(valid, (1 - eps) * (lse - z_y) + eps * (lse - z.mean(-1)) + z_loss * lse ** 2, 0.0)
    if reduction != "none":
        den = valid.sum().clamp(min=1) if reduction == "mean" else 1
        loss = loss.sum() / (den if num_items_in_batch is None else num_items_in_batch)
    if not return_stats:
        return loss
    logp = z.detach().log_softmax(-1)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    return loss, {"entropy": ent, "correct": (z.argmax(-1) == y) & valid}


def lowp_torch_fn(h, W, y, b, workspace_mib=None, **kw):
    """The Hugging Face recipe: logits from F.linear in the input dtype, the loss in fp32."""
    return loss_from_logits(torch.nn.functional.linear(h, W, b), y, **kw)


def upstream_for(kw, N, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(N, generator=g) + 0.5 if kw.get("reduction") == "none" else torch.tensor(0.75)
    return u.to(device)


def compare(device, dtype, N, D, V, bias=False, ignore_frac=0.2, frozen_w=False, seed=0, int32_labels=False,
            **kw):
    h, W, b, y = make_inputs(device, N, D, V, dtype, bias, ignore_frac, seed)
    y = y.int() if int32_labels else y
    up = upstream_for(kw, N, device)
    loss, stats, grads = run(fused_linear_cross_entropy, h, W, b, y, up, frozen_w, **kw)
    assert loss.dtype == torch.float32
    d64 = lambda t: None if t is None else t.double()  # noqa: E731
    loss64, stats64, grads64 = run(ref_fn, d64(h), d64(W), d64(b), y, up.double(), frozen_w, **kw)
    if frozen_w:
        assert grads[1] is None, "a frozen weight must get no gradient"
    names = ["loss", "grad_hidden", "grad_weight", "grad_bias"]
    pairs = [(loss, loss64)] + list(zip(grads, grads64))
    if dtype == torch.float32:
        loss32, stats32, grads32 = run(ref_fn, h, W, b, y, up, frozen_w, **kw)
        for name, (got, want), same in zip(names, pairs, [loss32] + grads32):
            if want is not None:
                assert got.dtype == (torch.float32 if name == "loss" else dtype), name
                check_in_norm(got, want, what=name + " vs float64")
                check_in_norm(got, same, what=name + " vs fp32 reference")
    else:
        lossl, statsl, gradsl = run(lowp_torch_fn, h, W, b, y, up, frozen_w, **kw)
        for name, (got, want), same in zip(names, pairs, [lossl] + gradsl):
            if want is not None:
                assert got.dtype == (torch.float32 if name == "loss" else dtype), name
                check_in_norm(got, want, same, what=name, lowp=dtype)
    if stats is not None:
        valid = y != IGN
        assert stats["entropy"].dtype == torch.float32 and stats["correct"].dtype == torch.bool
        assert (stats["entropy"][~valid] == 0).all() and not stats["correct"][~valid].any()
        if dtype == torch.float32:
            check_in_norm(stats["entropy"], stats64["entropy"], what="entropy")
            assert torch.equal(stats["correct"], stats64["correct"])
        else:
            check_in_norm(stats["entropy"], stats64["entropy"], statsl["entropy"], what="entropy", lowp=dtype)
            # argmax of rounded logits may differ only where the top two are within rounding error.
            z = torch.nn.functional.linear(d64(h), d64(W), d64(b)).float()
            top2 = z.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.1
            assert torch.equal(stats["correct"][clear], stats64["correct"][clear])
    return loss, grads


FP32_CASES = {
    "mean": dict(),
    "sum+smoothing+softcap+scale+zloss": dict(reduction="sum", label_smoothing=0.1, softcap=2.5,
                                              logit_scale=0.8, z_loss=1e-3),
    "none+bias+stats(recompute)": dict(reduction="none", bias=True, return_stats=True, softcap=4.0),
    "none+frozen+stats(TRL)": dict(reduction="none", frozen_w=True, return_stats=True, logit_scale=1.3),
    "mean+bias+smoothing+tiny-workspace": dict(bias=True, label_smoothing=0.2, workspace_mib=0.004, N=77),
    "num_items-int": dict(num_items_in_batch=37, z_loss=1e-2),
    "num_items-tensor+sum+softcap": dict(reduction="sum", num_items_in_batch=torch.tensor(29), softcap=1.5),
    "no-ignored+stats": dict(ignore_frac=0.0, return_stats=True, label_smoothing=0.05),
    "frozen+mean+scale+int32-labels": dict(frozen_w=True, logit_scale=0.5, int32_labels=True),
}


@pytest.mark.parametrize("case", list(FP32_CASES))
def test_fp32_matches_reference(device, case):
    kw = dict(FP32_CASES[case])
    kw.setdefault("N", 37)
    if isinstance(kw.get("num_items_in_batch"), torch.Tensor):
        kw["num_items_in_batch"] = kw["num_items_in_batch"].to(device)
    compare(device, torch.float32, D=40, V=389, **kw)


LOWP_CASES = {
    "mean+softcap+smoothing": dict(softcap=3.0, label_smoothing=0.1),
    "none+frozen+stats": dict(reduction="none", frozen_w=True, return_stats=True),
    "sum+bias+zloss+tiny-workspace": dict(reduction="sum", bias=True, z_loss=1e-3, workspace_mib=0.01),
    "none+bias(recompute)": dict(reduction="none", bias=True, logit_scale=0.7),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(LOWP_CASES))
def test_low_precision_within_twice_torch_error(device, dtype, case):
    compare(device, dtype, N=41, D=72, V=301, **LOWP_CASES[case])


def test_fp16_tiny_probabilities_survive(device):
    """fp16 dX would underflow for p_j / n_tokens (a GradScaler's factor only arrives in backward):
    the kernel pre-scales it, so a mean over 16K tokens under a loss scale keeps torch's precision."""
    h, W, _, y = make_inputs(device, 41, 72, 301, torch.float16, seed=4)
    up, kw = torch.tensor(2.0 ** 14, device=device), dict(num_items_in_batch=2 ** 14)
    loss, _, grads = run(fused_linear_cross_entropy, h, W, None, y, up, **kw)
    _, _, grads64 = run(ref_fn, h.double(), W.double(), None, y, up.double(), **kw)
    _, _, gradsl = run(lowp_torch_fn, h, W, None, y, up, **kw)
    for name, got, want, same in zip(["grad_hidden", "grad_weight"], grads, grads64, gradsl):
        check_in_norm(got, want, same, what=name, lowp=torch.float16)


def test_large_vocab(device):
    """V > 65,536 (one program streams many blocks; offsets past 2^16)."""
    compare(device, torch.float32, N=6, D=16, V=65_539, softcap=5.0, return_stats=True, ignore_frac=0.3)


def test_hidden_frozen_weight_trainable(device):
    h, W, b, y = make_inputs(device, 29, 40, 203, bias=True)
    wl, bl = W.clone().requires_grad_(), b.clone().requires_grad_()
    fused_linear_cross_entropy(h, wl, y, bl, reduction="sum").backward()
    w64, b64 = W.double().requires_grad_(), b.double().requires_grad_()
    reference.fused_linear_cross_entropy(h.double(), w64, y, b64, reduction="sum").backward()
    check_in_norm(wl.grad, w64.grad, what="grad_weight")
    check_in_norm(bl.grad, b64.grad, what="grad_bias")


def test_non_contiguous_inputs(device):
    h, W, _, y = make_inputs(device, 33, 40, 203)
    ht = h.t().contiguous().t().requires_grad_()  # column-major views
    wt = W.t().contiguous().t().requires_grad_()
    assert not ht.is_contiguous() and not wt.is_contiguous()
    fused_linear_cross_entropy(ht, wt, y, label_smoothing=0.1).backward()
    want = run(fused_linear_cross_entropy, h, W, None, y, torch.tensor(1.0), label_smoothing=0.1)
    check_in_norm(ht.grad, want[2][0], what="grad_hidden", rtol=1e-6)
    check_in_norm(wt.grad, want[2][1], what="grad_weight", rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_weight_does_no_weight_gradient_work(device, monkeypatch, reduction):
    calls = []
    real = common.addmm_fp32_
    monkeypatch.setattr(common, "addmm_fp32_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    h, W, _, y = make_inputs(device, 37, 40, 211)
    up = upstream_for(dict(reduction=reduction), 37, device)
    _, _, grads = run(fused_linear_cross_entropy, h, W, None, y, up, frozen_w=True, reduction=reduction,
                      workspace_mib=0.02)
    assert grads[1] is None and grads[0] is not None and not calls
    _, _, grads = run(fused_linear_cross_entropy, h, W, None, y, up, reduction=reduction, workspace_mib=0.02)
    assert grads[1] is not None and len(calls) >= 2  # the spy does see dW work when W trains


def test_tiny_workspace_runs_several_chunks(device, monkeypatch):
    launches = []
    real = ce_mod._launch
    monkeypatch.setattr(ce_mod, "_launch", lambda *a, **k: (launches.append(a[1].shape[0]), real(*a, **k))[1])
    h, W, _, y = make_inputs(device, 83, 40, 389)
    one = run(fused_linear_cross_entropy, h, W, None, y, torch.tensor(1.0))
    assert len(launches) == 1
    many = run(fused_linear_cross_entropy, h, W, None, y, torch.tensor(1.0), workspace_mib=0.03)
    assert len(launches) >= 4 and max(launches[1:]) <= 0.03 * 2 ** 20 // (389 * 4)  # rows within budget
    for a, b in zip([one[0]] + one[2][:2], [many[0]] + many[2][:2]):
        check_in_norm(b, a, what="chunked vs single chunk", rtol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum"), dict(num_items_in_batch=0),
                                dict(num_items_in_batch=torch.tensor(0)), dict(reduction="none"),
                                dict(return_stats=True, label_smoothing=0.1, z_loss=1e-3)],
                         ids=["mean", "sum", "num_items=0", "num_items=tensor(0)", "none", "stats"])
def test_all_ignored_gives_zero_loss_and_zero_grads(device, kw):
    h, W, b, y = make_inputs(device, 21, 40, 97, bias=True)
    y = torch.full_like(y, IGN)
    if isinstance(kw.get("num_items_in_batch"), torch.Tensor):
        kw = dict(kw, num_items_in_batch=kw["num_items_in_batch"].to(device))
    loss, stats, grads = run(fused_linear_cross_entropy, h, W, b, y, torch.tensor(1.0, device=device), **kw)
    assert torch.isfinite(loss).all() and (loss == 0).all()
    for g in grads:
        assert g is not None and torch.isfinite(g).all() and (g == 0).all()
    if stats is not None:
        assert (stats["entropy"] == 0).all() and not stats["correct"].any()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_empty_input(device, reduction):
    h, W, b, y = make_inputs(device, 0, 40, 97, bias=True)
    loss, stats, grads = run(fused_linear_cross_entropy, h, W, b, y, torch.tensor(1.0, device=device),
                             reduction=reduction, return_stats=True)
    assert loss.shape == (() if reduction == "mean" else (0,)) and (loss == 0).all()
    assert stats["entropy"].shape == (0,) and grads[0].shape == (0, 40)
    assert (grads[1] == 0).all() and (grads[2] == 0).all()


def test_double_backward_and_second_backward_raise(device):
    h, W, _, y = make_inputs(device, 19, 40, 97)
    hl = h.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(fused_linear_cross_entropy(hl, W, y), hl, create_graph=True)
    loss = fused_linear_cross_entropy(hl, W, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_reference_path_dispatch(device, monkeypatch):
    """Where Triton cannot run, the public functions fall back to plain PyTorch, same numbers."""
    h, W, b, y = make_inputs(device, 31, 40, 211, bias=True)
    kw = dict(reduction="sum", softcap=3.0, num_items_in_batch=0, label_smoothing=0.1)
    want = run(fused_linear_cross_entropy, h, W, b, y, torch.tensor(1.0), **kw)
    logits = torch.randn(31, 211, device=device, requires_grad=True)
    want_plain = cross_entropy(logits, y, z_loss=1e-3)
    monkeypatch.setattr(ce_mod, "use_triton", lambda *t: False)
    got = run(fused_linear_cross_entropy, h, W, b, y, torch.tensor(1.0), **kw)
    for a, e in zip([got[0]] + got[2], [want[0]] + want[2]):
        assert a.shape == e.shape and a.dtype == e.dtype
        check_in_norm(a, e, what="reference path")
    plain = cross_entropy(logits, y, z_loss=1e-3)
    assert plain.shape == want_plain.shape
    check_in_norm(plain, want_plain, what="plain reference path")


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kw", [dict(bias=True, softcap=3.0, workspace_mib=0.004),
                                dict(reduction="none", bias=True, return_stats=True)], ids=["mean", "none(recompute)"])
def test_fp32_master_weight_under_half_hidden(device, monkeypatch, path, dtype, kw):
    """Autocast over fp32 master weights: an fp32 W (and bias) with bf16/fp16 hidden. The products read W's
    16-bit values, so loss, stats and dH equal those of the same call on W.to(dtype) bit for bit; dW comes back
    in fp32, the accumulator unrounded (on the Triton path, rounded to dtype it is that call's dW), closer to
    float64 than the stock autocast recipe's (dW rounded to dtype, then upcast)."""
    if path == "reference":
        monkeypatch.setattr(ce_mod, "use_triton", lambda *t: False)
    kw = dict(kw)
    h, W, b, y = make_inputs(device, 45, 64, 331, torch.float32, kw.pop("bias"), 0.2, seed=3)
    h = h.to(dtype)
    up = upstream_for(kw, 45, device)
    loss, stats, (gh, gw, gb) = run(fused_linear_cross_entropy, h, W, b, y, up, **kw)
    same = run(fused_linear_cross_entropy, h, W.to(dtype), b.to(dtype), y, up, **kw)
    assert gh.dtype == dtype and gw.dtype == torch.float32 and gb.dtype == torch.float32
    assert torch.equal(loss, same[0]) and torch.equal(gh, same[2][0])
    if stats is not None:
        assert all(torch.equal(stats[k], same[1][k]) for k in stats)
    if path == "triton":  # one accumulator either way (the reference's 16-bit W gradient rounds per chunk)
        assert torch.equal(gw.to(dtype), same[2][1]) and torch.equal(gb.to(dtype), same[2][2])
    assert not torch.equal(gw, gw.to(dtype).float())  # fp32 values: the accumulator, not a rounded copy

    def stock(hl, wl, yl, bl, workspace_mib=None, **k):  # autocast's cast inside autograd, as HF runs it
        return loss_from_logits(torch.nn.functional.linear(hl, wl.to(dtype), bl.to(dtype)), yl, **k)

    d64 = lambda t: t.to(dtype).double()  # noqa: E731 - float64 math on the values the products read
    _, _, want = run(ref_fn, h.double(), d64(W), d64(b), y, up.double(), **kw)
    _, _, torch_grads = run(stock, h, W, b, y, up, **kw)
    for name, got, ref, tg in zip(("dW", "db"), (gw, gb), want[1:], torch_grads[1:]):
        check_in_norm(got, ref, tg, what=name, lowp=dtype)
        if path == "reference" or device == "cuda":  # the interpreter truncates dX's 16-bit stores (FACTS)
            assert (got.double() - ref).norm() <= (tg.double() - ref).norm(), name  # no final rounding to dtype


# ------------------------------------------------------------------------------------------------
# plain cross_entropy on logits
# ------------------------------------------------------------------------------------------------

PLAIN_CASES = {
    "mean": dict(),
    "sum+smoothing+softcap+zloss": dict(reduction="sum", label_smoothing=0.1, softcap=3.0, z_loss=1e-3),
    "none": dict(reduction="none"),
    "num_items": dict(num_items_in_batch=17),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_plain_cross_entropy(device, dtype, case):
    kw = PLAIN_CASES[case]
    N, V = 29, 317
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(N, V, generator=g) * 3).to(device=device, dtype=dtype)
    y = torch.randint(0, V, (N,), generator=g).to(device)
    y[::4] = IGN
    up = upstream_for(kw, N, device)
    before = logits.clone()
    got, _, (gx, _, _) = run(lambda x, _w, t, _b, **k: cross_entropy(x, t, **k), logits, logits, None, y, up,
                             frozen_w=True, **kw)
    assert torch.equal(logits, before), "cross_entropy must not write its input logits"
    eye = torch.eye(V, dtype=torch.float64, device=device)
    want, _, (gx64, _, _) = run(ref_fn, logits.double(), eye, None, y, up.double(), frozen_w=True, **kw)
    if dtype == torch.float32:
        check_in_norm(got, want, what="loss")
        check_in_norm(gx, gx64, what="grad_logits")
        if case in ("mean", "none"):  # torch's own op agrees too
            ref = torch.nn.functional.cross_entropy(logits, y, reduction=kw.get("reduction", "mean"))
            check_in_norm(got, ref, what="loss vs F.cross_entropy")
    else:
        same, _, (gxs, _, _) = run(lambda x, _w, t, _b, **k: loss_from_logits(x, t, **k), logits, logits, None,
                                   y, up, frozen_w=True, **kw)
        check_in_norm(got, want, same, what="loss", lowp=dtype)
        check_in_norm(gx, gx64, gxs, what="grad_logits", lowp=dtype)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------

BAD = {
    "hidden-1d": (lambda h, W, y: dict(hidden=h[0]), ValueError, "hidden"),
    "D-mismatch": (lambda h, W, y: dict(weight=W[:, :-1]), ValueError, "disagree on D"),
    "labels-length": (lambda h, W, y: dict(labels=y[:-1]), ValueError, "labels"),
    "labels-float": (lambda h, W, y: dict(labels=y.float()), TypeError, "labels"),
    "label-too-big": (lambda h, W, y: dict(labels=torch.full_like(y, W.shape[0])), ValueError, "labels"),
    "label-negative": (lambda h, W, y: dict(labels=torch.full_like(y, -3)), ValueError, "labels"),
    "dtype-mismatch": (lambda h, W, y: dict(weight=W.double()), TypeError, "weight"),
    "float64": (lambda h, W, y: dict(hidden=h.double(), weight=W.double()), TypeError, "hidden"),
    "bias-shape": (lambda h, W, y: dict(bias=torch.zeros(3, device=h.device)), ValueError, "bias"),
    "bias-dtype": (lambda h, W, y: dict(bias=torch.zeros(W.shape[0], device=h.device).half()), TypeError, "bias"),
    "reduction": (lambda h, W, y: dict(reduction="avg"), ValueError, "reduction"),
    "softcap-zero": (lambda h, W, y: dict(softcap=0.0), ValueError, "softcap"),
    "softcap-negative": (lambda h, W, y: dict(softcap=-30.0), ValueError, "softcap"),
    "smoothing": (lambda h, W, y: dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    "z_loss": (lambda h, W, y: dict(z_loss=-1.0), ValueError, "z_loss"),
    "workspace": (lambda h, W, y: dict(workspace_mib=0), ValueError, "workspace_mib"),
    "num_items": (lambda h, W, y: dict(num_items_in_batch=-2), ValueError, "num_items_in_batch"),
    "device": (lambda h, W, y: dict(labels=y.to("meta")), ValueError, "labels"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_argument(device, case):
    h, W, _, y = make_inputs(device, 7, 16, 23)
    change, exc, name = BAD[case]
    args = dict(hidden=h, weight=W, labels=y)
    args.update(change(h, W, y))
    with pytest.raises(exc, match=name):
        fused_linear_cross_entropy(**args)


def test_plain_bad_input(device):
    x = torch.randn(5, 11, device=device)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(x, torch.full((5,), 11, device=device))
    with pytest.raises(TypeError, match="logits"):
        cross_entropy(x.double(), torch.zeros(5, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy(x, torch.zeros(5, dtype=torch.long, device=device), softcap=0)


# ------------------------------------------------------------------------------------------------
# GPU, real sizes (the lead runs these on the H200)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("frozen", [False, True])
def test_gpu_llama3_head_bf16(softcap, frozen):
    N, D, V = 4096, 4096, 128256
    h, W, _, y = make_inputs("cuda", N, D, V, torch.bfloat16, ignore_frac=0.05, seed=5)
    loss, _, grads = run(fused_linear_cross_entropy, h, W, None, y, torch.tensor(1.0, device="cuda"),
                         frozen_w=frozen, softcap=softcap)
    loss32, _, grads32 = run(ref_fn, h.float(), W.float(), None, y, torch.tensor(1.0, device="cuda"),
                             frozen_w=frozen, softcap=softcap)
    lossl, _, gradsl = run(lowp_torch_fn, h, W, None, y, torch.tensor(1.0, device="cuda"),
                           frozen_w=frozen, softcap=softcap)
    for name, got, want, same in zip(["loss", "grad_hidden", "grad_weight"], [loss] + grads[:2],
                                     [loss32] + grads32[:2], [lossl] + gradsl[:2]):
        if want is None:
            assert got is None
            continue
        check_in_norm(got, want, what=name + " vs fp32 reference", rtol=1e-2)  # sanity; the bench reports it
        check_in_norm(got, want, same, what=name, lowp=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_workspace_past_int32_offsets():
    """One chunk of 17,000 × 128,256 logits (> 2^31 elements): int64 row offsets."""
    N, D, V = 17_000, 64, 128_256
    h, W, _, y = make_inputs("cuda", N, D, V, torch.bfloat16, ignore_frac=0.0, seed=6)
    big = run(fused_linear_cross_entropy, h, W, None, y, torch.tensor(1.0, device="cuda"), workspace_mib=5000)
    small = run(fused_linear_cross_entropy, h, W, None, y, torch.tensor(1.0, device="cuda"), workspace_mib=256)
    for a, b in zip([big[0]] + big[2][:2], [small[0]] + small[2][:2]):
        check_in_norm(a, b, what="one chunk vs several", rtol=1e-3)


@pytest.mark.gpu
def test_gpu_fp32_master_weight_backward_allocates_no_weight_gradient_copy():
    """Llama-3 head, fp32 W with bf16 hidden: the dW the forward accumulated is handed over as the gradient,
    so the backward allocates nothing W-sized (stock autocast's bf16 dW and its fp32 upcast: 3 GiB); rounded
    to bf16 it is the bf16-W call's dW bit for bit."""
    N, D, V = 4096, 4096, 128256
    h, W, _, y = make_inputs("cuda", N, D, V, torch.float32, ignore_frac=0.05, seed=7)
    h = h.bfloat16().requires_grad_()
    W = W.requires_grad_()
    loss = fused_linear_cross_entropy(h, W, y)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    assert W.grad.dtype == torch.float32
    assert torch.cuda.max_memory_allocated() - before < 64 * 2 ** 20  # nothing dW-sized (2 GiB fp32) is made
    _, _, same = run(fused_linear_cross_entropy, h, W.detach().bfloat16(), None, y, torch.tensor(1.0, device="cuda"))
    assert torch.equal(W.grad.bfloat16(), same[1])
