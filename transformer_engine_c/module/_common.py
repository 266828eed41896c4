"""The steps Linear and LayerNormLinear share inside their autograd
Functions: tensor-parallel and userbuffers configuration, input validation,
and the tensor-parallel GEMM steps (fprop, dgrad, wgrad) with their
collectives, overlapped or not. The modules themselves (parameters, TE's
constructor arguments) build on module/base.py."""
import contextlib
import warnings

import torch

from .. import _engine
from ..distributed import all_gather_rows, all_reduce, reduce_scatter_rows, resolve_tp
from ..userbuffers import CommOverlap
from ._weights import is_distributed_weight, weight_grad

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


def compute_dtype(weight):
    """(dtype, cast): the dtype a layer call computes in and whether inputs
    and parameters are cast to it: torch.autocast's where it is on for the
    parameters' device type (TransformerEngine honours it the same way: fp32
    master weights cast per call), else the parameters' own, uncast."""
    kind = "cuda" if weight.is_cuda else "cpu"
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        _engine.dtype_code(dtype, "the autocast dtype")
        return dtype, True
    return weight.dtype, False


class TPConfig:
    """The tensor-parallel facts a layer's autograd function needs."""

    __slots__ = ("mode", "sp", "group", "size", "rank")

    def __init__(self, parallel_mode, sequence_parallel, tp_group, tp_size):
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        self.group, self.size, self.rank = resolve_tp(tp_group, tp_size)
        self.mode = parallel_mode
        # As in TE: sequence parallelism is off on one rank; without a
        # parallel mode it only marks the norm parameters (each rank holds
        # its own tokens, so their gradients are partial sums).
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


def check_same_size(layer, tp_group):
    """set_tensor_parallel_group: the new group must have the layer's
    tensor-parallel size (its weights were split for it)."""
    size = resolve_tp(tp_group, None)[1]
    if size != layer.tp.size:
        raise ValueError(f"{type(layer).__name__}.set_tensor_parallel_group: the group has {size} ranks but the "
                         f"layer was built for a tensor-parallel size of {layer.tp.size}")


_UB_VALID = {"column": ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad"),
             "row": ("ub_overlap_rs", "ub_overlap_ag")}


class UBConfig:
    """Which userbuffers overlaps a layer runs and on which communicators.

    The flags mean what they mean in TransformerEngine, and a flag that does
    not apply is ignored as TE ignores it (one UserWarning per layer names
    them): column layers use ub_overlap_ag, ub_overlap_rs_dgrad and the bulk
    flags (the bulk ones are off when ub_overlap_rs_dgrad is on), row layers
    ub_overlap_rs and ub_overlap_ag, and only under sequence parallelism, or
    on a single rank with a communicator given directly (ub_comm), which runs
    the schedules on one rank.

    Roles: "fprop" (column: input all-gather + GEMM; row: GEMM + output
    reduce-scatter), "dgrad" (column: dgrad reduce-scatter, or the bulk
    all-gather of the saved input; row: grad_output all-gather + dgrad) and
    "wgrad" (column: bulk reduce-scatter of dgrad during wgrad). Communicators
    come from ub_comm (a CommOverlap for every role, or {role: CommOverlap})
    or from the registry as f"{ub_name}_{role}"."""

    def __init__(self, layer, flags, ub_name, ub_comm, tp):
        asked = [k for k in UB_FLAGS if flags.get(k)]
        mode, cls = tp.mode, type(layer).__name__
        live = mode is not None and (tp.sp or (tp.size == 1 and ub_comm is not None))
        on = [k for k in asked if live and k in _UB_VALID[mode]]
        if "ub_overlap_rs_dgrad" in on:
            on = [k for k in on if k not in ("ub_bulk_dgrad", "ub_bulk_wgrad")]
        ignored = [k for k in asked if k not in on]
        if ignored:
            why = ("without parallel_mode" if mode is None else
                   "without sequence parallelism" if not live else
                   f"by a {mode}-parallel layer (or replaced by ub_overlap_rs_dgrad)")
            warnings.warn(f"{cls}: {', '.join(ignored)} ignored {why}, as TransformerEngine ignores them",
                          UserWarning, stacklevel=4)
        self.flags = {k: k in on for k in UB_FLAGS}
        self.enabled = bool(on)
        self.comms = {}
        if not on:
            return
        roles = set()
        if mode == "column":
            if "ub_overlap_ag" in on:
                roles.add("fprop")
            if "ub_overlap_rs_dgrad" in on or "ub_bulk_dgrad" in on:
                roles.add("dgrad")
            if "ub_bulk_wgrad" in on:
                roles.add("wgrad")
        else:
            if "ub_overlap_rs" in on:
                roles.add("fprop")
            if "ub_overlap_ag" in on:
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
            if not isinstance(c, CommOverlap):
                raise TypeError(f"{cls}: ub_comm must be a transformer_engine_c.CommOverlap or a dict of them, "
                                f"got {type(c).__name__}")
            if c.tp_size != tp.size:
                raise ValueError(f"{cls}: communicator '{c.name}' has {c.tp_size} ranks, the layer's tp group "
                                 f"{tp.size}")
            self.comms[role] = c
        if "ub_bulk_dgrad" in on and "ub_bulk_wgrad" in on and self.comms["dgrad"] is self.comms["wgrad"]:
            raise ValueError(f"{cls}: ub_bulk_dgrad and ub_bulk_wgrad run at the same time (the wgrad GEMM reads "
                             "the gathered input from the dgrad communicator while the wgrad one "
                             "reduce-scatters): give two communicators (ub_comm={'dgrad': a, 'wgrad': b})")

    def __getitem__(self, k):
        return self.flags[k]


class _NoUB:
    """A UBConfig with nothing on: what a call with no tokens uses (the
    schedules need at least one row per rank)."""
    enabled = False
    flags = dict.fromkeys(UB_FLAGS, False)
    comms = {}

    def __getitem__(self, k):
        return False


NO_UB = _NoUB()


def cast(t, dtype):
    """t in the call's compute dtype (None and tensors already in it pass)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def check_input(inp, in_local, dtype, device, tp, cast, name="inp"):
    """Validate the layer input; return it as a contiguous 2-D [tokens, in]
    in the layer's compute dtype `dtype`: under autocast (`cast`) the input
    is cast to it, as TransformerEngine casts it; outside autocast its dtype
    must be the parameters' (TE's rule too)."""
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inp).__name__}")
    if not inp.is_floating_point():
        raise TypeError(f"{name} has dtype {inp.dtype}; expected {dtype}")
    if inp.device != device:
        raise ValueError(f"{name} is on {inp.device} but the layer's parameters are on {device}")
    if inp.dim() not in (2, 3):
        raise ValueError(f"{name} must be 2-D [tokens, hidden] or 3-D [seq, batch, hidden], got shape {tuple(inp.shape)}")
    if inp.shape[-1] != in_local:
        raise ValueError(f"{name} has last dimension {inp.shape[-1]}; expected {in_local} (shape {tuple(inp.shape)})")
    if tp.sp and tp.mode == "row" and inp.shape[0] % tp.size:
        raise ValueError(f"{name}: sequence length {inp.shape[0]} is not divisible by the tensor-parallel size "
                         f"{tp.size} (sequence_parallel reduce-scatters the output along the sequence)")
    if inp.dtype != dtype:
        if not cast:
            raise TypeError(f"{name} has dtype {inp.dtype} but the layer's parameters are {dtype} (outside "
                            "torch.autocast the input must have the parameters' dtype)")
        inp = inp.to(dtype)
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


def like_input(y, inp_shape, tp=None):
    """y [tokens, features] with the input's leading dims (y itself for a
    2-D input). `tp`: y is the layer's output, whose sequence length the
    sequence-parallel collectives changed (needed only when batch is 0)."""
    if len(inp_shape) == 2:
        return y
    b = inp_shape[1]
    if b:
        return y.view(y.shape[0] // b, b, y.shape[1])
    s = inp_shape[0]
    if tp is not None and tp.sp:
        s = s * tp.size if tp.mode == "column" else s // tp.size if tp.mode == "row" else s
    return y.view(s, 0, y.shape[1])


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
    y = _engine.linear(x_total, w, fused_bias)
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
    dx = _engine.dgrad(dy_total, w)
    if tp.mode == "column":
        dx = reduce_scatter_rows(dx, tp.group, tp.size) if tp.sp else all_reduce(dx, tp.group, tp.size)
    return dx


class Wgrad:
    """How one backward finishes its weight gradient, as TransformerEngine
    does: returned to autograd; or, with fuse_wgrad_accumulation, accumulated
    in fp32 into `main_grad` by the GEMM itself (overwritten on the first
    micro-batch); or, with delay_wgrad_compute, computed later by the
    module's backward_dw(). `bias_from_local`: the bias gradient is summed
    over this rank's tokens only (a row layer under sequence parallelism,
    whose bias carries `sequence_parallel` and is reduced by the framework)."""

    __slots__ = ("layer", "params", "weight", "need_w", "fuse", "accumulate", "delay", "with_bias",
                 "bias_from_local")

    def __init__(self, layer, weight, with_bias, is_first_microbatch, bias_from_local=False, need_w=True):
        # with_bias: the bias gradient is wanted; need_w: the weight's is (a
        # frozen weight gets no GEMM, no main_grad write and no .grad).
        self.layer, self.weight, self.with_bias, self.need_w = layer, weight, with_bias, need_w
        self.fuse = layer.fuse_wgrad_accumulation
        self.accumulate = self.fuse and not is_first_microbatch
        self.delay = layer.delay_wgrad_compute
        # The parameter objects (for main_grad, or .grad in backward_dw).
        self.params = layer._weight_params() if self.fuse or self.delay else None
        self.bias_from_local = bias_from_local

    def __call__(self, dy_total, x_total, ub, dy_local=None):
        """(dw for autograd, db for autograd): computed now, or (None, None)
        after queueing the GEMM for backward_dw()."""
        db_local = None
        if self.bias_from_local and self.with_bias:
            db_local = dy_local.sum(0, dtype=torch.float32).to(dy_local.dtype)
        if self.delay:
            dy_total, x_total = outside_buffers(dy_total, ub), outside_buffers(x_total, ub)
            self.layer._wgrad_queue.append((self, dy_total, x_total, db_local))
            return None, None
        dw, db = self.compute(dy_total, x_total)
        return dw, (db_local if self.bias_from_local else db)

    def compute(self, dy_total, x_total):
        """dW = dY^T X (and the bias gradient, the sum of dY over tokens):
        into main_grad with fuse_wgrad_accumulation, else returned."""
        with_bias = self.with_bias and not self.bias_from_local
        if not self.need_w:  # only the bias gradient: dY's column sums, no GEMM
            return None, (dy_total.sum(0, dtype=torch.float32).to(dy_total.dtype) if with_bias else None)
        w = self.weight
        if not self.fuse or is_distributed_weight(w):
            res = _engine.wgrad(dy_total, x_total, with_bias)
            dw, db = res if with_bias else (res, None)
            if self.fuse and not is_distributed_weight(w):
                return self._into_main_grad(dw), db
            return weight_grad(w, dw), db
        if len(self.params) == 1:
            main = main_grad_of(self.params[0])
            res = _engine.gemm(dy_total, x_total, transa=True, out=main, accumulate=self.accumulate,
                               bias_grad=with_bias)
            db = res[1] if with_bias else None
        else:
            res = _engine.gemm(dy_total, x_total, transa=True, out_dtype=torch.float32, bias_grad=with_bias)
            dw, db = res if with_bias else (res, None)
            return self._into_main_grad(dw), db
        return self._dummy_grads(), db

    def _into_main_grad(self, dw):
        """Add (or, on a first micro-batch, copy) dw into the main_grad of
        each weight parameter (rows of dw in parameter order)."""
        row = 0
        for p in self.params:
            part = dw[row:row + p.shape[0]]
            row += p.shape[0]
            main = main_grad_of(p)
            main.add_(part) if self.accumulate else main.copy_(part)
        return self._dummy_grads()

    def _dummy_grads(self):
        """TransformerEngine's protocol with Megatron's DDP: a weight with
        `grad_added_to_main_grad` gets it set and a dummy gradient (zeros if it
        asks by `zero_out_wgrad`) that the framework's hook ignores; without
        the attribute the gradient is None."""
        out = []
        for p in self.params:
            if hasattr(p, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = True
                make = torch.zeros if getattr(p, "zero_out_wgrad", False) else torch.empty
                out.append(make(p.shape, dtype=p.dtype, device=p.device))
            else:
                out.append(None)
        if len(out) == 1 or any(g is None for g in out):
            return out[0] if len(out) == 1 else None
        return torch.cat(out)


def main_grad_of(p):
    main = getattr(p, "main_grad", None)
    if main is None:
        raise RuntimeError("fuse_wgrad_accumulation=True needs the weight's main_grad (an fp32 tensor of the "
                           "weight's shape that the training framework allocates, as Megatron does); this "
                           f"weight of shape {tuple(p.shape)} has none")
    if main.shape != p.shape or main.dtype != torch.float32 or not main.is_contiguous() or main.device != p.device:
        raise ValueError(f"weight.main_grad must be a contiguous float32 tensor of shape {tuple(p.shape)} on "
                         f"{p.device}; got {main.dtype} {tuple(main.shape)} on {main.device}")
    return main


def in_comm_buffer(t, comms):
    """Whether the bytes of t (contiguous) lie in any of comms' buffers
    (CommOverlap.overlaps, its address range found once)."""
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


def ub_fprop(x, w, bias, tp, ub):
    """fprop through a communicator when the layer's flags say so and the
    overlap pays at this shape (CommOverlap.take_overlap), else None."""
    if not ub.enabled or x.shape[0] == 0:
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


def norm_ag_gemm(comm, x, gamma, beta, eps, zero_centered_gamma, w, bias, tp, gathered):
    """LayerNorm/RMSNorm straight into this rank's slot of `comm`'s buffer,
    then the all-gather + GEMM overlap on it. Returns (y, ln_out, mu,
    rsigma, the gathered normalised input or None): ln_out (what is saved
    and returned) is a copy, never the buffer, made on the comm stream while
    the GEMMs run; `gathered` asks for a copy of the whole gathered input.
    The communicator is held for the sequence (another thread's operation
    between the norm and the gather would overwrite the slot)."""
    with comm.exclusive():
        slot = comm.get_buffer(local_chunk=True, shape=x.shape, dtype=x.dtype)
        ln_view, mu, rsigma = _engine.norm_fwd(x, gamma, beta, eps, zero_centered_gamma, out=slot)
        ln_out = torch.empty_like(x)
        y = comm.ag_gemm(ln_view, w, bias=bias, local_copy=ln_out)
        ln_total = None
        if gathered:
            ln_total = comm.get_buffer(shape=(x.shape[0] * tp.size, x.shape[1]), dtype=x.dtype).clone()
    return y, ln_out, mu, rsigma, ln_total


def _held(ub):
    """Every communicator of `ub` held by this thread (a backward's bulk
    start ... finish pairs and buffer reads belong together)."""
    stack = contextlib.ExitStack()
    for c in {id(c): c for c in ub.comms.values()}.values():
        stack.enter_context(c.exclusive())
    return stack


def linear_backward(ctx, dy, x_local, w, weight, need_dx, iw):
    """A layer's linear backward: (dx, dw, db). `weight` is the saved weight
    object (a DistributedWeight comes back as itself), `w` the full weight in
    the compute dtype; the weight and bias gradients are wanted as
    ctx.needs_input_grad[iw] and [iw + 1] say."""
    layer = ctx.layer
    tp, need = layer.tp, ctx.needs_input_grad
    wg = None
    if need[iw] or need[iw + 1]:
        wg = Wgrad(layer, weight, ctx.has_bias and need[iw + 1], ctx.first_mb,
                   bias_from_local=tp.mode == "row" and tp.sp, need_w=need[iw])
    if tp.mode == "column":
        return column_backward(dy, x_local, w, tp, layer.ub, need_dx, wg)
    return row_backward(dy, x_local, w, tp, layer.ub, need_dx, wg)


def column_backward(dy, x_local, w, tp, ub, need_dx, wg):
    """Column layer backward (dy: [S, out/tp]; x_local: the saved local
    input; wg: a Wgrad, or None when no weight/bias gradient is needed).
    Returns (dx, dw, db), running the ub overlaps the flags ask for."""
    if dy.shape[0] == 0:
        ub = NO_UB
    try:
        if not ub.enabled:
            return _column_backward(dy, x_local, w, tp, ub, need_dx, wg)
        with _held(ub):
            return _column_backward(dy, x_local, w, tp, ub, need_dx, wg)
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


def _column_backward(dy, x_local, w, tp, ub, need_dx, wg):
    f = ub.flags if ub.enabled else dict.fromkeys(UB_FLAGS, False)
    need_w = wg is not None
    x_total = gathering = bulk_gather = None
    if f["ub_bulk_dgrad"] and need_w:
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
        elif f["ub_bulk_wgrad"] and need_w:
            dx_partial = _engine.dgrad(dy, w)
        else:
            dx = dgrad(dy, w, tp)
    if bulk_gather is not None:
        x_total = bulk_gather.bulk_ag_finish()
    if dx_partial is not None:
        ub.comms["wgrad"].bulk_rs_start(dx_partial)
    dw = db = None
    if need_w:
        if gathering is not None:
            gathering.wait()
        elif x_total is None:
            x_total = gather_input(x_local, tp)
        dw, db = wg(dy, x_total, ub)
    if dx_partial is not None:
        dx = ub.comms["wgrad"].bulk_rs_finish()
    return dx, dw, db


def row_backward(dy_local, x_local, w, tp, ub, need_dx, wg):
    """Row layer backward (dy_local: this rank's grad_output; x_local: the
    saved input). Returns (dx, dw, db). With ub_overlap_ag the grad_output
    all-gather overlaps dgrad and wgrad reads the gathered grad_output from
    the buffer (copied first if wgrad is delayed)."""
    if ub.enabled and ub["ub_overlap_ag"] and need_dx and dy_local.shape[0] and ub.comms["dgrad"].take_overlap(
            "ag", dy_local.shape[0], dy_local.shape[1], w.shape[1]):
        c = ub.comms["dgrad"]
        with c.exclusive():  # the gathered grad_output stays in the buffer until wgrad has read it
            dx = c.ag_gemm(dy_local, w, transb=False)
            dy = c.get_buffer(shape=(dy_local.shape[0] * c.tp_size, dy_local.shape[1]), dtype=dy_local.dtype)
            dw = db = None
            if wg is not None:
                dw, db = wg(dy, x_local, ub, dy_local)
        return dx, dw, db
    else:
        dy = gather_grad_output(dy_local, tp)
        dx = dgrad(dy, w, tp) if need_dx else None
    dw = db = None
    if wg is not None:
        dw, db = wg(dy, x_local, ub, dy_local)
    return dx, dw, db
