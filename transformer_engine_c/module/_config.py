"""A layer's configuration and input rules, shared by the three layers:
TensorParallel (TPConfig) and userbuffers (UBConfig) facts, device and dtype
defaults, the compute dtype of a call, and the validation of a layer input
(what a call off the plan's common case goes through; module/_plan.py)."""
import warnings

import torch

from .. import _engine
from ..distributed import resolve_tp
from ..userbuffers import CommOverlap

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
        self.ub_name, self._fp8 = (ub_name if ub_comm is None else None), None
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
                from ..userbuffers import _registry, get_ub
                c = get_ub(f"{ub_name}_{role}", use_fp8=not _registry)  # initialize_ub(use_fp8=True): FP8 only
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

    def for_fp8(self):
        """The configuration an FP8 call runs: the same flags on the FP8
        communicators of the registry (initialize_ub's quantization mode
        FP8) where it has them, else on these (a buffer of the compute dtype
        holds twice the FP8 bytes). Resolved on the first FP8 call."""
        if self._fp8 is None:
            from ..userbuffers import has_fp8_ub, get_ub
            if self.ub_name is None or not has_fp8_ub():
                self._fp8 = self
            else:
                fp8 = object.__new__(UBConfig)
                fp8.flags, fp8.enabled, fp8.ub_name, fp8._fp8 = self.flags, self.enabled, self.ub_name, None
                fp8.comms = {role: get_ub(f"{self.ub_name}_{role}", use_fp8=True) for role in self.comms}
                fp8._fp8 = fp8
                self._fp8 = fp8
        return self._fp8


class _NoUB:
    """A UBConfig with nothing on: what a call with no tokens uses (the
    schedules need at least one row per rank)."""
    enabled = False
    flags = dict.fromkeys(UB_FLAGS, False)
    comms = {}

    def __getitem__(self, k):
        return False

    def for_fp8(self):
        return self


NO_UB = _NoUB()


def cast(t, dtype):
    """t in the call's compute dtype (None and tensors already in it pass)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def returned_bias(b, dtype):
    """The bias a return_bias layer hands back, in the compute dtype (an
    empty tensor for a layer without one, as TE). One that needs no
    gradient (that empty tensor, a frozen bias) is a new alias, never the
    layer's own object: an autograd Function that returns what it is given
    (a reentrant checkpoint's forward) attaches its history to that object,
    which would make the layer's tensor a non-leaf whose backward re-enters
    the Function without end. A bias that needs a gradient is the parameter
    itself (tec.checkpoint hands such a leaf back around the Function)."""
    t = cast(b, dtype)
    return t.view_as(t) if t is b and not t.requires_grad else t


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
