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

    def __deepcopy__(self, memo):
        # Immutable and holding a process group (which cannot be copied): a
        # deep-copied layer shares its tensor-parallel group, as it should.
        return self

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


_UB_VALID = {"column": ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"),
             "row": ("ub_overlap_rs", "ub_overlap_ag")}


class UBConfig:
    """Which userbuffers overlaps a layer runs and on which communicators.

    Roles: "fprop" (column: input all-gather + GEMM; row: GEMM + output
    reduce-scatter), "dgrad" (column: dgrad reduce-scatter, or the bulk
    all-gather of the saved input; row: grad_output all-gather + dgrad) and
    "wgrad" (column: bulk reduce-scatter of dgrad during wgrad). Communicators
    come from ub_comm (a CommOverlap for every role, or {role: CommOverlap})
    or from the registry as f"{ub_name}_{role}"."""

    def __init__(self, layer, flags, ub_name, ub_comm, tp):
        self.flags = {k: bool(flags.get(k)) for k in UB_FLAGS}
        on = [k for k, v in self.flags.items() if v]
        self.enabled = bool(on)
        self.comms = {}
        cls = type(layer).__name__
        if not on:
            if ub_name is not None or ub_comm is not None:
                raise ValueError(f"{cls}: ub_name/ub_comm given but no ub_* overlap flag is set")
            return
        mode = tp.mode
        if mode is None:
            raise ValueError(f"{cls}: {', '.join(on)} need parallel_mode='column' or 'row'")
        bad = [k for k in on if k not in _UB_VALID[mode]]
        if bad:
            raise ValueError(f"{cls}: {', '.join(bad)} do not apply to a {mode}-parallel layer "
                             f"(valid: {', '.join(_UB_VALID[mode])})")
        if tp.size > 1 and not tp.sp:
            raise ValueError(f"{cls}: {', '.join(on)} overlap the sequence-parallel collectives and need "
                             "sequence_parallel=True")
        f = self.flags
        if f["ub_overlap_rs_dgrad"] and (f["ub_bulk_dgrad"] or f["ub_bulk_wgrad"]):
            raise ValueError(f"{cls}: ub_overlap_rs_dgrad already overlaps the dgrad reduce-scatter (with the "
                             "dgrad GEMM); it cannot be combined with ub_bulk_dgrad/ub_bulk_wgrad, which use the "
                             "dgrad and wgrad communicators for the bulk all-gather / reduce-scatter")
        roles = set()
        if mode == "column":
            if f["ub_overlap_ag"]:
                roles.add("fprop")
            if f["ub_overlap_rs_dgrad"] or f["ub_bulk_dgrad"]:
                roles.add("dgrad")
            if f["ub_bulk_wgrad"]:
                roles.add("wgrad")
        else:
            if f["ub_overlap_rs"]:
                roles.add("fprop")
            if f["ub_overlap_ag"]:
                roles.add("dgrad")
        for role in sorted(roles):
            if isinstance(ub_comm, dict):
                c = ub_comm.get(role)
                if c is None:
                    raise ValueError(f"{cls}: ub_comm has no communicator for role {role!r} "
                                     f"(needed by {', '.join(on)})")
            elif ub_comm is not None:
                c = ub_comm
            elif ub_name is not None:
                from ..userbuffers import get_ub
                c = get_ub(f"{ub_name}_{role}")
            else:
                raise ValueError(f"{cls}: {', '.join(on)} need ub_name (registry, see initialize_ub) or ub_comm")
            if c.tp_size != tp.size:
                raise ValueError(f"{cls}: communicator '{c.name}' has {c.tp_size} ranks, the layer's tp group "
                                 f"{tp.size}")
            self.comms[role] = c
        if f["ub_bulk_dgrad"] and f["ub_bulk_wgrad"] and self.comms["dgrad"] is self.comms["wgrad"]:
            raise ValueError(f"{cls}: ub_bulk_dgrad and ub_bulk_wgrad run at the same time (the wgrad GEMM reads "
                             "the gathered input from the dgrad communicator while the wgrad one "
                             "reduce-scatters): give two communicators (ub_comm={'dgrad': a, 'wgrad': b})")

    def __getitem__(self, k):
        return self.flags[k]


class TPModule(torch.nn.Module):
    """What the layers share as modules: the tensor-parallel facts TE exposes."""

    @property
    def parallel_mode(self):
        return self.tp.mode

    @property
    def sequence_parallel(self):
        return self.tp.sp


def check_ub_flags(layer, flags, ub_comm=None, tp=None):
    return UBConfig(layer, flags, flags.get("ub_name"), ub_comm, tp if tp is not None else layer.tp)


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
    return as_2d(inp)


# A reshape or view costs microseconds of host time, on every layer call:
# 2-D tensors skip them. The autograd Functions return 2-D outputs (and 3-D
# grads for 3-D inputs); the modules view a 3-D input's output outside the
# Function, so an output can be modified in place whatever the input's rank
# (a view made inside a custom Function cannot be). LayerNormLinear's
# normalised output, which is also saved, is the exception on purpose.

def as_2d(t):
    """t as a contiguous [tokens, features]: t itself when it already is one."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def like_input(y, inp_shape):
    """y [tokens, features] with the input's leading dims (y itself for a 2-D input)."""
    if len(inp_shape) == 2:
        return y
    return y.view(y.shape[0] // inp_shape[1], inp_shape[1], y.shape[1])


# -------------------------------------------------------------- GEMM steps


def gather_input(x, tp, async_op=False):
    """Column + sequence parallel: the full-sequence input every rank needs
    (with async_op: (it, work to wait for or None))."""
    if tp.mode == "column" and tp.sp:
        return all_gather_rows(x, tp.group, tp.size, async_op)
    return (x, None) if async_op else x


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


# ------------------------------------------------------ userbuffers steps


def outside_buffers(t, ub):
    """t, or a copy of it if it lives in one of the layer's communicator
    buffers (a caller may pass get_buffer(local_chunk=True) as the input):
    what is saved for backward must not alias a buffer the next layer reuses."""
    if ub.enabled and any(comm.overlaps(t) for comm in ub.comms.values()):
        return t.clone()
    return t


def ub_fprop(x, w, bias, tp, ub):
    """fprop through a communicator when the layer's flags say so and the
    overlap pays at this shape (CommOverlap.take_overlap), else None."""
    if not ub.enabled:
        return None
    if tp.mode == "column" and ub["ub_overlap_ag"]:
        c = ub.comms["fprop"]
        if c.take_overlap("ag", x.shape[0], x.shape[1], w.shape[0]):
            return c.ag_gemm(x, w, bias=bias)
    elif tp.mode == "row" and ub["ub_overlap_rs"]:
        c = ub.comms["fprop"]
        if c.take_overlap("rs", x.shape[0] // tp.size, x.shape[1], w.shape[0]):
            return c.gemm_rs(x, w, bias=bias)
    return None


def column_backward(dy, x_local, w, tp, ub, need_dx, need_w, with_bias):
    """Column layer backward (dy: [S, out/tp]; x_local: the saved local input).
    Returns (dx, (dw, db) or None), running the ub overlaps the flags ask for."""
    try:
        return _column_backward(dy, x_local, w, tp, ub, need_dx, need_w, with_bias)
    except BaseException:
        for comm in ub.comms.values():  # no bulk operation is left pending
            comm._abandon()
        raise


def wgrad_gather_comm(x_local, w, tp, ub):
    """The communicator that gathers a column layer's input for wgrad on the
    copy engines when ub_bulk_dgrad does not: the layer's fprop communicator
    (it gathered the same input in the forward, so its buffer fits), idle
    during the backward unless it is also the dgrad one, and only where the
    forward overlapped at this shape. None: NCCL gathers it."""
    if not (ub.enabled and tp.sp and ub["ub_overlap_ag"]):
        return None
    c = ub.comms["fprop"]
    if c is ub.comms.get("dgrad") or c is ub.comms.get("wgrad"):
        return None
    if x_local.numel() * x_local.element_size() * tp.size > c.nbytes:
        return None
    return c if c.pays("ag", x_local.shape[0], x_local.shape[1], w.shape[0]) else None


def _column_backward(dy, x_local, w, tp, ub, need_dx, need_w, with_bias):
    f = ub.flags if ub.enabled else dict.fromkeys(UB_FLAGS, False)
    x_total = gathering = bulk_gather = None
    if f["ub_bulk_dgrad"]:
        bulk_gather = ub.comms["dgrad"]
    elif need_w:
        bulk_gather = wgrad_gather_comm(x_local, w, tp, ub)
    if bulk_gather is not None:  # the input all-gather for wgrad runs during the dgrad GEMM
        bulk_gather.bulk_ag_start(x_local)
    elif need_w and need_dx:
        x_total, gathering = gather_input(x_local, tp, async_op=True)
    dx = dx_partial = None
    if need_dx:
        if f["ub_overlap_rs_dgrad"] and ub.comms["dgrad"].take_overlap("rs", dy.shape[0] // tp.size, dy.shape[1],
                                                                      w.shape[1]):
            dx = ub.comms["dgrad"].gemm_rs(dy, w, transb=False)
        elif f["ub_bulk_wgrad"]:
            dx_partial = _engine.gemm(dy, w)
        else:
            dx = dgrad(dy, w, tp)
    if bulk_gather is not None:
        x_total = bulk_gather.bulk_ag_finish()
    if dx_partial is not None:
        ub.comms["wgrad"].bulk_rs_start(dx_partial)
    res = None
    if need_w:
        if gathering is not None:
            gathering.wait()
        elif x_total is None:
            x_total = gather_input(x_local, tp)
        res = wgrad(dy, x_total, with_bias)
        res = res if with_bias else (res, None)
    if dx_partial is not None:
        dx = ub.comms["wgrad"].bulk_rs_finish()
    return dx, res


def row_backward(dy_local, w, tp, ub, need_dx):
    """Row layer: (dx or None, dy_total for wgrad). With ub_overlap_ag the
    grad_output all-gather overlaps dgrad; dy_total is then a buffer view,
    valid until the communicator's next use (wgrad runs right after)."""
    if ub.enabled and ub["ub_overlap_ag"] and need_dx and ub.comms["dgrad"].take_overlap(
            "ag", dy_local.shape[0], dy_local.shape[1], w.shape[1]):
        c = ub.comms["dgrad"]
        dx = c.ag_gemm(dy_local, w, transb=False)
        return dx, c.get_buffer(shape=(dy_local.shape[0] * c.tp_size, dy_local.shape[1]), dtype=dy_local.dtype)
    dy = gather_grad_output(dy_local, tp)
    return (dgrad(dy, w, tp) if need_dx else None), dy
