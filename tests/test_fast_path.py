"""The layers' fast path (module/_fast.py): taken in the common case, it gives
bit for bit the general path's outputs and gradients (the same engine
kernels); everything off the common case (autocast, a layout or dtype the
engine cannot take as is, a replaced parameter, a flag set after
construction) takes the general path, with its errors."""
import threading

import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c.module import _fast
from conftest import CUDA_SKIP

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


def _general(monkeypatch, m):
    """Send m through the general path from now on."""
    monkeypatch.setattr(_fast, "make_plan", lambda layer: False)
    m.__dict__["_plan"] = None


def _fast_fn(y):
    """Whether y came out of one of the fast path's autograd Functions."""
    fn = y.grad_fn
    return fn is not None and getattr(fn, "_forward_cls", None) in (_fast._LinearFn, _fast._LayerNormLinearFn,
                                                                     _fast._LayerNormMLPFn)


def _run(m, x, dy, return_bias=False):
    """(outputs..., x.grad, every parameter's grad) of one forward + backward."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    m.zero_grad(set_to_none=True)
    out = m(x)
    y = out[0] if return_bias else out
    y.backward(dy)
    grads = [p.grad for _, p in m.named_parameters()]
    return [y.detach()] + ([out[1].detach()] if return_bias else []) + [x.grad] + grads, _fast_fn(y)


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if u is None or v is None:
            assert u is None and v is None
        else:
            assert u.shape == v.shape and u.dtype == v.dtype and torch.equal(u, v)


CASES = [("linear", {}), ("linear", {"bias": False}), ("linear", {"return_bias": True}),
         ("lnl", {}), ("lnl", {"bias": False}), ("lnl", {"normalization": "RMSNorm"}),
         ("lnl", {"zero_centered_gamma": True}), ("lnl", {"return_bias": True}),
         ("linear", {"parallel_mode": "column"}), ("lnl", {"parallel_mode": "row"}),
         ("mlp", {}), ("mlp", {"bias": False}), ("mlp", {"return_bias": True}), ("mlp", {"normalization": "RMSNorm"}),
         ("mlp", {"zero_centered_gamma": True}), ("mlp", {"set_parallel_mode": True}),
         ("mlp", {"activation": "swiglu"}), ("mlp", {"activation": "relu", "bias": False}),
         ("mlp", {"activation": "clamped_swiglu", "activation_params": {"limit": 3.0, "alpha": 1.5}})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 24), (3, 2, 24)])
@pytest.mark.parametrize("kind,kw", CASES)
def test_fast_equals_general(monkeypatch, device, dtype, shape, kind, kw):
    m = _layer(kind, device, dtype, **kw)
    x = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(*shape[:-1], 24 if kind == "mlp" else 20, dtype=dtype, device=device)
    rb = kw.get("return_bias", False)
    fast, took = _run(m, x, dy, rb)
    assert took, "the common case did not take the fast path"
    with torch.no_grad():
        y_fast = m(x)
    _general(monkeypatch, m)
    general, took = _run(m, x, dy, rb)
    assert not took
    _same(fast, general)
    with torch.no_grad():
        y_general = m(x)
    _same(list(y_fast) if rb else [y_fast], list(y_general) if rb else [y_general])


def _wgrad_run(m, x, dy, mode, first):
    """main_grad (fuse) or the gradients backward_dw() gives (delay) after
    one micro-batch; with grad_added_to_main_grad, the dummy gradient too."""
    m.zero_grad(set_to_none=True)
    if mode == "fuse":
        m.weight.main_grad = torch.full(m.weight.shape, 0.25, device=x.device)
        m.weight.grad_added_to_main_grad = False
        m.weight.zero_out_wgrad = True  # the dummy gradient is zeros (else uninitialised)
    y = m(x, is_first_microbatch=first)
    took = _fast_fn(y)
    y.backward(dy)
    if mode == "fuse":
        assert m.weight.grad_added_to_main_grad is True
        return [m.weight.main_grad, m.weight.grad, m.bias.grad, x.grad], took
    assert m.weight.grad is None
    m.backward_dw()
    return [m.weight.grad, m.bias.grad, x.grad], took


@pytest.mark.parametrize("kind", ["linear", "lnl"])
@pytest.mark.parametrize("mode", ["fuse", "delay"])
@pytest.mark.parametrize("first", [None, True, False])
@pytest.mark.parametrize("shape", [(8, 24), (3, 2, 24)])
def test_fused_and_delayed_wgrad_equal_general(monkeypatch, device, kind, mode, first, shape):
    """fuse_wgrad_accumulation (main_grad, TE's grad_added_to_main_grad
    protocol, overwritten on a first micro-batch) and delay_wgrad_compute
    (backward_dw) through the fast path: the general path's numbers."""
    kw = {"fuse_wgrad_accumulation": True} if mode == "fuse" else {"delay_wgrad_compute": True}
    m = _layer(kind, device, torch.float32, **kw)
    x = torch.randn(*shape, device=device, requires_grad=True)
    dy = torch.randn(*shape[:-1], 20, device=device)
    fast, took = _wgrad_run(m, x, dy, mode, first)
    assert took
    x.grad = None
    _general(monkeypatch, m)
    general, took = _wgrad_run(m, x, dy, mode, first)
    assert not took
    _same(fast, general)


@pytest.mark.parametrize("kind", ["linear", "lnl", "mlp"])
def test_fast_partial_grads(monkeypatch, device, kind):
    """A frozen weight (bias gradient only), an input without grad, and a
    grad_output that is not contiguous: still the general path's numbers."""
    m = _layer(kind, device, torch.float32)
    for name in (("fc1_weight", "fc2_weight", "fc1_bias") if kind == "mlp" else ("weight",)):
        getattr(m, name).requires_grad_(False)
    x = torch.randn(6, 24, device=device)
    dy = torch.randn(24 if kind == "mlp" else 20, 6, device=device).t()  # not contiguous
    fast, took = _run(m, x, dy)
    assert took and fast[1] is None  # no input gradient
    _general(monkeypatch, m)
    general, _ = _run(m, x, dy)
    _same(fast, general)


@pytest.mark.parametrize("kind", ["linear", "lnl"])
def test_off_the_common_case_takes_the_general_path(device, kind):
    m = _layer(kind, device, torch.float32)
    x = torch.randn(6, 24, device=device, requires_grad=True)
    assert _fast_fn(m(x))
    assert not _fast_fn(m(torch.randn(24, 6, device=device).t().requires_grad_()))  # not contiguous
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = m(x)
    assert not _fast_fn(y) and y.dtype == torch.bfloat16
    attr = "save_original_input" if kind == "linear" else "return_layernorm_output"
    setattr(m, attr, True)  # set after construction: the plan is remade
    assert m._plan is None
    out = m(x)
    assert not _fast_fn(out if kind == "linear" else out[0])
    setattr(m, attr, False)
    assert _fast_fn(m(x))
    with torch.no_grad():
        m.weight = torch.nn.Parameter(m.weight.t().contiguous().t())  # a weight that is not contiguous
    y = m(x)
    assert not _fast_fn(y)
    y.sum().backward()
    assert m.weight.grad is not None


@pytest.mark.parametrize("kind", ["linear", "lnl"])
def test_return_bias_without_bias_after_a_dtype_change(monkeypatch, device, kind):
    """return_bias=True without a bias returns the layer's empty bias tensor
    (not a parameter: .to(dtype) leaves it) in the call's dtype."""
    m = _layer(kind, device, torch.float32, bias=False, return_bias=True).to(torch.bfloat16)
    x = torch.randn(4, 24, dtype=torch.bfloat16, device=device, requires_grad=True)
    y, b = m(x)
    assert _fast_fn(y) and b.dtype == torch.bfloat16 and b.numel() == 0
    _general(monkeypatch, m)
    y2, b2 = m(x)
    assert not _fast_fn(y2) and b2.dtype == b.dtype and b2.shape == b.shape and torch.equal(y, y2)


@pytest.mark.parametrize("kind", ["linear", "lnl", "mlp"])
def test_bad_input_same_errors(device, kind):
    m = _layer(kind, device, torch.float32)
    with pytest.raises(TypeError, match="inp has dtype torch.float64"):
        m(torch.randn(4, 24, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="last dimension 23; expected 24"):
        m(torch.randn(4, 23, device=device))
    with pytest.raises(ValueError, match="must be 2-D"):
        m(torch.randn(24, device=device))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        m([[0.0] * 24])


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
    torch.autograd.Function.apply unwraps it (the fast path skips apply's
    Python wrapper)."""
    leak = []

    def f(a):
        leak.append(a)
        return a.sum()

    torch.func.grad(f)(torch.randn(4, 24))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leak[0])
    m = _layer(kind, "cpu", torch.float32)
    y = m(leak[0])
    assert _fast_fn(y)
    assert torch.equal(y, m(torch._C._functorch.unwrap_if_dead(leak[0])))


# -- the fast path's engine entry points (csrc/python/ops.c) --------------------------------------

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
    """A deep copy or an unpickled layer (also one pickled before plans
    existed: no _plan in its __dict__) runs the fast path with the same
    results."""
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
        assert _fast_fn(y2) and torch.equal(y2, y)


def test_mlp_off_the_common_case_takes_the_general_path(device):
    m = _layer("mlp", device, torch.float32)
    x = torch.randn(6, 24, device=device, requires_grad=True)
    assert _fast_fn(m(x))
    for attr in ("checkpoint", "delay_wgrad_compute", "return_layernorm_output"):
        setattr(m, attr, True)  # set after construction: the plan is remade
        assert m._plan is None
        out = m(x)
        assert not _fast_fn(out[0] if attr == "return_layernorm_output" else out), attr
        setattr(m, attr, False)
        assert _fast_fn(m(x))
    m2 = _layer("mlp", device, torch.float32, delay_wgrad_compute=True)
    y = m2(x)
    assert not _fast_fn(y)
    y.sum().backward()
    m2.backward_dw()
    assert m2.fc1_weight.grad is not None


def test_without_torch_private_entry_points_the_general_path_runs(monkeypatch):
    """A torch release lacking the private entry points the fast path uses
    (_fast.AVAILABLE False): every layer plans no fast path and computes the
    same results through the general path."""
    torch.manual_seed(0)
    fast = tec.Linear(16, 8, device="cpu")
    x = torch.randn(4, 16, requires_grad=True)
    y = fast(x)
    y.sum().backward()
    assert fast._fast_plan() is not False
    monkeypatch.setattr(_fast, "AVAILABLE", False)
    general = tec.Linear(16, 8, device="cpu")
    general.load_state_dict(fast.state_dict())
    assert general._fast_plan() is False
    x2 = x.detach().clone().requires_grad_(True)
    y2 = general(x2)
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(fast.weight.grad, general.weight.grad)



def test_temporaries_are_reused_per_thread_and_stream(monkeypatch):
    monkeypatch.setattr(_fast, "_temps", threading.local())
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    a = _fast._temp(x, (4, 3), -1, 0, _fast.T_PARTIAL)
    assert a.shape == (4, 3) and a.dtype == torch.bfloat16
    assert _fast._temp(x, (4, 3), -1, 0, _fast.T_PARTIAL) is a  # the same call again: reused
    assert _fast._temp(x, (4, 3), -1, 7, _fast.T_PARTIAL) is not a  # another stream: its own
    assert _fast._temp(x.float(), (4, 3), -1, 0, _fast.T_PARTIAL) is not a  # another dtype
    assert _fast._temp(x, (4, 2, 3), -1, 0, _fast.T_PARTIAL).shape == (4, 2, 3)
    assert _fast._temp(x, (4, 3), -1, 0, _fast.T_GATHERED) is not a  # another role: its own
    ws = _fast._temp_bytes(x, 100, -1, 0, _fast.T_NORM_WS)
    assert ws.dtype == torch.uint8 and ws.shape == (100,)
    assert _fast._temp_bytes(x, 100, -1, 0, _fast.T_NORM_WS) is ws
    other = []
    t = threading.Thread(target=lambda: other.append(_fast._temp(x, (4, 3), -1, 0, _fast.T_PARTIAL)))
    t.start()
    t.join()
    assert other[0] is not a  # another thread: its own


def test_temporaries_bounded(monkeypatch):
    monkeypatch.setattr(_fast, "_temps", threading.local())
    x = torch.zeros(2, 3)
    first = _fast._temp(x, (1, 3), -1, 0, _fast.T_PARTIAL)
    for r in range(2, 2 + _fast._TEMP_SLOTS):
        _fast._temp(x, (r, 3), -1, 0, _fast.T_PARTIAL)
    assert len(_fast._temps.slots) == _fast._TEMP_SLOTS
    assert _fast._temp(x, (1, 3), -1, 0, _fast.T_PARTIAL) is not first  # the oldest was dropped
    monkeypatch.setattr(_fast, "_TEMP_HELD", 48)  # bytes held: adding a temporary drops the oldest down to it
    _fast._temp(x, (1, 4), -1, 0, _fast.T_DY)
    assert sum(t.nbytes for t in _fast._temps.slots.values()) <= 48 and len(_fast._temps.slots) <= 3
    monkeypatch.setattr(_fast, "_TEMP_BYTES", 64)
    big = _fast._temp(x, (5, 4), -1, 0, _fast.T_PARTIAL)  # 80 bytes: above the limit, fresh every call
    assert _fast._temp(x, (5, 4), -1, 0, _fast.T_PARTIAL) is not big


def test_temporaries_not_while_capturing(monkeypatch):
    """On a CUDA device (code >= 0) a capture in progress gets a fresh
    tensor every call (shown on CPU tensors with the capture query mocked)."""
    monkeypatch.setattr(_fast, "_temps", threading.local())
    x = torch.zeros(2, 3)
    monkeypatch.setattr(_fast, "_capturing", lambda: False)
    a = _fast._temp(x, (4, 3), 0, 5, _fast.T_PARTIAL)
    assert _fast._temp(x, (4, 3), 0, 5, _fast.T_PARTIAL) is a
    monkeypatch.setattr(_fast, "_capturing", lambda: True)
    assert _fast._temp(x, (4, 3), 0, 5, _fast.T_PARTIAL) is not a
    monkeypatch.setattr(_fast, "_capturing", None)  # no query in this torch: never reused on CUDA
    assert _fast._temp(x, (4, 3), 0, 5, _fast.T_PARTIAL) is not a


def test_no_grad_norm_statistics_go_to_the_sink():
    m = _layer("lnl", "cpu", torch.float32)
    x = torch.randn(6, 24)
    with torch.no_grad():
        y = m(x)
    assert _fast._sinks[torch.device("cpu")].numel() >= 12
    assert torch.equal(y, m(x).detach())


@CUDA_SKIP
def test_temporaries_not_in_a_real_capture(monkeypatch):
    """torch.cuda.graph capture: the capture query answers, and every call
    gets a fresh tensor from the graph's pool; after it, reuse again."""
    monkeypatch.setattr(_fast, "_temps", threading.local())
    x = torch.zeros(2, 3, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    a = _fast._temp(x, (4, 3), 0, stream, _fast.T_PARTIAL)
    assert _fast._temp(x, (4, 3), 0, stream, _fast.T_PARTIAL) is a
    g = torch.cuda.CUDAGraph()
    got = []
    with torch.cuda.graph(g):
        s = torch.cuda.current_stream().cuda_stream
        got += [_fast._temp(x, (4, 3), 0, s, _fast.T_PARTIAL), _fast._temp(x, (4, 3), 0, s, _fast.T_PARTIAL)]
    assert got[0] is not got[1] and all(t is not a for t in got)
    assert _fast._temp(x, (4, 3), 0, stream, _fast.T_PARTIAL) is a
