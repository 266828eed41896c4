"""tec.LayerNormMLP: normalisation, fc1 (column parallel), activation and fc2
(row parallel) as one module with TransformerEngine 2.x's signature,
parameter names and shapes. Norm, GEMMs and activation run in the C engine;
under sequence parallelism the collectives overlap the GEMMs through the
fc1_* / fc2_* userbuffers communicators, in every grad mode."""
import torch

from .. import _engine
from .._C import prepare_for_saving, restore_from_saved
from ..distributed import reduce_scatter_rows
from . import _common as C
from . import _fast
from .base import TransformerEngineBaseModule, _add_grad, _set_tp_attributes, default_init_method

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACT_PARAM_KEYS = ("limit", "alpha", "glu_linear_offset")
FC1_FLAGS = ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
FC2_FLAGS = ("ub_overlap_rs", "ub_overlap_ag")
UB_NAMES = ("fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad")


class _Gemm:
    """What a Wgrad step reads of a layer, for one of the module's two GEMMs:
    its weight parameter (looked up by name, so a replaced parameter, e.g. a
    DistributedWeight, is seen), the module's wgrad options, and its own
    queue of delayed weight gradients."""

    def __init__(self, module, weight_name):
        self.module, self.weight_name = module, weight_name
        self._wgrad_queue = []

    @property
    def fuse_wgrad_accumulation(self):
        return self.module.fuse_wgrad_accumulation

    @property
    def delay_wgrad_compute(self):
        return self.module.delay_wgrad_compute

    def _weight_params(self):
        return [getattr(self.module, self.weight_name)]


def _norm_fc1(layer, x, ln_weight, ln_bias, w1, b1, want_gathered):
    """Norm, then fc1 on the (gathered) normalised input. Returns (ln_out:
    this rank's normalised tokens, memory of its own; mu; rsigma; fc1_out
    [tokens of the group, fc1's local features]; the gathered ln_out when
    asked, also memory of its own)."""
    tp, ub = layer.tp, layer.ub
    eps, zcg = layer.eps, layer.zero_centered_gamma
    if x.shape[0] and ub.enabled and ub["ub_overlap_ag"] and ub.comms["fprop"].take_overlap(
            "ag", x.shape[0], x.shape[1], w1.shape[0]):  # (no schedule for a call without tokens)
        fc1_out, ln_out, mu, rsigma, ln_total = C.norm_ag_gemm(ub.comms["fprop"], x, ln_weight, ln_bias, eps, zcg,
                                                               w1, b1, tp, want_gathered)
        return ln_out, mu, rsigma, fc1_out, ln_total
    ln_out, mu, rsigma = _engine.norm_fwd(x, ln_weight, ln_bias, eps, zcg)
    ln_total = C.gather_input(ln_out, tp)
    fc1_out = C.fprop(ln_total, w1, b1, tp)
    return ln_out, mu, rsigma, fc1_out, (ln_total if want_gathered else None)


class _LayerNormMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, layer,
                is_first_microbatch, dtype, cast):
        tp2 = layer.tp2
        x = C.check_input(inp, layer.hidden_size, dtype, fc1_weight.device, layer.tp, cast)
        w1 = layer._full_weight(fc1_weight, is_first_microbatch, dtype)
        w2 = layer._full_weight(fc2_weight, is_first_microbatch, dtype)
        g, beta, b1, b2 = (C.cast(t, dtype) for t in (ln_weight, ln_bias, fc1_bias, fc2_bias))
        want_gathered = layer.return_layernorm_output_gathered and layer.tp.sp
        # An input lying in fc1_fprop's buffer (a caller may pass a buffer
        # view) is copied before the norm writes this rank's slot.
        x = C.outside_buffers(x, layer.ub)
        ln_out, mu, rsigma, fc1_out, ln_total = _norm_fc1(layer, x, g, beta, w1, b1, want_gathered)
        act_out = _engine.act_fwd(fc1_out, layer.activation, **layer._act_kw)
        y = C.ub_fprop(act_out, w2, b2, tp2, layer.ub2)  # fc2's bias added once, after the reduction
        if y is None:
            y = C.fprop(act_out, w2, b2, tp2)
        # Nothing saved aliases a buffer: x is copied if it lies in one (a
        # caller may pass a buffer view); the rest is memory of its own.
        x_saved = C.outside_buffers(x, layer.ub2)
        if layer.checkpoint:  # TE's checkpoint=True: norm, fc1, activation recomputed in backward
            tensors = (x_saved, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight)
        else:
            tensors = (x_saved, ln_weight, fc1_weight, fc2_weight, ln_out, mu, rsigma, fc1_out, act_out)
        saved, ctx.objects = prepare_for_saving(*tensors)
        ctx.save_for_backward(*saved)
        ctx.layer, ctx.inp_shape, ctx.dtype, ctx.first_mb = layer, inp.shape, dtype, is_first_microbatch
        ctx.has_b1, ctx.has_b2 = fc1_bias is not None, fc2_bias is not None
        if not layer.return_layernorm_output:
            return y  # 2-D; the module gives it the input's leading dims
        # Views made here cannot be modified in place (autograd's rule for a
        # Function's view outputs), as LayerNormLinear's.
        ln_ret = ln_total if want_gathered else ln_out
        return y, C.like_input(ln_ret, inp.shape, layer.tp if want_gathered else None)

    @staticmethod
    def backward(ctx, dout, dln_ret=None):
        layer, dtype = ctx.layer, ctx.dtype
        tp1, tp2 = layer.tp, layer.tp2
        t = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        first_mb = None if ctx.first_mb is None else False  # a weight gathered in forward is reused
        if layer.checkpoint:
            x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight = t
            w1 = layer._full_weight(fc1_weight, first_mb, dtype)
            g = C.cast(ln_weight, dtype)
            ln_out, mu, rsigma, fc1_out, _ = _norm_fc1(layer, x, g, C.cast(ln_bias, dtype), w1,
                                                       C.cast(fc1_bias, dtype), False)
            act_out = _engine.act_fwd(fc1_out, layer.activation, **layer._act_kw)
        else:
            x, ln_weight, fc1_weight, fc2_weight, ln_out, mu, rsigma, fc1_out, act_out = t
            w1 = layer._full_weight(fc1_weight, first_mb, dtype)
            g = C.cast(ln_weight, dtype)
        w2 = layer._full_weight(fc2_weight, first_mb, dtype)
        need = ctx.needs_input_grad
        dy = C.as_2d(C.cast(dout, dtype))

        # fc2 (row): dgrad (ub_overlap_ag: the grad_output all-gather
        # overlapped), then wgrad and its bias gradient (this rank's tokens
        # under sequence parallelism: fc2_bias carries `sequence_parallel`).
        wg2 = None
        if need[5] or need[6]:
            wg2 = C.Wgrad(layer._gemm2, fc2_weight, ctx.has_b2 and need[6], ctx.first_mb,
                          bias_from_local=tp2.mode == "row" and tp2.sp, need_w=need[5])
        dact, dw2, db2 = C.row_backward(dy, act_out, w2, tp2, layer.ub2, True, wg2)
        del act_out

        # the activation's backward, fc1's bias gradient fused (column sums)
        res = _engine.act_bwd(dact, fc1_out, layer.activation, dbias=ctx.has_b1 and need[4], **layer._act_kw)
        dfc1, db1 = res if isinstance(res, tuple) else (res, None)
        del dact, fc1_out
        if db1 is not None and layer.delay_wgrad_compute:
            layer._fc1_dbias.append(db1)  # with fc1's weight gradient, in backward_dw()
            db1 = None

        # fc1 (column): dgrad + reduce-scatter, wgrad on the gathered ln_out
        wg1 = C.Wgrad(layer._gemm1, fc1_weight, False, ctx.first_mb) if need[3] else None
        dln, dw1, _ = C.column_backward(dfc1, ln_out, w1, tp1, layer.ub, True, wg1)
        if dln_ret is not None:
            dln_ret = C.as_2d(C.cast(dln_ret, dtype))
            if dln_ret.shape[0] != dln.shape[0]:  # the gathered output's gradient: this rank's rows, summed
                dln_ret = reduce_scatter_rows(dln_ret, tp1.group, tp1.size)
            dln = dln + dln_ret
        # The norm's parameter gradients: this rank's tokens only under
        # sequence parallelism; they carry `sequence_parallel` and the
        # framework sums them, as with TransformerEngine.
        dx, dgamma, dbeta = _engine.norm_bwd(dln, x, mu, rsigma, g, layer.zero_centered_gamma,
                                             with_dbeta=mu is not None)
        return (C.like_input(dx, ctx.inp_shape), dgamma, dbeta, dw1, db1, dw2, db2, None, None, None, None)


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
        if symmetric_ar_type is not None:
            raise NotImplementedError(f"symmetric_ar_type={symmetric_ar_type!r}: symmetric-memory all-reduce "
                                      "is not supported (use None)")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.activation = float(eps), normalization, activation
        self.activation_params = activation_params
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_bias, self.use_bias = bool(return_bias), bool(bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered and return_layernorm_output)
        self.set_parallel_mode, self.checkpoint = bool(set_parallel_mode), bool(checkpoint)
        self.seq_length, self.micro_batch_size, self.symmetric_ar_type = seq_length, micro_batch_size, None
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)

        spm = self.set_parallel_mode
        self.tp = C.TPConfig("column" if spm else None, sequence_parallel, tp_group, tp_size)
        self.tp2 = C.TPConfig("row" if spm else None, sequence_parallel, tp_group, tp_size)
        self.tp_size, self.tp_group = self.tp.size, self.tp.group
        if ffn_hidden_size % self.tp_size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by the tensor-parallel size "
                             f"{self.tp_size}")
        self.size_per_partition = ffn_hidden_size // self.tp_size
        flags = dict(ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
                     ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad)
        self.ub, self.ub2 = self._ub_configs(flags, ub_comm)
        if self.delay_wgrad_compute and self.ub["ub_bulk_wgrad"]:
            raise ValueError("LayerNormMLP: delay_wgrad_compute cannot be combined with ub_bulk_wgrad (the bulk "
                             "reduce-scatter of dgrad runs under the wgrad GEMM), as in TransformerEngine")

        gated = activation in _engine.GATED_ACTIVATIONS
        fc1_out = 2 * self.size_per_partition if gated else self.size_per_partition
        dtype, device = C.default_dtype(params_dtype), C.default_device(device)
        init_gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init_gamma(hidden_size, dtype=dtype, device=device))
        self.layer_norm_weight.sequence_parallel = self.tp.sp
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            self.layer_norm_bias.sequence_parallel = self.tp.sp
        else:
            self.layer_norm_bias = None
        tracker = (get_rng_state_tracker, rng_tracker_name)
        self.fc1_weight = _weight(fc1_out, hidden_size, dtype, device, init_method, tracker, 0)
        self.fc2_weight = _weight(hidden_size, self.size_per_partition, dtype, device, output_layer_init_method,
                                  tracker, 1)
        if bias:
            self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device))
            _set_tp_attributes(self.fc1_bias, True, 0)
            self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            if spm:
                self.fc2_bias.sequence_parallel = self.tp.sp
        else:  # as TE: empty tensors, not parameters
            self.fc1_bias = torch.empty(0, dtype=dtype, device=device)
            self.fc2_bias = torch.empty(0, dtype=dtype, device=device)
        self._gemm1 = _Gemm(self, "fc1_weight")
        self._gemm2 = _Gemm(self, "fc2_weight")
        self._fc1_dbias = []
        if self.delay_wgrad_compute:
            for n in ("fc1_weight", "fc2_weight") + (("fc1_bias", "fc2_bias") if bias else ()):
                getattr(self, n).skip_backward_post_hook = True

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
        return (C.UBConfig(self, {k: flags[k] for k in FC1_FLAGS}, "fc1", parts["fc1"], self.tp),
                C.UBConfig(self, {k: flags[k] for k in FC2_FLAGS}, "fc2", parts["fc2"], self.tp2))

    def forward(self, inp, is_first_microbatch=None):
        """inp: [tokens, hidden] or [seq, batch, hidden] (sequence first; this
        rank's part of the sequence under sequence parallelism). Returns the
        output, then fc2_bias with return_bias, then the normalised input
        with return_layernorm_output (TE's order). is_first_microbatch as
        TE's: main_grad overwritten on the first micro-batch with
        fuse_wgrad_accumulation, a DistributedWeight gathered once per step."""
        plan = self._plan
        if plan is None:
            plan = self._fast_plan()
        if plan:  # the common case, with the least host work (module/_fast.py); None: the general path
            out = _fast.layernorm_mlp(self, plan, inp, self.return_bias)
            if out is not None:
                return out
        dtype, cast = C.compute_dtype(self.fc1_weight)
        fc1_bias = self.fc1_bias if self.use_bias else None
        fc2_bias = self.fc2_bias if self.use_bias and not self.return_bias else None
        out = _LayerNormMLPFn.apply(inp, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight, fc1_bias,
                                    self.fc2_weight, fc2_bias, self, is_first_microbatch, dtype, cast)
        y, ln_out = out if self.return_layernorm_output else (out, None)
        res = (C.like_input(y, inp.shape),)
        if self.return_bias:
            res += (C.cast(self.fc2_bias, dtype),)
        if self.return_layernorm_output:
            res += (ln_out,)
        return res[0] if len(res) == 1 else res

    def backward_dw(self):
        """Compute the weight (and bias) gradients that a delay_wgrad_compute
        backward left, one backward's worth per call (fc2's, then fc1's):
        into main_grad with fuse_wgrad_accumulation, else added to .grad."""
        if not self.delay_wgrad_compute:
            return
        if not (self._gemm1._wgrad_queue or self._gemm2._wgrad_queue or self._fc1_dbias):
            raise RuntimeError("LayerNormMLP.backward_dw(): no delayed weight gradient is pending (run backward "
                               "first)")
        for gemm, bias_name in ((self._gemm2, "fc2_bias"), (self._gemm1, "fc1_bias")):
            db = None
            if gemm._wgrad_queue:
                wg, dy_total, x_total, db_local = gemm._wgrad_queue.pop(0)
                wg.delay = False
                dw, db = wg.compute(dy_total, x_total)
                if wg.bias_from_local:
                    db = db_local
                if dw is not None and not wg.fuse:
                    _add_grad(wg.params[0], dw)
            if bias_name == "fc1_bias" and self._fc1_dbias:
                db = self._fc1_dbias.pop(0)
            if db is not None and self.use_bias:
                _add_grad(getattr(self, bias_name), db)
        for hook in self._wgrad_hooks:
            hook()

    def set_tensor_parallel_group(self, tp_group):
        """TE's setter: the collectives use `tp_group` from now on (same size)."""
        C.check_same_size(self, tp_group)
        self.tp = C.TPConfig(self.tp.mode, self.tp.sp, tp_group, self.tp.size)
        self.tp2 = C.TPConfig(self.tp2.mode, self.tp2.sp, tp_group, self.tp2.size)
        self.tp_group = self.tp.group

    def ub_comms(self):
        """{TE name: CommOverlap} of the communicators this module uses."""
        return {f"{part}_{role}": c for part, ub in (("fc1", self.ub), ("fc2", self.ub2))
                for role, c in ub.comms.items()}

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, "
                f"set_parallel_mode={self.set_parallel_mode}, sequence_parallel={self.tp.sp}, "
                f"tp_size={self.tp_size}")


def _weight(rows, cols, dtype, device, init_method, tracker, partition_dim):
    """A weight parameter initialised as TE does (init_method, default
    normal(0, 0.023), under the RNG tracker's fork when given)."""
    w = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))
    init = init_method or default_init_method
    get_tracker, name = tracker
    if get_tracker is None:
        init(w.data)
    else:
        t = get_tracker()
        with (t.fork(name) if name else t.fork()):
            init(w.data)
    _set_tp_attributes(w, True, partition_dim)
    return w
