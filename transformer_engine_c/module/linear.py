"""tec.Linear: a tensor-parallel linear layer (TE's names and shapes) whose
GEMMs run in the C engine."""
import torch

from .._saved import prepare_for_saving, restore_from_saved
from . import base
from ._weights import weight_for_compute, weight_grad


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, layer):
        tp = layer.tp
        x = base.check_input(inp, layer.in_local, weight, tp)
        w = weight_for_compute(weight)
        y = base.ub_fprop(x, w, bias, tp, layer.ub)
        if y is None:
            y = base.fprop(base.gather_input(x, tp), w, bias, tp)
        # Save the local (not gathered) input: column + SP re-gathers it in backward.
        saved, ctx.objects = prepare_for_saving(base.outside_buffers(x, layer.ub), weight)
        ctx.save_for_backward(*saved)
        ctx.tp, ctx.inp_shape, ctx.has_bias = tp, inp.shape, bias is not None
        ctx.ub = layer.ub
        return y  # 2-D; the module gives it the input's leading dims

    @staticmethod
    def backward(ctx, dout):
        tp = ctx.tp
        x, weight = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        w = weight_for_compute(weight)
        dy_local = base.as_2d(dout)
        need_dx, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dw = db = None
        if tp.mode == "column":
            dx, res = base.column_backward(dy_local, x, w, tp, ctx.ub, need_dx, need_w, ctx.has_bias)
            if res is not None:
                dw, db = res
        else:
            dx, dy = base.row_backward(dy_local, w, tp, ctx.ub, need_dx)
            if need_w:
                res = base.wgrad(dy, base.gather_input(x, tp), ctx.has_bias)
                dw, db = res if ctx.has_bias else (res, None)
        if dw is not None:
            dw = weight_grad(weight, dw)
        return (base.like_input(dx, ctx.inp_shape) if dx is not None else None), dw, db, None


class Linear(base.TPModule):
    """y = x W^T + b with optional tensor parallelism.

    parallel_mode="column": weight [out/tp, in], output features split.
    parallel_mode="row": weight [out, in/tp], input features split, output
    reduced (reduce-scattered along the sequence with sequence_parallel).
    Inputs are [tokens, in] or [seq, batch, in] (sequence first, split across
    ranks under sequence_parallel), in the parameters' dtype and device.
    """

    def __init__(self, in_features, out_features, bias=True, *, params_dtype=None, device=None,
                 parallel_mode=None, sequence_parallel=False, tp_group=None, tp_size=1,
                 ub_overlap_ag=False, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                 ub_bulk_dgrad=False, ub_bulk_wgrad=False, ub_name=None, return_bias=False,
                 init_method=None, ub_comm=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp = base.TPConfig(parallel_mode, sequence_parallel, tp_group, tp_size)
        self.ub = base.check_ub_flags(self, dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                                       ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                                       ub_bulk_wgrad=ub_bulk_wgrad, ub_name=ub_name), ub_comm)
        self.in_local, self.out_local = self.tp.local_features(in_features, out_features)
        dtype, device = base.default_dtype(params_dtype), base.default_device(device)
        self.return_bias = return_bias
        self.weight = base.make_weight(self.out_local, self.in_local, dtype, device, init_method)
        bias_len = self.out_local if self.tp.mode == "column" else out_features
        self.bias = torch.nn.Parameter(torch.zeros(bias_len, dtype=dtype, device=device)) if bias else None

    def forward(self, inp):
        y = _LinearFn.apply(inp, self.weight, None if self.return_bias else self.bias, self)
        y = base.like_input(y, inp.shape)
        return (y, self.bias) if self.return_bias else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, parallel_mode={self.tp.mode}, "
                f"sequence_parallel={self.tp.sp}, tp_size={self.tp.size}")
