"""TransformerEngine's `LayerNorm` and `RMSNorm` modules on the engine's norm
kernels (the ones LayerNormLinear runs): normalisation over the last
dimension, fp32 statistics, optional zero-centred gamma."""
import numbers

import torch

from .. import _engine, _library
from ._config import default_device, default_dtype
from .base import ExtraStateMixin

__all__ = ["LayerNorm", "RMSNorm"]


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered_gamma):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y, mu, rsigma = _engine.norm_fwd(x2, weight, bias, eps, zero_centered_gamma)
        ctx.save_for_backward(x2, mu if mu is not None else rsigma, rsigma, weight)
        ctx.has_bias, ctx.zero_centered_gamma, ctx.shape = bias is not None, zero_centered_gamma, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, mu, rsigma, weight = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        dx, dgamma, dbeta = _engine.norm_bwd(dy2, x2, mu if ctx.has_bias else None, rsigma, weight,
                                             ctx.zero_centered_gamma, with_dbeta=ctx.has_bias)
        return dx.view(ctx.shape), dgamma, dbeta, None, None


def _features(normalized_shape, hidden_size, cls):
    if normalized_shape is None:
        if hidden_size is None:
            raise TypeError(f"{cls}: normalized_shape (or hidden_size) is required")
        normalized_shape = hidden_size
    elif hidden_size is not None:
        raise TypeError(f"{cls}: give normalized_shape or hidden_size, not both")
    if isinstance(normalized_shape, numbers.Integral):
        n = int(normalized_shape)
    else:
        dims = tuple(normalized_shape)
        if len(dims) != 1 or not isinstance(dims[0], numbers.Integral):
            raise NotImplementedError(f"{cls}: normalized_shape={normalized_shape!r}: only the last dimension "
                                      "can be normalised (an int or a 1-tuple)")
        n = int(dims[0])
    if n <= 0:
        raise ValueError(f"{cls}: normalized_shape must be positive, got {n}")
    return n


class _Norm(ExtraStateMixin, torch.nn.Module):
    _with_bias = True

    def __init__(self, normalized_shape=None, eps=1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma=False, device=None, *, hidden_size=None, dtype=None):
        super().__init__()
        cls = type(self).__name__
        n = _features(normalized_shape, hidden_size, cls)
        if params_dtype is not None and dtype is not None:
            raise TypeError(f"{cls}: give params_dtype or dtype, not both")
        eps = float(eps)
        if not eps >= 0:
            raise ValueError(f"{cls}: eps must be >= 0, got {eps}")
        dtype = default_dtype(params_dtype if params_dtype is not None else dtype)
        device = default_device(device)
        self.normalized_shape = (n,)
        self.eps = eps
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(n, dtype=dtype, device=device))
        if self._with_bias:
            self.bias = torch.nn.Parameter(torch.empty(n, dtype=dtype, device=device))
        else:
            self.bias = None
        self.reset_parameters()

    def reset_parameters(self):
        """gamma 1 (0 with zero_centered_gamma), beta 0; the parameters carry
        `sequence_parallel` (Megatron sums their gradients over the group)."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()
        for p in (self.weight, self.bias):
            if p is not None:
                p.sequence_parallel = bool(self.sequence_parallel)

    reset_layer_norm_parameters = reset_parameters

    def forward(self, inp):
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: inp must be a tensor, got {type(inp).__name__}")
        if inp.dim() == 0 or inp.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"{type(self).__name__}: inp's last dimension must be {self.normalized_shape[0]}, "
                             f"got shape {tuple(inp.shape)}")
        x = inp
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if x.dtype not in _engine.DTYPE_CODES:
            raise TypeError(f"{type(self).__name__}: inp dtype {x.dtype} is not supported "
                            "(float32, bfloat16, float16)")
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        b = self.bias
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)
        if torch.compiler.is_compiling():  # the registered operator (transformer_engine_c/_library.py)
            shape = x.shape
            y = _library.norm(x.reshape(-1, shape[-1]).contiguous(), w, b, float(self.eps),
                              bool(self.zero_centered_gamma))
            return y.view(shape)
        with torch.autocast(x.device.type, enabled=False):
            return _NormFn.apply(x, w, b, self.eps, self.zero_centered_gamma)

    def extra_repr(self):
        return f"{self.normalized_shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    """TransformerEngine's LayerNorm(normalized_shape, eps, sequence_parallel,
    params_dtype, zero_centered_gamma, device; hidden_size= as TE's older
    name): y = (x - mean) / sqrt(var + eps) * gamma + beta over the last
    dimension ((1 + gamma) with zero_centered_gamma). Parameters `weight`
    and `bias`, each carrying `sequence_parallel`. The computation runs in
    the input's dtype (the autocast dtype under torch.autocast)."""


class RMSNorm(_Norm):
    """TransformerEngine's RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma over
    the last dimension (arguments and parameter `weight` as LayerNorm's)."""

    _with_bias = False
