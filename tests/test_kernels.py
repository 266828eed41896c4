"""Each engine kernel against a float64 reference: fresh random non-zero
inputs, outputs poisoned (NaN) before the call so unwritten elements show."""
import pytest
import torch
import torch.nn.functional as F

from transformer_engine_c import _engine
from helpers import TOL, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(*shape, dtype, device, scale=1.0, offset=0.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + offset).to(dtype).to(device)


def poison(t):
    return t.fill_(float("nan"))


def norm_ref(x, g, b, eps, zcg):
    x, g = x.double().cpu(), g.double().cpu()
    g = g + 1 if zcg else g
    if b is None:
        rs = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x * rs * g, None, rs.squeeze(-1)
    mu = x.mean(-1, keepdim=True)
    rs = torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps)
    return (x - mu) * rs * g + b.double().cpu(), mu.squeeze(-1), rs.squeeze(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("zcg", [False, True])
@pytest.mark.parametrize("shape", [(1, 100), (37, 256), (64, 1000), (9, 1536), (33, 4096)])
def test_norm_fwd(device, dtype, rms, zcg, shape):
    rows, cols = shape
    x = rand(rows, cols, dtype=dtype, device=device, scale=2.0, offset=0.5)
    g = rand(cols, dtype=dtype, device=device, scale=0.3, offset=0.0 if zcg else 1.0)
    b = None if rms else rand(cols, dtype=dtype, device=device, scale=0.5)
    out = poison(torch.empty_like(x))
    y, mu, rs = _engine.norm_fwd(x, g, b, 1e-5, zcg, out=out)
    assert y.data_ptr() == out.data_ptr()
    yr, mur, rsr = norm_ref(x, g, b, 1e-5, zcg)
    assert rel_err(y, yr) < TOL[dtype]
    assert rel_err(rs, rsr) < 1e-5
    if not rms:
        assert rel_err(mu, mur) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("zcg", [False, True])
@pytest.mark.parametrize("shape", [(1, 100), (37, 256), (130, 768), (33, 4096)])
def test_norm_bwd(device, dtype, rms, zcg, shape):
    rows, cols = shape
    x = rand(rows, cols, dtype=dtype, device=device, scale=2.0, offset=0.5)
    g = rand(cols, dtype=dtype, device=device, scale=0.3, offset=0.0 if zcg else 1.0)
    b = None if rms else rand(cols, dtype=dtype, device=device, scale=0.5)
    dy = rand(rows, cols, dtype=dtype, device=device)
    _, mu, rs = _engine.norm_fwd(x, g, b, 1e-5, zcg)
    dx, dg, db = _engine.norm_bwd(dy, x, mu, rs, g, zcg, with_dbeta=not rms)
    xr = x.double().cpu().requires_grad_()
    gr = g.double().cpu().requires_grad_()
    br = None if rms else b.double().cpu().requires_grad_()
    yr, _, _ = norm_ref(xr, gr, br, 1e-5, zcg)
    yr.backward(dy.double().cpu())
    assert rel_err(dx, xr.grad) < 2 * TOL[dtype]
    assert rel_err(dg, gr.grad) < 2 * TOL[dtype]
    if not rms:
        assert rel_err(db, br.grad) < 2 * TOL[dtype]



@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape", [(2048, 768), (4096, 768), (8192, 256)])
def test_norm_param_grads_sum_as_well_as_torch(rms, shape):
    """The CPU engine's dgamma / dbeta (column sums over the rows, float32)
    against float64: relative error no larger than PyTorch's own CPU
    LayerNorm / RMSNorm's at the row counts of training (TE's 126m model:
    hidden 768, 2048 tokens), and the same bits on every run."""
    rows, cols = shape
    torch.manual_seed(rows + cols + rms)
    x = rand(rows, cols, dtype=torch.float32, device="cpu", scale=2.0, offset=0.5)
    g = rand(cols, dtype=torch.float32, device="cpu", scale=0.3, offset=1.0)
    b = None if rms else rand(cols, dtype=torch.float32, device="cpu", scale=0.5)
    dy = rand(rows, cols, dtype=torch.float32, device="cpu")
    _, mu, rs = _engine.norm_fwd(x, g, b, 1e-5, False)
    dx, dg, db = _engine.norm_bwd(dy, x, mu, rs, g, False, with_dbeta=not rms)
    again = _engine.norm_bwd(dy, x, mu, rs, g, False, with_dbeta=not rms)
    assert torch.equal(again[1], dg) and (rms or torch.equal(again[2], db))
    xt, gt = x.clone().requires_grad_(), g.clone().requires_grad_()
    bt = None if rms else b.clone().requires_grad_()
    yt = F.rms_norm(xt, (cols,), gt, 1e-5) if rms else F.layer_norm(xt, (cols,), gt, bt, 1e-5)
    yt.backward(dy)
    xr, gr = x.double().requires_grad_(), g.double().requires_grad_()
    br = None if rms else b.double().requires_grad_()
    norm_ref(xr, gr, br, 1e-5, False)[0].backward(dy.double())
    pairs = [(dg, gt.grad, gr.grad, "dgamma")] + ([] if rms else [(db, bt.grad, br.grad, "dbeta")])
    for ours, theirs, ref, name in pairs:
        err, torch_err = rel_err(ours, ref), rel_err(theirs, ref)
        assert err <= torch_err, f"{name}: relative error {err:.3g}, PyTorch's {torch_err:.3g}"


def gemm_ref(a, b, transa, transb, bias=None):
    a, b = a.double().cpu(), b.double().cpu()
    a = a.t() if transa else a
    b = b.t() if transb else b
    y = a @ b
    return y + bias.double().cpu() if bias is not None else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (33, 65, 17), (128, 96, 256)])
def test_gemm(device, dtype, layout, mnk):
    m, n, k = mnk
    transa, transb = {"fprop": (False, True), "dgrad": (False, False), "wgrad": (True, False)}[layout]
    a = rand(*((k, m) if transa else (m, k)), dtype=dtype, device=device)
    b = rand(*((n, k) if transb else (k, n)), dtype=dtype, device=device)
    bias = rand(n, dtype=dtype, device=device) if layout == "fprop" else None
    out = poison(torch.empty(m, n, dtype=dtype, device=device))
    res = _engine.gemm(a, b, transa=transa, transb=transb, out=out, bias=bias,
                       bias_grad=layout == "wgrad")
    y = res[0] if layout == "wgrad" else res
    assert y.data_ptr() == out.data_ptr()
    assert rel_err(y, gemm_ref(a, b, transa, transb, bias)) < TOL[dtype]
    if layout == "wgrad":
        assert rel_err(res[1], (a.t() if transa else a).double().cpu().sum(1)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_accumulate_into_fp32(device, dtype):
    m, n, k = 48, 80, 64
    a = rand(k, m, dtype=dtype, device=device)
    b = rand(k, n, dtype=dtype, device=device)
    acc = rand(m, n, dtype=torch.float32, device=device)
    ref = acc.double().cpu() + gemm_ref(a, b, True, False)
    _engine.gemm(a, b, transa=True, out=acc, accumulate=True)
    assert rel_err(acc, ref) < TOL[dtype]


def _gemm_stats():
    """The CUDA GEMM's counters (tec_cuda_gemm_stats in gemm.cu): [fused, epilogue kernels,
    SIMT, plans, sweeps enqueued, sweeps read back, choices other than the heuristic's, plans evicted]."""
    import ctypes
    out = (ctypes.c_longlong * 8)()
    ctypes.CDLL(_engine._CUDA_LIB).tec_cuda_gemm_stats(out)
    return list(out)


_SWEEP_CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_kernels import _gemm_stats, rand, gemm_ref, poison, TOL, rel_err, _engine
tune = sys.argv[2] == "1"
dt, dev = torch.bfloat16, "cuda"
m, n, k = 1152, 1408, 704
a, b = rand(k, m, dtype=dt, device=dev), rand(k, n, dtype=dt, device=dev)
prod = gemm_ref(a, b, True, False)
acc0 = rand(m, n, dtype=torch.float32, device=dev)
acc = acc0.clone()
s0 = _gemm_stats()
for _ in range(2):  # accumulating calls never sweep (a sweep would overwrite the accumulator)
    _engine.gemm(a, b, transa=True, out=acc, accumulate=True)
    torch.cuda.synchronize()
s1 = _gemm_stats()
assert s1[3] == s0[3] + 1 and s1[4] == s0[4], (s0, s1)
assert rel_err(acc, acc0.double().cpu() + 2 * prod) < TOL[dt]
out = poison(torch.empty(m, n, dtype=torch.float32, device=dev))
_engine.gemm(a, b, transa=True, out=out)  # same plan, overwriting: sweeps when tuning
torch.cuda.synchronize()
s2 = _gemm_stats()
assert s2[4] == s1[4] + tune and s2[5] == s1[5], (s1, s2)
assert rel_err(out, prod) < TOL[dt]
_engine.gemm(a, b, transa=True, out=acc, accumulate=True)  # reads the sweep back
torch.cuda.synchronize()
s3 = _gemm_stats()
assert s3[4] == s2[4] and s3[5] == s2[5] + tune, (s2, s3)
assert rel_err(acc, acc0.double().cpu() + 3 * prod) < TOL[dt]
for _ in range(2):
    y = _engine.gemm(a, b, transa=True, out=poison(out))
    assert rel_err(y, prod) < TOL[dt]
assert _gemm_stats()[3:6] == s3[3:6]
# Fused epilogues: the candidates also write the bias (fprop) or the bias gradient (wgrad).
m2, n2, k2 = 1088, 1216, 640
for layout in ("fprop", "wgrad"):
    if layout == "fprop":
        a2, b2, bias = rand(m2, k2, dtype=dt, device=dev), rand(n2, k2, dtype=dt, device=dev), rand(n2, dtype=dt, device=dev)
        ref = gemm_ref(a2, b2, False, True, bias)
    else:
        a2, b2 = rand(k2, m2, dtype=dt, device=dev), rand(k2, n2, dtype=dt, device=dev)
        ref, ref_bg = gemm_ref(a2, b2, True, False), a2.t().double().cpu().sum(1)
    t0 = _gemm_stats()
    for _ in range(3):  # sweeps, reads back, runs the choice
        if layout == "fprop":
            y = _engine.gemm(a2, b2, transb=True, bias=bias, out=poison(torch.empty(m2, n2, dtype=dt, device=dev)))
        else:  # outputs poisoned: a call that wrote nothing must not pass on a reused block
            from transformer_engine_c import _C
            y = poison(torch.empty(m2, n2, dtype=dt, device=dev))
            bg = poison(torch.empty(m2, dtype=dt, device=dev))
            nbytes = _C.gemm_workspace_bytes(0)
            ws = _engine.workspace(torch.device(dev, 0), nbytes)
            _C.gemm(0, 1, 1, 1, 0, m2, n2, k2, a2.data_ptr(), m2, b2.data_ptr(), n2, y.data_ptr(), n2, None,
                    bg.data_ptr(), 0, ws.data_ptr(), nbytes, _engine.stream_of(dev))
            torch.cuda.synchronize()
            assert rel_err(bg, ref_bg) < TOL[dt], layout
        torch.cuda.synchronize()
        assert rel_err(y, ref) < TOL[dt], layout
    t1 = _gemm_stats()
    assert t1[0] > t0[0], ("the epilogue was not fused", t0, t1)
    assert t1[4] == t0[4] + tune and t1[5] == t0[5] + tune, (layout, t0, t1)
print("OK", _gemm_stats())
"""


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU on this machine (the algorithm sweep is cuBLASLt's)")
@pytest.mark.parametrize("tune", ["1", "0"])
def test_gemm_algorithm_sweep(tune):
    """With TEC_GEMM_TUNE=1 the first overwriting call of a shape sweeps cuBLASLt's
    candidates on the stream and a later call keeps the fastest; accumulating calls
    never sweep; every result is right whichever algorithm ran, fused bias and bias
    gradient included. Without it (the default) nothing sweeps. In a fresh process:
    the setting is read once. (With tuning on it expects cuBLASLt to offer more than
    one algorithm for these shapes, as it does on H200.)"""
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TEC_GEMM_TUNE=tune)
    r = subprocess.run([sys.executable, "-c", _SWEEP_CHECK, here, tune], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


def test_gemm_strided_chunk(device):
    """A row block of a larger matrix (leading dimension > columns)."""
    a = rand(64, 40, dtype=torch.float32, device=device)
    w = rand(24, 32, dtype=torch.float32, device=device)
    big = poison(torch.empty(64, 50, dtype=torch.float32, device=device))
    view = big[:, 10:34]
    from transformer_engine_c import _C
    dev = _engine.device_code(device)
    nbytes = _C.gemm_workspace_bytes(dev)
    ws = _engine.workspace(device, nbytes)
    _C.gemm(dev, 0, 0, 0, 1, 64, 24, 32, a.data_ptr(), 40, w.data_ptr(), 32, view.data_ptr(), 50,
            None, None, 0, ws.data_ptr() if ws is not None else None, nbytes, _engine.stream_of(device))
    assert rel_err(view, a[:, :32].double().cpu() @ w.double().cpu().t()) < TOL[torch.float32]
    assert torch.isnan(big[:, :10]).all() and torch.isnan(big[:, 34:]).all()


def test_gemm_bad_leading_dim():
    from transformer_engine_c import _C
    a = torch.randn(4, 4)
    with pytest.raises(ValueError, match="leading dimension"):
        _C.gemm(-1, 0, 0, 0, 0, 4, 4, 4, a.data_ptr(), 2, a.data_ptr(), 4, a.data_ptr(), 4,
                None, None, 0, None, 0, 0)


def test_norm_layer_matches_torch(device):
    x = rand(16, 64, dtype=torch.float32, device=device)
    g = rand(64, dtype=torch.float32, device=device, offset=1.0)
    b = rand(64, dtype=torch.float32, device=device)
    y, _, _ = _engine.norm_fwd(x, g, b, 1e-5)
    assert rel_err(y, F.layer_norm(x, (64,), g, b, 1e-5)) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape", [(3, 7), (257, 1024), (2, 8192), (3, 12288), (2, 40000)])
@pytest.mark.parametrize("misaligned", [False, True])
def test_norm_edge_shapes(device, dtype, rms, shape, misaligned):
    """Wide rows (the block-per-row paths) and views offset by one element
    (the unaligned path), forward and backward."""
    rows, cols = shape
    off = 1 if misaligned else 0

    def view(t):
        buf = torch.empty(t.numel() + off, dtype=t.dtype, device=t.device)
        v = buf[off:].view(t.shape)
        v.copy_(t)
        return v

    x = view(rand(rows, cols, dtype=dtype, device=device, scale=2.0, offset=0.5))
    g = rand(cols, dtype=dtype, device=device, scale=0.3, offset=1.0)
    b = None if rms else rand(cols, dtype=dtype, device=device, scale=0.5)
    out = view(poison(torch.empty(rows, cols, dtype=dtype, device=device)))
    y, mu, rs = _engine.norm_fwd(x, g, b, 1e-5, False, out=out)
    yr, _, _ = norm_ref(x, g, b, 1e-5, False)
    assert rel_err(y, yr) < TOL[dtype]
    dy = view(rand(rows, cols, dtype=dtype, device=device))
    dx, dg, db = _engine.norm_bwd(dy, x, mu, rs, g, False, with_dbeta=not rms)
    xr = x.double().cpu().requires_grad_()
    gr = g.double().cpu().requires_grad_()
    br = None if rms else b.double().cpu().requires_grad_()
    norm_ref(xr, gr, br, 1e-5, False)[0].backward(dy.double().cpu())
    assert rel_err(dx, xr.grad) < 2 * TOL[dtype]
    assert rel_err(dg, gr.grad) < 2 * TOL[dtype]


@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_k_zero(device, accumulate):
    a = torch.empty(5, 0, device=device)
    b = torch.empty(0, 7, device=device)
    bias = rand(7, dtype=torch.float32, device=device)
    out = rand(5, 7, dtype=torch.float32, device=device)
    before = out.clone()
    if accumulate:
        _engine.gemm(a, b, out=out, accumulate=True)
        assert torch.equal(out, before)
    else:
        _engine.gemm(a, b, out=out, bias=bias)
        assert torch.equal(out.cpu(), bias.cpu().expand(5, 7))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mnk", [(3, 100, 17), (100, 3, 1)])
def test_gemm_misaligned(device, dtype, mnk):
    m, n, k = mnk
    abuf = rand(m * k + 1, dtype=dtype, device=device)
    a = abuf[1:].view(m, k)
    b = rand(n, k, dtype=dtype, device=device)
    y = _engine.gemm(a, b, transb=True)
    assert rel_err(y, gemm_ref(a, b, False, True)) < TOL[dtype]
