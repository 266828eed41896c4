"""TransformerEngine's `GroupedLinear` for mixture-of-experts: num_gemms
linear maps applied to consecutive row blocks of one input (m_splits rows
each), y_i = x_i W_i^T + b_i, on the engine's GEMMs run back to back on one
stream.

As in TE, the module does no tensor-parallel communication (an MoE layer's
dispatch and combine do it): parallel_mode and the group only decide the
weight shapes ("column": out_features / tp per rank, "row": in_features /
tp) and the parameters' parallel attributes; a bias with more than one rank
is refused, as TE refuses it."""
import torch
import torch.distributed as dist

from .. import _engine, _library
from ..quantization import FP8GlobalStateManager
from ._config import PARALLEL_MODES, compute_dtype, default_device, default_dtype, returned_bias
from ._wgrad import main_grad_of
from .base import TransformerEngineBaseModule, _init_weight, _set_tp_attributes

__all__ = ["GroupedLinear"]


def _wgrad_into(p, dy, x, accumulate):
    """dW into p.main_grad (fp32, accumulated unless a first micro-batch); a
    dummy gradient for autograd as Linear's fused path returns."""
    main = main_grad_of(p)
    if dy.shape[0]:
        _engine.gemm(dy, x, transa=True, out=main, accumulate=accumulate)
    elif not accumulate:
        main.zero_()
    if hasattr(p, "grad_added_to_main_grad"):
        p.grad_added_to_main_grad = True
        make = torch.zeros if getattr(p, "zero_out_wgrad", False) else torch.empty
        return make(p.shape, dtype=p.dtype, device=p.device)
    return None


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, layer, dtype, first_microbatch, *params):
        n = layer.num_gemms
        weights = [w.to(dtype) if w.dtype != dtype else w for w in params[:n]]
        biases = [b.to(dtype) if b.dtype != dtype else b for b in params[n:]] if layer.apply_bias else [None] * n
        xs = torch.split(x, m_splits)
        ys = []
        for xi, wi, bi in zip(xs, weights, biases):
            xi = xi.contiguous()
            ys.append(_engine.gemm(xi, wi.contiguous(), transb=True, bias=bi) if xi.shape[0] else
                      xi.new_empty(0, wi.shape[0]))
        ctx.save_for_backward(x, *params[:n])
        ctx.layer, ctx.m_splits, ctx.dtype, ctx.first = layer, m_splits, dtype, first_microbatch
        return torch.cat(ys) if ys else x.new_empty(0, layer.out_features)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        layer, dtype = ctx.layer, ctx.dtype
        dy = dy.to(dtype).contiguous()
        xs, dys = torch.split(x, ctx.m_splits), torch.split(dy, ctx.m_splits)
        need_dx = ctx.needs_input_grad[0]
        dxs, dws, dbs = [], [], []
        for i, (xi, dyi, p) in enumerate(zip(xs, dys, params)):
            xi, dyi = xi.contiguous(), dyi.contiguous()
            wi = p.to(dtype) if p.dtype != dtype else p
            if need_dx:
                dxs.append(_engine.gemm(dyi, wi.contiguous()) if dyi.shape[0] else xi.new_zeros(xi.shape))
            if not ctx.needs_input_grad[5 + i]:
                dws.append(None)
            elif layer.fuse_wgrad_accumulation:
                dws.append(_wgrad_into(layer._parameters[f"weight{i}"], dyi, xi, not ctx.first))
            else:
                dw = _engine.gemm(dyi, xi, transa=True) if dyi.shape[0] else torch.zeros_like(wi)
                dws.append(dw.to(p.dtype))
            if layer.apply_bias:
                dbs.append(dyi.sum(0, dtype=torch.float32).to(layer._parameters[f"bias{i}"].dtype))
        dx = torch.cat(dxs) if need_dx else None
        return (dx, None, None, None, None, *dws, *dbs)


class GroupedLinear(TransformerEngineBaseModule):
    """TransformerEngine's GroupedLinear(num_gemms, in_features, out_features,
    sequence_parallel, fuse_wgrad_accumulation, tp_group, tp_size,
    get_rng_state_tracker, rng_tracker_name, init_method, bias, return_bias,
    params_dtype, parallel_mode, device, ub_overlap_rs, ub_overlap_ag,
    ub_name, delay_wgrad_compute, save_original_input, name); parameters
    weight0.. / bias0.. as TE names them; forward(inp, m_splits,
    is_first_microbatch=None). Userbuffers overlap and delay_wgrad_compute
    raise NotImplementedError."""

    _fp8_num_gemms = None  # no FP8 yet: a checkpoint's FP8 state is ignored (module/_extra_state.py)

    def __init__(self, num_gemms, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None, device=None,
                 ub_overlap_rs=False, ub_overlap_ag=False, ub_name=None, delay_wgrad_compute=False,
                 save_original_input=False, name=None):
        super().__init__(name)
        if ub_overlap_rs or ub_overlap_ag:
            raise NotImplementedError("GroupedLinear: userbuffers overlap (ub_overlap_rs / ub_overlap_ag) is not "
                                      "supported (TE does not support it either)")
        if delay_wgrad_compute:
            raise NotImplementedError("GroupedLinear: delay_wgrad_compute is not supported")
        if parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {parallel_mode!r}")
        num_gemms, in_features, out_features = int(num_gemms), int(in_features), int(out_features)
        if num_gemms <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"num_gemms ({num_gemms}), in_features ({in_features}) and out_features "
                             f"({out_features}) must be positive")
        if tp_group is not None:
            tp_size = dist.get_world_size(tp_group)
        tp_size = int(tp_size)
        if tp_size > 1 and bias:
            raise ValueError("GroupedLinear: bias is not supported with more than one tensor-parallel rank (the "
                             "communication happens outside the module), as in TE")
        if parallel_mode == "column":
            if out_features % tp_size:
                raise ValueError(f"out_features={out_features} is not divisible by tp_size={tp_size}")
            out_features //= tp_size
        elif parallel_mode == "row":
            if in_features % tp_size:
                raise ValueError(f"in_features={in_features} is not divisible by tp_size={tp_size}")
            in_features //= tp_size
        dtype, device = default_dtype(params_dtype), default_device(device)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.tp_group, self.tp_size, self._parallel_mode = tp_group, tp_size, parallel_mode
        self._sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.delay_wgrad_compute = False
        self.use_bias, self.return_bias = bool(bias), bool(return_bias)
        self.apply_bias = self.use_bias and not self.return_bias
        self.save_original_input, self.ub_name = save_original_input, ub_name
        self.params_dtype = dtype
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            _init_weight(w, init_method, get_rng_state_tracker, rng_tracker_name, 1 if parallel_mode == "row" else 0)
            self.register_parameter(f"weight{i}", w)
            if self.use_bias:
                b = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                if parallel_mode == "row":
                    b.sequence_parallel = self._sequence_parallel
                elif parallel_mode == "column":
                    _set_tp_attributes(b, True, 0)
                self.register_parameter(f"bias{i}", b)
            else:
                setattr(self, f"bias{i}", torch.empty(0, dtype=dtype, device=device))

    @property
    def parallel_mode(self):
        return self._parallel_mode

    @property
    def sequence_parallel(self):
        return self._sequence_parallel

    def set_tensor_parallel_group(self, tp_group):
        if tp_group is not None and dist.get_world_size(tp_group) != self.tp_size:
            raise ValueError(f"GroupedLinear: tp_group has {dist.get_world_size(tp_group)} ranks, the layer "
                             f"was built for {self.tp_size}")
        self.tp_group = tp_group

    def _compiled(self, x, m_splits, dtype, weights, biases):
        """The GEMMs while torch.compile traces the layer: tec::gemm per
        group (transformer_engine_c/_library.py), the same engine GEMMs."""
        if self.fuse_wgrad_accumulation:
            raise NotImplementedError("GroupedLinear: fuse_wgrad_accumulation (main_grad written in backward) "
                                      "cannot be traced by torch.compile; call this layer eagerly")
        ys = []
        for i, xi in enumerate(torch.split(x, m_splits)):
            b = biases[i].to(dtype) if self.apply_bias else None
            ys.append(_library.linear(xi, weights[i].to(dtype), b))
        return torch.cat(ys)

    def forward(self, inp, m_splits, is_first_microbatch=None):
        if FP8GlobalStateManager.FP8_ENABLED or FP8GlobalStateManager.FP8_CALIBRATION:
            raise NotImplementedError("GroupedLinear does not compute in FP8 yet (inside an enabled FP8 autocast); "
                                      "Linear, LayerNormLinear and LayerNormMLP do")
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"GroupedLinear: inp must be a tensor, got {type(inp).__name__}")
        if isinstance(m_splits, torch.Tensor):
            m_splits = m_splits.tolist()
        m_splits = [int(m) for m in m_splits]
        if len(m_splits) != self.num_gemms or any(m < 0 for m in m_splits):
            raise ValueError(f"GroupedLinear: m_splits must be {self.num_gemms} non-negative sizes, got {m_splits}")
        if inp.shape[-1] != self.in_features:
            raise ValueError(f"GroupedLinear: inp's last dimension must be {self.in_features}, got "
                             f"{tuple(inp.shape)}")
        lead = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        if sum(m_splits) != x.shape[0]:
            raise ValueError(f"GroupedLinear: m_splits {m_splits} sum to {sum(m_splits)}, the input has "
                             f"{x.shape[0]} rows")
        weights = [self._parameters[f"weight{i}"] for i in range(self.num_gemms)]
        dtype, cast = compute_dtype(weights[0])
        if x.dtype != dtype:
            if not cast:
                raise TypeError(f"GroupedLinear: input dtype {x.dtype} differs from the parameters' {dtype}")
            x = x.to(dtype)
        biases = [self._parameters[f"bias{i}"] for i in range(self.num_gemms)] if self.apply_bias else []
        if torch.compiler.is_compiling():
            y = self._compiled(x, m_splits, dtype, weights, biases)
        else:
            with torch.autocast(x.device.type, enabled=False):
                y = _GroupedLinearFn.apply(x, m_splits, self, dtype, bool(is_first_microbatch), *weights, *biases)
        y = y.view(*lead, self.out_features)
        if self.return_bias:
            return y, [returned_bias(b, b.dtype) for b in (getattr(self, f"bias{i}") for i in range(self.num_gemms))]
        return y
