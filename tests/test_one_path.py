"""The layers' one implementation (module/_steps.py, _plan.py, _wgrad.py)
against float64 references and TransformerEngine's semantics: every
configuration of the plan (bias or not, return_bias, RMSNorm,
zero-centred gamma, the parallel modes on one rank, LayerNormMLP's
activations), 2-D and 3-D inputs, fp32 and bf16, the no-grad forward;
fused (main_grad) and delayed (backward_dw) weight gradients; frozen
parameters; calls that are not `ready` (a non-contiguous input or weight,
autocast, a flag set after construction) and their named errors; the entry
through Function.apply where torch lacks the private C entry point; the
temporaries the steps reuse."""
import threading

import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c.module import _plan, _temporaries
from conftest import CUDA_SKIP
from mlp_reference import layernorm_mlp as mlp_ref
from reference import layernorm_linear as lnl_ref

DTYPES = [torch.float32, torch.bfloat16]


def _randomise(m):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))


def _layer(kind, device, dtype, **kw):
    if kind == "linear":
        m = tec.Linear(24, 20, params_dtype=dtype, device=device, **kw)
    elif kind == "mlp":
        m = tec.LayerNormMLP(24, 32, params_dtype=dtype, device=device, **kw)
    else:
        m = tec.LayerNormLinear(24, 20, params_dtype=dtype, device=device, **kw)
    _randomise(m)
    return m


def _reference(m, kind, x):
    """The layer's output in float64 from float64 copies of its parameters
    (leaves needing grad as the parameters do): (output, {name: leaf})."""
    p = {n: t.detach().double().cpu().requires_grad_(t.requires_grad) for n, t in m.named_parameters()}
    rb = m.return_bias
    if kind == "linear":
        y = torch.nn.functional.linear(x, p["weight"], None if rb else p.get("bias"))
    elif kind == "lnl":
        y, _ = lnl_ref(x, p["layer_norm_weight"], p.get("layer_norm_bias"), p["weight"], None if rb else p.get("bias"),
                       eps=m.eps, normalization=m.normalization, zero_centered_gamma=m.zero_centered_gamma)
    else:
        q = dict(p)
        if rb:
            q.pop("fc2_bias", None)
        y, _ = mlp_ref(x, q, activation=m.activation, normalization=m.normalization, eps=m.eps,
                       zero_centered_gamma=m.zero_centered_gamma, act_kw=m._act_kw)
    return y, p


def _close(got, ref, what):
    """fp32: relative error of the whole tensor <= 1e-5; bf16: <= 0.02."""
    assert got is not None, f"{what}: missing"
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    tol = 1e-5 if got.dtype == torch.float32 else 2e-2
    g, r = got.detach().double().cpu(), ref.detach().double().cpu()
    err = ((g - r).norm() / r.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _check(m, kind, x, dy, first=None):
    """One forward + backward and a no-grad forward of m against the float64
    reference: output, returned bias, input and parameter gradients."""
    rb = m.return_bias
    xx = x.detach().clone().requires_grad_(x.requires_grad)
    m.zero_grad(set_to_none=True)
    out = m(xx, is_first_microbatch=first)
    y = out[0] if rb else out
    assert y.dtype == x.dtype and y.shape == dy.shape
    y.backward(dy)
    with torch.no_grad():
        y0 = m(x)
    xr = x.detach().double().cpu().requires_grad_(x.requires_grad)
    yr, p = _reference(m, kind, xr)
    yr.backward(dy.double().cpu())
    _close(y, yr, "output")
    _close(y0[0] if rb else y0, yr, "no-grad output")
    if rb:
        b = out[1]
        name = "fc2_bias" if kind == "mlp" else "bias"
        own = getattr(m, name)
        assert b.dtype == x.dtype and torch.equal(b, own.to(x.dtype))
    if x.requires_grad:
        _close(xx.grad, xr.grad, "input grad")
    else:
        assert xx.grad is None
    for name, t in m.named_parameters():
        if p[name].grad is None or not t.requires_grad:
            assert t.grad is None, f"{name} got a gradient"
        else:
            _close(t.grad, p[name].grad, f"{name} grad")
    return y


CASES = [("linear", {}), ("linear", {"bias": False}), ("linear", {"return_bias": True}),
         ("lnl", {}), ("lnl", {"bias": False}), ("lnl", {"normalization": "RMSNorm"}),
         ("lnl", {"zero_centered_gamma": True}), ("lnl", {"return_bias": True}),
         ("linear", {"parallel_mode": "column"}), ("linear", {"parallel_mode": "row"}),
         ("lnl", {"parallel_mode": "row"}), ("lnl", {"parallel_mode": "column", "bias": False}),
         ("mlp", {}), ("mlp", {"bias": False}), ("mlp", {"return_bias": True}), ("mlp", {"normalization": "RMSNorm"}),
         ("mlp", {"zero_centered_gamma": True}), ("mlp", {"set_parallel_mode": True}),
         ("mlp", {"activation": "swiglu"}), ("mlp", {"activation": "relu", "bias": False}),
         ("mlp", {"activation": "clamped_swiglu", "activation_params": {"limit": 3.0, "alpha": 1.5}})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 24), (3, 2, 24)])
@pytest.mark.parametrize("kind,kw", CASES)
def test_against_float64_reference(device, dtype, shape, kind, kw):
    m = _layer(kind, device, dtype, **kw)
    x = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(*shape[:-1], 24 if kind == "mlp" else 20, dtype=dtype, device=device)
    _check(m, kind, x, dy)
    call_ready = _plan.make_call(m, m._plan, x, *_call_args(m, kind), None).ready
    assert call_ready, "a plain call was not ready"


def _call_args(m, kind):
    """(first weight, the other tensors) as the module's forward passes them to make_call."""
    if kind == "mlp":
        b = m.use_bias
        return m.fc1_weight, (m.layer_norm_weight, m.layer_norm_bias, m.fc2_weight, m.fc1_bias if b else None,
                              m.fc2_bias if b else None)
    rest = (m.bias if m.use_bias else None,)
    if kind == "lnl":
        rest += (m.layer_norm_weight, m.layer_norm_bias)
    return m.weight, rest


@pytest.mark.parametrize("kind", ["linear", "lnl"])
@pytest.mark.parametrize("mode", ["fuse", "delay"])
@pytest.mark.parametrize("first", [None, True, False])
@pytest.mark.parametrize("shape", [(8, 24), (3, 2, 24)])
def test_fused_and_delayed_wgrad(device, kind, mode, first, shape):
    """fuse_wgrad_accumulation: dW accumulated in fp32 into main_grad
    (overwritten on a first micro-batch), TE's grad_added_to_main_grad
    protocol (a zero dummy gradient with zero_out_wgrad); delay_wgrad_compute:
    no weight gradient until backward_dw(), then the reference's."""
    kw = {"fuse_wgrad_accumulation": True} if mode == "fuse" else {"delay_wgrad_compute": True}
    m = _layer(kind, device, torch.float32, **kw)
    x = torch.randn(*shape, device=device)
    dy = torch.randn(*shape[:-1], 20, device=device)
    if mode == "fuse":
        m.weight.main_grad = torch.full(m.weight.shape, 0.25, device=device)
        m.weight.grad_added_to_main_grad = False
        m.weight.zero_out_wgrad = True
    y = m(x, is_first_microbatch=first)
    y.backward(dy)
    xr = x.double().cpu()
    yr, p = _reference(m, kind, xr)
    yr.backward(dy.double().cpu())
    if mode == "fuse":
        assert m.weight.grad_added_to_main_grad is True and torch.count_nonzero(m.weight.grad) == 0
        _close(m.weight.main_grad - (0.0 if first else 0.25), p["weight"].grad, "main_grad")
    else:
        assert m.weight.grad is None
        m.backward_dw()
        _close(m.weight.grad, p["weight"].grad, "backward_dw's weight grad")
        with pytest.raises(RuntimeError, match="no delayed weight gradient is pending"):
            m.backward_dw()
    _close(m.bias.grad, p["bias"].grad, "bias grad")


@pytest.mark.parametrize("kind", ["linear", "lnl", "mlp"])
def test_partial_grads(device, kind):
    """A frozen weight (bias gradient only), an input without grad, and a
    grad_output that is not contiguous."""
    m = _layer(kind, device, torch.float32)
    for name in (("fc1_weight", "fc2_weight", "fc1_bias") if kind == "mlp" else ("weight",)):
        getattr(m, name).requires_grad_(False)
    x = torch.randn(6, 24, device=device)
    dy = torch.randn(24 if kind == "mlp" else 20, 6, device=device).t()  # not contiguous
    _check(m, kind, x, dy)


@pytest.mark.parametrize("kind", ["linear", "lnl"])
def test_plain_weight_gradient_steps_are_shared_and_the_policy_read_per_call(device, kind):
    """A plain Wgrad (neither fused, delayed nor distributed) is made once per
    kind of backward and shared: backward calls that alternate a frozen and
    a trainable weight each get the reference's gradients, and
    fuse_wgrad_accumulation set after those calls takes effect at once."""
    m = _layer(kind, device, torch.float32)
    x = torch.randn(6, 24, device=device, requires_grad=True)
    dy = torch.randn(6, 20, device=device)
    owner = m._wgrads[0]
    assert owner.step(m.weight, True, None, False, True) is owner.step(m.weight, True, None, False, True)
    assert owner.step(m.weight, True, None, False, True) is not owner.step(m.weight, True, None, False, False)
    for frozen in (True, False, True, False):
        m.weight.requires_grad_(not frozen)
        _check(m, kind, x, dy)
    m.fuse_wgrad_accumulation = True
    m.weight.main_grad = torch.zeros(m.weight.shape, device=device)
    fused = owner.step(m.weight, True, False, False, True)
    assert fused.fuse and not fused.plain
    m(x, is_first_microbatch=False).backward(dy)
    yr, p = _reference(m, kind, x.detach().double().cpu())
    yr.backward(dy.double().cpu())
    _close(m.weight.main_grad, p["weight"].grad, "main_grad after fuse_wgrad_accumulation was set")


@pytest.mark.parametrize("kind", ["linear", "lnl"])
def test_calls_that_are_not_ready(device, kind):
    """What the Call does not take as is (a non-contiguous input or weight,
    autocast, a flag set after construction) is converted, with the
    reference's numbers; setting a plan attribute drops the plan."""
    m = _layer(kind, device, torch.float32)
    x = torch.randn(6, 24, device=device)
    dy = torch.randn(6, 20, device=device)
    _check(m, kind, torch.randn(24, 6, device=device).t(), dy)  # not contiguous
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    _close(y, _reference(m, kind, x.double().cpu())[0].to(torch.bfloat16), "autocast output")
    attr = "save_original_input" if kind == "linear" else "return_layernorm_output"
    m._make_plan()
    setattr(m, attr, True)  # set after construction: the plan is remade
    assert m._plan is None
    out = m(x)
    if kind == "lnl":
        y, ln = out
        _close(ln, torch.nn.functional.layer_norm(x.double().cpu(), (24,), m.layer_norm_weight.double().cpu(),
                                                  m.layer_norm_bias.double().cpu(), m.eps), "returned ln_out")
    setattr(m, attr, False)
    _check(m, kind, x, dy)
    with torch.no_grad():
        m.weight = torch.nn.Parameter(m.weight.t().contiguous().t())  # a weight that is not contiguous
    assert not m.weight.is_contiguous()
    _check(m, kind, x, dy)


@pytest.mark.parametrize("kind", ["linear", "lnl"])
def test_return_bias_without_bias_after_a_dtype_change(device, kind):
    """return_bias=True without a bias returns the layer's empty bias tensor
    (not a parameter: .to(dtype) leaves it) in the call's dtype."""
    m = _layer(kind, device, torch.float32, bias=False, return_bias=True).to(torch.bfloat16)
    x = torch.randn(4, 24, dtype=torch.bfloat16, device=device, requires_grad=True)
    y, b = m(x)
    assert b.dtype == torch.bfloat16 and b.numel() == 0
    _close(y, _reference(m, kind, x.detach().double().cpu())[0], "output")


@pytest.mark.parametrize("kind", ["linear", "lnl", "mlp"])
def test_bad_input_named_errors(device, kind):
    m = _layer(kind, device, torch.float32)
    with pytest.raises(TypeError, match="inp has dtype torch.float64"):
        m(torch.randn(4, 24, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="last dimension 23; expected 24"):
        m(torch.randn(4, 23, device=device))
    with pytest.raises(ValueError, match="must be 2-D"):
        m(torch.randn(24, device=device))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        m([[0.0] * 24])


@pytest.mark.parametrize("kind", ["linear", "lnl", "mlp"])
def test_replaced_parameter_of_a_wrong_shape_is_a_named_error(device, kind):
    """A parameter replaced by one of another shape is refused by name (the
    steps call the engine with the plan's shapes)."""
    m = _layer(kind, device, torch.float32)
    name = "fc2_weight" if kind == "mlp" else "weight"
    shape = getattr(m, name).shape
    setattr(m, name, torch.nn.Parameter(torch.randn(shape[0], shape[1] + 1, device=device)))
    with pytest.raises(ValueError, match=f"{name} has shape"):
        m(torch.randn(4, 24, device=device))


@pytest.mark.parametrize("kind", ["linear", "lnl"])
@pytest.mark.parametrize("swap", ["shape", "dtype", "gamma"])
def test_parameter_swapped_between_forward_and_backward(device, kind, swap):
    """A `.data` swap under a saved parameter is an error, never a wrong read."""
    if swap == "gamma" and kind == "linear":
        pytest.skip("Linear has no norm")
    m = _layer(kind, device, torch.float32)
    y = m(torch.randn(4, 24, device=device, requires_grad=True))
    if swap == "shape":
        m.weight.data = torch.randn(24, 20, device=device)
    elif swap == "dtype":
        m.weight.data = m.weight.data.double()
    else:
        m.layer_norm_weight.data = m.layer_norm_weight.data.half()
    what = "layer_norm_weight" if swap == "gamma" else "weight"
    with pytest.raises(RuntimeError, match=f"{what} changed between forward and backward"):
        y.sum().backward()


@pytest.mark.parametrize("kind", ["linear", "lnl"])
def test_dead_functorch_wrapper_input(kind):
    """A tensor a finished functorch transform left behind is unwrapped, as
    torch.autograd.Function.apply unwraps it (the C entry skips apply's
    Python wrapper)."""
    leak = []

    def f(a):
        leak.append(a)
        return a.sum()

    torch.func.grad(f)(torch.randn(4, 24))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leak[0])
    m = _layer(kind, "cpu", torch.float32)
    y = m(leak[0])
    assert torch.equal(y, m(torch._C._functorch.unwrap_if_dead(leak[0])))


def test_under_a_functorch_transform_function_apply_runs(monkeypatch):
    """Under torch.func transforms the Function is entered through
    Function.apply, never the C entry point (which would bypass functorch's
    checks): torch's own refusal of a Function without setup_context."""
    def refused(*args):
        raise AssertionError("the C entry point was used")
    monkeypatch.setattr(_plan, "_function_apply", refused)
    m = _layer("linear", "cpu", torch.float32)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda a: m(a).sum())(torch.randn(4, 24))


# -- the composite engine entry points the steps call (csrc/python/ops.c) -----------------------

def _ptrs(*ts):
    return [t.data_ptr() for t in ts]


def test_linear_bwd_binding_checks():
    from transformer_engine_c import _C
    dy, x, w = torch.randn(4, 8), torch.randn(4, 6), torch.randn(8, 6)
    dx, dw, db = torch.empty(4, 6), torch.empty(8, 6), torch.empty(8)
    _C.linear_bwd(-1, 0, 4, 8, 6, *_ptrs(dy, x, w, dx, dw, db), 0, 0, 0)
    torch.testing.assert_close(dx, dy @ w)
    torch.testing.assert_close(dw, dy.t() @ x)
    torch.testing.assert_close(db, dy.sum(0))
    with pytest.raises(ValueError, match="db needs dw"):
        _C.linear_bwd(-1, 0, 4, 8, 6, *_ptrs(dy, x, w, dx), 0, db.data_ptr(), 0, 0, 0)
    with pytest.raises(ValueError, match="dtype"):
        _C.linear_bwd(-1, 7, 4, 8, 6, *_ptrs(dy, x, w, dx, dw, db), 0, 0, 0)
    with pytest.raises(ValueError, match="negative size"):
        _C.linear_bwd(-1, 0, -4, 8, 6, *_ptrs(dy, x, w, dx, dw, db), 0, 0, 0)
    with pytest.raises(TypeError):
        _C.linear_bwd(-1, 0, 4, 8, 6)


def test_norm_linear_bindings_checks():
    from transformer_engine_c import _C
    x, g, beta, w, b = torch.randn(4, 6), torch.rand(6) + 0.5, torch.randn(6), torch.randn(8, 6), torch.randn(8)
    ln, mu, rs, y = torch.empty(4, 6), torch.empty(4), torch.empty(4), torch.empty(4, 8)
    _C.norm_linear_fwd(-1, 0, 4, 6, 8, *_ptrs(x, g, beta, ln, mu, rs), 1e-5, 0, *_ptrs(w, b, y), 0, 0, 0)
    ref = torch.nn.functional.layer_norm(x, (6,), g, beta, 1e-5)
    torch.testing.assert_close(ln, ref)
    torch.testing.assert_close(y, ref @ w.t() + b)
    with pytest.raises(ValueError, match="eps"):
        _C.norm_linear_fwd(-1, 0, 4, 6, 8, *_ptrs(x, g, beta, ln, mu, rs), -1.0, 0, *_ptrs(w, b, y), 0, 0, 0)
    with pytest.raises(ValueError, match="beta and mu together"):
        _C.norm_linear_fwd(-1, 0, 4, 6, 8, *_ptrs(x, g, beta, ln), 0, rs.data_ptr(), 1e-5, 0,
                           *_ptrs(w, b, y), 0, 0, 0)
    dy, dln, dx, dg, dbeta, dw, db = (torch.empty(4, 8).normal_(), torch.empty(4, 6), torch.empty(4, 6),
                                      torch.empty(6), torch.empty(6), torch.empty(8, 6), torch.empty(8))
    nws = _C.norm_bwd_workspace_bytes(-1, 4, 6)
    ws = torch.empty(nws, dtype=torch.uint8)
    _C.norm_linear_bwd(-1, 0, 4, 6, 8, *_ptrs(dy, x, ln, mu, rs, g), 0, *_ptrs(w, dln, dx, dg, dbeta, dw, db),
                       ws.data_ptr(), nws, 0, 0, 0)
    xr, gr, br = (t.clone().requires_grad_() for t in (x, g, beta))
    lnr = torch.nn.functional.layer_norm(xr, (6,), gr, br, 1e-5)
    lnr.backward(dy @ w)
    torch.testing.assert_close(dx, xr.grad)
    torch.testing.assert_close(dg, gr.grad)
    torch.testing.assert_close(dbeta, br.grad)
    torch.testing.assert_close(dw, dy.t() @ ref)
    torch.testing.assert_close(db, dy.sum(0))
    with pytest.raises(ValueError, match="db needs dw"):
        _C.norm_linear_bwd(-1, 0, 4, 6, 8, *_ptrs(dy, x, ln, mu, rs, g), 0, *_ptrs(w, dln, dx, dg, dbeta), 0,
                           db.data_ptr(), ws.data_ptr(), nws, 0, 0, 0)
    with pytest.raises(ValueError, match="workspace"):
        _C.norm_linear_bwd(-1, 0, 4, 6, 8, *_ptrs(dy, x, ln, mu, rs, g), 0,
                           *_ptrs(w, dln, dx, dg, dbeta, dw, db), 0, 0, 0, 0, 0)


@pytest.mark.parametrize("alias", ["a", "b"])
def test_cpu_gemm_output_overlapping_an_operand(alias):
    """The CPU GEMM reads float32 operands in place unless the output overlaps
    them: an output written over an operand still gives the product of the
    operands as they were (A: the output starts 4 rows into A, so the first
    rows written are rows of A the next block reads)."""
    from transformer_engine_c import _C
    store, b = torch.randn(12, 8), torch.randn(8, 8)
    a = store[:8]
    want = a @ b
    out = store[4:] if alias == "a" else b
    _C.gemm(-1, 0, 0, 0, 0, 8, 8, 8, a.data_ptr(), 8, b.data_ptr(), 8, out.data_ptr(), 8, 0, 0, 0, 0, 0, 0)
    torch.testing.assert_close(out, want)


def test_plan_survives_copy_and_pickle():
    """A deep copy or an unpickled layer (also one pickled without a plan:
    no _plan in its __dict__) gives the same results."""
    import copy
    import io
    m = _layer("lnl", "cpu", torch.float32)
    x = torch.randn(4, 24, requires_grad=True)
    y = m(x)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    old = torch.load(buf, weights_only=False)
    old.__dict__.pop("_plan")
    for other in (copy.deepcopy(m), old):
        y2 = other(x)
        assert torch.equal(y2, y)
        y2.sum().backward()


def test_mlp_flags_set_after_construction(device):
    """checkpoint, delay_wgrad_compute and return_layernorm_output set after
    construction drop the plan and take effect, with the reference's numbers."""
    m = _layer("mlp", device, torch.float32)
    x = torch.randn(6, 24, device=device)
    dy = torch.randn(6, 24, device=device)
    for attr in ("checkpoint", "return_layernorm_output"):
        m._make_plan()
        setattr(m, attr, True)
        assert m._plan is None
        out = m(x.requires_grad_())
        y = out[0] if attr == "return_layernorm_output" else out
        _close(y, _reference(m, "mlp", x.detach().double().cpu())[0], attr)
        setattr(m, attr, False)
        x = x.detach()
        _check(m, "mlp", x, dy)
    m2 = _layer("mlp", device, torch.float32, delay_wgrad_compute=True)
    y = m2(x)
    y.backward(dy)
    assert m2.fc1_weight.grad is None
    m2.backward_dw()
    yr, p = _reference(m2, "mlp", x.double().cpu())
    yr.backward(dy.double().cpu())
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        _close(getattr(m2, name).grad, p[name].grad, name)


def test_without_torch_private_entry_points_function_apply_runs(monkeypatch):
    """A torch release lacking the private C entry point (_plan.C_APPLY
    False): the layers enter their Function through Function.apply, with
    the same results."""
    torch.manual_seed(0)
    a = tec.Linear(16, 8, device="cpu")
    x = torch.randn(4, 16, requires_grad=True)
    y = a(x)
    y.sum().backward()
    monkeypatch.setattr(_plan, "C_APPLY", False)

    def refused(*args):
        raise AssertionError("the C entry point was used")
    monkeypatch.setattr(_plan, "_function_apply", refused)
    b = tec.Linear(16, 8, device="cpu")
    b.load_state_dict(a.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    y2 = b(x2)
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(a.weight.grad, b.weight.grad)


def test_temporaries_are_reused_per_thread_and_stream(monkeypatch):
    monkeypatch.setattr(_temporaries, "_temps", threading.local())
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    a = _temporaries.temp(x, (4, 3), -1, 0, _temporaries.T_PARTIAL)
    assert a.shape == (4, 3) and a.dtype == torch.bfloat16
    assert _temporaries.temp(x, (4, 3), -1, 0, _temporaries.T_PARTIAL) is a  # the same call again: reused
    assert _temporaries.temp(x, (4, 3), -1, 7, _temporaries.T_PARTIAL) is not a  # another stream: its own
    assert _temporaries.temp(x.float(), (4, 3), -1, 0, _temporaries.T_PARTIAL) is not a  # another dtype
    assert _temporaries.temp(x, (4, 2, 3), -1, 0, _temporaries.T_PARTIAL).shape == (4, 2, 3)
    assert _temporaries.temp(x, (4, 3), -1, 0, _temporaries.T_GATHERED) is not a  # another role: its own
    ws = _temporaries.temp_bytes(x, 100, -1, 0, _temporaries.T_NORM_WS)
    assert ws.dtype == torch.uint8 and ws.shape == (100,)
    assert _temporaries.temp_bytes(x, 100, -1, 0, _temporaries.T_NORM_WS) is ws
    other = []
    t = threading.Thread(target=lambda: other.append(_temporaries.temp(x, (4, 3), -1, 0, _temporaries.T_PARTIAL)))
    t.start()
    t.join()
    assert other[0] is not a  # another thread: its own


def test_temporaries_bounded(monkeypatch):
    monkeypatch.setattr(_temporaries, "_temps", threading.local())
    x = torch.zeros(2, 3)
    first = _temporaries.temp(x, (1, 3), -1, 0, _temporaries.T_PARTIAL)
    for r in range(2, 2 + _temporaries._TEMP_SLOTS):
        _temporaries.temp(x, (r, 3), -1, 0, _temporaries.T_PARTIAL)
    assert len(_temporaries._temps.slots) == _temporaries._TEMP_SLOTS
    assert _temporaries.temp(x, (1, 3), -1, 0, _temporaries.T_PARTIAL) is not first  # the oldest was dropped
    monkeypatch.setattr(_temporaries, "_TEMP_HELD", 48)  # bytes held: adding a temporary drops the oldest down to it
    _temporaries.temp(x, (1, 4), -1, 0, _temporaries.T_DY)
    assert sum(t.nbytes for t in _temporaries._temps.slots.values()) <= 48 and len(_temporaries._temps.slots) <= 3
    monkeypatch.setattr(_temporaries, "_TEMP_BYTES", 64)
    big = _temporaries.temp(x, (5, 4), -1, 0, _temporaries.T_PARTIAL)  # 80 bytes: above the limit, fresh every call
    assert _temporaries.temp(x, (5, 4), -1, 0, _temporaries.T_PARTIAL) is not big


def test_temporaries_not_while_capturing(monkeypatch):
    """On a CUDA device (code >= 0) a capture in progress gets a fresh
    tensor every call (shown on CPU tensors with the capture query mocked)."""
    monkeypatch.setattr(_temporaries, "_temps", threading.local())
    x = torch.zeros(2, 3)
    monkeypatch.setattr(_temporaries, "_capturing", lambda: False)
    a = _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL)
    assert _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL) is a
    monkeypatch.setattr(_temporaries, "_capturing", lambda: True)
    assert _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL) is not a
    monkeypatch.setattr(_temporaries, "_capturing", None)  # no query in this torch: never reused on CUDA
    assert _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL) is not a


def test_fresh_temporaries_only_on_a_cuda_device(monkeypatch):
    """Inside the compiled path's operators (fresh) a CUDA temporary (device
    code >= 0, shown with the capture query mocked) is a new tensor every
    call, a CPU one is reused as outside; the setting is restored."""
    monkeypatch.setattr(_temporaries, "_temps", threading.local())
    monkeypatch.setattr(_temporaries, "_capturing", lambda: False)
    x = torch.zeros(2, 3)
    before = _temporaries.fresh_temporaries(True)
    try:
        cpu = _temporaries.temp(x, (4, 3), -1, 0, _temporaries.T_PARTIAL)
        assert _temporaries.temp(x, (4, 3), -1, 0, _temporaries.T_PARTIAL) is cpu
        cuda = _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL)
        assert _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL) is not cuda
        assert _temporaries.norm_stats(torch.device("cpu"), 4, False, False)[0] is None  # the sink
    finally:
        assert _temporaries.fresh_temporaries(before) is True
    assert _temporaries.temp(x, (4, 3), 0, 5, _temporaries.T_PARTIAL) is _temporaries.temp(
        x, (4, 3), 0, 5, _temporaries.T_PARTIAL)


def test_no_grad_norm_statistics_go_to_the_sink():
    m = _layer("lnl", "cpu", torch.float32)
    x = torch.randn(6, 24)
    _temporaries._sinks.pop(torch.device("cpu"), None)
    with torch.no_grad():
        y = m(x)
    assert _temporaries._sinks[torch.device("cpu")].numel() >= 12
    assert torch.equal(y, m(x).detach())


@CUDA_SKIP
def test_temporaries_not_in_a_real_capture(monkeypatch):
    """torch.cuda.graph capture: the capture query answers, and every call
    gets a fresh tensor from the graph's pool; after it, reuse again."""
    monkeypatch.setattr(_temporaries, "_temps", threading.local())
    x = torch.zeros(2, 3, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    a = _temporaries.temp(x, (4, 3), 0, stream, _temporaries.T_PARTIAL)
    assert _temporaries.temp(x, (4, 3), 0, stream, _temporaries.T_PARTIAL) is a
    g = torch.cuda.CUDAGraph()
    got = []
    with torch.cuda.graph(g):
        s = torch.cuda.current_stream().cuda_stream
        got += [_temporaries.temp(x, (4, 3), 0, s, _temporaries.T_PARTIAL), _temporaries.temp(x, (4, 3), 0, s, _temporaries.T_PARTIAL)]
    assert got[0] is not got[1] and all(t is not a for t in got)
    assert _temporaries.temp(x, (4, 3), 0, stream, _temporaries.T_PARTIAL) is a
