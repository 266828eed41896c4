"""Pure-PyTorch reference of MultiheadAttention and TransformerLayer in
whatever dtype it is given (the tests give float64), reading the parameters
by TE's names from a {name: tensor} dict of an unsharded layer: the qkv
layouts, grouped-query attention, rotary embedding, the residual variants.
Written from TE's documented semantics, independently of the package's
code; tests/test_transformer_layer.py and
tests/distributed/run_transformer_layer_tp.py use it."""
import math

import torch
import torch.nn.functional as F

from mlp_reference import layernorm_mlp, norm


def rotate(x, freqs, interleaved=False):
    """RoPE of x [s, b, h, d] by angles freqs [>= s, 1, 1, d2]."""
    f = freqs[:x.shape[0]].to(x.dtype)
    d2 = f.shape[-1]
    head, tail = x[..., :d2], x[..., d2:]
    if interleaved:
        rot = torch.stack((-head[..., 1::2], head[..., 0::2]), dim=-1).flatten(-2)
    else:
        a, b = head.chunk(2, dim=-1)
        rot = torch.cat((-b, a), dim=-1)
    return torch.cat((head * f.cos() + rot * f.sin(), tail), dim=-1)


def attention(q, k, v, mask_type="causal", window=None):
    """q [s, b, h, d], k / v [skv, b, g, d] (g divides h) -> [s, b, h * d]."""
    s, b, h, d = q.shape
    skv, g = k.shape[0], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    i = torch.arange(s).view(s, 1)
    j = torch.arange(skv).view(1, skv)
    allowed = torch.ones(s, skv, dtype=torch.bool)
    if "causal" in mask_type:
        allowed &= j <= i
    if window is not None and window[0] >= 0:
        allowed &= j >= i - window[0]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
    return out.reshape(s, b, h * d)


def _heads(t, n, hn):
    return t.reshape(*t.shape[:-1], n, hn)


def split_qkv(mixed, heads, groups, hn, interleaved):
    """q [.., heads, hn], k and v [.., groups, hn] from the qkv GEMM's output:
    [q | k | v], or per key/value group [its queries | its key | its value]."""
    if not interleaved:
        hq, hkv = heads * hn, groups * hn
        return (_heads(mixed[..., :hq], heads, hn), _heads(mixed[..., hq:hq + hkv], groups, hn),
                _heads(mixed[..., hq + hkv:], groups, hn))
    per = heads // groups
    qs, ks, vs = [], [], []
    width = (per + 2) * hn
    for gi in range(groups):
        chunk = mixed[..., gi * width:(gi + 1) * width]
        qs.append(chunk[..., :per * hn])
        ks.append(chunk[..., per * hn:(per + 1) * hn])
        vs.append(chunk[..., (per + 1) * hn:])
    return (_heads(torch.cat(qs, -1), heads, hn), _heads(torch.cat(ks, -1), groups, hn),
            _heads(torch.cat(vs, -1), groups, hn))


def _get(p, prefix, *names):
    """The first of prefix + names present in p (None if none)."""
    for n in names:
        if prefix + n in p:
            return p[prefix + n]
    return None


def _cat(p, prefix, names):
    parts = [p[prefix + n] for n in names if prefix + n in p]
    return torch.cat(parts) if parts else None


def mha(x, p, prefix, cfg, encoder_output=None, freqs=None, mask_type="causal", window=None):
    """Self-attention (encoder_output None) or cross-attention of
    MultiheadAttention's parameters under `prefix`. Returns (output before
    the projection's bias, the projection's bias or None, the norm's output
    or None)."""
    heads, groups, hn = cfg["heads"], cfg["groups"], cfg["kv_channels"]
    eps, normalization, zcg = cfg.get("eps", 1e-5), cfg.get("normalization", "LayerNorm"), cfg.get("zcg", False)
    ln_out = None
    if encoder_output is None:
        lin = prefix + ("layernorm_qkv." if prefix + "layernorm_qkv.layer_norm_weight" in p else "qkv.")
        inp = x
        if lin.endswith("layernorm_qkv."):
            inp = ln_out = norm(x, p[lin + "layer_norm_weight"], p.get(lin + "layer_norm_bias"), eps, normalization,
                                zcg)
        w = _get(p, lin, "weight")
        w = w if w is not None else _cat(p, lin, ("query_weight", "key_weight", "value_weight"))
        b = _get(p, lin, "bias")
        b = b if b is not None else _cat(p, lin, ("query_bias", "key_bias", "value_bias"))
        q, k, v = split_qkv(F.linear(inp, w, b), heads, groups, hn, cfg.get("interleaved", False))
    else:
        lq = prefix + ("layernorm_query." if prefix + "layernorm_query.layer_norm_weight" in p else "query_layer.")
        inp = x
        if lq.endswith("layernorm_query."):
            inp = ln_out = norm(x, p[lq + "layer_norm_weight"], p.get(lq + "layer_norm_bias"), eps, normalization,
                                zcg)
        q = _heads(F.linear(inp, _get(p, lq, "weight", "query_weight"), _get(p, lq, "bias", "query_bias")), heads, hn)
        kv = prefix + "key_value."
        w = _get(p, kv, "weight")
        w = w if w is not None else _cat(p, kv, ("key_weight", "value_weight"))
        b = _get(p, kv, "bias")
        b = b if b is not None else _cat(p, kv, ("key_bias", "value_bias"))
        mixed = F.linear(encoder_output, w, b)
        if cfg.get("interleaved", False):  # per group: key, then value
            pairs = mixed.reshape(*mixed.shape[:-1], groups, 2 * hn)
            k, v = pairs[..., :hn], pairs[..., hn:]
        else:
            k, v = _heads(mixed[..., :groups * hn], groups, hn), _heads(mixed[..., groups * hn:], groups, hn)
    if freqs is not None:
        q, k = rotate(q, freqs, cfg.get("rope_interleaved", False)), rotate(k, freqs, cfg.get("rope_interleaved",
                                                                                              False))
    ctx = attention(q, k, v, mask_type, window)
    return F.linear(ctx, p[prefix + "proj.weight"]), p.get(prefix + "proj.bias"), ln_out


def transformer_layer(x, p, cfg, encoder_output=None, freqs=None):
    """TransformerLayer without dropout, x [s, b, hidden] (sbhd). cfg: heads,
    groups, kv_channels, interleaved, eps, normalization, zcg, activation,
    post_ln (apply_residual_connection_post_layernorm), output_ln,
    parallel (parallel_attention_mlp), decoder, mask_type, window."""
    def add(out, bias, residual):
        return residual + (out + bias if bias is not None else out)

    mask, window = cfg.get("mask_type", "causal"), cfg.get("window")
    out, bias, ln_out = mha(x, p, "self_attention.", cfg, freqs=freqs, mask_type=mask, window=window)
    mlp_p = {k[len("layernorm_mlp."):]: v for k, v in p.items() if k.startswith("layernorm_mlp.")}
    mlp_kw = dict(activation=cfg.get("activation", "gelu"), normalization=cfg.get("normalization", "LayerNorm"),
                  eps=cfg.get("eps", 1e-5), zero_centered_gamma=cfg.get("zcg", False))
    if cfg.get("parallel"):
        mlp_out, _ = layernorm_mlp(x, mlp_p, **mlp_kw)
        attn = out + bias if bias is not None else out
        return x + attn + mlp_out
    post_ln = cfg.get("post_ln", False)
    h = add(out, bias, ln_out if post_ln and ln_out is not None else x)
    if cfg.get("decoder"):
        out, bias, ln_out = mha(h, p, "inter_attention.", cfg, encoder_output=encoder_output, freqs=freqs,
                                mask_type="no_mask")
        h = add(out, bias, ln_out if post_ln else h)
    bias2 = mlp_p.pop("fc2_bias", None)
    mlp_out, mlp_ln = layernorm_mlp(h, mlp_p, **mlp_kw)
    y = add(mlp_out, bias2, mlp_ln if post_ln else h)
    if cfg.get("output_ln"):
        y = norm(y, p["layernorm.weight"], p.get("layernorm.bias"), cfg.get("eps", 1e-5),
                 cfg.get("normalization", "LayerNorm"), cfg.get("zcg", False))
    return y
