"""FP8 primary weights (quantized_model_init / fp8_model_init) on the CPU's
exact FP8 emulation: the layers' weights are Float8Tensor parameters with
TE's attributes; the FP8 GEMMs read their bytes (no cast per call, the
transpose made once per weight update); outside an autocast the layers
dequantize; optimizers update them in place; state_dicts round-trip; the
parameter memory is at most 0.6x the bf16 model's; the errors name what is
wrong. Each comparison has a negative case showing it catches a fault."""
import copy
import io
import json
import subprocess
import sys

import pytest
import torch

import transformer_engine_c as te
from transformer_engine_c.benchmarks import fp8_params as bench
from transformer_engine_c.module import _fp8, _fp8_gemm
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                                         MXFP8BlockScaling, QParams)
from transformer_engine_c.tensor import QuantizedTensor
from transformer_engine_c.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
from transformer_engine_c.tensor.float8_tensor import Float8Tensor

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
# current scaling with power-of-two scales: a dequantized weight re-quantizes
# to the same bytes and scale, so the bf16 twin's FP8 GEMMs see the same values
RECIPES = {"delayed": DelayedScaling, "current": lambda: Float8CurrentScaling(
    fp8_quant_fwd_weight=QParams(power_2_scale=True)), "block": Float8BlockScaling}
LAYERS = {
    "Linear": lambda d: te.Linear(64, 32, params_dtype=BF16, device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(64, 96, params_dtype=BF16, device=d),
    "LayerNormMLP": lambda d: te.LayerNormMLP(64, 128, params_dtype=BF16, device=d),
    "LayerNormMLP-checkpoint": lambda d: te.LayerNormMLP(64, 128, params_dtype=BF16, device=d, checkpoint=True),
}
WEIGHTS = {"Linear": ["weight"], "LayerNormLinear": ["weight"], "LayerNormMLP": ["fc1_weight", "fc2_weight"],
           "LayerNormMLP-checkpoint": ["fc1_weight", "fc2_weight"]}


@pytest.fixture(params=["cpu", "cuda"])
def dev(request):
    """The device of a test that runs on both (CUDA where there is a GPU)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine (GPU tests run on the GPU machines)")
    return request.param


@pytest.fixture(autouse=True)
def fresh_state():
    G.reset()
    torch.manual_seed(0)
    yield
    G.reset()


def storage(w):
    """(FP8 bytes, scale_inv) of an FP8 weight of either kind."""
    if isinstance(w, Float8BlockwiseQTensor):
        return w._rowwise_data, w._rowwise_scale_inv
    return w._data, w._scale_inv


def transpose(w):
    """The kept transpose (bytes) of an FP8 weight, or None."""
    return w._columnwise_data if isinstance(w, Float8BlockwiseQTensor) else w._transpose


def fp8_layer(kind, recipe, device="cpu"):
    with te.quantized_model_init(enabled=True, recipe=recipe):
        return LAYERS[kind](device)


def bf16_twin(m8, kind):
    """The same layer with plain bf16 parameters holding m8's (dequantized) values."""
    ref = LAYERS[kind](next(m8.parameters()).device)
    with torch.no_grad():
        for name, p in m8.named_parameters():
            getattr(ref, name).copy_(p.dequantize() if isinstance(p, QuantizedTensor) else p)
    return ref


def step(m, x, recipe, fp8=True, **kw):
    """(output, input gradient, parameter gradients) of one forward (in the
    FP8 autocast when fp8) and backward."""
    x = x.clone().requires_grad_()
    with te.autocast(enabled=fp8, recipe=recipe):
        y = m(x, **kw)
    y.float().square().sum().backward()
    return y.detach(), x.grad, [p.grad for p in m.parameters()]


def same(a, b):
    ya, ga, pa = a
    yb, gb, pb = b
    return torch.equal(ya, yb) and torch.equal(ga, gb) and all(torch.equal(u, v) for u, v in zip(pa, pb))


# ------------------------------------------------------------ construction


@pytest.mark.parametrize("rname", RECIPES)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_weights_are_float8_tensor_parameters_with_te_attributes(kind, rname, dev):
    m = fp8_layer(kind, RECIPES[rname](), dev)
    assert m.primary_weights_in_fp8
    for name, p in m.named_parameters():
        if name not in WEIGHTS[kind]:  # norms and biases stay bf16
            assert type(p) is torch.nn.Parameter and p.dtype == BF16, name
            continue
        want = Float8BlockwiseQTensor if rname == "block" else Float8Tensor
        assert type(p) is want and isinstance(p, torch.nn.Parameter) and isinstance(p, QuantizedTensor)
        assert p.dtype == BF16 and p.requires_grad and p.is_leaf and p.dim() == 2
        data, scale_inv = storage(p)
        assert data.dtype == torch.uint8 and data.shape == p.shape and scale_inv.dtype == torch.float32
        assert p._fp8_dtype == E4M3 and p._quantizer is not None
        assert transpose(p) is None  # made by the first FP8 call that needs it
        if rname == "block":  # one scale per 128x128 block (one block here)
            assert p._is_2D_scaled and scale_inv.numel() >= 1
        else:
            assert scale_inv.numel() == 1 and p._transpose_invalid
        assert p.tensor_model_parallel and p.partition_dim in (0, 1)
        d = p.dequantize()
        assert type(d) is torch.Tensor and d.dtype == BF16 and d.shape == p.shape
        assert 0.005 < d.float().std().item() < 0.05  # TE's normal(0, 0.023) init, in FP8
    with te.quantized_model_init(enabled=False):
        plain = LAYERS[kind]("cpu")
    assert not plain.primary_weights_in_fp8
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())


def test_split_weights_and_the_older_name():
    with te.fp8_model_init(enabled=True):
        m = te.Linear(64, 64, params_dtype=BF16, device="cpu", parameters_split=("query", "key"))
    assert type(m.query_weight) is Float8Tensor and type(m.key_weight) is Float8Tensor
    assert G.with_fp8_parameters() is False  # restored at the exit
    with te.autocast(recipe=DelayedScaling()):  # the split weights are concatenated (dequantized) per call
        y = m(torch.randn(16, 64, dtype=BF16))
    assert y.shape == (16, 64) and torch.isfinite(y.float()).all()


# ------------------------------------------------------------ numerics


@pytest.mark.parametrize("rname", RECIPES)
@pytest.mark.parametrize("kind", list(LAYERS))
def test_fp8_weights_match_a_bf16_layer_holding_their_values(kind, rname, dev):
    """Forward and backward in FP8 are bit-exact against the same layer whose
    bf16 weights are the dequantized values (the twin quantizes them to the
    same bytes); a twin whose weight differs in one element is not."""
    recipe = RECIPES[rname]()
    m8 = fp8_layer(kind, recipe, dev)
    ref = bf16_twin(m8, kind)
    x = torch.randn(16, 64, dtype=BF16, device=dev)
    got = step(m8, x, recipe)
    assert same(got, step(ref, x, recipe))
    bad = bf16_twin(m8, kind)
    w = getattr(bad, WEIGHTS[kind][0])
    with torch.no_grad():
        w[0, 0] = w[0, 0] * 2 + 0.25
    assert not same(got, step(bad, x, recipe))


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_outside_an_autocast_the_layer_dequantizes(kind):
    m8 = fp8_layer(kind, DelayedScaling())
    ref = bf16_twin(m8, kind)
    x = torch.randn(16, 64, dtype=BF16)
    assert same(step(m8, x, None, fp8=False), step(ref, x, None, fp8=False))
    with torch.no_grad():
        assert torch.equal(m8(x), ref(x))
    bad = bf16_twin(m8, kind)
    with torch.no_grad():
        getattr(bad, WEIGHTS[kind][0])[0, 0] += 0.5
        assert not torch.equal(m8(x), bad(x))


def count_weight_casts(monkeypatch):
    """Count the casts of weight roles (forward role 3i + 1): FP8Call._quantize
    calls, and the casts the one-call steps make (_fp8_gemm._cast_args)."""
    calls = []
    real, real_args = _fp8.FP8Call._quantize, _fp8_gemm._cast_args

    def counting(self, t, fp8_dtype, role, forward, *a, **k):
        if forward and role % 3 == 1:
            calls.append(role)
        return real(self, t, fp8_dtype, role, forward, *a, **k)

    def counting_args(f, t, fp8_dtype, role, forward, *a, **k):
        if forward and role % 3 == 1:
            calls.append(role)
        return real_args(f, t, fp8_dtype, role, forward, *a, **k)
    monkeypatch.setattr(_fp8.FP8Call, "_quantize", counting)
    monkeypatch.setattr(_fp8_gemm, "_cast_args", counting_args)
    return calls


@pytest.mark.parametrize("rname", RECIPES)
def test_the_gemms_read_the_weight_bytes_without_a_cast(monkeypatch, rname, dev):
    recipe = RECIPES[rname]()
    m8 = fp8_layer("LayerNormMLP", recipe, dev)
    ref = bf16_twin(m8, "LayerNormMLP")
    calls = count_weight_casts(monkeypatch)
    blocks = []  # block scaling's casts of weights (kind 1)
    real_blocks = _fp8.FP8Call._quantize_blocks

    def counting_blocks(self, t, fp8_dtype, kind, *a):
        if kind == 1:
            blocks.append(kind)
        return real_blocks(self, t, fp8_dtype, kind, *a)
    monkeypatch.setattr(_fp8.FP8Call, "_quantize_blocks", counting_blocks)
    operands = []
    real = _fp8.FP8Call._primary_weight
    monkeypatch.setattr(_fp8.FP8Call, "_primary_weight", lambda self, w: operands.append((w, real(self, w)))
                        or operands[-1][1])
    x = torch.randn(16, 64, dtype=BF16, device=dev)
    step(m8, x, recipe)
    assert calls == []
    assert [w for w, _ in operands] == [m8.fc1_weight, m8.fc2_weight]
    for w, q in operands:  # the parameter's own storage, not a copy
        data, scale_inv = storage(w)
        assert q.data is data and q.scale_inv is scale_inv and q.data_t is transpose(w)
    step(ref, x, recipe)  # the same counter sees the bf16 layer's casts
    assert calls == [1, 4]
    assert blocks == ([] if rname != "block" else [1, 1])


def test_the_transpose_is_made_once_per_weight_update(dev):
    recipe = DelayedScaling()
    m8 = fp8_layer("Linear", recipe, dev)
    w = m8.weight
    x = torch.randn(16, 64, dtype=BF16, device=dev)
    with torch.no_grad(), te.autocast(recipe=recipe):
        m8(x)
    assert w._transpose is None  # no backward: no transpose
    step(m8, x, recipe)
    t = w._transpose
    assert t is not None and torch.equal(t, w._data.t())
    step(m8, x, recipe)
    assert w._transpose is t  # kept: the weight did not change
    torch.optim.SGD(m8.parameters(), lr=0.1).step()
    assert w._transpose is None and w._transpose_invalid  # dropped by the in-place update
    step(m8, x, recipe)
    assert w._transpose is not t and torch.equal(w._transpose, w._data.t())


# ------------------------------------------------------------ training


def train(m, o, x, target, recipe, steps=6):
    losses = []
    for _ in range(steps):
        with te.autocast(recipe=recipe):
            loss = (m(x).float() - target.float()).square().mean()
        loss.backward()
        for p in m.parameters():
            assert p.grad.dtype == BF16 and type(p.grad) is torch.Tensor
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt", ["SGD", "Adam"])
@pytest.mark.parametrize("rname", ["delayed", "current", "block"])
def test_optimizers_train_fp8_weights_in_place(opt, rname, dev):
    recipe = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}[rname]()
    m8 = fp8_layer("LayerNormMLP", recipe, dev)
    w = m8.fc1_weight
    data, scale_inv = storage(w)
    before = (data.clone(), scale_inv.clone())
    o = torch.optim.SGD(m8.parameters(), lr=5.0) if opt == "SGD" else torch.optim.Adam(m8.parameters(), lr=1e-2)
    x = torch.randn(32, 64, dtype=BF16, device=dev)
    target = torch.randn(32, 64, dtype=BF16, device=dev)
    losses = train(m8, o, x, target, recipe)
    assert losses[-1] < 0.9 * losses[0], losses
    assert m8.fc1_weight is w and isinstance(w, QuantizedTensor)
    assert storage(w)[0] is data and storage(w)[1] is scale_inv  # updated in their storage
    assert transpose(w) is None  # dropped by the update
    assert not torch.equal(data, before[0]) and not torch.equal(scale_inv, before[1])


def test_without_an_update_nothing_trains():
    """The negative case of the test above: lr=0 re-quantizes the same
    values (current scaling: the same amax), so bytes and loss stay."""
    recipe = Float8CurrentScaling()
    m8 = fp8_layer("LayerNormMLP", recipe)
    data = m8.fc1_weight._data.clone()
    losses = train(m8, torch.optim.SGD(m8.parameters(), lr=0.0), torch.randn(32, 64, dtype=BF16),
                   torch.randn(32, 64, dtype=BF16), recipe, steps=3)
    assert not losses[-1] < 0.9 * losses[0] and len(set(losses)) == 1
    assert torch.equal(m8.fc1_weight._data, data)


def test_an_in_place_update_requantizes_with_the_quantizers_scale():
    """Current scaling: the new scale comes from the new values' amax;
    delayed: the meta's scale, the amax recorded in the history's row 0."""
    m = fp8_layer("Linear", Float8CurrentScaling())
    w = m.weight
    data, scale_inv = w._data.clone(), w._scale_inv.item()
    with torch.no_grad():
        w.mul_(4)
    assert w._scale_inv.item() == pytest.approx(4 * scale_inv, rel=1e-6)  # from the new amax
    assert torch.equal(w._data, data)  # the same FP8 values under a 4x scale
    md = fp8_layer("Linear", DelayedScaling())
    wd = md.weight
    hist = md.fp8_meta["scaling_fwd"].amax_history
    hist.zero_()
    md.fp8_meta["scaling_fwd"].scale[1] = 8.0
    with torch.no_grad():
        wd.add_(0.0)
    assert wd._scale_inv.item() == 1 / 8.0
    assert hist[0, 1].item() == pytest.approx(wd.dequantize().abs().max().item(), rel=0.07)


def test_main_grad_with_fuse_wgrad_accumulation_matches_the_bf16_layer(dev):
    recipe = DelayedScaling()
    with te.quantized_model_init(recipe=recipe):
        m8 = te.Linear(64, 32, params_dtype=BF16, device=dev, fuse_wgrad_accumulation=True)
    ref = te.Linear(64, 32, params_dtype=BF16, device=dev, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        ref.weight.copy_(m8.weight.dequantize())
        ref.bias.copy_(m8.bias)
    x = torch.randn(16, 64, dtype=BF16, device=dev)
    for m in (m8, ref):
        m.weight.main_grad = torch.zeros(32, 64, device=dev)
        for first in (True, False):
            with te.autocast(recipe=recipe):
                y = m(x, is_first_microbatch=first)
            y.float().sum().backward()
    assert m8.weight.main_grad.abs().sum() > 0
    assert torch.equal(m8.weight.main_grad, ref.weight.main_grad)


# ------------------------------------------------------------ tensor semantics


def test_tensor_operations_behave_as_te():
    m = fp8_layer("Linear", Float8CurrentScaling())
    w = m.weight
    d = w.detach()
    assert type(d) is Float8Tensor and d._data is w._data and not d.requires_grad
    c = w.clone()
    assert type(c) is Float8Tensor and c._data.data_ptr() != w._data.data_ptr() and torch.equal(c._data, w._data)
    f = w.float()
    assert type(f) is torch.Tensor and f.dtype == torch.float32 and torch.equal(f, w.dequantize(dtype=torch.float32))
    assert type(w.to(torch.float16)) is torch.Tensor and w.to(torch.float16).dtype == torch.float16
    v = w.detach().view(-1)
    assert type(v) is Float8Tensor and v.shape == (32 * 64,) and v._data.data_ptr() == w._data.data_ptr()
    r = w.detach().reshape(64, 32)
    assert type(r) is Float8Tensor and torch.equal(r.dequantize(), w.dequantize().reshape(64, 32))
    s = w * 2
    assert type(s) is torch.Tensor and torch.equal(s, w.dequantize() * 2)


def test_a_deep_copied_model_has_its_own_bytes_and_scales():
    recipe = DelayedScaling()
    m = fp8_layer("LayerNormMLP", recipe)
    m2 = copy.deepcopy(m)
    w, w2 = m.fc1_weight, m2.fc1_weight
    assert type(w2) is Float8Tensor and isinstance(w2, torch.nn.Parameter) and w2.requires_grad
    assert torch.equal(w2._data, w._data) and w2._data.data_ptr() != w._data.data_ptr()
    assert w2._quantizer.scale.data_ptr() == m2.fp8_meta["scaling_fwd"].scale[1:2].data_ptr()
    x = torch.randn(16, 64, dtype=BF16)
    with torch.no_grad(), te.autocast(recipe=recipe):
        assert torch.equal(m(x), m2(x))
    with torch.no_grad():
        w2.mul_(2)
    assert not torch.equal(w2.dequantize(), w.dequantize())  # the original is untouched


@pytest.mark.parametrize("rname", ["delayed", "block"])
def test_state_dict_round_trip(rname):
    recipe = RECIPES[rname]()
    m = fp8_layer("LayerNormMLP", recipe)
    x = torch.randn(16, 64, dtype=BF16)
    with te.autocast(recipe=recipe):
        m(x).sum().backward()  # a step of scale history in the extra state
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    kind = Float8BlockwiseQTensor if rname == "block" else Float8Tensor
    assert type(sd["fc1_weight"]) is kind
    m2 = fp8_layer("LayerNormMLP", recipe)
    assert not torch.equal(storage(m2.fc1_weight)[0], storage(m.fc1_weight)[0])
    m2.load_state_dict(sd)
    for name in ("fc1_weight", "fc2_weight"):
        a, b = getattr(m, name), getattr(m2, name)
        assert type(b) is kind and all(torch.equal(u, v) for u, v in zip(storage(a), storage(b)))
    if rname == "delayed":
        assert torch.equal(m.fp8_meta["scaling_fwd"].scale, m2.fp8_meta["scaling_fwd"].scale)
    with torch.no_grad(), te.autocast(recipe=recipe):
        assert torch.equal(m(x), m2(x))
    plain = LAYERS["LayerNormMLP"]("cpu")  # into bf16 parameters: the dequantized values
    plain.load_state_dict(sd)
    assert torch.equal(plain.fc1_weight, m.fc1_weight.dequantize())
    m3 = fp8_layer("LayerNormMLP", recipe)  # from bf16 parameters: quantized into the FP8 storage
    m3.load_state_dict(plain.state_dict())
    assert torch.equal(m3.fc1_weight.dequantize(), plain.fc1_weight)


def test_preserve_high_precision_init_val():
    known = torch.randn(32, 64) * 0.02

    def init(t):
        with torch.no_grad():
            t.copy_(known)
    with te.quantized_model_init(enabled=True, preserve_high_precision_init_val=True):
        m = te.Linear(64, 32, params_dtype=BF16, device="cpu", init_method=init)
    hp = m.weight.get_high_precision_init_val()
    assert hp.device.type == "cpu" and hp.dtype == BF16 and torch.equal(hp, known.to(BF16))
    assert not torch.equal(m.weight.dequantize(), hp)  # the parameter holds the FP8 values
    m.weight.clear_high_precision_init_val()
    assert m.weight.get_high_precision_init_val() is None and not hasattr(m.weight, "_high_precision_init_val")
    with te.quantized_model_init(enabled=True):
        m = te.Linear(64, 32, params_dtype=BF16, device="cpu")
    assert not hasattr(m.weight, "get_high_precision_init_val")


# ------------------------------------------------------------ errors


def test_bad_recipes_raise_naming_the_argument():
    with pytest.raises(NotImplementedError, match="quantized_model_init: recipe=MXFP8BlockScaling"):
        with te.quantized_model_init(enabled=True, recipe=MXFP8BlockScaling()):
            pass
    with pytest.raises(NotImplementedError, match=r"fp8_model_init: recipe=Float8BlockScaling\(w_block_scaling_dim=1"):
        with te.fp8_model_init(enabled=True, recipe=Float8BlockScaling(w_block_scaling_dim=1)):
            pass
    with pytest.raises(TypeError, match="recipe must be"):
        with te.quantized_model_init(enabled=True, recipe="delayed"):
            pass
    assert not G.with_fp8_parameters()
    with te.quantized_model_init(enabled=False, recipe="ignored when off"):
        assert not G.with_fp8_parameters()


def test_a_per_tensor_weight_refuses_block_scaling_and_a_lost_quantizer():
    m = fp8_layer("Linear", DelayedScaling())
    with te.autocast(recipe=Float8BlockScaling()):
        with pytest.raises(ValueError, match="Float8Tensor weight .* Float8BlockScaling GEMM"):
            m(torch.randn(16, 64, dtype=BF16))
    mb = fp8_layer("Linear", Float8BlockScaling())
    with te.autocast(recipe=DelayedScaling()):
        with pytest.raises(ValueError, match="Float8BlockwiseQTensor weight .* DelayedScaling GEMM"):
            mb(torch.randn(16, 64, dtype=BF16))
    with te.autocast(recipe=Float8BlockScaling(w_block_scaling_dim=1)):
        with pytest.raises(ValueError, match="w_block_scaling_dim=1"):
            mb(torch.randn(16, 64, dtype=BF16))
    buf = io.BytesIO()
    torch.save(m.weight.detach(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is Float8Tensor and torch.equal(loaded._data, m.weight._data)
    with pytest.raises(RuntimeError, match="no quantizer"):
        loaded.add_(1)


# ------------------------------------------------------------ memory


@pytest.mark.parametrize("rname", ["delayed", "block"])
def test_parameter_memory_is_at_most_0_6_of_bf16(dev, rname):
    """A memory fact (bytes): FP8 primary weights hold <= 0.6x the bf16
    model's parameter bytes, built and after a training step; the measure
    counts a held transpose (so it is not blind to one)."""
    recipe = RECIPES[rname]()
    hp = bench.build(te, 256, False, recipe, dev)
    f8 = bench.build(te, 256, True, recipe, dev)
    ratio = bench.param_bytes(f8) / bench.param_bytes(hp)
    assert ratio <= 0.6, ratio
    opt = torch.optim.SGD(f8.parameters(), lr=1e-3)
    bench.train_step(te, f8, torch.randn(32, 256, dtype=BF16, device=dev), recipe, opt)
    assert bench.param_bytes(f8) / bench.param_bytes(hp) <= 0.6
    w = f8[0].fc1_weight
    held = bench.param_bytes(f8)
    if rname == "block":
        w.update_usage(columnwise_usage=True)
        assert bench.param_bytes(f8) == held + w.numel() + w._columnwise_scale_inv.numel() * 4
    else:
        w.get_transpose()
        assert bench.param_bytes(f8) == held + w.numel()


def test_bench_fp8_params_runs_on_cpu(tmp_path):
    out = tmp_path / "b"
    r = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--fp8", "--fp8-params", "--device",
                        "cpu", "--hidden", "128", "--tokens", "32", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    row = json.loads((out / "fp8_params.json").read_text())["rows"][0]
    assert row["block"] == "fp8_params" and row["status"] == "PASS"
    assert row["ratios"]["params_fp8_vs_bf16"] <= 0.6 and row["bytes"]["fp8_step_peak"] is None
    assert "FP8 primary weights" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "transformer_engine_c.bench", "--fp8", "--fp8-params", "--device",
                          "cpu", "--hidden", "100"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--hidden" in bad.stderr


# ------------------------------------------------------------ sharded


def test_distributed_weight_of_fp8_shards_gathers_in_fp8():
    """tests/distributed/run_fp8_distributed_weight.py on 2 ranks (gloo):
    the gather moves uint8 bytes with one agreed scale, the layer's results
    equal the unsharded FP8 weight's, and its negative case (no amax
    reduction: the gather must re-scale) holds."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "distributed"))
    from launch import run_torchrun
    out = run_torchrun("run_fp8_distributed_weight.py", 2, timeout=300)
    assert "2 ranks" in out


def test_distributed_weight_of_an_fp8_shard_on_one_rank():
    recipe = Float8CurrentScaling()
    m = fp8_layer("Linear", recipe)
    full = m.weight
    w = te.DistributedWeight(full.detach())
    assert type(w).__name__ == "Float8DistributedWeight" and isinstance(w, torch.nn.Parameter)
    assert w.is_distributed_weight and w.world_size == 1 and w._data is full._data
    g = w.materialize()
    assert type(g) is Float8Tensor and g._data is full._data and w.gather_count == 1
    ref = bf16_twin(m, "Linear")
    m.weight = w
    x = torch.randn(16, 64, dtype=BF16)
    got = step(m, x, recipe)
    assert w.gather_count == 3 and w.grad is not None and w.grad.dtype == BF16  # forward and backward gather
    assert same(got, step(ref, x, recipe))


def test_a_block_scaled_shard_is_refused_naming_it():
    m = fp8_layer("Linear", Float8BlockScaling())
    with pytest.raises(NotImplementedError, match="Float8BlockwiseQTensor shard"):
        te.DistributedWeight.from_full(m.weight)
