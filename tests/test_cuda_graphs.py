"""CUDA graphs of the layers (tec.make_graphed_callables, torch.cuda.graph):
forward and backward captured once and replayed 100 times with new inputs
give exactly the eager results (the same kernels on the same data); what
cannot be replayed (DistributedWeight) is refused at capture time, naming the
layer. Userbuffers operations capture (on one rank here; two ranks:
tests/distributed/test_graph_overlap.py), and a bulk operation's start and
finish must be captured together.

FP8 under graphs (TE's semantics, graph.py): on the CPU, the argument
checks, the weight-caching flag's rule, the fp8_meta saved and restored
around a capture, and the replay protocol with the capture forward standing
in for the graph (the autocast with _graph=True, the first-module flag, the
backward amax update after the graphed node, the noop-flagged weight cast
into the graph buffer), each against eager steps bit for bit; on CUDA, the
graphs themselves: DelayedScaling and Float8CurrentScaling LayerNormMLP /
LayerNormLinear / Linear replayed 100 times against eager steps with an
optimizer between them, weight caching over micro-batches, the negative
cases (a weight cast frozen by caching, scales frozen outside the autocast),
and TE's test_cuda_graphs.py FP8 cases (tests/test_cuda_graphs_fp8.py)."""
import pytest
import torch

import transformer_engine_c as tec
from transformer_engine_c import graph
from transformer_engine_c.quantization import FP8GlobalStateManager as G
from transformer_engine_c.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA GPU on this machine (CUDA graphs run on the GPU machines)")


def _layers(device, dtype):
    torch.manual_seed(0)
    return {
        "Linear": tec.Linear(64, 96, params_dtype=dtype, device=device),
        "LayerNormLinear": tec.LayerNormLinear(64, 96, params_dtype=dtype, device=device),
        "LayerNormMLP": tec.LayerNormMLP(64, 128, params_dtype=dtype, device=device),
    }


def test_unsupported_arguments_are_refused():
    m = tec.Linear(16, 8, device="cpu")
    x = (torch.randn(4, 16),)
    for kw, word in [({"fp8_enabled": True, "fp8_calibrating": True}, "fp8_calibrating"),
                     ({"sample_kwargs": ({"is_first_microbatch": True},)}, "sample_kwargs"),
                     ({"_order": [1, -1]}, "_order"), ({"retain_graph_in_backward": True}, "retain_graph"),
                     ({"fp8_enabled": True, "fp8_recipe": MXFP8BlockScaling()}, "fp8_recipe: .*Blackwell"),
                     ({"fp8_enabled": True, "fp8_recipe": Float8BlockScaling(), "fp8_weight_caching": True},
                      "fp8_weight_caching is not supported with Float8BlockScaling")]:
        with pytest.raises(NotImplementedError, match=word):
            tec.make_graphed_callables(m, x, **kw)
    with pytest.raises(ValueError, match="fp8_enabled must be a bool or a tuple of 2 bools"):
        tec.make_graphed_callables((m, m), (x, x), fp8_enabled=(True,))
    with pytest.raises(TypeError, match="fp8_enabled must be a bool or a tuple of bools, got int"):
        tec.make_graphed_callables(m, x, fp8_enabled=1)
    with pytest.raises(TypeError, match="fp8_recipe must be a transformer_engine_c.recipe.Recipe, got str"):
        tec.make_graphed_callables(m, x, fp8_enabled=True, fp8_recipe="delayed")
    with pytest.raises(TypeError, match="graphs modules .*got function"):
        tec.make_graphed_callables(lambda t: t * 2, x, fp8_enabled=True)
    with pytest.raises(ValueError, match="FP8 needs num_warmup_iters >= 1"):
        tec.make_graphed_callables(m, x, fp8_enabled=True, num_warmup_iters=0)


@pytest.mark.parametrize("kw", [{}, {"fp8_enabled": True}, {"fp8_enabled": True, "fp8_weight_caching": True},
                                {"fp8_enabled": (True,), "fp8_recipe": Float8CurrentScaling()},
                                {"fp8_enabled": True, "fp8_recipe": Float8BlockScaling()}])
def test_fp8_arguments_pass_the_checks(kw):
    """What the checks accept goes on to the capture, which needs CUDA (the
    checks do not refuse TE's FP8 arguments)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's error: on a CUDA machine these arguments capture (the CUDA tests below)")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        tec.make_graphed_callables(tec.Linear(16, 16, device="cpu"), (torch.randn(16, 16),), **kw)


def test_weight_caching_flag_rule():
    assert graph.skip_weight_update(True) is False
    assert graph.skip_weight_update(False) is True
    for bad in (None, 1, "yes"):
        with pytest.raises(ValueError, match="is_first_microbatch boolean keyword argument must be given"):
            graph.skip_weight_update(bad)


def test_distributed_weight_is_refused_before_capture():
    c = tec.CommOverlap((8, 16), torch.float32, device="cpu", name="graph_ub")
    try:  # userbuffers overlap is capturable: on the CPU only the missing GPU stops it
        m = torch.nn.Sequential(tec.Linear(16, 8, parallel_mode="column", ub_overlap_ag=True, ub_comm=c,
                                           device="cpu"))
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="needs a CUDA device"):
                tec.make_graphed_callables(m, (torch.randn(8, 16),))
    finally:
        c.close()
    m = tec.Linear(16, 8, device="cpu")
    m.weight = tec.DistributedWeight.from_full(m.weight.detach())
    with pytest.raises(RuntimeError, match="weight is a DistributedWeight"):
        tec.make_graphed_callables(m, (torch.randn(4, 16),))


@CUDA
@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_graphed_layer_replays_as_eager(layer):
    device, dtype = torch.device("cuda"), torch.bfloat16
    eager = _layers(device, dtype)[layer]
    graphed_mod = _layers(device, dtype)[layer]  # same seed: the same parameters
    sample = torch.randn(32, 64, dtype=dtype, device=device, requires_grad=True)
    graphed = tec.make_graphed_callables(graphed_mod, (sample,))
    gen = torch.Generator(device=device).manual_seed(1)
    for step in range(100):
        x = torch.randn(32, 64, dtype=dtype, device=device, generator=gen)
        dy = torch.randn(32, 96 if layer != "LayerNormMLP" else 64, dtype=dtype, device=device, generator=gen)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        for m in (eager, graphed_mod):
            m.zero_grad(set_to_none=True)
        ye = eager(xe)
        ye.backward(dy)
        yg = graphed(xg)
        yg.backward(dy)
        torch.cuda.synchronize()
        assert torch.equal(yg, ye), (layer, step)
        assert torch.equal(xg.grad, xe.grad), (layer, step)
        for (n, pe), pg in zip(eager.named_parameters(), graphed_mod.parameters()):
            assert torch.equal(pg.grad, pe.grad), (layer, step, n)


@CUDA
def test_capture_refuses_distributed_weight_at_capture_time():
    m = tec.Linear(64, 96, params_dtype=torch.bfloat16, device="cuda")
    m.weight = tec.DistributedWeight.from_full(m.weight.detach())
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    m(x)  # eager works
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="Linear: a DistributedWeight .* cannot be captured in a CUDA graph"):
        with torch.cuda.graph(g):
            m(x)


@CUDA
def test_communicator_operations_replay_on_one_rank():
    """ag_gemm and gemm_rs captured under a plain torch.cuda.graph replay as
    eager (one rank: the schedules' copies and GEMMs, no handshakes)."""
    c = tec.CommOverlap((32, 64), torch.bfloat16, device="cuda", name="graph_ag")
    try:
        a = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(96, 64, dtype=torch.bfloat16, device="cuda")
        w2 = torch.randn(64, 96, dtype=torch.bfloat16, device="cuda")
        c.ag_gemm(a, w)  # warm-up (GEMM plans) before the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = c.ag_gemm(a, w)
            z = c.gemm_rs(y, w2)
        for _ in range(10):
            a.copy_(torch.randn_like(a))
            g.replay()
            ye = c.ag_gemm(a, w)
            assert torch.equal(y, ye)
            assert torch.equal(z, c.gemm_rs(ye, w2))
    finally:
        torch.cuda.synchronize()
        c.close()


@CUDA
def test_bulk_start_and_finish_must_be_captured_together():
    c = tec.CommOverlap((32, 64), torch.bfloat16, device="cuda", name="graph_bulk")
    try:
        t = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
        c.bulk_ag_start(t)
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="graph_bulk': bulk_ag_finish inside the CUDA graph capture its "
                                               "bulk_ag_start was outside of"):
            with torch.cuda.graph(g):
                c.bulk_ag_finish()
        assert torch.equal(c.bulk_ag_finish(), t)  # still pending: finished outside, as started
    finally:
        torch.cuda.synchronize()
        c.close()


# ------------------------------------------------------------------ FP8


def _fp8_layer(kind, device, dtype, seed=0, checkpoint=False):
    torch.manual_seed(seed)
    if kind == "Linear":
        return tec.Linear(64, 96, params_dtype=dtype, device=device)
    if kind == "LayerNormLinear":
        return tec.LayerNormLinear(64, 96, params_dtype=dtype, device=device)
    return tec.LayerNormMLP(64, 128, params_dtype=dtype, device=device, checkpoint=checkpoint)


def _meta_state(layer):
    ts = graph._meta_tensors(layer)
    return [] if ts is None else [t.clone() for t in ts]


def _standin(layer, recipe, caching, device="cpu"):
    """`layer` graphed with its capture forward standing in for the graph:
    the replay protocol of graph.py (flag, registration, first module,
    backward update after the node) around the calls a graph would replay,
    run eagerly (so on the CPU)."""
    flag = G.set_skip_fp8_weight_update_tensor(False, device=device) if caching else None
    cap = graph._Capture(layer, True, recipe, None, flag)
    layer.forward = graph._Replay(layer, cap.forward, cap.orig, layer.training, True, flag)
    return layer


def _train(layer, recipe, steps, device, dtype, first_mbs=None, autocast=True, seed=1):
    """`steps` optimizer steps over len(first_mbs) micro-batches each (one
    without is_first_microbatch when first_mbs is None); returns every
    micro-batch's output and input gradient, every step's parameter
    gradients, and the final fp8_meta tensors."""
    for p in layer.parameters():  # accumulated in place (a graph's grads are its static buffers)
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    gen = torch.Generator(device=device).manual_seed(seed)
    out_dim = 64 if isinstance(layer, tec.LayerNormMLP) else 96
    got = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        for mb in (first_mbs or (None,)):
            x = torch.randn(32, 64, dtype=dtype, device=device, generator=gen).requires_grad_()
            dy = torch.randn(32, out_dim, dtype=dtype, device=device, generator=gen)
            if isinstance(layer, tec.LayerNormMLP):  # two GEMMs' growth: SGD on random gradients would
                dy = dy * 0.1                        # diverge within 100 steps
            kw = {} if mb is None else {"is_first_microbatch": mb}
            with tec.autocast(enabled=autocast, recipe=recipe):
                y = layer(x, **kw)
            y.backward(dy)
            got += [y.detach().clone(), x.grad.clone()]
        got += [p.grad.clone() for p in layer.parameters()]
        opt.step()
    return got + _meta_state(layer)


def _assert_same(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert not w.is_floating_point() or torch.isfinite(w).all(), f"{what}: tensor {i}: the eager run diverged"
        assert torch.equal(g, w), f"{what}: tensor {i} of {len(want)} differs"


def _differs(got, want):
    return len(got) != len(want) or any(not torch.equal(g, w) for g, w in zip(got, want))


RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=16), "current": Float8CurrentScaling}
LAYERS = ["Linear", "LayerNormLinear", "LayerNormMLP"]


def _eager_and(kind, recipe_name, device, dtype, steps, first_mbs=None, caching=False, wrap=None, **kw):
    """(eager run, run of the same fresh layer wrapped by `wrap`)."""
    G.reset()
    want = _train(_fp8_layer(kind, device, dtype), RECIPES[recipe_name](), steps, device, dtype, first_mbs, **kw)
    G.reset()
    layer = wrap(_fp8_layer(kind, device, dtype), RECIPES[recipe_name](), caching)
    got = _train(layer, RECIPES[recipe_name](), steps, device, dtype, first_mbs, **kw)
    G.reset()
    return want, got


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_replay_protocol_matches_eager_on_cpu(kind, recipe):
    """The replay protocol around the capture forward gives eager's steps
    bit for bit (outputs, gradients, scales and histories), with the weights
    changing every step: the scale updates run once per step, where eager
    runs them."""
    want, got = _eager_and(kind, recipe, "cpu", torch.bfloat16, 6, wrap=lambda m, r, c: _standin(m, r, c))
    _assert_same(got, want, f"{kind} {recipe}")


@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_weight_caching_protocol_matches_eager_on_cpu(kind, recipe):
    """fp8_weight_caching: the noop-flagged cast into the graph buffer,
    driven by is_first_microbatch, gives eager weight caching's steps."""
    want, got = _eager_and(kind, recipe, "cpu", torch.bfloat16, 4, first_mbs=(True, False, False), caching=True,
                           wrap=lambda m, r, c: _standin(m, r, c))
    _assert_same(got, want, f"{kind} {recipe} caching")


def test_frozen_weight_or_scales_are_caught_on_cpu():
    """The checks above see a baked-in weight cast (caching on, every
    micro-batch after the first reusing it, against eager casts of the
    updated weights) and frozen scales (delayed scaling replayed outside
    the autocast, against eager steps inside it)."""
    G.reset()
    want = _train(_fp8_layer("LayerNormMLP", "cpu", torch.bfloat16), RECIPES["current"](), 3, "cpu", torch.bfloat16)
    G.reset()
    layer = _standin(_fp8_layer("LayerNormMLP", "cpu", torch.bfloat16), RECIPES["current"](), True)
    first = iter([True, False, False])

    def forward(x, _replay=layer.forward):
        return _replay(x, is_first_microbatch=next(first))
    layer.forward = forward
    got = _train(layer, RECIPES["current"](), 3, "cpu", torch.bfloat16)
    assert torch.equal(got[0], want[0])  # the first step casts the same weights
    assert _differs(got, want)
    want, got = _eager_and("LayerNormMLP", "delayed", "cpu", torch.bfloat16, 3, wrap=lambda m, r, c: _standin(m, r, c))
    _assert_same(got, want, "delayed")
    G.reset()
    frozen = _standin(_fp8_layer("LayerNormMLP", "cpu", torch.bfloat16), RECIPES["delayed"](), False)
    got = _train(frozen, RECIPES["delayed"](), 3, "cpu", torch.bfloat16, autocast=False)
    assert _differs(got[-6:], want[-6:])  # the scales and histories never moved


def test_graph_weight_buffer_follows_the_flag_on_cpu():
    """Under capture with the skip flag, the layer casts its weight into its
    graph buffer: flag 0 writes the cast of the weight as it is (and its
    amax), flag 1 writes nothing (the first micro-batch's cast stays, amax
    untouched), whatever the weight became."""
    recipe = DelayedScaling(amax_history_len=4)
    layer = _fp8_layer("Linear", "cpu", torch.float32)
    flag = G.set_skip_fp8_weight_update_tensor(False, device="cpu")
    x = torch.randn(32, 64)
    cap = graph._Capture(layer, True, recipe, None, flag)
    try:
        y0 = layer(x)  # the capture forward (no update at its exit: the history's row 0 stays)
        buf = layer._fp8_graph_weights[0]
        data0, sinv0 = buf.data.clone(), buf.scale_inv.clone()
        hist = layer.fp8_meta["scaling_fwd"].amax_history
        assert hist[0, 1].item() == layer.weight.abs().max().item()
        with torch.no_grad():
            layer.weight.mul_(3.0)
        hist.zero_()
        flag.fill_(1.0)
        y1 = layer(x)
        assert layer._fp8_graph_weights[0] is buf and torch.equal(buf.data, data0) and torch.equal(buf.scale_inv, sinv0)
        assert hist[0, 1].item() == 0.0  # no weight amax recorded
        assert torch.equal(y1, y0)  # the GEMM read the first cast
        flag.fill_(0.0)
        y2 = layer(x)
        assert not torch.equal(buf.data, data0) and not torch.equal(y2, y0)
        assert hist[0, 1].item() == layer.weight.abs().max().item()
    finally:
        cap.finish(False)
    assert "forward" not in layer.__dict__  # the class's forward back
    G.reset()


def test_capture_leaves_the_backward_update_to_the_replay_on_cpu():
    """Inside the capture forward no layer owns the backward amax update
    (the first-module flag is taken) and the autocast's exit runs no
    forward update (_graph=True): the capture changes no scale."""
    recipe = DelayedScaling(amax_history_len=4)
    layer = _fp8_layer("LayerNormMLP", "cpu", torch.float32)
    cap = graph._Capture(layer, True, recipe, None, None)
    try:
        for _ in range(3):
            y = layer(torch.randn(32, 64, requires_grad=True))
            y.backward(torch.randn_like(y))
        fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
        assert bool((fwd.scale == 1).all()) and bool((bwd.scale == 1).all())
        assert bool((fwd.amax_history[0] > 0).any()) and bool((bwd.amax_history[0] > 0).any())
        assert bool((fwd.amax_history[1:] == 0).all()) and bool((bwd.amax_history[1:] == 0).all())  # never rolled
    finally:
        cap.finish(False)
    with tec.autocast(recipe=recipe):  # eager again: the exit updates the forward scales
        y = layer(torch.randn(32, 64, requires_grad=True))
    y.backward(torch.randn_like(y))
    assert not bool((layer.fp8_meta["scaling_fwd"].scale == 1).all())
    assert not bool((layer.fp8_meta["scaling_bwd"].scale == 1).all())
    G.reset()


def test_fp8_tensors_restored_in_place_on_cpu():
    """save_fp8_tensors / restore_fp8_tensors: the values of before, in the
    same tensors; a meta made in between gets a fresh one's values; the
    check sees a change (without the restore the values differ)."""
    recipe = DelayedScaling(amax_history_len=4)
    a, b = _fp8_layer("LayerNormMLP", "cpu", torch.float32), _fp8_layer("Linear", "cpu", torch.float32, 1)
    for _ in range(2):
        with tec.autocast(recipe=recipe):
            y = a(torch.randn(32, 64, requires_grad=True))
        y.backward(torch.randn_like(y))
    seq = torch.nn.Sequential(a, torch.nn.Linear(64, 64), b)  # b has no fp8_meta yet
    before = _meta_state(a)
    ptrs = [t.data_ptr() for t in graph._meta_tensors(a)]
    saved = graph.save_fp8_tensors((seq,))
    for _ in range(2):
        with tec.autocast(recipe=recipe):
            y = b(a(torch.randn(32, 64, requires_grad=True)))
        y.backward(torch.randn_like(y))
    assert _differs(_meta_state(a), before)
    graph.restore_fp8_tensors(saved)
    _assert_same(_meta_state(a), before, "restored")
    assert [t.data_ptr() for t in graph._meta_tensors(a)] == ptrs
    fresh = tec._fp8_meta.make_fp8_meta(recipe, 1)
    _assert_same(_meta_state(b), [t for k in ("scaling_fwd", "scaling_bwd") for t in
                                  (fresh[k].scale, fresh[k].scale_inv, fresh[k].amax_history)], "fresh")
    G.reset()


# ------------------------------------------------------ FP8 graphs on CUDA


def _graph_it(dtype, **kw):
    def wrap(layer, recipe, caching):
        sample = torch.randn(32, 64, dtype=dtype, device="cuda", requires_grad=True)
        return tec.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=recipe,
                                          fp8_weight_caching=caching, **kw)
    return wrap


@CUDA
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_graph_replays_as_eager(kind, recipe):
    """100 graphed FP8 steps against 100 eager ones, the optimizer changing
    the weights in between: the same outputs, input and parameter gradients
    and final scales and histories, bit for bit."""
    want, got = _eager_and(kind, recipe, "cuda", torch.bfloat16, 100, wrap=_graph_it(torch.bfloat16))
    _assert_same(got, want, f"{kind} {recipe}")


@CUDA
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_graph_weight_caching_replays_as_eager(kind, recipe):
    """fp8_weight_caching: is_first_microbatch=True replays cast the
    weights, False ones reuse the first's FP8 weight in the same graph, as
    eager weight caching does (3 micro-batches a step, 20 steps)."""
    want, got = _eager_and(kind, recipe, "cuda", torch.bfloat16, 20, first_mbs=(True, False, False), caching=True,
                           wrap=_graph_it(torch.bfloat16))
    _assert_same(got, want, f"{kind} {recipe} caching")


@CUDA
def test_fp8_graph_with_a_frozen_weight_cast_differs():
    """The negative: a graph whose weight cast never runs again after the
    first replay (caching forced on, is_first_microbatch=False from then on)
    gives other results than eager steps that cast the updated weights."""
    G.reset()
    want = _train(_fp8_layer("LayerNormMLP", "cuda", torch.bfloat16), RECIPES["current"](), 5, "cuda", torch.bfloat16)
    G.reset()
    layer = _graph_it(torch.bfloat16)(_fp8_layer("LayerNormMLP", "cuda", torch.bfloat16), RECIPES["current"](), True)
    first = iter([True] + [False] * 4)
    replay = layer.forward
    layer.forward = lambda x: replay(x, is_first_microbatch=next(first))
    got = _train(layer, RECIPES["current"](), 5, "cuda", torch.bfloat16)
    assert torch.equal(got[0], want[0])
    assert _differs(got, want)
    G.reset()


@CUDA
def test_fp8_graph_replayed_outside_the_autocast_freezes_its_scales():
    """The negative for delayed scaling: replayed outside the autocast, no
    update runs (the scales stay those of capture time) and the steps
    differ from eager ones; inside it, they match (the test above)."""
    G.reset()
    want = _train(_fp8_layer("LayerNormLinear", "cuda", torch.bfloat16), RECIPES["delayed"](), 5, "cuda",
                  torch.bfloat16)
    G.reset()
    layer = _graph_it(torch.bfloat16)(_fp8_layer("LayerNormLinear", "cuda", torch.bfloat16), RECIPES["delayed"](),
                                      False)
    got = _train(layer, RECIPES["delayed"](), 5, "cuda", torch.bfloat16, autocast=False)
    assert _differs(got, want)
    assert bool((layer.fp8_meta["scaling_fwd"].scale == 1).all())
    G.reset()


@CUDA
def test_fp8_graph_weight_caching_needs_is_first_microbatch():
    layer = _graph_it(torch.bfloat16)(_fp8_layer("Linear", "cuda", torch.bfloat16), RECIPES["delayed"](), True)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    with tec.autocast(recipe=RECIPES["delayed"]()):
        with pytest.raises(ValueError, match="is_first_microbatch boolean keyword argument must be given"):
            layer(x)
        with pytest.raises(TypeError, match=r"keyword arguments \['scale'\] are not supported"):
            layer(x, is_first_microbatch=True, scale=2)
    G.reset()


@CUDA
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fp8_graph_steps_do_not_synchronise(recipe):
    """No host synchronisation in a graphed FP8 step, the scale updates
    outside the graphs included (torch's sync debug mode raises on one; the
    capture itself refuses any inside the graphs)."""
    layer = _graph_it(torch.bfloat16)(_fp8_layer("LayerNormMLP", "cuda", torch.bfloat16), RECIPES[recipe](), False)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            with tec.autocast(recipe=RECIPES[recipe]()):
                y = layer(x)
            y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    G.reset()


# TE's tests/pytorch/test_cuda_graphs.py, FP8 cases: a model of three layers
# graphed whole ("full") or layer by layer ("individual") against the same
# model eager, 3 optimizer steps of 2 micro-batches, [seq, batch, hidden]
# inputs, parameters, their gradients and the last output compared exactly.

class _Sequential(torch.nn.Sequential):
    """Passes keyword arguments (is_first_microbatch) to every module."""

    def forward(self, x, **kwargs):
        for m in self:
            x = m(x, **kwargs)
        return x


TE_MODULES = ["linear", "layernorm_mlp_nocheckpoint", "layernorm_mlp_checkpoint", "layernorm_linear"]


def _te_recipes():
    recipes = [DelayedScaling(), Float8CurrentScaling()]
    if torch.cuda.is_available() and tec.quantization.is_fp8_block_scaling_available():
        recipes.append(Float8BlockScaling())
    return recipes


def _te_module(module, dtype):
    h = 64
    if module == "linear":
        return tec.Linear(h, h, params_dtype=dtype, device="cuda")
    if module == "layernorm_linear":
        return tec.LayerNormLinear(h, h, params_dtype=dtype, device="cuda")
    return tec.LayerNormMLP(h, h, params_dtype=dtype, device="cuda", checkpoint=module.endswith("_checkpoint"))


def _te_run(graph_mode, module, dtype, recipe, caching):
    G.reset()
    torch.manual_seed(1234)
    torch.cuda.manual_seed(1234)
    modules = [_te_module(module, dtype) for _ in range(3)]
    for m in modules:
        for p in m.parameters():
            p.grad = torch.empty_like(p)

    def sample():
        return torch.ones(32, 2, 64, dtype=dtype, device="cuda", requires_grad=True)
    kw = dict(num_warmup_iters=10, fp8_enabled=True, fp8_recipe=recipe, fp8_weight_caching=caching)
    if graph_mode == "full":
        model = tec.make_graphed_callables(torch.nn.Sequential(*modules), (sample(),), **kw)
    elif graph_mode == "individual":
        model = _Sequential(*[tec.make_graphed_callables(m, (sample(),), **kw) for m in modules])
    else:
        model = _Sequential(*modules)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        for mb in range(2):
            x = torch.randn(32, 2, 64, dtype=dtype, device="cuda", requires_grad=True)
            dy = torch.randn(32, 2, 64, dtype=dtype, device="cuda")
            with tec.autocast(enabled=True, recipe=recipe):
                out = model(x, **({"is_first_microbatch": mb == 0} if caching else {}))
            out.backward(dy)
        opt.step()
    values = []
    for p in model.parameters():
        values += [p.detach().clone(), p.grad.clone()]
    G.reset()
    return values + [out.detach().clone()]


@CUDA
@pytest.mark.parametrize("module", TE_MODULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recipe", _te_recipes(), ids=lambda r: type(r).__name__)
def test_make_graphed_callables_te_fp8(module, dtype, recipe):
    full = _te_run("full", module, dtype, recipe, False)
    individual = _te_run("individual", module, dtype, recipe, False)
    eager = _te_run("none", module, dtype, recipe, False)
    _assert_same(full, eager, "full")
    _assert_same(individual, eager, "individual")


@CUDA
@pytest.mark.parametrize("module", TE_MODULES)
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=lambda r: type(r).__name__)
def test_make_graphed_callables_te_fp8_weight_caching(module, recipe):
    full = _te_run("full", module, torch.bfloat16, recipe, True)
    individual = _te_run("individual", module, torch.bfloat16, recipe, True)
    eager = _te_run("none", module, torch.bfloat16, recipe, True)
    _assert_same(full, eager, "full")
    _assert_same(individual, eager, "individual")


@CUDA
def test_capture_is_not_broken_by_garbage_finalized_during_it():
    """Garbage that earlier work leaves (here a communicator in a reference
    cycle, whose destroy synchronizes the device) is not finalized while
    make_graphed_callables captures: the collector is paused there. The
    module makes the cycle and enough objects to start a collection during
    each capture; a collection that ran would invalidate the capture."""
    import gc
    comms = [tec.CommOverlap((32, 64), torch.bfloat16, device="cuda", name="garbage")]

    class Churn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = tec.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")

        def forward(self, x):
            if torch.cuda.is_current_stream_capturing() and comms:
                cycle = [comms.pop()]
                cycle.append(cycle)
                del cycle
                junk = [[i] for i in range(20 * gc.get_threshold()[0])]  # past the youngest generation's threshold
                del junk
            return self.lin(x)

    model = Churn()
    x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    graphed = tec.make_graphed_callables(model, (x,), num_warmup_iters=2)
    assert not comms  # the capture made the garbage
    assert gc.isenabled()
    y = graphed(x)
    y.sum().backward()
    torch.cuda.synchronize()
    gc.collect()  # the communicators are destroyed now, outside any capture
