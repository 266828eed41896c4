"""The engine as PyTorch operators (torch.library, namespace `tec`): the
boundary torch.compile sees. Every operator has a fake implementation that
derives its outputs' shapes and dtypes from the arguments alone, and an
autograd formula; arguments are tensors and plain values, and objects cross
by name (a layer by the key it was registered under).

  tec::layer_fwd / tec::layer_bwd   one call of Linear, LayerNormLinear or
                                    LayerNormMLP: its autograd Function's
                                    forward and backward (module/_opcall.py),
                                    so a compiled layer runs the eager steps
  tec::norm_fwd / tec::norm_bwd     LayerNorm and RMSNorm (the engine's kernels)
  tec::gemm                         a GEMM (GroupedLinear's)
  tec::autocast_enter / _exit       an FP8 autocast entered inside a compiled
                                    function: its state set and restored,
                                    and its exit's scale update, at run time
  tec::refuse                       a refusal while tracing, its text kept

Eager calls go straight to the engine (the dispatcher's cost is not paid
there); a layer takes these operators while torch.compile traces it.
Operators that take part in a collective (a tensor-parallel layer) are
opaque to the compiler and every rank runs the same compiled program, so
their order is the program's."""
import itertools
import sys
import weakref

import torch

from . import _engine

_LAYERS = weakref.WeakValueDictionary()
# The full keys (configuration included) already resolved: a compiled call
# finds its layer with one lookup
_RESOLVED = {}
_KEYS = itertools.count()
# Part of every layer key, so of every compiled graph that calls the
# operators: PyTorch's on-disk caches reuse a graph only when its code is the
# same, so a change in what a compiled graph keeps or calls (such as which
# operators the compiler may drop) changes this, and graphs compiled before
# it are not reused
GRAPH_REVISION = 4


def register_layer(layer):
    """The key under which `layer` crosses into the operators."""
    key = f"{type(layer).__name__}#{next(_KEYS)}.r{GRAPH_REVISION}"
    _LAYERS[key] = layer
    return key


def _layer(key, check=False):
    """The live layer of a key "REGISTRY_KEY|CONFIGURATION" (layer_call's);
    `check`: its configuration is still the one in the key (while tracing; at
    run time the graph's guards on the layer's attributes see to it)."""
    if not check:
        ref = _RESOLVED.get(key)
        layer = None if ref is None else ref()
        if layer is not None:
            return layer
    name, _, signature = key.partition("|")
    layer = _LAYERS.get(name)
    if check and layer is not None and signature != layer._op_signature():
        raise RuntimeError(f"{type(layer).__name__} {name}: its configuration changed since the call was traced "
                           f"(traced as {signature}, now {layer._op_signature()})")
    if layer is None:
        raise RuntimeError(f"no live layer is registered as {key!r} (the module was deleted after its call was "
                           "compiled)")
    _RESOLVED[key] = weakref.ref(layer, lambda _, key=key: _RESOLVED.pop(key, None))
    return layer


def first_mb_code(is_first_microbatch):
    return -1 if is_first_microbatch is None else int(bool(is_first_microbatch))


# ---------------------------------------------------------------- layer calls

# A layer call's tensors cross as one list of optional tensors, in the
# Function's argument order (None where the call has no such tensor: a bias
# left out), and which of them need a gradient as the bits of an int (a
# bool[] argument costs the dispatcher microseconds per call). The operators are defined with torch.library.Library and
# their kernels registered for every backend (CompositeExplicitAutograd):
# a compiled graph calls them through the dispatcher with nothing else in
# between. Their gradients are the autograd Functions below, which
# torch.compile traces into the graph's backward.

_LIB = torch.library.Library("tec", "DEF")


def _define(schema, impl, fake, tags=()):
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=tags)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tec::{name}", fake, lib=_LIB)
    return getattr(torch.ops.tec, name).default


def _layer_fwd(key, args, first_mb, grad, fp8):
    return _layer(key)._op_forward(args, first_mb, grad, fp8)


def _layer_fwd_fake(key, args, first_mb, grad, fp8):
    return _layer(key, check=True)._op_forward_fake(args, grad, fp8)


def _needs(mask, n):
    """needs_input_grad of n arguments from its bit mask (bit i: argument i)."""
    return [bool(mask >> i & 1) for i in range(n)]


def _layer_bwd(key, args, saved, grads, needs, first_mb, fp8):
    """The gradient of each argument, or an empty [0] where it has none."""
    got = _layer(key)._op_backward(args, saved, grads, _needs(needs, len(args)), first_mb, fp8)
    return [g if g is not None else (args[0] if t is None else t).new_empty(0) for t, g in zip(args, got)]


def _layer_bwd_fake(key, args, saved, grads, needs, first_mb, fp8):
    _keep_layer_bwd_in_inductor()
    present = _layer(key)._op_grads_present(args, _needs(needs, len(args)))
    return [torch.empty_like(t) if want else (args[0] if t is None else t).new_empty(0)
            for t, want in zip(args, present)]


layer_fwd = _define("layer_fwd(str key, Tensor?[] args, int first_mb, bool grad, bool fp8) -> Tensor[]",
                    _layer_fwd, _layer_fwd_fake)
layer_bwd = _define("layer_bwd(str key, Tensor?[] args, Tensor[] saved, Tensor?[] grads, int needs, int first_mb, "
                    "bool fp8) -> Tensor[]", _layer_bwd, _layer_bwd_fake)
# layer_bwd writes what its outputs do not show (main_grad, the delayed weight
# gradients' queue): the compiler keeps it where no gradient it returns is used
_has_side_effect = getattr(torch.fx.node, "has_side_effect", torch.fx.node._side_effectful_functions.add)
_has_side_effect(layer_bwd)
_INDUCTOR_KEEPS_LAYER_BWD = False


def _keep_layer_bwd_in_inductor():
    """Inductor before torch 2.13 asks only an operator's schema whether it
    has side effects (a mutated argument), not the set above, and drops a
    layer_bwd none of whose outputs is used: its kernel's check is widened
    to name layer_bwd and the autocast operators. Done when a compiled graph's backward is traced (this
    operator's fake), once Inductor is loaded; never where Inductor asks the
    set itself."""
    global _INDUCTOR_KEEPS_LAYER_BWD
    if _INDUCTOR_KEEPS_LAYER_BWD:
        return
    ir = sys.modules.get("torch._inductor.ir")
    kernel = getattr(ir, "FallbackKernel", None)
    if kernel is None:  # Inductor not loaded (yet): nothing of it can drop the operator
        return
    _INDUCTOR_KEEPS_LAYER_BWD = True
    asks = kernel.has_side_effects
    code = getattr(asks, "__code__", None)
    if code is None or "is_impure" in code.co_names:  # torch >= 2.13: it asks the set
        return

    def has_side_effects(self):
        return self.op_overload in _KEPT or asks(self)
    kernel.has_side_effects = has_side_effects


# How many of tec.checkpoint's traced regions are open (checkpoint.py): their
# policy keeps an FP8 layer call's forward instead of running it again in the
# compiled backward. A traced FP8 call inside another checkpoint is refused
# (module/_opcall.forward_fake).
fp8_keeping_regions = 0


# ---------------------------------------------------------------- FP8 autocast inside a compiled function

# The autocast's own code (quantization.py) is told to these operators by
# autocast_hooks: enter(recipe_name, enabled, calibrating), exit(enabled, grad).
_AUTOCAST = {}


def autocast_hooks(enter, exit):
    _AUTOCAST["enter"], _AUTOCAST["exit"] = enter, exit


def _autocast_enter(recipe, enabled, calibrating):
    _AUTOCAST["enter"](recipe, enabled, calibrating)


def _autocast_exit(enabled, grad):
    _AUTOCAST["exit"](enabled, grad)


def _autocast_fake(*args):
    _keep_layer_bwd_in_inductor()


# Python state, not GPU work: never captured into a CUDA graph (mode="reduce-overhead"
# runs them on every call), where this torch can say so
_NOT_CAPTURED = tuple(getattr(torch.Tag, t) for t in ("cudagraph_unsafe",) if hasattr(torch.Tag, t))
autocast_enter = _define("autocast_enter(str recipe, bool enabled, bool calibrating) -> ()", _autocast_enter,
                         _autocast_fake, _NOT_CAPTURED)
autocast_exit = _define("autocast_exit(bool enabled, bool grad) -> ()", _autocast_exit, _autocast_fake,
                        _NOT_CAPTURED)
# they change what the layer operators after them read: kept, in program order
_has_side_effect(autocast_enter)
_has_side_effect(autocast_exit)
_KEPT = (layer_bwd, autocast_enter, autocast_exit)


# ---------------------------------------------------------------- refusals while tracing

def _refuse(why):
    raise NotImplementedError(why)


# Python code that torch.compile traces raises an exception that reaches the
# user as "Observed exception", without its text, on torch before 2.13; raised
# by an operator's fake implementation, which runs while tracing, it keeps
# its text on every torch. The operator never reaches a graph.
refuse = _define("refuse(str why) -> ()", _refuse, _refuse)


class _LayerCall(torch.autograd.Function):
    """One layer call through tec::layer_fwd, its gradient through tec::layer_bwd."""

    # forward takes its arguments as one tuple: torch's compiler calls a
    # Function's forward without ctx, in a call that needs no gradient, when
    # the argument count equals forward's parameter count (*args counted as
    # one), which (ctx, key, ..., n, *args) would with two tensors
    @staticmethod
    def forward(ctx, *args):
        key, first_mb, grad, fp8, n, *tensors = args
        outs = layer_fwd(key, tensors, first_mb, grad, fp8)
        ctx.key, ctx.first_mb, ctx.fp8, ctx.n, ctx.nargs = key, first_mb, fp8, n, len(tensors)
        ctx.save_for_backward(*tensors, *outs[n:])
        ctx.mark_non_differentiable(*outs[n:])
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        tensors, new = saved[:ctx.nargs], saved[ctx.nargs:]
        needs = sum(1 << i for i, need in enumerate(ctx.needs_input_grad[5:]) if need)
        got = layer_bwd(ctx.key, list(tensors), list(new), list(grads[:ctx.n]), needs, ctx.first_mb, ctx.fp8)
        return (None,) * 5 + tuple(None if t is None or g.shape != t.shape else g for g, t in zip(got, tensors))


def layer_call(layer, args, is_first_microbatch, fp8):
    """One traced layer call: the Function's outputs (2-D). fp8: the call
    runs inside an FP8 autocast (read while tracing: a guard of the graph)."""
    n = layer._op_noutputs()
    key = f"{layer._op_key}|{layer._op_signature()}"
    outs = _LayerCall.apply(key, first_mb_code(is_first_microbatch), torch.is_grad_enabled(), fp8, n, *args)
    return outs[:n]


# ---------------------------------------------------------------- norms

def _norm_fwd(x, weight, bias, eps, zero_centered_gamma):
    """(y, mu, rsigma) of a 2-D x; mu is empty for RMSNorm (no bias)."""
    y, mu, rsigma = _engine.norm_fwd(x, weight, bias, eps, zero_centered_gamma)
    return y, rsigma.new_empty(0) if mu is None else mu, rsigma


def _norm_fwd_fake(x, weight, bias, eps, zero_centered_gamma):
    rows = x.shape[0]
    return (torch.empty_like(x), x.new_empty(0 if bias is None else rows, dtype=torch.float32),
            x.new_empty(rows, dtype=torch.float32))


def _norm_bwd(dy, x, mu, rsigma, weight, zero_centered_gamma, with_dbeta):
    """(dx, dgamma, dbeta) (dbeta empty without with_dbeta)."""
    dx, dgamma, dbeta = _engine.norm_bwd(dy, x, mu if with_dbeta else None, rsigma, weight, zero_centered_gamma,
                                         with_dbeta=with_dbeta)
    return dx, dgamma, dgamma.new_empty(0) if dbeta is None else dbeta


def _norm_bwd_fake(dy, x, mu, rsigma, weight, zero_centered_gamma, with_dbeta):
    return torch.empty_like(x), torch.empty_like(weight), (torch.empty_like(weight) if with_dbeta
                                                           else weight.new_empty(0))


norm_fwd_op = _define("norm_fwd(Tensor x, Tensor weight, Tensor? bias, float eps, bool zero_centered_gamma) "
                      "-> (Tensor, Tensor, Tensor)", _norm_fwd, _norm_fwd_fake)
norm_bwd_op = _define("norm_bwd(Tensor dy, Tensor x, Tensor mu, Tensor rsigma, Tensor weight, "
                      "bool zero_centered_gamma, bool with_dbeta) -> (Tensor, Tensor, Tensor)", _norm_bwd,
                      _norm_bwd_fake)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zcg):
        y, mu, rsigma = norm_fwd_op(x, weight, bias, eps, zcg)
        ctx.save_for_backward(x, mu, rsigma, weight)
        ctx.zcg, ctx.has_bias = zcg, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mu, rsigma, weight = ctx.saved_tensors
        dx, dgamma, dbeta = norm_bwd_op(dy.contiguous(), x, mu, rsigma, weight, ctx.zcg, ctx.has_bias)
        return dx, dgamma, dbeta if ctx.has_bias else None, None, None


def norm(x, weight, bias, eps, zero_centered_gamma):
    """LayerNorm (bias given) or RMSNorm of a 2-D x through tec::norm_fwd / norm_bwd."""
    return _Norm.apply(x, weight, bias, eps, zero_centered_gamma)


# ---------------------------------------------------------------- GEMMs

def _gemm(a, b, bias, transa, transb):
    """op(a) @ op(b) (+ bias) in the engine (_engine.gemm)."""
    return _engine.gemm(a.contiguous(), b.contiguous(), transa=transa, transb=transb, bias=bias)


def _gemm_fake(a, b, bias, transa, transb):
    m = a.shape[1] if transa else a.shape[0]
    n = b.shape[0] if transb else b.shape[1]
    return a.new_empty(m, n)


gemm_op = _define("gemm(Tensor a, Tensor b, Tensor? bias, bool transa, bool transb) -> Tensor", _gemm, _gemm_fake)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return gemm_op(x, w, bias, False, True)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        need = ctx.needs_input_grad
        dx = gemm_op(dy, w, None, False, False) if need[0] else None
        dw = gemm_op(dy, x, None, True, False) if need[1] else None
        db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if ctx.has_bias and need[2] else None
        return dx, dw, db


def linear(x, w, bias=None):
    """x @ w^T (+ bias) through tec::gemm, differentiable."""
    return _Linear.apply(x, w, bias)


# ---------------------------------------------------------------- RoPE

def _rope(x, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward):
    return _engine.rope(x, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                        backward=backward)


def _rope_fake(x, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward):
    return x.new_empty(x.shape)


rope_op = _define("rope(Tensor x, Tensor freqs, str fmt, bool interleaved, Tensor? cu_seqlens, "
                  "Tensor? start_positions, int cp_size, int cp_rank, bool backward) -> Tensor", _rope, _rope_fake)
