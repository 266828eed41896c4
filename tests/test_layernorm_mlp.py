"""tec.LayerNormMLP on one process against the float64 reference
(tests/mlp_reference.py): output and every gradient, every activation, both
norms, every dtype; TE's constructor (names, shapes, attributes); the
options (return_bias, return_layernorm_output, checkpoint=True, no bias, 3-D
input); the userbuffers paths on a one-rank communicator (counted by
stats(), nothing saved aliases a buffer); bad arguments."""
import pytest
import torch

import transformer_engine_c as tec
from helpers import rel_err
from mlp_reference import GATED, layernorm_mlp, norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACTS = sorted(tec._engine.ACTIVATIONS)
H, FFN = 32, 48


def randomise(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            v = torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.3 if p.dim() == 2 else 0.2)
            if n == "layer_norm_weight" and not m.zero_centered_gamma:
                v += 1.0
            p.copy_(v.to(p.dtype))


def params64(m):
    return {n: p.detach().double().cpu().requires_grad_() for n, p in m.named_parameters()}


def run_both(m, x, dy, ref_kw, dln=None):
    """(module outputs, module grads, reference outputs, reference grads)."""
    out = m(x)
    y = out[0] if isinstance(out, tuple) else out
    loss = (y * dy).sum()
    if dln is not None:
        loss = loss + (out[-1] * dln).sum()
    loss.backward()
    p = params64(m)
    x64 = x.detach().double().cpu().requires_grad_()
    # under return_bias the module leaves fc2's bias to the caller
    y64, n64 = layernorm_mlp(x64, {k: v for k, v in p.items() if not (m.return_bias and k == "fc2_bias")},
                             **ref_kw)
    loss64 = (y64 * dy.double().cpu()).sum()
    if dln is not None:
        loss64 = loss64 + (n64 * dln.double().cpu()).sum()
    loss64.backward()
    return out, y64, n64, x64, p


def check_grads(m, x, x64, p, tol):
    assert rel_err(x.grad, x64.grad) < tol, "input grad"
    for n, param in m.named_parameters():
        if m.return_bias and n == "fc2_bias":  # returned, not applied: no gradient
            assert param.grad is None and p[n].grad is None, n
            continue
        assert rel_err(param.grad, p[n].grad) < tol, n


def make(dtype, **kw):
    kw.setdefault("params_dtype", dtype)
    kw.setdefault("device", "cpu")
    return tec.LayerNormMLP(H, FFN, **kw)


def _ref_kw(m, act_kw=None):
    return dict(activation=m.activation, normalization=m.normalization, eps=m.eps,
                zero_centered_gamma=m.zero_centered_gamma, act_kw=act_kw)


def draw_input(m, shape, dtype, margin=0.02):
    """Random input; for relu/reglu in 16-bit each token is redrawn until
    none of its pre-activations lies within `margin` of the kink: rounding
    the normalised input to 16 bits moves fc1's output by ~3e-3, which can
    flip relu's derivative for one element against the float64 reference
    (an error of ~15% in every gradient upstream: ill-conditioned data, not a
    wrong kernel)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).reshape(-1, shape[-1])
    if dtype != torch.float32 and m.activation in ("relu", "reglu"):
        p = {n: t.detach().double().cpu() for n, t in m.named_parameters()}
        for r in range(x.shape[0]):
            for _ in range(100):
                n64 = norm(x[r].double(), p["layer_norm_weight"], p.get("layer_norm_bias"), m.eps,
                           m.normalization, m.zero_centered_gamma)
                pre = torch.nn.functional.linear(n64, p["fc1_weight"], p.get("fc1_bias"))
                if pre[:m.size_per_partition].abs().min() > margin:
                    break
                x[r] = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype)
            else:
                raise AssertionError("no token away from relu's kink")
    return x.reshape(shape).requires_grad_()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp(device, dtype, activation, normalization):
    m = make(dtype, activation=activation, normalization=normalization, device=device)
    randomise(m)
    x = draw_input(m, (24, H), dtype).detach().to(device).requires_grad_()
    dy = torch.randn(24, H, dtype=dtype).to(device)
    y, y64, _, x64, p = run_both(m, x, dy, _ref_kw(m))
    assert y.shape == (24, H) and y.dtype == dtype
    # a chain of five roundings to dtype (norm, fc1, activation, fc2, dgrads)
    tol = {torch.float32: 1e-5, torch.bfloat16: 0.04, torch.float16: 0.006}[dtype]
    assert rel_err(y, y64) < tol
    check_grads(m, x, x64, p, tol)


@pytest.mark.parametrize("opts", [
    dict(bias=False), dict(zero_centered_gamma=True), dict(return_bias=True), dict(checkpoint=True),
    dict(return_layernorm_output=True), dict(return_layernorm_output=True, return_bias=True, checkpoint=True),
    dict(activation="clamped_swiglu", activation_params={"limit": 0.8, "alpha": 1.3, "glu_linear_offset": 0.5}),
])
@pytest.mark.parametrize("ndim", [2, 3])
def test_options(device, opts, ndim):
    dtype = torch.float32
    m = make(dtype, device=device, **opts)
    randomise(m, 1)
    shape = (24, H) if ndim == 2 else (6, 4, H)
    x = torch.randn(*shape, dtype=dtype).to(device).requires_grad_()
    dy = torch.randn(*shape, dtype=dtype).to(device)
    dln = torch.randn(*shape, dtype=dtype).to(device) if m.return_layernorm_output else None
    out, y64, n64, x64, p = run_both(m, x, dy, _ref_kw(m, opts.get("activation_params")), dln)
    if m.return_bias or m.return_layernorm_output:
        assert isinstance(out, tuple) and len(out) == 1 + m.return_bias + m.return_layernorm_output
        if m.return_bias:
            assert out[1] is m.fc2_bias  # TE's order: output, bias, normalised input
    y = out[0] if isinstance(out, tuple) else out
    assert y.shape == shape
    assert rel_err(y, y64) < 1e-5
    if m.return_layernorm_output:
        assert out[-1].shape == shape and rel_err(out[-1], n64) < 1e-5
    check_grads(m, x, x64, p, 1e-5)


def test_checkpoint_saves_only_the_inputs():
    """checkpoint=True keeps fc1's output (and the activation's) out of the
    saved tensors: the bytes saved per step drop by them."""
    def saved_bytes(checkpoint):
        m = make(torch.float32, checkpoint=checkpoint, activation="swiglu")
        x = torch.randn(64, H, requires_grad=True)
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x)
        y.sum().backward()
        return sum(total)
    full, ckpt = saved_bytes(False), saved_bytes(True)
    fc1_out = 64 * 2 * FFN * 4
    assert full - ckpt >= fc1_out + 64 * FFN * 4, (full, ckpt)


def test_te_parameters():
    """Names, shapes and attributes as TE's (checkpoints load across)."""
    m = make(torch.float32, activation="swiglu")
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"layer_norm_weight": (H,), "layer_norm_bias": (H,), "fc1_weight": (2 * FFN, H),
                      "fc1_bias": (2 * FFN,), "fc2_weight": (H, FFN), "fc2_bias": (H,)}
    assert m.fc1_weight.partition_dim == 0 and m.fc2_weight.partition_dim == 1
    assert m.layer_norm_weight.sequence_parallel is False
    r = make(torch.float32, normalization="RMSNorm", bias=False, activation="gelu")
    assert [n for n, _ in r.named_parameters()] == ["layer_norm_weight", "fc1_weight", "fc2_weight"]
    assert r.fc1_weight.shape == (FFN, H) and r.layer_norm_bias is None
    assert r.fc1_bias.numel() == 0 and r.fc2_bias.numel() == 0  # TE's empty tensors, not parameters
    torch.testing.assert_close(m.layer_norm_weight, torch.ones(H))
    assert 0.015 < m.fc1_weight.std().item() < 0.032  # TE's default init: normal(0, 0.023)
    z = make(torch.float32, zero_centered_gamma=True)
    torch.testing.assert_close(z.layer_norm_weight, torch.zeros(H))
    # TE's positional order
    p = tec.LayerNormMLP(H, FFN, 1e-6, False, True, None, None, 1, None, False, "RMSNorm", "reglu",
                         device="cpu")
    assert p.eps == 1e-6 and p.return_bias and not p.use_bias and p.normalization == "RMSNorm"
    assert p.activation == "reglu" and p.fc1_weight.shape == (2 * FFN, H)


def test_state_dict_loads_into_the_gated_layout():
    """A state dict round-trips, and fc1's rows are [activation | gate]: the
    module equals the reference whose activation half is fc1_weight[:FFN]."""
    a = make(torch.float32, activation="geglu")
    randomise(a, 3)
    b = make(torch.float32, activation="geglu")
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, H)
    torch.testing.assert_close(a(x), b(x))
    p = {n: t.detach().double() for n, t in a.named_parameters()}
    swapped = dict(p, fc1_weight=torch.cat([p["fc1_weight"][FFN:], p["fc1_weight"][:FFN]]),
                   fc1_bias=torch.cat([p["fc1_bias"][FFN:], p["fc1_bias"][:FFN]]))
    y = a(x).double()
    assert rel_err(y, layernorm_mlp(x.double(), p, activation="geglu")[0]) < 1e-5
    assert rel_err(y, layernorm_mlp(x.double(), swapped, activation="geglu")[0]) > 1e-2


# ------------------------------------------------ userbuffers on one rank

UB_COMBOS = [
    dict(ub_overlap_ag=True), dict(ub_overlap_rs=True), dict(ub_overlap_rs_dgrad=True),
    dict(ub_bulk_dgrad=True), dict(ub_bulk_wgrad=True), dict(ub_bulk_dgrad=True, ub_bulk_wgrad=True),
    dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True),
    dict(ub_overlap_ag=True, ub_overlap_rs=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True),
]
EXPECT = {  # flag -> (communicator, counter, runs per forward+backward)
    "ub_overlap_ag": [("fc1_fprop", "ag_overlap"), ("fc2_dgrad", "ag_overlap")],
    "ub_overlap_rs": [("fc2_fprop", "rs_overlap")],
    "ub_overlap_rs_dgrad": [("fc1_dgrad", "rs_overlap")],
    "ub_bulk_dgrad": [("fc1_dgrad", "bulk_ag")],
    "ub_bulk_wgrad": [("fc1_wgrad", "bulk_rs")],
}


@pytest.mark.parametrize("flags", UB_COMBOS, ids=lambda f: "+".join(sorted(f)))
@pytest.mark.parametrize("checkpoint", [False, True])
def test_userbuffers_one_rank(flags, checkpoint):
    comms = {n: tec.CommOverlap((24, 2 * FFN), torch.float32, tp_size=1, name=f"mlp1_{n}", device="cpu",
                                min_chunk_flops=0) for n in ("fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop",
                                                             "fc2_dgrad")}
    try:
        kw = dict(activation="swiglu", set_parallel_mode=True, checkpoint=checkpoint)
        ub = make(torch.float32, ub_comm=comms, **flags, **kw)
        ref = make(torch.float32, **kw)
        randomise(ub, 4)
        ref.load_state_dict(ub.state_dict())
        assert set(ub.ub_comms()) <= set(comms)
        x = torch.randn(24, H)
        dy = torch.randn(24, H)
        before = {n: c.stats() for n, c in comms.items()}
        with tec.debug.check_saved_tensors(list(comms.values())) as chk:
            xi = x.clone().requires_grad_()
            y = ub(xi)
            y.backward(dy)
        assert chk.checked > 0 and not chk.violations
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        yr.backward(dy)
        assert rel_err(y, yr) < 1e-5 and rel_err(xi.grad, xr.grad) < 1e-5
        for (n, p), (_, pr) in zip(ub.named_parameters(), ref.named_parameters()):
            assert rel_err(p.grad, pr.grad) < 1e-5, n
        # On one rank the schedules count each run as non_overlap (no peer to
        # overlap with); fc1's fprop runs again in the checkpoint recompute.
        want = dict.fromkeys(comms, 0)
        for flag in flags:
            if flag in ("ub_bulk_dgrad", "ub_bulk_wgrad") and flags.get("ub_overlap_rs_dgrad"):
                continue  # replaced by the dgrad overlap, as in TE
            for name, _ in EXPECT[flag]:
                want[name] += 2 if (checkpoint and name == "fc1_fprop") else 1
        runs = {n: c.stats()["non_overlap"] - before[n]["non_overlap"] for n, c in comms.items()}
        assert runs == want, (flags, runs, want)
    finally:
        for c in comms.values():
            c.close()


# ------------------------------------------------------------- bad input

def test_bad_arguments():
    with pytest.raises(ValueError, match="normalization must be"):
        make(torch.float32, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation 'tanh' is not supported"):
        make(torch.float32, activation="tanh")
    with pytest.raises(ValueError, match="activation_params must be a dict"):
        make(torch.float32, activation="clamped_swiglu", activation_params={"beta": 1.0})
    with pytest.raises(ValueError, match="ffn_hidden_size must be a positive int"):
        tec.LayerNormMLP(H, 0, device="cpu")
    with pytest.raises(ValueError, match="ub_comm has unknown names"):
        make(torch.float32, set_parallel_mode=True, ub_overlap_ag=True, ub_comm={"qkv_fprop": None})
    with pytest.warns(UserWarning, match="ub_overlap_ag ignored without parallel_mode"):
        make(torch.float32, ub_overlap_ag=True)
    m = make(torch.float32)
    with pytest.raises(ValueError, match="last dimension 16; expected 32"):
        m(torch.randn(4, 16))
    with pytest.raises(TypeError, match="dtype torch.float64 but the layer's parameters are torch.float32"):
        m(torch.randn(4, H, dtype=torch.float64))


@pytest.mark.parametrize("ub", [False, True])
def test_no_tokens(ub):
    """An empty input gives an empty output and zero parameter gradients,
    with userbuffers on too (no schedule runs for it)."""
    comms = {n: tec.CommOverlap((8, 2 * FFN), torch.float32, tp_size=1, name=f"mlp0_{n}", device="cpu")
             for n in ("fc1_fprop", "fc1_dgrad", "fc2_fprop", "fc2_dgrad")} if ub else {}
    try:
        kw = dict(set_parallel_mode=True, ub_overlap_ag=True, ub_overlap_rs=True, ub_overlap_rs_dgrad=True,
                  ub_comm=comms) if ub else {}
        m = make(torch.float32, activation="swiglu", **kw)
        x = torch.empty(0, 3, H, requires_grad=True)
        y = m(x)
        assert y.shape == (0, 3, H)
        y.sum().backward()
        assert x.grad.shape == x.shape
        for n, p in m.named_parameters():
            assert p.grad is not None and not p.grad.any(), n
    finally:
        for c in comms.values():
            c.close()


@pytest.mark.parametrize("activation", sorted(GATED))
def test_gated_fc1_is_doubled(activation):
    m = make(torch.float32, activation=activation)
    assert m.fc1_weight.shape == (2 * FFN, H)
