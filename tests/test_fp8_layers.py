"""The three layers in FP8 (DelayedScaling and Float8CurrentScaling), on the
CPU's exact emulation and on CUDA, against plain-PyTorch references: a
Linear step's output and gradients from the FP8 values TE's recipe gives,
the scale and amax-history updates through a layer (TE's test_recipe.py
cases: history 31 and 1024, max and most_recent, margin,
is_first_microbatch None/True/False), current scaling's quantization
against its rule (test_float8_current_scaling_exact.py), the layers'
accuracy against high precision (test_numerics.py's FP8 cases), weight
caching over micro-batches (test_sanity.py), main_grad, delayed wgrad,
LayerNormMLP's checkpoint, and the errors."""
import collections
import math

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c.quantization import RECOMPUTE_POSITION_KEY, FP8GlobalStateManager as G
from transformer_engine_c.recipe import DelayedScaling, Float8CurrentScaling, QParams

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


@pytest.fixture(autouse=True)
def fresh_state():
    G.reset()
    yield
    G.reset()


def deq(x, fp8_dtype, scale):
    """x's FP8 value under `scale` (float32 tensor of one element), in float64:
    x * scale saturated and rounded to the format, times scale's float32
    reciprocal (what the engine's scale_inv holds)."""
    m = MAX[fp8_dtype]
    data = (x.float() * scale).clamp(-m, m).to(fp8_dtype)
    return data.double() * torch.reciprocal(scale.float()).double()


def rel(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def test_rel_and_deq_are_not_vacuous():
    x = torch.randn(32, 16)
    one = torch.ones(1)
    assert rel(deq(x, E4M3, one), x) > 1e-3  # FP8 rounds
    assert rel(deq(x, E4M3, one), deq(x, E4M3, one * 1.3)) > 1e-3  # the scale matters


def gemm_tol(device, fast=False):
    """fp32 outputs: the CPU's emulation sums exact products in float32;
    Hopper keeps fewer bits per accumulation chunk (more with the fast
    accumulation of fprop)."""
    if device == "cpu":
        return 1e-5
    return 3e-3 if fast else 5e-4


def linear(device, n=32, k=64, **kw):
    torch.manual_seed(0)
    lin = te.Linear(k, n, params_dtype=torch.float32, device=device, **kw)
    with torch.no_grad():
        lin.bias.uniform_(-0.5, 0.5)
    return lin


def scales(layer):
    """(input scale, weight scale, grad-output scale) the next step uses."""
    meta = getattr(layer, "fp8_meta", None)
    if meta is None or "scaling_fwd" not in meta:
        return torch.ones(1), torch.ones(1), torch.ones(1)
    f, b = meta["scaling_fwd"].scale.cpu(), meta["scaling_bwd"].scale.cpu()
    return f[0:1].clone(), f[1:2].clone(), b[0:1].clone()


# ------------------------------------------------------- delayed scaling


def test_linear_delayed_scaling_steps_match_the_reference(device):
    """Three steps: each one's output and gradients are the products of the
    FP8 values under the scales the previous steps' amaxes gave."""
    lin = linear(device)
    recipe = DelayedScaling(amax_history_len=4)
    w = lin.weight.detach().cpu()
    amaxes = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = (torch.randn(32, 64, generator=gen) * (step + 1)).to(device).requires_grad_()
        dy = (torch.randn(32, 32, generator=gen) * 0.01 * (step + 1)).to(device)
        sx, sw, sg = scales(lin)
        with te.autocast(enabled=True, recipe=recipe):
            y = lin(x)
        y.backward(dy)
        xq, wq, gq = deq(x.detach().cpu(), E4M3, sx), deq(w, E4M3, sw), deq(dy.cpu(), E5M2, sg)
        assert rel(y.cpu(), xq @ wq.t() + lin.bias.detach().cpu().double()) < gemm_tol(device, fast=True)
        assert rel(x.grad.cpu(), gq @ wq) < gemm_tol(device)
        assert rel(lin.weight.grad.cpu(), gq.t() @ xq) < gemm_tol(device)
        assert rel(lin.bias.grad.cpu(), dy.cpu().double().sum(0)) < 1e-6
        lin.weight.grad = lin.bias.grad = None
        amaxes.append(x.detach().abs().max().cpu())
        # the update after the step: 448 / the largest amax of the history
        assert scales(lin)[0].item() == (torch.tensor([448.0]) / max(amaxes[-4:])).item()
    assert G.get_autocast_depth() == 0


def test_a_wrong_scale_would_be_caught(device):
    """The reference comparison above fails if the layer used another scale."""
    lin = linear(device)
    x = torch.randn(32, 64).to(device) * 3
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        y = lin(x)
    w = lin.weight.detach().cpu()
    wrong = deq(x.cpu(), E4M3, torch.tensor([1.3])) @ deq(w, E4M3, torch.ones(1)).t()
    assert rel(y.detach().cpu(), wrong + lin.bias.detach().cpu().double()) > 10 * gemm_tol(device, fast=True)


def _amax_algo(history, algo):
    return max(history) if algo == "max" else history[-1]


@pytest.mark.parametrize("history_len", [31, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
@pytest.mark.parametrize("first_mb", [None, True, False])
def test_scale_updates_through_a_linear(history_len, algo, margin, first_mb):
    """TE's test_recipe.py: after each step the input's, weight's and
    grad-output's scales are fp8_max / 2^margin over the history's max (or
    latest) amax; with is_first_microbatch=False the weight is cast once and
    its later amaxes are 0 (the old scale is kept where the algorithm sees
    only zeros)."""
    lin = linear("cpu")
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin)
    hx, hw, hg = [], [], []
    want_sw = torch.ones(1)
    factors = [1.0, 4.0, 2.0, 0.5, 3.0, 0.25]
    for step, f in enumerate(factors):
        x = torch.randn(16, 64) * f
        dy = torch.randn(16, 32) * f
        with te.autocast(enabled=True, recipe=recipe):
            y = lin(x, is_first_microbatch=first_mb and step % 3 == 0 if first_mb is not None else None)
        y.backward(dy)
        cast_w = first_mb is None or step == 0 or (first_mb is True and step % 3 == 0)
        hx.append(x.abs().max().item())
        hw.append(lin.weight.detach().abs().max().item() if cast_w else 0.0)
        hg.append(dy.abs().max().item())
        sx, sw, sg = scales(lin)
        div = 2.0 ** margin
        ax, aw, ag = (_amax_algo(h[-history_len:], algo) for h in (hx, hw, hg))
        assert sx.item() == (torch.tensor([448.0]) / torch.tensor([ax])).item() / div
        assert sg.item() == (torch.tensor([57344.0]) / torch.tensor([ag])).item() / div
        if aw > 0:
            want_sw = (torch.tensor([448.0]) / torch.tensor([aw])) / div
        assert sw.item() == want_sw.item(), f"step {step}"
        hist = lin.fp8_meta["scaling_fwd"].amax_history
        assert hist.shape == (history_len, 3) and hist[0].abs().sum() == 0  # the new row is zeroed


def test_nan_amax_keeps_the_scale():
    lin = linear("cpu")
    x = torch.randn(16, 64) * 2
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=1)):
        lin(x).sum().backward()
    before = scales(lin)[0].item()
    x[0, 0] = float("nan")
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=1)):
        lin(x).sum().backward()
    assert scales(lin)[0].item() == before


# ------------------------------------------------------- current scaling


def ref_scale(t, fp8_dtype, pow2=False, eps=0.0):
    amax = torch.tensor([max(t.abs().max().item(), eps)], dtype=torch.float32)
    s = torch.tensor([MAX[fp8_dtype]]) / amax
    if pow2:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


@pytest.mark.parametrize("pow2", [False, True])
def test_linear_current_scaling_matches_the_reference(device, pow2):
    lin = linear(device)
    qp = QParams(power_2_scale=pow2)
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=qp, fp8_quant_fwd_weight=qp, fp8_quant_bwd_grad=qp)
    x = (torch.randn(32, 64) * 7).to(device).requires_grad_()
    dy = (torch.randn(32, 32) * 1e-3).to(device)
    with te.autocast(enabled=True, recipe=recipe):
        y = lin(x)
    y.backward(dy)
    xc, w, dyc = x.detach().cpu(), lin.weight.detach().cpu(), dy.cpu()
    xq = deq(xc, E4M3, ref_scale(xc, E4M3, pow2))
    wq = deq(w, E4M3, ref_scale(w, E4M3, pow2))
    gq = deq(dyc, E5M2, ref_scale(dyc, E5M2, pow2))
    assert rel(y.detach().cpu(), xq @ wq.t() + lin.bias.detach().cpu().double()) < gemm_tol(device, fast=True)
    assert rel(x.grad.cpu(), gq @ wq) < gemm_tol(device)
    assert rel(lin.weight.grad.cpu(), gq.t() @ xq) < gemm_tol(device)
    assert lin.fp8_meta["recipe"] is recipe and "scaling_fwd" not in lin.fp8_meta


# ------------------------------------------------------- the three layers


def make(kind, device, dtype=torch.float32, **kw):
    torch.manual_seed(1)
    if kind == "Linear":
        return te.Linear(64, 96, params_dtype=dtype, device=device, **kw)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(64, 96, params_dtype=dtype, device=device, **kw)
    if kind == "RMSNormLinear":
        return te.LayerNormLinear(64, 96, normalization="RMSNorm", params_dtype=dtype, device=device, **kw)
    return te.LayerNormMLP(64, 128, params_dtype=dtype, device=device, activation=kind.split(":")[1], **kw)


KINDS = ["Linear", "LayerNormLinear", "RMSNormLinear", "MLP:gelu", "MLP:swiglu", "MLP:relu"]
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}


def run(layer, x, dy, recipe, steps=1, **kw):
    for _ in range(steps):
        for p in layer.parameters():
            p.grad = None
        x.grad = None
        if recipe is None:
            y = layer(x, **kw)
        else:
            with te.autocast(enabled=True, recipe=recipe):
                y = layer(x, **kw)
        y.backward(dy)
    return y.detach(), x.grad.clone(), {n: None if p.grad is None else p.grad.clone()
                                        for n, p in layer.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_layer_in_fp8_is_close_to_high_precision(device, kind, recipe):
    """test_numerics.py's FP8 cases: the output and every gradient within
    FP8's error of the same layer in high precision (and not equal to it)."""
    layer = make(kind, device)
    x = torch.randn(2, 16, 64, device=device, requires_grad=True)
    dy = torch.randn(2, 16, 96 if "Linear" in kind else 64, device=device)
    y0, dx0, g0 = run(layer, x, dy, None)
    y1, dx1, g1 = run(layer, x, dy, RECIPES[recipe](), steps=3)
    # gradients pass through E5M2 (two mantissa bits) once per GEMM they
    # cross; LayerNormMLP's input gradient twice, and relu's mask flips
    # wherever fc1's output changed sign
    tol = 0.25 if kind.startswith("MLP") else 0.15
    assert 1e-4 < rel(y1, y0) < 0.1
    assert rel(dx1, dx0) < tol
    for name in g0:
        assert rel(g1[name], g0[name]) < tol, name


def saved_bytes(layer, x, recipe):
    """The bytes of storage a forward saves for backward (autograd's
    saved-tensor hooks see everything save_for_backward keeps)."""
    seen = []

    def pack(t):
        seen.append(t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = layer(x)
    y.sum().backward()
    return sum(seen), seen


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "MLP:gelu"])
def test_fp8_saves_no_bf16_copy_of_a_gemm_only_input(kind):
    """Where wgrad reads the FP8 transpose the forward wrote, the layer
    keeps no high-precision copy of that GEMM input (a one-element
    stand-in): less is saved than without FP8, by the inputs' bytes."""
    layer = make(kind, "cpu", torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    plain, _ = saved_bytes(layer, x, None)
    fp8, sizes = saved_bytes(layer, x, DelayedScaling())
    gemm_inputs = 32 * 64 * 2 + (32 * 128 * 2 if kind.startswith("MLP") else 0)  # ln_out / x, the activation
    if kind == "Linear":  # x is the caller's tensor: its storage is what is kept (not a copy)
        assert min(sizes) == 2 and plain - fp8 == gemm_inputs - 2
    else:
        assert plain - fp8 == gemm_inputs - 2 * (2 if kind.startswith("MLP") else 1)


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_forward_equals_the_training_forward(kind):
    layer = make(kind, "cpu")
    x = torch.randn(32, 64)
    recipe = Float8CurrentScaling()
    with te.autocast(enabled=True, recipe=recipe):
        y = layer(x)
        with torch.no_grad():
            y_ng = layer(x)
    assert torch.equal(y.detach(), y_ng)


def test_layernorm_linear_against_the_fp8_reference(device):
    """The normalised input is cast with the input's scale, then the GEMMs
    run on the FP8 values (the norm itself in high precision)."""
    layer = te.LayerNormLinear(64, 32, params_dtype=torch.float32, device=device, return_layernorm_output=True)
    x = (torch.randn(32, 64) * 3 + 1).to(device).requires_grad_()
    dy = torch.randn(32, 32).to(device) * 0.1
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y, ln = layer(x)
    y.backward(dy)
    lnc, w = ln.detach().cpu(), layer.weight.detach().cpu()
    ref_ln = torch.nn.functional.layer_norm(x.detach().cpu(), (64,), eps=1e-5)
    assert rel(lnc, ref_ln) < 1e-5
    lq = deq(lnc, E4M3, ref_scale(lnc, E4M3))
    wq = deq(w, E4M3, ref_scale(w, E4M3))
    gq = deq(dy.cpu(), E5M2, ref_scale(dy.cpu(), E5M2))
    assert rel(y.detach().cpu(), lq @ wq.t() + layer.bias.detach().cpu().double()) < gemm_tol(device, fast=True)
    assert rel(layer.weight.grad.cpu(), gq.t() @ lq) < gemm_tol(device)


def test_bf16_layers_train_in_fp8(device):
    """bf16 parameters (the FP8 GEMMs' bias epilogue) over a few steps of SGD."""
    layer = make("MLP:gelu", device, dtype=torch.bfloat16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    x = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    target = torch.randn(64, 64, device=device, dtype=torch.bfloat16) * 0.1
    losses = []
    for _ in range(8):
        opt.zero_grad()
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            y = layer(x)
        loss = (y.float() - target.float()).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ------------------------------------------------ micro-batches and friends


def test_weight_cached_over_micro_batches():
    """test_sanity.py: is_first_microbatch=True casts and caches the FP8
    weight, False reuses it even after the weight changed (TE's weight
    caching), None casts every call."""
    lin = linear("cpu")
    x = torch.randn(16, 64)
    recipe = Float8CurrentScaling()
    with te.autocast(enabled=True, recipe=recipe):
        y_first = lin(x, is_first_microbatch=True)
    with torch.no_grad():
        lin.weight.mul_(2)
    with te.autocast(enabled=True, recipe=recipe):
        y_cached = lin(x, is_first_microbatch=False)
        y_new = lin(x, is_first_microbatch=None)
        y_recast = lin(x, is_first_microbatch=True)
    assert torch.equal(y_cached, y_first)
    assert not torch.equal(y_new, y_first)
    assert torch.equal(y_recast, y_new)


def test_main_grad_accumulates_fp8_weight_gradients():
    lin = linear("cpu", fuse_wgrad_accumulation=True)
    lin.weight.main_grad = torch.full_like(lin.weight, 5.0)
    ref = linear("cpu")
    recipe = Float8CurrentScaling()
    xs = [torch.randn(16, 64) for _ in range(2)]
    dys = [torch.randn(16, 32) for _ in range(2)]
    total = torch.zeros_like(ref.weight)
    for i, (x, dy) in enumerate(zip(xs, dys)):
        with te.autocast(enabled=True, recipe=recipe):
            lin(x, is_first_microbatch=i == 0).backward(dy)
            ref(x, is_first_microbatch=i == 0).backward(dy)
        total += ref.weight.grad
        ref.weight.grad = None
    assert torch.allclose(lin.weight.main_grad, total, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["Linear", "MLP:gelu"])
def test_delayed_wgrad_equals_immediate_in_fp8(kind):
    a, b = make(kind, "cpu"), make(kind, "cpu", delay_wgrad_compute=True)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 96 if kind == "Linear" else 64)
    ya, dxa, ga = run(a, x, dy, Float8CurrentScaling())
    yb, dxb, _ = run(b, x, dy, Float8CurrentScaling())
    b.backward_dw()
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
    for name, p in b.named_parameters():
        assert torch.equal(p.grad, ga[name]), name


def test_mlp_checkpoint_equals_no_checkpoint_in_fp8():
    a, b = make("MLP:gelu", "cpu"), make("MLP:gelu", "cpu", checkpoint=True)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 64)
    ra = run(a, x, dy, DelayedScaling(), steps=3)
    history = a.fp8_meta["scaling_fwd"].amax_history.clone()  # (every step updates every registered meta)
    rb = run(b, x, dy, DelayedScaling(), steps=3)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    for name in ra[2]:
        assert torch.equal(ra[2][name], rb[2][name]), name
    assert torch.equal(history, b.fp8_meta["scaling_fwd"].amax_history)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a = te.LayerNormLinear(64, 96, params_dtype=torch.float32, device="cpu")
        self.b = te.Linear(96, 64, params_dtype=torch.float32, device="cpu")

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("reentrant", [True, False])
def test_te_checkpoint_recomputes_in_fp8_with_the_forwards_scales(recipe, reentrant):
    """tec.checkpoint inside an FP8 autocast: the recomputation runs in FP8
    with the scales the forward used (delayed scaling's move after every
    step: the inputs grow), so outputs, gradients, scales and histories equal
    the run without checkpointing, step after step."""
    def steps(m):  # one model at a time: an autocast's exit updates every registered meta
        got = []
        for step in range(4):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)) * (1 + 2 * step)
            dy = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 + step))
            xi = x.clone().requires_grad_()
            for p in m.parameters():
                p.grad = None
            with te.autocast(recipe=RECIPES[recipe]()):
                y = te.checkpoint(m, xi, use_reentrant=reentrant) if m is ckpt else m(xi)
            y.backward(dy)
            got.append([y.detach(), xi.grad] + [p.grad.clone() for p in m.parameters()])
        metas = {(name, k): (layer.fp8_meta[k].scale.clone(), layer.fp8_meta[k].amax_history.clone())
                 for name, layer in (("a", m.a), ("b", m.b)) for k in ("scaling_fwd", "scaling_bwd")
                 if recipe == "delayed"}
        return got, metas

    plain, ckpt = _Block(), _Block()
    (want, want_meta), (got, got_meta) = steps(plain), steps(ckpt)
    for step, (a_step, b_step) in enumerate(zip(want, got)):
        for i, (a, b) in enumerate(zip(a_step, b_step)):
            assert torch.equal(a, b), f"step {step}: tensor {i} differs"
    for key, (scale, history) in want_meta.items():
        assert torch.equal(scale, got_meta[key][0]) and torch.equal(history, got_meta[key][1]), key
    assert not ckpt.a.__dict__["_fp8_recompute"] and not ckpt.b.__dict__["_fp8_recompute"]  # every stash popped


def test_module_called_twice_in_one_autocast():
    """As TE: both calls' amaxes go into the same history row, and the first
    call is the one that reduces the backward amaxes."""
    lin = linear("cpu")
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64) * 4
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=2)):
        y = lin(x1) + lin(x2)
    assert scales(lin)[0].item() == (torch.tensor([448.0]) / x2.abs().max()).item()
    y.sum().backward()
    assert scales(lin)[2].item() == 57344.0  # both grad outputs are ones


# ------------------------------------------------------------- errors


def test_fp8_shape_rule_names_the_input():
    lin = linear("cpu")
    with te.autocast(enabled=True):
        with pytest.raises(ValueError, match="inp.*divisible by 8"):
            lin(torch.randn(12, 64))
    odd = te.Linear(24, 32, device="cpu")
    with te.autocast(enabled=True):
        with pytest.raises(ValueError, match="inp"):
            odd(torch.randn(16, 24))
    narrow = te.Linear(64, 24, device="cpu")  # dgrad's inner dimension
    with te.autocast(enabled=True):
        with pytest.raises(ValueError, match=r"weight .*\(24, 64\)"):
            narrow(torch.randn(16, 64))


def test_unsupported_fp8_uses_raise_naming_them():
    with te.autocast(enabled=True):
        gl = te.GroupedLinear(2, 32, 32, device="cpu")
        with pytest.raises(NotImplementedError, match="GroupedLinear"):
            gl(torch.randn(32, 32), [16, 16])
    with te.autocast(enabled=False, calibrating=True):
        with pytest.raises(NotImplementedError, match="calibration"):
            linear("cpu")(torch.randn(16, 64))
    with pytest.raises(NotImplementedError, match="w_block_scaling_dim=1"):
        with te.fp8_model_init(enabled=True, recipe=te.recipe.Float8BlockScaling(w_block_scaling_dim=1)):
            pass
    lin = linear("cpu")
    with te.autocast(enabled=False):  # an autocast that is off changes nothing
        assert torch.equal(lin(torch.randn(12, 64) * 0), lin(torch.zeros(12, 64)))


def test_sequence_parallel_delayed_scaling_needs_amax_reduction():
    lin = te.Linear(64, 32, device="cpu", tp_size=1, sequence_parallel=True, parallel_mode="column")
    lin.tp.sp = True  # as on a group of several ranks
    with te.autocast(enabled=True, recipe=DelayedScaling(reduce_amax=False)):
        with pytest.raises(ValueError, match="reduce_amax"):
            lin(torch.randn(16, 64))


def test_a_changed_history_length_keeps_the_scales():
    """TE's adjust_amax_history_length: the scales stay, the history is cut
    to its newest rows (or padded with zeros), and the layer keeps updating."""
    lin = linear("cpu")
    x = torch.randn(16, 64) * 3
    for _ in range(3):
        with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
            lin(x).sum().backward()
    before = scales(lin)
    hist = lin.fp8_meta["scaling_fwd"].amax_history.clone()
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        y = lin(x)
        assert torch.equal(lin.fp8_meta["scaling_fwd"].amax_history[1:], hist[1:4])
    y.sum().backward()
    assert torch.equal(scales(lin)[0], before[0])  # the same amax: the same scale
    x2 = x * 2
    with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
        lin(x2).sum().backward()
    assert scales(lin)[0].item() == (torch.tensor([448.0]) / x2.abs().max()).item()


@pytest.mark.parametrize("kind", ["Linear", "MLP:gelu"])
def test_first_call_under_inference_mode_then_training(kind):
    """A layer whose first FP8 call runs under inference_mode (its fp8_meta
    made there) trains afterwards: the autocast's exit updates the meta in
    place outside inference_mode, which inference tensors would refuse."""
    layer = make(kind, "cpu")
    x = torch.randn(32, 64)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        with torch.inference_mode():
            layer(x)
    assert not layer.fp8_meta["scaling_fwd"].scale.is_inference()
    y, dx, grads = run(layer, x.clone().requires_grad_(), torch.randn(32, 96 if kind == "Linear" else 64),
                       DelayedScaling(), steps=2)
    assert torch.isfinite(dx).all() and all(g is not None for g in grads.values())


@pytest.mark.parametrize("activation", ["gelu", "srelu", "silu"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("checkpoint", [False, True])
def test_mlp_activation_fused_with_the_casts_changes_nothing(device, monkeypatch, activation, recipe, checkpoint):
    """LayerNormMLP in FP8 computes an element-wise activation inside fc2's
    input cast, and its backward inside dh's cast (module/_fp8.FP8Call.produce):
    over 3 bf16 steps the output, the input gradient, every parameter
    gradient (fc1's bias gradient: bit for bit on the CPU, within rounding on
    CUDA, where the two kernels sum in another order) and the scales equal the
    unfused path's (the activation written in bf16, then cast)."""
    from transformer_engine_c.module import _fp8
    results = []
    for fused in (True, False):
        # current scaling does not fuse by default (module/_fp8.FP8Call.fuses_activation): forced here
        monkeypatch.setattr(_fp8.FP8Call, "fuses_activation",
                            (lambda self, act: self.blocks is None and act < 16) if fused else (lambda self, act: False))
        G.reset()
        layer = make(f"MLP:{activation}", device, torch.bfloat16, checkpoint=checkpoint)
        torch.manual_seed(5)
        x = torch.randn(48, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(48, 64, device=device, dtype=torch.bfloat16)
        out = run(layer, x, dy, RECIPES[recipe](), steps=3)
        meta = layer.fp8_meta.get("scaling_fwd")
        results.append((out, None if meta is None else meta.amax_history.clone()))
    (ya, dxa, ga), ha = results[0]
    (yb, dxb, gb), hb = results[1]
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
    for name in ga:
        if name == "fc1_bias" and device != "cpu":
            assert torch.allclose(ga[name].float(), gb[name].float(), rtol=2e-2, atol=1e-2), name
        else:
            assert torch.equal(ga[name], gb[name]), name
    assert (ha is None) == (hb is None) and (ha is None or torch.equal(ha, hb))


def test_mlp_fused_activation_is_not_the_identity(monkeypatch):
    """The negative case of the test above: fused casts that skipped the
    activation (cast h itself) would change the output (two identical
    layers, each on its first call: the same scales)."""
    from transformer_engine_c.module import _fp8
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    outs = []
    for broken in (False, True):
        if broken:
            monkeypatch.setattr(_fp8.FP8Call, "produce", lambda self, t, act, act_input=None: t)  # h cast as it is
        G.reset()
        layer = make("MLP:gelu", "cpu", torch.bfloat16)
        with te.autocast(enabled=True, recipe=DelayedScaling()):
            outs.append(layer(x))
    assert not torch.equal(outs[0], outs[1])
    monkeypatch.undo()
    G.reset()
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        again = make("MLP:gelu", "cpu", torch.bfloat16)(x)
    assert torch.equal(again, outs[0])  # the comparison itself is deterministic


def test_fp8_calls_follow_a_changed_checkpoint_flag(monkeypatch):
    """An FP8 call keeps the forward's input transposes for backward unless
    the layer is LayerNormMLP(checkpoint=True), read from the layer's plan:
    setting layer.checkpoint between calls changes what the next call keeps."""
    from transformer_engine_c.module import _fp8
    kept = []

    class Recording(_fp8.FP8Call):
        __slots__ = ()

        def __init__(self, *args):
            super().__init__(*args)
            kept.append(self.keep_t)
    monkeypatch.setattr(_fp8, "FP8Call", Recording)
    layer = te.LayerNormMLP(64, 128)
    x = torch.randn(16, 64, requires_grad=True, device=layer.fc1_weight.device)
    for checkpoint in (False, True, False):
        layer.checkpoint = checkpoint
        with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4)):
            y = layer(x)
        y.sum().backward()
    assert kept == [True, False, True]


@pytest.mark.parametrize("reentrant", [True, False])
def test_te_checkpoint_without_grad_stashes_nothing(reentrant):
    """tec.checkpoint with grad disabled (an evaluation forward) records no
    graph, so nothing is recomputed: it stashes no forward scales, and a
    later checkpointed step recomputes with its own forward's scales (the
    same gradients as without the evaluation's checkpoint), after a step
    that moved them."""
    recipe = DelayedScaling(amax_history_len=4)

    def grads(ckpt_eval):
        torch.manual_seed(0)
        m = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cpu")
        gen = torch.Generator().manual_seed(1)
        xe = torch.randn(16, 64, generator=gen).bfloat16()
        with torch.no_grad(), te.autocast(recipe=recipe):
            te.checkpoint(m, xe, use_reentrant=reentrant) if ckpt_eval else m(xe)
        assert not m.__dict__.get("_fp8_recompute")
        for ckpt in (False, True):  # a step that moves the scales (larger inputs), then a checkpointed one
            x = (torch.randn(16, 64, generator=gen) * 100).bfloat16().requires_grad_()
            with te.autocast(recipe=recipe):
                y = te.checkpoint(m, x, use_reentrant=reentrant) if ckpt else m(x)
            y.float().square().sum().backward()
        return x.grad, m.weight.grad, m.bias.grad

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [True, False])
def test_te_checkpoint_stashes_through_the_state_manager(reentrant, monkeypatch):
    """A checkpointed FP8 call stashes its forward tensors and its recompute
    takes them back through FP8GlobalStateManager's TE methods (which
    callers may wrap), once each; only the FP8 layer's fp8_meta gets the
    recompute key, and the recompute empties its queue."""
    G.reset()
    calls = collections.Counter()
    for name in ("copy_forward_fp8_meta_tensors_for_recompute", "get_old_fp8_meta_tensors_for_recompute"):
        real = getattr(G, name)

        def wrapped(meta, real=real, name=name):
            calls[name] += 1
            real(meta)
        monkeypatch.setattr(G, name, staticmethod(wrapped))
    plain = te.Linear(64, 64, params_dtype=torch.float32, device="cpu")
    fp8 = te.Linear(64, 64, params_dtype=torch.float32, device="cpu")

    def body(x):
        x = plain(x)
        with te.autocast(recipe=DelayedScaling()):
            return fp8(x)
    x = torch.randn(32, 64, requires_grad=True)
    te.checkpoint(body, x, use_reentrant=reentrant).sum().backward()
    assert calls == {"copy_forward_fp8_meta_tensors_for_recompute": 1, "get_old_fp8_meta_tensors_for_recompute": 1}
    assert RECOMPUTE_POSITION_KEY in fp8.fp8_meta and RECOMPUTE_POSITION_KEY not in plain.fp8_meta
    assert not G.fp8_tensors_recompute_buffer[fp8.fp8_meta[RECOMPUTE_POSITION_KEY]]
    G.reset()
