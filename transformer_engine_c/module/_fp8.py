"""FP8 in the layers' GEMMs, per-tensor scaling (DelayedScaling and
Float8CurrentScaling) and block scaling (Float8BlockScaling), with
TransformerEngine 2.x's semantics.

Inside an enabled autocast a layer call gets an FP8Call (call.fp8, made by
module/_plan.make_call), and the steps (module/_steps.py) run each GEMM in
FP8 through it (module/_fp8_gemm.py); everything else (norms, activations,
collectives, bias gradients) stays in the compute dtype. What enters a GEMM
is quantized right before it, after any sequence-parallel gather, so a
gathered tensor has one scale and one amax (current scaling's all-reduced
amax, delayed scaling's maximum over the group's rows):

* fprop   Y = X W^T: X and W in E4M3 (the forward format), fast accumulation
          unless the recipe asks for split accumulation;
* dgrad   dX = dY W: dY in E5M2 (HYBRID's backward format), W's transpose;
* wgrad   dW = dY^T X: the transposes of dY and of the forward's X, split
          accumulation, into the weight's fp32 main_grad when fused.

The X of wgrad is the forward's FP8 value. Where the forward's GEMM read this
rank's own rows, the quantize that fed it also wrote the transpose (one pass),
kept for backward. Where it read gathered rows (column parallel under sequence
parallelism), the layer keeps its local rows as it does without FP8,
re-gathers them in backward and quantizes them with the scale the forward
used, which gives the same FP8 values.

Tensor roles follow TE's fp8_meta: GEMM i's input is forward role 3i, its
weight 3i + 1, its output gradient backward role 2i. Under DelayedScaling
each quantize uses the role's current scale and maxes the tensor's amax into
the history's row 0; the autocast's exit reduces and updates the forward
roles, the end of the first module's backward the backward roles
(quantization.py). Under Float8CurrentScaling each quantize takes the
tensor's own amax. Under Float8BlockScaling each block takes its own (the
recipe's block dims: 1x128 for X and dY, 128x128 for W by default): fprop
reads X's and W's rowwise blocks, dgrad dY's rowwise and W's columnwise
copy (for 128x128 the transpose of its bytes), wgrad the columnwise copies
of dY and X (128x1 blocks of the originals, quantized from the
high-precision values); a re-cast of a forward value (a re-gathered X, a
recompute) gives the same bytes, since nothing but the values decides them.

A Float8Tensor weight (FP8 primary weights, quantized_model_init) enters
the GEMMs as it is: its bytes and scale_inv, its transpose made once per
change of the weight (FP8Call._primary_weight); what follows is about the
other weights.

Weights are quantized (with their transpose, when backward will run) on
every call, or, when the caller passes is_first_microbatch, on the first
micro-batch and reused from the layer's cache until the next first one (TE's
weight caching: a weight changed between micro-batches of a step is not
re-read). Under CUDA graph capture with fp8_weight_caching (graph.py) the
weight is cast into the layer's graph buffer on every call, through the
engine's noop flag, which the replays set for the later micro-batches
(FP8Call.graph_weight).

Userbuffers overlap runs in FP8 under the per-tensor recipes (the FP8
communicators of initialize_ub's quantization mode FP8 where they exist, else
the layer's): a column layer casts its local rows into its slot of the
buffer with the scale the group shares and gathers FP8 bytes while the FP8
chunk GEMMs run (gather_input; backward gathers the kept bytes again for
wgrad, gathered_input); a row layer's dgrad gathers dY's FP8 bytes the same
way (gather_grad_output); the reduce-scatters' partials (a row layer's
fprop, a column layer's dgrad) are FP8 GEMMs' outputs in the compute dtype,
except a row layer's fprop partials through a communicator with fp8_buf
under DelayedScaling: those travel in E4M3 with the output role's scale
(output_partials).
Under Float8BlockScaling a layer whose flags ask for the overlap runs the
plain collectives, with one warning.
"""
import collections
import warnings

import torch

from .. import _C
from .. import _fp8_engine as E
from .._engine import DTYPE_CODES
from .._fp8_meta import fit_history, fp8_dtype_of, initial_fp8_meta, make_fp8_meta, module_device
from ..quantization import RECOMPUTE_STASH, FP8GlobalStateManager as _State
from ..recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from ..tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8Tensor
from ..te_distributed import in_fp8_activation_recompute_phase, is_fp8_activation_recompute_enabled

_U8, _F32 = torch.uint8, torch.float32
_CODES, _MAX = E.FP8_DTYPES, E.FP8_MAX


class Operand:
    """One tensor's FP8 form for the GEMMs: data (uint8, the tensor's shape)
    and/or data_t (its [last dim, rows] transpose), the scale it was cast
    with and scale_inv (float32, one element), the format, and src (the
    tensor it was cast from, for the backward's memo), and dbias (src's
    column sums from the same pass, or None). Under block scaling (block 1:
    1x128, 2: 128x128; 0 is per-tensor) scale is None, scale_inv holds
    data's block scales and scale_inv_t data_t's (_fp8_engine's
    block_scale_shape)."""

    __slots__ = ("data", "data_t", "scale", "scale_inv", "dtype", "src", "dbias", "scale_inv_t", "block")

    def __init__(self, data, data_t, scale, scale_inv, dtype, src=None, dbias=None, scale_inv_t=None, block=0):
        self.data, self.data_t, self.scale, self.scale_inv, self.dtype, self.src, self.dbias = (
            data, data_t, scale, scale_inv, dtype, src, dbias)
        self.scale_inv_t = scale_inv if scale_inv_t is None else scale_inv_t
        self.block = block

    def transpose_only(self, scale=None):
        """The same operand without its rowwise data (what wgrad keeps)."""
        return Operand(None, self.data_t, self.scale if scale is None else scale, self.scale_inv, self.dtype,
                       scale_inv_t=self.scale_inv_t, block=self.block)


def check_shape(t, name):
    """TE's rule for a tensor entering an FP8 GEMM, named after the argument."""
    E.check_fp8_gemm_shape(t.shape, name)


def _meta_for(layer, recipe, device):
    """The layer's fp8_meta (TE's layout), made or remade for `recipe`: a
    DelayedScaling's with its scaling tensors, other recipes' the recipe
    only. A meta of another recipe kind or history length is replaced; the
    recipe and group are refreshed on every call, as TE does."""
    meta = getattr(layer, "fp8_meta", None)
    if isinstance(recipe, DelayedScaling):
        fwd = meta.get("scaling_fwd") if meta else None
        if fwd is None or fwd.scale.device != device:
            # normal tensors even when the first call runs under inference_mode: the autocast's exit
            # updates them in place outside it
            with torch.inference_mode(False):
                meta = make_fp8_meta(recipe, type(layer)._fp8_num_gemms, device)
            layer.fp8_meta = meta
        elif fwd.amax_history.shape[0] != recipe.amax_history_len:
            _adjust_history(meta, recipe.amax_history_len)
    elif meta is None or "scaling_fwd" in meta:
        meta = layer.fp8_meta = initial_fp8_meta()
    meta["recipe"] = recipe
    meta["fp8_group"] = _State.get_fp8_group()
    meta["fp8_checkpoint"] = True  # TE's flag: the layer ran in FP8, its state is saved
    return meta


def _adjust_history(meta, length):
    """TE's rule for a recipe whose history length differs from the meta's
    (a loaded checkpoint, a changed recipe): the newest `length` rows are
    kept (row 0 first), or zero rows appended; the scales stay. The meta is
    registered again (its history is a new tensor)."""
    for key in ("scaling_fwd", "scaling_bwd"):
        m = meta[key]
        meta[key] = type(m).of(m.scale, m.scale_inv, fit_history(m.amax_history, length).clone())
    meta.pop(_State.get_buffer_info(), None)


_warned = set()
# checkpointed forwards whose recomputation has not run yet, per layer (the oldest dropped beyond this;
# FP8GlobalStateManager's stash of their tensors has the same bound)
_RECOMPUTE_STASH = RECOMPUTE_STASH


def _warn_no_overlap(layer, recipe):
    """Block scaling runs the plain collectives (one warning per layer)."""
    if not isinstance(recipe, Float8BlockScaling):
        return
    uses = getattr(layer, "ub", None) is not None and layer.ub.enabled
    uses = uses or (getattr(layer, "ub2", None) is not None and layer.ub2.enabled)
    if uses and id(layer) not in _warned:
        _warned.add(id(layer))
        warnings.warn(f"{type(layer).__name__}: userbuffers overlap is not used with Float8BlockScaling (its "
                      "block scales are not gathered through a communicator); this layer's FP8 calls run the "
                      "plain collectives", UserWarning, stacklevel=5)


def layer_call(call, layer, x, grad, first_mb):
    """The FP8Call of one layer call (module/_plan.Call: the engine device
    code, stream and workspace the casts and GEMMs use) inside an enabled
    autocast (x: the layer input, checked against TE's FP8 shape rule;
    grad: backward will run)."""
    recipe = _State.get_fp8_recipe()
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)):
        raise NotImplementedError(f"{type(layer).__name__}: {type(recipe).__name__} is not supported in the "
                                  "layers (DelayedScaling, Float8CurrentScaling and Float8BlockScaling are)")
    if isinstance(x, torch.Tensor) and x.dim() in (2, 3):
        check_shape(x, "inp")
    for name, p in layer._parameters.items():  # both dims of a weight are a GEMM's k or n
        if p is not None and p.dim() == 2 and (p.shape[0] % 16 or p.shape[1] % 16):
            raise ValueError(f"{type(layer).__name__}: FP8 execution requires both dims of {name} (this rank's "
                             f"shard) to be divisible by 16, got {tuple(p.shape)}")
    tp = layer.tp
    if isinstance(recipe, DelayedScaling) and tp.sp and not recipe.reduce_amax:
        raise ValueError(f"{type(layer).__name__}: sequence parallelism in FP8 with DelayedScaling needs "
                         "reduce_amax=True (the gathered tensors share one scale over the group)")
    _warn_no_overlap(layer, recipe)
    return FP8Call(call, layer, recipe, grad, first_mb)


class FP8Call:
    """One layer call's FP8 state (see the module docstring): the recipe's
    formats and accumulation modes, the forward's operands that backward
    reads, and the backward's quantized output gradients. `gi` is the GEMM
    the steps are running (0 or 1, LayerNormMLP's fc2 being 1)."""

    __slots__ = ("call", "layer", "recipe", "delayed", "meta", "fwd", "bwd", "split", "qparams", "grad", "first_mb",
                 "reduce_bwd", "gi", "inputs", "weights", "grads", "need_wgrad", "want_dbias", "recomputing",
                 "keep_t", "blocks", "produced")

    def __init__(self, call, layer, recipe, grad, first_mb):
        self.call = call
        self.layer, self.recipe, self.grad, self.first_mb = layer, recipe, grad, first_mb
        device = module_device(layer)
        self.meta = _meta_for(layer, recipe, device)
        self.delayed = isinstance(recipe, DelayedScaling)
        self.fwd = fp8_dtype_of(recipe.fp8_format, True)
        self.bwd = fp8_dtype_of(recipe.fp8_format, False)
        if self.delayed:
            # TE's fixed accumulation modes for per-tensor delayed scaling
            self.split = (False, True, True)
            self.qparams = None
        else:
            self.split = (recipe.fp8_gemm_fprop.use_split_accumulator, recipe.fp8_gemm_dgrad.use_split_accumulator,
                          recipe.fp8_gemm_wgrad.use_split_accumulator)
            self.qparams = (recipe.fp8_quant_fwd_inp, recipe.fp8_quant_fwd_weight, recipe.fp8_quant_bwd_grad)
        # block scaling: the block dims of the inputs, weights and output gradients
        self.blocks = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim) \
            if isinstance(recipe, Float8BlockScaling) else None
        # the first FP8 module of the outermost autocast reduces the backward amaxes
        self.reduce_bwd = self._checkpointed(layer, grad)
        if self.delayed and "recompute" not in self.meta:  # a recompute's stashed copy is not registered
            _State.add_fp8_tensors_to_global_buffer(self.meta)
        self.gi = 0
        self.inputs, self.weights, self.grads = {}, {}, {}
        self.need_wgrad, self.want_dbias = True, False
        # LayerNormMLP(checkpoint=True) keeps no activations: its forward keeps
        # only the scales, and backward's recompute uses them (recomputing)
        self.recomputing = False
        self.keep_t = not call.plan.checkpoint
        self.produced = {}  # a stand-in's address -> (it, x, activation, its input): produce()

    def _checkpointed(self, layer, grad):
        """Whether this call owns the backward amax reduction (the first FP8
        module of the outermost autocast, when backward runs), with TE's
        activation-recompute rules (tec.checkpoint): a checkpointed forward
        stashes the delayed-scaling scales and history it used
        (FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute)
        and whether it was the first module; its recomputation in backward
        takes them back (get_old_fp8_meta_tensors_for_recompute, then
        restore_fp8_meta_tensors after copying them), so it casts with the
        forward's scales (its amaxes go to the copy and are dropped) and the
        first module's recomputation (the one whose backward runs, under
        use_reentrant=True) owns the reduction."""
        if in_fp8_activation_recompute_phase():
            stash = layer.__dict__.get("_fp8_recompute")
            if not stash:
                return False
            first = stash.popleft()
            live = self.meta
            _State.get_old_fp8_meta_tensors_for_recompute(live)  # live holds the forward's tensors now
            if self.delayed:
                m = live["scaling_fwd"]
                fwd = type(m).of(m.scale.clone(), m.scale_inv.clone(), m.amax_history.clone())
                _State.restore_fp8_meta_tensors(live)
                self.meta = dict(live, scaling_fwd=fwd, recompute=True)
            return first and grad
        if not is_fp8_activation_recompute_enabled():
            return _State.is_first_fp8_module() if grad else False
        first = _State.is_first_fp8_module()
        _State.copy_forward_fp8_meta_tensors_for_recompute(self.meta)
        layer.__dict__.setdefault("_fp8_recompute", collections.deque(maxlen=_RECOMPUTE_STASH)).append(first)
        return first and grad

    # ----------------------------------------------------------- quantizing

    def _quantize(self, t, fp8_dtype, role, forward, qp, rowwise, columnwise, scale=None, dbias=False,
                  group=None, into=None, noop=None):
        """t's FP8 Operand: with `scale` given (a re-cast of a forward value),
        that scale and no amax; under delayed scaling the role's scale and
        amax-history entry; under current scaling t's own amax, or with
        `group` (a tensor about to be all-gathered in FP8) the maximum over
        the group's ranks, so that they share the scale. dbias: the same pass
        also sums t's columns (the Operand's dbias; not under block scaling,
        whose callers sum dY themselves). into: an Operand whose data,
        data_t and scale_inv receive the cast (a graph's persistent buffer, a
        communicator's slot: slot_operand); noop: the engine's device flag
        that switches the cast off (tec.h)."""
        if self.blocks is not None:  # each block's own amax: a re-cast gives the same bytes
            return self._quantize_blocks(t, fp8_dtype, 2 if not forward else role % 3, rowwise, columnwise)
        c = self.call
        amax = 0
        code = DTYPE_CODES[t.dtype]
        x, act = t, (0, 0, 0)  # the tensor read, and the activation fused ahead of the cast (produce())
        made = self.produced.get(t.data_ptr()) if self.produced else None
        if made is not None and made[0].numel() == t.numel():
            x = made[1]
            act = (1, made[2], 0) if made[3] is None else (2, made[2], made[3].data_ptr())
        if scale is None:
            if self.delayed:
                m = self.meta["scaling_fwd" if forward else "scaling_bwd"]
                scale = m.scale[role:role + 1]
                amax = m.amax_history.data_ptr() + 4 * role  # row 0's entry
            else:  # the tensor's amax, then its scale (tec.h's current-scaling rule), on the device
                buf = torch.empty(2, dtype=_F32, device=t.device)
                p = buf.data_ptr()
                if act[0]:  # the activation's values' amax: the fused cast writing nothing else
                    buf.zero_()
                    _C.fp8_quantize(c.dev, code, 0, 1, t.numel(), x.data_ptr(), p, 0, 0, p, 0, 0, 0, 0, 0, *act,
                                    c.stream)
                else:
                    _C.fp8_amax(c.dev, code, t.numel(), t.data_ptr(), p, c.stream)
                if group is not None and self.layer.tp.size > 1:
                    torch.distributed.all_reduce(buf[:1], op=torch.distributed.ReduceOp.MAX, group=group)
                _C.fp8_scale_from_amax(c.dev, 1, p, p + 4, 0, _MAX[fp8_dtype], int(qp.power_2_scale),
                                       float(qp.amax_epsilon), c.stream)
                scale = buf[1:2]
        # t is contiguous (the steps' tensors are), viewed as [rows, last dim]
        cols = t.shape[-1]
        rows = t.numel() // cols if cols else 0
        if into is not None:
            data, data_t, scale_inv = into.data, into.data_t, into.scale_inv
        else:
            data = torch.empty(t.shape, dtype=_U8, device=t.device) if rowwise else None
            data_t = torch.empty((cols, rows), dtype=_U8, device=t.device) if columnwise else None
            scale_inv = torch.empty(1, dtype=_F32, device=t.device)
        db = ws = None
        nbytes = 0
        if dbias:
            db = t.new_empty(cols)
            nbytes = _C.fp8_quantize_workspace_bytes(rows, cols)
            ws = torch.empty(nbytes, dtype=_U8, device=t.device)  # held until the call returns
        _C.fp8_quantize(c.dev, code, _CODES[fp8_dtype], rows, cols, x.data_ptr(), scale.data_ptr(),
                        0 if data is None else data.data_ptr(), 0 if data_t is None else data_t.data_ptr(), amax,
                        scale_inv.data_ptr(), 0 if db is None else db.data_ptr(), 0 if ws is None else ws.data_ptr(),
                        nbytes, 0 if noop is None else noop.data_ptr(), *act, c.stream)
        return Operand(data, data_t, scale, scale_inv, fp8_dtype, t, db)

    def _quantize_blocks(self, t, fp8_dtype, kind, rowwise, columnwise):
        """t's block-scaled Operand: kind 0 an input, 1 a weight, 2 an output
        gradient (the recipe's block dim and QParams of that role)."""
        c, dim, qp = self.call, self.blocks[kind], self.qparams[kind]
        cols = t.shape[-1]
        rows = t.numel() // cols if cols else 0

        def alloc(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=t.device)
        data = alloc(t.shape, _U8) if rowwise else None
        sinv = alloc(E.block_scale_shape(t.shape, dim), _F32) if rowwise else None
        data_t = alloc((cols, rows), _U8) if columnwise else None
        sinv_t = alloc(E.block_scale_shape(t.shape, dim, True), _F32) if columnwise else None
        if t.numel() == 0:  # no tokens: nothing to cast (the empty outputs have no address for the engine)
            return Operand(data, data_t, None, sinv, fp8_dtype, t, scale_inv_t=sinv_t, block=dim)
        _C.fp8_block_quantize(c.dev, DTYPE_CODES[t.dtype], _CODES[fp8_dtype], dim, rows, cols, t.data_ptr(),
                              0 if data is None else data.data_ptr(), 0 if sinv is None else sinv.data_ptr(),
                              0 if data_t is None else data_t.data_ptr(), 0 if sinv_t is None else sinv_t.data_ptr(),
                              int(qp.power_2_scale), float(qp.amax_epsilon), c.stream)
        return Operand(data, data_t, None, sinv, fp8_dtype, t, scale_inv_t=sinv_t, block=dim)

    def input(self, x, keep_t):
        """The fprop input of GEMM gi: rowwise, and with keep_t its transpose
        for wgrad (this rank's rows; else the scale is kept for a re-cast)."""
        gi = self.gi
        if self.recomputing:  # the forward's scale, no amax: the forward's FP8 values
            q = self._quantize(x, self.fwd, 0, True, None, True, keep_t, scale=self.inputs[gi].scale)
            self.inputs[gi] = q.transpose_only()
            return q
        q = self._quantize(x, self.fwd, 3 * gi, True, self.qparams and self.qparams[0], True,
                           self.grad and keep_t and self.keep_t)
        if self.grad:
            scale = q.scale if q.data_t is not None or not self.delayed else q.scale.clone()  # delayed: updated in place
            self.inputs[gi] = q.transpose_only(scale)
        return q

    def gather_input(self, x, out, group):
        """GEMM gi's fprop input for an all-gather in FP8 (a column layer's
        userbuffers overlap): this rank's rows x cast rowwise into out (its
        slot of the communicator's buffer) with a scale every rank of group
        uses (the gathered bytes carry one scale_inv). Backward keeps the
        scale, and keep_input's copy of the bytes, which it gathers again."""
        gi = self.gi
        if self.recomputing:
            return self._quantize(x, self.fwd, 0, True, None, True, False, scale=self.inputs[gi].scale,
                                  into=slot_operand(out, self.fwd))
        q = self._quantize(x, self.fwd, 3 * gi, True, self.qparams and self.qparams[0], True, False,
                           into=slot_operand(out, self.fwd), group=group)
        if self.grad:
            self.inputs[gi] = Operand(None, None, q.scale.clone() if self.delayed else q.scale, q.scale_inv, q.dtype)
        return q

    def keep_input(self, data):
        """The local FP8 bytes of GEMM gi's gathered input (a copy outside
        the buffer), for backward's FP8 re-gather."""
        q = self.inputs.get(self.gi)
        if q is not None:
            q.data = data

    def gathered_input(self, gathered):
        """GEMM gi's wgrad input from the re-gathered FP8 bytes [rows, k] of
        its forward input: their transpose, with the forward's scale."""
        q = self.inputs[self.gi]
        self.inputs[self.gi] = Operand(None, gathered.t().contiguous(), q.scale, q.scale_inv, q.dtype)

    def gather_grad_output(self, dy, out, group):
        """GEMM gi's output gradient for an all-gather in FP8 (a row layer's
        dgrad overlap): this rank's rows dy cast rowwise into out (its slot)
        with a scale the ranks of group share."""
        return self._quantize(dy, self.bwd, 2 * self.gi, False, self.qparams and self.qparams[2], True, False,
                              into=slot_operand(out, self.bwd), group=group)

    def gathered_grad_output(self, q, gathered, like):
        """GEMM gi's cached output gradient from the gathered FP8 bytes of
        q's tensor: their transpose for wgrad; `like` (a stand-in of the
        gathered dY's shape) is what the steps pass as dY."""
        self.grads[self.gi] = Operand(None, gathered.t().contiguous(), q.scale, q.scale_inv, q.dtype, src=like)

    def weight(self, w):
        """GEMM gi's weight in FP8 (with its transpose when backward runs):
        cast now, or the layer's cached cast on a later micro-batch; under
        CUDA graph capture with weight caching, the cast into the layer's
        graph buffer that the skip flag switches off (graph_weight)."""
        gi, layer = self.gi, self.layer
        if self.recomputing:
            return self.weights[gi]
        skip = _State.get_skip_fp8_weight_update_tensor() if _State.fp8_graph_capturing() else None
        q = None
        if isinstance(w, (Float8Tensor, Float8BlockwiseQTensor)):  # an FP8 primary weight: its own bytes, no cast
            q = self._primary_weight(w)
        elif skip is not None:  # under capture with weight caching: the graph buffer's cast
            q = self.graph_weight(w, skip)
        if q is not None:
            if self.grad:
                self.weights[gi] = q
            return q
        cache = layer.__dict__.setdefault("_fp8_weights", {})
        kept = cache.get(gi)
        if (self.first_mb is False and kept is not None and kept.dtype is self.fwd
                and kept.block == (self.blocks[1] if self.blocks else 0)
                and kept.data.shape == w.shape and kept.data.device == w.device
                and (kept.data_t is not None or not self.grad)):
            q = kept
        else:
            q = self._quantize(w, self.fwd, 3 * gi + 1, True, self.qparams and self.qparams[1], True, self.grad)
            q.src = None
            if self.first_mb is not None:
                cache[gi] = q
        if self.grad:
            self.weights[gi] = q
        return q

    def graph_weight(self, w, skip):
        """TE's weight caching under CUDA graphs: GEMM gi's weight is cast
        into a buffer the layer keeps for its graphs (`_fp8_graph_weights`:
        data, its transpose and scale_inv, made once per weight shape, dtype
        and device, so that every capture and replay uses the same memory),
        and the cast reads `skip` (the device flag of
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor) when it runs:
        a replay for a first micro-batch (flag 0) casts the weight and records
        its amax, a later one (flag 1) writes nothing and the GEMMs read the
        cast of the first, as eager is_first_microbatch=False does."""
        if self.blocks is not None:
            raise NotImplementedError(f"{type(self.layer).__name__}: fp8_weight_caching under CUDA graphs is not "
                                      "supported with Float8BlockScaling (its block cast has no noop flag)")
        if skip.device != w.device:
            raise ValueError(f"{type(self.layer).__name__}: the weight-caching flag is on {skip.device}, the "
                             f"weight on {w.device}")
        gi = self.gi
        buffers = self.layer.__dict__.setdefault("_fp8_graph_weights", {})
        buf = buffers.get(gi)
        if buf is None or buf.dtype is not self.fwd or buf.data.shape != w.shape or buf.data.device != w.device:
            # the transpose is always kept: a graph with and one without backward share the buffer
            buf = Operand(torch.empty(w.shape, dtype=_U8, device=w.device),
                          torch.empty((w.shape[-1], w.numel() // w.shape[-1]), dtype=_U8, device=w.device),
                          None, torch.ones(1, dtype=_F32, device=w.device), self.fwd)
            buffers[gi] = buf
        q = self._quantize(w, self.fwd, 3 * gi + 1, True, self.qparams and self.qparams[1], True, True, into=buf,
                           noop=skip)
        q.src = None
        return q

    def _primary_weight(self, w):
        """The Operand of an FP8 primary weight (a Float8Tensor, or a
        Float8BlockwiseQTensor of 128x128 blocks): its bytes and scales as
        they are, and, when backward runs, its transpose, made from the
        bytes once after each change of the weight and kept with it
        (Float8Tensor.get_transpose, Float8BlockwiseQTensor.update_usage; an
        in-place update drops it). A weight of another scaling than the
        recipe's, or of another format than its forward one, is refused."""
        name = type(self.layer).__name__
        block = isinstance(w, Float8BlockwiseQTensor)
        if block != (self.blocks is not None) or (block and self.blocks[1] != 2):
            made = "Float8BlockScaling" if block else "a per-tensor recipe"
            raise ValueError(f"{name}: a {type(w).__name__} weight (built under quantized_model_init with {made}) "
                             f"cannot enter a {type(self.recipe).__name__} GEMM"
                             f"{' of w_block_scaling_dim=1' if block and self.blocks else ''}; build the model "
                             "under the recipe it trains with")
        if w._fp8_dtype != self.fwd:
            raise ValueError(f"{name}: the FP8 weight is {w._fp8_dtype}, the recipe's forward format is {self.fwd}")
        if block:
            if w._rowwise_data is None:
                raise ValueError(f"{name}: the Float8BlockwiseQTensor weight holds no rowwise data")
            if self.grad:
                w.update_usage(columnwise_usage=True)
            return Operand(w._rowwise_data, w._columnwise_data if self.grad else None, None, w._rowwise_scale_inv,
                           w._fp8_dtype, scale_inv_t=w._columnwise_scale_inv if self.grad else None, block=2)
        if w._data is None:
            raise ValueError(f"{name}: the Float8Tensor weight holds no rowwise data")
        data_t = w.get_transpose() if self.grad else None
        return Operand(w._data, data_t, None, w._scale_inv, w._fp8_dtype)

    def grad_output(self, dy):
        """GEMM gi's output gradient in FP8: rowwise for dgrad, its transpose
        for wgrad (when need_wgrad), cast once per backward of the GEMM; with
        want_dbias the cast also sums the bias gradient (bias_grad)."""
        gi = self.gi
        q = self.grads.get(gi)
        if q is None or not same_tensor(q.src, dy) or (self.need_wgrad and dy.dim() >= 2 and q.data_t is None):
            q = self._quantize(dy, self.bwd, 2 * gi, False, self.qparams and self.qparams[2], True,
                               self.need_wgrad and dy.dim() >= 2, dbias=self.want_dbias and dy.dim() >= 2)
            self.grads[gi] = q
        return q

    def wgrad_input(self, xt):
        """The forward's FP8 X^T of GEMM gi (xt: the same rows in the compute
        dtype, re-gathered under sequence parallelism, re-cast with the
        forward's scale where the transpose was not kept)."""
        q = self.inputs[self.gi]
        if q.data_t is None:
            q = self._quantize(xt, self.fwd, 0, True, None, False, True, scale=q.scale)
        return q

    def begin_backward(self, gi, need_wgrad, want_dbias=False):
        """GEMM gi's backward begins: need_wgrad, its weight gradient is
        wanted; want_dbias, the bias gradient over the rows of its dY."""
        self.gi, self.need_wgrad, self.want_dbias = gi, need_wgrad, want_dbias

    def end_gemm(self, gi):
        """GEMM gi's backward is done: its operands are dropped (a delayed
        weight gradient holds what it reads)."""
        self.inputs.pop(gi, None)
        self.weights.pop(gi, None)
        self.grads.pop(gi, None)

    def fuses_activation(self, act):
        """Whether this call's casts compute activation `act` (an engine
        code) themselves (produce): delayed scaling (current scaling would
        compute the activation twice, once for its amax: slower than the
        activation kernel and a cast of its output, measured on an H200), an
        element-wise activation (a gated one changes the width), and bf16,
        whose fused CUDA kernels know the function when compiled (other
        dtypes' read it per element), or the CPU."""
        return (self.delayed and self.blocks is None and act < 16
                and (self.call.dtype is torch.bfloat16 or self.call.dev < 0))

    def produce(self, x, act, act_input=None):
        """A stand-in for act(x) (with act_input: act'(act_input) * x, x
        the gradient of the activation's output) of x's shape, whose values
        this call's FP8 casts compute from x as they cast (the engine's
        fused activation: the compute-dtype tensor is never written). Only
        this call's casts may read it (by its address, views included)."""
        s = stand_in(x, x.shape)
        self.produced[s.data_ptr()] = (s, x, act, act_input)
        return s

    def activation_grad_output(self, dact, h, act, need_wgrad, want_dbias):
        """The activation's backward fused with the cast of GEMM 0's output
        gradient (LayerNormMLP's fc1): (dh, a stand-in whose FP8 cast, with
        its transpose when need_wgrad, is made now and found by
        grad_output, and the bias gradient of fc1 from the same pass, or
        None)."""
        dh = self.produce(dact, act, h)
        q = self._quantize(dh, self.bwd, 0, False, self.qparams and self.qparams[2], True,
                           need_wgrad and dh.dim() >= 2, dbias=want_dbias and dh.dim() >= 2)
        self.grads[0] = q
        return dh, q.dbias

    def saved_input(self, t, gi):
        """What a layer saves for the backward of GEMM gi's input t: where
        the forward kept t's FP8 transpose (all that wgrad reads), a stand-in
        with t's shape, dtype and device over one element of storage (the
        steps read only its shape: the bf16 copy is not kept, as TE keeps
        only the FP8 one); t itself otherwise."""
        q = self.inputs.get(gi) if self.grad else None
        if q is None or q.data_t is None or self.recomputing or not self.keep_t:
            return t
        return stand_in(t, t.shape)

    def finish_backward(self):
        """End of a layer's backward: the first FP8 module of the autocast
        reduces and updates the backward amaxes (delayed scaling)."""
        self.inputs, self.weights, self.grads = {}, {}, {}
        self.produced = {}
        if self.reduce_bwd:
            self.reduce_bwd = False
            _State.reduce_and_update_fp8_tensors(forward=False)


def slot_operand(out, fp8_dtype):
    """The destination of a cast straight into a communicator's slot: its
    rowwise bytes into `out`, a fresh scale_inv, no transpose."""
    return Operand(out, None, None, torch.empty(1, dtype=_F32, device=out.device), fp8_dtype)


def stand_in(t, shape):
    """A tensor of `shape` with t's dtype and device over one element (all
    strides 0): what is saved or passed where the FP8 operands hold the
    values (only its shape is read)."""
    return torch.empty_strided(shape, (0,) * len(shape), dtype=t.dtype, device=t.device)


def same_tensor(a, b):
    """a and b are the same elements (b perhaps a 2-D view of a)."""
    return a is b or (a is not None and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()
                      and a.dtype is b.dtype)
