"""tec.LayerNormLinear: TransformerEngine's LayerNormLinear (same
constructor, parameters and semantics): LayerNorm or RMSNorm followed by a
linear layer, both in the C engine, with userbuffers overlap of the
sequence-parallel collectives."""
import torch

from .. import _engine
from .._C import prepare_for_saving, restore_from_saved
from ..distributed import reduce_scatter_rows
from . import _common as C
from . import _fast
from .base import TransformerEngineBaseModule

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _forward(inp, ln_weight, ln_bias, weight, bias, layer, is_first_microbatch, dtype, cast):
    """The forward's work, shared by the autograd Function and the no-grad
    path (which skips the Function): (output [tokens, out], the normalised
    output to return or None, (x, ln_out, mu, rsigma) for backward)."""
    tp, ub = layer.tp, layer.ub
    # An input lying in a communicator's buffer (a caller may pass a buffer
    # view) is copied: the norm may write the fprop slot, and what is saved
    # must outlive the buffer's next use.
    x = C.outside_buffers(C.check_input(inp, layer.in_local, dtype, weight.device, tp, cast), ub)
    w = layer._full_weight(weight, is_first_microbatch, dtype)
    g, beta, b = C.cast(ln_weight, dtype), C.cast(ln_bias, dtype), C.cast(bias, dtype)
    ln_total = None
    if tp.mode == "column" and ub.enabled and ub["ub_overlap_ag"] and x.shape[0] and ub.comms["fprop"].take_overlap(
            "ag", x.shape[0], x.shape[1], w.shape[0]):
        y, ln_out, mu, rsigma, ln_total = C.norm_ag_gemm(ub.comms["fprop"], x, g, beta, layer.eps,
                                                         layer.zero_centered_gamma, w, b, tp,
                                                         layer.return_layernorm_output_gathered)
    else:
        ln_out, mu, rsigma = _engine.norm_forward(x, g, beta, layer.eps, layer.zero_centered_gamma)
        y = C.ub_fprop(ln_out, w, b, tp, ub) if tp.mode == "row" and ub.enabled else None
        if y is None:
            ln_total = C.gather_input(ln_out, tp)
            y = C.fprop(ln_total, w, b, tp)
    ln_ret = None
    if layer.return_layernorm_output:
        if layer.return_layernorm_output_gathered and tp.mode == "column" and tp.sp:
            # The full sequence: the GEMM's gathered input (or a copy of the
            # buffer's); its gradient is reduce-scattered back in backward.
            ln_ret = C.like_input(ln_total, inp.shape, tp)
        else:
            # ln_out is also saved for backward: it is returned as a view
            # made in the Function, which autograd refuses to let be
            # modified in place.
            ln_ret = ln_out.view(inp.shape)
    return y, ln_ret, (x, ln_out, mu, rsigma)


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, layer, is_first_microbatch, dtype, cast):
        y, ln_ret, (x, ln_out, mu, rsigma) = _forward(inp, ln_weight, ln_bias, weight, bias, layer,
                                                      is_first_microbatch, dtype, cast)
        saved, ctx.objects = prepare_for_saving(x, ln_out, mu, rsigma, ln_weight, weight)
        ctx.save_for_backward(*saved)
        ctx.layer, ctx.inp_shape, ctx.has_bias, ctx.dtype = layer, inp.shape, bias is not None, dtype
        ctx.first_mb = is_first_microbatch
        # y is 2-D; the module gives it the input's leading dims.
        return y if ln_ret is None else (y, ln_ret)

    @staticmethod
    def backward(ctx, dout, dln_out=None):
        layer, dtype = ctx.layer, ctx.dtype
        tp = layer.tp
        x, ln_out, mu, rsigma, ln_weight, weight = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        w = layer._full_weight(weight, None if ctx.first_mb is None else False, dtype)
        g = C.cast(ln_weight, dtype)
        dy = C.as_2d(C.cast(dout, dtype))
        dln, dw, db = C.linear_backward(ctx, dy, ln_out, w, weight, True, 3)
        if dln_out is not None:
            dln_out = C.as_2d(C.cast(dln_out, dtype))
            if dln_out.shape[0] != dln.shape[0]:  # the gathered output's gradient: this rank's rows, summed
                dln_out = reduce_scatter_rows(dln_out, tp.group, tp.size)
            dln = dln + dln_out
        # Under sequence parallelism the norm's parameter gradients are this
        # rank's partial sums: the parameters carry `sequence_parallel` and
        # the framework sums them over the group, as with TransformerEngine.
        dx, dgamma, dbeta = _engine.norm_bwd(dln, x, mu, rsigma, g, layer.zero_centered_gamma,
                                             with_dbeta=mu is not None)
        return C.like_input(dx, ctx.inp_shape), dgamma, dbeta, dw, db, None, None, None, None


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
        dtype, device = C.default_dtype(params_dtype), C.default_device(device)
        self.rng_tracker_name = rng_tracker_name
        init_gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init_gamma(self.in_local, dtype=dtype, device=device))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(self.in_local, dtype=dtype, device=device))
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
        self._make_linear_params(out_features, self.in_local, dtype, device, init_method, get_rng_state_tracker,
                                 rng_tracker_name, bias, parameters_split)

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
        """inp [tokens, in] or [seq, batch, in]; is_first_microbatch as in Linear.
        Returns out, (out, bias), (out, ln_out) or (out, bias, ln_out), as TE."""
        if fp8_output or fp8_grad:
            raise NotImplementedError("FP8 outputs/gradients (fp8_output, fp8_grad) are not supported")
        plan = self._plan
        if plan is None:
            plan = self._fast_plan()
        if plan:  # the common case, with the least host work (module/_fast.py); None: the general path
            out = _fast.layernorm_linear(self, plan, inp, self.return_bias, is_first_microbatch)
            if out is not None:
                return out
        weight = self._weight_tensor()
        bias = self._bias_tensor()
        dtype, cast = C.compute_dtype(weight)
        args = (inp, self.layer_norm_weight, self.layer_norm_bias, weight, None if self.return_bias else bias, self,
                is_first_microbatch, dtype, cast)
        if torch.is_grad_enabled():
            out = _LayerNormLinearFn.apply(*args)
        else:
            y, ln_ret, _ = _forward(*args)
            out = y if ln_ret is None else (y, ln_ret)
        if self.return_layernorm_output:
            y, ln_out = C.like_input(out[0], inp.shape, self.tp), out[1]
        else:
            y = C.like_input(out, inp.shape, self.tp)
        if self.return_bias:
            if bias is None:
                bias = getattr(self, self.bias_names[0])
            bias = C.cast(bias, dtype)
            return (y, bias, ln_out) if self.return_layernorm_output else (y, bias)
        return (y, ln_out) if self.return_layernorm_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, parallel_mode={self.tp.mode}, "
                f"sequence_parallel={self.tp.sp}, tp_size={self.tp.size}")
