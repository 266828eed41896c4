"""The FP8 GEMMs of the layers' steps, run with a layer call's FP8Call
(module/_fp8.py: the recipe's formats, the operands' casts and what backward
keeps): fprop, dgrad and wgrad on FP8 operands, the overlap schedules' chunk
GEMMs and FP8 partials, and the one engine call per step that does a GEMM's
casts and the GEMM together where the call allows it.

tests/test_fp8_steps.py and tests/test_fp8_steps_fuzz.py compare the one-call
steps with the general path (ONE_CALL off).
"""
import torch
import torch.nn.functional as F

from .. import _C
from .. import _fp8_engine as E
from .._comm_overlap import FP8Gemm, FP8Partials
from .._engine import DTYPE_CODES
from ..quantization import FP8GlobalStateManager as _State
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8Tensor
from ._fp8 import Operand, same_tensor
from ._temporaries import T_FP8, temp_bytes

_U8, _F32 = torch.uint8, torch.float32
_CODES = E.FP8_DTYPES


# --------------------------------------------------------------- the GEMMs


def _as_2d(t):
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def _bias_fused(out, b):
    """Whether the FP8 GEMM may add b in its epilogue (a bf16 bias for a
    bf16 or fp32 output, fp16 for fp16)."""
    if b is None:
        return False
    return b.dtype is (torch.float16 if out.dtype is torch.float16 else torch.bfloat16)


def _gemm(c, a, qa, b, qb, out, bias, accumulate, split, ta=False, tb=False):
    """out [m, n] (+)= A [m, k] B [n, k]^T (+ bias) on FP8 data a, b of the
    Operands qa, qb (their scale_inv and format; ta / tb: a / b is the
    operand's data_t, with its block scales), through the call's device,
    workspace and stream; the layer checked the shapes."""
    m, k = a.shape
    n = b.shape[0]
    args = (c.dev, m, n, k, _CODES[qa.dtype], _CODES[qb.dtype], a.data_ptr(), max(k, 1), b.data_ptr(), max(k, 1),
            (qa.scale_inv_t if ta else qa.scale_inv).data_ptr(), (qb.scale_inv_t if tb else qb.scale_inv).data_ptr(),
            out.data_ptr(), n, DTYPE_CODES[out.dtype], 0 if bias is None else bias.data_ptr(), int(accumulate),
            0 if split else 1, c.ws, c.nbytes, c.stream)
    if qa.block:
        if m and n:  # no tokens: an empty product (empty block scales have no address for the engine)
            _C.fp8_block_gemm(*args, qa.block, qb.block)
    else:
        _C.fp8_gemm(*args)
    return out


def fprop(f, x, w, b, out, keep_t):
    """out = X W^T (+ b) in FP8 (x: [rows, k] or 3-D, out its [rows, n])."""
    if keep_t and one_call_ok(f, w):
        fprop_one_call(f, x, w, b, _as_2d(out))
        return
    qx = f.input(x, keep_t)
    qw = f.weight(w)
    o = _as_2d(out)
    fuse = _bias_fused(o, b)
    _gemm(f.call, _as_2d(qx.data), qx, qw.data, qw, o, b if fuse else None, False, f.split[0])
    if b is not None and not fuse:
        o += b


def output_partials(f, out_dtype):
    """The FP8Partials of GEMM gi's output, for a row layer's fprop
    reduce-scatter through a communicator with fp8_buf (TE's FP8 userbuffer):
    under DelayedScaling, the output role's (3 gi + 2) scale, scale_inv and
    amax-history entry, as TE's GEMM output quantizer; None under the other
    recipes (a partial's amax is known only after its GEMM) and for a float32
    output (FP8 partials sum into a 16-bit one)."""
    if not f.delayed or out_dtype is torch.float32:
        return None
    m = f.meta["scaling_fwd"]
    r = 3 * f.gi + 2
    return FP8Partials(f.fwd, m.scale[r:r + 1], m.scale_inv[r:r + 1], m.amax_history[0, r:r + 1])


def chunk_gemm(f, qa, qb, which, out_dtype):
    """The FP8Gemm of an overlap schedule's chunk GEMMs on Operands qa (the
    input or output gradient) and qb (the weight); which: 0 fprop, 1 dgrad
    (the recipe's accumulation mode)."""
    return FP8Gemm(qa.dtype, qa.scale_inv, qb.dtype, qb.scale_inv, out_dtype, fast_accum=not f.split[which])


def dgrad(f, dy, out):
    """out [rows, k] = dY W in FP8 (W's transpose of this call's forward)."""
    qdy = f.grad_output(dy)
    qw = f.weights[f.gi]
    _gemm(f.call, _as_2d(qdy.data), qdy, qw.data_t, qw, _as_2d(out), None, False, f.split[1], tb=True)


def bias_grad(f, dy):
    """dY's column sums (the bias gradient) from the cast of GEMM gi's
    output gradient, or None where that cast did not sum them (no bias
    gradient wanted, or another tensor than dy)."""
    q = f.grads.get(f.gi)
    return q.dbias if q is not None and q.dbias is not None and same_tensor(q.src, dy) else None


def wgrad_operands(f, dy, xt):
    """(dY^T, X^T) of GEMM gi as FP8 Operands, for wgrad now or later."""
    return f.grad_output(dy), f.wgrad_input(xt), f.split[2], f.call


def wgrad(ops, out_dtype, out=None, accumulate=False):
    """dW [n, k] = dY^T X from wgrad_operands' FP8 transposes, into `out`
    (accumulated with `accumulate`, e.g. an fp32 main_grad) or a fresh
    out_dtype tensor. A token count that is not a multiple of 16 (the GEMM's
    inner dimension) is padded with zero columns."""
    qdy, qx, split, c = ops
    a, b = qdy.data_t, qx.data_t
    rows = a.shape[1]
    if rows % 16:
        pad = 16 - rows % 16
        a, b = F.pad(a, (0, pad)), F.pad(b, (0, pad))
    if out is None:
        out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    return _gemm(c, a, qdy, b, qx, out, None, accumulate, split, ta=True, tb=True)


# ------------------------------------------------- one engine call per step
# The common case of a GEMM's forward and of its backward is one engine call
# (tec.h's tec_fp8_linear_fwd / _bwd: the casts and the GEMMs): per-tensor
# scaling, this rank's own rows, a plain weight, no recompute, no graph
# capture, a plain weight gradient. What those calls read only within the
# call (the input's rowwise bytes, dY's bytes, the current-scaling amax and
# scale, the bias-gradient workspace) lives in one temporary; what backward
# keeps (the input's and the weight's transposes and scale_inv) is an
# Operand as on the general path, which the general backward also reads.

# Whether the one-call steps run where they may (off: every FP8 step takes
# the general path; the tests compare the two).
ONE_CALL = True
_ALIGN = 256
_NO_CAST = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0)


_NO_NORM_FWD = (0, 0, 0, 0, 0, 0, 0.0, 0)
_NO_NORM_BWD = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def one_call_ok(f, w):
    """Whether GEMM gi's forward on this rank's rows may be one engine call
    (see above): per-tensor scaling, no recompute, the transposes kept, no
    activation to fuse under current scaling, a plain weight, no capture."""
    return (ONE_CALL and f.blocks is None and not f.recomputing and f.keep_t and (f.delayed or not f.produced)
            and type(w) is not Float8Tensor and type(w) is not Float8BlockwiseQTensor
            and not _State.fp8_graph_capturing())


def _up(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _cast_args(f, t, fp8_dtype, role, forward, qp, scale_inv, data, data_t, current, act=(0, 0, 0)):
    """The 13 arguments of one tec_fp8_cast of t (see _quantize's rules):
    delayed scaling reads the role's scale and maxes its amax-history entry;
    current scaling computes the amax and scale into `current` (two
    floats)."""
    if f.delayed:
        m = f.meta["scaling_fwd" if forward else "scaling_bwd"]
        return (t.data_ptr(), _CODES[fp8_dtype], m.scale.data_ptr() + 4 * role, m.amax_history.data_ptr() + 4 * role,
                scale_inv, data, data_t, 0, 0, 0.0) + act
    return (t.data_ptr(), _CODES[fp8_dtype], 0, 0, scale_inv, data, data_t, current, int(qp.power_2_scale),
            float(qp.amax_epsilon)) + act


def fprop_one_call(f, x, w, b, o, norm=_NO_NORM_FWD):
    """fprop's one engine call (see above): the casts of X (its transpose
    kept when backward runs) and of W (unless the layer's cached cast is
    reused), then the GEMM into o (2-D). norm: the 8 norm arguments of
    fp8_linear_fwd (its input, gamma, beta, x's address as its output, mu,
    rsigma, eps, zero_centered_gamma): the norm runs first, in the same
    call, and x is its output."""
    c, gi, dev = f.call, f.gi, x.device
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    n = w.shape[0]
    xsrc, act = x, (0, 0, 0)
    made = f.produced.get(x.data_ptr()) if f.produced else None
    if made is not None and made[0].numel() == x.numel():
        xsrc = made[1]
        act = (1, made[2], 0) if made[3] is None else (2, made[2], made[3].data_ptr())
    qw = _cached_weight(f, w)
    # the temporary: X's rowwise bytes, then the amax and scale of X and W under current scaling
    tmp = temp_bytes(x, _up(rows * k) + 16, c.dev, c.stream, T_FP8)
    p = tmp.data_ptr()
    cur = 0 if f.delayed else p + _up(rows * k)
    data_t = torch.empty((k, rows), dtype=_U8, device=dev) if f.grad else None
    sinv = torch.empty(1, dtype=_F32, device=dev)
    qp = f.qparams
    xa = _cast_args(f, xsrc, f.fwd, 3 * gi, True, qp and qp[0], sinv.data_ptr(), p,
                    0 if data_t is None else data_t.data_ptr(), cur, act)
    if qw is None:
        wd = torch.empty((n, k), dtype=_U8, device=dev)
        wt = torch.empty((k, n), dtype=_U8, device=dev) if f.grad else None
        qw = Operand(wd, wt, None, torch.empty(1, dtype=_F32, device=dev), f.fwd)
        wa = _cast_args(f, w, f.fwd, 3 * gi + 1, True, qp and qp[1], qw.scale_inv.data_ptr(), wd.data_ptr(),
                        0 if wt is None else wt.data_ptr(), cur + 8 if cur else 0)
        if f.first_mb is not None:
            f.layer.__dict__.setdefault("_fp8_weights", {})[gi] = qw
    else:
        wa = (0, _CODES[f.fwd], 0, 0, qw.scale_inv.data_ptr(), qw.data.data_ptr(), 0, 0, 0, 0.0, 0, 0, 0)
    fuse = _bias_fused(o, b)
    _C.fp8_linear_fwd(c.dev, DTYPE_CODES[x.dtype], rows, n, k, *xa, *wa, b.data_ptr() if fuse else 0, o.data_ptr(),
                      0 if f.split[0] else 1, c.ws, c.nbytes, c.stream, *norm)
    if b is not None and not fuse:
        o += b
    if f.grad:
        f.inputs[gi] = Operand(None, data_t, None, sinv, f.fwd)
        f.weights[gi] = qw


def _cached_weight(f, w):
    """The layer's cached FP8 weight of GEMM gi when this call may reuse it
    (a later micro-batch: FP8Call.weight's rule), else None."""
    if f.first_mb is not False:
        return None
    kept = f.layer.__dict__.get("_fp8_weights", {}).get(f.gi)
    if (kept is not None and kept.dtype is f.fwd and kept.block == 0 and kept.data.shape == w.shape
            and kept.data.device == w.device and (kept.data_t is not None or not f.grad)):
        return kept
    return None


def bwd_one_call_ok(f, dy, need_dx, need_w, with_db):
    """Whether GEMM gi's backward may be one engine call (linear_bwd_one_call):
    it does exactly the backward begin_backward announced (wgrad here when
    wanted, the bias gradient from dY's cast when wanted: else the general
    path, which casts dY for a weight gradient computed elsewhere and sums a
    bias gradient as before), its operands are there, and wgrad can take
    the token count."""
    if (not ONE_CALL or f.blocks is not None or f.recomputing or dy.dim() < 2 or need_w != f.need_wgrad
            or with_db != f.want_dbias):
        return False
    gi = f.gi
    if need_dx:
        qw = f.weights.get(gi)
        if qw is None or qw.data_t is None:
            return False
    if need_w:
        qx = f.inputs.get(gi)
        n = dy.shape[-1]
        if qx is None or qx.data_t is None or (dy.numel() // n if n else 0) % 16:
            return False
    return True


def linear_bwd_one_call(f, dy, dx, need_w, with_db, norm=_NO_NORM_BWD):
    """dgrad into dx (when given) and wgrad (need_w) of GEMM gi in one
    engine call, with the cast of dY (and its column sums: with_db):
    (dw, db), or None where the general path must run (block scaling, a
    recompute, a transpose not kept, a token count wgrad cannot take).
    norm: the 10 norm arguments of fp8_linear_bwd (the norm's input, mu,
    rsigma, gamma, its dx, dgamma, dbeta, zero_centered_gamma, workspace
    and its bytes): that norm's backward of dx runs in the same call."""
    if not bwd_one_call_ok(f, dy, dx is not None, need_w, with_db):
        return None
    gi = f.gi
    qx, qw = f.inputs.get(gi), f.weights.get(gi)
    n = dy.shape[-1]
    rows = dy.numel() // n
    c, dev = f.call, dy.device
    k = dx.shape[-1] if dx is not None else qx.data_t.shape[0]
    q = f.grads.get(gi)
    if q is not None and same_tensor(q.src, dy) and (q.data_t is not None or not need_w):
        da = (0, _CODES[q.dtype], 0, 0, q.scale_inv.data_ptr(), q.data.data_ptr() if q.data is not None else 0,
              0 if q.data_t is None else q.data_t.data_ptr(), 0, 0, 0.0, 0, 0, 0)
        db, ws, nbytes = (q.dbias if with_db else None), 0, 0
        with_db = False
        tmp = None
    else:
        nbytes = _C.fp8_quantize_workspace_bytes(rows, n) if with_db else 0
        size = _up(rows * n)
        # the temporary: dY's bytes, their transpose, the bias-gradient workspace, scale_inv and (current) amax, scale
        tmp = temp_bytes(dy, 2 * size + _up(nbytes) + 16, c.dev, c.stream, T_FP8)
        p = tmp.data_ptr()
        ws = p + 2 * size if nbytes else 0
        tail = p + 2 * size + _up(nbytes)
        qp = f.qparams
        da = _cast_args(f, dy, f.bwd, 2 * gi, False, qp and qp[2], tail, p if dx is not None else 0,
                        p + size if need_w else 0, tail + 8)
        db = dy.new_empty(n) if with_db else None
    dw = torch.empty((n, k), dtype=dy.dtype, device=dev) if need_w else None
    _C.fp8_linear_bwd(c.dev, DTYPE_CODES[dy.dtype], rows, n, k, *da, 0 if db is None or not with_db else db.data_ptr(),
                      ws, nbytes, 0 if dx is None else qw.data_t.data_ptr(), 0 if qw is None else qw.scale_inv.data_ptr(),
                      _CODES[qw.dtype if qw is not None else f.fwd], 0 if dx is None else dx.data_ptr(),
                      0 if f.split[1] else 1, 0 if dw is None else qx.data_t.data_ptr(),
                      0 if qx is None else qx.scale_inv.data_ptr(), _CODES[qx.dtype if qx is not None else f.fwd],
                      0 if dw is None else dw.data_ptr(), DTYPE_CODES[dy.dtype], 0,
                      0 if f.split[2] else 1, c.ws, c.nbytes, c.stream, *norm)
    return dw, db
