"""TransformerEngine's per-argument semantics of Linear and LayerNormLinear on
one rank, each against a float64 reference: fuse_wgrad_accumulation with
main_grad (and TE's grad_added_to_main_grad protocol), is_first_microbatch,
delay_wgrad_compute + backward_dw, torch.autocast, parameters_split,
save_original_input, the RNG tracker, TE's default initialisation and
parameter attributes, DistributedWeight gathered once per step."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import transformer_engine_c as tec
from helpers import TOL, rel_err

LAYERS = ["Linear", "LayerNormLinear"]


def _make(layer, device, **kw):
    m = getattr(tec, layer)(32, 24, device=device, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return m


def _reference(m, x, dy):
    """(dx, {param name: grad}) of the same layer in float64 on the CPU."""
    p = {n: t.detach().double().cpu().requires_grad_() for n, t in m.named_parameters()}
    xr = x.detach().double().cpu().requires_grad_()
    h = xr
    if "layer_norm_weight" in p:
        h = torch.nn.functional.layer_norm(xr, (xr.shape[-1],), p["layer_norm_weight"], p["layer_norm_bias"],
                                           m.eps)
    w = torch.cat([p[n] for n in m.weight_names])
    b = torch.cat([p[n] for n in m.bias_names]) if m.use_bias else None
    y = torch.nn.functional.linear(h, w, b)
    y.backward(dy.double().cpu())
    return y, xr.grad, {n: t.grad for n, t in p.items()}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_wgrad_accumulation(device, layer, dtype):
    m = _make(layer, device, fuse_wgrad_accumulation=True, params_dtype=dtype)
    m.weight.main_grad = torch.full(m.weight.shape, 0.5, dtype=torch.float32, device=device)
    xs = [torch.randn(8, 32, dtype=dtype, device=device) for _ in range(3)]
    dys = [torch.randn(8, 24, dtype=dtype, device=device) for _ in range(3)]
    want = torch.zeros(m.weight.shape, dtype=torch.float64)
    for i, (x, dy) in enumerate(zip(xs, dys)):
        first = i == 0
        m(x, is_first_microbatch=first if i < 2 else None).backward(dy)
        dw = _reference(m, x, dy)[2]["weight"]
        want = dw if first else want + dw  # the first micro-batch overwrites the 0.5s
    assert m.weight.main_grad.dtype == torch.float32
    assert rel_err(m.weight.main_grad, want) < TOL[dtype] * 3
    assert m.weight.grad is None  # without Megatron's attribute: no gradient through autograd
    if m.use_bias:
        assert m.bias.grad is not None  # other parameters' gradients go through autograd as usual


def test_grad_added_to_main_grad_protocol(device):
    """Megatron's DDP: the weight gets grad_added_to_main_grad = True and a
    dummy gradient (zeros when zero_out_wgrad) that its hook ignores."""
    m = _make("Linear", device, fuse_wgrad_accumulation=True)
    m.weight.main_grad = torch.zeros(m.weight.shape, device=device)
    m.weight.grad_added_to_main_grad = False
    m.weight.zero_out_wgrad = True
    x, dy = torch.randn(8, 32, device=device), torch.randn(8, 24, device=device)
    m(x).backward(dy)
    assert m.weight.grad_added_to_main_grad is True
    assert m.weight.grad is not None and not m.weight.grad.any()
    assert rel_err(m.weight.main_grad, _reference(m, x, dy)[2]["weight"]) < TOL[torch.float32] * 3


@pytest.mark.parametrize("layer", LAYERS)
def test_delay_wgrad_compute(device, layer):
    m = _make(layer, device, delay_wgrad_compute=True)
    assert m.weight.skip_backward_post_hook and m.need_backward_dw()
    x = torch.randn(8, 32, device=device, requires_grad=True)
    dy = torch.randn(8, 24, device=device)
    m(x).backward(dy)
    _, dx, grads = _reference(m, x, dy)
    assert rel_err(x.grad, dx) < TOL[torch.float32] * 3
    assert m.weight.grad is None and m.bias.grad is None  # left for backward_dw
    if layer == "LayerNormLinear":
        assert rel_err(m.layer_norm_weight.grad, grads["layer_norm_weight"]) < TOL[torch.float32] * 3
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    m.backward_dw()
    assert calls == [1]
    assert rel_err(m.weight.grad, grads["weight"]) < TOL[torch.float32] * 3
    assert rel_err(m.bias.grad, grads["bias"]) < TOL[torch.float32] * 3
    with pytest.raises(RuntimeError, match="no delayed weight gradient is pending"):
        m.backward_dw()


@pytest.mark.parametrize("layer", LAYERS)
def test_torch_autocast(layer):
    """fp32 master weights, bf16 compute under torch.autocast (as TE): the
    output is bf16, every parameter's gradient fp32, all close to fp64."""
    m = _make(layer, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    dy = torch.randn(8, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    yr, dx, grads = _reference(m, x, dy)
    assert x.grad.dtype == torch.float32 and rel_err(x.grad, dx) < TOL[torch.bfloat16] * 3
    assert rel_err(y, yr) < TOL[torch.bfloat16] * 3
    for n, p in m.named_parameters():
        assert p.grad.dtype == torch.float32, n
        assert rel_err(p.grad, grads[n]) < TOL[torch.bfloat16] * 3, n


def test_parameters_split(device):
    m = _make("Linear", device, parameters_split={"query_": 8, "key_": 8, "value_": 8})
    names = [n for n, _ in m.named_parameters()]
    assert names == ["query_weight", "key_weight", "value_weight", "query_bias", "key_bias", "value_bias"]  # TE's order
    assert m.key_weight.shape == (8, 32) and m.key_weight.data_ptr() == m.query_weight.data_ptr() + 8 * 32 * 4
    x = torch.randn(8, 32, device=device, requires_grad=True)
    dy = torch.randn(8, 24, device=device)
    y = m(x)
    y.backward(dy)
    yr, dx, grads = _reference(m, x, dy)
    assert rel_err(y, yr) < TOL[torch.float32] * 3 and rel_err(x.grad, dx) < TOL[torch.float32] * 3
    for n, p in m.named_parameters():
        assert rel_err(p.grad, grads[n]) < TOL[torch.float32] * 3, n
    even = tec.LayerNormLinear(32, 24, parameters_split=("q", "k", "v"), device=device)
    assert even.q_weight.shape == (8, 32) and even.v_bias.shape == (8,)
    with pytest.raises(ValueError, match="do not add up to out_features=24"):
        tec.Linear(32, 24, parameters_split={"a": 8, "b": 8}, device=device)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("return_bias", [False, True])
def test_split_parameters_enter_the_function_one_by_one(kind, return_bias):
    """Split parameters reach the GEMMs joined without a copy in autograd's
    graph: the same output and each parameter's gradient as a layer of one
    weight with their values, over steps with the parameters updated in
    place (the joined view sees it), and after one is replaced by a tensor
    elsewhere in memory (joined by a copy then); delay_wgrad_compute's
    gradients land in each split parameter too."""
    torch.manual_seed(0)
    split = {"query_": 8, "key_": 8, "value_": 8}
    m = getattr(tec, kind)(16, 24, parameters_split=split, return_bias=return_bias, device="cpu")
    one = getattr(tec, kind)(16, 24, return_bias=return_bias, device="cpu")
    names = ("query_", "key_", "value_")

    def sync():
        with torch.no_grad():
            one.weight.copy_(torch.cat([getattr(m, n + "weight") for n in names]))
            one.bias.copy_(torch.cat([getattr(m, n + "bias") for n in names]))
    x, dy = torch.randn(6, 16), torch.randn(6, 24)
    for step in range(3):
        if step == 1:  # a new Parameter over the same memory: the gradient is its own
            m.value_weight = torch.nn.Parameter(m.value_weight.data)
        if step == 2:  # a replaced parameter no longer lies beside the others
            m.key_weight = torch.nn.Parameter(m.key_weight.detach().clone() + 1.0)
        sync()
        for p in list(m.parameters()) + list(one.parameters()):
            p.grad = None
        outs = []
        for layer in (m, one):
            y = layer(x)
            y, b = (y[0], y[1]) if return_bias else (y, None)
            (y if b is None else y + b).backward(dy)
            outs.append(y)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat([getattr(m, n + "weight").grad for n in names]), one.weight.grad)
        torch.testing.assert_close(torch.cat([getattr(m, n + "bias").grad for n in names]), one.bias.grad)
        with torch.no_grad():  # an optimizer step, in place
            for n in names:
                getattr(m, n + "weight").mul_(0.5).add_(0.25)
        with torch.no_grad():
            y_ng = m(x)
        sync()
        with torch.no_grad():
            y_ref = one(x)
        torch.testing.assert_close(y_ng[0] if return_bias else y_ng, y_ref[0] if return_bias else y_ref)
    c = copy.deepcopy(m)  # a copy keeps no view of the original's parameters
    assert "_joined" in m.__dict__ and "_joined" not in c.__dict__
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
    d = getattr(tec, kind)(16, 24, parameters_split=split, delay_wgrad_compute=True, device="cpu")
    d(x).backward(dy)
    assert d.query_weight.grad is None
    d.backward_dw()
    assert all(getattr(d, n + "weight").grad is not None for n in names)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
def test_split_parameters_follow_a_data_swap(kind):
    """The joined view kept for split parameters is made again when a
    parameter's .data moves (the same Parameter object over other memory),
    back to back with the others or not."""
    torch.manual_seed(0)
    m = getattr(tec, kind)(16, 24, parameters_split={"query_": 8, "key_": 8, "value_": 8}, device="cpu")
    names = ("query_", "key_", "value_")
    x = torch.randn(6, 16)

    def ref():
        w = torch.cat([getattr(m, n + "weight") for n in names])
        b = torch.cat([getattr(m, n + "bias") for n in names])
        h = x if kind == "Linear" else F.layer_norm(x, (16,), m.layer_norm_weight, m.layer_norm_bias, m.eps)
        return F.linear(h, w, b)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref())
        whole = torch.randn(24, 16)  # new memory, the three back to back
        for i, n in enumerate(names):
            getattr(m, n + "weight").data = whole[8 * i:8 * (i + 1)]
        torch.testing.assert_close(m(x), ref())
        m.key_weight.data = torch.randn(8, 16)  # elsewhere: joined by a copy
        torch.testing.assert_close(m(x), ref())
        m.key_weight.data = whole[8:16]  # back beside the others
        torch.testing.assert_close(m(x), ref())


def test_save_original_input(device):
    m = _make("Linear", device, save_original_input=True)
    x = torch.randn(4, 2, 32, device=device, requires_grad=True)
    dy = torch.randn(4, 2, 24, device=device)
    m(x).backward(dy)
    _, dx, grads = _reference(m, x, dy)
    assert rel_err(x.grad, dx) < TOL[torch.float32] * 3
    assert rel_err(m.weight.grad, grads["weight"]) < TOL[torch.float32] * 3


class _Tracker:
    """Megatron's CUDA RNG tracker's interface: fork(name) around init."""

    def __init__(self):
        self.forks = []

    def fork(self, name="model-parallel-rng"):
        tracker = self

        class _Fork:
            def __enter__(self):
                tracker.forks.append(name)
                torch.manual_seed(1234)

            def __exit__(self, *exc):
                return False
        return _Fork()


def test_rng_tracker_and_init(device):
    t = _Tracker()
    a = tec.Linear(32, 24, get_rng_state_tracker=lambda: t, rng_tracker_name="tp-rng", device=device)
    b = tec.Linear(32, 24, get_rng_state_tracker=lambda: t, rng_tracker_name="tp-rng", device=device)
    assert t.forks == ["tp-rng", "tp-rng"]
    torch.testing.assert_close(a.weight, b.weight)  # both initialised under the tracker's state
    tec.LayerNormLinear(32, 24, get_rng_state_tracker=lambda: t, device=device)
    assert t.forks[-1] == "model-parallel-rng"
    big = tec.Linear(256, 512, device=device)  # TE's default: normal(0, 0.023), zero bias
    assert abs(big.weight.std().item() - 0.023) < 0.002 and not big.bias.any()
    calls = []
    tec.Linear(32, 24, init_method=lambda w: calls.append(tuple(w.shape)) or w.fill_(0.5), device=device)
    assert calls == [(24, 32)]


def test_te_parameter_attributes(device):
    col = tec.Linear(32, 24, parallel_mode="column", device=device)
    row = tec.Linear(32, 24, parallel_mode="row", bias=False, device=device)
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0 and col.bias.partition_dim == 0
    assert row.weight.partition_dim == 1
    assert isinstance(row.bias, torch.Tensor) and row.bias.numel() == 0  # TE: an empty tensor, not a parameter
    assert [n for n, _ in row.named_parameters()] == ["weight"]
    ln = tec.LayerNormLinear(32, 24, parallel_mode="column", sequence_parallel=True, device=device)
    assert ln.layer_norm_weight.sequence_parallel is False  # one rank: no sequence parallelism (as TE)
    rowln = tec.LayerNormLinear(32, 24, parallel_mode="row", device=device)  # TE offers it; norm of the local slice
    assert rowln.layer_norm_weight.shape == (32,)


def test_ignored_ub_flags_warn_once(device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = tec.Linear(32, 24, parallel_mode="column", ub_overlap_ag=True, ub_overlap_rs=True, ub_name="qkv",
                       device=device)
    assert len(caught) == 1 and "ub_overlap_ag, ub_overlap_rs ignored" in str(caught[0].message)
    assert not m.ub.enabled


def test_distributed_weight_gathered_once_per_step(device):
    m = _make("Linear", device)
    m.weight = tec.DistributedWeight.from_full(m.weight.detach())
    x = torch.randn(8, 32, device=device)
    for i in range(3):
        m(x, is_first_microbatch=i == 0).sum().backward()
    assert m.weight.gather_count == 1  # three forwards and backwards, one gather
    m(x).sum().backward()
    assert m.weight.gather_count == 3  # without is_first_microbatch: forward and backward each gather


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_frozen_parameters_get_nothing(device, layer, frozen):
    """A frozen weight (Megatron gives main_grad to trainable parameters
    only) or bias: no GEMM into main_grad, no .grad, no error; the other
    parameter's gradient is right, with fuse_wgrad_accumulation and with
    delay_wgrad_compute."""
    for kw in ({"fuse_wgrad_accumulation": True}, {"delay_wgrad_compute": True}):
        m = _make(layer, device, **kw)
        getattr(m, frozen).requires_grad_(False)
        if frozen == "bias" and kw.get("fuse_wgrad_accumulation"):
            m.weight.main_grad = torch.zeros(m.weight.shape, device=device)
        x = torch.randn(8, 32, device=device, requires_grad=True)
        dy = torch.randn(8, 24, device=device)
        m(x).backward(dy)
        if kw.get("delay_wgrad_compute"):
            m.backward_dw()
        _, dx, grads = _reference(m, x, dy)
        assert rel_err(x.grad, dx) < TOL[torch.float32] * 3
        assert getattr(m, frozen).grad is None and not hasattr(getattr(m, frozen), "main_grad") or frozen == "bias"
        if frozen == "weight":
            assert rel_err(m.bias.grad, grads["bias"]) < TOL[torch.float32] * 3
        elif kw.get("fuse_wgrad_accumulation"):
            assert m.bias.grad is None
            assert rel_err(m.weight.main_grad, grads["weight"]) < TOL[torch.float32] * 3
        else:
            assert m.bias.grad is None and rel_err(m.weight.grad, grads["weight"]) < TOL[torch.float32] * 3


@pytest.mark.parametrize("layer", ["LayerNormLinear", "LayerNormMLP"])
def test_input_inside_the_fprop_buffer(layer):
    """An input that is a view of the layer's own fprop buffer (the norm
    writes that slot on the overlapped path) gives the gradients of a plain
    input: the layer copies it first."""
    c = tec.CommOverlap((8, 32), torch.float32, device="cpu", name=f"inbuf_{layer}")
    try:
        kw = dict(ub_overlap_ag=True, ub_comm=c, device="cpu")
        if layer == "LayerNormLinear":
            m = tec.LayerNormLinear(32, 24, parallel_mode="column", **kw)
            ref = tec.LayerNormLinear(32, 24, parallel_mode="column", device="cpu")
        else:
            m = tec.LayerNormMLP(32, 48, set_parallel_mode=True, ub_comm=c, ub_overlap_ag=True, device="cpu")
            ref = tec.LayerNormMLP(32, 48, set_parallel_mode=True, device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        ref.load_state_dict(m.state_dict())
        x = torch.randn(8, 32)
        inside = c.get_buffer(local_chunk=True, shape=(8, 32), dtype=torch.float32)
        inside.copy_(x)
        xi, xr = inside.detach().requires_grad_(), x.clone().requires_grad_()
        y, yr = m(xi), ref(xr)
        dy = torch.randn_like(yr)
        y.backward(dy)
        yr.backward(dy)
        st = c.stats()
        assert st["ag_overlap"] + st["non_overlap"] >= 1, st  # the communicator's path ran (one rank: non_overlap)
        torch.testing.assert_close(y, yr)
        torch.testing.assert_close(xi.grad, xr.grad)
        for (n, p), pr in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, pr.grad, msg=n)
    finally:
        c.close()


@pytest.mark.parametrize("layer", ["LayerNormLinear", "LayerNormMLP"])
def test_return_layernorm_output_without_batch(layer):
    m = getattr(tec, layer)(16, 8, return_layernorm_output=True, device="cpu")
    x = torch.randn(4, 0, 16, requires_grad=True)
    y, ln = m(x)
    assert ln.shape == x.shape and y.shape[1] == 0
    (y.sum() + ln.sum()).backward()
    assert x.grad.shape == x.shape
