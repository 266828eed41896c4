"""What a layer decides once per configuration (its plan) and once per call
(its Call), and how a call enters the layer's autograd Function.

A plan is made on a layer's first call and kept until one of PLAN_ATTRS is
set (TransformerEngineBaseModule.__setattr__). A Call carries what the steps
(module/_steps.py) need: the engine's device code, GEMM workspace and stream,
the dtype code, and whether the call is `ready`: its input a contiguous 2-D
or 3-D tensor of the parameters' dtype on their device, its parameters plain
contiguous tensors, no autocast. A ready call skips the validation and
conversions (check_input, casts, a DistributedWeight's gather), which raise
the named errors otherwise; both run the same steps.

On tiny shapes a layer call is all host work, so the Function is entered
through its C entry point (torch's Python wrapper only unwraps functorch's
dead tensors, done here), and under functorch transforms, or where a torch
release lacks the private entry points, through Function.apply."""
import torch

from .. import _engine, debug
from ..quantization import FP8GlobalStateManager as _FP8State
from ._config import compute_dtype

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_DTYPE_CODES = _engine.DTYPE_CODES
_is_grad_enabled = torch.is_grad_enabled
try:
    _any_autocast = torch._C._is_any_autocast_enabled
    _functorch_active = torch._C._are_functorch_transforms_active
    _function_apply = torch._C._FunctionBase.__dict__["apply"]
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    C_APPLY = True
except (AttributeError, KeyError):
    C_APPLY = False

    def _any_autocast():
        return torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu")

# The layer attributes a plan is made from: setting one drops the layer's plan.
PLAN_ATTRS = frozenset(("weight_names", "bias_names", "use_bias", "tp", "ub", "fuse_wgrad_accumulation",
                        "delay_wgrad_compute", "save_original_input", "return_layernorm_output",
                        "return_layernorm_output_gathered", "zero_centered_gamma", "eps", "normalization",
                        "in_local", "out_local", "tp2", "ub2", "checkpoint", "activation", "_act_kw",
                        "hidden_size", "size_per_partition", "set_parallel_mode"))


def apply(cls, *args):
    """cls's forward through autograd (the C entry point where it may be used)."""
    if not C_APPLY or _functorch_active():
        return cls.apply(*args)
    x = args[0]
    if type(x) is _Tensor:
        args = (_unwrap_if_dead(x),) + args[1:]
    return _function_apply(cls, *args)


debug.register_apply_caller(apply.__code__)


class LinearPlan:
    """Linear's and LayerNormLinear's decisions for one configuration."""

    __slots__ = ("weight", "bias", "n", "k", "single", "sp_row", "size", "gamma", "beta", "eps", "zcg", "rms",
                 "shapes")

    def __init__(self, layer):
        self.single = len(layer.weight_names) == 1  # else the split parameters are concatenated per call
        self.weight = layer.weight_names[0]
        self.bias = layer.bias_names[0] if layer.use_bias else None
        self.n, self.k = layer.out_local, layer.in_local
        tp = layer.tp
        self.size = tp.size
        self.sp_row = tp.sp and tp.mode == "row"  # the sequence must divide over the group
        norm = hasattr(layer, "normalization")
        self.gamma = "layer_norm_weight" if norm else None
        self.beta = "layer_norm_bias" if norm and layer.normalization == "LayerNorm" else None
        self.rms = norm and layer.normalization == "RMSNorm"
        self.eps = float(layer.eps) if norm else 0.0
        self.zcg = 1 if norm and layer.zero_centered_gamma else 0
        # weight, bias, then the norm's weight and bias (make_call's order)
        self.shapes = ((self.n, self.k), (self.n,), (self.k,), (self.k,))


class MLPPlan:
    """LayerNormMLP's decisions for one configuration."""

    __slots__ = ("hidden", "f1", "ffn", "act", "act_params", "rms", "eps", "zcg", "bias", "k", "sp_row", "size",
                 "shapes")

    def __init__(self, layer):
        self.act = _engine.activation_code(layer.activation)
        self.hidden = self.k = layer.hidden_size
        self.ffn = layer.size_per_partition
        self.f1 = 2 * self.ffn if self.act >= 16 else self.ffn
        kw = layer._act_kw
        self.act_params = (float(kw.get("limit", 7.0)), float(kw.get("alpha", 1.702)),
                           float(kw.get("glu_linear_offset", 1.0)))
        self.rms = layer.normalization == "RMSNorm"
        self.eps, self.zcg = float(layer.eps), 1 if layer.zero_centered_gamma else 0
        self.bias = layer.use_bias
        self.sp_row, self.size = False, layer.tp.size
        # fc1's weight, the norm's weight and bias, fc2's weight, fc1's and fc2's bias (make_call's order)
        h = self.hidden
        self.shapes = ((self.f1, h), (h,), (h,), (h, self.ffn), (self.f1,), (h,))


class Call:
    """One call's facts for its steps (see the module docstring)."""

    __slots__ = ("layer", "plan", "dtype", "cast", "ready", "first_mb", "device", "dev", "ws", "nbytes", "stream",
                 "code", "fp8")

    def refresh_stream(self):
        """Backward may run on another stream than the forward: the current one."""
        if self.dev >= 0:
            self.stream = _engine.engine_device(self.dev).stream()


def make_call(layer, plan, x, w, params, is_first_microbatch):
    """The Call of one layer call: x the input, w the (first) weight, params
    the other tensors the Function reads (None allowed), in the order of
    plan.shapes."""
    c = Call()
    c.layer, c.plan, c.first_mb = layer, plan, is_first_microbatch
    c.fp8 = None
    if _FP8State.FP8_CALIBRATION and not _FP8State.FP8_ENABLED:
        raise NotImplementedError(f"{type(layer).__name__}: FP8 calibration (autocast(calibrating=True)) is not "
                                  "implemented")
    if _FP8State.FP8_ENABLED:  # the GEMMs run in FP8 (module/_fp8.py)
        from ._fp8 import layer_call
        c.fp8 = layer_call(c, layer, x, _is_grad_enabled(), is_first_microbatch)
    dtype = w.dtype
    ready = False
    shapes = plan.shapes
    if (type(x) is _Tensor and x.dtype is dtype and type(w) is _Parameter and w.is_contiguous()
            and w.shape == shapes[0]):
        sh = x.shape
        ready = (len(sh) in (2, 3) and sh[-1] == plan.k and x.is_contiguous()
                 and not (plan.sp_row and sh[0] % plan.size) and not _any_autocast())
        if ready:
            i = 1
            for p in params:
                if p is not None and not (type(p) is _Parameter and p.dtype is dtype and p.is_contiguous()
                                          and p.shape == shapes[i]):
                    ready = False
                    break
                i += 1
        if ready:
            index = _device_index(x, (w,) + tuple(params))
            ready = index is not None
    if ready:
        d = _engine.engine_device(index if index >= 0 else x.device)
        c.cast = False
    else:
        dtype, c.cast = compute_dtype(w)
        d = _engine.engine_device(_full_device(w.device))
    c.ready, c.dtype, c.code = ready, dtype, _DTYPE_CODES[dtype]
    c.device, c.dev, c.ws, c.nbytes = d.device, d.code, d.ws, d.nbytes
    c.stream = d.stream()
    return c


def _full_device(device):
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _device_index(x, params):
    """The CUDA ordinal of x when x and every tensor of params (None
    allowed) lie on it, -1 when all are on the CPU, else None."""
    if x.is_cpu:
        for p in params:
            if p is not None and not p.is_cpu:
                return None
        return -1
    if not x.is_cuda:
        return None
    index = x.get_device()
    for p in params:
        if p is not None and (not p.is_cuda or p.get_device() != index):
            return None
    return index


def check_params(named, dtype, device, shapes):
    """The converted parameters of a call that was not ready: each (name,
    tensor or None) of `named` of dtype, on device, contiguous, of its shape
    in `shapes` (the named errors of _engine.check_tensor)."""
    for (name, t), shape in zip(named, shapes):
        if t is not None:
            _engine.check_tensor(t, name, dtype=dtype, device=device, shape=shape)


def grad_output(dout, dtype):
    """dout as backward needs it: contiguous, in the compute dtype."""
    if dout.dtype is not dtype:
        dout = dout.to(dtype)
    return dout if dout.is_contiguous() else dout.contiguous()


def check_saved(t, dtype, shape, name):
    """A saved parameter still has its forward dtype, shape and layout (a
    `.data` swap between forward and backward would otherwise be read
    wrongly)."""
    if t.dtype is not dtype or t.shape != shape or not t.is_contiguous():
        raise RuntimeError(f"the layer's {name} changed between forward and backward: now {t.dtype} "
                           f"{tuple(t.shape)} strides {t.stride()}, was {dtype} {list(shape)} contiguous")
