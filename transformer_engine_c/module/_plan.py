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
# plain tensor types: a Parameter, or a tensor made from them (split parameters joined)
_PLAIN_TYPES = (_Parameter, _Tensor)
_DTYPE_CODES = _engine.DTYPE_CODES
_CPU = torch.device("cpu")
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
                 "shapes", "rest", "checkpoint")

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
        self.rest = self.shapes[1:]
        self.checkpoint = bool(getattr(layer, "checkpoint", False))  # what FP8 calls keep for backward


class MLPPlan:
    """LayerNormMLP's decisions for one configuration."""

    __slots__ = ("hidden", "f1", "ffn", "act", "act_params", "rms", "eps", "zcg", "bias", "k", "sp_row", "size",
                 "shapes", "rest", "checkpoint")

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
        self.rest = self.shapes[1:]
        self.checkpoint = bool(layer.checkpoint)


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
    c.layer, c.plan, c.first_mb, c.fp8 = layer, plan, is_first_microbatch, None
    if _FP8State.FP8_ENABLED or _FP8State.FP8_CALIBRATION:
        if not _FP8State.FP8_ENABLED:
            raise NotImplementedError(f"{type(layer).__name__}: FP8 calibration (autocast(calibrating=True)) is "
                                      "not implemented")
        from ._fp8 import layer_call  # the GEMMs run in FP8 (module/_fp8.py)
        c.fp8 = layer_call(c, layer, x, _is_grad_enabled(), is_first_microbatch)
    dtype = w.dtype
    d = _ready_device(plan, x, w, params, dtype)
    if d is not None:
        c.ready, c.cast = True, False
    else:
        c.ready = False
        dtype, c.cast = compute_dtype(w)
        d = _engine.engine_device(_full_device(w.device))
    c.dtype, c.code = dtype, _DTYPE_CODES[dtype]
    c.device, c.dev, c.ws, c.nbytes = d.device, d.code, d.ws, d.nbytes
    c.stream = 0 if d.code < 0 else d.stream()
    return c


def _ready_device(plan, x, w, params, dtype):
    """The engine Device of a ready call (see the module docstring), else
    None: x a plain contiguous 2-D or 3-D tensor of dtype with plan.k
    features (a row layer's sequence divisible over the group), w and each
    tensor of params (None allowed) a contiguous plain tensor (a Parameter,
    or split parameters joined) of dtype and its shape in plan.shapes, all
    on one CPU or CUDA device, no autocast."""
    if type(x) is not _Tensor or x.dtype is not dtype or type(w) not in _PLAIN_TYPES or not w.is_contiguous():
        return None
    shapes = plan.shapes
    sh = x.shape
    if (w.shape != shapes[0] or len(sh) not in (2, 3) or sh[-1] != plan.k or not x.is_contiguous()
            or plan.sp_row and sh[0] % plan.size or _any_autocast()):
        return None
    if x.is_cpu:
        if not w.is_cpu:
            return None
        for p, shape in zip(params, plan.rest):
            if p is not None and not (type(p) in _PLAIN_TYPES and p.dtype is dtype and p.is_cpu and p.is_contiguous()
                                      and p.shape == shape):
                return None
        return _engine.engine_device(_CPU)
    if not x.is_cuda:
        return None
    index = x.get_device()
    if not w.is_cuda or w.get_device() != index:
        return None
    for p, shape in zip(params, plan.rest):
        if p is not None and not (type(p) in _PLAIN_TYPES and p.dtype is dtype and p.is_cuda
                                  and p.get_device() == index and p.is_contiguous() and p.shape == shape):
            return None
    return _engine.engine_device(index)


def _full_device(device):
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
