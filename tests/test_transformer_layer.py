"""TransformerLayer and MultiheadAttention (transformer_engine_c.transformer,
attention.multi_head_attention), single process, on the CPU (and CUDA where
present), mirroring TransformerEngine's tests/pytorch/test_numerics.py with
references written here:
  * test_gpt_accuracy / test_mha_accuracy: against a GPT block and an
    attention made of torch.nn modules (nn.MultiheadAttention), output and
    every gradient;
  * every configuration (GQA, fused / interleaved / split qkv, kv_channels,
    decoder, post-LN residuals, output_layernorm, parallel_attention_mlp,
    RMSNorm and gated activations, zero-centred gamma, no bias, RoPE,
    sliding window) against the float64 reference of transformer_reference.py;
  * test_transformer_layer_hidden_states_format: sbhd, bshd and thd agree;
  * test_gpt_checkpointing: a state dict round trip mid-training gives the
    same results; activation recompute (tec.checkpoint of the block,
    checkpoint_core_attention) gives the same results;
  * TE's parameter names and registration order; the refusals."""
import io

import pytest
import torch
import torch.nn.functional as F

import transformer_engine_c as te
from helpers import rel_err
from transformer_reference import transformer_layer

H, HEADS, S, B = 64, 4, 8, 2


def _layer(device, dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    return te.TransformerLayer(H, 4 * H, HEADS, params_dtype=dtype, device=device, **kw)


def _randomize(module):
    """Non-trivial norm weights and biases (TE initialises them to ones and
    zeros): every 1-D parameter."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))


# ------------------------------------------------ TE's torch.nn references


class TorchLayerNormMLP(torch.nn.Module):
    def __init__(self, hidden, ffn, eps):
        super().__init__()
        self.ln = torch.nn.LayerNorm(hidden, eps=eps)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x)), approximate="tanh"))


class TorchGPT(torch.nn.Module):
    """Pre-LN GPT block of torch.nn modules (TE's test_numerics.TorchGPT)."""

    def __init__(self, hidden, eps, heads, parallel_attention_mlp=False):
        super().__init__()
        self.ln = torch.nn.LayerNorm(hidden, eps=eps)
        self.mhsa = torch.nn.MultiheadAttention(hidden, heads, dropout=0.0)
        self.ln_mlp = TorchLayerNormMLP(hidden, 4 * hidden, eps)
        self.parallel = parallel_attention_mlp

    def forward(self, x):
        s = x.shape[0]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)
        a = self.ln(x)
        a = self.mhsa(a, a, a, attn_mask=causal, need_weights=False)[0]
        if self.parallel:
            return x + a + self.ln_mlp(x)
        x = x + a
        return x + self.ln_mlp(x)


def _share_gpt(torch_gpt, block):
    qkv, mlp = block.self_attention.layernorm_qkv, block.layernorm_mlp
    with torch.no_grad():
        torch_gpt.ln.weight.copy_(qkv.layer_norm_weight)
        torch_gpt.ln.bias.copy_(qkv.layer_norm_bias)
        torch_gpt.mhsa.in_proj_weight.copy_(qkv.weight)
        torch_gpt.mhsa.in_proj_bias.copy_(qkv.bias)
        torch_gpt.mhsa.out_proj.weight.copy_(block.self_attention.proj.weight)
        torch_gpt.mhsa.out_proj.bias.copy_(block.self_attention.proj.bias)
        torch_gpt.ln_mlp.ln.weight.copy_(mlp.layer_norm_weight)
        torch_gpt.ln_mlp.ln.bias.copy_(mlp.layer_norm_bias)
        for name in ("fc1", "fc2"):
            getattr(torch_gpt.ln_mlp, name).weight.copy_(getattr(mlp, f"{name}_weight"))
            getattr(torch_gpt.ln_mlp, name).bias.copy_(getattr(mlp, f"{name}_bias"))


def _run(block, x, **kw):
    x = x.detach().clone().requires_grad_()
    y = block(x, **kw)
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    return y.detach(), x.grad


@pytest.mark.parametrize("parallel_attention_mlp", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_accuracy(device, dtype, parallel_attention_mlp):
    block = _layer(device, dtype, fuse_qkv_params=True, qkv_weight_interleaved=False,
                   parallel_attention_mlp=parallel_attention_mlp).eval()
    _randomize(block)
    torch_gpt = TorchGPT(H, 1e-5, HEADS, parallel_attention_mlp).to(device=device, dtype=dtype).eval()
    _share_gpt(torch_gpt, block)
    x = torch.randn(S, B, H, device=device).to(dtype)
    y, dx = _run(block, x)
    y_ref, dx_ref = _run(torch_gpt, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(y, y_ref) < tol
    assert rel_err(dx, dx_ref) < tol
    te_grads = {"ln.weight": block.self_attention.layernorm_qkv.layer_norm_weight,
                "mhsa.in_proj_weight": block.self_attention.layernorm_qkv.weight,
                "mhsa.in_proj_bias": block.self_attention.layernorm_qkv.bias,
                "mhsa.out_proj.weight": block.self_attention.proj.weight,
                "ln_mlp.fc1.weight": block.layernorm_mlp.fc1_weight,
                "ln_mlp.fc2.bias": block.layernorm_mlp.fc2_bias}
    ref = dict(torch_gpt.named_parameters())
    for name, p in te_grads.items():
        assert rel_err(p.grad, ref[name].grad) < tol, name


@pytest.mark.parametrize("mask_type", ["causal", "no_mask"])
def test_mha_accuracy(device, mask_type):
    """TE's test_mha_accuracy: MultiheadAttention without input layernorm
    against torch.nn.MultiheadAttention."""
    torch.manual_seed(0)
    mha = te.MultiheadAttention(H, HEADS, fuse_qkv_params=True, qkv_weight_interleaved=False, input_layernorm=False,
                                attn_mask_type=mask_type, attention_dropout=0.0, device=device, return_bias=False)
    ref = torch.nn.MultiheadAttention(H, HEADS, dropout=0.0).to(device)
    _randomize(mha)
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.qkv.weight)
        ref.in_proj_bias.copy_(mha.qkv.bias)
        ref.out_proj.weight.copy_(mha.proj.weight)
        ref.out_proj.bias.copy_(mha.proj.bias)
    x = torch.randn(S, B, H, device=device)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), 1) if mask_type == "causal" else None
    y, dx = _run(mha, x)
    y_ref, dx_ref = _run(lambda t: ref(t, t, t, attn_mask=mask, need_weights=False)[0], x)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(dx, dx_ref) < 1e-5
    assert rel_err(mha.qkv.weight.grad, ref.in_proj_weight.grad) < 1e-5
    assert rel_err(mha.proj.bias.grad, ref.out_proj.bias.grad) < 1e-5


# ------------------------------------------------- the float64 reference

CONFIGS = {
    "defaults": {},
    "gqa fused interleaved": dict(num_gqa_groups=2, fuse_qkv_params=True),
    "gqa fused concatenated": dict(num_gqa_groups=2, fuse_qkv_params=True, qkv_weight_interleaved=False),
    "mqa split": dict(num_gqa_groups=1),
    "kv_channels": dict(kv_channels=24),
    "decoder": dict(layer_type="decoder"),
    "decoder fused interleaved": dict(layer_type="decoder", fuse_qkv_params=True, num_gqa_groups=2),
    "post-LN": dict(apply_residual_connection_post_layernorm=True),
    "post-LN decoder": dict(apply_residual_connection_post_layernorm=True, layer_type="decoder"),
    "output_layernorm": dict(output_layernorm=True),
    "post-LN output_layernorm": dict(output_layernorm=True, apply_residual_connection_post_layernorm=True),
    "parallel_attention_mlp": dict(parallel_attention_mlp=True),
    "RMSNorm swiglu zero-centred": dict(normalization="RMSNorm", activation="swiglu", zero_centered_gamma=True),
    "no bias relu": dict(bias=False, activation="relu"),
    "window": dict(window_size=(3, 0)),
    "no_mask": dict(self_attn_mask_type="no_mask"),
}


def _reference_cfg(block, kw):
    groups = kw.get("num_gqa_groups") or HEADS
    return dict(heads=HEADS, groups=groups, kv_channels=kw.get("kv_channels") or H // HEADS,
                interleaved=bool(kw.get("fuse_qkv_params") and kw.get("qkv_weight_interleaved", True)),
                normalization=kw.get("normalization", "LayerNorm"), zcg=kw.get("zero_centered_gamma", False),
                activation=kw.get("activation", "gelu"), post_ln=kw.get("apply_residual_connection_post_layernorm",
                                                                       False),
                output_ln=kw.get("output_layernorm", False), parallel=kw.get("parallel_attention_mlp", False),
                decoder=kw.get("layer_type") == "decoder", mask_type=kw.get("self_attn_mask_type", "causal"),
                window=kw.get("window_size"))


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_against_float64_reference(device, name, rope):
    kw = CONFIGS[name]
    block = _layer(device, **kw)
    _randomize(block)
    cfg = _reference_cfg(block, kw)
    x = torch.randn(S, B, H, device=device, requires_grad=True)
    enc = torch.randn(S + 3, B, H, device=device, requires_grad=True)
    freqs = te.RotaryPositionEmbedding(cfg["kv_channels"] // 2 * 2, rotary_percent=0.5)(S + 3).to(device) if rope \
        else None
    y = block(x, encoder_output=enc if cfg["decoder"] else None, rotary_pos_emb=freqs)
    dy = torch.randn_like(y)
    y.backward(dy)

    p64 = {n: p.detach().double().cpu().requires_grad_() for n, p in block.named_parameters()}
    x64 = x.detach().double().cpu().requires_grad_()
    enc64 = enc.detach().double().cpu().requires_grad_()
    ref = transformer_layer(x64, p64, cfg, encoder_output=enc64 if cfg["decoder"] else None,
                            freqs=freqs.cpu().double() if rope else None)
    ref.backward(dy.double().cpu())
    assert rel_err(y, ref) < 1e-5
    assert rel_err(x.grad, x64.grad) < 1e-5
    if cfg["decoder"]:
        assert rel_err(enc.grad, enc64.grad) < 1e-5
    for n, p in block.named_parameters():
        ref_grad = p64[n].grad
        if ref_grad.norm() < 1e-12:  # the key bias: softmax does not see it (its gradient is rounding)
            assert p.grad.abs().max() < 1e-6, n
        else:
            assert rel_err(p.grad, ref_grad) < 1e-5, n


# ------------------------------------------------- formats, checkpointing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_layer_hidden_states_format(device, dtype):
    """TE's test: the same layer in sbhd, bshd and thd (padding_causal over
    packed equal sequences) gives the same output; and packed sequences of
    different lengths match their separate sbhd runs."""
    blocks = {fmt: _layer(device, dtype, attn_input_format=fmt,
                          **({"self_attn_mask_type": "padding_causal"} if fmt == "thd" else {}))
              for fmt in ("sbhd", "bshd", "thd")}
    for (n1, p1), (n2, p2) in zip(blocks["sbhd"].named_parameters(), blocks["thd"].named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    x = torch.randn(S, B, H, device=device).to(dtype)
    y_sbhd = blocks["sbhd"](x)
    y_bshd = blocks["bshd"](x.transpose(0, 1).contiguous())
    cu = torch.arange(B + 1, dtype=torch.int32, device=device) * S
    y_thd = blocks["thd"](x.transpose(0, 1).reshape(B * S, H).contiguous(), cu_seqlens_q=cu, cu_seqlens_kv=cu,
                          max_seqlen_q=S, max_seqlen_kv=S)
    torch.testing.assert_close(y_bshd, y_sbhd.transpose(0, 1).contiguous())
    torch.testing.assert_close(y_thd.view(B, S, H), y_bshd)
    # unequal lengths, with RoPE: each packed sequence as its own sbhd batch of one
    lens = [3, 8, 5]
    cu = torch.tensor([0, 3, 11, 16], dtype=torch.int32, device=device)
    packed = torch.randn(sum(lens), H, device=device).to(dtype)
    freqs = te.RotaryPositionEmbedding(H // HEADS)(8).to(device)
    y = blocks["thd"](packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8,
                      rotary_pos_emb=freqs)
    for i, n in enumerate(lens):
        piece = packed[int(cu[i]):int(cu[i + 1])]
        ref = blocks["sbhd"](piece.unsqueeze(1), rotary_pos_emb=freqs)
        torch.testing.assert_close(y[int(cu[i]):int(cu[i + 1])], ref.squeeze(1))


def _train(make, x, steps, reload=False):
    """steps forward/backward passes with dropout; with reload, the block is
    saved after half of them and a fresh one loads it, its gradients and the
    RNG state carried over (TE's _test_e2e_checkpointing)."""
    block = make()
    x.grad = None
    for i in range(steps):
        if reload and i == steps // 2:
            buf = io.BytesIO()
            torch.save(block.state_dict(), buf)
            grads = [p.grad.clone() for p in block.parameters()]
            rng = torch.get_rng_state()
            cuda_rng = torch.cuda.get_rng_state() if x.is_cuda else None  # dropout draws on x's device
            block = make()
            buf.seek(0)
            block.load_state_dict(torch.load(buf, weights_only=False))
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
            for p, g in zip(block.parameters(), grads):
                p.grad = g
        out = block(x)
        out.sum().backward()
    return [out.detach(), x.grad.clone()] + [p.grad.clone() for p in block.parameters()]


def test_gpt_checkpointing(device):
    def make():
        return _layer(device, hidden_dropout=0.1, attention_dropout=0.1, seed=1)

    x = torch.randn(S, B, H, device=device, requires_grad=True)
    plain = _train(make, x, 6)
    restored = _train(make, x, 6, reload=True)
    for i, (a, b) in enumerate(zip(plain, restored)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"tensor {i}")


@pytest.mark.parametrize("how", ["full reentrant", "full", "core attention"])
def test_activation_recompute(device, how):
    """TE's test_gpt_full_activation_recompute / selective recompute: the
    recomputed block gives the same output and gradients, dropout included."""
    block = _layer(device, hidden_dropout=0.1, attention_dropout=0.1)
    x = torch.randn(S, B, H, device=device)

    def run(recompute):
        torch.manual_seed(7)
        xg = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        if not recompute:
            y = block(xg)
        elif how == "core attention":
            y = block(xg, checkpoint_core_attention=True)
        else:
            y = te.checkpoint(block, xg, use_reentrant=how == "full reentrant")
        y.sum().backward()
        return [y.detach(), xg.grad] + [p.grad.clone() for p in block.parameters()]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fuse_wgrad_accumulation(device):
    block = _layer(device, fuse_qkv_params=True, fuse_wgrad_accumulation=True)
    weights = [p for n, p in block.named_parameters() if n.endswith("weight") and p.dim() == 2]
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    x = torch.randn(S, B, H, device=device, requires_grad=True)
    block(x, is_first_microbatch=True).sum().backward()
    first = [w.main_grad.clone() for w in weights]
    assert all(g.abs().sum() > 0 for g in first)
    block(x, is_first_microbatch=False).sum().backward()
    for w, g in zip(weights, first):
        torch.testing.assert_close(w.main_grad, 2 * g, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- TE's names and order


def _te_names(fused=False, decoder=False, output_ln=False, bias=True, rms=False):
    """TE 2.x's state_dict keys of a TransformerLayer, in order."""
    def linear(prefix, weights, norm=False):
        keys = []
        if norm:
            keys += [f"{prefix}.layer_norm_weight"] + ([] if rms else [f"{prefix}.layer_norm_bias"])
        keys += [f"{prefix}.{w}weight" for w in weights]
        keys += [f"{prefix}.{w}bias" for w in weights] if bias else []
        return keys + [f"{prefix}._extra_state"]

    split = ("query_", "key_", "value_")
    keys = linear("self_attention.layernorm_qkv" if not output_ln else "self_attention.qkv",
                  ("",) if fused else split, norm=not output_ln)
    keys += ["self_attention.core_attention._extra_state"] + linear("self_attention.proj", ("",))
    if decoder:
        keys += linear("inter_attention.layernorm_query", ("",) if fused else ("query_",), norm=True)
        keys += linear("inter_attention.key_value", ("",) if fused else ("key_", "value_"))
        keys += ["inter_attention.core_attention._extra_state"] + linear("inter_attention.proj", ("",))
    mlp = ["layernorm_mlp.layer_norm_weight"] + ([] if rms else ["layernorm_mlp.layer_norm_bias"])
    mlp += ["layernorm_mlp.fc1_weight"] + (["layernorm_mlp.fc1_bias"] if bias else [])
    mlp += ["layernorm_mlp.fc2_weight"] + (["layernorm_mlp.fc2_bias"] if bias else [])
    keys += mlp + ["layernorm_mlp._extra_state"]
    if output_ln:
        keys += ["layernorm.weight"] + ([] if rms else ["layernorm.bias"]) + ["layernorm._extra_state"]
    return keys


@pytest.mark.parametrize("kw", [dict(), dict(fused=True), dict(decoder=True), dict(decoder=True, fused=True),
                                dict(output_ln=True), dict(bias=False, rms=True), dict(output_ln=True, rms=True)],
                         ids=str)
def test_te_state_dict_keys(kw):
    """The state_dict's keys and order are TE 2.x's (a TE checkpoint loads
    with strict=True and position-paired parameters line up)."""
    layer = te.TransformerLayer(
        32, 64, 4, fuse_qkv_params=kw.get("fused", False), layer_type="decoder" if kw.get("decoder") else "encoder",
        output_layernorm=kw.get("output_ln", False), bias=kw.get("bias", True),
        normalization="RMSNorm" if kw.get("rms") else "LayerNorm", device="cpu")
    keys = list(layer.state_dict())
    want = _te_names(**kw)
    assert sorted(keys) == sorted(want)
    assert keys == want


def test_state_dict_round_trip_between_configs():
    """A state dict loads strictly into a freshly made layer of the same
    configuration, and the loaded layer computes the same output."""
    a = _layer("cpu", num_gqa_groups=2, fuse_qkv_params=True, layer_type="decoder")
    _randomize(a)
    b = _layer("cpu", seed=3, num_gqa_groups=2, fuse_qkv_params=True, layer_type="decoder")
    b.load_state_dict(a.state_dict(), strict=True)
    x, enc = torch.randn(S, B, H), torch.randn(S, B, H)
    torch.testing.assert_close(a(x, encoder_output=enc), b(x, encoder_output=enc), rtol=0, atol=0)


def test_mha_submodules_and_outputs():
    mha = te.MultiheadAttention(H, HEADS, input_layernorm=True, return_layernorm_output=True, return_bias=True,
                                attention_dropout=0.0, device="cpu")
    assert [n for n, _ in mha.named_children()] == ["layernorm_qkv", "core_attention", "proj"]
    out, bias, ln_out = mha(torch.randn(S, B, H))
    assert out.shape == (S, B, H) and bias.shape == (H,) and ln_out.shape == (S, B, H)
    cross = te.MultiheadAttention(H, HEADS, attention_type="cross", device="cpu")
    assert [n for n, _ in cross.named_children()] == ["query_layer", "key_value", "core_attention", "proj"]
    assert cross(torch.randn(S, B, H), encoder_output=torch.randn(S + 2, B, H)).shape == (S, B, H)
    qk = te.MultiheadAttention(H, HEADS, qk_norm_type="RMSNorm", device="cpu")
    assert [n for n, _ in qk.named_children()][:2] == ["q_norm", "k_norm"]


def test_alias_names():
    import transformer_engine_c.alias as alias
    alias.install_as_transformer_engine()
    try:
        import transformer_engine.pytorch as tep
        from transformer_engine.pytorch.attention.multi_head_attention import MultiheadAttention
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
        from transformer_engine.pytorch.transformer import TransformerLayer
        assert tep.TransformerLayer is TransformerLayer is te.TransformerLayer
        assert tep.MultiheadAttention is MultiheadAttention is tep.attention.MultiheadAttention
        assert apply_rotary_pos_emb is te.attention.rope.apply_rotary_pos_emb
        assert tep.RotaryPositionEmbedding is tep.attention.RotaryPositionEmbedding
    finally:
        alias.uninstall_transformer_engine_alias()


def test_mask_type_and_window_reach_the_attention():
    """TransformerLayer passes its attention only the mask type and window
    that differ from the attention's own: the layer's mask type (its
    attribute, or forward's argument) decides whatever the attention's
    attribute says, a window of None is the attention's own, and a change
    of either is seen on the next call."""
    x = torch.randn(S, B, H)
    layer = _layer("cpu")
    causal = layer(x)
    layer.self_attention.attn_mask_type = "no_mask"  # the layer's own mask type still decides
    assert torch.equal(layer(x), causal)
    no_mask = _layer("cpu", self_attn_mask_type="no_mask")(x)
    assert not torch.allclose(no_mask, causal)
    layer.self_attn_mask_type = "no_mask"
    assert torch.equal(layer(x), no_mask)
    assert torch.equal(layer(x, self_attn_mask_type="causal"), causal)
    layer.self_attention.attn_mask_type = "causal"
    assert torch.equal(layer(x), no_mask)
    layer.self_attn_mask_type = "causal"
    windowed = _layer("cpu", window_size=(1, 0))(x)
    assert not torch.allclose(windowed, causal)
    assert torch.equal(layer(x, window_size=(1, 0)), windowed)
    layer.self_attention.window_size = (1, 0)  # the layer's None is "the attention's own", as in TE
    assert torch.equal(layer(x), windowed)
    assert torch.equal(layer(x, window_size=(-1, 0)), causal)


def test_refusals():
    with pytest.raises(ValueError, match="fuse_wgrad_accumulation needs fuse_qkv_params"):
        te.TransformerLayer(H, 4 * H, HEADS, fuse_wgrad_accumulation=True, device="cpu")
    with pytest.raises(ValueError, match="parallel_attention_mlp"):
        te.TransformerLayer(H, 4 * H, HEADS, parallel_attention_mlp=True, output_layernorm=True, device="cpu")
    with pytest.raises(ValueError, match="layer_type"):
        te.TransformerLayer(H, 4 * H, HEADS, layer_type="encoder-decoder", device="cpu")
    with pytest.raises(NotImplementedError, match="L2Normalization"):
        te.TransformerLayer(H, 4 * H, HEADS, qk_norm_type="L2Normalization", device="cpu")
    with pytest.raises(NotImplementedError, match="softmax_type"):
        te.TransformerLayer(H, 4 * H, HEADS, softmax_type="learnable", device="cpu")
    layer = _layer("cpu")
    x = torch.randn(S, B, H)
    with pytest.raises(NotImplementedError, match="inference_params"):
        layer(x, inference_params=object())
    with pytest.raises(NotImplementedError, match="ALiBi"):
        layer(x, core_attention_bias_type="alibi")
    with pytest.raises(ValueError, match="self_attn_mask_type"):
        layer(x, self_attn_mask_type="diagonal")
    with pytest.raises(TypeError, match="boolean"):
        layer(x, self_attn_mask_type="padding", attention_mask=torch.zeros(B, 1, 1, S))
    with pytest.raises(ValueError, match="encoder_output"):
        _layer("cpu", layer_type="decoder")(x)


def test_fp8_autocast():
    """Under FP8 autocast the layers' GEMMs run in FP8 and attention in the
    compute dtype (TE's recipes without fp8_dpa): the output is within FP8's
    error of the bf16 layer's."""
    from transformer_engine_c import recipe
    block = _layer("cpu", torch.bfloat16)
    x = torch.randn(2 * S, B, H, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        y = block(x)
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert rel_err(y, block(x)) < 0.05


def test_drop_path():
    block = _layer("cpu", drop_path_rate=0.5).train()
    out = block.drop_path(torch.ones(400, 2, 3))
    kept = out[:, 0, 0] != 0
    assert torch.equal(out[kept], torch.full_like(out[kept], 2.0))  # whole first-dimension slices, scaled
    assert 120 < int(kept.sum()) < 280
    assert (out == 0).all(dim=(1, 2)).sum() == (~kept).sum()
    block.eval()
    assert torch.equal(block.drop_path(torch.ones(4, 2, 3)), torch.ones(4, 2, 3))


TE_ARGS = {
    (te.TransformerLayer, "__init__"): (
        "hidden_size ffn_hidden_size num_attention_heads num_gqa_groups layernorm_epsilon hidden_dropout "
        "attention_dropout init_method output_layer_init_method layer_number kv_channels self_attn_mask_type "
        "window_size enc_dec_attn_mask_type enc_dec_window_size tp_group tp_size params_dtype get_rng_state_tracker "
        "fuse_wgrad_accumulation seq_length micro_batch_size sequence_parallel "
        "apply_residual_connection_post_layernorm output_layernorm parallel_attention_mlp layer_type "
        "drop_path_rate set_parallel_mode fuse_qkv_params rotary_pos_interleaved zero_centered_gamma "
        "qkv_weight_interleaved ub_tp_comm_overlap ub_overlap_ag ub_overlap_rs ub_overlap_rs_dgrad ub_bulk_dgrad "
        "ub_bulk_wgrad bias activation normalization device attn_input_format name qk_norm_type qk_norm_eps "
        "qk_norm_before_rope softmax_type"),
    (te.TransformerLayer, "forward"): (
        "hidden_states attention_mask self_attn_mask_type window_size encoder_output enc_dec_attn_mask "
        "enc_dec_attn_mask_type enc_dec_window_size is_first_microbatch checkpoint_core_attention inference_params "
        "rotary_pos_emb core_attention_bias_type core_attention_bias alibi_slopes cu_seqlens_q cu_seqlens_kv "
        "cu_seqlens_q_padded cu_seqlens_kv_padded max_seqlen_q max_seqlen_kv fast_zero_fill pad_between_seqs"),
    (te.MultiheadAttention, "__init__"): (
        "hidden_size num_attention_heads kv_channels attention_dropout layernorm_epsilon init_method "
        "output_layer_init_method layer_number attn_mask_type window_size tp_group tp_size num_gqa_groups "
        "fuse_wgrad_accumulation get_rng_state_tracker sequence_parallel params_dtype return_bias "
        "return_layernorm_output input_layernorm attention_type set_parallel_mode fuse_qkv_params "
        "zero_centered_gamma qkv_weight_interleaved rotary_pos_interleaved ub_overlap_ag ub_overlap_rs "
        "ub_overlap_rs_dgrad ub_bulk_dgrad ub_bulk_wgrad bias normalization device qkv_format name qk_norm_type "
        "qk_norm_eps qk_norm_before_rope seq_length micro_batch_size softmax_type"),
    (te.MultiheadAttention, "forward"): (
        "hidden_states attention_mask encoder_output attn_mask_type window_size is_first_microbatch "
        "checkpoint_core_attention inference_params rotary_pos_emb core_attention_bias_type core_attention_bias "
        "alibi_slopes cu_seqlens_q cu_seqlens_kv cu_seqlens_q_padded cu_seqlens_kv_padded max_seqlen_q "
        "max_seqlen_kv fast_zero_fill pad_between_seqs"),
}


@pytest.mark.parametrize("key", list(TE_ARGS), ids=lambda k: f"{k[0].__name__}.{k[1]}")
def test_te_argument_order(key):
    """TE 2.9's arguments, in TE's order (code passes them positionally)."""
    import inspect
    cls, fn = key
    names = [n for n in inspect.signature(getattr(cls, fn)).parameters if n != "self"]
    assert names == TE_ARGS[key].split()


def _recompute_run(rec, fp8, fp8_params, how, reentrant):
    """TE's _test_e2e_full_recompute / _test_e2e_selective_recompute: a bf16
    block with dropout, its output and every gradient, recomputed (`how`) or
    not (None)."""
    torch.manual_seed(0)
    te.fp8.FP8GlobalStateManager.reset()
    with te.quantized_model_init(enabled=fp8 and fp8_params, recipe=rec):
        block = te.TransformerLayer(H, 4 * H, HEADS, hidden_dropout=0.1, attention_dropout=0.1,
                                    params_dtype=torch.bfloat16, fuse_qkv_params=True, device="cpu")
    x = torch.randn(2 * S, B, H, dtype=torch.bfloat16, requires_grad=reentrant)
    mask = torch.triu(torch.ones(2 * S, 2 * S, dtype=torch.bool), 1)
    with te.autocast(enabled=fp8, recipe=rec):
        if how == "full":
            y = te.checkpoint(block, x, attention_mask=mask, checkpoint_core_attention=False,
                              distribute_saved_activations=False, tp_group=None, use_reentrant=reentrant)
        else:
            y = block(x, attention_mask=mask, checkpoint_core_attention=how == "selective")
    y.sum().backward()
    return [y] + ([x.grad] if reentrant else []) + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("how,reentrant", [("full", True), ("full", False), ("selective", True)])
@pytest.mark.parametrize("fp8,fp8_params", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling"])
def test_activation_recompute_fp8(recipe_name, fp8, fp8_params, reentrant, how):
    """TE's test_gpt_full_activation_recompute / selective recompute with
    FP8 and FP8 parameters: recomputation changes no bit."""
    from transformer_engine_c import recipe
    rec = getattr(recipe, recipe_name)()
    ref = _recompute_run(rec, fp8, fp8_params, None, reentrant)
    got = _recompute_run(rec, fp8, fp8_params, how, reentrant)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_no_tokens(fmt):
    """A batch of no tokens (an empty sequence, or packed sequences all of
    length 0) runs forward and backward: an empty output of the input's
    shape and zero gradients."""
    block = _layer("cpu", num_gqa_groups=2, attn_input_format=fmt, layer_type="decoder",
                   self_attn_mask_type="padding_causal" if fmt == "thd" else "causal")
    shape = {"sbhd": (0, B, H), "bshd": (B, 0, H), "thd": (0, H)}[fmt]
    x = torch.randn(shape, requires_grad=True)
    enc = torch.randn({"sbhd": (3, B, H), "bshd": (B, 3, H), "thd": (0, H)}[fmt], requires_grad=True)
    kw = {}
    if fmt == "thd":
        zeros = torch.zeros(B + 1, dtype=torch.int32)
        kw = dict(cu_seqlens_q=zeros, cu_seqlens_kv=zeros, max_seqlen_q=0, max_seqlen_kv=0)
    y = block(x, encoder_output=enc, **kw)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape
    assert all(p.grad is None or not p.grad.any() for p in block.parameters())


def test_misuses_name_the_argument():
    """A wrong argument raises an exception that names it, not an error of
    an inner reshape, broadcast or slice; an encoder output of another
    batch is refused rather than broadcast."""
    decoder = _layer("cpu", layer_type="decoder")
    x = torch.randn(S, B, H)
    with pytest.raises(ValueError, match="encoder_output .* the same batch"):
        decoder(x, encoder_output=torch.randn(S, 1, H))
    with pytest.raises(ValueError, match=r"window_size must be a pair \(left, right\)"):
        decoder(x, window_size=(3,), encoder_output=x)
    with pytest.raises(ValueError, match="hidden_states must be 3-D in sbhd"):
        decoder(x[:, 0], encoder_output=x)
    with pytest.raises(TypeError, match="attention_mask: an arbitrary mask is one tensor"):
        _layer("cpu")(x, self_attn_mask_type="arbitrary", attention_mask=[torch.zeros(1, 1, S, S, dtype=torch.bool)])
    mha = te.MultiheadAttention(H, HEADS, attn_mask_type="arbitrary", device="cpu")
    with pytest.raises(TypeError, match="attention_mask must be boolean"):
        mha(x, attention_mask=torch.zeros(B, 1, S, S))
    thd = _layer("cpu", attn_input_format="thd", self_attn_mask_type="padding_causal")
    packed = torch.randn(5, H)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer tensor"):
        thd(packed, cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0]))
    with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor"):
        thd(packed, cu_seqlens_q=[0, 2, 5], rotary_pos_emb=te.RotaryPositionEmbedding(H // HEADS)(8))
