"""tec.LayerNormLinear: TransformerEngine's LayerNormLinear (same
constructor, parameters and semantics): LayerNorm or RMSNorm followed by a
linear layer, both in the C engine, with userbuffers overlap of the
sequence-parallel collectives."""
import torch

from .._C import prepare_for_saving, restore_from_saved
from ..distributed import reduce_scatter_rows
from . import _steps
from ._config import as_2d, cast, check_input, compute_dtype, default_device, default_dtype, like_input, returned_bias
from ._opcall import OpSpec, out_rows
from ._plan import apply, check_params, check_saved, grad_output, make_call
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8Tensor
from .base import TransformerEngineBaseModule, split_grads

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_is_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_PLAIN = (torch.Tensor, torch.nn.Parameter, Float8Tensor, Float8BlockwiseQTensor)  # saved as they are


def _forward(call, inp, ln_weight, ln_bias, weight, bias, keep):
    """The forward's work, shared by the autograd Function and the no-grad
    call: (output, the normalised output to return or None, (x, ln_out,
    stats) for backward). Without `keep` (no backward) what backward would
    read is not kept (temporaries)."""
    layer = call.layer
    tp, ub, plan = layer.tp, layer.ub, call.plan
    if call.ready:
        x, w, g, beta = inp, weight, ln_weight, ln_bias
    else:  # validated and converted (the named errors), 2-D
        dtype = call.dtype
        x = check_input(inp, layer.in_local, dtype, weight.device, tp, call.cast)
        w = layer._full_weight(weight, call.first_mb, dtype, call.fp8 is not None)
        g, beta, bias = cast(ln_weight, dtype), cast(ln_bias, dtype), cast(bias, dtype)
        check_params((("weight", w), ("bias", bias), ("layer_norm_weight", g), ("layer_norm_bias", beta)), dtype,
                     x.device, plan.shapes)
    # An input lying in a communicator's buffer (a caller may pass a buffer
    # view) is copied: the norm may write the fprop slot, and what is saved
    # must outlive the buffer's next use.
    if ub.enabled:
        x = _steps.outside_buffers(x, ub)
    ret = layer.return_layernorm_output
    gathered = ret and layer.return_layernorm_output_gathered and tp.mode == "column" and tp.sp
    y, ln_out, stats, ln_total = _steps.norm_fprop(call, tp, ub, x, g, beta, plan.eps, plan.zcg, w, bias,
                                                   keep or ret, gathered)
    ln_ret = None
    if gathered:
        # The full sequence: the GEMM's gathered input (or a copy of the
        # buffer's); its gradient is reduce-scattered back in backward.
        ln_ret = ln_total if ln_total.dim() == len(inp.shape) else like_input(ln_total, inp.shape, tp)
    elif ret:
        # ln_out is also saved for backward: it is returned as a view made in
        # the Function, which autograd refuses to let be modified in place.
        ln_ret = ln_out.view(inp.shape)
    return y, ln_ret, (x, ln_out, stats)


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, call, *parts):
        # parts: split parameters, weight and bias their join (LayerNormLinear._split_operands)
        y, ln_ret, (x, ln_out, stats) = _forward(call, inp, ln_weight, ln_bias, weight, bias, True)
        if call.fp8 is not None:
            ln_out = call.fp8.saved_input(ln_out, 0)
        if type(weight) in _PLAIN:
            ctx.save_for_backward(x, ln_out, stats, ln_weight, weight)
            ctx.objects = None
        else:  # a DistributedWeight saves itself
            saved, ctx.objects = prepare_for_saving(x, ln_out, stats, ln_weight, weight)
            ctx.save_for_backward(*saved)
        ctx.call, ctx.has_bias = call, bias is not None
        if not call.ready:
            ctx.inp_shape = inp.shape
        return y if ln_ret is None else (y, ln_ret)

    @staticmethod
    def backward(ctx, dout, dln_out=None):
        call = ctx.call
        call.refresh_stream()
        layer, dtype, plan = call.layer, call.dtype, call.plan
        tp = layer.tp
        if ctx.objects is None:
            x, ln_out, stats, ln_weight, weight = ctx.saved_tensors
        else:
            x, ln_out, stats, ln_weight, weight = restore_from_saved(ctx.objects, ctx.saved_tensors)
            ctx.objects = None
        if call.ready:
            w, g = weight, ln_weight
            check_saved(w, dtype, (plan.n, plan.k), "weight")
            check_saved(g, dtype, (plan.k,), "layer_norm_weight")
        else:
            w = layer._full_weight(weight, None if call.first_mb is None else False, dtype, call.fp8 is not None)
            g = cast(ln_weight, dtype)
        dy = grad_output(dout, dtype)
        extra = None
        if dln_out is not None:
            extra = grad_output(dln_out, dtype)
            if extra.numel() != ln_out.numel():  # the gathered output's gradient: this rank's rows, summed
                extra = reduce_scatter_rows(as_2d(extra), tp.group, tp.size)
            extra = extra.view(ln_out.shape)
        need = ctx.needs_input_grad
        need_w, need_b, nw = need[3], need[4], len(need) - 6  # nw: the split weights (then their biases)
        if nw:
            nw = len(layer.weight_names)
            need_w, need_b = any(need[6:6 + nw]), any(need[6 + nw:])
        wg = None
        if need_w or need_b:
            wg = layer._wgrads[0].step(weight, ctx.has_bias and need_b, call.first_mb, tp.mode == "row" and tp.sp,
                                       need_w)
        dx, dgamma, dbeta, dw, db = _steps.norm_linear_backward(call, tp, layer.ub, dy, x, ln_out, stats, g,
                                                                plan.zcg, plan.rms, w, wg, extra)
        if not call.ready:
            dx = like_input(dx, ctx.inp_shape)
        if call.fp8 is not None:
            call.fp8.finish_backward()
        if nw:
            sizes = layer.parameter_split_sizes
            return ((dx, dgamma, dbeta, None, None, None) + split_grads(dw, sizes, nw)
                    + split_grads(db, sizes, len(need) - 6 - nw))
        return dx, dgamma, dbeta, dw, db, None


def _nograd(call, a):
    y, ln_ret, _ = _forward(call, *a, False)
    return (y,) if ln_ret is None else (y, ln_ret)


def norm_saved_shapes(layer, x):
    """(shape, dtype) of the normalised rows and the statistics a norm's
    forward keeps for x [rows, features]."""
    rows = x.shape[0]
    rms = layer.normalization == "RMSNorm"
    return ((tuple(x.shape), x.dtype), ((rows if rms else 2 * rows,), torch.float32))


_OP_SPEC = OpSpec(
    _LayerNormLinearFn, weights={3: None}, biases=(4,),
    call=lambda layer, plan, a, first_mb: make_call(layer, plan, a[0], a[3], (a[4], a[1], a[2]), first_mb),
    nograd=_nograd,
    saved=lambda layer: ("x", "new", "new", 1, 3),
    new_shapes=lambda layer, a: norm_saved_shapes(layer, a[0]),
    ctx=lambda a: {"has_bias": a[4] is not None})


class LayerNormLinear(TransformerEngineBaseModule):
    """Normalisation (LayerNorm or RMSNorm over the last dim) then
    y = n W^T + b: TransformerEngine's `LayerNormLinear`, arguments in TE's
    order with TE's meaning.

    parallel_mode None, "column" (the normalised input is all-gathered along
    the sequence under sequence_parallel) or "row" (the input's features are
    split, each rank normalises its slice as TE does, the output is summed
    over the group). layer_norm_weight / layer_norm_bias cover the input
    features this rank holds and carry `sequence_parallel`: under sequence
    parallelism their gradients are this rank's partial sums, which the
    training framework sums over the group (`tec.allreduce_sequence_parallel_grads`
    outside Megatron). return_layernorm_output=True also returns the
    normalised input (this rank's tokens, or the whole sequence with
    return_layernorm_output_gathered). Beyond TE (keyword only): ub_comm
    (communicators given directly) and rng_tracker_name.
    """

    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, parameters_split=None,
                 zero_centered_gamma=False, device=None, ub_overlap_ag=False, ub_overlap_rs=False,
                 ub_overlap_rs_dgrad=False, ub_bulk_wgrad=False, ub_bulk_dgrad=False, ub_name=None,
                 delay_wgrad_compute=False, symmetric_ar_type=None, name=None, *, ub_comm=None,
                 rng_tracker_name=None):
        super().__init__(name)
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        self.eps, self.normalization = float(eps), normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered and return_layernorm_output)
        self._setup_tp(parallel_mode, sequence_parallel, tp_group, tp_size,
                       dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                            ub_bulk_wgrad=ub_bulk_wgrad),
                       ub_name, ub_comm, symmetric_ar_type, delay_wgrad_compute, fuse_wgrad_accumulation)
        self.in_local, self.out_local = self.tp.local_features(in_features, out_features)
        self.in_features, self.out_features = self.in_local, self.out_local  # this rank's, as in TE
        dtype, device = default_dtype(params_dtype), default_device(device)
        self.rng_tracker_name = rng_tracker_name
        self._make_norm_params(self.in_local, normalization, dtype, device)
        self._make_linear_params(out_features, self.in_local, dtype, device, init_method, get_rng_state_tracker,
                                 rng_tracker_name, bias, parameters_split)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        """inp [tokens, in] or [seq, batch, in]; is_first_microbatch as in Linear.
        Returns out, (out, bias), (out, ln_out) or (out, bias, ln_out), as TE."""
        if fp8_output or fp8_grad:
            raise NotImplementedError("FP8 outputs/gradients (fp8_output, fp8_grad) are not supported")
        if _compiling():
            return self._compiled(inp, is_first_microbatch)
        plan = self._plan or self._make_plan()
        params = self._parameters
        parts = ()
        if plan.single:
            weight = params[plan.weight]
            b = None if plan.bias is None else params[plan.bias]
        elif self.return_bias:
            weight, _, parts = self._split_operands(False)
            b = self._bias_tensor()
        else:
            weight, b, parts = self._split_operands(plan.bias is not None)
        g = params.get("layer_norm_weight")
        if g is None:
            g = self.layer_norm_weight
        beta = None
        if plan.beta is not None:
            beta = params.get("layer_norm_bias")
            if beta is None:
                beta = self.layer_norm_bias
        call = make_call(self, plan, inp, weight, (b, g, beta), is_first_microbatch)
        bias = None if self.return_bias else b
        if _is_grad_enabled():
            out = apply(_LayerNormLinearFn, inp, g, beta, weight, bias, call, *parts)
        else:
            y, ln_ret, _ = _forward(call, inp, g, beta, weight, bias, False)
            out = y if ln_ret is None else (y, ln_ret)
        if self.return_layernorm_output:
            y, ln_out = out
        else:
            y = out
        if y.dim() != inp.dim():  # a 2-D result for a 3-D input (validated, or from a communicator)
            y = like_input(y, inp.shape, self.tp)
        if self.return_bias:
            if b is None:
                b = getattr(self, self.bias_names[0])
            b = returned_bias(b, call.dtype)
            return (y, b, ln_out) if self.return_layernorm_output else (y, b)
        return (y, ln_out) if self.return_layernorm_output else y

    _op_spec = _OP_SPEC

    def _op_outputs(self, args):
        x, tp = args[0], self.tp
        outs = (((out_rows(tp, x.shape[0]), self.out_local), x.dtype),)
        if self.return_layernorm_output:
            gathered = self.return_layernorm_output_gathered and tp.mode == "column" and tp.sp
            outs += (((x.shape[0] * (tp.size if gathered else 1), x.shape[1]), x.dtype),)
        return outs

    def _compiled(self, inp, is_first_microbatch):
        """forward's call while torch.compile traces it (module/_opcall.py)."""
        weight, b = self._weight_tensor(), self._bias_tensor()
        g = self.layer_norm_weight
        beta = self.layer_norm_bias if self.normalization == "LayerNorm" else None
        dtype, c = compute_dtype(weight)
        x = check_input(inp, self.in_local, dtype, weight.device, self.tp, c)
        b = cast(b, dtype)
        outs = self._op_call((x, cast(g, dtype), cast(beta, dtype), cast(weight, dtype),
                              None if self.return_bias else b), is_first_microbatch)
        y = like_input(outs[0], inp.shape, self.tp)
        res = (y, returned_bias(getattr(self, self.bias_names[0]) if b is None else b, dtype)) if self.return_bias \
            else (y,)
        if self.return_layernorm_output:
            gathered = self.return_layernorm_output_gathered and self.tp.mode == "column" and self.tp.sp
            res += (like_input(outs[1], inp.shape, self.tp if gathered else None),)
        return res[0] if len(res) == 1 else res

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, parallel_mode={self.tp.mode}, "
                f"sequence_parallel={self.tp.sp}, tp_size={self.tp.size}")
