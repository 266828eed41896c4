"""Linear and LayerNormLinear (no tensor parallelism) against the pure-PyTorch
reference, computed in float64: output and every gradient."""
import pytest
import torch

import transformer_engine_c as tec
from helpers import TOL, rel_err
from reference import layernorm_linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _params64(m):
    return {n: p.detach().double().cpu().requires_grad_() for n, p in m.named_parameters()}


def _randomise(m):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))


def _shapes(ndim):
    return (24, 48) if ndim == 2 else (6, 4, 48)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(device, dtype, ndim, bias):
    m = tec.Linear(48, 40, bias=bias, params_dtype=dtype, device=device)
    _randomise(m)
    x = torch.randn(*_shapes(ndim), dtype=dtype, device=device, requires_grad=True)
    y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    p = _params64(m)
    xr = x.detach().double().cpu().requires_grad_()
    yr = torch.nn.functional.linear(xr, p["weight"], p.get("bias"))
    yr.backward(dy.double().cpu())
    assert y.shape == yr.shape and y.dtype == dtype and y.device == x.device
    tol = TOL[dtype] * 2
    assert rel_err(y, yr) < tol
    assert rel_err(x.grad, xr.grad) < tol
    for name, param in m.named_parameters():
        assert rel_err(param.grad, p[name].grad) < tol, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zcg", [False, True])
def test_layernorm_linear(device, dtype, ndim, bias, normalization, zcg):
    m = tec.LayerNormLinear(48, 40, bias=bias, normalization=normalization, zero_centered_gamma=zcg,
                            params_dtype=dtype, device=device, return_layernorm_output=True)
    _randomise(m)
    x = torch.randn(*_shapes(ndim), dtype=dtype, device=device, requires_grad=True)
    y, ln_out = m(x)
    dy, dln = torch.randn_like(y), torch.randn_like(ln_out)
    torch.autograd.backward([y, ln_out], [dy, dln])
    p = _params64(m)
    xr = x.detach().double().cpu().requires_grad_()
    yr, nr = layernorm_linear(xr, p["layer_norm_weight"], p.get("layer_norm_bias"), p["weight"], p.get("bias"),
                              normalization=normalization, zero_centered_gamma=zcg)
    torch.autograd.backward([yr, nr], [dy.double().cpu(), dln.double().cpu()])
    tol = TOL[dtype] * 3
    assert rel_err(y, yr) < tol
    assert rel_err(ln_out, nr) < tol
    assert rel_err(x.grad, xr.grad) < tol
    for name, param in m.named_parameters():
        assert rel_err(param.grad, p[name].grad) < tol, name


def test_return_bias(device):
    m = tec.Linear(16, 8, return_bias=True, device=device)
    _randomise(m)
    x = torch.randn(4, 16, device=device)
    y, b = m(x)
    assert b is m.bias
    assert rel_err(y + b, torch.nn.functional.linear(x, m.weight, m.bias)) < 1e-6


def test_no_grad_forward(device):
    m = tec.LayerNormLinear(16, 8, device=device)
    x = torch.randn(4, 16, device=device)
    with torch.no_grad():
        y = m(x)
    assert not y.requires_grad and y.shape == (4, 8)


def test_deepcopy_shares_tp_config(device):
    import copy
    m = tec.LayerNormLinear(16, 8, device=device)
    m2 = copy.deepcopy(m)
    assert m2.tp is m.tp and m2.weight is not m.weight
    x = torch.randn(4, 16, device=device)
    torch.testing.assert_close(m(x), m2(x))


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear"])
def test_output_can_be_modified_in_place(device, ndim, layer):
    """A residual add into the output (y += r) works for 2-D and 3-D inputs
    alike, with the gradients of y + r; the normalised output that
    LayerNormLinear also returns (and saves) cannot be changed in place."""
    m = getattr(tec, layer)(48, 40, device=device, **({"return_layernorm_output": True}
                                                     if layer == "LayerNormLinear" else {}))
    _randomise(m)
    x = torch.randn(*_shapes(ndim), device=device, requires_grad=True)
    out = m(x)
    y = out[0] if isinstance(out, tuple) else out
    assert y.shape == (*x.shape[:-1], 40)
    r = torch.randn_like(y)
    y_ref = y.detach().clone()
    y += r
    dy = torch.randn_like(y)
    y.backward(dy)
    dx = x.grad.clone()
    x.grad = None
    m.zero_grad()
    fresh = m(x)
    y2 = fresh[0] if isinstance(fresh, tuple) else fresh
    torch.testing.assert_close(y.detach(), y_ref + r)
    (y2 + r).backward(dy)
    torch.testing.assert_close(dx, x.grad)
    if layer == "LayerNormLinear":
        y3, ln_out = m(x)
        assert ln_out.shape == x.shape
        with pytest.raises(RuntimeError, match="inplace"):  # also saved for backward: refused
            ln_out.mul_(2)
