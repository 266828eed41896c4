"""The layers' fast path: Linear, LayerNormLinear and LayerNormMLP calls in the common case
(one weight tensor, no userbuffers or only communicators that fall back at
the call's shape, no autocast, plain parameters, a contiguous 2-D or 3-D
input of the parameters' dtype and device) with as little host work as the
engine needs. A fused or delayed
weight gradient runs the general path's Wgrad step.

On tiny shapes a layer call is all host work: every attribute read of a
tensor, every allocation and every Python frame counts. Here each tensor is
looked at once, outputs are allocated in their final shape (no views), the
autograd Function is entered through its C entry point (torch's Python
wrapper only unwraps functorch's dead tensors, and under functorch
transforms the general path runs), and each step is one engine call
(_C.linear_bwd, _C.norm_linear_fwd, _C.norm_linear_bwd). Under sequence
parallelism the collectives are the general path's, in its order: a column
layer gathers its (normalised) input rows before the GEMM and, in backward,
re-gathers them for wgrad while dgrad runs, then reduce-scatters dgrad (the
norm's backward follows on the local rows); a row layer reduce-scatters its
output before adding the bias and all-gathers grad_output in backward, its
bias gradient summed over the local rows. Anything off the
common case, a wrong input included, returns None and the layer takes its
general path, which raises the named errors: the semantics are the general
path's and the numerics the same engine kernels'."""
import threading
from math import prod as _prod

import torch

from .. import _C, _engine, debug
from ..distributed import _all_gather_into, _reduce_scatter_into, all_reduce
from . import _common
from ._common import NO_UB, Wgrad

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_DTYPE_CODES = _engine.DTYPE_CODES
_is_grad_enabled = torch.is_grad_enabled
# Private entry points of torch's (present from 2.1 to 2.13): where a release
# lacks one, every call takes the general path.
try:
    _any_autocast = torch._C._is_any_autocast_enabled
    _functorch_active = torch._C._are_functorch_transforms_active
    _function_apply = torch._C._FunctionBase.__dict__["apply"]
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    AVAILABLE = True
except (AttributeError, KeyError):
    AVAILABLE = False
_F32 = torch.float32
_U8 = torch.uint8
_empty = torch.empty
_raw_stream = _engine._raw_stream

# The layer attributes a plan is made from: setting one drops the layer's plan
# (TransformerEngineBaseModule.__setattr__).
PLAN_ATTRS = frozenset(("weight_names", "bias_names", "use_bias", "tp", "ub", "fuse_wgrad_accumulation",
                        "delay_wgrad_compute", "save_original_input", "return_layernorm_output",
                        "return_layernorm_output_gathered", "zero_centered_gamma", "eps", "normalization",
                        "in_local", "out_local", "tp2", "ub2", "checkpoint", "activation", "_act_kw",
                        "hidden_size", "size_per_partition", "set_parallel_mode"))

# Plan fields (a tuple: one index per read).
W, B, WSHAPE, BSHAPE, ROW_REDUCE, COL_REDUCE, TP, GAMMA, BETA, EPS, ZCG, WGRAD, SP, SIZE, UB = range(15)


def make_plan(layer):
    """What a fast call of `layer` needs, fixed until one of PLAN_ATTRS is set
    (fields: the constants above), or False off the common case. It holds the
    layer's TPConfig, not its group: a deep-copied layer shares the group."""
    if not AVAILABLE:
        return False
    if hasattr(layer, "tp2"):
        return _mlp_plan(layer)
    tp, ub = layer.tp, layer.ub
    ubp = _ub_plan(tp, ub) if ub.enabled else None
    if (len(layer.weight_names) != 1 or ub.enabled and ubp is None or getattr(layer, "save_original_input", False)
            or getattr(layer, "return_layernorm_output", False)):
        return False
    n, k = layer.out_local, layer.in_local
    size = tp.size
    norm = hasattr(layer, "normalization")
    # tp.sp: sequence parallel with a parallel mode (without one it only marks the norm's parameters)
    sp = tp.sp and tp.mode is not None
    if norm and tp.mode == "column" and size > 1 and not sp:
        return False  # dgrad is all-reduced between the GEMM and the norm's backward: the general path
    return (layer.weight_names[0], layer.bias_names[0] if layer.use_bias else None, (n, k), (n,),
            tp.mode == "row", tp.mode == "column" and size > 1 and not sp, tp,
            "layer_norm_weight" if norm else None,
            "layer_norm_bias" if norm and layer.normalization == "LayerNorm" else None,
            float(layer.eps) if norm else 0.0, 1 if norm and layer.zero_centered_gamma else 0,
            layer.fuse_wgrad_accumulation or layer.delay_wgrad_compute, sp, size, ubp)


# ------------------------------------------------- userbuffers that fall back
# A layer with ub_* flags whose communicators fall back at a call's shape
# (CommOverlap.take_overlap below min_chunk_flops) runs the non-overlapped
# collectives: the fast path runs it, counting the fallbacks as the general
# path does. Only the fprop / dgrad overlaps that can fall back qualify (the
# bulk ones always run); where one would overlap, the general path runs (in
# backward: its backward steps, with the layer's communicators).

def _ub_plan(tp, ub):
    """(the fprop overlap's op or None, the dgrad overlap's op or None), or
    None where the layer's flags are off the fast path."""
    f = ub.flags
    if not tp.sp or tp.mode is None or f["ub_bulk_dgrad"] or f["ub_bulk_wgrad"]:
        return None
    if tp.mode == "column":
        return ("ag" if f["ub_overlap_ag"] else None, "rs" if f["ub_overlap_rs_dgrad"] else None)
    return ("rs" if f["ub_overlap_rs"] else None, "ag" if f["ub_overlap_ag"] else None)


def _ub_forward_falls_back(layer, plan, x, rows):
    """Whether this call runs without overlap: x lies in no communicator's
    buffer (the general path copies it out) and the fprop overlap, if the
    flags ask for one, falls back (counted here, as take_overlap counts it)."""
    comms = layer.ub.comms
    if _common.in_comm_buffer(x, comms.values()):
        return False
    op = plan[UB][0]
    if op is None:
        return True
    n, k = plan[WSHAPE]
    r = rows // plan[SIZE] if plan[ROW_REDUCE] else rows
    return not comms["fprop"].take_overlap(op, r, k, n)  # True: it pays (nothing counted; the general path runs)


def _ub_backward_falls_back(layer, plan, x2d, w, rows, need_dx, need_wgrad):
    """Whether this backward runs without overlap (the fallbacks counted as
    the general path counts them), else False: the general path's backward
    steps run (a threshold lowered since the forward)."""
    comms, (fop, bop) = layer.ub.comms, plan[UB]
    n, k = plan[WSHAPE]
    column = not plan[ROW_REDUCE]
    if column and fop is not None and need_wgrad and _common.wgrad_gather_comm(
            x2d, w, plan[TP], layer.ub) is not None:
        return False  # the wgrad input would be gathered by the fprop communicator
    if bop is None or not need_dx:
        return True
    r = rows if column else rows // plan[SIZE]
    return not comms["dgrad"].take_overlap(bop, r, n, k)


def _general_backward(x2d, w, dy, state, need, iw, need_dx):
    """The general path's linear backward steps with the layer's
    communicators: (dx 2-D, dw, db); the weight and bias gradients are
    wanted as need[iw] and need[iw + 1] say."""
    plan, (rows, _, _), _, _, layer, first_mb = state
    wg = None
    if need[iw] or need[iw + 1]:
        wg = Wgrad(layer, w, need[iw + 1], first_mb, bias_from_local=plan[ROW_REDUCE], need_w=need[iw])
    steps = _common.row_backward if plan[ROW_REDUCE] else _common.column_backward
    return steps(dy.view(-1, dy.shape[-1]), x2d, w, plan[TP], layer.ub, need_dx, wg)


def _norm_backward(dln, x, stats, gamma, dx, dgamma, dbeta, zcg, rows, k, code, dev):
    """The norm's backward on this rank's rows (one engine call)."""
    d, stream = dev[1], dev[4]
    nbytes = _C.norm_bwd_workspace_bytes(d, rows, k)
    ws = _temp_bytes(x, nbytes, d, stream, T_NORM_WS)
    stp = stats.data_ptr()
    rms = dbeta is None
    _C.norm_bwd(d, code, rows, k, dln.data_ptr(), x.data_ptr(), 0 if rms else stp,
                stp if rms else stp + 4 * rows, gamma.data_ptr(), dx.data_ptr(), dgamma.data_ptr(),
                0 if rms else dbeta.data_ptr(), zcg, ws.data_ptr(), nbytes, stream)


_cpu = torch.device("cpu")
_cpu_dev = None  # (engine device code, workspace address, bytes) of the CPU, found on first use


def _device(x, params):
    """(torch.device, engine code, GEMM workspace address, its bytes, stream)
    when x and every tensor of `params` (None allowed) lie on one device,
    else None."""
    global _cpu_dev
    if x.is_cpu:
        for p in params:
            if p is not None and not p.is_cpu:
                return None
        if _cpu_dev is None:
            _cpu_dev = _engine._gemm_dev(_cpu)[:3]
        return (_cpu,) + _cpu_dev + (0,)
    if not x.is_cuda:
        return None
    index = x.get_device()  # an int: cheaper than torch.device objects
    for p in params:
        if p is not None and (p.get_device() != index or not p.is_cuda):
            return None
    cuda = _cuda_devs.get(index)
    if cuda is None:
        device = x.device
        cuda = _cuda_devs[index] = (device,) + (_engine._gemm_devs.get(device) or _engine._gemm_dev(device))[:3]
    return cuda + (_current_stream(index, cuda[0]),)


def _current_stream(index, device):
    """The raw current stream of CUDA device `index` (torch.device `device`)."""
    return _raw_stream(index) if _raw_stream is not None else _engine.stream_of(device)


_cuda_devs = {}  # CUDA ordinal -> (torch.device, engine code, GEMM workspace address, its bytes)


def _admit(x, grad):
    """x as torch's Function.apply would take it when grad is on (a tensor a
    finished functorch transform left, unwrapped), or None under an active
    functorch transform (the general path runs then)."""
    if not grad:
        return x
    if _functorch_active():
        return None
    return _unwrap_if_dead(x) if type(x) is _Tensor else x


def _placed(x, dtype, params):
    """(device, dtype code) of a call whose tensors share one device and
    whose dtype the engine takes, else None."""
    dev = _device(x, params)
    code = _DTYPE_CODES.get(dtype)
    return None if dev is None or code is None else (dev, code)


def _plain(t, dtype, shape):
    """t is a plain parameter of dtype and shape, contiguous (None passes)."""
    return t is None or (type(t) is _Parameter and t.dtype is dtype and t.shape == shape and t.is_contiguous())


def _rows(x, dtype, k):
    """(rows, s, b) of a plain contiguous input [rows, k] (b None) or
    [s, b, k] (rows = s * b > 0) of dtype, else None."""
    if type(x) is not _Tensor or x.dtype is not dtype:
        return None
    shape = x.shape
    nd = len(shape)
    if nd == 2:
        s, b = shape[0], None
        rows = s
    elif nd == 3:
        s, b = shape[0], shape[1]
        rows = s * b
    else:
        return None
    if shape[-1] != k or not rows or not x.is_contiguous():
        return None
    return rows, s, b


def _dims(s, b, n):
    """[s, n], or [s, b, n] for a 3-D call."""
    return (s, n) if b is None else (s, b, n)


def _new(x, s, b, n):
    """A fresh [s, n] or [s, b, n] tensor like x."""
    return x.new_empty(_dims(s, b, n))


def _grad_output(dout, dtype):
    """dout as backward needs it: contiguous, in the output's dtype."""
    if dout.dtype is not dtype:
        dout = dout.to(dtype)
    return dout if dout.is_contiguous() else dout.contiguous()


def _check_saved(t, dtype, shape, name):
    """A saved parameter still has its forward dtype, shape and layout (a
    `.data` swap between forward and backward would otherwise be read
    wrongly)."""
    if t.dtype is not dtype or t.shape != shape or not t.is_contiguous():
        raise RuntimeError(f"the layer's {name} changed between forward and backward: now {t.dtype} "
                           f"{tuple(t.shape)} strides {t.stride()}, was {dtype} {list(shape)} contiguous")


def _returned_bias(layer, b, dtype):
    """What return_bias returns: the bias parameter, or without one the
    layer's empty bias tensor, in the call's dtype (as the general path)."""
    if b is not None:
        return b
    b = getattr(layer, layer.bias_names[0])
    return b if b.dtype is dtype else b.to(dtype)


# Where a no-grad forward's norm writes its statistics: nothing reads them, so
# one float32 buffer per device serves every call and stream (writes racing
# into it are harmless) instead of an allocation per call. An outgrown buffer
# stays alive: a captured CUDA graph may still write to it.
_sinks = {}
_outgrown_sinks = []


def _stats_sink(device, count):
    """The address of at least `count` float32s of device's statistics sink."""
    t = _sinks.get(device)
    if t is None or t.numel() < count:
        if t is not None:
            _outgrown_sinks.append(t)
        t = _sinks[device] = _empty(max(count, 4096, 0 if t is None else 2 * t.numel()), dtype=_F32, device=device)
    return t.data_ptr()


def _norm_stats(device, rows, rms, keep):
    """(stats, its address) for a norm forward over `rows` rows: a fresh
    float32 [2 * rows] (LayerNorm: mu, then rsigma) or [rows] (RMSNorm) when
    backward keeps it, else (None, the statistics sink's address)."""
    count = rows if rms else 2 * rows
    if keep:
        stats = _empty(count, dtype=_F32, device=device)
        return stats, stats.data_ptr()
    return None, _stats_sink(device, count)


def _as_2d(t, rows, cols):
    """A contiguous t as [rows, cols] (t itself when it is 2-D)."""
    return t if t.dim() == 2 else t.view(rows, cols)


def _bias_grad_only(dy, rows, n, dtype):
    """The bias gradient without a weight gradient: dY's column sums, no GEMM
    (the general path's Wgrad does the same)."""
    return (dy if dy.dim() == 2 else dy.reshape(rows, n)).sum(0, dtype=_F32).to(dtype)


def _grown(t, size, temp=None):
    """A fresh tensor like t with `size` times its first dimension (gloo
    wants a collective's tensors of matching shapes); with temp (the engine's
    device code, the stream, the role) a temporary (_temp)."""
    sh = t.shape
    shape = (sh[0] * size,) + tuple(sh[1:])
    return t.new_empty(shape) if temp is None else _temp(t, shape, *temp)


def _gather(x, tp, async_op=False, temp=None):
    """Sequence parallel: the rows of x (along its first dimension) of every
    rank of tp's group gathered, rank-major (with async_op: (them, the work
    to wait for)); with temp (_grown) into a temporary."""
    out = _grown(x, tp.size, temp)
    work = _all_gather_into(out, x, tp.group, async_op)
    return (out, work) if async_op else out


# Temporaries: tensors that live only until the GEMM, kernel or collective
# that reads them within the same call, all in the calling stream's order (a
# collective's stream waits for it, and it for the collective): a forward's
# gathered input and its partial product before the reduce-scatter (without
# grad also the norm's, fc1's and the activation's outputs); in
# backward the gathered dY and input, the dgrad before its reduce-scatter, the
# activation's and the norm's gradients and workspaces. Where a call is all
# host work (small shapes), each thread keeps one tensor per (role, shape,
# dtype, device, stream) and reuses it instead of allocating one per call: the
# next call's writes are ordered after this call's reads, and two roles never
# share a tensor. Not while a CUDA graph is captured (its replays, on any
# stream, would share the tensor with eager calls), not above _TEMP_BYTES
# (memory held between calls), at most _TEMP_SLOTS and _TEMP_HELD bytes per
# thread (the oldest dropped first). Tensors that outlive the call (outputs,
# what backward saves, a delayed wgrad's operands) are never temporaries.
_TEMP_BYTES = 16 << 20
_TEMP_SLOTS = 32
_TEMP_HELD = 64 << 20  # bytes a thread holds at most
_temps = threading.local()
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
# roles
(T_GATHERED, T_PARTIAL, T_DGRAD, T_WGRAD_INPUT, T_DY, T_DACT, T_DH, T_DLN, T_ACT_WS, T_NORM_WS, T_SCRATCH, T_LN_OUT,
 T_FC1_OUT, T_ACT_OUT, T_MID) = range(15)


def _temp(x, shape, dev, stream, role, dtype=None):
    """A tensor of `shape` with x's device and dtype (or `dtype`) for the
    temporary `role` (above), read and written in `stream`'s order; dev: the
    engine's device code."""
    dtype = dtype or x.dtype
    if _prod(shape) * dtype.itemsize > _TEMP_BYTES or dev >= 0 and (_capturing is None or _capturing()):
        return x.new_empty(shape, dtype=dtype)
    slots = getattr(_temps, "slots", None)
    if slots is None:
        slots = _temps.slots = {}
    key = (role, shape, dtype, dev, stream)
    t = slots.get(key)
    if t is None:
        t = x.new_empty(shape, dtype=dtype)
        held = t.nbytes + sum(u.nbytes for u in slots.values())  # only when a temporary is added
        for old in list(slots):  # the oldest first
            if len(slots) < _TEMP_SLOTS and held <= _TEMP_HELD:
                break
            held -= slots.pop(old).nbytes
        slots[key] = t
    return t


def _temp_bytes(x, nbytes, dev, stream, role):
    """A uint8 [nbytes] workspace on x's device: a temporary (_temp)."""
    return _temp(x, (nbytes,), dev, stream, role, _U8)


def _gather_dy(dy, plan, dev):
    """A row layer's backward under sequence parallelism: dY's rows
    gathered, into a temporary unless a fused / delayed Wgrad step keeps
    them."""
    return _gather(dy, plan[TP], temp=None if plan[WGRAD] else (dev[1], dev[4], T_DY))


def _bwd_state(state):
    """A Function's saved state for its backward: the device tuple's stream
    the current one (backward may run on another stream than the forward),
    found once per backward."""
    dev = state[3]
    if dev[1] < 0:
        return state
    return state[:3] + (dev[:4] + (_current_stream(dev[1], dev[0]),),) + state[4:]


def _dgrad_scatter(dy, w, total, n, k, code, dev, out, tp):
    """Column + sequence parallel: dX = dY W over the gathered rows, then
    reduce-scattered over tp's group into `out` (this rank's rows): the
    general path's dgrad."""
    _, d, ws, nbytes, stream = dev
    dxt = _grown(out, tp.size, (d, stream, T_DGRAD))
    _C.gemm(d, code, code, 0, 0, total, k, n, dy.data_ptr(), n, w.data_ptr(), k, dxt.data_ptr(), k, 0, 0, 0, ws,
            nbytes, stream)
    _reduce_scatter_into(out, dxt, tp.group)
    return out


def _wgrad_gemm(dy, xt, total, n, k, code, dev, need_w, need_b, dtype):
    """dW = dY^T X over the gathered rows (and the bias gradient): the general
    path's wgrad, or the bias gradient alone without a weight gradient."""
    if not need_w:
        return None, (_bias_grad_only(dy, total, n, dtype) if need_b else None)
    _, d, ws, nbytes, _ = dev
    dw = xt.new_empty(n, k)
    db = xt.new_empty(n) if need_b else None
    _C.gemm(d, code, code, 1, 0, n, k, total, dy.data_ptr(), n, xt.data_ptr(), k, dw.data_ptr(), k, 0,
            0 if db is None else db.data_ptr(), 0, ws, nbytes, dev[4])
    return dw, db


def _sp_rows_ok(plan, s):
    """A row layer under sequence parallelism reduce-scatters along the
    sequence: its length must divide (else the general path's error)."""
    return not (plan[SP] and plan[ROW_REDUCE] and s % plan[SIZE])


# ----------------------------------------------------------------- Linear


def linear(layer, plan, x, return_bias, is_first_microbatch):
    """Linear's output (and its bias with return_bias), or None off the
    common case."""
    params = layer._parameters
    w = params.get(plan[W])
    bname = plan[B]
    b = params.get(bname) if bname is not None else None
    if w is None:
        return None
    grad = _is_grad_enabled()
    x = _admit(x, grad)
    if x is None:
        return None
    dtype = w.dtype
    wshape = plan[WSHAPE]
    n, k = wshape
    shape = _rows(x, dtype, k)
    if (shape is None or not _plain(w, dtype, wshape) or not _plain(b, dtype, plan[BSHAPE]) or _any_autocast()
            or not _sp_rows_ok(plan, shape[1])):
        return None
    placed = _placed(x, dtype, (w, b))
    if placed is None:
        return None
    dev, code = placed
    if plan[UB] is not None and not _ub_forward_falls_back(layer, plan, x, shape[0]):
        return None
    state = (plan, shape, code, dev, layer, is_first_microbatch)
    bias = None if return_bias else b
    if grad:
        y = _linear_apply(x, w, bias, state)
    else:
        y = _linear_fwd(x, w, bias, state)
    return (y, _returned_bias(layer, b, dtype)) if return_bias else y


def _linear_fwd(x, w, b, state):
    """Y = X W^T + b; a row layer all-reduces X W^T over the group (under
    sequence parallelism reduce-scatters it), then adds b; a column layer
    under sequence parallelism first gathers X's rows."""
    plan, (rows, s, bt), code, (_, dev, ws, nbytes, stream) = state[:4]
    n, k = plan[WSHAPE]
    reduce = plan[ROW_REDUCE]
    if plan[SP]:
        size = plan[SIZE]
        if reduce:
            y, out = _new(x, s // size, bt, n), _temp(x, _dims(s, bt, n), dev, stream, T_PARTIAL)
        else:
            x = _gather(x, plan[TP], temp=(dev, stream, T_GATHERED))
            rows *= size
            y = out = _new(x, s * size, bt, n)
    else:
        y = out = _new(x, s, bt, n)
    _C.gemm(dev, code, code, 0, 1, rows, n, k, x.data_ptr(), k, w.data_ptr(), k, out.data_ptr(), n,
            0 if b is None or reduce else b.data_ptr(), 0, 0, ws, nbytes, stream)
    if reduce:
        if plan[SP]:
            _reduce_scatter_into(y, out, plan[TP].group)
        else:
            all_reduce(y, plan[TP].group, plan[TP].size)
        if b is not None:
            y += b
    return y


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, state):
        y = _linear_fwd(x, w, b, state)
        ctx.save_for_backward(x, w)
        ctx.state = state
        return y

    @staticmethod
    def backward(ctx, dout):
        x, w = ctx.saved_tensors
        state = _bwd_state(ctx.state)
        plan, (rows, _, _), code, dev, layer, first_mb = state
        need = ctx.needs_input_grad
        n, k = plan[WSHAPE]
        dtype = x.dtype
        _check_saved(w, dtype, (n, k), "weight")
        dy = _grad_output(dout, dtype)
        if plan[UB] is not None and not _ub_backward_falls_back(layer, plan, _as_2d(x, rows, k), w, rows, need[0],
                                                                need[1] or need[2]):
            dx, dw, db = _general_backward(_as_2d(x, rows, k), w, dy, state, need, 1, need[0])
            return (None if dx is None else dx.view(x.shape)), dw, db, None
        sp = plan[SP]
        if sp and not plan[ROW_REDUCE]:
            return _column_sp_linear_bwd(x, w, dy, state, need) + (None,)
        dy_local = None
        if sp:  # row: dY's rows gathered; the bias gradient is this rank's rows' (the framework sums it)
            dy_local = dy
            dy = _gather_dy(dy, plan, dev)
        dx = torch.empty_like(x) if need[0] else None
        dw = db = wg = None
        if plan[WGRAD]:
            if need[1] or need[2]:
                wg = Wgrad(layer, w, need[2], first_mb, bias_from_local=sp, need_w=need[1])
        else:
            dw = w.new_empty(n, k) if need[1] else None
            if need[2]:
                if sp:
                    db = _bias_grad_only(dy_local, rows // plan[SIZE], n, dtype)
                else:
                    db = w.new_empty(n) if need[1] else _bias_grad_only(dy, rows, n, dtype)
        if dx is not None or dw is not None:
            _, d, ws, nbytes, stream = dev
            _C.linear_bwd(d, code, rows, n, k, dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                          0 if dx is None else dx.data_ptr(), 0 if dw is None else dw.data_ptr(),
                          0 if db is None or dw is None or sp else db.data_ptr(), ws, nbytes, stream)
        if dx is not None and plan[COL_REDUCE]:
            all_reduce(dx, plan[TP].group, plan[TP].size)
        if wg is not None:  # fused or delayed: the general path's step (main_grad, backward_dw's queue)
            dw, db = wg(_as_2d(dy, rows, n), _as_2d(x, rows, k), NO_UB,
                        None if dy_local is None else _as_2d(dy_local, rows // plan[SIZE], n))
        return dx, dw, db, None


def _column_sp_linear_bwd(x, w, dy, state, need):
    """Column + sequence parallel Linear backward, the general path's steps:
    the input's rows re-gathered for wgrad while dgrad runs, dgrad
    reduce-scattered, then wgrad (or the fused/delayed Wgrad step)."""
    plan, (rows, _, _), code, dev, layer, first_mb = state
    n, k = plan[WSHAPE]
    wg = Wgrad(layer, w, need[2], first_mb, need_w=need[1]) if plan[WGRAD] and (need[1] or need[2]) else None
    dx = torch.empty_like(x) if need[0] else None
    return _column_sp_backward(x, w, dy, rows * plan[SIZE], n, k, code, dev, plan[TP], dx, need[1], need[2], wg)


def _column_sp_backward(x, w, dy, total, n, k, code, dev, tp, dx, need_w, need_b, wg):
    """A column layer's backward under sequence parallelism, as the general
    path's: x (this rank's rows of the layer's input) re-gathered for wgrad
    while dgrad runs into dx (this rank's rows, reduce-scattered; None: no
    dgrad), then wgrad (the fused/delayed Wgrad step wg, or the GEMM with the
    bias gradient). Returns (dx, dw, db)."""
    xt = work = None
    if need_w or wg is not None:
        # a delayed Wgrad step keeps it: a temporary only without one
        temp = (dev[1], dev[4], T_WGRAD_INPUT) if wg is None else None
        if dx is not None:
            xt, work = _gather(x, tp, async_op=True, temp=temp)
        else:
            xt = _gather(x, tp, temp=temp)
    if dx is not None:
        _dgrad_scatter(dy, w, total, n, k, code, dev, dx, tp)
    if work is not None:
        work.wait()
    if wg is not None:
        return (dx,) + wg(_as_2d(dy, total, n), _as_2d(xt, total, k), NO_UB)
    return (dx,) + _wgrad_gemm(dy, xt, total, n, k, code, dev, need_w, need_b, dy.dtype)


_linear_apply = _function_apply.__get__(None, _LinearFn)


# -------------------------------------------------------- LayerNormLinear


def layernorm_linear(layer, plan, x, return_bias, is_first_microbatch):
    """LayerNormLinear's output (and its bias with return_bias), or None off
    the common case."""
    params = layer._parameters
    w = params.get(plan[W])
    bname, betaname = plan[B], plan[BETA]
    b = params.get(bname) if bname is not None else None
    gamma = params.get(plan[GAMMA])
    beta = params.get(betaname) if betaname is not None else None
    if w is None:
        return None
    grad = _is_grad_enabled()
    x = _admit(x, grad)
    if x is None:
        return None
    dtype = w.dtype
    wshape = plan[WSHAPE]
    n, k = wshape
    shape = _rows(x, dtype, k)
    if (shape is None or not _plain(w, dtype, wshape) or not _plain(b, dtype, plan[BSHAPE]) or gamma is None
            or not _plain(gamma, dtype, (k,)) or not _plain(beta, dtype, (k,)) or _any_autocast()
            or not _sp_rows_ok(plan, shape[1])):
        return None
    placed = _placed(x, dtype, (w, b, gamma, beta))
    if placed is None:
        return None
    dev, code = placed
    if plan[UB] is not None and not _ub_forward_falls_back(layer, plan, x, shape[0]):
        return None
    state = (plan, shape, code, dev, layer, is_first_microbatch)
    bias = None if return_bias else b
    if grad:
        y = _norm_linear_apply(x, gamma, beta, w, bias, state)
    else:
        y = _norm_linear_fwd(x, gamma, beta, w, bias, state, False)[0]
    return (y, _returned_bias(layer, b, dtype)) if return_bias else y


def _norm_linear_fwd(x, gamma, beta, w, b, state, keep=True):
    """(y, ln_out [rows, k], stats): the norm, then Y = ln_out W^T + b (a row
    layer all-reduces, or under sequence parallelism reduce-scatters, before
    adding b; a column layer under sequence parallelism normalises its rows,
    then gathers the normalised rows for the GEMM). stats: float32 [2, rows]
    (mu, then rsigma) for LayerNorm, [rows] (rsigma) for RMSNorm; without
    `keep` (no backward) None, written to the statistics sink, and ln_out a
    temporary."""
    plan, (rows, s, bt), code, (device, dev, ws, nbytes, stream) = state[:4]
    n, k = plan[WSHAPE]
    ln_out = x.new_empty(rows, k) if keep else _temp(x, (rows, k), dev, stream, T_LN_OUT)
    stats, sp = _norm_stats(device, rows, beta is None, keep)
    reduce = plan[ROW_REDUCE]
    mu, rsigma = 0 if beta is None else sp, sp + 4 * rows if beta is not None else sp
    if plan[SP] and not reduce:  # column: the norm, the gather, the GEMM (as the general path)
        size = plan[SIZE]
        _C.norm_fwd(dev, code, rows, k, x.data_ptr(), gamma.data_ptr(), 0 if beta is None else beta.data_ptr(),
                    ln_out.data_ptr(), mu, rsigma, plan[EPS], plan[ZCG], stream)
        ln_total = _gather(ln_out, plan[TP], temp=(dev, stream, T_GATHERED))
        y = _new(x, s * size, bt, n)
        _C.gemm(dev, code, code, 0, 1, rows * size, n, k, ln_total.data_ptr(), k, w.data_ptr(), k, y.data_ptr(), n,
                0 if b is None else b.data_ptr(), 0, 0, ws, nbytes, stream)
        return y, ln_out, stats
    if plan[SP]:
        y, out = _new(x, s // plan[SIZE], bt, n), _temp(x, _dims(s, bt, n), dev, stream, T_PARTIAL)
    else:
        y = out = _new(x, s, bt, n)
    _C.norm_linear_fwd(dev, code, rows, k, n, x.data_ptr(), gamma.data_ptr(),
                       0 if beta is None else beta.data_ptr(), ln_out.data_ptr(), mu, rsigma, plan[EPS], plan[ZCG],
                       w.data_ptr(), 0 if b is None or reduce else b.data_ptr(), out.data_ptr(), ws, nbytes, stream)
    if reduce:
        if plan[SP]:
            _reduce_scatter_into(y, out, plan[TP].group)
        else:
            all_reduce(y, plan[TP].group, plan[TP].size)
        if b is not None:
            y += b
    return y, ln_out, stats


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, w, b, state):
        y, ln_out, stats = _norm_linear_fwd(x, gamma, beta, w, b, state)
        ctx.save_for_backward(x, ln_out, stats, gamma, w)
        ctx.state = state
        ctx.rms = beta is None
        return y

    @staticmethod
    def backward(ctx, dout):
        x, ln_out, stats, gamma, w = ctx.saved_tensors
        state = _bwd_state(ctx.state)
        plan, (rows, _, _), code, dev, layer, first_mb = state
        need = ctx.needs_input_grad
        n, k = plan[WSHAPE]
        dtype = x.dtype
        _check_saved(w, dtype, (n, k), "weight")
        _check_saved(gamma, dtype, (k,), "layer_norm_weight")
        dy = _grad_output(dout, dtype)
        dx = torch.empty_like(x)
        dgamma = gamma.new_empty(k)
        dbeta = None if ctx.rms else gamma.new_empty(k)
        if plan[UB] is not None and not _ub_backward_falls_back(layer, plan, ln_out, w, rows, True, need[3] or need[4]):
            dln, dw, db = _general_backward(ln_out, w, dy, state, need, 3, True)
            _norm_backward(dln, x, stats, gamma, dx, dgamma, dbeta, plan[ZCG], rows, k, code, dev)
            return dx, dgamma, dbeta, dw, db, None
        sp = plan[SP]
        if sp and not plan[ROW_REDUCE]:
            return _column_sp_norm_linear_bwd(x, ln_out, stats, gamma, w, dy, dx, dgamma, dbeta, state, need)
        dy_local = None
        if sp:  # row: dY's rows gathered; the bias gradient is this rank's rows' (the framework sums it)
            dy_local = dy
            dy = _gather_dy(dy, plan, dev)
        dw = db = wg = None
        if plan[WGRAD]:
            if need[3] or need[4]:
                wg = Wgrad(layer, w, need[4], first_mb, bias_from_local=sp, need_w=need[3])
        else:
            dw = w.new_empty(n, k) if need[3] else None
            if need[4]:
                if sp:
                    db = _bias_grad_only(dy_local, rows // plan[SIZE], n, dtype)
                else:
                    db = w.new_empty(n) if need[3] else _bias_grad_only(dy, rows, n, dtype)
        _, d, ws, nbytes, stream = dev
        esize = x.element_size()
        dln_bytes = (rows * k * esize + 255) // 256 * 256
        norm_bytes = _C.norm_bwd_workspace_bytes(d, rows, k)
        scratch = _temp_bytes(x, dln_bytes + norm_bytes, d, stream, T_SCRATCH)
        scr, stp = scratch.data_ptr(), stats.data_ptr()
        _C.norm_linear_bwd(d, code, rows, k, n, dy.data_ptr(), x.data_ptr(), ln_out.data_ptr(),
                           0 if ctx.rms else stp, stp + 4 * rows if not ctx.rms else stp, gamma.data_ptr(),
                           plan[ZCG], w.data_ptr(), scr, dx.data_ptr(), dgamma.data_ptr(),
                           0 if dbeta is None else dbeta.data_ptr(), 0 if dw is None else dw.data_ptr(),
                           0 if db is None or dw is None or sp else db.data_ptr(), scr + dln_bytes,
                           norm_bytes, ws, nbytes, stream)
        if wg is not None:  # fused or delayed: the general path's step (main_grad, backward_dw's queue)
            dw, db = wg(_as_2d(dy, rows, n), ln_out, NO_UB,
                        None if dy_local is None else _as_2d(dy_local, rows // plan[SIZE], n))
        return dx, dgamma, dbeta, dw, db, None


def _column_sp_norm_linear_bwd(x, ln_out, stats, gamma, w, dy, dx, dgamma, dbeta, state, need):
    """Column + sequence parallel LayerNormLinear backward, the general
    path's steps: the normalised rows re-gathered for wgrad while dgrad
    runs, dgrad reduce-scattered to this rank's rows, wgrad (or the
    fused/delayed Wgrad step), then the norm's backward on the local rows
    (its parameter gradients this rank's partial sums, as the general path)."""
    plan, (rows, _, _), code, dev, layer, first_mb = state
    n, k = plan[WSHAPE]
    wg = Wgrad(layer, w, need[4], first_mb, need_w=need[3]) if plan[WGRAD] and (need[3] or need[4]) else None
    dln = _temp(ln_out, (rows, k), dev[1], dev[4], T_DLN)
    dln, dw, db = _column_sp_backward(ln_out, w, dy, rows * plan[SIZE], n, k, code, dev, plan[TP], dln, need[3],
                                      need[4], wg)
    _norm_backward(dln, x, stats, gamma, dx, dgamma, dbeta, plan[ZCG], rows, k, code, dev)
    return dx, dgamma, dbeta, dw, db, None


_norm_linear_apply = _function_apply.__get__(None, _LayerNormLinearFn)

# ----------------------------------------------------------- LayerNormMLP
# One process (tp = 1), no userbuffers, no checkpoint, no fused or delayed
# weight gradient, no returned norm output. Forward: the norm and fc1 in one
# engine call, the activation, fc2; the intermediates (ln_out, the norm's
# statistics, fc1's output, the activation's) live in one allocation, which
# is what is saved. Backward: fc2's dgrad + wgrad, the activation's backward
# with fc1's bias gradient, fc1's dgrad + wgrad + the norm's backward.

def _mlp_plan(layer):
    """(hidden, fc1 rows, ffn, activation code, limit, alpha, glu offset,
    LayerNorm, eps, zero_centered_gamma, fc2 bias added after the GEMM (a
    row-parallel fc2, as the general path adds it), bias, sequence parallel,
    its TPConfig, its userbuffers plan (_mlp_ub_plan) or None) or False."""
    tp = layer.tp
    sp = tp.size > 1 and layer.set_parallel_mode and tp.sp
    if ((tp.size != 1 and not sp) or layer.checkpoint or layer.return_layernorm_output
            or layer.fuse_wgrad_accumulation or layer.delay_wgrad_compute):
        return False
    ubp = None
    if layer.ub.enabled or layer.ub2.enabled:
        ubp = _mlp_ub_plan(layer) if sp else None
        if ubp is None:
            return False
    act = _engine.activation_code(layer.activation)
    ffn = layer.size_per_partition
    kw = layer._act_kw
    return (layer.hidden_size, 2 * ffn if act >= 16 else ffn, ffn, act, float(kw.get("limit", 7.0)),
            float(kw.get("alpha", 1.702)), float(kw.get("glu_linear_offset", 1.0)),
            layer.normalization == "LayerNorm", float(layer.eps), 1 if layer.zero_centered_gamma else 0,
            layer.tp2.mode == "row", layer.use_bias, sp, tp, ubp)


def _carve(*sizes):
    """Byte offsets of consecutive regions of the given sizes, each 256-byte
    aligned, and the total."""
    offs, total = [], 0
    for n in sizes:
        offs.append(total)
        total += (n + 255) // 256 * 256
    return offs, total


def layernorm_mlp(layer, plan, x, return_bias):
    """LayerNormMLP's output (and fc2's bias with return_bias), or None off
    the common case."""
    params = layer._parameters
    w1, w2, gamma = params.get("fc1_weight"), params.get("fc2_weight"), params.get("layer_norm_weight")
    hidden, f1, ffn = plan[0], plan[1], plan[2]
    beta = params.get("layer_norm_bias") if plan[7] else None
    b1 = b2 = None
    if plan[11]:
        b1, b2 = params.get("fc1_bias"), params.get("fc2_bias")
    if (w1 is None or w2 is None or gamma is None or (plan[7] and beta is None)
            or (plan[11] and (b1 is None or b2 is None))):
        return None
    grad = _is_grad_enabled()
    x = _admit(x, grad)
    if x is None:
        return None
    dtype = w1.dtype
    shape = _rows(x, dtype, hidden)
    if (shape is None or not _plain(w1, dtype, (f1, hidden)) or not _plain(w2, dtype, (hidden, ffn))
            or not _plain(gamma, dtype, (hidden,)) or not _plain(beta, dtype, (hidden,))
            or not _plain(b1, dtype, (f1,)) or not _plain(b2, dtype, (hidden,)) or _any_autocast()):
        return None
    placed = _placed(x, dtype, (w1, w2, gamma, beta, b1, b2))
    if placed is None:
        return None
    dev, code = placed
    fc2_bias = None if return_bias else b2
    if plan[12]:
        y = _layernorm_mlp_sp(layer, plan, x, gamma, beta, w1, b1, w2, fc2_bias, shape, code, dev, grad)
        if y is None:
            return None
    elif grad:
        y = _mlp_apply(x, gamma, beta, w1, b1, w2, fc2_bias, (plan, shape, code, dev))
    else:
        y = _mlp_fwd(x, gamma, beta, w1, b1, w2, fc2_bias, (plan, shape, code, dev), False)[0]
    if not return_bias:
        return y
    b = b2 if b2 is not None else layer.fc2_bias
    return y, (b if b.dtype is dtype else b.to(dtype))


def _mlp_fwd(x, gamma, beta, w1, b1, w2, b2, state, keep=True):
    """(y, the intermediates' allocation, its offsets: ln_out, stats, fc1
    out, activation out); without `keep` (no backward) the allocation is a
    temporary."""
    plan, (rows, s, bt), code, (_, dev, ws, nbytes, stream) = state
    hidden, f1, ffn, act = plan[0], plan[1], plan[2], plan[3]
    es = x.element_size()
    offs, total = _carve(rows * hidden * es, (2 if beta is not None else 1) * rows * 4, rows * f1 * es,
                         rows * ffn * es)
    mid = _empty(total, dtype=torch.uint8, device=x.device) if keep else _temp_bytes(x, total, dev, stream, T_MID)
    y = _new(x, s, bt, hidden)
    p = mid.data_ptr()
    ln, st, h, a = p + offs[0], p + offs[1], p + offs[2], p + offs[3]
    _C.norm_linear_fwd(dev, code, rows, hidden, f1, x.data_ptr(), gamma.data_ptr(),
                       0 if beta is None else beta.data_ptr(), ln, 0 if beta is None else st,
                       st + 4 * rows if beta is not None else st, plan[8], plan[9], w1.data_ptr(),
                       0 if b1 is None else b1.data_ptr(), h, ws, nbytes, stream)
    _C.act_fwd(dev, act, code, rows, ffn, h, 0, a, plan[4], plan[5], plan[6], stream)
    after = plan[10]
    _C.gemm(dev, code, code, 0, 1, rows, hidden, ffn, a, ffn, w2.data_ptr(), ffn, y.data_ptr(), hidden,
            0 if b2 is None or after else b2.data_ptr(), 0, 0, ws, nbytes, stream)
    if after and b2 is not None:
        y += b2
    return y, mid, offs


class _LayerNormMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, w1, b1, w2, b2, state):
        y, mid, offs = _mlp_fwd(x, gamma, beta, w1, b1, w2, b2, state)
        ctx.save_for_backward(x, mid, gamma, w1, w2)
        ctx.state, ctx.offs, ctx.rms = state, offs, beta is None
        return y

    @staticmethod
    def backward(ctx, dout):
        x, mid, gamma, w1, w2 = ctx.saved_tensors
        plan, (rows, _, _), code, dev = _bwd_state(ctx.state)
        hidden, f1, ffn, act = plan[0], plan[1], plan[2], plan[3]
        need = ctx.needs_input_grad  # x, gamma, beta, w1, b1, w2, b2
        dtype = x.dtype
        _check_saved(w1, dtype, (f1, hidden), "fc1_weight")
        _check_saved(w2, dtype, (hidden, ffn), "fc2_weight")
        _check_saved(gamma, dtype, (hidden,), "layer_norm_weight")
        dy = _grad_output(dout, dtype)
        device, d, ws, nbytes, stream = dev
        es = x.element_size()
        dx = torch.empty_like(x)
        dgamma = gamma.new_empty(hidden)
        dbeta = None if ctx.rms else gamma.new_empty(hidden)
        dw1 = w1.new_empty(f1, hidden) if need[3] else None
        db1 = w1.new_empty(f1) if need[4] else None
        dw2 = w2.new_empty(hidden, ffn) if need[5] else None
        db2 = None
        if need[6]:
            db2 = w2.new_empty(hidden) if need[5] else _bias_grad_only(dy, rows, hidden, dtype)
        act_bytes = _C.act_bwd_workspace_bytes(d, act, rows, ffn) if db1 is not None else 0
        norm_bytes = _C.norm_bwd_workspace_bytes(d, rows, hidden)
        offs, total = _carve(rows * ffn * es, rows * f1 * es, rows * hidden * es, act_bytes, norm_bytes)
        scratch = _temp_bytes(x, total, d, stream, T_SCRATCH)
        p, m = scratch.data_ptr(), mid.data_ptr()
        dact, dh, dln, aws, nws = (p + o for o in offs)
        ln, st, h, a = (m + o for o in ctx.offs)
        # fc2: dgrad into dact, wgrad (+ its bias gradient)
        _C.linear_bwd(d, code, rows, hidden, ffn, dy.data_ptr(), a, w2.data_ptr(), dact,
                      0 if dw2 is None else dw2.data_ptr(), 0 if db2 is None or dw2 is None else db2.data_ptr(),
                      ws, nbytes, stream)
        # the activation's backward, fc1's bias gradient fused
        _C.act_bwd(d, act, code, rows, ffn, dact, h, dh, 0 if db1 is None else db1.data_ptr(),
                   aws if db1 is not None else 0, act_bytes, plan[4], plan[5], plan[6], stream)
        # fc1: dgrad into dln, wgrad, then the norm's backward
        _C.norm_linear_bwd(d, code, rows, hidden, f1, dh, x.data_ptr(), ln, 0 if ctx.rms else st,
                           st + 4 * rows if not ctx.rms else st, gamma.data_ptr(), plan[9], w1.data_ptr(), dln,
                           dx.data_ptr(), dgamma.data_ptr(), 0 if dbeta is None else dbeta.data_ptr(),
                           0 if dw1 is None else dw1.data_ptr(), 0, nws, norm_bytes, ws, nbytes, stream)
        return dx, dgamma, dbeta, dw1, db1, dw2, db2, None


_mlp_apply = _function_apply.__get__(None, _LayerNormMLPFn)


# ------------------------------------------- LayerNormMLP, sequence parallel
# set_parallel_mode with sequence parallelism (fc1 column-, fc2 row-parallel),
# no userbuffers or only communicators that fall back at the call's shape;
# otherwise as above. The general path's steps and collectives, in its order:
# the norm on this rank's rows, their all-gather, fc1 (+ bias), the
# activation, fc2, the reduce-scatter, fc2's bias. Saved: x, the local
# normalised rows and statistics, fc1's and the activation's outputs over the
# group's rows (as the general path). Backward: grad_output all-gathered,
# fc2's dgrad + wgrad (its bias gradient over this rank's rows), the
# activation's backward with fc1's bias gradient, the normalised rows
# re-gathered while fc1's dgrad runs and is reduce-scattered, fc1's wgrad,
# the norm's backward on this rank's rows.

def _mlp_ub_plan(layer):
    """(fc1 fprop AG, fc2 fprop RS, fc2 dgrad AG, fc1 dgrad RS): which
    overlaps the flags ask for, or None where a flag is off the fast path
    (the bulk ones always run)."""
    f1 = layer.ub.flags if layer.ub.enabled else None
    f2 = layer.ub2.flags if layer.ub2.enabled else None
    if f1 is not None and (f1["ub_bulk_dgrad"] or f1["ub_bulk_wgrad"]):
        return None
    return (bool(f1 and f1["ub_overlap_ag"]), bool(f2 and f2["ub_overlap_rs"]), bool(f2 and f2["ub_overlap_ag"]),
            bool(f1 and f1["ub_overlap_rs_dgrad"]))


def _mlp_overlaps(ops):
    """ops: (communicator, op, rows, k, n) of the overlaps the flags ask for at
    this step. False when all fall back (then counted, as take_overlap counts
    them on the general path), True when one would overlap (nothing counted:
    the general path runs and counts)."""
    for c, op, r, k, n in ops:
        if c.pays(op, r, k, n):
            return True
    for c, op, _, _, _ in ops:
        c.count_fallback(op)
    return False


def _mlp_forward_ops(layer, ubp, rows, hidden, f1, ffn):
    ops = []
    if ubp[0]:
        ops.append((layer.ub.comms["fprop"], "ag", rows, hidden, f1))
    if ubp[1]:
        ops.append((layer.ub2.comms["fprop"], "rs", rows, ffn, hidden))
    return ops


def _layernorm_mlp_sp(layer, plan, x, gamma, beta, w1, b1, w2, b2, shape, code, dev, grad):
    """The sequence-parallel call's output, or None where the general path
    must run it (x in a communicator's buffer, or an overlap that pays)."""
    ubp = plan[14]
    if ubp is not None:
        for ub in (layer.ub, layer.ub2):
            if _common.in_comm_buffer(x, ub.comms.values()):
                return None
        if _mlp_overlaps(_mlp_forward_ops(layer, ubp, shape[0], plan[0], plan[1], plan[2])):
            return None
    state = (plan, shape, code, dev, layer)
    if grad:
        return _mlp_sp_apply(x, gamma, beta, w1, b1, w2, b2, state)
    return _mlp_sp_fwd(x, gamma, beta, w1, b1, w2, b2, state, False)[0]


def _mlp_sp_fwd(x, gamma, beta, w1, b1, w2, b2, state, keep=True):
    """(y, ln_out, stats, fc1's output, the activation's output); without
    `keep` (no backward) stats is None (_norm_linear_fwd) and the others are
    temporaries."""
    plan, (rows, s, bt), code, (device, dev, ws, nbytes, stream) = state[:4]
    hidden, f1, ffn, act, tp = plan[0], plan[1], plan[2], plan[3], plan[13]
    total = rows * tp.size
    ln_out = x.new_empty(rows, hidden) if keep else _temp(x, (rows, hidden), dev, stream, T_LN_OUT)
    stats, sp = _norm_stats(device, rows, beta is None, keep)
    _C.norm_fwd(dev, code, rows, hidden, x.data_ptr(), gamma.data_ptr(), 0 if beta is None else beta.data_ptr(),
                ln_out.data_ptr(), 0 if beta is None else sp, sp + 4 * rows if beta is not None else sp, plan[8],
                plan[9], stream)
    ln_total = _gather(ln_out, tp, temp=(dev, stream, T_GATHERED))
    h = x.new_empty(total, f1) if keep else _temp(x, (total, f1), dev, stream, T_FC1_OUT)
    _C.gemm(dev, code, code, 0, 1, total, f1, hidden, ln_total.data_ptr(), hidden, w1.data_ptr(), hidden,
            h.data_ptr(), f1, 0 if b1 is None else b1.data_ptr(), 0, 0, ws, nbytes, stream)
    del ln_total
    a = x.new_empty(total, ffn) if keep else _temp(x, (total, ffn), dev, stream, T_ACT_OUT)
    _C.act_fwd(dev, act, code, total, ffn, h.data_ptr(), 0, a.data_ptr(), plan[4], plan[5], plan[6], stream)
    # the shape of y's rows of every rank (gloo wants the same dims)
    out = _temp(x, _dims(s * tp.size, bt, hidden), dev, stream, T_PARTIAL)
    _C.gemm(dev, code, code, 0, 1, total, hidden, ffn, a.data_ptr(), ffn, w2.data_ptr(), ffn, out.data_ptr(), hidden,
            0, 0, 0, ws, nbytes, stream)
    y = _new(x, s, bt, hidden)
    _reduce_scatter_into(y, out, tp.group)
    if b2 is not None:
        y += b2
    return y, ln_out, stats, h, a


class _LayerNormMLPSPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, w1, b1, w2, b2, state):
        y, ln_out, stats, h, a = _mlp_sp_fwd(x, gamma, beta, w1, b1, w2, b2, state)
        ctx.save_for_backward(x, ln_out, stats, h, a, gamma, w1, w2)
        ctx.state, ctx.rms, ctx.has_b2 = state, beta is None, b2 is not None
        return y

    @staticmethod
    def backward(ctx, dout):
        x, ln_out, stats, h, a, gamma, w1, w2 = ctx.saved_tensors
        state = _bwd_state(ctx.state)
        plan, (rows, _, _), code, dev, layer = state
        hidden, f1, ffn = plan[0], plan[1], plan[2]
        need = ctx.needs_input_grad  # x, gamma, beta, w1, b1, w2, b2
        dtype = x.dtype
        _check_saved(w1, dtype, (f1, hidden), "fc1_weight")
        _check_saved(w2, dtype, (hidden, ffn), "fc2_weight")
        _check_saved(gamma, dtype, (hidden,), "layer_norm_weight")
        dy = _as_2d(_grad_output(dout, dtype), rows, hidden)
        dx = torch.empty_like(x)
        dgamma = gamma.new_empty(hidden)
        dbeta = None if ctx.rms else gamma.new_empty(hidden)
        if plan[14] is not None and _mlp_backward_overlaps(layer, plan, ln_out, w1, rows, need[3]):
            dln, grads = _mlp_general_backward(layer, dy, ln_out, h, a, w1, w2, need, ctx.has_b2)
        else:
            dln, grads = _mlp_sp_backward(dy, ln_out, h, a, w1, w2, need, ctx.has_b2, state)
        _norm_backward(dln, x, stats, gamma, dx, dgamma, dbeta, plan[9], rows, hidden, code, dev)
        return (dx, dgamma, dbeta) + grads + (None,)


def _mlp_backward_overlaps(layer, plan, ln_out, w1, rows, need_w1):
    """Whether a backward overlap would run (a threshold lowered since the
    forward, or fc1's input gathered for wgrad by its fprop communicator);
    else the fallbacks are counted as the general path counts them."""
    ubp, hidden, f1, ffn = plan[14], plan[0], plan[1], plan[2]
    if need_w1 and _common.wgrad_gather_comm(ln_out, w1, plan[13], layer.ub) is not None:
        return True
    ops = []
    if ubp[2]:
        ops.append((layer.ub2.comms["dgrad"], "ag", rows, hidden, ffn))
    if ubp[3]:
        ops.append((layer.ub.comms["dgrad"], "rs", rows, f1, hidden))
    return _mlp_overlaps(ops)


def _mlp_sp_backward(dy, ln_out, h, a, w1, w2, need, has_b2, state):
    """(dln on this rank's rows, (dw1, db1, dw2, db2))."""
    plan, (rows, _, _), code, dev, _ = state
    hidden, f1, ffn, act, tp = plan[0], plan[1], plan[2], plan[3], plan[13]
    total = rows * tp.size
    device, d, ws, nbytes, stream = dev
    dtype = dy.dtype
    db2 = _bias_grad_only(dy, rows, hidden, dtype) if need[6] else None  # this rank's rows, as the general path
    dyt = _gather(dy, tp, temp=(d, stream, T_DY))
    dw2 = w2.new_empty(hidden, ffn) if need[5] else None
    dact = _temp(dy, (total, ffn), d, stream, T_DACT)
    _C.linear_bwd(d, code, total, hidden, ffn, dyt.data_ptr(), a.data_ptr(), w2.data_ptr(), dact.data_ptr(),
                  0 if dw2 is None else dw2.data_ptr(), 0, ws, nbytes, stream)
    del dyt
    db1 = w1.new_empty(f1) if need[4] else None
    act_bytes = _C.act_bwd_workspace_bytes(d, act, total, ffn) if db1 is not None else 0
    aws = _temp_bytes(dy, act_bytes, d, stream, T_ACT_WS) if act_bytes else None
    dh = _temp(dy, (total, f1), d, stream, T_DH)
    _C.act_bwd(d, act, code, total, ffn, dact.data_ptr(), h.data_ptr(), dh.data_ptr(),
               0 if db1 is None else db1.data_ptr(), 0 if aws is None else aws.data_ptr(), act_bytes, plan[4],
               plan[5], plan[6], stream)
    del dact
    dln, dw1, _ = _column_sp_backward(ln_out, w1, dh, total, f1, hidden, code, dev, tp,
                                      _temp(ln_out, (rows, hidden), d, stream, T_DLN), need[3], False, None)
    return dln, (dw1, db1, dw2, db2 if has_b2 else None)


def _mlp_general_backward(layer, dy, ln_out, h, a, w1, w2, need, has_b2):
    """The general path's backward steps with the module's communicators
    (where an overlap runs): (dln on this rank's rows, (dw1, db1, dw2, db2))."""
    wg2 = None
    if need[5] or (need[6] and has_b2):
        wg2 = Wgrad(layer._gemm2, w2, has_b2 and need[6], None, bias_from_local=True, need_w=need[5])
    dact, dw2, db2 = _common.row_backward(dy, a, w2, layer.tp2, layer.ub2, True, wg2)
    res = _engine.act_bwd(dact, h, layer.activation, dbias=need[4], **layer._act_kw)
    dh, db1 = res if isinstance(res, tuple) else (res, None)
    wg1 = Wgrad(layer._gemm1, w1, False, None) if need[3] else None
    dln, dw1, _ = _common.column_backward(dh, ln_out, w1, layer.tp, layer.ub, True, wg1)
    return dln, (dw1, db1, dw2, db2)


_mlp_sp_apply = _function_apply.__get__(None, _LayerNormMLPSPFn)


# The functions that call a Function's C apply, and the Function: what
# tec.debug names as the saver.
debug.register_apply_callers({linear: _LinearFn, layernorm_linear: _LayerNormLinearFn,
                              layernorm_mlp: _LayerNormMLPFn, _layernorm_mlp_sp: _LayerNormMLPSPFn})
