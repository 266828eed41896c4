"""The steps of the three layers' autograd Functions, one version each: the
norm, fprop (Y = X W^T + b with the tensor-parallel collectives, or the
userbuffers overlap where the layer's flags ask for it and it pays), the
activation, and the backward's dgrad / wgrad with their collectives, the
norm's backward.

A step takes the call (module/_plan.Call: the engine's device code, GEMM
workspace, stream and dtype code) and contiguous tensors, and runs one engine
call per kernel sequence: where no collective separates them, a norm and its
GEMM (norm_linear_fwd), dgrad and wgrad (linear_bwd), or those and the norm's
backward (norm_linear_bwd) are one call. Outputs are allocated in their final
shape (no views) and what lives only within the call is a temporary
(module/_temporaries.py).
"""
import contextlib

import torch

from .. import _C
from ..distributed import _all_gather_into, _reduce_scatter_into, all_reduce
from . import _fp8, _fp8_gemm
from ._config import NO_UB, UB_FLAGS
from ._temporaries import (T_ACT_OUT, T_ACT_WS, T_DGRAD, T_DH, T_DLN, T_DY, T_GATHERED, T_LN_OUT, T_NORM_WS, T_PARTIAL,
                           T_WGRAD_INPUT, norm_stats, temp, temp_bytes)

_F32 = torch.float32
_U8 = torch.uint8
_NO_FLAGS = dict.fromkeys(UB_FLAGS, False)


def _mu_rsigma(p, rows, rms):
    """The addresses of mu (0 for RMSNorm) and rsigma in statistics at p."""
    return (0, p) if rms else (p, p + 4 * rows)


# ------------------------------------------------------------------ shapes


def out_dims(x, n, tp):
    """The output's shape for input x: x's leading dims with n features,
    the sequence (first) dim gathered (column) or scattered (row) under
    sequence parallelism."""
    sh = x.shape
    s = sh[0]
    if tp.sp:
        s = s * tp.size if tp.mode == "column" else s // tp.size if tp.mode == "row" else s
    return (s, n) if len(sh) == 2 else (s, sh[1], n)


def grown(t, size, tmp=None):
    """A fresh tensor like t with `size` times its first dimension; with
    tmp (the engine's device code, the stream, the role) a temporary."""
    sh = t.shape
    shape = (sh[0] * size,) + tuple(sh[1:])
    return t.new_empty(*shape) if tmp is None else temp(t, shape, *tmp)


def gather(x, tp, async_op=False, tmp=None):
    """Sequence parallel: the rows of x (along its first dimension) of every
    rank of tp's group, rank-major (with async_op: (them, the work to wait
    for or None)); x itself without sequence parallelism or on one rank."""
    if not tp.sp or tp.size == 1 or tp.mode is None:
        return (x, None) if async_op else x
    out = grown(x, tp.size, tmp)
    work = _all_gather_into(out, x, tp.group, async_op)
    return (out, work) if async_op else out


def bias_grad_only(dy, n):
    """The bias gradient without a weight gradient: dY's column sums, no GEMM."""
    return (dy if dy.dim() == 2 else dy.reshape(-1, n)).sum(0, dtype=_F32).to(dy.dtype)


def _bias_grad(call, dy, n):
    """The bias gradient: in FP8 the sums dY's cast took, else dY's own."""
    db = None if call.fp8 is None else _fp8_gemm.bias_grad(call.fp8, dy)
    return db if db is not None else bias_grad_only(dy, n)


def _rows(t):
    sh = t.shape
    return sh[0] if len(sh) == 2 else sh[0] * sh[1]


def new_rows(t, n):
    """A fresh tensor of t's (2-D or 3-D) leading dims with n features. Sizes
    are passed as ints: torch parses a torch.Size argument several times
    slower, a cost that shows on every call at small shapes."""
    sh = t.shape
    return t.new_empty(sh[0], n) if len(sh) == 2 else t.new_empty(sh[0], sh[1], n)


def new_like(t):
    """A fresh contiguous tensor of t's (2-D or 3-D) shape (ints, see new_rows)."""
    return t.new_empty(*t.shape)


def _as_2d(t):
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


# ------------------------------------------------------------ userbuffers


def in_comm_buffer(t, comms):
    """Whether the bytes of t (contiguous) lie in any of comms' buffers."""
    p = t.data_ptr()
    end = p + t.numel() * t.element_size()
    for c in comms:
        if c._overlaps(p, end):
            return True
    return False


def outside_buffers(t, ub):
    """t, or a copy of it if it lives in one of the layer's communicator
    buffers (a caller may pass get_buffer(local_chunk=True) as the input):
    what is saved for backward must not alias a buffer the next layer reuses."""
    if ub.enabled and in_comm_buffer(t, ub.comms.values()):
        return t.clone()
    return t


def _held(ub):
    """Every communicator of `ub` held by this thread (a backward's bulk
    start ... finish pairs and buffer reads belong together)."""
    stack = contextlib.ExitStack()
    for c in {id(c): c for c in ub.comms.values()}.values():
        stack.enter_context(c.exclusive())
    return stack


def fprop_overlap(call, tp, ub, x, w, bias):
    """fprop through the layer's communicator where its flags ask for the
    overlap and it pays at this shape (CommOverlap.take_overlap), else None.
    In FP8 the chunk GEMMs are FP8 GEMMs: a column layer gathers FP8 bytes
    (fp8_ag_gemm), a row layer's partials stay in the compute dtype, or are
    FP8 bytes through a communicator with fp8_buf (_fp8_gemm.output_partials)."""
    rows = x.shape[0]
    if not ub.enabled or rows == 0:
        return None
    if tp.mode == "column" and ub["ub_overlap_ag"]:
        c = ub.comms["fprop"]
        if c.take_overlap("ag", rows, x.shape[1], w.shape[0]):
            return c.ag_gemm(x, w, bias=bias) if call.fp8 is None else fp8_ag_gemm(call, c, x, w, bias, tp)
    elif tp.mode == "row" and ub["ub_overlap_rs"]:
        c = ub.comms["fprop"]
        if c.take_overlap("rs", rows // tp.size, x.shape[1], w.shape[0]):
            if call.fp8 is None:
                return c.gemm_rs(x, w, bias=bias)
            f = call.fp8
            qx, qw = f.input(x, True), f.weight(w)
            return c.gemm_rs(qx.data, qw.data, bias=bias, fp8=_fp8_gemm.chunk_gemm(f, qx, qw, 0, x.dtype),
                             fp8_partials=_fp8_gemm.output_partials(f, x.dtype) if c.fp8_buf else None)
    return None


def fp8_ag_gemm(call, comm, x, w, bias, tp):
    """A column layer's FP8 all-gather + GEMM: x (this rank's rows, 2-D)
    cast into its slot of the communicator's buffer with the scale the group
    shares, the FP8 bytes gathered while the chunk GEMMs run; backward keeps
    a copy of the local bytes (made on the comm stream), never the buffer."""
    f = call.fp8
    with comm.exclusive():
        slot = comm.get_buffer(local_chunk=True, shape=x.shape, dtype=_U8)
        qx = f.gather_input(x, slot, tp.group)
        qw = f.weight(w)
        keep = torch.empty_like(slot) if f.grad and not f.recomputing else None
        fuse = _fp8_gemm._bias_fused(x, bias)
        y = comm.ag_gemm(slot, qw.data, bias=bias if fuse else None, local_copy=keep,
                         fp8=_fp8_gemm.chunk_gemm(f, qx, qw, 0, x.dtype))
    if keep is not None:
        f.keep_input(keep)
    if bias is not None and not fuse:
        y += bias
    return y


def wgrad_gather_comm(x_local, w, tp, ub):
    """The communicator that gathers a column layer's input for wgrad on the
    copy engines when ub_bulk_dgrad does not: the layer's fprop communicator
    (it gathered the same input in the forward, so its buffer fits), idle
    during the backward unless it is also the dgrad one, and only where the
    forward overlapped at this shape. None: the collectives gather it."""
    if not (ub.enabled and tp.sp and ub["ub_overlap_ag"]):
        return None
    c = ub.comms["fprop"]
    if c is ub.comms.get("dgrad") or c is ub.comms.get("wgrad"):
        return None
    if x_local.numel() * x_local.element_size() * tp.size > c.nbytes:
        return None
    return c if c.pays("ag", x_local.shape[0], x_local.shape[1], w.shape[0]) else None


# ---------------------------------------------------------------- forward


def gemm(call, rows, n, k, x, w, b, out, local=True):
    """out [rows, n] = x [rows, k] w[n, k]^T (+ b), all contiguous; in FP8
    under an FP8 autocast (local: x is this rank's rows, not gathered ones)."""
    if call.fp8 is not None:
        _fp8_gemm.fprop(call.fp8, x, w, b, out, local)
        return
    _C.gemm(call.dev, call.code, call.code, 0, 1, rows, n, k, x.data_ptr(), k, w.data_ptr(), k, out.data_ptr(), n,
            0 if b is None else b.data_ptr(), 0, 0, call.ws, call.nbytes, call.stream)


def fprop(call, tp, ub, x, w, b, gi=0):
    """Y = X W^T + b with the layer's collectives: a column layer under
    sequence parallelism gathers X's rows first; a row layer all-reduces
    X W^T over the group (reduce-scatters it under sequence parallelism),
    then adds b. x: contiguous [rows, k] or [s, batch, k]. The output has
    the input's rank, except through a communicator (2-D). gi: which of the
    layer's GEMMs this is (its FP8 roles)."""
    n, k = w.shape
    if call.fp8 is not None:
        call.fp8.gi, ub = gi, _fp8_ub(call, ub)
    if ub.enabled:
        y = fprop_overlap(call, tp, ub, _as_2d(x), w, b)
        if y is not None:
            return y
    mode = tp.mode
    if mode == "row":
        y = x.new_empty(*out_dims(x, n, tp))
        out = temp(x, x.shape[:-1] + (n,), call.dev, call.stream, T_PARTIAL) if tp.sp and tp.size > 1 else y
        gemm(call, _rows(x), n, k, x, w, None, out)
        _reduce(out, y, tp)
        if b is not None:
            y += b
        return y
    if mode == "column" and tp.sp and tp.size > 1:
        x = gather(x, tp, tmp=(call.dev, call.stream, T_GATHERED))
        y = new_rows(x, n)
        gemm(call, _rows(x), n, k, x, w, b, y, local=False)
        return y
    y = new_rows(x, n)  # no collective: one GEMM into the output
    gemm(call, _rows(x), n, k, x, w, b, y)
    return y


def _fp8_ub(call, ub):
    """The userbuffers an FP8 call runs: the FP8 communicators under
    per-tensor scaling; none under block scaling (its per-block scales are
    not gathered through a communicator: the plain collectives run)."""
    return ub.for_fp8() if call.fp8.blocks is None else NO_UB


def _reduce(out, y, tp):
    """A row layer's reduction of its partial products `out` into y."""
    if tp.sp and tp.size > 1:
        _reduce_scatter_into(y, out, tp.group)
    else:
        all_reduce(y, tp.group, tp.size)


def norm(call, x, gamma, beta, eps, zcg, keep, out=None):
    """LayerNorm (beta given) or RMSNorm of x over its last dim: (ln_out,
    stats; see norm_stats). Without `keep` (no backward) ln_out is a
    temporary and stats None; `out` receives ln_out when given."""
    k = x.shape[-1]
    rows = _rows(x)
    if out is None:
        out = new_like(x) if keep else temp(x, x.shape, call.dev, call.stream, T_LN_OUT)
    stats, sp = norm_stats(call.device, rows, beta is None, keep)
    mu, rsigma = _mu_rsigma(sp, rows, beta is None)
    if rows == 0:  # no tokens: nothing to normalise
        return out, stats
    _C.norm_fwd(call.dev, call.code, rows, k, x.data_ptr(), gamma.data_ptr(), 0 if beta is None else beta.data_ptr(),
                out.data_ptr(), mu, rsigma, eps, zcg, call.stream)
    return out, stats


def norm_fprop(call, tp, ub, x, gamma, beta, eps, zcg, w, b, keep, want_gathered=False):
    """The norm, then fprop on the (gathered) normalised rows: (y, ln_out:
    this rank's normalised rows, stats, the gathered ln_out when asked and
    sequence parallel gathers it, else None). Where no collective separates
    them, norm and GEMM are one engine call; with ub_overlap_ag the norm
    writes straight into the communicator's buffer."""
    n, k = w.shape
    rows = _rows(x)
    fp8 = call.fp8 is not None
    if fp8:
        call.fp8.gi, ub = 0, _fp8_ub(call, ub)
    if ub.enabled and tp.mode == "column" and ub["ub_overlap_ag"] and rows and not (fp8 and want_gathered) and \
            ub.comms["fprop"].take_overlap("ag", rows, k, n):
        if fp8:  # the norm's output is cast into the buffer, in FP8
            ln_out, stats = norm(call, x, gamma, beta, eps, zcg, keep)
            y = fp8_ag_gemm(call, ub.comms["fprop"], _as_2d(ln_out), w, b, tp)
            return y, ln_out, stats, None
        return _norm_ag_gemm(call, ub.comms["fprop"], x, gamma, beta, eps, zcg, w, b, tp, keep, want_gathered)
    column_sp = tp.mode == "column" and tp.sp and tp.size > 1
    # FP8 with the norm, casts and GEMM in one engine call (given tokens: without, the general path still
    # casts the weight, which records its amax)
    one_call = fp8 and not ub.enabled and not column_sp and rows > 0 and _fp8_gemm.one_call_ok(call.fp8, w)
    if not one_call and (ub.enabled or fp8 or column_sp):
        ln_out, stats = norm(call, x, gamma, beta, eps, zcg, keep)
        if column_sp:
            dev, stream = call.dev, call.stream
            ln_total = gather(ln_out, tp, tmp=None if want_gathered else (dev, stream, T_GATHERED))
            y = new_rows(ln_total, n)
            gemm(call, _rows(ln_total), n, k, ln_total, w, b, y, local=False)
            return y, ln_out, stats, (ln_total if want_gathered else None)
        return fprop(call, tp, ub, ln_out, w, b), ln_out, stats, None
    # one engine call: the norm, then the GEMM (in FP8: the casts and the GEMM), a row layer's partial
    # product, reduced, then the bias
    dev, stream = call.dev, call.stream
    ln_out = new_like(x) if keep else temp(x, x.shape, dev, stream, T_LN_OUT)
    stats, sp = norm_stats(call.device, rows, beta is None, keep)
    mu, rsigma = _mu_rsigma(sp, rows, beta is None)
    row = tp.mode == "row"
    y = x.new_empty(*out_dims(x, n, tp))
    out = temp(x, x.shape[:-1] + (n,), dev, stream, T_PARTIAL) if row and tp.sp and tp.size > 1 else y
    if rows == 0:  # no tokens: an empty output (a row layer still takes part in the reduction)
        if row:
            _reduce(out, y, tp)
        return y, ln_out, stats, None
    beta_p = 0 if beta is None else beta.data_ptr()
    if one_call:
        _fp8_gemm.fprop_one_call(call.fp8, ln_out, w, None if row else b, _as_2d(out),
                            (x.data_ptr(), gamma.data_ptr(), beta_p, ln_out.data_ptr(), mu, rsigma, eps, zcg))
    else:
        _C.norm_linear_fwd(dev, call.code, rows, k, n, x.data_ptr(), gamma.data_ptr(), beta_p, ln_out.data_ptr(), mu,
                           rsigma, eps, zcg, w.data_ptr(), 0 if b is None or row else b.data_ptr(), out.data_ptr(),
                           call.ws, call.nbytes, stream)
    if row:
        _reduce(out, y, tp)
        if b is not None:
            y += b
    return y, ln_out, stats, None


def _norm_ag_gemm(call, comm, x, gamma, beta, eps, zcg, w, b, tp, keep, want_gathered):
    """The norm straight into this rank's slot of `comm`'s buffer, then the
    all-gather + GEMM overlap on it. ln_out (what is saved and returned) is a
    copy, never the buffer, made on the comm stream while the GEMMs run. The
    communicator is held for the sequence (another thread's operation between
    the norm and the gather would overwrite the slot)."""
    x2 = _as_2d(x)
    with comm.exclusive():
        slot = comm.get_buffer(local_chunk=True, shape=x2.shape, dtype=x.dtype)
        ln_view, stats = norm(call, x2, gamma, beta, eps, zcg, keep, out=slot)
        ln_out = torch.empty_like(x)
        y = comm.ag_gemm(ln_view, w, bias=b, local_copy=_as_2d(ln_out))
        ln_total = None
        if want_gathered:
            ln_total = comm.get_buffer(shape=(x2.shape[0] * tp.size, x2.shape[1]), dtype=x.dtype).clone()
    return y, ln_out, stats, ln_total


def act_fwd(call, act, x, keep, params):
    """The activation of x [rows, f1] (a gated one: [activation | gate]
    halves) into a fresh [rows, f1 or f1 / 2] (a temporary without `keep`)."""
    rows, f1 = _rows(x), x.shape[-1]
    cols = f1 // 2 if act >= 16 else f1
    shape = x.shape[:-1] + (cols,)
    a = new_rows(x, cols) if keep else temp(x, shape, call.dev, call.stream, T_ACT_OUT)
    _C.act_fwd(call.dev, act, call.code, rows, cols, x.data_ptr(), 0, a.data_ptr(), params[0], params[1], params[2],
               call.stream)
    return a


def act_bwd(call, act, dact, h, want_dbias, params, keep):
    """The activation's backward: (dh like h, the bias gradient (dh's column
    sums) or None); dh is a temporary unless `keep` (a delayed weight
    gradient reads it later)."""
    rows, f1 = _rows(h), h.shape[-1]
    cols = f1 // 2 if act >= 16 else f1
    dev, stream = call.dev, call.stream
    db = ws = None
    nbytes = 0
    if want_dbias:
        db = h.new_empty(f1)
        nbytes = _C.act_bwd_workspace_bytes(dev, act, rows, cols)
        ws = temp_bytes(h, nbytes, dev, stream, T_ACT_WS) if nbytes else None  # held until the call returns
    dh = new_like(h) if keep else temp(h, h.shape, dev, stream, T_DH)
    _C.act_bwd(dev, act, call.code, rows, cols, dact.data_ptr(), h.data_ptr(), dh.data_ptr(),
               0 if db is None else db.data_ptr(), 0 if ws is None else ws.data_ptr(), nbytes, params[0], params[1],
               params[2], stream)
    return dh, db


# --------------------------------------------------------------- backward


def linear_backward(call, tp, ub, dy, x, w, need_dx, wg, dx_out=None, gi=0):
    """A layer's linear backward: (dx, dw, db). dy: the output's gradient
    (contiguous, the compute dtype, the output's shape); x: the saved input
    (this rank's rows); w: the full weight; wg: the Wgrad (module/_wgrad.py),
    or None when neither the weight's nor the bias's gradient is wanted;
    dx_out: where dx goes (this rank's rows of the input's shape), else a
    fresh tensor. The userbuffers overlaps run as the layer's flags ask,
    where they pay at this shape. gi: which of the layer's GEMMs this is
    (its FP8 roles)."""
    if call.fp8 is not None:  # GEMM gi's FP8 operands are dropped once its backward is done
        call.fp8.begin_backward(gi, wg is not None and wg.need_w,
                                wg is not None and wg.with_bias and not wg.bias_from_local)
        try:
            return _linear_backward(call, tp, _fp8_ub(call, ub), dy, x, w, need_dx, wg, dx_out)
        finally:
            call.fp8.end_gemm(gi)
    return _linear_backward(call, tp, ub, dy, x, w, need_dx, wg, dx_out)


def _linear_backward(call, tp, ub, dy, x, w, need_dx, wg, dx_out):
    if dy.dim() != x.dim():  # a 2-D output (a communicator's) of a 3-D input
        dy = dy.view((-1,) + tuple(x.shape[1:-1]) + (dy.shape[-1],))
    if dy.numel() == 0 or x.numel() == 0:  # no tokens (the feature dims are never 0)
        return _no_tokens_backward(dy, x, w, need_dx, wg, dx_out)
    mode = tp.mode
    if mode == "row":
        return _row_backward(call, tp, ub, dy, x, w, need_dx, wg, dx_out)
    if ub.enabled:
        try:
            with _held(ub):
                return _column_backward(call, tp, ub, dy, x, w, need_dx, wg, dx_out)
        except BaseException:
            for comm in ub.comms.values():  # no bulk operation is left pending
                comm._abandon()
            raise
    if mode == "column" and tp.sp:
        return _column_backward(call, tp, NO_UB, dy, x, w, need_dx, wg, dx_out)
    # No gather (no parallel mode, or a column layer without sequence
    # parallelism): dgrad and wgrad in one engine call, then dgrad's
    # all-reduce over the group (a column layer on several ranks).
    dx = (dx_out if dx_out is not None else new_like(x)) if need_dx else None
    dw, db = _fused_linear_bwd(call, _rows(dy), dy, x, w, dx, wg, wg is not None and wg.with_bias)
    if dx is not None and mode == "column" and tp.size > 1:
        all_reduce(dx, tp.group, tp.size)
    if wg is not None:
        if not wg.plain:
            ops = None if call.fp8 is None or not wg.need_w else _fp8_gemm.wgrad_operands(call.fp8, dy, x)
            dw, db = wg(_as_2d(dy), _as_2d(x), NO_UB, fp8=ops)
        elif not wg.need_w:
            db = _bias_grad(call, dy, w.shape[0]) if wg.with_bias else None
    return dx, dw, db


def _no_tokens_backward(dy, x, w, need_dx, wg, dx_out):
    """A call without tokens: dx empty, the parameters' gradients zeros (or
    the Wgrad step's, which handles empty products)."""
    dx = (dx_out if dx_out is not None else new_like(x)) if need_dx else None
    if wg is None:
        return dx, None, None
    if not wg.plain:
        n, k = w.shape
        dw, db = wg(dy.reshape(-1, n), x.reshape(-1, k), NO_UB, dy.reshape(-1, n))
        return dx, dw, db
    dw = w.new_zeros(w.shape) if wg.need_w else None
    db = w.new_zeros(w.shape[0]) if wg.with_bias else None
    return dx, dw, db


def _fused_linear_bwd(call, rows, dy, x, w, dx, wg, with_db):
    """dx = dY W and, for a plain Wgrad, dW = dY^T X with the bias gradient
    (with_db) in one engine call. Returns (dw, db) or (None, None)."""
    n, k = w.shape
    dw = db = None
    if call.fp8 is not None:  # dgrad and wgrad as two FP8 GEMMs, the bias gradient from dY
        need_w = wg is not None and wg.plain and wg.need_w
        done = _fp8_gemm.linear_bwd_one_call(call.fp8, dy, dx, need_w, with_db and need_w)
        if done is not None:
            return done
        if dx is not None:
            _dgrad_gemm(call, rows, n, k, dy, w, dx)
        if wg is not None and wg.plain and wg.need_w:
            dw = _fp8_gemm.wgrad(_fp8_gemm.wgrad_operands(call.fp8, dy, x), dy.dtype)
            db = _bias_grad(call, dy, n) if with_db else None
        return dw, db
    if wg is not None and wg.plain and wg.need_w:
        dw = w.new_empty(n, k)
        if with_db:
            db = w.new_empty(n)
    if dx is not None or dw is not None:
        _C.linear_bwd(call.dev, call.code, rows, n, k, dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                      0 if dx is None else dx.data_ptr(), 0 if dw is None else dw.data_ptr(),
                      0 if db is None else db.data_ptr(), call.ws, call.nbytes, call.stream)
    return dw, db


def _wgrad(call, wg, dy, xt, ub, dy_local=None):
    """The weight gradient of a backward whose dgrad ran apart: (dw, db)."""
    n, k = dy.shape[-1], xt.shape[-1]
    ops = None if call.fp8 is None or not wg.need_w else _fp8_gemm.wgrad_operands(call.fp8, dy, xt)
    if not wg.plain:
        return wg(_as_2d(dy), _as_2d(xt), ub, None if dy_local is None else _as_2d(dy_local), fp8=ops)
    db_local = bias_grad_only(dy_local, n) if wg.bias_from_local and wg.with_bias else None
    if not wg.need_w:
        return None, (db_local if wg.bias_from_local else _bias_grad(call, dy, n) if wg.with_bias else None)
    if ops is not None:
        dw = _fp8_gemm.wgrad(ops, dy.dtype)
        return dw, (db_local if wg.bias_from_local else _bias_grad(call, dy, n) if wg.with_bias else None)
    dw = xt.new_empty(n, k)
    db = xt.new_empty(n) if wg.with_bias and not wg.bias_from_local else None
    _C.gemm(call.dev, call.code, call.code, 1, 0, n, k, _rows(dy), dy.data_ptr(), n, xt.data_ptr(), k, dw.data_ptr(),
            k, 0, 0 if db is None else db.data_ptr(), 0, call.ws, call.nbytes, call.stream)
    return dw, (db_local if wg.bias_from_local else db)


def _column_backward(call, tp, ub, dy, x, w, need_dx, wg, dx_out):
    """Column layer: dX = dY W, all-reduced over the group (reduce-scattered
    under sequence parallelism, or through the dgrad communicator with
    ub_overlap_rs_dgrad, or the wgrad one in bulk with ub_bulk_wgrad); dW on
    the input's rows, re-gathered under sequence parallelism while dgrad runs
    (in bulk on the copy engines with ub_bulk_dgrad, or the fprop
    communicator; wgrad_gather_comm)."""
    n, k = w.shape
    dev, stream = call.dev, call.stream
    column = tp.mode == "column" and tp.size > 1  # dgrad is reduced over the group
    sp = column and tp.sp
    f = ub.flags if ub.enabled else _NO_FLAGS
    need_w = wg is not None
    dx = (dx_out if dx_out is not None else new_like(x)) if need_dx else None
    xt = gathering = bulk_gather = None
    if need_w:
        bulk_gather = ub.comms["dgrad"] if f["ub_bulk_dgrad"] else wgrad_gather_comm(_as_2d(x), w, tp, ub)
    kept = _fp8_kept_input(call, x) if bulk_gather is not None else None
    if bulk_gather is not None:  # the input all-gather for wgrad runs during the dgrad GEMM (FP8 bytes in FP8)
        bulk_gather.bulk_ag_start(_as_2d(x) if kept is None else kept)
    elif need_w:
        tmp = (dev, stream, T_WGRAD_INPUT) if wg.plain else None  # a delayed Wgrad step keeps it
        if need_dx:
            xt, gathering = gather(x, tp, async_op=True, tmp=tmp)
        else:
            xt = gather(x, tp, tmp=tmp)
    partial = None
    if need_dx:
        rows = _rows(dy)
        if f["ub_overlap_rs_dgrad"] and ub.comms["dgrad"].take_overlap("rs", rows // tp.size, n, k):
            if call.fp8 is None:
                dx = ub.comms["dgrad"].gemm_rs(_as_2d(dy), w, transb=False).view(x.shape)
            else:  # dY [rows, n] times W's FP8 transpose [k, n]
                fp, qdy = call.fp8, call.fp8.grad_output(dy)
                qw = fp.weights[fp.gi]
                dx = ub.comms["dgrad"].gemm_rs(_as_2d(qdy.data), qw.data_t,
                                               fp8=_fp8_gemm.chunk_gemm(fp, qdy, qw, 1, dy.dtype)).view(x.shape)
        elif f["ub_bulk_wgrad"] and need_w:
            partial = dy.new_empty(rows, k)
            _dgrad_gemm(call, rows, n, k, dy, w, partial)
        else:
            out = temp(dx, dy.shape[:-1] + (k,), dev, stream, T_DGRAD) if sp else dx
            _dgrad_gemm(call, rows, n, k, dy, w, out)
            if sp:
                _reduce_scatter_into(dx, out, tp.group)
            elif column:
                all_reduce(dx, tp.group, tp.size)
    if bulk_gather is not None:
        xt = bulk_gather.bulk_ag_finish()
        if kept is not None:  # wgrad reads the transpose of the gathered bytes, a copy outside the buffer
            call.fp8.gathered_input(xt)
            xt = _fp8.stand_in(x, xt.shape)
    if partial is not None:
        ub.comms["wgrad"].bulk_rs_start(partial)
    dw = db = None
    if need_w:
        if gathering is not None:
            gathering.wait()
        dw, db = _wgrad(call, wg, dy, xt, ub)
    if partial is not None:
        dx = ub.comms["wgrad"].bulk_rs_finish().view(x.shape)
    return dx, dw, db


def _fp8_kept_input(call, x):
    """The local FP8 bytes the forward gathered for GEMM gi (FP8 overlap),
    which backward gathers again for wgrad, or None (not in FP8, or not
    kept: the compute-dtype rows are gathered and cast again)."""
    if call.fp8 is None:
        return None
    q = call.fp8.inputs.get(call.fp8.gi)
    return q.data if q is not None and q.data is not None and q.data_t is None else None


def _dgrad_gemm(call, rows, n, k, dy, w, out):
    """out [rows, k] = dY [rows, n] W [n, k] (in FP8 under an FP8 autocast)."""
    if call.fp8 is not None:
        _fp8_gemm.dgrad(call.fp8, dy, out)
        return
    _C.gemm(call.dev, call.code, call.code, 0, 0, rows, k, n, dy.data_ptr(), n, w.data_ptr(), k, out.data_ptr(), k,
            0, 0, 0, call.ws, call.nbytes, call.stream)


def _row_backward(call, tp, ub, dy_local, x, w, need_dx, wg, dx_out):
    """Row layer: dY's rows all-gathered under sequence parallelism (with
    ub_overlap_ag overlapped with dgrad, wgrad then reading the gathered dY
    from the communicator's buffer), dX = dY W, dW = dY^T X; the bias
    gradient is this rank's rows' under sequence parallelism (the framework
    sums it)."""
    n, k = w.shape
    if ub.enabled and ub["ub_overlap_ag"] and need_dx and ub.comms["dgrad"].take_overlap(
            "ag", _rows(dy_local), n, k):
        c = ub.comms["dgrad"]
        dy2 = _as_2d(dy_local)
        gathered = (dy2.shape[0] * c.tp_size, n)
        with c.exclusive():  # the gathered grad_output stays in the buffer until wgrad has read it
            if call.fp8 is None:
                dx = c.ag_gemm(dy2, w, transb=False).view(x.shape)
                dy = c.get_buffer(shape=gathered, dtype=dy2.dtype)
            else:  # dY's FP8 bytes gathered; wgrad reads the transpose of the gathered bytes
                f = call.fp8
                slot = c.get_buffer(local_chunk=True, shape=dy2.shape, dtype=_U8)
                qdy = f.gather_grad_output(dy2, slot, tp.group)
                qw = f.weights[f.gi]
                dx = c.ag_gemm(slot, qw.data_t, fp8=_fp8_gemm.chunk_gemm(f, qdy, qw, 1, dy2.dtype)).view(x.shape)
                # one rank: the gathered dY is dy2 (a bias gradient may sum it); under sequence
                # parallelism the bias gradient is the local rows' (bias_from_local)
                dy = dy2 if c.tp_size == 1 else _fp8.stand_in(dy2, gathered)
                if wg is not None and wg.need_w:
                    f.gathered_grad_output(qdy, c.get_buffer(shape=gathered, dtype=_U8), dy)
            dw = db = None
            if wg is not None:
                dw, db = _wgrad(call, wg, dy, _as_2d(x), ub, dy2)
        return dx, dw, db
    sp = tp.sp and tp.size > 1
    dy = gather(dy_local, tp, tmp=(call.dev, call.stream, T_DY) if wg is None or wg.plain else None) if sp \
        else dy_local
    dx = (dx_out if dx_out is not None else new_like(x)) if need_dx else None
    need_w = wg is not None
    if need_w and (not wg.plain or not wg.need_w):
        if dx is not None:
            _dgrad_gemm(call, _rows(dy), n, k, dy, w, dx)
        return (dx,) + _wgrad(call, wg, dy, x, ub, dy_local)
    with_db = need_w and wg.with_bias and not sp
    dw, db = _fused_linear_bwd(call, _rows(dy), dy, x, w, dx, wg, with_db)
    if need_w and wg.with_bias and sp:
        db = bias_grad_only(dy_local, n)
    return dx, dw, db


def norm_backward(call, dln, x, stats, gamma, zcg, rms, dx=None):
    """The norm's backward on this rank's rows: (dx, dgamma, dbeta; None for
    RMSNorm). Under sequence parallelism the parameter gradients are this
    rank's partial sums (the parameters carry `sequence_parallel` and the
    framework sums them, as with TransformerEngine)."""
    k = x.shape[-1]
    rows = _rows(x)
    dev, stream = call.dev, call.stream
    dx = new_like(x) if dx is None else dx
    dgamma = gamma.new_empty(k)
    dbeta = None if rms else gamma.new_empty(k)
    if rows == 0:  # no tokens: zero parameter gradients
        dgamma.zero_()
        if dbeta is not None:
            dbeta.zero_()
        return dx, dgamma, dbeta
    nbytes = _C.norm_bwd_workspace_bytes(dev, rows, k)
    ws = temp_bytes(x, nbytes, dev, stream, T_NORM_WS)
    mu, rsigma = _mu_rsigma(stats.data_ptr(), rows, rms)
    _C.norm_bwd(dev, call.code, rows, k, dln.data_ptr(), x.data_ptr(), mu, rsigma, gamma.data_ptr(), dx.data_ptr(),
                dgamma.data_ptr(), 0 if rms else dbeta.data_ptr(), zcg, ws.data_ptr(), nbytes, stream)
    return dx, dgamma, dbeta


def _fp8_norm_linear_backward(call, dy, x, ln_out, stats, gamma, zcg, rms, w, wg, gi):
    """norm_linear_backward in FP8 where no collective separates dgrad and
    the norm's backward: one engine call (dY's cast, dgrad into dln, wgrad,
    the norm's backward), or None where the general path must run."""
    f = call.fp8
    k = w.shape[1]
    rows = _rows(x)
    dev, stream = call.dev, call.stream
    need_w = wg is not None and wg.need_w
    with_db = wg is not None and wg.with_bias
    fused_db = with_db and need_w and not wg.bias_from_local
    f.begin_backward(gi, need_w, with_db and not wg.bias_from_local)
    if not _fp8_gemm.bwd_one_call_ok(f, dy, True, need_w, fused_db):
        return None
    try:
        dln = temp(ln_out, ln_out.shape, dev, stream, T_DLN)
        dx = new_like(x)
        dgamma = gamma.new_empty(k)
        dbeta = None if rms else gamma.new_empty(k)
        nbytes = _C.norm_bwd_workspace_bytes(dev, rows, k)
        ws = temp_bytes(x, nbytes, dev, stream, T_NORM_WS)
        mu, rsigma = _mu_rsigma(stats.data_ptr(), rows, rms)
        dw, db = _fp8_gemm.linear_bwd_one_call(f, dy, dln, need_w, fused_db,
                                          (x.data_ptr(), mu, rsigma, gamma.data_ptr(), dx.data_ptr(),
                                           dgamma.data_ptr(), 0 if dbeta is None else dbeta.data_ptr(), zcg,
                                           ws.data_ptr(), nbytes))
        return dx, dgamma, dbeta, dw, db
    finally:  # GEMM gi's FP8 operands are dropped once its backward is done
        f.end_gemm(gi)


def norm_linear_backward(call, tp, ub, dy, x, ln_out, stats, gamma, zcg, rms, w, wg, dln_extra=None, gi=0):
    """The backward of norm_fprop: (dx, dgamma, dbeta, dw, db). Where no
    collective separates them (no userbuffers; a row layer, or a column
    layer on one rank) dgrad, wgrad and the norm's backward are one engine
    call; otherwise linear_backward into this rank's rows of dln, then the
    norm's backward. dln_extra: a gradient of the returned normalised output
    (added to dln)."""
    n, k = w.shape
    rows = _rows(x)
    dev, stream = call.dev, call.stream
    fused = (not ub.enabled and rows and dln_extra is None and (tp.mode != "column" or tp.size == 1)
             and (wg is None or wg.plain))
    if fused and call.fp8 is not None and (tp.size == 1 or tp.mode == "row" and not tp.sp):
        done = _fp8_norm_linear_backward(call, dy, x, ln_out, stats, gamma, zcg, rms, w, wg, gi)
        if done is not None:
            return done
    if not fused or call.fp8 is not None:
        dln = temp(ln_out, ln_out.shape, dev, stream, T_DLN)
        dln, dw, db = linear_backward(call, tp, ub, dy, ln_out, w, True, wg, dln, gi)
        if dln_extra is not None:
            dln = dln + dln_extra
        return norm_backward(call, dln, x, stats, gamma, zcg, rms) + (dw, db)
    sp = tp.sp and tp.size > 1 and tp.mode == "row"
    dy_local = dy
    if sp:
        dy = gather(dy, tp, tmp=(dev, stream, T_DY))
    dx = new_like(x)
    dgamma = gamma.new_empty(k)
    dbeta = None if rms else gamma.new_empty(k)
    dw = db = None
    if wg is not None and wg.need_w:
        dw = w.new_empty(n, k)
        if wg.with_bias and not sp:
            db = w.new_empty(n)
    if wg is not None and wg.with_bias and (sp or not wg.need_w):
        db = bias_grad_only(dy_local if sp else dy, n)
    es = x.element_size()
    dln_bytes = (rows * k * es + 255) // 256 * 256
    norm_bytes = _C.norm_bwd_workspace_bytes(dev, rows, k)
    scratch = temp_bytes(x, dln_bytes + norm_bytes, dev, stream, T_DLN)
    scr = scratch.data_ptr()
    mu, rsigma = _mu_rsigma(stats.data_ptr(), rows, rms)
    _C.norm_linear_bwd(dev, call.code, rows, k, n, dy.data_ptr(), x.data_ptr(), ln_out.data_ptr(), mu, rsigma,
                       gamma.data_ptr(), zcg, w.data_ptr(), scr, dx.data_ptr(), dgamma.data_ptr(),
                       0 if dbeta is None else dbeta.data_ptr(), 0 if dw is None else dw.data_ptr(),
                       0 if db is None or dw is None or sp else db.data_ptr(), scr + dln_bytes, norm_bytes, call.ws,
                       call.nbytes, stream)
    return dx, dgamma, dbeta, dw, db
