"""What Linear and LayerNormLinear share: constructor checks, parameter
creation, input validation and the tensor-parallel GEMM steps (fprop, dgrad,
wgrad) with their non-overlapped collectives."""
import math

import torch

from .. import _engine
from ..distributed import all_gather_rows, all_reduce, reduce_scatter_rows, resolve_tp

PARALLEL_MODES = (None, "column", "row")
UB_FLAGS = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")


def default_device(device):
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    return device


def default_dtype(params_dtype):
    dtype = params_dtype or torch.get_default_dtype()
    _engine.dtype_code(dtype, "params_dtype")
    return dtype


class TPConfig:
    """The tensor-parallel facts a layer's autograd function needs."""

    __slots__ = ("mode", "sp", "group", "size", "rank")

    def __init__(self, parallel_mode, sequence_parallel, tp_group, tp_size):
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        self.group, self.size, self.rank = resolve_tp(tp_group, tp_size)
        self.mode = parallel_mode
        if sequence_parallel and parallel_mode is None:
            raise ValueError("sequence_parallel=True needs parallel_mode='column' or 'row'")
        self.sp = bool(sequence_parallel) and self.size > 1

    def local_features(self, in_features, out_features):
        """(local in, local out) of the weight shard."""
        for name, n, split in (("out_features", out_features, self.mode == "column"),
                               ("in_features", in_features, self.mode == "row")):
            if n <= 0:
                raise ValueError(f"{name} must be positive, got {n}")
            if split and n % self.size:
                raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size {self.size}")
        if self.mode == "column":
            return in_features, out_features // self.size
        if self.mode == "row":
            return in_features // self.size, out_features
        return in_features, out_features


def check_ub_flags(layer, flags):
    on = [k for k in UB_FLAGS if flags.get(k)]
    if on or flags.get("ub_name") is not None:
        raise NotImplementedError(f"{type(layer).__name__}: userbuffers overlap ({', '.join(on) or 'ub_name'}) "
                                  "is not available in this build yet")


def make_weight(out_local, in_local, dtype, device, init_method):
    w = torch.empty(out_local, in_local, dtype=dtype, device=device)
    if init_method is not None:
        init_method(w)
    else:
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    return torch.nn.Parameter(w)


def check_input(inp, in_local, weight, tp, name="inp"):
    """Validate the layer input; return it as a contiguous 2-D [tokens, in]."""
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inp).__name__}")
    if not inp.is_floating_point():
        raise TypeError(f"{name} has dtype {inp.dtype}; expected {weight.dtype}")
    if inp.dtype != weight.dtype:
        raise TypeError(f"{name} has dtype {inp.dtype} but the layer's parameters are {weight.dtype}")
    if inp.device != weight.device:
        raise ValueError(f"{name} is on {inp.device} but the layer's parameters are on {weight.device}")
    if inp.dim() not in (2, 3):
        raise ValueError(f"{name} must be 2-D [tokens, hidden] or 3-D [seq, batch, hidden], got shape {tuple(inp.shape)}")
    if inp.shape[-1] != in_local:
        raise ValueError(f"{name} has last dimension {inp.shape[-1]}; expected {in_local} (shape {tuple(inp.shape)})")
    if tp.sp and tp.mode == "row" and inp.shape[0] % tp.size:
        raise ValueError(f"{name}: sequence length {inp.shape[0]} is not divisible by the tensor-parallel size "
                         f"{tp.size} (sequence_parallel reduce-scatters the output along the sequence)")
    return inp.reshape(-1, inp.shape[-1]).contiguous()


def out_shape(inp_shape, rows, cols):
    """The output shape: the input's leading dims with rows tokens, cols features."""
    if len(inp_shape) == 2:
        return (rows, cols)
    return (rows // inp_shape[1], inp_shape[1], cols)


# -------------------------------------------------------------- GEMM steps


def gather_input(x, tp):
    """Column + sequence parallel: the full-sequence input every rank needs."""
    return all_gather_rows(x, tp.group, tp.size) if tp.mode == "column" and tp.sp else x


def fprop(x_total, w, bias, tp):
    """Y = X W^T (+ bias) followed by the row-parallel reduction."""
    fused_bias = bias if tp.mode != "row" else None
    y = _engine.gemm(x_total, w, transb=True, bias=fused_bias)
    if tp.mode == "row":
        y = reduce_scatter_rows(y, tp.group, tp.size) if tp.sp else all_reduce(y, tp.group, tp.size)
        if bias is not None:
            y += bias
    return y


def gather_grad_output(dy, tp):
    """Row + sequence parallel: the full-sequence grad_output for dgrad/wgrad."""
    return all_gather_rows(dy, tp.group, tp.size) if tp.mode == "row" and tp.sp else dy


def dgrad(dy_total, w, tp):
    """dX = dY W, followed by the column-parallel reduction."""
    dx = _engine.gemm(dy_total, w)
    if tp.mode == "column":
        dx = reduce_scatter_rows(dx, tp.group, tp.size) if tp.sp else all_reduce(dx, tp.group, tp.size)
    return dx


def wgrad(dy_total, x_total, with_bias):
    """dW = dY^T X, and the bias gradient (sum of dY over tokens)."""
    return _engine.gemm(dy_total, x_total, transa=True, bias_grad=with_bias)
