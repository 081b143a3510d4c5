"""SwiGLU / GeGLU kernels vs float64 math and the same-dtype reference, output and both gradients.

fp32: within 1e-5 relative. bf16/fp16: |kernel − ref64| ≤ 2·|torch_same_dtype − ref64| + 1 ulp
elementwise (both compute in fp32 and round once; the ulp covers the interpreter's truncation).
Also: the in-place reuse of gate/up for their gradients, and when it must not happen.
"""

import pytest
import torch

from fasttune.kernels import reference
from fasttune.kernels.swiglu import geglu, swiglu

from helpers.kernel_checks import check_elementwise

# σ(x) = 1/(1 + exp(−x)) overflows exp to inf for x ≪ 0 in the interpreter's numpy: the result
# (0) is right, only numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

ACTS = {
    "silu": (swiglu, reference.swiglu),
    "gelu_tanh": (lambda g, u: geglu(g, u, "tanh"), lambda g, u: reference.geglu(g, u, "tanh")),
    "gelu": (lambda g, u: geglu(g, u, "none"), lambda g, u: reference.geglu(g, u, "none")),
}


def check(out, ref64, same, name):
    """fp32: within 1e-5 relative; else the 2×-torch rule + 1 ulp, elementwise."""
    lowp = None if out.dtype == torch.float32 else out.dtype
    check_elementwise(out, ref64, same, what=name, lowp=lowp, rtol=1e-5)


def run(fn, gate, up, dy):
    y = fn(gate, up)
    need = [t for t in (gate, up) if t.requires_grad]
    grads = iter(torch.autograd.grad(y, need, dy.to(y.dtype)))
    return [y] + [next(grads) if t.requires_grad else None for t in (gate, up)]


def compare(act, gate, up, dy, make=None):
    """make(gate, up) → the op's actual inputs (a non-leaf graph); default: the leaves as given."""
    fn, ref = ACTS[act]
    make = make or (lambda g, u: (g, u))
    d = lambda t: t.detach().double().requires_grad_(t.requires_grad)  # noqa: E731
    got = run(lambda g, u: fn(*make(g, u)), gate, up, dy)
    same = run(lambda g, u: ref(*make(g, u)), gate, up, dy)
    ref64 = run(lambda g, u: ref(*make(g, u)), d(gate), d(up), dy.to(got[0].dtype).double())
    for name, a, s, r in zip(["y", "dgate", "dup"], got, same, ref64):
        assert (a is None) == (r is None), name
        if a is not None:
            check(a, r, s, name)
    return got


def inputs(shape, dtype, device, up_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 2.5).to(device, dtype).requires_grad_()
    up = torch.randn(shape, generator=g).to(device, up_dtype or dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device)
    return gate, up, dy


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_matches(device, act, dtype):
    gate, up, dy = inputs((3, 7, 201), dtype, device)
    y = compare(act, gate, up, dy)[0]
    assert y.dtype == dtype


def test_extreme_gate_values(device):
    """tanh as 2σ(2x) − 1 and the sigmoid saturate cleanly: no NaN/inf at large |gate|."""
    gate = torch.tensor([[-90.0, -30.0, -8.0, -1e-4, 0.0, 1e-4, 8.0, 30.0, 90.0]], device=device).requires_grad_()
    up = torch.ones_like(gate).requires_grad_()
    for act in ACTS:
        compare(act, gate, up, torch.ones_like(gate))


def test_mixed_dtypes_and_one_grad(device):
    gate, up, dy = inputs((37, 129), torch.bfloat16, device, up_dtype=torch.float32)
    compare("silu", gate, up, dy)  # output in gate's dtype
    compare("gelu_tanh", gate.detach(), up, dy)
    compare("gelu", gate, up.detach(), dy)


def test_noncontiguous_layouts(device):
    g = torch.Generator().manual_seed(4)
    ga = torch.randn(37, 2 * 133, generator=g).to(device).requires_grad_()
    ub = torch.randn(37, 2 * 133, generator=g).to(device).requires_grad_()
    dy = torch.randn(133, 37, generator=g).to(device).t()  # strided gradient
    # halves of fused gate_up-like tensors (rows 266 apart, read in place)
    compare("silu", ga, ub, dy, make=lambda a, b: (a[:, :133], b[:, 133:]))
    gt = torch.randn(133, 37, generator=g).to(device).requires_grad_()
    # last dim strided: copied first
    compare("gelu_tanh", gt, ub, dy, make=lambda a, b: (a.t(), b[:, 7:140]))


def test_gradients_reuse_dead_activations(device):
    """gate/up produced by projections are dead after backward: their buffers take the grads."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, 16, generator=g).to(device).requires_grad_()
    wg = (torch.randn(201, 16, generator=g) * 0.4).to(device).requires_grad_()
    wu = (torch.randn(201, 16, generator=g) * 0.4).to(device).requires_grad_()
    dy = torch.randn(2, 9, 201, generator=g).to(device)

    def grads(fn):
        gate, up = x @ wg.t(), x @ wu.t()
        y = fn(gate, up)
        return (y,) + torch.autograd.grad(y, (x, wg, wu), dy), gate, up

    got, gate, up = grads(swiglu)
    ref, _, _ = grads(reference.swiglu)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the buffers of gate and up now hold dL/dgate and dL/dup
    gl, ul = (x @ wg.t()).detach().requires_grad_(), (x @ wu.t()).detach().requires_grad_()
    dg_ref, du_ref = torch.autograd.grad(reference.swiglu(gl, ul), (gl, ul), dy)
    torch.testing.assert_close(gate.detach(), dg_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.detach(), du_ref, rtol=1e-5, atol=1e-6)

    gate, up = x @ wg.t(), x @ wu.t()
    y = swiglu(gate, up)
    torch.autograd.grad(y, (x,), dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(y, (x,), dy)  # a second backward must not read gradients as inputs


def test_leaves_are_never_overwritten(device):
    gate, up, dy = inputs((5, 67), torch.float32, device)
    before = gate.detach().clone(), up.detach().clone()
    compare("silu", gate, up, dy)
    assert torch.equal(gate.detach(), before[0]) and torch.equal(up.detach(), before[1])
    # one tensor as both inputs: overlapping buffers are not reused either
    g2 = (gate * 1)
    y = swiglu(g2, g2)
    dx, = torch.autograd.grad(y, (gate,), dy)
    yr = reference.swiglu(gate, gate)
    rx, = torch.autograd.grad(yr, (gate,), dy)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-6)


def test_bad_inputs(device):
    g = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(g, g[:, :7])
    with pytest.raises(TypeError, match="gate must be"):
        swiglu(g.double(), g)
    with pytest.raises(TypeError, match="up must be"):
        geglu(g, g.to(torch.int32))
    with pytest.raises(ValueError, match="approximate"):
        geglu(g, g, approximate="erf")
    with pytest.raises(ValueError, match="one device"):
        swiglu(g, torch.randn(4, 8, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_8b_shape(act):
    gate, up, dy = inputs((16384, 14336), torch.bfloat16, "cuda")
    compare(act, gate, up, dy)
