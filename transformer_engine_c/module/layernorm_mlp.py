"""tec.LayerNormMLP: normalisation, fc1 (column parallel), activation and fc2
(row parallel) as one module with TransformerEngine 2.x's signature,
parameter names and shapes. Norm, GEMMs and activation run in the C engine;
under sequence parallelism the collectives overlap the GEMMs through the
fc1_* / fc2_* userbuffers communicators, in every grad mode."""
import torch

from .. import _engine
from .._C import prepare_for_saving, restore_from_saved
from ..distributed import reduce_scatter_rows
from . import _steps, _temporaries
from ._config import UBConfig, TPConfig, as_2d, cast, check_input, compute_dtype, default_device, default_dtype
from ._config import like_input, returned_bias
from ._opcall import OpSpec, out_rows
from .layernorm_linear import norm_saved_shapes
from ._plan import MLPPlan, apply, check_params, check_saved, grad_output, make_call
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8Tensor
from .base import TransformerEngineBaseModule, _init_weight, _set_tp_attributes

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACT_PARAM_KEYS = ("limit", "alpha", "glu_linear_offset")
FC1_FLAGS = ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
FC2_FLAGS = ("ub_overlap_rs", "ub_overlap_ag")
UB_NAMES = ("fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad")
_is_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_PLAIN = (torch.Tensor, torch.nn.Parameter, Float8Tensor, Float8BlockwiseQTensor)  # saved as they are


def _norm_fc1_act(call, x, g, beta, w1, b1, keep, want_gathered):
    """The norm, fc1 on the (gathered) normalised rows, the activation:
    (ln_out: this rank's normalised rows, stats, fc1's output over the
    group's rows, the activation's output, the gathered ln_out when asked)."""
    layer, plan = call.layer, call.plan
    h, ln_out, stats, ln_total = _steps.norm_fprop(call, layer.tp, layer.ub, x, g, beta, plan.eps, plan.zcg, w1,
                                                   b1, keep or layer.return_layernorm_output, want_gathered)
    if call.fp8 is not None and call.fp8.fuses_activation(plan.act):
        a = call.fp8.produce(h, plan.act)  # computed by fc2's input cast: no compute-dtype copy
    else:
        a = _steps.act_fwd(call, plan.act, h, keep, plan.act_params)
    return ln_out, stats, h, a, ln_total


def _prepare(call, inp, g, beta, w1, b1, w2, b2):
    """The call's tensors as the steps read them (validated and converted
    when the call is not ready: the named errors)."""
    if call.ready:
        return inp, g, beta, w1, b1, w2, b2
    layer, dtype = call.layer, call.dtype
    x = check_input(inp, layer.hidden_size, dtype, w1.device, layer.tp, call.cast)
    w1 = layer._full_weight(w1, call.first_mb, dtype, call.fp8 is not None)
    w2 = layer._full_weight(w2, call.first_mb, dtype, call.fp8 is not None)
    g, beta, b1, b2 = (cast(t, dtype) for t in (g, beta, b1, b2))
    check_params((("fc1_weight", w1), ("layer_norm_weight", g), ("layer_norm_bias", beta), ("fc2_weight", w2),
                  ("fc1_bias", b1), ("fc2_bias", b2)), dtype, x.device, call.plan.shapes)
    return x, g, beta, w1, b1, w2, b2


def _forward(call, inp, g, beta, w1, b1, w2, b2, keep):
    """(y, the normalised output to return or None, (x, ln_out, stats, fc1's
    output, the activation's output))."""
    layer = call.layer
    x, g, beta, w1, b1, w2, b2 = _prepare(call, inp, g, beta, w1, b1, w2, b2)
    # An input lying in fc1_fprop's buffer (a caller may pass a buffer view)
    # is copied before the norm writes this rank's slot.
    if layer.ub.enabled:
        x = _steps.outside_buffers(x, layer.ub)
    want_gathered = layer.return_layernorm_output_gathered and layer.tp.sp
    ln_out, stats, h, a, ln_total = _norm_fc1_act(call, x, g, beta, w1, b1, keep, want_gathered)
    y = _steps.fprop(call, layer.tp2, layer.ub2, a, w2, b2, gi=1)  # fc2's bias added once, after the reduction
    ln_ret = None
    if layer.return_layernorm_output:
        ln_ret = ln_total if want_gathered else ln_out
        if ln_ret.dim() != len(inp.shape):
            ln_ret = like_input(ln_ret, inp.shape, layer.tp if want_gathered else None)
    return y, ln_ret, (x, ln_out, stats, h, a)


class _LayerNormMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, call):
        layer = call.layer
        y, ln_ret, (x, ln_out, stats, h, a) = _forward(call, inp, ln_weight, ln_bias, fc1_weight, fc1_bias,
                                                       fc2_weight, fc2_bias, True)
        # Nothing saved aliases a buffer: x is copied if it lies in one (a
        # caller may pass a buffer view); the rest is memory of its own.
        if layer.ub2.enabled:
            x = _steps.outside_buffers(x, layer.ub2)
        if layer.checkpoint:  # TE's checkpoint=True: norm, fc1, activation recomputed in backward
            tensors = (x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight)
        else:
            if call.fp8 is not None:
                ln_out, a = call.fp8.saved_input(ln_out, 0), call.fp8.saved_input(a, 1)
            tensors = (x, ln_weight, fc1_weight, fc2_weight, ln_out, stats, h, a)
        if type(fc1_weight) in _PLAIN and type(fc2_weight) in _PLAIN:
            ctx.save_for_backward(*tensors)
            ctx.objects = None
        else:  # a DistributedWeight saves itself
            saved, ctx.objects = prepare_for_saving(*tensors)
            ctx.save_for_backward(*saved)
        ctx.call, ctx.has_b1, ctx.has_b2 = call, fc1_bias is not None, fc2_bias is not None
        if not call.ready:
            ctx.inp_shape = inp.shape
        return y if ln_ret is None else (y, ln_ret)

    @staticmethod
    def backward(ctx, dout, dln_ret=None):
        call = ctx.call
        call.refresh_stream()
        layer, dtype, plan = call.layer, call.dtype, call.plan
        tp1, tp2 = layer.tp, layer.tp2
        t = ctx.saved_tensors if ctx.objects is None else restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        first_mb = None if call.first_mb is None else False  # a weight gathered in forward is reused
        if layer.checkpoint:
            x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight = t
        else:
            x, ln_weight, fc1_weight, fc2_weight, ln_out, stats, h, a = t
        if call.ready:
            w1, w2, g = fc1_weight, fc2_weight, ln_weight
            check_saved(w1, dtype, (plan.f1, plan.hidden), "fc1_weight")
            check_saved(w2, dtype, (plan.hidden, plan.ffn), "fc2_weight")
            check_saved(g, dtype, (plan.hidden,), "layer_norm_weight")
        else:
            w1 = layer._full_weight(fc1_weight, first_mb, dtype, call.fp8 is not None)
            w2 = layer._full_weight(fc2_weight, first_mb, dtype, call.fp8 is not None)
            g = cast(ln_weight, dtype)
        if layer.checkpoint:
            if call.fp8 is not None:  # recomputed with the forward's scales and FP8 weight
                call.fp8.recomputing = True
            ln_out, stats, h, a, _ = _norm_fc1_act(call, x, g, cast(ln_bias, dtype), w1, cast(fc1_bias, dtype),
                                                   True, False)
        need = ctx.needs_input_grad  # x, gamma, beta, w1, b1, w2, b2
        dy = grad_output(dout, dtype)
        wg_fc2, wg_fc1 = layer._wgrads

        # fc2 (row): dgrad (ub_overlap_ag: the grad_output all-gather
        # overlapped), then wgrad and its bias gradient (this rank's tokens
        # under sequence parallelism: fc2_bias carries `sequence_parallel`).
        wg2 = None
        if need[5] or need[6]:
            wg2 = wg_fc2.step(fc2_weight, ctx.has_b2 and need[6], call.first_mb,
                              bias_from_local=tp2.mode == "row" and tp2.sp, need_w=need[5])
        dact = _temporaries.temp(a, a.shape, call.dev, call.stream, _temporaries.T_DACT)
        dact, dw2, db2 = _steps.linear_backward(call, tp2, layer.ub2, dy, a, w2, True, wg2, dact, gi=1)
        del a

        # the activation's backward, fc1's bias gradient fused (column sums); in FP8 fused
        # with dh's cast too (dh is then a stand-in that only fc1's FP8 GEMMs read)
        wg1 = wg_fc1.step(fc1_weight, False, call.first_mb) if need[3] else None
        if call.fp8 is not None and call.fp8.fuses_activation(plan.act) and not layer.delay_wgrad_compute:
            dh, db1 = call.fp8.activation_grad_output(dact, h, plan.act, wg1 is not None and wg1.need_w,
                                                      ctx.has_b1 and need[4])
        else:
            dh, db1 = _steps.act_bwd(call, plan.act, dact, h, ctx.has_b1 and need[4], plan.act_params,
                                     layer.delay_wgrad_compute)
        del dact, h
        if db1 is not None and layer.delay_wgrad_compute:
            wg_fc1.bias_queue.append(db1)  # with fc1's weight gradient, in backward_dw()
            db1 = None

        # fc1 (column): dgrad (+ its reduction) and wgrad on the gathered
        # ln_out, then the norm's backward on this rank's rows
        extra = None
        if dln_ret is not None:
            extra = grad_output(dln_ret, dtype)
            if extra.numel() != ln_out.numel():  # the gathered output's gradient: this rank's rows, summed
                extra = reduce_scatter_rows(as_2d(extra), tp1.group, tp1.size)
            extra = extra.view(ln_out.shape)
        dx, dgamma, dbeta, dw1, _ = _steps.norm_linear_backward(call, tp1, layer.ub, dh, x, ln_out, stats, g,
                                                                plan.zcg, plan.rms, w1, wg1, extra)
        if not call.ready:
            dx = like_input(dx, ctx.inp_shape)
        if call.fp8 is not None:
            call.fp8.finish_backward()
        return dx, dgamma, dbeta, dw1, db1, dw2, db2, None


def _nograd(call, a):
    y, ln_ret, _ = _forward(call, *a, False)
    return (y,) if ln_ret is None else (y, ln_ret)


def _new_saved(layer, a):
    if layer.checkpoint:
        return ()
    x, plan = a[0], layer._plan or layer._make_plan()
    rows = out_rows(layer.tp, x.shape[0])  # fc1's rows: gathered under sequence parallelism
    return norm_saved_shapes(layer, x) + (((rows, plan.f1), x.dtype), ((rows, plan.ffn), x.dtype))


_OP_SPEC = OpSpec(
    _LayerNormMLPFn, weights={3: "fc1_weight", 5: "fc2_weight"}, biases=(4, 6),
    call=lambda layer, plan, a, first_mb: make_call(layer, plan, a[0], a[3], (a[1], a[2], a[5], a[4], a[6]),
                                                    first_mb),
    nograd=_nograd,
    saved=lambda layer: ("x", 1, 2, 3, 4, 5) if layer.checkpoint else ("x", 1, 3, 5, "new", "new", "new", "new"),
    new_shapes=_new_saved,
    ctx=lambda a: {"has_b1": a[4] is not None, "has_b2": a[6] is not None})


class LayerNormMLP(TransformerEngineBaseModule):
    """Normalisation -> fc1 -> activation -> fc2: TransformerEngine's
    LayerNormMLP (same positional order, defaults, parameter names and
    shapes, semantics).

    Parameters: layer_norm_weight / layer_norm_bias [hidden_size] (no bias
    for RMSNorm); fc1_weight [fc1_out, hidden_size] and fc1_bias [fc1_out]
    with fc1_out = ffn_hidden_size / tp_size, doubled for a gated activation
    (each rank's rows are [activation half | gate half], TE's layout);
    fc2_weight [hidden_size, ffn_hidden_size / tp_size], fc2_bias
    [hidden_size]. With set_parallel_mode, fc1 is column- and fc2
    row-parallel (fc2's bias added once, after the reduction). The norm
    parameters, and with set_parallel_mode fc2_bias, carry
    `sequence_parallel`: under sequence parallelism their gradients hold this
    rank's tokens only and the training framework sums them over the group
    (tec.allreduce_sequence_parallel_grads outside Megatron), as with TE.

    Userbuffers (under sequence parallelism with set_parallel_mode, as TE):
    ub_overlap_ag overlaps fc1's input all-gather with its GEMM (fc1_fprop)
    and fc2's grad_output all-gather with its dgrad (fc2_dgrad);
    ub_overlap_rs fc2's output reduce-scatter (fc2_fprop); ub_overlap_rs_dgrad
    fc1's dgrad reduce-scatter (fc1_dgrad), else ub_bulk_dgrad / ub_bulk_wgrad
    the bulk all-gather of the saved input and the bulk reduce-scatter of
    dgrad (fc1_dgrad, fc1_wgrad). The overlaps run in every grad mode.
    Communicators: the registry's (initialize_ub) under those names, or
    ub_comm (keyword, ours): {name: CommOverlap} with those names, or one
    CommOverlap for every role. checkpoint=True saves only the inputs and
    recomputes the norm, fc1 (with its overlap) and the activation in
    backward.
    """

    _plan_class = MLPPlan
    _fp8_num_gemms = 2

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, sequence_parallel=False, return_bias=False,
                 get_rng_state_tracker=None, tp_group=None, tp_size=1, init_method=None, bias=True,
                 normalization="LayerNorm", activation="gelu", activation_params=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation=False, params_dtype=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, seq_length=None,
                 micro_batch_size=None, set_parallel_mode=False, zero_centered_gamma=False, device=None,
                 ub_overlap_ag=False, name=None, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                 ub_bulk_dgrad=False, ub_bulk_wgrad=False, delay_wgrad_compute=False, symmetric_ar_type=None,
                 checkpoint=False, *, ub_comm=None, rng_tracker_name=None):
        super().__init__(name)
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        _engine.activation_code(activation)
        self._act_kw = {}
        if activation_params is not None:
            if not isinstance(activation_params, dict) or set(activation_params) - set(ACT_PARAM_KEYS):
                raise ValueError(f"activation_params must be a dict with keys among {ACT_PARAM_KEYS}, got "
                                 f"{activation_params!r}")
            if activation == "clamped_swiglu":
                self._act_kw = {k: float(v) for k, v in activation_params.items()}
        for what, n in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.activation = float(eps), normalization, activation
        self.activation_params = activation_params
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_bias, self.use_bias = bool(return_bias), bool(bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered and return_layernorm_output)
        self.set_parallel_mode, self.checkpoint = bool(set_parallel_mode), bool(checkpoint)
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size

        # fc1 is the base's GEMM (self.tp, self.ub); fc2 has its own (tp2, ub2)
        spm = self.set_parallel_mode
        self._setup_parallel("column" if spm else None, sequence_parallel, tp_group, tp_size, symmetric_ar_type)
        self.tp2 = TPConfig("row" if spm else None, sequence_parallel, tp_group, tp_size)
        if ffn_hidden_size % self.tp_size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by the tensor-parallel size "
                             f"{self.tp_size}")
        self.size_per_partition = ffn_hidden_size // self.tp_size
        flags = dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                     ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad)
        self.ub, self.ub2 = self._ub_configs(flags, ub_comm)
        self._setup_wgrad_policy(delay_wgrad_compute, fuse_wgrad_accumulation)

        gated = activation in _engine.GATED_ACTIVATIONS
        fc1_out = 2 * self.size_per_partition if gated else self.size_per_partition
        dtype, device = default_dtype(params_dtype), default_device(device)
        self._make_norm_params(hidden_size, normalization, dtype, device)
        # TE's registration order: fc1_weight, fc1_bias, fc2_weight, fc2_bias
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype, device=device))
        _init_weight(self.fc1_weight, init_method, get_rng_state_tracker, rng_tracker_name, 0)
        if bias:
            self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device))
            _set_tp_attributes(self.fc1_bias, True, 0)
        else:  # as TE: empty tensors, not parameters
            self.fc1_bias = torch.empty(0, dtype=dtype, device=device)
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden_size, self.size_per_partition, dtype=dtype,
                                                         device=device))
        _init_weight(self.fc2_weight, output_layer_init_method, get_rng_state_tracker, rng_tracker_name, 1)
        if bias:
            self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            if spm:
                self.fc2_bias.sequence_parallel = self.tp.sp
        else:
            self.fc2_bias = torch.empty(0, dtype=dtype, device=device)
        self._quantize_weights([("fc1_weight", 0), ("fc2_weight", 1)])  # inside quantized_model_init
        # backward_dw's order: fc2, then fc1 (fc1's bias gradient comes from the activation's backward)
        self._setup_wgrads([(["fc2_weight"], ["fc2_bias"]), (["fc1_weight"], ["fc1_bias"])], bias)

    def _ub_configs(self, flags, ub_comm):
        """(fc1's UBConfig, fc2's) from TE's flags; UBConfig ignores (with a
        warning) what does not apply, as TE does."""
        parts = {"fc1": None, "fc2": None}
        if isinstance(ub_comm, dict):
            bad = sorted(set(ub_comm) - set(UB_NAMES))
            if bad:
                raise ValueError(f"LayerNormMLP: ub_comm has unknown names {bad}; expected some of {UB_NAMES}")
            for part in parts:
                parts[part] = {k.split("_", 1)[1]: c for k, c in ub_comm.items() if k.startswith(part + "_")}
        elif ub_comm is not None:
            parts = {"fc1": ub_comm, "fc2": ub_comm}
        return (UBConfig(self, {k: flags[k] for k in FC1_FLAGS}, "fc1", parts["fc1"], self.tp),
                UBConfig(self, {k: flags[k] for k in FC2_FLAGS}, "fc2", parts["fc2"], self.tp2))

    def forward(self, inp, is_first_microbatch=None):
        """inp: [tokens, hidden] or [seq, batch, hidden] (sequence first; this
        rank's part of the sequence under sequence parallelism). Returns the
        output, then fc2_bias with return_bias, then the normalised input
        with return_layernorm_output (TE's order). is_first_microbatch as
        TE's: main_grad overwritten on the first micro-batch with
        fuse_wgrad_accumulation, a DistributedWeight gathered once per step."""
        if _compiling():
            return self._compiled(inp, is_first_microbatch)
        plan = self._plan or self._make_plan()
        params = self._parameters
        w1, w2, g = params.get("fc1_weight"), params.get("fc2_weight"), params.get("layer_norm_weight")
        if w1 is None or w2 is None or g is None:
            w1, w2, g = self.fc1_weight, self.fc2_weight, self.layer_norm_weight
        beta = None if plan.rms else _param(self, params, "layer_norm_bias")
        b1 = b2 = None
        if plan.bias:
            b1, b2 = _param(self, params, "fc1_bias"), _param(self, params, "fc2_bias")
        call = make_call(self, plan, inp, w1, (g, beta, w2, b1, b2), is_first_microbatch)
        fc2_bias = None if self.return_bias else b2
        args = (inp, g, beta, w1, b1, w2, fc2_bias, call)
        if _is_grad_enabled():
            out = apply(_LayerNormMLPFn, *args)
        else:
            y, ln_ret, _ = _forward(call, inp, g, beta, w1, b1, w2, fc2_bias, False)
            out = y if ln_ret is None else (y, ln_ret)
        y, ln_out = out if self.return_layernorm_output else (out, None)
        if y.dim() != inp.dim():  # a 2-D result for a 3-D input (validated, or from a communicator)
            y = like_input(y, inp.shape)
        res = (y,)
        if self.return_bias:
            res += (returned_bias(self.fc2_bias, call.dtype),)
        if self.return_layernorm_output:
            res += (ln_out,)
        return res[0] if len(res) == 1 else res

    _op_spec = _OP_SPEC

    def _op_outputs(self, args):
        x, tp = args[0], self.tp
        outs = (((out_rows(self.tp2, out_rows(tp, x.shape[0])), self.hidden_size), x.dtype),)
        if self.return_layernorm_output:
            gathered = self.return_layernorm_output_gathered and tp.sp
            outs += (((x.shape[0] * (tp.size if gathered else 1), x.shape[1]), x.dtype),)
        return outs

    def _compiled(self, inp, is_first_microbatch):
        """forward's call while torch.compile traces it (module/_opcall.py)."""
        w1, w2 = self.fc1_weight, self.fc2_weight
        dtype, c = compute_dtype(w1)
        x = check_input(inp, self.hidden_size, dtype, w1.device, self.tp, c)
        beta = None if self.normalization == "RMSNorm" else self.layer_norm_bias
        b1 = b2 = None
        if self.use_bias:
            b1, b2 = cast(self.fc1_bias, dtype), cast(self.fc2_bias, dtype)
        outs = self._op_call((x, cast(self.layer_norm_weight, dtype), cast(beta, dtype), cast(w1, dtype), b1,
                              cast(w2, dtype), None if self.return_bias else b2), is_first_microbatch)
        res = (like_input(outs[0], inp.shape),)
        if self.return_bias:
            res += (returned_bias(self.fc2_bias, dtype),)
        if self.return_layernorm_output:
            gathered = self.return_layernorm_output_gathered and self.tp.sp
            res += (like_input(outs[1], inp.shape, self.tp if gathered else None),)
        return res[0] if len(res) == 1 else res

    def set_tensor_parallel_group(self, tp_group):
        """TE's setter: both GEMMs' collectives use `tp_group` from now on
        (same size)."""
        super().set_tensor_parallel_group(tp_group)
        self.tp2 = TPConfig(self.tp2.mode, self.tp2.sp, tp_group, self.tp2.size)

    def ub_comms(self):
        """{TE name: CommOverlap} of the communicators this module uses."""
        return {f"{part}_{role}": c for part, ub in (("fc1", self.ub), ("fc2", self.ub2))
                for role, c in ub.comms.items()}

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, "
                f"set_parallel_mode={self.set_parallel_mode}, sequence_parallel={self.tp.sp}, "
                f"tp_size={self.tp_size}")


def _param(module, params, name):
    """module's `name`: from its _parameters (nn.Module's attribute lookup costs
    several times a dict's, on every call), else its attribute."""
    t = params.get(name)
    return t if t is not None else getattr(module, name)

