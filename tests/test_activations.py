"""The activation kernels (csrc/core/activation.h) against float64 references:
forward with and without the fused bias, backward (autograd of the float64
reference) with and without the bias gradient, every activation and dtype,
vector and scalar paths; the gated layout [activation half | gate half] is
TE's. Outputs are poisoned (NaN) first so unwritten elements show."""
import pytest
import torch
import torch.nn.functional as F

from transformer_engine_c import _C, _engine
from helpers import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LIMIT, ALPHA, OFFSET = 1.25, 1.5, 0.75  # a small clamp limit, so random inputs cross it


def _f64(name):
    """The element-wise function of `name` in float64 (torch ops, autograd-able)."""
    if name in ("gelu", "geglu"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name in ("relu", "reglu"):
        return F.relu
    if name in ("qgelu", "qgeglu"):
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name in ("srelu", "sreglu"):
        return lambda x: F.relu(x) ** 2
    if name in ("silu", "swiglu"):
        return F.silu
    if name == "glu":
        return torch.sigmoid
    assert name == "clamped_swiglu"
    return lambda x: te_clamp(x, hi=LIMIT) * torch.sigmoid(ALPHA * te_clamp(x, hi=LIMIT))


def te_clamp(x, lo=-float("inf"), hi=float("inf")):
    """clamp(x, lo, hi) whose gradient passes where lo <= x <= hi, bounds
    included, as TransformerEngine defines the clamped swiglu's derivatives
    (its activation's at x <= limit, its gate's at -limit <= g <= limit).
    torch.clamp's own gradient at a bound is 1 up to PyTorch 2.13 and 0 from
    2.14, so the reference does not use it."""
    return torch.where(x > hi, torch.full_like(x, hi), torch.where(x < lo, torch.full_like(x, lo), x))


def act_ref(name, x, swap_halves=False):
    """act(x) in float64; gated: f(first half) * second half (TE's layout), or
    the other way round with swap_halves (what a wrong layout would give)."""
    f = _f64(name)
    if name not in _engine.GATED_ACTIVATIONS:
        return f(x)
    a, g = x.chunk(2, dim=-1)
    if swap_halves:
        a, g = g, a
    if name == "clamped_swiglu":
        g = te_clamp(g, -LIMIT, LIMIT) + OFFSET
    return f(a) * g


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).to(device)


def poison(t):
    return t.fill_(float("nan"))


def kw(name):
    return dict(limit=LIMIT, alpha=ALPHA, glu_linear_offset=OFFSET) if name == "clamped_swiglu" else {}


NAMES = sorted(_engine.ACTIVATIONS)
# (rows, output cols): vector path (cols a multiple of 8), scalar path, one row
SHAPES = [(1, 8), (37, 20), (64, 256), (130, 1000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_act_fwd(device, dtype, name, shape, with_bias):
    rows, cols = shape
    in_cols = 2 * cols if name in _engine.GATED_ACTIVATIONS else cols
    x = rand(rows, in_cols, dtype=dtype, device=device, scale=2.0)
    bias = rand(in_cols, dtype=dtype, device=device, scale=0.5) if with_bias else None
    out = poison(torch.empty(rows, cols, dtype=dtype, device=device))
    y = _engine.act_fwd(x, name, bias=bias, out=out, **kw(name))
    assert y.data_ptr() == out.data_ptr() and y.shape == (rows, cols)
    xin = x.double().cpu() + (bias.double().cpu() if with_bias else 0)
    ref = act_ref(name, xin)
    assert rel_err(y, ref) < TOL[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_dbias", [False, True])
def test_act_bwd(device, dtype, name, shape, with_dbias):
    rows, cols = shape
    in_cols = 2 * cols if name in _engine.GATED_ACTIVATIONS else cols
    x = rand(rows, in_cols, dtype=dtype, device=device, scale=2.0)
    dy = rand(rows, cols, dtype=dtype, device=device)
    res = _engine.act_bwd(dy, x, name, dbias=with_dbias, **kw(name))
    dx, db = res if with_dbias else (res, None)
    assert dx.shape == x.shape
    x64 = x.double().cpu().requires_grad_(True)
    act_ref(name, x64).backward(dy.double().cpu())
    assert rel_err(dx, x64.grad) < TOL[dtype], name
    if with_dbias:
        # float32 column sums of the unrounded dx, rounded once
        assert db.shape == (in_cols,)
        assert rel_err(db, x64.grad.sum(0)) < max(TOL[dtype], 1e-5), name


def test_clamped_swiglu_gradient_at_the_limits(device):
    """At x == limit and g == +-limit exactly the gradients pass (TE's
    definition), just inside they pass, just outside they are zero:
    against values written out by hand."""
    out = 1.0 + 2 ** -10
    a = torch.tensor([[LIMIT, LIMIT, LIMIT * out, 0.5, 0.5, 0.5]], dtype=torch.float64)
    g = torch.tensor([[0.5, LIMIT, 0.5, -LIMIT, -LIMIT * out, LIMIT * out]], dtype=torch.float64)
    x = torch.cat([a, g], 1).to(device=device, dtype=torch.float32)
    dx = _engine.act_bwd(torch.ones(1, 6, device=device), x, "clamped_swiglu", **kw("clamped_swiglu")).cpu().double()

    def silu(v):
        return v * torch.sigmoid(ALPHA * v)

    def dsilu(v):
        s = torch.sigmoid(ALPHA * v)
        return ALPHA * v * s * (1 - s) + s
    a0, g0 = a[0], g[0]
    gate = g0.clamp(-LIMIT, LIMIT) + OFFSET
    want_da = torch.where(a0 <= LIMIT, dsilu(a0.clamp(max=LIMIT)), torch.zeros_like(a0)) * gate
    want_dg = silu(a0.clamp(max=LIMIT)) * ((g0 >= -LIMIT) & (g0 <= LIMIT)).double()
    assert want_da[0] != 0 and want_dg[1] != 0 and want_dg[3] != 0  # the bounds themselves pass
    assert want_da[2] == 0 and want_dg[4] == 0 and want_dg[5] == 0  # just outside does not
    torch.testing.assert_close(dx[0, :6], want_da, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx[0, 6:], want_dg, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gelu", "swiglu"])
def test_act_bwd_dbias_no_rows(device, name):
    cols = 16
    in_cols = 2 * cols if name in _engine.GATED_ACTIVATIONS else cols
    x = torch.empty(0, in_cols, device=device)
    dy = torch.empty(0, cols, device=device)
    dx, db = _engine.act_bwd(dy, x, name, dbias=True)
    assert dx.shape == (0, in_cols)
    assert torch.equal(db.cpu(), torch.zeros(in_cols))
    assert _engine.act_fwd(x, name).shape == (0, cols)


@pytest.mark.parametrize("name", sorted(_engine.GATED_ACTIVATIONS))
def test_gated_layout_is_checked(device, name):
    """The reference comparison tells TE's layout from the swapped one: a
    kernel that gated the other half would fail test_act_fwd."""
    x = rand(64, 2 * 128, dtype=torch.float32, device=device, scale=2.0)
    y = _engine.act_fwd(x, name, **kw(name))
    assert rel_err(y, act_ref(name, x.double().cpu())) < TOL[torch.float32]
    assert rel_err(y, act_ref(name, x.double().cpu(), swap_halves=True)) > 0.1


def test_gelu_is_the_tanh_form(device):
    """TE's gelu is the tanh approximation, not the erf form (they differ by
    ~1e-3 around |x| ~ 2, far above the float32 tolerance)."""
    x = rand(256, 512, dtype=torch.float32, device=device, scale=2.0)
    y = _engine.act_fwd(x, "gelu")
    x64 = x.double().cpu()
    assert rel_err(y, F.gelu(x64, approximate="tanh")) < TOL[torch.float32]
    assert rel_err(y, F.gelu(x64)) > 1e-4


def test_unaligned_views_take_the_scalar_path(device):
    """Inputs at an odd element offset (not 16-byte aligned) still compute right."""
    base = rand(33 * 2 * 64 + 1, dtype=torch.bfloat16, device=device, scale=2.0)
    x = base[1:].view(33, 128)
    assert x.data_ptr() % 16
    dy = rand(33, 64, dtype=torch.bfloat16, device=device)
    y = _engine.act_fwd(x, "swiglu")
    assert rel_err(y, act_ref("swiglu", x.double().cpu())) < TOL[torch.bfloat16]
    dx, db = _engine.act_bwd(dy, x, "swiglu", dbias=True)
    x64 = x.double().cpu().requires_grad_(True)
    act_ref("swiglu", x64).backward(dy.double().cpu())
    assert rel_err(dx, x64.grad) < TOL[torch.bfloat16]


# ---------------------------------------------------------------- bad input

def test_bad_activation_name():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="activation 'tanh' is not supported"):
        _engine.act_fwd(x, "tanh")
    with pytest.raises(ValueError, match="not supported"):
        _engine.act_bwd(x, x, None)


def test_gated_needs_even_width():
    x = torch.randn(4, 9)
    with pytest.raises(ValueError, match="swiglu is gated.*must be even"):
        _engine.act_fwd(x, "swiglu")


def test_bad_shapes_and_dtypes():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="bias has shape"):
        _engine.act_fwd(x, "geglu", bias=torch.randn(8))
    with pytest.raises(ValueError, match="out has shape"):
        _engine.act_fwd(x, "geglu", out=torch.empty(4, 16))
    with pytest.raises(TypeError, match="grad_output has dtype"):
        _engine.act_bwd(torch.randn(4, 16, dtype=torch.float16), x, "gelu")
    with pytest.raises(ValueError, match="grad_output has shape"):
        _engine.act_bwd(torch.randn(4, 16), x, "swiglu")
    with pytest.raises(ValueError, match="must be contiguous"):
        _engine.act_fwd(torch.randn(16, 4).t(), "gelu")
    with pytest.raises(ValueError, match="must be 2-D"):
        _engine.act_fwd(torch.randn(2, 4, 16), "gelu")


def test_engine_rejects_bad_arguments():
    """The C checks behind the wrappers (engine INVALID_ARG -> ValueError)."""
    x, y = torch.randn(4, 16), torch.empty(4, 8)
    with pytest.raises(ValueError, match="unknown activation 7"):
        _C.act_fwd(-1, 7, 0, 4, 8, x.data_ptr(), 0, y.data_ptr(), 7.0, 1.702, 1.0, 0)
    with pytest.raises(ValueError, match="clamped_swiglu needs limit > 0"):
        _C.act_fwd(-1, 21, 0, 4, 8, x.data_ptr(), 0, y.data_ptr(), 0.0, 1.702, 1.0, 0)
    with pytest.raises(ValueError, match="missing x or y"):
        _C.act_fwd(-1, 20, 0, 4, 8, 0, 0, y.data_ptr(), 7.0, 1.702, 1.0, 0)
    with pytest.raises(ValueError, match="rows=4 cols=0"):
        _C.act_fwd(-1, 20, 0, 4, 0, x.data_ptr(), 0, y.data_ptr(), 7.0, 1.702, 1.0, 0)
    with pytest.raises(ValueError, match="unknown dtype 5"):
        _C.act_fwd(-1, 0, 5, 4, 8, x.data_ptr(), 0, y.data_ptr(), 7.0, 1.702, 1.0, 0)
    dx, db = torch.empty(4, 16), torch.empty(16)
    with pytest.raises(ValueError, match="workspace of 0 bytes, 64 needed"):
        _C.act_bwd(-1, 20, 0, 4, 8, y.data_ptr(), x.data_ptr(), dx.data_ptr(), db.data_ptr(), 0, 0,
                   7.0, 1.702, 1.0, 0)
    with pytest.raises(TypeError, match="act_bwd"):
        _C.act_bwd(-1, 20, 0)


def test_clamped_swiglu_rejects_bad_params():
    with pytest.raises(ValueError, match="limit > 0 and alpha > 0"):
        _engine.act_fwd(torch.randn(4, 16), "clamped_swiglu", limit=-1.0)


def test_clamped_swiglu_defaults_are_te_s(device):
    """Without activation_params: limit 7, alpha 1.702, gate offset 1 (TE's)."""
    x = rand(32, 64, dtype=torch.float32, device=device, scale=6.0)
    a, g = x.double().cpu().chunk(2, dim=-1)
    m = torch.clamp(a, max=7.0)
    ref = m * torch.sigmoid(1.702 * m) * (torch.clamp(g, -7.0, 7.0) + 1.0)
    assert rel_err(_engine.act_fwd(x, "clamped_swiglu"), ref) < TOL[torch.float32]
