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
  tec::gemm                         a GEMM of GroupedLinear's

Eager calls go straight to the engine (the dispatcher's cost is not paid
there); a layer takes these operators while torch.compile traces it.
Operators that take part in a collective (a tensor-parallel layer) are
opaque to the compiler and every rank runs the same compiled program, so
their order is the program's."""
import itertools
import weakref
from typing import List, Optional

import torch
from torch import Tensor

from . import _engine

_LAYERS = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_layer(layer):
    """The key under which `layer` crosses into the operators."""
    key = f"{type(layer).__name__}#{next(_KEYS)}"
    _LAYERS[key] = layer
    return key


def _layer(key):
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"no live layer is registered as {key!r} (the module was deleted after its call was "
                           "compiled)")
    return layer


def first_mb_code(is_first_microbatch):
    return -1 if is_first_microbatch is None else int(bool(is_first_microbatch))


# ---------------------------------------------------------------- layer calls

# A layer call's tensors cross as a list of those given and, beside it, which
# of the Function's arguments they are (`given`): None has no place in a
# tensor list that autograd differentiates.

def _expand(tensors, given):
    it = iter(tensors)
    return [next(it) if g else None for g in given]


@torch.library.custom_op("tec::layer_fwd", mutates_args=())
def layer_fwd(key: str, tensors: List[Tensor], given: List[bool], first_mb: int, grad: bool,
              fp8: bool) -> List[Tensor]:
    return _layer(key)._op_forward(_expand(tensors, given), first_mb, grad, fp8)


@layer_fwd.register_fake
def _(key, tensors, given, first_mb, grad, fp8):
    return _layer(key)._op_forward_fake(_expand(tensors, given), grad, fp8)


@torch.library.custom_op("tec::layer_bwd", mutates_args=())
def layer_bwd(key: str, tensors: List[Tensor], given: List[bool], saved: List[Tensor],
              grads: List[Optional[Tensor]], needs: List[bool], first_mb: int, fp8: bool) -> List[Tensor]:
    return _layer(key)._op_backward(_expand(tensors, given), saved, grads, _expand(needs, given), first_mb, fp8)


@layer_bwd.register_fake
def _(key, tensors, given, saved, grads, needs, first_mb, fp8):
    return _layer(key)._op_backward_fake(_expand(tensors, given), _expand(needs, given))


def _layer_setup(ctx, inputs, output):
    key, tensors, given, first_mb, grad, fp8 = inputs
    n = _layer(key)._op_noutputs()
    ctx.key, ctx.given, ctx.first_mb, ctx.nargs, ctx.n, ctx.fp8 = key, given, first_mb, len(tensors), n, fp8
    ctx.save_for_backward(*tensors, *output[n:])
    ctx.mark_non_differentiable(*output[n:])
    ctx.set_materialize_grads(False)


def _layer_backward(ctx, grads):
    saved = ctx.saved_tensors
    tensors, new = list(saved[:ctx.nargs]), list(saved[ctx.nargs:])
    needs = [bool(n) for n in ctx.needs_input_grad[1]]
    got = layer_bwd(ctx.key, tensors, ctx.given, new, list(grads[:ctx.n]), needs, ctx.first_mb, ctx.fp8)
    present = _layer(ctx.key)._op_grads_present(_expand(tensors, ctx.given), _expand(needs, ctx.given))
    it = iter(got)
    full = [next(it) if want else None for want in present]
    return None, [g for g, a in zip(full, ctx.given) if a], None, None, None, None


layer_fwd.register_autograd(_layer_backward, setup_context=_layer_setup)


def layer_call(layer, args, is_first_microbatch, fp8):
    """One traced layer call: the Function's outputs (2-D). fp8: the call
    runs inside an FP8 autocast (read while tracing: a guard of the graph)."""
    outs = layer_fwd(layer._op_key, [a for a in args if a is not None], [a is not None for a in args],
                     first_mb_code(is_first_microbatch), torch.is_grad_enabled(), fp8)
    return outs[:layer._op_noutputs()]


# ---------------------------------------------------------------- norms

@torch.library.custom_op("tec::norm_fwd", mutates_args=())
def norm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float,
             zero_centered_gamma: bool) -> List[Tensor]:
    """(y, mu, rsigma) of a 2-D x; mu is empty for RMSNorm (no bias)."""
    y, mu, rsigma = _engine.norm_fwd(x, weight, bias, eps, zero_centered_gamma)
    return [y, rsigma.new_empty(0) if mu is None else mu, rsigma]


@norm_fwd.register_fake
def _(x, weight, bias, eps, zero_centered_gamma):
    rows = x.shape[0]
    stats = (lambda n: x.new_empty(n, dtype=torch.float32))
    return [torch.empty_like(x), stats(0 if bias is None else rows), stats(rows)]


@torch.library.custom_op("tec::norm_bwd", mutates_args=())
def norm_bwd(dy: Tensor, x: Tensor, mu: Tensor, rsigma: Tensor, weight: Tensor, zero_centered_gamma: bool,
             with_dbeta: bool) -> List[Tensor]:
    """(dx, dgamma, dbeta) (dbeta empty without with_dbeta)."""
    dx, dgamma, dbeta = _engine.norm_bwd(dy, x, mu if with_dbeta else None, rsigma, weight, zero_centered_gamma,
                                         with_dbeta=with_dbeta)
    return [dx, dgamma, dgamma.new_empty(0) if dbeta is None else dbeta]


@norm_bwd.register_fake
def _(dy, x, mu, rsigma, weight, zero_centered_gamma, with_dbeta):
    return [torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight) if with_dbeta
            else weight.new_empty(0)]


def _norm_setup(ctx, inputs, output):
    x, weight, bias, eps, zcg = inputs
    ctx.save_for_backward(x, output[1], output[2], weight)
    ctx.zcg, ctx.has_bias = zcg, bias is not None
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)


def _norm_backward(ctx, grads):
    x, mu, rsigma, weight = ctx.saved_tensors
    dy = grads[0].contiguous()
    dx, dgamma, dbeta = norm_bwd(dy, x, mu, rsigma, weight, ctx.zcg, ctx.has_bias)
    return dx, dgamma, dbeta if ctx.has_bias else None, None, None


norm_fwd.register_autograd(_norm_backward, setup_context=_norm_setup)


# ---------------------------------------------------------------- GEMMs

@torch.library.custom_op("tec::gemm", mutates_args=())
def gemm(a: Tensor, b: Tensor, bias: Optional[Tensor], transa: bool, transb: bool) -> Tensor:
    """op(a) @ op(b) (+ bias) in the engine (_engine.gemm)."""
    return _engine.gemm(a.contiguous(), b.contiguous(), transa=transa, transb=transb, bias=bias)


@gemm.register_fake
def _(a, b, bias, transa, transb):
    m = a.shape[1] if transa else a.shape[0]
    n = b.shape[0] if transb else b.shape[1]
    return a.new_empty(m, n)


def _gemm_setup(ctx, inputs, output):
    a, b, bias, transa, transb = inputs
    if transa or not transb:
        raise NotImplementedError("tec::gemm differentiates x @ w^T (+ bias) only")
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None


def _gemm_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dy = dy.contiguous()
    need = ctx.needs_input_grad
    dx = gemm(dy, w, None, False, False) if need[0] else None
    dw = gemm(dy, x, None, True, False) if need[1] else None
    db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if ctx.has_bias and need[2] else None
    return dx, dw, db, None, None


gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)
