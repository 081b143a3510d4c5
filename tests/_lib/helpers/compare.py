"""Comparisons shared by parity tests: relative errors of losses and of every trainable gradient."""

from __future__ import annotations

import copy

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a − b|| / max(||b||, tiny), in float64 (Frobenius norm)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def grad_errors(model_a: torch.nn.Module, model_b: torch.nn.Module, floor: float = 0.0) -> dict[str, float]:
    """Parameter name → relative error of its gradient (a vs b); both models share names.

    ``floor`` > 0: errors are relative to at least ``floor`` × the largest gradient norm of b, for
    gradients that are zero in exact math and only rounding noise in both runs (a key bias under
    softmax attention without RoPE: it shifts every score of a query by the same amount)."""
    grads_b = {n: p.grad for n, p in model_b.named_parameters() if p.requires_grad}
    if floor > 0:
        scale = max((float(g.detach().double().norm()) for g in grads_b.values() if g is not None), default=0.0)
        out = {}
        for name, p in model_a.named_parameters():
            ga, gb = p.grad, grads_b.get(name)
            if p.requires_grad and ga is not None and gb is not None:
                diff = float((ga.detach().double() - gb.detach().double()).norm())
                out[name] = diff / max(float(gb.detach().double().norm()), floor * scale, 1e-30)
            elif p.requires_grad:
                out[name] = 0.0 if ga is None and gb is None else float("inf")
        return out
    out = {}
    for name, p in model_a.named_parameters():
        if not p.requires_grad:
            continue
        ga, gb = p.grad, grads_b[name]
        if ga is None or gb is None:
            out[name] = 0.0 if ga is None and gb is None else float("inf")
            continue
        out[name] = rel_err(ga, gb) if gb.abs().max() > 0 else float(ga.abs().max())
    return out


def assert_grads_close(model_a, model_b, rtol: float, floor: float = 0.0) -> None:
    errs = grad_errors(model_a, model_b, floor)
    assert errs, "no trainable parameters compared"
    bad = {k: v for k, v in errs.items() if not v <= rtol}
    assert not bad, f"{len(bad)} gradients differ beyond {rtol}: {dict(list(bad.items())[:5])}"


def assert_same_steps(a: list, b: list) -> None:
    """Two runs' steps, each (loss, {name: gradient}), equal bit for bit."""
    assert len(a) == len(b)
    for i, ((la, ga), (lb, gb)) in enumerate(zip(a, b)):
        assert torch.equal(la, lb), (i, la, lb)
        assert ga.keys() == gb.keys() and ga
        bad = [n for n in ga if not torch.equal(ga[n], gb[n])]
        assert not bad, f"step {i}: gradients differ bitwise: {bad[:4]}"


def make_head_inputs(device, N: int, D: int, V: int, dtype=torch.float32, bias: bool = False,
                     ignore_frac: float = 0.2, seed: int = 0):
    """(hidden [N, D], weight [V, D], bias [V] or None, labels [N]) for the loss-head kernels;
    ~ignore_frac of the labels are -100. Fresh values per seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    h = torch.randn(N, D, **kw)
    W = torch.randn(V, D, **kw) * D ** -0.5 * 2
    b = torch.randn(V, **kw) * 0.5 if bias else None
    y = torch.randint(0, V, (N,), **kw)
    y[torch.rand(N, **kw) < ignore_frac] = -100
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(h), cast(W), cast(b), y


# Gradients judged against float64 instead of stock fp32: Qwen3.5's gated delta rule (transformers' own code,
# stock in both runs) sums cancelling terms into its decay parameters' gradients, so stock fp32 is itself
# 1e-5 to 5e-4 from float64 there (3 seeds measured) and any rounding change upstream moves them as much.
FP64_JUDGED = ("linear_attn.dt_bias", "linear_attn.A_log")


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy whose fp32 parameters are each moved by 0, +1 or -1 times 2^-24 of themselves (about half an ulp):
    what a different but equally valid rounding upstream does to what follows."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            if p.dtype == torch.float32:
                p.mul_(1 + torch.randint(-1, 2, p.shape, generator=g).to(p.device, torch.float32) * 2.0 ** -24)
    return twin


PERTURBED_RUNS = 4


def assert_grads_close_judging_ill_conditioned(fast, stock, rtol: float, rerun) -> None:
    """``assert_grads_close`` for every gradient but the ``FP64_JUDGED`` ones, which must be at least about
    as close to float64 as fp32 is: ``rerun(model)`` runs the same step on a float64 copy of stock, and on
    ``PERTURBED_RUNS`` fp32 copies of stock perturbed by half an ulp (``_perturbed``). fp32's error there is
    the largest of stock's and those copies' errors: stock's alone is one draw, and a lucky one (4.9e-6
    against a spread of 2e-6 to 7e-4 over seeds) failed a fasttune run at 1.9e-5 on one CPU."""
    errs = {n: e for n, e in grad_errors(fast, stock).items() if not n.endswith(FP64_JUDGED)}
    assert errs and max(errs.values()) <= rtol, {n: e for n, e in errs.items() if e > rtol}
    judged = [n for n, p in stock.named_parameters() if n.endswith(FP64_JUDGED) and p.grad is not None]
    if not judged:
        return
    exact = copy.deepcopy(stock).double()
    if callable(getattr(exact, "set_experts_implementation", None)):
        exact.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64
    rerun(exact)
    twins = [_perturbed(stock, seed) for seed in range(PERTURBED_RUNS)]
    for twin in twins:
        rerun(twin)
    ref, fast_p = dict(exact.named_parameters()), dict(fast.named_parameters())
    fp32_runs = [dict(m.named_parameters()) for m in (stock, *twins)]
    for name in judged:
        err_fast = rel_err(fast_p[name].grad, ref[name].grad)
        err_fp32 = [rel_err(run[name].grad, ref[name].grad) for run in fp32_runs]
        assert err_fast <= 2 * max(err_fp32) + 1e-6, (name, err_fast, err_fp32)
