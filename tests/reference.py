"""Pure-PyTorch references for the layers (F.layer_norm / the RMS formula +
F.linear), used by the unit tests and the torchrun runners."""
import torch
import torch.nn.functional as F


def norm(x, gamma, beta, eps, normalization, zero_centered_gamma):
    g = gamma + 1 if zero_centered_gamma else gamma
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), g, beta, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * g


def layernorm_linear(x, ln_weight, ln_bias, weight, bias, *, eps=1e-5, normalization="LayerNorm",
                     zero_centered_gamma=False):
    n = norm(x, ln_weight, ln_bias, eps, normalization, zero_centered_gamma)
    return F.linear(n, weight, bias), n
