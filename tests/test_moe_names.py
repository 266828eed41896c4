"""GroupedLinear, the router functions, the RNG states tracker and TE's
checkpoint arguments against plain-PyTorch references (per-expert F.linear;
per-token loops over experts for the router)."""
import pytest
import torch
import torch.nn.functional as F

import transformer_engine_c as te
from helpers import rel_err

torch.manual_seed(0)


# ---------------------------------------------------------------- GroupedLinear

@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_matches_per_expert_linear(bias):
    m = te.GroupedLinear(3, 16, 8, bias=bias, device="cpu", init_method=lambda w: torch.nn.init.normal_(w, 0, 0.1))
    names = [n for n, _ in m.named_parameters()]
    assert names == ([f"{k}{i}" for i in range(3) for k in ("weight", "bias")] if bias
                     else [f"weight{i}" for i in range(3)])
    if bias:
        with torch.no_grad():
            for i in range(3):
                getattr(m, f"bias{i}").normal_()
    splits = [4, 0, 6]
    x = torch.randn(10, 16, requires_grad=True)
    y = m(x, splits)
    xd = x.detach().double().requires_grad_()
    ps = {n: p.detach().double().requires_grad_() for n, p in m.named_parameters()}
    ref = torch.cat([F.linear(xi, ps[f"weight{i}"], ps.get(f"bias{i}"))
                     for i, xi in enumerate(torch.split(xd, splits))])
    assert rel_err(y, ref) < 1e-5
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    assert rel_err(x.grad, xd.grad) < 1e-5
    for n, p in m.named_parameters():
        if ps[n].grad.abs().sum() == 0:
            assert p.grad.abs().sum() == 0, n  # the expert with no tokens
        else:
            assert rel_err(p.grad, ps[n].grad) < 1e-5, n


def test_grouped_linear_fuse_wgrad_and_tp_shapes():
    m = te.GroupedLinear(2, 8, 6, bias=False, fuse_wgrad_accumulation=True, device="cpu")
    for i in range(2):
        w = getattr(m, f"weight{i}")
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
    x, dy = torch.randn(5, 8), torch.randn(5, 6)
    for first in (True, False):
        m(x, [2, 3], is_first_microbatch=first).backward(dy)
    for i, sl in enumerate((slice(0, 2), slice(2, 5))):
        w = getattr(m, f"weight{i}")
        assert w.grad_added_to_main_grad
        assert rel_err(w.main_grad, 2 * dy[sl].t() @ x[sl]) < 1e-5  # first overwritten, then accumulated
    col = te.GroupedLinear(2, 8, 6, parallel_mode="column", tp_size=2, bias=False, device="cpu")
    row = te.GroupedLinear(2, 8, 6, parallel_mode="row", tp_size=2, bias=False, device="cpu")
    assert col.weight0.shape == (3, 8) and col.weight0.partition_dim == 0
    assert row.weight0.shape == (6, 4) and row.weight0.partition_dim == 1 and row.weight0.tensor_model_parallel
    with pytest.raises(ValueError, match="bias"):
        te.GroupedLinear(2, 8, 6, tp_size=2, parallel_mode="column", bias=True)
    with pytest.raises(ValueError, match="m_splits"):
        m(x, [1, 1])
    with pytest.raises(NotImplementedError, match="userbuffers"):
        te.GroupedLinear(2, 8, 6, ub_overlap_ag=True)


# ---------------------------------------------------------------- router

def ref_topk(logits, topk, pre_softmax, num_groups, group_topk, scaling, score_function, expert_bias):
    """Token by token, expert by expert, in float64."""
    t, e = logits.shape
    probs = torch.zeros(t, e, dtype=torch.float64)
    chosen = torch.zeros(t, e, dtype=torch.bool)
    for r in range(t):
        x = logits[r].double()
        if score_function == "softmax":
            s = torch.softmax(x, 0) if pre_softmax else x
        else:
            s = torch.sigmoid(x)
        sel = s + expert_bias.double() if expert_bias is not None else s
        allowed = list(range(e))
        if group_topk:
            size = e // num_groups
            gscore = [sorted(sel[g * size:(g + 1) * size].tolist(), reverse=True)[:topk // group_topk]
                      for g in range(num_groups)]
            best = sorted(range(num_groups), key=lambda g: -sum(gscore[g]))[:group_topk]
            allowed = [j for j in range(e) if j // size in best]
        idx = sorted(allowed, key=lambda j: -sel[j].item())[:topk]
        vals = s[idx]
        if score_function == "softmax" and not pre_softmax:
            vals = torch.softmax(vals, 0)
        if score_function == "sigmoid" and topk > 1:
            vals = vals / (vals.sum() + 1e-20)
        if scaling:
            vals = vals * scaling
        probs[r, idx] = vals
        chosen[r, idx] = True
    return probs, chosen


@pytest.mark.parametrize("score_function,pre,groups,bias", [
    ("softmax", False, None, False), ("softmax", True, None, False), ("softmax", True, (4, 2), False),
    ("sigmoid", False, None, False), ("sigmoid", False, None, True), ("sigmoid", False, (4, 2), True)])
def test_fused_topk_with_score_function(score_function, pre, groups, bias):
    logits = torch.randn(12, 8, requires_grad=True)
    expert_bias = torch.randn(8) * 0.1 if bias else None
    ng, gk = groups or (None, None)
    probs, rmap = te.router.fused_topk_with_score_function(logits, 4, pre, ng, gk, 2.0, score_function, expert_bias)
    ref_p, ref_map = ref_topk(logits.detach(), 4, pre, ng, gk, 2.0, score_function, expert_bias)
    assert rmap.dtype == torch.bool and torch.equal(rmap, ref_map)
    assert rel_err(probs, ref_p) < 1e-6
    # gradients: against autograd through the per-token reference
    ld = logits.detach().double().requires_grad_()
    ref_p2, _ = ref_topk(ld, 4, pre, ng, gk, 2.0, score_function, expert_bias)
    w = torch.randn(12, 8)
    (probs * w).sum().backward()
    (ref_p2 * w.double()).sum().backward()
    assert rel_err(logits.grad, ld.grad) < 1e-5


def test_aux_loss_functions():
    logits = torch.randn(10, 6, requires_grad=True)
    for fn in ("softmax", "sigmoid"):
        rmap, scores = te.router.fused_compute_score_for_moe_aux_loss(logits, 2, fn)
        s = torch.softmax(logits.double(), -1) if fn == "softmax" else torch.sigmoid(logits.double())
        s = s / s.sum(-1, keepdim=True)
        assert scores.dtype == torch.float32 and rel_err(scores, s) < 1e-6
        assert torch.equal(rmap.sum(1), torch.full((10,), 2)) and torch.equal(rmap, s >= s.topk(2).values[:, -1:])
    probs = torch.softmax(logits, -1)
    tpe = torch.tensor([3, 1, 4, 1, 5, 6])
    loss = te.router.fused_moe_aux_loss(probs, tpe, 10, 6, 2, 0.01)
    want = sum(probs[:, e].double().sum() * tpe[e] for e in range(6)) * 6 * 0.01 / (2 * 10 * 10)
    assert loss.shape == () and abs(loss.item() - want.item()) < 1e-7
    loss.backward()
    assert logits.grad is not None
    with pytest.raises(ValueError, match="score_function"):
        te.router.fused_compute_score_for_moe_aux_loss(logits, 2, "tanh")
    with pytest.raises(ValueError, match="tokens_per_expert"):
        te.router.fused_moe_aux_loss(probs, tpe[:3], 10, 6, 2, 0.01)


# ---------------------------------------------------------------- tracker, checkpoint

def test_rng_states_tracker():
    tr = te.distributed.CudaRNGStatesTracker(device="cpu")
    tr.add("a", 5)
    with pytest.raises(RuntimeError, match="seed 5"):
        tr.add("b", 5)
    with pytest.raises(RuntimeError, match="already exists"):
        tr.add("a", 6)
    with pytest.raises(KeyError, match="not added"):
        with tr.fork("zz"):
            pass
    before = torch.get_rng_state()
    with tr.fork("a"):
        x = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    assert torch.equal(x, torch.rand(3)), "fork did not draw from the named state"
    saved = tr.get_states()
    with tr.fork("a"):
        y = torch.rand(3)
    tr.set_states(saved)
    with tr.fork("a"):
        assert torch.equal(torch.rand(3), y), "set_states did not restore"


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_replays_tracker_dropout(reentrant):
    tr = te.distributed.CudaRNGStatesTracker(device="cpu")
    tr.add("model-parallel-rng", 3)
    lin = te.Linear(8, 8, device="cpu")

    def block(x):
        with tr.fork():
            return F.dropout(lin(x), 0.5)

    x = torch.randn(4, 8, requires_grad=True)
    saved = tr.get_states()
    plain = block(x)
    plain.sum().backward()
    g_plain, gw_plain = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    tr.set_states(saved)
    out = te.distributed.checkpoint(block, x, use_reentrant=reentrant, distribute_saved_activations=False,
                                    get_rng_state_tracker=lambda: tr, tp_group=None)
    after_forward = tr.get_states()["model-parallel-rng"].clone()
    assert torch.equal(out, plain)
    out.sum().backward()
    assert torch.equal(tr.get_states()["model-parallel-rng"], after_forward), "recompute moved the tracker"
    assert torch.equal(x.grad, g_plain) and torch.equal(lin.weight.grad, gw_plain), \
        "the recomputation drew another dropout mask"
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        te.distributed.checkpoint(block, x, distribute_saved_activations=True)


def test_checkpoint_without_tracker_replay_differs():
    """The negative case of the test above: without get_rng_state_tracker the
    recomputation draws a fresh mask from the tracker, and the gradient
    differs from the plain run's."""
    tr = te.distributed.CudaRNGStatesTracker(device="cpu")
    tr.add("model-parallel-rng", 3)

    def block(x):
        with tr.fork():
            return F.dropout(x * 2, 0.5)

    x = torch.randn(64, requires_grad=True)
    saved = tr.get_states()
    block(x).sum().backward()
    g_plain = x.grad.clone()
    x.grad = None
    tr.set_states(saved)
    te.checkpoint(block, x, use_reentrant=False).sum().backward()
    assert not torch.equal(x.grad, g_plain)


def test_activation_recompute_forward_and_gather():
    d = te.distributed
    assert not d.in_fp8_activation_recompute_phase()
    with d.activation_recompute_forward(activation_recompute=True, recompute_phase=True):
        assert d.in_fp8_activation_recompute_phase() and not d.is_fp8_activation_recompute_enabled()
    assert not d.in_fp8_activation_recompute_phase()
    x = torch.randn(3, 2)
    out, work = d.gather_along_first_dim(x, None)
    assert out is x and work is None
    with pytest.raises(NotImplementedError, match="quantizer"):
        d.gather_along_first_dim(x, None, quantizer=object())


def test_dummy_wgrad_and_all_rng_states():
    from transformer_engine_c.module.base import get_dummy_wgrad
    a = get_dummy_wgrad([3, 4], torch.float32, device="cpu")
    b = get_dummy_wgrad([3, 4], torch.float32, zero=True, device="cpu")
    assert a.data_ptr() == b.data_ptr() and b.abs().sum() == 0 and b.shape == (3, 4)
    assert get_dummy_wgrad([3, 4], torch.bfloat16, device="cpu").data_ptr() != a.data_ptr()
    tr = te.distributed.CudaRNGStatesTracker(device="cpu")
    tr.add("all-states-check", 77)
    assert torch.equal(te.distributed.get_all_rng_states()["all-states-check"], tr.get_states()["all-states-check"])
