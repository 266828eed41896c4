"""TransformerLayer and MultiheadAttention over randomly drawn
configurations, against the float64 reference of transformer_reference.py:
the layer type (encoder, decoder with an encoder output), every mask type
with its padding / arbitrary masks, sliding windows, given to the
constructor or to forward, the formats (sbhd, bshd, thd with cu_seqlens
and padding between the sequences), grouped-query heads, kv_channels,
fused / interleaved / split qkv, bias, every activation, LayerNorm /
RMSNorm, zero-centred gamma, layernorm_epsilon, the residual variants
(post-LN, output_layernorm, parallel_attention_mlp), RoPE (interleaved or
not, partial, a query and a key table), qk_norm, core_attention_bias,
MHA's input_layernorm / return_layernorm_output / return_bias, fused
weight gradients, checkpoint_core_attention and tec.checkpoint, a second
step after an update of the weights, no_grad / inference_mode, fp32 / bf16
/ fp16 (or float32 under torch.autocast), FP8 autocast (delayed, current and
block scaling), set_parallel_mode on one rank, dropout and drop_path
(checked bit for bit only), strided inputs, no and one token. The layers
run on the CPU (or on a configuration's `device`). Each configuration runs once;
its outputs and every gradient must be within the dtype's error of the
reference, and it must give the same bits without checkpointing, without
autograd, and from a fresh layer that loads its state dict after a step.
A tenth of the configurations are misused (a bad mask, cu_seqlens past
the input, too few angles, ...) and must raise a ValueError, TypeError or
NotImplementedError naming what is wrong. A fixed sample of
configurations runs here; `configs` draws more for a longer search."""
import collections
import contextlib
import random

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from helpers import one_thread
from transformer_reference import mha, transformer_layer

ACTIVATIONS = ("gelu", "relu", "qgelu", "srelu", "silu", "geglu", "reglu", "qgeglu", "sreglu", "swiglu",
               "clamped_swiglu", "glu")
MASKS = ("causal", "padding", "no_mask", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right",
         "arbitrary")
CROSS_MASKS = ("no_mask", "padding", "arbitrary", "causal_bottom_right", "padding_causal_bottom_right")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# relative error of the whole tensor against float64: outputs, gradients (bf16's and FP8's gradients sum
# many rounded products, some of them near cancellation: a relu's, or a bias of one head's)
TOL = {"fp32": (2e-5, 1e-4), "fp16": (1e-2, 0.05), "bf16": (4e-2, 0.15), "fp8": (0.15, 0.4)}
FLOOR = {"fp32": 3e-3, "fp16": 1e-2, "bf16": 3e-2, "fp8": 3e-2}
ALLOWED_ERRORS = (ValueError, TypeError, NotImplementedError)


def _window(rng, mask):
    if rng.random() < 0.6:
        return None
    left = rng.choice([-1, 0, 1, 2, 4])
    right = rng.choice([0, -1]) if "causal" in mask else rng.choice([-1, 0, 1, 3])
    return (left, right)


def random_config(rng):
    """One configuration (plain data, printable as a reproducer's argument)."""
    kind = "MHA" if rng.random() < 0.25 else "TL"
    heads = rng.choice([1, 2, 4])
    c = dict(kind=kind, seed=rng.randrange(10000), hidden=rng.choice([32, 48, 64]), heads=heads,
             groups=rng.choice([g for g in (1, 2, 4) if heads % g == 0] + [None]),
             kv=rng.choice([None, None, 8, 12, 16]), ffn=rng.choice([32, 48, 64]),
             fmt=rng.choice(["sbhd", "bshd", "thd"]), fuse_qkv=rng.random() < 0.5,
             interleaved=rng.random() < 0.5, bias=rng.random() < 0.7, act=rng.choice(ACTIVATIONS),
             norm=rng.choice(["LayerNorm", "RMSNorm"]), zcg=rng.random() < 0.3,
             dtype=rng.choice(["fp32", "fp32", "bf16", "fp16"]), b=rng.choice([1, 2, 3]),
             s=rng.choice([0, 1, 1, 2, 3, 5, 8, 8, 12, 16, 40]), s_enc=rng.choice([0, 1, 3, 4, 8, 11, 33]))
    masks = [m for m in MASKS if c["fmt"] != "thd" or m != "arbitrary"]
    c["mask"] = rng.choice(masks)
    c["window"] = _window(rng, c["mask"])
    cross = kind == "TL" and rng.random() < 0.35 or kind == "MHA" and rng.random() < 0.4
    c["cross"] = cross
    if cross:
        c["enc_mask"] = rng.choice([m for m in CROSS_MASKS if c["fmt"] != "thd" or m != "arbitrary"])
        c["enc_window"] = _window(rng, c["enc_mask"])
    if kind == "TL":
        c.update(post_ln=rng.random() < 0.25, output_ln=rng.random() < 0.25)
        c["parallel"] = not cross and not c["post_ln"] and not c["output_ln"] and rng.random() < 0.3
    else:
        c.update(input_ln=rng.random() < 0.6, return_bias=rng.random() < 0.5)
        c["ret_ln"] = c["input_ln"] and rng.random() < 0.5
    # thd: padding rows between the sequences (cu_seqlens_*_padded, pad_between_seqs)
    c["pad_between"] = c["fmt"] == "thd" and rng.random() < 0.4
    c["rope"] = rng.choice([None, None, "plain", "interleaved"])
    c["rope_percent"] = rng.choice([1.0, 0.5])
    c["rope_pair"] = c["rope"] is not None and rng.random() < 0.2  # (query's angles, key's angles)
    c["qk_norm"] = rng.choice([None] * 4 + ["RMSNorm", "LayerNorm"])
    c["qk_before"] = rng.random() < 0.5
    c["at_forward"] = rng.random() < 0.2  # mask types and windows given to forward, not the constructor
    # core_attention_bias (self-attention only: TransformerLayer gives it to both attentions)
    c["attn_bias"] = rng.choice([None] * 6 + ["post_scale_bias", "pre_scale_bias"]) \
        if c["fmt"] != "thd" and not cross else None
    c["fuse_wgrad"] = c["fuse_qkv"] and rng.random() < 0.3
    c["ckpt"] = rng.choice([None, None, None, "core", "reentrant", "nonreentrant"])
    c["grad"] = rng.choice(["train"] * 6 + ["nograd", "inference"])
    # dropout: no reference, the checkpointed run and the loaded layer against the plain one only
    c["dropout"] = 0.2 if c["grad"] == "train" and rng.random() < 0.1 else 0.0
    c["eps"] = rng.choice([1e-5, 1e-3])
    c["strided"] = rng.random() < 0.1  # the inputs views of every other element of wider tensors
    c["second_step"] = rng.random() < 0.2  # after a step of SGD, against the reference again
    c["parallel_mode"] = rng.random() < 0.15  # set_parallel_mode on one rank
    # the input: of the parameters' dtype, or float32 under torch.autocast (bf16) to float32 parameters
    c["input"] = rng.choice([None, None, None, "amp"]) if c["dtype"] == "fp32" else None
    hn = c["kv"] or c["hidden"] // heads
    dims = (c["hidden"], c["ffn"], hn * heads, hn * (c["groups"] or heads))
    # a misuse (MISUSES) in some: the run must raise a Python exception naming what is wrong
    c["misuse"] = rng.choice(sorted(MISUSES)) if rng.random() < 0.1 else None
    c["fp8"] = None
    if all(d % 16 == 0 for d in dims) and rng.random() < 0.25:
        c["fp8"] = rng.choice(["delayed", "current", "block"])
        if rng.random() < 0.8:  # FP8 GEMMs need a multiple of 8 tokens
            c["s"] = rng.choice([8, 16])
            c["s_enc"] = rng.choice([8, 16])
    return c


# misuse: (exception types, a word the message must hold)
MISUSES = {
    "gqa": ((ValueError,), "num_gqa_groups"),
    "causal_window": ((ValueError,), "window_size"),
    "no_cu_seqlens": ((ValueError,), "cu_seqlens"),
    "no_attention_mask": ((ValueError,), "attention_mask"),
    "float_mask": ((TypeError,), "attention_mask"),
    "mask_shape": ((ValueError,), "attention_mask"),
    "mask_type": ((ValueError,), "mask_type"),
    "short_freqs": ((ValueError,), "freqs"),
    "wide_freqs": ((ValueError,), "freqs"),
    "no_encoder_output": ((ValueError,), "encoder_output"),
    "hidden_size": ((ValueError,), "last dimension"),
    "arbitrary_shape": ((ValueError,), "attention_mask"),
    "cu_seqlens_total": ((ValueError,), "cu_seqlens"),
    "no_main_grad": ((RuntimeError,), "main_grad"),  # the engine's named error
    "input_dtype": ((TypeError,), "dtype"),
    "encoder_batch": ((ValueError,), "encoder_output"),
    "window_pair": ((ValueError,), "window_size"),
    "cu_seqlens_dtype": ((TypeError,), "cu_seqlens"),
    "mask_list": ((TypeError,), "attention_mask"),
    "hidden_dims": ((ValueError,), "hidden_states"),  # outside torch.autocast the input must have the parameters' dtype
}


def rng_fmt(c):
    return "sbhd" if c["fmt"] == "thd" else c["fmt"]


def _misused(c):
    """c with its misuse applied (a configuration that must raise)."""
    c, m = dict(c, fp8=None, window=None, enc_window=None, rope_pair=False), c["misuse"]
    if m == "gqa":
        c.update(heads=4, groups=3)
    elif m == "causal_window":
        c.update(mask="causal", window=(2, 2), kind="TL", cross=False, post_ln=False, output_ln=False,
                 parallel=False)
    elif m in ("no_cu_seqlens", "cu_seqlens_total"):
        c.update(fmt="thd", mask="padding_causal", enc_mask="padding", pad_between=False, s=max(c["s"], 2),
                 rope=None, attn_bias=None)
    elif m in ("no_attention_mask", "float_mask", "mask_shape"):
        c.update(fmt="sbhd", mask="padding", kind="TL", cross=False, post_ln=False, output_ln=False,
                 parallel=False, s=max(c["s"], 2))
    elif m == "mask_type":
        c.update(mask="diagonal", enc_mask="diagonal")
    elif m == "arbitrary_shape":
        c.update(fmt="sbhd", mask="arbitrary", kind="TL", cross=False, post_ln=False, output_ln=False,
                 parallel=False, s=max(c["s"], 2))
    elif m in ("short_freqs", "wide_freqs"):
        c.update(rope="plain", rope_percent=1.0, s=max(c["s"], 3), fmt="sbhd")
    elif m == "encoder_batch":
        c.update(cross=True, enc_mask="no_mask", parallel=False, fmt=rng_fmt(c), b=2)
    elif m == "window_pair":
        c.update(window=(3,), enc_window=(3,))
    elif m == "cu_seqlens_dtype":
        c.update(fmt="thd", mask="padding_causal", enc_mask="padding", pad_between=False, attn_bias=None)
    elif m == "mask_list":
        c.update(fmt="bshd", mask="arbitrary", enc_mask="arbitrary", s=max(c["s"], 1), s_enc=max(c["s_enc"], 1))
    elif m == "input_dtype":
        c.update(dtype="bf16", input="fp32")
    elif m == "no_main_grad":
        c.update(fuse_qkv=True, fuse_wgrad=True, grad="train", ckpt=None)
    elif m == "no_encoder_output":
        c.update(cross=True, enc_mask="no_mask", enc_window=None, parallel=False)
    return c


def _run_misused(c):
    """The misused configuration's forward and backward; None if it ran."""
    m, d = build(c), inputs(c)
    if c["misuse"] == "no_main_grad":
        for p in m.parameters():
            if hasattr(p, "main_grad"):
                del p.main_grad
    what = c["misuse"]
    if what == "no_attention_mask":
        d["mask"] = None
    elif what == "float_mask":
        d["mask"] = d["mask"].float()
    elif what == "mask_shape":
        d["mask"] = torch.zeros(c["b"], 1, 1, c["s"] + 1, dtype=torch.bool)
    elif what == "arbitrary_shape":
        d["mask"] = torch.zeros(c["b"], 1, c["s"], c["s"] + 1, dtype=torch.bool)
    elif what == "short_freqs":
        d["freqs"] = d["freqs"][:c["s"] - 1]
    elif what == "wide_freqs":
        hn = c["kv"] or c["hidden"] // c["heads"]
        d["freqs"] = te.RotaryPositionEmbedding(hn + 2)(c["s"]).cpu()
    elif what == "encoder_batch":
        d["enc"] = d["enc"][:, :1]
    elif what == "mask_list":
        d["mask"] = [d["mask"]]
    elif what == "hidden_size":
        d["x"] = torch.randn(*d["x"].shape[:-1], c["hidden"] + 8)
    elif what == "cu_seqlens_total":
        d["lens"] = [n + 1 for n in d["lens"]]  # more tokens than the input holds
        d["valid"] = torch.ones(sum(d["lens"]) - len(d["lens"]), dtype=torch.bool)
        d["x"] = torch.cat([d["x"], torch.zeros(1, *d["x"].shape[1:])])
    outs = forward(m, c, d, c["ckpt"], cu_lens=d["lens"] if what == "cu_seqlens_total" else None,
                   cu_dtype=torch.float32 if what == "cu_seqlens_dtype" else torch.int32,
                   extra_dim=what == "hidden_dims",
                   no_cu=what == "no_cu_seqlens", drop_encoder=what == "no_encoder_output")
    if c["grad"] == "train":
        sum(o.float().sum() for o in outs if o.requires_grad).backward()


def misuse_differences(c):
    c = _misused(c)
    types, word = MISUSES[c["misuse"]]
    try:
        te.fp8.FP8GlobalStateManager.reset()
        _run_misused(c)
    except types as e:
        if word not in str(e):
            return [f"misuse {c['misuse']}: {type(e).__name__} without {word!r}: {e}"]
        return []
    except Exception as e:  # noqa: BLE001  (reported)
        return [f"misuse {c['misuse']}: {type(e).__name__}: {e}"]
    return [f"misuse {c['misuse']}: ran"]


def configs(seed, n):
    rng = random.Random(seed)
    return [random_config(rng) for _ in range(n)]


# ------------------------------------------------------------ the package


def build(c):
    dtype = DTYPES[c["dtype"]]
    torch.manual_seed(c["seed"])
    common = dict(num_gqa_groups=c["groups"], kv_channels=c["kv"], fuse_qkv_params=c["fuse_qkv"],
                  qkv_weight_interleaved=c["interleaved"], bias=c["bias"], normalization=c["norm"],
                  zero_centered_gamma=c["zcg"], rotary_pos_interleaved=c["rope"] == "interleaved",
                  fuse_wgrad_accumulation=c["fuse_wgrad"], params_dtype=dtype, device=c.get("device", "cpu"),
                  qk_norm_type=c["qk_norm"], qk_norm_before_rope=c["qk_before"], layernorm_epsilon=c["eps"],
                  set_parallel_mode=c["parallel_mode"])
    fwd = c["at_forward"]
    if c["kind"] == "TL":
        m = te.TransformerLayer(
            c["hidden"], c["ffn"], c["heads"], hidden_dropout=c["dropout"], attention_dropout=c["dropout"],
            self_attn_mask_type="causal" if fwd else c["mask"], window_size=None if fwd else c["window"],
            enc_dec_attn_mask_type="no_mask" if fwd else c.get("enc_mask", "no_mask"),
            enc_dec_window_size=None if fwd else c.get("enc_window"),
            apply_residual_connection_post_layernorm=c["post_ln"], output_layernorm=c["output_ln"],
            parallel_attention_mlp=c["parallel"], layer_type="decoder" if c["cross"] else "encoder",
            activation=c["act"], attn_input_format=c["fmt"], drop_path_rate=c["dropout"], **common)
    else:
        m = te.MultiheadAttention(
            c["hidden"], c["heads"], attention_dropout=c["dropout"],
            attn_mask_type="causal" if fwd else c["enc_mask"] if c["cross"] else c["mask"],
            window_size=None if fwd else c["enc_window"] if c["cross"] else c["window"], return_bias=c["return_bias"],
            return_layernorm_output=c["ret_ln"], input_layernorm=c["input_ln"],
            attention_type="cross" if c["cross"] else "self", qkv_format=c["fmt"], **common)
    gen = torch.Generator().manual_seed(c["seed"])
    with torch.no_grad():  # norm parameters and biases away from their initial ones and zeros
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_((0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype))
    if c["fuse_wgrad"]:
        for p in m.parameters():
            if p.dim() == 2:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return m


def inputs(c):
    """The data of a configuration, in sbhd (thd: each sequence one batch of
    its own), its masks (True: masked out), lengths and angle table."""
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    b, s, se, h = c["b"], c["s"], c["s_enc"], c["hidden"]
    d = dict()
    if c["fmt"] == "thd":
        d["lens"] = [rng_int(gen, 0, s) for _ in range(b)]
        d["lens_enc"] = [rng_int(gen, min(1, se) if sum(d["lens"]) else 0, se) for _ in range(b)]
        d["pads"] = [rng_int(gen, 0, 2) if c["pad_between"] else 0 for _ in range(b)]
        d["pads_enc"] = [rng_int(gen, 0, 2) if c["pad_between"] else 0 for _ in range(b)]
        d["valid"] = _pack(torch.ones(s, b, 1, dtype=torch.bool), d["lens"], d["pads"], junk=False)[:, 0]
    d["x"] = torch.randn(s, b, h, generator=gen)
    d["enc"] = torch.randn(se, b, h, generator=gen)
    self_mask = c["mask"] if c["kind"] == "TL" or not c["cross"] else c["enc_mask"]
    d["mask"] = _mask(gen, self_mask, b, s, s if not c["cross"] or c["kind"] == "TL" else se,
                      c["kind"] == "MHA" and c["cross"])
    if c["cross"] and c["kind"] == "TL":
        d["enc_mask"] = _mask(gen, c["enc_mask"], b, s, se, True)
    if c["attn_bias"]:
        shape = rng_int(gen, 0, 1) or b, c["heads"], s, s
        d["bias"] = torch.randn(shape, generator=gen)
    if c["rope"]:
        hn = c["kv"] or h // c["heads"]
        rope = te.RotaryPositionEmbedding(hn, rotary_percent=c["rope_percent"], interleaved=c["rope"] == "interleaved")
        rows = max(s, se, 1) + (2 if c["pad_between"] else 0)  # the padding rows turn too
        d["freqs"] = rope(rows).cpu()  # the table is made on the GPU where there is one, as TE's
        if c["rope_pair"]:
            d["freqs"] = (d["freqs"], te.RotaryPositionEmbedding(
                hn, rotary_percent=c["rope_percent"], interleaved=c["rope"] == "interleaved", rotary_base=50.0)(rows).cpu())
    return d


def rng_int(gen, lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _mask(gen, mask_type, b, sq, skv, pair):
    if "padding" in mask_type:
        lq = torch.randint(0, sq + 1, (b,), generator=gen)
        lk = torch.randint(0, skv + 1, (b,), generator=gen) if pair else lq
        q = (torch.arange(sq).view(1, sq) >= lq.view(b, 1)).view(b, 1, 1, sq)
        k = (torch.arange(skv).view(1, skv) >= lk.view(b, 1)).view(b, 1, 1, skv)
        return (q, k) if pair else q
    if mask_type == "arbitrary":
        shape = (b, 1, sq, skv) if torch.rand((), generator=gen) < 0.5 else (1, 1, sq, skv)
        return torch.rand(shape, generator=gen) < 0.3
    return None


def _pack(t, lens, pads, junk=True):
    """sbhd [s, b, h] -> thd [sum(lens + pads), h]: each batch's first
    lens[i] rows, then pads[i] rows of junk (or zeros)."""
    pieces = []
    for i, (n, p) in enumerate(zip(lens, pads)):
        filler = torch.sin(torch.arange(p * t.shape[-1], dtype=torch.float32)).view(p, t.shape[-1]) * 3 if junk else \
            torch.zeros(p, t.shape[-1])
        pieces += [t[:n, i], filler.to(t.dtype)]
    return torch.cat(pieces) if pieces else t.new_zeros(0, t.shape[-1])


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist() if lens else []), dtype=torch.int32)


def _to_fmt(t, c, lens, pads=None, junk=True):
    if c["fmt"] == "bshd":
        return t.transpose(0, 1).contiguous()
    if c["fmt"] == "thd":
        return _pack(t, lens, pads, junk)
    return t.contiguous()


def make_recipe(name):
    return {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}[name]()


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _on(t, device):
    """t (a tensor, a pair of them or None) on device."""
    if isinstance(t, (tuple, list)):
        return type(t)(_on(u, device) for u in t)
    return None if t is None else t.to(device)


def forward(m, c, d, checkpoint, cu_lens=None, no_cu=False, drop_encoder=False, cu_dtype=torch.int32,
            extra_dim=False):
    """The module's outputs (a list) on the configuration's inputs (made on
    the CPU, given on the configuration's device); x and the encoder output
    as given to it in d["x_in"], d["enc_in"]."""
    dtype, dev = DTYPES[c["dtype"]], c.get("device", "cpu")
    x = _to_fmt(d["x"], c, d.get("lens"), d.get("pads")).to(dev, torch.float32 if c["input"] else dtype, copy=True)
    if cu_lens is not None:  # cu_seqlens of more tokens than x holds
        x = x[:int(d["valid"].numel())]
    enc = _to_fmt(d["enc"], c, d.get("lens_enc"), d.get("pads_enc")).to(dev, dtype, copy=True)
    if c["grad"] == "train":
        x.requires_grad_()
        enc.requires_grad_()
    d["x_in"], d["enc_in"] = x, enc
    if extra_dim:
        x = x.unsqueeze(0)
    if c["strided"]:
        x, enc = (torch.stack((t, torch.zeros_like(t)), -1).flatten(-2)[..., ::2] for t in (x, enc))
    kw = dict(rotary_pos_emb=_on(d.get("freqs"), dev))
    if c["attn_bias"]:
        # (a keyword argument: no gradient through the reentrant checkpoint, which refuses it)
        d["bias_in"] = d["bias"].to(dev, dtype, copy=True).requires_grad_(c["grad"] == "train"
                                                                         and c["ckpt"] != "reentrant")
        kw.update(core_attention_bias_type=c["attn_bias"], core_attention_bias=d["bias_in"])
    if c["at_forward"] and c["kind"] == "TL":
        kw.update(self_attn_mask_type=c["mask"], window_size=c["window"])
        if c["cross"]:
            kw.update(enc_dec_attn_mask_type=c["enc_mask"], enc_dec_window_size=c["enc_window"])
    elif c["at_forward"]:
        kw.update(attn_mask_type=c["enc_mask"] if c["cross"] else c["mask"],
                  window_size=c["enc_window"] if c["cross"] else c["window"])
    if c["fmt"] == "thd":
        cu, cu_enc = (_on(_cu(n).to(cu_dtype), dev) for n in (d["lens"] if cu_lens is None else cu_lens,
                                                                 d["lens_enc"]))
        mx, mx_enc = max(d["lens"] + [0]), max(d["lens_enc"] + [0])
        kw.update(cu_seqlens_q=cu, max_seqlen_q=mx)
        if c["cross"]:
            kw.update(cu_seqlens_kv=cu_enc, max_seqlen_kv=mx_enc)
        elif c["kind"] == "MHA":
            kw.update(cu_seqlens_kv=cu, max_seqlen_kv=mx)
        if c["pad_between"]:
            cu_pad = _on(_cu([n + p for n, p in zip(d["lens"], d["pads"])]), dev)
            cu_enc_pad = _on(_cu([n + p for n, p in zip(d["lens_enc"], d["pads_enc"])]), dev)
            kw.update(cu_seqlens_q_padded=cu_pad, pad_between_seqs=True,
                      cu_seqlens_kv_padded=cu_enc_pad if c["cross"] else cu_pad)
            if c["kind"] == "TL" and not c["cross"]:
                del kw["cu_seqlens_kv_padded"]
        if no_cu:
            kw = {k: v for k, v in kw.items() if not k.startswith("cu_seqlens")}
    else:
        kw["attention_mask"] = _on(d["mask"], dev)
    if c["kind"] == "TL":
        if c["cross"]:
            kw["encoder_output"] = enc
            if c["fmt"] != "thd":
                kw["enc_dec_attn_mask"] = _on(d.get("enc_mask"), dev)
    elif c["cross"]:
        kw["encoder_output"] = enc
    if drop_encoder:
        kw.pop("encoder_output", None)
    grad_ctx = {"train": contextlib.nullcontext, "nograd": torch.no_grad,
                "inference": torch.inference_mode}[c["grad"]]()
    fp8 = te.autocast(enabled=True, recipe=make_recipe(c["fp8"])) if c["fp8"] else contextlib.nullcontext()
    amp = torch.autocast(torch.device(dev).type, dtype=torch.bfloat16) if c["input"] == "amp" else \
        contextlib.nullcontext()
    with grad_ctx, amp, fp8:
        if checkpoint == "core":
            return _flat(m(x, checkpoint_core_attention=True, **kw))
        if checkpoint in ("reentrant", "nonreentrant"):
            # the encoder output positionally (the reentrant checkpoint's gradients are the positional inputs')
            args = (x,)
            if "encoder_output" in kw:
                mask = kw.pop("attention_mask", None)
                args = (x, mask, kw.pop("encoder_output")) if c["kind"] == "MHA" else \
                    (x, mask, kw.pop("self_attn_mask_type", None), kw.pop("window_size", None),
                     kw.pop("encoder_output"))
            return _flat(te.checkpoint(m, *args, use_reentrant=checkpoint == "reentrant", **kw))
        return _flat(m(x, **kw))


def run(c, checkpoint=None, m=None, grad=None, reset=True):
    """(module, inputs, outputs, dys, gradients {name: tensor}); `grad`
    overrides the configuration's grad mode."""
    if reset:
        te.fp8.FP8GlobalStateManager.reset()
    c = c if grad is None else dict(c, grad=grad)
    m = build(c) if m is None else m
    d = inputs(c)
    torch.manual_seed(c["seed"] + 3)  # dropout's
    outs = forward(m, c, d, checkpoint)
    gen = torch.Generator().manual_seed(c["seed"] + 2)
    dys = [torch.randn(o.shape, generator=gen) for o in outs]
    if "valid" in d:  # no gradient into the rows between the sequences
        dys = [dy * d["valid"].view(-1, 1) if dy.dim() == 2 else dy for dy in dys]
    grads = {}
    if c["grad"] == "train":
        loss = sum((o.float() * dy.to(o.device)).sum() for o, dy in zip(outs, dys) if o.requires_grad)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        grads["x"] = d["x_in"].grad
        if c["attn_bias"] and c["ckpt"] != "reentrant":
            grads["bias"] = d["bias_in"].grad
        if c["cross"]:
            grads["enc"] = d["enc_in"].grad
        for n, p in m.named_parameters():
            grads[n] = p.main_grad if hasattr(p, "main_grad") and p.dim() == 2 else p.grad
    return m, d, outs, dys, grads


# ------------------------------------------------------------ the reference


def _ref_cfg(c):
    return dict(eps=c["eps"], heads=c["heads"], groups=c["groups"] or c["heads"], kv_channels=c["kv"] or c["hidden"] // c["heads"],
                interleaved=c["fuse_qkv"] and c["interleaved"], normalization=c["norm"], zcg=c["zcg"],
                activation=c["act"], post_ln=c.get("post_ln"), output_ln=c.get("output_ln"),
                parallel=c.get("parallel"), decoder=c["cross"], rope_interleaved=c["rope"] == "interleaved",
                mask_type=c["mask"], window=_ref_window(c["window"], c["mask"]),
                qk_norm=c["qk_norm"], qk_norm_before_rope=c["qk_before"],
                enc_mask_type=c.get("enc_mask", "no_mask"), enc_window=_ref_window(c.get("enc_window"),
                                                                                   c.get("enc_mask", "")))


def _ref_window(window, mask_type):
    if window is None:
        return None
    return (window[0], 0 if "causal" in mask_type else window[1])


def _lengths(mask, mask_type, b):
    """TE's actual lengths of a padding mask (its unmasked positions), or None."""
    if mask is None or "padding" not in mask_type:
        return None
    q, kv = mask if isinstance(mask, tuple) else (mask, mask)
    return (~q).reshape(b, -1).sum(1), (~kv).reshape(b, -1).sum(1)


def _allowed(mask, mask_type, b, sq, skv):
    """TE's mask (True: masked out) as the reference's allowed-mask."""
    if mask is None:
        return None
    if isinstance(mask, tuple):
        return ~mask[0].view(b, 1, sq, 1) & ~mask[1].view(b, 1, 1, skv)
    if "padding" in mask_type:  # of self-attention
        return ~mask.view(b, 1, sq, 1) & ~mask.view(b, 1, 1, skv)
    return ~mask


def _ref_module(c, p, x, enc, freqs, cfg):
    """The reference's outputs (a list, as the module returns them), x and
    enc [s, b, hidden] float64."""
    if c["kind"] == "TL":
        return [transformer_layer(x, p, cfg, encoder_output=enc if c["cross"] else None, freqs=freqs)]
    mask_type, window = (cfg["enc_mask_type"], cfg["enc_window"]) if c["cross"] else (cfg["mask_type"],
                                                                                       cfg["window"])
    out, bias, ln_out = mha(x, p, "", cfg, encoder_output=enc if c["cross"] else None, freqs=freqs,
                            mask_type=mask_type, window=window, allowed=cfg.get("allowed"),
                            lengths=cfg.get("lengths"), bias=cfg.get("bias"))
    if c["return_bias"]:
        outs = [out, bias if bias is not None else torch.zeros(0, dtype=out.dtype)]
    else:
        outs = [out + bias if bias is not None else out]
    return outs + ([ln_out] if c["ret_ln"] else [])


def reference(c, m, d, dys):
    """(outputs, gradients) of the float64 reference on the module's
    parameters and the configuration's inputs, in the module's formats."""
    p = {n: t.detach().cpu().double().requires_grad_() for n, t in m.named_parameters()}
    x, enc = d["x"].double().requires_grad_(), d["enc"].double().requires_grad_()
    freqs = d.get("freqs")
    freqs = tuple(f.double() for f in freqs) if isinstance(freqs, tuple) else None if freqs is None else \
        freqs.double()
    cfg = _ref_cfg(c)
    b, s, se = c["b"], c["s"], c["s_enc"]
    if c["fmt"] != "thd":
        skv = se if c["cross"] and c["kind"] == "MHA" else s
        self_mask = c["enc_mask"] if c["cross"] and c["kind"] == "MHA" else c["mask"]
        cfg["allowed"] = _allowed(d["mask"], self_mask, b, s, skv)
        cfg["enc_allowed"] = _allowed(d.get("enc_mask"), c.get("enc_mask", ""), b, s, se)
        cfg["lengths"] = _lengths(d["mask"], self_mask, b)
        cfg["enc_lengths"] = _lengths(d.get("enc_mask"), c.get("enc_mask", ""), b)
        if c["attn_bias"]:
            bias = d["bias"].to(DTYPES[c["dtype"]]).double().requires_grad_()
            cfg["bias"] = (c["attn_bias"], bias)
        outs = _ref_module(c, p, x, enc, freqs, cfg)
        if c["fmt"] == "bshd":
            outs = [o.transpose(0, 1) if o.dim() == 3 else o for o in outs]
    else:  # each sequence alone, a batch of one, its mask type without padding
        for key in ("mask_type", "enc_mask_type"):
            cfg[key] = cfg[key].replace("padding_", "").replace("padding", "no_mask")
        pieces = []
        for i, (n, ne) in enumerate(zip(d["lens"], d["lens_enc"])):
            pieces.append(_ref_module(c, p, x[:n, i:i + 1], enc[:ne, i:i + 1], freqs, cfg))
        outs = []
        for k in range(len(_flat(dys))):
            if pieces and pieces[0][k].dim() == 1:  # the projection's bias
                outs.append(pieces[0][k])
            else:
                valid = torch.cat([pc[k][:, 0] for pc in pieces]) if pieces else \
                    torch.zeros(0, c["hidden"], dtype=torch.float64)
                outs.append(torch.zeros(len(d["valid"]), c["hidden"], dtype=torch.float64).index_put(
                    (d["valid"],), valid))
    grads = {}
    if c["grad"] == "train":
        loss = sum((o * dy.double()).sum() for o, dy in zip(outs, dys))
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
        grads["x"] = _to_fmt(_zero_if_none(x.grad, x), c, d.get("lens"), d.get("pads"), junk=False)
        if c["attn_bias"] and c["ckpt"] != "reentrant":
            grads["bias"] = _zero_if_none(cfg["bias"][1].grad, cfg["bias"][1])
        if c["cross"]:
            grads["enc"] = _to_fmt(_zero_if_none(enc.grad, enc), c, d.get("lens_enc"), d.get("pads_enc"),
                                   junk=False)
        grads.update({n: _zero_if_none(t.grad, t) for n, t in p.items()})
    return outs, grads


def _zero_if_none(g, t):
    return torch.zeros_like(t) if g is None else g


# ------------------------------------------------------------ the comparison


def err(out, ref, floor=1e-5):
    """Relative error of the whole tensor, the reference's norm floored at
    `floor` times the root of its size (a gradient that cancels to nearly
    nothing, such as the key bias's, which softmax does not see but RoPE
    turns, is compared by the rounding it leaves)."""
    out = torch.zeros_like(ref) if out is None else out.detach().cpu().double()
    if out.shape != ref.shape:
        return float("inf")
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / max(ref.norm().item(), floor * max(1, ref.numel()) ** 0.5)).item()


def same_bits(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def differences(c):
    """What goes wrong in configuration c (empty: nothing)."""
    if c["misuse"]:
        return misuse_differences(c)
    try:
        m, d, outs, dys, grads = run(c, c["ckpt"])
    except ALLOWED_ERRORS as e:
        return [f"raised {type(e).__name__}: {e}"] if not _expected_refusal(c, e) else []
    diffs = _against_reference(c, m, d, outs, dys, grads) if not c["dropout"] else []
    # the same bits without checkpointing, in training, and from a fresh layer loading the state dict
    if c["ckpt"]:
        _, _, outs2, _, grads2 = run(c, None)
        diffs += [f"checkpoint {c['ckpt']}: output {i} differs" for i, (a, b) in enumerate(zip(outs, outs2))
                  if not same_bits(a, b)]
        diffs += [f"checkpoint {c['ckpt']}: grad {n} differs" for n in grads if not same_bits(grads[n], grads2[n])]
    # (a bias with a gradient takes another of torch's attention kernels: no bit for bit comparison)
    if c["grad"] != "train" and not c["attn_bias"]:
        _, _, outs2, _, _ = run(c, c["ckpt"], grad="train")
        diffs += [f"{c['grad']}: output {i} differs from training's" for i, (a, b) in enumerate(zip(outs, outs2))
                  if not same_bits(a, b)]
    fresh = build(dict(c, seed=c["seed"] + 7))
    fresh.load_state_dict(m.state_dict(), strict=True)
    if c["fuse_wgrad"]:
        for p in fresh.parameters():
            if p.dim() == 2:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    # both with the state after a step (FP8's scales and amax history included)
    _, _, outs3, _, _ = run(c, c["ckpt"], m=fresh, reset=False)
    _, _, outs4, _, _ = run(c, c["ckpt"], m=m, reset=False)
    diffs += [f"state dict: output {i} differs" for i, (a, b) in enumerate(zip(outs4, outs3)) if not same_bits(a, b)]
    # (not with delayed scaling: its scales are the last step's, and a gradient that grew saturates)
    if c["second_step"] and c["grad"] == "train" and not c["dropout"] and c["fp8"] != "delayed" and not diffs:
        diffs += [f"second step: {e}" for e in _second_step(c, m)]
    return diffs


def _second_step(c, m):
    """A step of SGD on the parameters (main_grad where fused), then the
    same configuration again: against the reference at the new weights (no
    FP8 weight kept from before the update)."""
    with torch.no_grad():
        for p in m.parameters():
            g = p.main_grad if hasattr(p, "main_grad") and p.dim() == 2 else p.grad
            if g is not None:
                p.sub_((0.05 * g / max(g.norm().item(), 1e-6) * p.norm().clamp_min(1.0)).to(p.dtype))
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
    _, d, outs, dys, grads = run(c, c["ckpt"], m=m, reset=False)
    return _against_reference(c, m, d, outs, dys, grads)


def _against_reference(c, m, d, outs, dys, grads):
    prec = "fp8" if c["fp8"] else "bf16" if c["input"] == "amp" else c["dtype"]
    tol, floor = TOL[prec], FLOOR[prec]
    if prec != "fp32" and c.get("act") in ("relu", "reglu"):
        # a unit whose input rounds across relu's kink passes all or none of its gradient
        tol = (tol[0], max(tol[1], 0.4))
    ref_outs, ref_grads = reference(c, m, d, dys)
    diffs = []
    if len(outs) != len(ref_outs):
        return [f"{len(outs)} outputs, the reference {len(ref_outs)}"]
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        if "valid" in d and o.dim() == 2:  # what the rows between the sequences hold is not defined
            o, r = o[d["valid"].to(o.device)], r[d["valid"]]
        e = err(o, r, floor)
        if not e < tol[0]:
            diffs.append(f"output {i}: error {e:.3g}")
    for n, r in ref_grads.items():
        e = err(grads.get(n), r, floor)
        if not e < tol[1]:
            diffs.append(f"grad {n}: error {e:.3g}")
    return diffs


def _expected_refusal(c, e):
    """Refusals the package documents (TE's own limits): FP8 GEMMs of a
    token count that is not a multiple of 8."""
    return bool(c["fp8"]) and "FP8 execution requires the product of the leading dims" in str(e)


SAMPLE = configs(1, 300)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors of a few hundred elements: threads only cost time."""
    with one_thread():
        yield


@pytest.mark.parametrize("i", range(len(SAMPLE)))
def test_drawn_configuration(i):
    """A drawn configuration: within the dtype's error of the float64
    reference, the same bits without checkpointing, in training and after a
    state dict round trip; or, misused, a clear exception."""
    c = SAMPLE[i]
    diffs = differences(c)
    assert not diffs, f"{c}: {diffs}"


def test_the_sample_covers_the_options():
    """The sample draws what it claims to: both modules, every format,
    mask type and activation, decoders, FP8 of every recipe, each
    checkpoint, the grad modes, padding between packed sequences, no and
    one token, torch.autocast, set_parallel_mode, and misuses."""
    seen = collections.defaultdict(set)
    for c in SAMPLE:
        for key in ("kind", "fmt", "mask", "act", "cross", "fp8", "ckpt", "grad", "pad_between", "rope",
                    "qk_norm", "attn_bias", "dtype", "misuse", "input", "parallel_mode"):
            seen[key].add(c[key])
        seen["tokens"].add(min(c["s"], 2))
    assert seen["kind"] == {"TL", "MHA"} and seen["fmt"] == {"sbhd", "bshd", "thd"}
    assert seen["mask"] == set(MASKS) and seen["act"] == set(ACTIVATIONS)
    assert seen["cross"] == seen["pad_between"] == {False, True} and seen["tokens"] == {0, 1, 2}
    assert seen["fp8"] == {None, "delayed", "current", "block"} and seen["dtype"] == {"fp32", "bf16", "fp16"}
    assert seen["ckpt"] == {None, "core", "reentrant", "nonreentrant"}
    assert seen["grad"] == {"train", "nograd", "inference"}
    assert seen["rope"] == {None, "plain", "interleaved"} and seen["qk_norm"] == {None, "RMSNorm", "LayerNorm"}
    assert seen["attn_bias"] == {None, "post_scale_bias", "pre_scale_bias"}
    assert seen["input"] == {None, "amp"} and seen["parallel_mode"] == {False, True}
    assert len(seen["misuse"]) >= 8


def _caught(configs):
    return sum(bool(differences(c)) for c in configs)


def test_the_checker_catches_a_planted_error(monkeypatch):
    """Negative test: attention's output off by one part in a thousand, or
    a bottom-right diagonal at the padded tensor's corner instead of each
    sequence's, fails the comparison; cu_seqlens past the input, unchecked,
    fail the misuse check."""
    from transformer_engine_c.attention import dot_product_attention as dpa
    plain = [c for c in SAMPLE if c["dtype"] == "fp32" and not c["fp8"] and not c["misuse"] and c["s"] > 1
             and not c["dropout"] and c["grad"] == "train" and c["fmt"] != "thd" and not c["input"]][:12]
    assert _caught(plain) == 0
    real_attend = dpa._attend
    monkeypatch.setattr(dpa, "_attend", lambda *a: real_attend(*a) * 1.001)
    assert _caught(plain) == len(plain)
    monkeypatch.setattr(dpa, "_attend", real_attend)

    real_band = dpa._band
    monkeypatch.setattr(dpa, "_band", lambda *a: real_band(*a[:6]))  # the shift of each sequence dropped
    cross = dict(SAMPLE[0], kind="MHA", cross=True, enc_mask="padding_causal_bottom_right", enc_window=None,
                 fmt="bshd", dtype="fp32", fp8=None, misuse=None, b=3, s=5, s_enc=8, input_ln=False,
                 return_bias=False, ret_ln=False, attn_bias=None, dropout=0.0, seed=5)
    assert _caught([cross]) == 1
    monkeypatch.setattr(dpa, "_band", real_band)
    assert _caught([cross]) == 0

    misused = dict(SAMPLE[0], misuse="cu_seqlens_total")
    assert _caught([misused]) == 0
    monkeypatch.setattr(dpa, "_check_cu_seqlens", lambda *a: None)
    assert _caught([misused]) == 1
