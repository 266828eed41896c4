"""The engine's FP8 linear steps (tec_fp8_linear_fwd / _bwd, csrc/core/fp8_steps.c):
each is one call that casts and multiplies, and must produce exactly what the
separate calls (_fp8_engine's quantize, amax, scale_from_amax and fp8_gemm)
produce: the same bytes, amax-history entries, scale_inv, bias gradient and
GEMM outputs. Delayed and current scaling, a cached weight, a fused bias, an
accumulated wgrad; and the refusals. On the CPU here, on CUDA where present
(scripts/gpu_validate.sh)."""
import pytest
import torch

from transformer_engine_c import _C
from transformer_engine_c import _fp8_engine as F
from transformer_engine_c._engine import DTYPE_CODES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CODE = F.FP8_DTYPES
BF16 = torch.bfloat16
NO_NORM_FWD = (0, 0, 0, 0, 0, 0, 0.0, 0)
NO_NORM_BWD = (0,) * 10


def f32(n, device, value=0.0):
    return torch.full((n,), value, dtype=torch.float32, device=device)


def u8(shape, device):
    return torch.full(shape, 0x5A, dtype=torch.uint8, device=device)  # a sentinel, never a cast's whole output


def ptr(t):
    return 0 if t is None else t.data_ptr()


def cast_args(x, fmt, scale=None, amax=None, sinv=None, data=None, data_t=None, current=None, pow2=0, eps=0.0):
    return (ptr(x), CODE[fmt], ptr(scale), ptr(amax), ptr(sinv), ptr(data), ptr(data_t), ptr(current), pow2,
            eps, 0, 0, 0)


def ws(device):
    return torch.empty(1 << 20, dtype=torch.uint8, device=device)


def reference_scale(x, fmt, current, pow2, eps, scale):
    """The scale the step casts with: `scale` (delayed) or x's own
    (current scaling, through the separate engine calls)."""
    if not current:
        return scale
    a = F.amax(x)
    s = torch.empty(1, dtype=torch.float32, device=x.device)
    F.scale_from_amax(a, fmt, power_2_scale=bool(pow2), amax_epsilon=eps, scale=s)
    return s


@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fwd_equals_the_separate_calls(device, current, cached, bias):
    gen = torch.Generator().manual_seed(3)
    rows, n, k = 48, 32, 64
    x = (torch.randn(rows, k, generator=gen) * 3).to(BF16).to(device)
    w = torch.randn(n, k, generator=gen).to(BF16).to(device)
    b = torch.randn(n, generator=gen).to(BF16).to(device) if bias else None
    sx, sw = f32(1, device, 4.0), f32(1, device, 16.0)
    # the reference: the separate calls
    hx, hw = f32(1, device, 0.5), f32(1, device, 0.5)
    rsx = reference_scale(x, E4M3, current, 1, 1e-3, sx)
    rsw = reference_scale(w, E4M3, current, 1, 1e-3, sw)
    qx, qxt, rsinv_x = F.quantize(x, E4M3, rsx, amax=None if current else hx, columnwise=True)
    qw, qwt, rsinv_w = F.quantize(w, E4M3, rsw, amax=None if current else hw, columnwise=True)
    want = F.fp8_gemm(qx, rsinv_x, E4M3, qw, rsinv_w, E4M3, out_dtype=BF16, bias=b, use_split_accumulator=False)
    # the step
    ax, aw = f32(1, device, 0.5), f32(1, device, 0.5)
    cur = f32(4, device) if current else None
    dx, dxt, sinv_x = u8((rows, k), device), u8((k, rows), device), f32(1, device)
    if cached:  # the weight's earlier cast, not cast again
        dw, sinv_w = qw.clone(), rsinv_w.clone()
        wa = cast_args(None, E4M3, sinv=sinv_w, data=dw)
    else:
        dw, dwt, sinv_w = u8((n, k), device), u8((k, n), device), f32(1, device)
        wa = cast_args(w, E4M3, None if current else sw, None if current else aw, sinv_w, dw, dwt,
                       None if cur is None else cur[2:], 1, 1e-3)
    xa = cast_args(x, E4M3, None if current else sx, None if current else ax, sinv_x, dx, dxt,
                   None if cur is None else cur[:2], 1, 1e-3)
    y = torch.empty(rows, n, dtype=BF16, device=device)
    work = ws(device)
    stream = 0 if device == "cpu" else torch.cuda.current_stream().cuda_stream
    dev = -1 if device == "cpu" else torch.cuda.current_device()
    _C.fp8_linear_fwd(dev, DTYPE_CODES[BF16], rows, n, k, *xa, *wa, ptr(b), y.data_ptr(), 1, work.data_ptr(),
                      work.numel(), stream, *NO_NORM_FWD)
    assert torch.equal(dx, qx) and torch.equal(dxt, qxt) and torch.equal(sinv_x, rsinv_x)
    assert torch.equal(dw, qw) and torch.equal(sinv_w, rsinv_w)
    if not cached:
        assert torch.equal(dwt, qwt)
    if not current:
        assert torch.equal(ax, hx) and (cached or torch.equal(aw, hw))
        assert float(ax) > 0.5  # the history entry was maxed into, not left
    assert torch.equal(y, want)


@pytest.mark.parametrize("current", [False, True])
@pytest.mark.parametrize("parts", ["both", "dgrad", "wgrad"])
@pytest.mark.parametrize("dbias", [False, True])
def test_linear_bwd_equals_the_separate_calls(device, current, parts, dbias):
    gen = torch.Generator().manual_seed(5)
    rows, n, k = 32, 48, 64
    dy = (torch.randn(rows, n, generator=gen) * 0.01).to(BF16).to(device)
    x = torch.randn(rows, k, generator=gen).to(BF16).to(device)
    w = torch.randn(n, k, generator=gen).to(BF16).to(device)
    _, qxt, sinv_x = F.quantize(x, E4M3, f32(1, device, 8.0), rowwise=False, columnwise=True)
    _, qwt, sinv_w = F.quantize(w, E4M3, f32(1, device, 32.0), rowwise=False, columnwise=True)
    dgrad, wgrad = parts in ("both", "dgrad"), parts in ("both", "wgrad")
    sdy, hdy = f32(1, device, 2.0 ** 12), f32(1, device)
    rs = reference_scale(dy, E5M2, current, 0, 0.0, sdy)
    rdb = torch.empty(n, dtype=BF16, device=device) if dbias else None
    qdy, qdyt, rsinv = F.quantize(dy, E5M2, rs, amax=None if current else hdy, columnwise=True, dbias=rdb)
    want_dx = F.fp8_gemm(qdy, rsinv, E5M2, qwt, sinv_w, E4M3, out_dtype=BF16)
    main = torch.randn(n, k, generator=gen).to(device)
    want_dw = F.fp8_gemm(qdyt, rsinv, E5M2, qxt, sinv_x, E4M3, out_dtype=torch.float32, out=main.clone(),
                         accumulate=True)
    d, dt, sinv, amax = u8((rows, n), device), u8((n, rows), device), f32(1, device), f32(1, device)
    cur = f32(2, device) if current else None
    dya = cast_args(dy, E5M2, None if current else sdy, None if current else amax, sinv, d if dgrad else None,
                    dt if wgrad else None, cur)
    db = torch.empty(n, dtype=BF16, device=device) if dbias else None
    nb = _C.fp8_quantize_workspace_bytes(rows, n) if dbias else 0
    dbws = torch.empty(max(nb, 1), dtype=torch.uint8, device=device)
    dx = torch.empty(rows, k, dtype=BF16, device=device) if dgrad else None
    dw = main.clone() if wgrad else None
    work = ws(device)
    stream = 0 if device == "cpu" else torch.cuda.current_stream().cuda_stream
    dev = -1 if device == "cpu" else torch.cuda.current_device()
    _C.fp8_linear_bwd(dev, DTYPE_CODES[BF16], rows, n, k, *dya, ptr(db), ptr(dbws) if dbias else 0, nb,
                      qwt.data_ptr(), sinv_w.data_ptr(), CODE[E4M3], ptr(dx), 0, qxt.data_ptr(), sinv_x.data_ptr(),
                      CODE[E4M3], ptr(dw), DTYPE_CODES[torch.float32], 1, 0, work.data_ptr(), work.numel(), stream,
                      *NO_NORM_BWD)
    assert torch.equal(sinv, rsinv)
    if dgrad:
        assert torch.equal(d, qdy) and torch.equal(dx, want_dx)
    if wgrad:
        assert torch.equal(dt, qdyt) and torch.equal(dw, want_dw)
        assert not torch.equal(dw, main)  # accumulated into, not left
    if dbias:
        assert torch.equal(db, rdb)
    if not current:
        assert torch.equal(amax, hdy)


@pytest.mark.parametrize("rms", [False, True])
def test_norm_steps_equal_the_separate_calls(device, rms):
    """The norm fused ahead of the forward step (its output is what is
    cast) and the norm's backward after the backward step (of dgrad's
    output): exactly the separate norm_fwd / norm_bwd calls around the
    steps."""
    gen = torch.Generator().manual_seed(9)
    rows, n, k = 32, 48, 64
    dev = -1 if device == "cpu" else torch.cuda.current_device()
    stream = 0 if device == "cpu" else torch.cuda.current_stream().cuda_stream
    code = DTYPE_CODES[BF16]
    x = torch.randn(rows, k, generator=gen).to(BF16).to(device)
    g = (1 + 0.1 * torch.randn(k, generator=gen)).to(BF16).to(device)
    beta = None if rms else (0.1 * torch.randn(k, generator=gen)).to(BF16).to(device)
    w = torch.randn(n, k, generator=gen).to(BF16).to(device)
    work = ws(device)

    def stats():
        return f32(rows, device), (None if rms else f32(rows, device))

    # reference: the norm, then the forward step on its output
    ln_ref, (rs_ref, mu_ref) = torch.empty_like(x), stats()
    _C.norm_fwd(dev, code, rows, k, x.data_ptr(), g.data_ptr(), ptr(beta), ln_ref.data_ptr(), ptr(mu_ref),
                rs_ref.data_ptr(), 1e-5, 0, stream)
    outs = []
    for fused in (False, True):
        ln, (rs, mu) = (ln_ref, (rs_ref, mu_ref)) if not fused else (torch.empty_like(x), stats())
        s_x, s_w = f32(1, device, 4.0), f32(1, device, 16.0)
        d, dt, sx = u8((rows, k), device), u8((k, rows), device), f32(1, device)
        wd, wt, sw = u8((n, k), device), u8((k, n), device), f32(1, device)
        y = torch.empty(rows, n, dtype=BF16, device=device)
        norm = (x.data_ptr(), g.data_ptr(), ptr(beta), ln.data_ptr(), ptr(mu), rs.data_ptr(), 1e-5, 0) if fused \
            else NO_NORM_FWD
        _C.fp8_linear_fwd(dev, code, rows, n, k, *cast_args(ln, E4M3, s_x, None, sx, d, dt),
                          *cast_args(w, E4M3, s_w, None, sw, wd, wt), 0, y.data_ptr(), 1, work.data_ptr(),
                          work.numel(), stream, *norm)
        outs.append((ln, rs, y, d, dt, sx))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # backward: the step's dgrad into dln, then the norm's backward of it
    dy = (torch.randn(rows, n, generator=gen) * 0.01).to(BF16).to(device)
    nb = _C.norm_bwd_workspace_bytes(dev, rows, k)
    grads = []
    for fused in (False, True):
        dln, dx = torch.empty_like(x), torch.empty_like(x)
        dg, db = torch.empty_like(g), (None if rms else torch.empty_like(g))
        nws = torch.empty(max(nb, 1), dtype=torch.uint8, device=device)
        q, sinv, sdy = u8((rows, n), device), f32(1, device), f32(1, device, 2.0 ** 10)
        norm = (x.data_ptr(), ptr(mu_ref), rs_ref.data_ptr(), g.data_ptr(), dx.data_ptr(), dg.data_ptr(), ptr(db),
                0, nws.data_ptr(), nb) if fused else NO_NORM_BWD
        _C.fp8_linear_bwd(dev, code, rows, n, k, *cast_args(dy, E5M2, sdy, None, sinv, q),
                          0, 0, 0, wt.data_ptr(), sw.data_ptr(), CODE[E4M3], dln.data_ptr(), 0, 0, 0, CODE[E4M3],
                          0, code, 0, 0, work.data_ptr(), work.numel(), stream, *norm)
        if not fused:
            _C.norm_bwd(dev, code, rows, k, dln.data_ptr(), x.data_ptr(), ptr(mu_ref), rs_ref.data_ptr(),
                        g.data_ptr(), dx.data_ptr(), dg.data_ptr(), ptr(db), 0, nws.data_ptr(), nb, stream)
        grads.append((dln, dx, dg) + (() if rms else (db,)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert grads[1][1].abs().sum() > 0  # the norm's backward ran


_KEEP = []  # the tensors behind the addresses the refusal tests pass


def keep(*ts):
    _KEEP.extend(ts)
    return ts if len(ts) > 1 else ts[0]


def _fwd_call(device, **over):
    rows, n, k = 16, 16, 16
    x, s = keep(torch.ones(rows, k, dtype=BF16, device=device), f32(1, device, 1.0))
    a = dict(x=cast_args(x, E4M3, s, None, keep(f32(1, device)), keep(u8((rows, k), device))),
             w=cast_args(x, E4M3, s, None, keep(f32(1, device)), keep(u8((rows, k), device))), rows=rows)
    a.update(over)
    y = torch.empty(rows, n, dtype=BF16, device=device)
    work = ws(device)
    dev = -1 if device == "cpu" else torch.cuda.current_device()
    stream = 0 if device == "cpu" else torch.cuda.current_stream().cuda_stream
    _C.fp8_linear_fwd(dev, DTYPE_CODES[BF16], a["rows"], n, k, *a["x"], *a["w"], 0, y.data_ptr(), 1,
                      work.data_ptr(), work.numel(), stream, *a.get("norm", NO_NORM_FWD))
    return y


def test_steps_refuse_bad_input(device):
    x = keep(torch.ones(16, 16, dtype=BF16, device=device))
    assert torch.equal(_fwd_call(device), torch.full((16, 16), 16.0, dtype=BF16, device=device))
    no_data = cast_args(x, E4M3, keep(f32(1, device, 1.0)), None, keep(f32(1, device)), None)
    with pytest.raises(ValueError, match="x.data and w.data are required"):
        _fwd_call(device, x=no_data)
    with pytest.raises(ValueError, match="negative size"):
        _fwd_call(device, rows=-1)
    act = cast_args(x, E4M3, None, None, keep(f32(1, device)), keep(u8((16, 16), device)), None,
                    keep(f32(2, device)))[:10] + (1, 0, 0)
    with pytest.raises(ValueError, match="current scaling with a fused activation"):
        _fwd_call(device, x=act)
    with pytest.raises(ValueError, match="format"):
        _fwd_call(device, x=(x.data_ptr(), 7) + no_data[2:])
    dev = -1 if device == "cpu" else torch.cuda.current_device()
    dy = cast_args(x, E5M2, keep(f32(1, device, 1.0)), None, keep(f32(1, device)), keep(u8((16, 16), device)),
                   keep(u8((16, 16), device)))
    t, sinv = u8((16, 16), device), f32(1, device)
    out = torch.empty(16, 16, dtype=BF16, device=device)
    common = (0, 0, 0, t.data_ptr(), sinv.data_ptr(), 0)
    with pytest.raises(ValueError, match="multiple of 16"):
        _C.fp8_linear_bwd(dev, DTYPE_CODES[BF16], 8, 16, 16, *dy, *common, 0, 0, t.data_ptr(), t.data_ptr(), 0,
                          out.data_ptr(), DTYPE_CODES[BF16], 0, 0, 0, 0, 0, *NO_NORM_BWD)
    with pytest.raises(ValueError, match="dgrad needs dy.data and w_t"):
        _C.fp8_linear_bwd(dev, DTYPE_CODES[BF16], 16, 16, 16, *dy, 0, 0, 0, 0, 0, 0, out.data_ptr(), 0,
                          0, 0, 0, 0, DTYPE_CODES[BF16], 0, 0, 0, 0, 0, *NO_NORM_BWD)
    with pytest.raises(ValueError, match="the norm's backward needs dx"):
        _C.fp8_linear_bwd(dev, DTYPE_CODES[BF16], 16, 16, 16, *dy, 0, 0, 0, 0, 0, 0, 0, 0,
                          0, 0, 0, 0, DTYPE_CODES[BF16], 0, 0, 0, 0, 0, x.data_ptr(), *NO_NORM_BWD[1:])
    with pytest.raises(TypeError, match="fp8_linear_bwd"):
        _C.fp8_linear_bwd(dev)


# ------------------------------------------------------- through the layers

import transformer_engine_c as te  # noqa: E402
from transformer_engine_c.module import _fp8_gemm  # noqa: E402
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402


def _layer(kind, device, bias):
    torch.manual_seed(0)
    kw = dict(params_dtype=BF16, device=device, bias=bias)
    if kind == "Linear":
        return te.Linear(64, 96, **kw)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(64, 96, **kw)
    return te.LayerNormMLP(64, 128, **kw)


def _steps(m, recipe, device, first_mb, lead=(32,)):
    """Three training steps of m under recipe on inputs of leading dims
    `lead`: each step's output, input gradient and parameter gradients,
    then the FP8 state."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(3):
        x = torch.randn(*lead, 64, generator=gen).to(BF16).to(device).requires_grad_()
        dy = torch.randn(*lead, 64 if isinstance(m, te.LayerNormMLP) else 96, generator=gen).to(BF16).to(device)
        m.zero_grad(set_to_none=True)
        with te.autocast(enabled=True, recipe=recipe):
            y = m(x, is_first_microbatch=(i == 0) if first_mb else None)
        y.backward(dy)
        out += [y, x.grad] + [p.grad for p in m.parameters()]
    meta = getattr(m, "fp8_meta", {})
    for key in ("scaling_fwd", "scaling_bwd"):
        if key in meta:
            out += [meta[key].scale, meta[key].scale_inv, meta[key].amax_history]
    # copies: a later autocast's update also rolls the histories of metas still registered
    return [None if t is None else t.detach().clone() for t in out]


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("rname", ["delayed", "current"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("first_mb", [False, True])
def test_layers_one_call_equals_the_general_path(monkeypatch, device, kind, rname, bias, first_mb):
    """The one-call steps change nothing a layer computes: outputs,
    gradients and the delayed-scaling state bit for bit against the general
    path, over steps (a cached weight with is_first_microbatch); and they
    are the steps that ran (counted)."""
    recipe = DelayedScaling(amax_history_len=4) if rname == "delayed" else Float8CurrentScaling()
    calls = []
    real_fwd, real_bwd = _fp8_gemm.fprop_one_call, _fp8_gemm.linear_bwd_one_call
    monkeypatch.setattr(_fp8_gemm, "fprop_one_call", lambda *a: calls.append("f") or real_fwd(*a))
    monkeypatch.setattr(_fp8_gemm, "linear_bwd_one_call", lambda *a: calls.append("b") or real_bwd(*a))
    one = _steps(_layer(kind, device, bias), recipe, device, first_mb)
    assert "f" in calls and "b" in calls
    monkeypatch.setattr(_fp8_gemm, "ONE_CALL", False)
    general = _steps(_layer(kind, device, bias), recipe, device, first_mb)
    assert len(one) == len(general)
    for i, (a, b) in enumerate(zip(one, general)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"tensor {i} differs"


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("lead", [(24,), (8, 2), (0,)])
def test_layers_one_call_other_token_counts(monkeypatch, device, kind, lead):
    """3-D inputs, a token count wgrad takes on the general path (24: not a
    multiple of 16, padded there), and no tokens: the same results as the
    general path."""
    recipe = DelayedScaling(amax_history_len=4)
    one = _steps(_layer(kind, device, True), recipe, device, False, lead)
    monkeypatch.setattr(_fp8_gemm, "ONE_CALL", False)
    general = _steps(_layer(kind, device, True), recipe, device, False, lead)
    for i, (a, b) in enumerate(zip(one, general)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"tensor {i} differs"


def _prepared(kind, device, how):
    m = _layer(kind, device, True)
    if how == "frozen":  # no weight gradient, a bias gradient
        for name, p in m.named_parameters():
            if "weight" in name and "norm" not in name:
                p.requires_grad_(False)
    elif how == "fused":  # the weight gradient into main_grad (fp32), outside the one-call step
        m.fuse_wgrad_accumulation = True
        for name, p in m.named_parameters():
            if "weight" in name and "norm" not in name:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    return m


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("how", ["frozen", "fused"])
def test_layers_weight_gradient_elsewhere_equals_the_general_path(monkeypatch, device, kind, how):
    """A frozen weight with a trained bias, and fuse_wgrad_accumulation (the
    weight gradient into main_grad): the same gradients, main_grads and
    state as the general path."""
    recipe = DelayedScaling(amax_history_len=4)
    results = []
    for one_call in (True, False):
        monkeypatch.setattr(_fp8_gemm, "ONE_CALL", one_call)
        m = _prepared(kind, device, how)
        out = _steps(m, recipe, device, False)
        out += [p.main_grad.clone() for p in m.parameters() if hasattr(p, "main_grad")]
        results.append(out)
    for i, (a, b) in enumerate(zip(*results)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"tensor {i} differs"
