"""tec.LayerNormMLP: normalisation, fc1 (column parallel), activation and fc2
(row parallel) as one module with TransformerEngine 2.x's signature,
parameter names and shapes. Norm, GEMMs and activation run in the C engine;
under sequence parallelism the collectives overlap the GEMMs through the
fc1_* / fc2_* userbuffers communicators, in every grad mode."""
import warnings

import torch

from .. import _engine
from .._saved import prepare_for_saving, restore_from_saved
from ..distributed import reduce_scatter_rows
from . import base
from ._weights import weight_for_compute, weight_grad

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACT_PARAM_KEYS = ("limit", "alpha", "glu_linear_offset")
FC1_FLAGS = ("ub_overlap_ag", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
FC2_FLAGS = ("ub_overlap_rs", "ub_overlap_ag")
UB_NAMES = ("fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop", "fc2_dgrad")


def te_default_init(w):
    """TransformerEngine's default weight init: normal, mean 0, std 0.023."""
    torch.nn.init.normal_(w, mean=0.0, std=0.023)


class _Config:
    """What the Function needs of the module (fixed at construction)."""

    __slots__ = ("tp1", "tp2", "ub1", "ub2", "eps", "zcg", "activation", "act_kw", "checkpoint",
                 "return_ln", "return_ln_gathered", "hidden")

    def __deepcopy__(self, memo):  # holds process groups and communicators: shared by copies
        return self


def _norm_fc1(x, ln_weight, ln_bias, w1, b1, cfg, want_gathered):
    """Norm, then fc1 on the (gathered) normalised input. Returns (ln_out:
    this rank's normalised tokens, memory of its own; mu; rsigma; fc1_out
    [tokens of the group, fc1 local out]; the gathered ln_out if asked, also
    memory of its own)."""
    tp, ub = cfg.tp1, cfg.ub1
    if ub.enabled and ub["ub_overlap_ag"] and ub.comms["fprop"].take_overlap("ag", x.shape[0], x.shape[1],
                                                                             w1.shape[0]):
        # The norm writes straight into this rank's slot of the fc1_fprop
        # buffer; ln_out (what is saved and returned) is a copy made on the
        # comm stream while the GEMMs run.
        comm = ub.comms["fprop"]
        slot = comm.get_buffer(local_chunk=True, shape=x.shape, dtype=x.dtype)
        ln_view, mu, rsigma = _engine.norm_fwd(x, ln_weight, ln_bias, cfg.eps, cfg.zcg, out=slot)
        ln_out = torch.empty_like(x)
        fc1_out = comm.ag_gemm(ln_view, w1, bias=b1, local_copy=ln_out)
        ln_total = None
        if want_gathered:
            ln_total = comm.get_buffer(shape=(x.shape[0] * tp.size, x.shape[1]), dtype=x.dtype).clone()
        return ln_out, mu, rsigma, fc1_out, ln_total
    ln_out, mu, rsigma = _engine.norm_fwd(x, ln_weight, ln_bias, cfg.eps, cfg.zcg)
    ln_total = base.gather_input(ln_out, tp)
    fc1_out = base.fprop(ln_total, w1, b1, tp)
    return ln_out, mu, rsigma, fc1_out, (ln_total if want_gathered else None)


class _LayerNormMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, cfg):
        x = base.check_input(inp, cfg.hidden, fc1_weight, cfg.tp1)
        w1, w2 = weight_for_compute(fc1_weight), weight_for_compute(fc2_weight)
        want_gathered = cfg.return_ln and cfg.return_ln_gathered
        ln_out, mu, rsigma, fc1_out, ln_total = _norm_fc1(x, ln_weight, ln_bias, w1, fc1_bias, cfg, want_gathered)
        act_out = _engine.act_fwd(fc1_out, cfg.activation, **cfg.act_kw)
        y = base.ub_fprop(act_out, w2, None, cfg.tp2, cfg.ub2)
        if y is None:  # fc2_bias is given here only without a parallel mode (else added after the reduction)
            y = base.fprop(act_out, w2, fc2_bias, cfg.tp2)
        # Nothing saved aliases a buffer: x is copied if it lies in one (a
        # caller may pass a buffer view), the rest is memory of its own.
        x_saved = base.outside_buffers(base.outside_buffers(x, cfg.ub1), cfg.ub2)
        if cfg.checkpoint:  # fc1's output is recomputed in backward (TE's checkpoint=True)
            tensors = (x_saved, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight)
        else:
            tensors = (x_saved, ln_weight, fc1_weight, fc2_weight, ln_out, mu, rsigma, fc1_out, act_out)
        saved, ctx.objects = prepare_for_saving(*tensors)
        ctx.save_for_backward(*saved)
        ctx.cfg, ctx.inp_shape = cfg, inp.shape
        ctx.has_b1, ctx.has_b2 = fc1_bias is not None, fc2_bias is not None
        if not cfg.return_ln:
            return y
        # Returned views made here cannot be modified in place (autograd's
        # rule for a Function's view outputs), as for LayerNormLinear.
        ln_ret = ln_total if want_gathered else ln_out
        return y, (ln_ret if len(inp.shape) == 2 else ln_ret.view(-1, *inp.shape[1:]))

    @staticmethod
    def backward(ctx, dout, dln_ret=None):
        cfg = ctx.cfg
        t = restore_from_saved(ctx.objects, ctx.saved_tensors)
        ctx.objects = None
        if cfg.checkpoint:
            x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight = t
            w1 = weight_for_compute(fc1_weight)
            ln_out, mu, rsigma, fc1_out, _ = _norm_fc1(x, ln_weight, ln_bias, w1, fc1_bias, cfg, False)
            act_out = _engine.act_fwd(fc1_out, cfg.activation, **cfg.act_kw)
        else:
            x, ln_weight, fc1_weight, fc2_weight, ln_out, mu, rsigma, fc1_out, act_out = t
            w1 = weight_for_compute(fc1_weight)
        w2 = weight_for_compute(fc2_weight)
        need = ctx.needs_input_grad
        dy = base.as_2d(dout)

        # fc2 (row): dgrad, with ub_overlap_ag the grad_output all-gather
        # overlapped; wgrad right after (dy_total may be a buffer view).
        dact, dy_total = base.row_backward(dy, w2, cfg.tp2, cfg.ub2, True)
        dw2 = db2 = None
        if need[5] or need[6]:
            res = base.wgrad(dy_total, act_out, ctx.has_b2)
            dw2, db2 = res if ctx.has_b2 else (res, None)
            dw2 = weight_grad(fc2_weight, dw2)
        del dy_total, act_out

        # activation backward, fc1's bias gradient fused (column sums of dfc1)
        res = _engine.act_bwd(dact, fc1_out, cfg.activation, dbias=ctx.has_b1, **cfg.act_kw)
        dfc1, db1 = res if ctx.has_b1 else (res, None)
        del dact, fc1_out

        # fc1 (column): dgrad + reduce-scatter, wgrad on the gathered ln_out
        need_w1 = need[3]
        dln, res = base.column_backward(dfc1, ln_out, w1, cfg.tp1, cfg.ub1, True, need_w1, False)
        dw1 = None
        if res is not None:
            dw1 = weight_grad(fc1_weight, res[0])
        if dln_ret is not None:
            dln_ret = base.as_2d(dln_ret)
            if cfg.return_ln_gathered and cfg.tp1.mode == "column" and cfg.tp1.sp:
                dln_ret = reduce_scatter_rows(dln_ret, cfg.tp1.group, cfg.tp1.size)
            dln = dln + dln_ret
        # Norm parameters: this rank's tokens only under sequence parallelism;
        # they carry `sequence_parallel` and the framework sums them (as TE).
        dx, dgamma, dbeta = _engine.norm_bwd(dln, x, mu, rsigma, ln_weight, cfg.zcg, with_dbeta=mu is not None)
        return (base.like_input(dx, ctx.inp_shape), dgamma, dbeta, dw1, (db1 if need[4] else None), dw2,
                db2, None)


class LayerNormMLP(torch.nn.Module):
    """Normalisation -> fc1 -> activation -> fc2, TransformerEngine's
    LayerNormMLP (same positional order, defaults, parameter names/shapes).

    Parameters: layer_norm_weight / layer_norm_bias [hidden_size] (no bias
    for RMSNorm); fc1_weight [fc1_out, hidden_size] and fc1_bias [fc1_out]
    with fc1_out = ffn_hidden_size / tp_size, doubled for a gated activation
    (each rank's rows are [activation half | gate half], TE's layout);
    fc2_weight [hidden_size, ffn_hidden_size / tp_size], fc2_bias
    [hidden_size]. With set_parallel_mode, fc1 is column- and fc2
    row-parallel; fc2's bias is added after the reduction. Under sequence
    parallelism the norm parameters and fc2_bias carry
    `sequence_parallel = True`: their gradients hold this rank's tokens only
    and the training framework sums them over the group (as with TE).

    Userbuffers (under sequence parallelism, as TE): ub_overlap_ag overlaps
    fc1's input all-gather (fc1_fprop) and fc2's grad_output all-gather with
    its dgrad (fc2_dgrad); ub_overlap_rs fc2's output reduce-scatter
    (fc2_fprop); ub_overlap_rs_dgrad fc1's dgrad reduce-scatter (fc1_dgrad),
    else ub_bulk_dgrad / ub_bulk_wgrad the bulk ones (fc1_dgrad, fc1_wgrad).
    Communicators come from the registry (initialize_ub) under those names,
    or from ub_comm: {name: CommOverlap} with those names, or one
    CommOverlap for every role. checkpoint=True saves only the inputs and
    recomputes the norm, fc1 and the activation in backward.
    """

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, sequence_parallel=False, return_bias=False,
                 get_rng_state_tracker=None, tp_group=None, tp_size=1, init_method=None, bias=True,
                 normalization="LayerNorm", activation="gelu", activation_params=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation=False, params_dtype=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, seq_length=None,
                 micro_batch_size=None, set_parallel_mode=False, zero_centered_gamma=False, device=None,
                 ub_overlap_ag=False, name=None, ub_overlap_rs=False, ub_overlap_rs_dgrad=False,
                 ub_bulk_dgrad=False, ub_bulk_wgrad=False, delay_wgrad_compute=False, symmetric_ar_type=None,
                 checkpoint=False, *, ub_comm=None):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        _engine.activation_code(activation)
        act_kw = {}
        if activation_params is not None:
            if not isinstance(activation_params, dict) or set(activation_params) - set(ACT_PARAM_KEYS):
                raise ValueError(f"activation_params must be a dict with keys among {ACT_PARAM_KEYS}, got "
                                 f"{activation_params!r}")
            if activation == "clamped_swiglu":
                act_kw = {k: float(v) for k, v in activation_params.items()}
        for what, n in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        if fuse_wgrad_accumulation or delay_wgrad_compute:
            raise NotImplementedError("LayerNormMLP: fuse_wgrad_accumulation and delay_wgrad_compute are not "
                                      "supported yet")
        if symmetric_ar_type is not None:
            warnings.warn("LayerNormMLP: symmetric_ar_type is not supported; the standard all-reduce is used "
                          "(same result)", UserWarning, stacklevel=2)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.activation = float(eps), normalization, activation
        self.activation_params = activation_params
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.return_bias, self.use_bias = bool(return_bias), bool(bias)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.return_layernorm_output_gathered = bool(return_layernorm_output_gathered)
        self.set_parallel_mode, self.checkpoint, self.name = bool(set_parallel_mode), bool(checkpoint), name
        self.fuse_wgrad_accumulation, self.delay_wgrad_compute = fuse_wgrad_accumulation, delay_wgrad_compute
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size

        spm = self.set_parallel_mode
        tp1 = base.TPConfig("column" if spm else None, sequence_parallel and spm, tp_group, tp_size)
        tp2 = base.TPConfig("row" if spm else None, sequence_parallel and spm, tp_group, tp_size)
        self.tp_group, self.tp_size = tp1.group, tp1.size
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1
        if ffn_hidden_size % self.tp_size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by the tensor-parallel size "
                             f"{self.tp_size}")
        self.size_per_partition = ffn_hidden_size // self.tp_size
        gated = activation in _engine.GATED_ACTIVATIONS
        fc1_out = 2 * self.size_per_partition if gated else self.size_per_partition

        cfg = _Config()
        cfg.tp1, cfg.tp2, cfg.hidden = tp1, tp2, hidden_size
        cfg.ub1, cfg.ub2 = self._ub_configs(tp1, tp2, ub_comm, dict(
            ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs, ub_overlap_rs_dgrad=ub_overlap_rs_dgrad,
            ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad))
        cfg.eps, cfg.zcg, cfg.activation, cfg.act_kw = self.eps, self.zero_centered_gamma, activation, act_kw
        cfg.checkpoint = self.checkpoint
        cfg.return_ln, cfg.return_ln_gathered = self.return_layernorm_output, self.return_layernorm_output_gathered
        self._cfg = cfg

        dtype, device = base.default_dtype(params_dtype), base.default_device(device)
        init_gamma = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init_gamma(hidden_size, dtype=dtype, device=device))
        self.layer_norm_bias = (torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
                                if normalization == "LayerNorm" else None)
        self.fc1_weight = self._weight(fc1_out, hidden_size, dtype, device, init_method, get_rng_state_tracker)
        self.fc1_bias = torch.nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device)) if bias else None
        self.fc2_weight = self._weight(hidden_size, self.size_per_partition, dtype, device,
                                       output_layer_init_method, get_rng_state_tracker)
        self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        # TE's / Megatron's parameter attributes
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel
        for p, dim in ((self.fc1_weight, 0), (self.fc1_bias, 0), (self.fc2_weight, 1)):
            if p is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
        if self.fc2_bias is not None and spm:
            self.fc2_bias.sequence_parallel = self.sequence_parallel

    @staticmethod
    def _weight(rows, cols, dtype, device, init_method, rng_tracker):
        init = init_method or te_default_init
        if rng_tracker is None:
            return base.make_weight(rows, cols, dtype, device, init)
        with rng_tracker().fork():
            return base.make_weight(rows, cols, dtype, device, init)

    def _ub_configs(self, tp1, tp2, ub_comm, flags):
        """(fc1's UBConfig, fc2's): TE's flag semantics (on only under
        sequence parallelism with set_parallel_mode, or on one rank with
        ub_comm given; ub_overlap_rs_dgrad replaces the bulk overlaps)."""
        asked = [k for k, v in flags.items() if v]
        live = self.set_parallel_mode and (tp1.sp or (tp1.size == 1 and ub_comm is not None))
        if asked and not live:
            warnings.warn(f"LayerNormMLP: {', '.join(asked)} ignored without set_parallel_mode and sequence "
                          "parallelism, as TransformerEngine ignores them", UserWarning, stacklevel=3)
        on = {k: bool(v) and live for k, v in flags.items()}
        if on["ub_overlap_rs_dgrad"]:
            on["ub_bulk_dgrad"] = on["ub_bulk_wgrad"] = False
        comms = {"fc1": None, "fc2": None}
        if isinstance(ub_comm, dict):
            bad = sorted(set(ub_comm) - set(UB_NAMES))
            if bad:
                raise ValueError(f"LayerNormMLP: ub_comm has unknown names {bad}; expected some of {UB_NAMES}")
            for part in comms:
                comms[part] = {k.split("_", 1)[1]: c for k, c in ub_comm.items() if k.startswith(part + "_")}
        elif ub_comm is not None:
            comms = {"fc1": ub_comm, "fc2": ub_comm}
        out = []
        for part, names, tp in (("fc1", FC1_FLAGS, tp1), ("fc2", FC2_FLAGS, tp2)):
            f = {k: on[k] for k in names}
            any_on = any(f.values())
            out.append(base.UBConfig(self, f, part if any_on and comms[part] is None else None,
                                     comms[part] if any_on else None, tp))
        return out

    def forward(self, inp, is_first_microbatch=None):
        """inp: [tokens, hidden] or [seq, batch, hidden] (sequence first; this
        rank's part of the sequence under sequence parallelism). Returns the
        output, then fc2_bias with return_bias, then the normalised input
        with return_layernorm_output (TE's order)."""
        spm = self.set_parallel_mode
        fc2_bias_in = self.fc2_bias if (self.use_bias and not self.return_bias and not spm) else None
        out = _LayerNormMLPFn.apply(inp, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                                    self.fc1_bias, self.fc2_weight, fc2_bias_in, self._cfg)
        y, ln_out = out if self.return_layernorm_output else (out, None)
        y = base.like_input(y, inp.shape)
        if spm and self.use_bias and not self.return_bias:
            y = y + self.fc2_bias
        res = (y,)
        if self.return_bias:
            res += (self.fc2_bias,)
        if self.return_layernorm_output:
            res += (ln_out,)
        return res[0] if len(res) == 1 else res

    def ub_comms(self):
        """{TE name: CommOverlap} of the communicators this module uses."""
        return {f"{part}_{role}": c for part, ub in (("fc1", self._cfg.ub1), ("fc2", self._cfg.ub2))
                for role, c in ub.comms.items()}

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"normalization={self.normalization}, activation={self.activation}, "
                f"set_parallel_mode={self.set_parallel_mode}, sequence_parallel={self.sequence_parallel}, "
                f"tp_size={self.tp_size}")
