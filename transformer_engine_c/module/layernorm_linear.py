"""tec.LayerNormLinear: LayerNorm or RMSNorm followed by a column-parallel
(or non-parallel) linear layer, both in the C engine."""
import torch

from .. import _engine
from .._saved import prepare_for_saving, restore_from_saved
from ..distributed import all_reduce
from . import base
from ._weights import weight_for_compute, weight_grad

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, bias, layer):
        tp = layer.tp
        x = base.check_input(inp, layer.in_features, weight, tp)
        w = weight_for_compute(weight)
        ub = layer.ub
        if ub.enabled and ub["ub_overlap_ag"] and ub.comms["fprop"].take_overlap("ag", x.shape[0], x.shape[1],
                                                                                 w.shape[0]):
            # The norm writes straight into this rank's slot of the buffer;
            # what is saved (and returned) is a copy, never the buffer, made
            # on the comm stream while the GEMMs run.
            comm = ub.comms["fprop"]
            slot = comm.get_buffer(local_chunk=True, shape=x.shape, dtype=x.dtype)
            ln_view, mu, rsigma = _engine.norm_fwd(x, ln_weight, ln_bias, layer.eps, layer.zero_centered_gamma,
                                                   out=slot)
            ln_out = torch.empty_like(x)
            y = comm.ag_gemm(ln_view, w, bias=bias, local_copy=ln_out)
            del slot, ln_view
        else:
            ln_out, mu, rsigma = _engine.norm_fwd(x, ln_weight, ln_bias, layer.eps, layer.zero_centered_gamma)
            y = base.fprop(base.gather_input(ln_out, tp), w, bias, tp)
        saved, ctx.objects = prepare_for_saving(x, ln_out, mu, rsigma, ln_weight, weight)
        ctx.save_for_backward(*saved)
        ctx.tp, ctx.inp_shape, ctx.has_bias = tp, inp.shape, bias is not None
        ctx.zero_centered_gamma = layer.zero_centered_gamma
        ctx.ub = ub
        # y is 2-D, the module gives it the input's leading dims. ln_out is
        # also saved for backward: it is returned as a view made here, which
        # autograd refuses to let be modified in place.
        return (y, ln_out.view(inp.shape)) if layer.return_layernorm_output else y

    @staticmethod
    def backward(ctx, dout, dln_out=None):
        tp = ctx.tp
        x, ln_out, mu, rsigma, ln_weight, weight = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        w = weight_for_compute(weight)
        dy = base.as_2d(dout)
        need_w = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dln, res = base.column_backward(dy, ln_out, w, tp, ctx.ub, True, need_w, ctx.has_bias)
        if dln_out is not None:
            dln = dln + dln_out.reshape(dln.shape)
        dw = db = None
        if res is not None:
            dw, db = res
            dw = weight_grad(weight, dw)
        # Under sequence parallelism each rank normalised only its own tokens:
        # the parameter grads are summed over the group, both rows of one
        # tensor in one collective (so the two .grad tensors share a storage).
        dparams = torch.empty(1 + (mu is not None), x.shape[1], dtype=ln_weight.dtype,
                              device=x.device) if tp.sp else None
        dx, dgamma, dbeta = _engine.norm_bwd(dln, x, mu, rsigma, ln_weight, ctx.zero_centered_gamma,
                                             with_dbeta=mu is not None, dparams=dparams)
        if dparams is not None:
            all_reduce(dparams, tp.group, tp.size)
        return base.like_input(dx, ctx.inp_shape), dgamma, dbeta, dw, db, None


class LayerNormLinear(base.TPModule):
    """Normalisation (LayerNorm or RMSNorm over the last dim) then y = n W^T + b.

    parallel_mode None or "column" (the normalised input is all-gathered along
    the sequence under sequence_parallel). layer_norm_weight / layer_norm_bias
    are full [in_features]; under sequence_parallel their gradients are summed
    over the tensor-parallel group in backward, so every rank holds the full
    gradient. return_layernorm_output=True also returns the normalised input
    (this rank's tokens, before any gather).
    """

    def __init__(self, in_features, out_features, eps=1e-5, bias=True, *, normalization="LayerNorm",
                 zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None, device=None,
                 parallel_mode=None, sequence_parallel=False, tp_group=None, tp_size=1,
                 ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                 ub_bulk_dgrad=False, ub_bulk_wgrad=False, ub_name=None, return_bias=False,
                 init_method=None, ub_comm=None):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        if parallel_mode == "row":
            raise ValueError("parallel_mode='row' is not supported by LayerNormLinear (the normalisation "
                             "needs the whole hidden dimension); use 'column' or None")
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization = float(eps), normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.tp = base.TPConfig(parallel_mode, sequence_parallel, tp_group, tp_size)
        self.ub = base.check_ub_flags(self, dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                                       ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                                       ub_bulk_wgrad=ub_bulk_wgrad, ub_name=ub_name), ub_comm)
        self.in_local, self.out_local = self.tp.local_features(in_features, out_features)
        dtype, device = base.default_dtype(params_dtype), base.default_device(device)
        init_gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init_gamma(in_features, dtype=dtype, device=device))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(in_features, dtype=dtype, device=device))
                                if normalization == "LayerNorm" else None)
        self.weight = base.make_weight(self.out_local, self.in_local, dtype, device, init_method)
        self.bias = torch.nn.Parameter(torch.zeros(self.out_local, dtype=dtype, device=device)) if bias else None

    def forward(self, inp):
        out = _LayerNormLinearFn.apply(inp, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                                       None if self.return_bias else self.bias, self)
        if self.return_layernorm_output:
            out = (base.like_input(out[0], inp.shape), out[1])
        else:
            out = base.like_input(out, inp.shape)
        if self.return_bias:
            return (*out, self.bias) if isinstance(out, tuple) else (out, self.bias)
        return out

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, parallel_mode={self.tp.mode}, "
                f"sequence_parallel={self.tp.sp}, tp_size={self.tp.size}")
