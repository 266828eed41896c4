"""Pure-PyTorch reference of LayerNormMLP (norm -> fc1 -> activation -> fc2)
in whatever dtype it is given (the tests give float64), with TE's gated
layout: fc1's output rows per tensor-parallel rank are [activation | gate]."""
import torch
import torch.nn.functional as F

GATED = ("geglu", "reglu", "qgeglu", "sreglu", "swiglu", "clamped_swiglu", "glu")


def act(name, x, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """TE's activation `name` on x ([..., 2n] for a gated one: f(first half) * second half)."""
    base = {"gelu": lambda v: F.gelu(v, approximate="tanh"), "relu": F.relu,
            "qgelu": lambda v: v * torch.sigmoid(1.702 * v), "srelu": lambda v: F.relu(v) ** 2, "silu": F.silu,
            "clamped_swiglu": lambda v: torch.clamp(v, max=limit) * torch.sigmoid(alpha * torch.clamp(v, max=limit)),
            "glu": torch.sigmoid}
    base.update(geglu=base["gelu"], reglu=base["relu"], qgeglu=base["qgelu"], sreglu=base["srelu"],
                swiglu=base["silu"])
    if name not in GATED:
        return base[name](x)
    a, g = x.chunk(2, dim=-1)
    if name == "clamped_swiglu":
        g = torch.clamp(g, -limit, limit) + glu_linear_offset
    return base[name](a) * g


def norm(x, gamma, beta, eps, normalization, zero_centered_gamma):
    g = gamma + 1 if zero_centered_gamma else gamma
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), g, beta, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def fc1_global(fc1_weights, gated):
    """The unsharded fc1 weight (or bias) from the per-rank shards, each
    [activation rows | gate rows] when gated: [all activation rows | all gate
    rows], the layout of a tp_size=1 module."""
    if not gated:
        return torch.cat(fc1_weights)
    halves = [w.chunk(2, dim=0) for w in fc1_weights]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def layernorm_mlp(x, p, *, activation="gelu", normalization="LayerNorm", eps=1e-5, zero_centered_gamma=False,
                  act_kw=None):
    """p: {name: tensor} with TE's parameter names (unsharded; biases may be
    missing). Returns (output, normalised input)."""
    n = norm(x, p["layer_norm_weight"], p.get("layer_norm_bias"), eps, normalization, zero_centered_gamma)
    h = F.linear(n, p["fc1_weight"], p.get("fc1_bias"))
    return F.linear(act(activation, h, **(act_kw or {})), p["fc2_weight"], p.get("fc2_bias")), n
