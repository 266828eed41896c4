"""tec.Linear: TransformerEngine's Linear (same constructor, parameters and
semantics) whose GEMMs run in the C engine, with userbuffers overlap of the
sequence-parallel collectives."""
import torch

from .._C import prepare_for_saving, restore_from_saved
from . import _common as C
from . import _fast
from .base import TransformerEngineBaseModule


def _forward(inp, weight, bias, layer, is_first_microbatch, dtype, cast):
    """The forward's work, shared by the autograd Function and the no-grad
    path (which skips the Function: nothing to save, no graph node):
    (output [tokens, out], the validated 2-D input)."""
    tp = layer.tp
    x = C.check_input(inp, layer.in_local, dtype, weight.device, tp, cast)
    w = layer._full_weight(weight, is_first_microbatch, dtype)
    b = C.cast(bias, dtype)
    y = C.ub_fprop(x, w, b, tp, layer.ub) if layer.ub.enabled else None
    if y is None:
        y = C.fprop(C.gather_input(x, tp), w, b, tp)
    return y, x


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, layer, is_first_microbatch, dtype, cast):
        ub = layer.ub
        y, x = _forward(inp, weight, bias, layer, is_first_microbatch, dtype, cast)
        # Save the local (not gathered) input: column + SP re-gathers it in
        # backward. save_original_input keeps the caller's tensor instead (no
        # second copy when the cast or 2-D view made one).
        kept = inp if layer.save_original_input else x
        saved, ctx.objects = prepare_for_saving(C.outside_buffers(kept, ub), weight)
        ctx.save_for_backward(*saved)
        ctx.layer, ctx.inp_shape, ctx.has_bias, ctx.dtype = layer, inp.shape, bias is not None, dtype
        # A cached gathered weight is reused in backward (no second gather).
        ctx.first_mb = is_first_microbatch
        return y  # 2-D; the module gives it the input's leading dims

    @staticmethod
    def backward(ctx, dout):
        layer, dtype = ctx.layer, ctx.dtype
        x, weight = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        if layer.save_original_input:
            x = C.as_2d(C.cast(x, dtype))
        w = layer._full_weight(weight, None if ctx.first_mb is None else False, dtype)
        dy = C.as_2d(C.cast(dout, dtype))
        dx, dw, db = C.linear_backward(ctx, dy, x, w, weight, ctx.needs_input_grad[0], 1)
        return (C.like_input(dx, ctx.inp_shape) if dx is not None else None), dw, db, None, None, None, None


class Linear(TransformerEngineBaseModule):
    """y = x W^T + b with optional tensor parallelism, TransformerEngine's
    `Linear` (arguments in TE's order, with TE's meaning).

    parallel_mode="column": weight [out/tp, in], output features split (the
    input is all-gathered along the sequence under sequence_parallel).
    parallel_mode="row": weight [out, in/tp], input features split, output
    summed over the group (reduce-scattered along the sequence under
    sequence_parallel); the bias is added once after the reduction and, under
    sequence_parallel, carries `sequence_parallel = True`: its gradient is
    this rank's partial sum, which the training framework sums over the
    group (Megatron does; `tec.allreduce_sequence_parallel_grads` does it
    for other loops). Inputs are [tokens, in] or [seq, batch, in], sequence
    first. Beyond TE (keyword only): `ub_comm` gives the layer its
    communicator(s) directly instead of the registry.
    """

    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None, parameters_split=None,
                 device=None, ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                 ub_bulk_dgrad=False, ub_bulk_wgrad=False, ub_name=None, delay_wgrad_compute=False,
                 symmetric_ar_type=None, save_original_input=False, name=None, *, ub_comm=None):
        super().__init__(name)
        self._setup_tp(parallel_mode, sequence_parallel, tp_group, tp_size,
                       dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                            ub_bulk_wgrad=ub_bulk_wgrad),
                       ub_name, ub_comm, symmetric_ar_type, delay_wgrad_compute, fuse_wgrad_accumulation)
        self.in_local, self.out_local = self.tp.local_features(in_features, out_features)
        self.in_features, self.out_features = self.in_local, self.out_local  # this rank's, as in TE
        dtype, device = C.default_dtype(params_dtype), C.default_device(device)
        self.return_bias = bool(return_bias)
        self.save_original_input = bool(save_original_input)
        self.rng_tracker_name = rng_tracker_name
        self._make_linear_params(out_features, self.in_local, dtype, device, init_method, get_rng_state_tracker,
                                 rng_tracker_name, bias, parameters_split)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        """inp [tokens, in] or [seq, batch, in]. is_first_microbatch (TE): None,
        or whether this is the first micro-batch of a step (main_grad is then
        overwritten rather than accumulated, and a DistributedWeight is
        gathered once per step)."""
        if fp8_output or fp8_grad:
            raise NotImplementedError("FP8 outputs/gradients (fp8_output, fp8_grad) are not supported")
        plan = self._plan
        if plan is None:
            plan = self._fast_plan()
        if plan:  # the common case, with the least host work (module/_fast.py); None: the general path
            out = _fast.linear(self, plan, inp, self.return_bias, is_first_microbatch)
            if out is not None:
                return out
        weight = self._weight_tensor()
        bias = self._bias_tensor()
        dtype, cast = C.compute_dtype(weight)
        args = (inp, weight, None if self.return_bias else bias, self, is_first_microbatch, dtype, cast)
        y = _LinearFn.apply(*args) if torch.is_grad_enabled() else _forward(*args)[0]
        y = C.like_input(y, inp.shape, self.tp)
        if self.return_bias:
            if bias is None:
                bias = getattr(self, self.bias_names[0])
            return y, C.cast(bias, dtype)
        return y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, parallel_mode={self.tp.mode}, "
                f"sequence_parallel={self.tp.sp}, tp_size={self.tp.size}")
