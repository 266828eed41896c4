"""TE's LayerNorm / RMSNorm modules and DotProductAttention against float64
references written out in plain PyTorch (explicit mean/variance; explicit
scores, masks and softmax)."""
import math

import pytest
import torch
import torch.nn.functional as F

import transformer_engine_c as te
from helpers import rel_err

torch.manual_seed(0)


# ------------------------------------------------------------------ norms

def ref_norm(x, g, b, eps, zero_centered, rms):
    x = x.double()
    g = g.double() + (1 if zero_centered else 0)
    if rms:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * g + b.double()


@pytest.mark.parametrize("rms", [False, True], ids=["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_forward_backward(rms, zero_centered):
    cls = te.RMSNorm if rms else te.LayerNorm
    m = cls(24, eps=1e-5, sequence_parallel=True, zero_centered_gamma=zero_centered, device="cpu")
    assert [n for n, _ in m.named_parameters()] == (["weight"] if rms else ["weight", "bias"])
    assert all(p.sequence_parallel for p in m.parameters())
    assert torch.equal(m.weight, torch.zeros(24) if zero_centered else torch.ones(24))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(5, 3, 24, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    params = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    xd = x.detach().double().requires_grad_()
    ref = ref_norm(xd, params["weight"], params.get("bias"), 1e-5, zero_centered, rms)
    assert rel_err(y, ref) < 1e-5
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert rel_err(x.grad, xd.grad) < 1e-5
    for n, p in m.named_parameters():
        assert rel_err(p.grad, params[n].grad) < 1e-5, n


def test_norm_bf16_and_arguments():
    m = te.LayerNorm(hidden_size=16, params_dtype=torch.bfloat16, device="cpu")
    assert m.weight.dtype == torch.bfloat16 and m.normalized_shape == (16,)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    ref = ref_norm(x, m.weight, m.bias, 1e-5, False, False)
    assert rel_err(m(x), ref) < 1e-2
    with pytest.raises(ValueError, match="last dimension must be 16"):
        m(torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="normalized_shape"):
        te.LayerNorm((4, 4))
    with pytest.raises(TypeError, match="normalized_shape"):
        te.RMSNorm()
    with pytest.raises(ValueError, match="eps"):
        te.RMSNorm(8, eps=-1.0)
    with pytest.raises(TypeError, match="float64"):
        te.RMSNorm(8, device="cpu")(torch.randn(2, 8, dtype=torch.float64))


# ------------------------------------------------------------------ attention

def ref_attention(q, k, v, allowed, scale):
    """q [b, h, sq, d], k/v [b, hk, skv, d] float64; allowed [b|1, h|1, sq, skv]
    True = attend; rows with nothing allowed give 0."""
    h, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hk, 1)
    v = v.repeat_interleave(h // hk, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if allowed is not None:
        allowed = allowed.expand_as(s)
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1)
    if allowed is not None:
        p = torch.nan_to_num(p) * allowed.any(-1, keepdim=True)
    return p @ v


def tri(sq, skv, offset=0, left=-1):
    i = torch.arange(sq).view(-1, 1) + offset
    j = torch.arange(skv).view(1, -1)
    ok = j <= i
    if left >= 0:
        ok &= j >= i - left
    return ok


def make_qkv(b, s, skv, h, hk, d, fmt, dtype=torch.float32):
    shape = {"sbhd": lambda n, hh: (n, b, hh, d), "bshd": lambda n, hh: (b, n, hh, d)}[fmt]
    q = torch.randn(shape(s, h), dtype=dtype, requires_grad=True)
    k = torch.randn(shape(skv, hk), dtype=dtype, requires_grad=True)
    v = torch.randn(shape(skv, hk), dtype=dtype, requires_grad=True)
    return q, k, v


def to_bhsd(t, fmt):
    return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.transpose(1, 2)


def from_bhsd(t, fmt):
    t = t.permute(2, 0, 1, 3) if fmt == "sbhd" else t.transpose(1, 2)
    return t.reshape(t.shape[0], t.shape[1], -1)


CASES = [  # mask type, s_q, s_kv, window
    ("no_mask", 6, 6, None), ("causal", 6, 6, None), ("causal", 4, 6, None), ("causal_bottom_right", 4, 6, None),
    ("causal", 6, 6, (2, 0)), ("no_mask", 6, 6, (1, 1)), ("padding", 6, 6, None), ("padding_causal", 6, 6, None),
    ("arbitrary", 6, 6, None)]


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type,sq,skv,window", CASES)
def test_dot_product_attention(fmt, mask_type, sq, skv, window):
    b, h, hk, d = 2, 4, 2, 8
    attn = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask_type,
                                  window_size=window, attention_type="self" if sq == skv else "cross")
    q, k, v = make_qkv(b, sq, skv, h, hk, d, fmt)
    allowed = None
    mask = None
    if mask_type.startswith("causal"):
        off = skv - sq if mask_type.endswith("bottom_right") else 0
        allowed = tri(sq, skv, off, window[0] if window else -1).view(1, 1, sq, skv)
    elif window is not None:
        i, j = torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)
        allowed = ((j <= i + window[1]) & (j >= i - window[0])).view(1, 1, sq, skv)
    if mask_type.startswith("padding"):
        lens = [sq, sq - 2]
        pad = torch.stack([torch.arange(sq) >= n for n in lens]).view(b, 1, 1, sq)  # True = padded
        mask = pad
        ok = (~pad).view(b, 1, sq, 1) & (~pad).view(b, 1, 1, sq)
        if mask_type == "padding_causal":
            ok = ok & tri(sq, skv).view(1, 1, sq, skv)
        allowed = ok
    elif mask_type == "arbitrary":
        mask = torch.rand(b, 1, sq, skv) < 0.3
        mask[0, 0, 1] = True  # a row with nothing to attend to
        allowed = ~mask
    out = attn(q, k, v, attention_mask=mask)
    assert out.shape == ((sq, b, h * d) if fmt == "sbhd" else (b, sq, h * d))
    qd, kd, vd = (to_bhsd(t.detach().double(), fmt).requires_grad_() for t in (q, k, v))
    ref = from_bhsd(ref_attention(qd, kd, vd, allowed, 1 / math.sqrt(d)), fmt)
    assert rel_err(out, ref) < 1e-5
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    for t, r, n in ((q, qd, "q"), (k, kd, "k"), (v, vd, "v")):
        assert rel_err(t.grad, from_bhsd(r.grad, fmt).view(t.shape)) < 1e-5, n


@pytest.mark.parametrize("bottom_right", [None, False, True])
def test_dot_product_attention_window_alignment(bottom_right):
    """TE's bottom_right_diagonal: None aligns a no_mask window bottom-right
    (causal's top-left); False / True choose."""
    sq, skv, d = 4, 7, 8
    attn = te.DotProductAttention(2, d, attn_mask_type="no_mask", window_size=(1, 1), attention_type="cross",
                                  bottom_right_diagonal=bottom_right)
    q, k, v = make_qkv(1, sq, skv, 2, 2, d, "sbhd")
    off = 0 if bottom_right is False else skv - sq
    i, j = torch.arange(sq).view(-1, 1) + off, torch.arange(skv).view(1, -1)
    allowed = ((j <= i + 1) & (j >= i - 1)).view(1, 1, sq, skv)
    ref = from_bhsd(ref_attention(*(to_bhsd(t.detach().double(), "sbhd") for t in (q, k, v)), allowed,
                                  1 / math.sqrt(d)), "sbhd")
    assert rel_err(attn(q, k, v), ref) < 1e-5
    i2 = torch.arange(sq).view(-1, 1) + (skv - sq - off)  # the other alignment: must differ
    wrong = ((j <= i2 + 1) & (j >= i2 - 1)).view(1, 1, sq, skv)
    bad = from_bhsd(ref_attention(*(to_bhsd(t.detach().double(), "sbhd") for t in (q, k, v)), wrong,
                                  1 / math.sqrt(d)), "sbhd")
    assert rel_err(attn(q, k, v), bad) > 1e-3


def test_dot_product_attention_thd_and_scale():
    h, d = 2, 8
    attn = te.DotProductAttention(h, d, qkv_format="thd", attn_mask_type="padding_causal", softmax_scale=0.3)
    lens = [3, 5, 1]
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, h, d, requires_grad=True) for _ in range(3))
    out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    assert out.shape == (9, h * d)
    pieces, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        qi, ki, vi = (t.detach()[sl].double().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        pieces.append(ref_attention(qi, ki, vi, tri(n, n).view(1, 1, n, n), 0.3)[0].transpose(0, 1))
        start += n
    ref = torch.cat(pieces).reshape(9, h * d)
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attn(q, k, v)


def test_dot_product_attention_dropout_under_tracker():
    tracker = te.distributed.CudaRNGStatesTracker(device="cpu")
    tracker.add("model-parallel-rng", 11)
    attn = te.DotProductAttention(2, 8, attention_dropout=0.5, attn_mask_type="no_mask",
                                  get_rng_state_tracker=lambda: tracker)
    q, k, v = (torch.randn(4, 1, 2, 8) for _ in range(3))
    before = torch.get_rng_state()
    a = attn(q, k, v)
    assert torch.equal(torch.get_rng_state(), before), "dropout drew from the default generator"
    b = attn(q, k, v)
    assert not torch.equal(a, b), "the tracker's state did not advance"
    tracker2 = te.distributed.CudaRNGStatesTracker(device="cpu")
    tracker2.add("model-parallel-rng", 11)
    attn2 = te.DotProductAttention(2, 8, attention_dropout=0.5, attn_mask_type="no_mask",
                                   get_rng_state_tracker=lambda: tracker2)
    assert torch.equal(attn2(q, k, v), a), "the same tracker seed gave another mask"
    attn.eval()
    ref = from_bhsd(ref_attention(*(to_bhsd(t.double(), "sbhd") for t in (q, k, v)), None, 1 / math.sqrt(8)),
                    "sbhd")
    assert rel_err(attn(q, k, v), ref) < 1e-5  # no dropout in eval


def test_dot_product_attention_kept_plans_follow_changes():
    """The plan kept per (format, mask type, window, diagonal) follows a
    changed attribute or argument, another sequence length and dtype: each
    call gives what a fresh layer gives, and a bad value still raises."""
    torch.manual_seed(0)
    d = 8

    def fresh(q, k, v, **kw):
        return te.DotProductAttention(2, d, attention_type="cross")(q, k, v, **kw)

    attn = te.DotProductAttention(2, d, attention_type="cross")
    q, k, v = (torch.randn(6, 1, 2, d) for _ in range(3))
    assert torch.equal(attn(q, k, v), fresh(q, k, v))  # causal
    attn.attn_mask_type = "no_mask"  # an attribute changed after the first call
    assert torch.equal(attn(q, k, v), fresh(q, k, v, attn_mask_type="no_mask"))
    assert not torch.allclose(attn(q, k, v), fresh(q, k, v))
    attn.window_size = (1, 1)
    assert torch.equal(attn(q, k, v), fresh(q, k, v, attn_mask_type="no_mask", window_size=(1, 1)))
    attn.window_size = None
    for kw in (dict(window_size=[2, 0], attn_mask_type="causal"), dict(attn_mask_type="causal_bottom_right"),
               dict(attn_mask_type="no_mask", window_size=(1, 1), bottom_right_diagonal=False)):
        assert torch.equal(attn(q, k[:4], v[:4], **kw), fresh(q, k[:4], v[:4], **kw)), kw
    q2, k2, v2 = (torch.randn(3, 2, 2, d, dtype=torch.bfloat16) for _ in range(3))  # other lengths, dtype
    assert torch.equal(attn(q2, k2, v2, attn_mask_type="causal"), fresh(q2, k2, v2, attn_mask_type="causal"))
    bq, bk, bv = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    assert torch.equal(attn(bq, bk, bv, qkv_format="bshd"), fresh(q, k, v, attn_mask_type="no_mask").transpose(0, 1))
    attn.qkv_format = "bshd"
    assert torch.equal(attn(bq, bk, bv), fresh(q, k, v, attn_mask_type="no_mask").transpose(0, 1))
    with pytest.raises(ValueError, match="qkv_format"):
        attn(q, k, v, qkv_format="sbdh")
    with pytest.raises(ValueError, match="window_size"):
        attn(bq, bk, bv, attn_mask_type="causal", window_size=(1, 1))
    with pytest.raises(ValueError, match="window_size"):
        attn(bq, bk, bv, attn_mask_type="causal", window_size=(1, 1))  # not kept after raising
    with pytest.raises(ValueError, match="4-D"):
        attn(bq[0], bk, bv)


def test_dot_product_attention_kept_bands():
    """The causal-diagonal and window masks kept per (lengths, mask type,
    window, diagonal, device) give the reference's result for each key in
    turn, and again after other keys pushed them out; rows with no key come
    out zero; a bias is masked by the kept band; the kept masks stay as
    made."""
    from transformer_engine_c.attention import dot_product_attention as dpa_mod
    torch.manual_seed(0)
    dpa_mod._BANDS.clear()
    d = 8
    cases = [("causal", 6, 6, (2, 0), None), ("causal_bottom_right", 7, 4, None, None),
             ("causal", 4, 6, None, None), ("no_mask", 5, 8, (1, 1), None), ("no_mask", 5, 6, (1, 1), None),
             ("no_mask", 5, 8, (1, 1), False),
             ("causal", 9, 9, (3, 0), None)]
    cases += [("no_mask", n, n, (1, 0), None) for n in range(2, 2 + dpa_mod._BANDS_KEPT)]

    def allowed_of(mask_type, sq, skv, window, br):
        left, right = (-1, 0) if window is None else window
        bottom_right = mask_type not in ("causal",) if br is None else br
        i = torch.arange(sq).view(-1, 1) + ((skv - sq) if bottom_right or mask_type.endswith("bottom_right") else 0)
        j = torch.arange(skv).view(1, -1)
        ok = torch.ones(sq, skv, dtype=torch.bool)
        if right != -1:
            ok &= j <= i + right
        if left != -1:
            ok &= j >= i - left
        return ok.view(1, 1, sq, skv)

    for rnd in range(2):  # the second round after the later keys pushed the first ones out
        for mask_type, sq, skv, window, br in cases:
            attn = te.DotProductAttention(2, d, attn_mask_type=mask_type, window_size=window,
                                          bottom_right_diagonal=br, attention_type="cross")
            q, k, v = make_qkv(2, sq, skv, 2, 2, d, "sbhd")
            ref = from_bhsd(ref_attention(*(to_bhsd(t.detach().double(), "sbhd") for t in (q, k, v)),
                                          allowed_of(mask_type, sq, skv, window, br), 1 / math.sqrt(d)), "sbhd")
            out = attn(q, k, v)
            assert rel_err(out, ref) < 1e-5, (rnd, mask_type, sq, skv, window, br)
            out.backward(torch.randn_like(out))
            assert len(dpa_mod._BANDS) <= dpa_mod._BANDS_KEPT
    q, k, v = make_qkv(1, 7, 4, 2, 2, d, "sbhd")
    out = te.DotProductAttention(2, d, attn_mask_type="causal_bottom_right", attention_type="cross")(q, k, v)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))  # queries before the first key's diagonal
    band = dpa_mod._BANDS[(7, 4, "causal_bottom_right", (-1, 0), True, torch.device("cpu"))]
    want = allowed_of("causal_bottom_right", 7, 4, None, None)
    assert band.empty is not None and torch.equal(band.mask[0, 0, 3:], want[0, 0, 3:])  # as made
    bias = torch.randn(1, 2, 6, 6)
    attn = te.DotProductAttention(2, d, attn_mask_type="causal", window_size=(2, 0))
    q, k, v = make_qkv(1, 6, 6, 2, 2, d, "sbhd")
    out = attn(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    qd, kd, vd = (to_bhsd(t.detach().double(), "sbhd") for t in (q, k, v))
    ok = allowed_of("causal", 6, 6, (2, 0), None)
    s_ = (qd @ kd.transpose(-1, -2)) / math.sqrt(d) + bias.double()
    ref = from_bhsd(torch.softmax(s_.masked_fill(~ok, float("-inf")), -1) @ vd, "sbhd")
    assert rel_err(out, ref) < 1e-5


def test_dot_product_attention_refusals():
    with pytest.raises(ValueError, match="attn_mask_type"):
        te.DotProductAttention(2, 8, attn_mask_type="diagonal")
    with pytest.raises(ValueError, match="num_gqa_groups"):
        te.DotProductAttention(4, 8, num_gqa_groups=3)
    with pytest.raises(NotImplementedError, match="softmax_type"):
        te.DotProductAttention(2, 8, softmax_type="learnable")
    attn = te.DotProductAttention(2, 8)
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(NotImplementedError, match="FP8 attention"):
        attn(q, q, q, fp8_output=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=te.recipe.DelayedScaling()):  # high precision, as TE's
        assert torch.equal(attn(q, q, q), attn.eval()(q, q, q))
    with pytest.raises(NotImplementedError, match="ALiBi"):
        attn(q, q, q, core_attention_bias_type="alibi")
    with pytest.raises(ValueError, match="holds 2 query"):
        attn(torch.randn(4, 1, 3, 8), q, q)
    with pytest.raises(ValueError, match="attention_mask is required"):
        te.DotProductAttention(2, 8, attn_mask_type="padding")(q, q, q)
    assert "_extra_state" in attn.state_dict() and attn.state_dict()["_extra_state"].numel() == 0


@pytest.mark.parametrize("mask_type,window", [("padding_causal_bottom_right", None),
                                               ("padding_causal_bottom_right", (1, 0)), ("padding", (1, 2))])
def test_dot_product_attention_padding_diagonal_per_sequence(mask_type, window):
    """Under a padding mask the bottom-right diagonal (of the
    *_bottom_right types, and of a window on `padding`) sits at each
    sequence's own corner, its actual key/value length less its query
    length, as TE's: cross-attention over padded batches equals each
    sequence alone without padding."""
    torch.manual_seed(0)
    b, sq, skv, lens_q, lens_kv = 2, 5, 7, [3, 5], [6, 2]
    q, k, v = torch.randn(b, sq, 2, 8), torch.randn(b, skv, 2, 8), torch.randn(b, skv, 2, 8)
    q_mask = (torch.arange(sq).view(1, sq) >= torch.tensor(lens_q).view(b, 1)).view(b, 1, 1, sq)
    kv_mask = (torch.arange(skv).view(1, skv) >= torch.tensor(lens_kv).view(b, 1)).view(b, 1, 1, skv)
    attn = te.DotProductAttention(2, 8, qkv_format="bshd", attention_type="cross")
    out = attn(q, k, v, attention_mask=(q_mask, kv_mask), attn_mask_type=mask_type, window_size=window)
    alone = mask_type.replace("padding_", "").replace("padding", "no_mask")
    for i, (lq, lk) in enumerate(zip(lens_q, lens_kv)):
        ref = attn(q[i:i + 1, :lq], k[i:i + 1, :lk], v[i:i + 1, :lk], attn_mask_type=alone, window_size=window)
        torch.testing.assert_close(out[i, :lq], ref[0])


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask", "causal_bottom_right"])
def test_dot_product_attention_bias(bias_type, mask_type):
    """core_attention_bias is added to the scores after the scale
    (post_scale_bias) or before it (pre_scale_bias), and the mask type
    still applies (a causal mask with a bias among them)."""
    torch.manual_seed(0)
    b, h, s, d = 2, 2, 5, 8
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask_type)
    q, k, v = make_qkv(b, s, s, h, h, d, "bshd")
    bias = torch.randn(1, h, s, s)
    out = attn(q, k, v, core_attention_bias_type=bias_type, core_attention_bias=bias)
    qd, kd, vd = (to_bhsd(t, "bshd").double() for t in (q, k, v))
    scale = 1 / math.sqrt(d)
    scores = (qd @ kd.transpose(-1, -2) + bias.double()) * scale if bias_type == "pre_scale_bias" else \
        (qd @ kd.transpose(-1, -2)) * scale + bias.double()
    if mask_type != "no_mask":
        scores = scores.masked_fill(~tri(s, s).view(1, 1, s, s), float("-inf"))
    ref = from_bhsd(torch.softmax(scores, -1) @ vd, "bshd")
    assert rel_err(out, ref) < 1e-5


def test_dot_product_attention_mask_and_cu_seqlens_checks():
    """Masks of the wrong shape and cu_seqlens beyond the input raise a
    ValueError naming the argument (not an error of an indexing op)."""
    q = torch.randn(4, 2, 2, 8)
    padding = te.DotProductAttention(2, 8, attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"attention_mask: the query padding mask must be \[b, 1, 1, s\]"):
        padding(q, q, q, attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key/value padding mask"):
        padding(q, q, q, attention_mask=(torch.zeros(2, 1, 1, 4, dtype=torch.bool),
                                         torch.zeros(2, 1, 1, 3, dtype=torch.bool)))
    arbitrary = te.DotProductAttention(2, 8, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="attention_mask: an arbitrary mask must broadcast"):
        arbitrary(q, q, q, attention_mask=torch.zeros(2, 1, 4, 5, dtype=torch.bool))
    thd = te.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal")
    t = torch.randn(5, 2, 8)

    def cu(*v):
        return torch.tensor(v, dtype=torch.int32)

    with pytest.raises(ValueError, match="cu_seqlens_q describes 6 tokens; the input holds 5"):
        thd(t, t, t, cu_seqlens_q=cu(0, 3, 6), cu_seqlens_kv=cu(0, 3, 5))
    with pytest.raises(ValueError, match="cu_seqlens_kv must be non-decreasing"):
        thd(t, t, t, cu_seqlens_q=cu(0, 3, 5), cu_seqlens_kv=cu(0, 3, 2))
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        thd(t, t, t, cu_seqlens_q=cu(0, 3, 5), cu_seqlens_kv=cu(0, 3, 5), cu_seqlens_q_padded=cu(0, 2, 5),
            cu_seqlens_kv_padded=cu(0, 3, 5))
    assert thd(t, t, t, cu_seqlens_q=cu(0, 2, 4), cu_seqlens_kv=cu(0, 2, 4)).shape == (5, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_norms_attention_grouped(dtype):
    """The engine's CUDA norm kernels, PyTorch's fused attention kernels and
    the grouped GEMMs on the GPU against the float64 references."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rms in (False, True):
        m = (te.RMSNorm if rms else te.LayerNorm)(64, params_dtype=dtype, device="cuda")
        x = torch.randn(7, 64, device="cuda", dtype=dtype, requires_grad=True)
        y = m(x)
        ref = ref_norm(x.detach().cpu(), m.weight.detach().cpu(), None if rms else m.bias.detach().cpu(), 1e-5,
                       False, rms)
        assert rel_err(y, ref) < tol
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    for mask_type in ("causal", "no_mask", "padding_causal"):
        attn = te.DotProductAttention(4, 64, num_gqa_groups=2, attn_mask_type=mask_type)
        q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in make_qkv(2, 16, 16, 4, 2, 64, "sbhd"))
        mask = None
        allowed = tri(16, 16).view(1, 1, 16, 16) if "causal" in mask_type else None
        if mask_type == "padding_causal":
            pad = torch.stack([torch.arange(16) >= n for n in (16, 11)]).view(2, 1, 1, 16)
            mask = pad.cuda()
            allowed = allowed & (~pad).view(2, 1, 16, 1) & (~pad).view(2, 1, 1, 16)
        out = attn(q, k, v, attention_mask=mask)
        ref = from_bhsd(ref_attention(*(to_bhsd(t.detach().double().cpu(), "sbhd") for t in (q, k, v)), allowed,
                                      1 / 8), "sbhd")
        assert rel_err(out, ref) < (2e-5 if dtype == torch.float32 else 2e-2), mask_type
        out.float().sum().backward()
        assert torch.isfinite(q.grad).all()
    g = te.GroupedLinear(3, 32, 16, bias=False, params_dtype=dtype, device="cuda")
    x = torch.randn(9, 32, device="cuda", dtype=dtype)
    y = g(x, [2, 3, 4])
    ref = torch.cat([F.linear(xi.double().cpu(), getattr(g, f"weight{i}").double().cpu())
                     for i, xi in enumerate(torch.split(x, [2, 3, 4]))])
    assert rel_err(y, ref) < tol
