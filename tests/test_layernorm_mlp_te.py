"""TransformerEngine's per-argument semantics of LayerNormMLP on one rank,
against the float64 reference (tests/mlp_reference.py):
fuse_wgrad_accumulation with main_grad for both weights, is_first_microbatch,
delay_wgrad_compute + backward_dw (both GEMMs and both biases, also with
checkpoint=True), torch.autocast, the RNG tracker and init methods, the
arguments TE has and we refuse."""
import contextlib

import pytest
import torch

import transformer_engine_c as tec
from helpers import rel_err
from mlp_reference import layernorm_mlp

H, FFN = 32, 48
TOL32 = 1e-5


def make(**kw):
    kw.setdefault("device", "cpu")
    m = tec.LayerNormMLP(H, FFN, activation="swiglu", **kw)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in m.named_parameters():
            v = torch.randn(p.shape, generator=g) * 0.3 + (1.0 if n == "layer_norm_weight" else 0.0)
            p.copy_(v.to(p.dtype))
    return m


def reference(m, x, dy):
    """(y, dx, {name: grad}) in float64."""
    p = {n: t.detach().double().requires_grad_() for n, t in m.named_parameters()}
    xr = x.detach().double().requires_grad_()
    y, _ = layernorm_mlp(xr, p, activation=m.activation, normalization=m.normalization, eps=m.eps)
    y.backward(dy.double())
    return y, xr.grad, {n: t.grad for n, t in p.items()}


def test_fuse_wgrad_accumulation():
    m = make(fuse_wgrad_accumulation=True)
    for n in ("fc1_weight", "fc2_weight"):
        getattr(m, n).main_grad = torch.full(getattr(m, n).shape, 0.5)
    want = {}
    for i in range(3):
        x, dy = torch.randn(16, H), torch.randn(16, H)
        m(x, is_first_microbatch=(i == 0) if i < 2 else None).backward(dy)
        grads = reference(m, x, dy)[2]
        for n in ("fc1_weight", "fc2_weight"):  # the first micro-batch overwrites the 0.5s
            want[n] = grads[n] if i == 0 else want[n] + grads[n]
    for n in ("fc1_weight", "fc2_weight"):
        p = getattr(m, n)
        assert p.grad is None, n  # without Megatron's attribute: no gradient through autograd
        assert rel_err(p.main_grad, want[n]) < TOL32, n
    assert m.fc1_bias.grad is not None and m.fc2_bias.grad is not None


def test_fuse_wgrad_accumulation_needs_main_grad():
    m = make(fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="needs the weight's main_grad"):
        m(torch.randn(8, H)).sum().backward()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_delay_wgrad_compute(checkpoint):
    m = make(delay_wgrad_compute=True, checkpoint=checkpoint)
    assert m.need_backward_dw() and m.fc1_weight.skip_backward_post_hook and m.fc2_bias.skip_backward_post_hook
    x = torch.randn(16, H, requires_grad=True)
    dy = torch.randn(16, H)
    m(x).backward(dy)
    _, dx, grads = reference(m, x, dy)
    assert rel_err(x.grad, dx) < TOL32
    assert rel_err(m.layer_norm_weight.grad, grads["layer_norm_weight"]) < TOL32
    for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        assert getattr(m, n).grad is None, f"{n}: left for backward_dw"
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    m.backward_dw()
    assert calls == [1]
    for n in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        assert rel_err(getattr(m, n).grad, grads[n]) < TOL32, n
    with pytest.raises(RuntimeError, match="no delayed weight gradient is pending"):
        m.backward_dw()


def test_delay_wgrad_compute_rejects_bulk_wgrad():
    c = tec.CommOverlap((16, H), torch.float32, tp_size=1, name="mlp_delay_bulk", device="cpu")
    c2 = tec.CommOverlap((16, H), torch.float32, tp_size=1, name="mlp_delay_bulk2", device="cpu")
    try:
        with pytest.raises(ValueError, match="delay_wgrad_compute cannot be combined with ub_bulk_wgrad"):
            make(delay_wgrad_compute=True, set_parallel_mode=True, ub_bulk_wgrad=True,
                 ub_comm={"fc1_dgrad": c, "fc1_wgrad": c2})
    finally:
        c.close()
        c2.close()


def test_torch_autocast():
    """fp32 master weights, bf16 compute under torch.autocast (as TE)."""
    m = make()
    x = torch.randn(16, H, requires_grad=True)
    dy = torch.randn(16, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    yr, dx, grads = reference(m, x, dy)
    assert rel_err(y, yr) < 0.04 and x.grad.dtype == torch.float32 and rel_err(x.grad, dx) < 0.04
    for n, p in m.named_parameters():
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, grads[n]) < 0.04, n


def test_rng_tracker_and_init_methods():
    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            yield

    def fc1_init(w):
        torch.nn.init.constant_(w, 0.25)

    m = tec.LayerNormMLP(H, FFN, device="cpu", get_rng_state_tracker=Tracker, init_method=fc1_init,
                         output_layer_init_method=lambda w: torch.nn.init.constant_(w, -0.5))
    assert forks == ["model-parallel-rng", "model-parallel-rng"]  # one fork per weight, as TE
    assert (m.fc1_weight == 0.25).all() and (m.fc2_weight == -0.5).all()


def test_symmetric_ar_type_not_supported():
    with pytest.raises(NotImplementedError, match="symmetric_ar_type='one_shot'"):
        tec.LayerNormMLP(H, FFN, device="cpu", symmetric_ar_type="one_shot")


def test_module_namespace():
    assert tec.module.LayerNormMLP is tec.LayerNormMLP
