"""Pure-PyTorch reference of MultiheadAttention and TransformerLayer in
whatever dtype it is given (the tests give float64), reading the parameters
by TE's names from a {name: tensor} dict of an unsharded layer: the qkv
layouts, grouped-query attention, rotary embedding, qk norms, the mask
types (TE's diagonal alignment, padding, arbitrary masks, windows),
attention biases, the residual variants. Written from TE's documented
semantics, independently of the package's code;
tests/test_transformer_layer.py, tests/test_transformer_layer_fuzz.py and
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


def attention(q, k, v, mask_type="causal", window=None, allowed=None, lengths=None, bias=None):
    """q [s, b, h, d], k / v [skv, b, g, d] (g divides h) -> [s, b, h * d].
    TE's masks: the causal diagonal and the window (left, right) are aligned
    top-left for causal and padding_causal, bottom-right (key j of query i
    shifted by skv - s) for every other type; `allowed` (True: attend), if
    given, broadcasts to [b, h, s, skv] (padding and arbitrary masks); with
    `lengths` (each batch's query and key/value lengths, [b] each: a padding
    mask's), the bottom-right corner is each batch's own; `bias` (pre- or
    post-scale: (type, [.., h, s, skv])) is added to the scores. A query
    with no key left gives zeros."""
    s, b, h, d = q.shape
    skv, g = k.shape[0], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k)
    if bias is not None and bias[0] == "pre_scale_bias":
        scores = scores + bias[1]
    scores = scores / math.sqrt(d)
    if bias is not None and bias[0] == "post_scale_bias":
        scores = scores + bias[1]
    causal = "causal" in mask_type
    offset = torch.tensor(0 if mask_type in ("causal", "padding_causal") else skv - s).view(1, 1, 1, 1)
    if lengths is not None and mask_type not in ("causal", "padding_causal"):
        offset = (lengths[1] - lengths[0]).view(b, 1, 1, 1)
    i = torch.arange(s).view(1, 1, s, 1) + offset
    j = torch.arange(skv).view(1, 1, 1, skv)
    band = torch.ones(i.shape[0], 1, s, skv, dtype=torch.bool)
    if causal:
        band &= j <= i
    if window is not None and window[0] >= 0:
        band &= j >= i - window[0]
    if window is not None and window[1] >= 0 and not causal:
        band &= j <= i + window[1]
    keep = band if allowed is None else band & allowed.to(torch.bool)
    keep = keep.expand(b, h, s, skv)
    empty = ~keep.any(-1, keepdim=True)
    scores = scores.masked_fill(~(keep | empty), float("-inf"))
    probs = scores.softmax(-1).masked_fill(empty, 0.0)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
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


def _qk_norm(q, k, p, prefix, cfg):
    """MultiheadAttention's qk_norm_type: each head's query and key
    normalised (q_norm, k_norm; eps qk_norm_eps)."""
    eps = cfg.get("qk_norm_eps", 1e-6)
    return tuple(norm(t, p[f"{prefix}{n}.weight"], p.get(f"{prefix}{n}.bias"), eps, cfg["qk_norm"], False)
                 for t, n in ((q, "q_norm"), (k, "k_norm")))


def mha(x, p, prefix, cfg, encoder_output=None, freqs=None, mask_type="causal", window=None, allowed=None,
        lengths=None, bias=None):
    """Self-attention (encoder_output None) or cross-attention of
    MultiheadAttention's parameters under `prefix` (`allowed`, `lengths`,
    `bias`: attention's). Returns (output before the projection's bias, the
    projection's bias or None, the norm's output or None). freqs: one angle
    table, or (the query's, the key's); cfg's qk_norm ("RMSNorm" /
    "LayerNorm"), qk_norm_eps and qk_norm_before_rope normalise each head's
    query and key."""
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
    qk_norm, before = cfg.get("qk_norm"), cfg.get("qk_norm_before_rope", False)
    if qk_norm and before:
        q, k = _qk_norm(q, k, p, prefix, cfg)
    if freqs is not None:
        q_freqs, k_freqs = freqs if isinstance(freqs, tuple) else (freqs, freqs)
        q, k = rotate(q, q_freqs, cfg.get("rope_interleaved", False)), rotate(k, k_freqs,
                                                                                cfg.get("rope_interleaved", False))
    if qk_norm and not before:
        q, k = _qk_norm(q, k, p, prefix, cfg)
    ctx = attention(q, k, v, mask_type, window, allowed, lengths, bias)
    return F.linear(ctx, p[prefix + "proj.weight"]), p.get(prefix + "proj.bias"), ln_out


def transformer_layer(x, p, cfg, encoder_output=None, freqs=None):
    """TransformerLayer without dropout, x [s, b, hidden] (sbhd). cfg: heads,
    groups, kv_channels, interleaved, eps, normalization, zcg, activation,
    post_ln (apply_residual_connection_post_layernorm), output_ln,
    parallel (parallel_attention_mlp), decoder, mask_type, window, allowed
    (self-attention's extra mask, True: attend), lengths, bias, and
    cross-attention's enc_mask_type, enc_window, enc_allowed, enc_lengths."""
    def add(out, bias, residual):
        return residual + (out + bias if bias is not None else out)

    mask, window = cfg.get("mask_type", "causal"), cfg.get("window")
    out, bias, ln_out = mha(x, p, "self_attention.", cfg, freqs=freqs, mask_type=mask, window=window,
                            allowed=cfg.get("allowed"), lengths=cfg.get("lengths"), bias=cfg.get("bias"))
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
                                mask_type=cfg.get("enc_mask_type", "no_mask"), window=cfg.get("enc_window"),
                                allowed=cfg.get("enc_allowed"), lengths=cfg.get("enc_lengths"))
        h = add(out, bias, ln_out if post_ln else h)
    bias2 = mlp_p.pop("fc2_bias", None)
    mlp_out, mlp_ln = layernorm_mlp(h, mlp_p, **mlp_kw)
    y = add(mlp_out, bias2, mlp_ln if post_ln else h)
    if cfg.get("output_ln"):
        y = norm(y, p["layernorm.weight"], p.get("layernorm.bias"), cfg.get("eps", 1e-5),
                 cfg.get("normalization", "LayerNorm"), cfg.get("zcg", False))
    return y
