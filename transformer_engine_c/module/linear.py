"""tec.Linear: TransformerEngine's Linear (same constructor, parameters and
semantics) whose GEMMs run in the C engine, with userbuffers overlap of the
sequence-parallel collectives."""
import torch

from .._C import prepare_for_saving, restore_from_saved
from . import _steps
from ._config import as_2d, cast, check_input, compute_dtype, default_device, default_dtype, like_input, returned_bias
from ._opcall import OpSpec, out_rows
from ._plan import apply, check_params, check_saved, grad_output, make_call
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8Tensor
from .base import TransformerEngineBaseModule, split_grads

_is_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_PLAIN = (torch.Tensor, torch.nn.Parameter, Float8Tensor, Float8BlockwiseQTensor)  # saved as they are


def _forward(call, inp, weight, bias):
    """The forward's work, shared by the autograd Function and the no-grad
    call (which skips the Function: nothing to save, no graph node):
    (output, the input as the steps read it, the full weight)."""
    layer = call.layer
    if call.ready:
        x, w = inp, weight
    else:  # validated and converted (the named errors), 2-D
        x = check_input(inp, layer.in_local, call.dtype, weight.device, layer.tp, call.cast)
        w = layer._full_weight(weight, call.first_mb, call.dtype, call.fp8 is not None)
        bias = cast(bias, call.dtype)
        check_params((("weight", w), ("bias", bias)), call.dtype, x.device, call.plan.shapes)
    return _steps.fprop(call, layer.tp, layer.ub, x, w, bias), x, w


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, call, *parts):
        # parts: split parameters, weight and bias their join (Linear._split_operands)
        y, x, _ = _forward(call, inp, weight, bias)
        layer = call.layer
        # Save the local (not gathered) input: column + SP re-gathers it in
        # backward. save_original_input keeps the caller's tensor instead (no
        # second copy when the cast or 2-D view made one).
        kept = inp if layer.save_original_input else x
        if call.fp8 is not None:  # where wgrad reads only the FP8 transpose, a stand-in
            stand_in = call.fp8.saved_input(x, 0)
            kept = kept if stand_in is x else stand_in
        if layer.ub.enabled:
            kept = _steps.outside_buffers(kept, layer.ub)
        if type(weight) in _PLAIN:
            ctx.save_for_backward(kept, weight)
            ctx.objects = None
        else:  # a DistributedWeight saves itself
            saved, ctx.objects = prepare_for_saving(kept, weight)
            ctx.save_for_backward(*saved)
        ctx.call, ctx.has_bias = call, bias is not None
        if not call.ready:
            ctx.inp_shape = inp.shape
        return y

    @staticmethod
    def backward(ctx, dout):
        call = ctx.call
        call.refresh_stream()
        layer, dtype = call.layer, call.dtype
        if ctx.objects is None:
            x, weight = ctx.saved_tensors
        else:
            x, weight = restore_from_saved(ctx.objects, ctx.saved_tensors)
            ctx.objects = None
        if call.ready:
            w = weight
            check_saved(w, dtype, call.plan.shapes[0], "weight")
        else:
            if layer.save_original_input:
                x = as_2d(cast(x, dtype))
            # a weight gathered for this step is reused (no second gather)
            w = layer._full_weight(weight, None if call.first_mb is None else False, dtype, call.fp8 is not None)
        dy = grad_output(dout, dtype)
        need = ctx.needs_input_grad
        need_w, need_b, nw = need[1], need[2], len(need) - 4  # nw: the split weights (then their biases)
        if nw:
            nw = len(layer.weight_names)
            need_w, need_b = any(need[4:4 + nw]), any(need[4 + nw:])
        tp = layer.tp
        wg = None
        if need_w or need_b:
            wg = layer._wgrads[0].step(weight, ctx.has_bias and need_b, call.first_mb, tp.mode == "row" and tp.sp,
                                       need_w)
        dx, dw, db = _steps.linear_backward(call, tp, layer.ub, dy, x, w, need[0], wg)
        if dx is not None and not call.ready:
            dx = like_input(dx, ctx.inp_shape)
        if call.fp8 is not None:
            call.fp8.finish_backward()
        if nw:
            sizes = layer.parameter_split_sizes
            return (dx, None, None, None) + split_grads(dw, sizes, nw) + split_grads(db, sizes, len(need) - 4 - nw)
        return dx, dw, db, None


_OP_SPEC = OpSpec(
    _LinearFn, weights={1: None}, biases=(2,),
    call=lambda layer, plan, a, first_mb: make_call(layer, plan, a[0], a[1], (a[2],), first_mb),
    nograd=lambda call, a: (_forward(call, *a)[0],),
    saved=lambda layer: ("x", 1),
    new_shapes=lambda layer, a: (),
    ctx=lambda a: {"has_bias": a[2] is not None})


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
        dtype, device = default_dtype(params_dtype), default_device(device)
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
        if _compiling():
            return self._compiled(inp, is_first_microbatch)
        plan = self._plan or self._make_plan()
        parts = ()
        if plan.single:
            params = self._parameters
            weight = params[plan.weight]
            b = None if plan.bias is None else params[plan.bias]
        elif self.return_bias:
            weight, _, parts = self._split_operands(False)
            b = self._bias_tensor()
        else:
            weight, b, parts = self._split_operands(plan.bias is not None)
        call = make_call(self, plan, inp, weight, (b,), is_first_microbatch)
        bias = None if self.return_bias else b
        if _is_grad_enabled():
            y = apply(_LinearFn, inp, weight, bias, call, *parts)
        else:
            y = _forward(call, inp, weight, bias)[0]
        if y.dim() != inp.dim():  # a 2-D result for a 3-D input (validated, or from a communicator)
            y = like_input(y, inp.shape, self.tp)
        if self.return_bias:
            if b is None:
                b = getattr(self, self.bias_names[0])
            return y, returned_bias(b, call.dtype)
        return y

    _op_spec = _OP_SPEC

    def _op_outputs(self, args):
        return (((out_rows(self.tp, args[0].shape[0]), self.out_local), args[1].dtype),)

    def _compiled(self, inp, is_first_microbatch):
        """forward's call while torch.compile traces it (module/_opcall.py)."""
        weight, b = self._weight_tensor(), self._bias_tensor()
        dtype, c = compute_dtype(weight)
        x = check_input(inp, self.in_local, dtype, weight.device, self.tp, c)
        b = cast(b, dtype)
        y, = self._op_call((x, cast(weight, dtype), None if self.return_bias else b), is_first_microbatch)
        y = like_input(y, inp.shape, self.tp)
        if self.return_bias:
            return y, returned_bias(getattr(self, self.bias_names[0]) if b is None else b, dtype)
        return y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, parallel_mode={self.tp.mode}, "
                f"sequence_parallel={self.tp.sp}, tp_size={self.tp.size}")
