"""The layers under torch.compile(fullgraph=True): no graph break, and the
same outputs and gradients as the eager layer, bit for bit (the same engine
runs both). CPU here (Inductor's C++ backend); the CUDA variants where a GPU
is present."""
import pytest
import torch
import torch._dynamo

import transformer_engine_c as tec
from transformer_engine_c.quantization import FP8GlobalStateManager

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DEV = DEVICES[-1]  # where the tests without a device parameter run (the layers' default device)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _breaks():
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _grads(m, x):
    return [x.grad] + [p.grad for p in m.parameters()]


def _run(m, x, g, *extra, **kw):
    x = x.detach().clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    out = m(x, *extra, **kw)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(g)
    return out, [None if t is None else t.clone() for t in _grads(m, x)]


def _same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
    elif a is None:
        assert b is None
    else:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), (a - b).abs().max()


def check_compiled(m, x, *extra, dynamic=False, exact=True, **kw):
    """m compiled with fullgraph: no graph break, outputs and every gradient
    equal to eager's (to rounding where `exact` is False: a reduction torch's
    compiler orders its own way)."""
    ref = m(x, *extra, **kw)
    y = ref[0] if isinstance(ref, tuple) else ref
    g = torch.randn_like(y)
    out_e, grads_e = _run(m, x, g, *extra, **kw)
    compiled = torch.compile(m, fullgraph=True, dynamic=dynamic)
    out_c, grads_c = _run(compiled, x, g, *extra, **kw)
    assert _breaks() == 0
    if exact:
        _same(out_e, out_c)
        _same(grads_e, grads_c)
    else:
        torch.testing.assert_close((out_e, grads_e), (out_c, grads_c), rtol=1e-6, atol=1e-6)
    return compiled


LAYERS = {
    "Linear": lambda d: tec.Linear(64, 48, device=d),
    "Linear-nobias": lambda d: tec.Linear(64, 48, bias=False, device=d),
    "LayerNormLinear": lambda d: tec.LayerNormLinear(64, 48, device=d),
    "LayerNormLinear-RMSNorm": lambda d: tec.LayerNormLinear(64, 48, normalization="RMSNorm", device=d),
    "LayerNormMLP-gelu": lambda d: tec.LayerNormMLP(64, 96, device=d),
    "LayerNormMLP-swiglu-RMSNorm": lambda d: tec.LayerNormMLP(64, 96, activation="swiglu",
                                                              normalization="RMSNorm", device=d),
    "LayerNormMLP-relu-nobias": lambda d: tec.LayerNormMLP(64, 96, activation="relu", bias=False, device=d),
    "LayerNorm": lambda d: tec.LayerNorm(64, device=d),
    "RMSNorm": lambda d: tec.RMSNorm(64, zero_centered_gamma=True, device=d),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(24, 64), (6, 4, 64)], ids=["2d", "3d"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_fullgraph_matches_eager(name, shape, device):
    torch.manual_seed(0)
    m = LAYERS[name](device)
    check_compiled(m, torch.randn(*shape, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_layer_returns_bias_and_layernorm_output(device):
    torch.manual_seed(1)
    check_compiled(tec.LayerNormLinear(64, 32, return_bias=True, return_layernorm_output=True, device=device),
                   torch.randn(5, 3, 64, device=device))
    check_compiled(tec.LayerNormMLP(64, 96, return_bias=True, return_layernorm_output=True, device=device),
                   torch.randn(15, 64, device=device))
    check_compiled(tec.Linear(64, 32, return_bias=True, device=device), torch.randn(15, 64, device=device))



@pytest.mark.parametrize("make", [lambda: tec.Linear(64, 32, bias=False, return_bias=True, device=DEV),
                                  lambda: tec.LayerNormLinear(64, 32, bias=False, return_bias=True, device=DEV)],
                         ids=["Linear", "LayerNormLinear"])
def test_return_bias_without_a_bias_returns_the_empty_tensor(make):
    """return_bias on a layer without a bias: compiled, the same empty
    tensor as the eager call (TE's)."""
    torch.manual_seed(19)
    m = make()
    x = torch.randn(12, 64, device=DEV)
    y, b = torch.compile(m, fullgraph=True)(x)
    ye, be = m(x)
    _same((y, b), (ye, be))
    assert b.numel() == 0


def test_a_call_of_two_tensors_without_grad():
    """A layer call that crosses with two tensors (Linear without a bias:
    the input and the weight) and needs no gradient (under no_grad, or a
    frozen weight and an input without grad): the compiler calls the
    Function's forward as it does any other's."""
    torch.manual_seed(20)
    m = torch.nn.Sequential(tec.Linear(64, 48, bias=False, device=DEV), tec.Linear(48, 32, bias=False, device=DEV))
    f = torch.compile(m, fullgraph=True)
    x = torch.randn(2, 6, 64, device=DEV)
    with torch.no_grad():
        _same(f(x), m(x))
    with torch.inference_mode():
        _same(f(x), m(x))
    for p in m.parameters():
        p.requires_grad_(False)
    _same(f(x), m(x))
    assert _breaks() == 0


def test_layernorm_mlp_checkpoint_and_bf16():
    torch.manual_seed(2)
    check_compiled(tec.LayerNormMLP(64, 96, checkpoint=True, device=DEV), torch.randn(16, 64, device=DEV))
    check_compiled(tec.LayerNormMLP(64, 96, params_dtype=torch.bfloat16, device=DEV),
                   torch.randn(16, 64, dtype=torch.bfloat16, device=DEV))


def test_grouped_linear_fullgraph():
    torch.manual_seed(3)
    m = tec.GroupedLinear(3, 32, 16, device=DEV)
    # the bias gradient is torch's column sum, which Inductor compiles: equal to rounding
    check_compiled(m, torch.randn(10, 32, device=DEV), [4, 6, 0], exact=False)


def test_dot_product_attention_fullgraph():
    torch.manual_seed(4)
    m = tec.DotProductAttention(4, 16, attn_mask_type="causal")
    q, k, v = (torch.randn(8, 2, 4, 16, requires_grad=True, device=DEV) for _ in range(3))
    ref = m(q, k, v)
    out = torch.compile(m, fullgraph=True)(q, k, v)
    assert _breaks() == 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fused_rope_fullgraph():
    from transformer_engine_c.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

    torch.manual_seed(17)
    freqs = RotaryPositionEmbedding(16)(8).to(DEV)
    t = torch.randn(8, 2, 4, 16, device=DEV, requires_grad=True)

    def f(t, fmt):
        return apply_rotary_pos_emb(t, freqs, fmt, fused=True)

    g = torch.randn_like(t)
    for fmt in ("sbhd", "bshd"):
        te = t.detach().clone().requires_grad_()
        tc = t.detach().clone().requires_grad_()
        ye, yc = f(te, fmt), torch.compile(f, fullgraph=True)(tc, fmt)
        ye.backward(g)
        yc.backward(g)
        _same(ye, yc)
        _same(te.grad, tc.grad)
    assert _breaks() == 0


@pytest.mark.parametrize("kw", [dict(self_attn_mask_type="causal"),
                                dict(normalization="RMSNorm", activation="swiglu", num_gqa_groups=2),
                                dict(layer_type="decoder")], ids=["causal", "rms-swiglu-gqa", "decoder"])
def test_transformer_layer_fullgraph(kw):
    from transformer_engine_c.attention.rope import RotaryPositionEmbedding

    torch.manual_seed(18)
    layer = tec.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, device=DEV, **kw)
    rope = RotaryPositionEmbedding(16)(8).to(DEV)
    extra = {"encoder_output": torch.randn(8, 2, 64, device=DEV)} if kw.get("layer_type") == "decoder" else {}
    # on CUDA the layer's own torch ops (residuals, the rotation) are Inductor's kernels: equal to rounding
    check_compiled(layer, torch.randn(8, 2, 64, device=DEV), rotary_pos_emb=rope, exact=DEV == "cpu", **extra)


class Block(torch.nn.Module):
    """A GPT-style pre-LN block of the package's layers."""

    def __init__(self, hidden=64, heads=4, **kw):
        super().__init__()
        self.heads = heads
        self.qkv = tec.LayerNormLinear(hidden, 3 * hidden, **kw)
        self.attn = tec.DotProductAttention(heads, hidden // heads, attn_mask_type="causal")
        self.proj = tec.Linear(hidden, hidden, **kw)
        self.mlp = tec.LayerNormMLP(hidden, 4 * hidden, **kw)

    def forward(self, x, is_first_microbatch=None):
        s, b, h = x.shape
        q, k, v = self.qkv(x, is_first_microbatch=is_first_microbatch).view(s, b, 3, self.heads, -1).unbind(2)
        x = x + self.proj(self.attn(q, k, v), is_first_microbatch=is_first_microbatch)
        return x + self.mlp(x, is_first_microbatch=is_first_microbatch)


def test_block_fullgraph_no_grad_and_recompiles():
    torch.manual_seed(5)
    m = Block(device=DEV)
    x = torch.randn(8, 2, 64, device=DEV)
    compiled = check_compiled(m, x)
    with torch.no_grad():  # the no-grad forward: nothing kept for backward, same output
        _same(m(x), compiled(x))
    compiled(torch.randn(8, 2, 64, device=DEV)).sum().backward()  # an input without grad: its own graph
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):  # no per-call guard: the same configuration and shapes do not recompile
        compiled(torch.randn(8, 2, 64, device=DEV)).sum().backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_block_under_checkpoint_inside_compiled():
    torch.manual_seed(6)
    m = Block(device=DEV)

    def f(x):
        return torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)

    x = torch.randn(8, 2, 64, device=DEV)
    g = torch.randn(8, 2, 64, device=DEV)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(xe).backward(g)
    ge = [xe.grad] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    torch.compile(f, fullgraph=True)(xc).backward(g)
    gc = [xc.grad] + [p.grad for p in m.parameters()]
    assert _breaks() == 0
    _same(ge, gc)


def test_fuse_wgrad_accumulation_main_grad_and_first_microbatch():
    torch.manual_seed(7)
    def build():
        torch.manual_seed(8)
        m = Block(fuse_wgrad_accumulation=True, device=DEV)
        for p in m.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        return m
    eager, comp = build(), build()
    f = torch.compile(comp, fullgraph=True)
    for step in range(3):
        x = torch.randn(8, 2, 64, device=DEV)
        eager(x, is_first_microbatch=step == 0).sum().backward()
        f(x, is_first_microbatch=step == 0).sum().backward()
    assert _breaks() == 0
    for (n, pe), pc in zip(eager.named_parameters(), comp.parameters()):
        assert torch.equal(pe.main_grad, pc.main_grad), n
        _same(pe.grad, pc.grad)


def test_delay_wgrad_compute_and_backward_dw():
    torch.manual_seed(9)
    def build():
        torch.manual_seed(10)
        return tec.LayerNormMLP(64, 96, delay_wgrad_compute=True, device=DEV)
    eager, comp = build(), build()
    x = torch.randn(16, 64, device=DEV)
    eager(x).sum().backward()
    torch.compile(comp, fullgraph=True)(x).sum().backward()
    assert _breaks() == 0
    assert comp.fc1_weight.grad is None  # left for backward_dw, as eagerly
    eager.backward_dw()
    comp.backward_dw()
    for pe, pc in zip(eager.parameters(), comp.parameters()):
        _same(pe.grad, pc.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("policy", ["fuse_wgrad_accumulation", "delay_wgrad_compute"])
def test_a_backward_whose_only_result_is_main_grad_or_the_delayed_queue(policy, backend):
    """A layer whose backward returns no gradient the graph uses (an input
    without grad, no bias, the weight's gradient written into main_grad or
    left for backward_dw): the compiled backward still runs it (Inductor
    before torch 2.13 keeps an operator only when its schema mutates, and
    the package widens that check for tec::layer_bwd)."""

    def build():
        torch.manual_seed(21)
        m = tec.Linear(32, 32, bias=False, device=DEV, **{policy: True})
        m.weight.main_grad = torch.zeros(32, 32, device=DEV)
        return m
    x = torch.randn(8, 32, device=DEV)
    eager, comp = build(), build()
    eager(x).sum().backward()
    torch.compile(comp, fullgraph=True, backend=backend)(x).sum().backward()
    if policy == "delay_wgrad_compute":
        eager.backward_dw()
        comp.backward_dw()
    _same(eager.weight.grad, comp.weight.grad)
    assert torch.equal(eager.weight.main_grad, comp.weight.main_grad)
    assert eager.weight.main_grad.abs().sum() > 0 or eager.weight.grad is not None


def test_autocast_bf16_inside_compiled():
    torch.manual_seed(11)
    m = Block(device=DEV)
    x = torch.randn(8, 2, 64, device=DEV)

    def f(x):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            return m(x)

    ref = f(x)
    out = torch.compile(f, fullgraph=True)(x)
    assert _breaks() == 0
    assert out.dtype == ref.dtype
    _same(ref, out)


def _fp8_steps(m, recipe, xs, forward=None):
    """Steps of m, the FP8 autocast entered around each forward (or
    forward(x) in its place): every output and gradient, then every FP8
    meta's scale, scale_inv and amax history at the end."""
    out = []
    for x in xs:
        x = x.clone().requires_grad_()
        if forward is None:
            with tec.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = m(x)
        else:
            y = forward(x)
        y.sum().backward()
        out += [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
        for p in m.parameters():
            p.grad = None
    state = [t.clone() for mod in m.modules() if getattr(mod, "fp8_meta", None)
             for k in ("scaling_fwd", "scaling_bwd") if mod.fp8_meta.get(k) is not None
             for t in (mod.fp8_meta[k].scale, mod.fp8_meta[k].scale_inv, mod.fp8_meta[k].amax_history)]
    return out, state


@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"])
def test_fp8_compiled_steps_match_eager_with_their_state(recipe):
    """N compiled FP8 steps leave the outputs, gradients and the recipe's
    state (scales, amax histories) of N eager steps, bit for bit (the
    autocast entered around the compiled call)."""
    from transformer_engine_c.module import _opcall

    def build():
        torch.manual_seed(12)
        return torch.nn.Sequential(tec.LayerNormLinear(64, 128, device=DEV),
                                   tec.LayerNormMLP(128, 256, activation="swiglu", device=DEV),
                                   tec.Linear(128, 64, device=DEV))
    torch.manual_seed(13)
    xs = [torch.randn(32, 64, device=DEV) for _ in range(4)]
    make = getattr(tec.recipe, recipe)
    out_e, state_e = _fp8_steps(build(), make(), xs)
    out_c, state_c = _fp8_steps(torch.compile(build(), fullgraph=True), make(), xs)
    assert _breaks() == 0
    _same(out_e, out_c)
    _same(state_e, state_c)
    if recipe == "DelayedScaling":
        assert len(state_e) == 3 * 2 * 3
    import gc
    gc.collect()
    assert not _opcall._FP8_CTX  # every forward's kept operands were freed with its backward


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner, use_reentrant):
        super().__init__()
        self.inner, self.use_reentrant = inner, use_reentrant

    def forward(self, x):
        return tec.checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("recipe", ["DelayedScaling", "Float8CurrentScaling"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "nonreentrant"])
def test_fp8_tec_checkpoint_inside_compiled_matches_eager(recipe, use_reentrant):
    """tec.checkpoint inside the compiled function, the FP8 autocast around
    its call: the FP8 layer calls keep their forward for the backward (not
    run again there, outside the autocast); outputs, gradients and the
    recipe's state as eager tec.checkpoint's, bit for bit."""
    def build():
        torch.manual_seed(22)
        return _Checkpointed(torch.nn.Sequential(tec.LayerNormLinear(32, 64, device=DEV),
                                                 tec.LayerNormMLP(64, 64, device=DEV),
                                                 tec.Linear(64, 32, bias=False, device=DEV)), use_reentrant)
    torch.manual_seed(23)
    xs = [torch.randn(16, 32, device=DEV) for _ in range(3)]
    make = getattr(tec.recipe, recipe)
    out_e, state_e = _fp8_steps(build(), make(), xs)
    out_c, state_c = _fp8_steps(torch.compile(build(), fullgraph=True, backend="aot_eager"), make(), xs)
    assert _breaks() == 0
    _same(out_e, out_c)
    _same(state_e, state_c)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fp8_torch_checkpoint_inside_compiled_names_tec_checkpoint(backend):
    """torch's own checkpoint inside the compiled function would run an FP8
    layer call again in the compiled backward, outside the autocast: refused
    while compiling, naming tec.checkpoint, whatever the partitioner would
    decide (on every device); the same function without FP8 compiles."""
    m = tec.Linear(32, 32, device=DEV)
    f = torch.compile(lambda x: torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False), fullgraph=True,
                      backend=backend)
    x = torch.randn(16, 32, device=DEV, requires_grad=True)
    with tec.fp8_autocast(enabled=True, fp8_recipe=tec.recipe.DelayedScaling()):
        with pytest.raises(Exception, match="FP8 layer call inside torch.utils.checkpoint.*use tec.checkpoint"):
            f(x)
    assert not FP8GlobalStateManager.FP8_ENABLED
    f(x).sum().backward()


def test_fp8_forward_without_backward_frees_its_operands():
    from transformer_engine_c.module import _opcall
    import gc

    m = torch.compile(tec.LayerNormMLP(64, 128, device=DEV), fullgraph=True)
    with tec.fp8_autocast(enabled=True, fp8_recipe=tec.recipe.DelayedScaling()):
        y = m(torch.randn(32, 64, requires_grad=True, device=DEV))
    assert len(_opcall._FP8_CTX) == 1
    del y
    gc.collect()
    assert not _opcall._FP8_CTX


# torch 2.13 and newer trace an FP8 autocast entered inside the compiled function; before 2.13 it is refused
def test_compiled_without_fp8_called_inside_an_autocast_recompiles():
    """The autocast's state is a guard of the compiled graph: entering one
    around a function compiled without it compiles again, in FP8."""
    torch.manual_seed(14)
    m = tec.Linear(32, 32, device=DEV)
    f = torch.compile(m, fullgraph=True)
    x = torch.randn(16, 32, device=DEV)
    _same(f(x), m(x))
    with tec.fp8_autocast(enabled=True, fp8_recipe=tec.recipe.Float8CurrentScaling()):
        ref = m(x)
        out = f(x)
    _same(ref, out)


def test_distributed_weight_is_refused():
    m = tec.Linear(32, 32, device=DEV)
    m.weight = tec.DistributedWeight.from_full(m.weight.detach().clone())
    # torch before 2.13 reports an exception raised while tracing as "Observed exception", without its text
    newer = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
    with pytest.raises(Exception, match="DistributedWeight.*torch.compile" if newer else None):
        torch.compile(m, fullgraph=True)(torch.randn(4, 32, device=DEV))


def test_the_fullgraph_check_catches_a_call_into_the_extension():
    """Negative test of the guard the tests above rely on: a module that
    calls the extension's C functions directly (no registered operator)
    fails fullgraph tracing."""
    from transformer_engine_c import _engine

    class Raw(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8, device=DEV))

        def forward(self, x):
            return _engine.gemm(x, self.w, transb=True)

    with pytest.raises(Exception, match="(?i)skipped|unsupported|graph break"):
        torch.compile(Raw(), fullgraph=True)(torch.randn(4, 8, device=DEV))


def test_the_compiled_path_calls_no_private_torch_entry_point():
    """The traced path goes through the public Function-free route: the
    private apply entry point the eager path uses is never reached while
    compiling (a negative check: eager does reach it)."""
    from transformer_engine_c.module import _plan

    if not _plan.C_APPLY:
        pytest.skip("this torch lacks the private apply entry point: nothing to guard")
    seen = []
    real = _plan._function_apply

    def spy(*a):
        seen.append(a[0])
        return real(*a)

    m = tec.LayerNormMLP(32, 64, device=DEV)
    _plan._function_apply = spy
    try:
        x = torch.randn(8, 32, requires_grad=True, device=DEV)
        torch.compile(m, fullgraph=True)(x).sum().backward()
        assert seen == []
        m(torch.randn(8, 32, requires_grad=True, device=DEV)).sum().backward()
        assert seen  # the spy works: eager's call went through it
    finally:
        _plan._function_apply = real


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (none here)")


@needs_cuda
def test_reduce_overhead_replays_the_block_as_eager():
    """mode="reduce-overhead": the layers' operators replay inside PyTorch's
    CUDA graphs, with eager's results."""
    torch.manual_seed(15)
    m = Block(params_dtype=torch.float32, device="cuda")
    f = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # graphs are recorded on a later call, then replayed
        x = torch.randn(8, 2, 64, device="cuda")
        g = torch.randn(8, 2, 64, device="cuda")
        out_e, grads_e = _run(m, x, g)
        out_c, grads_c = _run(f, x, g)
        torch.testing.assert_close((out_c, grads_c), (out_e, grads_e), rtol=1e-5, atol=1e-5)
    assert _breaks() == 0


class _TorchBlock(torch.nn.Module):
    """Block's structure in torch.nn modules: the control of the
    reduce-overhead gradient-accumulation test (torch's own layers under the
    same loop)."""

    def __init__(self, hidden=64, heads=4, **kw):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv = torch.nn.LayerNorm(hidden, **kw), torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.ln2, self.fc1 = torch.nn.LayerNorm(hidden, **kw), torch.nn.Linear(hidden, 4 * hidden, **kw)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden, **kw)

    def forward(self, x):
        s, b, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(s, b, 3, self.heads, -1).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                                             is_causal=True)
        x = x + self.proj(a.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def _accumulate_under_reduce_overhead(make):
    """Three optimizer steps of 4 micro-batches each, .grad accumulating
    over the micro-batches (set to None once per step), under
    mode="reduce-overhead" and eagerly: None where the accumulated
    gradients match, else the exception the compiled loop raised."""
    torch.manual_seed(18)
    m = make(device="cuda")
    f = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    xs = [torch.randn(8, 2, 64, device="cuda") for _ in range(4)]
    gs = [torch.randn(8, 2, 64, device="cuda") for _ in range(4)]
    try:
        for step in range(3):
            for fn in (m, f):
                for p in m.parameters():
                    p.grad = None
                for x, g in zip(xs, gs):
                    fn(x).backward(g)
                grads = [p.grad.clone() for p in m.parameters()]
                if fn is m:
                    ref = grads
            torch.testing.assert_close(grads, ref, rtol=1e-5, atol=1e-5)
    except RuntimeError as e:
        return e
    finally:
        torch._dynamo.reset()
    return None


@needs_cuda
def test_reduce_overhead_accumulates_gradients_as_torch_nn():
    """mode="reduce-overhead" with gradient accumulation (no zero_grad
    between micro-batches): the package's block does what the same block of
    torch.nn modules does under the same loop on this torch. Where torch's
    loop runs, ours runs and accumulates eager's gradients; where PyTorch's
    CUDA graph trees refuse a .grad buffer made during capture (PyTorch's own
    limit, its nn.Linear included), ours is refused the same way."""
    control = _accumulate_under_reduce_overhead(_TorchBlock)
    ours = _accumulate_under_reduce_overhead(Block)
    if control is None:
        assert ours is None, f"torch.nn's block accumulates under reduce-overhead, ours raised: {ours}"
    else:
        assert ours is not None and "CUDAGraphs" in str(ours) and "CUDAGraphs" in str(control), (control, ours)
    assert _breaks() == 0


@needs_cuda
def test_graphed_callables_after_a_compiled_region():
    """tec.make_graphed_callables captures after a compiled region ran in
    the same process, and replays as eager."""
    torch.manual_seed(16)
    m = Block(params_dtype=torch.float32, device="cuda")
    x = torch.randn(8, 2, 64, device="cuda", requires_grad=True)
    torch.compile(m, fullgraph=True)(x).sum().backward()
    other = Block(params_dtype=torch.float32, device="cuda")
    other.load_state_dict(m.state_dict())
    g = tec.make_graphed_callables(other, (x,))
    x2 = torch.randn(8, 2, 64, device="cuda")
    torch.testing.assert_close(g(x2), m(x2), rtol=1e-5, atol=1e-5)


def test_the_operator_checks_what_the_function_saved_against_its_declaration():
    """Negative test of the compiled path's own check: a declaration that
    differs from what the layer's Function saved raises, naming the layer."""
    from transformer_engine_c.module import _opcall

    m = tec.LayerNormLinear(32, 32, device=DEV)
    spec = m._op_spec
    wrong = _opcall.OpSpec(spec.fn, weights=spec.weights, biases=spec.biases, call=spec.call, nograd=spec.nograd,
                           saved=spec.saved, ctx=spec.ctx,
                           new_shapes=lambda layer, a: tuple((s, torch.float64) for s, _ in spec.new_shapes(layer, a)))
    m._op_spec = wrong
    with pytest.raises(Exception, match="LayerNormLinear.*(declared|internal)"):
        torch.compile(m, fullgraph=True)(torch.randn(8, 32, device=DEV, requires_grad=True))


def test_the_operator_checks_the_gradients_against_its_declaration():
    """Negative test: a gradient the declaration promises but the Function
    does not give (delay_wgrad_compute's queue, hidden from the declaration)
    raises instead of passing a wrong gradient on."""
    from transformer_engine_c.module import _opcall

    m = tec.Linear(32, 32, delay_wgrad_compute=True, device=DEV)
    spec = m._op_spec  # a declaration that does not know which arguments are the weight and bias
    m._op_spec = _opcall.OpSpec(spec.fn, weights={}, biases=(), call=spec.call, nograd=spec.nograd,
                                saved=spec.saved, ctx=spec.ctx, new_shapes=spec.new_shapes)
    y = torch.compile(m, fullgraph=True)(torch.randn(8, 32, device=DEV, requires_grad=True))
    with pytest.raises(Exception, match="Linear.*no gradient for argument 1"):
        y.sum().backward()


def test_the_traced_key_holds_the_layers_configuration():
    """A traced call names its layer with the configuration its declared
    outputs derive from, so a graph cached on disk by another process (where
    the same registry key may be another kind of layer) is not reused."""
    a = tec.Linear(32, 48, device=DEV)
    b = tec.Linear(32, 48, return_bias=True, device=DEV)
    c = tec.LayerNormMLP(32, 64, return_layernorm_output=True, device=DEV)
    assert a._op_signature() == b._op_signature()  # the same declared outputs
    assert c._op_signature() != tec.LayerNormMLP(32, 64, device=DEV)._op_signature()
    from transformer_engine_c import _library
    with pytest.raises(RuntimeError, match="configuration changed since the call was traced"):
        _library._layer(f"{c._op_key}|{a._op_signature()}", check=True)


def test_the_operators_backward_takes_its_forwards_call():
    """tec::layer_bwd takes the Call its forward made where that forward was
    the layer's last (as an eager backward takes ctx.call), and derives one
    where another forward came between (micro-batches in flight); the
    gradients are the same either way."""
    from transformer_engine_c.module import _opcall

    m = tec.LayerNormLinear(32, 16, device=DEV)
    made = []
    spec = m._op_spec
    m._op_spec = _opcall.OpSpec(spec.fn, weights=spec.weights, biases=spec.biases, nograd=spec.nograd,
                                saved=spec.saved, ctx=spec.ctx, new_shapes=spec.new_shapes,
                                call=lambda *a: made.append(1) or spec.call(*a))
    xs = [torch.randn(8, 32, device=DEV) for _ in range(2)]
    args = [[x, m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias] for x in xs]
    needs, dy = [True] * 5, torch.randn(8, 16, device=DEV)

    def forward(a):
        outs = m._op_forward(a, -1, True, False)
        return outs[1:]  # the saved tensors the forward made

    grads = []
    new = forward(args[0])
    grads.append(m._op_backward(args[0], new, [dy], needs, -1, False))
    assert len(made) == 1  # the backward took the forward's Call
    news = [forward(a) for a in args]
    grads += [m._op_backward(a, n, [dy], needs, -1, False) for a, n in zip(args, news)][::-1]
    assert len(made) == 4  # the first backward's forward was not the last: its Call made again
    for got, want in zip(grads[2], grads[0]):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))
