"""The layers' fast path: Linear and LayerNormLinear calls in the common case
(one weight tensor, no userbuffers, no sequence parallelism, no fused or
delayed weight gradient, no autocast, a contiguous 2-D or 3-D input of the
parameters' dtype and device) with as little host work as the engine needs.

On tiny shapes a layer call is all host work: every attribute read of a
tensor, every allocation and every Python frame counts. Here each tensor is
looked at once, outputs are allocated in their final shape (no views), the
autograd Function is entered through its C entry point (torch's Python
wrapper only unwraps functorch's dead tensors, and functorch transforms take
the general path) and backward runs dgrad, wgrad and the bias gradient in one
engine call. Anything off the common case (a wrong input included) returns
None and the layer takes its general path, which raises the named errors, so
the semantics are the general path's; the numerics are the same engine
calls."""
import torch

from .. import _C, _engine
from ..distributed import all_reduce

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_DTYPE_CODES = _engine.DTYPE_CODES
_gemm_devs = _engine._gemm_devs
_is_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_function_apply = torch._C._FunctionBase.__dict__["apply"]
_F32 = torch.float32

# The layer attributes a plan is made from: setting one drops the layer's plan
# (TransformerEngineBaseModule.__setattr__).
PLAN_ATTRS = frozenset(("weight_names", "bias_names", "use_bias", "tp", "ub", "fuse_wgrad_accumulation",
                        "delay_wgrad_compute", "save_original_input", "return_layernorm_output",
                        "return_layernorm_output_gathered", "zero_centered_gamma", "eps", "normalization",
                        "in_local", "out_local"))


def make_plan(layer):
    """What a fast call of `layer` needs, fixed until one of PLAN_ATTRS is set:
    (weight name, bias name or None, weight shape, row all-reduce, column
    all-reduce, group, size); False when the layer is off the common case."""
    tp, ub = layer.tp, layer.ub
    if (len(layer.weight_names) != 1 or ub.enabled or tp.sp or layer.fuse_wgrad_accumulation
            or layer.delay_wgrad_compute or getattr(layer, "save_original_input", False)
            or getattr(layer, "return_layernorm_output", False)):
        return False
    size = tp.size
    return (layer.weight_names[0], layer.bias_names[0] if layer.use_bias else None,
            (layer.out_local, layer.in_local), tp.mode == "row" and size > 1, tp.mode == "column" and size > 1,
            tp.group, size)


def _params_ok(w, b, wshape, dtype, device):
    """The weight (and bias) are plain parameters of the plan's shape, in
    `dtype` on `device`, contiguous."""
    if (type(w) is not _Parameter or w.dtype is not dtype or w.shape != wshape or w.device != device
            or not w.is_contiguous()):
        return False
    return b is None or (type(b) is _Parameter and b.dtype is dtype and b.shape[0] == wshape[0]
                         and b.device == device and b.is_contiguous())


def _input(x, k):
    """(rows, output shape prefix) of a plain contiguous [rows, k] or
    [s, b, k] input with rows > 0, else None."""
    if type(x) is not _Tensor:
        return None
    shape = x.shape
    nd = len(shape)
    if nd == 2:
        m = shape[0]
    elif nd == 3:
        m = shape[0] * shape[1]
    else:
        return None
    if shape[-1] != k or not m or not x.is_contiguous():
        return None
    return m, shape[:-1]


def _device(device):
    """(engine device code, workspace address, bytes, stream)."""
    dev, ws, nbytes, _ = _gemm_devs.get(device) or _engine._gemm_dev(device)
    return dev, ws, nbytes, (0 if dev < 0 else _engine.stream_of(device))


# ----------------------------------------------------------------- Linear


def linear(layer, plan, x, return_bias):
    """The layer's output (and its bias with return_bias), or None off the
    common case."""
    if _any_autocast():
        return None
    params = layer._parameters
    w = params[plan[0]]
    bname = plan[1]
    b = params[bname] if bname is not None else None
    dtype = w.dtype
    wshape = plan[2]
    if type(x) is not _Tensor or x.dtype is not dtype:
        return None
    device = w.device
    if x.device != device or not _params_ok(w, b, wshape, dtype, device):
        return None
    shape = _input(x, wshape[1])
    if shape is None:
        return None
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        return None
    bias = None if return_bias else b
    if _is_grad_enabled():
        if _functorch_active():
            return None
        y = _function_apply.__get__(None, _LinearFn)(x, w, bias, (plan, shape, code))
    else:
        y = _linear_fwd(x, w, bias, plan, shape, code)
    if return_bias:
        return y, b if b is not None else getattr(layer, layer.bias_names[0])
    return y


def _linear_fwd(x, w, b, plan, shape, code):
    """Y = X W^T + b; a row layer all-reduces X W^T over the group, then adds b."""
    m, lead = shape
    n, k = plan[2]
    y = x.new_empty(lead + (n,))
    dev, ws, nbytes, stream = _device(x.device)
    reduce = plan[3]
    _C.gemm(dev, code, code, 0, 1, m, n, k, x.data_ptr(), k, w.data_ptr(), k, y.data_ptr(), n,
            0 if b is None or reduce else b.data_ptr(), 0, 0, ws, nbytes, stream)
    if reduce:
        all_reduce(y, plan[5], plan[6])
        if b is not None:
            y += b
    return y


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, state):
        y = _linear_fwd(x, w, b, *state)
        ctx.save_for_backward(x, w)
        ctx.state = state
        return y

    @staticmethod
    def backward(ctx, dout):
        x, w = ctx.saved_tensors
        plan, (m, _), code = ctx.state
        need = ctx.needs_input_grad
        n, k = plan[2]
        dx, dw, db = linear_backward(dout, x, w, m, n, k, code, need[0], need[1], need[2])
        if dx is not None and plan[4]:
            all_reduce(dx, plan[5], plan[6])
        return dx, dw, db, None


def linear_backward(dout, x, w, m, n, k, code, need_dx, need_w, need_b):
    """(dx shaped as x, dw, db) of Y = X W^T + b in one engine call; dout is
    made contiguous in x's dtype first (autograd hands over any layout)."""
    if dout.dtype is not x.dtype:
        dout = dout.to(x.dtype)
    if not dout.is_contiguous():
        dout = dout.contiguous()
    dx = x.new_empty(x.shape) if need_dx else None
    dw = w.new_empty((n, k)) if need_w else None
    db = None
    if need_b:
        if need_w:
            db = w.new_empty((n,))
        else:  # only the bias gradient: dY's column sums, no GEMM (as the general path)
            db = dout.reshape(m, n).sum(0, dtype=_F32).to(w.dtype)
    if dx is None and dw is None:
        return dx, dw, db
    dev, ws, nbytes, stream = _device(x.device)
    _C.linear_bwd(dev, code, m, n, k, dout.data_ptr(), x.data_ptr(), w.data_ptr(),
                  0 if dx is None else dx.data_ptr(), 0 if dw is None else dw.data_ptr(),
                  0 if db is None or not need_w else db.data_ptr(), ws, nbytes, stream)
    return dx, dw, db
