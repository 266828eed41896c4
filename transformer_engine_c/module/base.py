"""TransformerEngine's `module/base.py`, as this package offers it: the
userbuffers registry with TE's signatures (initialize_ub, get_ub, destroy_ub,
UserBufferQuantizationMode) and TransformerEngineBaseModule, what every
layer module shares:

* TE's constructor semantics: tensor-parallel group and size, the userbuffers
  flags (a flag that does not apply is ignored, as in TE), parameters created
  as TE creates them (one contiguous weight, optionally split into named
  parameters by `parameters_split`; `init_method` under the RNG tracker's
  fork; TE's parallel attributes on every parameter; inside
  quantized_model_init the weights quantized into Float8Tensor parameters);
* the compute dtype of a call (torch.autocast's, else the parameters');
* delayed weight gradients (`delay_wgrad_compute`, `backward_dw()`);
* the gathered DistributedWeight kept across the micro-batches of a step
  (`is_first_microbatch`).

Each layer has one autograd Function (in its own file), whose steps live in
module/_steps.py; the per-configuration plan and the per-call facts in
module/_plan.py; the weight-gradient policy in module/_wgrad.py.
"""
import enum
import types

import torch
import torch.distributed as dist

from .. import userbuffers as _ub
from .._fp8_meta import fp8_dtype_of, initial_fp8_meta, make_fp8_meta
from ..quantization import FP8GlobalStateManager as _FP8State
from ..recipe import DelayedScaling, Float8BlockScaling
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8ParamQuantizer, Float8Tensor
from ..tensor.quantized_tensor import QuantizedTensor
from .. import _library
from .. import quantization as _quantization
from . import _extra_state, _opcall
from ._config import TPConfig, UBConfig, check_same_size
from ._plan import PLAN_ATTRS, LinearPlan
from ._weights import is_distributed_weight
from ._wgrad import WeightGrads

_Parameter = torch.nn.Parameter

__all__ = ["initialize_ub", "get_ub", "destroy_ub", "UserBufferQuantizationMode", "TransformerEngineBaseModule"]


# ------------------------------------------------------------ the registry


class UserBufferQuantizationMode(enum.Enum):
    """The buffer formats TE's initialize_ub can create: NONE (the
    activation dtype) and FP8 (uint8 buffers that FP8 calls gather FP8 bytes
    through; get_ub(name, use_fp8=True))."""
    NONE = "none"
    FP8 = "fp8"


_domains = {}  # (world size, tp size) -> this rank's tensor-parallel domain group


def _domain_group(tp_size):
    """The tensor-parallel group of this rank when initialize_ub is not given
    one: the world if tp_size is its size, else TE's domains of tp_size
    consecutive ranks (made once; collective, like TE's)."""
    if not (dist.is_available() and dist.is_initialized()):
        if tp_size != 1:
            raise ValueError(f"initialize_ub: tp_size={tp_size} needs torch.distributed to be initialized")
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size == world:
        return None
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"initialize_ub: tp_size={tp_size} does not divide the world size {world} "
                         "(tensor-parallel domains are tp_size consecutive ranks)")
    key = (world, tp_size)
    if key not in _domains:
        mine = None
        for start in range(0, world, tp_size):  # every rank creates every domain, in the same order
            g = dist.new_group(list(range(start, start + tp_size)))
            if start <= rank < start + tp_size:
                mine = g
        _domains[key] = mine
    return _domains[key]


def initialize_ub(shape, tp_size, use_fp8=False, quantization_modes=None, dtype=torch.bfloat16, ub_cfgs=None,
                  bootstrap_backend=None, with_cublasmp=False, *, tp_group=None, **kwargs):
    """Create the userbuffers communicators of TE's layer names (qkv, proj,
    fc1, fc2 x fprop, dgrad, wgrad); collective over the tensor-parallel group.

    TE's arguments mean what they mean in TE: `shape` is [sequence * batch,
    hidden] of the full activations; `tp_size` the tensor-parallel size, whose
    domains are tp_size consecutive ranks of the world when no `tp_group` is
    given (ours, keyword only); `ub_cfgs` {layer name: {method, ...}}. The
    buffers live on the current CUDA device, or on the CPU where the group
    has no NCCL backend (gloo) or there is no GPU (`device=` decides).
    `bootstrap_backend` may be "nccl" or "gloo" (the handles are exchanged over
    the tensor-parallel process group either way); MPI bootstrapping and
    cuBLASMp raise NotImplementedError. `quantization_modes` (or the older
    `use_fp8`) as in TE: NONE makes buffers of `dtype`, FP8 uint8 buffers of
    the same shape that the layers' FP8 calls gather FP8 bytes through
    (docs/fp8.md, "Userbuffers"). Further keywords
    (transport, device, timeout, min_chunk_flops, gemm_sm_margin) are
    CommOverlap's."""
    if quantization_modes is None:  # TE: the older use_fp8 picks one mode
        modes = [UserBufferQuantizationMode.FP8 if use_fp8 else UserBufferQuantizationMode.NONE]
    else:
        if isinstance(quantization_modes, (str, UserBufferQuantizationMode)) or not quantization_modes:
            raise TypeError("initialize_ub: quantization_modes must be a non-empty list of "
                            f"UserBufferQuantizationMode, got {quantization_modes!r}")
        try:
            modes = [UserBufferQuantizationMode(m) for m in quantization_modes]
        except ValueError:
            raise ValueError(f"initialize_ub: quantization_modes {quantization_modes!r}: each must be a "
                             "UserBufferQuantizationMode (NONE or FP8)") from None
    if with_cublasmp:
        raise NotImplementedError("initialize_ub(with_cublasmp=True): cuBLASMp overlap is not supported")
    if bootstrap_backend not in (None, "nccl", "gloo"):
        if bootstrap_backend == "mpi":
            raise NotImplementedError("initialize_ub(bootstrap_backend='mpi'): bootstrapping goes through "
                                      "torch.distributed; use 'nccl' or 'gloo'")
        raise ValueError(f"bootstrap_backend must be None, 'nccl' or 'gloo', got {bootstrap_backend!r}")
    if tp_group is None:
        tp_group = _domain_group(int(tp_size))
    if kwargs.get("device") is None and kwargs.get("transport", "auto") == "auto" and dist.is_available() \
            and dist.is_initialized() and "nccl" not in dist.get_backend(tp_group):
        kwargs["device"] = "cpu"  # a gloo-only group trains on the CPU, whether or not the host has GPUs
    _ub.initialize_ub(shape, tp_size, dtype=dtype, ub_cfgs=ub_cfgs, tp_group=tp_group,
                      modes=[m.value for m in modes], **kwargs)


def get_ub(name, use_fp8=False):
    """The communicator initialize_ub created for a TE layer name: the FP8
    one (quantization mode FP8) with use_fp8."""
    return _ub.get_ub(name, use_fp8)


def destroy_ub():
    """Close every communicator initialize_ub created (collective)."""
    _ub.destroy_ub()


_dummy_wgrads = {}


def get_dummy_wgrad(shape, dtype, zero=False, device=None):
    """TE's shared placeholder weight gradient (what a layer hands autograd
    after accumulating into main_grad itself): one cached tensor per shape,
    dtype and device (the current CUDA device, else the CPU; `device=` is
    ours), zeroed when `zero`."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None and torch.cuda.is_available() \
        else torch.device(device or "cpu")
    key = (tuple(int(n) for n in shape), dtype, dev)
    t = _dummy_wgrads.get(key)
    if t is None:
        t = _dummy_wgrads[key] = torch.empty(key[0], dtype=dtype, device=dev)
    if zero:
        t.zero_()
    return t.detach()


# ------------------------------------------------------ the module base


def _init_normal(std):
    def init(t):
        return torch.nn.init.normal_(t, mean=0.0, std=std)
    return init


# TransformerEngine's default weight initialisation (init_method=None).
default_init_method = _init_normal(0.023)


def _split_sizes(parameters_split, out_features):
    """TE's parameters_split: (weight names, bias names, sizes along out_features)."""
    if parameters_split is None:
        return ["weight"], ["bias"], [out_features]
    if not parameters_split:
        raise ValueError("parameters_split cannot split the weight into 0 parameters")
    if isinstance(parameters_split, dict):
        names, sizes = list(parameters_split), [int(v) for v in parameters_split.values()]
    elif all(isinstance(n, str) for n in parameters_split):
        names = list(parameters_split)
        sizes = [out_features // len(names)] * len(names)
    else:
        raise TypeError(f"parameters_split must be a tuple of names or a dict name -> size, got {parameters_split!r}")
    if sum(sizes) != out_features:
        raise ValueError(f"parameters_split sizes {sizes} do not add up to out_features={out_features}")
    stems = [n.rstrip("_") for n in names]
    return [f"{s}_weight" for s in stems], [f"{s}_bias" for s in stems], sizes


def _joined_view(parts):
    """Split parameters (along dim 0) as one tensor outside autograd: a view
    of their storage where they still lie there back to back (as they are
    made), else None."""
    p0 = parts[0]
    rows, storage, end = 0, p0.untyped_storage().data_ptr(), p0.data_ptr()
    for p in parts:
        if (p.data_ptr() != end or not p.is_contiguous() or p.dtype is not p0.dtype
                or p.untyped_storage().data_ptr() != storage):
            return None
        rows += p.shape[0]
        end += p.nbytes
    return p0.detach().as_strided((rows,) + tuple(p0.shape[1:]), p0.stride())


class _Joined:
    """Split parameters joined for a layer's calls (_split_operands): the
    views and what they were made from (name, parameter, its address and
    shape, each)."""

    __slots__ = ("with_bias", "checks", "weight", "bias", "parts")

    def __init__(self, with_bias, checks, weight, bias, parts):
        self.with_bias, self.checks, self.weight, self.bias, self.parts = with_bias, checks, weight, bias, parts


def split_grads(g, sizes, count):
    """The gradients of `count` split parameters (the rows `sizes` of g, or
    None each without g)."""
    if not count:
        return ()
    return (None,) * count if g is None else g.split_with_sizes(sizes)


def _set_tp_attributes(t, is_parallel, dim):
    """TE's (and Megatron's) tensor-model-parallel attributes."""
    t.tensor_model_parallel = is_parallel
    t.partition_dim = dim
    t.partition_stride = 1


def _init_weight(w, init_method, get_rng_state_tracker, rng_tracker_name, partition_dim):
    """Initialise weight parameter w as TE does (init_method, default
    normal(0, 0.023), under the RNG tracker's fork when given) and give it
    TE's tensor-parallel attributes."""
    init = init_method or default_init_method
    if get_rng_state_tracker is None:
        init(w.data)
    else:
        tracker = get_rng_state_tracker()
        with (tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()):
            init(w.data)
    _set_tp_attributes(w, True, partition_dim)


def _get_init_val(param):
    """A primary FP8 weight's value before quantization (CPU), or None once cleared."""
    return getattr(param, "_high_precision_init_val", None)


def _clear_init_val(param):
    """Drop the kept initial value (after the master weights are made from it)."""
    if hasattr(param, "_high_precision_init_val"):
        del param._high_precision_init_val


class ExtraStateMixin:
    """TransformerEngine's `_extra_state` entry of a module's state_dict, in
    TE's format (the FP8 recipe and delayed scaling's fp8_meta, pickled into
    a uint8 CPU tensor; an empty one without FP8 state), so that TE's
    state_dicts and ours load into each other with strict=True. Reading and
    writing it is module/_extra_state.py's."""

    def get_extra_state(self):
        return _extra_state.get_extra_state(self)

    def set_extra_state(self, state):
        _extra_state.set_extra_state(self, state)


class TransformerEngineBaseModule(ExtraStateMixin, torch.nn.Module):
    """Base of this package's layers (see the module docstring)."""

    # The layer's plan (module/_plan.py), made on the first call and kept in
    # the instance; None: not made yet (a class attribute, so a layer
    # unpickled without one reads None too).
    _plan = None
    _plan_class = LinearPlan
    _fp8_num_gemms = 1  # the GEMMs of the layer's fp8_meta (module/_fp8.py)

    def __init__(self, name=None):
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        self.name = name
        self._wgrads = []            # the WeightGrads of the layer's GEMMs (backward_dw's order)
        self._wgrad_hooks = []
        self._gathered = {}          # id(DistributedWeight) -> (it, the full weight) for is_first_microbatch
        self.__dict__["_op_key"] = _library.register_layer(self)  # how torch.compile's operators find it
        self.fp8_meta = initial_fp8_meta()  # TE's; its FP8 state joins at the first FP8 call

    # -- construction -------------------------------------------------------

    def _setup_tp(self, parallel_mode, sequence_parallel, tp_group, tp_size, ub_flags, ub_name, ub_comm,
                  symmetric_ar_type, delay_wgrad_compute, fuse_wgrad_accumulation):
        self._setup_parallel(parallel_mode, sequence_parallel, tp_group, tp_size, symmetric_ar_type)
        self.ub = UBConfig(self, ub_flags, ub_name, ub_comm, self.tp)
        self.ub_name = ub_name
        self._setup_wgrad_policy(delay_wgrad_compute, fuse_wgrad_accumulation)

    def _setup_parallel(self, parallel_mode, sequence_parallel, tp_group, tp_size, symmetric_ar_type):
        """The tensor-parallel facts of the layer's (first) GEMM: self.tp."""
        if symmetric_ar_type is not None:
            raise NotImplementedError(f"symmetric_ar_type={symmetric_ar_type!r}: symmetric-memory all-reduce "
                                      "is not supported (use None)")
        self.tp = TPConfig(parallel_mode, sequence_parallel, tp_group, tp_size)
        self.tp_size, self.tp_group = self.tp.size, self.tp.group
        self.symmetric_ar_type = symmetric_ar_type

    def _setup_wgrad_policy(self, delay_wgrad_compute, fuse_wgrad_accumulation):
        """fuse_wgrad_accumulation and delay_wgrad_compute, the latter checked
        against the userbuffers flags (self.ub) as TE checks it."""
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        if self.delay_wgrad_compute and self.ub["ub_bulk_wgrad"]:
            raise ValueError(f"{type(self).__name__}: delay_wgrad_compute cannot be combined with ub_bulk_wgrad "
                             "(the bulk reduce-scatter of dgrad runs under the wgrad GEMM), as in "
                             "TransformerEngine")

    def _make_norm_params(self, features, normalization, dtype, device):
        """layer_norm_weight [features] (ones, zeros with zero_centered_gamma)
        and, for LayerNorm, layer_norm_bias (zeros; None for RMSNorm)."""
        init_gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init_gamma(features, dtype=dtype, device=device))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(features, dtype=dtype, device=device))
                                if normalization == "LayerNorm" else None)
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is None:
                continue
            # Replicated over the group (partial gradients under sequence
            # parallelism, which the framework sums), except in row mode:
            # there each rank owns its slice of the features and sees every
            # token, so its gradient is complete. TE marks those too, and a
            # framework that sums them gets tp-fold wrong gradients; we do not.
            p.sequence_parallel = self.tp.sp and self.tp.mode != "row"
            if self.tp.mode == "row":
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1

    def _make_linear_params(self, out_features, in_local, dtype, device, init_method, get_rng_state_tracker,
                            rng_tracker_name, bias, parameters_split):
        """The weight [out/tp or out, in_local] as one contiguous tensor, and
        the bias, registered whole or as the named slices of parameters_split
        (each initialised on its own, as TE does)."""
        self.weight_names, self.bias_names, sizes = _split_sizes(parameters_split, out_features)
        if self.tp.mode == "column":
            for name, n in zip(self.weight_names, sizes):
                if n % self.tp.size:
                    raise ValueError(f"{name}: {n} output features are not divisible by the tensor-parallel "
                                     f"size {self.tp.size}")
            sizes = [n // self.tp.size for n in sizes]
        self.parameter_split_sizes = sizes
        out_local = sum(sizes)
        weight = torch.empty(out_local, in_local, dtype=dtype, device=device)
        biases = torch.zeros(out_local, dtype=dtype, device=device) if bias else None
        # TE's registration order: every weight slice, then every bias slice
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for name, row, n in zip(self.weight_names, starts, sizes):
            w = torch.nn.Parameter(weight[row:row + n])
            _init_weight(w, init_method, get_rng_state_tracker, rng_tracker_name, 1 if self.tp.mode == "row" else 0)
            self.register_parameter(name, w)
        for name, row, n in zip(self.bias_names, starts, sizes):
            if bias:
                b = torch.nn.Parameter(biases[row:row + n])
                if self.tp.mode == "row":
                    b.sequence_parallel = self.tp.sp
                elif self.tp.mode == "column":
                    _set_tp_attributes(b, True, 0)
                self.register_parameter(name, b)
            else:  # as TE: an empty tensor, not a parameter
                setattr(self, name, torch.empty(0, dtype=dtype, device=device))
        self.use_bias = bool(bias)
        self._quantize_weights([(name, 0) for name in self.weight_names])
        for role, c in self.ub.comms.items():
            if c.device != torch.device(device):
                raise ValueError(f"{type(self).__name__}: communicator '{c.name}' ({role}) is on {c.device} but the "
                                 f"layer's parameters are on {device} (pass device= to initialize_ub / CommOverlap)")
        self._setup_wgrads([(self.weight_names, self.bias_names)], bias)

    def _quantize_weights(self, weights):
        """FP8 primary weights: inside quantized_model_init(enabled=True),
        each (parameter name, GEMM index) of `weights` is replaced by a
        Float8Tensor parameter of its initialised values, as TE's
        reset_parameters does: the recipe's forward format, per-tensor
        scaling (DelayedScaling: the scale of the weight's role in the
        layer's fp8_meta, made now, whose amax history records each cast;
        Float8CurrentScaling: the weight's own amax), or under
        Float8BlockScaling a Float8BlockwiseQTensor of 128x128 blocks (the
        recipe's weight QParams); rowwise bytes only (the
        transpose the backward reads is made by the first FP8 call after each
        change and kept with the tensor). The parameter keeps the attributes
        set on the original; with preserve_high_precision_init_val the
        original values stay on the CPU (get_high_precision_init_val /
        clear_high_precision_init_val, TE's methods)."""
        self.primary_weights_in_fp8 = _FP8State.with_fp8_parameters()
        self.preserve_high_precision_init_val = _FP8State.with_high_precision_init_val()
        if not self.primary_weights_in_fp8:
            return
        recipe = _FP8State.get_fp8_recipe()
        fp8_dtype = fp8_dtype_of(recipe.fp8_format, True)
        for name, gi in weights:
            old = self._parameters[name]
            device = old.device
            if isinstance(recipe, DelayedScaling):
                meta = getattr(self, "fp8_meta", None)
                if not meta or "scaling_fwd" not in meta or meta["scaling_fwd"].scale.device != device:
                    self.fp8_meta = make_fp8_meta(recipe, type(self)._fp8_num_gemms, device)
                quantizer = Float8ParamQuantizer(self, 3 * gi + 1, fp8_dtype)
            elif isinstance(recipe, Float8BlockScaling):
                qp = recipe.fp8_quant_fwd_weight
                quantizer = Float8BlockQuantizer(fp8_dtype, rowwise=True, columnwise=False,
                                                 amax_epsilon=qp.amax_epsilon, force_pow_2_scales=qp.power_2_scale,
                                                 block_scaling_dim=2)
            else:
                qp = recipe.fp8_quant_fwd_weight
                quantizer = Float8CurrentScalingQuantizer(fp8_dtype, device, columnwise=False,
                                                          force_pow_2_scales=qp.power_2_scale,
                                                          amax_epsilon=qp.amax_epsilon)
            init_val = old.detach().to("cpu", copy=True) if self.preserve_high_precision_init_val else None
            param = torch.nn.Parameter(quantizer.quantize(old.detach()), requires_grad=old.requires_grad)
            for k, v in old.__dict__.items():  # TE's / Megatron's parallel attributes
                setattr(param, k, v)
            if init_val is not None:
                param._high_precision_init_val = init_val
                param.get_high_precision_init_val = types.MethodType(_get_init_val, param)
                param.clear_high_precision_init_val = types.MethodType(_clear_init_val, param)
            self.register_parameter(name, param)

    def _setup_wgrads(self, gemms, bias):
        """One WeightGrads per GEMM from its (weight names, bias names), in
        backward_dw's order; with delay_wgrad_compute the parameters skip
        their post-backward hooks (TE's attribute: backward_dw runs them)."""
        self._wgrads = [WeightGrads(self, weights, biases) for weights, biases in gemms]
        if self.delay_wgrad_compute:
            for weights, biases in gemms:
                for name in weights + (biases if bias else []):
                    getattr(self, name).skip_backward_post_hook = True

    # -- per call -----------------------------------------------------------

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in PLAN_ATTRS:  # what the plan was made from changed
            self.__dict__["_plan"] = None

    def _make_plan(self):
        """The layer's plan (module/_plan.py), made now."""
        plan = self.__dict__["_plan"] = self._plan_class(self)
        return plan

    # Parameters are read from _parameters directly: nn.Module.__getattr__
    # costs several times a dict lookup, on every call (a parameter the user
    # assigned later, a DistributedWeight say, is registered there too).

    def _weight_params(self):
        return [self._parameters[n] for n in self.weight_names]

    def _weight_tensor(self):
        """The weight the GEMMs use: the parameter itself, or the split
        parameters concatenated (differentiably)."""
        if len(self.weight_names) == 1:
            return self._parameters[self.weight_names[0]]
        return torch.cat(self._weight_params())

    def _split_operands(self, with_bias):
        """(weight, bias, parts) of a call with split parameters: the joined
        weight and bias (outside autograd) and the parameters that enter the
        layer's Function themselves, after its other arguments, so that its
        backward hands each its rows of dW and db (split_grads): no
        concatenation in autograd's graph, forward or backward. Joined are
        views of the storage the parameters share (_joined_view), kept in the
        layer (a _Joined) while the parameters are the same objects over the
        same memory (their addresses and shapes; the views hold that storage,
        so no other tensor can take those addresses), or copies made per call
        where they no longer lie back to back. The bias only `with_bias`; a
        quantized or distributed split weight is joined by torch.cat as
        before (parts empty)."""
        params = self._parameters
        kept = self.__dict__.get("_joined")
        if kept is not None and kept.with_bias == with_bias:
            for name, p, ptr, shape in kept.checks:
                q = params.get(name)
                if q is not p or q.data_ptr() != ptr or q.shape != shape:
                    break
            else:
                return kept.weight, kept.bias, kept.parts
        names = list(self.weight_names)
        nw = len(names)
        if with_bias:
            names += self.bias_names
        parts = tuple(params[n] for n in names)
        if any(type(p) is not _Parameter for p in parts):
            return self._weight_tensor(), self._bias_tensor() if with_bias else None, ()
        w = _joined_view(parts[:nw])
        b = _joined_view(parts[nw:]) if with_bias else None
        if w is None or with_bias and b is None:  # copies, made per call
            self.__dict__["_joined"] = None
            w = torch.cat([p.detach() for p in parts[:nw]]) if w is None else w
            if with_bias and b is None:
                b = torch.cat([p.detach() for p in parts[nw:]])
            return w, b, parts
        self.__dict__["_joined"] = _Joined(with_bias, tuple(zip(names, parts, (p.data_ptr() for p in parts),
                                                                (p.shape for p in parts))), w, b, parts)
        return w, b, parts

    def _bias_tensor(self):
        """The bias parameter (concatenated when split), or None without one."""
        if not self.use_bias:
            return None
        if len(self.bias_names) == 1:
            return self._parameters[self.bias_names[0]]
        return torch.cat([self._parameters[n] for n in self.bias_names])

    def _full_weight(self, w, is_first_microbatch, dtype, fp8=False):
        """The full weight for a GEMM, in the compute dtype: a DistributedWeight
        is gathered on every call, or, when the caller says which micro-batch
        this is (is_first_microbatch not None), once on the first and reused
        until the next first micro-batch. A quantized weight (FP8 primary
        weights) passes as it is to FP8 GEMMs (`fp8`: the call computes in
        FP8, which reads its bytes) and is dequantized for the others."""
        if is_distributed_weight(w):
            refuse_capture(self, "a DistributedWeight (its gather is a collective outside the graph)")
            if is_first_microbatch is None:
                full = w.materialize()
            else:
                kept = self._gathered.get(id(w))
                if is_first_microbatch or kept is None or kept[0] is not w:
                    kept = self._gathered[id(w)] = (w, w.materialize())
                full = kept[1]
        else:
            full = w
        if isinstance(full, QuantizedTensor):
            if fp8 and type(full) in (Float8Tensor, Float8BlockwiseQTensor) and full.dtype == dtype:
                return full
            return full.dequantize(dtype=dtype)
        if full.dtype != dtype:
            return full.to(dtype, memory_format=torch.contiguous_format)
        return full if full.is_contiguous() else full.contiguous()  # torch accepts any layout; so do we

    # -- the operators torch.compile traces (module/_opcall.py) -------------

    def __setstate__(self, state):
        # deepcopy and unpickling: the copy crosses into the operators under a key of its own, and keeps
        # nothing made for the original's calls (a Call holds the engine's workspace address; the joined
        # views, the original's parameters)
        for key in ("_op_state", "_joined"):
            state.pop(key, None)
        super().__setstate__(state)
        self.__dict__["_op_key"] = _library.register_layer(self)

    def _op_call(self, args, is_first_microbatch):
        """A call traced by torch.compile: args are the Function's tensors,
        2-D, in the compute dtype (a DistributedWeight refused)."""
        for i in self._op_spec.weights:
            if is_distributed_weight(args[i]):
                raise NotImplementedError(f"{type(self).__name__}: a DistributedWeight cannot be traced by "
                                          "torch.compile (its gather is a collective outside the graph); "
                                          "call this layer eagerly (torch.compiler.disable) or use a plain weight")
        if self.fuse_wgrad_accumulation and len(getattr(self, "weight_names", ())) > 1:
            raise NotImplementedError(f"{type(self).__name__}: fuse_wgrad_accumulation with parameters_split "
                                      "cannot be traced by torch.compile")
        fp8 = _quantization.fp8_enabled
        return _library.layer_call(self, args, is_first_microbatch, fp8)

    def _op_signature(self):
        """The configuration the operators' declared outputs derive from. It
        is part of the key a traced call holds, so a compiled graph that
        PyTorch's caches keep on disk is reused only for a layer of the same
        configuration (another process may give another layer the same
        registry key). Read from __dict__: an attribute this kind of layer
        does not have is then a dictionary miss, where getattr would go
        through nn.Module.__getattr__ and its AttributeError, in each guard
        check of a compiled graph that holds the key."""
        d = self.__dict__
        tp = d["tp"]
        tp2 = d.get("tp2", tp)
        return (f"{tp.mode},{tp.sp},{tp.size},{tp2.mode},{tp2.sp},{tp2.size},{d.get('in_local', 0)},"
                f"{d.get('out_local', 0)},{d.get('hidden_size', 0)},{d.get('size_per_partition', 0)},"
                f"{d.get('activation', '')},{d.get('normalization', '')},{d.get('checkpoint', False)},"
                f"{d.get('return_layernorm_output', False)},{d.get('return_layernorm_output_gathered', False)}")

    def _op_forward(self, args, first_mb, grad, fp8):
        return _opcall.forward(self, args, first_mb, grad, fp8)

    def _op_forward_fake(self, args, grad, fp8):
        return _opcall.forward_fake(self, args, grad, fp8)

    def _op_backward(self, args, saved, grads, needs, first_mb, fp8):
        return _opcall.backward(self, args, saved, grads, needs, first_mb, fp8)

    def _op_grads_present(self, args, needs):
        return _opcall.grads_present(self, args, needs)

    def _op_noutputs(self):
        return 2 if self.__dict__.get("return_layernorm_output", False) else 1

    # -- delayed weight gradients -------------------------------------------

    def need_backward_dw(self):
        """True when delay_wgrad_compute left weight gradients for backward_dw()."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook):
        """Call `hook()` after each backward_dw() has put its gradients in
        place (Megatron registers its gradient-reduction hooks here)."""
        self._wgrad_hooks.append(hook)

    def backward_dw(self):
        """Compute the weight (and bias) gradients a delay_wgrad_compute
        backward left, oldest first, one backward's worth per call: into
        main_grad with fuse_wgrad_accumulation, else added to .grad."""
        if not self.delay_wgrad_compute:
            return
        if not any(owner.pending() for owner in self._wgrads):
            raise RuntimeError(f"{type(self).__name__}.backward_dw(): no delayed weight gradient is pending "
                               "(run backward first)")
        for owner in self._wgrads:
            owner.finish_delayed()
        for hook in self._wgrad_hooks:
            hook()

    # -- what TE's modules expose ---------------------------------------------

    @property
    def parallel_mode(self):
        return self.tp.mode

    @property
    def sequence_parallel(self):
        return self.tp.sp

    def set_tensor_parallel_group(self, tp_group):
        """TE's setter: the layer's collectives use `tp_group` from now on (its
        size must stay the layer's tensor-parallel size)."""
        check_same_size(self, tp_group)
        self.tp = TPConfig(self.tp.mode, self.tp.sp, tp_group, self.tp.size)
        self.tp_group = self.tp.group


def refuse_capture(layer, what):
    """Raise, naming the layer and the feature, when a CUDA graph is being
    captured: a feature that cannot be replayed must fail at capture time,
    not give wrong results at replay."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        name = f" '{layer.name}'" if getattr(layer, "name", None) else ""
        raise RuntimeError(f"{type(layer).__name__}{name}: {what} cannot be captured in a CUDA graph; "
                           "capture the layer without it (see tec.make_graphed_callables)")
