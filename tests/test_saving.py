"""prepare_for_saving / restore_from_saved, DistributedWeight (single process)
and tec.checkpoint. `python3 -m pytest -q tests/test_saving.py`."""
import contextlib
import copy
import gc
import pickle
import sys

import pytest
import torch
import torch.utils.checkpoint

import transformer_engine_c as tec
from transformer_engine_c import _C
from transformer_engine_c.module._weights import is_distributed_weight, weight_grad

from helpers import without_keep_by_reference


class Storage:
    """A quantized-storage-like object using the delegation protocol: it saves
    its tensors in its place and is restored in place (returns None)."""

    def __init__(self, data, scale):
        self.data, self.scale = data, scale

    def prepare_for_saving(self):
        tensors = [self.data, self.scale]
        self.data = self.scale = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self.data, self.scale = tensors


class Rebuilt:
    """Delegation with a separate state that returns a new object."""

    def __init__(self, t):
        self.t = t

    def prepare_for_saving(self):
        return (self.t,), _RebuiltState()


class _RebuiltState:
    def restore_from_saved(self, tensors):
        return Rebuilt(tensors[0] * 1)


# -- the two functions alone ----------------------------------------------------------------

def test_plain_and_none_pass_through():
    a, b = torch.randn(3), torch.randn(2, 2)
    p = torch.nn.Parameter(torch.randn(4))
    saved, objs = tec.prepare_for_saving(a, None, b, p)
    assert isinstance(saved, tuple) and len(saved) == 4
    assert saved[0] is a and saved[1] is None and saved[2] is b and saved[3] is p
    assert isinstance(objs, _C.SavedObjects) and len(objs) == 4 and not objs.consumed
    out = tec.restore_from_saved(objs, saved)
    assert isinstance(out, list) and out[0] is a and out[1] is None and out[2] is b and out[3] is p
    assert objs.consumed


def test_empty():
    saved, objs = tec.prepare_for_saving()
    assert saved == () and len(objs) == 0
    assert tec.restore_from_saved(objs, ()) == []


def test_distributed_weight_kept_by_reference():
    w = tec.DistributedWeight(torch.randn(4, 3))
    x = torch.randn(2, 3)
    saved, objs = tec.prepare_for_saving(x, w)
    assert saved[1] is w  # saved as a tensor too (autograd's version checks see it)
    unpacked = [t.detach().clone() for t in saved]  # what a hook might hand back
    x2, w2 = tec.restore_from_saved(objs, unpacked)
    assert w2 is w and x2 is unpacked[0]
    assert "1 kept by reference" in repr(objs)


def test_marker_on_other_tensor_subclass():
    class Marked(torch.Tensor):
        pass

    t = torch.randn(3).as_subclass(Marked)
    t.is_distributed_weight = True
    u = torch.randn(3).as_subclass(Marked)  # subclass without the marker: plain
    u.is_distributed_weight = 0
    saved, objs = tec.prepare_for_saving(t, u)
    r = tec.restore_from_saved(objs, [torch.zeros(3), torch.zeros(3)])
    assert r[0] is t and r[1] is not u


def test_exact_parameter_is_plain():
    """An exact nn.Parameter is saved as a plain tensor even with a marker set
    on the instance (as module/_weights.py decides): only subclasses carry it."""
    p = torch.nn.Parameter(torch.randn(3))
    p.is_distributed_weight = True
    saved, objs = tec.prepare_for_saving(p)
    assert "0 kept by reference" in repr(objs)
    r = tec.restore_from_saved(objs, [torch.zeros(3)])
    assert r[0] is not p


def test_delegation_in_place_and_new_object():
    d, s = torch.randn(4), torch.tensor(2.0)
    st = Storage(d, s)
    rb = Rebuilt(torch.ones(2))
    x = torch.randn(1)
    saved, objs = tec.prepare_for_saving(x, st, None, rb)
    assert len(saved) == 5 and saved[1] is d and saved[2] is s and saved[3] is None
    assert st.data is None  # the storage dropped its references
    out = tec.restore_from_saved(objs, saved)
    assert len(out) == 4
    assert out[0] is x and out[1] is st and st.data is d and st.scale is s and out[2] is None
    assert isinstance(out[3], Rebuilt) and torch.equal(out[3].t, torch.ones(2))


def test_delegation_zero_tensors():
    class Empty:
        def prepare_for_saving(self):
            return [], self

        def restore_from_saved(self, tensors):
            assert tensors == []

    e = Empty()
    a = torch.randn(1)
    saved, objs = tec.prepare_for_saving(e, a, e)
    assert saved == (a,)
    assert tec.restore_from_saved(objs, saved) == [e, a, e]


def test_errors_prepare():
    with pytest.raises(TypeError, match=r"argument 1 is int; expected a torch.Tensor, None"):
        tec.prepare_for_saving(torch.randn(1), 3)

    class BadReturn:
        def prepare_for_saving(self):
            return [torch.randn(1)]

    with pytest.raises(TypeError, match=r"must return a pair \(tensors, state\)"):
        tec.prepare_for_saving(BadReturn())

    class NoRestore:
        def prepare_for_saving(self):
            return [torch.randn(1)], object()

    with pytest.raises(TypeError, match="has no restore_from_saved"):
        tec.prepare_for_saving(NoRestore())

    class BadTensors:
        def prepare_for_saving(self):
            return [torch.randn(1), "x"], self

        def restore_from_saved(self, t):
            pass

    with pytest.raises(TypeError, match="returned str at position 1; expected torch.Tensor or None"):
        tec.prepare_for_saving(BadTensors())


def test_errors_restore():
    """The C entry point's checks (tec.restore_from_saved adds TE's list form on top)."""
    from transformer_engine_c import _C
    a = torch.randn(2)
    saved, objs = tec.prepare_for_saving(a, None)
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        _C.restore_from_saved(objs)
    with pytest.raises(TypeError, match="must be the objects returned by prepare_for_saving"):
        _C.restore_from_saved([None, None], saved)
    with pytest.raises(TypeError, match="must be the saved tensors"):
        _C.restore_from_saved(objs, 3)
    with pytest.raises(ValueError, match=r"expected 2 saved tensors \(prepare_for_saving of 2 objects\), got 1"):
        _C.restore_from_saved(objs, saved[:1])
    assert not objs.consumed  # a failed check does not consume
    assert _C.restore_from_saved(objs, list(saved)) == [a, None]
    with pytest.raises(ValueError, match="already restored"):
        _C.restore_from_saved(objs, saved)
    with pytest.raises(TypeError):
        _C.SavedObjects()


def test_no_leaks():
    w = tec.DistributedWeight(torch.randn(2, 2))
    st = Storage(torch.randn(2), torch.randn(1))
    a = torch.randn(2)
    before = (sys.getrefcount(w), sys.getrefcount(st), sys.getrefcount(a))
    for _ in range(1000):
        saved, objs = tec.prepare_for_saving(a, w, st, None)
        tec.restore_from_saved(objs, saved)
        saved, objs = tec.prepare_for_saving(a, w, st)  # dropped without restore
        del saved, objs
    assert (sys.getrefcount(w), sys.getrefcount(st), sys.getrefcount(a)) == before


def test_no_leaks_on_error_paths():
    t = torch.randn(2)

    class Bad:
        def prepare_for_saving(self):
            return [t, "x"], self

        def restore_from_saved(self, ts):
            pass

    class Raises(Storage):
        def restore_from_saved(self, ts):
            raise KeyError("boom")

    b, r, st = Bad(), Raises(None, None), Storage(None, None)
    before = [sys.getrefcount(o) for o in (t, b, r, st)]
    for _ in range(500):
        with pytest.raises(TypeError):
            tec.prepare_for_saving(t, st, b)
        st.data, st.scale = t, t
        r.data, r.scale = t, t
        saved, objs = tec.prepare_for_saving(st, r, t)
        with pytest.raises(KeyError):
            tec.restore_from_saved(objs, saved)
        st.data = st.scale = None
        del saved, objs
    r.data = r.scale = st.data = st.scale = None
    assert [sys.getrefcount(o) for o in (t, b, r, st)] == before


def test_gc_tracking():
    _, plain = tec.prepare_for_saving(torch.randn(1))
    assert not gc.is_tracked(plain)  # holds no references
    _, refs = tec.prepare_for_saving(tec.DistributedWeight(torch.randn(1)))
    assert gc.is_tracked(refs)


# -- DistributedWeight, one process ---------------------------------------------------------

def test_distributed_weight_single_process():
    full = torch.randn(4, 3)
    w = tec.DistributedWeight.from_full(full)
    assert isinstance(w, torch.nn.Parameter) and w.is_distributed_weight and w.requires_grad
    assert w.full_shape == (4, 3) and w.world_size == 1 and w.shard_rank == 0
    m = w.materialize()
    assert type(m) is torch.Tensor and torch.equal(m, full) and w.gather_count == 1
    assert type(w * 2) is torch.Tensor
    with pytest.raises(ValueError, match="does not make a weight of shape"):
        tec.DistributedWeight(torch.randn(2, 3), (4, 3))
    with pytest.raises(TypeError):
        tec.DistributedWeight([1.0])
    with pytest.raises(ValueError, match="expected a gradient of shape"):
        w.reduce_grad(torch.randn(2, 3))
    assert "DistributedWeight(full_shape=(4, 3)" in repr(w)


def test_reduce_grad_routing():
    w = tec.DistributedWeight(torch.randn(4, 3))
    g = torch.randn(4, 3)
    w.reduce_grad(g)
    assert torch.equal(w.grad, g) and w.grad is not g
    w.reduce_grad(g)
    assert torch.allclose(w.grad, 2 * g)
    w.main_grad = torch.zeros(4, 3, dtype=torch.float64)
    w.reduce_grad(g)
    assert torch.allclose(w.main_grad, g.double()) and torch.allclose(w.grad, 2 * g)


def test_as_module_parameter():
    lin = torch.nn.Linear(3, 4, bias=False)
    lin.weight = tec.DistributedWeight.from_full(lin.weight)
    assert any(p is lin.weight for p in lin.parameters())
    sd = lin.state_dict()
    assert type(sd["weight"]) is torch.Tensor and sd["weight"].shape == (4, 3)
    lin.load_state_dict({"weight": torch.zeros(4, 3)})
    assert lin.weight.abs().sum() == 0 and isinstance(lin.weight, tec.DistributedWeight)
    lin2 = copy.deepcopy(lin)
    assert isinstance(lin2.weight, tec.DistributedWeight) and lin2.weight is not lin.weight
    assert lin2.weight.full_shape == (4, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    lin.weight.reduce_grad(torch.ones(4, 3))
    opt.step()
    assert torch.equal(lin.weight.detach(), -torch.ones(4, 3))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(lin.weight)


# -- a layer-like autograd function ----------------------------------------------------------

SEEN = []  # (restored weight is the original, restored weight type) per backward


def weight_for_compute(w):
    """The full weight, gathered again on every call (as the layers do without is_first_microbatch)."""
    return w.materialize() if is_distributed_weight(w) else w


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        wf = weight_for_compute(w)
        saved, ctx.objs = tec.prepare_for_saving(x, w)
        ctx.save_for_backward(*saved)
        ctx.orig = w
        return x @ wf.t()

    @staticmethod
    def backward(ctx, gy):
        x, w = tec.restore_from_saved(ctx.objs, ctx.saved_tensors)
        SEEN.append((w is ctx.orig, type(w)))
        wf = weight_for_compute(w)
        return gy @ wf, weight_grad(w, gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


def _offload_hooks():
    def pack(t):
        return t.device, t.detach().to("cpu", copy=True)

    def unpack(packed):
        device, t = packed
        return t.to(device, copy=True)
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _run(mode, x, w):
    f = lambda a: torch.nn.functional.gelu(_Linear.apply(a, w))  # noqa: E731
    if mode == "none":
        return f(x)
    if mode == "identity":
        with _identity_hooks():
            return f(x)
    if mode == "offload":
        with _offload_hooks():
            return f(x)
    if mode == "torch_ckpt_reentrant":
        return torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)
    if mode == "torch_ckpt":
        return torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
    if mode == "tec_ckpt_reentrant":
        return tec.checkpoint(f, x, use_reentrant=True)
    if mode == "tec_ckpt":
        return tec.checkpoint(f, x, use_reentrant=False)
    raise AssertionError(mode)


MODES = ["none", "identity", "offload", "torch_ckpt_reentrant", "torch_ckpt", "tec_ckpt_reentrant", "tec_ckpt"]


@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_identity_through_autograd(mode, main_grad):
    torch.manual_seed(0)
    full = torch.randn(5, 3)
    x = torch.randn(2, 4, 3, requires_grad=True)
    w = tec.DistributedWeight.from_full(full)
    if main_grad:
        w.main_grad = torch.zeros(5, 3)
    xr = x.detach().clone().requires_grad_()
    wr = full.clone().requires_grad_()
    ref = torch.nn.functional.gelu(xr @ wr.t())
    ref.square().sum().backward()

    SEEN.clear()
    gathers = w.gather_count
    out = _run(mode, x, w)
    out.square().sum().backward()
    assert SEEN and all(same and t is tec.DistributedWeight for same, t in SEEN), SEEN
    # forward + backward, plus the recomputed forward under checkpointing: never cached
    assert w.gather_count - gathers == (3 if "ckpt" in mode else 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    grad = w.main_grad if main_grad else w.grad
    torch.testing.assert_close(grad, wr.grad, rtol=1e-5, atol=1e-6)
    if main_grad:
        assert w.grad is None


@pytest.mark.parametrize("mode", ["identity", "offload", "torch_ckpt"])
def test_negative_without_keep_by_reference(mode):
    """The same flow with keep-by-reference switched off: backward gets the plain
    tensor the hooks unpacked, so the identity check above would fail and the
    gradient misses main_grad."""
    full = torch.randn(5, 3)
    x = torch.randn(4, 3, requires_grad=True)
    w = tec.DistributedWeight.from_full(full)
    w.main_grad = torch.zeros(5, 3)
    SEEN.clear()
    with without_keep_by_reference():
        _run(mode, x, w).sum().backward()
    assert SEEN and not any(same for same, _ in SEEN)
    assert all(t is not tec.DistributedWeight for _, t in SEEN)
    assert w.main_grad.abs().sum() == 0  # the weight gradient went the wrong way
    assert tec.prepare_for_saving is _C.prepare_for_saving  # the real function is back


def test_no_hooks_keeps_identity_even_without_references():
    """Without hooks autograd itself hands back the leaf object: keep-by-reference
    only matters under hooks (why the negative test uses them)."""
    x = torch.randn(4, 3, requires_grad=True)
    w = tec.DistributedWeight(torch.randn(5, 3))
    SEEN.clear()
    with without_keep_by_reference():
        _run("none", x, w).sum().backward()
    assert SEEN == [(True, tec.DistributedWeight)]


def test_checkpoint_kwargs():
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    out = tec.checkpoint(lambda a, b=None: a * b, x, b=y, use_reentrant=False)
    out.sum().backward()
    assert torch.equal(x.grad, y.detach()) and torch.equal(y.grad, x.detach())
    with pytest.raises(ValueError, match="pass tensors that require grad positionally"):
        tec.checkpoint(lambda a, b=None: a * b, x, b=y, use_reentrant=True)
    out = tec.checkpoint(lambda a, s=1.0: a * s, x, s=2.0, use_reentrant=True)
    assert torch.equal(out, 2 * x.detach())
    with pytest.raises(TypeError):
        tec.checkpoint(x, use_reentrant=True)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear"])
def test_checkpoint_of_a_layer_returning_its_bias(use_reentrant, layer):
    """return_bias hands back the bias Parameter itself. Through torch's
    reentrant checkpoint it used to come out as a non-leaf (the module's own
    parameter given a grad_fn), and backward recursed without end; now it is
    handed back untouched and the gradients match the plain run."""
    m = getattr(tec, layer)(8, 6, return_bias=True, device="cpu")
    x = torch.randn(4, 8, requires_grad=True)
    y, b = m(x)
    (y + b).square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    y, b = tec.checkpoint(m, x, use_reentrant=use_reentrant)
    assert b is m.bias and m.bias.is_leaf and m.bias.grad_fn is None
    (y + b).square().sum().backward()
    got = [x.grad] + [p.grad for p in m.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    b2 = tec.checkpoint(lambda a: m.bias, x, use_reentrant=use_reentrant)  # a lone leaf output
    assert b2 is m.bias and m.bias.is_leaf



@pytest.mark.parametrize("checkpoint", ["torch", "tec"])
@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("bias", ["none", "frozen"])
def test_reentrant_checkpoint_of_a_layer_returning_a_bias_without_grad(checkpoint, layer, bias):
    """return_bias of a layer without a bias (TE's empty tensor) or with a
    frozen one hands back a new alias: a reentrant checkpoint's Function
    attaches its history to what it returns, and the layer's own tensor
    given a grad_fn made backward re-enter the checkpoint without end
    (memory grew until the process died). The layer's tensor stays a leaf,
    and two steps' gradients match the plain run's."""
    torch.manual_seed(0)

    def make():
        kw = dict(bias=bias != "none", return_bias=True, device="cpu")
        m = tec.LayerNormMLP(8, 16, **kw) if layer == "LayerNormMLP" else getattr(tec, layer)(8, 6, **kw)
        if bias == "frozen":
            m.get_parameter("fc2_bias" if layer == "LayerNormMLP" else "bias").requires_grad_(False)
        return m
    m, ref = make(), make()
    ref.load_state_dict(m.state_dict())
    name = "fc2_bias" if layer == "LayerNormMLP" else "bias"
    own = getattr(m, name)
    x = torch.randn(4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    for _ in range(2):
        if checkpoint == "torch":
            y, b = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=True)
        else:
            y, b = tec.checkpoint(m, x, use_reentrant=True)
        assert b is not own and getattr(m, name) is own and own.is_leaf and own.grad_fn is None
        yr, br = ref(x2)
        (y + b if b.numel() else y).square().sum().backward()
        (yr + br if br.numel() else yr).square().sum().backward()
        assert own.is_leaf and own.grad_fn is None
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)

# -- torch.compile ----------------------------------------------------------------------------

def _compiled_or_refused(fn, x, w):
    """torch.compile of fn(x) using DistributedWeight w: either our error is
    raised (PyTorch 2.13 traces into the subclass and meets the guard) or the
    compiler does not put w into a graph and the call runs eagerly (PyTorch
    2.11 falls back for the subclass), which is seen as a gather at run time
    and the eager result. Tracing it into a graph is what must never happen."""
    torch._dynamo.reset()
    gathers = w.gather_count
    try:
        out = torch.compile(fn, backend="eager")(x)
    except RuntimeError as e:
        assert "DistributedWeight cannot be used under torch.compile" in str(e), e
        return "raised"
    finally:
        torch._dynamo.reset()
    assert w.gather_count > gathers, "the compiled call did not gather at run time: w was traced into a graph"
    torch.testing.assert_close(out, fn(x))
    return "eager"


def test_compile_with_distributed_weight_raises():
    w = tec.DistributedWeight(torch.randn(5, 3))
    x = torch.randn(4, 3)
    _compiled_or_refused(lambda a: _Linear.apply(a, w), x, w)
    _compiled_or_refused(lambda a: a @ w.materialize().t(), x, w)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        with pytest.raises(RuntimeError, match="DistributedWeight cannot be used under torch.compile"):
            torch.compile(lambda a: a @ w.materialize().t(), backend="eager")(x)
    torch._dynamo.reset()
    # a plain weight still compiles
    p = torch.nn.Parameter(torch.randn(5, 3))
    torch.compile(lambda a: a @ p.t(), backend="eager")(x)


# -- the layers with a one-process DistributedWeight -------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
def test_layers_with_distributed_weight(kind, mode, device):
    torch.manual_seed(0)
    cls = getattr(tec, kind)
    ref = cls(16, 12, device=device)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, device=device) * 0.3)
    m = cls(16, 12, device=device)
    m.load_state_dict(ref.state_dict())
    m.weight = tec.DistributedWeight.from_full(ref.weight)
    x = torch.randn(6, 2, 16, device=device)
    xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    yr.square().sum().backward()
    gathers = m.weight.gather_count
    if mode in ("none", "identity", "offload"):
        ctx = {"none": contextlib.nullcontext, "identity": _identity_hooks, "offload": _offload_hooks}[mode]
        with ctx():
            y = m(xd)
    else:
        reentrant = mode.endswith("reentrant")
        ck = tec.checkpoint if mode.startswith("tec") else torch.utils.checkpoint.checkpoint
        y = ck(m, xd, use_reentrant=reentrant)
    y.square().sum().backward()
    assert m.weight.gather_count - gathers == (3 if "ckpt" in mode else 2)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xd.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for (name, p), (_, pr) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, pr.grad, rtol=1e-5, atol=1e-5, msg=lambda s: f"{name}: {s}")


def test_layer_with_distributed_weight_under_compile_raises():
    torch._dynamo.reset()
    m = tec.Linear(16, 12, device="cpu")
    m.weight = tec.DistributedWeight.from_full(m.weight)
    how = _compiled_or_refused(m, torch.randn(4, 16), m.weight)
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        assert how == "raised"
