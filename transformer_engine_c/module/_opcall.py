"""A layer's autograd Function run inside the engine's operators: the path
torch.compile traces (transformer_engine_c/_library.py registers the
operators; each layer's forward takes this path while it is being compiled).

The compiler sees one layer call as two operators. `tec::layer_fwd` runs the
layer's Function.forward on the call's tensors and returns its output(s) and
the tensors its backward reads that are not inputs (the normalised rows,
the statistics, fc1's and the activation's outputs); `tec::layer_bwd` runs
the same Function.backward on them. Eager calls and compiled calls therefore
share every step; only the way in differs.

What an operator returns is declared before it runs (its fake
implementation: shapes and dtypes from the arguments and the layer's
configuration alone), and each real call checks that what the Function
saved is what was declared, raising where it is not."""
import itertools
import sys
import weakref

import torch
import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy

from .. import _library
from ..quantization import unwind_in_graph
from ._config import as_2d
from ._steps import outside_buffers
from ._temporaries import fresh_temporaries


class OpSpec:
    """How one layer class's Function is run by the operators.

    fn: the autograd Function; weights: {position among the Function's
    tensor arguments: the parameter's name (None: the layer's first weight)};
    biases: the positions of the biases; call(layer,
    plan, args, first_mb): the layer's Call; nograd(call, args): the outputs
    of a forward that keeps nothing for backward; saved(layer): where each
    tensor the Function saves comes from (an int: that argument; "x": the
    input, as the steps read it; "new": a tensor the forward made);
    new_shapes(layer, args): the (shape, dtype) of each "new" one, in order;
    ctx(args): the ctx attributes Function.backward reads."""

    __slots__ = ("fn", "weights", "biases", "call", "nograd", "saved", "new_shapes", "ctx")

    def __init__(self, fn, *, weights, biases, call, nograd, saved, new_shapes, ctx):
        self.fn, self.weights, self.biases = fn, weights, biases
        self.call, self.nograd, self.saved, self.new_shapes = call, nograd, saved, new_shapes
        self.ctx = ctx


class _Ctx:
    """Stands in for autograd's ctx around a Function's forward and backward."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


class OpState:
    """What a layer's operator calls derive from its plan and OpSpec alone,
    made on the layer's first operator call and again when either changes
    (a PLAN_ATTRS attribute set drops the plan): where each saved tensor
    comes from, which of them the forward makes, the communicator buffers
    its outputs must not lie in, whether every needed gradient is returned
    (no delayed or main_grad weight gradients), the input shapes and dtypes
    whose saved tensors were checked, and the key and Call of the last forward."""

    __slots__ = ("plan", "spec", "saved", "new_at", "buffers", "all_grads", "checked", "last")

    def __init__(self, layer, plan, spec):
        d = layer.__dict__
        self.plan, self.spec = plan, spec
        self.saved = tuple(spec.saved(layer))
        self.new_at = tuple(i for i, where in enumerate(self.saved) if where == "new")
        self.buffers = tuple(cfg for cfg in (d["ub"], d.get("ub2")) if cfg is not None and cfg.enabled)
        self.all_grads = not (layer.delay_wgrad_compute or layer.fuse_wgrad_accumulation)
        self.checked = set()
        self.last = None

    def __reduce__(self):
        # a pickled or copied layer keeps none of it (its OpSpec holds lambdas; its own calls make it anew)
        return _no_state, ()


def _no_state():
    return None


def _state(layer, plan):
    """The layer's OpState for `plan` and its current OpSpec."""
    st = layer.__dict__.get("_op_state")
    spec = layer._op_spec
    if st is None or st.plan is not plan or st.spec is not spec:
        st = layer.__dict__["_op_state"] = OpState(layer, plan, spec)
    return st


def out_rows(tp, rows):
    """A layer output's rows for `rows` input rows: gathered (column) or
    scattered (row) under sequence parallelism."""
    if tp.sp:
        return rows * tp.size if tp.mode == "column" else rows // tp.size if tp.mode == "row" else rows
    return rows


def _first_mb(code):
    return None if code < 0 else bool(code)


def _saved_x(layer, call, inp):
    """The input as the Function saved it: the caller's tensor for a ready
    call (or save_original_input), else its 2-D view."""
    if call.ready or getattr(layer, "save_original_input", False):
        return inp
    return as_2d(inp)


# An FP8 forward keeps its FP8 operands (the inputs' casts and transposes)
# in its Call for the backward, as an eager call does, and saves stand-ins
# for the high-precision tensors: its whole ctx waits here, under a key that
# crosses to the backward as a one-element CPU tensor (the "token"). The
# entry lives as long as the token: a forward whose backward never runs
# (a checkpointed forward's first run, a forward outside training) frees it.
_FP8_CTX = {}
_FP8_KEYS = itertools.count()


def _check_fp8(layer, call, fp8):
    if (call.fp8 is not None) != fp8:
        # traced in FP8 and run outside the autocast: the graph's guards see to its entry, so this is a
        # recomputation in the compiled backward (torch's checkpoint; tec.checkpoint keeps FP8 calls)
        hint = "; a checkpoint around FP8 layers inside the compiled function must be tec.checkpoint, whose " \
            "backward keeps their FP8 forward" if fp8 else ""
        raise RuntimeError(f"{type(layer).__name__}: compiled {'with' if fp8 else 'without'} an FP8 autocast, "
                           f"called {'without' if fp8 else 'with'} one (enter the autocast around the compiled "
                           f"function's call, as when it was compiled{hint})")


def _call_key(x, first_mb):
    """What a layer call's Call derives from besides the layer's parameters
    and plan: the input's memory, shape and dtype and the micro-batch flag.
    A backward whose forward was the layer's last one (with this key and
    plan) takes that forward's Call, as an eager backward takes ctx.call,
    instead of deriving it again."""
    return x.data_ptr(), x.shape, x.dtype, first_mb


def forward(layer, args, first_mb, grad, fp8):
    # temporaries are fresh allocations only on a CUDA device (module/_temporaries.py)
    cuda = args[0].is_cuda
    before = fresh_temporaries(True) if cuda else None
    try:
        return _forward(layer, args, first_mb, grad, fp8)
    except BaseException:
        # the compiled code this call belongs to stops here: an autocast it entered is left, as a `with` block
        unwind_in_graph()
        raise
    finally:
        if cuda:
            fresh_temporaries(before)


def _forward(layer, args, first_mb, grad, fp8):
    """tec::layer_fwd's real work: [output (2-D), (the normalised input)] +
    the new saved tensors when `grad` (an FP8 call: the token)."""
    plan = layer._plan or layer._make_plan()
    st = _state(layer, plan)
    spec = st.spec
    if fp8:
        with torch.set_grad_enabled(grad):  # an FP8 call keeps its operands for a backward (ops run without grad)
            call = spec.call(layer, plan, args, _first_mb(first_mb))
    else:
        call = spec.call(layer, plan, args, _first_mb(first_mb))
    if (call.fp8 is not None) != fp8:
        _check_fp8(layer, call, fp8)
    if not grad:
        return _owned(st, spec.nograd(call, args), ())
    ctx = _Ctx()
    out = spec.fn.forward(ctx, *args, call)
    outs = out if isinstance(out, tuple) else (out,)
    if fp8:
        key = next(_FP8_KEYS)
        _FP8_CTX[key] = ctx
        token = torch.tensor([key], dtype=torch.int64, device="cpu")
        weakref.finalize(token, _FP8_CTX.pop, key, None)
        return _owned(st, outs, ()) + [token]
    x = args[0]
    st.last = (_call_key(x, first_mb), call)
    saved = ctx.saved_tensors
    shape = (x.shape, x.dtype, call.ready)
    if shape not in st.checked:  # once per input shape and dtype: what was saved is what the operator declares
        _check_saved(layer, st, call, args, saved)
        st.checked.add(shape)
    new = [saved[i] for i in st.new_at]
    return _owned(st, outs, new) + new


def _recomputed_region():
    """Whether the call being traced lies in a checkpointed region whose
    calls the compiled backward runs again (torch's checkpoint tags the
    nodes it traces), and not in one of tec.checkpoint's."""
    if not fx_traceback.has_preserved_node_meta() or _library.fp8_keeping_regions:
        return False
    meta = fx_traceback.current_meta
    if "recompute" in meta:
        return meta["recompute"] in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
    return _inside_plain_checkpoint()


def _inside_plain_checkpoint():
    """Whether torch's compiler is running a torch.utils.checkpoint region
    without a policy (its higher-order operator is on the stack): torch
    2.11 tags the region's own nodes as recomputed but not the nodes of a
    custom autograd Function's forward inside it (where a layer call is),
    which carry no tag; torch 2.8 and 2.13 tag the layer call itself."""
    hop = getattr(sys.modules.get("torch._higher_order_ops.wrap"), "TagActivationCheckpoint", None)
    code = getattr(getattr(hop, "__call__", None), "__code__", None)
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _check_saved(layer, st, call, args, saved):
    if len(saved) != len(st.saved):
        _mismatch(layer, f"{len(saved)} saved tensors, {len(st.saved)} declared")
    new = [saved[i] for i in st.new_at]
    for t, where in zip(saved, st.saved):
        if where == "new":
            continue
        if where == "x":
            x = _saved_x(layer, call, args[0])
            if t.data_ptr() != x.data_ptr() or t.shape != x.shape:
                _mismatch(layer, "the saved input is not the input")
        elif t is not args[where]:
            _mismatch(layer, f"saved tensor {where} is not that argument")
    declared = st.spec.new_shapes(layer, args)
    if [(tuple(t.shape), t.dtype) for t in new] != [(tuple(s), d) for s, d in declared]:
        _mismatch(layer, f"saved {[(tuple(t.shape), t.dtype) for t in new]}, declared {declared}")


def forward_fake(layer, args, grad, fp8):
    """tec::layer_fwd's outputs from the arguments alone. An FP8 call that
    the compiler traces inside a checkpoint other than tec.checkpoint is
    refused here, while compiling, on every device: that checkpoint would
    run it again in the compiled backward, outside the autocast."""
    if fp8 and grad and _recomputed_region():
        raise RuntimeError(f"{type(layer).__name__}: an FP8 layer call inside torch.utils.checkpoint in a "
                           "function torch.compile traces would run again in the compiled backward, outside the "
                           "FP8 autocast: use tec.checkpoint, whose backward keeps the FP8 calls' forward")
    inp = args[0]
    outs = [inp.new_empty(s, dtype=d) for s, d in layer._op_outputs(args)]
    if grad and fp8:
        outs.append(torch.empty(1, dtype=torch.int64, device="cpu"))
    elif grad:
        outs += [inp.new_empty(s, dtype=d) for s, d in layer._op_spec.new_shapes(layer, args)]
    return outs


def backward(layer, args, new, grads, needs, first_mb, fp8):
    cuda = args[0].is_cuda
    before = fresh_temporaries(True) if cuda else None
    try:
        return _backward(layer, args, new, grads, needs, first_mb, fp8)
    finally:
        if cuda:
            fresh_temporaries(before)


def _backward(layer, args, new, grads, needs, first_mb, fp8):
    """tec::layer_bwd's real work: the gradient of each of the Function's
    tensor arguments, None where grads_present declares none."""
    plan = layer._plan or layer._make_plan()
    st = _state(layer, plan)
    spec = st.spec
    if fp8:
        ctx = _FP8_CTX.pop(int(new[0].item()), None)
        if ctx is None:
            raise RuntimeError(f"{type(layer).__name__}: the FP8 forward this backward belongs to is gone (its "
                               "backward already ran: a compiled FP8 graph is differentiated once)")
        ctx.needs_input_grad = tuple(needs) + (False,)
        return _present(layer, st, spec.fn.backward(ctx, *grads), args, needs)
    x = args[0]
    last = st.last
    if last is not None and last[0] == _call_key(x, first_mb):
        call = last[1]  # the forward's, as an eager backward reads ctx.call
    else:
        call = spec.call(layer, plan, args, _first_mb(first_mb))
        if call.fp8 is not None:
            _check_fp8(layer, call, False)
    ctx = _Ctx()
    it = iter(new)
    ctx.saved_tensors = tuple(next(it) if where == "new" else _saved_x(layer, call, x) if where == "x"
                              else args[where] for where in st.saved)
    ctx.call, ctx.objects, ctx.inp_shape = call, None, x.shape
    ctx.needs_input_grad = tuple(needs) + (False,)
    for k, v in spec.ctx(args).items():
        setattr(ctx, k, v)
    return _present(layer, st, spec.fn.backward(ctx, *grads), args, needs)


def _present(layer, st, res, args, needs):
    """The gradients the operator declared (grads_present); one not asked
    for (an input gradient the Function always computes) is dropped."""
    if st.all_grads:  # every needed gradient is returned
        wants = [a is not None and bool(need) for a, need in zip(args, needs)]
    else:
        wants = grads_present(layer, args, needs)
    out = []
    for i, (g, want) in enumerate(zip(res, wants)):
        if want and g is None:
            _mismatch(layer, f"no gradient for argument {i}, where one was declared")
        out.append(g if want else None)
    return out


def grads_present(layer, args, needs):
    """Which of the Function's tensor arguments get a gradient: none where
    not needed; delay_wgrad_compute leaves the weights' and biases' for
    backward_dw(); fuse_wgrad_accumulation writes the weights' into main_grad
    and returns TE's dummy only where the weight asks for one
    (grad_added_to_main_grad)."""
    spec = layer._op_spec
    out = []
    for i, (a, need) in enumerate(zip(args, needs)):
        want = a is not None and bool(need)
        if want and i in spec.weights:
            if layer.delay_wgrad_compute:
                want = False
            elif layer.fuse_wgrad_accumulation:
                name = spec.weights[i] or layer.weight_names[0]
                want = hasattr(layer._parameters[name], "grad_added_to_main_grad")
        elif want and i in spec.biases and layer.delay_wgrad_compute:
            want = False
        out.append(want)
    return out


def _owned(st, outs, saved):
    """The outputs as tensors the compiler may own: each 2-D, and a copy
    where it lies in one of the layer's communicator buffers (which the next
    call reuses) or shares memory with a saved tensor or an earlier output
    (LayerNormLinear's normalised output is also saved)."""
    res = []
    taken = {t.data_ptr() for t in saved}
    for t in outs:
        if t.dim() != 2:
            t = t.reshape(-1, t.shape[-1])
        for cfg in st.buffers:
            t = outside_buffers(t, cfg)
        if not t.numel():
            # an empty tensor has no address to compare, but it may still be
            # a view of an argument or of a saved tensor: the operator's
            # outputs must not share storage with either, so it is made anew
            t = t.new_empty(t.shape)
        elif t.data_ptr() in taken:
            t = t.clone()
        taken.add(t.data_ptr())
        res.append(t)
    return res


def _mismatch(layer, what):
    raise RuntimeError(f"{type(layer).__name__}: the compiled path's operator found {what} (an internal "
                       "inconsistency between the layer's Function and its operator declaration)")
